"""What an RL step runs on, built and placed: the runtime, the rollout backend and the trainers.

`build_parts(model, engine, cfg, ...)` returns the `StepParts` an `RLStep` (rl/step.py) is assembled from
(`RLStep.from_parts`; `RLStep(model, engine, cfg, ...)` builds them with this). In order:

    runtime      this process (`Runtime`), or the data-parallel rank injected as `parallel`
    backend      the rollout backend bound to the runtime (a data-parallel rank's deals the prompts)
    reference    a Trainer with no optimizer (it only scores), placed by the runtime in `ref_weights`
    critic       PPO-GAE's value model in `critic_weights`, then its Critic trainer
    memory fit   under a memory manager, the plan, checkpointing and optimizer offload that fit the device
                 (rl/step_memory.py), chosen before the trainers' optimizers exist
    actor        the policy placed by the runtime, trained by an `Actor`

Each model is placed by the runtime (`Runtime.place`: this process, or sharded over a data-parallel group);
the reference scores where the actor's passes run unless its placement scores each rank's share.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, replace

from ..memory import MemoryConfig, MemoryFit, MemoryManager
from ..models import Qwen25VL
from .actor import Actor
from .config import RLConfig
from .critic import Critic, build_value_model
from .rollout import NativeRollout, RolloutBackend, as_rollout_backend
from .runtime import Runtime
from .step_memory import fit_step, local_tensors
from .trainer import Trainer

# the regions a step allocates in when built (resumed for that where the current phase has them paused)
TRAINER_REGIONS = ("ref_weights", "optimizer", "grads", "critic_weights", "critic_optimizer", "critic_grads")


@dataclass
class StepParts:
    """The built parts of an RL step (`build_parts`). cfg / memory_cfg: the settings as chosen (the fit's
    checkpointing and optimizer offload filled in); data_parallel: the runtime when it is a data-parallel
    rank's (the `parallel` given), None on this process alone."""
    runtime: Runtime
    backend: RolloutBackend | None
    actor: Actor
    reference: Trainer | None
    critic: Critic | None
    cfg: RLConfig
    memory: MemoryManager | None
    memory_cfg: MemoryConfig
    memory_fit: MemoryFit | None
    processor: object = None
    data_parallel: Runtime | None = None


def build_parts(model: Qwen25VL, engine, cfg: RLConfig, processor=None, ref_model: Qwen25VL | None = None,
                memory: MemoryManager | None = None, memory_cfg: MemoryConfig | None = None,
                parallel: Runtime | None = None) -> StepParts:
    """The parts of an RL step over `model` (the arguments as `RLStep`'s): ValueError for a backend or config
    the runtime cannot run, or a memory plan that nothing fits."""
    backend = as_rollout_backend(engine)
    if cfg.cosched and backend is not None and not isinstance(backend, NativeRollout):
        raise ValueError(f"cosched needs the native rollout backend: with {backend.name} the co-scheduler "
                         "runs in its scheduler (engine_patches.sglang.CoschedHook), which RLStep does not drive")
    # where the step runs: this process alone, or the data-parallel rank injected (rl/runtime.py), and the
    # backend it rolls out on (a data-parallel rank's deals the prompts over the ranks)
    runtime = parallel or Runtime(model)
    backend = runtime.bind(backend, model, memory, cfg)
    memory_cfg = memory_cfg or MemoryConfig()
    processor = processor or (backend.processor if backend is not None else None)
    if cfg.freeze_vision_tower:  # before the optimizer is built: the vision tower has no trainable state
        model.visual.requires_grad_(False)
    resident = memory.resident(TRAINER_REGIONS) if memory is not None else contextlib.nullcontext()
    with resident:  # a step may be built in any phase of the plan it replaces
        return _trainers(model, ref_model, cfg, runtime, backend, memory, memory_cfg, processor, parallel)


def _trainers(model: Qwen25VL, ref_model: Qwen25VL | None, cfg: RLConfig, rt: Runtime, backend, memory,
              memory_cfg: MemoryConfig, processor, parallel) -> StepParts:
    """The reference, the critic's value model, the memory fit, and the actor's and critic's trainers, each
    placed by the runtime in its region."""
    def region(tag: str):
        return lambda: memory.region(tag) if memory is not None else contextlib.nullcontext()

    # the reference: a trainer with no optimizer (it only scores), placed where the actor's passes run below
    reference = None
    if ref_model is not None or cfg.kl_coef > 0:
        reference = rt.place(lambda: ref_model if ref_model is not None else copy.deepcopy(model),
                             region("ref_weights"), trainable=False, role="reference")
        ref = reference.model.requires_grad_(False).eval()
        if memory is not None:
            memory.preserve("ref_weights", lambda: local_tensors(ref))
    # PPO-GAE's value model (rl/critic.py), in its region before the plan is fitted: its bytes are planned
    value = None
    if cfg.uses_critic:
        value = rt.place(lambda: build_value_model(model, cfg.critic_model_path, cfg.seed),
                         region("critic_weights"), trainable=True, role="critic")
        if cfg.freeze_vision_tower:
            value.model.backbone.visual.requires_grad_(False)
        if memory is not None:
            memory.preserve("critic_weights", lambda: local_tensors(value.model))
    # before the trainer is built: what fits the device decides its checkpointing and where its optimizer
    # state lives (memory/fit.py); without a memory manager what is left to the plan stays off. Either way
    # a runtime's own checkpointing (FSDP's) stays on
    fit = None
    if memory is not None:
        fit = fit_step(rt, backend, cfg, memory, memory_cfg, model, reference and reference.model,
                       value and value.model)
        decoder, vision = fit.gradient_checkpointing, fit.vision_gradient_checkpointing
    else:
        _, _, decoder, vision = rt.trainer_footprint(0, 0, bool(cfg.gradient_checkpointing),
                                                     bool(cfg.vision_gradient_checkpointing))
    cfg = replace(cfg, gradient_checkpointing=decoder, vision_gradient_checkpointing=vision)
    offload = memory_cfg.optimizer_offload
    memory_cfg = replace(memory_cfg, optimizer_offload=fit.optimizer_offload if fit
                         else "none" if offload == "auto" else offload)
    offload = memory_cfg.optimizer_offload
    policy = rt.place(lambda: model, contextlib.nullcontext, trainable=True, role="actor")
    actor = Actor(policy.model, cfg, memory, offload, placement=policy.placement, sweeps=policy.sweeps)
    if reference is not None:  # backing off with the actor's scoring
        reference.score_backoff = actor.score_backoff
        if reference.placement.world == 1:  # placed on this process alone: scored where the actor's passes run
            reference.placement = actor.placement
    critic = Critic(value.model, cfg, memory, offload, placement=value.placement) if value is not None else None
    return StepParts(rt, backend, actor, reference, critic, cfg, memory, memory_cfg, fit, processor, parallel)
