"""The order of one RL step's work: a schedule runs the rollout and the stages after it.

    Phased   rollout, then rewards -> reference -> advantages -> update over the whole batch
             (`RLStep.train`): today's order, and what every other schedule must equal
    Fused    the same stages over prompt groups as they finish, beside the rollout's tail
             (rl/pipeline.py `GroupPipeline`), then the first mini-batch's optimizer step and the
             other mini-batches as phased runs them; equal to phased up to summation order
    Auto     one of the two per step, chosen by what earlier steps measured (rl/auto_schedule.py);
             the update is the same whichever runs, up to summation order

Both run the prefix co-scheduler beside their rollout when `cfg.cosched` (cosched/handover.py): Phased through
`RLStep.generate`, Fused around its pipeline — the chunks read the prefix states it hands over and take
over the jobs it has not finished when they need them; what no chunk claimed runs after the rollout.

`schedule_of(cfg)` picks one by `RLConfig.schedule`; `RLStep.run` hands it the step, the prompts and
their sampling parameters, the reward function and the metrics to fill, and returns what it returns:
the rolled-out batch with its rewards. A schedule asks the step's runtime (rl/runtime.py) where the
work runs — one process or each data-parallel rank on its share — and never branches on it.

Fused falls back to phased, reporting `rollplex/fused=0`: for a step it cannot reproduce
(`fused_unsupported`: the config, a backend that does not report groups, the runtime, a fused rollout
phase over the memory plan's budget), warned once per reason; and, with `rollplex/fused_fallback_oom=1`,
when a fused stage runs out of memory (on any rank) — nothing was applied, and the finished rollout is
scored and trained phased. Any other error in a fused stage is raised with nothing applied.
"""

from __future__ import annotations

import logging
import time

import torch

from ..cosched.handover import co_scheduled
from ..cosched.scheduler import decode_stream, on_stream, side_stream
from ..cosched.timeline import DecodeMarks
from .auto_schedule import AutoChooser
from .batch import RolloutBatch
from .config import RLConfig
from .errors import TrainOOM, release_frames
from .fuse_gate import FuseGate, gate_settings
from .pipeline import GroupPipeline, fallback_on, fused_unsupported
from .remax import score_baselines
from .timing import phase_timer as _timer
from .trainer import mini_batch_sizes

log = logging.getLogger("rollplex.rl")


class Phased:
    """Roll out every prompt, then score and train the whole batch."""

    def run(self, step, prompts: list, params: list, rewards, per_prompt: dict, m: dict) -> RolloutBatch:
        with _timer(m, "gen", step.device, step.timeline):
            batch = step.generate(prompts, params, **per_prompt)
        m.update(step.rollout_metrics)
        return self.after_rollout(step, batch, rewards, m)

    @staticmethod
    def after_rollout(step, batch: RolloutBatch, rewards, m: dict) -> RolloutBatch:
        """Rewards, then reference, advantages and the update (`RLStep.train`) of a finished rollout."""
        with _timer(m, "reward", step.device):
            batch.rewards, extra = rewards(batch, list(range(batch.num_prompts)))
            score_baselines(rewards, batch, list(range(batch.num_prompts)))  # ReMax's greedy responses
        m.update(extra)
        m.update(step.train(batch))
        return batch


class Fused:
    """Train the first mini-batch's groups as they finish, beside the rollout (rl/pipeline.py); phased where
    it cannot (see the module docstring)."""

    def __init__(self):
        self._streams: dict[int, tuple] = {}  # SMs -> (side stream, its green context), made on first use
        self._decode_stream = None  # decode's high-priority stream without the co-scheduler (which has one)
        self._warned: set[str] = set()
        # the admission gate (rl/fuse_gate.py): its measurements span steps; one set here carries them in
        # (made from the config on first use, remade when its settings change)
        self.gate: FuseGate | None = None

    def run(self, step, prompts: list, params: list, rewards, per_prompt: dict, m: dict) -> RolloutBatch:
        why = step.fused_unsupported()
        if why is None:
            return self._fused(step, prompts, params, rewards, per_prompt, m)
        if why not in self._warned:
            self._warned.add(why)
            log.warning("schedule='fused' runs phased: %s", why)
        m["rollplex/fused"] = 0.0
        return Phased().run(step, prompts, params, rewards, per_prompt, m)

    def _side_stream(self, step, sms: int | None = None):
        """The side stream of fused work in a green context of `sms` SMs (default `fuse_sms`; 0: all SMs at
        low priority), made once per partition; None on CPU."""
        if step.device.type != "cuda":
            return None
        sms = step.cfg.fuse_sms if sms is None else sms
        if sms not in self._streams:
            self._streams[sms] = side_stream(step.device, sms)  # (stream, its context)
        return self._streams[sms][0]

    def _decode_priority(self, step):
        """Decode on a high-priority stream: the co-scheduler's when it runs, else this schedule's."""
        if step.cosched is not None:
            return step.cosched.decode_priority()
        if self._decode_stream is None:
            self._decode_stream = decode_stream(step.device)
        return on_stream(self._decode_stream, step.device)

    def _gate(self, cfg: RLConfig) -> FuseGate:
        want = gate_settings(cfg)
        g = self.gate
        if g is None or (g.policy, g.sms_by_batch, g.default_sms) != want:
            self.gate = g = FuseGate(*want)
        return g

    def _fused(self, step, prompts: list, params: list, rewards, per_prompt: dict, m: dict) -> RolloutBatch:
        """Rollout with the group pipeline beside it, then the optimizer step."""
        step.enter("rollout")
        # the gradients and the reference stay resident from the rollout through the optimizer step: resumed
        # after entering the rollout, and afterwards whatever the phase the step ends in gives them
        for tag in fused_regions(step):
            step.memory.resume(tag)
        try:
            return self._fused_step(step, prompts, params, rewards, per_prompt, m)
        finally:
            if step.memory is not None:
                step.memory.enter(step.memory.current)

    def _fused_step(self, step, prompts: list, params: list, rewards, per_prompt: dict, m: dict) -> RolloutBatch:
        cfg, tl, rt, actor = step.cfg, step.timeline, step.runtime, step.actor
        ref = step.ref if step.uses_reference(cfg) else None
        # the prefix co-scheduler (cfg.cosched) as one producer of the pipeline: its jobs run beside decode and
        # each chunk reads (or takes over) the prefix states of its prompts; the reference stays resident
        # through the rollout here (`fused_regions`), so its prefixes are planned whatever the memory plan
        frozen = step.keeps_vision
        handover = step.plan_handover(prompts, frozen, ref_resident=True)
        # this runtime's groups (a data-parallel rank: its engine's share), and how many of them are the first
        # mini-batch's
        mine, trained = rt.fused.share(len(prompts), mini_batch_sizes(len(prompts), cfg.ppo_mini_batches)[0])
        pipe = GroupPipeline(step, prompts, [p.n for p in params], per_prompt, rewards, self._side_stream(step), tl,
                             len(mine), trained, self._gate(cfg), lambda sms: self._side_stream(step, sms), handover)
        # the decode lane of the timeline: the co-scheduler draws it when it runs (with what it admitted)
        marks = DecodeMarks(tl) if tl is not None and step.engine is not None and not handover else None
        hooked = [h for h in (pipe, marks) if h is not None and step.engine is not None]  # the gate hears decode
        outs = self._roll_out(step, prompts, params, pipe, handover, marks, hooked, ref, m)
        batch = step.rollout_batch(prompts, outs, **per_prompt)
        batch.prefix = handover
        # every rank's chunks and counts (None: this pipeline's are all)
        ended = self._end_stages(step, batch, pipe, handover, ref, m)
        if ended is None:  # out of memory in a stage: phased
            return Phased.after_rollout(step, batch, rewards, m)  # reads the handover's prefix states
        results, counts = ended
        batch.prefix = {}  # consumed by the chunks: free them before the update
        pipe.resolve_times()
        assert len(mine) < len(prompts) or pipe.order == batch.finish_order(), "the first mini-batch is trained"
        got = pipe.assemble(batch, results)
        batch.rewards, batch.baselines = got["rewards"], got["baselines"]
        m.update(got["reward_metrics"])
        _, reward_kl, kl_m = step.kl_reward_penalty(batch, got["ref"], cfg)
        m.update(kl_m)
        train_lp = got["old"] if got["old"] is not None else got["logprobs"]  # as phased: the old ones when scored

        def actor_update() -> tuple[dict, torch.Tensor]:
            if cfg.num_updates == 1:
                return actor.apply_groups(cfg, got["accumulated"].metrics, batch.mask), train_lp
            # the first mini-batch's optimizer step, then the others as the phased update runs them
            train_b, _ = step.training_views(batch)
            stats, _ = actor.update(train_b, got["advantages"], got["ref"] if cfg.use_kl_loss else None, got["old"],
                                    step.step_idx, cfg, accumulated=got["accumulated"])
            return stats, train_lp

        step.update(batch, got["advantages"], got["seq_rewards"], reward_kl, cfg, m, actor_update)
        m.update(pipe.metrics(m["timing_s/gen"], counts))
        return batch

    def _roll_out(self, step, prompts: list, params: list, pipe: GroupPipeline, handover: dict, marks, hooked: list,
                  ref, m: dict) -> list:
        """The rollout with the pipeline (and the co-scheduler) beside it: the backend's outputs."""
        rt, tl, actor, frozen = step.runtime, step.timeline, step.actor, step.keeps_vision
        # in the rollout phase, entered by `_fused`; data-parallel: trainer and reference gathered, no collective
        # until the end (undone here if the rollout fails). The co-scheduler finishes (its metrics, the main
        # stream joins its stream) after the worker stopped: no claim comes in while it settles
        with _timer(m, "gen", step.device, tl), rt.fused.gathered(actor, ref):
            with co_scheduled(step.cosched, step.engine, handover, prompts if frozen else (), tl,
                              priority=False) as cosched_metrics:
                pipe.start()
                for h in hooked:
                    step.engine.hooks.append(h)
                done = False
                try:
                    with self._decode_priority(step):
                        outs = step.backend.generate(prompts, params, keep_vision=frozen, on_output=pipe.add)
                    done = True
                finally:
                    pipe.stop()
                    for h in hooked:
                        step.engine.hooks.remove(h)
                    if marks is not None:
                        marks.close()
                    if not done:  # a failed rollout: what the chunks accumulated goes with it
                        actor.discard_groups()
        step.rollout_metrics = cosched_metrics
        m.update(cosched_metrics)
        return outs

    @staticmethod
    def _end_stages(step, batch: RolloutBatch, pipe: GroupPipeline, handover: dict, ref,
                    m: dict) -> tuple[list | None, tuple[int, int] | None] | None:
        """The chunks left after the rollout, then every rank's agreement on the stages and the gradients reduced
        once: every rank's chunks and counts (None, None: this pipeline's are the whole batch's) when the fused
        update goes on; None when a stage ran out of memory somewhere (the accumulated chunks are dropped and
        the step runs phased); any other stage's error is raised."""
        actor = step.actor
        with _timer(m, "fused_tail", step.device, step.timeline):
            # prefix work no chunk claimed beside decode: in its normal phase, as the phased step runs it
            # (standalone, which calibrates the co-scheduler); the chunks left then find it done
            try:
                for key in handover:
                    step.complete_handover(batch, key, m)
            except BaseException as e:  # noqa: BLE001 - as a fused stage's: chunks dropped, out of memory runs phased
                pipe.error = pipe.error or e
            pipe.drain()
        # every rank agrees whether some rank's stage failed, then the gradients are reduced once and the
        # ranks' chunks shared
        err = pipe.error
        flags = [int(err is not None and fallback_on(err)), int(err is not None and not fallback_on(err))]
        (oom, other), results, counts = step.runtime.fused.end(actor, ref, flags, pipe)
        if other and err is None:
            pipe.error = RuntimeError("a fused stage failed on another data-parallel rank")
        elif oom and err is None:
            pipe.error = TrainOOM("a fused stage ran out of device memory on another data-parallel rank", 0)
        if pipe.error is None:
            return results, counts
        actor.discard_groups()
        if not fallback_on(pipe.error):
            raise pipe.error
        log.warning("fused schedule: a stage ran out of device memory (%s); this step runs phased", pipe.error)
        m["rollplex/fused"], m["rollplex/fused_fallback_oom"] = 0.0, 1.0
        release_frames(pipe.error)  # the failed pass's activations, before the phased update
        return None


class Auto:
    """Fused or phased per step, by the seconds per token each took on earlier steps (`AutoChooser`): its
    exploration, re-probes and the fused gate's report of whether any group trained beside decode. The
    fused schedule's state (side streams, admission gate) persists across the steps it runs."""

    def __init__(self, cfg: RLConfig):
        self.phased, self.fused = Phased(), Fused()
        self.chooser = AutoChooser(reprobe_steps=cfg.auto_reprobe_steps, margin=cfg.auto_margin)

    @property
    def gate(self) -> FuseGate | None:
        return self.fused.gate

    @gate.setter
    def gate(self, gate: FuseGate | None) -> None:
        self.fused.gate = gate

    def run(self, step, prompts: list, params: list, rewards, per_prompt: dict, m: dict) -> RolloutBatch:
        ch = self.chooser
        if "fused" in ch.arms and step.fused_unsupported() is not None:
            ch.unavailable("fused")
        arm = ch.pick()
        t0 = time.perf_counter()
        batch = (self.fused if arm == "fused" else self.phased).run(step, prompts, params, rewards, per_prompt, m)
        seconds = time.perf_counter() - t0
        tokens = sum(len(batch.prompts[g].input_ids) for g in batch.group.tolist()) + float(batch.mask.sum())
        groups = m.get("rollplex/fused_groups_in_rollout", 0.0) if arm == "fused" else None
        if arm == "fused" and m.get("rollplex/fused", 1.0) == 0.0:  # it ran phased after all
            if not m.get("rollplex/fused_fallback_oom"):
                ch.unavailable("fused")  # it cannot run here; out of memory: not paying until re-probed
        ch.record(arm, seconds, tokens, groups)
        m.update(ch.metrics())
        return batch


SCHEDULES = {"phased": Phased, "fused": Fused, "auto": Auto}


def schedule_of(cfg: RLConfig) -> Phased | Fused | Auto:
    """A new schedule of `cfg.schedule` (a Fused one keeps its side stream and warnings per step; an Auto one
    its measurements)."""
    return Auto(cfg) if cfg.schedule == "auto" else SCHEDULES[cfg.schedule]()


def why_not_fused(step) -> str | None:
    """Why `step` cannot run the fused schedule (None: it can): its config, its backend, its runtime, or the
    memory the fused rollout phase needs."""
    why = fused_unsupported(step.cfg)
    if why is not None:
        return why
    if step.backend is None or not getattr(step.backend, "reports_groups", False):
        return f"the {step.rollout_backend} rollout backend does not report groups as they finish"
    if (why := step.runtime.fused.unsupported()) is not None:
        return why
    fit = step.memory_fit
    if fit is not None and fit.budget is not None:
        # the rollout phase holds, besides its own regions, what the plan releases there but the fused
        # stages read (the gradients, the reference), and one update micro-batch's activations; a data-parallel
        # rank also the trainer's units and gradients, and a sharded reference's, gathered
        sizes, acts = step.memory_sizes(), step.activation_estimate()
        peak = (fit.plan.peak("rollout", sizes, {}) + sum(sizes[t] for t in fused_regions(step)) + acts["update"]
                + step.runtime.fused.extra_bytes(step.actor))
        if peak > fit.budget:
            return (f"the fused rollout phase needs {peak / 2**30:.1f} GiB (the KV cache, gradients, reference "
                    f"and one update micro-batch together), over the plan's budget of {fit.budget / 2**30:.1f} GiB")
    return None


def fused_regions(step) -> list[str]:
    """Regions the fused stages read that the memory plan does not keep during the rollout."""
    if step.memory is None:
        return []
    need = ["grads"] + (["ref_weights"] if step.uses_reference(step.cfg) else [])
    return [t for t in need if step.memory.plan.get("rollout", t) != "resident"]
