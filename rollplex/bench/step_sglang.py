"""`python -m rollplex.bench step --backend sglang`: the step's rows with SGLang decoding, beside the native ones.

SGLang runs in its own process (`--sglang-pythonpath`, its pack with its own transformers) on the preset's
directory (model_dir.py) with dummy weights, through the SGLang rollout backend and its plugin (reached by
name through rollplex.backends, never imported from engine_patches here). Each row restores the initial weights, so
every SGLang row first hands the policy over (`SGLangRollout.update_weights`, timed: `weight_push_s`, the
cost a training loop pays once per step), then:

    sglang          phased: SGLang's rollout, then reference scoring + the actor update with prefix
                    sharing (the `rollplex` row's trainer); step = gen + ref + update (+ the hand-over:
                    `sglang_with_push`)
    sglang-fused    the fused schedule on SGLang: each prompt's group reported as its samples finish,
                    trained beside the rollout's tail
    sglang-cosched  (--sglang-cosched) the phased row with the co-scheduler as SGLang's scheduler hook:
                    the reference's prefix work admitted beside SGLang's decode steps, its prefix states
                    handed over by CUDA IPC and consumed by the reference scoring; the hook's metrics
                    (chunks admitted, hidden seconds) in the row

SGLang's memory: with --sglang-memory-saver (torch-memory-saver where SGLang runs) its KV cache and weights
are released outside the rollout, as the backend does in training; without it they stay (set
--sglang-mem-fraction so that the trainer fits beside them).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from ..backends import BackendConfig, plugin, rollout_backend
from ..rl.batch import RolloutBatch
from ..rl.config import RLConfig
from .common import sync
from .model_dir import write_model_dir


def add_args(ap) -> None:
    ap.add_argument("--backend", default="native", choices=["native", "sglang"],
                    help="sglang: also the rows with SGLang decoding (in its own process), beside the native ones")
    ap.add_argument("--sglang-pythonpath", default=None, help="SGLang's own site folder (e.g. /tmp/sgl)")
    ap.add_argument("--sglang-attention-backend", default="triton", help="SGLang's text attention (its vision "
                    "tower: triton_attn, unless --sglang-args sets mm_attention_backend)")
    ap.add_argument("--sglang-mem-fraction", type=float, default=0.25)
    ap.add_argument("--sglang-cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                    help="SGLang's CUDA graphs for its decode steps (SGLang's default; --no-sglang-cuda-graph "
                    "starts faster and decodes slower)")
    ap.add_argument("--sglang-memory-saver", action="store_true",
                    help="release SGLang's KV cache and weights outside the rollout (torch-memory-saver)")
    ap.add_argument("--sglang-cosched", action="store_true",
                    help="also the sglang-cosched row: the co-scheduler as SGLang's scheduler hook")
    ap.add_argument("--sglang-args", default=None, help="further SGLang server arguments, a JSON object")


def start(args, cfg, model, memory, cosched_config: dict | None):
    """The SGLang rollout backend on `cfg`'s directory, attached to `model`; None with --backend native."""
    if args.backend != "sglang":
        return None
    if not args.sglang_pythonpath:
        raise SystemExit("--backend sglang needs --sglang-pythonpath (SGLang's own site folder)")
    out = Path(tempfile.mkdtemp(prefix="rollplex-sglang-model-"))
    write_model_dir(cfg, out)
    hook = None
    if args.sglang_cosched:
        from ..models import save_model

        save_model(model, out)  # the hook's reference model loads from here (SGLang itself does not)
        hook = plugin("sglang").cosched_hook(str(out), "bfloat16", cosched_config)
    # the vision tower's attention too: SGLang's default on Hopper is FA3, which the pack leaves out
    extra = {"load_format": "dummy", "skip_tokenizer_init": True, "attention_backend": args.sglang_attention_backend,
             "mm_attention_backend": "triton_attn", "sampling_backend": "pytorch", "log_level": "warning",
             "disable_cuda_graph": not args.sglang_cuda_graph}
    extra.update(json.loads(args.sglang_args) if args.sglang_args else {})
    bcfg = BackendConfig("sglang", sglang_mem_fraction_static=args.sglang_mem_fraction,
                         sglang_memory_saver=args.sglang_memory_saver, sglang_release_weights=args.sglang_memory_saver,
                         sglang_pythonpath=args.sglang_pythonpath, sglang_args=json.dumps(extra))
    t0 = time.perf_counter()
    sgl = rollout_backend(bcfg, str(out), None, "bfloat16", seed=0, hook_spec=hook)
    sgl.attach(model, memory)
    print(json.dumps({"bench": "step_sglang_setup", "sglang_version": sgl.version, "start_s":
                      round(time.perf_counter() - t0, 1), "device_gib": round(sgl.device_bytes / 2**30, 2),
                      "model_dir": str(out), "cosched_hook": hook is not None,
                      "args": extra}), flush=True)
    return sgl


def push(sgl) -> float:
    """Hand the (restored) policy over to SGLang; seconds."""
    sync()
    t0 = time.perf_counter()
    sgl.update_weights()
    sync()
    return time.perf_counter() - t0


def phased(step_mod, system, sgl, prompts, params, rl_kw: dict, cfg, grid, label: str, step: str, frozen: bool,
           init: dict, ref, seed: int, cosched: bool = False) -> dict:
    """The phased step with SGLang's rollout (and, cosched, the hook's prefix states); one row."""
    step_mod.restore(system.model, init, frozen)
    push_s = push(sgl)
    step_mod.enter(system, "rollout")
    if cosched:
        sgl.engine.start_admission(prompts)
    sync()
    t0 = time.perf_counter()
    outs = sgl.generate(prompts, params)
    sync()
    gen_s = time.perf_counter() - t0
    extra = {"weight_push_s": round(push_s, 3), "backend": "sglang"}
    batch = RolloutBatch.from_outputs(prompts, outs, pad_id=0)
    batch.rewards = torch.rand(batch.num_samples, generator=torch.Generator().manual_seed(seed)).round()
    if cosched:
        co = sgl.engine.stop_admission()
        extra.update({k.split("/", 1)[1]: round(v, 4) for k, v in co.items()})
        batch.prefix = plugin("sglang").received_rows(sgl.engine.prefix_states())
    sgl.enter_phase("ref")  # SGLang's memory goes back outside the rollout (with its memory saver)
    try:
        rl = step_mod.trainer(system, RLConfig(mode="rollplex", freeze_vision_tower=frozen, **rl_kw), rollout=False,
                              reward_fn="exact", ref_model=ref)
        row = step_mod._train_row(rl, batch, cfg, grid, label, step, "sglang-cosched" if cosched else "sglang",
                                  frozen, gen_s, extra)
    finally:
        batch.prefix = {}
        if cosched:
            sgl.engine.release_prefix_states()
    del rl, batch, outs
    step_mod._drop_trainer(system)
    return row


def summary(row: dict, r: dict, key: str) -> None:
    """An SGLang row's times into the workload's summary row."""
    row[key] = r["gen_s"] + r["ref_plus_update_s"]
    row[key + "_gen_s"], row[key + "_push_s"] = r["gen_s"], r["weight_push_s"]
    row[key + "_with_push"] = row[key] + r["weight_push_s"]
    for k in ("cosched_chunks", "prefix_hidden_s", "decode_slowdown"):
        if k in r:
            row[f"{key}_{k}"] = r[k]
