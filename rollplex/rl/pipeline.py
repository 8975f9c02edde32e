"""The step as a pipeline of prompt groups: finished groups are scored and trained beside the rollout's tail.

A rollout reports each prompt's group as its n samples finish (`RolloutBackend.reports_groups`). What
follows the rollout — reward, reference logprobs, advantages (per group) and the actor's forward/backward
— needs nothing but the group; only the optimizer step needs the whole batch, so it runs once, after the
last group, and the step stays exactly on-policy:

    rollout ──group i done──> chunk of consecutive groups in finishing order
        -> reward -> reference logprobs -> KL penalty, advantages -> actor fwd/bwd (grads += unnormalised)
    after the last group: grads /= the (first) mini-batch's normaliser -> clip -> AdamW (Actor.apply_groups)
    several updates: then the other mini-batches and epochs, phased (Actor.update)

A chunk closes at `micro_batch_prompts` groups (or `fuse_chunk_tokens` tokens). Chunks completed while
the rollout decodes run on a worker thread (on a GPU a side stream in a green context of `fuse_sms` SMs),
admitted by the gate (rl/fuse_gate.py); the rest runs after the rollout on the caller's thread. Chunks are
consecutive runs of the finishing order whoever runs them, so the result equals the phased step up to the
order of the gradient sums and one division. With the co-scheduler each chunk reads (or claims) its
prompts' prefix states (cosched/handover.py `claim`). Data-parallel, each rank runs this pipeline on its
own engine's groups with no collective until one all-reduce after the last (`runtime.fused`).
`fused_unsupported` names what fused work cannot reproduce; the step then runs phased, as it does after an
out-of-memory error in a stage. More in docs/ARCHITECTURE.md ("The step as a pipeline of groups").
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from dataclasses import dataclass

import torch

from ..cosched.handover import claim
from .actor import METRICS, Accumulated, fused_loss_norm
from .algos import compute_advantages
from .batch import RolloutBatch
from .config import RLConfig
from .errors import TrainOOM, is_oom
from .fuse_gate import FuseGate
from .remax import score_baselines
from .scoring import logprobs
from .trainer import mini_batch_sizes

BATCH_WIDE = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "gpg")  # whiten / scale over the batch
# the decode loop's host work waits for the GIL while the worker launches kernels: switch threads often
SWITCH_INTERVAL_S = 2e-4


def fused_unsupported(cfg: RLConfig) -> str | None:
    """Why a step of `cfg` cannot be fused (None: it can), for what the config alone decides."""
    if cfg.filter_groups:
        return "filter_groups (dynamic sampling) keeps a group only once the whole batch is scored"
    if cfg.uses_critic:
        return ("adv_estimator='gae' whitens its advantages over the whole batch and trains a critic on returns "
                "known only then")
    if cfg.adv_estimator in BATCH_WIDE:
        return f"adv_estimator={cfg.adv_estimator!r} whitens or scales advantages over the whole batch"
    if cfg.rollout_corr.needs_whole_batch:
        return ("the rollout correction's batch normalisation, rejection or veto needs the whole batch's old "
                "logprobs before the update")
    if fused_loss_norm(cfg) is None:
        return (f"policy_loss={cfg.policy_loss!r} divides its loss by sequences and the KL loss / entropy bonus by "
                "tokens: one division at the end cannot reproduce both")
    return None


@dataclass
class ChunkResult:
    """What one chunk of groups left for the end of the step (rows in prompt-then-sample order)."""
    prompts: list[int]  # prompt indices, finishing order
    rows: torch.Tensor  # [n] sample indices in the whole batch
    rewards: torch.Tensor  # [n] scores
    reward_metrics: dict  # the reward function's extra metrics (means over the chunk)
    ref: torch.Tensor | None  # [n, R_c] reference logprobs
    advantages: torch.Tensor  # [n] (outcome estimators)
    seq_rewards: torch.Tensor  # [n]
    logprobs: torch.Tensor | None  # [n, R_c] the trainer's (device); None: a later mini-batch's groups
    old: torch.Tensor | None  # [n, R_c] old logprobs (several updates per rollout)
    seconds: float = 0.0  # the chunk's stages, timed where they ran (device events on a GPU)
    baselines: torch.Tensor | None = None  # [n] ReMax: the reward of each sample's prompt's greedy response


class GroupPipeline:
    """One step's groups through the stages (see the module docstring). `step`: the RLStep (its reference,
    actor, reward and vision settings); `rewards(chunk, prompt_ids) -> (scores [n], metrics)`."""

    def __init__(self, step, prompts: list, samples: list[int], per_prompt: dict, rewards, stream=None,
                 timeline=None, expected: int | None = None, trained: int | None = None,
                 gate: FuseGate | None = None, stream_for=None, handover: dict | None = None):
        """expected: how many groups this pipeline gets (default: all; a data-parallel rank its share);
        trained: how many of them, the first to finish, are trained (default: the first mini-batch's);
        gate: admission beside decode (default: always); stream_for(sms): the side stream of a partition
        of `sms` SMs (default: `stream` whatever the partition); handover: the co-scheduler's prefix rows
        of the prompts, by consumer (cosched/handover.py; default: none, scoring runs the prefixes)."""
        self.step, self.prompts, self.per_prompt, self.rewards = step, prompts, per_prompt, rewards
        self.cfg = cfg = step.cfg
        self.expected = len(prompts) if expected is None else expected
        self.trained = mini_batch_sizes(len(prompts), cfg.ppo_mini_batches)[0] if trained is None else trained
        self.offsets = [0]
        for n in samples:
            self.offsets.append(self.offsets[-1] + n)
        self.chunk = cfg.micro_batch_prompts  # groups per chunk at most
        # ... and tokens, when given: a chunk closes once it holds this many, so long groups go one by one
        self.chunk_tokens = cfg.fuse_chunk_tokens or float("inf")
        self.stream, self.timeline = stream, timeline
        self.cuda = stream is not None
        self.gate = gate if gate is not None else FuseGate()
        self.stream_for = stream_for
        self.handover = handover or {}
        self._streams = [stream] if stream is not None else []  # the side streams chunks ran on
        self._held = False  # a chunk is ready but the gate holds it: decode steps wake the worker
        self.outputs: dict[int, object] = {}
        self.order: list[int] = []  # finished prompts, finishing order
        self.taken = 0  # groups of `order` already in a chunk
        self.results: list[ChunkResult] = []
        self.acc: torch.Tensor | None = None  # the actor's unnormalised metrics, summed over chunks
        self.error: BaseException | None = None
        self.in_rollout = 0  # chunks done by the worker (beside the rollout)
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._switch = None
        self._events: list = []  # (start, end) device events of the worker's chunks

    # ---- the rollout's side ---------------------------------------------------------------------
    def add(self, i: int, output) -> None:
        """Prompt i's group is done (called from the decode loop: only hands it over)."""
        with self._cond:
            self.outputs[i] = output
            self.order.append(i)
            self._cond.notify()

    def on_decode_step(self, info) -> None:
        """The decode loop's hook: the step goes to the gate; a held chunk is re-examined."""
        self.gate.on_decode_step(info, time.perf_counter())
        if self._held and self.gate.admit():
            with self._cond:
                self._cond.notify()

    def start(self) -> None:
        """Zero the gradients and start the worker (its stream ordered after the caller's work)."""
        self.gate.begin()
        self.step.actor.begin_groups()
        if self.cuda:
            idx = self.step.device.index
            self._device_index = idx if idx is not None else torch.cuda.current_device()
            self.stream.wait_stream(torch.cuda.current_stream())
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._thread = threading.Thread(target=self._work, name="rollplex-fused", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """The rollout is over (or failed): the worker ends after its current chunk; the caller's stream
        then waits for the worker's."""
        self.gate.finish(time.perf_counter())
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._switch is not None:
            sys.setswitchinterval(self._switch)
            self._switch = None
        if self.cuda:
            for s in self._streams:
                torch.cuda.current_stream().wait_stream(s)

    def _admitted(self) -> bool:
        left = self.expected - len(self.order)
        return left <= self.cfg.fuse_below * self.expected

    def _next_chunk(self) -> list[int] | None:
        """The next whole chunk once it is done and admitted; None when the worker should end."""
        with self._cond:
            while True:
                if self._stopping or self.error is not None:
                    return None
                ids = self._chunk(final=False)
                ready = ids is not None and self._admitted()
                if ready and self.gate.admit():
                    self._held = False
                    self.taken += len(ids)
                    return ids
                self._held = ready
                self._cond.wait()

    def _chunk(self, final: bool) -> list[int] | None:
        """The finished groups that make the next chunk: `order` from `taken` until the chunk holds `chunk`
        groups or `chunk_tokens` tokens (prompt once, responses), or reaches the end of the groups
        trained (the first mini-batch); with `final` (every group is done) also a shorter one at the end.
        A function of the finishing order alone, whoever calls it."""
        ids, tokens = [], 0
        end = self.trained if self.taken < self.trained else len(self.prompts)
        for i in self.order[self.taken : end]:
            ids.append(i)
            tokens += self._tokens([i])
            if len(ids) == self.chunk or tokens >= self.chunk_tokens:
                return ids
        return ids if ids and (final or self.taken + len(ids) == self.trained) else None

    def _tokens(self, ids: list[int]) -> int:
        """The chunk's tokens: each prompt once, every response."""
        return sum(len(self.outputs[i].prompt_token_ids) + sum(len(s.token_ids) for s in self.outputs[i].samples)
                   for i in ids)

    def _work(self) -> None:
        if self.cuda:  # the step's device (a new thread starts on device 0)
            torch.cuda.set_device(self._device_index)
        prev = self.stream
        while (ids := self._next_chunk()) is not None:
            stream = self._chunk_stream(prev)
            self.gate.start(self._tokens(ids))
            try:
                with torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext():
                    t0 = self._mark()
                    self._run(ids)
                    self.in_rollout += 1
                    self._record(t0, ids, "beside decode")
            except BaseException as e:  # noqa: BLE001 - handed to the caller after the rollout
                self.error = e
                return
            finally:
                self.gate.end()
            prev = stream

    def _chunk_stream(self, prev):
        """The side stream of the partition the gate gives the current decode batch, ordered after `prev`
        (the chunks accumulate into the same gradients)."""
        if not self.cuda or self.stream_for is None:
            return self.stream
        stream = self.stream_for(self.gate.sms(self.gate.batch))
        if stream is not prev:
            stream.wait_stream(prev)
            if all(stream is not s for s in self._streams):
                self._streams.append(stream)
        return stream

    # ---- the caller's side, after the rollout -----------------------------------------------------
    def drain(self) -> None:
        """Run the chunks the worker left (every group is done), on the caller's thread and stream."""
        if self.error is not None:
            return
        while (ids := self._chunk(final=True)) is not None:
            self.taken += len(ids)
            t0 = self._mark()
            try:
                self._run(ids)
            except BaseException as e:  # noqa: BLE001 - the step decides (OOM: run phased)
                self.error = e
                return
            self._record(t0, ids, "after the rollout")

    def _mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _record(self, t0, ids: list[int], where: str) -> None:
        t1 = self._mark()
        res = self.results[-1]
        if self.cuda:
            self._events.append((res, t0, t1))
        else:
            res.seconds = t1 - t0
        if self.timeline is not None:
            name = f"groups {ids[0]}..{ids[-1]} ({len(ids)}) {where}"
            if self.cuda:
                self.timeline.device_span("fused", name, t0, t1)
            else:
                self.timeline.host_span("fused", name, t0, t1)

    def resolve_times(self) -> None:
        """The chunks' times from their CUDA events (after the caller's stream has waited for the worker);
        the gate learns the standalone cost from the chunks that ran after the rollout, then settles."""
        for res, a, b in self._events:
            b.synchronize()
            res.seconds = a.elapsed_time(b) / 1e3
        self._events.clear()
        for res in self.results[self.in_rollout:]:
            self.gate.alone(self._tokens(res.prompts), res.seconds)
        self.gate.settle()

    # ---- the stages of one chunk --------------------------------------------------------------------
    def _run(self, ids: list[int]) -> None:
        st, cfg = self.step, self.cfg
        trained = self.taken - len(ids) < self.trained  # a chunk never straddles the end of the groups trained
        chunk = self.chunk_batch(ids)
        # the co-scheduler's prefix states of these prompts, taken over where it has not finished them (a
        # worker that waits for a prefill gives up once the rollout is stopped)
        chunk.prefix = claim(st.cosched, self.handover, ids, st.device, lambda: self._stopping)
        scores, reward_metrics = self.rewards(chunk, ids)
        chunk.rewards = scores
        score_baselines(self.rewards, chunk, ids)  # ReMax: the chunk's greedy responses
        train_b, ref_b = st.training_views(chunk)
        rt = st.runtime
        local = rt.fused.placement()  # this data-parallel rank alone (no collective); None: each trainer's own
        lp = logprobs(cfg.temperature)
        ref = st.reference.score(ref_b, lp, cfg, prefix_key="ref", placement=local) if st.uses_reference(cfg) \
            else None
        # several updates: the ratio's denominator, by the weights the rollout sampled from (phased scores it
        # before the first optimizer step too)
        old = rt.old_scorer(st.actor, cfg).score(train_b, lp, cfg, prefix_key="old", placement=local,
                                                 what="the old-logprob scoring") if cfg.num_updates > 1 else None
        chunk.prefix.clear()  # consumed (the views share the dict): the update runs its own prefixes
        penalty, _, _ = st.kl_reward_penalty(chunk, ref, cfg)
        adv, seq_rewards = compute_advantages(cfg.adv_estimator, scores, chunk.group, chunk.mask, penalty,
                                              cfg.norm_adv_by_std, cfg.gamma, cfg.singleton_adv, chunk.baselines)
        logp = None
        if trained:
            acc, logp = st.actor.accumulate_groups(cfg, train_b, adv, ref if cfg.use_kl_loss else None, old, local)
            self.acc = acc if self.acc is None else self.acc + acc
        rows = torch.cat([torch.arange(self.offsets[i], self.offsets[i + 1]) for i in ids])
        self.results.append(ChunkResult(ids, rows, scores, reward_metrics, ref, adv, seq_rewards, logp, old,
                                        baselines=chunk.baselines))

    def chunk_batch(self, ids: list[int]) -> RolloutBatch:
        """The finished groups `ids` as a RolloutBatch (group-indexed within the chunk)."""
        per = {k: [v[i] for i in ids] for k, v in self.per_prompt.items() if v is not None}
        return self.step.rollout_batch([self.prompts[i] for i in ids], [self.outputs[i] for i in ids], **per)

    # ---- the whole batch, assembled -------------------------------------------------------------------
    def assemble(self, batch: RolloutBatch, results: list[ChunkResult] | None = None) -> dict:
        """The chunks' per-sample results in `batch`'s rows: rewards [N], ref [N, R] or None, advantages
        [N] (the estimators fused runs are outcome ones), sequence rewards [N], the trainer's logprobs
        [N, R] (host; the groups trained), old logprobs [N, R] or None, reward metrics, and what the
        first mini-batch accumulated here (`Accumulated`). results: every rank's chunks (default: these)."""
        mine = [r.rows for r in self.results if r.logprobs is not None]
        N, R = batch.responses.shape
        results = self.results if results is None else results
        per_token = any(r.advantages.dim() == 2 for r in results)  # remax: [n, R_c] per chunk
        out = {"rewards": torch.zeros(N), "seq_rewards": torch.zeros(N), "logprobs": torch.zeros(N, R),
               "advantages": torch.zeros(N, R) if per_token else torch.zeros(N)}
        has_ref = all(r.ref is not None for r in results)
        has_old = bool(results) and all(r.old is not None for r in results)
        out["ref"] = torch.zeros(N, R) if has_ref else None
        out["old"] = torch.zeros(N, R) if has_old else None
        out["baselines"] = torch.zeros(N) if results and all(r.baselines is not None for r in results) else None
        sums: dict[str, float] = {}
        for r in results:
            out["rewards"][r.rows] = r.rewards.float()
            out["seq_rewards"][r.rows] = r.seq_rewards.float().cpu()
            if per_token:
                out["advantages"][r.rows, : r.advantages.shape[1]] = r.advantages.float().cpu()
            else:
                out["advantages"][r.rows] = r.advantages.float().cpu()
            if r.logprobs is not None:
                out["logprobs"][r.rows, : r.logprobs.shape[1]] = r.logprobs.float().cpu()
            if has_ref:
                out["ref"][r.rows, : r.ref.shape[1]] = r.ref.float().cpu()
            if has_old:
                out["old"][r.rows, : r.old.shape[1]] = r.old.float().cpu()
            if out["baselines"] is not None:
                out["baselines"][r.rows] = r.baselines.float().cpu()
            for k, v in r.reward_metrics.items():
                sums[k] = sums.get(k, 0.0) + v * len(r.rows)
        out["reward_metrics"] = {k: v / N for k, v in sums.items()}
        rows = torch.cat(mine) if mine else torch.zeros(0, dtype=torch.long)
        acc = self.acc if self.acc is not None else torch.zeros(len(METRICS), device=self.step.device)
        out["accumulated"] = Accumulated(acc, rows, out["logprobs"][rows])
        return out

    def counts(self) -> tuple[int, int]:
        """(groups of the first mini-batch trained while others decoded, groups done) here."""
        beside = self.results[: self.in_rollout]
        return sum(len(r.prompts) for r in beside if r.logprobs is not None), len(self.order)

    def shareable(self) -> list[ChunkResult]:
        """The chunks' results on the host (to send to the other ranks of a data-parallel step)."""
        cpu = lambda t: None if t is None else t.detach().cpu()  # noqa: E731
        return [ChunkResult(r.prompts, r.rows, cpu(r.rewards), r.reward_metrics, cpu(r.ref), cpu(r.advantages),
                            cpu(r.seq_rewards), cpu(r.logprobs), cpu(r.old), r.seconds, cpu(r.baselines))
                for r in self.results]

    def metrics(self, rollout_s: float, counts: tuple[int, int] | None = None) -> dict:
        """counts: (groups trained beside decode, groups) over every rank (default: `counts()`)."""
        beside = self.results[: self.in_rollout]
        trained, groups = counts or self.counts()
        return {**self.gate.metrics(), "rollplex/fused": 1.0,
                "rollplex/fused_groups_in_rollout": float(trained),
                "rollplex/fused_groups": float(groups),
                "timing_s/fused_in_rollout": sum(r.seconds for r in beside),
                "timing_s/fused_after_rollout": sum(r.seconds for r in self.results[self.in_rollout:]),
                "rollplex/groups_per_s": groups / rollout_s if rollout_s > 0 else 0.0}


def fallback_on(error: BaseException) -> bool:
    """Whether a fused stage's error lets the step run phased instead (out of memory) or must be raised."""
    return isinstance(error, TrainOOM) or is_oom(error)
