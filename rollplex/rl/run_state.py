"""Checkpoint / resume of an RL run: an HF directory for the policy (readable by transformers and
by `load_model`), the reference policy beside it, and `trainer_state.pt` with the optimizer,
LR scheduler, step counter, the adaptive KL controller's coefficient (kl_ctrl="adaptive"), data position
and RNG states. With a critic (PPO-GAE, rl/critic.py) its HF directory is `critic/` beside the policy (the
backbone in HF names and the value head as `score.*`, readable as `critic_model_path`), its optimizer
state in the trainer state's `critic` (a data-parallel critic: gathered to rank 0 for the directory,
and each rank's shards in its trainer state, restored as they are, like the reference's). Loading
copies weights *in place* so the native engine, which reads the same tensors, keeps decoding with the
restored policy; a rollout backend with its own copy of the policy (SGLang) gets the restored weights
copied in.

A data-parallel step (under a process group; every rank calls save / load together) writes the same HF
directories from rank 0 (the policy whole as a per-rank engine holds it, or gathered from the trainer's
shards under a tensor-parallel engine; the reference gathered from its shards), and
per rank `trainer_state.rank{r}-of-{W}.pt`: that rank's optimizer shards (fp32 masters and moments,
which restore the trainer's shards), its reference shards, the scheduler, step counter and its RNG
states, as verl writes one file per rank. It loads into a group of the same size and layout; loading
rebuilds the engine's weights from the trainer's restored shards (`sync_weights`).

The weights are stored once: the HF files are the source of truth. `trainer_state.pt` keeps the fp32
masters only where the HF files round them (bf16 weights); on load a master that no longer rounds to
the HF weights (the files were edited) is rebuilt from them, and the load says how many were. A load
reads and checks everything before it changes anything (`load_checkpoint`): a missing, truncated or
corrupt file, other names or shapes, values not finite in the live dtype, optimizer hyperparameters,
flags or moments, scheduler or RNG states that would poison training, files outside the folder
(run_state_checks.py) are a ValueError with the run as it was.

A save is atomic (`save_checkpoint`): the data state is checked first, the files are written into
`.NAME.partial` beside the target, synced, and renamed over it in one step, so a failed save or a
killed process leaves the checkpoint that was there whole.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..models import hf_to_rollplex, save_model
from ..models.hf_io import read_safetensors
from .atomic_dir import replace_dir, sync_tree
from .critic import HEAD, save_value_model, value_state
from .run_state_checks import (
    check_adamw,
    check_data_state,
    check_file,
    check_index,
    check_masters,
    check_rng,
    check_scheduler,
    check_weight,
    per_step_max,
)
from .step import RLStep

STATE = "trainer_state.pt"


# what a checkpoint reads or writes besides the policy: resident for the duration whatever the phase
_HELD = ("ref_weights", "optimizer", "critic_weights", "critic_optimizer")


def _held(step: RLStep, modified: bool):
    return step.memory.resident(_HELD, modified) if step.memory is not None else contextlib.nullcontext()


def _rank_file(step: RLStep) -> str:
    """This process's trainer-state file: STATE on one process, one file per rank of a group."""
    par = step.parallel
    return STATE if par is None else f"trainer_state.rank{par.rank}-of-{par.world}.pt"


def save_checkpoint(step: RLStep, path: str | Path, data_state: dict | None = None,
                    tokenizer_dir: str | Path | None = None) -> Path:
    """Write the checkpoint (every rank of a data-parallel step calls this with the same path), atomically:
    `data_state` is checked first (ValueError, nothing written), the files go into a temporary folder
    beside `path`, are synced, and then replace `path` in one rename; until then a checkpoint already at
    `path` is untouched, whatever fails (a full disk, a killed process)."""
    check_data_state(data_state or {})
    path = Path(path)
    with _held(step, modified=False):
        par = step.parallel
        lead = par is None or par.rank == 0
        tmp = path.parent / f".{path.name}.partial"  # the same file system as `path`: a rename, not a copy
        err = None
        if lead:
            try:
                if path.is_symlink() or (path.exists() and not path.is_dir()):
                    raise NotADirectoryError(f"{path} exists and is not a folder")
                path.parent.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed part-way
                tmp.mkdir()
            except OSError as e:
                err = e
        _agree(step, err)
        try:
            _save(step, tmp, data_state, tokenizer_dir)
            err = None
            if lead:
                try:
                    sync_tree(tmp)
                    replace_dir(tmp, path)
                except OSError as e:
                    err = e
            _agree(step, err)
        except BaseException:
            if lead:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        return path


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
    critic_state = None
    if step.critic is not None and par is not None:  # every rank gathers the critic's shards
        full = _full_state(step.critic.model, writer)
        critic_state = {k.removeprefix("backbone."): v for k, v in full.items()} if full is not None else None
    err = None
    if writer:  # the HF directories
        try:
            # in the engine's dtype: the trainer's shards may be fp32 masters under a mixed-precision policy
            save_model(step.model, path, copy_tokenizer_from=tokenizer_dir, state=policy_state,
                       dtype=next(step.model.parameters()).dtype)
            if step.ref is not None:
                save_model(step.ref, path / "ref", state=ref_state)
            if step.critic is not None:
                save_value_model(step.critic.model, path / "critic", state=critic_state)
            (path / "rollplex_step.json").write_text(json.dumps({"global_step": step.step_idx}) + "\n")
        except OSError as e:
            err = e
    del ref_state, policy_state, critic_state
    _agree(step, err)
    # the HF files hold the weights: fp32 masters are stored again only where those files round them (bf16)
    masters = next(step.model.parameters()).dtype != torch.float32
    state = {
        "actor": step.actor.state_dict(masters=masters),
        "step_idx": step.step_idx,
        "rl_config": asdict(step.cfg),
        "data": data_state or {},
        "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
    }
    if step.kl_ctrl is not None:
        state["kl_ctrl_value"] = step.kl_ctrl.value
    if step.critic is not None:
        state["critic"] = step.critic.state_dict(masters=masters)
    if par is not None:
        state["world"] = par.world
        if step.ref is not None:  # this rank's shards, restored as they are
            state["ref_shards"] = {k: _local(v).cpu() for k, v in step.ref.state_dict().items()}
        if step.critic is not None:  # the critic's too
            state["critic_shards"] = {k: _local(v).cpu() for k, v in value_state(step.critic.model).items()}
    err = None
    try:
        torch.save(state, path / _rank_file(step))
    except OSError as e:
        err = e
    _agree(step, err)  # the checkpoint is whole once every rank has written
    return path


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _read_model(model, path: Path, what: str, tp=None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the tensors to copy into `model` — a tensor-parallel model, split by the plan `tp`
    (rollplex.parallel.TPPlan): its shards —, the whole tensors read) from the HF directory `path`, checked
    against `model`: every name present and none unknown, the same shapes, floating point, finite.
    ValueError otherwise (unreadable or truncated files included)."""
    check_index(path)  # every file it reads is a regular file inside `path`
    try:
        hf = read_safetensors(path)
        full = state = hf_to_rollplex(hf, model.cfg)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a truncated or corrupt file: the checkpoint's fault, not the server's
        raise ValueError(f"{what} in {path} is not readable ({type(e).__name__}: {e})") from None
    own = model.state_dict()
    live = {k: v.dtype for k, v in own.items()}
    if tp is not None:
        missing = set(own) - set(state)
        if missing:
            raise ValueError(f"{what} in {path} lacks {sorted(missing)[:3]}")
        state = tp.shard({k: v for k, v in state.items() if k in own}, model.cfg)
    missing, unknown = set(own) - set(state), set(state) - set(own)
    if missing or unknown:
        raise ValueError(f"{what} in {path} does not match this model: "
                         + (f"lacks {sorted(missing)[:3]}" if missing else f"has unknown {sorted(unknown)[:3]}"))
    wrong = [k for k, v in own.items() if state[k].shape != v.shape]
    if wrong:
        raise ValueError(f"{what} in {path} has other shapes for {wrong[:3]}")
    for k, t in full.items():
        if not t.is_floating_point():
            raise ValueError(f"{what} in {path}: {k} is {t.dtype}, not floating point")
        check_weight(t, live.get(k, t.dtype), f"{what} in {path}: {k}")  # finite once cast to the live dtype
    return state, full


def _copy_into(model, state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(state[k])


def load_checkpoint(step: RLStep, path: str | Path, report: dict | None = None) -> dict:
    """Restore policy, reference, optimizer, scheduler, step counter and RNG; returns the data state.
    Everything is read and checked first (files present and readable, names, shapes, dtypes, finite
    values, the trainer state's structure): a checkpoint that fails raises ValueError with nothing
    changed. Then it is copied in: the policy from its HF files (the source of truth; a saved fp32
    master that no longer rounds to them — the files were edited — is rebuilt from them, and `report`,
    when given, gets `masters_rebuilt`). Under a process group every rank calls it and they refuse
    together; a checkpoint of another world size is refused."""
    path = Path(path)
    name = _rank_file(step)
    ok = (path / name).exists() or (path / name).is_symlink()
    if step.parallel is not None:  # every rank refuses together, or none does
        flag = torch.tensor([int(ok)], device=step.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=step.parallel.group)
        ok = bool(flag.item())
    if not ok:
        single = (path / STATE).exists()
        raise ValueError(f"{path} is not a Rollplex checkpoint for this run (no {name}"
                         + ("; it was written by one process" if single and name != STATE else "") + ")")
    err, read = None, None
    try:  # shapes only from the live state: its regions may stay offloaded meanwhile
        read = _read(step, path, name)
    except ValueError as e:
        err = e
    _agree_valid(step, err)
    with _held(step, modified=True):
        return _load(step, read, report)


def _agree_valid(step: RLStep, err: ValueError | None) -> None:
    """Raise ValueError on every rank of a group when any rank found its part of the checkpoint invalid."""
    if step.parallel is not None:
        flag = torch.tensor([int(err is not None)], device=step.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=step.parallel.group)
        if flag.item() and err is None:
            err = ValueError("another rank found its part of the checkpoint invalid (see its log)")
    if err is not None:
        raise err


def _read(step: RLStep, path: Path, name: str) -> dict:
    """Everything a load copies in, read and checked; no live state is touched."""
    par = step.parallel
    try:
        check_file(path / name)  # a symlink or a FIFO is not read
        # weights_only: the state is tensors and plain containers; never unpickle arbitrary objects
        state = torch.load(path / name, map_location="cpu", weights_only=True)
    except ValueError as e:
        raise ValueError(f"{path / name} is not a readable trainer state ({e})") from None
    except Exception as e:  # noqa: BLE001 - truncated, garbage or not weights-only: the checkpoint's fault
        raise ValueError(f"{path / name} is not a readable trainer state ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not {"actor", "step_idx", "rng"} <= set(state):
        raise ValueError(f"{path / name} is not a Rollplex trainer state (it needs actor, step_idx, rng)")
    if not isinstance(state["step_idx"], int) or isinstance(state["step_idx"], bool) \
            or not 0 <= state["step_idx"] < 1 << 62:
        raise ValueError(f"{path / name}: step_idx is not a step count")
    if not isinstance(state.get("data", {}), dict):
        raise ValueError(f"{path / name}: the data state is not a dict")
    kl = state.get("kl_ctrl_value", 0.0)  # absent: a run saved with a fixed KL coefficient keeps its kl_coef
    if not (isinstance(kl, float) and math.isfinite(kl) and kl >= 0):
        raise ValueError(f"{path / name}: the adaptive KL coefficient is not a finite number >= 0")
    try:
        check_data_state(state.get("data") or {})
        step.actor.check_state_dict(state["actor"])
        _check_optimizer(step.actor, state["actor"], max(per_step_max("lr"), step.cfg.lr), "the optimizer")
        check_scheduler(state["actor"]["scheduler"], step.actor.scheduler.state_dict(),
                        max(per_step_max("lr"), step.cfg.lr))
        check_rng(state["rng"])  # on throwaway generators: checks the state, changes nothing
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{path / name}: {e}") from None
    # the policy: what the engine decodes, under a tensor-parallel engine this rank's shard (its plan)
    policy, full = _read_model(step.model, path, "the policy", None if par is None else par.tp)
    out = {"state": state, "policy": policy, "full": full, "ref": None, "critic": None,
           "weights_dtype": next(iter(full.values())).dtype}
    if step.critic is not None:
        out["critic"] = _read_critic(step, path, name, state)
    if step.ref is not None:
        if not (path / "ref").is_dir():
            raise ValueError(f"{path} has no reference policy (ref/) but this run uses one")
        if par is None:
            out["ref"] = _read_model(step.ref, path / "ref", "the reference policy")[0]
        else:  # this rank's shards, restored as they are
            shards, own = state.get("ref_shards"), step.ref.state_dict()
            if not isinstance(shards, dict) or set(shards) != set(own):
                raise ValueError(f"{path / name} holds no reference shards for this run")
            for k, v in own.items():
                t = shards[k]
                if not (isinstance(t, torch.Tensor) and t.shape == _local(v).shape and t.is_floating_point()):
                    raise ValueError(f"{path / name}: the reference shard {k} is not this run's (shape, dtype)")
                check_weight(t, v.dtype, f"{path / name}: the reference shard {k}")
    return out


def _read_critic(step: RLStep, path: Path, name: str, state: dict) -> dict[str, torch.Tensor]:
    """The critic's tensors by `value_state`'s names from `critic/`, checked like the policy's; its optimizer
    state checked against the live critic's."""
    if not (path / "critic").is_dir() or "critic" not in state:
        raise ValueError(f"{path} has no critic (critic/ and its trainer state) but this run trains one")
    try:
        step.critic.check_state_dict(state["critic"])
        _check_optimizer(step.critic, state["critic"], max(per_step_max("critic_lr"), step.cfg.critic_lr),
                         "the critic's optimizer")
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{path / name}: {e}") from None
    own = value_state(step.critic.model)
    try:
        check_index(path / "critic")
    except ValueError as e:
        raise ValueError(f"the critic in {path / 'critic'}: {e}") from None
    try:
        hf = read_safetensors(path / "critic")
        got = {**hf_to_rollplex({k: v for k, v in hf.items() if k not in HEAD}, step.critic.model.cfg),
               **{k: hf[k] for k in HEAD if k in hf}}
    except Exception as e:  # noqa: BLE001 - a truncated or corrupt file: the checkpoint's fault
        raise ValueError(f"the critic in {path / 'critic'} is not readable ({type(e).__name__}: {e})") from None
    got.pop("lm_head.weight", None)
    if set(got) != set(own) or any(got[k].shape != v.shape for k, v in own.items()):
        raise ValueError(f"the critic in {path / 'critic'} does not match this run's (names or shapes)")
    for k, t in got.items():  # finite once cast to the live dtype
        check_weight(t, own[k].dtype, f"the critic in {path / 'critic'}: {k}")
    if step.parallel is not None:  # a sharded critic restores this rank's shards as they are
        shards = state.get("critic_shards")
        if not isinstance(shards, dict) or set(shards) != set(own) or not all(
                isinstance(shards[k], torch.Tensor) and shards[k].shape == _local(v).shape for k, v in own.items()):
            raise ValueError(f"{path / name} holds no critic shards for this run (names, shapes)")
        for k, v in own.items():
            check_weight(shards[k], v.dtype, f"{path / name}: the critic shard {k}")
        return shards
    return got


def _check_optimizer(trainer, sd: dict, lr_max: float, what: str) -> None:
    """The saved optimizer state of an actor or critic (`sd["optimizer"]`: MasterAdamW's) against the
    trainer's live optimizer: AdamW's hyperparameters, flags and moments, and the fp32 masters."""
    opt = trainer.optimizer
    masters = opt.master
    check_adamw(sd["optimizer"]["opt"], opt.opt.state_dict(), [m.shape for m in masters], lr_max,
                masters[0].dtype, what)
    check_masters(sd["optimizer"].get("master"), masters)


def _load(step: RLStep, read: dict, report: dict | None) -> dict:
    par, state = step.parallel, read["state"]
    _copy_into(step.model, read["policy"])
    if step.critic is not None:
        with torch.no_grad():  # (a data-parallel rank's: its shards)
            for k, v in value_state(step.critic.model).items():
                _local(v).copy_(read["critic"][k])
        step.critic.load_state_dict(state["critic"], read["weights_dtype"])
    if par is not None:  # the trainer's shards that are not windows of the engine's tensors read it too
        par.weights.pull(read["full"])
    if step.ref is not None:
        if par is None:
            _copy_into(step.ref, read["ref"])
        else:
            with torch.no_grad():
                for k, v in step.ref.state_dict().items():
                    _local(v).copy_(state["ref_shards"][k])
    # the trainer holds the HF weights now: masters that still round to them restore their fp32 values
    rebuilt = step.actor.load_state_dict(state["actor"], read["weights_dtype"])
    if par is not None:  # the engine's weights from the restored trainer, as after an update
        par.sync_weights()
        total = torch.tensor([rebuilt], device=step.device)
        dist.all_reduce(total, group=par.group)
        rebuilt = int(total.item())
    if step.backend is not None:
        step.backend.update_weights()
    step.step_idx = state["step_idx"]
    if step.kl_ctrl is not None and "kl_ctrl_value" in state:
        step.kl_ctrl.value = state["kl_ctrl_value"]
    random.setstate(state["rng"]["python"])
    torch.set_rng_state(state["rng"]["torch"])
    if report is not None:
        report["masters_rebuilt"] = rebuilt
    return state.get("data") or {}
