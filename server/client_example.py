"""A Python client for the Rollplex server (httpx): generate with an image, a GRPO rollout, a train step.

    python -m rollplex.server &                                  # or server/launch.sh on a GPU
    python server/client_example.py --url http://127.0.0.1:30000 [--api-key KEY] [--image cat.png]

Without --image a small red square is sent. Rewards are computed here, client-side, to show the
`rewards` form of /train_step (the server can also score with a registered `reward` name).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import sys

import httpx

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # one per image in /generate text prompts


def image_b64(path: str | None) -> str:
    if path:
        with open(path, "rb") as f:
            return base64.b64encode(f.read()).decode()
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (220, 40, 40)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def check(r: httpx.Response) -> dict | list:
    if r.status_code >= 400:
        sys.exit(f"{r.request.method} {r.request.url.path} -> {r.status_code}: {r.json()['error']['message']}")
    return r.json()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--api-key", default=os.environ.get("ROLLPLEX_API_KEY"))
    ap.add_argument("--image", default=None, help="an image file (default: a red square)")
    ap.add_argument("--n", type=int, default=4)
    args = ap.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    c = httpx.Client(base_url=args.url, headers=headers, timeout=600)
    img = image_b64(args.image)

    print("health:", check(c.get("/health")))

    # 1. SGLang-style generation: templated text with an image placeholder, greedy, with logprobs
    text = (f"<|im_start|>user\n{IMAGE}What color is the shape? Answer with one word.<|im_end|>\n"
            "<|im_start|>assistant\n")
    out = check(c.post("/generate", json={"text": text, "image_data": img, "return_logprob": True,
                                          "sampling_params": {"temperature": 0, "max_new_tokens": 16}}))
    print("generate:", repr(out["text"]), out["meta_info"]["finish_reason"],
          "logprobs:", [round(lp, 3) for lp, _, _ in out["meta_info"]["output_token_logprobs"][:5]])

    # streaming: Server-Sent Events, cumulative text per chunk, then [DONE]
    with c.stream("POST", "/generate", json={"text": text, "image_data": img, "stream": True,
                                             "sampling_params": {"max_new_tokens": 16}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
        print("stream:", repr(last["text"]))

    # 2. a GRPO rollout: chat messages (or verl rows) x n samples; the server keeps it for training
    prompt = {"messages": [{"role": "user", "content": "<image>What color is the shape?\nA. red\nB. green\n"
                                                       "Answer with the letter only."}],
              "images": [img], "ground_truth": "A"}
    ro = check(c.post("/rollout", json={"prompts": [prompt], "n": args.n, "sampling_params": {"max_new_tokens": 8}}))
    for s in ro["samples"]:
        print(f"  sample {s['prompt_index']}.{s['sample_index']}: {s['text']!r} ({s['finish_reason']})")

    # 3. a train step with client-side rewards (one per sample, in the order returned)
    rewards = [1.0 if s["text"].strip().upper().startswith("A") else 0.0 for s in ro["samples"]]
    metrics = check(c.post("/train_step", json={"rollout_id": ro["rollout_id"], "rewards": rewards}))
    keys = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "timing_s/step", "training/global_step")
    print("train_step:", {k: metrics[k] for k in keys if k in metrics})
    # ... or let the server score: {"rollout_id": ..., "reward": "choice"} (uses the prompts' ground truths)

    mem = check(c.get("/memory"))
    print("memory (MiB):", {k: round(v / 2**20, 1) for k, v in mem["regions"].items()})


if __name__ == "__main__":
    main()
