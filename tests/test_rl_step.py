"""The RL step on the tiny model (CPU, fp32): `serial` (packed or padded sequences) and `rollplex` compute
the same update on responses of different lengths within a group (also with the RLOO, Dr.GRPO and
REINFORCE++ estimators); metrics; the LR schedule's unit; the adaptive KL
controller; checkpoint/resume gives the same next step as not stopping."""

import copy
import dataclasses

import pytest
import torch
from helpers import assert_fp32_close, assert_weights_close, capture_grads

from rollplex.engine import Engine, EngineConfig
from rollplex.models import ModelInputs, load_model
from rollplex.rl.config import RLConfig
from rollplex.rl.parts import build_parts
from rollplex.rl.run_state import load_checkpoint, save_checkpoint
from rollplex.rl.step import RLStep
from rollplex.tiny import shape_color

ROWS = shape_color.make_rows(6, seed=3)


BASE = dict(n=4, max_new_tokens=6, lr=1e-2, kl_coef=0.05, micro_batch_prompts=2, micro_batch_samples=3)


def _step(tiny_dir, proc, **cfg):
    model = load_model(tiny_dir)
    engine = Engine(model, proc, EngineConfig(max_num_seqs=64, max_model_len=256))
    return RLStep(model, engine, RLConfig(**{**BASE, **cfg}), proc, reward_fn="shape_color")


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
def test_a_step_over_built_parts_is_the_step_built_whole(tiny_dir, proc):
    """`RLStep.from_parts` runs on the parts `build_parts` built (runtime, backend, actor, reference) and
    computes the step `RLStep(model, engine, cfg, ...)` does."""
    whole = _step(tiny_dir, proc)
    model = load_model(tiny_dir)
    engine = Engine(model, proc, EngineConfig(max_num_seqs=64, max_model_len=256))
    parts = build_parts(model, engine, RLConfig(**BASE), proc)
    rl = RLStep.from_parts(parts, reward_fn="shape_color")
    assert rl.actor is parts.actor and rl.reference is parts.reference and rl.backend is parts.backend
    assert rl.model is model and rl.actor.model is model and rl.engine is engine and rl.critic is None
    a, b = whole.step(ROWS[:3]), rl.step(ROWS[:3])
    assert all(a[k] == b[k] for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/score/mean"))
    assert all(torch.equal(p, q) for p, q in zip(whole.model.parameters(), rl.model.parameters()))
    assert a["perf/compiled_graphs"] == 0 and a["timing_s/compile"] == 0.0  # eager on CPU: nothing compiled


def test_compile_metrics_count_what_a_block_compiled():
    from rollplex.rl.timing import compile_metrics

    f = torch.compile(lambda x: (x * 3).sin(), backend="eager")
    first, again = {}, {}
    with compile_metrics(first):
        f(torch.ones(5))
    with compile_metrics(again):
        f(torch.ones(5))
    assert first["perf/compiled_graphs"] == 1 and first["timing_s/compile"] > 0
    assert again == {"perf/compiled_graphs": 0, "timing_s/compile": 0.0}


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
@pytest.mark.parametrize("updates", [dict(), dict(ppo_mini_batches=2, loss_agg_mode="seq-mean-token-mean")])
def test_serial_and_rollplex_compute_the_same_update(tiny_dir, proc, updates):
    ref = _step(tiny_dir, proc, mode="rollplex", **updates)
    batch = ref.rollout(ROWS)
    batch.rewards = torch.tensor([float(i % 3 == 0) for i in range(batch.num_samples)])  # varied advantages
    R = batch.responses.shape[1]
    for i in range(batch.num_samples):  # responses of one group end at different tokens, as EOS makes them
        batch.mask[i, 1 + (5 * i) % R:] = 0
    lens = batch.response_lengths()
    assert all(len(set(lens[g * 4: g * 4 + 4])) > 1 for g in range(batch.num_prompts))
    results = {}
    # micro-batches by a token budget (verl's dynamic batch size) split the same batch differently
    budget = dict(micro_batch_max_tokens=150)
    for key, mode, packed, extra in (("rollplex", "rollplex", True, {}), ("prefix_state", "rollplex", False, {}),
                                     ("rollplex_budget", "rollplex", True, budget),
                                     ("serial_budget", "serial", True, budget),
                                     ("serial_padded", "serial", False, budget), ("serial", "serial", True, {})):
        # a small lr: Adam's first steps are ~lr * sign(grad), which turns last-bit noise in near-zero
        # gradients into lr-sized weight differences at large lr
        rl = _step(tiny_dir, proc, mode=mode, lr=1e-4, packed=packed, **updates, **extra)
        grads = capture_grads(rl)
        metrics = rl.train(copy.deepcopy(batch))
        results[key] = (metrics, grads, {n: p.detach().clone() for n, p in rl.model.named_parameters()})
    for key in ("rollplex", "prefix_state", "rollplex_budget"):
        _assert_same_update(*results[key], *results["serial"], updates)
    _assert_same_update(*results["serial_budget"], *results["serial"], updates, dedup=1)
    _assert_same_update(*results["serial_padded"], *results["serial"], updates, dedup=1)


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
@pytest.mark.parametrize("algo", [
    # the groups' rewards are (1 0 0 1) (0 0 1 0) (0 1 0 0) (1 0 0 1): the largest RLOO advantage is a lone 1
    # against three 0s, 1 - 0 = 1; Dr.GRPO's is 1 - 1/4 (no std division)
    dict(adv_estimator="rloo", expect_max=1.0),
    dict(adv_estimator="dr_grpo", loss_agg_mode="seq-mean-token-sum-norm", expect_max=0.75),
    # per-token advantages, the KL penalty in the reward under the adaptive controller, GSPO and TIS
    dict(adv_estimator="reinforce_plus_plus", gamma=0.9, use_kl_loss=False, kl_ctrl="adaptive", kl_penalty="abs",
         policy_loss="gspo", tis_imp_ratio_cap=2.0),
])
def test_serial_and_rollplex_agree_for_the_estimators(tiny_dir, proc, algo):
    algo = dict(algo)
    expect_max = algo.pop("expect_max", None)
    ref = _step(tiny_dir, proc, mode="rollplex", **algo)
    batch = ref.rollout(ROWS[:4])
    batch.rewards = torch.tensor([float(i % 3 == 0) for i in range(batch.num_samples)])
    results = {}
    for mode in ("rollplex", "serial"):
        rl = _step(tiny_dir, proc, mode=mode, lr=1e-4, **algo)
        grads = capture_grads(rl)
        results[mode] = (rl.train(copy.deepcopy(batch)), grads,
                         {n: p.detach().clone() for n, p in rl.model.named_parameters()})
        if algo.get("kl_ctrl") == "adaptive":  # verl's update from the step's measured KL, 32 samples, horizon 1e4
            m = results[mode][0]
            err = min(max(m["actor/reward_kl_penalty"] / 0.1 - 1, -0.2), 0.2)
            assert m["actor/reward_kl_penalty_coeff"] == 0.05 and m["actor/reward_kl_penalty"] > 0
            assert rl.kl_ctrl.value == pytest.approx(0.05 * (1 + err * batch.num_samples / 1e4))
    _assert_same_update(*results["rollplex"], *results["serial"], {})
    if expect_max is not None:
        assert results["serial"][0]["critic/advantages/max"] == pytest.approx(expect_max)


@pytest.mark.parametrize("unit", ["step", "optimizer_step"])
def test_lr_schedule_unit(unit):
    """verl advances the schedule once per train step (every mini-batch at the same lr); the other unit
    once per optimizer step. Warm-up over 4: lr x 1/4, then x 2/4."""
    from parallel_helpers import rollout_batch, tiny_cfg, tiny_model

    from rollplex.rl.actor import Actor

    actor = Actor(tiny_model(tiny_cfg()), RLConfig(lr=1e-3, warmup_steps=4, ppo_mini_batches=2, kl_coef=0.0,
                                                   lr_schedule_unit=unit))
    batch, adv, _ = rollout_batch(prompts=2, R=3)
    m, _ = actor.update(batch, adv, None, actor.old_logprobs(batch))
    if unit == "step":
        assert actor.scheduler.last_epoch == 1 and m["actor/lr"] == pytest.approx(0.25e-3)
    else:
        assert actor.scheduler.last_epoch == 2 and m["actor/lr"] == pytest.approx((0.25e-3 + 0.5e-3) / 2)


def _assert_same_update(m1, g1, w1, m2, g2, w2, updates, dedup=4):
    """Equal up to fp32 summation order (helpers.fp32_rtol): the paths pack, batch and accumulate the
    same terms differently."""
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "training/rollout_probs_diff_mean"):
        assert_fp32_close(m1[k], m2[k], k, scale=1.0)  # means of O(1) terms that may cancel: relative to 1
    assert len(g1) == len(g2) == updates.get("ppo_mini_batches", 1)
    for a, b in zip(g1, g2):
        for name in a:
            assert_fp32_close(a[name], b[name], f"grad {name}")
    for name in w1:
        assert_weights_close(w1[name], w2[name], f"weight {name}")
    assert m1["rollplex/prefix_dedup_ratio"] == dedup and m2["rollplex/prefix_dedup_ratio"] == 1


def test_micro_batch_plans():
    from rollplex.rl.batch import RolloutBatch
    from rollplex.rl.microbatch import MicroBatching, micro_batches, plan_micro_batches

    assert plan_micro_batches([3, 3, 3], 2) == [[0, 1], [2]]
    assert plan_micro_batches([5, 1, 1, 7, 2], 99, max_tokens=7) == [[0, 1, 2], [3], [4]]
    assert plan_micro_batches([10, 10], 1, max_tokens=5) == [[0], [1]]  # an item over the budget still gets a pass
    assert plan_micro_batches([], 4) == []
    prompts = [ModelInputs(list(range(n))) for n in (10, 20, 30)]
    mask = torch.zeros(6, 8)
    for i, n in enumerate((8, 2, 5, 5, 1, 8)):
        mask[i, :n] = 1
    batch = RolloutBatch(prompts, torch.tensor([0, 0, 1, 1, 2, 2]), torch.zeros(6, 8, dtype=torch.long), mask)
    # rollplex, packed: prompt once + its responses' tokens -> costs 20, 30, 39
    got = [idx.tolist() for _, idx in micro_batches(batch, "rollplex", MicroBatching(1, 1, 50, packed=True))]
    assert got == [[0, 1, 2, 3], [4, 5]]
    # prefix-state path pads responses to R = 8: costs 26, 36, 46
    got = [idx.tolist() for _, idx in micro_batches(batch, "rollplex", MicroBatching(1, 1, 62, packed=False))]
    assert got == [[0, 1, 2, 3], [4, 5]]
    # serial: the prompt per sequence -> costs 18, 12, 25, 25, 31, 38
    got = [idx.tolist() for _, idx in micro_batches(batch, "serial", MicroBatching(1, 1, 40, packed=True))]
    assert got == [[0, 1], [2], [3], [4], [5]]
    # by count: two prompts (with all their samples) / three sequences per pass
    got = [idx.tolist() for _, idx in micro_batches(batch, "rollplex", RLConfig(micro_batch_prompts=2).micro_batching)]
    assert got == [[0, 1, 2, 3], [4, 5]]
    got = [idx.tolist() for _, idx in micro_batches(batch, "serial", RLConfig(micro_batch_samples=3).micro_batching)]
    assert got == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError):
        MicroBatching(0, 1, None, packed=True)


def test_step_metrics_and_live_weights(tiny_dir, proc):
    rl = _step(tiny_dir, proc)
    before = {n: p.detach().clone() for n, p in rl.model.named_parameters()}
    m = rl.step(ROWS[:3])
    for key in ("timing_s/gen", "timing_s/ref", "timing_s/update_actor", "timing_s/step", "perf/throughput",
                "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
                "actor/kl_coef", "critic/score/mean",
                "response_length/mean", "training/rollout_probs_diff_mean", "training/rollout_probs_diff_max"):
        assert key in m, key
    assert m["training/rollout_probs_diff_max"] < 1e-4  # engine and trainer agree on the sampled tokens
    changed = any(not torch.equal(before[n], p) for n, p in rl.model.named_parameters())
    assert changed and rl.engine.model is rl.model  # the engine decodes with the updated tensors
    assert all(torch.equal(before[n], p) for n, p in rl.ref.named_parameters())  # reference frozen


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
def test_train_takes_a_config_for_that_step_only(tiny_dir, proc):
    rl = _step(tiny_dir, proc, ppo_mini_batches=2)
    base = rl.cfg
    lrs = []
    opt_step = rl.actor.optimizer.step

    def step():
        lrs.append([g["lr"] for g in rl.actor.optimizer.param_groups])
        opt_step()

    rl.actor.optimizer.step = step
    batch = rl.rollout(ROWS[:4])
    batch.rewards = torch.tensor([float(i % 2) for i in range(batch.num_samples)])
    m = rl.train(copy.deepcopy(batch), dataclasses.replace(base, lr=1e-3, kl_coef=0.0, micro_batch_prompts=1))
    assert lrs == [[1e-3], [1e-3]] and m["actor/lr"] == 1e-3  # every optimizer step of that train call
    assert "timing_s/ref" not in m and m["actor/kl_loss"] == 0.0  # kl_coef 0: no reference pass
    assert rl.cfg is base and rl.actor.cfg is base and base.lr == 1e-2 and base.kl_coef == 0.05
    lrs.clear()
    m = rl.train(copy.deepcopy(batch))
    assert lrs == [[1e-2], [1e-2]] and m["actor/lr"] == 1e-2 and "timing_s/ref" in m


def test_resume_gives_the_same_next_step(tiny_dir, proc, tmp_path):
    a = _step(tiny_dir, proc, ppo_mini_batches=2)
    a.step(ROWS[:4])
    save_checkpoint(a, tmp_path / "ck", data_state={"position": 4}, tokenizer_dir=tiny_dir)
    m_a = a.step(ROWS[2:6])
    b = _step(tiny_dir, proc, ppo_mini_batches=2)
    assert load_checkpoint(b, tmp_path / "ck") == {"position": 4}
    m_b = b.step(ROWS[2:6])
    for k in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean"):
        assert m_a[k] == pytest.approx(m_b[k], rel=1e-6, abs=1e-9), k
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.allclose(p, q, atol=1e-7), n
    # the saved policy is an ordinary HF checkpoint
    assert load_model(tmp_path / "ck").cfg == a.model.cfg


def test_resume_restores_the_adaptive_kl_coefficient(tiny_dir, proc, tmp_path):
    algo = dict(use_kl_loss=False, kl_ctrl="adaptive")
    a = _step(tiny_dir, proc, **algo)
    a.kl_ctrl.value = 0.123  # where earlier steps moved it
    save_checkpoint(a, tmp_path / "ck")
    b = _step(tiny_dir, proc, **algo)
    assert b.kl_ctrl.value == 0.05  # kl_coef
    load_checkpoint(b, tmp_path / "ck")
    assert b.kl_ctrl.value == 0.123
