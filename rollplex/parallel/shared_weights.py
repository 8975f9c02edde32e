"""The trainer's FSDP2 shards inside the rollout engine's weights: the sharing plan applied at run time.

A colocated rank holds the weights its engine decodes — the policy whole (per-rank rollout), or its
tensor-parallel shard of the policy (a TP engine over a group of ranks) — and the
trainer's FSDP2 shard of every parameter. The training layout is `weights.runtime_train_layout`: with
one TP engine over every rank, o / down are sharded by columns and the fused q/k/v and gate/up stored
in blocked order (rows grouped by TP shard; the trainer's layers read them back in order through the
forward ops its FSDP routing passes every layer call, `fsdp.set_layer_ops`, and `natural` restores the
order of anything gathered whole), so each of the engine's text shards is the rank's FSDP2 shard.
`rollplex.weights` plans training layout FSDP(W) against
rollout layout TP(N) (N = 1 for a per-rank engine) with each rank at the rollout slot its engine's
group gives it (`rollout_groups`): where the rank's training shard lies inside its rollout
tensor at a fixed offset, the trainer adopts that window as its shard's storage (`_adopt`, before the
optimizer reads the shards), so the shard costs no memory of its own and every optimizer step writes
the engine's weights in place — the engine decodes them with no copy. That is every parameter of a
per-rank engine; under TP, the parameters the engine keeps whole (vision tower, norms) and the
vocab-parallel shards (embedding, LM head) whose rows line up with FSDP's. `rebuild`, after each
optimizer step, fills everything else of the rollout tensors by the plan's copies (local block copies
first, batched P2P per bucket of parameters for what other ranks hold); at world size 1 there is
nothing to rebuild.

A share is realised only where the plan's buffer is the engine's tensor as it already is: the engine's
tensors and CUDA graphs keep their addresses. A rank whose FSDP2 chunk is padded (dim 0 not a
multiple of the world size), or a training shard that is not one window of the rollout tensor
(column-parallel fused q/k/v and gate/up against FSDP's row chunks, row-parallel o/down), keeps a
separate shard, as does every parameter when the trainer's dtype differs from the engine's.
Parameters that do not train (a frozen vision tower) are never rebuilt: nothing changes them.

The trainer is built on the meta device (`meta_copy`) and sharded there, so no transient second full
copy of the model is ever allocated; `_adopt` then gives every FSDP2 parameter its real local tensor
(the engine's window, or its chunk cut from the whole policy the step was built from) through
`FSDPParam.reset_sharded_param`, the path `load_state_dict(assign=True)` takes. Nothing here keeps a
reference to that whole policy: under a TP engine it is freed once the caller drops it.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn as nn

from ..models import ForwardOps
from ..weights import ModelPlan, ParamPlan, RolloutLayout, model_specs, plan, realised, runtime_train_layout
from ..weights.mapping import Mapping
from ..weights.storage import cut, rebuild
from .fsdp import set_layer_ops, unit_params, units
from .tp import TPPlan

BUCKET_BYTES = 256 << 20  # rollout bytes per rebuild exchange: bounds its packing buffers


def _in_order(qkv_rows: torch.Tensor, gate_up_rows: torch.Tensor):
    """A layer's fused weights read in the parameters' row order (models.ForwardOps.text_weights)."""
    def read(qkv_w, qkv_b, gate_up_w):  # one gather of each fused weight per use; its backward scatters back
        return qkv_w[qkv_rows], None if qkv_b is None else qkv_b[qkv_rows], gate_up_w[gate_up_rows]  # Qwen3: no bias

    return read


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters are on the meta device (buffers are copied)."""
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in model.parameters()}
    return copy.deepcopy(model, memo)


def column_sharded(model: nn.Module, world: int, rollout_tp: int) -> set[str]:
    """The parameters the colocated trainer shards by columns (`Shard(1)`) under the runtime layout
    (`weights.runtime_train_layout`): o / down when one tensor-parallel engine spans the `world` ranks."""
    layout = runtime_train_layout(world, rollout_tp)
    specs = model_specs(model.cfg, [(n, tuple(p.shape)) for n, p in model.named_parameters()])
    return {s.name for s in specs if layout.column_sharded(s)}


def fsdp_params(model: nn.Module) -> dict[str, object]:
    """{parameter name: its FSDPParam} of a model `fully_shard` sharded (while its parameters are the
    sharded ones)."""
    by_id = {id(fp.sharded_param): fp for u in units(model) for fp in unit_params(u)}
    return {n: by_id[id(p)] for n, p in model.named_parameters() if id(p) in by_id}


class SharedWeights:
    """This rank's trainer shards adopted into the engine's tensors, and their rebuild (module doc)."""

    def __init__(self, trainer: nn.Module, rollout: nn.Module, source: nn.Module, group: dist.ProcessGroup,
                 bucket_bytes: int = BUCKET_BYTES, share: bool = True, slot_of: tuple[int, ...] | None = None,
                 tp: TPPlan | None = None):
        """rollout: the model the engine decodes (the policy itself, or this rank's tensor-parallel copy
        of it); source: the whole policy, read once for the shards that are not windows of `rollout`;
        slot_of: every rank's rollout slot g * N + t (default: rank r is slot r, consecutive engines);
        tp: the plan `rollout` was split by (None: it is the policy whole)."""
        self.group, self.rank, self.world = group, dist.get_rank(group), dist.get_world_size(group)
        rollout_params = dict(rollout.named_parameters())
        source_params = dict(source.named_parameters())
        fps = fsdp_params(trainer)
        if set(fps) != set(rollout_params) or set(fps) != set(source_params):
            raise ValueError("the trainer's FSDP parameters are not the policy's")
        self.tp = 1 if tp is None else tp.size
        vision_tp = tp is not None and tp.vision  # the tower's blocks sharded
        trainer_dtype = next(iter(fps.values())).sharded_param.dtype
        same_dtype = all(p.dtype == trainer_dtype for p in rollout_params.values())
        specs = model_specs(source.cfg, [(n, tuple(p.shape)) for n, p in source_params.items()])
        # only the shares that are windows of the engine's tensors as they are (`realised`); whether a
        # rank realises its share is decided from the layouts alone, so every rank knows every rank's plan
        slots = tuple(range(self.world)) if slot_of is None else tuple(slot_of)
        layout = runtime_train_layout(self.world, self.tp)
        self.plan = realised(plan(specs, layout, RolloutLayout(self.tp, vision_tp),
                                  share=share and same_dtype, mapping=Mapping("engines", slots, None)))
        for spec in specs:  # the trainer was sharded with the layout's placement (`column_sharded`)
            dim = 1 if layout.column_sharded(spec) else 0
            if fps[spec.name].fsdp_placement.dim != dim:
                raise ValueError(f"{spec.name}: the trainer shards dim {fps[spec.name].fsdp_placement.dim}, the "
                                 f"runtime layout dim {dim} (shard it with `column_sharded`)")
        self.rollout: dict[str, torch.Tensor] = {}  # the engine's tensor as [rows, width] of its region
        self.train: dict[str, torch.Tensor] = {}  # the FSDP2 shard's padded storage as [rows + pad, width]
        self.shared: set[str] = set()  # names whose shard is a window of the engine's tensor here
        with torch.no_grad():
            for spec in specs:
                self._adopt(spec.name, fps[spec.name], rollout_params[spec.name], source_params[spec.name],
                            self.plan.param(spec.name, self.rank))
        # parameters stored in another row order (blocked: the engine's TP shards contiguous): each stored
        # row's parameter row, and the trainer's layers given the reads that put them back in order
        self.rows = {s.name: torch.tensor(r) for s in specs if (r := layout.storage_rows(s)) is not None}
        if self.rows:
            dev = next(iter(rollout_params.values())).device
            order = []
            for kind in ("layers.0.self_attn.qkv_proj.weight", "layers.0.mlp.gate_up_proj.weight"):
                name = next(n for n in self.rows if n.endswith(kind))
                order.append(torch.argsort(self.rows[name]).to(dev))
            set_layer_ops(trainer, ForwardOps(text_weights=_in_order(*order)))
        trainable = [s for s in specs if fps[s.name].sharded_param.requires_grad]
        self.buckets: list[ModelPlan] = []  # the plan over buckets of parameters: one exchange each
        cur, size = [], 0
        for s in trainable:
            cur.append(s)
            size += self.rollout[s.name].numel() * self.rollout[s.name].element_size()
            if size >= bucket_bytes:
                self.buckets.append(dataclasses.replace(self.plan, specs=tuple(cur)))
                cur, size = [], 0
        if cur:
            self.buckets.append(dataclasses.replace(self.plan, specs=tuple(cur)))
        self.rebuilt_bytes = sum(c.numel * self.rollout[s.name].element_size()
                                 for s in trainable for c in self.plan.param(s.name, self.rank).copies)

    def _adopt(self, name: str, fp, rollout: torch.Tensor, source: torch.Tensor, p: ParamPlan) -> None:
        t, s = p.train, p.rollout
        padded = tuple(fp.padded_sharded_param_size)
        assert padded[0] == t.rows + t.pad and math.prod(padded[1:]) == t.width, (name, padded, t)
        assert rollout.numel() == s.numel, (name, tuple(rollout.shape), s)
        rollout = rollout.detach()
        self.rollout[name] = rollout.view(s.rows, s.width)
        if p.share is not None:  # a window of the engine's tensor (the plan kept only those)
            assert rollout.is_contiguous(), name
            sh = p.share
            local = rollout.view(-1)[sh.train_offset : sh.train_offset + sh.train_numel].view(padded)
        else:
            local = cut(source.detach(), t).to(fp.sharded_param.dtype).view(padded)[: t.rows]
        param = nn.Parameter(fp.to_sharded_dtensor(local), requires_grad=fp.sharded_param.requires_grad)
        mi = fp._module_info
        for mod, attr in [(mi.module, mi.param_name), *zip(mi.shared_modules, mi.shared_param_names)]:
            mod._parameters[attr] = param
        fp.reset_sharded_param()
        data = fp._sharded_param_data
        self.train[name] = data.view(t.rows + t.pad, t.width)
        if p.share is not None:
            assert data.data_ptr() == local.data_ptr(), f"FSDP2 did not adopt the shared storage of {name}"
            self.shared.add(name)

    # ---- after each optimizer step --------------------------------------------------------------
    @torch.no_grad()
    def rebuild(self) -> None:
        """Fill the engine's elements this rank's shard does not hold, from the shards that hold them (every
        rank calls it; nothing moves at world size 1 with every share realised)."""
        for b in self.buckets:
            if any(b.param(s.name, r).copies for s in b.specs for r in range(self.world)):
                rebuild(b, self.rank, {s.name: self.train[s.name] for s in b.specs},
                        {s.name: self.rollout[s.name] for s in b.specs}, self.group)

    @torch.no_grad()
    def pull(self, full: dict[str, torch.Tensor]) -> None:
        """Copy whole tensors `full` ({name: tensor}, a loaded checkpoint) into the shards that are not
        windows of the engine's tensors; the shared ones read the engine's, loaded beside them."""
        for name, t in self.train.items():
            if name not in self.shared:
                p = self.plan.param(name, self.rank)
                t[: p.train.rows].copy_(cut(full[name].to(t.device), p.train)[: p.train.rows])

    def natural(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """A whole trainer tensor (parameter or gradient, gathered from the shards) in the parameter's own
        row order."""
        rows = self.rows.get(name)
        if rows is None:
            return whole
        out = torch.empty_like(whole)
        out[rows.to(whole.device)] = whole
        return out

    def report(self) -> dict[str, float]:
        """Bytes on this rank: trainer shards shared with the engine's tensors, kept separately, and
        rebuilt after each optimizer step."""
        def nbytes(names):
            return sum(self.train[n].numel() * self.train[n].element_size() for n in names)

        return {"shared_bytes": nbytes(self.shared), "separate_bytes": nbytes(set(self.train) - self.shared),
                "rebuilt_bytes": self.rebuilt_bytes}
