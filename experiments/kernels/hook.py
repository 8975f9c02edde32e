"""`python -m experiments.kernels.hook [--device cpu|cuda]`: the decode-loop hook's cost.

Runs the same greedy rollout three times per configuration — no hook, a no-op hook, a recording
hook — alternating configurations, and reports the median wall time per decode step of each. The
outputs must be identical (the hook only observes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rollplex.bench.timing import env_info
from rollplex.engine import Engine, EngineConfig, RecordingHook, SamplingParams
from rollplex.models import load_model
from rollplex.tiny import ensure_tiny


class NoOpHook:
    def on_decode_step(self, info) -> None:
        pass


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.kernels.hook")
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    model = load_model(args.model or ensure_tiny(), device=args.device)
    if args.device == "cuda":  # the bench owns the model (the engine compiles only its decode)
        model.compile()
    prompts = [[5 + i, 6, 7, 8] for i in range(args.batch)]
    sp = SamplingParams(temperature=0, max_new_tokens=args.tokens, ignore_eos=True)
    hooks = {"none": [], "noop": [NoOpHook()], "recording": [RecordingHook()]}
    engines = {k: Engine(model, None, EngineConfig(max_num_seqs=args.batch), hooks=h) for k, h in hooks.items()}
    per_step: dict[str, list[float]] = {k: [] for k in hooks}
    outputs = {}
    for _ in range(args.repeats):
        for name, eng in engines.items():
            if args.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            steps0 = eng.decode_steps
            out = eng.generate(prompts, sp)
            if args.device == "cuda":
                torch.cuda.synchronize()
            per_step[name].append((time.perf_counter() - t0) / max(1, eng.decode_steps - steps0) * 1e3)
            outputs[name] = [o.samples[0].token_ids for o in out]
    assert outputs["none"] == outputs["noop"] == outputs["recording"], "a hook changed the outputs"
    rows = {k: round(statistics.median(v), 4) for k, v in per_step.items()}
    print(json.dumps({"bench": "hook", "device": args.device, "batch": args.batch, "ms_per_step": rows,
                      **env_info()}))
    print(f"\n| hook | ms per decode step (median of {args.repeats}) |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v} |")


if __name__ == "__main__":
    main()
