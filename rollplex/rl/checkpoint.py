"""Checkpoint / resume of an RL run: an HF directory for the policy (readable by transformers and
by `load_model`), the reference policy beside it, and `trainer_state.pt` with the optimizer,
LR scheduler, step counter, data position and RNG states. Loading copies weights *in place* so the
native engine, which reads the same tensors, keeps decoding with the restored policy; a rollout backend
with its own copy of the policy (SGLang) gets the restored weights copied in.
"""

from __future__ import annotations

import contextlib
import json
import random
from dataclasses import asdict
from pathlib import Path

import torch

from ..models import hf_to_rollplex, save_model
from ..models.checkpoint import read_safetensors
from .step import RLStep

STATE = "trainer_state.pt"


# what a checkpoint reads or writes besides the policy: resident for the duration whatever the phase
_HELD = ("ref_weights", "optimizer")


def _held(step: RLStep, modified: bool):
    return step.memory.resident(_HELD, modified) if step.memory is not None else contextlib.nullcontext()


def _single_process(step: RLStep) -> None:
    if step.parallel is not None:  # sharded trainer and optimizer state: one writer per rank's shards needed
        raise ValueError("checkpoints of a data-parallel RL step are not supported yet")


def save_checkpoint(step: RLStep, path: str | Path, data_state: dict | None = None,
                    tokenizer_dir: str | Path | None = None) -> Path:
    _single_process(step)
    with _held(step, modified=False):
        return _save(step, Path(path), data_state, tokenizer_dir)


def _save(step: RLStep, path: Path, data_state: dict | None, tokenizer_dir) -> Path:
    save_model(step.model, path, copy_tokenizer_from=tokenizer_dir)
    if step.ref is not None:
        save_model(step.ref, path / "ref")
    state = {
        "actor": step.actor.state_dict(),
        "step_idx": step.step_idx,
        "rl_config": asdict(step.cfg),
        "data": data_state or {},
        "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
    }
    torch.save(state, path / STATE)
    (path / "rollplex_step.json").write_text(json.dumps({"global_step": step.step_idx}) + "\n")
    return path


def _load_into(model, path: Path) -> None:
    state = hf_to_rollplex(read_safetensors(path), model.cfg)
    with torch.no_grad():
        own = model.state_dict()
        missing = set(own) - set(state)
        if missing:
            raise ValueError(f"checkpoint {path} lacks {sorted(missing)[:3]}...")
        wrong = [k for k, v in own.items() if state[k].shape != v.shape]
        if wrong:  # checked before any copy: a failed load leaves the model untouched
            raise ValueError(f"checkpoint {path} has other shapes for {wrong[:3]}")
        for k, v in own.items():
            v.copy_(state[k])


def load_checkpoint(step: RLStep, path: str | Path) -> dict:
    """Restore policy, reference, optimizer, scheduler, step counter and RNG; returns the data state."""
    _single_process(step)
    path = Path(path)
    if not (path / STATE).exists():
        raise ValueError(f"{path} is not a Rollplex checkpoint (no {STATE})")
    # weights_only: the state is tensors and plain containers; never unpickle arbitrary objects
    state = torch.load(path / STATE, map_location="cpu", weights_only=True)
    with _held(step, modified=True):
        return _load(step, path, state)


def _load(step: RLStep, path: Path, state: dict) -> dict:
    _load_into(step.model, path)
    if step.ref is not None:
        if not (path / "ref").exists():
            raise ValueError(f"{path} has no reference policy but this run uses one")
        _load_into(step.ref, path / "ref")
    step.actor.load_state_dict(state["actor"])
    if step.backend is not None:
        step.backend.update_weights()
    step.step_idx = state["step_idx"]
    random.setstate(state["rng"]["python"])
    torch.set_rng_state(state["rng"]["torch"])
    return state["data"]
