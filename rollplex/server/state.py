"""The hosted runtime: policy, processor, engine, reference model + trainer (RLStep), rollout store, worker.

    ServerState(cfg):  [model .. rl: rollplex.system.build(cfg), the assembly every entry point shares]
                       model  <- HF dir (load_model + VLProcessor) | preset name (random init, ids only)
                                 | None (the embedded tiny model, written on first use)
                       [format warm-up: rollplex.rl.warmup on the shape-colour task's rows]
                       engine <- Engine(model, processor, cfg.engine)   decodes with the trainer's tensors
                                 | SGLang (cfg.backend.rollout_backend = "sglang"): no engine here; SGLang
                                   started on the checkpoint, the rollout backend of the RL step
                       rl     <- RLStep(model, engine | backend, cfg.rl)  ref = frozen copy when kl_coef > 0
                       store  <- RolloutStore(ttl, cap, bytes per client / all);  worker <- EngineWorker(engine)
                       rewards <- RewardRegistry: built-ins + --reward / --reward-module (rewards.py),
                                  scored on `scoring`'s threads
                       intake <- a few threads, each with its own copy of the processor: encode prompts,
                                 their images read and decoded by `media` (MediaPolicy, media.py)

ServerConfig is a SystemConfig (rollplex/system.py: model, device, dtype, the nested configs, and the
checks across them) with the server's own settings. The configs it hosts, nested: `engine`
(EngineConfig), `rl` (RLConfig, whose n / temperature / top_p / max_new_tokens are also the
defaults of /rollout, max_new_tokens that of /generate), `memory` (MemoryConfig) and `backend`
(BackendConfig: the rollout backend), `limits` (ServerLimits). `rl.seed` seeds the model init and
warm-up. Rewards a request may name, and local media files it may read, are the operator's to open
(`reward_modules`, `allow_client_reward_code`, `media_root`): by default none beyond the built-ins.

With the SGLang backend /rollout runs as one worker job through the RL step's backend (SGLang batches
it), /train_step as with the native engine, and /generate is not served (it streams from the native
engine's loop); `engine` is None.

Every method below except `describe`, `encode_prompt` and `encode_generate` runs on the engine thread (through
`worker.run`): the engine, the model, the optimizer and the engine's processor are touched by that
one thread only. Prompts are encoded on the intake threads (`encode_prompt`, `encode_generate`,
`intake_processor`: each thread's own copy, as a tokenizer is not safe to share between threads),
so tokenizing and image preprocessing never hold up a decode step, and one heavy prompt does not
queue every other client's behind it (inflight.py). Request sizes are bounded by `cfg.limits`
(limits.py) before any of that work starts.
Train-step overrides apply to that step only: the step runs with `dataclasses.replace(rl.cfg, ...)`
(validated; temperature = the rollout's, so the trainer scores the distribution that was sampled).
`weights_version` counts weight changes (train steps, loads, and a train step that failed after an
optimizer step: rl/errors.py); a rollout sampled at another version trains only off-policy.
Checkpoints are read and written only under `cfg.checkpoint_root` (`confine`), never into the root
itself, and over an existing one only when asked (`save(..., overwrite=True)`). `fingerprint` is what
a train step or a load changes (GET /checksum).

Started by torchrun (the default process group initialised before this is built), every rank builds
the same state and the RL step is data-parallel (group.py); `world_size` is the group's size. Rank 0
holds `commands` (group.Commands): its `train` hands each step to the other ranks before running it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from ..data import row_to_inputs
from ..models import ModelInputs
from ..parallel.fsdp import local_tensor
from ..rl.actor import TrainOOM
from ..rl.checkpoint import load_checkpoint, save_checkpoint
from ..rl.checkpoint_checks import check_data_state
from ..rl.config import RLConfig
from ..system import SystemConfig, build
from .group import collective_oom
from .limits import ServerLimits
from .media import MediaPolicy, RequestPixels
from .metrics import Metrics
from .rewards import RewardRegistry
from .schemas import MAX_ABS_REWARD
from .store import RetainedRollout, RolloutStore, StaleRollout, tensor_bytes
from .worker import EngineWorker

log = logging.getLogger("rollplex.server")


# seconds an idle keep-alive connection stays open (uvicorn's default, 5, closes connections that a driver's
# pool of hundreds, busy on its own CPU between uses, is about to send on: its next request fails)
KEEP_ALIVE_S = 75.0
# threads that score /train_step rewards (reward functions run outside the training lock: rewards.py)
REWARD_THREADS = 2


def server_rl_config() -> RLConfig:
    """The server's default RLConfig: RLConfig's defaults with room for longer answers (this
    max_new_tokens is also the default of /generate)."""
    return RLConfig(max_new_tokens=128)


@dataclass
class ServerConfig(SystemConfig):
    """SystemConfig (model, device, dtype, rl, engine, memory, backend, fsdp, ...: rollplex/system.py, which
    also checks what spans components) with the server's own settings."""

    api_key: str | None = None
    reward: str = "default"  # /train_step's reward for requests without rewards (name or module:function)
    # more rewards requests may name: [NAME=]module:function or FILE.py:function, imported at startup
    reward_modules: tuple[str, ...] = ()
    # requests may name module:function / FILE.py:function rewards, which the server then imports and runs
    allow_client_reward_code: bool = False
    # local image / video files a request names are read only under this folder; None: none are read
    media_root: str | None = None
    intake_threads: int = 4  # threads that tokenise prompts and decode images, each with its own processor
    rollout_ttl_s: float = 600.0  # seconds a training rollout is retained
    max_rollouts: int = 16  # retained rollouts per client (its oldest evicted)
    rl: RLConfig = field(default_factory=server_rl_config)  # the defaults; /train_step overrides per step
    limits: ServerLimits = field(default_factory=ServerLimits)  # request sizes (limits.py)
    # /save and /load read and write only under this folder (created on the first save);
    # None: `checkpoints` under the working directory
    checkpoint_root: str | None = None

    def __post_init__(self):
        if self.checkpoint_root is None:
            self.checkpoint_root = "checkpoints"
        if not self.checkpoint_root:
            raise ValueError("checkpoint_root must be a folder path")
        # resolved once, so a later chdir does not move it
        self.checkpoint_root = str(Path(self.checkpoint_root).expanduser().resolve())
        if self.media_root is not None:
            if not self.media_root or not Path(self.media_root).expanduser().is_dir():
                raise ValueError(f"media_root {self.media_root!r} is not a folder")
            self.media_root = str(Path(self.media_root).expanduser().resolve())
        self.reward_modules = tuple(self.reward_modules)
        if self.intake_threads < 1:
            raise ValueError("intake_threads must be >= 1")
        if self.rl.cosched:
            # /rollout runs requests through the engine loop shared with /generate, which does not host the
            # co-scheduler; a silently ignored flag would report numbers it did not produce
            raise ValueError("cosched is not available in the server yet (RLStep.step and the bench run it)")
        if self.rl.schedule != "phased":
            # /rollout and /train_step are separate calls: there is no rollout for fused work to run beside
            raise ValueError(f"schedule={self.rl.schedule!r} needs a step that rolls out and trains in one call "
                             "(RLStep.run: the driver and the bench); the server's steps are phased")
        super().__post_init__()  # device, dtype and the checks across components


class CheckpointExists(ValueError):
    """/save onto an existing checkpoint without `overwrite` (409)."""


def _sums(tensors) -> float:
    """The sum of every element and of its square over `tensors`, in float64 pieces of 16M elements (no
    float64 copy of a whole tensor), accumulated per device with one host sync each."""
    acc: dict[torch.device, torch.Tensor] = {}
    for t in tensors:
        a = acc.setdefault(t.device, torch.zeros((), dtype=torch.float64, device=t.device))
        for piece in t.detach().reshape(-1).split(1 << 24):
            piece = piece.double()
            a += piece.sum() + piece.square().sum()
    return float(sum(float(a) for a in acc.values()))


def confine(root: str | Path, path: str) -> Path:
    """`path` resolved under `root` (relative paths are taken from the root); ValueError when the
    resolved path (after `..` and symlinks) is not inside the root."""
    root = Path(root).resolve()
    full = (root / path).resolve()  # an absolute `path` replaces the root
    if not full.is_relative_to(root):
        raise ValueError(f"{path!r} resolves to {full}, outside the checkpoint root {root} "
                         "(give a path relative to the root, or start the server with another --checkpoint-root)")
    return full


def _leave_group(e: BaseException, where: str = "out of device memory inside a data-parallel pass") -> None:
    """A failure on this rank alone inside a collective phase (out of memory inside a data-parallel pass, a
    rollout share that failed): the other ranks wait in its collectives and cannot be brought back in
    step, so this process exits and torchrun ends the group."""
    log.critical("%s (%s): the process group cannot continue; exiting so that torchrun ends every rank", where, e)
    logging.shutdown()
    os._exit(1)


class ServerState:
    def __init__(self, cfg: ServerConfig, launched: float | None = None):
        """launched: `time.perf_counter()` when the process began starting the server (the CLI's entry), so
        that the startup phases count the imports before this; None: now."""
        t_init = time.perf_counter()
        self.launched = t_init if launched is None else launched
        # seconds per startup phase, in order (logged, and reported by /health)
        self.startup_s: dict[str, float] = {} if launched is None else {"imports": t_init - launched}
        self.cfg = cfg
        # policy, [format warm-up], [TP shard], engine or SGLang, memory manager, RL step: one assembly for
        # every entry point (rollplex/system.py); rewards are the server's (rewards.py)
        self.rewards = RewardRegistry(cfg.reward, cfg.reward_modules, cfg.allow_client_reward_code)
        system = build(cfg, reward_fn=self.rewards.default, logger=log)
        self.startup_s.update(system.startup_s)
        self.system = system
        self.model_path, self.processor, self.model = system.model_path, system.processor, system.model
        self.warmup_loss, self.world_size = system.warmup_loss, system.world_size
        self.memory, self.engine, self.rl = system.memory, system.engine, system.rl
        self._length_warned = False  # a rollout longer than the memory plan's max_new_tokens was reported
        self.store = RolloutStore(cfg.rollout_ttl_s, cfg.max_rollouts, cfg.limits.max_client_rollout_bytes,
                                  cfg.limits.max_retained_bytes)
        self.media = MediaPolicy(cfg.limits, cfg.media_root)
        self.intake = ThreadPoolExecutor(cfg.intake_threads, thread_name_prefix="rollplex-intake")
        # /train_step's reward functions, outside the training lock: threads of their own, so that slow ones
        # occupy neither the intake threads nor the event loop's default executor
        self.scoring = ThreadPoolExecutor(REWARD_THREADS, thread_name_prefix="rollplex-reward")
        # each intake thread copies this one on its first prompt (a tokenizer is not safe to share between
        # threads); it is touched only under the lock, to be copied
        self._intake_template = copy.deepcopy(self.processor)
        self._intake_lock = threading.Lock()
        self._intake_local = threading.local()
        self.worker = EngineWorker(self.engine, decode=self._decode if self.processor is not None else None,
                                   before_step=self.enter_rollout)
        self.metrics = Metrics()
        self.weights_version = 0
        self.commands = None  # rank 0 of a process group: group.Commands (set by the CLI)
        self.last_train: dict = {}
        self.started = time.time()

    @property
    def intake_processor(self):
        """This thread's own copy of the processor (None without a tokenizer)."""
        proc = getattr(self._intake_local, "processor", None)
        if proc is None and self._intake_template is not None:
            with self._intake_lock:
                proc = self._intake_local.processor = copy.deepcopy(self._intake_template)
        return proc

    def _phase(self, name: str, t0: float) -> float:
        self.startup_s[name] = time.perf_counter() - t0
        return self.startup_s[name]

    def mark_ready(self) -> None:
        """The HTTP server is about to accept requests: log the time since launch and its phases."""
        self.startup_s["ready"] = time.perf_counter() - self.launched
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in self.startup_s.items() if k not in ("ready", "engine"))
        log.info("startup: ready in %.1fs (%s)", self.startup_s["ready"], parts)

    def close(self) -> None:
        self.worker.close()
        self.intake.shutdown(wait=False, cancel_futures=True)
        self.scoring.shutdown(wait=False, cancel_futures=True)
        self.rl.backend.close()

    def _decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.processor.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_texts(self, ids: list[int]) -> list[str]:
        if self.processor is None:
            return [None] * len(ids)
        return [self.processor.decode([t], skip_special_tokens=False) for t in ids]

    def describe(self) -> dict:
        cfg = self.cfg
        return {"model": str(self.model_path or cfg.model), "mode": cfg.rl.mode,
                "rollout_backend": self.rl.rollout_backend, "device": cfg.device, "dtype": cfg.dtype,
                "world_size": self.world_size, "global_step": self.rl.step_idx, "weights_version": self.weights_version,
                "retained_rollouts": len(self.store), "has_ref_model": self.rl.ref is not None,
                "max_model_len": cfg.engine.max_model_len, "max_num_seqs": cfg.engine.max_num_seqs,
                "uptime_s": round(time.time() - self.started, 3),
                "startup_s": {k: round(v, 3) for k, v in self.startup_s.items()}}

    def engine_counts(self) -> dict | None:
        """{"waiting", "running"} requests of the native engine; None when the rollouts run elsewhere."""
        if self.engine is None:
            return None
        return {"waiting": len(self.engine.scheduler.waiting), "running": len(self.engine.scheduler.running)}

    # ---- engine-thread methods ----------------------------------------------------------------
    def enter_rollout(self) -> None:
        """Before an engine step: the KV cache (and whatever else the rollout phase holds) is resident."""
        if self.memory is not None and self.memory.current != "rollout":
            self.memory.enter("rollout")

    def encode_prompt(self, p, pixels: RequestPixels | None = None) -> ModelInputs:
        """ModelInputs for a RolloutPrompt (chat messages / verl row / ids); runs on an intake thread. Its
        images and videos are read and decoded under the media policy first (media.py), their pixels
        charged to the prompt's budget and to its request's (`pixels`, shared by the request's prompts)."""

        if p.input_ids is not None:
            return ModelInputs(input_ids=list(p.input_ids))
        if self.intake_processor is None:
            raise ValueError("this server has no tokenizer (a preset model): send `input_ids` prompts")
        budget = self.media.budget(pixels)
        messages = self.media.chat(p.chat(), budget)
        images, videos = self.media.prompt(p.images, p.videos, budget)
        return row_to_inputs(self.intake_processor, {"prompt": messages, "images": images, "videos": videos})

    def encode_generate(self, prompt, pixels: RequestPixels | None = None) -> ModelInputs:
        """ModelInputs for a /generate prompt (templated text, {"text", "images"}, or token ids); runs on an
        intake thread, its images decoded under the media policy first (charged as `encode_prompt`'s)."""
        if isinstance(prompt, list):  # token ids (prepared on the event loop): no processor copy for it
            return self.engine.encode(prompt)
        if isinstance(prompt, dict):
            prompt = {**prompt, "images": self.media.images(prompt.get("images"), self.media.budget(pixels))}
        return self.engine.encode(prompt, self.intake_processor)

    def sample(self, inputs: list[ModelInputs], params: list, keep_vision: bool) -> tuple[list, int]:
        """(one RequestOutput per prompt, the weights version they were sampled from) through the RL
        step's rollout backend; a worker job when the rollouts run outside the engine loop (SGLang) or
        over a process group, where rank 0 first hands the prompts to the other ranks (group.py) and every
        rank samples its share."""
        if self.commands is not None:
            # every rank draws the same samples: seedless requests get their seeds here, once, on rank 0
            params = [p if p.seed is not None else replace(p, seed=random.getrandbits(62)) for p in params]
            self.commands.send("rollout", inputs, params)
            try:
                return self.rl.sample(inputs, params, keep_vision=keep_vision), self.weights_version
            except Exception as e:  # noqa: BLE001 - the prompts were checked: this rank's failure alone
                _leave_group(e, "this rank's share of a group rollout failed")
        return self.rl.sample(inputs, params, keep_vision=keep_vision), self.weights_version

    def train(self, entry: RetainedRollout, rewards, overrides: dict, reward_s: float,
              off_policy: bool = False) -> dict:
        """One step on a retained rollout: rewards [N] (list or tensor); overrides: RLConfig fields
        for this step only. A rollout sampled from other weights raises StaleRollout unless
        `off_policy`: then the engine's logprobs of the sampled tokens are the PPO ratio's old
        logprobs, so the clipped ratio corrects for the policy having moved since sampling."""
        stale = entry.weights_version != self.weights_version
        if stale and not off_policy:
            raise StaleRollout(entry.weights_version, self.weights_version)
        cfg = replace(self.rl.cfg, **{**overrides, "temperature": entry.temperature})  # ValueError if invalid
        if cfg.kl_coef > 0 and self.rl.ref is None:
            raise ValueError("this server holds no reference model (started with --kl-coef 0): "
                             "restart it with --kl-coef > 0 to use a KL term")
        if cfg.uses_critic and self.rl.critic is None:
            raise ValueError("this server holds no critic (started without --adv-estimator gae): restart it with "
                             "--adv-estimator gae to train PPO with a critic")
        old = entry.batch.rollout_logprobs if stale else None
        if stale and old is None:
            raise ValueError("this rollout has no engine logprobs to train it off-policy")
        rewards = torch.as_tensor(rewards, dtype=torch.float64)
        if rewards.shape != (entry.batch.num_samples,):
            raise ValueError(f"got rewards of shape {tuple(rewards.shape)} for {entry.batch.num_samples} samples")
        # a client's or a reward function's: huge rewards overflow the advantages' statistics (NaN metrics)
        bad = (~torch.isfinite(rewards) | (rewards.abs() > MAX_ABS_REWARD)).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"rewards must be finite with |reward| <= {MAX_ABS_REWARD:g}: sample {bad[0]} has "
                             f"{float(rewards[bad[0]])} ({len(bad)} such)")
        rewards = rewards.float()
        self._check_planned_length(entry.batch.responses.shape[1])
        if self.commands is not None:  # validated: every other rank runs this same step (group.py)
            self.commands.send("train", entry, rewards, overrides, reward_s, off_policy)
        t0 = time.perf_counter()
        step0 = self.rl.step_idx  # RLStep.train counts a step that changed the weights, even in part
        try:
            # a non-finite loss or gradient norm fails the step (422) rather than being skipped silently
            m = self.rl.train(replace(entry.batch, rewards=rewards), cfg, old_logprobs=old, nonfinite="raise")
        except TrainOOM as e:
            if self.world_size > 1 and not collective_oom(e):
                _leave_group(e)
            raise
        except torch.OutOfMemoryError as e:  # outside the back-offs of scoring and of the update
            if self.world_size > 1:
                _leave_group(e)
            if self.model.inv_freq.is_cuda:
                torch.cuda.empty_cache()
            done = self.rl.step_idx != step0  # after the update: all of it was applied
            raise TrainOOM(f"the train step ran out of device memory {'after' if done else 'before'} its update: "
                           f"{e}; lower the micro-batch size or offload the reference model (--memory-overrides "
                           "ref_weights:*=offloaded)", cfg.num_updates if done else 0) from e
        finally:
            if self.rl.step_idx != step0:  # the weights changed: rollouts sampled before (this one too) are stale
                self.weights_version += 1
        train_s = time.perf_counter() - t0
        b = entry.batch
        tokens = sum(len(b.prompts[g].input_ids) for g in b.group.tolist()) + float(b.mask.sum())
        step_s = entry.gen_s + reward_s + train_s
        m.update({"timing_s/gen": entry.gen_s, "timing_s/reward": reward_s, "timing_s/train": train_s,
                  "timing_s/step": step_s, "perf/throughput": tokens / max(step_s, 1e-9),
                  "training/global_step": self.rl.step_idx, "training/off_policy": float(stale),
                  "training/weights_version_lag": float(self.weights_version - 1 - entry.weights_version)})
        self.last_train = {k: v for k, v in m.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        return m

    def _check_planned_length(self, width: int) -> None:
        """Warn once when a rollout's responses run past the max_new_tokens the memory plan sized the update's
        activations for at startup: its micro-batches may then run out of memory and back off (slower steps,
        the first one most)."""
        planned = self.rl.cfg.max_new_tokens
        if self.memory is None or width <= planned or self._length_warned:
            return
        self._length_warned = True
        log.warning("a rollout's responses run to %d tokens; the memory plan sized the update for max_new_tokens=%d "
                    "(%.1fx fewer response tokens per micro-batch): start the server with --max-new-tokens %d",
                    width, planned, width / planned, width)

    def checkpoint_path(self, path: str) -> Path:
        """`path` (relative: under the checkpoint root) resolved, symlinks included; ValueError when it
        lies outside the root."""
        return confine(self.cfg.checkpoint_root, path)

    def save(self, path: str, data_state: dict | None, overwrite: bool = False) -> dict:
        """Write a checkpoint under the checkpoint root, never into the root itself, and over an existing
        checkpoint (a non-empty folder) only with `overwrite` (CheckpointExists otherwise), which replaces
        the folder whole, atomically (a folder that is not a checkpoint is never replaced); `data_state`
        must round-trip (rl/checkpoint_checks.py). Over a process group rank 0 checks the path, then every
        rank writes its part (rl/checkpoint.py)."""

        full = self.checkpoint_path(path)
        if not (self.world_size > 1 and self.commands is None):  # a follower writes where rank 0 checked
            if full == Path(self.cfg.checkpoint_root).resolve():
                raise ValueError(f"{path!r} is the checkpoint root itself: save into a folder under it "
                                 "(e.g. run1/global_step_100)")
            if full.is_dir() and any(full.iterdir()):
                if not overwrite:
                    raise CheckpointExists(f"{full} already exists (and is not empty); pass overwrite: true to "
                                           "replace the checkpoint there, or save under another path")
                if not any(full.glob("trainer_state*.pt")) and not (full / "rollplex_step.json").exists():
                    # overwrite replaces the whole folder: never one that holds other things (other runs)
                    raise ValueError(f"{full} is not a checkpoint (no trainer state): overwrite replaces only a "
                                     "checkpoint; save under another path")
            check_data_state(data_state or {})  # before anything is written (and before the ranks are told)
        if self.commands is not None:
            self.commands.send("save", path, data_state)
        out = save_checkpoint(self.rl, full, data_state, tokenizer_dir=self.model_path)
        ref = out / "ref" if self.rl.ref is not None else None
        return {"path": str(out), "global_step": self.rl.step_idx, "ref_path": str(ref) if ref else None}

    def load(self, path: str) -> dict:
        full = self.checkpoint_path(path)
        if not full.is_dir():
            raise ValueError(f"checkpoint {full} is not a directory")
        if self.commands is not None:  # every rank restores its shards (a checkpoint of this group's size)
            self.commands.send("load", path)
        report: dict = {}
        try:  # a ValueError comes from the checks, before anything was changed
            data_state = load_checkpoint(self.rl, full, report)
        except ValueError:
            raise
        except BaseException:  # while copying in: the weights may have changed
            self.weights_version += 1
            self.store.clear()
            raise
        self.weights_version += 1
        dropped = self.store.clear()  # sampled from the previous weights: no longer on-policy
        return {"path": str(full), "global_step": self.rl.step_idx, "data_state": data_state,
                "dropped_rollouts": dropped, "masters_rebuilt": report.get("masters_rebuilt", 0)}

    def checksums(self) -> tuple[float, float]:
        """(policy weights, optimizer state) fingerprints: the sum of every element and of its square, each
        tensor reduced in float64 on its own (no copy of the model is kept); the optimizer's covers its
        separate fp32 masters, both AdamW moments and the step counts. Under a process group the trainer's
        shards partition the optimizer state (and, under a tensor-parallel engine, the policy): the ranks'
        sums are added (a collective: rank 0 sends "checksum" to the followers)."""

        par, opt = self.rl.parallel, self.rl.actor.optimizer
        if par is not None and self.commands is not None:
            self.commands.send("checksum")
        whole = par is None or par.holds_policy
        held = self.memory.resident(["optimizer"]) if self.memory is not None else contextlib.nullcontext()
        with torch.no_grad(), held:
            w = _sums(self.model.parameters() if whole else
                      (local_tensor(p.detach()) for p in self.rl.actor.model.parameters()))
            o = _sums(opt.state_tensors()) + sum(float(st["step"]) for st in opt.opt.state.values() if "step" in st)
        if par is not None:
            total = torch.tensor([0.0 if whole else w, o], dtype=torch.float64, device=self.rl.device)
            dist.all_reduce(total, group=par.group)
            w, o = (w if whole else float(total[0])), float(total[1])
        return w, o

    def fingerprint(self) -> dict:
        """What a train step or a load changes (GET /checksum): weights and optimizer checksums (null, with
        `weights_finite` / `optimizer_finite` false, when they hold NaN or inf), global step, weights
        version, the LR schedule's position and the retained rollouts."""
        w, o = self.checksums()
        # a non-finite sum (NaN or inf weights) is reported as such: null and finite: false, never a 500
        return {"weights_checksum": w if math.isfinite(w) else None, "weights_finite": math.isfinite(w),
                "optimizer_checksum": o if math.isfinite(o) else None, "optimizer_finite": math.isfinite(o),
                "global_step": self.rl.step_idx,
                "weights_version": self.weights_version, "lr_schedule_step": self.rl.actor.scheduler.last_epoch,
                "retained_rollouts": self.store.ids()}

    def ledger(self) -> dict:
        """Bytes per memory region (distinct storages), + torch.cuda allocator stats on GPU."""
        params = list(self.model.parameters())
        opt = self.rl.actor.optimizer
        opt_state = opt.state_tensors()
        regions = {
            "weights": tensor_bytes(params + list(self.model.buffers())),
            "ref_weights": tensor_bytes(list(self.rl.ref.parameters())) if self.rl.ref is not None else 0,
            # the native engine's; SGLang's KV cache is in its own memory pool, not counted here
            "kv_cache": tensor_bytes([self.engine.runner.k_cache, self.engine.runner.v_cache])
            if self.engine is not None else 0,
            "optimizer_state": tensor_bytes(opt_state),
            "grads": tensor_bytes([p.grad for p in params if p.grad is not None]),  # persistent buffers
            "retained_rollouts": self.store.nbytes(),
        }
        out = {"regions": regions, "total_bytes": sum(regions.values()), "retained_rollouts": len(self.store),
               "kv_cache_blocks": {"total": self.engine.blocks.num_blocks, "free": self.engine.blocks.num_free,
                                   "block_size": self.engine.cfg.block_size} if self.engine is not None else None,
               "rollout_backend": self.rl.rollout_backend, "device": self.cfg.device, "cuda": None}
        out["manager"] = self.memory.report() if self.memory is not None else None
        dev = self.model.inv_freq.device
        if dev.type == "cuda":
            out["cuda"] = {"allocated": torch.cuda.memory_allocated(dev), "reserved": torch.cuda.memory_reserved(dev),
                           "max_allocated": torch.cuda.max_memory_allocated(dev),
                           "total": torch.cuda.get_device_properties(dev).total_memory}
        return out
