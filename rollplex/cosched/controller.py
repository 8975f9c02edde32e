"""Admission control: how much prefix work to launch beside each decode step.

A decode hook calls `admit(step, batch_size, last_step_ms)` right after the engine reports a decode
step; the controller answers with the chunks to launch beside that step, and hears back through
`complete(chunk)` or `oom(chunk)`. No clocks and no device calls here: times come in as arguments.

Per batch-size bucket (the decode graphs' batch sizes, so one bucket has one no-overlap step time) it
keeps a baseline from clean steps and an AIMD budget driven by the measured slowdown against `bound`,
with a ceiling at the work that last broke the bound, a duty cycle below the smallest chunk, a serial
fallback where overlap does not pay, and a back-off after an OOM. The control law in full, and the
accounting (hidden + in flight + claimed + left = total): docs/ARCHITECTURE.md ("The co-scheduler":
admission control).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from .work import Chunk, WorkQueue


@dataclass(frozen=True)
class CoschedConfig:
    slowdown_bound: float = 0.05
    headroom: float = 0.3  # hold band: slowdown in [bound * (1 - headroom), bound]
    buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # upper edges; larger batches use the last
    measure_lag: int = 2  # a reported step time belongs to the step this many launches back
    baseline_ema: float = 0.2  # weight of a new clean sample
    baseline_samples: int = 2
    initial_budget: float = 0.02  # first budget of a bucket, as a fraction of its baseline
    increase: float = 0.005  # additive increase, as a fraction of the baseline
    decrease: float = 0.5  # multiplicative decrease
    max_chunk_ms: float = 2.0
    max_in_flight: int = 4
    serial_after: int = 3
    min_gain: float = 0.25  # a chunk must hide this share of its cost net of the decode time it adds
    oom_cooldown_steps: int = 16
    reprobe_every: int = 64  # 0: never re-measure the baseline
    job_prompts: int = 4  # prompts per prefix job (one batched forward): bigger runs faster, holds more
    # SMs the admitted work may use: 0 shares every SM with decode (a low-priority stream); N > 0 confines it
    # to a green-context partition of N SMs, so a chunk's blocks can never occupy more than that share
    side_sms: int = 0

    def __post_init__(self):
        if not 0 < self.slowdown_bound < 1:
            raise ValueError("slowdown_bound must be in (0, 1)")
        if not 0 <= self.headroom < 1:
            raise ValueError("headroom must be in [0, 1)")
        if not self.buckets or any(b <= 0 for b in self.buckets) or list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError("buckets must be positive and strictly ascending")
        if self.measure_lag < 1:
            raise ValueError("measure_lag must be >= 1")
        if not 0 < self.baseline_ema <= 1:
            raise ValueError("baseline_ema must be in (0, 1]")
        if not 0 < self.decrease < 1:
            raise ValueError("decrease must be in (0, 1)")
        if self.initial_budget < 0 or self.increase <= 0 or self.max_chunk_ms <= 0:
            raise ValueError("initial_budget must be >= 0, increase and max_chunk_ms > 0")
        if min(self.baseline_samples, self.max_in_flight, self.serial_after) < 1:
            raise ValueError("baseline_samples, max_in_flight and serial_after must be >= 1")
        if not 0 <= self.min_gain < 1:
            raise ValueError("min_gain must be in [0, 1)")
        if self.job_prompts < 1:
            raise ValueError("job_prompts must be >= 1")
        if self.side_sms < 0:
            raise ValueError("side_sms must be >= 0 (0: share every SM)")
        if self.oom_cooldown_steps < 0 or self.reprobe_every < 0:
            raise ValueError("oom_cooldown_steps and reprobe_every must be >= 0")


@dataclass
class _Bucket:
    budget_ms: float | None = None  # None until the baseline exists
    baseline_ms: float | None = None
    clean: int = 0  # clean samples seen
    since_probe: int = 0  # steps since the last forced clean one
    ceiling_ms: float = float("inf")  # admitted work that broke the bound
    epoch: int = 0  # bumps whenever the budget moves
    strikes: int = 0  # consecutive smallest-chunk tries that did not pay
    serial: bool = False
    duty: int | None = 1  # smallest-chunk tries: one step in `duty` (None: wait for the last try's measure)
    last_try: int = -(1 << 30)
    try_slowdown: float | None = None  # EMA of the slowdown of steps with a smallest-chunk try


@dataclass(frozen=True)
class _Record:
    bucket: int
    loaded: bool  # something was in flight beside the step
    epoch: int
    smallest_try: bool  # the budget was below the smallest chunk and that chunk was tried
    admitted_ms: float


@dataclass
class AdmissionController:
    config: CoschedConfig
    queue: WorkQueue
    _buckets: dict[int, _Bucket] = field(default_factory=dict)
    _records: dict[int, _Record] = field(default_factory=dict)
    _in_flight: dict[int, Chunk] = field(default_factory=dict)  # id(chunk) -> chunk
    _cooldown_until: int = -1
    _step: int = -1  # the last step admit() saw
    _stats: dict[str, float] = field(default_factory=lambda: dict(
        hidden_ms=0.0, overhead_ms=0.0, slowdown_sum=0.0, slowdown_max=0.0, loaded_measured=0, measured=0,
        admitted=0, ooms=0, claimed_ms=0.0))

    def bucket_of(self, batch_size: int) -> int:
        edges = self.config.buckets
        return edges[min(bisect.bisect_left(edges, batch_size), len(edges) - 1)]

    def _state(self, bucket: int) -> _Bucket:
        if bucket not in self._buckets:
            self._buckets[bucket] = _Bucket()
        return self._buckets[bucket]

    def admit(self, step: int, batch_size: int, last_step_ms: float | None,
              measured_step: int | None = None) -> list[Chunk]:
        """Take the step time of `measured_step` (default: `step - measure_lag`), then return the
        chunks to launch beside decode step `step`."""
        self._step = step
        if last_step_ms is not None:
            self._observe(step - self.config.measure_lag if measured_step is None else measured_step, last_step_ms)
        for old in [s for s in self._records if s <= step - 4 * self.config.measure_lag]:
            del self._records[old]  # never measured (the caller skipped them)
        bucket = self.bucket_of(batch_size)
        b = self._state(bucket)
        chunks, smallest_try = [], False
        b.since_probe += 1
        if self.config.reprobe_every and b.since_probe > self.config.reprobe_every:
            b.since_probe, b.ceiling_ms = 0, float("inf")  # this step is the probe: nothing admitted
        elif not (b.serial or step < self._cooldown_until or b.budget_ms is None):
            since = step - b.last_try
            # a try waits for its predecessor's measurement (or for that to be given up as lost)
            may_try = since >= b.duty if b.duty is not None else since > 4 * self.config.measure_lag
            chunks, smallest_try = self._cut(b.budget_ms, b.ceiling_ms, may_try)
            if smallest_try:
                b.last_try, b.duty = step, None
        for c in chunks:
            self._in_flight[id(c)] = c
        self._records[step] = _Record(bucket, bool(self._in_flight), b.epoch, smallest_try,
                                      sum(c.cost_ms for c in chunks))
        self._stats["admitted"] += len(chunks)
        return chunks

    def _cut(self, budget_ms: float, ceiling_ms: float, may_try: bool) -> tuple[list[Chunk], bool]:
        cfg, chunks, spend, total = self.config, [], budget_ms, 0.0
        smallest = self.queue.min_chunk_ms()
        smallest_try = smallest is not None and budget_ms < smallest
        if smallest_try:  # one smallest chunk on its duty step; the ceiling does not apply to it
            if not may_try or len(self._in_flight) >= cfg.max_in_flight:
                return [], False
            c = self._take_below(smallest, float("inf"))
            return ([c], True) if c is not None else ([], False)
        while len(self._in_flight) + len(chunks) < cfg.max_in_flight:
            smallest = self.queue.min_chunk_ms()
            room = ceiling_ms - total
            if smallest is None or smallest >= room or spend < smallest:
                break
            c = self._take_below(min(spend, cfg.max_chunk_ms), room)
            if c is None:
                break
            chunks.append(c)
            spend -= c.cost_ms
            total += c.cost_ms
        return chunks, False

    def _take_below(self, target_ms: float, room_ms: float) -> Chunk | None:
        """A chunk of about target_ms that costs less than room_ms (whole units make the target inexact)."""
        c = self.queue.take(min(target_ms, room_ms))
        while c.cost_ms >= room_ms:
            self.queue.put_back(c)
            smaller = self.queue.take(c.cost_ms - c.item.unit_ms * c.item.min_units)
            if smaller.cost_ms >= c.cost_ms:  # cannot shrink (a tail is never left below the smallest chunk)
                self.queue.put_back(smaller)
                return None
            c = smaller
        return c

    def _observe(self, measured_step: int, ms: float) -> None:
        rec = self._records.pop(measured_step, None)
        if rec is None:
            return
        cfg, b = self.config, self._state(rec.bucket)
        self._stats["measured"] += 1
        if not rec.loaded:
            ema = cfg.baseline_ema
            if b.baseline_ms is None or ms < b.baseline_ms:  # noise only ever makes a step slower
                b.baseline_ms = ms
            else:  # contexts grow: drift up, but one odd step (a host hiccup) by at most half of itself
                b.baseline_ms = (1 - ema) * b.baseline_ms + ema * min(ms, 1.5 * b.baseline_ms)
            b.clean += 1
            if b.budget_ms is None and b.clean >= cfg.baseline_samples:
                larger = [self._buckets[k].budget_ms for k in sorted(self._buckets) if k > rec.bucket
                          and self._buckets[k].budget_ms is not None and not self._buckets[k].serial]
                b.budget_ms = larger[0] if larger else cfg.initial_budget * b.baseline_ms
            return
        if b.baseline_ms is None:
            return  # loaded by chunks admitted in another bucket before this one had a baseline
        slowdown = ms / b.baseline_ms - 1
        s = self._stats
        s["overhead_ms"] += ms - b.baseline_ms
        s["slowdown_sum"] += slowdown
        s["slowdown_max"] = max(s["slowdown_max"], slowdown)
        s["loaded_measured"] += 1
        if b.budget_ms is None:
            return
        if rec.smallest_try:
            self._duty(b, rec, slowdown)
        if slowdown > cfg.slowdown_bound:
            if rec.admitted_ms > 0 and not rec.smallest_try:
                b.ceiling_ms = min(b.ceiling_ms, rec.admitted_ms)
            if rec.epoch == b.epoch:
                b.budget_ms *= cfg.decrease
                b.epoch += 1
            return
        if slowdown < cfg.slowdown_bound * (1 - cfg.headroom) and rec.epoch == b.epoch:
            b.budget_ms = min(b.budget_ms + cfg.increase * b.baseline_ms, cfg.max_in_flight * cfg.max_chunk_ms,
                              b.ceiling_ms)
            b.epoch += 1

    def _duty(self, b: _Bucket, rec: _Record, slowdown: float) -> None:
        """After a smallest-chunk try: does overlap pay, and on how many steps may the next one come."""
        cfg = self.config
        pays = max(0.0, slowdown) * b.baseline_ms <= (1 - cfg.min_gain) * rec.admitted_ms
        b.strikes = 0 if pays else b.strikes + 1
        b.serial = b.strikes >= cfg.serial_after
        b.try_slowdown = slowdown if b.try_slowdown is None else 0.5 * (b.try_slowdown + slowdown)
        target = cfg.slowdown_bound * (1 - cfg.headroom)
        b.duty = max(1, math.ceil(max(0.0, b.try_slowdown) / target))

    def complete(self, chunk: Chunk) -> None:
        del self._in_flight[id(chunk)]
        self._stats["hidden_ms"] += chunk.cost_ms

    def cancel(self, chunk: Chunk) -> None:
        """An admitted chunk that was not launched: back to the queue, no penalty."""
        del self._in_flight[id(chunk)]
        self.queue.put_back(chunk)

    def claimed(self, cost_ms: float, chunk: Chunk | None = None) -> None:
        """Work of `cost_ms` was taken away by its consumer (`WorkQueue.claim`), or (`chunk`) an admitted chunk
        that was not launched: it is neither hidden nor left."""
        if chunk is not None:
            del self._in_flight[id(chunk)]
        self._stats["claimed_ms"] += cost_ms

    def oom(self, chunk: Chunk) -> None:
        """The chunk failed for memory (memory is shared by all buckets, so all back off): requeue it,
        halve every budget and admit nothing for the cool-down."""
        del self._in_flight[id(chunk)]
        self.queue.put_back(chunk)
        for b in self._buckets.values():
            if b.budget_ms is not None:
                b.budget_ms *= 0.5
                b.epoch += 1
        self._cooldown_until = self._step + 1 + self.config.oom_cooldown_steps
        self._stats["ooms"] += 1

    def in_flight_ms(self) -> float:
        return sum(c.cost_ms for c in self._in_flight.values())

    def budget_ms(self, batch_size: int) -> float | None:
        b = self._buckets.get(self.bucket_of(batch_size))
        return None if b is None or b.serial else b.budget_ms

    def serial_buckets(self) -> list[int]:
        return sorted(k for k, b in self._buckets.items() if b.serial)

    def metrics(self) -> dict[str, float]:
        """Hidden = estimated standalone cost of chunks finished beside decode; left = work that runs
        in its normal phase; claimed = work its consumer took away and ran itself, not beside decode;
        overhead = decode time added over the baseline (the price of hiding)."""
        s, n = self._stats, self._stats["loaded_measured"]
        return {
            "rollplex/prefix_hidden_s": s["hidden_ms"] / 1e3,
            "rollplex/prefix_in_flight_s": self.in_flight_ms() / 1e3,
            "rollplex/prefix_left_s": self.queue.left_ms() / 1e3,
            "rollplex/prefix_claimed_s": s["claimed_ms"] / 1e3,
            "rollplex/prefix_total_s": self.queue.total_ms() / 1e3,
            "rollplex/decode_overhead_s": s["overhead_ms"] / 1e3,
            # the bounded quantity: mean over every measured decode step (a clean one adds nothing)
            "rollplex/decode_slowdown": s["slowdown_sum"] / s["measured"] if s["measured"] else 0.0,
            "rollplex/decode_slowdown_loaded": s["slowdown_sum"] / n if n else 0.0,
            "rollplex/decode_slowdown_max": s["slowdown_max"],
            "rollplex/cosched_chunks": float(s["admitted"]),
            "rollplex/cosched_ooms": float(s["ooms"]),
            "rollplex/cosched_serial_buckets": float(len(self.serial_buckets())),
        }
