"""`python -m rollplex.demo`: GRPO teaches the embedded tiny Qwen2.5-VL to read colours.

1. Write / load the tiny random-init checkpoint (it knows no language yet).
2. Format warm-up: a few supervised steps on *randomly labelled* answers teach it to reply with one
   option letter and stop — it learns the format, not the answer, so it scores chance (0.25).
3. GRPO with the native engine (shared weights), shared-prefix scoring and training until the mean
   reward reaches the target; a progress bar per step; a reward curve PNG at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from PIL import Image, ImageDraw

from .data import row_to_inputs
from .engine import Engine, EngineConfig
from .models import load_model
from .processor import VLProcessor
from .rl.batch import RolloutBatch
from .rl.config import RLConfig
from .rl.step import RLStep
from .tasks import shape_color
from .tiny import ensure_tiny


def demo_image(color: str = "red", size: int = 56) -> Image.Image:
    img = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(img).ellipse([8, 8, size - 8, size - 8], fill=color)
    return img


def format_warmup(model, processor, rows: list[dict], steps: int, lr: float, seed: int = 0) -> float:
    """Supervised steps on the answer *format*: maximise p(any option letter) for the first token
    and p(<|im_end|>) after a letter. No letter is preferred, so the model learns to answer with a
    letter and stop, not which letter: it stays at chance and must learn to read the image."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    letters = [processor.tokenizer.encode(x, add_special_tokens=False)[0] for x in shape_color.LETTERS]
    loss = torch.tensor(0.0)
    for _ in range(steps):
        batch_rows = rng.sample(rows, min(16, len(rows)))
        prompts = [row_to_inputs(processor, r) for r in batch_rows]
        responses = [[rng.choice(letters), processor.eos_token_id] for _ in prompts]
        batch = RolloutBatch.from_samples(prompts, list(range(len(prompts))), responses, pad_id=0)
        hidden = model.response_hidden(model.prefix(batch.prompts), batch.responses, batch.group)  # [n, 2, C]
        logp = torch.log_softmax(model.logits(hidden).float(), -1)
        any_letter = torch.logsumexp(logp[:, 0, letters], -1)  # log p(first token is some letter)
        stop = logp[:, 1, processor.eos_token_id]  # log p(<|im_end|> | a letter)
        loss = -(any_letter + stop).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def plot_rewards(history: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [h["training/global_step"] for h in history]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
    ax[0].plot(steps, [h["critic/score/mean"] for h in history], marker="o", ms=3)
    ax[0].axhline(0.25, ls="--", c="gray", lw=1, label="chance")
    ax[0].set(xlabel="step", ylabel="mean reward", title="shape colour: reward", ylim=(0, 1.05))
    ax[0].legend()
    ax[1].plot(steps, [h["perf/throughput"] for h in history], marker="o", ms=3, c="tab:orange")
    ax[1].set(xlabel="step", ylabel="tokens/s", title="throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rollplex.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: the embedded tiny model)")
    ap.add_argument("--mode", default="rollplex", choices=["rollplex", "serial"])
    ap.add_argument("--steps", type=int, default=300, help="max GRPO steps (stops early at --target)")
    ap.add_argument("--target", type=float, default=0.8, help="stop when the mean reward of 3 steps reaches it")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--kl-coef", type=float, default=0.0, help="KL loss to the warmed-up reference policy")
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/demo")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    path = args.model or ensure_tiny()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(path, device=device)
    proc = VLProcessor.from_pretrained(path)
    rows = shape_color.make_rows(512, seed=args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    loss = format_warmup(model, proc, rows, args.warmup_steps, lr=1e-3, seed=args.seed)
    print(f"format warm-up: {args.warmup_steps} steps on random letters, loss {loss:.3f} "
          f"({time.perf_counter() - t0:.1f}s)")
    if device == "cuda":  # the demo owns the model (the engine compiles only its decode)
        model.compile()
    engine = Engine(model, proc, EngineConfig(max_num_seqs=256, max_model_len=512))
    cfg = RLConfig(mode=args.mode, n=args.n, temperature=1.0, max_new_tokens=4, lr=args.lr, kl_coef=args.kl_coef,
                   micro_batch_prompts=8, micro_batch_samples=32, seed=args.seed, grad_clip=1.0)
    rl = RLStep(model, engine, cfg, proc, reward_fn="shape_color")
    rng = random.Random(args.seed)
    history: list[dict] = []
    from tqdm import tqdm

    bar = tqdm(range(args.steps), desc=f"GRPO ({args.mode})", unit="step")
    for _ in bar:
        m = rl.step(rng.sample(rows, args.prompts))
        history.append(m)
        recent = sum(h["critic/score/mean"] for h in history[-3:]) / len(history[-3:])
        bar.set_postfix(reward=f"{m['critic/score/mean']:.2f}", avg3=f"{recent:.2f}")
        if len(history) >= 3 and recent >= args.target:
            break
    bar.close()
    with open(out / "metrics.jsonl", "w") as f:
        for h in history:
            f.write(json.dumps(h) + "\n")
    png = plot_rewards(history, out / "reward.png")
    first, last = history[0]["critic/score/mean"], sum(h["critic/score/mean"] for h in history[-3:]) / 3
    print(f"mean reward: {first:.2f} (step 1) -> {last:.2f} (last 3 steps) in {len(history)} steps, "
          f"{time.perf_counter() - t0:.0f}s total")
    print(f"metrics: {out / 'metrics.jsonl'}" + (f", plot: {png}" if png else ""))


if __name__ == "__main__":
    main()
