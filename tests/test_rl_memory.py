"""The RL step under the phase-aware memory manager (accounting backend, CPU, fp32): released regions
read as garbage, so these tests fail if anything reads a region outside the phases the plan gives it.
Same updated weights as without memory management; the engine's tokens survive a KV release/resume;
OOM in the update backs off or leaves the weights and optimizer as they were."""

import copy
import weakref

import pytest
import torch

from rollplex.engine import Engine, EngineConfig, SamplingParams
from rollplex.memory import MemoryConfig, MemoryManager, PhasePlan
from rollplex.models import load_model
from rollplex.rl import actor as actor_mod
from rollplex.rl.activation_checkpointing import activation_checkpointing
from rollplex.rl.actor import TrainOOM
from rollplex.rl.config import RLConfig
from rollplex.rl.microbatch import Backoff, MicroBatching
from rollplex.rl.placement import SingleProcess
from rollplex.rl.step import RLStep
from rollplex.rl.trainer import retry_oom
from rollplex.tiny import shape_color

ROWS = shape_color.make_rows(4, seed=5)
EVERYTHING_MOVES = "ref_weights:*=offloaded,optimizer:*=offloaded"


def _parity_reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """Varies within a group on the untrained tiny model (the task's own reward is 0 for every sample)."""
    return float(sum(map(ord, solution_str)) % 2)


def _step(tiny_dir, proc, memory_cfg: MemoryConfig | None, kv_cache_tokens: int | None = None, **cfg):
    model = load_model(tiny_dir)
    mm = MemoryManager(PhasePlan.releases_only(), backend="accounting") if memory_cfg is not None else None
    engine = Engine(model, proc, EngineConfig(max_num_seqs=64, max_model_len=256, kv_cache_tokens=kv_cache_tokens),
                    memory=mm)
    base = dict(n=4, max_new_tokens=6, lr=1e-3, kl_coef=0.05, micro_batch_prompts=2)
    return RLStep(model, engine, RLConfig(**{**base, **cfg}), proc, reward_fn=_parity_reward, memory=mm,
                  memory_cfg=memory_cfg)


def _weights(rl):
    return {n: p.detach().clone() for n, p in rl.model.named_parameters()}


def _opt_state(rl):
    return [t.clone() for t in rl.actor.optimizer.state_tensors()]


def test_managed_step_equals_unmanaged(tiny_dir, proc):
    plain = _step(tiny_dir, proc, None)
    managed = _step(tiny_dir, proc, MemoryConfig(memory_plan="release", memory_overrides=EVERYTHING_MOVES))
    assert managed.memory.plan.get("rollout", "optimizer") == "offloaded"
    for _ in range(2):  # the second step resumes offloaded moments and a re-zeroed gradient region
        m_plain = plain.step(ROWS)
        m_managed = managed.step(ROWS)
        assert m_plain["critic/score/mean"] == m_managed["critic/score/mean"]
        assert m_managed["actor/grad_norm"] == m_plain["actor/grad_norm"] > 0  # clipped at grad_clip
        for (n, a), b in zip(_weights(plain).items(), _weights(managed).values()):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
    assert m_managed["memory/offload_copy_gib"] > 0 and "memory/update/resident_gib" in m_managed
    assert managed.memory.current == "update" and managed.memory.state["kv_cache"] == "released"
    report = managed.memory.report()
    assert report["phases"]["rollout"]["resident_bytes"]["kv_cache"] > 0
    assert "kv_cache" not in report["phases"]["update"]["resident_bytes"]


def test_engine_tokens_survive_release_and_resume(tiny_dir, proc):
    rl = _step(tiny_dir, proc, MemoryConfig(memory_plan="release"))
    sp = SamplingParams(n=3, temperature=0.0, max_new_tokens=8)
    prompts = [shape_color.make_rows(1, seed=s)[0] for s in (1, 2)]
    from rollplex.data import row_to_inputs

    inputs = [row_to_inputs(proc, r) for r in prompts]
    rl.memory.enter("rollout")
    before = [[s.token_ids for s in o.samples] for o in rl.engine.generate(inputs, sp)]
    rl.memory.enter("update")
    assert torch.isnan(rl.engine.runner.k_cache).all()  # released: poisoned
    with pytest.raises(RuntimeError, match="KV cache is released"):
        rl.engine.generate(inputs, sp)
    rl.memory.enter("rollout")
    after = [[s.token_ids for s in o.samples] for o in rl.engine.generate(inputs, sp)]
    assert before == after


def test_auto_plan_and_checkpointing(tiny_dir, proc):
    rl = _step(tiny_dir, proc, MemoryConfig(), gradient_checkpointing=True, vision_gradient_checkpointing=True)
    assert rl.memory.plan.name == "auto" and rl.memory.plan.get("update", "kv_cache") == "released"
    assert activation_checkpointing(rl.model) == (True, True)
    plain = _step(tiny_dir, proc, None)
    rl.step(ROWS)
    plain.step(ROWS)
    for (n, a), b in zip(_weights(plain).items(), _weights(rl).values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)


def test_a_step_too_large_for_the_device_takes_the_measures_it_needs(tiny_dir, proc):
    """A device between the update's planned peak with the AdamW moments on it and with them paged: the step
    is built with the reference offloaded, checkpointing on and the moments paged (memory/fit.py's choice
    from the planned sizes), reports it, and trains as the unmanaged step does."""
    plain = _step(tiny_dir, proc, None, kv_cache_tokens=1024)  # a KV cache smaller than the update's needs
    on_device, paged = plain.memory_sizes("none"), plain.memory_sizes("moments")
    acts = plain.activation_estimate(checkpointing=True)["update"]
    # the update with the reference offloaded and checkpointing on; the rollout and ref phases stay below
    need = [s["weights"] + s["optimizer"] + s["grads"] + acts for s in (on_device, paged)]
    # a quarter of the moments' bytes above the paged need: too little to keep the reference resident as well
    budget = need[1] + (need[0] - need[1]) / 4
    rl = _step(tiny_dir, proc, MemoryConfig(device_capacity_gib=budget / MemoryConfig().memory_budget / 2**30),
               kv_cache_tokens=1024)
    taken = ("reference offloaded", "activation checkpointing", "optimizer_offload=moments")
    assert rl.memory_fit.measures == taken and rl.memory.report()["fit"]["measures"] == list(taken)
    assert rl.cfg.gradient_checkpointing and activation_checkpointing(rl.model) == (True, True)
    assert rl.memory_cfg.optimizer_offload == "moments" and rl.actor.optimizer.offload
    assert not rl.actor.optimizer._page_masters
    assert rl.memory.plan.get("update", "ref_weights") == "offloaded"
    assert rl.memory.plan.fits(rl.memory_sizes(), rl.activation_estimate(), rl.memory_fit.budget)
    assert not plain.cfg.gradient_checkpointing and not plain.actor.optimizer.offload  # no manager: all left off
    plain.step(ROWS)
    first = rl.step(ROWS)
    for (n, a), b in zip(_weights(plain).items(), _weights(rl).values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)
    # the host buffers the step made (pinned on a GPU: the first step's slow part), once: the paged moments
    # at the first page-out and the offloaded regions' copies at their first pause
    moments = 2 * 4 * sum(m.numel() for m in rl.actor.optimizer.master)
    copies = sum(b.numel() * b.element_size() for _, bufs in rl.memory._copies.values() for b in bufs)
    assert moments > 0 and copies > 0
    assert first["memory/host_alloc_gib"] * 2**30 == pytest.approx(moments + copies, rel=1e-12)
    assert first["memory/host_alloc_s"] > 0
    second = rl.step(ROWS)
    assert second["memory/host_alloc_gib"] == 0 and second["memory/host_alloc_s"] == 0


def test_a_step_that_cannot_fit_fails_when_built(tiny_dir, proc):
    with pytest.raises(ValueError, match="does not fit the device") as e:
        _step(tiny_dir, proc, MemoryConfig(device_capacity_gib=1e-3), gradient_checkpointing=False)
    msg = str(e.value)
    assert "kept as given: gradient_checkpointing=False" in msg and "optimizer_offload=moments" in msg
    assert "the resident regions alone need" in msg


def _oom_when(pred):
    real = actor_mod.token_logprobs

    def fake(model, mb, *a, **k):
        if pred(mb):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(model, mb, *a, **k)

    return fake


def test_oom_backs_off_to_smaller_micro_batches(tiny_dir, proc, monkeypatch):
    # no KL (reference scoring keeps the configured micro-batches) and a small lr: Adam's first step is
    # ~lr * sign(grad), which turns last-bit noise in near-zero gradients into lr-sized differences
    kw = dict(kl_coef=0.0, lr=1e-5)
    ref = _step(tiny_dir, proc, None, micro_batch_prompts=1, **kw)
    rl = _step(tiny_dir, proc, MemoryConfig(memory_plan="release"), micro_batch_prompts=4, **kw)
    batch = ref.rollout(ROWS)
    batch.rewards = torch.tensor([float(i % 3 == 0) for i in range(batch.num_samples)])
    ref.train(copy.deepcopy(batch))
    monkeypatch.setattr(actor_mod, "token_logprobs", _oom_when(lambda mb: mb.num_prompts > 1))
    rl.train(copy.deepcopy(batch))
    assert rl.actor._plan(rl.cfg).prompts == 1
    for (n, a), b in zip(_weights(ref).items(), _weights(rl).values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)


def test_oom_at_the_smallest_micro_batch_leaves_state_unchanged(tiny_dir, proc, monkeypatch):
    rl = _step(tiny_dir, proc, MemoryConfig(memory_plan="release"))
    rl.step(ROWS)  # the optimizer has state
    batch = rl.rollout(ROWS)
    batch.rewards = torch.ones(batch.num_samples)
    w0, s0 = _weights(rl), _opt_state(rl)
    sched0 = rl.actor.scheduler.last_epoch
    monkeypatch.setattr(actor_mod, "token_logprobs", _oom_when(lambda mb: True))
    with pytest.raises(TrainOOM) as e:
        rl.train(copy.deepcopy(batch))
    assert e.value.applied_updates == 0 and "gradient_checkpointing" in str(e.value)
    assert activation_checkpointing(rl.model) == (True, True)  # the last rung before giving up
    assert all(torch.equal(a, b) for a, b in zip(w0.values(), _weights(rl).values()))
    assert all(torch.equal(a, b) for a, b in zip(s0, _opt_state(rl)))
    assert rl.actor.scheduler.last_epoch == sched0
    monkeypatch.undo()
    rl.train(copy.deepcopy(batch))  # and the next step works
    assert not all(torch.equal(a, b) for a, b in zip(w0.values(), _weights(rl).values()))


def test_checkpoint_while_regions_are_offloaded(tiny_dir, proc, tmp_path):
    """Save and load from the rollout phase, where the reference model and AdamW state are offloaded:
    the checkpoint holds their real contents and the resumed run takes the same next step."""
    from rollplex.rl.run_state import load_checkpoint, save_checkpoint

    mem = MemoryConfig(memory_plan="release", memory_overrides=EVERYTHING_MOVES)
    a = _step(tiny_dir, proc, mem)
    a.step(ROWS)
    a.memory.enter("rollout")
    assert a.memory.state["optimizer"] == "offloaded"
    save_checkpoint(a, tmp_path / "ck")
    assert a.memory.state["optimizer"] == "offloaded" and a.memory.state["ref_weights"] == "offloaded"
    m_a = a.step(ROWS)
    b = _step(tiny_dir, proc, mem)
    b.memory.enter("rollout")
    load_checkpoint(b, tmp_path / "ck")
    m_b = b.step(ROWS)
    assert m_a["actor/grad_norm"] == pytest.approx(m_b["actor/grad_norm"], rel=1e-6)
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7, msg=n)
    assert torch.isnan(next(a.ref.parameters())).all()  # offloaded in the update phase
    with a.memory.resident(["ref_weights"]), b.memory.resident(["ref_weights"]):
        for x, y in zip(a.ref.parameters(), b.ref.parameters()):
            assert torch.equal(x, y) and not torch.isnan(x).any()
    assert a.memory.state["ref_weights"] == "offloaded"


def test_out_of_memory_back_off_recovers_after_the_failed_pass_is_freed():
    held, freed_at_recover = [], []

    def attempt(plan: MicroBatching) -> MicroBatching:
        if not held:
            activations = torch.ones(1024)  # what the failed pass's frame holds
            held.append(weakref.ref(activations))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return plan

    backoff = Backoff()
    out = retry_oom(attempt, MicroBatching(4, 8, None, True), "rollplex", backoff, SingleProcess(), None,
                    "the actor update", ("", ""), recover=lambda: freed_at_recover.append(held[0]() is None))
    # the cached blocks are returned (`recover`) once the failed pass's tensors are gone, not while its
    # exception still holds them
    assert freed_at_recover == [True]
    assert out == backoff.cap == MicroBatching(2, 8, None, True)
