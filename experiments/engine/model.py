"""`python -m experiments.engine.model`: our Qwen2.5-VL vs transformers' on the GPU.

1. Correctness: W3B shapes (random bf16 weights shared by both models), one 448x448 image + 96
   text tokens: max/mean |logit difference| and argmax agreement, plus the ViT output difference.
2. Speed: the vision tower on 32 images of 448x448 (32 x 1024 patches), ours (flash varlen and
   padded-SDPA backends) vs transformers' (its per-window Python loop), CUDA events, medians.
Prints JSON lines, then a short table.
"""

from __future__ import annotations

import argparse
import json

import torch

from rollplex.bench.common import vit_flops
from rollplex.bench.timing import env_info, time_ms
from rollplex.models import Qwen25VL, hf_model, hf_to_rollplex
from rollplex.presets import preset


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.engine.model")
    ap.add_argument("--preset", default="qwen2.5-vl-3b")
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--size", type=int, default=448)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--skip-hf-vit", action="store_true")
    args = ap.parse_args(argv)
    dev, dt = "cuda", torch.bfloat16
    cfg = preset(args.preset)
    torch.manual_seed(0)
    with torch.device(dev):
        hf = hf_model(cfg).to(dt).eval()  # transformers' model of the preset's family
    ours = Qwen25VL(cfg).to(dev)
    ours.load_state_dict(hf_to_rollplex(hf.state_dict(), cfg), strict=True)
    ours = ours.to(dt).eval()
    info = env_info()
    rows = []

    # --- 1. logits parity, one image + 96 text tokens --------------------------------------
    g = torch.Generator().manual_seed(0)
    side = args.size // cfg.vision.patch_size
    n_img = side * side // cfg.vision.spatial_merge_size**2
    ids = torch.randint(0, 150000, (48,), generator=g).tolist()
    ids = ids + [cfg.vision_start_token_id] + [cfg.image_token_id] * n_img + [cfg.vision_end_token_id]
    ids = ids + torch.randint(0, 150000, (46,), generator=g).tolist()
    pix = torch.randn(side * side, cfg.vision.patch_dim, generator=g).to(dev, dt)
    grid = torch.tensor([[1, side, side]], device=dev)

    class P:
        input_ids = ids
        pixel_values = pix
        image_grid_thw = grid

    with torch.no_grad():
        t = torch.tensor([ids], device=dev)
        mm = (t == cfg.image_token_id).int()
        ref = hf(input_ids=t, pixel_values=pix, image_grid_thw=grid, mm_token_type_ids=mm).logits[0].float()
        got = ours([P])[0].float()
        diff = (got - ref).abs()
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        vref = torch.cat(hf.model.get_image_features(pix, grid).pooler_output).float()
        vgot = ours.visual(pix, [(1, side, side)]).float()
    r = {"bench": "model_logits_bf16", "preset": args.preset, "tokens": len(ids),
         "max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(),
         "ref_abs_mean": ref.abs().mean().item(), "argmax_agree": agree,
         "vit_max_abs_diff": (vgot - vref).abs().max().item(), "vit_ref_abs_mean": vref.abs().mean().item(), **info}
    print(json.dumps(r), flush=True)
    rows.append(r)
    # fp32 copies of the same weights: the implementations agree in fp32; in bf16 each is about as far
    # from the fp32 result as the other, i.e. the bf16 gap is rounding, not a different computation
    with torch.no_grad():
        got32 = ours.float()([P])[0]
        hf.float()
        hf.model.visual.float()
        ref32 = hf(input_ids=t, pixel_values=pix.float(), image_grid_thw=grid, mm_token_type_ids=mm).logits[0]
        r2 = {"bench": "model_logits_fp32", "fp32_max_abs_diff": (got32 - ref32).abs().max().item(),
              "fp32_mean_abs_diff": (got32 - ref32).abs().mean().item(),
              "ours_bf16_vs_fp32_mean_abs": (got - got32).abs().mean().item(),
              "hf_bf16_vs_fp32_mean_abs": (ref - ref32).abs().mean().item()}
        ours, hf = ours.to(dt), hf.to(dt)
    print(json.dumps(r2), flush=True)
    rows.append(r2)

    # --- 2. ViT speed -------------------------------------------------------------------------
    grids = [(1, side, side)] * args.images
    pixels = torch.randn(args.images * side * side, cfg.vision.patch_dim, device=dev, dtype=dt)
    flops = vit_flops(cfg, grids)
    timings = {}
    with torch.no_grad():
        for backend in ("auto", "sdpa"):
            ours.visual.set_attention_backend(backend)
            timings[f"ours_{backend}"] = time_ms(lambda: ours.visual(pixels, grids), iters=args.iters)
        ours.visual.set_attention_backend("auto")
        ours.visual.compile()
        timings["ours_compiled"] = time_ms(lambda: ours.visual(pixels, grids), warmup=3, iters=args.iters)
        if not args.skip_hf_vit:
            gt = torch.tensor(grids, device=dev)
            timings["transformers"] = time_ms(lambda: hf.model.visual(pixels, grid_thw=gt), warmup=1, iters=3)
    for name, ms in timings.items():
        r = {"bench": "vit", "impl": name, "images": args.images, "size": args.size, "ms": round(ms, 2),
             "tflops": round(flops / ms / 1e9, 1), **info}
        print(json.dumps(r), flush=True)
        rows.append(r)

    print("\n| check | value |\n|---|---|")
    r0 = rows[0]
    print(f"| logits bf16 max/mean abs diff vs transformers | {r0['max_abs_diff']:.4f} / {r0['mean_abs_diff']:.5f} "
          f"(mean |logit| {r0['ref_abs_mean']:.3f}, argmax agree {r0['argmax_agree']:.3f}) |")
    print(f"| logits fp32 max/mean abs diff vs transformers | {r2['fp32_max_abs_diff']:.2e} / "
          f"{r2['fp32_mean_abs_diff']:.2e} |")
    print(f"| bf16 vs fp32 mean abs diff: ours / transformers | {r2['ours_bf16_vs_fp32_mean_abs']:.4f} / "
          f"{r2['hf_bf16_vs_fp32_mean_abs']:.4f} |")
    for name, ms in timings.items():
        print(f"| ViT {args.images}x{args.size}^2 {name} | {ms:.1f} ms ({flops / ms / 1e9:.0f} TFLOP/s) |")


if __name__ == "__main__":
    main()
