"""The fused schedule (rl/pipeline.py) on the tiny model (CPU, fp32): groups scored and trained while the
rollout still decodes give the phased step's update up to summation order — KL as a loss and as a
reward penalty, trained and frozen vision tower, RLOO, groups finishing out of prompt order — and a
step that fused work cannot reproduce, or whose fused stage runs out of memory, runs phased."""

import dataclasses
import weakref

import pytest
import torch
from helpers import assert_fp32_close, assert_weights_close, capture_grads
from parallel_helpers import spawn

from rollplex.cosched import CoschedConfig, CoScheduler, PrefixJob
from rollplex.cosched.controller import AdmissionController
from rollplex.engine import Engine, EngineConfig, SamplingParams
from rollplex.memory import MemoryConfig, MemoryManager, PhasePlan
from rollplex.models import ModelInputs, load_model
from rollplex.rl.actor import Actor
from rollplex.rl.batch import RolloutBatch
from rollplex.rl.config import RLConfig
from rollplex.rl.fuse_gate import BUCKETS, FuseGate, _Bucket
from rollplex.rl.pipeline import GroupPipeline, fused_unsupported
from rollplex.rl.step import RLStep, rollout_requests
from rollplex.tiny import shape_color

ROWS = shape_color.make_rows(6, seed=3)
# each prompt's samples stop at their own length: groups finish in the order 0, 4, 2, 5, 1, 3
LENGTHS = [3, 9, 5, 12, 4, 7]


def _reward(data_source, text, ground_truth, extra_info):
    return float(len(text) % 3 == 0)  # varied within groups: non-zero advantages


def _step(tiny_dir, proc, memory_cfg: MemoryConfig | None = None, cosched_cfg: CoschedConfig | None = None,
          seqs: int = 64, **cfg):
    model = load_model(tiny_dir)
    # the accounting backend poisons released regions: reading one outside its phases shows as NaN
    mm = MemoryManager(PhasePlan.releases_only(), backend="accounting") if memory_cfg is not None else None
    engine = Engine(model, proc, EngineConfig(max_num_seqs=seqs, max_model_len=256), memory=mm)
    # a small lr: Adam's first steps are ~lr * sign(grad), which turns last-bit noise into lr-sized differences
    base = dict(n=4, max_new_tokens=12, lr=1e-4, kl_coef=0.05, micro_batch_prompts=2, micro_batch_samples=3)
    return RLStep(model, engine, RLConfig(**{**base, **cfg}), proc, reward_fn=_reward, memory=mm,
                  memory_cfg=memory_cfg, cosched=cosched_cfg)


def _run(rl: RLStep, lengths: list[int] = LENGTHS) -> tuple[dict, list[dict], dict]:
    """One whole step on ROWS with `lengths`: (metrics, gradients at each optimizer step, updated weights)."""
    grads = capture_grads(rl)
    prompts, params, per_prompt = rollout_requests(rl.processor, ROWS, rl.cfg, rl.step_idx)
    params = [SamplingParams(n=p.n, max_new_tokens=k, seed=p.seed, ignore_eos=True) for p, k in zip(params, lengths)]
    _, m = rl.run(prompts, params, **per_prompt)
    return m, grads, {n: p.detach().clone() for n, p in rl.model.named_parameters()}


def _assert_same_step(fused, phased, step=1, updates=1):
    (m1, g1, w1), (m2, g2, w2) = fused, phased
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac",
              "actor/ppo_kl", "critic/score/mean", "critic/rewards/mean", "critic/advantages/mean",
              "training/rollout_probs_diff_mean"):
        if k in m2:
            assert_fp32_close(m1[k], m2[k], k, scale=1.0)
    assert set(k for k in m2 if k.startswith(("actor/", "critic/"))) <= set(m1)
    assert len(g1) == len(g2) == updates
    for a, b in zip(g1, g2):
        for name in b:
            assert_fp32_close(a[name], b[name], f"grad {name}")
    for name in w2:
        assert_weights_close(w1[name], w2[name], f"weight {name}")
    assert m1["training/global_step"] == m2["training/global_step"] == step


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
@pytest.mark.parametrize("algo", [
    dict(),  # GRPO, KL as a loss
    # KL as a reward penalty. At the first step the policy is the reference and the penalty is rounding
    # noise, which dividing by a group's std would blow up in a group of equal scores: no std here
    dict(use_kl_loss=False, kl_ctrl="adaptive", kl_penalty="abs", norm_adv_by_std=False),
    dict(freeze_vision_tower=True, adv_estimator="rloo", tis_imp_ratio_cap=2.0),
    dict(mode="serial", loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.01),
], ids=["grpo-kl-loss", "kl-in-reward", "frozen-vision-rloo", "serial-seq-mean"])
def test_fused_equals_phased(tiny_dir, proc, tail, algo):
    phased = _run(_step(tiny_dir, proc, **algo))
    rl = _step(tiny_dir, proc, schedule="fused", **algo)
    fused = _run(rl)
    m = fused[0]
    assert m["rollplex/fused"] == 1.0 and m["rollplex/fused_groups"] == 6
    assert m["rollplex/fused_groups_in_rollout"] >= 2  # a chunk trained while other groups decoded
    _assert_same_step(fused, phased)
    if "kl_ctrl" in algo:  # the adaptive controller moved by the same measured KL
        assert_fp32_close(m["actor/kl_coef"], phased[0]["actor/kl_coef"], "kl_coef")


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
def test_fused_several_mini_batches_equals_phased(tiny_dir, proc, tail, monkeypatch):
    """Two mini-batches, two epochs: the first mini-batch is the groups that finished first (0, 4, 2), trained
    beside the rollout; the other and the second epoch (a seeded permutation, the same in both schedules)
    follow its optimizer step as in the phased step, whose first epoch is cut from the same finishing order.
    (KL as a loss: with the KL in the reward a group of equal scores trains on rounding noise, which the
    later mini-batches' clipping would amplify.)"""
    cut = []
    mini_batches = Actor._mini_batches

    def recording(self, cfg, batch, epoch, step):
        out = mini_batches(self, cfg, batch, epoch, step)
        cut.append(out)
        return out

    monkeypatch.setattr(Actor, "_mini_batches", recording)
    cfg = dict(ppo_mini_batches=2, ppo_epochs=2)
    phased = _run(_step(tiny_dir, proc, **cfg))
    assert cut[0] == [[0, 4, 2], [5, 1, 3]]  # the finishing order, not prompt order
    fused = _run(_step(tiny_dir, proc, schedule="fused", **cfg))
    m = fused[0]
    assert m["rollplex/fused"] == 1.0 and m["rollplex/fused_groups"] == 6
    assert 2 <= m["rollplex/fused_groups_in_rollout"] <= 3  # only the first mini-batch's groups are trained
    _assert_same_step(fused, phased, updates=4)


# the prefix co-scheduler's jobs of two prompts each: ref/0 = prompts 0, 1 (they finish last), ref/1 = 2, 3,
# ref/2 = 4, 5; groups finish 2, 4, 3, 5, 1, 0, so the first chunk (2, 4) needs ref/1 and ref/2
COSCHED_LENGTHS = [12, 11, 3, 5, 4, 7]
# admit eagerly (on CPU a chunk runs inline, so every loaded step is slow): the test is about exactness
EAGER = CoschedConfig(slowdown_bound=0.9, baseline_samples=1, initial_budget=50.0, max_chunk_ms=1e6,
                      max_in_flight=2, serial_after=1000, reprobe_every=0, job_prompts=2)


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
@pytest.mark.parametrize("extra", [dict(), dict(ppo_mini_batches=2), dict(freeze_vision_tower=True)],
                         ids=["kl-loss", "old-logprobs", "frozen-vision"])
def test_fused_with_the_prefix_coscheduler_equals_phased(tiny_dir, proc, tail, monkeypatch, extra):
    """The co-scheduler as a producer of the pipeline: it runs ref/0 beside decode (its admission is held to
    that job), while the worker's first chunk, beside decode too, takes ref/1 and ref/2 over from it and runs
    them itself (with two mini-batches the old policy's jobs too; with the frozen tower over the engine's
    encodings). Every prefix unit runs once, and the step is the phased one, with or without the co-scheduler
    (KL as a loss: the reference is scored over the handed-over prefix states)."""
    phased = _run(_step(tiny_dir, proc, **extra), COSCHED_LENGTHS)
    phased_co = _run(_step(tiny_dir, proc, cosched_cfg=EAGER, cosched=True, **extra), COSCHED_LENGTHS)
    assert phased_co[0]["rollplex/prefix_hidden_s"] > 0

    admit = AdmissionController.admit

    def only_ref0(self, *a, **kw):
        chunks = admit(self, *a, **kw)
        for c in [c for c in chunks if not c.item.key.startswith("ref/0/")]:
            self.cancel(c)  # back to the queue: the pipeline's chunks claim it
        return [c for c in chunks if c.item.key.startswith("ref/0/")]

    runs: dict[tuple[str, int], int] = {}
    unit = PrefixJob._unit

    def counted(self, u):
        runs[self.key, u] = runs.get((self.key, u), 0) + 1
        return unit(self, u)

    monkeypatch.setattr(AdmissionController, "admit", only_ref0)
    monkeypatch.setattr(PrefixJob, "_unit", counted)
    rl = _step(tiny_dir, proc, schedule="fused", cosched_cfg=EAGER, cosched=True, **extra)
    fused = _run(rl, COSCHED_LENGTHS)
    m = fused[0]
    assert m["rollplex/fused"] == 1.0 and m["rollplex/fused_groups_in_rollout"] >= 2
    # both producers ran prefix work: ref/0 beside decode, ref/1 and ref/2 claimed by the worker's first chunk
    assert m["rollplex/prefix_hidden_s"] > 0 and m["rollplex/cosched_chunks"] > 0
    assert m["rollplex/prefix_claimed_s"] > 0
    old = ["old/1", "old/2"] if extra.get("ppo_mini_batches") else []  # the first chunk scores old logprobs too
    # (old/0 is held back by the admission too: the last chunk or the normal phase runs it)
    assert m["rollplex/cosched_jobs_claimed"] == 2 if not old else m["rollplex/cosched_jobs_claimed"] >= 4
    assert m["rollplex/prefix_hidden_s"] + m["rollplex/prefix_in_flight_s"] + m["rollplex/prefix_claimed_s"] + \
        m["rollplex/prefix_left_s"] == pytest.approx(m["rollplex/prefix_total_s"])
    keys = ["ref/0", "ref/1", "ref/2"] + (["old/0", *old] if old else [])
    assert sorted({k for k, _ in runs}) == sorted(keys) and set(runs.values()) == {1}
    updates = extra.get("ppo_mini_batches", 1)
    _assert_same_step(fused, phased, updates=updates)
    _assert_same_step(fused, phased_co, updates=updates)


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
def test_a_chunk_waits_for_the_prefill_of_its_jobs_prompts(tiny_dir, proc, monkeypatch):
    """Frozen tower, one prompt decoding at a time: the first chunk (group 0) needs ref/0, whose prompt 1 the
    engine prefills only once group 0 is done, with the encodings the job takes. The worker claims it while
    decode is held, waits for that prefill, then takes the job over; the step is the phased one."""
    import threading

    extra = dict(freeze_vision_tower=True, micro_batch_prompts=1)
    phased = _run(_step(tiny_dir, proc, seqs=4, **extra))
    claim, claiming, waited = CoScheduler.claim, threading.Event(), []

    def spy(self, jobs, cancelled=None):
        waited.append(bool({j.key for j in jobs} & self._pending_jobs.keys()))
        claiming.set()
        return claim(self, jobs, cancelled)

    add = GroupPipeline.add

    def held_add(self, i, output):
        add(self, i, output)
        if len(self.order) == 1:  # decode (and the next prompt's prefill) waits until the worker claims
            assert claiming.wait(60)

    monkeypatch.setattr(CoScheduler, "claim", spy)
    monkeypatch.setattr(GroupPipeline, "add", held_add)
    rl = _step(tiny_dir, proc, seqs=4, schedule="fused", cosched_cfg=EAGER, cosched=True, **extra)
    fused = _run(rl)
    assert waited[0] and fused[0]["rollplex/cosched_jobs_waiting"] == 0
    assert fused[0]["rollplex/fused"] == 1.0 and fused[0]["rollplex/cosched_jobs_claimed"] >= 1
    _assert_same_step(fused, phased)


def test_fused_data_parallel_equals_phased(tmp_path, tiny_dir):
    """Two ranks (gloo), each rolling out and training its share of the groups at its own pace: rank 0's
    finish 0, 4, 2 and rank 1's 5, 1, 3, so the whole rollout's order interleaves them as 0, 5, 4, 1, 2, 3
    and the first of two mini-batches is two of rank 0's groups and one of rank 1's. The gradients are
    reduced once after the rollout; normalisers, metrics and updated weights are the phased step's."""
    from fused_dp_worker import worker

    # three samples: each group of the first mini-batch then has unequal rewards (non-zero advantages)
    cfg = RLConfig(n=3, max_new_tokens=12, lr=1e-4, kl_coef=0.05, micro_batch_prompts=1, ppo_mini_batches=2)
    spawn(worker, args=(2, f"file://{tmp_path}/store", tiny_dir, ROWS, LENGTHS, cfg), nprocs=2)


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
def test_fused_under_the_memory_manager(tiny_dir, proc, tail):
    """The plan releases the gradients and offloads the reference and optimizer outside their phases: the
    fused rollout holds the gradients and the reference, and two steps give the unmanaged update."""
    moves = MemoryConfig(memory_plan="release", memory_overrides="ref_weights:*=offloaded,optimizer:*=offloaded")
    plain, managed = _step(tiny_dir, proc), _step(tiny_dir, proc, moves, schedule="fused")
    assert managed.memory.plan.get("rollout", "grads") == "released"
    for step in (1, 2):
        phased, fused = _run(plain), _run(managed)
        assert fused[0]["rollplex/fused"] == 1.0
        _assert_same_step(fused, phased, step)
        assert managed.memory.current == "update" and managed.memory.state["kv_cache"] == "released"


def test_fused_phase_that_does_not_fit_runs_phased(tiny_dir, proc):
    rl = _step(tiny_dir, proc, MemoryConfig(memory_plan="release"), schedule="fused")
    sizes, acts = rl.memory_sizes(), rl.activation_estimate()
    # the fused rollout holds the weights, KV cache, gradients, reference, the optimizer state (this plan keeps
    # it resident) and one update micro-batch at once
    need = (sizes["weights"] + sizes["kv_cache"] + sizes["grads"] + sizes["ref_weights"] + sizes["optimizer"]
            + acts["update"])
    rl.memory_fit = dataclasses.replace(rl.memory_fit, capacity=need, budget=need)
    assert rl.fused_unsupported() is None
    rl.memory_fit = dataclasses.replace(rl.memory_fit, budget=need - 1)
    assert "fused rollout phase needs" in rl.fused_unsupported()
    m = _run(rl)[0]
    assert m["rollplex/fused"] == 0.0 and m["training/global_step"] == 1


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
def test_fused_stage_out_of_memory_runs_the_step_phased(tiny_dir, proc, tail, monkeypatch):
    phased = _run(_step(tiny_dir, proc))
    calls = []
    accumulate = Actor.accumulate_groups

    held, freed_before_update = [], []

    def oom_on_second(self, *a, **kw):
        calls.append(1)
        if len(calls) == 2:
            activations = torch.ones(1024)  # what the failed pass's frame holds
            held.append(weakref.ref(activations))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return accumulate(self, *a, **kw)

    train = RLStep.train

    def phased_train(self, *a, **kw):
        freed_before_update.append(all(r() is None for r in held))
        return train(self, *a, **kw)

    monkeypatch.setattr(Actor, "accumulate_groups", oom_on_second)
    monkeypatch.setattr(RLStep, "train", phased_train)
    fused = _run(_step(tiny_dir, proc, schedule="fused"))
    assert len(calls) == 2  # the first chunk was accumulated, then dropped
    assert held and freed_before_update == [True]  # the phased update does not run beside the failed pass's tensors
    assert fused[0]["rollplex/fused"] == 0.0 and fused[0]["rollplex/fused_fallback_oom"] == 1.0
    _assert_same_step(fused, phased)


def test_fused_stage_error_is_raised_with_nothing_applied(tiny_dir, proc, monkeypatch):
    rl = _step(tiny_dir, proc, schedule="fused")
    before = {n: p.detach().clone() for n, p in rl.model.named_parameters()}

    def bad_reward(*a):
        raise RuntimeError("grader crashed")

    rl.reward_fn = bad_reward
    with pytest.raises(ValueError, match="grader crashed"):
        _run(rl)
    assert rl.step_idx == 0 and rl.actor.scheduler.last_epoch == 0
    for n, p in rl.model.named_parameters():
        assert torch.equal(p, before[n]) and (p.grad is None or not p.grad.any()), n


def test_failed_rollout_drops_the_fused_chunks(tiny_dir, proc, tail, monkeypatch):
    rl = _step(tiny_dir, proc, schedule="fused")
    before = {n: p.detach().clone() for n, p in rl.model.named_parameters()}
    generate = rl.engine.generate

    def fails_after_three_groups(prompts, params, keep_vision=False, on_output=None):
        def report(i, out):
            on_output(i, out)
            if len(seen) == 3:
                raise RuntimeError("the engine failed")
            seen.append(i)

        seen: list[int] = []
        return generate(prompts, params, keep_vision=keep_vision, on_output=report)

    monkeypatch.setattr(rl.engine, "generate", fails_after_three_groups)
    with pytest.raises(RuntimeError, match="the engine failed"):
        _run(rl)
    assert rl.step_idx == 0 and not rl.model.training  # the trainer is back in eval mode, nothing applied
    for n, p in rl.model.named_parameters():
        assert torch.equal(p, before[n]) and (p.grad is None or not p.grad.any()), n


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
def test_what_fused_cannot_reproduce_runs_phased(tiny_dir, proc):
    cfg = dict(adv_estimator="reinforce_plus_plus")
    phased = _run(_step(tiny_dir, proc, **cfg))
    fused = _run(_step(tiny_dir, proc, schedule="fused", **cfg))
    assert fused[0]["rollplex/fused"] == 0.0
    for name, w in phased[2].items():
        assert torch.equal(fused[2][name], w)  # the same code ran: bitwise


def test_first_epoch_mini_batches_follow_the_finishing_order(tiny_dir):
    actor = Actor(load_model(tiny_dir), RLConfig(ppo_mini_batches=2, ppo_epochs=2))
    batch = RolloutBatch.from_samples([ModelInputs([5, 6]) for _ in range(5)], [0, 1, 2, 3, 4], [[7]] * 5, pad_id=0)
    assert actor._mini_batches(actor.cfg, batch, 0, 0) == [[0, 1, 2], [3, 4]]  # unknown: prompt order
    batch.finished = [4, 0, 3, 1, 2]  # prompt 1 finished first, then 3, 4, 2, 0
    assert batch.finish_order() == [1, 3, 4, 2, 0]
    assert actor._mini_batches(actor.cfg, batch, 0, 0) == [[1, 3, 4], [2, 0]]
    later = actor._mini_batches(actor.cfg, batch, 1, 0)  # a permutation seeded by (seed, step, epoch)
    assert later == actor._mini_batches(actor.cfg, batch, 1, 0) and sorted(sum(later, [])) == [0, 1, 2, 3, 4]
    sub, _ = batch.select_prompts([3, 1])
    assert sub.finished == [1, 0] and sub.finish_order() == [1, 0]


def test_fused_unsupported_names_the_reason():
    assert fused_unsupported(RLConfig()) is None
    assert fused_unsupported(RLConfig(ppo_mini_batches=2, ppo_epochs=2)) is None
    assert "whitens" in fused_unsupported(RLConfig(adv_estimator="reinforce_plus_plus"))
    assert "gspo" in fused_unsupported(RLConfig(policy_loss="gspo", kl_coef=0.1))
    assert fused_unsupported(RLConfig(policy_loss="gspo", kl_coef=0.1, use_kl_loss=False)) is None
    RLConfig(schedule="fused", cosched=True)  # one process: the co-scheduler feeds the pipeline
    from rollplex.parallel.colocated import check_config

    with pytest.raises(ValueError, match="one process only"):
        check_config(RLConfig(schedule="fused", cosched=True))
    check_config(RLConfig(schedule="fused"))
    check_config(RLConfig(cosched=True))
    with pytest.raises(ValueError, match="fuse_below"):
        RLConfig(fuse_below=0.0)
    with pytest.raises(ValueError, match="schedule"):
        RLConfig(schedule="pipelined")


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
def test_a_gate_holding_every_bucket_trains_after_the_rollout(tiny_dir, proc):
    """fuse_admission="pays" where every decode-batch bucket cost more decode time than it saved: no chunk
    runs beside decode, all run after the rollout, and the update is the phased one."""
    phased = _run(_step(tiny_dir, proc))
    rl = _step(tiny_dir, proc, schedule="fused", fuse_admission="pays")
    rl.schedule.gate = FuseGate("pays", buckets={b: _Bucket(added=2.0, saved=1.0) for b in BUCKETS})
    fused = _run(rl)
    m = fused[0]
    assert m["rollplex/fused"] == 1.0 and m["rollplex/fused_groups_in_rollout"] == 0
    assert m["timing_s/fused_in_rollout"] == 0 and m["rollplex/fused_held_buckets"] == len(BUCKETS)
    assert rl.schedule.gate.ms_per_token > 0  # learnt from the chunks that ran alone
    _assert_same_step(fused, phased)
