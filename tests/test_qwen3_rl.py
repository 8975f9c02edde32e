"""The RL step on the tiny Qwen3-VL (CPU, fp32): `serial` and `rollplex` (packed and prefix-state)
compute the same update, and with a frozen tower every prompt's images go through the tower once, at
the engine's prefill, DeepStack features riding along in `vision_embeds` to scoring and training."""

import copy

import pytest
import torch
from helpers import capture_grads
from test_rl_step import _assert_same_update

from rollplex.engine import Engine, EngineConfig
from rollplex.models import Qwen3VL, load_model
from rollplex.processor import VLProcessor
from rollplex.rl.config import RLConfig
from rollplex.rl.step import RLStep
from rollplex.tiny import shape_color, write_tiny

ROWS = shape_color.make_rows(6, seed=3)


@pytest.fixture(scope="module")
def q3_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny_qwen3_rl"), seed=1, family="qwen3_vl")


@pytest.fixture(scope="module")
def q3_proc(q3_dir):
    return VLProcessor.from_pretrained(q3_dir)


def _step(path, proc, **cfg):
    model = load_model(path)
    assert isinstance(model, Qwen3VL)
    engine = Engine(model, proc, EngineConfig(max_num_seqs=64, max_model_len=256))
    base = dict(n=4, max_new_tokens=6, lr=1e-2, kl_coef=0.05, micro_batch_prompts=2, micro_batch_samples=3)
    return RLStep(model, engine, RLConfig(**{**base, **cfg}), proc, reward_fn="shape_color")


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
def test_serial_and_rollplex_compute_the_same_update(q3_dir, q3_proc):
    ref = _step(q3_dir, q3_proc, mode="rollplex")
    batch = ref.rollout(ROWS)
    batch.rewards = torch.tensor([float(i % 3 == 0) for i in range(batch.num_samples)])
    results = {}
    for key, mode, packed in (("rollplex", "rollplex", True), ("prefix_state", "rollplex", False),
                              ("serial", "serial", True)):
        rl = _step(q3_dir, q3_proc, mode=mode, lr=1e-4, packed=packed)
        grads = capture_grads(rl)
        metrics = rl.train(copy.deepcopy(batch))
        results[key] = (metrics, grads, {n: p.detach().clone() for n, p in rl.model.named_parameters()})
    for key in ("rollplex", "prefix_state"):
        _assert_same_update(*results[key], *results["serial"], {})
    grads = results["serial"][1][0]
    assert grads["visual.deepstack_merger_list.1.linear_fc2.weight"].abs().sum() > 0  # DeepStack trains


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
def test_frozen_tower_encodes_each_prompt_once(q3_dir, q3_proc):
    rl = _step(q3_dir, q3_proc, mode="rollplex", freeze_vision_tower=True)
    encoded = []
    towers = [rl.model.visual] + ([rl.ref.visual] if getattr(rl, "ref", None) is not None else [])
    hooks = [t.register_forward_hook(lambda m, args, out: encoded.append(len(args[1]))) for t in towers]
    metrics = rl.step(ROWS)
    for h in hooks:
        h.remove()
    assert sum(encoded) == len(ROWS)  # one image per row, encoded once for its n = 4 samples, policy and reference
    assert "actor/pg_loss" in metrics and metrics["rollplex/prefix_dedup_ratio"] == 4
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in rl.model.visual.parameters())


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
@pytest.mark.parametrize("extra", [dict(), dict(freeze_vision_tower=True), dict(cosched=True)],
                         ids=["kl-loss", "frozen-vision", "coscheduled-prefixes"])
def test_fused_equals_phased(q3_dir, q3_proc, tail, extra):
    """Groups scored and trained while the rollout still decodes (and, co-scheduled, their prefixes with
    the DeepStack features computed beside decode) give the phased step's update."""
    from test_fused_step import EAGER, _assert_same_step, _run
    from test_fused_step import _step as fused_step

    if extra.get("cosched"):
        extra = dict(extra, cosched_cfg=EAGER)
    # the phased step without the co-scheduler: its prefixes come from the model's own forward
    phased = _run(fused_step(q3_dir, q3_proc, **{k: v for k, v in extra.items() if not k.startswith("cosched")}))
    fused = _run(fused_step(q3_dir, q3_proc, schedule="fused", **extra))
    m = fused[0]
    assert m["rollplex/fused"] == 1.0 and m["rollplex/fused_groups"] == 6
    assert m["rollplex/fused_groups_in_rollout"] >= 2
    if extra.get("cosched"):
        assert m["rollplex/prefix_hidden_s"] + m["rollplex/prefix_claimed_s"] > 0  # prefix jobs ran
    _assert_same_step(fused, phased)
