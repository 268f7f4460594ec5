"""compression/state.py QueryCache: the ring buffer of a sequence's queries by logical position, against a dict of
the positions last stored (what `get` must return, and when it must say it does not hold them)."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compression.state import QueryCache

L, H, D = 2, 3, 4


def rows(first: int, n: int) -> torch.Tensor:
    """[L, n, H, D] whose every value names its position, so a misplaced row shows."""
    pos = torch.arange(first, first + n, dtype=torch.float32)
    return pos.view(1, n, 1, 1).expand(L, n, H, D) + torch.arange(L * H * D).view(L, 1, H, D) / 100


class Model:
    """The rule, written out: a store contiguous with what is held extends it, any other starts over; at most
    `capacity` newest positions are kept."""

    def __init__(self, capacity: int):
        self.capacity, self.held = capacity, {}

    def store(self, first: int, n: int) -> None:
        if not self.held or first != max(self.held) + 1:
            self.held = {}
        self.held.update({p: p for p in range(first, first + n)})
        hi = first + n
        self.held = {p: v for p, v in self.held.items() if p >= hi - self.capacity}


def test_hand_worked_wrap():
    """Capacity 5: positions 0..3, then 4..6 wrap (slots 4, 0, 1); 2..6 are held, 0..1 are not."""
    c = QueryCache(5)
    c.store(0, rows(0, 4))
    c.store(4, rows(4, 3))
    assert (c.lo, c.hi) == (2, 7)
    assert torch.equal(c.buf[:, 0], rows(5, 1)[:, 0]) and torch.equal(c.buf[:, 1], rows(6, 1)[:, 0])
    assert torch.equal(c.get(2, 5), rows(2, 5))  # read across the wrap
    assert c.get(1, 2) is None and c.get(6, 2) is None
    got = c.get(5, 2)
    c.store(7, rows(7, 1))  # what get returned is a copy, not a view of the ring
    assert torch.equal(got, rows(5, 2))


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 9),
       ops=st.lists(st.tuples(st.booleans(), st.integers(0, 30), st.integers(1, 12)), min_size=1, max_size=12))
def test_against_dict(capacity, ops):
    c, m = QueryCache(capacity), Model(capacity)
    for contiguous, first, n in ops:
        first = c.hi if contiguous else first
        c.store(first, rows(first, n))
        m.store(first, n)
        held = sorted(m.held)
        assert (c.lo, c.hi) == (held[0], held[-1] + 1)
        for a in range(c.lo - 1, c.hi + 1):
            for b in range(a + 1, c.hi + 2):
                got = c.get(a, b - a)
                if all(p in m.held for p in range(a, b)):
                    assert torch.equal(got, rows(a, b - a))
                else:
                    assert got is None
