"""Rollplex's rollout requests in SGLang's `Engine.generate` form, and SGLang's answers in Rollplex's.

Request (`generate_kwargs`): every sample is its own request with n = 1, prompt-major, so sample j of
a prompt with seed s is drawn with `sampling_seed` s + j — the native engine's rule ("sample j of a
request with n samples and seed s is drawn as a request with n = 1 and seed s + j"), which keeps the
n samples distinct under SGLang's deterministic sampling too (it seeds unseeded requests alike).

    input_ids        Rollplex's token ids, image placeholders already expanded: SGLang decodes exactly
                     the prompt the trainer scores
    image_data       per request None, or one {"format": "processor_output", "pixel_values",
                     "image_grid_thw"} with the prompt's preprocessed images on the host (SGLang takes
                     one such item per request; a prompt's samples share one item); only for prompts
                     with images
    sampling_params  SGLang's names: max_new_tokens, temperature, top_p, top_k, min_p, stop,
                     stop_token_ids, ignore_eos, skip_special_tokens, sampling_seed
    return_logprob   True: the sampled tokens' logprobs come back with them

Answer (one dict per request, in request order; names from SGLang's tokenizer manager, listed in
contract.py):

    {"text", "output_ids": [ids through the stop token],
     "meta_info": {"prompt_tokens", "finish_reason": {"type": "stop", "matched": id|str}
                   | {"type": "length", "length": k} | {"type": "abort", "message": ...},
                   "output_token_logprobs": [(logprob, token_id, text|None), ...], ...}}

`request_outputs` turns them into one `RequestOutput` per prompt (its samples in order), the form the
native engine returns and RolloutBatch.from_outputs reads. SGLang's default logprob is
log_softmax(logits / temperature) before top-k/top-p, the native engine's definition (unless SGLang
runs with SGLANG_RETURN_ORIGINAL_LOGPROB). An answer that does not fit — a prompt SGLang counted with
another length, logprobs for other tokens than output_ids, an unfinished request — is a RuntimeError
rather than a batch the trainer would score against the wrong tokens; a prompt that cannot be sent
(a video) is a ValueError.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from rollplex.engine import RequestOutput, SampleOutput, SamplingParams

PROCESSOR_OUTPUT = "processor_output"
FINISH_TYPES = {"stop": "stop", "length": "length", "abort": "abort"}


def sampling_dict(sp: SamplingParams, seed: int, j: int = 0) -> dict:
    """Sample j's SGLang sampling_params (n = 1; its own length cap when the request gives one)."""
    cap = sp.max_new_tokens if sp.sample_max_new_tokens is None else sp.sample_max_new_tokens[j]
    d = {"max_new_tokens": cap, "temperature": sp.temperature, "top_p": sp.top_p,
         "top_k": sp.top_k, "min_p": sp.min_p, "ignore_eos": sp.ignore_eos,
         "skip_special_tokens": sp.skip_special_tokens, "sampling_seed": int(seed), "n": 1}
    if sp.stop:
        d["stop"] = list(sp.stop)
    if sp.stop_token_ids:
        d["stop_token_ids"] = list(sp.stop_token_ids)
    return d


def image_item(prompt) -> dict | None:
    """The prompt's preprocessed images as one SGLang processor_output item; None without images."""
    if prompt.video_grids:
        raise ValueError("video prompts are not supported by the sglang rollout backend (text and image prompts are)")
    if not prompt.image_grids:
        return None
    # on the host, as an HF processor's output: SGLang moves them to its own device (and they cross to an
    # engine in another process by value, never as a CUDA IPC handle it would have to share again)
    return {"format": PROCESSOR_OUTPUT, "pixel_values": prompt.pixel_values.detach().cpu(),
            "image_grid_thw": prompt.image_grid_thw.detach().cpu()}


def sample_seeds(params: Sequence[SamplingParams], rng: random.Random) -> list[list[int]]:
    """Per prompt, one seed per sample: seed + j, or drawn from `rng` for an unseeded prompt."""
    out = []
    for sp in params:
        base = sp.seed if sp.seed is not None else rng.randrange(2**62)
        out.append([(base + j) % 2**63 for j in range(sp.n)])
    return out


def generate_kwargs(prompts: Sequence, params: Sequence[SamplingParams], seeds: list[list[int]]) -> dict:
    """Keyword arguments of SGLang's Engine.generate for these prompts: one request per sample."""
    if len(prompts) != len(params) or len(seeds) != len(params):
        raise ValueError("one SamplingParams (and one seed list) per prompt")
    ids, images, sps = [], [], []
    for p, sp, ss in zip(prompts, params, seeds):
        item = image_item(p)
        for j, s in enumerate(ss):
            ids.append(list(p.input_ids))
            images.append(item)
            sps.append(sampling_dict(sp, s, j))
    kw = {"input_ids": ids, "sampling_params": sps, "return_logprob": True}
    if any(x is not None for x in images):
        kw["image_data"] = images
    return kw


def _finish(meta: dict, where: str) -> tuple[str, int | str | None]:
    reason = meta.get("finish_reason")
    if not isinstance(reason, dict) or reason.get("type") not in FINISH_TYPES:
        raise RuntimeError(f"{where}: finish_reason {reason!r} is not a finished request's "
                         "({'type': 'stop' | 'length' | 'abort', ...})")
    kind = FINISH_TYPES[reason["type"]]
    return kind, reason.get("matched") if kind == "stop" else None


def sample_output(raw: dict, prompt_len: int, sp: SamplingParams, where: str,
                  decode: Callable[[list[int], bool], str] | None = None) -> SampleOutput:
    """One SGLang answer (a dict) as a SampleOutput."""
    if not isinstance(raw, dict) or not isinstance(raw.get("meta_info"), dict) or "output_ids" not in raw:
        raise RuntimeError(f"{where}: expected SGLang's {{'output_ids', 'meta_info', ...}}, got {type(raw).__name__}")
    meta = raw["meta_info"]
    ids = [int(t) for t in raw["output_ids"]]
    if "prompt_tokens" in meta and meta["prompt_tokens"] != prompt_len:
        raise RuntimeError(f"{where}: SGLang counted {meta['prompt_tokens']} prompt tokens where Rollplex sent "
                         f"{prompt_len}: it did not decode the prompt the trainer scores")
    lps = meta.get("output_token_logprobs")
    if lps is None:
        raise RuntimeError(f"{where}: no output_token_logprobs in meta_info (was return_logprob dropped?)")
    if len(lps) < len(ids) or any(int(e[1]) != t for e, t in zip(lps, ids)):
        raise RuntimeError(f"{where}: output_token_logprobs do not cover output_ids token for token "
                         f"({len(lps)} logprobs, {len(ids)} tokens)")
    reason, matched = _finish(meta, where)
    if not ids and reason != "abort":
        raise RuntimeError(f"{where}: a finished sample without tokens")
    if decode is not None:
        text = decode(ids, sp.skip_special_tokens)
        if isinstance(matched, str) and matched in text:  # as the native engine: the answer ends before it
            text = text[: text.index(matched)]
    else:
        text = raw.get("text")
    return SampleOutput(ids, [float(e[0]) for e in lps[: len(ids)]], reason, matched, text)


def request_outputs(prompts: Sequence, params: Sequence[SamplingParams], raw: list,
                    decode: Callable[[list[int], bool], str] | None = None,
                    request_ids: Sequence[str] | None = None) -> list[RequestOutput]:
    """SGLang's answers to generate_kwargs(prompts, params, ...) as one RequestOutput per prompt."""
    if isinstance(raw, dict):
        raw = [raw]
    want = sum(sp.n for sp in params)
    if not isinstance(raw, list) or len(raw) != want:
        raise RuntimeError(f"SGLang answered {len(raw) if isinstance(raw, list) else type(raw).__name__} "
                         f"outputs for {want} requests")
    outs, k = [], 0
    for i, (p, sp) in enumerate(zip(prompts, params)):
        samples = [sample_output(raw[k + j], len(p.input_ids), sp, f"prompt {i} sample {j}", decode)
                   for j in range(sp.n)]
        k += sp.n
        rid = request_ids[i] if request_ids is not None else str(i)
        outs.append(RequestOutput(rid, list(p.input_ids), samples, meta={"backend": "sglang"}))
    return outs
