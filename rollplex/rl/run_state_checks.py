"""What a checkpoint must pass before a load applies any of it, and a save writes any of it.

    check_data_state(x)                          JSON-like, round-trips through torch.save / load and JSON
    check_file(path)                             a regular file, not a symlink (never a FIFO or a device)
    check_index(dir)                             model.safetensors.index.json names files in `dir` only
    check_weight(t, live_dtype, what)            a float dtype, finite after the cast to the live dtype
    check_adamw(saved, live, shapes, lr_max)     torch AdamW state_dicts: hyperparameters, flags, moments
    check_masters(saved, live)                   fp32 master weights: dtype, shape, finite
    check_scheduler(saved, live, lr_max)         torch LR scheduler state_dicts
    check_rng(rng)                               the python and torch RNG states

Each takes the saved state (plain dicts and tensors read with `weights_only`) and, where it needs them, the
live objects' own state dicts, and raises ValueError naming what is wrong; none changes anything. A value
that passes cannot poison training once applied: the optimizer's lr lies within the per-step override's
bounds (rl/config.py `per_step`; or the run's own lr when that is larger), its flags are the live
optimizer's (a checkpoint cannot turn on `maximize` or `amsgrad`), moments are finite with
`exp_avg_sq >= 0` in the masters' dtype, and a scheduler carries no `lr_lambdas` state (torch copies
it into the live lambdas' `__dict__`).
"""

from __future__ import annotations

import json
import math
import os
import random
import stat
from dataclasses import fields
from pathlib import Path

import torch

from .config import PER_STEP, RLConfig

# dtypes a weight may be stored in (float8 and other exotic formats: refused)
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_COUNT = 1 << 62  # step counters, epochs
INT64 = (-(1 << 63), (1 << 63) - 1)
MAX_DEPTH = 32  # nesting of a data state
MAX_INDEX_BYTES = 64 << 20  # an index file: a weight map, never this large
INDEX = "model.safetensors.index.json"
ADAMW_STATE = ("step", "exp_avg", "exp_avg_sq")


def per_step_max(name: str) -> float:
    """The upper bound a /train_step override of RLConfig field `name` may take."""
    f = next(f for f in fields(RLConfig) if f.name == name)
    return float(f.metadata[PER_STEP]["le"])


def _real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# ---- the data state ------------------------------------------------------------------------------
def check_data_state(x, where: str = "data_state", depth: int = 0) -> None:
    """ValueError unless `x` is made of dicts with string keys, lists, strings of valid unicode, finite
    floats, 64-bit ints, bools and None, at most MAX_DEPTH deep: what a load returns as it was saved."""
    if depth > MAX_DEPTH:
        raise ValueError(f"{where}: nested more than {MAX_DEPTH} deep")
    if x is None or isinstance(x, bool):
        return
    if isinstance(x, int):
        if not INT64[0] <= x <= INT64[1]:
            raise ValueError(f"{where}: an int outside the 64-bit range")
    elif isinstance(x, float):
        if not math.isfinite(x):
            raise ValueError(f"{where}: {x} is not a finite number")
    elif isinstance(x, str):
        _unicode(x, where)
    elif isinstance(x, dict):
        for k, v in x.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: a key of type {type(k).__name__} (keys are strings)")
            _unicode(k, where)
            check_data_state(v, f"{where}[{k[:40]!r}]", depth + 1)
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            check_data_state(v, f"{where}[{i}]", depth + 1)
    else:
        raise ValueError(f"{where}: a {type(x).__name__} (a data state holds JSON values only)")


def _unicode(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: no JSON answer can carry it back
        raise ValueError(f"{where}: a string that is not valid unicode (a lone surrogate)") from None


# ---- files ---------------------------------------------------------------------------------------
def check_file(path: Path) -> None:
    """ValueError unless `path` is a regular file itself (a symlink could name any host file, a FIFO
    would hang the reader)."""
    try:
        st = os.lstat(path)
    except OSError:
        raise ValueError(f"{path} is missing") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path} is not a regular file (a symlink, folder or device)")


def check_index(folder: Path) -> None:
    """ValueError unless the weight files of an HF folder are regular files inside it: the index (when
    there is one) names plain file names, never a path out of the folder."""
    index, single = folder / INDEX, folder / "model.safetensors"
    if not index.exists() and not index.is_symlink():
        if not single.exists() and not single.is_symlink():
            raise ValueError(f"{folder}: no model.safetensors or {INDEX}")
        check_file(single)
        return
    check_file(index)
    if index.stat().st_size > MAX_INDEX_BYTES:
        raise ValueError(f"{index} is over {MAX_INDEX_BYTES} bytes")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(f"{index} is not an index ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: weight_map is not a dict")
    for name in set(weight_map.values()):
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise ValueError(f"{index} names {name!r}: a weight file is a file name inside the checkpoint")
        check_file(folder / name)


# ---- tensors -------------------------------------------------------------------------------------
def check_weight(t, live_dtype: torch.dtype, what: str) -> None:
    """ValueError unless `t` is a tensor of a weight dtype whose values stay finite in `live_dtype` (1e300
    in float64 is finite, and inf once copied into a bf16 or fp32 parameter)."""
    if not isinstance(t, torch.Tensor) or t.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"{what} is {getattr(t, 'dtype', type(t).__name__)}, not one of "
                         f"{', '.join(str(d).removeprefix('torch.') for d in WEIGHT_DTYPES)}")
    if not bool(torch.isfinite(t.to(live_dtype)).all()):
        raise ValueError(f"{what} has non-finite values (in the live dtype {str(live_dtype).removeprefix('torch.')})")


def _moment(t, shape: torch.Size, dtype: torch.dtype, what: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.shape != shape:
        raise ValueError(f"{what} is not a {str(dtype).removeprefix('torch.')} tensor of shape {tuple(shape)}")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{what} has non-finite values")


def check_masters(saved, live: list[torch.Tensor]) -> None:
    """The optimizer's saved fp32 masters (a list of tensors or None each) against the live ones."""
    if saved is None:
        return
    if not isinstance(saved, list) or len(saved) != len(live):
        raise ValueError(f"the optimizer state holds no list of {len(live)} master weights")
    for i, (s, m) in enumerate(zip(saved, live)):
        if s is not None:
            _moment(s, m.shape, m.dtype, f"the master weights of parameter {i}")


# ---- optimizer and scheduler ---------------------------------------------------------------------
def check_adamw(saved, live: dict, shapes: list[torch.Size], lr_max: float, dtype: torch.dtype = torch.float32,
                what: str = "the optimizer") -> None:
    """`saved` (a torch AdamW state_dict) against `live` (the run's own optimizer's state_dict) over
    parameters of `shapes`: the same groups, no setting the live ones lack, the live flags, lr in
    [0, lr_max], betas in [0, 1), eps in (0, 1],
    weight decay in [0, 1], and per parameter at most a step count and the two moments (`dtype`, finite,
    exp_avg_sq >= 0)."""
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list) \
            or not isinstance(saved.get("state"), dict):
        raise ValueError(f"{what}'s state is not an AdamW state_dict")
    groups, own = saved["param_groups"], live["param_groups"]
    if len(groups) != len(own) or not all(isinstance(g, dict) for g in groups):
        raise ValueError(f"{what}'s state has {len(groups)} parameter groups, this run {len(own)}")
    for j, (g, o) in enumerate(zip(groups, own)):
        where = f"{what}'s parameter group {j}"
        # a setting this torch's AdamW lacks is refused; one it added since the save takes its default
        if not set(g) <= set(o) or not {"params", "lr", "betas", "eps", "weight_decay"} <= set(g):
            raise ValueError(f"{where} has other settings ({sorted(set(g) ^ set(o))[:4]})")
        for k, v in g.items():
            if k in ("lr", "initial_lr"):
                if not (_real(v) and 0 <= v <= lr_max):
                    raise ValueError(f"{where}: {k}={v!r} is not a finite number in [0, {lr_max:g}]")
            elif k == "betas":
                if not (isinstance(v, (tuple, list)) and len(v) == 2 and all(_real(b) and 0 <= b < 1 for b in v)):
                    raise ValueError(f"{where}: betas={v!r} are not two numbers in [0, 1)")
            elif k == "eps":
                if not (_real(v) and 0 < v <= 1):
                    raise ValueError(f"{where}: eps={v!r} is not a finite number in (0, 1]")
            elif k == "weight_decay":
                if not (_real(v) and 0 <= v <= 1):
                    raise ValueError(f"{where}: weight_decay={v!r} is not a finite number in [0, 1]")
            elif k == "params":
                if v != o["params"]:
                    raise ValueError(f"{where} is over other parameters (this run trains {len(shapes)} tensors)")
            elif v != o[k] or type(v) is not type(o[k]):  # amsgrad, maximize, foreach, fused...: the run's
                raise ValueError(f"{where}: {k}={v!r}, this run's optimizer has {o[k]!r}")
    n = len(shapes)
    for i, st in saved["state"].items():
        if not (isinstance(i, int) and 0 <= i < n) or not isinstance(st, dict):
            raise ValueError(f"{what}'s state names parameter {i!r}, this run has {n}")
        if not set(st) <= set(ADAMW_STATE):
            raise ValueError(f"{what}'s state of parameter {i} holds {sorted(set(st) - set(ADAMW_STATE))}")
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                _moment(st[k], shapes[i], dtype, f"{what}'s {k} of parameter {i}")
        if "exp_avg_sq" in st and bool((st["exp_avg_sq"] < 0).any()):
            raise ValueError(f"{what}'s exp_avg_sq of parameter {i} has negative values")
        if "step" in st:
            s = st["step"]
            s = float(s) if isinstance(s, torch.Tensor) and s.numel() == 1 and s.is_floating_point() else s
            if not (_real(s) and 0 <= s <= MAX_COUNT and float(s).is_integer()):
                raise ValueError(f"{what}'s step count of parameter {i} is not a count")


def check_scheduler(saved, live: dict, lr_max: float, what: str = "the LR scheduler") -> None:
    """`saved` (an LR scheduler's state_dict) against `live` (the run's own): none but the live keys, no
    `lr_lambdas` state, base and last lrs finite within [0, lr_max], counters within range."""
    # torch sets every key as an attribute of the scheduler (an "optimizer" key would replace its optimizer):
    # only the live scheduler's own keys, the counters and lrs among them
    if not isinstance(saved, dict) or not set(saved) <= set(live) or not {"base_lrs", "last_epoch"} <= set(saved):
        got = sorted(saved)[:8] if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"{what}'s state is not this run's (keys {got})")
    n = len(live["base_lrs"])
    for k, v in saved.items():
        if k == "lr_lambdas":  # None per function lambda; anything else is copied into the live lambdas
            if not (isinstance(v, list) and len(v) == n and all(x is None for x in v)):
                raise ValueError(f"{what}'s state carries lr_lambdas state (only plain functions are this run's)")
        elif k in ("base_lrs", "_last_lr"):
            if not (isinstance(v, list) and len(v) == n and all(_real(x) and 0 <= x <= lr_max for x in v)):
                raise ValueError(f"{what}: {k} are not {n} finite numbers in [0, {lr_max:g}]")
        elif k in ("last_epoch", "_step_count"):
            if not (isinstance(v, int) and not isinstance(v, bool) and -1 <= v <= MAX_COUNT):
                raise ValueError(f"{what}: {k}={v!r} is not a count")
        elif type(v) is not type(live[k]) or (not isinstance(v, (bool, type(None))) and v != live[k]):
            raise ValueError(f"{what}: {k}={v!r}, this run's scheduler has {live[k]!r}")


def check_rng(rng) -> None:
    """The python and torch RNG states, set on throwaway generators (nothing live is touched)."""
    if not isinstance(rng, dict) or not {"python", "torch"} <= set(rng):
        raise ValueError("the RNG state lacks its python or torch part")
    try:
        random.Random().setstate(rng["python"])
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"the python RNG state is not one ({e})") from None
    t = rng["torch"]
    if not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.shape == torch.get_rng_state().shape):
        raise ValueError("the torch RNG state is not one")
    try:
        torch.Generator().set_state(t)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"the torch RNG state is not one ({e})") from None
