"""The fused schedule on the GPU: prompt groups scored and trained on a side stream (a green context of
some SMs, or a low-priority stream over all of them) beside graphed decode steps give the phased step's
update (fp32), and chunks really ran during the rollout; with the prefix co-scheduler too, whose jobs the
chunks take over from its stream."""

import pytest
import torch
from helpers import kernel_model, make_prompt

from rollplex.cosched import CoschedConfig, Timeline
from rollplex.cosched.controller import AdmissionController
from rollplex.engine import Engine, EngineConfig, SamplingParams
from rollplex.rl.config import RLConfig
from rollplex.rl.step import RLStep

pytestmark = pytest.mark.gpu
LENGTHS = [8, 96, 16, 120, 24, 64]  # groups finish out of prompt order, a long tail after the first chunks


def _step(cosched_cfg=None, **cfg):
    model = kernel_model("cuda")
    engine = Engine(model, None, EngineConfig(max_num_seqs=64, max_model_len=512, kv_cache_tokens=64 * 512,
                                              cuda_graph_max_bs=32))
    rl = RLStep(model, engine, RLConfig(n=4, max_new_tokens=128, lr=1e-4, kl_coef=0.05, micro_batch_prompts=2, **cfg),
                reward_fn="exact", cosched=cosched_cfg)
    rl.timeline = Timeline(rl.device)
    g = torch.Generator().manual_seed(0)
    prompts = [make_prompt(g, images=[(1, 4 + 2 * (i % 3), 6)], text_len=(3 + i, 5)) for i in range(6)]
    for p in prompts:
        p.pixel_values = p.pixel_values.cuda()
    params = [SamplingParams(n=4, max_new_tokens=k, ignore_eos=True, seed=10 + i) for i, k in enumerate(LENGTHS)]
    scores = torch.tensor([float(i % 3 == 0) for i in range(24)])

    def rewards(_batch, ids):
        return torch.cat([scores[4 * i: 4 * i + 4] for i in ids]), {}

    _, m = rl.run(prompts, params, rewards=rewards)
    return m, {n: p.detach().clone() for n, p in model.named_parameters()}, rl


@pytest.mark.parametrize("sms", [0, 66])
def test_fused_beside_graphed_decode_is_exact(sms):
    m0, w0, _ = _step()
    m1, w1, rl = _step(schedule="fused", fuse_sms=sms)
    assert m1["rollplex/fused"] == 1.0 and m1["rollplex/fused_groups_in_rollout"] >= 2
    assert m1["timing_s/fused_in_rollout"] > 0
    _assert_close(m1, w1, m0, w0)
    rl.timeline.resolve()
    assert any(s.lane == "fused" for s in rl.timeline.spans) and any(s.lane == "decode" for s in rl.timeline.spans)


def _assert_close(m1, w1, m0, w0):
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert m1[k] == pytest.approx(m0[k], rel=1e-4, abs=1e-6), k
    init = dict(kernel_model("cuda").named_parameters())
    for name in w0:  # relative to the weights, or for zero-initialised biases to the update they received
        diff = (w1[name] - w0[name]).norm()
        rel_w = (diff / w0[name].norm().clamp_min(1e-12)).item()
        rel_upd = (diff / (w0[name] - init[name]).norm().clamp_min(1e-12)).item()
        assert rel_w <= 1e-5 or rel_upd <= 5e-3, f"{name}: {rel_w:.2e} / {rel_upd:.2e}"


@pytest.mark.parametrize("sms", [0, 66])
def test_fused_with_the_prefix_coscheduler_is_exact(sms, monkeypatch):
    """The co-scheduler runs ref/0 (prompts 0, 1) on its stream beside decode, held to that job; the first
    chunk (groups 0 and 2) takes ref/0 over, its stream waiting for the chunks in flight, and ref/1 whole."""
    m0, w0, _ = _step()
    admit = AdmissionController.admit

    def only_ref0(self, *a, **kw):
        chunks = admit(self, *a, **kw)
        for c in [c for c in chunks if not c.item.key.startswith("ref/0/")]:
            self.cancel(c)
        return [c for c in chunks if c.item.key.startswith("ref/0/")]

    monkeypatch.setattr(AdmissionController, "admit", only_ref0)
    eager = CoschedConfig(slowdown_bound=0.5, baseline_samples=1, initial_budget=5.0, max_in_flight=4, job_prompts=2,
                          serial_after=1000)
    m1, w1, rl = _step(eager, schedule="fused", fuse_sms=sms, cosched=True)
    assert m1["rollplex/fused"] == 1.0 and m1["rollplex/fused_groups_in_rollout"] >= 2
    assert m1["rollplex/cosched_chunks"] > 0 and m1["rollplex/prefix_claimed_s"] > 0
    _assert_close(m1, w1, m0, w0)
    rl.timeline.resolve()
    assert any(s.lane == "cosched" for s in rl.timeline.spans) and any(s.lane == "fused" for s in rl.timeline.spans)
