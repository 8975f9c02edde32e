"""The tables of docs/WEIGHT_SHARING.md: one plan per (model, training layout, rollout TP), with the
parameters stored as-is and in blocked order (`TrainLayout.block` = the rollout TP degree)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from .layout import ParamSpec, RolloutLayout, TrainLayout, runtime_train_layout
from .planner import engine_mapping, plan, realised
from .report import Links, Summary

DEFAULT_TRAIN = ("fsdp8", "fsdp16", "fsdp32", "fsdp4xrep8", "tp2", "tp4", "tp8", "tp2xfsdp16", "tp4xfsdp8", "tp8xfsdp4")


def parse_train(text: str, vision_tp: bool = False) -> TrainLayout:
    """'fsdp32', 'tp4xfsdp8', 'fsdp8xrep4' -> TrainLayout (degrees not named are 1)."""
    deg: dict[str, int] = {}
    for tok in text.lower().split("x"):
        m = re.fullmatch(r"(tp|fsdp|rep)(\d+)", tok)
        if not m or m.group(1) in deg:
            raise ValueError(f"bad training layout {text!r}: use tokens tpN, fsdpN, repN joined by 'x'")
        deg[m.group(1)] = int(m.group(2))
    return TrainLayout(tp=deg.get("tp", 1), fsdp=deg.get("fsdp", 1), rep=deg.get("rep", 1), vision_tp=vision_tp)


@dataclass(frozen=True)
class Cell:
    model: str
    train: TrainLayout
    rollout_tp: int
    asis: Summary | None = None
    blocked: Summary | None = None  # None: blocked order changes nothing here
    error: str | None = None


def make_cells(model: str, specs: Sequence[ParamSpec], trains: Sequence[TrainLayout], rollout_tps: Sequence[int],
               vision_tp: bool = False, links: Links | None = None, gpus_per_node: int = 8,
               share: bool = True) -> list[Cell]:
    links = links or Links()
    out = []
    for tr in trains:
        for tp in rollout_tps:
            roll = RolloutLayout(tp, vision_tp)
            try:
                asis = Summary.of(plan(specs, tr, roll, gpus_per_node, share), links)
                blocked = None
                if tp > tr.tp and tp % tr.tp == 0:
                    btr = TrainLayout(tr.tp, tr.fsdp, tr.rep, block=tp, vision_tp=tr.vision_tp, block_vision=vision_tp)
                    blocked = Summary.of(plan(specs, btr, roll, gpus_per_node, share), links)
            except ValueError as e:
                out.append(Cell(model, tr, tp, error=str(e)))
                continue
            out.append(Cell(model, tr, tp, asis, blocked))
    return out


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f}"


def _cols(s: Summary) -> list[str]:
    return [f"{_gib(s.max('extra'))} ({100 * s.saved:.0f}%)", f"{_gib(s.max('rebuilt'))} ({_gib(s.max('remote'))})",
            f"{s.est_ms:.0f}"]


def sharing_table(cells: Sequence[Cell]) -> str:
    head = ["training", "GPUs", "rollout TP", "mapping", "rollout copy", "extra (saved)", "rebuilt (remote)",
            "est. ms", "blocked: extra (saved)", "blocked: rebuilt (remote)", "blocked: est. ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        row = [c.train.label, str(c.train.world), str(c.rollout_tp)]
        if c.error is not None:
            row += ["n/a: " + c.error] + [""] * (len(head) - 4)
        else:
            row += [c.asis.mapping_label, _gib(c.asis.max("rollout"))] + _cols(c.asis)
            row += _cols(c.blocked) if c.blocked is not None else ["same"] * 3
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def footprint_table(cells: Sequence[Cell]) -> str:
    head = ["training", "rollout TP", "training state", "naive: rollout copy", "naive: total", "shared: extra",
            "shared: total", "blocked: extra", "blocked: total"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        if c.error is not None:
            continue
        f = c.asis.footprint()
        b = (c.blocked or c.asis).footprint()
        row = [c.train.label, str(c.rollout_tp), f"{f['training']:.1f}", f"{f['rollout copy']:.1f}",
               f"{f['total naive']:.1f}", f"{f['rollout extra']:.1f}", f"{f['total shared']:.1f}",
               f"{b['rollout extra']:.1f}", f"{b['total shared']:.1f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def runtime_table(specs: Sequence[ParamSpec], trains: Sequence[TrainLayout], rollout_tps: Sequence[int],
                  links: Links | None = None, gpus_per_node: int = 8) -> str:
    """What the colocated data-parallel step holds per GPU (rollplex.parallel.shared_weights): FSDP over
    every rank (`runtime_train_layout`: o / down sharded by columns under one engine over every rank),
    rollout engines of TP N grouped by `engine_mapping`, and only the shares that are windows of the
    engine's tensors (`realised`); the training layouts that are plain FSDP."""
    head = ["training", "rollout TP", "engines", "FSDP shard", "rollout shard", "extra (saved)", "weights per GPU",
            "rebuilt (remote)", "est. ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for tr in trains:
        if tr.tp != 1 or tr.rep != 1 or tr.block != 1:
            continue
        for tp in rollout_tps:
            row = [tr.label, str(tp)]
            try:
                m = engine_mapping(specs, tr.world, tp)
                p = realised(plan(specs, runtime_train_layout(tr.world, tp), RolloutLayout(tp), gpus_per_node,
                                  mapping=m))
            except ValueError as e:
                lines.append("| " + " | ".join(row + ["n/a: " + str(e)] + [""] * (len(head) - 3)) + " |")
                continue
            sm = Summary.of(p, links or Links())
            row += [m.name, _gib(sm.max("train")), _gib(sm.max("rollout"))] + _cols(sm)[:1]
            row += [_gib(max(b.train + b.extra for b in sm.ranks))] + _cols(sm)[1:]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
