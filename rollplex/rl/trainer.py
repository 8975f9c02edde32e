"""What every model of a step shares (the actor's, the critic's, the reference's): one model, its
MasterAdamW (none for the reference, which only scores), where its passes run, and the loops written once.

    score(batch, forward, cfg)             no-grad [N, R] of `forward` over the batch's passes, down the
                                           out-of-memory ladder (`retry_oom`); nothing is applied
    fit(cfg, batch, step_idx, minibatch)   epochs x mini-batches: `minibatch` accumulates one mini-batch's
                                           gradients and metrics, `apply` takes its optimizer step
    apply(stats, where, nonfinite)         a non-finite metric skips the step (or raises NonFiniteUpdate),
                                           else `optimizer_step` and, per optimizer step, the LR schedule
    optimizer_step(applied)                agreed over a data-parallel placement's ranks (one all-reduce):
                                           every rank raises the same TrainOOM / TrainStepFailed, saying
                                           what was written
    retry_oom(attempt, ...)                the out-of-memory ladder of every pass, trained or scored:
                                           halved micro-batches, activation checkpointing, TrainOOM
    failure(error, applied)                what a failed update raises: the error as it is before the first
                                           optimizer step, TrainStepFailed saying what was applied after one

Mini-batches (`mini_batches`): the first epoch cuts the order in which the groups finished decoding
(`RolloutBatch.finish_order`) into consecutive runs, so its first mini-batch holds the groups that
finished first — what the fused schedule trains beside the rollout's tail; later epochs deal a
permutation seeded by (seed, step, epoch). Sizes differ by one at most, the first ones larger.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from ..models.transfer import to_device
from .activation_checkpointing import activation_checkpointing, set_activation_checkpointing
from .batch import RolloutBatch
from .config import RLConfig
from .errors import NonFiniteUpdate, TrainOOM, TrainStepError, TrainStepFailed, is_oom, release_frames
from .microbatch import Backoff, MicroBatching, halve
from .optimizer import MasterAdamW, OptimizerStepOOM
from .placement import CollectiveOOM, Placement, SingleProcess

log = logging.getLogger("rollplex.rl")
T = TypeVar("T")
# forward(model, micro-batch, mode, packed, prefix_key) -> [n, R]: what `Trainer.score` runs per pass
# (rl/scoring.py `logprobs`, rl/critic.py `values`)
Forward = Callable[[torch.nn.Module, RolloutBatch, str, bool, "str | None"], torch.Tensor]
# what to change when scoring runs out of memory: inside a data-parallel pass; at the smallest micro-batch
SCORE_HINTS = ("lower micro_batch_prompts / micro_batch_max_tokens or offload the reference model",
               "lower n or max_new_tokens, or offload the reference model (--memory-overrides "
               "ref_weights:*=offloaded)")


def lr_lambda(cfg: RLConfig) -> Callable[[int], float]:
    """The LR schedule's factor at a step: linear warm-up over `warmup_steps`, then constant or cosine
    down to `total_steps`."""
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "cosine":
            t = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
            return 0.5 * (1 + math.cos(math.pi * t))
        return 1.0

    return f


def mini_batch_sizes(num_prompts: int, k: int) -> list[int]:
    """Prompts in each of the (at most) k mini-batches of a rollout of num_prompts: sizes that differ by
    one at most, the first ones larger."""
    return [n for n in (len(range(i, num_prompts, k)) for i in range(k)) if n]


def mini_batches(cfg: RLConfig, batch: RolloutBatch, epoch: int, step_idx: int) -> list[list[int]]:
    """The prompts of each mini-batch of `epoch` of an update at step `step_idx` (see the module docstring)."""
    k = cfg.ppo_mini_batches
    if epoch == 0:
        order, out = batch.finish_order(), []
        for n in mini_batch_sizes(batch.num_prompts, k):
            out.append(order[sum(map(len, out)):][:n])
        return out
    g = torch.Generator().manual_seed(cfg.seed * 1000003 + step_idx * 1009 + epoch)
    order = torch.randperm(batch.num_prompts, generator=g).tolist()
    return [order[i::k] for i in range(k) if order[i::k]]


def retry_oom(attempt: Callable[[MicroBatching], T], plan: MicroBatching, mode: str, backoff: Backoff,
              placement: Placement, model: torch.nn.Module, what: str, hints: tuple[str, str], applied: int = 0,
              recover: Callable[[], None] | None = None, checkpointing: bool = False) -> T:
    """`attempt(micro-batching)` down the out-of-memory ladder: `plan` capped by `backoff`, halved on each
    out-of-memory error (kept in `backoff` for the rest of the run), at one prompt (one sequence) per pass
    activation checkpointing turned on (with `checkpointing`: a trained pass), then TrainOOM (`applied`
    optimizer steps before it; `hints`: what to change inside a data-parallel pass, at the smallest).
    Under a data-parallel placement the ranks back off together from a CollectiveOOM; an out-of-memory
    error inside a pass whose other ranks wait in its collectives raises TrainOOM at once. recover: drops
    what the failed attempt left (default: the allocator's cached blocks). Other errors propagate."""
    unit = "prompt" if mode == "rollplex" else "sequence"
    while True:
        current = backoff.plan(plan)
        try:
            return attempt(current)
        except Exception as e:  # noqa: BLE001 - only OOM is retried
            if not is_oom(e):
                raise
            release_frames(e)  # the failed attempt's tensors, so that `recover` can return their memory
            (recover or (lambda: _empty_cache(model)))()
            if not (isinstance(e, CollectiveOOM) or placement.on_oom() == "retry"):
                raise TrainOOM(f"{what} ran out of device memory inside a data-parallel pass (the other ranks wait "
                               f"in its collectives, so it cannot be retried); {hints[0]}", applied) from e
            smaller = halve(current, mode)
            if smaller is None and checkpointing and activation_checkpointing(model) != (True, True):
                # last rung: recompute activations in backward instead of keeping them
                log.warning("%s out of memory at the smallest micro-batch: turning on activation checkpointing "
                            "for the rest of the run", what)
                set_activation_checkpointing(model, True, True)
                continue
            if smaller is None:
                raise TrainOOM(f"{what} ran out of device memory at one {unit} per micro-batch; {hints[1]}",
                               applied) from e
            log.warning("%s out of memory: micro-batches of %s from now on", what, smaller)
            backoff.cap = smaller


def _first(out):
    """A pass's first output (a forward may return several)."""
    return out[0] if isinstance(out, tuple) else out


def _empty_cache(model: torch.nn.Module) -> None:
    if model.inv_freq.device.type == "cuda":
        torch.cuda.empty_cache()


class Loss(Protocol):
    """What a trainer's passes compute (`Trainer.accumulate`): rl/actor.py `PolicyLoss`, rl/critic.py `ValueLoss`."""
    metrics: tuple[str, ...]  # the names of the metric vector `__call__` returns

    def norms(self, mask: torch.Tensor) -> tuple: ...  # a mini-batch's normalisers (its response mask [n, R])

    def forward(self, model: torch.nn.Module, mb: RolloutBatch, mode: str, packed: bool): ...  # one pass's outputs

    def __call__(self, out, mb: RolloutBatch, rows: torch.Tensor,
                 norms: tuple) -> tuple[torch.Tensor, torch.Tensor]: ...  # (loss to backward, metrics)

    def start(self) -> None: ...  # before each attempt at a mini-batch: drop what a failed one kept

    # the fused schedule's (PolicyLoss): what divides the gradients and each metric of an unnormalised mini-batch
    def scales(self, mask: torch.Tensor) -> tuple[float, list[float]]: ...


class Trainer:
    score_hints = SCORE_HINTS  # what `score`'s TrainOOM says to change (inside a data-parallel pass; at the smallest)
    train_hints = SCORE_HINTS  # ... and the update's (the actor's and the critic's their own)
    update_name = "the update"  # how the update's TrainOOM calls it

    def __init__(self, model: torch.nn.Module, optimizer: MasterAdamW | None = None,
                 placement: Placement | None = None, memory=None,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None = None, per_optimizer_step: bool = False,
                 role: str = "trainer", score_backoff: Backoff | None = None,
                 sweeps: Callable[[], Callable] | None = None):
        """optimizer: None for a model that only scores (the reference); placement: where the passes run
        (default: this process); scheduler: an LR schedule stepped after each applied optimizer step when
        `per_optimizer_step` (its unit; otherwise the caller steps it per train step); role: the metrics'
        prefix ("actor"); score_backoff: the scoring back-off to share (the reference's is the actor's);
        sweeps: for a model sharded over ranks, what makes the gather of a co-scheduled prefix sweep
        (`sweep_gather`; None: the model is held whole here)."""
        self.model, self.optimizer, self.memory = model, optimizer, memory
        self.placement = placement or SingleProcess()
        self.sweeps = sweeps
        self.scheduler, self.per_optimizer_step, self.role = scheduler, per_optimizer_step, role
        self.name = f"the {role}"  # how errors call it
        self.applied = 0  # optimizer steps the current (or last) update applied
        # the micro-batchings out-of-memory back-offs halved to, kept for later steps: training and scoring
        self.train_backoff, self.score_backoff = Backoff(), score_backoff or Backoff()

    def sweep_gather(self):
        """The gather a co-scheduled prefix sweep of the model runs its units on (cosched/sharded.py), made for
        one rollout's sweep; None for a model held whole here."""
        return self.sweeps() if self.sweeps is not None else None

    @torch.no_grad()
    def score(self, batch: RolloutBatch, forward: Forward, cfg: RLConfig, prefix_key: str | None = None,
              placement: Placement | None = None, what: str | None = None) -> torch.Tensor:
        """No-grad `forward` of every response token [N, R] (fp32, host), zero on padding, every process of
        the placement getting the whole of it; `prefix_key`: the passes read the rollout's prefix states for
        that consumer (`batch.prefix`, rollplex mode) instead of running the prefix. placement: instead of the
        trainer's (a data-parallel rank's fused stages score alone). An out-of-memory error halves the
        micro-batches and retries (`retry_oom`, the halved plan kept in `score_backoff`), down to TrainOOM with
        nothing applied; `what` names the scoring in its message (default: "the <role> scoring")."""
        pl, model, mode = placement or self.placement, self.model, cfg.mode
        if prefix_key is not None and (mode != "rollplex" or prefix_key not in batch.prefix):
            prefix_key = None
        rows = batch.prefix[prefix_key] if prefix_key is not None else None
        # each process scores the prompts whose prefix states it holds
        prompts = rows.planned() if rows is not None and pl.world > 1 else None

        def attempt(plan: MicroBatching) -> torch.Tensor:
            out = torch.zeros(batch.responses.shape, dtype=torch.float32, device=model.inv_freq.device)
            for mb, idx in pl.passes(batch, mode, plan, prefix=prefix_key is not None, prompts=prompts):
                v = pl.run(model, forward, model, mb, mode, plan.packed, prefix_key)
                n = idx.shape[0]  # rows past n: a placement's masked-out dummies
                # stays on the device: no sync per micro-batch
                out[to_device(idx, out.device)] = v[:n] * to_device(mb.mask[:n], out.device)
            return pl.sum_(out).cpu()

        return retry_oom(attempt, cfg.micro_batching, mode, self.score_backoff, pl, model,
                         what or f"{self.name} scoring", self.score_hints)

    def fit(self, cfg: RLConfig, batch: RolloutBatch, step_idx: int,
            minibatch: Callable[[int, int, RolloutBatch, torch.Tensor], dict], nonfinite: str = "skip") -> dict:
        """The update: `cfg.ppo_epochs` epochs of `mini_batches`, `minibatch(epoch, done, mini, mini_idx)` leaving
        one mini-batch's gradients and returning its metrics (`train_minibatch`; its samples' indices in `batch`:
        mini_idx), then `step_or_skip` takes its optimizer step (counted in `applied`). Returns the metrics
        averaged over the mini-batches, `<role>/skipped_updates` when some were skipped (non-finite). A failure
        raises what `failure` says; either way `end_update` runs and the model is back in eval mode."""
        if nonfinite not in ("skip", "raise"):
            raise ValueError(f"nonfinite must be 'skip' or 'raise', got {nonfinite!r}")
        self.model.train()
        self.applied = 0
        try:
            out = self._epochs(cfg, batch, step_idx, minibatch, nonfinite)
        except BaseException as e:
            self.end_update(self.applied, e)
            raise self.failure(e, self.applied)  # noqa: B904 - the error itself, or one caused by it
        self.end_update(self.applied)
        return out

    def _epochs(self, cfg: RLConfig, batch: RolloutBatch, step_idx: int, minibatch, nonfinite: str) -> dict:
        total = sum(len(self._mini_batches(cfg, batch, e, step_idx)) for e in range(cfg.ppo_epochs))
        sums: dict[str, float] = {}
        done = skipped = 0
        for epoch in range(cfg.ppo_epochs):
            for prompt_ids in self._mini_batches(cfg, batch, epoch, step_idx):
                mini, mini_idx = batch.select_prompts(sorted(prompt_ids))
                stats = minibatch(epoch, done, mini, mini_idx)
                if self.step_or_skip(stats, f"mini-batch {done + 1} of {total} of {self.name}'s update", nonfinite):
                    self.applied += 1
                else:
                    skipped += 1
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v
                done += 1
        out = {k: v / max(done, 1) for k, v in sums.items()}
        if skipped:
            out[f"{self.role}/skipped_updates"] = float(skipped)
        return out

    def train_minibatch(self, cfg: RLConfig, mini: RolloutBatch, mini_idx: torch.Tensor, loss: Loss,
                        step_idx: int) -> dict:
        """One mini-batch's gradients (`accumulate` into zeroed ones) down the out-of-memory ladder (`retry_oom`:
        a failed attempt's gradients are dropped, `loss.start()` drops what it kept), then `stats`."""
        def attempt(plan: MicroBatching) -> torch.Tensor:
            loss.start()
            return self.accumulate(cfg, mini, mini_idx, loss, plan)

        acc = retry_oom(attempt, cfg.micro_batching, cfg.mode, self.train_backoff, self.placement, self.model,
                        self.update_name, self.train_hints, self.applied, self.recover, checkpointing=True)
        return self.stats(cfg, acc, loss, step_idx)

    def accumulate(self, cfg: RLConfig, mini: RolloutBatch, mini_idx: torch.Tensor, loss: Loss,
                   plan: MicroBatching | None = None, norms: tuple | None = None, zero: bool = True,
                   placement: Placement | None = None) -> torch.Tensor:
        """Forward/backward of this process's share of one mini-batch's micro-batches into the gradients;
        returns its part of `loss.metrics` (a device tensor: an .item() per micro-batch would make the host
        wait for the GPU each time; the caller sums it over the placement's processes).

        Every loss term is divided by the *whole mini-batch's* normaliser (`loss.norms` over all processes'
        tokens or sequences), so summing the gradients over micro-batches and processes gives the
        mini-batch's gradient. Rows of a pass past its sample indices are a placement's masked-out dummies.
        An out-of-memory error in a pass the placement defers (`on_oom`) ends this process's passes, and
        `end_passes` backs every process off together.

        plan: the micro-batching (default: the step's, capped by the update's back-off); norms: instead of the
        mini-batch's (the fused schedule passes ones); zero: start from zeroed gradients (False: add to what is
        there); placement: instead of the trainer's."""
        model, pl = self.model, placement or self.placement
        plan = plan or self.train_backoff.plan(cfg.micro_batching)
        norms = norms or loss.norms(mini.mask)
        if zero:
            self.optimizer.zero_grad()
        acc = torch.zeros(len(loss.metrics), device=model.inv_freq.device)
        for mb, idx in pl.passes(mini, cfg.mode, plan):
            try:
                gidx = mini_idx[idx]  # the real samples' indices in the whole batch
                out = pl.run(model, loss.forward, model, mb, cfg.mode, plan.packed)
                value, metrics = loss(out, mb, gidx, norms)
                value.backward()
                acc += metrics
            except Exception as err:  # noqa: BLE001 - only OOM is deferred
                if not (is_oom(err) and pl.on_oom() == "defer"):
                    raise
                break  # this rank's part of the mini-batch is lost: `end_passes` backs every rank off
        # a placement whose passes accumulated gradients reduces them now (or raises CollectiveOOM)
        pl.end_passes(model, lambda mb: _first(loss.forward(model, mb, cfg.mode, plan.packed)))
        return acc

    def stats(self, cfg: RLConfig, acc: torch.Tensor, loss: Loss, step_idx: int) -> dict:
        """One mini-batch's metrics (summed over the placement's processes: one host sync per mini-batch), its
        gradients clipped on their global norm and the lr of its optimizer step set (`set_lr`)."""
        pl = self.placement
        out = dict(zip(loss.metrics, pl.sum_(acc).tolist()))
        out[f"{self.role}/grad_norm"] = float(pl.clip_grad_norm_(self.optimizer.touched_params(), cfg.grad_clip))
        out[f"{self.role}/lr"] = self.set_lr(cfg, step_idx)
        return out

    def set_lr(self, cfg: RLConfig, step_idx: int) -> float:
        """The lr of the next optimizer step, set on the optimizer (the actor's and the critic's schedules)."""
        raise NotImplementedError(f"{self.name} has no LR schedule")

    def apply(self, cfg: RLConfig, acc: torch.Tensor, loss: Loss, mask: torch.Tensor, step_idx: int,
              nonfinite: str = "skip") -> dict:
        """The optimizer step of a mini-batch accumulated unnormalised (`accumulate` with unit norms, the fused
        schedule: mask is its [N, R]): gradients and metrics divided by the normalisers a whole-batch update
        uses (`normalise`), then clipped and applied as `fit` applies one mini-batch (metrics,
        NonFiniteUpdate, TrainOOM and the LR schedule alike)."""
        acc = self.normalise(acc, loss, mask)
        self.applied = 0
        try:
            stats = self.stats(cfg, acc, loss, step_idx)
            applied = self.step_or_skip(stats, "the batch", nonfinite)
        except BaseException as e:
            self.end_update(0, e)
            raise
        self.applied = int(applied)
        self.end_update(self.applied)
        if not applied:
            stats[f"{self.role}/skipped_updates"] = 1.0
        return stats

    def normalise(self, acc: torch.Tensor, loss: Loss, mask: torch.Tensor) -> torch.Tensor:
        """Divide the gradients an unnormalised `accumulate` left by the mini-batch's normaliser (mask: its
        response mask), as `loss.scales` says; returns the metrics `acc` divided alike."""
        grad_scale, metric_scales = loss.scales(mask)
        with torch.no_grad():
            for p in self.optimizer.touched_params():
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
        return acc * torch.tensor(metric_scales, device=acc.device)

    def end_update(self, applied: int, error: BaseException | None = None) -> None:
        """After an update's optimizer steps (`applied` of them, or a failure `error`): a step that changed
        the weights, even part-way, advances a per-step LR schedule once (a per-optimizer-step one was
        advanced by `optimizer_step`); the gradients go (between updates the buffers are the memory
        manager's to release; without one they are freed); the model is back in eval mode."""
        if (self.scheduler is not None and not self.per_optimizer_step
                and (applied > 0 or getattr(error, "partial_update", False))):
            self.scheduler.step()
        if error is not None:
            self.recover()
        else:
            self.optimizer.zero_grad(set_to_none=self.memory is None)
        self.model.eval()

    def _mini_batches(self, cfg: RLConfig, batch: RolloutBatch, epoch: int, step_idx: int) -> list[list[int]]:
        return mini_batches(cfg, batch, epoch, step_idx)

    def step_or_skip(self, stats: dict, where: str, nonfinite: str) -> bool:
        """One mini-batch's optimizer step on its clipped gradients, whether applied: a non-finite metric
        (loss, gradient norm; the same on every rank of a placement, which all skip alike) skips it with
        no LR-schedule step (verl skips it too), or raises NonFiniteUpdate with `nonfinite="raise"`."""
        bad = [k for k, v in stats.items() if not math.isfinite(v)]
        if bad and nonfinite == "raise":
            raise NonFiniteUpdate(
                f"non-finite {', '.join(bad)} in {where} (the loss or the gradients overflowed: check the rewards, "
                "lr and coefficients); its optimizer step was skipped", self.applied)
        if bad:
            return False
        self.optimizer_step(self.applied)
        if self.per_optimizer_step and self.scheduler is not None:
            self.scheduler.step()
        return True

    def optimizer_step(self, applied: int) -> None:
        """The mini-batch's optimizer step. Out of memory inside it raises TrainOOM on every process of the
        placement (they agree with one all-reduce over several), another error TrainStepFailed, saying what
        was written: `applied` whole steps before it, and whether this one wrote any chunk on some process,
        in which case it counts as applied for the LR schedule (stepped here per optimizer step, by the
        caller per train step)."""
        pl, err, other = self.placement, None, None
        try:
            self.optimizer.step()
        except OptimizerStepOOM as e:
            err = e
        except Exception as e:  # noqa: BLE001 - out of memory outside MasterAdamW's chunks, or another error
            err = OptimizerStepOOM(0, len(self.optimizer.chunks), True)  # either may have written some: assume so
            err.__cause__ = e
            other = None if is_oom(e) else e
        failed, changed, failed_other = err is not None, err is None or err.changed, other is not None
        if pl.world > 1:
            flags = pl.sum_(torch.tensor([float(failed), float(changed), float(failed_other)]))
            failed, changed, failed_other = bool(flags[0] > 0), bool(flags[1] > 0), bool(flags[2] > 0)
        if not failed:
            return
        self.recover()
        if changed and self.per_optimizer_step and self.scheduler is not None:
            self.scheduler.step()
        written, chunks = (err.written, err.total) if err is not None else (len(self.optimizer.chunks),) * 2
        torn = err is not None and err.torn
        if failed_other:  # not out of memory (on some rank): whatever it wrote is kept, and said
            cause = other or RuntimeError("the optimizer step failed on another data-parallel rank")
            raise TrainStepFailed(f"{self.name}'s optimizer step failed: {type(cause).__name__}: {cause}", applied,
                                  partial_update=changed, chunks_written=written, chunks_total=chunks,
                                  torn=torn) from cause
        cause = err if pl.world == 1 else CollectiveOOM("a data-parallel rank ran out of device memory in the "
                                                        "optimizer step")
        raise TrainOOM(f"{self.name}'s optimizer step ran out of device memory ({err or 'on another rank'}); "
                       "offload the optimizer state (optimizer_offload) or lower the memory the step holds",
                       applied, partial_update=changed, chunks_written=written, chunks_total=chunks,
                       torn=torn) from cause

    def recover(self) -> None:
        """Drop a failed pass's gradients and cached blocks (its tensors are gone with the exception)."""
        self.optimizer.zero_grad(set_to_none=self.memory is None)
        _empty_cache(self.model)

    def failure(self, error: BaseException, applied: int) -> BaseException:
        """What an update that failed with `error` after `applied` optimizer steps raises: a TrainStepError
        (it says what was applied) or an error before any optimizer step as it is; any other error after
        one as a TrainStepFailed saying so, caused by it."""
        if isinstance(error, TrainStepError) or not isinstance(error, Exception) or applied == 0:
            return error
        out = TrainStepFailed(f"{self.name}'s update failed after an optimizer step: {type(error).__name__}: "
                              f"{error}", applied)
        out.__cause__ = error
        return out
