"""The co-scheduler on the GPU: reference prefix work launched on its own stream beside graphed decode
steps gives the same step as without it (fp32, tiny model), and work really ran beside decode."""

import pytest
import torch

from rollplex.cosched import CoschedConfig, Timeline
from rollplex.demo import shape_color
from rollplex.engine import Engine, EngineConfig
from rollplex.models import load_model
from rollplex.rl.config import RLConfig
from rollplex.rl.step import RLStep

ROWS = shape_color.make_rows(8, seed=5)
EAGER = CoschedConfig(slowdown_bound=0.5, baseline_samples=1, initial_budget=5.0, max_in_flight=4, job_prompts=2,
                      serial_after=1000)


def _step(tiny_dir, proc, cosched: bool, frozen: bool):
    model = load_model(tiny_dir, "cuda")
    engine = Engine(model, proc, EngineConfig(max_num_seqs=64, max_model_len=256, compile_decode=False))
    rl = RLStep(model, engine, RLConfig(n=4, max_new_tokens=48, lr=1e-4, kl_coef=0.05, micro_batch_prompts=2,
                                        cosched=cosched, freeze_vision_tower=frozen),
                proc, reward_fn="shape_color", cosched=EAGER)
    rl.timeline = Timeline(rl.device)
    batch = rl.rollout(ROWS)
    roll = dict(rl.rollout_metrics)
    batch.rewards = torch.tensor([float(i % 3 == 0) for i in range(batch.num_samples)])
    m = rl.train(batch)
    return m, roll, {n: p.detach().clone() for n, p in model.named_parameters()}, rl


@pytest.mark.parametrize("frozen", [False, True])
def test_cosched_on_a_side_stream_is_exact(tiny_dir, proc, frozen, tmp_path):
    m0, _, w0, _ = _step(tiny_dir, proc, False, frozen)
    m1, roll, w1, rl = _step(tiny_dir, proc, True, frozen)
    assert roll["rollplex/cosched_chunks"] > 0 and roll["rollplex/prefix_hidden_s"] > 0
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert m1[k] == pytest.approx(m0[k], rel=1e-4, abs=1e-6), k
    for name in w0:
        diff = (w1[name] - w0[name]).norm() / w0[name].norm().clamp_min(1e-6)
        assert diff.item() <= 1e-4, name
    rl.timeline.write_trace(tmp_path / "trace.json")
    assert any(s.lane == "cosched" for s in rl.timeline.spans)
