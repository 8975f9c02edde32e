"""`python -m rollplex.bench sglang {smoke,rollout}`: SGLang as the rollout engine on the GPU, beside Rollplex's.

SGLang runs in a process of its own (`--sglang-pythonpath DIR`: its pack, e.g. /tmp/sgl, with its own
transformers) on a directory written for the preset (model_dir.py: config, tokenizer and processor files,
no weights), with `load_format="dummy"`. Before the first rollout the rollout backend (SGLangRollout,
reached through rollplex.backends) copies the trainer's policy in (random weights, seed 0), so SGLang and
Rollplex's engine decode the same model. Prompts go as token ids + pixel values (processor_output items).

    smoke     one W3B image prompt, greedy 16 tokens through SGLang, then Rollplex's engine on the same
              ids: both outputs, whether they agree, SGLang's logprobs against the trainer's for SGLang's
              tokens; SGLang's start, weight hand-over and first-generate (kernel JIT) times
    rollout   W3B (and --workloads w3b-tail) shapes: tokens/s of SGLang and the native engine side by side
              (each warmed by a rollout of the same shapes first), the weight hand-over time, greedy
              agreement on a few prompts, and the rollout-trainer mismatch as verl reports it
              (training/rollout_probs_diff_{mean,max}: |p_rollout - p_trainer| over response tokens) for
              both engines

One JSON line per result, then a table. SGLang's settings: --attention-backend (triton JITs faster than
flashinfer; the pack has no FA3, so the vision tower runs SGLang's triton_attn too), --sglang-mem-fraction,
--sglang-cuda-graph, --sglang-args (JSON, over the defaults).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..backends import BackendConfig, rollout_backend
from ..engine import Engine, EngineConfig, SamplingParams
from ..models import build_model, init_weights
from ..presets import preset
from ..rl.batch import RolloutBatch
from ..rl.config import RLConfig
from ..rl.scoring import logprobs
from ..rl.trainer import Trainer
from .common import make_prompts, sync
from .model_dir import write_model_dir
from .spec import tail_lengths
from .timing import env_info


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m rollplex.bench sglang", description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["smoke", "rollout"])
    ap.add_argument("--sglang-pythonpath", required=True, help="SGLang's own site folder (e.g. /tmp/sgl)")
    ap.add_argument("--preset", default="qwen2.5-vl-3b")
    ap.add_argument("--workloads", default="w3b", help="rollout: comma list of w3b, w3b-tail")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--greedy-prompts", type=int, default=4)
    ap.add_argument("--greedy-tokens", type=int, default=64)
    ap.add_argument("--attention-backend", default="triton")
    ap.add_argument("--sglang-mem-fraction", type=float, default=0.3)
    ap.add_argument("--sglang-cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                    help="SGLang's CUDA graphs (default: off for smoke, on for rollout)")
    ap.add_argument("--sglang-memory-saver", action="store_true",
                    help="start SGLang with its memory saver (needs torch-memory-saver where SGLang runs)")
    ap.add_argument("--sglang-args", default=None, help="further SGLang server arguments, a JSON object")
    ap.add_argument("--kv-cache-tokens", type=int, default=None,
                    help="the native engine's KV budget (default: the workload's sequences)")
    ap.add_argument("--model-dir", default=None, help="where to write the preset's directory (default: a temp dir)")
    return ap


def sglang_config(args, cuda_graph: bool) -> BackendConfig:
    # the vision tower's attention too: SGLang's default on Hopper is FA3, which the pack leaves out
    extra = {"load_format": "dummy", "skip_tokenizer_init": True, "attention_backend": args.attention_backend,
             "mm_attention_backend": "triton_attn", "sampling_backend": "pytorch",
             "disable_cuda_graph": not cuda_graph, "log_level": "info" if args.what == "smoke" else "warning"}
    if cuda_graph:
        extra["cuda_graph_max_bs"] = args.prompts * args.n
    extra.update(json.loads(args.sglang_args) if args.sglang_args else {})
    return BackendConfig("sglang", sglang_mem_fraction_static=args.sglang_mem_fraction,
                         sglang_memory_saver=args.sglang_memory_saver, sglang_release_weights=False,
                         sglang_pythonpath=args.sglang_pythonpath, sglang_args=json.dumps(extra))


def timed(fn):
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def emit(row: dict) -> dict:
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return row


def mismatch(model, prompts, outs) -> dict:
    """verl's rollout-trainer mismatch: |p_rollout - p_trainer| over response tokens (mean, max), and the
    largest logprob difference."""
    batch = RolloutBatch.from_outputs(prompts, outs, pad_id=0)
    cfg = RLConfig(mode="rollplex", micro_batch_prompts=4, micro_batch_samples=8, packed=True)
    train = Trainer(model).score(batch, logprobs(), cfg)
    sel = batch.mask.to(train.device) > 0
    roll = batch.rollout_logprobs.to(train.device)
    diff = (roll.exp() - train.exp()).abs()[sel]
    return {"rollout_probs_diff_mean": float(diff.mean()), "rollout_probs_diff_max": float(diff.max()),
            "logprob_diff_max": float((roll - train).abs()[sel].max())}


def greedy_agreement(a, b) -> dict:
    """How far two engines' greedy samples agree: identical samples, and the first differing position."""
    firsts, same = [], 0
    for x, y in zip((s.token_ids for o in a for s in o.samples), (s.token_ids for o in b for s in o.samples)):
        k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        same += x == y
        firsts.append(k)
    return {"greedy_same": same, "greedy_samples": len(firsts), "greedy_first_diff_min": min(firsts),
            "greedy_first_diff_mean": sum(firsts) / len(firsts)}


def tokens(outs) -> int:
    return sum(len(s.token_ids) for o in outs for s in o.samples)


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("python -m rollplex.bench sglang runs on a GPU (SGLang needs CUDA)")
    smoke = args.what == "smoke"
    cuda_graph = args.sglang_cuda_graph if args.sglang_cuda_graph is not None else not smoke
    cfg = preset(args.preset)
    out_dir = Path(args.model_dir or tempfile.mkdtemp(prefix="rollplex-sglang-model-"))
    write_model_dir(cfg, out_dir)
    with torch.device("cuda"):
        model = init_weights(build_model(cfg), seed=0, std=0.02)
    model = model.to(torch.bfloat16).eval().requires_grad_(False)
    emit({"bench": "sglang_setup", "what": args.what, "model_dir": str(out_dir), "attention_backend":
          args.attention_backend, "sglang_cuda_graph": cuda_graph, **env_info()})
    rollout, start_s = timed(lambda: rollout_backend(sglang_config(args, cuda_graph), str(out_dir), None,
                                                     "bfloat16", seed=0))
    try:
        rollout.attach(model, None)
        _, push_s = timed(rollout.update_weights)
        emit({"bench": "sglang_start", "sglang_version": rollout.version, "start_s": start_s,
              "weight_push_s": push_s, "weight_gib": sum(p.numel() * p.element_size() for p in model.parameters())
              / 2**30})
        if smoke:
            _smoke(args, cfg, model, rollout)
        else:
            _rollout(args, cfg, model, rollout)
    finally:
        rollout.close()


def _native(args, n_seqs: int, max_len: int, model, compile_decode: bool | None = None) -> Engine:
    """Rollplex's engine over the policy, its KV cache sized for the workload's sequences (graphed decode up
    to that batch; its decode compiled unless told otherwise, as in the step bench)."""
    kv = args.kv_cache_tokens or n_seqs * max_len
    seqs = max(n_seqs, 8)
    return Engine(model, None, EngineConfig(max_num_seqs=seqs, max_model_len=max_len, kv_cache_tokens=kv,
                                            max_num_batched_tokens=40000, cuda_graph_max_bs=seqs,
                                            compile_decode=compile_decode))


def _smoke(args, cfg, model, rollout) -> None:
    prompts, _ = make_prompts(cfg, 1, 1, device="cuda", dtype=torch.bfloat16)
    greedy = [SamplingParams(n=1, temperature=0, max_new_tokens=16, ignore_eos=True)]
    sgl, first_s = timed(lambda: rollout.generate(prompts, greedy))
    sgl2, again_s = timed(lambda: rollout.generate(prompts, greedy))
    eng = _native(args, 8, len(prompts[0].input_ids) + 64, model, compile_decode=False)  # a quick start
    nat, nat_s = timed(lambda: eng.generate(prompts, greedy))
    row = {"bench": "sglang_smoke", "prompt_tokens": len(prompts[0].input_ids), "sglang_first_generate_s": first_s,
           "sglang_generate_s": again_s, "native_generate_s": nat_s,
           "sglang_ids": sgl[0].samples[0].token_ids, "native_ids": nat[0].samples[0].token_ids,
           "sglang_repeatable": sgl[0].samples[0].token_ids == sgl2[0].samples[0].token_ids,
           "sglang_finish": sgl[0].samples[0].finish_reason, **greedy_agreement(sgl, nat),
           **{f"sglang_{k}": v for k, v in mismatch(model, prompts, sgl).items()},
           **{f"native_{k}": v for k, v in mismatch(model, prompts, nat).items()}}
    emit(row)


def _rollout(args, cfg, model, rollout) -> None:
    rows = []
    for label in args.workloads.split(","):
        prompts, _ = make_prompts(cfg, args.prompts, 1, device="cuda", dtype=torch.bfloat16)
        lens = (tail_lengths(args.prompts, args.new_tokens, seed=7) if label.endswith("-tail")
                else [args.new_tokens] * args.prompts)

        def params(seed, lens=lens):
            return [SamplingParams(n=args.n, max_new_tokens=k, ignore_eos=True, seed=seed * 100_003 + i)
                    for i, k in enumerate(lens)]

        eng = _native(args, args.prompts * args.n, len(prompts[0].input_ids) + max(lens) + 8, model)
        row = {"bench": "sglang_rollout", "workload": label, "prompts": args.prompts, "n": args.n}
        for name, gen in (("sglang", rollout.generate), ("native", eng.generate)):
            _, cold = timed(lambda gen=gen, prompts=prompts: gen(prompts, params(1)))
            outs, warm = timed(lambda gen=gen, prompts=prompts: gen(prompts, params(0)))
            n_tok = tokens(outs)
            row.update({f"{name}_cold_s": cold, f"{name}_gen_s": warm, f"{name}_tokens": n_tok,
                        f"{name}_tok_s": n_tok / warm,
                        **{f"{name}_{k}": v for k, v in mismatch(model, prompts, outs).items()}})
            print(f"{label} {name}: {n_tok} tokens in {warm:.2f} s ({n_tok / warm:,.0f} tok/s; cold {cold:.1f} s)",
                  file=sys.stderr, flush=True)  # progress: a run cut short still tells SGLang's speed
            del outs
        greedy = [SamplingParams(n=1, temperature=0, max_new_tokens=args.greedy_tokens, ignore_eos=True)] \
            * args.greedy_prompts
        g_prompts = prompts[:args.greedy_prompts]
        row.update(greedy_agreement(rollout.generate(g_prompts, greedy), eng.generate(g_prompts, greedy)))
        _, row["weight_push_s"] = timed(rollout.update_weights)
        del eng
        torch.cuda.empty_cache()
        rows.append(emit(row))
    print("\n| workload | SGLang tok/s (s) | native tok/s (s) | SGLang / native | weight hand-over s | "
          "probs diff mean / max, SGLang | the same, native | greedy same (first diff, mean) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['sglang_tok_s']:,.0f} ({r['sglang_gen_s']:.2f}) | "
              f"{r['native_tok_s']:,.0f} ({r['native_gen_s']:.2f}) | {r['sglang_tok_s'] / r['native_tok_s']:.2f} | "
              f"{r['weight_push_s']:.2f} | {r['sglang_rollout_probs_diff_mean']:.4f} / "
              f"{r['sglang_rollout_probs_diff_max']:.3f} | {r['native_rollout_probs_diff_mean']:.4f} / "
              f"{r['native_rollout_probs_diff_max']:.3f} | {r['greedy_same']}/{r['greedy_samples']} "
              f"({r['greedy_first_diff_mean']:.1f}) |")
