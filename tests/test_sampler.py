"""Sampler: draws follow softmax(logits/T) restricted by top-k/top-p/min-p; noise depends only on
(seed, step, token) so a row's draw does not depend on its batch; logprobs are temperature-scaled."""

import torch

from rollplex.engine.sampler import SamplingTensors, sample, token_keys, uniform_noise

LOGITS = torch.tensor([[1.0, 2.0, 0.5, -1.0, 0.0]])
N = 20000


def _freq(rows):
    st = SamplingTensors.build(rows, LOGITS.shape[1], "cpu")
    toks, lps = sample(LOGITS.expand(len(rows), -1), st)
    return torch.bincount(toks, minlength=LOGITS.shape[1]).float() / len(rows), toks, lps


def test_distribution_matches_temperature_softmax():
    freq, toks, lps = _freq([(0.7, -1, 1.0, 0.0, s, 3) for s in range(N)])
    ref = torch.softmax(LOGITS[0] / 0.7, -1)
    assert (freq - ref).abs().max() < 0.015
    assert torch.allclose(lps, torch.log(ref)[toks], atol=1e-6)  # logprob of the temperature-scaled policy


def test_truncations():
    p = torch.softmax(LOGITS[0], -1)
    freq, _, _ = _freq([(1.0, 2, 1.0, 0.0, s, 0) for s in range(N)])  # top-k 2: tokens 1 and 0
    assert freq[[2, 3, 4]].sum() == 0 and abs(freq[0] - p[0] / (p[0] + p[1])) < 0.015
    freq, _, _ = _freq([(1.0, -1, 0.7, 0.0, s, 0) for s in range(N)])  # top-p 0.7 keeps tokens 1, 0
    assert freq[[2, 3, 4]].sum() == 0
    freq, _, _ = _freq([(1.0, -1, 1.0, 0.3, s, 0) for s in range(N)])  # min-p: p >= 0.3 * p_max
    kept = p >= 0.3 * p.max()
    assert freq[~kept].sum() == 0 and (freq[kept] > 0).all()


def test_greedy_rows_and_batch_independence():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    rows = [(0.0, -1, 1.0, 0.0, 1, 0), (1.0, -1, 1.0, 0.0, 7, 4), (0.9, 5, 0.9, 0.0, 8, 2),
            (1.0, -1, 1.0, 0.0, 9, 0), (0.0, -1, 1.0, 0.0, 3, 1), (1.3, -1, 1.0, 0.1, 7, 4)]
    toks, lps = sample(logits, SamplingTensors.build(rows, 50, "cpu"))
    assert toks[0] == logits[0].argmax() and toks[4] == logits[4].argmax()
    for i in range(6):  # the same row alone draws the same token
        t1, l1 = sample(logits[i : i + 1], SamplingTensors.build([rows[i]], 50, "cpu"))
        assert t1.item() == toks[i].item() and abs(l1.item() - lps[i].item()) < 1e-6
    u = uniform_noise(torch.tensor([5, 5, 6]), torch.tensor([0, 1, 0]), token_keys(1000, "cpu"))
    assert (u > 0).all() and (u < 1).all() and not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert abs(u.mean().item() - 0.5) < 0.02


def test_a_compiled_call_runs_while_another_thread_traces_a_graph():
    """The fused schedule compiles training graphs on a worker thread while the engine calls its compiled
    sampler on another; torch.fx's tracing flag is process-wide, so without the setting in compile_fn
    the decode thread's call raised "using FX to symbolically trace a dynamo-optimized function"."""
    import threading

    from rollplex.models.layers import compile_fn

    f = compile_fn(lambda x: x * 2 + 1, backend="eager")
    x = torch.arange(3.0)
    assert torch.equal(f(x), x * 2 + 1)
    inside, release = threading.Event(), threading.Event()

    class Slow(torch.nn.Module):
        def forward(self, y):
            inside.set()
            release.wait(30)
            return y + 1

    tracer = threading.Thread(target=torch.fx.symbolic_trace, args=(Slow(),))
    tracer.start()
    assert inside.wait(30)
    try:
        out = f(x)
    finally:
        release.set()
        tracer.join()
    assert torch.equal(out, x * 2 + 1)
