"""Qwen3-VL under the parallel plans: every parameter has a tensor-parallel role (weights/qwen.py), a
rank's shards are the right slices, and tensor-parallel decode over gloo ranks equals one process."""

import pytest
import torch
from parallel_helpers import spawn
from qwen3_helpers import qwen3_prompt, tiny_qwen3
from qwen3_tp_worker import worker

from rollplex.parallel.tp import shard_state_dict
from rollplex.weights.qwen import model_specs


def test_every_parameter_has_a_layout_rule():
    model = tiny_qwen3()
    specs = {s.name: s for s in model_specs(model.cfg)}
    assert specs.keys() == dict(model.named_parameters()).keys()
    assert specs["model.layers.0.self_attn.q_norm.weight"].tp_dim is None
    assert specs["visual.blocks.0.mlp.linear_fc1.weight"].tp_dim == 0
    assert specs["visual.blocks.0.mlp.linear_fc2.weight"].tp_dim == 1
    assert specs["visual.deepstack_merger_list.0.linear_fc1.weight"].tp_dim is None


def test_shard_state_dict_cuts_qwen3_shards():
    model = tiny_qwen3()
    cfg, full = model.cfg, {n: p.detach() for n, p in model.named_parameters()}
    t, D = cfg.text, cfg.text.head_dim
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    for rank in range(2):
        local = shard_state_dict(full, cfg, 2, rank)
        q, k, v = full[qkv].split([t.num_attention_heads * D, t.num_key_value_heads * D, t.num_key_value_heads * D])
        want = torch.cat([q[rank * 2 * D:(rank + 1) * 2 * D], k[rank * D:(rank + 1) * D], v[rank * D:(rank + 1) * D]])
        assert torch.equal(local[qkv], want)
        assert local["model.layers.0.self_attn.k_norm.weight"] is full["model.layers.0.self_attn.k_norm.weight"]
        vis = shard_state_dict(full, cfg, 2, rank, vision=True)["visual.blocks.0.mlp.linear_fc1.weight"]
        I = cfg.vision.intermediate_size
        assert torch.equal(vis, full["visual.blocks.0.mlp.linear_fc1.weight"][rank * I // 2:(rank + 1) * I // 2])


@pytest.mark.slow
@pytest.mark.parametrize("vision", [False, True], ids=["text", "text_and_vision"])
def test_tp_decode_equals_single_process(tmp_path, vision):
    from parallel_tp_worker import run

    g = torch.Generator().manual_seed(1)
    prompts = [qwen3_prompt(g, text_len=(6, 3)), qwen3_prompt(g, images=[(1, 4, 6)], text_len=(4, 5)),
               qwen3_prompt(g, text_len=(2, 2))]
    want = run(tiny_qwen3(seed=7).eval(), prompts)
    spawn(worker, args=(2, f"file://{tmp_path}/store", prompts, want, vision), nprocs=2)


@pytest.fixture(scope="module")
def q3_dir(tmp_path_factory):
    from rollplex.tiny import write_tiny

    return write_tiny(tmp_path_factory.mktemp("tiny_qwen3_dp"), seed=1, family="qwen3_vl")


@pytest.mark.slow
@pytest.mark.parametrize("world,rollout,rl", [
    (2, "data", dict(ppo_mini_batches=2)),
    # the engine's encodings (DeepStack columns included) stand in for both frozen towers
    (2, "data", dict(freeze_vision_tower=True)),
    (2, "tensor", dict()),
    # the tower's blocks split over the engine's ranks too, their shards rebuilt after the update
    (2, "tensor+vision", dict()),
])
def test_data_parallel_step_equals_single_process(tmp_path, q3_dir, world, rollout, rl):
    """The FSDP-sharded RL step over gloo ranks (per-rank or tensor-parallel rollout) computes the
    single-process step on the tiny Qwen3-VL: tokens, metrics, gradients, updated weights."""
    from test_parallel_step import BASE, _spawn

    from rollplex.rl.config import RLConfig

    _spawn(tmp_path, q3_dir, world, RLConfig(**{**BASE, **rl}), rollout=rollout,
           steps=1 if rollout == "tensor+vision" else 2)
