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

Correctness first, in fp32: an fp32 copy of the model decodes the first `--check-prompts` prompts
greedily with speculation off and then at every replayed acceptance, and every token must agree. The
timed rows run in `--dtype` (bf16 by default), where greedy decoding is not batch-invariant: the verify
pass's k+1-row GEMMs round differently from graphed decode's, so a near-tie of the random weights'
logits can flip and a sample part from speculation off's; from there on its replayed drafts are wrong,
so the exact rule's rows (`replay a=`) accept less than `a` (on an H100, 0.1-0.9 tokens at a = 1-4). The
`forced a=` rows then keep each sample on the reference (`ForcedReplay`: the right draft tokens and the
reference's next token kept whatever the policy drew; not exact, timing only): each pass keeps a + 1
tokens at the cost real speculation pays at that acceptance, and `agreed` is how many of those tokens the
policy's own draws matched. The table says how many samples kept every token and where the rest parted.
Then one JSON line per row and a table last: tail time, tail decode tokens/s, speed-up over speculation
off, the measured mean accepted length and acceptance rate.
"""

from __future__ import annotations

import argparse
import copy
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
    """Drafts from a reference run: the next `accept` reference tokens, then wrong tokens up to k. `ahead`: each
    sequence's next k + 1 reference tokens (what `ForcedReplay` keeps, however much of the draft the engine
    left: it drops a draft with no room for its K/V)."""

    def __init__(self, reference: dict[int, list[int]], accept: int, k: int, vocab: int):
        self.reference, self.accept, self.k, self.vocab = reference, accept, k, vocab
        self.ahead: list[list[int]] = []

    def __call__(self, seqs, open_requests) -> list[list[int]]:
        out, self.ahead = [], []
        for s in seqs:
            ref = self.reference[id(s.request.inputs)]
            k = min(self.k, s.request.max_len - len(s) - 1)
            pos = s.num_output_tokens
            nxt = ref[pos : pos + k]
            out.append([t if j < self.accept else (t + 1) % self.vocab for j, t in enumerate(nxt)])
            self.ahead.append(ref[pos : pos + k + 1])
        return out


class ForcedReplay:
    """A timing rule: the verify step's sampling as the exact rule's, then, whatever the policy drew, the
    draft's `accept` right tokens and the reference's next token kept (teacher-forced). In bf16 a verify pass
    rounds differently from decode, a near-tie of random weights flips, and a sample that parts from the
    reference is drafted wrong tokens from then on; forcing keeps every sample on the reference, so each pass
    keeps exactly accept + 1 tokens, at the cost real speculation pays at that acceptance. Not exact: for
    timing rows only (the exact rule's rows and the fp32 check stand beside them). `agreed` / `forced_total`:
    how many kept tokens the policy's own draws matched."""

    def __init__(self, replay: ReplayDrafts):
        self.replay, self.agreed, self.forced_total = replay, 0, 0

    def __call__(self, sampler, logits, st, drafts):
        tokens, logprobs = sampler(logits, st)
        tokens, logprobs = tokens.tolist(), logprobs.tolist()
        out, r = [], 0
        for d, ahead in zip(drafts, self.replay.ahead):
            a = min(self.replay.accept, len(d))
            keep = d[:a] + [ahead[a] if a < len(ahead) else tokens[r + a]]
            self.agreed += sum(x == y for x, y in zip(tokens[r : r + a + 1], keep))
            self.forced_total += a + 1
            out.append((keep, logprobs[r : r + a + 1]))
            r += len(d) + 1
        return out


class TailClock:
    """A decode hook: the host time of the first decode step with at most `limit` sequences, and the steps
    (decode or verification) from there on."""

    def __init__(self, limit: int):
        self.limit, self.start, self.steps = limit, None, 0

    def on_decode_step(self, info) -> None:
        if self.start is None and info.batch_size <= self.limit:
            sync()
            self.start = time.perf_counter()
        if self.start is not None:
            self.steps += 1


def run(eng: Engine, prompts, params, limit: int):
    """(outputs, rollout s, tail s, the speculation counts of this run or None with speculation off, the tail's
    steps)."""
    clock = TailClock(limit)
    eng.hooks.append(clock)
    stats0 = eng.spec.stats.copy() if eng.spec is not None else None
    try:
        sync()
        t0 = time.perf_counter()
        outs = eng.generate(prompts, params)
        sync()
        end = time.perf_counter()
    finally:
        eng.hooks.remove(clock)
    return (outs, end - t0, end - (clock.start or end), None if stats0 is None else eng.spec.stats.since(stats0),
            clock.steps)


def _tail_row(name: str, drafts: str, total_s: float, tail_s: float, n_tail: int, steps: int) -> dict:
    """A row's timing fields: rollout and tail seconds, tail tokens/s, the tail's steps and seconds per step."""
    return {"workload": "spec-tail", "model": name, "drafts": drafts, "rollout_s": total_s, "tail_s": tail_s,
            "tail_tok_s": n_tail / tail_s, "tail_steps": steps, "step_ms": 1e3 * tail_s / max(steps, 1)}


def tail_tokens(outs, lengths: list[int], limit: int) -> int:
    """Tokens generated while at most `limit` sequences decode (all samples of a prompt run to its length)."""
    per = sorted((n for o, n in zip(outs, lengths) for _ in o.samples), reverse=True)
    cut = per[limit] if limit < len(per) else 0  # tokens before the batch fell to `limit`
    return sum(max(n - cut, 0) for n in per[:limit])


def agreement(outs, reference: dict[int, list[int]], prompts) -> tuple[int, int, float]:
    """(samples equal to the reference, samples, mean share of a sample's tokens before it parted)."""
    same, total, kept = 0, 0, 0.0
    for p, o in zip(prompts, outs):
        ref = reference[id(p)]
        for s in o.samples:
            n = next((i for i, (x, y) in enumerate(zip(s.token_ids, ref)) if x != y), min(len(s.token_ids), len(ref)))
            same += s.token_ids == ref
            total += 1
            kept += n / max(len(ref), 1)
    return same, total, kept / max(total, 1)


def check_fp32(model, prompts, lengths: list[int], a, accepts: list[int]) -> int:
    """Greedy tokens of an fp32 copy of `model` with speculation at every replayed acceptance equal
    speculation off's on the first `a.check_prompts` prompts (up to `a.check_new_tokens` tokens);
    SystemExit names the first that differs. Returns the samples checked."""
    m32 = model if next(model.parameters()).dtype == torch.float32 else copy.deepcopy(model).float()
    ps = [copy.copy(p) for p in prompts[: a.check_prompts]]
    for p in ps:
        if p.pixel_values is not None:
            p.pixel_values = p.pixel_values.float()
    new = [min(m, a.check_new_tokens) for m in lengths[: a.check_prompts]]
    params = [SamplingParams(temperature=0, max_new_tokens=m, ignore_eos=True, n=2) for m in new]
    cfg = EngineConfig(max_num_seqs=64, max_model_len=max(len(p.input_ids) for p in ps) + max(new) + a.k + 8,
                       kv_cache_tokens=4 * sum(len(p.input_ids) + m + a.k + 8 for p, m in zip(ps, new)),
                       speculative_tokens=a.k, speculative_max_batch=64, speculative_max_fraction=1.0)
    eng = Engine(m32, None, cfg)
    spec, eng.spec = eng.spec, None
    want = eng.generate(ps, params)
    reference = {id(p): o.samples[0].token_ids for p, o in zip(ps, want)}
    if any(s.token_ids != reference[id(p)] for p, o in zip(ps, want) for s in o.samples):
        raise SystemExit("fp32 greedy samples of one prompt differ without speculation")
    eng.spec = spec
    for acc in accepts:
        spec.drafts = ReplayDrafts(reference, acc, a.k, m32.cfg.text.vocab_size)
        same, total, _ = agreement(eng.generate(ps, params), reference, ps)
        if same != total:
            raise SystemExit(f"fp32: speculation changed greedy tokens of {total - same} of {total} samples "
                             f"(replayed acceptance {acc})")
    del eng, spec, m32
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return 2 * len(ps)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rollplex.bench spec", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen2.5-vl-3b")
    ap.add_argument("--model", default=None, help="an HF checkpoint dir instead of the preset (a CPU check: the "
                    "tiny model with --device cpu)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                    help="the timed rows' dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    ap.add_argument("--check-prompts", type=int, default=4, help="prompts of the fp32 correctness check")
    ap.add_argument("--check-new-tokens", type=int, default=96, help="longest response of the fp32 check")
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
    ap.add_argument("--no-forced", dest="forced", action="store_false",
                    help="no teacher-forced rows (ForcedReplay): only the exact rule's")
    ap.add_argument("--adaptive", action="store_true",
                    help="speculative_adaptive: back off below what a verification costs (measured step times)")
    ap.add_argument("--json", default=None, help="append the rows as JSON lines to this file")
    a = ap.parse_args(argv)
    accepts = [int(x) for x in a.accept.split(",")]
    if any(not 0 <= x <= a.k for x in accepts):
        raise SystemExit("--accept lengths must be in [0, k]")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench spec needs a GPU (or --device cpu with a small --model)")
    torch.manual_seed(a.seed)
    dtype = getattr(torch, a.dtype or ("bfloat16" if a.device == "cuda" else "float32"))
    if a.model:
        from ..models import load_model

        model = load_model(a.model, a.device, dtype).eval()
    else:
        from ..presets import random_model

        model = random_model(a.preset, device=a.device, dtype=dtype, seed=a.seed).eval()
    name = a.model or a.preset
    total = a.prompts * a.n
    limit = int(a.tail_fraction * total)
    cfg = EngineConfig(max_num_seqs=max(256, total), max_model_len=a.max_new_tokens + 512,
                       gpu_memory_utilization=a.gpu_memory_utilization, max_num_batched_tokens=40000,
                       speculative_tokens=a.k, speculative_max_batch=max(limit, 1),
                       speculative_max_fraction=a.tail_fraction, speculative_adaptive=a.adaptive)
    prompts, _ = make_prompts(model.cfg, a.prompts, 1, size=a.image_size, seed=a.seed, device=a.device, dtype=dtype)
    lengths = tail_lengths(a.prompts, a.max_new_tokens, a.seed)
    checked = check_fp32(model, prompts, lengths, a, accepts)
    print(f"correctness (fp32): speculation at replayed acceptance {a.accept} gave speculation off's greedy "
          f"tokens for all {checked} samples of {min(a.check_prompts, a.prompts)} prompts", flush=True)
    t0 = time.perf_counter()
    eng = Engine(model, None, cfg)
    startup = time.perf_counter() - t0
    params = [SamplingParams(temperature=0, max_new_tokens=m, ignore_eos=True, n=a.n) for m in lengths]
    spec: Speculator = eng.spec
    eng.spec = None  # speculation off: the normal graphed decode path
    run(eng, prompts, params, limit)  # warm-up (compiles the sampler and prefill shapes)
    outs, total_s, tail_s, _, steps = run(eng, prompts, params, limit)
    reference = {id(p): o.samples[0].token_ids for p, o in zip(prompts, outs)}
    vocab = model.cfg.text.vocab_size
    n_tail = tail_tokens(outs, lengths, limit)
    env = env_info()
    rows = [{**_tail_row(name, "off", total_s, tail_s, n_tail, steps), "speedup": 1.0, "verifications": 0,
             "mean_accepted": 0.0, "acceptance": 0.0,
             **dict(zip(("same_samples", "_", "kept"), agreement(outs, reference, prompts)))}]
    eng.spec = spec
    spec.drafts = ReplayDrafts(reference, max(accepts), a.k, vocab)
    run(eng, prompts, params, limit)  # warm-up of the verify path
    exact = spec.rule
    for forced in (False, True) if a.forced else (False,):
        for acc in accepts:
            spec.drafts = ReplayDrafts(reference, acc, a.k, vocab)
            spec.rule = ForcedReplay(spec.drafts) if forced else exact
            got, total_s, tail_s, d, steps = run(eng, prompts, params, limit)
            same, n_samples, kept = agreement(got, reference, prompts)
            if dtype == torch.float32 and same != n_samples:
                raise SystemExit(f"speculation changed greedy tokens of {n_samples - same} of {n_samples} samples "
                                 f"(replayed acceptance {acc}{', forced' if forced else ''})")
            label = f"{'forced' if forced else 'replay'} a={acc}"
            rows.append({**_tail_row(name, label, total_s, tail_s, n_tail, steps),
                         "speedup": rows[0]["tail_s"] / tail_s, "verifications": d.steps,
                         "verify_ms": d.wall_ms / max(d.steps, 1), "verify_pass_ms": d.forward_ms / max(d.steps, 1),
                         "mean_accepted": d.mean_accepted, "acceptance": d.acceptance_rate,
                         "same_samples": same, "kept": kept,
                         "policy_agreed": (spec.rule.agreed / max(spec.rule.forced_total, 1)) if forced else None})
    spec.rule = exact
    print(f"{total} samples, tail = at most {limit} sequences decoding, {n_tail} tail tokens; "
          f"{a.dtype or str(dtype).split('.')[-1]}: 'same' counts samples with every token of speculation off")
    meta = {**env, "prompts": a.prompts, "n": a.n, "max_new_tokens": a.max_new_tokens, "k": a.k,
            "tail_limit": limit, "startup_s": startup, "adaptive": a.adaptive}
    for r in rows:
        line = json.dumps({**r, **meta})
        print(line)
        if a.json:
            with open(a.json, "a") as f:
                f.write(line + "\n")
    print(f"\n{name}, {a.prompts}x{a.n}, up to {a.max_new_tokens} tokens, k={a.k}"
          f"{', adaptive back-off' if a.adaptive else ''}, {env.get('gpu', a.device)}")
    # step ms: the tail's seconds per step (a decode or a verification); where every step verifies (forced, no
    # back-off), its ratio to speculation off's row is what a verification costs in decode steps
    # verify ms: a verification step's wall time on the host; pass: of it, the pass's GPU time (the rest is
    # host work before and after it — drafting, inputs, the rule — and sampling)
    print("| drafts | rollout s | tail s | tail tok/s | tail speed-up | tail steps | verifications | "
          "verify ms (pass) | step ms | vs off | mean accepted | acceptance | same | tokens before parting | agreed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        v = f"{r['verify_ms']:.2f} ({r['verify_pass_ms']:.2f})" if r["verifications"] else ""
        print(f"| {r['drafts']} | {r['rollout_s']:.2f} | {r['tail_s']:.3f} | {r['tail_tok_s']:.0f} | "
              f"{r['speedup']:.2f}x | {r['tail_steps']} | {r['verifications']} | {v} | {r['step_ms']:.2f} | "
              f"{r['step_ms'] / rows[0]['step_ms']:.2f}x | {r['mean_accepted']:.2f} | {r['acceptance']:.2f} | "
              f"{r['same_samples']}/{total} | {r['kept']:.0%} | "
              f"{'' if r.get('policy_agreed') is None else format(r['policy_agreed'], '.0%')} |")


if __name__ == "__main__":
    main()
