"""Reward functions with verl's signature `compute_score(data_source, solution_str, ground_truth,
extra_info=None) -> float | dict` and a registry to pick them by name or `module:function` path.

Built-ins: `exact` (normalised string match), `choice` (multiple-choice letter), `math_boxed`
(`\\boxed{}` answer: geo3k-style 0.9 * accuracy + 0.1 * format), and `shape_color` (the embedded demo
task). `default_compute_score` dispatches on `data_source` like verl's. `score_samples` is the one
loop that scores a rollout's samples (the RL step and the server's /train_step both use it), and
`score_batch` adds DAPO's overlong reward shaping to it (`overlong_penalty`, verl's DAPO reward manager
with reward_model.overlong_buffer): with a buffer of L tokens and max_new_tokens M, a response of
length l (its EOS included) gets min(-(l - (M - L)) / L * factor, 0) added to its score: nothing up to
M - L tokens, then linearly down to -factor at M. Its metrics, under verl's reward_extra_info names:
`critic/score/overlong_reward` (the mean penalty) and `critic/score/overlong` (the share penalised).

The built-ins run in time linear in their inputs (no pattern that backtracks over a client's ground
truth) and refuse a response or ground truth over MAX_TEXT_CHARS characters (ValueError).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .batch import RolloutBatch

RewardFn = Callable[..., "float | dict"]
REWARD_EXTRA_INFO = "reward_extra_info"  # the per-sample extra values in a scored batch's extras
# characters of a response or ground truth the built-ins score: beyond any answer they compare, and a
# bound on the work one sample can ask for
MAX_TEXT_CHARS = 1 << 16


def _capped(fn: RewardFn) -> RewardFn:
    """A built-in that refuses texts over MAX_TEXT_CHARS before scoring them."""
    @functools.wraps(fn)
    def capped(data_source, solution_str, ground_truth, extra_info=None):
        for what, x in (("response", solution_str), ("ground truth", ground_truth)):
            n = len(x) if isinstance(x, str) else len(str(x))
            if n > MAX_TEXT_CHARS:
                raise ValueError(f"a {what} of {n} characters is over the built-in rewards' limit of {MAX_TEXT_CHARS}")
        return fn(data_source, solution_str, ground_truth, extra_info)

    return capped


def _norm(s: str) -> str:
    return re.sub(r"\s+", " ", str(s)).strip().strip(".").lower()


@_capped
def exact_match(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return float(_norm(solution_str) == _norm(ground_truth))


_CHOICE = re.compile(r"\b([A-Z])\b")


def extract_choice(text: str) -> str | None:
    """The first standalone capital letter, e.g. 'B' in 'The answer is B.' or 'B'."""
    text = re.sub(r"<\|[^|]*\|>", " ", text)  # special tokens
    m = _CHOICE.search(text)
    return m.group(1) if m else None


@_capped
def choice(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return float(extract_choice(solution_str) == str(ground_truth).strip().upper())


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (balanced braces), or None."""
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    depth, j = 0, i + len("\\boxed{") - 1
    for k in range(j, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                return text[j + 1 : k]
    return None


def _math_norm(s: str) -> str:
    s = _norm(s).replace(" ", "").replace("\\left", "").replace("\\right", "").replace("$", "")
    # [^{}]: a scan from one \frac{ stops at the next brace, so no two scans overlap (linear time)
    s = re.sub(r"\\(d|t)?frac\{([^{}]*)\}\{([^{}]*)\}", r"\2/\3", s)
    s = re.sub(r"\^\{?\\circ\}?|°|\\degree", "", s)
    return s.removeprefix("x=")


@_capped
def math_boxed(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    """geo3k-style: score = 0.9 * accuracy + 0.1 * format (format: a \\boxed{} answer present)."""
    ans = last_boxed(solution_str)
    fmt = float(ans is not None)
    acc = float(ans is not None and _math_norm(ans) == _math_norm(ground_truth))
    return {"score": 0.9 * acc + 0.1 * fmt, "acc": acc, "format": fmt}


@_capped
def shape_color(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """The demo task: the answer is the option letter of the shape's colour."""
    return choice(data_source, solution_str, ground_truth, extra_info)


REGISTRY: dict[str, RewardFn] = {
    "exact": exact_match,
    "choice": choice,
    "math_boxed": math_boxed,
    "geo3k": math_boxed,
    "shape_color": shape_color,
}
_BY_SOURCE = {"hiyouga/geometry3k": math_boxed, "geo3k": math_boxed, "rollplex/shape_color": shape_color}


def default_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    fn = _BY_SOURCE.get(data_source)
    if fn is None:
        raise ValueError(f"no default reward for data_source {data_source!r}; pass a reward name or module:function")
    return fn(data_source, solution_str, ground_truth, extra_info)


def get_reward_fn(name: str | None) -> RewardFn:
    """A registered name, a `module:function` / `path/to/file.py:function` path, or None (dispatch).
    A path imports (runs) that code: for the caller's own names, never a remote client's (the server
    keeps its own registry: rollplex/server/rewards.py)."""
    if name is None or name == "default":
        return default_compute_score
    if name in REGISTRY:
        return REGISTRY[name]
    if ":" in name:
        return load_reward(name)
    raise ValueError(f"unknown reward {name!r}; known: {sorted(REGISTRY)} or module:function")


def load_reward(name: str) -> RewardFn:
    """The function a `module:function` / `path/to/file.py:function` path names (imports or executes it)."""
    if ":" in name:
        mod_name, fn_name = name.rsplit(":", 1)
        try:
            if mod_name.endswith(".py"):
                spec = importlib.util.spec_from_file_location("rollplex_custom_reward", mod_name)
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
            else:
                mod = importlib.import_module(mod_name)
            fn = getattr(mod, fn_name)
        except (ImportError, AttributeError, FileNotFoundError) as e:
            raise ValueError(f"cannot load reward function {name!r}: {e}") from e
        if not callable(fn):
            raise ValueError(f"{name!r} is not callable")
        return fn
    raise ValueError(f"{name!r} is not a module:function or file.py:function path")


def score(fn: RewardFn, data_source, solution_str, ground_truth, extra_info=None) -> tuple[float, dict]:
    """Call a reward function; returns (scalar score, extra metrics)."""
    out = fn(data_source, solution_str, ground_truth, extra_info)
    if isinstance(out, dict):
        if "score" not in out:
            raise ValueError("a reward function returning a dict must include 'score'")
        return float(out["score"]), {k: float(v) for k, v in out.items() if k != "score"}
    return float(out), {}


def score_samples(fn: RewardFn, data_sources: Sequence, texts: Sequence[str], ground_truths: Sequence,
                  extra_infos: Sequence, name: str | None = None, per_sample: list | None = None
                  ) -> tuple[list[float], dict]:
    """Score every sample: (scores, metrics averaged over the samples as `critic/score/<key>`).
    per_sample: a list to append each sample's extra values to ({key: float}, the dict a reward function
    returns without its score; verl's reward_extra_info). ValueError, naming the sample, when the function
    raises or returns a non-finite score."""
    name = name or getattr(fn, "__name__", "reward")
    scores, extra = [], {}
    for i, args in enumerate(zip(data_sources, texts, ground_truths, extra_infos)):
        try:
            s, e = score(fn, *args)
        except Exception as err:  # the reward function's or the data's problem: report it
            raise ValueError(f"reward {name!r} failed on sample {i}: {type(err).__name__}: {err}") from err
        if not math.isfinite(s):
            raise ValueError(f"reward {name!r} returned {s} for sample {i}")
        scores.append(s)
        if per_sample is not None:
            per_sample.append(e)
        for k, v in e.items():
            extra.setdefault(k, []).append(v)
    return scores, {f"critic/score/{k}": sum(v) / len(v) for k, v in extra.items()}


def overlong_penalty(lengths: Sequence[int], max_new_tokens: int, buffer_len: int, factor: float) -> list[float]:
    """DAPO's soft overlong punishment per response (module docstring); all 0.0 when buffer_len is 0.
    ValueError for a buffer longer than max_new_tokens (it would penalise every response)."""
    if buffer_len == 0:
        return [0.0] * len(lengths)
    if not 0 < buffer_len <= max_new_tokens:
        raise ValueError(f"overlong_buffer_len must be within [0, max_new_tokens={max_new_tokens}], got {buffer_len}")
    expected = max_new_tokens - buffer_len
    return [-(n - expected) / buffer_len * factor if n > expected else 0.0 for n in lengths]


def score_batch(fn: RewardFn, batch: RolloutBatch, max_new_tokens: int, overlong_buffer_len: int = 0,
                overlong_penalty_factor: float = 1.0, name: str | None = None
                ) -> tuple[list[float], torch.Tensor, dict]:
    """A rollout's (scores, rewards [N] fp32, metrics): the reward function's score per sample, and the
    reward trained on, the score plus its overlong penalty (module docstring; max_new_tokens: the
    rollout's). Each sample's extra values (the keys a reward function returns beside its score: `acc`, ...)
    go into `batch.extras["reward_extra_info"]`, as verl keeps them, for dynamic sampling's
    `filter_groups_metric`. ValueError as `score_samples`."""
    ex = batch.extras
    infos: list[dict] = []
    scores, extra = score_samples(fn, ex["data_sources"], ex["texts"], ex["ground_truths"], ex["extra_infos"],
                                  name=name, per_sample=infos)
    batch.extras[REWARD_EXTRA_INFO] = infos
    if not overlong_buffer_len:
        return scores, torch.tensor(scores, dtype=torch.float32), extra
    lengths = [int(n) for n in batch.mask.sum(-1).tolist()]
    penalty = overlong_penalty(lengths, max_new_tokens, overlong_buffer_len, overlong_penalty_factor)
    extra["critic/score/overlong_reward"] = sum(penalty) / max(len(penalty), 1)
    extra["critic/score/overlong"] = sum(p < 0 for p in penalty) / max(len(penalty), 1)
    return scores, torch.tensor([s + p for s, p in zip(scores, penalty)], dtype=torch.float32), extra
