"""`python -m torch.distributed.run --nproc-per-node N -m rollplex.bench parallel COMMAND`: the multi-process
paths end to end, on a synthetic rollout (random prompts, every other one with an image; random
responses and rewards). Rank 0 prints one JSON line.

    train          FSDP2 data-parallel actor update(s) over all ranks (parallel/data_parallel.py)
    decode         the engine with the model tensor-parallel over all ranks (parallel/tp.py)
    disaggregated  --steps RL steps of the disaggregated layout (DisaggregatedStep, random rewards):
                   --train-ranks trainer ranks, rollout engines of --rollout-tp ranks on the rest;
                   rollout, reference scoring, update, weight broadcast; per-rank timings
    step           the whole RL step through RLStep's data-parallel path against one process:
                   --check, then --bench (the warm W3B step both ways); its own options (parallel_step.py,
                   `... -m rollplex.bench parallel step --help`)

--check (train, decode): rank 0 also runs the single-process path on a copy of the model and reports
the largest difference (train: weights after the update; decode: tokens, logprobs). --model: a
checkpoint directory or a preset name (random weights, seeded); default: the embedded tiny checkpoint.
--device cuda: NCCL, one GPU per process (torchrun's LOCAL_RANK).

The flags are SystemConfig's (rollplex/cli.py: the RL step's and the engine's sections, `--model`,
`--device`, `--dtype`, `--seed`), with this bench's defaults; `--samples` and `--new-tokens` are
`--n` and `--max-new-tokens`. The bench's own: the synthetic workload, the disaggregated layout,
`--steps`, `--check`, and the rollout `--temperature` (0: greedy).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ..cli import ConfigParser
from ..engine import Engine, SamplingParams
from ..models import ModelConfig, ModelInputs, Qwen25VL, init_weights, load_model
from ..parallel.data_parallel import DataParallelActor
from ..parallel.disaggregated import DisaggregatedLayout
from ..parallel.fsdp import DTYPES, FSDPConfig, full_state_dict, full_tensor
from ..parallel.launch import Process, init_from_env
from ..parallel.tp import apply_tensor_parallel
from ..presets import preset
from ..rl.actor import Actor
from ..rl.algos import grpo_advantages
from ..rl.batch import RolloutBatch
from ..rl.config import RLConfig
from ..system import SystemConfig, build_disaggregated
from ..tiny import ensure_tiny
from . import parallel_step


def build_model(proc: Process, name: str | None, dtype: torch.dtype, seed: int) -> Qwen25VL:
    """The same weights on every rank: a checkpoint, or a preset initialised from `seed`."""
    if name is None:
        if proc.local_rank == 0:  # one writer per machine
            ensure_tiny()
        dist.barrier()
        name = str(ensure_tiny())
    if Path(name).is_dir():
        return load_model(name, proc.device, dtype).eval()
    with torch.device(proc.device):
        model = Qwen25VL(preset(name))
    return init_weights(model, seed=seed).to(dtype).eval()


def synthetic_prompts(cfg: ModelConfig, count: int, length: int, grid: int, seed: int) -> list[ModelInputs]:
    """Random text prompts of `length` tokens; even ones start with a grid x grid-patch image (0: none)."""
    g = torch.Generator().manual_seed(seed)
    special = min(cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id)
    m = cfg.vision.spatial_merge_size
    out = []
    for i in range(count):
        ids = torch.randint(3, special, (length,), generator=g).tolist()
        if grid and i % 2 == 0:
            if grid % m:
                raise ValueError(f"--image-grid must be a multiple of the merge size {m}")
            vis = [cfg.vision_start_token_id, *[cfg.image_token_id] * (grid * grid // (m * m)), cfg.vision_end_token_id]
            out.append(ModelInputs(vis + ids, torch.randn(grid * grid, cfg.vision.patch_dim, generator=g),
                                   torch.tensor([[1, grid, grid]])))
        else:
            out.append(ModelInputs(ids))
    return out


def synthetic_batch(cfg: ModelConfig, prompts: list[ModelInputs], n: int, max_len: int, seed: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed + 1)
    special = min(cfg.image_token_id, cfg.vision_start_token_id)
    group = [i for i in range(len(prompts)) for _ in range(n)]
    responses = [torch.randint(3, special, (int(torch.randint(1, max_len + 1, (1,), generator=g)),),
                               generator=g).tolist() for _ in group]
    rewards = torch.rand(len(group), generator=g).tolist()
    return RolloutBatch.from_samples(prompts, group, responses, pad_id=0, rewards=rewards)


def _fsdp(cfg: SystemConfig) -> FSDPConfig:
    # fp32 shards are the masters; bf16 only as the layers' compute dtype
    return FSDPConfig(param_dtype="bfloat16", reduce_dtype="float32") if cfg.dtype == "bfloat16" else FSDPConfig()


def _sync(proc: Process) -> None:
    if proc.device.type == "cuda":
        torch.cuda.synchronize(proc.device)


def cmd_train(proc: Process, args, system: SystemConfig) -> dict:
    rl = system.rl
    model = build_model(proc, system.model, torch.float32, rl.seed)
    ref = copy.deepcopy(model) if args.check and proc.rank == 0 else None
    cfg = model.cfg
    batch = synthetic_batch(cfg, synthetic_prompts(cfg, args.prompts, args.prompt_len, args.image_grid, rl.seed),
                            rl.n, rl.max_new_tokens, rl.seed)
    adv = grpo_advantages(batch.rewards, batch.group)
    actor = DataParallelActor(model, rl, init_device_mesh(proc.device.type, (proc.world,)), _fsdp(system))
    grads = _first_step_grads(actor.optimizer, model) if args.check else {}
    times, metrics = [], {}
    for s in range(args.steps):
        t0 = time.perf_counter()
        metrics, _ = actor.update(batch, adv, None, step_idx=s)
        _sync(proc)
        times.append(round(time.perf_counter() - t0, 4))
    out = {"step_s": times, "metrics": metrics}
    if args.check:
        full = full_state_dict(model)
        if ref is not None:
            single = Actor(ref, rl)
            want_grads = _first_step_grads(single.optimizer, ref)
            for s in range(args.steps):
                want, _ = single.update(batch, adv, None, step_idx=s)
            w = dict(ref.named_parameters())
            out["check"] = {
                # Adam's first steps are ~lr * sign(grad): rounding noise in a near-zero gradient element moves
                # its weight by up to 2 lr, so the gradients are the sharper comparison
                "max_rel_grad_diff": max(((grads[n] - g).norm() / g.norm().clamp_min(1e-12)).item()
                                         for n, g in want_grads.items()),
                "max_abs_weight_diff": max((full[n] - w[n].detach()).abs().max().item() for n in full),
                "grad_norm_diff": abs(metrics["actor/grad_norm"] - want["actor/grad_norm"])}
    return out


def _first_step_grads(optimizer, model: Qwen25VL) -> dict:
    """Filled with the full gradients the optimizer's first step reads (gathered from FSDP shards)."""
    out: dict = {}
    step = optimizer.step

    def capture():
        if not out:
            out.update({n: full_tensor(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None})
        step()

    optimizer.step = capture
    return out


def _generate(engine: Engine, prompts: list[ModelInputs], args, rl: RLConfig) -> tuple[list, float]:
    sp = SamplingParams(max_new_tokens=rl.max_new_tokens, temperature=args.temperature, n=rl.n, seed=rl.seed,
                        ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sp)
    return outs, time.perf_counter() - t0


def cmd_decode(proc: Process, args, system: SystemConfig) -> dict:
    model = build_model(proc, system.model, DTYPES[system.dtype], system.rl.seed)
    ref = copy.deepcopy(model) if args.check and proc.rank == 0 else None
    prompts = synthetic_prompts(model.cfg, args.prompts, args.prompt_len, args.image_grid, system.rl.seed)
    tp = apply_tensor_parallel(model)
    outs, dt = _generate(Engine(model, None, system.engine, tp=tp), prompts, args, system.rl)
    tokens = sum(len(s.token_ids) for o in outs for s in o.samples)
    out = {"generate_s": round(dt, 4), "tokens_per_s": round(tokens / dt, 1)}
    if ref is not None:
        want, _ = _generate(Engine(ref, None, system.engine), prompts, args, system.rl)
        pairs = [(a, b) for o, r in zip(outs, want) for a, b in zip(o.samples, r.samples)]
        out["check"] = {"tokens_equal": all(a.token_ids == b.token_ids for a, b in pairs),
                        "max_logprob_diff": max(abs(x - y) for a, b in pairs for x, y in zip(a.logprobs, b.logprobs))}
    return out


def cmd_disaggregated(proc: Process, args, system: SystemConfig) -> dict:
    """The disaggregated RL step (`DisaggregatedStep`) on synthetic prompts with random rewards: trainer
    ranks first, then rollout engines of `--rollout-tp` ranks; per-rank timings and the trainer's metrics."""
    if (proc.world - args.train_ranks) % args.rollout_tp or proc.world <= args.train_ranks:
        raise ValueError(f"{proc.world} ranks: {args.train_ranks} trainer ranks leave no whole engines of "
                         f"{args.rollout_tp} ranks")
    layout = DisaggregatedLayout(args.train_ranks, args.rollout_tp, (proc.world - args.train_ranks) // args.rollout_tp,
                                 wire_dtype=system.dtype)
    rl = system.rl
    model = build_model(proc, system.model, torch.float32, rl.seed)  # a rollout rank casts its shards
    prompts = synthetic_prompts(model.cfg, args.prompts, args.prompt_len, args.image_grid, rl.seed)
    params = [SamplingParams(max_new_tokens=rl.max_new_tokens, temperature=args.temperature, n=rl.n,
                             seed=rl.seed * 1_000_003 + i * 101, ignore_eos=True) for i in range(len(prompts))]
    step = build_disaggregated(dataclasses.replace(system, fsdp=_fsdp(system)), layout, model=model,
                               reward_fn="exact")
    metrics = {}
    for i in range(args.steps):
        g = torch.Generator().manual_seed(rl.seed + i)
        metrics = step.run(prompts, params, rewards=torch.rand(len(prompts) * rl.n, generator=g).round())
    timing = {k.removeprefix("timing_s/"): round(v, 4) for k, v in metrics.items() if k.startswith("timing_s/")}
    every = [None] * proc.world
    dist.all_gather_object(every, {"role": step.role, **timing})
    out = {"layout": {"train": layout.train, "rollout_tp": layout.rollout_tp, "replicas": layout.replicas},
           "per_rank": every}
    if step.role == "train":
        out["metrics"] = {k: metrics[k] for k in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean")}
    return out


COMMANDS = {"train": cmd_train, "decode": cmd_decode, "disaggregated": cmd_disaggregated}

# The bench's defaults over SystemConfig's; what it sets itself (compile off, FSDP from --dtype, the engine's
# max_model_len from the prompt and decode lengths unless given) and the rollout's temperature (greedy by
# default, which RLConfig's temperature does not allow) are its own
DEFAULTS = {"device": "cpu", "dtype": "float32", "rl": RLConfig(n=2, max_new_tokens=8, lr=1e-4, micro_batch_prompts=2)}
SKIP = ("compile", "format_warmup_steps", "memory", "backend", "fsdp", "tp", "cosched", "rl.temperature")


def parser() -> ConfigParser:
    ap = ConfigParser(SystemConfig, DEFAULTS, skip=SKIP, description=__doc__.splitlines()[0],
                      prog="python -m torch.distributed.run --nproc-per-node N -m rollplex.bench parallel",
                      aliases={"rl.n": ("--samples",), "rl.max_new_tokens": ("--new-tokens",)},
                      help={"device": "cpu (gloo) or cuda (NCCL, one GPU per process)",
                            "dtype": "rollout weights / training compute dtype (training keeps fp32 shards)",
                            "max_new_tokens": "decode length (train: longest random response)",
                            "max_model_len": "default: the prompt and decode lengths + 64"})
    ap.add_argument("command", choices=[*sorted(COMMANDS), "step"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--image-grid", type=int, default=4, help="image patches per side on even prompts (0: none)")
    ap.add_argument("--temperature", type=float, default=0.0, help="rollout temperature (0: greedy)")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--train-ranks", type=int, default=1, help="disaggregated: trainer ranks")
    ap.add_argument("--rollout-tp", type=int, default=1, help="disaggregated: ranks per rollout engine")
    ap.add_argument("--check", action="store_true", help="train / decode: compare with one process on rank 0")
    return ap


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["step"]:
        parallel_step.main(argv[1:])
        return
    ap = parser()
    args = ap.parse_args(argv)
    given = ap.given(args)
    max_len = {} if "engine.max_model_len" in given else {
        "engine.max_model_len": args.prompt_len + given.get("rl.max_new_tokens", DEFAULTS["rl"].max_new_tokens) + 64}
    try:
        system = ap.config(args, **max_len)
    except ValueError as e:
        ap.error(str(e))
    if min(args.steps, args.prompts, system.rl.n, system.rl.max_new_tokens) < 1:
        ap.error("--steps, --prompts, --samples and --new-tokens must be >= 1")
    proc = init_from_env(system.device)
    try:
        report = {"command": args.command, "world": proc.world, **COMMANDS[args.command](proc, args, system)}
        dist.barrier()
        if proc.rank == 0:
            print(json.dumps(report), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
