"""Fixed pool of KV blocks with an O(1) free list and reference counts."""
from __future__ import annotations


class BlockPool:
    """Hands out block ids. A block is either free (on the free list, ref count 0) or referenced (ref count
    >= 1). `share` adds a reference so one block can later back several sequences (prefix sharing)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # Popped from the end: reversed so the first allocations get ids 0, 1, 2, ...
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int = 1) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise MemoryError(f"need {n} KV blocks, only {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_counts[b] < 1:
                raise ValueError(f"cannot share free block {b}")
            self.ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero return to the free list. Blocks are
        pushed in reverse so a sequence's head blocks are reused first."""
        for b in reversed(blocks):
            if self.ref_counts[b] < 1:
                raise ValueError(f"double free of block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)

    def check_invariants(self) -> None:
        free = self._free
        assert len(set(free)) == len(free), "a block is on the free list twice"
        free_set = set(free)
        for b, rc in enumerate(self.ref_counts):
            assert rc >= 0, f"block {b} has negative ref count {rc}"
            assert (rc == 0) == (b in free_set), f"block {b}: ref count {rc} but free={b in free_set}"
        assert self.num_free + sum(1 for rc in self.ref_counts if rc > 0) == self.num_blocks
