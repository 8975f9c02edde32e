"""The co-scheduler: the engine's decode hook that runs prefix work beside decode steps.

During a rollout the RL step hands it `PrefixJob`s (the reference model's prefix of each prompt
group, ...). It is registered as an engine hook and, per decode step:

    on_decode_step(info)       takes the measured period of a finished step (end to end from the
                               step before, which also catches a host that launched late), asks the
                               AdmissionController how much work to admit beside this step
    after_decode_launch(info)  launches those chunks on its own stream once the step is queued, so
                               the device runs both and the host's launch cost overlaps the decode
    on_prefill(requests)       a job that reuses the engine's vision encodings becomes ready once
                               its prompts were prefilled; its stream then waits for that prefill

Exactness: a job runs the same ops as its normal-phase counterpart, unit by unit, so where it runs
never changes what it computes. OOM while launching a chunk hands the unfinished units back to the
queue and the controller backs off; `finish()` leaves whatever was never admitted to the phase that
normally runs it (`PrefixRows.gather` completes it there) — except a sharded model's sweep, whose rest
runs at once on every rank (sharded.py) — joins the streams, and returns metrics.

Under the fused schedule the co-scheduler is one producer of the step's pipeline of groups (rl/pipeline.py):
a chunk of finished groups scored on the pipeline's worker thread may need a job before it is done. The
worker then `claim`s it: under the lock the hook holds while it admits, launches and polls, the job's
pending units leave the queue and its admitted chunks not yet launched are dropped, so the hook never
runs a unit of it again; the worker's stream waits for the job's chunks in flight (their CUDA events)
and the worker runs the rest (cosched/handover.py `claim`). Claimed work is counted apart from the
hidden and the left (`rollplex/prefix_claimed_s`, `rollplex/cosched_jobs_claimed`).

Costs are FLOP estimates over a throughput (TFLOP/s) calibrated from standalone runs of the same
work (`calibrate`), so the controller's budgets are in standalone milliseconds. On CPU there is no
second stream: chunks run inline, which keeps the logic (and its exactness) testable.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from .controller import AdmissionController, CoschedConfig
from .prefix import PrefixJob
from .timeline import Timeline
from .work import Chunk, WorkItem, WorkQueue


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def decode_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A high-priority stream for decode, so the block scheduler hands free SMs to it before work on a
    side stream; None off CUDA."""
    return torch.cuda.Stream(device, priority=-100) if torch.device(device).type == "cuda" else None


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream | None, device: torch.device):
    """Run the body's work on `stream` (ordered after what came before, and before what follows); as it
    is with None."""
    if stream is None:
        yield
        return
    cur = torch.cuda.current_stream(device)
    stream.wait_stream(cur)
    with torch.cuda.stream(stream):
        yield
    cur.wait_stream(stream)


def side_stream(device: torch.device, sms: int) -> tuple[torch.cuda.Stream, object]:
    """The stream admitted work runs on, and what must outlive it: a low-priority stream over every SM, or
    (sms > 0) the stream of a green context holding `sms` SMs (the driver rounds the count up to its
    partition granularity) and that context."""
    if sms == 0:
        return torch.cuda.Stream(device, priority=0), None
    from torch.cuda import green_contexts

    total = torch.cuda.get_device_properties(device).multi_processor_count
    if not 0 < sms < total:
        raise ValueError(f"side_sms={sms}: the device has {total} SMs; give 0 (share all) or fewer than {total}")
    if not green_contexts.SUPPORTED or not hasattr(green_contexts.GreenContext, "Stream"):
        raise ValueError(f"side_sms={sms} needs CUDA green contexts with streams (torch {torch.__version__} "
                         "lacks them); use side_sms=0")
    ctx = green_contexts.GreenContext.create(num_sms=sms, device_id=device.index or torch.cuda.current_device())
    return ctx.Stream(), ctx


class CoScheduler:
    def __init__(self, config: CoschedConfig, device: torch.device, tflops: float | None = None,
                 memory=None):
        self.config, self.device, self.memory = config, torch.device(device), memory
        self.cuda = self.device.type == "cuda"
        # standalone throughput of prefix work; refined by `calibrate`
        self.tflops = tflops or (200.0 if self.cuda else 0.02)
        # decode runs on a high-priority stream while work is co-scheduled and the work on a low-priority
        # one, so the block scheduler hands free SMs to decode first and the work fills what is left
        self.stream, self._green_context = side_stream(self.device, config.side_sms) if self.cuda else (None, None)
        self.decode_stream = decode_stream(self.device)
        self.timeline: Timeline | None = None
        self._active = False
        # the hook (the decode loop's thread) and `claim` (the fused pipeline's worker) share the queue and
        # the jobs: whatever one of them reads or changes of either, it does holding this
        self._lock = threading.RLock()

    # ---- a rollout --------------------------------------------------------------------------
    def begin(self, jobs: list[tuple[PrefixJob, int]], timeline: Timeline | None = None,
              prefilled: Sequence = ()) -> None:
        """Start a rollout's work: (job, priority) pairs. A job with prompts among `prefilled` (the
        engine's, asked to keep their vision encodings) is admitted once the engine has prefilled them,
        and takes their encodings instead of running a vision tower."""
        with self._lock:
            self._begin(jobs, timeline, prefilled)

    def _begin(self, jobs: list[tuple[PrefixJob, int]], timeline: Timeline | None, prefilled: Sequence) -> None:
        self.queue = WorkQueue()
        self.ctrl = AdmissionController(self.config, self.queue)
        self._claimed_jobs = 0
        self.timeline = timeline
        self.jobs: dict[str, PrefixJob] = {}
        self._waiting: dict[int, list[tuple[PrefixJob, int, object]]] = {}  # id(prompt) -> (job, row, what runs it)
        self._pending_jobs: dict[str, tuple[PrefixJob, int, int]] = {}  # key -> (job, priority, rows left)
        self._ready_event: dict[str, object] = {}
        self._inflight: list[tuple[Chunk, PrefixJob, object, object]] = []  # chunk, job, start mark, end mark
        self._to_launch: list[Chunk] = []
        self._step_marks: list[tuple[int, int, object, float]] = []  # step, batch size, mark, admitted ms
        self._launch_s = 0.0
        engine_prompts = {id(p) for p in prefilled}
        for job, prio in jobs:
            self.jobs[job.key] = job
            waits = 0
            for member in getattr(job, "members", [job]):  # a sweep's prompts are its jobs'
                for r, p in enumerate(member.prompts):
                    if id(p) in engine_prompts and p.has_vision and p.vision_embeds is None:
                        self._waiting.setdefault(id(p), []).append((member, r, job))
                        waits += 1
            if waits:
                self._pending_jobs[job.key] = (job, prio, waits)
            else:
                self._enqueue(job, prio)
        self._active = True

    def _enqueue(self, job: PrefixJob, prio: int) -> None:
        kind = job.key.split("/")[0]
        for k, (part, units, per_unit) in enumerate(job.parts()):  # in order: a part's units follow the last's
            self.queue.add(WorkItem(f"{job.key}/{part}", kind, 3 * prio + k, self._ms(per_unit * units), units))

    def _ms(self, flops: float) -> float:
        return flops / (self.tflops * 1e9)

    def decode_priority(self):
        """Run the engine's work inside on the high-priority stream (ordered after what came before)."""
        return on_stream(self.decode_stream, self.device)

    # ---- engine hook ------------------------------------------------------------------------
    def on_prefill(self, requests) -> None:
        if not self._active or not self._waiting:
            return
        with self._lock:
            self._prefilled(requests)

    def _prefilled(self, requests) -> None:
        for req in requests:
            for member, r, job in self._waiting.pop(id(req.inputs), []):
                if req.vision_embeds is None:
                    raise RuntimeError("the engine kept no vision encodings (add_request(keep_vision=True))")
                member.prompts[r] = replace(member.prompts[r], vision_embeds=req.vision_embeds)
                j, prio, left = self._pending_jobs[job.key]
                if left == 1:
                    del self._pending_jobs[job.key]
                    if self.cuda:  # the job's first unit must see this prefill's output
                        ev = torch.cuda.Event()
                        ev.record()
                        self._ready_event[job.key] = ev
                    self._enqueue(job, prio)
                else:
                    self._pending_jobs[job.key] = (j, prio, left - 1)

    def on_decode_step(self, info) -> None:
        if not self._active:
            return
        with self._lock:
            self._admit(info)

    def _admit(self, info) -> None:
        self._poll()
        # only end-to-end periods between consecutive decode steps: the first step after a prefill or an
        # idle gap has none (its own duration includes start-up effects and would inflate the baseline)
        self._to_launch = self.ctrl.admit(info.step, info.batch_size, info.last_period_ms)
        if self.timeline is not None:
            self._step_marks.append((info.step, info.batch_size, self.timeline.now(),
                                     sum(c.cost_ms for c in self._to_launch)))

    def after_decode_launch(self, info) -> None:
        if not self._active or not self._to_launch:
            return
        with self._lock:  # a claim waits until the chunks are launched (on CPU: run)
            self._launch_all()

    def _launch_all(self) -> None:
        chunks, self._to_launch = self._to_launch, []
        t0 = time.perf_counter()
        for i, c in enumerate(chunks):
            if not self._launch(c):
                for rest in chunks[i + 1 :]:  # keep units in order: what follows a failed chunk waits
                    self.ctrl.cancel(rest)
                break
        self._launch_s += time.perf_counter() - t0
        if not self.cuda:
            self._poll()

    def _launch(self, chunk: Chunk) -> bool:
        key, part = chunk.item.key.rsplit("/", 1)
        job = self.jobs[key]
        start, stop = job.part_units(part, chunk.start, chunk.stop)
        ctx = torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()
        region = self.memory.region("prefix_states") if self.memory is not None else contextlib.nullcontext()
        tl = self.timeline
        with ctx, region:
            if self.cuda and key in self._ready_event:
                self.stream.wait_event(self._ready_event.pop(key))
            mark0 = tl.now() if tl is not None else None
            done0 = job.next_unit
            try:
                job.run(start, stop)
            except Exception as e:  # noqa: BLE001 - only OOM is handled
                if not _is_oom(e):
                    raise
                done = job.next_unit - done0  # units that finished before the failure stay done
                self.ctrl.oom(chunk)
                if done:
                    self.queue.mark_done(chunk.item.key, chunk.start, chunk.start + done)
                if self.cuda:
                    torch.cuda.empty_cache()
                return False
            mark1 = tl.now() if tl is not None else None
            end = None
            if self.cuda:
                end = torch.cuda.Event()
                end.record()
        self._inflight.append((chunk, job, (mark0, mark1), end))
        return True

    def _poll(self) -> None:
        """Chunks whose work finished on the device count as hidden."""
        still = []
        for rec in self._inflight:
            chunk, _, _, end = rec
            if end is None or end.query():
                self.ctrl.complete(chunk)
                self._record_chunk(rec)
            else:
                still.append(rec)
        self._inflight = still

    def _record_chunk(self, rec) -> None:
        chunk, _, (m0, m1), _ = rec
        if self.timeline is not None and m0 is not None:
            self.timeline.device_span("cosched", f"{chunk.item.key}[{chunk.start}:{chunk.stop}]", m0, m1,
                                      est_ms=round(chunk.cost_ms, 3))

    # ---- a consumer that cannot wait ----------------------------------------------------------
    def claim(self, jobs: Sequence[PrefixJob], cancelled=None) -> list:
        """Take `jobs` away from beside decode: a consumer on another thread (the fused schedule's pipeline)
        needs them now and runs what is left of them itself (`PrefixJob.complete`, on its own stream). Their
        pending units leave the queue and their admitted chunks not yet launched are dropped, so the hook
        never runs a unit of them again; a chunk being launched finishes launching first (the lock). Returns
        the CUDA events the consumer's stream must wait for before it runs or reads them: the ends of their
        chunks in flight and the prefill their vision encodings come from (none on CPU, where a chunk runs
        inline). A job whose prompts the engine has yet to prefill is waited for (polling; `cancelled()`
        true ends the wait with a RuntimeError). Claimed work counts as claimed, not hidden nor left."""
        keys = {j.key for j in jobs}
        while True:
            with self._lock:
                if not self._active:  # no rollout: nothing runs beside decode, whatever ran is on the side stream
                    return [self._side_event()] if self.cuda else []
                if not keys & self._pending_jobs.keys():
                    return self._claim(keys)
            if cancelled is not None and cancelled():
                raise RuntimeError("the rollout ended before the engine prefilled the prompts of a claimed job")
            time.sleep(1e-3)

    def _claim(self, keys: set[str]) -> list:
        events, claimed = [], set()
        for k, item in self.queue.items.items():
            key = k.rsplit("/", 1)[0]
            if key in keys and (units := self.queue.claim(k)):
                self.ctrl.claimed(units * item.unit_ms)
                claimed.add(key)
        keep = []
        for c in self._to_launch:
            key = c.item.key.rsplit("/", 1)[0]
            if key in keys:
                self.ctrl.claimed(c.cost_ms, c)
                claimed.add(key)
            else:
                keep.append(c)
        self._to_launch = keep
        self._claimed_jobs += len(claimed)
        events += [end for _, job, _, end in self._inflight if job.key in keys and end is not None]
        events += [self._ready_event.pop(k) for k in keys if k in self._ready_event]
        return events

    def _side_event(self):
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    # ---- end of the rollout -----------------------------------------------------------------
    def finish(self) -> dict[str, float]:
        """Stop admitting; the main stream waits for the chunks in flight, whose results it will read."""
        if not self._active:
            return {}
        with self._lock:
            return self._finish()

    def _finish(self) -> dict[str, float]:
        self._active = False
        lockstep_s = self._complete_lockstep()
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            main = torch.cuda.current_stream(self.device)
            for job in self.jobs.values():  # tensors made on the side stream, read and freed on the main one
                for t in job.tensors():
                    t.record_stream(main)
        for rec in self._inflight:
            self.ctrl.complete(rec[0])
            self._record_chunk(rec)
        self._inflight = []
        if self.timeline is not None:
            marks = self._step_marks
            for (step, bs, m, adm), nxt in zip(marks, marks[1:]):
                if nxt[0] == step + 1:
                    self.timeline.device_span("decode", f"step {step}", m, nxt[2], batch_size=bs,
                                              admitted_ms=round(adm, 3))
        m = self.ctrl.metrics()
        m["rollplex/cosched_launch_host_s"] = self._launch_s
        if lockstep_s is not None:
            m["rollplex/prefix_sweep_rollout_end_s"] = lockstep_s
        m["rollplex/cosched_jobs_waiting"] = float(len(self._pending_jobs))
        m["rollplex/cosched_jobs_claimed"] = float(self._claimed_jobs)
        return m

    def _complete_lockstep(self) -> float | None:
        """Run what is left of every sweep of a sharded model (cosched/sharded.py) now, on every rank:
        its gathers must all be issued before the step's next collective, which could otherwise wait on
        a rank whose side stream waits for a gather another rank issues only later. Standalone, so its
        time calibrates the cost estimates. None when there is no sweep."""
        sweeps = [j for j in self.jobs.values() if getattr(j, "lockstep", False)]
        if not sweeps:
            return None
        if self.cuda:  # decode is over: the rest runs on the main stream, after what the side stream holds
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            torch.cuda.synchronize(self.device)
        flops = sum(j.left_flops() for j in sweeps)
        t0 = time.perf_counter()
        region = self.memory.region("prefix_states") if self.memory is not None else contextlib.nullcontext()
        with region, torch.no_grad():
            if any(j.key in self._pending_jobs for j in sweeps):
                raise RuntimeError("a sweep's prompts were never prefilled by the engine (no vision encodings)")
            for j in sweeps:
                j.complete()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            # the gathered units' blocks cached for the side stream would stay out of reach of the phases
            # that follow on the main stream (the update's activations): back to the device with them
            torch.cuda.empty_cache()
        dt = time.perf_counter() - t0
        self.calibrate(flops, dt)
        return dt

    def calibrate(self, flops: float, seconds: float) -> None:
        """Refine the throughput estimate from a standalone run of `flops` of prefix work."""
        if flops > 0 and seconds > 0:
            measured = flops / seconds / 1e12
            self.tflops = 0.5 * self.tflops + 0.5 * measured
