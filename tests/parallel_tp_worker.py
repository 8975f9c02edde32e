"""One rank of the tensor-parallel decode test: the model split over gloo ranks, its prefill logits and
the engine's greedy and seeded generations against the single-process ones."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
import torch.distributed as dist
from helpers import FORWARD_TERMS, assert_fp32_close
from parallel_helpers import init_group, tiny_cfg, tiny_model

from rollplex.engine import Engine, EngineConfig, SamplingParams
from rollplex.parallel import apply_tensor_parallel

ENGINE = dict(max_num_seqs=8, max_model_len=128, kv_cache_tokens=1024)


def sampling() -> list[SamplingParams]:
    """Greedy with the prompt's logprobs; seeded sampling with top-k truncation (decode gathers the
    logits), and without (decode draws from each rank's vocabulary shard), two samples each."""
    return [SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, logprob_start_len=0),
            SamplingParams(max_new_tokens=8, temperature=1.0, top_k=40, n=2, seed=7, ignore_eos=True),
            SamplingParams(max_new_tokens=8, temperature=0.8, n=2, seed=11, ignore_eos=True)]


def run(model, prompts, plan=None) -> dict:
    """Prefill logits of the prompts and the engine's outputs under every sampling setting (plan: the
    TPPlan `model` was split by, None for a whole model)."""
    with torch.no_grad():
        logits = model(prompts) if plan is None else plan.forward(model, prompts)
    engine = Engine(model, None, EngineConfig(**ENGINE), tp=plan)
    outs = {}
    for i, sp in enumerate(sampling()):
        res = engine.generate(prompts, sp)
        outs[i] = [([s.token_ids for s in r.samples], [s.logprobs for s in r.samples], r.input_token_logprobs)
                   for r in res]
    return dict(logits=logits, lens=[len(p.input_ids) for p in prompts], outs=outs)


def worker(rank: int, world: int, init: str, tie: bool, prompts, want: dict, vision: bool = False) -> None:
    init_group(rank, world, init)
    try:
        cfg = tiny_cfg(tie)
        model = tiny_model(cfg)
        before = module_state(model)
        tp = apply_tensor_parallel(model, vision=vision)
        assert module_state(model) == before  # only parameters were replaced
        v, blk = cfg.vision, model.visual.blocks[0]
        assert tp.vision == vision and (tp.ops.vision_post is not None) == vision
        if vision:  # the tower's blocks split too: heads, MLP, biases of the column-parallel parts
            assert blk.attn.num_heads == v.num_heads // world
            assert blk.attn.qkv.weight.shape == (3 * v.hidden_size // world, v.hidden_size)
            assert blk.mlp.down_proj.weight.shape == (v.hidden_size, v.intermediate_size // world)
            assert blk.attn.proj.bias.shape == (v.hidden_size,)
        else:
            assert blk.attn.qkv.weight.shape == (3 * v.hidden_size, v.hidden_size)
        t = cfg.text
        a = model.model.layers[0].self_attn
        kv = max(t.num_key_value_heads // world, 1)
        assert (a.num_heads, a.num_kv_heads) == (t.num_attention_heads // world, kv)
        assert a.qkv_proj.weight.shape == ((a.num_heads + 2 * kv) * t.head_dim, t.hidden_size)
        assert model.model.layers[0].mlp.down_proj.weight.shape == (t.hidden_size, t.intermediate_size // world)
        assert model.head_weight.shape == (t.vocab_size // world, t.hidden_size) and tp.size == world
        got = run(model, prompts, tp)
        check_vocab_parallel_sampler(model, tp)
        for b, n in enumerate(want["lens"]):  # sharded matmuls sum their inner dimension in pieces
            assert_fp32_close(got["logits"][b, :n], want["logits"][b, :n], f"logits of prompt {b}", FORWARD_TERMS)
        for i, reqs in want["outs"].items():
            for (tok, lp, inp), (gtok, glp, ginp) in zip(reqs, got["outs"][i]):
                assert gtok == tok, (i, gtok, tok)
                assert [len(x) for x in glp] == [len(x) for x in lp]
                assert_fp32_close(sum(glp, []), sum(lp, []), f"logprobs of setting {i}", FORWARD_TERMS)
                if inp is not None:
                    assert ginp[0] is None
                    assert_fp32_close(ginp[1:], inp[1:], f"prompt logprobs of setting {i}", FORWARD_TERMS)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def check_vocab_parallel_sampler(model, tp) -> None:
    """The shard-wise draw equals the draw from the gathered logits: greedy, sampled and mixed rows, and
    rows whose best scores tie across shards (the lower token id wins, as in a whole-vocabulary argmax)."""
    from rollplex.engine.sampler import Sampler, SamplingTensors
    from rollplex.engine.vocab_parallel_sampler import VocabParallelSampler

    V = model.cfg.text.vocab_size
    g = torch.Generator().manual_seed(5)
    full = torch.randn(6, V, generator=g) * 3
    full[4] = 0.0  # every token ties: greedy picks token 0
    full[5] = full[5].clamp(max=5.0)
    full[5, 1], full[5, V - 1] = 9.0, 9.0  # a tie across the first and the last shard
    rows = [(0.0, -1, 1.0, 0.0, 1, 0), (1.0, -1, 1.0, 0.0, 2, 3), (0.7, -1, 1.0, 0.0, 3, 1),
            (1.3, -1, 1.0, 0.0, 4, 9), (0.0, -1, 1.0, 0.0, 5, 0), (0.0, -1, 1.0, 0.0, 6, 0)]
    st = SamplingTensors.build(rows, V, "cpu")
    want_tok, want_lp = Sampler()(full, st)
    vp = VocabParallelSampler(tp, V, Sampler())
    rows_per = V // tp.size
    tok, lp = vp(full[:, tp.rank * rows_per : (tp.rank + 1) * rows_per].contiguous(), st)
    assert torch.equal(tok, want_tok), (tok, want_tok)
    assert_fp32_close(lp, want_lp, "vocab-parallel logprobs", FORWARD_TERMS)
    assert tok[4] == 0 and tok[5] == 1


def module_state(model) -> dict:
    """Every module's class and instance dict, its parameters by name only (sharding replaces those
    tensors): values by identity, containers (children, buffers, hooks) item by item."""
    def value(v):
        if isinstance(v, dict):
            return tuple((k, value(x)) for k, x in v.items())
        return v if isinstance(v, (bool, int, float, str, type(None))) else id(v)

    return {name: (type(m), {k: tuple(v) if k == "_parameters" else value(v) for k, v in vars(m).items()})
            for name, m in model.named_modules()}


def plan_worker(rank: int, world: int, init: str, prompts, want: dict) -> None:
    """Applying TP (vision blocks too) replaces parameters and nothing else; the engine, the prefill and
    a re-application read the split from the plan and the parameters, not from the model object."""
    init_group(rank, world, init)
    try:
        _plan_checks(rank, world, prompts, want)
        # the plan, the engines and the refused calls' tracebacks (which hold the group) are gone before
        # the group is: a process group destroyed at interpreter exit can abort the process
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _plan_checks(rank: int, world: int, prompts, want: dict) -> None:
    model = tiny_model(tiny_cfg())
    before = module_state(model)
    tp = apply_tensor_parallel(model, vision=True)
    assert module_state(model) == before
    assert model.head_weight.shape[0] * world == model.cfg.text.vocab_size  # the parameters are the shards
    assert (tp.size, tp.rank, tp.vision) == (world, rank, True)
    with pytest.raises(ValueError, match="already tensor-parallel"):
        apply_tensor_parallel(model)
    with pytest.raises(ValueError, match="no tensor-parallel plan"):
        Engine(model, None, EngineConfig(**ENGINE))
    with pytest.raises(ValueError, match="vision blocks"):
        Engine(model, None, EngineConfig(**ENGINE), tp=dataclasses.replace(tp, vision=False))
    with torch.no_grad():
        logits = tp.forward(model, prompts)
    for b, n in enumerate(want["lens"]):
        assert_fp32_close(logits[b, :n], want["logits"][b, :n], f"logits of prompt {b}", FORWARD_TERMS)
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    got = [r.samples[0].token_ids for r in Engine(model, None, EngineConfig(**ENGINE), tp=tp).generate(prompts, sp)]
    assert got == want["greedy"], (got, want["greedy"])
    assert module_state(model) == before  # running it changed nothing either
