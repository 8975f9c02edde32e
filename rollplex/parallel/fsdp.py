"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for Rollplex's Qwen2.5-VL, applied from outside the model.

Units, as torchtitan cuts a transformer: every decoder layer, every vision block, and the root (token
embeddings, patch embed, merger, final norm, LM head). Each unit's parameters become DTensor shards
over the data-parallel mesh; a unit is all-gathered just before it computes and freed after
(`reshard_after_forward`), its gradient reduce-scattered in backward.

The model's layer math does not run in the layer modules' `forward`: `TextDecoder.layer(i, ...)` and
`VisionTower.block(blk, ...)` read the parameters of layer i / block blk directly (one compiled
function serves every layer). FSDP2 gathers a unit around a *call of its module*, so the plan routes
each layer through one: the layer module gets a `forward` that runs the decoder's own layer function
(or whatever sits in the decoder's `layer` slot when the plan is applied: an activation-checkpointing
wrapper composes, as in torchtitan where checkpointing is applied before FSDP), and the decoder's
`layer` slot — an instance attribute, the hook `rl.activation_checkpointing` uses too — dispatches to that module
call. The vision tower's `block` slot likewise. Every routed layer call runs with the forward ops
the sharding's owner set (`set_layer_ops`; models.ForwardOps), e.g. the reads of fused projections
a trainer stores in a tensor-parallel engine's row order (shared_weights.py). The root has no single
forward either (training calls `group_hidden`, then the LM head): it gets `run_sharded(fn, *args)`,
registered as an FSDP forward method, that runs `fn` with the root's parameters gathered; the logprob
pass of a micro-batch runs inside it (`sharded_call`).

Gradients are *summed* over ranks, not averaged (`set_gradient_divide_factor(1)`): the data-parallel
trainer divides each rank's loss by the whole mini-batch's normaliser, so the sum is the
single-process gradient (data_parallel.py).

Activation checkpointing composes the same way: the plan registers its routing with
`rl.activation_checkpointing.route_layers`, so turning checkpointing on or off puts the plain or the
checkpointed layer function back into the slot and routes the modules through it again (the update's
OOM ladder turns it on after sharding).

Every rank must call the units in the same order and the same number of times per backward (FSDP's
collectives pair up by order): the caller keeps the micro-batch structure equal across ranks.
`full_state_dict` gathers the full tensors (names are unchanged: FSDP2 adds no wrapper modules).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Shard

from ..models import ForwardOps, Qwen25VL
from ..rl.activation_checkpointing import route_layers, set_activation_checkpointing

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROOT_METHOD = "run_sharded"


@dataclass(frozen=True)
class FSDPConfig:
    # free each layer's gathered parameters after its forward (gathered again for backward): ZeRO-3.
    # False keeps them until backward (ZeRO-2: less communication, more memory)
    reshard_after_forward: bool = True
    # mixed precision: the layers compute in param_dtype from fp32 shards (the shards are the fp32
    # masters) and reduce gradients in reduce_dtype; None: the parameters' own dtype
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    # per-layer activation checkpointing of the decoder / the vision tower, inside each FSDP unit
    activation_checkpointing: bool = False
    vision_activation_checkpointing: bool = False
    # a colocated trainer's shards are windows of the policy's own tensors where the sharing plan
    # allows (parallel/shared_weights.py); False keeps separate shards, copied into the policy after
    # each update
    share_policy_storage: bool = True
    # False: every rank holds the whole frozen reference (no FSDP): its scoring needs no collective
    # inside a pass, so each rank co-schedules its share's reference prefixes beside its decode, as it
    # does the old policy's; the cost is a whole copy of the reference per rank
    shard_reference: bool = True
    # consecutive decoder layers (and vision blocks) per FSDP unit: one gather and one reduce per unit
    # and pass. FSDP2's hooks cost host time per unit, pass and direction; more layers per unit
    # means fewer, larger collectives and more gathered parameters resident at once
    layers_per_unit: int = 1
    # False: every unit is gathered before a mini-batch's first pass and stays gathered, its passes
    # accumulate unsharded gradients, and they are reduce-scattered after its last (DDP's no_sync;
    # `reduce_gathered`): one gather and one reduce per unit and mini-batch instead of
    # per pass, and passes that run no collective, at the cost of an unsharded copy of the parameters
    # and of their gradients while the mini-batch runs. None:
    # False for a mini-batch when that copy and its largest pass fit every rank's free device memory
    # (the ranks agree before its first pass), True otherwise
    reduce_every_pass: bool | None = None

    def __post_init__(self):
        if self.layers_per_unit < 1:
            raise ValueError(f"layers_per_unit must be >= 1, got {self.layers_per_unit}")
        for name in ("param_dtype", "reduce_dtype"):
            v = getattr(self, name)
            if v is not None and v not in DTYPES:
                raise ValueError(f"{name} must be one of {sorted(DTYPES)} or None, got {v!r}")

    def mp_policy(self) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(param_dtype=DTYPES.get(self.param_dtype),
                                    reduce_dtype=DTYPES.get(self.reduce_dtype))


def _route_through_modules(model: Qwen25VL) -> None:
    """Give every decoder layer and vision block a `forward` running its math, and make the decoder's
    `layer` / the tower's `block` slot call those modules. Everything is bound to its instance (bound
    methods, partials of them, flags shared through the instances' own attributes), so a deep copy of
    the model routes through the copy's modules: a closure would keep calling the original's layers."""
    text, vis = model.model, model.visual
    layer_fn, block_fn = text.layer, vis.block  # bound methods, or checkpointing wrappers
    for i, lyr in enumerate(text.layers):
        lyr.forward = functools.partial(layer_fn, i)
    for blk in vis.blocks:
        blk.forward = functools.partial(block_fn, blk)
    # set: the module's own forward, past FSDP2's hooks (`direct_call`); the ops every layer call runs
    # with (`set_layer_ops`). The slots read them from their own instance: one list object each, shared
    # with the model's, which a deep copy keeps shared among the copies
    vars(text)["_fsdp_direct"] = vars(vis)["_fsdp_direct"] = _direct_flag(model)
    vars(text)["_fsdp_layer_ops"] = _layer_ops(model)
    text.layer = types.MethodType(_routed_layer, text)
    vis.block = types.MethodType(_routed_block, vis)


def _routed_layer(text, i, x, delta, cos, sin, attend, ops=None):
    ops = _merged(ops, vars(text)["_fsdp_layer_ops"][0])
    lyr = text.layers[i]
    return (lyr.forward if vars(text)["_fsdp_direct"][0] else lyr)(x, delta, cos, sin, attend, ops)


def _routed_block(vis, blk, *args):
    return (blk.forward if vars(vis)["_fsdp_direct"][0] else blk)(*args)


def _direct_flag(model: nn.Module) -> list[bool]:
    """The model's one-element switch between module calls (FSDP2's hooks) and direct forwards."""
    return vars(model).setdefault("_fsdp_direct", [False])


def _layer_ops(model: nn.Module) -> list[ForwardOps | None]:
    return vars(model).setdefault("_fsdp_layer_ops", [None])


def _merged(ops: ForwardOps | None, routed: ForwardOps | None) -> ForwardOps | None:
    """The caller's ops with the routed ones filling the steps it leaves to the model."""
    if ops is None or routed is None:
        return routed if ops is None else ops
    return dataclasses.replace(routed, **{f.name: v for f in dataclasses.fields(ops)
                                          if (v := getattr(ops, f.name)) is not None})


def set_layer_ops(model: nn.Module, ops: ForwardOps | None) -> None:
    """Run every decoder layer call of a model `apply_fsdp` sharded with `ops` (models.ForwardOps; the steps
    a caller's own ops leave to the model): how the sharding's owner has the layers read what it stores,
    e.g. fused projections stored in another row order (shared_weights.py). Kept across changes of checkpointing;
    the model object's class and methods are untouched."""
    _layer_ops(model)[0] = ops


def layer_ops(model: nn.Module) -> ForwardOps | None:
    """The ops `set_layer_ops` gave the layers of `model` (None: the model's own steps)."""
    return _layer_ops(model)[0]


def apply_fsdp(model: Qwen25VL, mesh: DeviceMesh, cfg: FSDPConfig | None = None,
               column_sharded: Collection[str] = ()) -> Qwen25VL:
    """Shard `model` in place over the 1-D data-parallel `mesh` (every rank calls this with the same
    full weights). Returns the model, now an FSDPModule whose parameters are DTensor shards: `Shard(0)`
    (row chunks), or `Shard(1)` (column windows, evenly split) for the parameters named in
    `column_sharded` — the layout in which a tensor-parallel engine's row-parallel shards are a rank's
    FSDP shards (parallel/shared_weights.py)."""
    cfg = cfg or FSDPConfig()
    if mesh.ndim != 1:
        raise ValueError(f"FSDP needs a 1-D data-parallel mesh, got {mesh.ndim} dims")
    if isinstance(model, FSDPModule):
        raise ValueError("the model is already sharded")
    set_activation_checkpointing(model, cfg.activation_checkpointing, cfg.vision_activation_checkpointing)
    route_layers(model, _route_through_modules)
    kw = dict(mesh=mesh, mp_policy=cfg.mp_policy())
    by_columns = {id(p) for n, p in model.named_parameters() if n in set(column_sharded)}
    if by_columns:
        kw["shard_placement_fn"] = lambda p: Shard(1) if id(p) in by_columns else None
    k = cfg.layers_per_unit
    for mods in (list(model.visual.blocks), list(model.model.layers)):
        for i in range(0, len(mods), k):
            unit = mods[i:i + k]
            fully_shard(unit if len(unit) > 1 else unit[0], reshard_after_forward=cfg.reshard_after_forward, **kw)
    # the root's parameters (embeddings, LM head) are needed again at once in backward: kept gathered
    setattr(model, ROOT_METHOD, lambda fn, *args: _owned(fn(*args)))
    fully_shard(model, reshard_after_forward=False, **kw)
    register_fsdp_forward_method(model, ROOT_METHOD)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            # (set_reduce_scatter_divide_factor: its name in older torch)
            (getattr(m, "set_gradient_divide_factor", None) or m.set_reduce_scatter_divide_factor)(1.0)
            if hasattr(m, "set_force_sum_reduction_for_comms"):  # a plain SUM: gloo has no PREMUL_SUM
                m.set_force_sum_reduction_for_comms(True)
    return model


def units(model: nn.Module) -> list[FSDPModule]:
    """The FSDP units of a model `apply_fsdp` sharded, the root last (each once: a unit of several
    layers is one FSDP state shared by its modules)."""
    seen, out = set(), []
    for m in model.modules():
        if isinstance(m, FSDPModule) and m is not model and id(m._get_fsdp_state()) not in seen:
            seen.add(id(m._get_fsdp_state()))
            out.append(m)
    return out + [model] if isinstance(model, FSDPModule) else out


def set_accumulating(model: nn.Module, on: bool, cfg: FSDPConfig) -> None:
    """Passes that follow keep the units gathered and their gradients unsharded (on) or reduce them
    after backward and reshard as `cfg` says (off)."""
    model.set_requires_gradient_sync(not on)
    model.set_reshard_after_backward(not on)
    for u in units(model)[:-1]:  # (the root stays gathered through a pass either way)
        if hasattr(u, "set_reshard_after_forward"):
            u.set_reshard_after_forward(cfg.reshard_after_forward and not on, recurse=False)


def gather_all(model: nn.Module) -> None:
    """All-gather every unit now, in one order on every rank (a unit already gathered is skipped)."""
    state = model._get_fsdp_state()
    if hasattr(state, "_lazy_init"):  # the root's streams, before any forward has set them up
        state._lazy_init()
    for u in units(model):
        u.unshard()


def keep_gathered(model: nn.Module, on: bool, cfg: FSDPConfig) -> None:
    """No-grad passes that follow keep every unit gathered after its forward (on), or reshard as `cfg`
    says, the units freed now (off: after a scoring call's last pass)."""
    for u in units(model)[:-1]:
        if hasattr(u, "set_reshard_after_forward"):
            u.set_reshard_after_forward(cfg.reshard_after_forward and not on, recurse=False)
    if not on:
        for u in units(model):
            u.reshard()


def _param_groups(unit: FSDPModule) -> list:
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # older torch: one group per state
        groups = [g for g in [state._fsdp_param_group] if g is not None]
    return groups


def unit_params(unit: FSDPModule) -> list:
    """The FSDPParams (FSDP2's per-parameter state) of one unit."""
    return [fp for g in _param_groups(unit) for fp in g.fsdp_params]


def drop_unsharded_grads(model: nn.Module) -> None:
    """Forget gradients accumulated unsharded by passes whose mini-batch never reached its reduce (an
    out-of-memory error in between), and free the gathered parameters. A pass that raised leaves its
    units in FSDP2's forward state, where a unit kept gathered after forward will not reshard: they are
    set idle first, so every rank's units end sharded and the next gathers pair up across ranks."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    ctx = getattr(model._get_fsdp_state(), "_state_ctx", None)
    if ctx is not None and hasattr(ctx, "iter_forward_root"):
        ctx.iter_forward_root = None
    for u in units(model):
        u._get_fsdp_state()._training_state = TrainingState.IDLE
        for g in _param_groups(u):
            g._training_state = TrainingState.IDLE
        for fp in unit_params(u):
            fp.unsharded_accumulated_grad = None
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None
        u.reshard()


def gathered_grads(model: nn.Module) -> list[torch.Tensor | None]:
    """The gradients passes past the hooks accumulated into the gathered parameters, one entry per
    parameter of every unit (units in order, the root last; None: no pass touched it here)."""
    return [fp._unsharded_param.grad for u in units(model) for fp in unit_params(u)]


def reduce_gathered(model: nn.Module, present: list[bool], group) -> None:
    """Reduce-scatter what `gathered_grads` holds into the sharded parameters' gradients (summed over the
    ranks; a sharded gradient already there is added to) and free it: one collective per unit and dtype
    instead of a pass through FSDP2's hooks. `present[i]`: whether some rank has gradient i (every rank
    passes the same list, agreed beforehand); where this rank has none, it sends zeros. The shards are
    FSDP2's (`Shard(0)`, chunks of ceil(rows / world) rows, laid out as its own reduce-scatter lays them,
    `torch._chunk_cat`; or `Shard(1)`, even column windows). One rank: the sum over one rank is the
    gradient itself, kept as the shard."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    i = 0
    for u in units(model):
        todo: dict[torch.dtype, list] = {}
        for fp in unit_params(u):
            if present[i]:
                full = fp._unsharded_param
                g = full.grad if full.grad is not None else torch.zeros_like(full)
                todo.setdefault(g.dtype, []).append((fp, g))
            i += 1
        for dtype in sorted(todo, key=str):  # the same collectives in the same order on every rank
            # row chunks first, then column windows (`Shard(1)`, even): each rank's part of both, in order
            pairs = sorted(todo[dtype], key=lambda x: x[0].fsdp_placement.dim)
            if world == 1:
                locals_ = [g for _, g in pairs]
            else:
                rows_ = [g for fp, g in pairs if fp.fsdp_placement.dim == 0]
                cols_ = [g.view(g.shape[0], world, -1).transpose(0, 1).reshape(world, -1)
                         for fp, g in pairs if fp.fsdp_placement.dim == 1]
                parts = ([torch._chunk_cat(rows_, 0, world)] if rows_ else []) + cols_  # [world, chunks]
                inp = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
                out = torch.empty(inp.shape[1], dtype=dtype, device=inp.device)
                dist.reduce_scatter_tensor(out, inp.reshape(-1), group=group)
                locals_, off = [], 0
                for fp, g in pairs:
                    if fp.fsdp_placement.dim == 1:
                        n = g.numel() // world
                        locals_.append(out[off : off + n].view(g.shape[0], -1))
                    else:
                        rows = g.shape[0]
                        chunk = -(-rows // world)
                        n = chunk * (g.numel() // rows if rows else 0)
                        mine = max(0, min(chunk, rows - rank * chunk))
                        locals_.append(out[off : off + n].view(chunk, *g.shape[1:])[:mine])
                    off += n
            for (fp, _), local in zip(pairs, locals_):
                sp = fp.sharded_param
                grad = DTensor.from_local(local, sp.device_mesh, sp.placements, run_check=False, shape=sp.shape,
                                          stride=sp.stride())
                if sp.grad is None:
                    sp.grad = grad
                else:
                    sp.grad += grad
                # what autograd (and FSDP2's own reduce) runs once a parameter's gradient is accumulated: the
                # optimizer learns which parameters a mini-batch touched from these
                for hook in (getattr(sp, "_post_accumulate_grad_hooks", None) or {}).values():
                    hook(sp)
                fp._unsharded_param.grad = None
    assert i == len(present), "one presence flag per parameter of the units"


def _owned(out):
    """Views among a root pass's outputs copied out: FSDP hooks its backward on the outputs, and a
    hook on a view is lost to an in-place op on it."""
    if isinstance(out, tuple):
        return tuple(_owned(t) for t in out)
    return out.clone() if isinstance(out, torch.Tensor) and out._base is not None else out


def sharded_call(model: nn.Module, fn, *args):
    """fn(*args) with the root's parameters gathered (its FSDP forward): a pass over the model."""
    if isinstance(model, FSDPModule):
        return getattr(model, ROOT_METHOD)(fn, *args)
    return fn(*args)


def can_call_directly(cfg: FSDPConfig) -> bool:
    """Whether passes over gathered units may skip FSDP2's hooks (`direct_call`): not under a mixed
    precision policy, whose hooks cast the inputs and keep the gradients in the reduce dtype."""
    return cfg.param_dtype is None and cfg.reduce_dtype is None


def direct_call(model: nn.Module, fn, *args):
    """fn(*args) on the gathered parameters, past FSDP2's hooks: every unit must be gathered (`gather_all`)
    and stay so until the passes end. The same math on the same tensors as through the hooks; their host
    time per unit and pass (pre/post-forward, the autograd functions they insert, pre/post-backward) is
    what keeps the device waiting at one rank. Autograd accumulates into the unsharded parameters'
    `.grad`, which a later pass through the hooks with gradient sync on reduce-scatters (or scoring
    needs none)."""
    flag = _direct_flag(model)
    flag[0] = True
    try:
        return fn(*args)
    finally:
        flag[0] = False


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (a collective over its mesh); plain tensors as they are."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """{name: full parameter} on every rank (one all-gather per parameter): what a checkpoint, a weight
    broadcast to rollout ranks or a comparison with a single-process model reads."""
    with torch.no_grad():
        return {n: full_tensor(p.detach()) for n, p in model.named_parameters()}
