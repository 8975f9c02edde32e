"""Checkpoint / resume of an RL run: an HF directory for the policy (readable by transformers and
by `load_model`), the reference policy beside it, and `trainer_state.pt` with the optimizer,
LR scheduler, step counter, data position and RNG states. Loading copies weights *in place* so the
native engine, which reads the same tensors, keeps decoding with the restored policy; a rollout backend
with its own copy of the policy (SGLang) gets the restored weights copied in.

A data-parallel step (under a process group; every rank calls save / load together) writes the same HF
directories from rank 0 (the policy whole as a per-rank engine holds it, or gathered from the trainer's
shards under a tensor-parallel engine; the reference gathered from its shards), and
per rank `trainer_state.rank{r}-of-{W}.pt`: that rank's optimizer shards (fp32 masters and moments,
which restore the trainer's shards), its reference shards, the scheduler, step counter and its RNG
states, as verl writes one file per rank. It loads into a group of the same size and layout; loading
rebuilds the engine's weights from the trainer's restored shards (`sync_weights`).
"""

from __future__ import annotations

import contextlib
import json
import random
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..models import hf_to_rollplex, save_model
from ..models.checkpoint import read_safetensors
from .step import RLStep

STATE = "trainer_state.pt"


# what a checkpoint reads or writes besides the policy: resident for the duration whatever the phase
_HELD = ("ref_weights", "optimizer")


def _held(step: RLStep, modified: bool):
    return step.memory.resident(_HELD, modified) if step.memory is not None else contextlib.nullcontext()


def _rank_file(step: RLStep) -> str:
    """This process's trainer-state file: STATE on one process, one file per rank of a group."""
    par = step.parallel
    return STATE if par is None else f"trainer_state.rank{par.rank}-of-{par.world}.pt"


def save_checkpoint(step: RLStep, path: str | Path, data_state: dict | None = None,
                    tokenizer_dir: str | Path | None = None) -> Path:
    """Write the checkpoint (every rank of a data-parallel step calls this with the same path)."""
    with _held(step, modified=False):
        return _save(step, Path(path), data_state, tokenizer_dir)


def _full_state(model, keep: bool) -> dict | None:
    """Whole tensors of a possibly sharded model, on the host, one at a time (a collective when it holds
    DTensors: every rank takes part, only a rank that `keep`s them holds the result)."""
    out = {}
    for k, v in model.state_dict().items():
        full = v.full_tensor() if isinstance(v, DTensor) else v
        if keep:
            out[k] = full.detach().cpu()
        del full
    return out if keep else None


def _agree(step: RLStep, err: BaseException | None) -> None:
    """Raise on every rank of a group when any rank failed (none is left waiting in a collective)."""
    if step.parallel is None:
        if err is not None:
            raise err
        return
    flag = torch.tensor([int(err is not None)], device=step.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=step.parallel.group)
    if err is not None:
        raise err
    if flag.item():
        raise OSError("another rank failed to write its part of the checkpoint (see its log)")


def _save(step: RLStep, path: Path, data_state: dict | None, tokenizer_dir) -> Path:
    par = step.parallel
    writer = par is None or par.rank == 0
    ref_state = _full_state(step.ref, writer) if step.ref is not None else None  # every rank gathers shards
    # the policy: whole on this rank, or (a tensor-parallel engine's shards) gathered from the trainer's
    policy_state = None if par is None or par.holds_policy else par.full_state(step.actor.model, writer)
    err = None
    if writer:  # the HF directories
        try:
            # in the engine's dtype: the trainer's shards may be fp32 masters under a mixed-precision policy
            save_model(step.model, path, copy_tokenizer_from=tokenizer_dir, state=policy_state,
                       dtype=next(step.model.parameters()).dtype)
            if step.ref is not None:
                save_model(step.ref, path / "ref", state=ref_state)
            (path / "rollplex_step.json").write_text(json.dumps({"global_step": step.step_idx}) + "\n")
        except OSError as e:
            err = e
    del ref_state, policy_state
    _agree(step, err)
    state = {
        "actor": step.actor.state_dict(),
        "step_idx": step.step_idx,
        "rl_config": asdict(step.cfg),
        "data": data_state or {},
        "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
    }
    if par is not None:
        state["world"] = par.world
        if step.ref is not None:  # this rank's shards, restored as they are
            state["ref_shards"] = {k: _local(v).cpu() for k, v in step.ref.state_dict().items()}
    err = None
    try:
        torch.save(state, path / _rank_file(step))
    except OSError as e:
        err = e
    _agree(step, err)  # the checkpoint is whole once every rank has written
    return path


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _load_into(model, path: Path) -> dict[str, torch.Tensor]:
    """Copy the HF directory's weights into `model` (a tensor-parallel model: its shards of them);
    returns the whole tensors read."""
    full = state = hf_to_rollplex(read_safetensors(path), model.cfg)
    tp = getattr(model.model, "tensor_parallel", None)
    if tp is not None:
        from ..parallel.tp import shard_state_dict

        own_names = set(model.state_dict())
        vision = getattr(model.visual, "tensor_parallel", None) is not None
        state = shard_state_dict({k: v for k, v in state.items() if k in own_names}, model.cfg, tp.size, tp.rank,
                                 vision)
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
    return full


def load_checkpoint(step: RLStep, path: str | Path) -> dict:
    """Restore policy, reference, optimizer, scheduler, step counter and RNG; returns the data state.
    Under a process group every rank calls it; a checkpoint of another world size is refused."""
    path = Path(path)
    name = _rank_file(step)
    ok = (path / name).exists()
    if step.parallel is not None:  # every rank refuses together, or none does
        flag = torch.tensor([int(ok)], device=step.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=step.parallel.group)
        ok = bool(flag.item())
    if not ok:
        single = (path / STATE).exists()
        raise ValueError(f"{path} is not a Rollplex checkpoint for this run (no {name}"
                         + ("; it was written by one process" if single and name != STATE else "") + ")")
    # weights_only: the state is tensors and plain containers; never unpickle arbitrary objects
    state = torch.load(path / name, map_location="cpu", weights_only=True)
    with _held(step, modified=True):
        return _load(step, path, state)


def _load(step: RLStep, path: Path, state: dict) -> dict:
    par = step.parallel
    full = _load_into(step.model, path)
    if par is not None:  # the trainer's shards that are not windows of the engine's tensors read it too
        par.weights.pull(full)
    del full
    if step.ref is not None:
        if not (path / "ref").exists():
            raise ValueError(f"{path} has no reference policy but this run uses one")
        if par is None:
            _load_into(step.ref, path / "ref")
        else:
            with torch.no_grad():
                for k, v in step.ref.state_dict().items():
                    _local(v).copy_(state["ref_shards"][k])
    step.actor.load_state_dict(state["actor"])  # its masters restore the trainer's weights (shards)
    if par is not None:  # the engine's weights from the restored trainer, as after an update
        par.sync_weights()
    if step.backend is not None:
        step.backend.update_weights()
    step.step_idx = state["step_idx"]
    random.setstate(state["rng"]["python"])
    torch.set_rng_state(state["rng"]["torch"])
    return state["data"]
