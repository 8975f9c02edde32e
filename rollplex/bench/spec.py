"""`python -m rollplex.bench spec`: the rollout's tail with and without speculative decoding (GPU).

The presets' random weights accept almost no draft from siblings, so the mechanism is measured with a
controlled acceptance: drafts are replayed from an earlier greedy run of the same prompts — the first
`a` draft tokens are the tokens greedy decoding will produce, the rest are wrong — which gives a mean
accepted length of `a` per sequence and verification (less near a sequence's end), at the full cost
of verifying `k` draft tokens. `a = 0` is the no-acceptance case: every draft rejected.

Workload: W3B shapes (Qwen2.5-VL-3B, random bf16 weights), `--prompts` prompts x `--n` samples, each
prompt one 448x448 image + 96 text tokens, greedy, response lengths per prompt from a log-normal tail
(median max_new_tokens / 4). The tail phase runs from the first decode step with at most
`--tail-fraction` of the samples still decoding to the end of the rollout; speculation is allowed
there only (speculative_max_fraction = the tail fraction).

Correctness first: every speculative rollout must give the greedy run's tokens. Then one JSON line per
row and a table last: tail time, tail decode tokens/s, speed-up over speculation off, the measured
mean accepted length and acceptance rate.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ..engine import Engine, EngineConfig, SamplingParams
from ..engine.speculative import Speculator
from .common import make_prompts, sync
from .timing import env_info


def tail_lengths(n_prompts: int, new_tokens: int, seed: int) -> list[int]:
    """Per-prompt response lengths, log-normal with median new_tokens / 4, in [16, new_tokens]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.randn(n_prompts, generator=g) * 0.9) * (new_tokens / 4)
    return [int(v) for v in x.clamp(16, new_tokens).round().tolist()]


class ReplayDrafts:
    """Drafts from a reference run: the next `accept` reference tokens, then wrong tokens up to k."""

    def __init__(self, reference: dict[int, list[int]], accept: int, k: int, vocab: int):
        self.reference, self.accept, self.k, self.vocab = reference, accept, k, vocab

    def __call__(self, seqs, open_requests) -> list[list[int]]:
        out = []
        for s in seqs:
            ref = self.reference[id(s.request.inputs)]
            k = min(self.k, s.request.max_len - len(s) - 1)
            pos = s.num_output_tokens
            nxt = ref[pos : pos + k]
            out.append([t if j < self.accept else (t + 1) % self.vocab for j, t in enumerate(nxt)])
        return out


class TailClock:
    """A decode hook: the host time of the first decode step with at most `limit` sequences."""

    def __init__(self, limit: int):
        self.limit, self.start = limit, None

    def on_decode_step(self, info) -> None:
        if self.start is None and info.batch_size <= self.limit:
            sync()
            self.start = time.perf_counter()


def run(eng: Engine, prompts, params, limit: int):
    clock = TailClock(limit)
    eng.hooks.append(clock)
    stats0 = dict(eng.spec_stats) if eng.spec is not None else {}
    try:
        sync()
        t0 = time.perf_counter()
        outs = eng.generate(prompts, params)
        sync()
        end = time.perf_counter()
    finally:
        eng.hooks.remove(clock)
    return outs, end - t0, end - (clock.start or end), stats0


def tail_tokens(outs, lengths: list[int], limit: int) -> int:
    """Tokens generated while at most `limit` sequences decode (all samples of a prompt run to its length)."""
    per = sorted((n for o, n in zip(outs, lengths) for _ in o.samples), reverse=True)
    cut = per[limit] if limit < len(per) else 0  # tokens before the batch fell to `limit`
    return sum(max(n - cut, 0) for n in per[:limit])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rollplex.bench spec", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen2.5-vl-3b")
    ap.add_argument("--model", default=None, help="an HF checkpoint dir instead of the preset (a CPU check: the "
                    "tiny model with --device cpu)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=1024, help="the longest response (4096: w3b-long-tail)")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per sequence and step")
    ap.add_argument("--accept", default="0,1,2,3,4", help="accepted draft lengths to replay (each <= k)")
    ap.add_argument("--tail-fraction", type=float, default=0.25)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="the engine's share of GPU memory "
                    "(0.7 on an H200 for --max-new-tokens 4096 without preemption)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="append the rows as JSON lines to this file")
    a = ap.parse_args(argv)
    accepts = [int(x) for x in a.accept.split(",")]
    if any(not 0 <= x <= a.k for x in accepts):
        raise SystemExit("--accept lengths must be in [0, k]")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench spec needs a GPU (or --device cpu with a small --model)")
    torch.manual_seed(a.seed)
    if a.model:
        from ..models import load_model

        model = load_model(a.model, a.device, torch.bfloat16 if a.device == "cuda" else torch.float32).eval()
    else:
        from ..presets import random_model

        model = random_model(a.preset, device=a.device, dtype=torch.bfloat16, seed=a.seed).eval()
    name = a.model or a.preset
    total = a.prompts * a.n
    limit = int(a.tail_fraction * total)
    cfg = EngineConfig(max_num_seqs=max(256, total), max_model_len=a.max_new_tokens + 512,
                       gpu_memory_utilization=a.gpu_memory_utilization, max_num_batched_tokens=40000, speculative_tokens=a.k, speculative_max_batch=max(limit, 1),
                       speculative_max_fraction=a.tail_fraction)
    t0 = time.perf_counter()
    eng = Engine(model, None, cfg)
    startup = time.perf_counter() - t0
    dtype = next(model.parameters()).dtype
    prompts, _ = make_prompts(model.cfg, a.prompts, 1, size=a.image_size, seed=a.seed, device=a.device, dtype=dtype)
    lengths = tail_lengths(a.prompts, a.max_new_tokens, a.seed)
    params = [SamplingParams(temperature=0, max_new_tokens=m, ignore_eos=True, n=a.n) for m in lengths]
    spec: Speculator = eng.spec
    eng.spec = None  # speculation off: the normal graphed decode path
    run(eng, prompts, params, limit)  # warm-up (compiles the sampler and prefill shapes)
    outs, total_s, tail_s, _ = run(eng, prompts, params, limit)
    reference = {id(p): o.samples[0].token_ids for p, o in zip(prompts, outs)}
    vocab = model.cfg.text.vocab_size
    n_tail = tail_tokens(outs, lengths, limit)
    env = env_info()
    rows = [{"workload": "spec-tail", "model": name, "drafts": "off", "rollout_s": total_s, "tail_s": tail_s,
             "tail_tok_s": n_tail / tail_s, "speedup": 1.0, "mean_accepted": 0.0, "acceptance": 0.0}]
    eng.spec = spec
    spec.drafts = ReplayDrafts(reference, max(accepts), a.k, vocab)
    run(eng, prompts, params, limit)  # warm-up of the verify path
    for acc in accepts:
        spec.drafts = ReplayDrafts(reference, acc, a.k, vocab)
        before = dict(spec.stats.__dict__)
        got, total_s, tail_s, _ = run(eng, prompts, params, limit)
        for p, o in zip(prompts, got):  # correctness: greedy tokens as without speculation
            if any(s.token_ids != reference[id(p)] for s in o.samples):
                raise SystemExit(f"speculation changed greedy tokens (replayed acceptance {acc})")
        d = {k: spec.stats.__dict__[k] - before[k] for k in before}
        rows.append({"workload": "spec-tail", "model": name, "drafts": f"replay a={acc}", "rollout_s": total_s,
                     "tail_s": tail_s, "tail_tok_s": n_tail / tail_s, "speedup": rows[0]["tail_s"] / tail_s,
                     "mean_accepted": d["accepted"] / max(d["seq_steps"], 1),
                     "acceptance": d["accepted"] / max(d["drafted"], 1)})
    print(f"correctness: every speculative rollout gave the greedy tokens of speculation off "
          f"({total} samples, tail = at most {limit} sequences decoding, {n_tail} tail tokens)")
    meta = {**env, "prompts": a.prompts, "n": a.n, "max_new_tokens": a.max_new_tokens, "k": a.k,
            "tail_limit": limit, "startup_s": startup}
    for r in rows:
        line = json.dumps({**r, **meta})
        print(line)
        if a.json:
            with open(a.json, "a") as f:
                f.write(line + "\n")
    print(f"\n{name}, {a.prompts}x{a.n}, up to {a.max_new_tokens} tokens, k={a.k}, {env.get('gpu', a.device)}")
    print("| drafts | rollout s | tail s | tail tok/s | tail speed-up | mean accepted | acceptance |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['drafts']} | {r['rollout_s']:.2f} | {r['tail_s']:.3f} | {r['tail_tok_s']:.0f} | "
              f"{r['speedup']:.2f}x | {r['mean_accepted']:.2f} | {r['acceptance']:.2f} |")


if __name__ == "__main__":
    main()
