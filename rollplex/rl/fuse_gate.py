"""When the fused schedule's chunks run beside decode: admitted where fusing pays, by measurement.

A chunk of finished groups trained beside the rollout costs the decode time it adds (decode steps slow
down while the chunk shares the device) and saves its own time (otherwise it runs after the rollout,
alone). Fusing pays where the first is smaller. Both depend on the decode batch: a full batch keeps
the SMs busy and slows most; the tail's handful of sequences is bound by reading the weights and
leaves most of the device idle. `FuseGate` measures both per decode-batch bucket, across steps, and
holds chunks in buckets where fusing did not pay: they wait for the batch to shrink into a bucket that
pays, or for the rollout's end. Torch-free: times come in as arguments. Its calls, in a step's order:
`on_decode_step` at each launch, `admit` / `start` / `end` around a chunk beside decode, `alone` for
one after the rollout, `finish` at the rollout's end, `settle` once the step is over.

Baselines are per step (contexts restart with each rollout) and per bucket; a bucket with no clean
step yet borrows the nearest measured one (decode time rises with the batch, so a larger bucket's
baseline makes the added time an underestimate: the gate errs toward fusing, as before it existed).
The same accounting runs on two parts of a period where the engine reports them: the decode forward's
own GPU time (`DecodeStepInfo.last_forward`), which grows when kernels share the
device, and the host's time launching the step (`last_launch_ms`), which grows when the decode loop's
host work waits (e.g. for the GIL while the worker thread launches kernels).
More in docs/ARCHITECTURE.md ("The step as a pipeline of groups": admission).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

POLICIES = ("always", "pays")
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # upper edges of decode-batch buckets; larger: the last
FORWARD_LAG = 8  # steps a forward's time may arrive after its step closed (overlap scheduling: two)


@dataclass
class _Chunk:
    bucket: int
    tokens: int
    added_ms: float = 0.0


@dataclass
class _Bucket:
    added: float | None = None  # EMA over steps of the decode ms chunks started here added
    saved: float | None = None  # ... and of the ms they would have taken alone
    held_steps: int = 0  # steps since the bucket last admitted a chunk while held


@dataclass
class FuseGate:
    policy: str = "always"
    sms_by_batch: tuple[tuple[int, int], ...] = ()
    default_sms: int = 0
    baseline_ema: float = 0.2
    stats_ema: float = 0.5
    reprobe_steps: int = 8
    buckets: dict[int, _Bucket] = field(default_factory=dict)
    ms_per_token: float | None = None  # a chunk's standalone cost per token (EMA over after-rollout chunks)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"fuse admission {self.policy!r}: one of {POLICIES}")
        self.sms_by_batch = tuple(sorted(self.sms_by_batch, reverse=True))
        self.begin()

    # ---- one step ---------------------------------------------------------------------------------
    def begin(self) -> None:
        self._baseline: dict[int, float] = {}
        self._open: tuple[float, _Chunk | None, int, int] | None = None  # (launch time, chunk, batch, step)
        self._forward_base: dict[int, float] = {}  # the forward's device ms, per bucket, in clean steps
        self._closed: dict[int, tuple[int, bool]] = {}  # step -> (bucket, beside a chunk) until its forward is in
        self._launch_base: dict[int, float] = {}  # the host's launch ms, per bucket, in clean periods
        self.forward_added_ms = self.launch_added_ms = 0.0
        self._chunks: list[_Chunk] = []
        self._current: _Chunk | None = None
        self._admitted_held: set[int] = set()
        self.batch = 0
        self.clean_ms = self.added_ms = 0.0

    def on_decode_step(self, info, now: float) -> None:
        """The decode loop's hook, at each launch (`now`: host seconds). The loop's period from one launch
        to the next (what the rollout's wall time is made of, host gaps included) belongs to the step
        launched first: with no chunk in flight during it, it is clean and moves its batch bucket's
        baseline; beside a chunk (in flight at its launch, or started during it: a chunk started after
        the last launch delays the rollout's end), `period - baseline` is decode time the chunk added."""
        self._close(now, getattr(info, "last_launch_ms", None))
        self._open = (now, self._current, info.batch_size, info.step)
        self.batch = info.batch_size
        forward = getattr(info, "last_forward", None)
        if forward is not None and forward[0] in self._closed:
            self._forward(*self._closed.pop(forward[0]), forward[1])

    def finish(self, now: float) -> None:
        """The rollout ended: the last period closes."""
        self._close(now)
        self._open = None

    def _close(self, now: float, launch_ms: float | None = None) -> None:
        """The open period ends at `now`; launch_ms: the host's time launching its step (None: unknown)."""
        if self._open is None:
            return
        t0, chunk, batch, step = self._open
        ms, b = (now - t0) * 1e3, bucket_of(batch)
        self._closed[step] = (b, chunk is not None)
        self._closed.pop(step - FORWARD_LAG, None)  # its forward time never came (none on CPU): bounded
        if chunk is None:
            self._clean(self._baseline, b, ms)
            self.clean_ms += ms
            if launch_ms is not None:
                self._clean(self._launch_base, b, launch_ms)
            return
        base = _nearest(self._baseline, b)
        if base is not None:
            extra = max(ms - base, 0.0)
            chunk.added_ms += extra
            self.added_ms += extra
        base = _nearest(self._launch_base, b)
        if launch_ms is not None and base is not None:
            self.launch_added_ms += max(launch_ms - base, 0.0)

    def _forward(self, b: int, beside: bool, ms: float) -> None:
        """A closed step's forward GPU time: a clean one moves the bucket's baseline, one beside a chunk
        adds what it exceeds it by."""
        if not beside:
            self._clean(self._forward_base, b, ms)
            return
        base = _nearest(self._forward_base, b)
        if base is not None:
            self.forward_added_ms += max(ms - base, 0.0)

    def _clean(self, baselines: dict[int, float], b: int, ms: float) -> None:
        old = baselines.get(b)
        # a faster clean time replaces the baseline at once (hiccups only slow steps); slower ones drift it up
        baselines[b] = ms if old is None or ms < old else old + self.baseline_ema * (ms - old)

    def admit(self) -> bool:
        """Whether a chunk may start now: `policy="always"`, or `"pays"` where the current bucket's measured
        (added decode time) < (chunk time saved), where nothing is measured yet, and once every
        `reprobe_steps` steps in a held bucket (so a bucket that stopped paying can be seen to pay again)."""
        if self.policy == "always":
            return True
        b = bucket_of(self.batch)
        st = self.buckets.get(b)
        if st is None or st.added is None or st.saved is None or st.added < st.saved:
            return True
        # held long enough: one chunk this step measures the bucket again
        return st.held_steps >= self.reprobe_steps and b not in self._admitted_held

    def start(self, tokens: int) -> None:
        """A chunk starts beside decode; its tokens (the saving's estimate: tokens x the standalone seconds
        per token)."""
        b = bucket_of(self.batch)
        if b in self.held():
            self._admitted_held.add(b)
        self._current = _Chunk(b, tokens)
        self._chunks.append(self._current)
        if self._open is not None and self._open[1] is None:  # the open period runs beside it from here on
            self._open = (self._open[0], self._current, *self._open[2:])

    def end(self) -> None:
        """The chunk beside decode ended."""
        self._current = None

    def alone(self, tokens: int, seconds: float) -> None:
        """A chunk that ran after the rollout, alone: the standalone rate (EMA)."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = seconds * 1e3 / tokens
        old = self.ms_per_token
        self.ms_per_token = rate if old is None else old + self.stats_ema * (rate - old)

    def settle(self) -> None:
        """Fold this step's chunks into their buckets (needs a standalone rate: until one is measured,
        nothing is judged and every bucket admits)."""
        per: dict[int, list[float]] = {}
        if self.ms_per_token is not None:
            for c in self._chunks:
                added, saved = per.setdefault(c.bucket, [0.0, 0.0])
                per[c.bucket] = [added + c.added_ms, saved + c.tokens * self.ms_per_token]
        for b, st in self.buckets.items():
            if b not in per and st.added is not None and st.added >= (st.saved or 0.0):
                st.held_steps += 1
        for b, (added, saved) in per.items():
            st = self.buckets.setdefault(b, _Bucket())
            w = self.stats_ema
            st.added = added if st.added is None else st.added + w * (added - st.added)
            st.saved = saved if st.saved is None else st.saved + w * (saved - st.saved)
            st.held_steps = 0
        self._open = self._current = None

    def sms(self, batch: int) -> int:
        """The partition for a chunk starting beside `batch` decoding sequences: `sms_by_batch` ((min batch,
        SMs) pairs, largest first), else `default_sms`."""
        for min_batch, n in self.sms_by_batch:
            if batch >= min_batch:
                return n
        return self.default_sms

    def held(self) -> list[int]:
        """Buckets (upper edges) where fusing did not pay when last measured."""
        return sorted(b for b, st in self.buckets.items()
                      if st.added is not None and st.saved is not None and st.added >= st.saved)

    def metrics(self) -> dict:
        m = {"rollplex/fused_decode_added_s": self.added_ms / 1e3,
             "rollplex/fused_decode_forward_added_s": self.forward_added_ms / 1e3,
             "rollplex/fused_decode_launch_added_s": self.launch_added_ms / 1e3,
             "rollplex/fused_decode_slowdown": self.added_ms / self.clean_ms if self.clean_ms > 0 else 0.0,
             "rollplex/fused_held_buckets": float(len(self.held()))}
        if self.ms_per_token is not None:
            m["rollplex/fused_saved_s"] = sum(c.tokens for c in self._chunks) * self.ms_per_token / 1e3
        return m


def gate_settings(cfg) -> tuple[str, tuple[tuple[int, int], ...], int]:
    """A config's (policy, sms_by_batch largest first, default_sms): FuseGate's settings, as it holds them."""
    return (cfg.fuse_admission, tuple(sorted(parse_sms_by_batch(cfg.fuse_sms_by_batch), reverse=True)),
            cfg.fuse_sms)


def _nearest(baselines: dict[int, float], b: int) -> float | None:
    """Bucket b's baseline, else the nearest measured bucket's (the larger on a tie), None if none is."""
    if b in baselines:
        return baselines[b]
    if not baselines:
        return None
    return baselines[min(baselines, key=lambda k: (abs(BUCKETS.index(k) - BUCKETS.index(b)), -k))]


def bucket_of(batch: int) -> int:
    i = bisect.bisect_left(BUCKETS, batch)
    return BUCKETS[min(i, len(BUCKETS) - 1)]


def parse_sms_by_batch(entries) -> tuple[tuple[int, int], ...]:
    """("64:66", "16:100") -> ((64, 66), (16, 100)): while at least 64 sequences decode, chunks run in a
    green context of 66 SMs; at 16..63, 100; below, `fuse_sms`. ValueError on a malformed entry."""
    out = []
    for e in entries:
        try:
            b, n = (int(x) for x in str(e).split(":"))
        except ValueError:
            raise ValueError(f"fuse_sms_by_batch entry {e!r}: expected 'MIN_BATCH:SMS', e.g. '64:66'") from None
        if b < 1 or n < 0:
            raise ValueError(f"fuse_sms_by_batch entry {e!r}: the batch must be >= 1 and the SMs >= 0 (0: all)")
        out.append((b, n))
    if len({b for b, _ in out}) != len(out):
        raise ValueError(f"fuse_sms_by_batch {tuple(entries)}: one entry per batch size")
    return tuple(out)
