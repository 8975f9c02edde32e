"""Phase plan and memory manager on the accounting backend (same semantics as torch-memory-saver)."""

import pytest
import torch

from rollplex.memory import MemoryManager, MemoryRegionError, PhasePlan

GiB = 2**30


def test_plan_validation():
    with pytest.raises(ValueError, match="resident there"):
        PhasePlan({"rollout": {"kv_cache": "released"}})
    with pytest.raises(ValueError, match="offloaded"):
        PhasePlan({"rollout": {"optimizer": "released"}})
    with pytest.raises(ValueError, match="unknown memory tag"):
        PhasePlan({"rollout": {"kv": "released"}})
    with pytest.raises(ValueError, match="unknown phase"):
        PhasePlan({"train": {}})
    with pytest.raises(ValueError, match="tag:phase=residency"):
        PhasePlan.releases_only().with_overrides("optimizer=offloaded")


def test_plan_overrides_and_table():
    plan = PhasePlan.releases_only().with_overrides("optimizer:*=offloaded, ref_weights:update=offloaded")
    assert plan.get("rollout", "optimizer") == "offloaded" and plan.get("ref", "optimizer") == "offloaded"
    assert plan.get("update", "optimizer") == "resident"
    assert plan.get("update", "ref_weights") == "offloaded" and plan.get("rollout", "ref_weights") == "resident"
    assert plan.get("ref", "kv_cache") == "released" and plan.get("rollout", "grads") == "released"
    text = plan.table({"optimizer": 30 * GiB, "kv_cache": 10 * GiB}, {"update": 5 * GiB})
    assert "optimizer" in text and "30.0" in text and "peak GiB" in text
    assert ("optimizer", "offloaded", "resident") in plan.transitions("ref", "update")


def test_auto_plan_offloads_cheapest_first():
    sizes = {"weights": 8 * GiB, "ref_weights": 8 * GiB, "kv_cache": 40 * GiB, "optimizer": 45 * GiB,
             "grads": 8 * GiB}
    acts = {"rollout": 2 * GiB, "ref": 4 * GiB, "update": 20 * GiB}
    roomy = PhasePlan.auto(sizes, acts, budget=140 * GiB)
    assert roomy.get("update", "kv_cache") == "released" and roomy.get("rollout", "ref_weights") == "resident"
    # ref weights (frozen: one copy per resume) go before the optimizer (copied out and back)
    mid = PhasePlan.auto(sizes, acts, budget=100 * GiB)
    assert mid.get("update", "ref_weights") == "offloaded" and mid.get("rollout", "optimizer") == "resident"
    tight = PhasePlan.auto(sizes, acts, budget=85 * GiB)
    assert tight.get("rollout", "optimizer") == "offloaded" and tight.fits(sizes, acts, 85 * GiB)
    over = PhasePlan.auto(sizes, acts, budget=70 * GiB)  # regions fit, activations do not: best effort
    assert over.name.startswith("auto (activations") and over.get("rollout", "optimizer") == "offloaded"
    with pytest.raises(ValueError, match="do not fit"):
        PhasePlan.auto(sizes, acts, budget=50 * GiB)


def _setup(plan=None, capacity=None):
    plan = plan or PhasePlan.releases_only().with_overrides("ref_weights:*=offloaded,optimizer:*=offloaded")
    mm = MemoryManager(plan, backend="accounting", capacity=capacity)
    with mm.region("kv_cache"):
        kv = torch.ones(1000)
    with mm.region("ref_weights"):
        ref = torch.randn(300)
    with mm.region("optimizer"):
        opt = torch.randn(200)
    with mm.region("grads"):
        grads = torch.zeros(100)
    mm.preserve("ref_weights", lambda: [ref])
    mm.preserve("optimizer", lambda: [opt])
    mm.on_resume("grads", grads.zero_)
    return mm, kv, ref, opt, grads


def test_phase_cycle_keeps_what_must_survive():
    mm, kv, ref, opt, grads = _setup()
    ref0, opt0 = ref.clone(), opt.clone()
    assert mm.region_bytes("kv_cache") == 4000
    mm.enter("rollout")
    assert mm.state["optimizer"] == "offloaded" and mm.state["ref_weights"] == "offloaded"
    assert torch.isnan(opt).all() and torch.isnan(ref).all()  # released memory reads as garbage
    assert torch.isnan(grads).all()
    mm.enter("ref")
    assert torch.equal(ref, ref0) and mm.state["kv_cache"] == "released" and torch.isnan(kv).all()
    mm.enter("update")
    assert torch.equal(opt, opt0) and torch.equal(grads, torch.zeros(100))
    opt.add_(1.0)  # the optimizer step changes the region: the next offload must copy it again
    mm.enter("rollout")
    mm.enter("update")
    assert torch.equal(opt, opt0 + 1.0)
    # the frozen reference was copied out once: later pauses cost no copy
    copies = mm.ledger.copy_bytes
    mm.enter("ref")
    mm.enter("rollout")
    assert mm.ledger.copy_bytes - copies == ref.numel() * 4 + opt.numel() * 4  # ref in, opt out
    m = mm.ledger.take_metrics()
    assert m["memory/transition_s"] >= 0 and "memory/pause_s/kv_cache" in m and "memory/ref/resident_gib" in m
    assert mm.ledger.transition_s() == 0.0


def test_errors_are_exceptions():
    mm, kv, *_ = _setup()
    mm.pause("kv_cache")
    with pytest.raises(MemoryRegionError, match="already released"):
        mm.pause("kv_cache")
    with pytest.raises(MemoryRegionError, match="cannot allocate"):
        with mm.region("kv_cache"):
            torch.empty(3)
    mm.resume("kv_cache")
    with pytest.raises(MemoryRegionError, match="already resident"):
        mm.resume("kv_cache")
    with pytest.raises(MemoryRegionError, match="unknown memory tag"):
        mm.pause("kv")


def test_resume_without_room_is_refused():
    mm, kv, *_ = _setup(capacity=4000 + 1200 + 800 + 400)
    mm.pause("kv_cache")
    with mm.region("prefix_states"):
        hog = torch.empty(600)  # someone took the room meanwhile
    with pytest.raises(MemoryRegionError, match="cannot resume the kv_cache region"):
        mm.resume("kv_cache")
    assert mm.state["kv_cache"] == "released"
    del hog
    mm.resume("kv_cache")
    assert mm.state["kv_cache"] == "resident"


def test_view_and_inplace_ops_do_not_count_as_allocations():
    mm = MemoryManager(PhasePlan.releases_only(), backend="accounting")
    base = torch.zeros(10)
    with mm.region("grads"):
        v = base.view(2, 5)
        base.add_(1)
        w = torch.zeros(4)
    assert mm.region_bytes("grads") == 16
    del w
    assert mm.region_bytes("grads") == 0 and v.shape == (2, 5)


def test_memory_config_builds_plans():
    from rollplex.memory import MemoryConfig, activation_bytes

    sizes = {"weights": 8 * GiB, "kv_cache": 60 * GiB, "optimizer": 45 * GiB, "grads": 8 * GiB}
    acts = {"update": activation_bytes(2048, 36, 8192, 2, checkpointing=False)}
    assert activation_bytes(2048, 36, 8192, 2, checkpointing=True) < acts["update"] / 10
    resident = MemoryConfig(memory_plan="resident").build_plan(sizes, acts, 140 * GiB)
    assert resident.get("update", "kv_cache") == "resident"
    auto = MemoryConfig().build_plan(sizes, acts, 140 * GiB)
    assert auto.get("update", "kv_cache") == "released" and auto.name == "auto"
    custom = MemoryConfig(memory_overrides="optimizer:rollout=offloaded").build_plan(sizes, acts, 140 * GiB)
    assert custom.get("rollout", "optimizer") == "offloaded" and custom.get("ref", "optimizer") == "resident"
    with pytest.raises(ValueError):
        MemoryConfig(memory_overrides="optimizer:rollout=gone")
    with pytest.raises(ValueError):
        MemoryConfig(memory_plan="fancy")
