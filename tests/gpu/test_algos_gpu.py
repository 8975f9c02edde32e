"""The menu's newer options on the GPU (fp32, graphed decode): ReMax's greedy continuation decoded beside
the samples in the same call, serial == rollplex for a ReMax step, and a step with rollout correction
(normalised IS weights, IcePop rejection) whose metrics are finite."""

import pytest
import torch
from helpers import assert_fp32_close, capture_grads, kernel_model, make_prompt

from rollplex.engine import Engine, EngineConfig, SamplingParams
from rollplex.rl.config import RLConfig
from rollplex.rl.step import RLStep

pytestmark = pytest.mark.gpu


def _step(**cfg):
    model = kernel_model("cuda")
    engine = Engine(model, None, EngineConfig(max_num_seqs=64, max_model_len=512, kv_cache_tokens=64 * 512,
                                              cuda_graph_max_bs=32))
    base = dict(n=4, max_new_tokens=24, lr=1e-4, kl_coef=0.05, micro_batch_prompts=2)
    return RLStep(model, engine, RLConfig(**{**base, **cfg}), reward_fn=_reward)


def _reward(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 3) / 2


def _prompts(greedy: int):
    g = torch.Generator().manual_seed(0)
    prompts = [make_prompt(g, images=[(1, 4 + 2 * (i % 3), 6)], text_len=(3 + i, 5)) for i in range(4)]
    for p in prompts:
        p.pixel_values = p.pixel_values.cuda()
    params = [SamplingParams(n=4, max_new_tokens=24, seed=10 + i, n_greedy=greedy) for i in range(4)]
    return prompts, params


def test_remax_step_serial_equals_rollplex_on_gpu():
    runs = {}
    for mode in ("rollplex", "serial"):
        rl = _step(mode=mode, adv_estimator="remax")
        grads = capture_grads(rl)
        prompts, params = _prompts(1)
        batch, m = rl.run(prompts, params, ground_truths=[""] * 4, data_sources=["x"] * 4, extra_infos=[None] * 4)
        runs[mode] = (batch, m, grads)
    (b1, m1, g1), (b2, m2, g2) = runs["rollplex"], runs["serial"]
    assert b1.greedy.num_samples == 4 and torch.equal(b1.greedy.responses, b2.greedy.responses)
    assert torch.equal(b1.baselines, b2.baselines)
    for k in ("actor/pg_loss", "actor/grad_norm"):
        assert_fp32_close(m1[k], m2[k], k, scale=1.0)
    for a, b in zip(g1, g2):
        for name in a:
            assert_fp32_close(a[name], b[name], f"grad {name}")


def test_rollout_correction_step_on_gpu():
    rl = _step(rollout_is="token", rollout_is_batch_normalize=True, rollout_rs="token", rollout_rs_threshold=1.001,
               rollout_rs_threshold_lower=0.999)
    prompts, params = _prompts(0)
    batch = rl.generate(prompts, params, ground_truths=[""] * 4, data_sources=["x"] * 4, extra_infos=[None] * 4)
    batch.rewards = torch.tensor([float(i % 3 == 0) for i in range(batch.num_samples)])
    m = rl.train(batch)
    for k in ("rollout_corr/rollout_is_batch_norm_factor", "rollout_corr/rollout_rs_masked_fraction",
              "rollout_corr/kl", "rollout_corr/chi2_token", "actor/grad_norm"):
        assert torch.isfinite(torch.tensor(m[k])), k
    assert 0.0 <= m["rollout_corr/rollout_rs_masked_fraction"] <= 1.0
