"""Rank mapping: which rollout slot (group g, TP rank t) each training rank plays.

How much a rank can share depends only on its training region and on t, and the total is a sum
over ranks, so the best mapping over all world! permutations is an assignment problem: training
ranks x rollout slots, weight = elements shared (then, as a tie-break, elements the rank can copy
locally), solved exactly with the Hungarian algorithm. That optimum is the bound every plan is
measured against.

A mapping must also be placeable: rollout TP groups, and training TP groups, each on one node
(their collectives run every layer). Ranks joined by either kind of group form a component; the
mapping is node-local when the components pack into nodes of `gpus_per_node`. FSDP's own order is
free (its collectives span the whole mesh anyway), so the physical placement follows the components.

Candidates: the digit interleavings of (g, t) into a training rank's mixed-radix digits (prime
factors), which include the contiguous mapping rank = g * tp + t ("ggttt" at world 32, TP 8) and
the strided one rank = t * groups + g ("tttgg"), and the Hungarian assignment itself (slots of
equal t numbered in rank order). The chosen mapping is the best node-local candidate; `optimal`
says whether it reaches the bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations


@dataclass(frozen=True)
class Mapping:
    name: str
    slot_of: tuple[int, ...]  # training rank -> rollout slot g * tp + t
    node_of: tuple[int, ...] | None  # training rank -> node, None when not node-local


def _primes(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


def _digits(x: int, radices: list[int]) -> list[int]:
    out = []
    for r in reversed(radices):
        out.append(x % r)
        x //= r
    return out[::-1]


def interleavings(world: int, tp: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, slot_of) for every interleaving of t's and g's prime digits, contiguous first."""
    if world % tp:
        raise ValueError(f"rollout TP {tp} does not divide the world size {world}")
    groups = world // tp
    td, gd = _primes(tp), _primes(groups)
    n = len(td) + len(gd)
    out: dict[tuple[int, ...], str] = {}
    for pos in sorted(combinations(range(n), len(td)), key=lambda p: [-x for x in p]):
        kinds = ["t" if i in pos else "g" for i in range(n)]
        ti, gi = iter(td), iter(gd)
        radices = [next(ti) if k == "t" else next(gi) for k in kinds]
        slot_of = [0] * world
        for g in range(groups):
            for t in range(tp):
                tdig, gdig = iter(_digits(t, td)), iter(_digits(g, gd))
                rank = 0
                for k, rad in zip(kinds, radices):
                    rank = rank * rad + (next(tdig) if k == "t" else next(gdig))
                slot_of[rank] = g * tp + t
        out.setdefault(tuple(slot_of), "".join(kinds) or "-")
    return [(name, slots) for slots, name in out.items()]


def hungarian(weight: list[list[int]]) -> list[int]:
    """Column assigned to each row maximising the total weight of a square matrix (exact)."""
    n = len(weight)
    inf = float("inf")
    u, v, p, way = [0] * (n + 1), [0] * (n + 1), [0] * (n + 1), [0] * (n + 1)
    for i in range(1, n + 1):
        p[0], j0 = i, 0
        minv, used = [inf] * (n + 1), [False] * (n + 1)
        while True:
            used[j0] = True
            i0, delta, j1 = p[j0], inf, 0
            for j in range(1, n + 1):
                if not used[j]:
                    cur = -weight[i0 - 1][j - 1] - u[i0] - v[j]
                    if cur < minv[j]:
                        minv[j], way[j] = cur, j0
                    if minv[j] < delta:
                        delta, j1 = minv[j], j
            for j in range(n + 1):
                if used[j]:
                    u[p[j]] += delta
                    v[j] -= delta
                else:
                    minv[j] -= delta
            j0 = j1
            if p[j0] == 0:
                break
        while j0:
            j1 = way[j0]
            p[j0] = p[j1]
            j0 = j1
    col = [0] * n
    for j in range(1, n + 1):
        col[p[j] - 1] = j - 1
    return col


def placement(train_tp: int, rollout_tp: int, slot_of: tuple[int, ...], gpus_per_node: int) -> tuple[int, ...] | None:
    """Node of each rank with every training and rollout TP group inside one node, or None."""
    world = len(slot_of)
    parent = list(range(world))

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    first_of_group: dict[int, int] = {}
    for r in range(world):
        parent[find(r)] = find(r - r % train_tp)
        g = slot_of[r] // rollout_tp
        parent[find(r)] = find(first_of_group.setdefault(g, r))
    comps: dict[int, list[int]] = {}
    for r in range(world):
        comps.setdefault(find(r), []).append(r)
    free = [gpus_per_node] * -(-world // gpus_per_node)
    node_of = [0] * world
    for members in sorted(comps.values(), key=lambda m: (-len(m), m[0])):
        node = next((i for i, f in enumerate(free) if f >= len(members)), None)
        if node is None:
            return None
        free[node] -= len(members)
        for r in members:
            node_of[r] = node
    return tuple(node_of)


@dataclass(frozen=True)
class MappingChoice:
    mapping: Mapping
    score: int
    bound: int  # the best score over all mappings, node-local or not

    @property
    def optimal(self) -> bool:
        return self.score == self.bound


def choose_mapping(world: int, train_tp: int, rollout_tp: int, gain: Callable[[int, int], int],
                   gpus_per_node: int = 8, forced: Mapping | None = None) -> MappingChoice:
    """gain(rank, t): what training rank `rank` scores as rollout TP rank t. forced: score this
    mapping only (still against the bound)."""
    table = [[gain(r, t) for t in range(rollout_tp)] for r in range(world)]
    assign = hungarian([[table[r][slot % rollout_tp] for slot in range(world)] for r in range(world)])
    bound = sum(table[r][assign[r] % rollout_tp] for r in range(world))
    seen: dict[int, int] = {}
    hung = []
    for r in range(world):  # renumber groups: the k-th rank (in rank order) given t joins group k
        t = assign[r] % rollout_tp
        hung.append(seen.setdefault(t, 0) * rollout_tp + t)
        seen[t] += 1
    cands = interleavings(world, rollout_tp) + [("assignment", tuple(hung))]
    if forced is not None:
        if sorted(forced.slot_of) != list(range(world)):
            raise ValueError("a mapping's slot_of must be a permutation of the world's ranks")
        cands = [(forced.name, forced.slot_of)]
    best = None
    for name, slots in cands:
        score = sum(table[r][slots[r] % rollout_tp] for r in range(world))
        nodes = placement(train_tp, rollout_tp, slots, gpus_per_node)
        key = (nodes is not None, score)
        if best is None or key > best[0]:
            best = (key, Mapping(name, slots, nodes), score)
    return MappingChoice(best[1], best[2], bound)
