"""`python -m experiments.kernels.hostloop`: the engine's host work per decode step, without the model.

The model's decode forward and the sampler are replaced by stubs that return fixed logits and
tokens, so what is timed is what the host does around them every step: scheduling and block
bookkeeping, building the step's input tensors (ids, positions, block tables, sampling
parameters), appending tokens and checking stop conditions. On the GPU this work either hides behind the running
step (overlap scheduling) or, when it is longer than the step, sets the pace — so it is a number to
keep small. CPU only; B sequences of `--tokens` new tokens (n samples per prompt, like a GRPO batch).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rollplex.bench.timing import env_info
from rollplex.engine import Engine, EngineConfig, SamplingParams
from rollplex.models import load_model
from rollplex.tiny import ensure_tiny


class StepClock:
    def __init__(self):
        self.t: list[float] = []

    def on_decode_step(self, info) -> None:
        self.t.append(time.perf_counter())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.kernels.hostloop")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=352)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--with-sampler", action="store_true", help="keep the real sampler (CPU compute)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = load_model(ensure_tiny()).eval()
    V = model.cfg.text.vocab_size
    clock = StepClock()
    eng = Engine(model, None, EngineConfig(max_num_seqs=args.batch, max_model_len=args.prompt_len + args.tokens + 16,
                                           kv_cache_tokens=(args.prompt_len + args.tokens + 16) * args.batch),
                 hooks=[clock])
    logits = torch.randn(args.batch, V, generator=torch.Generator().manual_seed(0))
    eng.runner._decode_forward = lambda meta, bt, *a, **kw: logits[: meta.shape[1]]  # no model: host work only
    tokens, logprobs = logits.argmax(-1), logits.log_softmax(-1).amax(-1)
    if not args.with_sampler:  # on the GPU sampling is device work; here it would be CPU compute
        eng.sampler = lambda lg, st: (tokens[: lg.shape[0]], logprobs[: lg.shape[0]])
    prompts = [[5 + (i % 200)] * args.prompt_len for i in range(args.batch // args.n)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=args.tokens, ignore_eos=True, n=args.n, seed=0)
    per_step = []
    for _ in range(args.repeats):
        clock.t.clear()
        eng.generate(prompts, sp)
        periods = [(b - a) * 1e3 for a, b in zip(clock.t[:-1], clock.t[1:])]
        per_step.append(statistics.median(periods))
    r = {"bench": "hostloop", "batch": args.batch, "tokens": args.tokens, "with_sampler": args.with_sampler,
         "host_ms_per_decode_step": round(statistics.median(per_step), 3), **env_info()}
    print(json.dumps(r))


if __name__ == "__main__":
    main()
