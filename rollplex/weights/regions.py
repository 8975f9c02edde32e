"""Regions: which elements of a parameter one rank holds, and in which local order.

Every parameter is seen as a 2-D matrix [rows, cols] (a 1-D tensor is [n, 1]; an N-D tensor
[shape[0], prod(shape[1:])]). A rank's local tensor is a stack of rectangles of that matrix, all of
one width, one under the other: local row 0 is the first rectangle's first row. This covers every
layout Rollplex plans for:

    FSDP2 Shard(0)             one rectangle of whole rows (or none), then padding rows
    TP column-parallel         rows of each fused part (q/k/v, gate/up) stacked: several rectangles
    TP row-parallel            all rows x one column window: one rectangle
    blocked storage order      column windows stacked as rows (see layout.storage_region)

FSDP2 pads every shard to the size of shard 0 (`_chunk_with_empty` + `_get_dim0_padded_size` in
torch.distributed.fsdp._fully_shard): `pad` counts those rows. Padding holds no parameter element,
so nothing can be shared through it.

Pure Python (no torch): the planner runs on the real 7B/32B shapes without touching a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rect:
    """Rows [r0, r1) x columns [c0, c1) of a parameter's 2-D matrix."""

    r0: int
    r1: int
    c0: int
    c1: int

    def __post_init__(self):
        assert 0 <= self.r0 <= self.r1 and 0 <= self.c0 <= self.c1, self

    @property
    def rows(self) -> int:
        return self.r1 - self.r0

    @property
    def width(self) -> int:
        return self.c1 - self.c0

    @property
    def numel(self) -> int:
        return self.rows * self.width

    def __and__(self, other: Rect) -> Rect | None:
        r0, r1 = max(self.r0, other.r0), min(self.r1, other.r1)
        c0, c1 = max(self.c0, other.c0), min(self.c1, other.c1)
        return Rect(r0, r1, c0, c1) if r0 < r1 and c0 < c1 else None

    def minus(self, cut: Rect) -> list[Rect]:
        """self without `cut` (which must lie inside self): up to four rectangles."""
        out = []
        if cut.r0 > self.r0:
            out.append(Rect(self.r0, cut.r0, self.c0, self.c1))
        if cut.r1 < self.r1:
            out.append(Rect(cut.r1, self.r1, self.c0, self.c1))
        if cut.c0 > self.c0:
            out.append(Rect(cut.r0, cut.r1, self.c0, cut.c0))
        if cut.c1 < self.c1:
            out.append(Rect(cut.r0, cut.r1, cut.c1, self.c1))
        return out


@dataclass(frozen=True)
class Region:
    """A local tensor [rows + pad, width]: `rects` stacked in order, then `pad` rows of padding."""

    rects: tuple[Rect, ...]
    width: int
    pad: int = 0

    def __post_init__(self):
        assert self.pad >= 0 and self.width >= 1, self
        assert all(r.width == self.width and r.rows > 0 for r in self.rects), self

    @classmethod
    def of(cls, rects, width: int, pad: int = 0) -> Region:
        """Drops empty rectangles and merges vertically adjacent ones (same columns)."""
        merged: list[Rect] = []
        for r in rects:
            if r.rows == 0:
                continue
            if merged and merged[-1].r1 == r.r0 and (merged[-1].c0, merged[-1].c1) == (r.c0, r.c1):
                merged[-1] = Rect(merged[-1].r0, r.r1, r.c0, r.c1)
            else:
                merged.append(r)
        return cls(tuple(merged), width, pad)

    @property
    def rows(self) -> int:
        return sum(r.rows for r in self.rects)

    @property
    def numel(self) -> int:
        """Parameter elements held (padding excluded)."""
        return self.rows * self.width

    @property
    def padded_numel(self) -> int:
        return (self.rows + self.pad) * self.width

    def starts(self) -> list[int]:
        """Local row of each rectangle's first row."""
        out, pos = [], 0
        for r in self.rects:
            out.append(pos)
            pos += r.rows
        return out

    def slice_rows(self, a: int, b: int) -> Region:
        """Local rows [a, b) (clamped to the held rows), without padding."""
        out = []
        for start, r in zip(self.starts(), self.rects):
            lo, hi = max(a, start), min(b, start + r.rows)
            if lo < hi:
                out.append(Rect(r.r0 + lo - start, r.r0 + hi - start, r.c0, r.c1))
        return Region.of(out, self.width)

    def row_key(self, i: int) -> tuple[int, int] | None:
        """(matrix row, first column) of local row i; None for padding."""
        for start, r in zip(self.starts(), self.rects):
            if start <= i < start + r.rows:
                return (r.r0 + i - start, r.c0)
        return None


def fsdp_chunk(region: Region, n: int, s: int) -> Region:
    """Shard s of n of `region`'s local dim 0 as FSDP2 cuts it: torch.chunk into ceil(rows / n)-row
    pieces (the trailing shards may be short or empty), every shard padded to the first one's size."""
    if not 0 <= s < n:
        raise ValueError(f"shard {s} out of range for {n} shards")
    rows = region.rows
    size = -(-rows // n)
    a, b = min(s * size, rows), min((s + 1) * size, rows)
    part = region.slice_rows(a, b)
    return Region(part.rects, region.width, size - (b - a))


def intersect_numel(a: Region, b: Region) -> int:
    """Elements held by both regions (the rectangles of one region never overlap)."""
    total = 0
    for x in a.rects:
        for y in b.rects:
            z = x & y
            if z is not None:
                total += z.numel
    return total
