"""Fixed pool of KV blocks: reference counts, a free list, and the prefix cache's hash -> block map.

A block is in exactly one of three states:
- *free*: on the free stack, ref count 0, holds nothing worth keeping;
- *cached*: ref count 0 but registered under a prefix hash; it stays reusable (a prefix-cache hit takes it back)
  until an allocation finds the free stack empty and evicts it, least recently freed first;
- *used*: ref count >= 1 (several sequences may share a cached prompt block).
Allocation prefers the free stack so cached prefixes survive as long as possible.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # Freed blocks, popped from the end; blocks [_fresh, num_blocks) were never handed out and are taken in id
        # order after the stack runs dry (the same order as a stack initialised to all ids, lowest on top, but a
        # host pool of ~10^5 blocks never materialises or checks its untouched tail).
        self._free: list[int] = []
        self._fresh = 0
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks with ref count 0, LRU first
        self._hash_to_block: dict[Hashable, int] = {}
        self._block_to_hash: dict[int, Hashable] = {}

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: free plus evictable cached ones."""
        return len(self._free) + (self.num_blocks - self._fresh) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._block_to_hash)

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def allocate(self, n: int = 1) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise MemoryError(f"need {n} KV blocks, only {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            elif self._fresh < self.num_blocks:
                b = self._fresh
                self._fresh += 1
            else:  # evict the least recently freed cached block
                b, _ = self._evictable.popitem(last=False)
                del self._hash_to_block[self._block_to_hash.pop(b)]
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def share(self, blocks: list[int]) -> None:
        """One more reference to blocks that are in use."""
        for b in blocks:
            if self.ref_counts[b] < 1:
                raise ValueError(f"cannot share free block {b}")
            self.ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block. Blocks reaching zero go back in reverse table order: a freed
        sequence's head blocks are reused (or, if cached, evicted) last."""
        for b in reversed(blocks):
            if self.ref_counts[b] < 1:
                raise ValueError(f"double free of block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if b in self._block_to_hash:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    # -- prefix cache -------------------------------------------------------------------------------------
    def lookup(self, key: Hashable) -> int | None:
        return self._hash_to_block.get(key)

    def touch(self, blocks: list[int]) -> None:
        """Take a reference to cached blocks found by `lookup` (reviving them if their ref count was 0)."""
        for b in blocks:
            if b not in self._block_to_hash:
                raise ValueError(f"block {b} is not cached")
            if self.ref_counts[b] == 0:
                del self._evictable[b]
            self.ref_counts[b] += 1

    def cache(self, block: int, key: Hashable) -> bool:
        """Register a full, used block under `key`; False (and nothing changes) if the key or block already is."""
        if self.ref_counts[block] < 1:
            raise ValueError(f"cannot cache free block {block}")
        if key in self._hash_to_block or block in self._block_to_hash:
            return False
        self._hash_to_block[key] = block
        self._block_to_hash[block] = key
        return True

    def is_cached(self, block: int) -> bool:
        return block in self._block_to_hash

    def num_evictable_in(self, blocks: list[int]) -> int:
        """How many of these cached blocks sit unreferenced (touching them takes them out of `num_free`)."""
        return sum(1 for b in blocks if self.ref_counts[b] == 0)

    def num_references(self) -> int:
        """Sum of all ref counts (blocks past the fresh mark hold none)."""
        return sum(self.ref_counts[:self._fresh])

    def check_invariants(self) -> None:
        """Exact state checks. Engine tests run them after every step and a host pool has ~10^5 blocks, so the
        untouched tail is checked with one C-level count and everything else is proportional to touched blocks."""
        free, evictable, rc, n, fresh = self._free, self._evictable, self.ref_counts, self.num_blocks, self._fresh
        assert len(rc) == n and 0 <= fresh <= n
        assert rc[fresh:].count(0) == n - fresh, "a never-allocated block has a reference"
        touched = rc[:fresh]
        assert not touched or min(touched) >= 0, f"block {touched.index(min(touched))} has ref count {min(touched)}"
        free_set = set(free)
        assert len(free_set) == len(free), "a block is on the free list twice"
        assert not free_set & evictable.keys(), "a block is both free and evictable"
        idle = free + list(evictable)
        assert not idle or (min(idle) >= 0 and max(idle) < fresh), "a free/evictable id was never allocated"
        # idle blocks all have ref count 0, and there are as many zeros as idle blocks: zero <=> idle
        assert not any(rc[b] for b in idle), "a free/evictable block has a nonzero ref count"
        assert touched.count(0) == len(idle), f"{touched.count(0)} touched blocks have ref count 0, {len(idle)} idle"
        assert evictable.keys() <= self._block_to_hash.keys(), "an evictable block is not cached"
        assert not free_set & self._block_to_hash.keys(), "a free-stack block is still cached"
        assert len(self._hash_to_block) == len(self._block_to_hash)
        assert all(self._hash_to_block[k] == b for b, k in self._block_to_hash.items()), "hash map out of sync"
