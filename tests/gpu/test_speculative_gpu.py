"""Speculative decoding on CUDA (skipped without it): the graphed verification pass over the paged KV
(Triton attention) keeps greedy tokens and seeded samples as plain graphed decode draws them, with the
full forward's logprobs, for batches that fall in several verify-graph buckets and the eager path."""

import pytest
import torch
from helpers import kernel_model, make_prompt

from rollplex.engine import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.gpu


def _full_logprobs(model, p, ids, temperature):
    full = p.with_response(ids)
    with torch.no_grad():
        logits = model([full])[0].float()
    P = len(p.input_ids)
    ref = torch.log_softmax(logits[P - 1 : P - 1 + len(ids)] / temperature, -1)
    return ref.gather(-1, torch.tensor(ids, device=logits.device)[:, None]).squeeze(-1).cpu()


@pytest.mark.parametrize("graphs", [True, False])
def test_speculation_keeps_greedy_tokens_samples_and_logprobs(graphs):
    model = kernel_model("cuda")
    base = dict(max_num_seqs=32, max_model_len=512, kv_cache_tokens=64 * 512, cuda_graph_max_bs=32,
                cuda_graph=graphs)
    plain = Engine(model, None, EngineConfig(**base))
    spec = Engine(model, None, EngineConfig(**base, speculative_tokens=4, speculative_max_batch=16,
                                            speculative_max_fraction=1.0, speculative_prompt_cache=8))
    assert bool(spec.runner.verify_graphs) == graphs
    g = torch.Generator().manual_seed(0)
    prompts = [make_prompt(g, images=[(1, 4 + 2 * i, 6)], text_len=(3 + i, 5)) for i in range(5)]
    for p in prompts:
        p.pixel_values = p.pixel_values.cuda()
    greedy = [SamplingParams(temperature=0, max_new_tokens=24 + 8 * i, ignore_eos=True, n=2) for i in range(5)]
    sampled = SamplingParams(temperature=0.7, top_k=5, max_new_tokens=40, ignore_eos=True, n=3, seed=4)
    for params, t in ((greedy, 1.0), (sampled, 0.7)):
        ref = plain.generate(prompts, params)
        for _ in range(2):  # the second run drafts from the first's responses (the prompt cache)
            outs = spec.generate(prompts, params)
            for p, a, b in zip(prompts, ref, outs):
                for x, y in zip(a.samples, b.samples):
                    assert x.token_ids == y.token_ids
                    assert (_full_logprobs(model, p, y.token_ids, t) - torch.tensor(y.logprobs)).abs().max() < 1e-4
    s = spec.spec_stats
    assert s["accepted"] > 0 and s["drafted"] > s["accepted"]
    assert spec.blocks.num_free == spec.blocks.num_blocks - 1


def test_failing_drafts_verify_once_then_draft_in_shadow():
    """Drafts the policy never takes: one verification per rollout, then graphed plain decode with drafts
    scored in shadow (the overlapped path: a token in flight at every shadow draft); tokens unchanged, and
    the verification's pass timed by CUDA events within its step's wall time."""
    model = kernel_model("cuda")
    base = dict(max_num_seqs=32, max_model_len=512, kv_cache_tokens=64 * 512, cuda_graph_max_bs=32)
    plain = Engine(model, None, EngineConfig(**base))
    spec = Engine(model, None, EngineConfig(**base, speculative_tokens=4, speculative_max_batch=16,
                                            speculative_max_fraction=1.0))
    g = torch.Generator().manual_seed(1)
    prompts = [make_prompt(g, images=[(1, 4, 6)], text_len=(3, 5)) for _ in range(4)]
    for p in prompts:
        p.pixel_values = p.pixel_values.cuda()
    params = SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True, n=2)
    ref = plain.generate(prompts, params)
    vocab = model.cfg.text.vocab_size
    spec.spec.drafts = lambda seqs, _: [[(s.token_ids[-1] + 1) % vocab] * 4 for s in seqs]
    outs = spec.generate(prompts, params)
    assert [[x.token_ids for x in o.samples] for o in ref] == [[x.token_ids for x in o.samples] for o in outs]
    s = spec.spec_stats
    assert s["steps"] == 1 and s["shadow_drafts"] > 8
    assert 0 < s["forward_ms"] < s["wall_ms"]
