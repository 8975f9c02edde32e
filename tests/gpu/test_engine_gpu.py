"""The engine on CUDA (skipped without it): graphed decode with the Triton paged attention gives the
reference decoder's greedy tokens and full-forward logprobs, across several batch buckets."""

import pytest
import torch
from helpers import kernel_model, make_prompt

from rollplex.engine import Engine, EngineConfig, SamplingParams
from rollplex.generate import generate

pytestmark = pytest.mark.gpu


def _model():
    return kernel_model("cuda")


@pytest.mark.parametrize("kernel", ["gather", "tma"])
def test_graphed_engine_matches_reference_decoder(kernel):
    """Each attention kernel in turn (the tuner only gets that variant's candidates)."""
    from rollplex.kernels.paged_attention import DECODE_CANDIDATES, attn_variant

    cands = tuple(c for c in DECODE_CANDIDATES if attn_variant(c[1]) == kernel)
    model = _model()
    eng = Engine(model, None, EngineConfig(max_num_seqs=32, max_model_len=512, kv_cache_tokens=64 * 512,
                                           cuda_graph_max_bs=32, attn_candidates=cands))
    assert eng.runner.graphs and eng.cfg.block_size == 64
    assert all(attn_variant(c[1]) == kernel for c in eng.runner.attn_cfg.values() if c[1] is not None)
    g = torch.Generator().manual_seed(0)
    prompts = [make_prompt(g, images=[(1, 4 + 2 * i, 6)], text_len=(3 + i, 5)) for i in range(5)]
    for p in prompts:
        p.pixel_values = p.pixel_values.cuda()
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.samples[0].token_ids == generate(model, p, 40).token_ids
    sampled = eng.generate(prompts, SamplingParams(temperature=0.9, max_new_tokens=30, ignore_eos=True, n=3, seed=4))
    for p, o in zip(prompts, sampled):
        for s in o.samples:
            # sampled ids may be vision placeholders (the tiny vocabulary holds them): text in a response
            full = p.with_response(s.token_ids)
            with torch.no_grad():
                logits = model([full])[0].float()
            P = len(p.input_ids)
            ref = torch.log_softmax(logits[P - 1 : P - 1 + len(s.token_ids)] / 0.9, -1)
            ref = ref.gather(-1, torch.tensor(s.token_ids, device="cuda")[:, None]).squeeze(-1)
            assert (ref.cpu() - torch.tensor(s.logprobs)).abs().max().item() < 1e-4


def test_a_hook_hears_each_steps_forward_gpu_time():
    """With a hook listening, each decode step's forward (the graph replay alone) is timed with CUDA events and
    reported once that step completed: an earlier step's index, a time within that step's start..end."""
    model = _model()
    eng = Engine(model, None, EngineConfig(max_num_seqs=32, max_model_len=512, kv_cache_tokens=64 * 512,
                                           cuda_graph_max_bs=32))
    infos = []

    class Hook:
        def on_decode_step(self, info):
            infos.append(info)

    eng.hooks.append(Hook())
    g = torch.Generator().manual_seed(0)
    prompts = [make_prompt(g, images=[(1, 4, 6)], text_len=(3, 5)) for _ in range(3)]
    for p in prompts:
        p.pixel_values = p.pixel_values.cuda()
    eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True))
    timed = [(i.step, i.last_forward, i.last_step_ms) for i in infos if i.last_forward is not None]
    assert len(timed) >= 20
    for step, (fwd_step, ms), step_ms in timed:  # both from the same completed step
        assert fwd_step < step and 0 < ms <= step_ms + 1e-3
