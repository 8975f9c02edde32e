"""Speculative decoding from siblings on the tiny model (CPU, fp32): the samples are distributed as plain
sampling (a chi-square test that rejects a biased acceptance rule), seeded and greedy samples are the
same tokens, logprobs are the policy's, the KV rollback survives preemption and stops."""

import importlib.util
import os

import pytest
import torch
from test_engine import _full_logprobs, _prompts

from rollplex.engine import Engine, EngineConfig, SamplingParams
from rollplex.engine.sampler import keep_mask
from rollplex.models import load_model
from rollplex.rl.config import RLConfig
from rollplex.rl.step import RLStep
from rollplex.tiny import shape_color

# speculation in every decode step, however little it accepts
SPEC = dict(speculative_tokens=3, speculative_max_batch=4096, speculative_max_fraction=1.0,
            speculative_min_accepted=0.0)


def _triton_runnable() -> bool:
    return importlib.util.find_spec("triton") is not None and (
        torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_model(tiny_dir).eval()


def _engine(model, proc, **cfg):
    return Engine(model, proc, EngineConfig(**cfg))


def chi_square_p(a: list, b: list) -> float:
    """p-value of a chi-square test that samples a and b come from one categorical distribution
    (categories with fewer than 10 pooled draws merged into one)."""
    cats = sorted(set(a) | set(b))
    counts = torch.tensor([[a.count(c), b.count(c)] for c in cats], dtype=torch.float64)
    small = counts.sum(1) < 10
    counts = torch.cat([counts[~small], counts[small].sum(0, keepdim=True)]) if small.any() else counts
    counts = counts[counts.sum(1) > 0]
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = counts.shape[0] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def resample_on_rejection(sampler, logits, st, drafts):
    """A classic wrong rule: accept the draft with probability p(draft) but on a rejection draw again
    from p itself (the draft included) instead of from the residual. It favours drafted tokens."""
    lp = torch.log_softmax(logits.float() / st.temperature[:, None], -1)
    probs = lp.masked_fill(~keep_mask(lp, st.top_k, st.top_p, st.min_p), float("-inf")).softmax(-1)
    g = torch.Generator().manual_seed(int(st.seeds[0]) ^ int(st.steps[0]))
    out, r = [], 0
    for d in drafts:
        toks = []
        for j, x in enumerate(d):
            if torch.rand((), generator=g) < probs[r + j, x]:
                toks.append(x)
                continue
            toks.append(int(torch.multinomial(probs[r + j], 1, generator=g)))
            break
        else:
            toks.append(int(torch.multinomial(probs[r + len(d)], 1, generator=g)))
        out.append((toks, lp[r : r + len(toks)].gather(-1, torch.tensor(toks)[:, None]).squeeze(-1).tolist()))
        r += len(d) + 1
    return out


def _draws(model, proc, spec: bool, seed: int, n: int = 800, rule=None) -> list[tuple]:
    """n samples of 4 tokens (top-k 3: a few likely tokens per step, so drafts are often right and often
    wrong). With speculation, an earlier request of the prompt fills the prompt cache the drafts come from."""
    eng = _engine(model, proc, max_num_seqs=1024, speculative_prompt_cache=1, **(SPEC if spec else {}))
    prompt = _prompts(proc)[3]
    params = dict(temperature=1.0, top_k=3, max_new_tokens=4, ignore_eos=True)
    if spec:
        eng.generate([prompt], SamplingParams(n=16, seed=10**9, **params))
        if rule is not None:
            eng.spec.rule = rule
    out = eng.generate([prompt], SamplingParams(n=n, seed=seed, **params))[0]
    if spec:
        s = eng.spec_stats
        assert 0.1 < s["accepted"] / s["drafted"] < 0.9, s  # drafts are tested: accepted and rejected
    return [tuple(s.token_ids) for s in out.samples]


def test_speculative_samples_are_distributed_as_plain_sampling_and_a_biased_rule_is_not(model, proc):
    plain = _draws(model, proc, spec=False, seed=0)
    exact = _draws(model, proc, spec=True, seed=10**6)  # other seeds: an independent sample
    biased = _draws(model, proc, spec=True, seed=10**6, rule=resample_on_rejection)
    for j in (1, 2, 3):  # the tokens speculation draws (token 0 comes from the prefill)
        assert chi_square_p([t[j] for t in plain], [t[j] for t in exact]) > 1e-3 / 3
    assert min(chi_square_p([t[j] for t in plain], [t[j] for t in biased]) for j in (1, 2, 3)) < 1e-6


def test_seeded_samples_are_the_same_tokens_and_logprobs_are_the_policys(model, proc):
    prompts = _prompts(proc)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=4, max_new_tokens=16, ignore_eos=True, n=3, seed=5)
    plain = _engine(model, proc).generate(prompts, params)
    eng = _engine(model, proc, speculative_prompt_cache=8, **SPEC)
    eng.generate(prompts, SamplingParams(**{**params.__dict__, "seed": 77}))  # earlier responses to draft from
    spec = eng.generate(prompts, params)
    assert eng.spec_stats["accepted"] > 0
    for p, a, b in zip(prompts, plain, spec):
        for x, y in zip(a.samples, b.samples):
            assert x.token_ids == y.token_ids
            ref = _full_logprobs(model, p, y.token_ids, 0.8)
            assert (torch.tensor(y.logprobs) - ref).abs().max().item() <= 1e-5


def test_greedy_tokens_are_the_same_with_and_without_speculation(model, proc):
    prompts = _prompts(proc)
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, n=2)
    plain = _engine(model, proc).generate(prompts, params)
    eng = _engine(model, proc, **SPEC)
    spec = eng.generate(prompts, params)
    assert eng.spec_stats["accepted"] > 0
    assert [[s.token_ids for s in o.samples] for o in plain] == [[s.token_ids for s in o.samples] for o in spec]


def test_stops_and_preemption_under_a_tiny_kv_cache_give_the_same_outputs(model, proc):
    prompts = _prompts(proc)
    free = _engine(model, proc).generate(prompts[:1], SamplingParams(temperature=0, max_new_tokens=40,
                                                                     ignore_eos=True))[0].samples[0].token_ids
    stop = next(t for i, t in enumerate(free) if i >= 6 and t not in free[:i])  # first reached mid-response
    params = [SamplingParams(temperature=0, max_new_tokens=40, stop_token_ids=[stop], ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=3, max_new_tokens=39, n=3, seed=5, ignore_eos=True)] * 2
    ref = _engine(model, proc).generate(prompts, params)
    # the prompt cache drafts the whole response, the stop token and what followed it included
    eng = _engine(model, proc, kv_cache_tokens=16 * 14, speculative_prompt_cache=4, **SPEC)
    for _ in range(2):
        out = eng.generate(prompts, params)
        for a, b in zip(ref, out):
            for x, y in zip(a.samples, b.samples):
                assert (x.token_ids, x.finish_reason) == (y.token_ids, y.finish_reason)
                assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) <= 1e-5
    assert eng.scheduler.num_preemptions > 0 and eng.spec_stats["accepted"] > 0
    assert out[0].samples[0].finish_reason == "stop" and out[0].samples[0].token_ids[-1] == stop
    assert eng.blocks.num_free == eng.blocks.num_blocks - 1  # every block back, drafts' included


def test_speculation_runs_only_while_the_batch_is_small(model, proc):
    eng = _engine(model, proc, speculative_tokens=2, speculative_max_batch=2, speculative_max_fraction=0.5)
    calls = {"decode": [], "verify": []}
    for name in calls:
        real = getattr(eng.runner, name)

        def spy(*a, _real=real, _name=name, **kw):
            calls[_name].append(len(kw["ids"]) if _name == "decode" else len(a[-1]))
            return _real(*a, **kw)

        setattr(eng.runner, name, spy)
    prompt = _prompts(proc)[3]
    lengths = [4, 8, 12, 16]  # the batch shrinks by one sequence at a time
    eng.generate([prompt] * 4, [SamplingParams(temperature=0, max_new_tokens=m, ignore_eos=True) for m in lengths])
    assert calls["verify"] and calls["decode"]
    # sequences verified / decoded per step: decode leaves off once at most 2 run (one step of 2 may come
    # first: a sequence whose last token is in flight still counts as running)
    assert max(calls["verify"]) <= 2 and min(calls["decode"]) >= 2 and calls["decode"].count(2) <= 1
    off = _engine(model, proc)
    assert off.spec is None and off.spec_stats == {}


def test_drafts_that_fail_back_speculation_off(model, proc):
    eng = _engine(model, proc, speculative_tokens=3, speculative_max_fraction=1.0)
    eng.spec.drafts = lambda seqs, _: [[0, 0, 0] for _ in seqs]  # drafts greedy decoding never takes
    params = SamplingParams(temperature=0, max_new_tokens=100, ignore_eos=True)
    prompt = _prompts(proc)[3]
    plain = _engine(model, proc).generate([prompt], params)[0].samples[0].token_ids
    assert 0 not in plain
    out = eng.generate([prompt], params)[0].samples[0].token_ids
    assert out == plain
    # one verification; from then on plain steps, drafting in shadow: no draft matches, none verifies again
    s = eng.spec_stats
    assert s["steps"] == 1 and s["accepted"] == 0 and s["shadow_drafts"] >= 20 and s["shadow_accepted"] == 0
    # the next rollout's tail starts afresh: it verifies first, then backs off again
    assert eng.generate([prompt], params)[0].samples[0].token_ids == plain
    assert eng.spec_stats["steps"] == 2


def test_verification_resumes_once_shadow_drafts_match(model, proc):
    """Drafts that fail back speculation off; when they start to match the tokens plain decoding draws, the
    shadow drafts say so and verification resumes (and accepts). Tokens unchanged throughout."""
    params = SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True)
    prompt = _prompts(proc)[3]
    plain = _engine(model, proc).generate([prompt], params)[0].samples[0]
    ref = plain.token_ids
    eng = _engine(model, proc, speculative_tokens=3, speculative_max_fraction=1.0)
    verified_at = []

    def drafts(seqs, _):  # wrong before output token 20, then the reference's next tokens (greedy: right)
        out = []
        for s in seqs:
            pos = s.num_output_tokens  # the first position to draft (past a token in flight)
            k = min(3, s.request.max_len - len(s) - 1)
            out.append([0] * k if pos < 20 else ref[pos : pos + k])
            if s.pending == 0:
                verified_at.append(pos)
        return out

    eng.spec.drafts = drafts
    out = eng.generate([prompt], params)[0].samples[0]
    assert out.token_ids == ref and out.logprobs == pytest.approx(plain.logprobs, abs=1e-5)
    s = eng.spec_stats
    assert s["accepted"] > 0 and s["shadow_drafts"] > 0 and s["shadow_accepted"] > 0
    # the first verification failed; the next ones came only after drafts turned right, and then most
    # steps verified (about 4 tokens each: the 40 tokens after position 20 in well under 40 steps)
    assert verified_at[0] < 20 and all(p >= 20 for p in verified_at[1:]) and 1 < s["steps"] <= 16


def test_a_back_off_ends_with_its_rollout():
    from rollplex.engine.speculative import Speculator

    spec = Speculator(EngineConfig(speculative_tokens=4, speculative_max_batch=8))
    assert not spec.active(running=16, waiting=0) and spec.active(running=4, waiting=0)  # the tail of 16
    spec.count([[1, 2, 3, 4]] * 4, [1, 1, 1, 1])  # nothing accepted: backed off
    assert spec.backed_off and not spec.active(running=4, waiting=0)
    assert not spec.active(running=0, waiting=16)  # the next rollout: its prompts wait for prefill
    assert not spec.active(running=16, waiting=0)
    assert not spec.backed_off and spec.active(running=4, waiting=0)


def test_shadow_drafts_score_what_a_verification_would_accept():
    """Backed off, each shadow draft is scored by the leading tokens of it that plain decoding then drew
    (a token in flight at drafting time drafted past); verification resumes once the latest scores reach the
    bar, and not before every decoding sequence has one (up to the window)."""
    from types import SimpleNamespace

    from rollplex.engine.sequence import Request
    from rollplex.engine.speculative import Speculator

    spec = Speculator(EngineConfig(speculative_tokens=3, speculative_max_batch=8, speculative_max_fraction=1.0,
                                   speculative_min_accepted=1.0))
    req = Request("r", SimpleNamespace(input_ids=[7, 7]), SamplingParams(max_new_tokens=100, n=2), [0, 0])
    a, b = req.seqs
    a.pending = b.pending = 1
    future = {id(a): [10, 11, 12, 13, 14], id(b): [20, 21, 22, 23, 24]}  # what decoding will draw
    guess = {id(a): [11, 12, 13], id(b): [21, 99, 23]}  # drafts for the positions after the token in flight
    spec.drafts = lambda seqs, _: [list(guess[id(s)]) for s in seqs]
    assert spec.active(running=2, waiting=0)
    spec.count([[1, 2, 3]] * 2, [1, 1])
    assert spec.backed_off
    spec.shadow([a, b], ["r"])  # drafted at 3 tokens known + 1 in flight: positions 3, 4, 5
    assert spec.stats.shadow_drafts == 0

    def draw(n):  # n decode steps resolve
        for s in (a, b):
            for _ in range(n):
                s.token_ids.append(future[id(s)][len(s.token_ids) - 2])

    draw(2)  # a: 10 (in flight), 11 -> matches so far; b: 20, 21 -> 1 of 1 so far
    spec.shadow([a, b], ["r"])
    assert spec.stats.shadow_drafts == 0 and spec.backed_off
    draw(1)  # b's 22 parts from its draft's 99: b scores 1; a: 11, 12 match, one more to come
    spec.shadow([a, b], ["r"])
    assert spec.stats.shadow_drafts == 1 and spec.stats.shadow_accepted == 1 and spec.backed_off
    draw(1)  # a's 13: all 3 accepted -> scores (1 + 3) / 2 = 2 per sequence >= 1: verify again
    spec.shadow([a, b], ["r"])
    assert spec.stats.shadow_accepted == 4 and not spec.backed_off and spec.active(running=2, waiting=0)


def test_speculative_options_are_validated():
    for bad in ({"speculative_tokens": -1}, {"speculative_tokens": 17}, {"speculative_max_batch": 0},
                {"speculative_max_fraction": 0.0}, {"speculative_max_fraction": 1.5}, {"speculative_ngram": 0},
                {"speculative_prompt_cache": -1}, {"speculative_min_accepted": -0.1}):
        with pytest.raises(ValueError, match="speculative"):
            EngineConfig(**bad)


def test_rl_step_trains_on_the_policys_logprobs_with_speculation(tiny_dir, proc):
    policy = load_model(tiny_dir)
    engine = Engine(policy, proc, EngineConfig(max_num_seqs=64, max_model_len=256, speculative_prompt_cache=8, **SPEC))
    # a low temperature: the random tiny policy is near uniform, and drafts are tested only where it is not
    cfg = RLConfig(n=4, max_new_tokens=12, lr=1e-2, kl_coef=0.05, micro_batch_prompts=2, temperature=0.03)
    rl = RLStep(policy, engine, cfg, proc, reward_fn="shape_color")
    rows = shape_color.make_rows(3, seed=3)
    accepted = 0
    for _ in range(2):  # the second step drafts from the first one's responses too
        m = rl.step(rows)
        assert m["training/rollout_probs_diff_max"] < 1e-4  # engine and trainer agree on the sampled tokens
        # the step's own speculation counts (the engine's are since it started)
        assert m["rollout/spec_verify_steps"] > 0 and 0 <= m["rollout/spec_acceptance_rate"] <= 1
        assert m["rollout/spec_draft_tokens"] >= m["rollout/spec_accepted_tokens"] >= 0
        assert m["rollout/spec_shadow_drafts"] == 0  # a bar of 0 never backs off: nothing drafted in shadow
        accepted += m["rollout/spec_accepted_tokens"]
    assert engine.spec_stats["accepted"] == accepted > 0


def test_spec_bench_checks_tokens_and_prints_its_table(tiny_dir, capsys):
    from rollplex.bench import spec as bench

    bench.main(["--model", str(tiny_dir), "--device", "cpu", "--prompts", "4", "--n", "2", "--max-new-tokens", "32",
                "--image-size", "56", "--accept", "0,2"])
    out = capsys.readouterr().out
    assert "correctness (fp32): speculation at replayed acceptance 0,2 gave speculation off's greedy tokens for " \
           "all 8 samples of 4 prompts" in out
    table = out.strip().splitlines()[-7:]
    assert all(row.split("|")[13].strip() == "8/8" for row in table[2:])  # fp32 rows are checked exactly too
    assert table[0].startswith("| drafts |") and table[2].startswith("| off |")
    assert table[3].startswith("| replay a=0 |") and table[4].startswith("| replay a=2 |")
    # teacher-forced timing rows: a + 1 tokens kept per pass; in fp32 the policy drew every forced token
    assert table[5].startswith("| forced a=0 |") and table[6].startswith("| forced a=2 |")
    assert float(table[6].split("|")[11]) > 1.0 and table[6].split("|")[15].strip() == "100%"
    assert float(table[4].split("|")[11]) > 1.0  # mean accepted length of the a=2 replay
    # the tail's steps: three tokens kept per verification take fewer steps than one per decode step
    assert 0 < int(table[6].split("|")[6]) < int(table[2].split("|")[6])
    # the off row verifies nothing; the forced a = 2 row (never backed off) verifies in every tail step but
    # the one that first takes the plain step in flight
    steps, verified = int(table[6].split("|")[6]), int(table[6].split("|")[7])
    assert int(table[2].split("|")[7]) == 0 and steps - 1 <= verified <= steps
    assert table[2].split("|")[10].strip() == "1.00x"  # the off row's step time against itself
    # a verification's wall time and, within it, its pass's (on CPU the pass's own wall time)
    assert table[2].split("|")[8].strip() == ""
    wall, pass_ms = table[6].split("|")[8].strip().rstrip(")").split(" (")
    assert 0 < float(pass_ms) < float(wall)


@pytest.mark.skipif(not _triton_runnable(), reason="needs triton and CUDA (or TRITON_INTERPRET=1)")
def test_greedy_tokens_are_the_same_with_the_triton_verify_kernel(model, proc, monkeypatch):
    """The verification pass through the Triton kernel (a sequence's rows read its K/V once, as on the GPU;
    here under the interpreter) gives plain decoding's greedy tokens; head_dim 64, as that kernel needs."""
    import dataclasses
    import functools

    from rollplex.engine import model_runner
    from rollplex.kernels import paged_attention
    from rollplex.models import build_model, init_weights

    text = dataclasses.replace(model.cfg.text, num_attention_heads=2, num_key_value_heads=1, mrope_section=(8, 12, 12))
    m64 = init_weights(build_model(dataclasses.replace(model.cfg, text=text)), seed=3, std=0.05).eval()
    calls = []

    def triton_verify(*args, **kw):
        calls.append(args[0].shape)
        return paged_attention.paged_verify_attention(*args, **{**kw, "backend": "triton"})

    monkeypatch.setattr(model_runner, "paged_verify_attention", functools.partial(triton_verify))
    prompts = _prompts(proc)[:2]
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, n=2)
    plain = _engine(m64, proc, block_size=16).generate(prompts, params)
    eng = _engine(m64, proc, block_size=16, **SPEC)
    spec = eng.generate(prompts, params)
    assert any(len(s) == 4 and s[1] > 1 for s in calls)  # [B, rows, H, D]: several rows per sequence
    assert eng.spec_stats["accepted"] > 0
    assert [[s.token_ids for s in o.samples] for o in plain] == [[s.token_ids for s in o.samples] for o in spec]


def test_drafts_follow_a_sibling_once_its_tokens_are_indexed():
    """Speculator: a new request's samples are indexed before its first drafts; later tokens are counted by
    `index` (the engine calls it while the verification pass runs) and only then drafted from."""
    from types import SimpleNamespace

    from rollplex.engine.sequence import Request
    from rollplex.engine.speculative import Speculator

    spec = Speculator(EngineConfig(speculative_tokens=3))
    req = Request("r", SimpleNamespace(input_ids=[7, 8, 9]), SamplingParams(n=2), seeds=[0, 1])
    a, b = req.seqs
    a.token_ids += [1, 2, 3, 4]
    b.token_ids += [1, 2]
    assert spec.drafts([b], ["r"]) == [[3, 4]]  # sibling a's text after (1, 2), indexed when the group opened
    a.token_ids += [5, 6]
    assert spec.drafts([b], ["r"]) == [[3, 4]]  # a's new tokens are not counted yet
    spec.index([b])
    assert spec.drafts([b], ["r"]) == [[3, 4, 5]]


def test_groups_counted_ahead_within_the_budget_draft_as_counted_at_once():
    """`prepare` (the host's idle time during plain decode steps) counts the samples' tokens a budget at a
    time, every group in turn; once it has caught up, drafts are those of groups counted in one go."""
    from types import SimpleNamespace

    from rollplex.engine.sequence import Request
    from rollplex.engine.speculative import Speculator

    def requests():
        out = []
        for r in range(3):
            req = Request(f"r{r}", SimpleNamespace(input_ids=[7, 8, 9 + r]), SamplingParams(n=3), seeds=[0, 1, 2])
            for i, s in enumerate(req.seqs):
                s.token_ids += [(r + i + j) % 5 for j in range(40)]
            out.append(req)
        return out

    ahead, once = Speculator(EngineConfig(speculative_tokens=3)), Speculator(EngineConfig(speculative_tokens=3))
    reqs, reqs_once = requests(), requests()
    seqs = [s for r in reqs for s in r.seqs]
    ahead.prepare(seqs, 0.0)
    assert ahead.drafter.groups == {}  # no idle time, nothing done
    calls = 0
    while any(g.seen.get(s.sample_index, 0) < 40 for r in reqs for s in r.seqs
              for g in [ahead.drafter.groups.get(r.request_id, SimpleNamespace(seen={}))]):
        ahead.prepare(seqs, 1e-9)  # each call stops after one sample
        calls += 1
    assert calls >= 9 and set(ahead.drafter.groups) == {"r0", "r1", "r2"}
    for r in reqs:
        r.seqs[0].token_ids += [4, 4]
    for r in reqs_once:
        r.seqs[0].token_ids += [4, 4]
    ahead.prepare(seqs, 1e3)  # caught up: the new tokens are counted too
    probe = [r.seqs[1] for r in reqs]
    assert ahead.drafts(probe, ["r0", "r1", "r2"]) == once.drafts([r.seqs[1] for r in reqs_once], ["r0", "r1", "r2"])
    assert ahead.drafter.groups["r0"].table == once.drafter.groups["r0"].table


def test_counting_ahead_in_the_hosts_idle_time_keeps_the_tokens(model, proc, monkeypatch):
    """The engine gives `prepare` half the time its host waited for a decode step (on a GPU); with a wait
    made up on the CPU the groups are counted during plain decode steps and the tokens are unchanged."""
    prompts = _prompts(proc)
    params = [SamplingParams(temperature=0, max_new_tokens=8 + 8 * i, ignore_eos=True, n=2)
              for i in range(len(prompts))]
    plain = _engine(model, proc).generate(prompts, params)
    eng = _engine(model, proc, speculative_tokens=3, speculative_max_fraction=0.5, speculative_min_accepted=0.0)
    budgets = []
    prepare, resolve = eng.spec.prepare, eng._resolve
    monkeypatch.setattr(eng.spec, "prepare", lambda seqs, ms: (budgets.append(ms), prepare(seqs, ms))[1])
    opened = []  # at each verification: were its groups counted before it?
    drafts = eng.spec.drafts
    monkeypatch.setattr(eng.spec, "drafts", lambda seqs, reqs: (
        opened.append(all(x.request.request_id in eng.spec.drafter.groups for x in seqs)), drafts(seqs, reqs))[1])

    def waited():
        out = resolve()
        eng._idle_ms = 20.0  # as if the host had waited 20 ms for the step
        return out

    monkeypatch.setattr(eng, "_resolve", waited)
    out = eng.generate(prompts, params)
    assert [[s.token_ids for s in o.samples] for o in plain] == [[s.token_ids for s in o.samples] for o in out]
    assert budgets and max(budgets) >= 10.0 and eng.spec_stats["steps"] > 0 and opened and all(opened)


def test_adaptive_back_off_asks_a_verification_to_pay_for_itself():
    """speculative_adaptive: the bar is max(speculative_min_accepted, verify ms / decode ms - 1), from step
    times measured in the tail only (its first tail decodes two steps plainly to time one); off, the
    configured bar."""
    from rollplex.engine.speculative import Speculator

    spec = Speculator(EngineConfig(speculative_tokens=4, speculative_adaptive=True, speculative_max_batch=8))
    assert spec.min_accepted() == 0.5  # nothing measured yet
    spec.active(running=64, waiting=0)  # a large batch: not the tail, its steps are not counted
    spec.note_step(30.0, verify=False)
    assert spec.decode_ms is None
    # the first tail: two plain decode steps, to time one, before speculating
    assert [spec.active(running=4, waiting=0) for _ in range(3)] == [False, False, True]
    spec.note_step(4.0, verify=False)
    spec.note_step(10.0, verify=True)
    assert spec.min_accepted() == pytest.approx(1.5)  # a pass of 10 ms must keep 2.5 tokens per sequence
    spec.count([[1, 2, 3, 4]] * 2, [2, 3])  # 1.5 accepted per sequence: not below the bar
    assert not spec.backed_off
    spec.count([[1, 2, 3, 4]] * 2, [2, 2])  # 1.0 accepted: above the configured 0.5, below what the pass costs
    assert spec.backed_off
    spec.note_step(2.0, verify=True)  # moving averages: 10 + 0.25 * (2 - 10) = 8 ms
    assert spec.verify_ms == pytest.approx(8.0) and spec.min_accepted() == pytest.approx(1.0)
    fixed = Speculator(EngineConfig(speculative_tokens=4, speculative_max_batch=8))
    fixed.active(running=4, waiting=0)
    fixed.note_step(4.0, verify=False)
    fixed.note_step(40.0, verify=True)
    assert fixed.min_accepted() == 0.5


def test_adaptive_back_off_verifies_less_where_a_pass_is_dear(model, proc, monkeypatch):
    """With every verification made slow, the adaptive engine verifies fewer steps than the fixed bar lets
    it, and the tokens are the same (which steps verify never changes them)."""
    import time as _time

    prompts = _prompts(proc)
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, n=2)
    cfg = dict(speculative_tokens=3, speculative_max_batch=4096, speculative_max_fraction=1.0,
               speculative_min_accepted=0.5)
    outs, steps = [], []
    for adaptive in (False, True):
        eng = _engine(model, proc, speculative_adaptive=adaptive, **cfg)
        verify = eng.runner.verify
        monkeypatch.setattr(eng.runner, "verify", lambda *a, _v=verify, **kw: (_time.sleep(0.02), _v(*a, **kw))[1])
        outs.append([[s.token_ids for s in o.samples] for o in eng.generate(prompts, params)])
        steps.append(eng.spec_stats["steps"])
    assert outs[0] == outs[1]
    assert 0 < steps[1] < steps[0], steps
