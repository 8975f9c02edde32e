"""serial == rollplex for the menu's losses and estimators on the tiny model (CPU, fp32): the
shared-prefix mode and verl's per-sample order compute the same update, per-sequence aggregation
(sapo, geo_mean) and the menu's hyperparameters included."""

import copy

import pytest
import torch
from helpers import assert_fp32_close, capture_grads

from rollplex.engine import Engine, EngineConfig
from rollplex.models import load_model
from rollplex.rl.config import RLConfig
from rollplex.rl.step import RLStep
from rollplex.tiny import shape_color

ROWS = shape_color.make_rows(4, seed=3)


def _step(tiny_dir, proc, **cfg):
    model = load_model(tiny_dir)
    engine = Engine(model, proc, EngineConfig(max_num_seqs=64, max_model_len=256))
    base = dict(n=4, max_new_tokens=6, lr=1e-4, kl_coef=0.05, micro_batch_prompts=2, micro_batch_samples=3)
    return RLStep(model, engine, RLConfig(**{**base, **cfg}), proc, reward_fn="shape_color")


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
@pytest.mark.parametrize("algo", [
    dict(policy_loss="sapo", tau_pos=2.0, tau_neg=3.0, ppo_epochs=2),
    dict(policy_loss="cispo", clip_ratio_high=0.28, ppo_epochs=2, kl_loss_type="k3+"),
    dict(policy_loss="geo_mean", clip_ratio_low=0.4, clip_ratio_high=0.4, ppo_mini_batches=2),
    dict(adv_estimator="opo", policy_loss="gpg", loss_agg_mode="token-sum"),
    dict(adv_estimator="grpo_passk", policy_loss="reinforce"),
], ids=lambda a: "-".join(f"{k}={v}" for k, v in a.items()))
def test_serial_and_rollplex_agree_for_the_menu(tiny_dir, proc, algo):
    ref = _step(tiny_dir, proc, mode="rollplex", **algo)
    batch = ref.rollout(ROWS)
    batch.rewards = torch.tensor([float(i % 3 == 0) for i in range(batch.num_samples)])  # varied advantages
    results = {}
    for mode in ("rollplex", "serial"):
        rl = _step(tiny_dir, proc, mode=mode, **algo)
        grads = capture_grads(rl)
        results[mode] = (rl.train(copy.deepcopy(batch)), grads)
    (m1, g1), (m2, g2) = results["rollplex"], results["serial"]
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert_fp32_close(m1[k], m2[k], k, scale=1.0)
    assert len(g1) == len(g2) >= 1 and float(m1["actor/grad_norm"]) > 0
    for a, b in zip(g1, g2):
        for name in a:
            assert_fp32_close(a[name], b[name], f"grad {name}")
