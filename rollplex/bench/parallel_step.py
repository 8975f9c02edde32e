"""`python -m torch.distributed.run --nproc-per-node N -m rollplex.bench parallel step [--check] [--bench]`: the
RL step through `RLStep`'s data-parallel path (parallel/colocated.py) against the single-process step.

--check   correctness first, on a reduced fp32 copy of the shapes (`--check-layers` decoder layers and
          vision blocks, random weights): the whole step — rollout, reference scoring, update, weight
          sync — on one process and data-parallel over the group, from the same weights with the same
          seeded rollout and rewards. Every rank runs both; rank 0 reports whether the rollouts are equal
          token for token and the largest relative gradient, metric and absolute weight differences, and
          the command fails past `--tol` (the bench does not run).
--bench   the W3B step (`--prompts` x `--samples` samples, one `--image-size` image, or a video of
          `--frames` frames, + `--text-tokens` text tokens per prompt, `--new-tokens` new tokens; bf16
          and compiled on CUDA) on one process, then data-parallel, each from the same initial weights:
          `--warmup-steps` steps (dynamo compiles, allocator growth, first-call tuning, the OOM ladder
          settling; reported as `warm-up`) and then `--timed-steps` timed steps. Rank 0 prints a table
          of gen / ref / update / weight-sync / step seconds, graphs compiled, peak memory and any OOM
          back-off per step, each path's overhead against one process (medians of the timed steps),
          and the largest weight difference between the paths after their steps. The data-parallel
          path is given the default group explicitly, so at world size 1 it measures FSDP2 over a
          group of one (which `data_parallel(group="auto")` skips).
--paths   which paths run, single first: `parallel` (the trainer's shards inside the policy),
          `parallel-copy` (kept apart and copied in after each update), `parallel-serial` (serial
          colocation: the data-parallel step in serial mode), `disaggregated` (last:
          `--train-ranks` trainer ranks, the others rollout engines of `--rollout-tp` ranks, the
          weights broadcast after each update; its sync column is the broadcast).
          A data-parallel path may carry FSDPConfig fields after a colon, `;`-separated
          (`parallel:layers_per_unit=4`): the same step with other FSDP2 settings, side by side.
--rollout-tp N   the data-parallel paths roll out with tensor-parallel engines of N ranks, grouped for
          weight sharing (`new_rollout_group`; data-parallel rollout groups; N = the world size: one engine);
          `--vision-tp` splits the vision tower's blocks over them too.

On CPU (`--device cpu`) everything runs over gloo in fp32 with the same code, for tiny shapes:
`--preset tiny` (the embedded tiny checkpoint's shapes) or a checkpoint directory. Rewards are random
0/1 per sample (seeded): a model with random weights earns no task reward.

The flags are SystemConfig's (rollplex/cli.py: `--device`, `--compile`, the RL step's, the engine's and
the tensor-parallel sections) with the bench's defaults; its names from before are aliases: `--samples`
(`--n`), `--new-tokens` (`--max-new-tokens`), `--micro-prompts`, `--serial-samples`
(`--micro-batch-samples`), `--kv-memory` (`--gpu-memory-utilization`), `--rollout-tp`
(`--tensor-parallel`), `--vision-tp`. The workload, the paths, the check's sizes and the step counts
are its own.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from ..cli import ConfigParser
from ..engine import EngineConfig
from ..models import ModelConfig, Qwen25VL, init_weights
from ..parallel.launch import Process, init_from_env
from ..presets import preset
from ..rl.activation_checkpointing import activation_checkpointing
from ..rl.config import RLConfig
from ..rl.step import RLStep
from ..system import SystemConfig
from ..tiny import ensure_tiny
from .common import make_prompts
from .parallel_paths import BenchPath, EngineFactory, base, bench_paths, capture_grads, free_memory, sampling_params


def model_config(name: str) -> ModelConfig:
    """A preset name, "tiny" (the embedded tiny checkpoint), a checkpoint directory or an HF config.json."""
    if name == "tiny":
        name = str(ensure_tiny())
    if Path(name).is_dir() or name.endswith(".json"):
        return ModelConfig.from_hf(name)
    return preset(name)


def reduced(cfg: ModelConfig, layers: int) -> ModelConfig:
    """`cfg` with at most `layers` decoder layers and vision blocks (full attention where it was)."""
    v = cfg.vision
    depth = min(v.depth, layers)
    vision = dataclasses.replace(v, depth=depth, fullatt_block_indexes=tuple(i for i in v.fullatt_block_indexes
                                                                              if i < depth) or (depth - 1,))
    text = dataclasses.replace(cfg.text, num_hidden_layers=min(cfg.text.num_hidden_layers, layers))
    return dataclasses.replace(cfg, text=text, vision=vision)


def random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, compile_: bool) -> Qwen25VL:
    with torch.device(device):
        model = init_weights(Qwen25VL(cfg), seed=0, std=0.02)
    model = model.to(dtype).eval()
    if compile_:
        model.compile()
    return model


def check(proc: Process, args, system: SystemConfig) -> dict:
    """The reduced fp32 step on one process and data-parallel (see the module docstring)."""
    cfg = reduced(model_config(args.preset), args.check_layers)
    model = random_model(cfg, proc.device, torch.float32, compile_=False)
    prompts, _ = make_prompts(cfg, args.check_prompts, args.frames, size=args.image_size, text=args.text_tokens,
                              device=proc.device, dtype=torch.float32)
    # lr 1e-6: Adam's first step is ~lr * sign(grad), so rounding noise in a near-zero gradient moves a weight
    # by at most 2 lr, under the tolerance; the gradients are the sharper comparison
    rl_cfg = RLConfig(n=args.check_samples, kl_coef=0.01, lr=1e-6, micro_batch_prompts=2,
                      micro_batch_samples=system.rl.micro_batch_samples, max_new_tokens=args.check_tokens,
                      cosched=system.rl.cosched)
    params = sampling_params(len(prompts), args.check_samples, args.check_tokens, seed=3)
    max_len = len(prompts[0].input_ids) + args.check_tokens + 16
    out = {}
    for label, group, fsdp in bench_paths(args):
        m = copy.deepcopy(model)
        engine_fn = EngineFactory(m, system, max_len, False)
        path = BenchPath(label, m, engine_fn, rl_cfg, group, fsdp, args, "float32")
        grads = capture_grads(path.rl) if path.rl is not None else None
        metrics, tokens = path.step(prompts, params, seed=3, device=proc.device)
        if path.rl is not None:  # a disaggregated rollout rank trains nothing: rank 0 (a trainer) compares
            # the policy's whole weights (gathered from the trainer's shards under a tensor-parallel engine)
            out[label] = dict(metrics=metrics, tokens=tokens.cpu(), grads=grads,
                              weights={n: p.cpu() for n, p in path.rl.policy_state().items()})
        del path, m
        free_memory()
    cosched = {label: {"hidden_s": o["metrics"].get("rollplex/prefix_hidden_s", 0.0),
                       "sweep": "rollplex/prefix_sweep_rollout_end_s" in o["metrics"]} for label, o in out.items()}
    a = out.pop("single")
    keys = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm")
    res = {"paths": sorted(out), "tokens_equal": all(torch.equal(a["tokens"], b["tokens"]) for b in out.values()),
           "max_rel_grad_diff": max(((b["grads"][0][n] - g).norm() / g.norm().clamp_min(1e-12)).item()
                                    for b in out.values() for n, g in a["grads"][0].items()),
           "max_rel_metric_diff": max(abs(a["metrics"][k] - b["metrics"][k]) / max(abs(a["metrics"][k]), 1e-12)
                                      for b in out.values() for k in keys),
           "max_abs_weight_diff": max((a["weights"][n] - w).abs().max().item()
                                      for b in out.values() for n, w in b["weights"].items()),
           "weights_moved": any(not torch.equal(a["weights"][n], w.detach().cpu())
                                for n, w in model.named_parameters())}
    if system.rl.cosched:  # per path: prefix work hidden beside decode, and whether a sharded model's ran as a sweep
        res["cosched"] = cosched
    res["passed"] = bool(res["tokens_equal"] and res["weights_moved"] and
                         max(res["max_rel_grad_diff"], res["max_rel_metric_diff"], res["max_abs_weight_diff"])
                         <= args.tol)
    return res


def bench(proc: Process, args, system: SystemConfig) -> list[dict]:
    """The warm W3B step on one process, then data-parallel (see the module docstring)."""
    cuda = proc.device.type == "cuda"
    compiled = cuda and system.compile is not False
    rl_cfg = system.rl
    cfg = model_config(args.preset)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = random_model(cfg, proc.device, dtype, compile_=compiled)
    prompts, _ = make_prompts(cfg, args.prompts, args.frames, size=args.image_size, text=args.text_tokens,
                              device=proc.device, dtype=dtype)
    max_len = len(prompts[0].input_ids) + rl_cfg.max_new_tokens + 64
    engine_fn = EngineFactory(model, system, max_len, compiled)
    engine_fn(None)  # the policy's engine, built (and its decode compiled) before any path is timed
    init = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    rows, finals = [], {}
    for label, group, fsdp in bench_paths(args):
        with torch.no_grad():  # every path starts from the same weights (the reference is copied from them)
            for k, v in model.state_dict().items():
                v.copy_(init[k])
        policy = model
        if base(label) == "disaggregated":  # its rollout ranks shard their model: a copy, the engines freed first
            engine_fn.engine = None
            free_memory()
            policy = copy.deepcopy(model)
        path = BenchPath(label, policy, engine_fn, rl_cfg, group, fsdp, args, "bfloat16" if cuda else "float32")
        rl = path.rl
        steps = ([("warm-up", 1 + i) for i in range(args.warmup_steps)]
                 + [("timed", 100 + i) for i in range(args.timed_steps)]
                 + ([("profiled", 200)] if args.profile and cuda else []))
        for step, seed in steps:
            graphs0 = counters["stats"]["unique_graphs"]
            retries0 = torch.cuda.memory_stats(proc.device).get("num_alloc_retries", 0) if cuda else 0
            if cuda:
                torch.cuda.reset_peak_memory_stats(proc.device)
            prof = _profile_update(rl) if step == "profiled" and rl is not None else None
            params = sampling_params(len(prompts), rl_cfg.n, rl_cfg.max_new_tokens, seed)
            m, _ = path.step(prompts, params, seed, proc.device)
            if prof is not None and proc.rank == 0:
                print(json.dumps({"bench": "update_profile", "path": label, **prof}), flush=True)
            backoff = rl.actor._backoff if rl is not None else None  # the OOM ladder's micro-batching
            rows.append({"path": label, "step": step, "world": proc.world,
                         **{f"{short}_s": round(m.get(f"timing_s/{k}", 0.0), 3) for short, k in
                            (("gen", "gen"), ("ref", "ref"), ("update", "update_actor"), ("sync", "sync_weights"),
                             ("total", "step"))},
                         "graphs_compiled": counters["stats"]["unique_graphs"] - graphs0,
                         "alloc_retries": (torch.cuda.memory_stats(proc.device).get("num_alloc_retries", 0) - retries0
                                           if cuda else 0),
                         "peak_gib": round(torch.cuda.max_memory_allocated(proc.device) / 2**30, 1) if cuda else 0.0,
                         "oom_backoff": None if backoff is None else f"{backoff.prompts}x{backoff.samples}",
                         "checkpointing": rl is not None and any(activation_checkpointing(rl.actor.model)),
                         # co-scheduled prefix work: hidden beside decode; a sharded model's rest at the rollout's end
                         "hidden_s": round(m.get("rollplex/prefix_hidden_s", 0.0), 3),
                         "sweep_end_s": round(m.get("rollplex/prefix_sweep_rollout_end_s", 0.0), 3)})
            if proc.rank == 0:
                print(json.dumps({"bench": "dp_step", **rows[-1]}), flush=True)
        if rl is not None:  # (a disaggregated rollout rank holds shards in the wire dtype)
            finals[label] = {n: p.to("cpu", copy=True) for n, p in rl.policy_state().items()}
        del rl, path, policy
        free_memory()
    if "single" in finals:
        for label, got in finals.items():
            if label != "single":
                diff = max((finals["single"][n].float() - w.float()).abs().max().item() for n, w in got.items())
                rows.append({"path": label, "final_weight_max_abs_diff": diff})
    return rows


def _profile_update(rl: RLStep) -> dict:
    """Profile the next `actor.update` (filled in when it returns): its wall time against the device
    time of its kernels by family, to attribute what the data-parallel update adds (wall minus busy is
    time the device waited on the host)."""
    out: dict = {}
    update = rl.actor.update

    def profiled(*a, **k):
        from torch.profiler import ProfilerActivity, profile

        rl.actor.update = update
        with profile(activities=[ProfilerActivity.CUDA]) as prof:  # kernels only: host tracing costs seconds
            t0 = time.perf_counter()
            res = update(*a, **k)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        fam: dict[str, float] = {}
        for e in prof.key_averages():
            dev = getattr(e, "self_device_time_total", 0) / 1e6
            name = e.key.lower()
            kind = ("nccl" if "nccl" in name else "gemm" if any(x in name for x in ("gemm", "matmul", "mm_", "cutlass",
                                                                                   "sm90", "nvjet"))
                    else "attention" if any(x in name for x in ("flash", "attention", "fmha")) else
                    "copy/cat" if any(x in name for x in ("copy", "cat", "memcpy", "split", "chunk")) else
                    "foreach/optimizer" if "foreach" in name or "adam" in name else "other")
            if e.device_type == torch.autograd.DeviceType.CUDA:  # kernels (ops' GPU time would count twice)
                fam[kind] = fam.get(kind, 0.0) + dev
        busy = sum(fam.values())
        out.update(wall_s=round(wall, 3), device_busy_s=round(busy, 3),
                   device_s={k: round(v, 3) for k, v in sorted(fam.items())})
        return res

    rl.actor.update = profiled
    return out


def table(rows: list[dict]) -> str:
    timed: dict[str, list[float]] = {}
    cosched = any(r.get("hidden_s") for r in rows)
    lines = ["| path | step | ranks | gen s | ref s | update s | sync s | step s | graphs compiled | peak GiB | "
             "alloc retries | OOM back-off |" + (" prefix hidden s | sweep at end s |" if cosched else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if cosched else "")]
    for r in rows:
        if "step" in r:
            if r["step"] == "timed":
                timed.setdefault(r["path"], []).append(r["total_s"])
            lines.append(f"| {r['path']} | {r['step']} | {r['world']} | {r['gen_s']:.2f} | {r['ref_s']:.2f} | "
                         f"{r['update_s']:.2f} | {r['sync_s']:.3f} | {r['total_s']:.2f} | {r['graphs_compiled']} | "
                         f"{r['peak_gib']} | {r['alloc_retries']} | {r['oom_backoff'] or '-'}"
                         f"{' +ckpt' if r['checkpointing'] else ''} |"
                         + (f" {r['hidden_s']:.2f} | {r['sweep_end_s']:.2f} |" if cosched else ""))
    for label in timed:
        if label != "single" and "single" in timed:
            over = statistics.median(timed[label]) / statistics.median(timed["single"]) - 1
            lines.append(f"\n{label} step vs one process (median of timed steps): {over:+.1%}")
    for other in ("parallel-serial", "disaggregated"):
        if "parallel" in timed and other in timed:
            speedup = statistics.median(timed[other]) / statistics.median(timed["parallel"])
            lines.append(f"\ncolocated (parallel) over {other} on the same ranks: {speedup:.2f}x")
    return "\n".join(lines)


# The bench's defaults over SystemConfig's: the W3B step's RL settings and engine. The model (--preset), its
# dtype (bf16 on CUDA, the check in fp32), FSDP (per path, --paths), the engine's length and decode compile
# (from the prompts and --compile) are the bench's to set; the rollout samples at temperature 1; --warmup-steps
# are its untimed steps, not the LR schedule's
DEFAULTS = {"device": "cuda",
            "rl": RLConfig(n=8, kl_coef=0.01, lr=1e-6, micro_batch_prompts=4, micro_batch_samples=8,
                           max_new_tokens=512),
            "engine": EngineConfig(max_num_seqs=256, gpu_memory_utilization=0.2, max_num_batched_tokens=40000)}
SKIP = ("model", "dtype", "format_warmup_steps", "memory", "backend", "fsdp", "cosched", "rl.temperature",
        "rl.warmup_steps", "engine.max_model_len", "engine.compile_decode")


def parser() -> ConfigParser:
    ap = ConfigParser(SystemConfig, DEFAULTS, skip=SKIP, description=__doc__.splitlines()[0],
                      prog="python -m torch.distributed.run --nproc-per-node N -m rollplex.bench parallel step",
                      aliases={"rl.n": ("--samples",), "rl.max_new_tokens": ("--new-tokens",),
                               "rl.micro_batch_prompts": ("--micro-prompts",),
                               "rl.micro_batch_samples": ("--serial-samples",),
                               "engine.gpu_memory_utilization": ("--kv-memory",),
                               "tp.tensor_parallel": ("--rollout-tp",), "tp.tensor_parallel_vision": ("--vision-tp",)},
                      help={"device": "cpu (gloo, fp32) or cuda (NCCL, one GPU per process)",
                            "compile": "torch.compile the model and the engine's decode (CUDA); --no-compile: eager",
                            "micro_batch_samples": "parallel-serial path: sequences per forward/backward",
                            "gpu_memory_utilization": "share of GPU memory for the KV cache",
                            "tensor_parallel": "data-parallel paths roll out with tensor-parallel engines of this many "
                                               "ranks (and the disaggregated path's engines have as many)",
                            "tensor_parallel_vision": "with --rollout-tp > 1: the engines split the vision tower's "
                                                      "blocks too",
                            "cosched": "co-schedule the reference's prefixes beside decode on the rollplex-mode "
                                       "colocated paths (a sharded reference as a sweep in lockstep over the ranks; "
                                       "the serial and disaggregated baselines run their phases in turn)"})
    ap.add_argument("--check", action="store_true", help="compare with one process first (fails past --tol)")
    ap.add_argument("--bench", action="store_true", help="time the warm step on one process and data-parallel")
    ap.add_argument("--preset", default="qwen2.5-vl-3b", help="preset name, tiny, checkpoint dir or config.json")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=448, help="image side in pixels")
    ap.add_argument("--text-tokens", type=int, default=96)
    ap.add_argument("--warmup-steps", type=int, default=2, help="untimed steps per path before the timed ones")
    ap.add_argument("--timed-steps", type=int, default=2, help="timed steps per path (the table compares medians)")
    ap.add_argument("--paths", default="single,parallel",
                    help="paths to time, in order: single (one process), parallel (the data-parallel step), "
                         "parallel-copy (the same with the trainer's shards kept apart from the policy), "
                         "parallel-serial, disaggregated; a data-parallel path may set FSDPConfig fields: "
                         "parallel:layers_per_unit=4;reshard_after_forward=false")
    ap.add_argument("--frames", type=int, default=1,
                    help="1: one image per prompt; more: one video of this many frames (W3B-video: 8)")
    ap.add_argument("--train-ranks", type=int, default=0,
                    help="disaggregated path: trainer ranks (default: half the world); the rest roll out")
    ap.add_argument("--profile", action="store_true",
                    help="one more, untimed step per path with its update profiled (GPU time by kernel family)")
    ap.add_argument("--check-layers", type=int, default=2, help="decoder layers and vision blocks of the check")
    ap.add_argument("--check-prompts", type=int, default=4)
    ap.add_argument("--check-samples", type=int, default=4)
    ap.add_argument("--check-tokens", type=int, default=16)
    ap.add_argument("--tol", type=float, default=1e-5, help="largest relative gradient / metric and absolute "
                    "weight difference the check accepts")
    return ap


def main(argv=None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        system = ap.config(args)
    except ValueError as e:
        ap.error(str(e))
    if not (args.check or args.bench):
        ap.error("nothing to do: pass --check and/or --bench")
    if args.warmup_steps < 0 or args.timed_steps < 1:
        ap.error("--warmup-steps must be >= 0 and --timed-steps >= 1")
    proc = init_from_env(system.device)
    if proc.world % system.tp.tensor_parallel:
        ap.error(f"--rollout-tp {system.tp.tensor_parallel} must divide the world size {proc.world}")
    failed = False
    try:
        if args.check:
            res = check(proc, args, system)
            failed = not res["passed"]
            if proc.rank == 0:
                print(json.dumps({"bench": "dp_step_check", "world": proc.world, **res}), flush=True)
        if args.bench and not failed:
            rows = bench(proc, args, system)
            if proc.rank == 0:
                for r in rows:
                    if "final_weight_max_abs_diff" in r:
                        print(json.dumps({"bench": "dp_step_weights", **r}), flush=True)
                print(table(rows), flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if failed:
        sys.exit("the data-parallel step differs from the single-process step (see dp_step_check)")
