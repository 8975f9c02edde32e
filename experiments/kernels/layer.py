"""`python -m experiments.kernels.layer`: the decode step's decoder layers under different GEMM choices.

Asks whether inductor's own GEMM choices beat the model's: in the graphed decode step at small batch
most of the time goes to the four GEMMs of each layer, which stream their weights below the HBM
bandwidth. Here the layers' compiled glue + GEMMs (`_pre_attention`, `_post_attention`; attention
replaced by passing q through, since it is not what varies) run once per decoder layer with distinct
weights inside one CUDA graph, per variant:

* `default`   - torch.compile as the model does it (GEMMs are cuBLAS calls)
* `autotune`  - inductor max-autotune: cuBLAS vs Triton GEMM templates timed per shape, epilogue /
                prologue fusion into the chosen template
* `autotune+` - plus persistent TMA templates and split-K decomposition (decompose_k) for any K
                at least 4x the output's larger side

Each variant's outputs are checked against `default`, then timed (median graph replay). Prints JSON
lines and a table; inductor's autotune tables go to stderr.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from rollplex.bench.timing import env_info, time_ms
from rollplex.engine.decode_forward import _pre_attention
from rollplex.models import ModelConfig
from rollplex.models.text import _post_attention
from rollplex.presets import preset

VARIANTS = {
    "default": {},
    "autotune": {"max_autotune": True},
    "autotune+": {"max_autotune": True, "triton.enable_persistent_tma_matmul": True,
                  "triton.decompose_k_threshold": 4},
}


def layer_weights(cfg: ModelConfig, n: int, dev, dtype, seed: int = 0) -> list[dict]:
    t = cfg.text
    C, D, H, Hkv, I = t.hidden_size, t.head_dim, t.num_attention_heads, t.num_key_value_heads, t.intermediate_size
    g = torch.Generator(device=dev).manual_seed(seed)

    def w(*shape, scale=0.02):
        return (torch.randn(*shape, device=dev, dtype=dtype, generator=g) * scale)

    return [dict(norm1=1 + w(C, scale=0.1), qkv_w=w((H + 2 * Hkv) * D, C), qkv_b=w((H + 2 * Hkv) * D),
                 o_w=w(C, H * D), norm2=1 + w(C, scale=0.1), gate_up_w=w(2 * I, C), down_w=w(C, I))
            for _ in range(n)]


def run_layers(pre, post, x, layers, cfg: ModelConfig):
    t = cfg.text
    delta = None
    for lw in layers:
        q, k, v, x = pre(x, delta, lw["norm1"], lw["qkv_w"], lw["qkv_b"], t.rms_norm_eps, t.num_attention_heads,
                         t.num_key_value_heads)
        # q stands in for the attention output, contiguous like the kernel's
        x, delta = post(x, q.contiguous(), lw["o_w"], lw["norm2"], lw["gate_up_w"], lw["down_w"], t.rms_norm_eps)
    return x + delta


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.kernels.layer")
    ap.add_argument("--preset", default="qwen2.5-vl-3b", help="a preset name or an HF config.json")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--layers", type=int, default=0, help="0 = the model's layer count")
    args = ap.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    cfg = ModelConfig.from_hf(args.preset) if args.preset.endswith(".json") else preset(args.preset)
    n = args.layers or cfg.text.num_hidden_layers
    layers = layer_weights(cfg, n, dev, dtype)
    wbytes = sum(v.numel() * v.element_size() for lw in layers for v in lw.values())
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        x = torch.randn(B, 1, cfg.text.hidden_size, device=dev, dtype=dtype)
        ref = None
        for name in args.variants.split(","):
            opts = VARIANTS[name]
            torch._dynamo.reset()
            kw = dict(dynamic=False, **({"options": opts} if opts else {}))
            pre, post = torch.compile(_pre_attention, **kw), torch.compile(_post_attention, **kw)
            if dev == "cpu":
                pre, post = _pre_attention, _post_attention
            with torch.no_grad():
                out = run_layers(pre, post, x, layers, cfg)
                err = 0.0 if ref is None else ((out.float() - ref.float()).abs().max() /
                                               ref.float().abs().max()).item()
                ref = out if ref is None else ref
                if dev == "cuda":
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        run_layers(pre, post, x, layers, cfg)
                    torch.cuda.current_stream().wait_stream(side)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        run_layers(pre, post, x, layers, cfg)
                    ms = time_ms(g.replay, warmup=3, iters=20)
                    del g
                else:
                    ms = time_ms(functools.partial(run_layers, pre, post, x, layers, cfg), device=dev)
            r = {"bench": "layer", "batch": B, "variant": name, "layers": n, "ms": round(ms, 3),
                 "TBps": round(wbytes / ms / 1e9, 2), "rel_err_vs_default": round(err, 5), **env_info()}
            print(json.dumps(r), flush=True)
            rows.append(r)
    print(f"\n{'B':>4} {'variant':<11} {'ms':>7} {'TB/s':>6} {'vs default':>10} {'rel err':>8}")
    base = {r["batch"]: r["ms"] for r in rows if r["variant"] == rows[0]["variant"]}
    for r in rows:
        print(f"{r['batch']:>4} {r['variant']:<11} {r['ms']:>7.3f} {r['TBps']:>6.2f} "
              f"{base[r['batch']] / r['ms']:>9.3f}x {r['rel_err_vs_default']:>8.5f}")


if __name__ == "__main__":
    main()
