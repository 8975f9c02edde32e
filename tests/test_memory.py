"""Phase plan and memory manager on the accounting backend (same semantics as torch-memory-saver)."""

from dataclasses import replace

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
    # a step without a reference or a critic: their rows and the critic's phase are left out
    held = ("weights", "kv_cache", "optimizer", "grads", "prefix_states")
    lines = plan.table({"optimizer": 30 * GiB}, {"update": 5 * GiB}, held).splitlines()
    assert [ln.split()[0] for ln in lines[2:]] == [*held, "activations", "peak"]
    assert lines[1].split() == ["tag", "GiB", "rollout", "ref", "update"]
    assert "critic_weights" in text and "update_critic" in text  # the whole plan without `held`


def _fixed(sizes, acts):
    """An estimate that no trainer setting changes: only residency moves can lower a peak."""
    return lambda checkpointing, optimizer_offload: (sizes, acts)


def test_auto_plan_offloads_cheapest_first():
    from rollplex.memory.fit import fit

    sizes = {"weights": 8 * GiB, "ref_weights": 8 * GiB, "kv_cache": 40 * GiB, "optimizer": 45 * GiB,
             "grads": 8 * GiB}
    acts = {"rollout": 2 * GiB, "ref": 4 * GiB, "update": 20 * GiB}
    roomy = fit(_fixed(sizes, acts), 140 * GiB, memory_budget=1.0).plan
    assert roomy.name == "auto" and roomy.get("update", "kv_cache") == "released"
    assert roomy.get("rollout", "ref_weights") == "resident"
    # ref weights (frozen: one copy per resume) go before the optimizer (copied out and back)
    mid = fit(_fixed(sizes, acts), 100 * GiB, memory_budget=1.0)
    assert mid.measures == ("reference offloaded",)
    assert mid.plan.get("update", "ref_weights") == "offloaded" and mid.plan.get("rollout", "optimizer") == "resident"
    tight = fit(_fixed(sizes, acts), 85 * GiB, memory_budget=1.0)
    assert tight.plan.get("rollout", "optimizer") == "offloaded" and tight.plan.fits(sizes, acts, 85 * GiB)
    # the regions fit, the activations do not: nothing left to take, so no plan (never a crash mid-step)
    with pytest.raises(ValueError, match="the activations need 20.0 GiB, 9.0 GiB is left") as e:
        fit(_fixed(sizes, acts), 70 * GiB, memory_budget=1.0)
    assert "optimizer offloaded" in str(e.value) and "micro_batch_prompts" in str(e.value)
    with pytest.raises(ValueError, match="the resident regions alone need"):
        fit(_fixed(sizes, acts), 50 * GiB, memory_budget=1.0)


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


def test_forget_drops_an_owners_callbacks_and_copy():
    mm, kv, ref, opt, grads = _setup()
    mm.enter("rollout")
    mm.enter("update")  # the optimizer's host copy exists; the gradients were zeroed on resume
    for tag in ("optimizer", "grads"):
        mm.forget(tag)
    assert "optimizer" not in mm._copies
    grads.fill_(3.0)
    copies = mm.ledger.copy_bytes
    mm.enter("rollout")
    mm.enter("update")  # nothing copied out or in for the optimizer, nothing zeroes the gradients
    assert mm.ledger.copy_bytes == copies and torch.isnan(opt).all() and torch.isnan(grads).all()


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
    resident = MemoryConfig(memory_plan="resident").fit(_fixed(sizes, acts), 160 * GiB).plan
    assert resident.get("update", "kv_cache") == "resident"
    auto = MemoryConfig().fit(_fixed(sizes, acts), 140 * GiB).plan
    assert auto.get("update", "kv_cache") == "released" and auto.name == "auto"
    custom = MemoryConfig(memory_overrides="optimizer:rollout=offloaded").fit(_fixed(sizes, acts), 140 * GiB).plan
    assert custom.get("rollout", "optimizer") == "offloaded" and custom.get("ref", "optimizer") == "resident"
    unchecked = MemoryConfig().fit(_fixed(sizes, acts), None)  # CPU: no capacity, nothing taken
    assert unchecked.budget is None and unchecked.measures == () and unchecked.optimizer_offload == "none"
    with pytest.raises(ValueError):
        MemoryConfig(memory_overrides="optimizer:rollout=gone")
    with pytest.raises(ValueError):
        MemoryConfig(memory_plan="fancy")
    with pytest.raises(ValueError, match="device_capacity_gib"):
        MemoryConfig(device_capacity_gib=0)


# ---- fitting the RL step to one H200, with the presets' real shapes (nothing allocated) ------------------------
H200 = 139 * GiB  # what torch reports of the H200's 141 GB, about


def _preset_fit(name: str, workload: dict, capacity: int = H200, memory=None, kv_capacity: int = H200):
    """fit_memory, as RLStep runs it, for `name`'s shapes with random bf16 weights, a reference, and the KV
    cache the engine sizes at gpu_memory_utilization 0.5 on a device of `kv_capacity` bytes (half of it, less
    the weights and its warm-up prefill: 53.5 GiB for 7B and 62.3 GiB for 3B on the H200 measured)."""
    from rollplex.memory import Footprint, MemoryConfig
    from rollplex.models import Qwen25VL
    from rollplex.presets import preset
    from rollplex.rl.config import RLConfig
    from rollplex.rl.step import fit_memory

    cfg = preset(name)
    with torch.device("meta"):
        n = sum(p.numel() for p in Qwen25VL(cfg).parameters())
    weights = 2 * n
    footprint = Footprint(weights, weights, kv_capacity // 2 - weights - GiB, n, 2)
    rl = workload if isinstance(workload, RLConfig) else RLConfig(kl_coef=0.001, **workload)
    return fit_memory(cfg, rl, memory or MemoryConfig(), footprint, capacity)


def _workload(label: str) -> dict:
    from rollplex.bench.memory import WORKLOADS

    _, _, n, new_tokens, micro = WORKLOADS[label]
    return {"n": n, "max_new_tokens": new_tokens, "micro_batch_prompts": micro}


def _fits(fit) -> bool:
    return all(v <= fit.budget for v in fit.peaks().values())


@pytest.mark.parametrize("capacity_gib", [139, 140.4])  # 140.4: nvidia-smi's 143,771 MiB
def test_w7b_defaults_take_checkpointing_and_paged_moments(capacity_gib):
    fit = _preset_fit("qwen2.5-vl-7b", _workload("w7b"), int(capacity_gib * GiB))
    # the reference's offload was taken first, then dropped: the moments make the step fit without it
    assert fit.measures == ("activation checkpointing", "optimizer_offload=moments")
    assert fit.gradient_checkpointing and fit.vision_gradient_checkpointing and fit.optimizer_offload == "moments"
    assert fit.plan.get("update", "ref_weights") == "resident" and fit.plan.get("update", "kv_cache") == "released"
    assert _fits(fit) and fit.plan.name == "auto (activation checkpointing, optimizer_offload=moments)"
    assert fit.sizes["optimizer"] == 2 * fit.sizes["grads"]  # fp32 masters only: 4 of the 12 bytes per parameter
    # the rungs before the moments do not fit, and a user's optimizer_offload is never changed
    with pytest.raises(ValueError, match="update .* over") as e:
        from rollplex.memory import MemoryConfig

        _preset_fit("qwen2.5-vl-7b", _workload("w7b"), int(capacity_gib * GiB), MemoryConfig(optimizer_offload="none"))
    assert "kept as given: optimizer_offload=none" in str(e.value)
    assert "measures taken: reference offloaded, activation checkpointing" in str(e.value)


def test_3b_defaults_keep_every_region_resident():
    from rollplex.server.state import server_rl_config

    for rl in (_workload("w3b"), replace(server_rl_config(), kl_coef=0.001)):
        fit = _preset_fit("qwen2.5-vl-3b", rl)
        assert fit.measures == () and fit.plan.name == "auto" and _fits(fit)
        assert not fit.gradient_checkpointing and fit.optimizer_offload == "none"
        assert fit.plan.get("update", "ref_weights") == "resident"
    # 6x the response tokens: checkpointing is enough (the reference's offload, taken first, is dropped again)
    fit = _preset_fit("qwen2.5-vl-3b", _workload("w3b-long"))
    assert fit.measures == ("activation checkpointing",) and fit.optimizer_offload == "none"
    assert fit.plan.get("update", "ref_weights") == "resident"


def test_explicit_choices_are_kept():
    from rollplex.memory import MemoryConfig

    # without checkpointing the 7B update fits only once the moments are paged too
    fit = _preset_fit("qwen2.5-vl-7b", {**_workload("w7b"), "gradient_checkpointing": False})
    assert not fit.gradient_checkpointing and fit.measures == ("optimizer_offload=moments",)
    assert _fits(fit)
    # an explicit plan gets no offloads: the 7B's paged moments and checkpointing fit it without them
    fit = _preset_fit("qwen2.5-vl-7b", _workload("w7b"), memory=MemoryConfig(memory_plan="release"))
    assert fit.plan.get("update", "ref_weights") == "resident" and "reference offloaded" not in fit.measures
    assert fit.optimizer_offload == "moments" and _fits(fit)
    fit = _preset_fit("qwen2.5-vl-7b", _workload("w7b"), memory=MemoryConfig(optimizer_offload="all"))
    assert fit.optimizer_offload == "all" and not any(m.startswith("optimizer_offload") for m in fit.measures)


def test_pinned_host_memory_is_checked():
    """The 7B's paged moments pin 61.8 GiB: within 0.6 of a 128 GiB host (the H200 machine's), not of 64."""
    from rollplex.memory import Footprint, MemoryConfig
    from rollplex.rl.step import fit_memory

    fit = _preset_fit("qwen2.5-vl-7b", _workload("w7b"))
    footprint = Footprint(fit.sizes["weights"], fit.sizes["ref_weights"], fit.sizes["kv_cache"],
                          fit.sizes["grads"] // 2, 2)
    from rollplex.presets import preset
    from rollplex.rl.config import RLConfig

    rl = RLConfig(kl_coef=0.001, **_workload("w7b"))
    ok = fit_memory(preset("qwen2.5-vl-7b"), rl, MemoryConfig(), footprint, H200, host_capacity=128 * GiB)
    assert ok.optimizer_offload == "moments"
    with pytest.raises(ValueError, match="pinned host memory"):
        fit_memory(preset("qwen2.5-vl-7b"), rl, MemoryConfig(), footprint, H200, host_capacity=64 * GiB)


def test_a_step_that_cannot_fit_names_what_was_tried():
    with pytest.raises(ValueError) as e:
        _preset_fit("qwen2.5-vl-7b", _workload("w7b"), capacity=10 * GiB)
    msg = str(e.value)
    assert "does not fit the device" in msg and "against a budget of 9.2 GiB" in msg
    assert ("measures taken: reference offloaded, activation checkpointing, optimizer_offload=moments, "
            "optimizer_offload=all") in msg
    assert "the resident regions alone need" in msg and "gpu_memory_utilization" in msg and "more GPUs" in msg
    # regions that fit but activations that do not: the tokens per micro-batch are named
    with pytest.raises(ValueError, match="micro_batch_prompts=2, micro_batch_max_tokens=None, n=64"):
        _preset_fit("qwen2.5-vl-7b", {**_workload("w7b"), "n": 64, "max_new_tokens": 4096})


def test_a_critic_trains_in_a_phase_of_its_own_and_regions_are_planned_at_their_mapped_bytes():
    """PPO-GAE on W3B shapes (frozen tower, a 20 GiB KV cache): each trainer's update holds its own gradients
    only, and the step fits the H200. A region whose pool already maps more bytes (a trainer of the whole
    model dropped before: its pool keeps them; 44.5 GiB each measured on the H200) is planned at those, and
    the plan then moves the critic out of the rollout."""
    from rollplex.memory import Footprint, MemoryConfig
    from rollplex.models import Qwen25VL
    from rollplex.presets import preset
    from rollplex.rl.config import RLConfig
    from rollplex.rl.step import fit_memory

    cfg = preset("qwen2.5-vl-3b")
    with torch.device("meta"):
        model = Qwen25VL(cfg)
    n = sum(p.numel() for p in model.parameters())
    text = n - sum(p.numel() for p in model.visual.parameters())
    footprint = Footprint(2 * n, 2 * n, 20 * GiB, text, 2, critic_weights=2 * n, critic_trainable=text)
    rl = RLConfig(adv_estimator="gae", kl_coef=0.001, freeze_vision_tower=True, **_workload("w3b"))
    fit = fit_memory(cfg, rl, MemoryConfig(), footprint, H200)
    assert _fits(fit) and "critic offloaded" not in fit.measures
    resident = {p: {t for t in fit.sizes if fit.plan.get(p, t) == "resident"} for p in ("update", "update_critic")}
    assert "grads" in resident["update"] and "critic_grads" not in resident["update"]
    assert "critic_grads" in resident["update_critic"] and "grads" not in resident["update_critic"]
    # the critic's micro-batch: the backbone's activations without the logits
    assert 0 < fit.activations["update_critic"] < fit.activations["update"]
    assert fit_memory(cfg, replace(rl, adv_estimator="grpo"), MemoryConfig(), footprint, H200
                      ).activations["update_critic"] == 0
    mapped = {"optimizer": int(44.5 * GiB), "critic_optimizer": int(44.5 * GiB)}
    big = fit_memory(cfg, rl, MemoryConfig(), footprint, H200, mapped=mapped)
    assert big.sizes["optimizer"] == mapped["optimizer"] and big.sizes["grads"] == fit.sizes["grads"]
    assert "critic offloaded" in big.measures and _fits(big)
    assert big.plan.get("rollout", "critic_optimizer") == "offloaded"


def test_ledger_counts_device_allocations_per_phase_and_step():
    """`memory/<phase>/device_mallocs`: segments the allocator requested during the phase, summed over the
    step's entries of that phase and reset with the step's metrics (a first step shows its allocator warming)."""
    from rollplex.memory.ledger import Ledger

    led = Ledger()
    led.record_phase("update", {})
    led.record_mallocs("update", 40)
    led.record_mallocs("update", 2)
    led.record_mallocs("rollout", 0)
    m = led.take_metrics()
    assert m["memory/update/device_mallocs"] == 42.0 and m["memory/rollout/device_mallocs"] == 0.0
    assert led.take_metrics()["memory/update/device_mallocs"] == 0.0


def test_ledger_counts_host_buffers_made_per_step():
    """`memory/host_alloc_s` / `_gib`: host buffers made for offloaded state since the last step's metrics (on
    a GPU page-locked: the first step's cost of paging, reported apart from the copies)."""
    from rollplex.memory.ledger import Ledger

    led = Ledger()
    led.record_host_alloc(1.5, 3 * 2**30)
    led.record_host_alloc(0.5, 2**30)
    m = led.take_metrics()
    assert m["memory/host_alloc_s"] == 2.0 and m["memory/host_alloc_gib"] == 4.0
    m = led.take_metrics()
    assert m["memory/host_alloc_s"] == 0.0 and m["memory/host_alloc_gib"] == 0.0
