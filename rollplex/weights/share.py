"""Share or rebuild: one rank, one parameter.

The rank holds a training tensor T (its FSDP/TP shard, padded) and needs a rollout tensor S (its TP
shard). Storage is shared where the two are the *same elements in the same order*: a run of S's
local rows equal to a run of T's, at one offset delta (S row i is T row i + delta). Then one buffer
holds both, each a contiguous window of it:

    S inside T      S is a view of the training shard: no memory at all (`Share.is_view`)
    T inside S      the training shard lives inside the rollout buffer; only the rest of S is
                    extra memory (a TP shard made of several FSDP shards: partial share)
    overlapping     a joint buffer covering both; the overlap is stored once

Only whole local rows of equal width can coincide, so a column window (row-parallel) never shares
with whole rows (FSDP): the result would be a strided view, and the engine's GEMMs, CUDA graphs and
memory planner assume contiguous weights.

Everything in S outside the shared window is rebuilt after each optimizer step: copied block by
block from the training tensors that hold it, the rank's own first (a local copy, no link), then
ranks on its node, then the rest. A `Copy` is a 2-D block: `rows` x `width` elements, element (i, j)
at `offset + i * pitch + j` of the flat source / destination tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .regions import Rect, Region


@dataclass(frozen=True)
class Share:
    """S's local elements [first, first + numel) are T's elements [first + delta * width, ...); one
    buffer of `buffer_numel` elements holds T (padded) at `train_offset` and S at `rollout_offset`."""

    first: int
    numel: int
    buffer_numel: int
    train_offset: int
    rollout_offset: int
    train_numel: int  # padded training tensor

    @property
    def is_view(self) -> bool:
        """S lies inside the training tensor: the buffer is the training shard itself."""
        return self.train_offset == 0 and self.buffer_numel == self.train_numel

    @property
    def extra_numel(self) -> int:
        """Memory the rollout tensor adds on top of the training tensor."""
        return self.buffer_numel - self.train_numel


@dataclass(frozen=True)
class Copy:
    src: int  # training rank holding the block
    src_offset: int
    src_pitch: int
    dst_offset: int
    dst_pitch: int
    rows: int
    width: int

    @property
    def numel(self) -> int:
        return self.rows * self.width


@dataclass(frozen=True)
class ParamPlan:
    rollout: Region
    train: Region
    share: Share | None
    copies: tuple[Copy, ...]

    @property
    def shared_numel(self) -> int:
        return 0 if self.share is None else self.share.numel

    @property
    def extra_numel(self) -> int:
        return self.rollout.numel if self.share is None else self.share.extra_numel


def _matches(s: Region, t: Region, delta: int, lo: int, hi: int) -> bool:
    """S rows [lo, hi) equal T rows [lo + delta, hi + delta)? Both are piecewise linear in the local
    row, so comparing at every breakpoint is enough."""
    points = {lo}
    points.update(p for p in s.starts() if lo < p < hi)
    points.update(p - delta for p in t.starts() if lo < p - delta < hi)
    points.update(p - delta for p in [t.rows] if lo < p - delta < hi)  # where padding starts
    for i in points:
        key = s.row_key(i)
        if key is None or key != t.row_key(i + delta):
            return False
    return True


def find_share(s: Region, t: Region) -> Share | None:
    """The largest run of S rows stored identically in T (ties: the one that is a view of T)."""
    if s.width != t.width or not s.rects or not t.rects:
        return None
    best = None
    t_rows = t.rows + t.pad
    for ps, rs in zip(s.starts(), s.rects):
        for pt, rt in zip(t.starts(), t.rects):
            if rs.c0 != rt.c0 or rs.r1 <= rt.r0 or rt.r1 <= rs.r0:
                continue
            delta = (pt - rt.r0) - (ps - rs.r0)
            lo, hi = max(0, -delta), min(s.rows, t_rows - delta)
            if lo >= hi or not _matches(s, t, delta, lo, hi):
                continue
            a = max(0, -delta)  # buffer row of T's first row; S starts at a + delta
            b = a + delta
            size = max(a + t_rows, b + s.rows)
            key = (hi - lo, size == t_rows and a == 0, -size)
            if best is None or key > best[0]:
                best = (key, Share(lo * s.width, (hi - lo) * s.width, size * s.width, a * s.width, b * s.width,
                                   t_rows * t.width))
    return None if best is None else best[1]


def plan_copies(s: Region, share: Share | None, sources: Sequence[tuple[int, Region]]) -> tuple[Copy, ...]:
    """Copies covering every element of S outside the shared window, taken from `sources`
    ([(rank, training region)], most preferred first). Each element is covered exactly once."""
    lo, hi = (0, 0) if share is None else (share.first // s.width, (share.first + share.numel) // s.width)
    starts = s.starts()
    todo: list[tuple[int, Rect]] = []  # (index of S's rectangle, uncovered part of it)
    for k, (start, r) in enumerate(zip(starts, s.rects)):
        for a, b in ((0, lo), (hi, s.rows)):
            a, b = max(a, start), min(b, start + r.rows)
            if a < b:
                todo.append((k, Rect(r.r0 + a - start, r.r0 + b - start, r.c0, r.c1)))
    copies = []
    for src, t in sources:
        if not todo:
            break
        t_starts = t.starts()
        left = []
        for k, piece in todo:
            parts = [piece]
            for pt, rt in zip(t_starts, t.rects):
                nxt = []
                for p in parts:
                    z = p & rt
                    if z is None:
                        nxt.append(p)
                        continue
                    rs, ps = s.rects[k], starts[k]
                    copies.append(Copy(src, (pt + z.r0 - rt.r0) * t.width + z.c0 - rt.c0, t.width,
                                       (ps + z.r0 - rs.r0) * s.width + z.c0 - rs.c0, s.width, z.rows, z.width))
                    nxt.extend(p.minus(z))
                parts = nxt
            left.extend((k, p) for p in parts)
        todo = left
    if todo:
        raise ValueError(f"no training rank holds {todo[0][1]} of the rollout shard")
    return tuple(copies)


def plan_param(s: Region, t: Region, sources: Sequence[tuple[int, Region]], share: bool = True) -> ParamPlan:
    """share=False: the training tensor is not in the rollout dtype, so everything is rebuilt (the
    rank's own elements by a local cast-copy)."""
    sh = find_share(s, t) if share else None
    return ParamPlan(s, t, sh, plan_copies(s, sh, sources))
