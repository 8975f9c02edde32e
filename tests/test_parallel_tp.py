"""Tensor-parallel decode on gloo (spawned ranks): prefill logits within 1e-5 of the single-process
model, and the engine's greedy and seeded generations equal token for token (logprobs within 1e-5)."""

import pytest
import torch
from helpers import make_prompt
from parallel_helpers import spawn, tiny_cfg, tiny_model
from parallel_tp_worker import ENGINE, module_state, plan_worker, run, worker

from rollplex.engine import Engine, EngineConfig, SamplingParams
from rollplex.parallel.tp import TPConfig, TPPlan, apply_tensor_parallel, shard_state_dict


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [make_prompt(g, text_len=(6, 3)), make_prompt(g, images=[(1, 4, 4)], text_len=(4, 5)),
            make_prompt(g, text_len=(2, 2))]


@pytest.mark.slow
@pytest.mark.parametrize("world,tie,vision", [(2, False, False), (4, True, False),
                                             (2, False, True)])  # the vision tower's blocks split too
def test_tp_decode_equals_single_process(tmp_path, world, tie, vision):
    prompts = _prompts()
    want = run(tiny_model(tiny_cfg(tie)), prompts)
    spawn(worker, args=(world, f"file://{tmp_path}/store", tie, prompts, want, vision), nprocs=world)


def test_shard_state_dict_cuts_megatron_shards():
    cfg = tiny_cfg()
    full = {n: p.detach() for n, p in tiny_model(cfg).named_parameters()}
    t, D = cfg.text, cfg.text.head_dim
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    for rank in range(2):
        local = shard_state_dict(full, cfg, 2, rank)
        q, k, v = full[qkv].split([t.num_attention_heads * D, t.num_key_value_heads * D, t.num_key_value_heads * D])
        want = torch.cat([q[rank * 2 * D:(rank + 1) * 2 * D], k[rank * D:(rank + 1) * D], v[rank * D:(rank + 1) * D]])
        assert torch.equal(local[qkv], want)
        o = full["model.layers.0.self_attn.o_proj.weight"]
        assert torch.equal(local["model.layers.0.self_attn.o_proj.weight"], o[:, rank * 32:(rank + 1) * 32])
        gu = full["model.layers.0.mlp.gate_up_proj.weight"]
        assert torch.equal(local["model.layers.0.mlp.gate_up_proj.weight"],
                           torch.cat([gu[rank * 56:(rank + 1) * 56], gu[112 + rank * 56:112 + (rank + 1) * 56]]))
        assert torch.equal(local["lm_head.weight"], full["lm_head.weight"][rank * 160:(rank + 1) * 160])
        assert local["visual.blocks.0.attn.qkv.weight"] is full["visual.blocks.0.attn.qkv.weight"]  # whole
    # over 4 ranks the 2 KV heads are replicated: ranks 0, 1 hold head 0
    k0 = [shard_state_dict(full, cfg, 4, r)[qkv][D:2 * D] for r in range(4)]
    assert torch.equal(k0[0], k0[1]) and not torch.equal(k0[1], k0[2])


def test_applying_tp_replaces_parameters_only(tmp_path):
    """Over 2 gloo ranks, vision blocks split too: the model's modules, attributes and methods are as they
    were; its forward and the engine's greedy decode match one process when given the plan."""
    prompts = _prompts()
    model = tiny_model(tiny_cfg())
    with torch.no_grad():
        want = dict(logits=model(prompts), lens=[len(p.input_ids) for p in prompts])
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    want["greedy"] = [r.samples[0].token_ids for r in Engine(model, None, EngineConfig(**ENGINE)).generate(prompts, sp)]
    spawn(plan_worker, args=(2, f"file://{tmp_path}/store", prompts, want), nprocs=2)


def test_engine_refuses_a_plan_its_model_was_not_split_by():
    with pytest.raises(ValueError, match="a plan over 2 ranks"):
        Engine(tiny_model(tiny_cfg()), None, EngineConfig(kv_cache_tokens=256), tp=TPPlan(None, 2, 0))
    with pytest.raises(ValueError, match="tensor_parallel must be"):
        TPConfig(tensor_parallel=0)
    with pytest.raises(ValueError, match="needs tensor_parallel > 1"):
        TPConfig(tensor_parallel_vision=True)


def test_one_rank_group_and_a_later_compile(tmp_path):
    """Degree 1 keeps every parameter; the plan's functions run a model compiled after it (they are not
    the model's own, so the compile leaves them eager)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        cfg = tiny_cfg()
        ref, model = tiny_model(cfg), tiny_model(cfg)
        params, before = list(model.parameters()), module_state(model)
        tp = apply_tensor_parallel(model)
        assert tp.size == 1 and all(a is b for a, b in zip(model.parameters(), params, strict=True))
        assert module_state(model) == before
        model.compile(backend="eager")
        assert model.model._pre is not ref.model._pre
        p = _prompts()[:1]
        with torch.no_grad():
            assert torch.allclose(tp.forward(model, p), ref(p), atol=1e-6)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tie,vision", [(False, False), (True, False), (False, True)])
def test_sharing_plan_rollout_regions_are_the_engines_shards(tie, vision):
    # what the sharing plan (rollplex.weights) calls a rank's rollout shard, and so what its memory
    # tables count, is the tensor the tensor-parallel engine holds: every parameter, TP 2 and 4 (4 ranks
    # replicate each KV head twice), the vision tower whole or (TP 2: its 2 heads) split
    from rollplex.weights import RolloutLayout, model_specs
    from rollplex.weights.storage import cut

    cfg = tiny_cfg(tie)
    full = {n: p.detach() for n, p in tiny_model(cfg).named_parameters()}
    specs = model_specs(cfg)
    assert {s.name for s in specs} == set(full)
    for tp in (2,) if vision else (2, 4):
        for rank in range(tp):
            engine = shard_state_dict(full, cfg, tp, rank, vision)
            for s in specs:
                region = RolloutLayout(tp, vision_tp=vision).region(s, rank)
                want = cut(full[s.name], region)[: region.rows]
                assert engine[s.name].numel() == want.numel(), (tp, rank, s.name)
                assert torch.equal(engine[s.name].reshape(want.shape), want), (tp, rank, s.name)
