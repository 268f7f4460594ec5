"""Pure functions of the throughput/quality sweep (bench/pareto.py): the Pareto front of (cost, gain) points and the
best setting under a quality-cost bound. No engine, no I/O: tests/test_pareto.py checks them on hand-made points."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class Point:
    """One setting on one pool: ``cost`` is minimised (an NLL increase over the full cache), ``gain`` maximised
    (output tok/s over none's on the same pool)."""
    name: str
    cost: float
    gain: float


def dominates(a: Point, b: Point) -> bool:
    """a is at least as good as b on both axes and strictly better on one."""
    return a.cost <= b.cost and a.gain >= b.gain and (a.cost < b.cost or a.gain > b.gain)


def pareto_front(points: Iterable[Point]) -> list[Point]:
    """The points no other point dominates, by increasing cost (then name). Points equal on both axes do not
    dominate one another, so every copy of a non-dominated (cost, gain) stays on the front. NaN costs or gains
    (a missing measurement) are left out. O(n log n): sorted by cost, then gain descending, a point is on the front
    iff its gain beats the best gain of every strictly cheaper point and equals the best gain at its own cost."""
    pts = sorted((p for p in points if p.cost == p.cost and p.gain == p.gain),
                 key=lambda p: (p.cost, -p.gain, p.name))
    front: list[Point] = []
    best_cheaper = float("-inf")  # best gain among points of strictly lower cost
    i = 0
    while i < len(pts):
        j = i
        while j < len(pts) and pts[j].cost == pts[i].cost:
            j += 1
        top = pts[i].gain  # the best gain at this cost (sorted descending)
        if top > best_cheaper:
            front.extend(p for p in pts[i:j] if p.gain == top)
            best_cheaper = top
        i = j
    return front


def cost_bound(full_nll: float, fraction: float = 0.01) -> float:
    """The largest NLL increase within ``fraction`` of the full cache's NLL (1%: Δ ≤ 0.01 · NLL_full)."""
    if not full_nll > 0:
        raise ValueError(f"the full cache's NLL must be positive, got {full_nll!r}")
    return fraction * full_nll


def best_within(points: Sequence[Point], bound: float) -> Point | None:
    """The point of highest gain among those with cost ≤ bound (ties: lower cost, then name); None if none
    qualifies. It is always on the front of `points` (a point dominating it would also be within the bound)."""
    ok = [p for p in points if p.cost <= bound and p.gain == p.gain]
    return min(ok, key=lambda p: (-p.gain, p.cost, p.name)) if ok else None
