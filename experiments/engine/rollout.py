"""`python -m experiments.engine.rollout`: the native engine on W3B, and transformers on the same batch.

1. Correctness first: on the W3B model the engine's greedy tokens equal our reference decoder's for
   a few prompts, and its sampled-token logprobs equal a full forward's.
2. W3B rollout: 32 prompts (one 448x448 image + 96 text tokens each) x n=8 x 512 new tokens
   (ignore_eos): wall time, generated tokens/s, prefill vs decode split.
3. Batch sweep B = 8, 64, 256: median decode step (engine step incl. sampling and host work, and
   the bare graph replay) against the HBM floor = (weight bytes + KV bytes read per step) / copy
   bandwidth measured in the same run.
4. transformers' `generate` on the same 256 sequences (fewer new tokens: it is far slower), tok/s.
Prints JSON lines, then a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import time

import torch

from experiments.common import gemms_str, set_decode_state, w3b_prompts
from rollplex.bench.timing import env_info, time_ms
from rollplex.engine import Engine, EngineConfig, RecordingHook, SamplingParams
from rollplex.engine.sampler import SamplingTensors
from rollplex.generate import generate
from rollplex.models import ModelInputs, Qwen25VL, hf_model, hf_to_rollplex, init_weights
from rollplex.presets import preset


class WallHook:
    """Wall-clock time of every decode launch: the period between launches is what a step costs."""

    def __init__(self):
        self.t: list[float] = []

    def on_decode_step(self, info) -> None:
        self.t.append(time.perf_counter())

    def periods(self) -> list[float]:
        return [(b - a) * 1e3 for a, b in zip(self.t[:-1], self.t[1:])]


def copy_bandwidth(device="cuda") -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    x = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), warmup=2, iters=5)
    return 2 * x.numel() / (ms / 1e3)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.engine.rollout")
    ap.add_argument("--preset", default="qwen2.5-vl-3b")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--sweep", default="8,64,256")
    ap.add_argument("--hf-new-tokens", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args(argv)
    dev = "cuda"
    cfg = preset(args.preset)
    torch.manual_seed(0)
    hf = None
    if not args.skip_hf:  # transformers' twin holds the same weights (ours is loaded from it)
        with torch.device(dev):
            hf = hf_model(cfg).to(torch.bfloat16).eval()  # transformers' model of the preset's family
        with torch.device(dev):
            model = Qwen25VL(cfg)
        model.load_state_dict(hf_to_rollplex(hf.state_dict(), cfg))
    else:
        with torch.device(dev):
            model = init_weights(Qwen25VL(cfg), seed=0, std=0.02)
    model = model.to(torch.bfloat16).eval().compile()  # the bench owns the model (the engine compiles only its decode)
    info = env_info()
    rows = []
    hook, wall_hook = RecordingHook(), WallHook()
    eng = Engine(model, None, EngineConfig(max_num_seqs=256, max_model_len=2048, gpu_memory_utilization=0.85,
                                           max_num_batched_tokens=32768), hooks=[hook, wall_hook])
    print(json.dumps({"bench": "engine_init", "kv_blocks": eng.runner.num_blocks, "block_size": eng.cfg.block_size,
                      "graphs": sorted(eng.runner.graphs),
                      "attn_cfg": {b: eng.runner.attn_cfg.get(b) for b in (8, 64, 256)},
                      "gemms": {b: gemms_str(eng.runner.gemms.get(b)) for b in (8, 64, 256)}}), flush=True)

    # --- 1. correctness ---------------------------------------------------------------------------
    prompts = w3b_prompts(cfg, args.prompts, device=dev)
    greedy = eng.generate(prompts[:3], SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True))
    ref = [generate(model, p, 16).token_ids for p in prompts[:3]]
    match = sum(a.samples[0].token_ids == b for a, b in zip(greedy, ref))
    first_tokens = sum(a.samples[0].token_ids[:4] == b[:4] for a, b in zip(greedy, ref))
    sampled = eng.generate(prompts[:2], SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True, seed=1))
    diffs = []
    for p, o in zip(prompts[:2], sampled):
        s = o.samples[0]
        full = p.with_response(s.token_ids)  # a sampled vision placeholder id is text in a response
        with torch.no_grad():
            logits = model([full])[0].float()
        P = len(p.input_ids)
        lp = torch.log_softmax(logits[P - 1 : P - 1 + len(s.token_ids)], -1)
        lp = lp.gather(-1, torch.tensor(s.token_ids, device=dev)[:, None]).squeeze(-1)
        diffs.append((lp.cpu() - torch.tensor(s.logprobs)).abs())
    d = torch.cat(diffs)
    r = {"bench": "engine_correctness_bf16", "greedy_equal_reference": f"{match}/3",
         "greedy_first4_equal": f"{first_tokens}/3", "logprob_diff_mean": d.mean().item(),
         "logprob_diff_max": d.max().item()}
    print(json.dumps(r), flush=True)
    rows.append(r)

    # --- 2. W3B rollout, overlap scheduling off and on (same engine, same outputs) -------------------
    sp = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, ignore_eos=True, n=args.n, seed=0)
    eng.generate(prompts[:4], SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, n=args.n))  # warm
    tokens_by_mode = {}
    for overlap in (False, True):
        eng.cfg = dataclasses.replace(eng.cfg, overlap_schedule=overlap)
        hook.infos.clear()
        wall_hook.t.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = eng.generate(prompts, sp)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        tokens_by_mode[overlap] = [s.token_ids for o in outs for s in o.samples]
        ntok = sum(len(s.token_ids) for o in outs for s in o.samples)
        steps = [i.last_step_ms for i in hook.infos if i.last_step_ms is not None]
        r = {"bench": "rollout_w3b", "overlap_schedule": overlap, "prompts": args.prompts, "n": args.n,
             "new_tokens": args.max_new_tokens, "wall_s": round(wall, 2), "tokens": ntok,
             "tok_per_s": round(ntok / wall, 1), "decode_steps": len(hook.infos),
             "median_gpu_step_ms": round(statistics.median(steps), 3),
             "median_step_period_ms": round(statistics.median(wall_hook.periods()), 3),
             "preemptions": eng.scheduler.num_preemptions, **info}
        print(json.dumps(r), flush=True)
        rows.append(r)
    same = tokens_by_mode[False] == tokens_by_mode[True]
    print(json.dumps({"bench": "overlap_same_tokens", "equal": same}), flush=True)
    rows.append({"bench": "overlap_same_tokens", "equal": same})

    # --- 3. batch sweep vs HBM floor --------------------------------------------------------------
    bw = copy_bandwidth()
    weight_bytes = sum(p.numel() * p.element_size() for k, p in model.named_parameters() if not k.startswith("visual"))
    ctx = 352 + 256  # mid-rollout context
    kv_tok = 2 * cfg.text.num_hidden_layers * cfg.text.num_key_value_heads * cfg.text.head_dim * 2
    text_prompts = [ModelInputs(torch.randint(0, 150000, (352,)).tolist()) for _ in range(256)]
    for B in [int(x) for x in args.sweep.split(",")]:
        hook.infos.clear()
        wall_hook.t.clear()
        eng.generate(text_prompts[:B], SamplingParams(temperature=1.0, max_new_tokens=512, ignore_eos=True))
        # engine step = wall-clock period between decode launches (host work included; with overlap the
        # host's bookkeeping hides behind the running step), around context 608
        periods = wall_hook.periods()
        step_ms = statistics.median(periods[200:300]) if len(periods) > 300 else statistics.median(periods)
        replay_ms = None
        if B in eng.runner.graphs:  # the bare graph at exactly the floor's context
            set_decode_state(eng.runner, B, ctx)
            g, _ = eng.runner.graphs[B]
            replay_ms = time_ms(g.replay, warmup=3, iters=20)
        # the sampler alone (compiled draw over the full vocabulary, temperature 1, as in the rollout):
        # engine step = replay + sampler + what the host could not hide
        V = cfg.text.vocab_size
        logits = torch.randn(B, V, device=dev, dtype=torch.bfloat16)
        st = SamplingTensors.build([(1.0, -1, 1.0, 0.0, i, 300) for i in range(B)], V, dev)
        sampler_ms = time_ms(functools.partial(eng.sampler, logits, st), warmup=3, iters=20)
        floor_ms = (weight_bytes + B * ctx * kv_tok) / bw * 1e3
        r = {"bench": "decode_sweep", "batch": B, "context": ctx, "engine_step_ms": round(step_ms, 3),
             "graph_replay_ms": replay_ms and round(replay_ms, 3), "sampler_ms": round(sampler_ms, 3),
             "hbm_floor_ms": round(floor_ms, 3),
             "floor_frac_engine": round(floor_ms / step_ms, 3),
             "floor_frac_replay": replay_ms and round(floor_ms / replay_ms, 3), "copy_bw_TBps": round(bw / 1e12, 2),
             "tok_per_s": round(B / step_ms * 1e3, 1)}
        print(json.dumps(r), flush=True)
        rows.append(r)

    # --- 4. transformers generate on the same 256 sequences ---------------------------------------
    if hf is not None:
        ids = torch.tensor([p.input_ids for p in prompts], device=dev)
        pix = torch.cat([p.pixel_values for p in prompts])
        grid = torch.cat([p.image_grid_thw for p in prompts]).to(dev)
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pix, image_grid_thw=grid,
                  mm_token_type_ids=(ids == cfg.image_token_id).int(), do_sample=True, num_return_sequences=args.n,
                  max_new_tokens=args.hf_new_tokens, min_new_tokens=args.hf_new_tokens, pad_token_id=0)
        with torch.no_grad():
            hf.generate(**{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = hf.generate(**kw)
            torch.cuda.synchronize()
        wall_hf = time.perf_counter() - t0
        ntok_hf = (out.shape[1] - ids.shape[1]) * out.shape[0]
        r = {"bench": "rollout_transformers", "sequences": out.shape[0], "new_tokens": args.hf_new_tokens,
             "wall_s": round(wall_hf, 2), "tok_per_s": round(ntok_hf / wall_hf, 1), **info}
        print(json.dumps(r), flush=True)
        rows.append(r)

    print("\n| measurement | value |\n|---|---|")
    for r in rows:
        print("| " + r["bench"] + " | " + ", ".join(f"{k}={v}" for k, v in r.items()
                                                  if k not in ("bench", "torch", "date", "transformers", "gpu")) + " |")


if __name__ == "__main__":
    main()
