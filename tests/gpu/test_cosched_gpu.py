"""The co-scheduler on the GPU: reference prefix work launched on its own stream beside graphed decode
steps gives the same step as without it (fp32), and work really ran beside decode."""

import pytest
import torch
from helpers import kernel_model, make_prompt

from rollplex.cosched import CoschedConfig, Timeline
from rollplex.engine import Engine, EngineConfig, SamplingParams
from rollplex.rl.config import RLConfig
from rollplex.rl.step import RLStep

pytestmark = pytest.mark.gpu
EAGER = CoschedConfig(slowdown_bound=0.5, baseline_samples=1, initial_budget=5.0, max_in_flight=4, job_prompts=2,
                      serial_after=1000)


def _model():
    return kernel_model("cuda")


def _step(cosched: bool, frozen: bool):
    model = _model()
    engine = Engine(model, None, EngineConfig(max_num_seqs=64, max_model_len=512, kv_cache_tokens=64 * 512,
                                              cuda_graph_max_bs=32))
    rl = RLStep(model, engine, RLConfig(n=4, max_new_tokens=48, lr=1e-4, kl_coef=0.05, micro_batch_prompts=2,
                                        cosched=cosched, freeze_vision_tower=frozen), reward_fn="exact", cosched=EAGER)
    rl.timeline = Timeline(rl.device)
    g = torch.Generator().manual_seed(0)
    prompts = [make_prompt(g, images=[(1, 4 + 2 * (i % 3), 6)], text_len=(3 + i, 5)) for i in range(6)]
    for p in prompts:
        p.pixel_values = p.pixel_values.cuda()
    params = [SamplingParams(n=4, max_new_tokens=48, ignore_eos=True, seed=10 + i) for i in range(6)]
    batch = rl.generate(prompts, params)
    roll = dict(rl.rollout_metrics)
    batch.rewards = torch.tensor([float(i % 3 == 0) for i in range(batch.num_samples)])
    m = rl.train(batch)
    return m, roll, {n: p.detach().clone() for n, p in model.named_parameters()}, rl


@pytest.mark.parametrize("frozen", [False, True])
def test_cosched_on_a_side_stream_is_exact(frozen, tmp_path):
    m0, _, w0, _ = _step(False, frozen)
    m1, roll, w1, rl = _step(True, frozen)
    assert roll["rollplex/cosched_chunks"] > 0 and roll["rollplex/prefix_hidden_s"] > 0
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert m1[k] == pytest.approx(m0[k], rel=1e-4, abs=1e-6), k
    init = dict(_model().named_parameters())
    for name in w0:  # relative to the weights, or for zero-initialised biases to the update they received
        diff = (w1[name] - w0[name]).norm()
        rel_w = (diff / w0[name].norm().clamp_min(1e-12)).item()
        rel_upd = (diff / (w0[name] - init[name]).norm().clamp_min(1e-12)).item()
        assert rel_w <= 1e-5 or rel_upd <= 5e-3, f"{name}: {rel_w:.2e} / {rel_upd:.2e}"
    rl.timeline.write_trace(tmp_path / "trace.json")
    assert any(s.lane == "cosched" for s in rl.timeline.spans)
