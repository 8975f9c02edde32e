"""`python -m rollplex.bench memory`: full GRPO steps under the phase-aware memory manager.

Each workload builds the policy (a preset's real shapes, random bf16 weights), the engine with its KV
cache in the manager's `kv_cache` region, and an RLStep (reference model, AdamW with fp32 masters),
prints the plan the manager chose with the all-resident footprint next to it and the measures it took
to fit the device (memory/fit.py: reference offloaded, activation checkpointing, paged AdamW state;
flags given here are kept as given), then runs a warm-up
step and `--steps` timed steps (rollout in `rollplex` mode, reference scoring, actor update) and
reports per phase: seconds, peak GiB, resident GiB, and what the transitions cost.

The engine, the memory manager and the RL step are assembled by rollplex.system.build; the memory, RL
and engine options are flags generated from SystemConfig (rollplex/cli.py), the workload's n, response
length and micro-batch size (`--micro-prompts`, an alias of `--micro-batch-prompts`) unless given.

Correctness first: before anything is timed, the engine's greedy tokens for two prompts are compared
across a release/resume cycle of the KV cache (they must be identical).

Workloads: w3b (3B shapes, 32 prompts x 8 x 512 tokens, one 448^2 image each), w3b-long (16 samples
of 1,536 tokens per prompt: 6x W3B's response tokens), w7b (7B shapes, as w3b).

    python -m rollplex.bench memory --workloads w3b,w3b-long
    python -m rollplex.bench memory --workloads w7b
    python -m rollplex.bench memory --workloads w7b --optimizer-offload moments --gradient-checkpointing
"""

from __future__ import annotations

import gc
import json
import time

import torch

from ..cli import ConfigParser
from ..engine import EngineConfig, SamplingParams
from ..memory import PHASES, PhasePlan
from ..models import ModelConfig, Qwen25VL, init_weights
from ..presets import preset
from ..rl.batch import RolloutBatch
from ..rl.config import RLConfig
from ..rl.step import RLStep
from ..system import SystemConfig, build
from ..tiny import ensure_tiny
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


# The bench's defaults, over SystemConfig's (a workload sets n, max_new_tokens and micro_batch_prompts unless
# they are given; the device, the memory backend and the KV budget follow --device unless given)
DEFAULTS = {"rl": RLConfig(kl_coef=0.001, lr=1e-6),
            "engine": EngineConfig(max_num_seqs=256, max_model_len=2048, max_num_batched_tokens=40000)}
SKIP = ("model", "format_warmup_steps", "backend", "fsdp", "cosched", "tp")


def system_config(ap: ConfigParser, args, label: str) -> SystemConfig:
    """The SystemConfig of workload `label`: the given flags over the workload's settings over DEFAULTS."""
    _, _, n, new_tokens, micro = WORKLOADS[label]
    given = ap.given(args)
    cuda = torch.device(given.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")).type == "cuda"
    own = {"rl.n": n, "rl.max_new_tokens": new_tokens, "rl.micro_batch_prompts": micro,
           "memory.memory_backend": "tms" if cuda else "accounting",
           "engine.kv_cache_tokens": None if cuda else 16384}
    return ap.config(args, **{k: v for k, v in own.items() if k not in given})


def run(label: str, sys_cfg: SystemConfig, args) -> list[dict]:
    name, n_prompts = WORKLOADS[label][:2]
    n, new_tokens = sys_cfg.rl.n, sys_cfg.rl.max_new_tokens
    cfg = _model_config(name)
    torch.manual_seed(0)
    dev = torch.device(sys_cfg.device)
    cuda = dev.type == "cuda"
    with dev:
        model = init_weights(Qwen25VL(cfg), seed=0, std=0.02).to(getattr(torch, sys_cfg.dtype)).eval()
    # the engine with its KV cache in the manager's kv_cache region, and the RL step (rollplex/system.py);
    # a manager under every plan, resident included, whose transitions the bench reports
    system = build(sys_cfg, model=model, reward_fn="exact", managed=True)
    rl, mm, eng, rl_cfg = system.rl, system.memory, system.engine, sys_cfg.rl
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
    del rl, eng, model, system
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rows


def parser() -> ConfigParser:
    ap = ConfigParser(SystemConfig, DEFAULTS, skip=SKIP, prog="python -m rollplex.bench memory",
                      aliases={"rl.micro_batch_prompts": ("--micro-prompts",)},
                      help={"micro_batch_prompts": "prompts (x n samples) per forward/backward of the update "
                                                   "(default: the workload's)",
                            "n": "samples per prompt (default: the workload's)",
                            "max_new_tokens": "response length (default: the workload's)",
                            "memory_backend": "default: tms on cuda, accounting on cpu",
                            "kv_cache_tokens": "default: profiled on cuda, 16384 on cpu"})
    ap.add_argument("--workloads", default="w3b")
    ap.add_argument("--steps", type=int, default=1, help="timed steps after the warm-up step")
    return ap


def main(argv=None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    print(json.dumps({"bench": "memory_env", **env_info()}), flush=True)
    rows = []
    for label in args.workloads.split(","):
        try:
            rows += run(label, system_config(ap, args, label), args)
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
