"""`python -m rollplex.bench memory`: full GRPO steps under the phase-aware memory manager.

Each workload builds the policy (a preset's real shapes, random bf16 weights), the engine with its KV
cache in the manager's `kv_cache` region, and an RLStep (reference model, AdamW with fp32 masters),
prints the plan the manager chose with the all-resident footprint next to it and the measures it took
to fit the device (memory/fit.py: reference offloaded, activation checkpointing, paged AdamW state;
flags given here are kept as given), then runs a warm-up
step and `--steps` timed steps (rollout in `rollplex` mode, reference scoring, actor update) and
reports per phase: seconds, peak GiB, resident GiB, and what the transitions cost.

Correctness first: before anything is timed, the engine's greedy tokens for two prompts are compared
across a release/resume cycle of the KV cache (they must be identical).

Workloads: w3b (3B shapes, 32 prompts x 8 x 512 tokens, one 448^2 image each), w3b-long (16 samples
of 1,536 tokens per prompt: 6x W3B's response tokens), w7b (7B shapes, as w3b).

    python -m rollplex.bench memory --workloads w3b,w3b-long
    python -m rollplex.bench memory --workloads w7b
    python -m rollplex.bench memory --workloads w7b --optimizer-offload moments --gradient-checkpointing
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from ..engine import Engine, EngineConfig, SamplingParams
from ..memory import PHASES, MemoryConfig, MemoryManager, PhasePlan
from ..memory.fit import OPTIMIZER_OFFLOADS
from ..models import Qwen25VL, init_weights
from ..presets import preset
from ..rl.batch import RolloutBatch
from ..rl.config import RLConfig
from ..rl.step import RLStep
from .common import make_prompts, sync
from .timing import env_info

GiB = 2**30
WORKLOADS = {  # preset, prompts, n, new tokens, micro-batch prompts
    "w3b": ("qwen2.5-vl-3b", 32, 8, 512, 4),
    "w3b-long": ("qwen2.5-vl-3b", 32, 16, 1536, 4),
    "w7b": ("qwen2.5-vl-7b", 32, 8, 512, 2),
    "tiny": ("tiny", 4, 4, 16, 2),  # the embedded tiny model: a CPU smoke run of this script
}


def _model_config(name: str):
    if name != "tiny":
        return preset(name)
    from ..models import ModelConfig
    from ..tiny import ensure_tiny

    return ModelConfig.from_hf(str(ensure_tiny() / "config.json"))


def _rollout(rl: RLStep, prompts, n: int, new_tokens: int, seed: int) -> tuple[RolloutBatch, float, float]:
    """(batch, decode seconds, seconds to enter the rollout phase)."""
    sync()
    t0 = time.perf_counter()
    rl.memory.enter("rollout")
    sync()
    enter_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = rl.engine.generate(prompts, SamplingParams(n=n, max_new_tokens=new_tokens, ignore_eos=True, seed=seed))
    sync()
    gen_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(seed)
    batch = RolloutBatch.from_samples(
        prompts, [i for i, o in enumerate(outs) for _ in o.samples], [s.token_ids for o in outs for s in o.samples],
        pad_id=0, logprobs=[s.logprobs for o in outs for s in o.samples],
        rewards=torch.rand(sum(len(o.samples) for o in outs), generator=g).round().tolist())
    return batch, gen_s, enter_s


def _check_release_resume(rl: RLStep, prompts) -> bool:
    sp = SamplingParams(n=2, temperature=0.0, max_new_tokens=32)
    rl.memory.enter("rollout")
    a = [[s.token_ids for s in o.samples] for o in rl.engine.generate(prompts[:2], sp)]
    rl.memory.enter("update")
    rl.memory.enter("rollout")
    b = [[s.token_ids for s in o.samples] for o in rl.engine.generate(prompts[:2], sp)]
    return a == b


def run(label: str, args) -> list[dict]:
    name, n_prompts, n, new_tokens, micro = WORKLOADS[label]
    cfg = _model_config(name)
    torch.manual_seed(0)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    with dev:
        model = init_weights(Qwen25VL(cfg), seed=0, std=0.02).to(torch.bfloat16 if cuda else torch.float32).eval()
    if cuda and not args.no_compile:
        model.compile()
    mem_cfg = MemoryConfig(memory_plan=args.memory_plan, memory_overrides=args.memory_overrides,
                           optimizer_offload=args.optimizer_offload, device_capacity_gib=args.device_capacity_gib)
    mm = MemoryManager(PhasePlan.releases_only(), dev, backend="tms" if cuda else "accounting")
    eng = Engine(model, None, EngineConfig(max_num_seqs=256, max_model_len=2048,
                                           gpu_memory_utilization=args.gpu_memory_utilization,
                                           kv_cache_tokens=None if cuda else 16384,
                                           max_num_batched_tokens=40000), memory=mm)
    rl_cfg = RLConfig(n=n, max_new_tokens=new_tokens, kl_coef=0.001, lr=1e-6,
                      micro_batch_prompts=args.micro_prompts or micro,
                      gradient_checkpointing=args.gradient_checkpointing)
    rl = RLStep(model, eng, rl_cfg, reward_fn="exact", memory=mm, memory_cfg=mem_cfg)
    sizes, acts = rl.memory_sizes(), rl.activation_estimate()
    resident = PhasePlan.all_resident()
    # what every region resident in every phase would need, without the fit's measures (optimizer state on
    # the device, no checkpointing): regions, plus the update's activations
    bare, bare_acts = rl.memory_sizes("none"), rl.activation_estimate(checkpointing=False)
    setup = {"bench": "memory_setup", "workload": label, "plan": mm.plan.to_dict()["phases"],
             "sizes_gib": {k: round(v / GiB, 2) for k, v in sizes.items()},
             "all_resident_regions_gib": round(resident.resident_bytes("update", bare) / GiB, 1),
             "all_resident_update_peak_gib": round(resident.peak("update", bare, bare_acts) / GiB, 1),
             "planned_peak_gib": {p: round(mm.plan.peak(p, sizes, acts) / GiB, 1) for p in PHASES},
             # what the plan chose to fit the device (memory/fit.py), and from what
             "fit": rl.memory_fit.to_dict(), "kv_blocks": eng.runner.num_blocks}
    print(json.dumps(setup), flush=True)
    print(mm.plan.table(sizes, acts), flush=True)
    prompts, _ = make_prompts(cfg, n_prompts, 1, size=448 if cuda else 56, text=96 if cuda else 8, device=dev,
                              dtype=next(model.parameters()).dtype)
    ok = _check_release_resume(rl, prompts)
    print(json.dumps({"bench": "memory_check", "workload": label, "tokens_identical_after_release_resume": ok}),
          flush=True)
    if not ok:
        raise SystemExit("engine tokens changed across a KV release/resume")
    rows = []
    for step in range(args.steps + 1):
        batch, gen_s, enter_s = _rollout(rl, prompts, n, new_tokens, seed=step)
        sync()
        t0 = time.perf_counter()
        m = rl.train(batch)
        sync()
        train_s = time.perf_counter() - t0
        step_s = enter_s + gen_s + train_s  # train_s includes the ref / update transitions
        row = {"bench": "memory", "workload": label, "step": "warm-up" if step == 0 else f"timed{step}",
               "gen_s": round(gen_s, 2), "rollout_tok_s": round(batch.num_samples * new_tokens / gen_s),
               "ref_s": round(m.get("timing_s/ref", 0.0), 2), "update_s": round(m["timing_s/update_actor"], 2),
               "step_s": round(step_s, 2), "transition_s": round(m["memory/transition_s"], 3),
               "transition_share": round(m["memory/transition_s"] / step_s, 4),
               "offload_copy_gib": round(m["memory/offload_copy_gib"], 1),
               "micro_batch_prompts": rl.actor._plan(rl_cfg).prompts,
               **{f"{p}_peak_gib": round(m.get(f"memory/{p}/peak_gib", 0.0), 1) for p in ("rollout", "ref", "update")},
               **{f"{p}_resident_gib": round(m.get(f"memory/{p}/resident_gib", 0.0), 1)
                  for p in ("rollout", "ref", "update")},
               "pg_loss": m["actor/pg_loss"], "grad_norm": m["actor/grad_norm"],
               "transitions": {k.removeprefix("memory/"): round(v, 4) for k, v in m.items()
                               if k.startswith(("memory/pause_s", "memory/resume_s"))}}
        print(json.dumps(row), flush=True)
        rows.append(row)
    del rl, eng, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rollplex.bench memory")
    ap.add_argument("--workloads", default="w3b")
    ap.add_argument("--steps", type=int, default=1, help="timed steps after the warm-up step")
    ap.add_argument("--memory-plan", default="auto", choices=["auto", "release", "resident"])
    ap.add_argument("--memory-overrides", default=None)
    ap.add_argument("--optimizer-offload", default="auto", choices=OPTIMIZER_OFFLOADS,
                    help="auto: none, unless the memory plan needs moments or all to fit the device")
    ap.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                    help="default: on only when the memory plan needs it to fit the device")
    ap.add_argument("--device-capacity-gib", type=float, default=None,
                    help="device memory the plan fits the step into (default: the GPU's total memory)")
    ap.add_argument("--micro-prompts", type=int, default=None,
                    help="prompts (x n samples) per forward/backward of the update (default: the workload's)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="the engine's share (the server default)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    print(json.dumps({"bench": "memory_env", **env_info()}), flush=True)
    rows = []
    for label in args.workloads.split(","):
        try:
            rows += run(label, args)
        except ValueError as e:  # the memory plan found no way to fit the step: its reasons, not a traceback
            raise SystemExit(f"bench memory {label}: {e}") from None
    print("\n| workload | step | rollout tok/s | gen s | ref s | update s | step s | transitions s (share) | "
          "peak GiB rollout / ref / update | micro-batch prompts |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['step']} | {r['rollout_tok_s']} | {r['gen_s']} | {r['ref_s']} | "
              f"{r['update_s']} | {r['step_s']} | {r['transition_s']} ({r['transition_share']:.1%}) | "
              f"{r['rollout_peak_gib']} / {r['ref_peak_gib']} / {r['update_peak_gib']} | {r['micro_batch_prompts']} |")


if __name__ == "__main__":
    main()
