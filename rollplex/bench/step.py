"""`python -m rollplex.bench step`: one GRPO step, `serial` vs `rollplex`, side by side.

Workloads (DESIGN.md §4): W3B (32 prompts x n=8, one 448x448 image + 96 text tokens, 512 new
tokens) and W3B-video (8 frames of 448x448 -> 1024 visual tokens). One engine rollout is shared by
both modes (rollout is identical in both); then reference scoring and the actor update run in each
mode on the same batch from the same initial weights. Correctness first: on a small batch the two
modes' losses agree. Reports per-phase times, the step ratio and the actor update's MFU (executed
FLOPs / time / 989 TFLOP/s bf16 dense peak).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import time

import torch

from ..engine import Engine, EngineConfig, SamplingParams
from ..models import ModelConfig, ModelInputs, Qwen25VL, init_weights
from ..presets import preset
from ..rl.batch import RolloutBatch
from ..rl.config import RLConfig
from ..rl.step import RLStep
from .model import vit_flops
from .timing import env_info

PEAK_TFLOPS = 989.0


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_prompts(cfg, n_prompts: int, frames: int, size: int = 448, text: int = 96, seed: int = 0, device="cuda",
                 dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    side = size // cfg.vision.patch_size
    t = max(1, frames // cfg.vision.temporal_patch_size)
    n_vis = t * side * side // cfg.vision.spatial_merge_size**2
    video = frames > 1
    tok = cfg.video_token_id if video else cfg.image_token_id
    out = []
    for _ in range(n_prompts):
        vocab = min(150000, cfg.image_token_id - 1)
        ids = torch.randint(0, vocab, (text // 2,), generator=g).tolist()
        ids += [cfg.vision_start_token_id] + [tok] * n_vis + [cfg.vision_end_token_id]
        ids += torch.randint(0, vocab, (text - text // 2 - 2,), generator=g).tolist()
        pix = torch.randn(t * side * side, cfg.vision.patch_dim, generator=g).to(device, dtype)
        grid = torch.tensor([[t, side, side]])
        p = ModelInputs(ids)
        if video:
            p.pixel_values_videos, p.video_grid_thw, p.second_per_grid_ts = pix, grid, [1.0]
        else:
            p.pixel_values, p.image_grid_thw = pix, grid
        out.append(p)
    return out, [(t, side, side)]


def update_flops(cfg, batch: RolloutBatch, mode: str, grid) -> float:
    """Executed FLOPs of one forward+backward over the batch in `mode` (x3 of the forward)."""
    t = cfg.text
    qkv = t.hidden_size * (t.num_attention_heads + 2 * t.num_key_value_heads) * t.head_dim
    layer = qkv + t.hidden_size**2 + 3 * t.hidden_size * t.intermediate_size
    linear = 2 * (t.num_hidden_layers * layer + t.hidden_size * t.vocab_size)
    attn_per_pair = 4 * t.num_hidden_layers * t.hidden_size  # QK^T + PV, per (query, key) pair
    P = len(batch.prompts[0].input_ids)
    R = batch.responses.shape[1]
    N, B = batch.num_samples, batch.num_prompts
    vis = vit_flops(cfg, grid)
    if mode == "rollplex":
        prefix = B * (P * linear + attn_per_pair * P * P / 2 + vis)
        resp = N * ((R - 1) * linear + attn_per_pair * (R - 1) * (P + R / 2))
    else:
        L = P + R - 1
        prefix, resp = 0.0, N * (L * linear + attn_per_pair * L * L / 2 + vis)
    return 3 * (prefix + resp)


def run_modes(model, batch: RolloutBatch, rl_kw: dict, grid, label: str, cfg, warm: int = 0) -> list[dict]:
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref = copy.deepcopy(model).requires_grad_(False)
    rows = []
    from torch._dynamo.utils import counters

    for mode in ("serial", "rollplex"):
        cold = None
        for it in range(1 + warm):  # with `warm`, the first run compiles (dynamo) and the second is timed
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    v.copy_(init[k])
            rl = RLStep(model, None, RLConfig(mode=mode, **rl_kw), reward_fn="exact", ref_model=ref)
            _sync()
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            graphs0 = counters["stats"]["unique_graphs"]
            t0 = time.perf_counter()
            m = rl.train(copy.copy(batch))
            _sync()
            wall = time.perf_counter() - t0
            new_graphs = counters["stats"]["unique_graphs"] - graphs0
            if it < warm:
                cold = [round(wall, 2), new_graphs]
                del rl
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        fl = update_flops(cfg, batch, mode, grid)
        r = {"bench": "step", "workload": label, "mode": mode, "prompts": batch.num_prompts, "n": batch.num_samples,
             "ref_s": round(m.get("timing_s/ref", 0.0), 3), "update_actor_s": round(m["timing_s/update_actor"], 3),
             "ref_plus_update_s": round(wall, 3), "update_tflops": round(fl / m["timing_s/update_actor"] / 1e12, 1),
             "update_mfu": round(fl / m["timing_s/update_actor"] / 1e12 / PEAK_TFLOPS, 3),
             "pg_loss": m["actor/pg_loss"], "kl_loss": m["actor/kl_loss"], "grad_norm": m["actor/grad_norm"],
             "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if torch.cuda.is_available() else 0,
             "cold_s_and_graphs": cold, "dynamo_graphs_compiled": new_graphs}
        print(json.dumps(r), flush=True)
        rows.append(r)
        del rl
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rollplex.bench step")
    ap.add_argument("--preset", default="qwen2.5-vl-3b")
    ap.add_argument("--workloads", default="w3b,w3b-video")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--video-prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=512)
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
    ap.add_argument("--no-warm", action="store_true", help="time the first run (dynamo compiles included)")
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
        # 4 image prompts x 8 samples fit next to the engine, reference and optimizer state (129 GiB
        # peak on the H200); a video prompt has 3x the prompt tokens
        rl_kw["micro_batch_prompts"] = args.micro_prompts or (2 if frames > 1 else 4)
        rl_kw["micro_batch_samples"] = args.micro_samples or (4 if frames > 1 else 8)  # 8 video sequences: OOM
        n_prompts = args.video_prompts if frames > 1 else args.prompts
        prompts, grid = make_prompts(cfg, n_prompts, frames, device=args.device, dtype=dtype)
        # correctness first: the two modes agree on a small batch
        small = eng.generate(prompts[:2], SamplingParams(n=2, max_new_tokens=16, ignore_eos=True, seed=1))
        sb = RolloutBatch.from_samples(prompts[:2], [0, 0, 1, 1], [s.token_ids for o in small for s in o.samples],
                                       pad_id=0, logprobs=[s.logprobs for o in small for s in o.samples],
                                       rewards=[1.0, 0.0, 0.0, 1.0])
        chk = run_modes(model, sb, {**rl_kw, "n": 2}, grid, label + "-check", cfg)
        print(json.dumps({"bench": "step_check", "workload": label, "pg_loss_serial": chk[0]["pg_loss"],
                          "pg_loss_rollplex": chk[1]["pg_loss"], "grad_norm_serial": chk[0]["grad_norm"],
                          "grad_norm_rollplex": chk[1]["grad_norm"]}), flush=True)
        _sync()
        t0 = time.perf_counter()
        outs = eng.generate(prompts, SamplingParams(n=args.n, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0))
        _sync()
        gen_s = time.perf_counter() - t0
        batch = RolloutBatch.from_samples(
            prompts, [i for i, o in enumerate(outs) for _ in o.samples],
            [s.token_ids for o in outs for s in o.samples], pad_id=0,
            logprobs=[s.logprobs for o in outs for s in o.samples],
            rewards=[float(torch.rand(()) < 0.5) for o in outs for _ in o.samples])
        rows = run_modes(model, batch, rl_kw, grid, label, cfg, warm=0 if args.no_warm else 1)
        s, r = rows
        total_s, total_r = gen_s + s["ref_plus_update_s"], gen_s + r["ref_plus_update_s"]
        summary.append((label, gen_s, s, r, total_s, total_r))
        print(json.dumps({"bench": "step_summary", "workload": label, "gen_s": round(gen_s, 2),
                          "step_serial_s": round(total_s, 2), "step_rollplex_s": round(total_r, 2),
                          "speedup": round(total_s / total_r, 3),
                          "ref_speedup": round(s["ref_s"] / max(r["ref_s"], 1e-9), 3),
                          "update_speedup": round(s["update_actor_s"] / r["update_actor_s"], 3)}), flush=True)
    print("\n| workload | mode | gen s | ref s | update s | step s | update TFLOP/s (MFU) | speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for label, gen_s, s, r, ts, tr in summary:
        for row, tot in ((s, ts), (r, tr)):
            print(f"| {label} | {row['mode']} | {gen_s:.2f} | {row['ref_s']:.2f} | {row['update_actor_s']:.2f} | "
                  f"{tot:.2f} | {row['update_tflops']} ({row['update_mfu']:.0%}) | "
                  f"{'1.00' if row['mode'] == 'serial' else f'{ts / tr:.2f}'}x |")
