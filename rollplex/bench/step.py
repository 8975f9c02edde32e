"""`python -m rollplex.bench step`: one GRPO step, `serial` vs `rollplex`, side by side, warm.

Workloads: W3B (32 prompts x n=8, one 448x448 image + 96 text tokens, 512 new tokens) and W3B-video
(8 frames of 448x448 -> 1024 visual tokens). A step is one engine rollout, shared by both modes (the
rollout is identical in both), then reference scoring and the actor update in each mode on that batch
from the same initial weights. Correctness first: on a small batch the two modes' losses agree.

Every phase is timed warm: a warm-up step of the same shapes (its own rollout, with another seed, and
both modes' scoring + update) runs first and pays the one-off costs (dynamo compiles and recompiles at
the full batch shape, the allocator growing, first-call autotuning); then a second, different step is
timed. The warm-up step is reported separately as the cold start (`cold_*` fields, `cold` table rows),
so the step ratio is the one a training loop sees from its second step on. Reports per-phase times,
the step ratio and the actor update's MFU (executed FLOPs / time / 989 TFLOP/s bf16 dense peak).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import time

import torch

from ..engine import Engine, EngineConfig, SamplingParams
from ..models import ModelConfig, Qwen25VL, init_weights
from ..presets import preset
from ..rl.batch import RolloutBatch
from ..rl.config import RLConfig
from ..rl.step import RLStep
from .common import PEAK_TFLOPS, make_prompts, sync, update_flops
from .timing import env_info


def rollout(eng: Engine, prompts: list, n: int, new_tokens: int, seed: int) -> tuple[RolloutBatch, float, int]:
    """One timed engine rollout of `prompts` x n samples (fixed length: ignore_eos) with random 0/1 rewards:
    (batch, seconds, graphs dynamo compiled during it)."""
    from torch._dynamo.utils import counters

    graphs0 = counters["stats"]["unique_graphs"]
    sync()
    t0 = time.perf_counter()
    outs = eng.generate(prompts, SamplingParams(n=n, max_new_tokens=new_tokens, ignore_eos=True, seed=seed))
    sync()
    gen_s = time.perf_counter() - t0
    batch = RolloutBatch.from_samples(
        prompts, [i for i, o in enumerate(outs) for _ in o.samples],
        [s.token_ids for o in outs for s in o.samples], pad_id=0,
        logprobs=[s.logprobs for o in outs for s in o.samples],
        rewards=[float(torch.rand(()) < 0.5) for o in outs for _ in o.samples])
    return batch, gen_s, counters["stats"]["unique_graphs"] - graphs0


def run_modes(model, batch: RolloutBatch, rl_kw: dict, grid, label: str, cfg, step: str = "timed") -> list[dict]:
    """Reference scoring + actor update of `batch` in each mode, each from the model's current weights
    (restored between the modes); one JSON row per mode."""
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref = copy.deepcopy(model).requires_grad_(False)
    rows = []
    from torch._dynamo.utils import counters

    for mode in ("serial", "rollplex"):
        with torch.no_grad():
            for k, v in model.state_dict().items():
                v.copy_(init[k])
        rl = RLStep(model, None, RLConfig(mode=mode, **rl_kw), reward_fn="exact", ref_model=ref)
        sync()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        graphs0 = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        m = rl.train(copy.copy(batch))
        sync()
        wall = time.perf_counter() - t0
        fl = update_flops(cfg, batch, mode, grid)
        r = {"bench": "step", "workload": label, "step": step, "mode": mode, "prompts": batch.num_prompts,
             "n": batch.num_samples, "ref_s": round(m.get("timing_s/ref", 0.0), 3),
             "update_actor_s": round(m["timing_s/update_actor"], 3), "ref_plus_update_s": round(wall, 3),
             "update_tflops": round(fl / m["timing_s/update_actor"] / 1e12, 1),
             "update_mfu": round(fl / m["timing_s/update_actor"] / 1e12 / PEAK_TFLOPS, 3),
             "pg_loss": m["actor/pg_loss"], "kl_loss": m["actor/kl_loss"], "grad_norm": m["actor/grad_norm"],
             "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if torch.cuda.is_available() else 0,
             "dynamo_graphs_compiled": counters["stats"]["unique_graphs"] - graphs0}
        print(json.dumps(r), flush=True)
        rows.append(r)
        del rl
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rollplex.bench step")
    ap.add_argument("--preset", default="qwen2.5-vl-3b", help="a preset name or an HF config.json")
    ap.add_argument("--workloads", default="w3b,w3b-video")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--video-prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--image-size", type=int, default=448, help="image / video frame side in pixels")
    ap.add_argument("--text-tokens", type=int, default=96, help="text tokens per prompt around the image")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--micro-prompts", type=int, default=None,
                    help="rollplex: prompts (x n samples) per fwd/bwd (default: 4 for w3b, 2 for w3b-video)")
    ap.add_argument("--micro-tokens", type=int, default=None,
                    help="token budget per fwd/bwd instead of the counts (RLConfig.micro_batch_max_tokens)")
    ap.add_argument("--micro-samples", type=int, default=None,
                    help="serial: sequences per fwd/bwd (default: 8 for w3b, 4 for w3b-video)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-packed", action="store_true",
                    help="rollplex: a prefix pass, then padded responses (RLConfig.packed=False), not one packed pass")
    ap.add_argument("--no-warm", action="store_true",
                    help="no warm-up step: time the first step (compiles and first-call costs included)")
    ap.add_argument("--compile-dynamic", default="auto", choices=["true", "auto"],
                    help="torch.compile shapes: all symbolic (true) or only those that change (auto)")
    args = ap.parse_args(argv)
    cfg = preset(args.preset) if not args.preset.endswith(".json") else ModelConfig.from_hf(args.preset)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    with torch.device(args.device):
        model = init_weights(Qwen25VL(cfg), seed=0, std=0.02)
    model = model.to(dtype).eval()
    if args.device == "cuda" and not args.no_compile:
        model.compile(dynamic=True if args.compile_dynamic == "true" else None)
    eng = Engine(model, None, EngineConfig(max_num_seqs=256, max_model_len=2048, gpu_memory_utilization=0.2,
                                           max_num_batched_tokens=40000,
                                           compile_decode=False if args.no_compile else None))
    info = env_info()
    print(json.dumps({"bench": "step_setup", "kv_blocks": eng.runner.num_blocks, **info}), flush=True)
    rl_kw = dict(n=args.n, kl_coef=0.01, lr=1e-6, micro_batch_max_tokens=args.micro_tokens, packed=not args.no_packed)
    summary = []
    for label in args.workloads.split(","):
        frames = 8 if label == "w3b-video" else 1
        # micro-batches that fit one 141 GB GPU next to the engine's KV cache, the reference model and the
        # optimizer state (8 serial video sequences per pass do not: a video prompt has 3x the tokens)
        rl_kw["micro_batch_prompts"] = args.micro_prompts or (2 if frames > 1 else 4)
        rl_kw["micro_batch_samples"] = args.micro_samples or (4 if frames > 1 else 8)
        n_prompts = args.video_prompts if frames > 1 else args.prompts
        prompts, grid = make_prompts(cfg, n_prompts, frames, size=args.image_size, text=args.text_tokens,
                                     device=args.device, dtype=dtype)
        # correctness first: the two modes agree on a small batch
        small = eng.generate(prompts[:2], SamplingParams(n=2, max_new_tokens=16, ignore_eos=True, seed=1))
        sb = RolloutBatch.from_samples(prompts[:2], [0, 0, 1, 1], [s.token_ids for o in small for s in o.samples],
                                       pad_id=0, logprobs=[s.logprobs for o in small for s in o.samples],
                                       rewards=[1.0, 0.0, 0.0, 1.0])
        chk = run_modes(model, sb, {**rl_kw, "n": 2}, grid, label + "-check", cfg, step="check")
        print(json.dumps({"bench": "step_check", "workload": label, "pg_loss_serial": chk[0]["pg_loss"],
                          "pg_loss_rollplex": chk[1]["pg_loss"], "grad_norm_serial": chk[0]["grad_norm"],
                          "grad_norm_rollplex": chk[1]["grad_norm"]}), flush=True)
        cold = None
        if not args.no_warm:  # the warm-up step: same shapes, another rollout seed
            cold_batch, cold_gen_s, cold_graphs = rollout(eng, prompts, args.n, args.new_tokens, seed=1)
            cold = (cold_batch, cold_gen_s, cold_graphs,
                    run_modes(model, cold_batch, rl_kw, grid, label, cfg, step="cold"))
        batch, gen_s, graphs = rollout(eng, prompts, args.n, args.new_tokens, seed=0)
        s, r = run_modes(model, batch, rl_kw, grid, label, cfg, step="timed" if cold else "first")
        total_s, total_r = gen_s + s["ref_plus_update_s"], gen_s + r["ref_plus_update_s"]
        out = {"bench": "step_summary", "workload": label, "gen_s": round(gen_s, 3),
               "step_serial_s": round(total_s, 3), "step_rollplex_s": round(total_r, 3),
               "speedup": round(total_s / total_r, 3), "ref_speedup": round(s["ref_s"] / max(r["ref_s"], 1e-9), 3),
               "update_speedup": round(s["update_actor_s"] / r["update_actor_s"], 3),
               "rollout_dynamo_graphs": graphs, "warm": cold is not None}
        table = [(label, "timed" if cold else "first", gen_s, s, r)]
        if cold:
            cold_batch, cold_gen_s, cold_graphs, (cs, cr) = cold
            cold_s, cold_r = cold_gen_s + cs["ref_plus_update_s"], cold_gen_s + cr["ref_plus_update_s"]
            out.update({"cold_rollout_s": round(cold_gen_s, 3), "cold_rollout_dynamo_graphs": cold_graphs,
                        "cold_step_serial_s": round(cold_s, 3),
                        "cold_step_rollplex_s": round(cold_r, 3), "cold_speedup": round(cold_s / cold_r, 3),
                        "timed_rollout_differs": not torch.equal(batch.responses, cold_batch.responses)})
            table.append((label, "cold (warm-up)", cold_gen_s, cs, cr))
        print(json.dumps(out), flush=True)
        summary += table
    print("\n| workload | step | mode | gen s | ref s | update s | step s | update TFLOP/s (MFU) | speedup |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, step, gen_s, s, r in summary:
        ts, tr = gen_s + s["ref_plus_update_s"], gen_s + r["ref_plus_update_s"]
        for row, tot in ((s, ts), (r, tr)):
            print(f"| {label} | {step} | {row['mode']} | {gen_s:.2f} | {row['ref_s']:.2f} | "
                  f"{row['update_actor_s']:.2f} | {tot:.2f} | {row['update_tflops']} ({row['update_mfu']:.0%}) | "
                  f"{'1.00' if row['mode'] == 'serial' else f'{ts / tr:.2f}'}x |")
