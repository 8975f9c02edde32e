"""Prefix work in pieces: a few prompts' vision tower + prompt prefill, run a unit at a time.

A `PrefixJob` computes exactly what `Qwen25VL.prefix(prompts)` computes — the same calls in the same
order, so the same values — but split into units that a co-scheduler launches between decode steps,
in three parts (`parts()`), each a run of equal-cost units:

    vision   block 0 .. depth-1 of one vision-tower call over the job's images and videos (none when
             no prompt needs the tower: they carry `vision_embeds`, or get them from the engine's
             prefill before the job starts, `external_vision`)
    embed    token embeddings with the visual features in place, M-RoPE tables
    layers   decoder layer 0 .. L-1, keeping each layer's rotated K/V; the last also final-norms

A unit either completes or leaves the job as it was (a layer's outputs replace the state only once it
returns), so a chunk that runs out of memory part-way is resumed at the first unit it did not finish.

The hand-over to scoring, which prompt's prefix is in which job, is `PrefixRows` (rows.py).

Costs are estimated from FLOPs (`parts`): the co-scheduler turns them into milliseconds with a
throughput it calibrates from standalone runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from ..models import ModelInputs, Qwen25VL
from ..models.attention import sdpa
from ..models.qwen2_5_vl import PrefixState


class PrefixJob:
    def __init__(self, model: Qwen25VL, prompts: Sequence[ModelInputs], key: str, external_vision: bool = False):
        if not prompts:
            raise ValueError("a prefix job needs at least one prompt")
        self.model, self.prompts, self.key = model, list(prompts), key
        self.num_layers = model.cfg.text.num_hidden_layers
        tower = not external_vision and any(p.vision_embeds is None and p.has_vision for p in self.prompts)
        self.vision_units = len(model.visual.blocks) if tower else 0
        self.units = self.vision_units + 1 + self.num_layers
        self.next_unit = 0
        self._vis = self._vis_batch = None
        self._x = self._delta = self._cos = self._sin = self._e = None
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.state: PrefixState | None = None
        self.owner = None  # a ShardedPrefix that runs this job's units (cosched/sharded.py)

    @property
    def done(self) -> bool:
        return self.next_unit == self.units

    def parts(self) -> list[tuple[str, int, float]]:
        """(part, units, forward FLOPs per unit) in order: vision (when the tower runs), embed, layers."""
        cfg = self.model.cfg
        t = cfg.text
        tokens = sum(len(p.input_ids) for p in self.prompts)
        attn = sum(len(p.input_ids) ** 2 for p in self.prompts) * 2 * t.num_attention_heads * t.head_dim
        layer = sum(x.numel() for x in self.model.model.layers[0].parameters())
        out = []
        if self.vision_units:
            patches = sum(t_ * h * w for p in self.prompts if p.vision_embeds is None
                          for t_, h, w in (*p.image_grids, *p.video_grids))
            block = sum(x.numel() for x in self.model.visual.blocks[0].parameters())
            out.append(("vision", self.vision_units, 2.0 * block * patches))
        out.append(("embed", 1, 2.0 * t.hidden_size * tokens + 1.0))
        out.append(("layers", self.num_layers, 2.0 * layer * tokens + attn))
        return out

    def part_units(self, part: str, start: int, stop: int) -> tuple[int, int]:
        """A part's unit range -> the job's unit range."""
        base = {"vision": 0, "embed": self.vision_units, "layers": self.vision_units + 1}[part]
        return base + start, base + stop

    def left_flops(self) -> float:
        total, u = 0.0, 0
        for _, n, per in self.parts():
            total += per * max(0, min(n, u + n - self.next_unit))
            u += n
        return total

    @torch.no_grad()
    def run(self, start: int, stop: int) -> None:
        """Run units [start, stop); start must be the next unit (units run in order)."""
        if start != self.next_unit or not start <= stop <= self.units:
            raise ValueError(f"prefix job {self.key}: units [{start}, {stop}) but the next unit is {self.next_unit}")
        for u in range(start, stop):
            self._unit(u)
            self.next_unit = u + 1

    def complete(self) -> PrefixState:
        """Run whatever units are left (through the sweep that owns the job, if one does); the job's
        PrefixState."""
        if self.owner is not None:
            self.owner.complete()
        self.run(self.next_unit, self.units)
        assert self.state is not None
        return self.state

    def _unit(self, u: int) -> None:
        m = self.model
        if u < self.vision_units:  # one block of the tower over the job's images / videos
            vis = self._vis
            if u == 0:
                self._vis_batch = m.vision_batch(self.prompts)
                vis = m.visual.begin(*self._vis_batch[:2])
            m.visual.run_block(u, vis)
            self._vis = vis
            if u == self.vision_units - 1:
                feats = m.visual.end(vis)
                visual = m.split_visual(self.prompts, feats, self._vis_batch)
                self.prompts = [p if f is None else replace(p, vision_embeds=f) for p, f in zip(self.prompts, visual)]
                self._vis = self._vis_batch = None
            return
        if u == self.vision_units:
            e = m.embed_prompts(self.prompts)
            cos, sin = m.rope(e.positions, e.embeds.dtype)
            self._e, self._x, self._cos, self._sin = e, e.embeds, cos, sin
            return
        i = u - self.vision_units - 1
        kept: list[torch.Tensor] = []

        def attend(layer, q, k, v):
            kept[:] = [k, v]
            return sdpa(q, k, v, causal=True)  # right padding: valid queries never see pads

        x, delta = m.model.layer(i, self._x, self._delta, self._cos, self._sin, attend)
        x, delta = m.model.add_deepstack(i, x, delta, self._e.deepstack)  # Qwen3-VL's, after the first layers
        if i == self.num_layers - 1:
            hidden = m.model.finish(x, delta)
            e = self._e
            last = hidden[torch.arange(hidden.shape[0], device=hidden.device), e.lens - 1]
            self.state = PrefixState([*self.keys, kept[0]], [*self.values, kept[1]], e.lens, e.rope_delta, last)
            self._x = self._delta = self._cos = self._sin = self._e = None
            self.keys, self.values = [], []
            return
        self.keys.append(kept[0])
        self.values.append(kept[1])
        self._x, self._delta = x, delta

    def tensors(self) -> list[torch.Tensor]:
        """Every device tensor the job holds (for stream bookkeeping)."""
        ts = [*self.keys, *self.values]
        for t in (self._x, self._delta, self._cos, self._sin):
            if t is not None:
                ts.append(t)
        if self._vis is not None:
            ts += [self._vis.x, self._vis.cos, self._vis.sin]
        if self.state is not None:
            s = self.state
            ts += [*s.keys, *s.values, s.lens, s.rope_delta, s.last_hidden]
        if self._e is not None:
            ts += [self._e.embeds, self._e.positions, self._e.lens, self._e.rope_delta]
        ts += [p.vision_embeds for p in self.prompts if p.vision_embeds is not None]
        return [t for t in ts if t.is_cuda]
