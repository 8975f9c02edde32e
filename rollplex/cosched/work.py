"""Movable prefix work: items, the chunks cut from them, and the priority queue that hands them out.

A `WorkItem` is one piece of forward work that may run beside decode instead of in its own phase
(the reference prefix of prompt i, the actor's vision encoding of prompt i, ...). It is divisible
into `size` units (tokens or layers) of equal estimated cost, and never into pieces smaller than
`min_units`. The queue cuts chunks of a requested cost from the highest-priority item first (lower
`priority` runs first: the reference prefix before the actor's encodings, since the reference has
no other use for its idle phase). A chunk that fails is put back as a range, so whatever is never
admitted stays pending and runs in the item's normal phase. A consumer that needs an item before the
queue has handed all of it out takes the rest away (`claim`): no chunk of it is cut afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkItem:
    key: str  # unique, e.g. "ref/3"
    kind: str  # e.g. "ref_prefix", "actor_vision"
    priority: int  # lower first
    cost_ms: float  # estimated standalone cost of the whole item
    size: int  # divisible units (tokens or layers)
    min_units: int = 1  # smallest chunk worth launching

    def __post_init__(self):
        if self.cost_ms <= 0 or self.size <= 0:
            raise ValueError(f"work item {self.key!r} needs cost_ms > 0 and size > 0")
        if not 1 <= self.min_units <= self.size:
            raise ValueError(f"work item {self.key!r} needs 1 <= min_units <= size")

    @property
    def unit_ms(self) -> float:
        return self.cost_ms / self.size


@dataclass(frozen=True)
class Chunk:
    item: WorkItem
    start: int  # units [start, stop) of the item
    stop: int

    @property
    def cost_ms(self) -> float:
        return (self.stop - self.start) * self.item.unit_ms


@dataclass
class WorkQueue:
    items: dict[str, WorkItem] = field(default_factory=dict)
    pending: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # key -> sorted unit ranges

    def add(self, item: WorkItem) -> None:
        if item.key in self.items:
            raise ValueError(f"duplicate work item {item.key!r}")
        self.items[item.key] = item
        self.pending[item.key] = [(0, item.size)]

    def _order(self) -> list[WorkItem]:
        return sorted((self.items[k] for k, r in self.pending.items() if r), key=lambda it: it.priority)

    def min_chunk_ms(self) -> float | None:
        """Cost of the smallest chunk the next take() could cut (None when nothing is pending)."""
        order = self._order()
        if not order:
            return None
        it = order[0]
        a, b = self.pending[it.key][0]
        return min(it.min_units, b - a) * it.unit_ms

    def take(self, target_ms: float) -> Chunk | None:
        """Cut the next chunk of about `target_ms` (at least the item's smallest chunk)."""
        order = self._order()
        if not order:
            return None
        it = order[0]
        ranges = self.pending[it.key]
        a, b = ranges[0]
        units = max(it.min_units, int(target_ms / it.unit_ms))
        stop = b if b - a - units < it.min_units else a + units  # no tail smaller than a chunk
        if stop < b:
            ranges[0] = (stop, b)
        else:
            ranges.pop(0)
        return Chunk(it, a, stop)

    def put_back(self, chunk: Chunk) -> None:
        ranges = self.pending[chunk.item.key]
        assert all(b <= chunk.start or a >= chunk.stop for a, b in ranges), "chunk overlaps pending work"
        ranges.append((chunk.start, chunk.stop))
        ranges.sort()

    def mark_done(self, key: str, start: int, stop: int) -> None:
        """Units [start, stop) of an item finished after all (a chunk that failed part-way)."""
        out = []
        for a, b in self.pending[key]:
            if b <= start or a >= stop:
                out.append((a, b))
                continue
            if a < start:
                out.append((a, start))
            if b > stop:
                out.append((stop, b))
        self.pending[key] = out

    def claim(self, key: str) -> int:
        """Take away an item's pending units (whoever claims them runs them): no chunk of them is cut again;
        how many there were."""
        units = sum(b - a for a, b in self.pending[key])
        self.pending[key] = []
        return units

    def remaining(self, key: str) -> list[tuple[int, int]]:
        """Unit ranges of an item that were never done beside decode: its normal phase runs these."""
        return list(self.pending[key])

    def left_ms(self) -> float:
        return sum((b - a) * self.items[k].unit_ms for k, r in self.pending.items() for a, b in r)

    def total_ms(self) -> float:
        return sum(it.cost_ms for it in self.items.values())
