"""One config for the whole runtime (`SystemConfig`) and the one place that assembles it (`build`).

    SystemConfig            model, device, dtype, compile, format_warmup_steps, and the component configs,
                            nested as they are (nothing restated):
        rl       RLConfig       (rl/config.py)        the step: algorithm, micro-batches, schedule
        engine   EngineConfig   (engine/config.py)    the native engine
        tp       TPConfig       (parallel/tp.py)      tensor-parallel rollout engines over torchrun's group
        memory   MemoryConfig   (memory/config.py)    the phase-aware memory manager (off: plan resident)
        backend  BackendConfig  (backends.py)         the rollout backend: native | sglang
        fsdp     FSDPConfig     (parallel/fsdp.py)    the trainer's FSDP2 when the step runs over a group
        cosched  CoschedConfig  (cosched/controller.py) the prefix co-scheduler (used with rl.cosched)

    build(cfg, ...) -> System   policy <- cfg.model (HF dir / cached id | preset: random weights |
                                          None: the embedded tiny model), unless a model is given
                                [format warm-up: cfg.format_warmup_steps supervised steps]
                                [TP shard: tp.tensor_parallel > 1, over torchrun's group: a TPPlan]
                                [compile: cfg.compile, None = on CUDA]
                                memory  <- MemoryManager when cfg.memory.managed
                                rollout <- Engine(policy | its TP shard, tp=plan) | the SGLang backend
                                rl      <- RLStep(..., parallel=data_parallel(group)): data-parallel
                                           when torchrun started the process group (placement "auto")

The server's ServerConfig (server/state.py) is a SystemConfig with the server's own settings added;
the demo, the step and memory benchmarks build theirs with their own defaults. Every entry point's
flags are generated from its config by rollplex/cli.py, so an option has one flag everywhere and a
new config field is a new flag with nothing restated.

`__post_init__` resolves the device and dtype and checks what spans components (each nested config
checks its own fields): the co-scheduler needs the native engine and something to move (a reference
model, kl_coef > 0, or an old policy, num_updates > 1); a tensor-parallel engine is the native one;
an SGLang backend must be installed, checked before anything is loaded. Checks that need the process
group (its size) are `check_group`'s, called by build before any rank loads a model.

The placement (one process, data-parallel over torchrun's group, or a given group) is build's
`group` argument, not a config field: a process group is a runtime handle. A caller may hand build
its own policy (`model`: the benchmarks' random weights) and native engine (`engine`: the parallel
benchmark shares one across its paths).

A rank may hold one part of the system (`build(..., part=)`): "trainer", the RL step with no rollout
backend (it trains batches others roll out), or "rollout", the engine alone, its model split in place
over a given tensor-parallel group. `build_disaggregated` builds the disaggregated step
(parallel/disaggregated_step.py: trainer and rollout ranks apart, weights broadcast) from one config:
each rank its role's part.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from .backends import BackendConfig, require_backend, rollout_backend
from .cosched import CoschedConfig
from .engine import Engine, EngineConfig
from .memory import TAGS, MemoryConfig, MemoryManager, PhasePlan
from .models import load_model
from .models.hub import looks_like_hub_id, resolve_model_dir
from .parallel import new_rollout_group, tensor_parallel_copy
from .parallel.colocated import data_parallel
from .parallel.data_parallel import check_passes
from .parallel.disaggregated import DisaggregatedLayout, init_disaggregated
from .parallel.disaggregated_step import DisaggregatedStep
from .parallel.fsdp import DTYPES as FSDP_DTYPES
from .parallel.fsdp import FSDPConfig
from .parallel.tp import TPConfig, apply_tensor_parallel
from .presets import random_model
from .rl.config import RLConfig
from .rl.step import RLStep
from .rl.warmup import format_warmup
from .tiny import ensure_tiny, shape_color

log = logging.getLogger("rollplex.system")

DEVICES = ("cuda", "cpu")
DTYPES = ("bfloat16", "float32")
PARTS = ("whole", "trainer", "rollout")


@dataclass
class SystemConfig:
    model: str | None = None  # HF directory, cached HF model id or preset name; None: the embedded tiny model
    device: str | None = None  # default: cuda if available
    dtype: str | None = None  # default: bfloat16 on cuda, float32 on cpu
    compile: bool | None = None  # torch.compile the policy's forward (prefill, training); None: on cuda
    format_warmup_steps: int = 0  # supervised answer-format steps on the shape-colour task before the engine
    rl: RLConfig = field(default_factory=RLConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)  # which regions are resident in which phase
    backend: BackendConfig = field(default_factory=BackendConfig)  # the rollout backend: native | sglang
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)  # the trainer's and reference's FSDP2 over a group
    cosched: CoschedConfig = field(default_factory=CoschedConfig)  # the prefix co-scheduler (rl.cosched)
    tp: TPConfig = field(default_factory=TPConfig)  # tensor-parallel rollout engines under torchrun

    def __post_init__(self):
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cuda or cpu, got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("--device cuda but CUDA is not available (use --device cpu)")
        if self.dtype is None:
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be bfloat16 or float32, got {self.dtype!r}")
        if self.format_warmup_steps < 0:
            raise ValueError("format_warmup_steps must be >= 0")
        rl, native = self.rl, self.backend.rollout_backend == "native"
        if rl.cosched and not native:
            raise ValueError(f"cosched needs the native rollout backend: with {self.backend.rollout_backend} the "
                             "co-scheduler runs in its scheduler (engine_patches.sglang.CoschedHook)")
        if rl.cosched and rl.kl_coef <= 0 and rl.num_updates == 1:
            # nothing to move: no reference model, and the old policy's logprobs are the rollout's own
            raise ValueError("cosched moves the reference model's prefix work: it needs kl_coef > 0 (or "
                             "ppo_epochs x ppo_mini_batches > 1, whose old-policy prefix it moves)")
        if self.tp.tensor_parallel > 1 and not native:
            raise ValueError(f"tensor_parallel {self.tp.tensor_parallel} shards the native engine; the "
                             f"{self.backend.rollout_backend} backend has its own (leave --tensor-parallel at 1)")
        if not native:
            try:  # before any model is loaded: a missing SGLang fails the start at once
                require_backend(self.backend.rollout_backend, self.backend)
            except ImportError as e:
                raise ValueError(str(e)) from None


def check_group(cfg: SystemConfig, world: int) -> None:
    """ValueError for a config that cannot run over a process group of `world` ranks (before any rank starts
    building, so every rank fails the same way)."""
    if world == 1:
        return
    if cfg.backend.rollout_backend != "native":
        raise ValueError(f"the {cfg.backend.rollout_backend} rollout backend is not served over a process group "
                         "yet: every rank's native engine samples the rollouts (leave --rollout-backend at native)")
    if world % cfg.tp.tensor_parallel:
        raise ValueError(f"--tensor-parallel {cfg.tp.tensor_parallel} over {world} ranks: a tensor-parallel "
                         f"engine spans a share of the group's ranks, so its degree must divide {world} (1: each "
                         "rank's engine decodes the full policy)")
    check_passes(cfg.rl.mode, cfg.rl.packed)


def load_policy(cfg: SystemConfig):
    """(model dir or None, model in eval mode, processor or None) for `cfg.model`."""

    dtype = getattr(torch, cfg.dtype)
    if cfg.model is None:
        path = ensure_tiny()
    elif Path(cfg.model).is_dir() or looks_like_hub_id(cfg.model):  # a directory or a cached HF model id
        path = resolve_model_dir(cfg.model)
    else:  # a preset: the real shapes with random weights and no tokenizer (token-id prompts only)

        model = random_model(cfg.model, cfg.device, dtype, seed=cfg.rl.seed)  # warns: random weights
        log.warning("preset %s has no tokenizer: prompts must be input_ids", cfg.model)
        return None, model.eval(), None
    from .processor import VLProcessor  # transformers' tokenizers and image processors: seconds of import, paid on load

    return path, load_model(path, cfg.device, dtype).eval(), VLProcessor.from_pretrained(path)


@dataclass
class System:
    """What build assembled. `model` is what the engine decodes and the step trains (rl.model: the policy,
    or this rank's tensor-parallel shard of it); `engine` is the native engine (None with another rollout
    backend), `rollout` the backend the step rolls out with; `rl` is None when build was asked for none."""

    config: SystemConfig
    model: object
    processor: object | None
    model_path: Path | None
    engine: Engine | None
    rollout: object | None
    memory: MemoryManager | None
    rl: RLStep | None
    world_size: int = 1
    warmup_loss: float | None = None
    startup_s: dict[str, float] = field(default_factory=dict)  # seconds per assembly phase, in order
    _policy: object = None  # the whole policy the engine's model was cut from (rl_step builds over it)
    _parallel_group: object = "auto"

    def rl_step(self, rl: RLConfig | None = None, *, rollout: bool = True, cosched: CoschedConfig | None = None,
                backend=None, **kw) -> RLStep:
        """Another RLStep over this system's model, rollout backend, memory manager and placement: `rl` and
        `cosched` (default: the config's), without a rollout backend when not `rollout` (train() on given
        batches), or with `backend` instead of the system's (a benchmark's second engine); kw: RLStep's
        reward_fn, ref_model, processor."""
        cfg = self.config
        if self._policy is None:
            raise ValueError("the whole policy was dropped for its tensor-parallel shard: build with step=False "
                             "to make RL steps with System.rl_step")
        rl = rl or cfg.rl
        backend = backend if backend is not None else self.rollout if rollout else None
        kw.setdefault("processor", self.processor)
        return RLStep(self._policy, backend, rl, memory=self.memory, memory_cfg=cfg.memory,
                      cosched=cosched or cfg.cosched,
                      parallel=data_parallel(self._policy, backend, rl, self._parallel_group, fsdp=cfg.fsdp), **kw)

    def close(self) -> None:
        if self.rl is not None:
            self.rl.backend.close()


def build(cfg: SystemConfig, *, model=None, processor=None, model_path: Path | None = None, reward_fn=None,
          ref_model=None, group="auto", step: bool = True, warmup_rows: list | None = None,
          managed: bool | None = None, engine: Engine | None = None, logger: logging.Logger | None = None,
          part: str = "whole", tp_group=None) -> System:
    """Assemble `cfg` (see the module docstring). model / processor / model_path: a policy built by the
    caller (a benchmark's random weights) instead of loading cfg.model; reward_fn, ref_model: the RLStep's;
    group: the data-parallel placement ("auto": torchrun's default group when it has more than one rank,
    None: this process alone, or a process group); step: False builds no RLStep (System.rl_step makes
    them); warmup_rows: the format warm-up's rows (default: 256 shape-colour rows); managed: whether a
    memory manager is built (default: cfg.memory.managed); engine: a native engine the caller built over
    `model` or its tensor-parallel shard, used as is (the parallel benchmark shares one across its paths);
    logger: where the startup phases are logged; part: the whole system, or only its "trainer" (the RL step
    without a rollout backend) or its "rollout" (the engine, no step) part; tp_group: the process group a
    "rollout" part's engine is tensor-parallel over, its model split in place (None: cfg.tp's engines).
    The global RNG is seeded (rl.seed) when the policy is loaded here; a caller's model comes with the
    caller's RNG state."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    if tp_group is not None and part != "rollout":
        raise ValueError("tp_group is the group of a rollout part's engine (part='rollout')")
    lg = logger or log
    out = System(cfg, None, processor, model_path, None, None, None, None, _parallel_group=group)

    def phase(name: str, t0: float) -> float:
        out.startup_s[name] = time.perf_counter() - t0
        return out.startup_s[name]

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    out.world_size = world if group == "auto" else (1 if group is None else dist.get_world_size(group))
    check_group(cfg, world if group == "auto" else out.world_size)
    t0 = time.perf_counter()
    if model is None:
        torch.manual_seed(cfg.rl.seed)
        out.model_path, model, out.processor = load_policy(cfg)
        lg.info("startup: weights loaded in %.1fs (%s)", phase("weights", t0), out.model_path or cfg.model)
    if cfg.format_warmup_steps:
        if out.processor is None:
            raise ValueError("--format-warmup-steps needs a model with a tokenizer")

        t0 = time.perf_counter()
        rows = warmup_rows if warmup_rows is not None else shape_color.make_rows(256, seed=cfg.rl.seed)
        out.warmup_loss = format_warmup(model, out.processor, rows, shape_color.LETTERS, cfg.format_warmup_steps,
                                        lr=1e-3, seed=cfg.rl.seed, progress=sys.stderr.isatty())  # no bar in a log
        model.eval()
        lg.info("startup: format warm-up in %.1fs (%d steps, loss %.3f)", phase("format_warmup", t0),
                cfg.format_warmup_steps, out.warmup_loss)
        if out.world_size > 1:
            # the warm-up's updates may round differently per device: every rank starts from rank 0's weights
            with torch.no_grad():
                for t in (*model.parameters(), *model.buffers()):
                    dist.broadcast(t.data, src=0)
    decoded, plan = model, None  # what the engine decodes: the policy, or this rank's tensor-parallel shard
    tp = cfg.tp.tensor_parallel
    if tp_group is not None:
        plan = apply_tensor_parallel(model, tp_group)
    elif tp > 1 and engine is None and part != "trainer":
        if world % tp:
            raise ValueError(f"--tensor-parallel {tp} needs a torchrun group of a multiple of as many ranks "
                             f"(this one has {world})")
        # engines of tp ranks, grouped for weight sharing (every rank creates every engine's group, in
        # the same order); the weight sync rewrites the shards, the vision tower is the policy's
        vision = cfg.tp.tensor_parallel_vision
        decoded, plan = tensor_parallel_copy(model, new_rollout_group(model.cfg, tp, vision=vision), vision)
    if cfg.compile if cfg.compile is not None else model.inv_freq.is_cuda:
        model.compile()  # lazy: the engine's warm-up prefill compiles
        if decoded is not model:
            decoded.compile()
    # the phase-aware memory manager: the KV cache is released outside rollout, the rest follows the plan
    if (cfg.memory.managed if managed is None else managed) and engine is None and part != "trainer":
        out.memory = MemoryManager(PhasePlan.releases_only(), cfg.device, backend=cfg.memory.memory_backend)
    t0 = time.perf_counter()
    if part == "trainer":
        pass  # the batches it trains are rolled out elsewhere
    elif cfg.backend.rollout_backend != "native":
        if out.model_path is None:
            raise ValueError(f"the {cfg.backend.rollout_backend} rollout backend starts on a checkpoint directory: "
                             "give --model DIR (a preset has none)")
        try:
            out.rollout = rollout_backend(cfg.backend, str(out.model_path), out.processor, cfg.dtype, cfg.rl.seed)
        except ImportError as e:
            raise ValueError(str(e)) from None
        lg.info("startup: %s rollout engine in %.1fs", cfg.backend.rollout_backend,
                phase(f"{cfg.backend.rollout_backend}_engine", t0))
    elif engine is not None:
        out.rollout = out.engine = engine
        out.memory = engine.memory
    else:
        out.rollout = out.engine = Engine(decoded, out.processor, cfg.engine, memory=out.memory, tp=plan)
        runner = out.engine.runner
        out.startup_s.update(runner.startup_s)
        lg.info("startup: engine in %.1fs: KV cache sizing %.1fs (on GPU a warm-up prefill, its compile "
                "included), decode kernel tuning %.1fs, decode compile + graph capture %.1fs; KV cache %d blocks "
                "of %d tokens", phase("engine", t0), runner.startup_s["kv_sizing"], runner.startup_s["tuning"],
                runner.startup_s["capture"], out.engine.blocks.num_blocks, out.engine.cfg.block_size)
    out._policy = out.model = model
    if step and part != "rollout":
        t0 = time.perf_counter()
        out.rl = out.rl_step(reward_fn=reward_fn, ref_model=ref_model, rollout=part != "trainer")
        lg.info("startup: trainer in %.1fs (reference model: %s)", phase("trainer", t0),
                "yes" if out.rl.ref is not None else "no")
        # the step's model: the policy, or this rank's tensor-parallel shard of it, in which case the whole
        # policy loaded above is dropped here (the trainer's and the engine's shards replace it)
        out.model = out.rl.model
        out._policy = None if out.model is not model else model
        if out.memory is not None:
            held = tuple(t for t in TAGS if not ((t == "ref_weights" and out.rl.ref is None)
                                                 or (t.startswith("critic_") and out.rl.critic is None)))
            lg.info("memory (%s backend):\n%s", out.memory.backend.name,
                    out.memory.plan.table(out.rl.memory_sizes(), out.rl.activation_estimate(), held))
    return out


def build_disaggregated(cfg: SystemConfig, layout: DisaggregatedLayout, *, model, processor=None,
                        reward_fn=None) -> DisaggregatedStep:
    """This rank's part of the disaggregated step (parallel/disaggregated_step.py) over torchrun's group: a
    trainer rank builds the "trainer" part, data-parallel over the trainer ranks; a rollout rank the "rollout"
    part over its engine's ranks, `model` cast to the layout's wire dtype. model: the initial policy, the same
    full weights on every rank. No memory manager: the layout keeps every tensor resident."""
    d = init_disaggregated(layout, model.inv_freq.device.type)
    if d.role == "train":
        system = build(cfg, model=model, processor=processor, reward_fn=reward_fn, group=d.train_mesh.get_group(),
                       managed=False, part="trainer")
        return DisaggregatedStep(d, cfg.rl, processor, rl=system.rl)
    system = build(cfg, model=model.to(FSDP_DTYPES[layout.wire_dtype]), processor=processor, group=None,
                   managed=False, part="rollout", tp_group=d.tp_group)
    return DisaggregatedStep(d, cfg.rl, processor, engine=system.engine)
