"""`python -m rollplex.bench step`: one GRPO step, `serial` vs `rollplex`, side by side, warm.

Workloads (bench/workloads.py): W3B (32 prompts x n=8, one 448x448 image + 96 text tokens, 512 new tokens),
W3B-video (8 frames of 448x448 -> 1024 visual tokens), their tails (lengths per sample from a long tail)
and w3b-long-tail (16 x 16, log-normal lengths up to 4096, median 800); `--preset` picks the model
(qwen3-vl-4b runs the same shapes on Qwen3-VL-4B).

`serial` is verl's best configuration: each sample a full sequence with its image re-encoded, the
sequences packed without padding (use_remove_padding) in micro-batches cut by a token budget
(use_dynamic_bsz, `--serial-max-tokens`: a comma list, one row per budget, the fastest the summary's
`serial`), old logprobs skipped with one update per rollout. `serial-padded` is the older baseline:
`--micro-samples` sequences per pass, right-padded to the longest.

A step is one engine rollout, shared by the modes (the rollout is identical in all), then reference
scoring and the actor update in each mode on that batch from the same initial weights. Correctness
first: on a small batch the modes' losses agree.

Every phase is timed warm: a warm-up step of the same shapes (its own rollout, with another seed, and
both modes' scoring + update) runs first and pays the one-off costs (dynamo compiles and recompiles at
the full batch shape, the allocator growing, first-call autotuning); then a second, different step is
timed. The warm-up step is reported separately as the cold start (`cold_*` fields, `cold` table rows),
so the step ratio is the one a training loop sees from its second step on. Reports per-phase times,
the step ratio and the actor update's MFU (executed FLOPs / time / 989 TFLOP/s bf16 dense peak).

The policy (random weights of `--preset`) and the engine are assembled by rollplex.system.build, each
row's RL step by `System.rl_step`; the RL, engine and co-scheduler options are flags generated from
SystemConfig (rollplex/cli.py: `--kl-coef`, `--micro-batch-prompts`, `--no-packed`, `--job-prompts`,
...), the older `--micro-prompts`, `--micro-samples` and `--micro-tokens` kept as aliases.

Memory: every region stays resident (`--memory-plan resident`, the default) unless a memory flag says
otherwise; PPO with a critic (`--adv-estimator gae`) defaults to the phase-aware plan (`auto`,
memory/fit.py), because a 3B critic's weights, gradients and AdamW state do not fit one 141 GB GPU beside
the resident GRPO step. Under a plan the bench enters the manager's phases around its own engine and
reference work, allocates its reference in the `ref_weights` region, keeps the initial weights it restores
between rows in host memory, and drops each row's trainer from the manager before the next row builds
its own. Each row reports the plan it ran under (`memory_plan`: the plan's name with the measures taken).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import time
from dataclasses import asdict, fields, replace

import torch

from ..cli import ConfigParser
from ..cosched import CoschedConfig, PrefixRows, Timeline
from ..engine import Engine, EngineConfig, SamplingParams
from ..memory import MemoryConfig
from ..models import ModelConfig, Qwen25VL, init_weights
from ..presets import preset
from ..rl.batch import RolloutBatch
from ..rl.config import RLConfig
from ..rl.fuse_gate import FuseGate
from ..rl.parts import TRAINER_REGIONS
from ..rl.step import RLStep
from ..system import System, SystemConfig, build
from . import step_sglang
from .common import PEAK_TFLOPS, make_prompts, sync, update_flops
from .timing import env_info
from .workloads import Workload, workload


def rollout(eng: Engine, prompts: list, params: list[SamplingParams], seed: int,
            keep_vision: bool = False) -> tuple[RolloutBatch, float, int]:
    """One timed engine rollout (fixed lengths: ignore_eos) with random 0/1 rewards: (batch, seconds,
    graphs dynamo compiled during it). keep_vision: the prompts carry the prefill's vision encodings."""
    from torch._dynamo.utils import counters

    graphs0 = counters["stats"]["unique_graphs"]
    sync()
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params, keep_vision=keep_vision)
    sync()
    gen_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(seed)
    batch = RolloutBatch.from_outputs(prompts, outs, pad_id=0)
    batch.rewards = torch.rand(batch.num_samples, generator=g).round()
    if keep_vision:
        batch.prompts = [replace(p, vision_embeds=o.vision_embeds) for p, o in zip(prompts, outs)]
    return batch, gen_s, counters["stats"]["unique_graphs"] - graphs0


def strip_vision(batch: RolloutBatch) -> RolloutBatch:
    """The batch as serial mode sees it: each sample re-encodes its images (verl's order)."""
    return replace(batch, prompts=[replace(p, vision_embeds=None) for p in batch.prompts])


def run_modes(system: System, batch: RolloutBatch, rl_kw: dict, grid, label: str, cfg, step: str = "timed",
              modes=("serial", "rollplex"), frozen: bool = False, init=None, ref=None,
              backoffs: dict | None = None) -> list[dict]:
    """Reference scoring + actor update of `batch` in each mode, each from the same initial weights
    (restored between the modes); one JSON row per mode. backoffs: the micro-batchings an out-of-memory
    back-off halved to, carried from a row to the next of its workload and mode (filled here), as a
    training loop's trainer keeps them from its first step on."""
    model = system.model
    init = init or initial_weights(system)
    ref = ref or reference(system)
    rows = []
    for mode in modes:
        restore(model, init, frozen)
        rl = trainer(system, RLConfig(**mode_kw(mode, rl_kw), freeze_vision_tower=frozen), rollout=False,
                     reward_fn="exact", ref_model=ref)
        key = (label, mode, frozen)
        if backoffs is not None and key in backoffs:
            _set_backoffs(rl, backoffs[key])
        rows.append(_train_row(rl, copy.copy(batch), cfg, grid, label, step, mode, frozen))
        if backoffs is not None:
            backoffs[key] = _backoffs(rl)
        del rl
        _drop_trainer(system)
    return rows


def mode_kw(mode: str, rl_kw: dict) -> dict:
    """A row's RLConfig fields: `serial@TOKENS` packs its sequences in passes of TOKENS tokens (verl's
    use_remove_padding + use_dynamic_bsz), `serial-padded` pads `micro_batch_samples` sequences per pass,
    any other mode takes rl_kw as given."""
    if mode == "serial-padded":
        return {**rl_kw, "mode": "serial", "packed": False, "micro_batch_max_tokens": None}
    if mode.startswith("serial@"):
        return {**rl_kw, "mode": "serial", "packed": True, "micro_batch_max_tokens": int(mode.split("@", 1)[1])}
    return {**rl_kw, "mode": mode}


def workload_kw(rl_kw: dict, wl: Workload, given: dict) -> None:
    """Set the workload's RL fields in rl_kw (those given on the command line win): its samples per prompt and
    longest response (what the memory plan's activation estimate reads), micro-batches that fit one 141 GB GPU
    next to the KV cache, the reference and the optimizer state (8 serial video sequences per pass do not: a
    video prompt has 3x the tokens), and for reasoning lengths activation checkpointing and rollplex passes cut
    by a 32k-token budget (a 16-sample group of up to 4096-token responses does not fit one pass without)."""
    video = wl.frames > 1
    rl_kw["n"] = wl.n
    rl_kw["max_new_tokens"] = given.get("rl.max_new_tokens") or wl.new_tokens
    rl_kw["micro_batch_prompts"] = given.get("rl.micro_batch_prompts") or (2 if video else 1 if wl.long else 4)
    rl_kw["micro_batch_samples"] = given.get("rl.micro_batch_samples") or (4 if video else 8)
    rl_kw["micro_batch_max_tokens"] = given.get("rl.micro_batch_max_tokens") or (32768 if wl.long else None)
    for flag in ("gradient_checkpointing", "vision_gradient_checkpointing"):
        rl_kw[flag] = given[f"rl.{flag}"] if f"rl.{flag}" in given else (True if wl.long else None)


def _backoffs(rl: RLStep) -> dict:
    """The trainers' out-of-memory back-off state (rl/microbatch.py Backoff; the actor's training cap)."""
    out = {"actor": rl.actor._backoff, "actor_score": rl.actor.score_backoff}
    if rl.critic is not None:
        out.update(critic_score=rl.critic.score_backoff, critic_train=rl.critic.train_backoff)
    return out


def _set_backoffs(rl: RLStep, kept: dict) -> None:
    rl.actor._backoff, rl.actor.score_backoff = kept["actor"], kept["actor_score"]
    if rl.critic is not None and "critic_train" in kept:
        rl.critic.score_backoff, rl.critic.train_backoff = kept["critic_score"], kept["critic_train"]


def initial_weights(system: System) -> dict:
    """A copy of the policy's weights to restore between rows: on the device, or in host memory under a memory
    plan (whose budget does not count tensors outside its regions)."""
    host = system.memory is not None
    return {k: v.detach().to("cpu", copy=True) if host else v.detach().clone()
            for k, v in system.model.state_dict().items()}


def reference(system: System):
    """The frozen reference every row shares: a copy of the policy, in the `ref_weights` region under a plan."""
    mm = system.memory
    with mm.region("ref_weights") if mm is not None else contextlib.nullcontext():
        return copy.deepcopy(system.model).requires_grad_(False)


def enter(system: System, phase: str) -> None:
    """The memory manager's `phase` (no-op without one) before the bench's own work of that phase: the engine's
    rollout (the KV cache), the reference's passes."""
    if system.memory is not None:
        system.memory.enter(phase)


def trainer(system: System, rl: RLConfig, **kw) -> RLStep:
    """A row's RL step (System.rl_step), built in `update` (the KV cache released); the step resumes the regions
    it allocates in for that."""
    enter(system, "update")
    return system.rl_step(rl, **kw)


def _drop_trainer(system: System) -> None:
    """Let go of a row's trainer (deleted by the caller): the manager's offload and resume callbacks still
    hold its optimizer state and value model, so the next row's would be built beside them. Forgotten before
    the phase changes, so nothing copies what is dropped."""
    mm = system.memory
    if mm is not None:
        for tag in TRAINER_REGIONS:
            if tag != "ref_weights":  # the reference is the bench's own, shared by every row
                mm.forget(tag)
        mm.enter("update")
    _free()


def _plan_name(rl: RLStep) -> str:
    """The memory plan a row ran under: `resident` (no manager), or the configured plan with the measures its
    fit took (memory/fit.py) and the user's overrides."""
    fit, mc = rl.memory_fit, rl.memory_cfg
    if fit is None:
        return "resident"
    return (mc.memory_plan + (f" ({', '.join(fit.measures)})" if fit.measures else "")
            + (f" + {mc.memory_overrides}" if mc.memory_overrides else ""))


def restore(model, init: dict, frozen: bool) -> None:
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(init[k])
    model.requires_grad_(True)
    model.visual.requires_grad_(not frozen)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _probs_diff(m: dict) -> dict:
    """The engine-trainer mismatch of a row (verl's `training/rollout_probs_diff_*`): with the KL loss (trainer
    against reference), it says which side departs when a check row's KL differs between modes."""
    return {k.split("/")[1]: m[k] for k in ("training/rollout_probs_diff_mean", "training/rollout_probs_diff_max")
            if k in m}


def _train_row(rl: RLStep, batch: RolloutBatch, cfg, grid, label: str, step: str, mode: str, frozen: bool,
               gen_s: float | None = None, extra: dict | None = None) -> dict:
    from torch._dynamo.utils import counters

    sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    graphs0 = counters["stats"]["unique_graphs"]
    t0 = time.perf_counter()
    m = rl.train(batch)
    sync()
    wall = time.perf_counter() - t0
    fl = update_flops(cfg, batch, "rollplex" if mode == "cosched" else mode.split("@")[0], grid)
    r = {"bench": "step", "workload": label, "step": step, "mode": mode.split("@")[0],
         "vision": "frozen" if frozen else "trained",
         "prompts": batch.num_prompts, "n": batch.num_samples, "ref_s": round(m.get("timing_s/ref", 0.0), 3),
         "update_actor_s": round(m["timing_s/update_actor"], 3), "ref_plus_update_s": round(wall, 3),
         "update_tflops": round(fl / m["timing_s/update_actor"] / 1e12, 1),
         "update_mfu": round(fl / m["timing_s/update_actor"] / 1e12 / PEAK_TFLOPS, 3),
         "pg_loss": m["actor/pg_loss"], "kl_loss": m["actor/kl_loss"], "grad_norm": m["actor/grad_norm"],
         **_probs_diff(m),
         "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if torch.cuda.is_available() else 0,
         "dynamo_graphs_compiled": counters["stats"]["unique_graphs"] - graphs0,
         "prefix_normal_phase_s": round(m.get("rollplex/prefix_ref_normal_phase_s", 0.0), 3),
         "memory_plan": _plan_name(rl), "micro_batch_max_tokens": rl.cfg.micro_batch_max_tokens,
         "packed": rl.cfg.packed, "gradient_checkpointing": rl.cfg.gradient_checkpointing}
    if any(k.startswith("memory/") and k.endswith("/peak_gib") for k in m):
        # under a plan, on the GPU: the manager's phase peaks, which leave out the regions paused in the phase
        # (the allocator's peak above still counts their tensors)
        r.update({f"{p}_peak_gib": round(m[f"memory/{p}/peak_gib"], 1) for p in ("ref", "update", "update_critic")
                  if f"memory/{p}/peak_gib" in m})
    if "timing_s/update_critic" in m:  # PPO with a critic (adv_estimator gae): the critic's share of the step
        r.update(values_s=round(m["timing_s/values"], 3), update_critic_s=round(m["timing_s/update_critic"], 3),
                 vf_loss=m["critic/vf_loss"])
    if gen_s is not None:
        r["gen_s"] = round(gen_s, 3)
    r.update(extra or {})
    print(json.dumps(r), flush=True)
    return r


def cosched_step(system: System, prompts, params, rl_kw: dict, co_cfg: CoschedConfig, cfg, grid, label: str,
                 step: str, frozen: bool, init: dict, ref, seed: int, timeline: Timeline | None = None) -> dict:
    """A whole step with the co-scheduler: the rollout (the reference's prefix admitted beside decode),
    then scoring and the update consuming the prefix states it handed over."""
    restore(system.model, init, frozen)
    rl = trainer(system, RLConfig(mode="rollplex", cosched=True, freeze_vision_tower=frozen, **rl_kw),
                 reward_fn="exact", ref_model=ref, cosched=co_cfg)
    rl.cosched.tflops = _TFLOPS.get(label, rl.cosched.tflops)
    rl.timeline = timeline
    sync()
    t0 = time.perf_counter()
    batch = rl.generate(prompts, params)
    sync()
    gen_s = time.perf_counter() - t0
    if timeline is not None:
        timeline.host_span("phase", "gen", t0, t0 + gen_s)
    co = rl.rollout_metrics
    g = torch.Generator().manual_seed(seed)
    batch.rewards = torch.rand(batch.num_samples, generator=g).round()
    extra = {k.split("/", 1)[1]: round(v, 4) for k, v in co.items()}
    row = _train_row(rl, batch, cfg, grid, label, step, "cosched", frozen, gen_s, extra)
    _TFLOPS[label] = rl.cosched.tflops  # calibrated: the next step of this workload starts from it
    del rl, batch
    _drop_trainer(system)
    return row


_TFLOPS: dict[str, float] = {}


def fused_step(system: System, prompts, params, rl_kw: dict, fuse: tuple, cfg, grid, label: str,
               step: str, frozen: bool, init: dict, ref, seed: int, timeline: Timeline | None = None,
               gate: FuseGate | None = None, backend=None) -> dict:
    """A whole step on the fused schedule (fuse: (fuse_sms, fuse_below, fuse_chunk_tokens, fuse_admission)):
    groups scored and trained beside the rollout's tail, the rest after it, one optimizer step. Its rewards
    are the phased rows' (the same random 0/1 per sample, in prompt order), so the losses and gradient
    norms compare. gate: the admission gate of the row's earlier steps (its measurements carry over).
    backend: another rollout backend than the system's (SGLang): the restored policy is handed over to it
    first (timed apart from the step)."""
    restore(system.model, init, frozen)
    push_s = step_sglang.push(backend) if backend is not None else None
    sms, below, tokens, admission = fuse
    rl = trainer(system, RLConfig(mode="rollplex", schedule="fused", fuse_sms=sms, fuse_below=below,
                                  fuse_chunk_tokens=tokens, fuse_admission=admission, freeze_vision_tower=frozen,
                                  **rl_kw),
                 reward_fn="exact", ref_model=ref, backend=backend)
    rl.timeline = timeline
    rl.schedule.gate = gate
    offsets = [0]
    for p in params:
        offsets.append(offsets[-1] + p.n)
    scores = torch.rand(offsets[-1], generator=torch.Generator().manual_seed(seed)).round()

    def rewards(_chunk, ids):
        return torch.cat([scores[offsets[i]: offsets[i + 1]] for i in ids]), {}

    sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    batch, m = rl.run(prompts, params, rewards=rewards)
    sync()
    wall = time.perf_counter() - t0
    r = {"bench": "step", "workload": label, "step": step,
         "mode": "fused" if backend is None else f"{backend.name}-fused",
         "vision": "frozen" if frozen else "trained",
         "fuse_sms": sms, "fuse_below": below, "fused": m.get("rollplex/fused", 0.0),
         "step_s": round(wall, 3), "gen_s": round(m["timing_s/gen"], 3),
         "tail_s": round(m.get("timing_s/fused_tail", 0.0), 3),
         "update_actor_s": round(m["timing_s/update_actor"], 3),
         "in_rollout_s": round(m.get("timing_s/fused_in_rollout", 0.0), 3),
         "groups_in_rollout": m.get("rollplex/fused_groups_in_rollout", 0.0),
         "decode_added_s": round(m.get("rollplex/fused_decode_added_s", 0.0), 3),
         # two parts of it: the decode forward's own GPU time, the host's time launching decode steps
         "decode_forward_added_s": round(m.get("rollplex/fused_decode_forward_added_s", 0.0), 3),
         "decode_launch_added_s": round(m.get("rollplex/fused_decode_launch_added_s", 0.0), 3),
         "held_buckets": m.get("rollplex/fused_held_buckets", 0.0), "admission": admission,
         "groups": batch.num_prompts, "pg_loss": m["actor/pg_loss"], "kl_loss": m["actor/kl_loss"],
         "grad_norm": m["actor/grad_norm"], **_probs_diff(m),
         "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if torch.cuda.is_available() else 0,
         "memory_plan": _plan_name(rl)}
    if push_s is not None:
        r["weight_push_s"] = round(push_s, 3)
    print(json.dumps(r), flush=True)
    r["gate"] = rl.schedule.gate
    del rl, batch
    _drop_trainer(system)
    return r


def prefix_standalone_s(ref, prompts, job_prompts: int) -> float:
    """Seconds of the movable work alone: the reference's prefix of every prompt, nothing beside it."""
    for _ in range(2):  # the first pass warms the compiled shapes
        rows = PrefixRows.plan(ref, prompts, job_prompts, "ref")
        sync()
        t0 = time.perf_counter()
        rows.complete()
        sync()
        dt = time.perf_counter() - t0
        del rows
    return dt


# The bench's defaults, over SystemConfig's; the fields each row sets (mode, schedule, co-scheduling, the
# vision tower, the comma lists of fused and co-scheduled variants) have no flag of their own
DEFAULTS = {"rl": RLConfig(kl_coef=0.01, lr=1e-6),
            "engine": EngineConfig(max_num_seqs=256, max_model_len=2048, gpu_memory_utilization=0.2,
                                   max_num_batched_tokens=40000),
            "memory": MemoryConfig(memory_plan="resident")}
PER_ROW = ("mode", "cosched", "schedule", "fuse_sms", "fuse_below", "fuse_chunk_tokens", "fuse_admission",
           "freeze_vision_tower")
SKIP = ("model", "format_warmup_steps", "backend", "fsdp", "tp", "cosched.slowdown_bound", "cosched.side_sms",
        *(f"rl.{f}" for f in PER_ROW if f != "fuse_chunk_tokens"))


def parser() -> ConfigParser:
    ap = ConfigParser(SystemConfig, DEFAULTS, skip=SKIP, prog="python -m rollplex.bench step",
                      aliases={"rl.micro_batch_prompts": ("--micro-prompts",),
                               "rl.micro_batch_samples": ("--micro-samples",),
                               "rl.micro_batch_max_tokens": ("--micro-tokens",)},
                      help={"micro_batch_prompts": "rollplex: prompts (x n samples) per fwd/bwd (default: 4 for w3b, "
                                                   "2 for w3b-video)",
                            "micro_batch_samples": "serial: sequences per fwd/bwd (default: 8 for w3b, 4 for "
                                                   "w3b-video)",
                            "fuse_chunk_tokens": "fused: a chunk of groups also closes at this many tokens",
                            "compile": "torch.compile the model and the engine's decode; default: on cuda",
                            "compile_decode": "default: as --compile",
                            "memory_plan": "resident: nothing moves (the default; with --adv-estimator gae: auto); "
                                           "auto: the cheapest residency plan that fits; release: KV cache and "
                                           "gradients released when idle"})
    ap.add_argument("--preset", default="qwen2.5-vl-3b", help="a preset name or an HF config.json")
    ap.add_argument("--workloads", default="w3b,w3b-video,w3b-tail,w3b-video-tail")
    ap.add_argument("--modes", default="serial,rollplex,fused",
                    help="serial: per-sample full sequences, packed, token-budgeted (verl's best); serial-padded: "
                    "--micro-samples padded sequences per pass; rollplex: prefix sharing, phased; fused: sharing, "
                    "groups trained beside the rollout's tail; cosched: sharing + the prefix co-scheduler")
    ap.add_argument("--serial-max-tokens", default=None,
                    help="serial: token budget per pass (verl's ppo_max_token_len_per_gpu), a comma list, one serial "
                    "row per value (the summary keeps the fastest); default 16384, 32768 for w3b-long-tail")
    ap.add_argument("--long-prompts", type=int, default=16, help="w3b-long-tail: prompts")
    ap.add_argument("--long-n", type=int, default=16, help="w3b-long-tail: samples per prompt")
    ap.add_argument("--long-new-tokens", type=int, default=4096, help="w3b-long-tail: the longest response")
    ap.add_argument("--long-median", type=int, default=800, help="w3b-long-tail: the median response length")
    ap.add_argument("--fuse-sms", default="0", help="fused: comma list, one row per value (crossed with "
                    "--fuse-below); N > 0 confines the fused work to a green context of N SMs")
    ap.add_argument("--fuse-admission", default="always", help="fused: comma list (always, pays), one row per "
                    "value; pays holds chunks in decode-batch buckets where they cost decode more than they saved "
                    "in the row's earlier steps")
    ap.add_argument("--fuse-below", default="1.0", help="fused: comma list; start when at most this fraction of "
                    "the groups is still decoding")
    ap.add_argument("--vision", default="trained,frozen", help="trained and/or frozen (freeze_vision_tower)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--video-prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=512, help="response length (the tails: the longest)")
    ap.add_argument("--image-size", type=int, default=448, help="image / video frame side in pixels")
    ap.add_argument("--text-tokens", type=int, default=96, help="text tokens per prompt around the image")
    ap.add_argument("--slowdown-bound", default=str(CoschedConfig.slowdown_bound),
                    help="comma list: one co-scheduled row per value (crossed with --side-sms)")
    ap.add_argument("--side-sms", default="0", help="comma list: one co-scheduled row per value; 0 shares every SM "
                    "with decode, N > 0 confines the admitted work to a green context of N SMs")
    ap.add_argument("--check-only", action="store_true",
                    help="only the correctness check of each workload (two prompts, every mode), no timed rows")
    ap.add_argument("--no-warm", action="store_true",
                    help="no warm-up step: time the first step (compiles and first-call costs included)")
    ap.add_argument("--compile-dynamic", default="auto", choices=["true", "auto"],
                    help="torch.compile shapes: all symbolic (true) or only those that change (auto)")
    ap.add_argument("--trace", default=None, help="write the first workload's timed co-scheduled step as a "
                    "Chrome/Perfetto trace (JSON) to this path")
    step_sglang.add_args(ap)
    return ap


def main(argv=None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    given = ap.given(args)
    try:  # the engine's decode compiles with the model unless told otherwise
        scfg = ap.config(args, **({"engine.compile_decode": False}
                                  if given.get("compile") is False and "engine.compile_decode" not in given else {}))
    except ValueError as e:
        ap.error(str(e))
    plan_why = "given" if any(k.startswith("memory.") for k in given) else "default"
    if scfg.rl.adv_estimator == "gae" and "memory.memory_plan" not in given:
        # the critic's regions beside the resident GRPO step do not fit one GPU: the plan fits them (fit.py)
        scfg, plan_why = replace(scfg, memory=replace(scfg.memory, memory_plan="auto")), "gae: the critic's regions"
    device = scfg.device
    cfg = preset(args.preset) if not args.preset.endswith(".json") else ModelConfig.from_hf(args.preset)
    try:
        loads = [workload(label, args, scfg.rl.n) for label in args.workloads.split(",")]
    except ValueError as e:
        ap.error(str(e))
    if "engine.max_model_len" not in given:  # room for the longest sequence of every workload
        need = max(len(make_prompts(cfg, 1, w.frames, size=args.image_size, text=args.text_tokens, device="cpu",
                                    dtype=torch.float32)[0][0].input_ids) + w.new_tokens for w in loads)
        if need > scfg.engine.max_model_len:
            scfg = replace(scfg, engine=replace(scfg.engine, max_model_len=need))
    dtype = getattr(torch, scfg.dtype)
    with torch.device(device):
        model = init_weights(Qwen25VL(cfg), seed=0, std=0.02)
    model = model.to(dtype).eval()
    if scfg.compile if scfg.compile is not None else device.startswith("cuda"):
        model.compile(dynamic=True if args.compile_dynamic == "true" else None)
    # the engine over the policy (rollplex/system.py); each row's RL step is made over it (System.rl_step)
    system = build(replace(scfg, compile=False), model=model, step=False)
    eng = system.engine
    mm = system.memory
    print(json.dumps({"bench": "step_setup", "preset": args.preset, "kv_blocks": eng.runner.num_blocks,
                      "max_model_len": scfg.engine.max_model_len, "memory_plan": scfg.memory.memory_plan,
                      "memory_plan_why": plan_why, "memory_backend": mm.backend.name if mm is not None else None,
                      **env_info()}), flush=True)
    modes = args.modes.split(",")
    given_serial = [int(x) for x in args.serial_max_tokens.split(",")] if args.serial_max_tokens else None
    fuses = [(int(a), float(b), scfg.rl.fuse_chunk_tokens, c) for a in args.fuse_sms.split(",")
             for b in args.fuse_below.split(",") for c in args.fuse_admission.split(",")]
    gates: dict = {}  # (workload, vision, fuse) -> the fused rows' admission gate, carried from step to step
    backoffs: dict = {}  # (workload, mode, frozen) -> the serial / rollplex rows' OOM back-offs, likewise
    co_cfgs = [replace(scfg.cosched, slowdown_bound=float(b), side_sms=int(v))
               for b in args.slowdown_bound.split(",") for v in args.side_sms.split(",")]
    rl_kw = {f.name: getattr(scfg.rl, f.name) for f in fields(RLConfig) if f.init and f.name not in PER_ROW}
    init, ref = initial_weights(system), reference(system)
    sgl = step_sglang.start(args, cfg, model, mm, asdict(scfg.cosched))
    if sgl is not None and sgl.device_bytes and "memory.device_capacity_gib" not in given:
        # SGLang's processes hold their share through every row, native ones too: each row's plan fits the rest
        left = (torch.cuda.mem_get_info()[1] - sgl.device_bytes) / 2**30
        system.config = replace(system.config, memory=replace(system.config.memory, device_capacity_gib=left))
    summary, fused_rows, sgl_rows, traced = [], [], [], False
    for wl in loads:
        label, frames, n_prompts = wl.label, wl.frames, wl.prompts
        budgets = given_serial or [32768 if wl.long else 16384]
        serial_modes = [f"serial@{b}" for b in budgets] if "serial" in modes else []
        workload_kw(rl_kw, wl, given)
        prompts, grid = make_prompts(cfg, n_prompts, frames, size=args.image_size, text=args.text_tokens,
                                     device=device, dtype=dtype)
        params = wl.params

        visions = [v == "frozen" for v in args.vision.split(",")]
        _check(system, prompts, rl_kw, co_cfgs[0], fuses[0], cfg, grid, label, init, ref,
               serial_modes[:1] + [m for m in modes if m != "serial"], visions[0])
        for frozen in visions if not args.check_only else ():
            vis = "frozen" if frozen else "trained"
            restore(model, init, frozen)
            if frozen:
                enter(system, "rollout")
            shown = _with_engine_vision(eng, prompts) if frozen else prompts
            enter(system, "ref")
            movable = prefix_standalone_s(ref, shown, scfg.cosched.job_prompts)
            steps = ([("cold", 1)] if not args.no_warm else []) + [("timed" if not args.no_warm else "first", 0)]
            for step, seed in steps:
                row = {"workload": label, "vision": vis, "step": step, "movable_s": movable}
                phased = serial_modes + [m for m in ("serial-padded", "rollplex") if m in modes]
                if phased:
                    restore(model, init, frozen)  # the rollout's vision encodings come from these weights
                    enter(system, "rollout")
                    batch, gen_s, _ = rollout(eng, prompts, params(seed), seed, keep_vision=frozen)
                    row["gen_s"] = gen_s
                    row["response_tokens"] = int(batch.mask.sum())
                    for mode in phased:
                        b = strip_vision(batch) if mode.startswith("serial") else batch
                        r = run_modes(system, b, rl_kw, grid, label, cfg, step, modes=(mode,), frozen=frozen,
                                      init=init, ref=ref, backoffs=backoffs)[0]
                        key = mode.split("@")[0].replace("-", "_")
                        if "@" in mode:
                            row[f"{key}_{mode.split('@')[1]}"] = gen_s + r["ref_plus_update_s"]
                        if key in row and row[key] <= gen_s + r["ref_plus_update_s"]:
                            continue  # the fastest serial budget is the row's serial
                        row[key] = gen_s + r["ref_plus_update_s"]
                        row[key + "_ref_s"], row[key + "_update_s"] = r["ref_s"], r["update_actor_s"]
                        if "@" in mode:
                            row["serial_max_tokens"] = int(mode.split("@")[1])
                        if "values_s" in r:
                            row[key + "_critic_s"] = r["values_s"] + r["update_critic_s"]
                        row["memory_plan"] = r["memory_plan"]
                    del batch
                    _free()
                if sgl is not None:  # the same step with SGLang decoding: phased, then with its scheduler hook
                    for co in (False, True) if args.sglang_cosched else (False,):
                        r = step_sglang.phased(_this(), system, sgl, prompts, params(seed), rl_kw, cfg, grid,
                                               label, step, frozen, init, ref, seed, cosched=co)
                        step_sglang.summary(row, r, "sglang_cosched" if co else "sglang")
                for fuse in fuses if "fused" in modes else []:
                    tl = None
                    if args.trace and step != "cold" and not traced:
                        tl, traced = Timeline(torch.device(device)), True
                    r = fused_step(system, prompts, params(seed), rl_kw, fuse, cfg, grid, label, step, frozen,
                                   init, ref, seed, tl, gates.get((label, vis, fuse)))
                    gates[(label, vis, fuse)] = r.pop("gate")
                    if sgl is not None:
                        rs = fused_step(system, prompts, params(seed), rl_kw, fuse, cfg, grid, label, step, frozen,
                                        init, ref, seed, None, gates.get((label, vis, fuse, "sglang")), backend=sgl)
                        gates[(label, vis, fuse, "sglang")] = rs.pop("gate")
                        row.update(sglang_fused=rs["step_s"], sglang_fused_gen_s=rs["gen_s"],
                                   sglang_fused_push_s=rs["weight_push_s"], sglang_fused_on=rs["fused"])
                    frow = {**row, "fuse_sms": fuse[0], "fuse_below": fuse[1], "admission": fuse[3],
                            "decode_added_s": r["decode_added_s"],
                            "decode_forward_added_s": r["decode_forward_added_s"],
                            "decode_launch_added_s": r["decode_launch_added_s"], "held_buckets": r["held_buckets"],
                            "fused": r["step_s"],
                            "fused_gen_s": r["gen_s"], "fused_tail_s": r["tail_s"],
                            "fused_update_s": r["update_actor_s"],
                            "in_rollout_s": r["in_rollout_s"], "groups_in_rollout": r["groups_in_rollout"],
                            "chunks": -(-n_prompts // rl_kw["micro_batch_prompts"]), "fused_on": r["fused"]}
                    if tl is not None:
                        _write_timeline(tl, args.trace, f"{label}, {vis} tower: fused groups beside decode")
                    print(json.dumps({"bench": "step_summary", **{k: round(v, 4) if isinstance(v, float) else v
                                                                   for k, v in frow.items()}}), flush=True)
                    fused_rows.append(frow)
                variants = co_cfgs if "cosched" in modes else ([None] if "fused" not in modes else [])
                for co_cfg in variants:
                    vrow = dict(row)
                    if co_cfg is not None:
                        tl = None
                        if args.trace and step != "cold" and not traced:
                            tl, traced = Timeline(torch.device(device)), True
                        r = cosched_step(system, prompts, params(seed), rl_kw, co_cfg, cfg, grid, label, step,
                                         frozen, init, ref, seed, tl)
                        vrow["side_sms"], vrow["slowdown_bound"] = co_cfg.side_sms, co_cfg.slowdown_bound
                        vrow["cosched"] = r["gen_s"] + r["ref_plus_update_s"]
                        vrow["cosched_gen_s"] = r["gen_s"]
                        vrow["cosched_ref_s"], vrow["cosched_update_s"] = r["ref_s"], r["update_actor_s"]
                        vrow["hidden_est_s"] = r.get("prefix_hidden_s", 0.0)
                        vrow["slowdown_ctrl"] = r.get("decode_slowdown", 0.0)
                        if tl is not None:
                            tl.write_trace(args.trace)
                            print(json.dumps({"bench": "step_trace", "path": args.trace}), flush=True)
                    print(json.dumps({"bench": "step_summary", **{k: round(v, 4) if isinstance(v, float) else v
                                                                   for k, v in vrow.items()}}), flush=True)
                    summary.append(vrow)
                if sgl is not None:
                    sgl_rows.append({**row, **({"fused": fused_rows[-1]["fused"]} if fused_rows and "fused" in modes
                                               else {})})
    if sgl is not None:
        sgl.close()
    if summary:
        _table(summary)
    if fused_rows:
        _fused_table(fused_rows)
    if sgl_rows:
        _sglang_table(sgl_rows)


def _this():
    import sys

    return sys.modules[__name__]


def _sglang_table(rows: list[dict]) -> None:
    """The same steps with SGLang decoding beside the native engine (phased and fused), the policy's
    hand-over to SGLang apart, and the co-scheduler hook's admitted work."""
    fmt = lambda x, f="{:.2f}": "-" if x is None else f.format(x)  # noqa: E731
    print("\n| workload | vision | step | native phased s (gen) | SGLang phased s (gen) | hand-over s | "
          "native fused s | SGLang fused s (gen) | SGLang + hook s (chunks, hidden s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        hook = (f"{fmt(r.get('sglang_cosched'))} ({fmt(r.get('sglang_cosched_cosched_chunks'), '{:.0f}')}, "
                f"{fmt(r.get('sglang_cosched_prefix_hidden_s'), '{:.3f}')})" if "sglang_cosched" in r else "-")
        print(f"| {r['workload']} | {r['vision']} | {r['step']} | {fmt(r.get('rollplex'))} ({fmt(r.get('gen_s'))}) | "
              f"{fmt(r.get('sglang'))} ({fmt(r.get('sglang_gen_s'))}) | {fmt(r.get('sglang_push_s'))} | "
              f"{fmt(r.get('fused'))} | {fmt(r.get('sglang_fused'))} ({fmt(r.get('sglang_fused_gen_s'))}) | {hook} |")


def _write_timeline(tl: Timeline, path: str, title: str) -> None:
    tl.write_trace(path)
    png = tl.plot(str(path).rsplit(".", 1)[0] + ".png", title=title)
    print(json.dumps({"bench": "step_trace", "path": path, "png": str(png) if png else None}), flush=True)


def _fused_table(rows: list[dict]) -> None:
    """Fused against phased. Movable: the reference + update work of every chunk but the last (the last
    can only start when the rollout ends); limit: the phased step minus it; share: of it hidden."""
    print("\n| workload | vision | step | serial s | phased s (gen) | fused s (gen / tail / update) | SMs | below | "
          "admission (held buckets) | in rollout s | decode added s (forward / launch) | movable s | limit s | share | "
          "fused vs phased | vs serial |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda x, f="{:.2f}": "-" if x is None else f.format(x)  # noqa: E731
    for r in rows:
        phased, fused, base = r.get("rollplex"), r["fused"], r.get("serial")
        movable = share = limit = None
        if phased is not None:
            movable = (r["rollplex_ref_s"] + r["rollplex_update_s"]) * (1 - 1 / r["chunks"])
            limit = phased - movable
            share = (phased - fused) / movable if movable > 0 else None
        print(f"| {r['workload']} | {r['vision']} | {r['step']} | {fmt(base)} | "
              f"{fmt(phased)} ({fmt(r.get('gen_s'))}) | "
              f"{fused:.2f} ({r['fused_gen_s']:.2f} / {r['fused_tail_s']:.2f} / {r['fused_update_s']:.2f})"
              f"{'' if r['fused_on'] else ' phased'} | {r['fuse_sms'] or 'all'} | {r['fuse_below']:g} | "
              f"{r['admission']} ({r['held_buckets']:g}) | {r['in_rollout_s']:.2f} | {r['decode_added_s']:.2f} "
              f"({fmt(r.get('decode_forward_added_s'))} / {fmt(r.get('decode_launch_added_s'))}) | "
              f"{fmt(movable)} | {fmt(limit)} | {fmt(share, '{:.0%}')} | "
              f"{fmt(phased / fused - 1 if phased else None, '{:+.1%}')} | {fmt(base / fused if base else None)}x |")


def _with_engine_vision(eng: Engine, prompts: list) -> list:
    """The prompts carrying the engine prefill's vision encodings (what a frozen tower reuses)."""
    outs = eng.generate(prompts, SamplingParams(n=1, max_new_tokens=1), keep_vision=True)
    return [replace(p, vision_embeds=o.vision_embeds) for p, o in zip(prompts, outs)]


def _check(system: System, prompts, rl_kw, co_cfg, fuse, cfg, grid, label, init, ref, modes, frozen: bool) -> None:
    """Correctness first, on two prompts: serial, rollplex, the co-scheduled and the fused step agree.
    frozen: the vision tower as the first rows train it (under a memory plan a trainer region's pool keeps
    what its largest trainer mapped, so a check training more parameters than the rows would make their
    plan pay for its bytes)."""
    model, eng = system.model, system.engine
    small = [SamplingParams(n=2, max_new_tokens=16, ignore_eos=True, seed=1 + i) for i in range(2)]
    restore(model, init, frozen)
    enter(system, "rollout")
    sb, _, _ = rollout(eng, prompts[:2], small, seed=1)
    kw = {**rl_kw, "n": 2}
    rows = run_modes(system, strip_vision(sb), kw, grid, label + "-check", cfg, "check",
                     modes=[m for m in modes if m.startswith("serial") or m == "rollplex"], frozen=frozen, init=init,
                     ref=ref)
    if "rollplex" in modes and kw["micro_batch_prompts"] > 1:  # one group per pass too: packing apart from sharing
        one = run_modes(system, strip_vision(sb), {**kw, "micro_batch_prompts": 1}, grid, label + "-check", cfg,
                        "check", modes=["rollplex"], frozen=frozen, init=init, ref=ref)
        rows += [{**r, "mode": "rollplex_one_group"} for r in one]
    out = {"bench": "step_check", "workload": label}
    keys = ("pg_loss", "kl_loss", "grad_norm", "rollout_probs_diff_max")
    out.update({f"{r['mode']}_{k}": r[k] for r in rows for k in keys if k in r})
    if "cosched" in modes:
        r = cosched_step(system, prompts[:2], small, kw, co_cfg, cfg, grid, label + "-check", "check", frozen,
                         init, ref, seed=1)
        out.update({f"cosched_{k}": r[k] for k in ("pg_loss", "kl_loss", "grad_norm")})
    if "fused" in modes:
        r = fused_step(system, prompts[:2], small, {**kw, "micro_batch_prompts": 1}, fuse, cfg, grid,
                       label + "-check", "check", frozen, init, ref, seed=1)
        out.update({f"fused_{k}": r[k] for k in keys if k in r})
    print(json.dumps(out), flush=True)
    print(check_verdict(out), flush=True)


def check_verdict(out: dict) -> str:
    """One line on a check row: every mode's KL loss (the trainer's first pass against the reference, both
    from the same initial weights) within rounding of the first mode's; rounding in bf16 leaves ~1e-5."""
    kls = {k[: -len("_kl_loss")]: v for k, v in out.items() if k.endswith("_kl_loss")}
    if not kls:
        return "check: no KL loss to compare"
    base_mode, base = next(iter(kls.items()))
    off = {m: v for m, v in kls.items() if abs(v - base) > 4 * abs(base) + 1e-4}
    if not off:
        return f"check: ok (KL loss {', '.join(f'{m} {v:.3g}' for m, v in kls.items())})"
    return (f"check: MISMATCH: KL loss {', '.join(f'{m} {v:.3g}' for m, v in off.items())} against {base_mode} "
            f"{base:.3g} from the same weights (the trainer's first pass departs from the reference's)")


def _table(summary: list[dict]) -> None:
    print("\n| workload | vision | step | movable s | serial s (budget) | serial-padded s | rollplex s | bound | "
          "side SMs | cosched s (gen s) | limit s | hidden of limit | decode slowdown | vs serial |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in summary:
        base, share, co = r.get("serial"), r.get("rollplex"), r.get("cosched")
        limit = share - r["movable_s"] if share is not None else None
        frac = (share - co) / r["movable_s"] if share is not None and co is not None else None
        slow = r["cosched_gen_s"] / r["gen_s"] - 1 if co is not None and "gen_s" in r else None
        fmt = lambda x, f="{:.2f}": "-" if x is None else f.format(x)  # noqa: E731
        print(f"| {r['workload']} | {r['vision']} | {r['step']} | {r['movable_s']:.3f} | {fmt(base)} "
              f"({r.get('serial_max_tokens', '-')}) | {fmt(r.get('serial_padded'))} | {fmt(share)} | "
              f"{fmt(r.get('slowdown_bound'), '{:g}')} | {r.get('side_sms', 0) or 'all'} | "
              f"{fmt(co)} ({fmt(r.get('cosched_gen_s'))}) | {fmt(limit)} | {fmt(frac, '{:.0%}')} | "
              f"{fmt(slow, '{:+.1%}')} | {fmt(base / co if base and co else None)}x |")
    critic = [r for r in summary if "rollplex_critic_s" in r or "serial_critic_s" in r]
    if critic:  # PPO with a critic: values scored + the critic's update, inside each mode's step
        print("\n| workload | vision | step | serial s (critic s) | rollplex s (critic s) | critic vs serial | "
              "memory plan |")
        print("|---|---|---|---|---|---|---|")
        for r in critic:
            cs, cr = r.get("serial_critic_s"), r.get("rollplex_critic_s")
            ratio = f"{cs / cr:.2f}x" if cs and cr else "-"
            print(f"| {r['workload']} | {r['vision']} | {r['step']} | {r.get('serial', 0):.2f} ({cs or 0:.2f}) | "
                  f"{r.get('rollplex', 0):.2f} ({cr or 0:.2f}) | {ratio} | {r.get('memory_plan', '-')} |")
