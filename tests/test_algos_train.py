"""Each policy loss, advantage estimator, aggregation and straight-through KL of the menu trains the
demo's tiny model on CPU for a few steps through the whole RL step (rollout, reward, reference,
advantages, update): finite metrics and weights that moved. A smoke check, not a learning run."""

import itertools
import math

import pytest
import torch

from rollplex.engine import Engine, EngineConfig
from rollplex.models import load_model
from rollplex.rl.config import RLConfig
from rollplex.rl.step import RLStep
from rollplex.tiny import shape_color

ROWS = shape_color.make_rows(4, seed=3)

CASES = [
    dict(policy_loss="sapo"),
    dict(policy_loss="cispo", clip_ratio_high=0.28),
    dict(policy_loss="gpg", adv_estimator="gpg"),
    dict(policy_loss="reinforce", loss_agg_mode="token-sum"),
    dict(policy_loss="clip_cov", clip_cov_ratio=0.2, clip_cov_lb=-10.0, clip_cov_ub=10.0),
    dict(policy_loss="kl_cov", kl_cov_ratio=0.2),
    dict(policy_loss="geo_mean", clip_ratio_low=0.4, clip_ratio_high=0.4),
    dict(adv_estimator="opo"),
    dict(adv_estimator="grpo_passk"),
    dict(kl_loss_type="k3+", kl_coef=0.1),
    dict(policy_loss="sapo", mode="serial", ppo_epochs=2),
]


def _reward():
    """Scores 0, 0.5, 1, 0.25, ... in turn: every group of 4 has differing rewards."""
    calls = itertools.count()

    def reward(data_source, solution_str, ground_truth, extra_info=None):
        return (0.0, 0.5, 1.0, 0.25)[next(calls) % 4]

    return reward


@pytest.mark.parametrize("options", CASES, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_menu_option_trains_the_tiny_model(tiny_dir, proc, options):
    torch.manual_seed(0)
    model = load_model(tiny_dir)
    engine = Engine(model, proc, EngineConfig(max_num_seqs=64, max_model_len=256))
    cfg = RLConfig(**{**dict(n=4, max_new_tokens=4, lr=1e-3, micro_batch_prompts=2), **options})
    rl = RLStep(model, engine, cfg, proc, reward_fn=_reward())
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        m = rl.step(ROWS)
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss"):
            assert math.isfinite(float(m[key])), (key, m[key])
        assert float(m["actor/grad_norm"]) > 0  # the loss reached the weights
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
