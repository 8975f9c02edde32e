"""Activation (gradient) checkpointing for the actor, applied from outside the model.

Each decoder layer (`TextDecoder.layer`) and vision block (`VisionTower.block`) becomes a
non-reentrant `torch.utils.checkpoint` region: backward keeps only the layer inputs and recomputes
the rest, trading about one extra forward for activations that no longer grow with the layer count.
The wrappers sit on the instances, so the model's code and the engine's decode path are untouched;
with autograd off (scoring, decode) the original method runs directly. Same values and gradients as
without checkpointing (held by the tests).
"""

from __future__ import annotations

import types

import torch
from torch.utils.checkpoint import checkpoint

from ..models import Qwen25VL


def _checkpointed(name: str):
    """`obj.name` as a checkpoint region, as a function of the instance it is bound to. Bound with
    `types.MethodType`, a deep copy of the instance (a reference or critic copied from the policy) binds
    the wrapper to the copy: a closure over the original's bound method would run the original's layers,
    weights and gradients from the copy."""
    def run(self, *args):
        orig = getattr(type(self), name).__get__(self)
        if not torch.is_grad_enabled():
            return orig(*args)
        return checkpoint(orig, *args, use_reentrant=False)

    return run


def _wrap(obj, name: str) -> None:
    if name in vars(obj):  # already wrapped
        return
    setattr(obj, name, types.MethodType(_checkpointed(name), obj))


def _unwrap(obj, name: str) -> None:
    vars(obj).pop(name, None)


_FLAGS = "_activation_checkpointing"  # vars(model): (decoder, vision) as last set
_ROUTE = "_layer_route"  # vars(model): how a wrapper routes the layer slots through its modules


def set_activation_checkpointing(model: Qwen25VL, decoder: bool, vision: bool) -> None:
    """Turn per-layer checkpointing of the decoder and/or the vision tower on or off. On a model whose
    layer calls a wrapper routes (`route_layers`: FSDP2's units), the slots get the plain methods back,
    are (un)wrapped, then routed again: the wrapper's units and hooks are untouched."""
    route = vars(model).get(_ROUTE)
    if route is not None:
        vars(model.model).pop("layer", None)
        vars(model.visual).pop("block", None)
    for on, obj, name in ((decoder, model.model, "layer"), (vision, model.visual, "block")):
        (_wrap if on else _unwrap)(obj, name)
    vars(model)[_FLAGS] = (bool(decoder), bool(vision))
    if route is not None:
        route(model)


def route_layers(model: Qwen25VL, route) -> None:
    """Route the model's layer slots with `route(model)`, now and after every change of checkpointing (a
    wrapper whose units must see each layer call: FSDP2)."""
    vars(model)[_ROUTE] = route
    route(model)


def activation_checkpointing(model: Qwen25VL) -> tuple[bool, bool]:
    """Whether the decoder layers / vision blocks run checkpointed."""
    return vars(model).get(_FLAGS, (False, False))
