"""`python -m rollplex.demo`: load a checkpoint (default: the embedded tiny model), encode an image
prompt with the checkpoint's processor, generate a few tokens and score them with a full forward.

This is the smoke test a newcomer runs first; later it grows into the GRPO learning demo.
"""

from __future__ import annotations

import argparse

import torch
from PIL import Image, ImageDraw

from .generate import generate
from .models import load_model
from .processor import VLProcessor
from .tiny import ensure_tiny


def demo_image(color: str = "red", size: int = 56) -> Image.Image:
    img = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(img).ellipse([8, 8, size - 8, size - 8], fill=color)
    return img


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rollplex.demo")
    ap.add_argument("--model", default=None, help="HF checkpoint directory (default: embedded tiny model)")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    path = args.model or ensure_tiny()
    model = load_model(path, device=args.device).eval()
    proc = VLProcessor.from_pretrained(path)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color is the shape?"}]}]
    prompt = proc.encode(messages=messages, images=[demo_image()])
    gen = generate(model, prompt, args.max_new_tokens, stop_token_ids=(proc.eos_token_id,))
    # score prompt + response with one full forward: the engine-side logprobs must match
    full = type(prompt)(**{**prompt.__dict__, "input_ids": prompt.input_ids + gen.token_ids})
    with torch.no_grad():
        logits = model([full])[0].float()
    P = len(prompt.input_ids)
    rows = torch.log_softmax(logits[P - 1 : P - 1 + len(gen.token_ids)], -1)
    scored = rows.gather(-1, torch.tensor(gen.token_ids, device=rows.device)[:, None]).squeeze(-1)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {path} ({n_params / 1e6:.2f}M params, {args.device})")
    print(f"prompt: {P} tokens, image grid {prompt.image_grid_thw.tolist()}")
    print(f"generated {len(gen.token_ids)} tokens ({gen.finish_reason}): {proc.decode(gen.token_ids)!r}")
    diff = (scored.cpu() - torch.tensor(gen.logprobs)).abs().max().item()
    print(f"max |generation logprob - full-forward logprob| = {diff:.2e}")


if __name__ == "__main__":
    main()
