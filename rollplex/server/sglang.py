"""SGLang's /generate schema <-> Rollplex: request -> one `PromptSpec` per prompt; outputs -> SGLang dicts.

Request (GenerateReqInput): `text` (templated text; image prompts hold one
`<|vision_start|><|image_pad|><|vision_end|>` per image, which the processor expands) or `input_ids`,
single or batch; `image_data` per prompt (one image or a list); `sampling_params` (one dict or one
per prompt); `return_logprob` / `logprob_start_len` (scalars or per prompt).

Response per sample (a dict for one prompt with n = 1, else a list, prompt-major):

    {"text", "output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens", "cached_tokens",
     "finish_reason": {"type": "stop", "matched": id|str} | {"type": "length", "length": k}
                    | {"type": "abort", "message": ...},
     "e2e_latency", ["output_token_logprobs": [[logprob, token_id, text|null], ...],
                     "input_token_logprobs": [[logprob|null, token_id, text|null], ...]]}}

Streaming chunks carry the cumulative text / output_ids / logprobs so far, `finish_reason` null until
the last chunk of that sample, and `index` (position among the prompt-major samples).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pydantic import BaseModel, ValidationError

from ..engine import SamplingParams
from ..engine.sampling_params import SEED_MAX
from . import limits as caps
from .errors import bad_request
from .limits import ServerLimits
from .schemas import GenerateRequest, SGLangSamplingParams


def describe(e: ValidationError, prefix: str = "") -> str:
    parts = []
    for err in e.errors(include_url=False, include_input=False):
        loc = ".".join(str(x) for x in (prefix, *err["loc"]) if x != "")
        parts.append(f"{loc}: {err['msg']}" if loc else err["msg"])
    return "; ".join(dict.fromkeys(parts))


def validate(model: type[BaseModel], data, where: str):
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise bad_request(describe(e, where)) from None


def sampling_params(raw: dict | None, defaults: dict, max_n: int, where: str = "sampling_params",
                    limits: ServerLimits | None = None, **extra) -> SamplingParams:
    """SGLang sampling_params (+ server defaults) -> SamplingParams; HTTP 400 on anything invalid, or
    over the stop limits (limits.py) when given."""
    given = validate(SGLangSamplingParams, raw or {}, where).given()
    merged = {**defaults, **given, **extra}
    if merged.get("n", 1) > max_n:
        raise bad_request(f"{where}.n={merged['n']} exceeds the server's max_num_seqs={max_n}")
    try:
        sp = SamplingParams(**merged)
        if limits is not None:
            caps.check_stops(limits, sp.stop, sp.stop_token_ids, where)
        return sp
    except (ValueError, TypeError) as e:
        raise bad_request(f"{where}: {e}" if not str(e).startswith(where) else str(e)) from None


def group_params(sp: SamplingParams, prompts: int, limits: ServerLimits | None = None) -> list[SamplingParams]:
    """One SamplingParams per prompt of a /rollout: prompt i's samples draw with seed + i*n + j, so the
    whole range must fit an int64 (400 otherwise, before any work), as must prompts x n the samples cap."""
    try:
        if limits is not None:
            caps.check_samples(limits, prompts, sp.n)
    except ValueError as e:
        raise bad_request(str(e)) from None
    if sp.seed is None:
        return [sp] * prompts
    last = sp.seed + prompts * sp.n - 1
    if last > SEED_MAX:
        raise bad_request(f"sampling_params.seed={sp.seed}: prompt i's sample j draws with seed + i*n + j, and "
                          f"{prompts} prompts x n={sp.n} reach {last}, over 2**63 - 1: pass a seed of at most "
                          f"{SEED_MAX - prompts * sp.n + 1}")
    return [replace(sp, seed=sp.seed + i * sp.n) for i in range(prompts)]


@dataclass
class PromptSpec:
    prompt: object  # templated text, {"text", "images"}, or token ids
    params: SamplingParams
    return_logprob: bool
    rid: str | None


def _per_prompt(value, batch: int, name: str, is_list_value: bool = False) -> list:
    """A scalar applies to every prompt; a list must have one entry per prompt."""
    if isinstance(value, list) and not is_list_value:
        if len(value) != batch:
            raise bad_request(f"{name} has {len(value)} entries for {batch} prompts")
        return value
    return [value] * batch


def _images(image_data, batch: int, batched: bool) -> list[list[str]]:
    if image_data is None:
        return [[] for _ in range(batch)]
    if not batched:
        if isinstance(image_data, str):
            return [[image_data]]
        if any(not isinstance(x, str) for x in image_data):
            raise bad_request("image_data for one prompt is an image or a list of images (strings)")
        return [list(image_data)]
    if not isinstance(image_data, list) or len(image_data) != batch:
        raise bad_request("image_data for a batch must be a list with one entry (image, list or null) per prompt")
    return [[] if x is None else [x] if isinstance(x, str) else list(x) for x in image_data]


def expand(req: GenerateRequest, defaults: dict, max_n: int,
           limits: ServerLimits | None = None) -> tuple[list[PromptSpec], bool]:
    """(one spec per prompt, batched?) for a /generate request; 400 over `limits` (stops, rid, samples)."""
    if req.text is not None:
        batched = isinstance(req.text, list)
        prompts = list(req.text) if batched else [req.text]
    else:
        batched = bool(req.input_ids) and isinstance(req.input_ids[0], list)
        prompts = list(req.input_ids) if batched else [req.input_ids]
    if not prompts:
        raise bad_request("empty batch")
    B = len(prompts)
    images = _images(req.image_data, B, batched)
    if req.input_ids is not None and any(images):
        raise bad_request("image_data needs `text` prompts with image placeholders, not `input_ids`")
    sps = _per_prompt(req.sampling_params, B, "sampling_params")
    want_lp = _per_prompt(req.return_logprob, B, "return_logprob")
    starts = _per_prompt(req.logprob_start_len, B, "logprob_start_len")
    rids = _per_prompt(req.rid, B, "rid")
    tops = _per_prompt(req.top_logprobs_num, B, "top_logprobs_num")
    if any(t for t in tops):
        raise bad_request("top_logprobs_num > 0 is not supported by rollplex")
    specs = []
    for i, p in enumerate(prompts):
        where = f"sampling_params[{i}]" if isinstance(req.sampling_params, list) else "sampling_params"
        if sps[i] is not None and not isinstance(sps[i], dict):
            raise bad_request(f"{where} must be an object")
        lp = bool(want_lp[i])
        start = starts[i] if starts[i] is not None else -1
        if start < -1:
            raise bad_request("logprob_start_len must be -1 or >= 0")
        params = sampling_params(sps[i], defaults, max_n, where, limits, logprob_start_len=start if lp else -1)
        if limits is not None:
            try:
                caps.check_rid(limits, rids[i], f"rid[{i}]" if isinstance(req.rid, list) else "rid")
            except ValueError as e:
                raise bad_request(str(e)) from None
        prompt = {"text": p, "images": images[i]} if images[i] else p
        specs.append(PromptSpec(prompt, params, lp, rids[i]))
    if limits is not None:
        total = sum(s.params.n for s in specs)
        if total > limits.max_samples:
            raise bad_request(f"{B} prompts ask for {total} samples in one request; this server takes at most "
                              f"{limits.max_samples} ({caps.flag('max_samples')}): split the batch")
    return specs, batched


# ---- outputs ------------------------------------------------------------------------------------
def finish_reason(reason: str | None, matched, n_tokens: int) -> dict | None:
    if reason == "stop":
        return {"type": "stop", "matched": matched}
    if reason == "length":
        return {"type": "length", "length": n_tokens}
    if reason == "abort":
        return {"type": "abort", "message": "request aborted"}
    return None


def _triples(logprobs, ids, texts) -> list[list]:
    texts = texts if texts is not None else [None] * len(ids)
    return [[lp, t, s] for lp, t, s in zip(logprobs, ids, texts)]


def sample_id(base: str, n: int, j: int) -> str:
    """`meta_info.id` of sample j of a prompt with n samples: the request's id, suffixed `-j` when n > 1.
    Every streamed chunk of the sample and the non-streaming answer carry this one id."""
    return base if n == 1 else f"{base}-{j}"


def sample_dict(rid: str, prompt_tokens: int, ids: list[int], logprobs: list[float], text: str | None,
                reason: dict | None, want_logprob: bool, token_texts: list | None = None,
                input_logprobs: list | None = None, latency: float | None = None) -> dict:
    meta = {"id": rid, "prompt_tokens": prompt_tokens, "completion_tokens": len(ids), "cached_tokens": 0,
            "finish_reason": reason}
    if latency is not None:
        meta["e2e_latency"] = latency
    if want_logprob:
        meta["output_token_logprobs"] = _triples(logprobs, ids, token_texts)
        meta["input_token_logprobs"] = input_logprobs or []
    return {"text": text or "", "output_ids": list(ids), "meta_info": meta}


def input_logprobs(out, start: int, token_texts: list | None = None) -> list[list]:
    """[[logprob|None, token_id, text|None]] for prompt positions start.. (None for prompt token 0)."""
    lps = out.input_token_logprobs
    if lps is None or start < 0:
        return []
    ids = out.prompt_token_ids[start:]
    return _triples(lps, ids, token_texts)
