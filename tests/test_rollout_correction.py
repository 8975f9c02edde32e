"""Rollout correction (rl/rollout_correction.py, verl's algorithm.rollout_correction): the IS weights,
rejection masks, veto and mismatch metrics on hand-computed inputs, the config's checks, and a step that
trains with them (serial == rollplex; the fused schedule runs phased where the whole batch is needed)."""

import copy
import math

import pytest
import torch
from helpers import assert_fp32_close

from rollplex.engine import Engine, EngineConfig
from rollplex.models import load_model
from rollplex.rl.config import RLConfig
from rollplex.rl.pipeline import fused_unsupported
from rollplex.rl.rollout_correction import RolloutCorrection, is_weights, mismatch_metrics, rollout_correction
from rollplex.rl.step import RLStep
from rollplex.tiny import shape_color

L2, L3, L4 = math.log(2), math.log(3), math.log(4)
# two sequences of 3 slots; the second has 2 response tokens
OLD = torch.tensor([[0.0, L3, -L4], [L2, -L2, 0.0]])
ROLL = torch.zeros(2, 3)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def close(a, b, tol=1e-6):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol)


def test_token_and_sequence_weights_are_truncated():
    # token: exp(log r) = [1, 3, 1/4], [2, 1/2] truncated at 2, 0 outside the mask
    assert close(is_weights(OLD, ROLL, MASK, "token", 2.0), [[1, 2, 0.25], [2, 0.5, 0]])
    # sequence: exp(sum) = 3/4 and 1, every token of the sequence
    assert close(is_weights(OLD, ROLL, MASK, "sequence", 2.0), [[0.75, 0.75, 0.75], [1, 1, 0]])
    assert close(is_weights(OLD, ROLL, MASK, "sequence", 0.9), [[0.75, 0.75, 0.75], [0.9, 0.9, 0]])
    # |log r| past 20 is clamped before exp (no inf): exp(20) truncated
    big = is_weights(torch.tensor([[50.0]]), torch.zeros(1, 1), torch.ones(1, 1), "token", 1e30)
    assert close(big, [[math.exp(20)]], tol=1e3) and torch.isfinite(big).all()


def test_batch_normalised_weights():
    w, keep, m = rollout_correction(OLD, ROLL, MASK, RolloutCorrection("token", 2.0, True))
    mean = (1 + 2 + 0.25 + 2 + 0.5) / 5
    assert close(w, torch.tensor([[1, 2, 0.25], [2, 0.5, 0]]) / mean)
    assert m["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(mean)
    assert torch.equal(keep, MASK)
    w, _, m = rollout_correction(OLD, ROLL, MASK, RolloutCorrection("sequence", 2.0, True))
    # over sequences, each once: (3/4 + 1) / 2
    assert close(w, torch.tensor([[0.75, 0.75, 0.75], [1, 1, 0]]) / 0.875)
    assert m["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(0.875)


def test_is_metrics():
    _, _, m = rollout_correction(OLD, ROLL, MASK, RolloutCorrection("token", 2.0))
    p = "rollout_corr/rollout_is_"
    # before truncation: [1, 3, 1/4, 2, 1/2]
    assert m[p + "mean"] == pytest.approx((1 + 3 + 0.25 + 2 + 0.5) / 5)
    assert m[p + "max"] == pytest.approx(3) and m[p + "min"] == pytest.approx(0.25)
    assert m[p + "ratio_fraction_high"] == pytest.approx(1 / 5) and m[p + "ratio_fraction_low"] == pytest.approx(1 / 5)
    wc = torch.tensor([1, 2, 0.5, 2, 0.5])  # clamped to [1/2, 2] for std and ESS
    assert m[p + "std"] == pytest.approx(float((wc.square().mean() - wc.mean() ** 2).sqrt()), rel=1e-5)
    assert m[p + "eff_sample_size"] == pytest.approx(float(1 / ((wc / wc.mean()).square().mean())), rel=1e-5)
    seq = torch.tensor([(1 + 3 + 0.25) / 3, (2 + 0.5) / 2])
    assert m[p + "seq_mean"] == pytest.approx(float(seq.mean())) and m[p + "seq_max"] == pytest.approx(float(seq.max()))
    assert m[p + "seq_max_deviation"] == pytest.approx(float((seq - 1).abs().max()))
    _, _, m = rollout_correction(OLD, ROLL, MASK, RolloutCorrection("sequence", 2.0))
    assert m[p + "max"] == pytest.approx(1.0) and m[p + "min"] == pytest.approx(0.75)
    assert m[p + "ratio_fraction_high"] == 0 and m[p + "ratio_fraction_low"] == 0


def test_icepop_token_rejection():
    rc = RolloutCorrection(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.5)
    w, keep, m = rollout_correction(OLD, ROLL, MASK, rc)
    assert w is None
    # token weights [1, 3, 1/4], [2, 1/2]: 3 and 1/4 fall outside [1/2, 2]; the bounds themselves are kept
    assert torch.equal(keep, torch.tensor([[1.0, 0, 0], [1, 1, 0]]))
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 5)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)
    # the lower bound defaults to 1 / upper
    assert RolloutCorrection(rollout_rs="token", rollout_rs_threshold=4.0).rs_bounds == (0.25, 4.0)


def test_sequence_and_geometric_rejection():
    rc = RolloutCorrection(rollout_rs="sequence", rollout_rs_threshold=1.5, rollout_rs_threshold_lower=0.8)
    _, keep, m = rollout_correction(OLD, ROLL, MASK, rc)
    # sequence weights 3/4 (out) and 1 (in)
    assert torch.equal(keep, torch.tensor([[0.0, 0, 0], [1, 1, 0]]))
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(3 / 5)
    assert m["rollout_corr/rollout_rs_ratio_fraction_low"] == pytest.approx(0.5)
    # geometric: exp(mean log r) = (3/4)^(1/3) = 0.9086 and 1: both inside [0.9, 1.1]
    rc = RolloutCorrection(rollout_rs="geometric", rollout_rs_threshold=1.1, rollout_rs_threshold_lower=0.9)
    _, keep, _ = rollout_correction(OLD, ROLL, MASK, rc)
    assert torch.equal(keep, MASK)
    rc = RolloutCorrection(rollout_rs="geometric", rollout_rs_threshold=1.1, rollout_rs_threshold_lower=0.95)
    _, keep, _ = rollout_correction(OLD, ROLL, MASK, rc)
    assert torch.equal(keep, torch.tensor([[0.0, 0, 0], [1, 1, 0]]))


def test_veto_rejects_a_sequence_with_a_catastrophic_token():
    _, keep, m = rollout_correction(OLD, ROLL, MASK, RolloutCorrection(rollout_token_veto_threshold=0.3))
    # the first sequence holds a token of weight 1/4 < 0.3
    assert torch.equal(keep, torch.tensor([[0.0, 0, 0], [1, 1, 0]]))
    assert m["rollout_corr/rollout_is_veto_fraction"] == pytest.approx(0.5)
    assert m["rollout_corr/rollout_is_catastrophic_token_fraction"] == pytest.approx(1 / 5)
    # a masked-out slot never vetoes
    old = torch.tensor([[0.0, -30.0]])
    _, keep, _ = rollout_correction(old, torch.zeros(1, 2), torch.tensor([[1.0, 0.0]]),
                                    RolloutCorrection(rollout_token_veto_threshold=0.3))
    assert torch.equal(keep, torch.tensor([[1.0, 0.0]]))


def test_mismatch_metrics():
    old = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    roll = torch.tensor([[-1.5, -2.0], [-0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    m = mismatch_metrics(old, roll, mask)
    assert m["kl"] == pytest.approx(-0.5 / 3)  # mean(rollout - old)
    assert m["k3_kl"] == pytest.approx((math.exp(0.5) - 0.5 - 1) / 3)
    assert m["training_log_ppl"] == pytest.approx((1.5 + 0.5) / 2)
    assert m["training_ppl"] == pytest.approx((math.exp(1.5) + math.exp(0.5)) / 2)
    assert m["rollout_log_ppl"] == pytest.approx((1.75 + 0.5) / 2)
    assert m["log_ppl_diff"] == pytest.approx(-0.25 / 2) and m["log_ppl_diff_min"] == pytest.approx(-0.25)
    assert m["log_ppl_abs_diff"] == pytest.approx(0.125) and m["log_ppl_diff_max"] == pytest.approx(0.0)
    assert m["ppl_ratio"] == pytest.approx((math.exp(-0.25) + 1) / 2)
    assert m["chi2_token"] == pytest.approx((math.exp(1.0) + 1 + 1) / 3 - 1)
    assert m["chi2_seq"] == pytest.approx((math.exp(1.0) + 1) / 2 - 1)
    # the same metrics come prefixed from rollout_correction
    _, _, full = rollout_correction(old, roll, mask, RolloutCorrection())
    assert full["rollout_corr/kl"] == pytest.approx(m["kl"]) and full["rollout_corr/rollout_is_veto_fraction"] == 0


def test_config_checks():
    for bad in (dict(rollout_is="seq"), dict(rollout_rs="tokens", rollout_rs_threshold=2.0),
                dict(rollout_rs="token"), dict(rollout_is_batch_normalize=True),
                dict(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=3.0),
                dict(rollout_is="token", tis_imp_ratio_cap=2.0), dict(rollout_is="token", rollout_is_threshold=0.0),
                dict(rollout_token_veto_threshold=-1.0)):
        with pytest.raises(ValueError):
            RLConfig(**bad)
    cfg = RLConfig(tis_imp_ratio_cap=3.0)  # the token-level IS weights of verl's old name
    assert cfg.rollout_corr.rollout_is == "token" and cfg.rollout_corr.rollout_is_threshold == 3.0
    assert not cfg.rollout_corr.needs_whole_batch and fused_unsupported(cfg) is None
    cfg = RLConfig(rollout_rs="token", rollout_rs_threshold=2.0)
    assert cfg.rollout_corr.needs_whole_batch and "rollout correction" in fused_unsupported(cfg)


ROWS = shape_color.make_rows(4, seed=3)


def _step(tiny_dir, proc, **cfg):
    model = load_model(tiny_dir)
    engine = Engine(model, proc, EngineConfig(max_num_seqs=64, max_model_len=256))
    base = dict(n=4, max_new_tokens=6, lr=1e-4, kl_coef=0.05, micro_batch_prompts=2, micro_batch_samples=3)
    return RLStep(model, engine, RLConfig(**{**base, **cfg}), proc, reward_fn="shape_color")


@pytest.mark.parametrize("algo", [
    dict(rollout_is="sequence", rollout_is_threshold=1.5),
    dict(rollout_is="token", rollout_is_batch_normalize=True, rollout_rs="token", rollout_rs_threshold=1.02,
         rollout_rs_threshold_lower=0.98),
], ids=["sequence-is", "normalised-icepop"])
def test_a_step_trains_with_rollout_correction_in_both_modes(tiny_dir, proc, algo):
    ref = _step(tiny_dir, proc, **algo)
    batch = ref.rollout(ROWS)
    batch.rewards = torch.tensor([float(i % 3 == 0) for i in range(batch.num_samples)])
    # an engine/trainer mismatch large enough that some tokens leave the [0.98, 1.02] window
    g = torch.Generator().manual_seed(0)
    batch.rollout_logprobs = batch.rollout_logprobs + 0.05 * torch.randn(batch.rollout_logprobs.shape, generator=g)
    out = {}
    for mode in ("rollplex", "serial"):
        out[mode] = _step(tiny_dir, proc, mode=mode, **algo).train(copy.deepcopy(batch))
    m1, m2 = out["rollplex"], out["serial"]
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "rollout_corr/rollout_is_mean", "rollout_corr/kl"):
        assert_fp32_close(m1[k], m2[k], k, scale=1.0)
    assert m1["rollout_corr/k3_kl"] > 0 and float(m1["actor/grad_norm"]) > 0
    if "rollout_rs" in algo:
        assert 0 < m1["rollout_corr/rollout_rs_masked_fraction"] < 1
        assert m1["rollout_corr/rollout_is_batch_norm_factor"] > 0
