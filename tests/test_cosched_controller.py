"""Admission control against a deterministic fake cost model (no device, no clocks)."""

from dataclasses import dataclass

import pytest

from rollplex.cosched import AdmissionController, CoschedConfig, WorkItem, WorkQueue


@dataclass
class FakeDecode:
    """step_ms = base(batch) * (1 + interference): work beside decode costs `weight(batch)` times its
    share of the step; a bigger batch leaves fewer SMs idle, so its weight grows with the batch."""
    per_batch: float = 1 / 128  # interference weight per running sequence
    floor: float = 0.0  # interference of any admission at all (models work that never overlaps well)

    def base(self, batch: int) -> float:
        return 10.0 + 0.02 * batch

    def step_ms(self, batch: int, admitted_ms: float) -> float:
        if admitted_ms == 0:
            return self.base(batch)
        frac = admitted_ms / self.base(batch)
        return self.base(batch) * (1 + self.floor + frac * self.per_batch * batch)


def make_queue(prompts: int = 64) -> WorkQueue:
    q = WorkQueue()
    for i in range(prompts):
        q.add(WorkItem(f"ref/{i}", "ref_prefix", 0, cost_ms=7.0, size=36))
        q.add(WorkItem(f"vit/{i}", "actor_vision", 1, cost_ms=3.0, size=32, min_units=4))
    return q


def drive(ctrl, batches, model, lag=2, oom_on=()):
    """Engine-like loop: the time of step s reaches the controller at the launch of step s + lag; the
    chunks admitted at a step finish beside it, except that the last chunk of the n-th admitting step
    (n in `oom_on`) runs out of memory. Returns (step_ms, admitted_ms) per step."""
    times, admitted, n = [], [], 0
    for s, bs in enumerate(batches):
        chunks = ctrl.admit(s, bs, times[s - lag] if s >= lag else None)
        if chunks:
            n += 1
            if n in oom_on:
                ctrl.oom(chunks.pop())
        work = sum(c.cost_ms for c in chunks)
        times.append(model.step_ms(bs, work))
        admitted.append(work)
        for c in chunks:
            ctrl.complete(c)
    return times, admitted


def slowdowns(times, batches, model):
    return [t / model.base(b) - 1 for t, b in zip(times, batches)]


def assert_accounted(ctrl):
    m = ctrl.metrics()
    total = m["rollplex/prefix_hidden_s"] + m["rollplex/prefix_in_flight_s"] + m["rollplex/prefix_left_s"]
    assert total == pytest.approx(m["rollplex/prefix_total_s"], rel=1e-12)


def test_converges_under_the_bound():
    cfg, model = CoschedConfig(), FakeDecode()
    ctrl = AdmissionController(cfg, make_queue())
    batches = [64] * 600
    times, admitted = drive(ctrl, batches, model)
    tail = slowdowns(times, batches, model)[300:]
    assert max(tail) <= cfg.slowdown_bound
    # converged into the hold band, not parked at zero, apart from the forced clean steps
    loaded = [x for x, a in zip(tail, admitted[300:]) if a > 0]
    assert len(loaded) >= 295 and min(loaded) >= cfg.slowdown_bound * (1 - cfg.headroom) - 0.005
    assert sum(admitted[300:]) / 300 > 0.5 * cfg.slowdown_bound * model.base(64) / (64 * model.per_batch)
    assert ctrl.serial_buckets() == []
    assert_accounted(ctrl)


def test_admits_more_as_the_batch_shrinks():
    cfg, model = CoschedConfig(), FakeDecode()
    ctrl = AdmissionController(cfg, make_queue(prompts=256))
    batches = [256] * 400 + [16] * 400
    times, admitted = drive(ctrl, batches, model)
    sd = slowdowns(times, batches, model)
    # at 256 the bound lies between one and two of the smallest chunks: the two-chunk step is retried
    # once per probe period (two steps, as measurements arrive two steps late), the mean stays under
    assert sum(sd[250:400]) / 150 <= cfg.slowdown_bound and sum(x > cfg.slowdown_bound for x in sd[250:400]) <= 6
    assert max(sd[650:]) <= cfg.slowdown_bound
    big, small = sum(admitted[250:400]) / 150, sum(admitted[650:]) / 150
    assert small > 4 * big > 0
    # the small bucket starts from the large bucket's budget instead of from scratch
    assert ctrl.budget_ms(16) > ctrl.budget_ms(256)
    assert_accounted(ctrl)


def test_a_new_bucket_starts_from_the_larger_buckets_budget():
    cfg, model = CoschedConfig(), FakeDecode(per_batch=1 / 4096)
    ctrl = AdmissionController(cfg, make_queue(prompts=256))
    drive(ctrl, [256] * 300 + [16] * 6, model)
    large, small = ctrl.budget_ms(256), ctrl.budget_ms(16)
    assert large > 10 * cfg.initial_budget * model.base(16)
    assert large <= small <= large + cfg.increase * model.base(16)


def test_serial_where_any_admission_breaks_the_bound():
    cfg, model = CoschedConfig(), FakeDecode(floor=0.2)
    ctrl = AdmissionController(cfg, make_queue())
    batches = [64] * 300
    times, admitted = drive(ctrl, batches, model)
    assert ctrl.serial_buckets() == [64]
    tries = [i for i, a in enumerate(admitted) if a > 0]
    # a few tries, then the smallest chunk once per probe period until serial_after of them failed
    assert len(tries) <= 10 and tries[-1] < (cfg.serial_after + 1) * (cfg.reprobe_every + 1)
    assert ctrl.budget_ms(64) is None
    m = ctrl.metrics()
    assert m["rollplex/cosched_serial_buckets"] == 1
    assert m["rollplex/prefix_left_s"] > 0.99 * m["rollplex/prefix_total_s"]
    assert m["rollplex/decode_slowdown_max"] >= 0.2
    assert_accounted(ctrl)


def test_oom_backs_off_and_requeues():
    cfg, model = CoschedConfig(oom_cooldown_steps=10), FakeDecode()
    q = make_queue(prompts=4)
    ctrl = AdmissionController(cfg, q)
    batches = [64] * 80
    drive(ctrl, batches[:40], model)
    before = ctrl.budget_ms(64)
    chunks = ctrl.admit(40, 64, None)
    assert chunks
    failed = chunks[-1]
    for c in chunks[:-1]:
        ctrl.complete(c)
    ctrl.oom(failed)
    assert ctrl.budget_ms(64) == pytest.approx(before / 2)
    assert (failed.start, failed.stop) in q.remaining(failed.item.key) or any(
        a <= failed.start and failed.stop <= b for a, b in q.remaining(failed.item.key))
    assert all(ctrl.admit(s, 64, None) == [] for s in range(41, 51))  # cool-down
    assert ctrl.admit(51, 64, None)
    assert ctrl.metrics()["rollplex/cosched_ooms"] == 1


def test_all_work_is_accounted_and_can_drain():
    cfg, model = CoschedConfig(), FakeDecode(per_batch=1 / 512)
    q = make_queue(prompts=2)
    ctrl = AdmissionController(cfg, q)
    drive(ctrl, [8] * 2000, model, oom_on={3, 4})
    m = ctrl.metrics()
    assert m["rollplex/prefix_left_s"] == 0 and m["rollplex/prefix_in_flight_s"] == 0
    assert m["rollplex/prefix_hidden_s"] == pytest.approx(m["rollplex/prefix_total_s"])
    assert m["rollplex/cosched_ooms"] == 2


def test_partial_work_falls_back_to_the_normal_phase():
    ctrl = AdmissionController(CoschedConfig(), make_queue())
    batches = [128] * 100
    drive(ctrl, batches, FakeDecode())
    m = ctrl.metrics()
    assert 0 < m["rollplex/prefix_hidden_s"] < m["rollplex/prefix_total_s"]
    assert m["rollplex/cosched_chunks"] > 0 and m["rollplex/decode_slowdown"] <= 0.05
    assert_accounted(ctrl)
    # the reference prefixes go first: some actor encoding may be untouched, no reference work is
    # left while any actor encoding has started
    started_vit = any(ctrl.queue.remaining(k) != [(0, 32)] for k in ctrl.queue.items if k.startswith("vit/"))
    ref_left = any(ctrl.queue.remaining(k) for k in ctrl.queue.items if k.startswith("ref/"))
    assert not (started_vit and ref_left)


def test_measurement_is_attributed_to_the_step_it_belongs_to():
    # baselines come only from clean steps: with the time of step s reported at s + lag, the bucket's
    # baseline is the fake's base time exactly, however the batch changes in between
    cfg, model = CoschedConfig(measure_lag=1), FakeDecode()
    ctrl = AdmissionController(cfg, make_queue())
    batches = [32, 32, 32, 4, 4, 4, 32, 4] * 20
    drive(ctrl, batches, model, lag=1)
    for bs in (32, 4):
        assert ctrl._buckets[ctrl.bucket_of(bs)].baseline_ms == pytest.approx(model.base(bs))


def test_bucket_of():
    ctrl = AdmissionController(CoschedConfig(buckets=(1, 8, 64)), WorkQueue())
    assert [ctrl.bucket_of(b) for b in (1, 2, 8, 9, 64, 500)] == [1, 8, 8, 64, 64, 64]


def test_chunks_cover_the_item_once():
    q = WorkQueue()
    q.add(WorkItem("ref/0", "ref_prefix", 0, cost_ms=10.0, size=10, min_units=3))
    got = []
    while (c := q.take(3.5)) is not None:
        got.append((c.start, c.stop))
    assert got == [(0, 3), (3, 6), (6, 10)]  # no tail smaller than a chunk
    with pytest.raises(ValueError):
        q.add(WorkItem("ref/0", "ref_prefix", 0, cost_ms=1.0, size=1))


@pytest.mark.parametrize("kw", [
    dict(slowdown_bound=0), dict(slowdown_bound=1.5), dict(headroom=1), dict(buckets=()),
    dict(buckets=(8, 4)), dict(buckets=(0, 4)), dict(measure_lag=0), dict(baseline_ema=0),
    dict(decrease=1), dict(increase=0), dict(max_chunk_ms=0), dict(max_in_flight=0),
    dict(serial_after=0), dict(baseline_samples=0), dict(oom_cooldown_steps=-1), dict(reprobe_every=-1),
    dict(side_sms=-1),
])
def test_config_validation(kw):
    with pytest.raises(ValueError):
        CoschedConfig(**kw)


@pytest.mark.parametrize("kw", [dict(cost_ms=0), dict(size=0), dict(min_units=0), dict(min_units=99)])
def test_work_item_validation(kw):
    args = dict(key="k", kind="ref_prefix", priority=0, cost_ms=1.0, size=8) | kw
    with pytest.raises(ValueError):
        WorkItem(**args)


def test_one_slow_clean_step_does_not_make_loaded_steps_look_fast():
    """A first decode step twice as slow as the rest (start-up) must not let the bound be broken: the
    baseline moves by at most half per clean sample, so loaded steps are judged against ~the true time."""
    model = FakeDecode()
    cfg = CoschedConfig(reprobe_every=0)
    ctrl = AdmissionController(cfg, make_queue())
    batches = [256] * 400
    times, admitted = [], []
    for s, bs in enumerate(batches):
        measured = None
        if s >= 2:
            measured = 2 * model.base(bs) if s == 2 else times[s - 2]  # step 0 reported at twice its time
        chunks = ctrl.admit(s, bs, measured)
        work = sum(c.cost_ms for c in chunks)
        times.append(model.step_ms(bs, work))
        admitted.append(work)
        for c in chunks:
            ctrl.complete(c)
    late = [t / model.base(256) - 1 for t in times[100:]]
    assert sum(admitted) > 0
    assert sum(late) / len(late) <= cfg.slowdown_bound


@dataclass
class LinearDecode:
    """Work beside decode adds `cost` of its own time to the step, whatever the chunk size (a decode
    step that already uses every SM): a single unit breaks a small bound on its own step."""
    cost: float
    base_ms: float = 5.0

    def base(self, batch: int) -> float:
        return self.base_ms

    def step_ms(self, batch: int, admitted_ms: float) -> float:
        return self.base_ms + self.cost * admitted_ms


def unit_queue(items: int = 64, unit_ms: float = 1.2) -> WorkQueue:
    q = WorkQueue()
    for i in range(items):
        q.add(WorkItem(f"ref/{i}", "ref_prefix", 0, cost_ms=36 * unit_ms, size=36))
    return q


def test_duty_cycle_keeps_the_mean_under_the_bound_when_one_unit_breaks_it():
    # one 1.2 ms unit slows its 5 ms step by 0.4 * 1.2 / 5 = 9.6%, twice the 5% bound, but hides more
    # than it costs: admitted on every third step or so, the mean slowdown stays inside the bound
    cfg, model = CoschedConfig(), LinearDecode(cost=0.4)
    ctrl = AdmissionController(cfg, unit_queue())
    batches = [256] * 900
    times, admitted = drive(ctrl, batches, model)
    tail = slowdowns(times, batches, model)[100:]
    assert max(tail) > cfg.slowdown_bound  # single steps do break it
    assert sum(tail) / len(tail) <= cfg.slowdown_bound
    assert ctrl.serial_buckets() == []
    hidden = sum(admitted[100:])
    assert hidden >= 0.25 * len(tail) * 1.2  # at least one unit in four steps
    assert hidden - sum(t - model.base_ms for t in times[100:]) > 0.5 * hidden  # it pays
    m = ctrl.metrics()
    assert m["rollplex/decode_slowdown"] <= cfg.slowdown_bound < m["rollplex/decode_slowdown_loaded"]
    assert_accounted(ctrl)


def test_serial_where_a_unit_costs_decode_more_than_it_hides():
    cfg, model = CoschedConfig(), LinearDecode(cost=0.9)
    ctrl = AdmissionController(cfg, unit_queue())
    batches = [256] * 300
    times, admitted = drive(ctrl, batches, model)
    assert ctrl.serial_buckets() == [256]
    assert sum(a > 0 for a in admitted) <= cfg.serial_after + 2
