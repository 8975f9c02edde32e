"""`python -m experiments.kernels.profile`: where the GPU time of a decode step and a training pass goes.

Not a benchmark with goals: a breakdown that tells which kernels to fuse or tune next.

1. Paged decode attention alone at the sweep's shapes (B = 64/256, context 608, W3B heads), per
   `num_splits`: microseconds and achieved KV bandwidth.
2. The graphed decode step (W3B, compiled layers) at B = 64 and 256, context 608: replay time and
   the kernels inside it, by category (GEMM, paged attention, fused Triton glue, other) with counts.
3. One training micro-batch (fwd + bwd of the token logprobs) per mode and size: wall time, the
   sum of kernel times (wall >> kernels means the host is the bottleneck), categories, TFLOP/s.
Prints JSON lines, then tables.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import torch.nn.functional as F

from experiments.common import gemms_str, set_decode_state
from rollplex.bench.common import make_prompts, update_flops
from rollplex.bench.timing import env_info, time_ms
from rollplex.engine import Engine, EngineConfig
from rollplex.kernels.paged_attention import DECODE_CANDIDATES, attn_variant, fits, paged_decode_attention
from rollplex.kernels.tuning import graph_time_us, round_robin
from rollplex.models import ModelConfig, ModelInputs, Qwen25VL, init_weights
from rollplex.presets import preset
from rollplex.rl.batch import RolloutBatch
from rollplex.rl.scoring import token_logprobs

DT = {"cuda": torch.bfloat16, "cpu": torch.float32}
CATEGORIES = (
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90", "xmma", "cublas", "gemv", "splitk")),
    ("flash_attn", ("flash", "fmha", "attention")),
    ("paged_attn", ("split_kernel", "merge_kernel")),
    ("triton_fused", ("triton_",)),
    ("copy_index", ("copy", "index", "scatter", "gather", "cat", "fill")),
    ("reduce", ("reduce",)),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def kernel_profile(fn, iters: int = 3) -> dict:
    """Kernels launched by `iters` calls of fn (after one warm-up): per-call ms and count by category
    and the top kernels. Empty on CPU (smoke runs)."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return {}

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    cats: dict[str, list[float]] = {}
    names: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.time_range.elapsed_us()
        c = cats.setdefault(category(e.name), [0.0, 0])
        c[0] += us / iters / 1e3
        c[1] += 1 / iters
        n = names.setdefault(e.name[:80], [0.0, 0])
        n[0] += us / iters / 1e3
        n[1] += 1 / iters
    total = sum(v[0] for v in cats.values())
    top = sorted(names.items(), key=lambda kv: -kv[1][0])[:25]
    return {"kernel_ms": round(total, 3), "kernels": round(sum(v[1] for v in cats.values())),
            "by_category": {k: [round(v[0], 3), round(v[1])]
                            for k, v in sorted(cats.items(), key=lambda kv: -kv[1][0])},
            "top": [[k, round(v[0], 3), round(v[1])] for k, v in top]}


def host_trace(fn, path: str) -> None:
    """One fn() call (1) under CUDA sync debugging: every host<->device sync it makes, with the Python
    frames that made it, goes to `path`.syncs.txt; (2) under the profiler with CPU ops: a gzipped Chrome
    trace `path`.json.gz, to see what the host was doing while the GPU sat idle."""
    import os
    import traceback
    import warnings

    from torch.profiler import ProfilerActivity, profile

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    syncs: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-2] if "rollplex" in f.filename]
        syncs.append(f"{message}\n" + "".join(traceback.format_list(frames[-6:])))

    torch.cuda.synchronize()
    old = warnings.showwarning
    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old
    torch.cuda.synchronize()
    with open(path + ".syncs.txt", "w") as f:
        f.write(f"{len(syncs)} syncs\n\n" + "\n".join(syncs))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    _export_gz(prof, path)
    print(json.dumps({"bench": "host_trace", "path": path, "syncs": len(syncs)}), flush=True)


def _export_gz(prof, path: str) -> None:
    """The profiler's Chrome trace as `path`.json.gz (about a tenth of the size of the plain JSON)."""
    import gzip
    import os
    import shutil

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    prof.export_chrome_trace(path + ".json")
    with open(path + ".json", "rb") as a, gzip.open(path + ".json.gz", "wb") as b:
        shutil.copyfileobj(a, b)
    os.remove(path + ".json")


TILES = [dict(tile_n=t, num_warps=w, num_stages=st) for t in (32, 64, 128) for w in (4, 8) for st in (2, 3)]
# TMA: one block (or a part of one) per tile, the block ids loaded up front
TILES += [dict(tma=True, tile_n=t, num_stages=st) for t in (32, 64) for st in (2, 3, 4)]
BLOCK = 64  # the engine's KV block size on CUDA (EngineConfig.block_size=None)


LAYERS = 8


def _attend_kv(q, block_table, seq_lens, kv, **kw):
    """paged_decode_attention with its caches given as one (k_cache, v_cache) pair (for round_robin)."""
    return paged_decode_attention(q, kv[0], kv[1], block_table, seq_lens, **kw)


def attention_sweep(cfg, batches, ctx: int, rows: list, dev: str) -> None:
    """Paged decode attention as the engine calls it (fused new-token write, rotary, in-kernel split
    merge), per (num_splits, tile) config."""
    t = cfg.text
    bs = BLOCK if dev == "cuda" else 16
    for B in batches:
        per = -(-ctx // bs)
        # the timed calls cycle through LAYERS caches, as the step does through its layers: one layer's
        # KV at B = 64 (40 MB) fits L2, and timing one cache over and over measures L2, not HBM
        kvs = [(torch.randn(1 + B * per, bs, t.num_key_value_heads, t.head_dim, device=dev, dtype=DT[dev]),
                torch.randn(1 + B * per, bs, t.num_key_value_heads, t.head_dim, device=dev, dtype=DT[dev]))
               for _ in range(LAYERS if dev == "cuda" else 1)]
        kc, vc = kvs[0]
        q = torch.randn(B, t.num_attention_heads, t.head_dim, device=dev, dtype=DT[dev])
        kn = torch.randn(B, t.num_key_value_heads, t.head_dim, device=dev, dtype=DT[dev])
        vn = torch.randn_like(kn)
        bt = torch.zeros(B, 2048 // bs, dtype=torch.int32, device=dev)
        bt[:, :per] = (1 + torch.arange(B * per, device=dev).view(B, per)).int()
        lens = torch.full((B,), ctx, device=dev)
        kv_bytes = 2 * B * ctx * t.num_key_value_heads * t.head_dim * 2
        ang = torch.rand(B, t.head_dim // 2, device=dev) * 600
        cos, sin = torch.cat([ang, ang], -1).cos().to(q.dtype), torch.cat([ang, ang], -1).sin().to(q.dtype)
        sem = torch.zeros(B * t.num_key_value_heads, dtype=torch.int32, device=dev)
        ref = paged_decode_attention(q, kc.clone(), vc.clone(), bt, lens, backend="reference", k_new=kn, v_new=vn,
                                     cos=cos, sin=sin)
        configs = [(s, tile) for s in (None, 1, 2, 4, 8) for tile in TILES
                   if fits(tile, bs, torch.device(dev))] if dev == "cuda" else [(None, None)]
        best = None
        for s, tile in configs:
            attend = functools.partial(_attend_kv, q, bt, lens, num_splits=s, k_new=kn, v_new=vn, tile=tile, cos=cos,
                                       sin=sin, semaphore=sem)
            try:
                err = (attend(kvs[0]).float() - ref.float()).abs().max().item()
                us = graph_time_us(round_robin(attend, kvs)) if dev == "cuda" else \
                    time_ms(functools.partial(attend, kvs[0]), device=dev) * 1e3
            except Exception as e:  # a config the compiler rejects (e.g. out of shared memory)
                print(json.dumps({"bench": "paged_attn", "batch": B, "num_splits": s, "tile": tile,
                                  "error": str(e)[:120]}), flush=True)
                continue
            r = {"bench": "paged_attn", "batch": B, "context": ctx, "num_splits": s or "auto", "tile": tile,
                 "us": round(us, 2), "TBps": round(kv_bytes / us / 1e6, 2), "max_err": round(err, 4)}
            print(json.dumps(r), flush=True)
            if s is None and tile is None or s is None and tile == dict(tile_n=64, num_warps=4, num_stages=2):
                rows.append(r)  # the current default (tile_n 64, 4 warps, 2 stages, auto splits)
            if best is None or us < best["us"]:
                best = r
        if best is not None:
            rows.append({**best, "best": True})


def attention_parts(cfg, batches, ctx: int, rows: list, dev: str) -> None:
    """What the attention kernel's fused pieces cost: the engine's default launch (auto splits, fused
    rotary, new-token write and split merge) against the same launch with each piece switched off
    (rotary, new-token write, both; merge as a second kernel), KV cycled over LAYERS caches."""
    if dev != "cuda":
        return
    t = cfg.text
    bs, Hkv, D = BLOCK, t.num_key_value_heads, t.head_dim
    for B in batches:
        per = -(-ctx // bs)
        kvs = [(torch.randn(1 + B * per, bs, Hkv, D, device=dev, dtype=DT[dev]),
                torch.randn(1 + B * per, bs, Hkv, D, device=dev, dtype=DT[dev])) for _ in range(LAYERS)]
        bt = (1 + torch.arange(B * per, device=dev, dtype=torch.int32)).view(B, per)
        q = torch.randn(B, t.num_attention_heads, D, device=dev, dtype=DT[dev])
        kn = torch.randn(B, Hkv, D, device=dev, dtype=DT[dev])
        lens = torch.full((B,), ctx, device=dev)
        cos, sin = torch.ones(B, D, device=dev, dtype=DT[dev]), torch.zeros(B, D, device=dev, dtype=DT[dev])
        sem = torch.zeros(B * Hkv, dtype=torch.int32, device=dev)
        full = dict(k_new=kn, v_new=kn, cos=cos, sin=sin, semaphore=sem)
        no_rot, no_new = {"cos": None, "sin": None}, {"k_new": None, "v_new": None}
        variants = {"default": {}, "no_rotary": no_rot, "no_new_token": no_new, "neither": {**no_rot, **no_new},
                    "merge_kernel": {"semaphore": None}}
        r = {"bench": "attn_parts", "batch": B, "context": ctx}
        for name, off in variants.items():
            attend = functools.partial(_attend_kv, q, bt, lens, **{**full, **off})
            r[f"{name}_us"] = round(graph_time_us(round_robin(attend, kvs), 16), 2)
        print(json.dumps(r), flush=True)
        rows.append(r)
        del kvs


GEMM_COPIES = 8  # weights per shape the timed calls cycle through (8 x 8.4 MB > L2, like the step's layers)


def gemm_sweep(cfg, batches, rows: list, dev: str) -> None:
    """The decode step's GEMMs (one layer's qkv, o, gate_up, down at M = B rows), graph-timed with the
    calls cycling through GEMM_COPIES weights (read from HBM, as in the step; the smaller weights fit
    L2 and a single copy timed over and over measures L2):
    * cuBLAS `F.linear` (what the model runs) and the best Triton skinny-GEMM candidate
      (`experiments/kernels/skinny_gemm.py`)
    * `mm(W, x^T)`: the transposed problem, which cuBLAS tiles differently (output [N, M])
    * split-K as a batched GEMM with fp32 output, `bmm(x_s, W_s^T, out_dtype=fp32)` over S slices of
      K, alone (its reduction could fuse into the next norm kernel) and with an eager sum + cast."""
    if dev != "cuda":
        return
    t = cfg.text
    C, D = t.hidden_size, t.head_dim
    shapes = {"qkv": ((t.num_attention_heads + 2 * t.num_key_value_heads) * D, C, True),
              "o": (C, t.num_attention_heads * D, False), "gate_up": (2 * t.intermediate_size, C, False),
              "down": (C, t.intermediate_size, False)}
    g = torch.Generator(device=dev).manual_seed(0)

    for B in batches:
        for name, (N, K, has_bias) in shapes.items():
            r = _gemm_variants(B, N, K, has_bias, g, dev)
            r = {"bench": "gemm", "batch": B, "gemm": name, **r}
            print(json.dumps(r), flush=True)
            rows.append(r)


def swiglu_sweep(cfg, batches, rows: list, dev: str) -> None:
    """gate_up + SwiGLU at M = B rows, as the decode step can run it: cuBLAS GEMM + inductor's fused
    SwiGLU (compiled, what the model runs) vs each Triton `swiglu_linear` config (kernels/swiglu_gemm.py),
    graph-timed with calls cycling through GEMM_COPIES weights. Checks the best config's output
    against the compiled path first."""
    if dev != "cuda":
        return
    from rollplex.engine.decode_forward import _gate_up_swiglu
    from rollplex.kernels.swiglu_gemm import swiglu_linear, tune_swiglu

    t = cfg.text
    compiled = torch.compile(_gate_up_swiglu)
    g = torch.Generator(device=dev).manual_seed(0)
    for B in batches:
        x = torch.randn(B, t.hidden_size, device=dev, dtype=DT[dev], generator=g)
        ws = [torch.randn(2 * t.intermediate_size, t.hidden_size, device=dev, dtype=DT[dev], generator=g) * 0.02
              for _ in range(GEMM_COPIES)]
        best, times = tune_swiglu(x, ws, baseline=compiled)
        err = 0.0 if best is None else (swiglu_linear(x, ws[0], best).float() - compiled(x, ws[0]).float()).abs().max()
        r = {"bench": "swiglu", "batch": B, "weights_MB": round(ws[0].numel() * 2 / 1e6, 1),
             "cublas_compiled_us": round(times[None], 2), "best": str(best), "best_us": round(times[best], 2),
             "speedup": round(times[None] / times[best], 3), "max_err_vs_compiled": float(err),
             "all_us": {str(k): round(v, 2) for k, v in times.items()}}
        print(json.dumps(r), flush=True)
        rows.append(r)
        del ws


def _gemm_variants(B: int, N: int, K: int, has_bias: bool, g, dev: str) -> dict:
    from experiments.kernels.skinny_gemm import skinny_linear, tune_linear

    x = torch.randn(B, K, device=dev, dtype=DT[dev], generator=g)
    ws = [torch.randn(N, K, device=dev, dtype=DT[dev], generator=g) * 0.02 for _ in range(GEMM_COPIES)]
    b = torch.randn(N, device=dev, dtype=DT[dev], generator=g) if has_bias else None

    best, times = tune_linear(x, ws, b)
    ref = F.linear(x, ws[0], b).float()
    err = (skinny_linear(x, ws[0], b, best).float() - ref).abs().max().item()
    mb = ws[0].numel() * ws[0].element_size() / 1e6
    r = {"N": N, "K": K, "weights_MB": round(mb, 1),
         "cublas_us": round(times[None], 2), "cublas_TBps": round(mb / times[None], 2),
         "best": best, "best_us": round(times[best], 2), "best_TBps": round(mb / times[best], 2),
         "speedup": round(times[None] / times[best], 3), "max_err_vs_cublas": round(err, 4)}

    def transposed(w):  # [N, B]
        y = torch.mm(w, x.T)
        return y if b is None else y + b[:, None]

    r["transposed_us"] = round(graph_time_us(round_robin(transposed, ws), 20), 2)
    r["transposed_err"] = round((transposed(ws[0]).T.float() - ref).abs().max().item(), 4)
    for S in (2, 4, 8):
        if K % S:
            continue
        xs = x.view(B, S, K // S).transpose(0, 1)  # [S, B, K/S]

        def part(w, S=S, xs=xs):  # [S, B, N] fp32 partial sums
            return torch.bmm(xs, w.view(N, S, K // S).permute(1, 2, 0), out_dtype=torch.float32)

        def whole(w, part=part):
            y = part(w).sum(0)
            return (y if b is None else y + b.float()).to(x.dtype)

        r[f"splitk{S}_gemm_us"] = round(graph_time_us(round_robin(part, ws), 20), 2)
        r[f"splitk{S}_with_reduce_us"] = round(graph_time_us(round_robin(whole, ws), 20), 2)
        r[f"splitk{S}_err"] = round((whole(ws[0]).float() - ref).abs().max().item(), 4)
    return r


def decode_profile(model, batches, ctx: int, rows: list, split_k: tuple[int, int] | None = None,
                   attn_candidates: tuple | None = None) -> None:
    eng = Engine(model, None, EngineConfig(max_num_seqs=max(batches), max_model_len=2048, gpu_memory_utilization=0.6,
                                           max_num_batched_tokens=8192, decode_split_k=split_k,
                                           attn_candidates=attn_candidates))
    run = eng.runner
    for B in batches:
        set_decode_state(run, B, ctx)
        g, logits = run.graphs[B]
        ms = time_ms(g.replay, warmup=3, iters=20)
        prof = kernel_profile(g.replay)
        r = {"bench": "decode_profile", "batch": B, "context": ctx, "replay_ms": round(ms, 3),
             "logits_checksum": round(logits[:B].double().sum().item(), 3),
             "attn_cfg": str(run.attn_cfg.get(B)), "gemms": gemms_str(run.gemms.get(B)),
             "gemms_us": str(run.gemms_us.get(B)), **prof}
        print(json.dumps(r), flush=True)
        rows.append(r)
    del eng


class _ProfileSteps:
    """Decode hook: profiles (CPU + CUDA) `count` decode iterations after `skip`, timing each period."""

    def __init__(self, skip: int, count: int):
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.prof = profile(activities=acts)
        self.skip, self.count, self.seen, self.t = skip, count, 0, []

    def on_decode_step(self, info) -> None:
        import time

        if self.seen == self.skip:
            self.prof.start()
        if self.skip <= self.seen <= self.skip + self.count:
            self.t.append(time.perf_counter())
        if self.seen == self.skip + self.count:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.prof.stop()
        self.seen += 1


def engine_profile(model, batches, rows: list, dev: str, trace_dir: str | None = None, skip: int = 100,
                   count: int = 20) -> None:
    """The engine's decode loop as it runs (overlap scheduling, sampling, host bookkeeping): per step,
    wall period vs GPU kernel time, the GPU time outside the graph replay (sampler, copies), and the
    host ops that take the most time. The gap between period and kernel time is what the host adds."""
    from rollplex.engine import SamplingParams

    eng = Engine(model, None, EngineConfig(max_num_seqs=max(batches), max_model_len=2048,
                                           gpu_memory_utilization=0.6, max_num_batched_tokens=8192))
    c = model.cfg
    hi = min(150000, c.text.vocab_size, c.image_token_id, c.video_token_id, c.vision_start_token_id)  # text ids only
    g = torch.Generator().manual_seed(0)
    for B in batches:
        prompts = [ModelInputs(torch.randint(0, hi, (352,), generator=g).tolist()) for _ in range(B)]
        hook = _ProfileSteps(skip, count)
        eng.hooks = [hook]
        eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=skip + count + 8, ignore_eos=True))
        eng.hooks = []
        periods = [(b - a) * 1e3 for a, b in zip(hook.t, hook.t[1:])]
        events = hook.prof.events()
        gpu: dict[str, list[float]] = {}
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CUDA:
                k = gpu.setdefault(e.name[:60], [0.0, 0])
                k[0] += e.time_range.elapsed_us() / 1e3 / count
                k[1] += 1 / count
        kernel_ms = sum(v[0] for v in gpu.values())
        cpu: dict[str, list[float]] = {}
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CPU:
                c = cpu.setdefault(e.name[:60], [0.0, 0])
                c[0] += e.self_cpu_time_total / 1e3 / count
                c[1] += 1 / count
        def top(d, n):
            return [[k, round(v[0], 3), round(v[1], 1)] for k, v in sorted(d.items(), key=lambda kv: -kv[1][0])[:n]]

        r = {"bench": "engine_profile", "batch": B, "steps": count,
             "period_ms": round(sorted(periods)[len(periods) // 2], 3), "gpu_kernel_ms": round(kernel_ms, 3),
             "gpu_top": top(gpu, 12), "host_top": top(cpu, 15)}
        print(json.dumps(r), flush=True)
        rows.append(r)
        if trace_dir:
            _export_gz(hook.prof, f"{trace_dir}/engine_b{B}")
    del eng


def train_profile(model, cfg, configs, rows: list, dev: str, resp_len: int, trace_dir: str | None = None) -> None:
    prompts, grid = make_prompts(cfg, 8, 1, device=dev, dtype=DT[dev])
    g = torch.Generator().manual_seed(0)
    for mode, n_prompts, n_samples in configs:
        n = 8
        resp = torch.randint(0, min(150000, cfg.text.vocab_size), (n_prompts * n, resp_len), generator=g)
        batch = RolloutBatch(prompts[:n_prompts], torch.arange(n_prompts).repeat_interleave(n), resp,
                             torch.ones(resp.shape))
        if mode == "serial":
            batch = batch.select_samples(torch.arange(n_samples))
        model.train()

        packed = mode == "packed"  # rollplex with the micro-batch packed into one sequence
        mode = "rollplex" if packed else mode

        def fwd_bwd(batch=batch, mode=mode, packed=packed):
            lp, _ = token_logprobs(model, batch, mode, packed=packed)
            lp.sum().backward()
            for p in model.parameters():
                p.grad = None

        def fwd(batch=batch, mode=mode, packed=packed):
            with torch.no_grad():
                token_logprobs(model, batch, mode, packed=packed)

        try:
            ms = time_ms(fwd_bwd, warmup=2, iters=3, device=dev)
            if trace_dir and dev == "cuda":
                host_trace(fwd_bwd, f"{trace_dir}/train_{'packed' if packed else mode}")
            ms_fwd = time_ms(fwd, warmup=1, iters=3, device=dev)
            prof = kernel_profile(fwd_bwd, iters=1)
        except torch.OutOfMemoryError as e:
            print(json.dumps({"bench": "train_profile", "mode": mode, "oom": str(e)[:200]}), flush=True)
            torch.cuda.empty_cache()
            continue
        fl = update_flops(cfg, batch, mode, grid)
        r = {"bench": "train_profile", "mode": "packed" if packed else mode, "prompts": batch.num_prompts,
             "sequences": batch.num_samples,
             "fwd_bwd_ms": round(ms, 1), "fwd_nograd_ms": round(ms_fwd, 1), "TFLOPs": round(fl / ms / 1e9, 1),
             "mfu": round(fl / ms / 1e9 / 989, 3), "ms_per_sequence": round(ms / batch.num_samples, 1),
             "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if dev == "cuda" else 0, **prof}
        print(json.dumps(r), flush=True)
        rows.append(r)
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.empty_cache()
    model.eval()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.kernels.profile")
    ap.add_argument("--preset", default="qwen2.5-vl-3b")
    ap.add_argument("--parts", default="attn,decode,train",
                    help="any of attn, attn-parts, gemm, swiglu, decode, engine, train")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--context", type=int, default=608)
    ap.add_argument("--train", default="rollplex:2,packed:2,serial:8",
                    help="mode:size items; rollplex/packed: prompts (x 8 samples), serial: sequences")
    ap.add_argument("--response-len", type=int, default=512)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the attn/train parts")
    ap.add_argument("--compile-dynamic", default="auto",
                    help="torch.compile shapes: all symbolic (true) or only those that change (auto); "
                    "'true,auto' profiles each in turn (the model's forward; the engine compiles its decode "
                    "layers with automatic-dynamic shapes)")
    ap.add_argument("--decode-split-k", default="auto",
                    help="decode part: 'S_o,S_down' K slices of the o/down GEMMs (1,1: plain GEMMs) or auto (tuned)")
    ap.add_argument("--attn-kernels", default="all", choices=["all", "gather", "tma"],
                    help="decode part: the paged-attention candidates the engine's tuner gets (the gather kernel's "
                    "or the TMA kernel's), to compare the kernels inside the step")
    ap.add_argument("--trace", default=None, help="directory: per training mode, a Chrome trace (CPU + CUDA) and "
                    "the host syncs (with their Python frames) of one fwd+bwd")
    args = ap.parse_args(argv)
    dev = args.device
    cfg = ModelConfig.from_hf(args.preset) if args.preset.endswith(".json") else preset(args.preset)
    print(json.dumps({"bench": "profile_setup", **env_info()}), flush=True)
    rows: list[dict] = []
    batches = [int(b) for b in args.batches.split(",")]
    parts = args.parts.split(",")
    if "attn" in parts:
        attention_sweep(cfg, batches, args.context, rows, dev)
    if "attn-parts" in parts:
        attention_parts(cfg, batches, args.context, rows, dev)
    if "gemm" in parts:
        gemm_sweep(cfg, batches, rows, dev)
    if "swiglu" in parts:
        swiglu_sweep(cfg, batches, rows, dev)
    with torch.device(dev):
        model = init_weights(Qwen25VL(cfg), seed=0, std=0.02)
    model = model.to(DT[dev]).eval()
    dynamics = args.compile_dynamic.split(",")
    if any(d not in ("true", "auto") for d in dynamics):
        raise ValueError("--compile-dynamic takes true, auto or both, comma-separated")
    if dev == "cuda":
        model.compile(dynamic=True if dynamics[0] == "true" else None)
    if "decode" in parts and dev == "cuda":
        sk = None if args.decode_split_k == "auto" else tuple(int(v) for v in args.decode_split_k.split(","))
        cands = None if args.attn_kernels == "all" else tuple(
            c for c in DECODE_CANDIDATES if attn_variant(c[1]) == args.attn_kernels)
        decode_profile(model, batches, args.context, rows, sk, cands)
    if "engine" in parts:
        engine_profile(model, batches, rows, dev, args.trace)
    if "train" in parts:
        configs = []
        for item in args.train.split(","):
            mode, k = item.split(":")
            configs.append((mode, int(k) if mode in ("rollplex", "packed") else 1, int(k)))
        for i, d in enumerate(dynamics):
            if i and dev == "cuda":  # fresh compiled functions: the new setting starts from no cache entries
                model.compile(dynamic=True if d == "true" else None)
            first = len(rows)
            train_profile(model, cfg, configs, rows, dev, args.response_len, args.trace)
            for r in rows[first:]:
                r["compile_dynamic"] = d
    print()
    for r in rows:
        if r["bench"] in ("paged_attn", "gemm"):
            continue
        print(f"## {r['bench']} " + ", ".join(f"{k}={v}" for k, v in r.items()
                                                  if k not in ("bench", "by_category", "top", "gpu_top", "host_top")))
        for k, v in r.get("by_category", {}).items():
            print(f"  {k:14s} {v[0]:9.3f} ms  {v[1]:6d} kernels")
        for name, ms, cnt in r.get("top", [])[:8]:
            print(f"    {ms:9.3f} ms {cnt:6d}x  {name}")
        for key in ("gpu_top", "host_top"):
            for name, ms, cnt in r.get(key, []):
                print(f"    {key[:4]} {ms:9.3f} ms/step {cnt:6.1f}x  {name}")
    gemms = [r for r in rows if r["bench"] == "gemm"]
    if gemms:
        print("\n| B | GEMM | weights MB | cuBLAS us (TB/s) | best Triton or cuBLAS | us (TB/s) | mm(W, x^T) us | "
              "split-K 2 / 4 / 8: bmm us (+ reduce) |")
        print("|---|---|---|---|---|---|---|---|")
        for r in gemms:
            sk = " / ".join(
                f"{r[f'splitk{S}_gemm_us']} (+{r[f'splitk{S}_with_reduce_us'] - r[f'splitk{S}_gemm_us']:.1f})"
                for S in (2, 4, 8) if f"splitk{S}_gemm_us" in r)
            print(f"| {r['batch']} | {r['gemm']} | {r['weights_MB']} | {r['cublas_us']} ({r['cublas_TBps']}) | "
                  f"{r['best'] or 'cuBLAS'} | {r['best_us']} ({r['best_TBps']}) | {r['transposed_us']} | {sk} |")
    attn = [r for r in rows if r["bench"] == "paged_attn"]
    if attn:
        print("\n| B | splits | tile | us | TB/s | |\n|---|---|---|---|---|---|")
    for r in attn:
        print(f"| {r['batch']} | {r['num_splits']} | {r['tile']} | {r['us']} | {r['TBps']} | "
              f"{'best' if r.get('best') else 'default'} |")


if __name__ == "__main__":
    main()
