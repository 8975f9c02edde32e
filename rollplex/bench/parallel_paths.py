"""The paths the data-parallel step bench runs (parallel_step.py): one process, the colocated data-parallel
step (trainer shards inside the policy or apart, rollplex or serial mode, per-rank or tensor-parallel
rollout groups) and the disaggregated step, each built the same way and stepped with the same seeded
prompts and rewards, so their results can be compared and their times set side by side."""

from __future__ import annotations

import dataclasses
import gc
import time

import torch
import torch.distributed as dist

from ..engine import Engine, EngineConfig, SamplingParams
from ..memory import MemoryConfig
from ..models import Qwen25VL
from ..parallel.disaggregated import DisaggregatedLayout
from ..parallel.fsdp import FSDPConfig, full_tensor
from ..parallel.rollout_groups import new_rollout_group
from ..parallel.tp import tensor_parallel_copy
from ..rl.config import RLConfig
from ..rl.step import RLStep
from ..system import SystemConfig, build, build_disaggregated


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bench_rewards(num: int, seed: int) -> torch.Tensor:
    return torch.rand(num, generator=torch.Generator().manual_seed(seed)).round()


def sampling_params(n_prompts: int, n: int, new_tokens: int, seed: int) -> list[SamplingParams]:
    # seeded per prompt: a prompt's samples do not depend on which rank generates it
    return [SamplingParams(n=n, max_new_tokens=new_tokens, ignore_eos=True, seed=seed * 100_003 + i * 101)
            for i in range(n_prompts)]


def engine_config(system: SystemConfig, max_len: int, compile_decode: bool) -> EngineConfig:
    """The bench's engine settings with the length its prompts need and decode compiled with the model or not."""
    return dataclasses.replace(system.engine, max_model_len=max_len, compile_decode=None if compile_decode else False)


def policy_engine(model: Qwen25VL, system: SystemConfig, max_len: int, compile_decode: bool) -> Engine:
    return Engine(model, None, engine_config(system, max_len, compile_decode))


def capture_grads(rl: RLStep) -> list[dict]:
    grads: list[dict] = []
    step = rl.actor.optimizer.step

    def capture():
        order = rl.parallel.weights.natural if rl.parallel is not None else (lambda n, t: t)
        grads.append({n: order(n, full_tensor(p.grad)).float().clone() for n, p in rl.actor.model.named_parameters()
                      if p.grad is not None})
        step()

    rl.actor.optimizer.step = capture
    return grads


def one_step(rl: RLStep, prompts, params, seed: int, device: torch.device) -> tuple[dict, torch.Tensor]:
    """Rollout, rewards, reference scoring, update (and weight sync): (metrics with timings, tokens)."""
    sync_device(device)
    t0 = time.perf_counter()
    batch = rl.generate(prompts, params)
    sync_device(device)
    gen_s = time.perf_counter() - t0
    batch.rewards = bench_rewards(batch.num_samples, seed)
    m = rl.train(batch)
    m.update(rl.rollout_metrics)
    sync_device(device)
    m["timing_s/gen"] = gen_s
    m["timing_s/step"] = time.perf_counter() - t0
    return m, batch.responses


def path_spec(spec: str, known: dict) -> tuple[str, dict]:
    """`name` or `name:key=value,...` (FSDPConfig fields for this path) -> (name, {field: value})."""
    name, _, rest = spec.partition(":")
    if name not in known:
        raise ValueError(f"--paths: unknown path {name!r} (choose from {sorted(known)})")
    fields = {f.name: f.type for f in dataclasses.fields(FSDPConfig)}
    over = {}
    for item in filter(None, rest.split(";")):
        key, _, value = item.partition("=")
        if key not in fields or name == "single":
            raise ValueError(f"--paths: {spec!r}: {key!r} is not an FSDPConfig field of a data-parallel path")
        over[key] = (value.lower() in ("1", "true") if "bool" in str(fields[key])
                     else int(value) if "int" in str(fields[key]) else value)
    return name, over


def bench_paths(args) -> list[tuple[str, dist.ProcessGroup | None, FSDPConfig | None]]:
    """(label, group, FSDP config) of each path `--paths` names, in order; "single" comes first. A path
    may carry FSDPConfig fields, `parallel:layers_per_unit=4;reshard_after_forward=false`."""
    known = {"single": None, "parallel": {}, "parallel-copy": {"share_policy_storage": False},
             "parallel-serial": {}, "disaggregated": {}}
    specs = [path_spec(x, known) for x in args.paths.split(",")]
    labels = [x for x in args.paths.split(",")]
    if len(set(labels)) != len(labels):
        raise ValueError("--paths: a path is named twice")
    names = [n for n, _ in specs]
    if "single" not in names or len(names) < 2:
        raise ValueError("--paths needs single and at least one data-parallel path")
    paths = {}
    for label, (name, over) in zip(labels, specs):
        paths[label] = (None, None) if name == "single" else (
            dist.group.WORLD, FSDPConfig(**{**known[name], **over}))
    # the disaggregated path turns its rollout ranks' model into shards: it runs last, on a copy
    order = (["single"] + [x for x in labels if x != "single" and base(x) != "disaggregated"]
             + [x for x in labels if base(x) == "disaggregated"])
    return [(label, *paths[label]) for label in order]


def base(label: str) -> str:
    """A path's kind: its label without FSDP settings."""
    return label.partition(":")[0]


def disaggregated_layout(train_ranks: int, rollout_tp: int, world: int, wire_dtype: str) -> DisaggregatedLayout:
    train = train_ranks or world // 2
    if not 0 < train < world or (world - train) % rollout_tp:
        raise ValueError(f"disaggregated: {train} trainer ranks of {world} leave no whole rollout engines of "
                         f"--rollout-tp {rollout_tp} ranks")
    return DisaggregatedLayout(train, rollout_tp, (world - train) // rollout_tp, wire_dtype=wire_dtype)


class BenchPath:
    """One path's step: a colocated `RLStep` (one process or data-parallel) or the disaggregated step."""

    def __init__(self, label: str, model: Qwen25VL, engine_fn, rl_cfg: RLConfig, group, fsdp, args, wire_dtype: str):
        self.ds = None
        if base(label) == "parallel-serial":  # serial colocation: every sample its own sequence, no prefix sharing
            # (and nothing to co-schedule: the baseline runs its phases in turn)
            rl_cfg = dataclasses.replace(rl_cfg, mode="serial", cosched=False, micro_batch_prompts=1)
        if base(label) == "disaggregated":
            rl_cfg = dataclasses.replace(rl_cfg, cosched=False)  # its trainer ranks never decode
            system = engine_fn.system
            ecfg = engine_config(system, engine_fn.max_len, engine_fn.compile_decode)
            layout = disaggregated_layout(args.train_ranks, system.tp.tensor_parallel, dist.get_world_size(),
                                          wire_dtype)
            cfg = SystemConfig(device=model.inv_freq.device.type, dtype=wire_dtype, compile=False, rl=rl_cfg,
                               engine=ecfg, fsdp=fsdp or FSDPConfig())
            self.ds = build_disaggregated(cfg, layout, model=model, reward_fn="exact")
            self.rl = self.ds.rl  # None on rollout ranks
        else:
            # the path's placement (one process: group None; data-parallel over `group`) and its engine, shared
            # with the previous path of the same kind, assembled by rollplex.system.build
            engine = engine_fn(group)
            cfg = SystemConfig(device=model.inv_freq.device.type, dtype=wire_dtype, compile=False, rl=rl_cfg,
                               engine=engine.cfg, memory=MemoryConfig(memory_plan="resident"),
                               fsdp=fsdp or FSDPConfig())
            self.rl = build(cfg, model=model, engine=engine, group=group, reward_fn="exact").rl
        self.model = model

    def step(self, prompts, params, seed: int, device: torch.device) -> tuple[dict, torch.Tensor]:
        if self.ds is None:
            return one_step(self.rl, prompts, params, seed, device)
        n = sum(p.n for p in params)
        m = self.ds.run(prompts, params, rewards=bench_rewards(n, seed))
        m["timing_s/sync_weights"] = m.get("timing_s/sync_weights", 0.0) + m.pop("timing_s/broadcast_weights")
        tokens = self.ds.last_batch.responses if self.ds.last_batch is not None else torch.empty(0)
        return m, tokens


@dataclasses.dataclass
class EngineFactory:
    """Builds a colocated path's engine (`path_engine`); the disaggregated path reads its settings."""

    model: Qwen25VL
    system: SystemConfig  # its engine and tp sections
    max_len: int
    compile_decode: bool
    engine: Engine | None = None  # reuse: the engine built for the previous path of the same kind

    def __call__(self, group) -> Engine:
        tp = group is not None and self.system.tp.tensor_parallel > 1
        if self.engine is None or (self.engine.model is not self.model) != tp:
            self.engine = None
            free_memory()
            self.engine = path_engine(self.model, self.system, self.max_len, self.compile_decode, group)
        return self.engine


def path_engine(model: Qwen25VL, system: SystemConfig, max_len: int, compile_decode: bool, group) -> Engine:
    """The engine a path rolls out with: the policy itself, or under a group with `--rollout-tp` N > 1 this
    rank's tensor-parallel copy of it over its engine's N ranks (`new_rollout_group`: a data-parallel
    rollout group)."""
    size = system.tp.tensor_parallel
    if group is None or size == 1:
        return policy_engine(model, system, max_len, compile_decode)
    vision = system.tp.tensor_parallel_vision  # the vision tower's blocks split over the engine too
    tp_model, tp = tensor_parallel_copy(model, new_rollout_group(model.cfg, size, vision=vision), vision)
    if compile_decode:
        tp_model.compile()
    return Engine(tp_model, None, engine_config(system, max_len, compile_decode), tp=tp)
