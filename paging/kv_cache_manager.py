"""KVCacheManager: the only code that creates, extends, shares, compacts or frees a sequence's blocks and changes
its KV length (vLLM v1's KVCacheManager plays the same role). The scheduler asks it for slots, the compression
stage asks it to gather keys and apply compactions, preemption and finishing ask it to free.

Prefix caching: full blocks of a prompt are keyed by (parent key, token ids) and registered in the pool once
computed. A new (or preempted) request takes the longest cached prefix of its prompt and only prefills the rest.
Blocks whose reference count drops to zero stay cached until an allocation evicts them (least recently freed
first). Compaction rewrites slots in place, so it must never touch a shared or cached block: only a sequence's
`cacheable_prompt_tokens` (the prompt tokens its compression never rewrites) are ever cached or taken from the
cache.

Paging imports nothing of the engine or of compression: what it reads of a sequence is `PagedSequence`, and the
compaction jobs it applies are `paging.compaction.CompactionJob`s.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence as Seq

import torch

from paging.block_pool import BlockPool
from paging.compaction import CompactionJob, blocks_to_free, compact_batch
from paging.kv_cache import KVCache


class PagedSequence(Protocol):
    """What the KV manager reads of a sequence (engine/sequence.py has it) and the fields only it writes."""
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]  # owned here
    kv_len: int  # owned here
    host_block_table: list[int]  # owned here: swapped out

    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def cacheable_prompt_tokens(self) -> int: ...  # leading prompt tokens that compaction never rewrites
    @property
    def logits_from(self) -> int: ...  # first logical position whose logits the next step must compute


Sequence = PagedSequence


@dataclass
class FullTier:
    """A sequence's never-compressed KV in the host store, in logical order (lossless mode, engine/lossless.py)."""
    block_table: list[int] = field(default_factory=list)
    length: int = 0


class KVCacheManager:
    def __init__(self, kv_cache: KVCache, enable_prefix_caching: bool = True, host_blocks: int = 0,
                 compute_dtype: torch.dtype | None = None):
        self.kv_cache = kv_cache
        # gathered keys / values (compression scorers) come back in this dtype; None: the cache's own
        self.compute_dtype = compute_dtype
        self.block_size = kv_cache.block_size
        self.pool = BlockPool(kv_cache.num_blocks)
        # Swap space (vLLM's swap preemption): a second block store in host memory (pinned on CUDA so copies can
        # run asynchronously), allocated lazily by the OS as blocks are first written.
        self.host: torch.Tensor | None = None
        self.host_pool: BlockPool | None = None
        if host_blocks > 0:
            d = kv_cache.data
            pin = d.device.type == "cuda"
            self.host = torch.empty((d.shape[0], host_blocks, *d.shape[2:]), dtype=d.dtype, pin_memory=pin)
            self.host_pool = BlockPool(host_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self._keys: dict[int, list[int]] = {}  # seq_id -> keys of its cacheable prompt blocks
        self._registered: dict[int, int] = {}  # seq_id -> leading blocks of its table already offered to the cache
        self._full: dict[int, FullTier] = {}  # seq_id -> its full tier (lossless mode), freed with it
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache (vLLM counts tokens)
        self.prefix_hits = 0  # of which found cached

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_needed(self, seq: "Sequence", num_new_tokens: int) -> int:
        need = -(-(seq.kv_len + num_new_tokens) // self.block_size)
        return max(0, need - len(seq.block_table))

    # -- prefix cache -------------------------------------------------------------------------------------
    def _cacheable_tokens(self, seq: "Sequence") -> int:
        return seq.cacheable_prompt_tokens if self.enable_prefix_caching else 0

    def _block_keys(self, seq: "Sequence") -> list[int]:
        keys = self._keys.get(seq.seq_id)
        if keys is None:
            bs, parent = self.block_size, None
            keys = []
            for i in range(self._cacheable_tokens(seq) // bs):
                # Python's hash of a tuple of ints is deterministic (no per-process salt)
                parent = hash((parent, tuple(seq.prompt_token_ids[i * bs:(i + 1) * bs])))
                keys.append(parent)
            self._keys[seq.seq_id] = keys
        return keys

    def find_cached_prefix(self, seq: "Sequence") -> list[int]:
        """Blocks of the longest cached prefix of a waiting sequence's prompt. Every position whose logits are
        needed is left to compute: the last one (the next token) and, for scoring, all from `score_from - 1`."""
        if not self.enable_prefix_caching or seq.block_table:
            return []
        limit = max(0, seq.logits_from) // self.block_size
        blocks = []
        for key in self._block_keys(seq)[:limit]:
            b = self.pool.lookup(key)
            if b is None:
                break
            blocks.append(b)
        return blocks

    # -- slots --------------------------------------------------------------------------------------------
    def allocate_slots(self, seq: "Sequence", num_new_tokens: int, cached: Seq[int] | None = None,
                       watermark: int = 0) -> bool:
        """Give `seq` blocks for `num_new_tokens` more KV slots, keeping `watermark` blocks free. ``cached`` (for a
        waiting sequence being admitted) are the prefix blocks from `find_cached_prefix`: they are shared and
        become its first slots. Returns False, changing nothing, if the pool cannot supply the blocks."""
        admitting = cached is not None
        cached = list(cached or [])
        if cached and seq.block_table:
            raise ValueError("cached prefix blocks can only start an empty block table")
        cached_tokens = len(cached) * self.block_size
        need = max(0, -(-(seq.kv_len + cached_tokens + num_new_tokens) // self.block_size)
                   - len(seq.block_table) - len(cached))
        # reviving unreferenced cached blocks takes them out of the free count too
        if need + self.pool.num_evictable_in(cached) + watermark > self.pool.num_free:
            return False
        if admitting and self.enable_prefix_caching:
            self.prefix_queries += seq.num_prompt_tokens
            self.prefix_hits += cached_tokens
        if cached:
            self.pool.touch(cached)
            seq.block_table.extend(cached)
            seq.kv_len = cached_tokens
            self._registered[seq.seq_id] = len(cached)
        seq.block_table.extend(self.pool.allocate(need))
        return True

    def commit(self, seq: "Sequence", num_tokens: int) -> None:
        """The step wrote `num_tokens` new slots: advance the KV length and offer newly full prompt blocks to the
        prefix cache."""
        seq.kv_len += num_tokens
        if not self.enable_prefix_caching:
            return
        keys = self._block_keys(seq)
        done = self._registered.get(seq.seq_id, 0)
        full = min(len(keys), seq.kv_len // self.block_size)
        for i in range(done, full):
            self.pool.cache(seq.block_table[i], keys[i])  # a block with the same key may already be cached
        self._registered[seq.seq_id] = max(done, full)

    def free(self, seq: "Sequence", finished: bool = True) -> None:
        """Return every block (cached ones stay reusable), the full tier's too. ``finished=False`` (preemption)
        keeps the prompt's block keys for its re-admission."""
        self.pool.free(seq.block_table)
        seq.block_table = []
        if seq.host_block_table:
            self.host_pool.free(seq.host_block_table)
            seq.host_block_table = []
        tier = self._full.pop(seq.seq_id, None)
        if tier is not None and tier.block_table:
            self.host_pool.free(tier.block_table)
        seq.kv_len = 0
        self._registered.pop(seq.seq_id, None)
        if finished:
            self._keys.pop(seq.seq_id, None)

    # -- swapping -----------------------------------------------------------------------------------------
    def can_swap_out(self, seq: "Sequence") -> bool:
        return self.host_pool is not None and 0 < len(seq.block_table) <= self.host_pool.num_free

    def swap_out(self, seq: "Sequence") -> int:
        """Copy a sequence's blocks to host memory and free them; its KV length, and everything that depends on
        the cache (compression frontier, positions), stay as they are. Returns the blocks moved."""
        table = seq.block_table
        host = self.host_pool.allocate(len(table))
        src = torch.tensor(table, device=self.kv_cache.data.device)
        self.host[:, torch.tensor(host)] = self.kv_cache.data[:, src].to("cpu", non_blocking=self.host.is_pinned())
        if self.host.is_pinned():
            torch.cuda.current_stream(self.kv_cache.data.device).synchronize()
        self.pool.free(table)
        seq.block_table = []
        seq.host_block_table = host
        self._registered.pop(seq.seq_id, None)
        return len(host)

    def swap_in(self, seq: "Sequence") -> int:
        """Bring a swapped sequence's KV back into fresh device blocks (bit-identical). The caller checked that
        enough blocks are free. Returns the blocks moved."""
        host = seq.host_block_table
        dev = self.pool.allocate(len(host))
        dst = torch.tensor(dev, device=self.kv_cache.data.device)
        self.kv_cache.data[:, dst] = self.host[:, torch.tensor(host)].to(self.kv_cache.data.device, non_blocking=True)
        self.host_pool.free(host)
        seq.host_block_table = []
        seq.block_table = dev
        self._registered[seq.seq_id] = len(dev)  # private copies: never offered to the prefix cache again
        return len(dev)

    # -- a second, never compressed tier of a sequence's KV in the host store (lossless mode's full tier) --------
    def full_tier(self, seq: "Sequence") -> FullTier:
        """The sequence's full tier, to read (empty if it has none); it is freed with the sequence."""
        return self._full.get(seq.seq_id) or FullTier()

    def _own_tier(self, seq: "Sequence") -> FullTier:
        tier = self._full.get(seq.seq_id)
        if tier is None:
            tier = self._full[seq.seq_id] = FullTier()
        return tier

    def truncate(self, seq: "Sequence", new_kv_len: int) -> None:
        """Drop device slots past `new_kv_len` (rejected drafts) and the whole blocks after them."""
        if not 0 <= new_kv_len <= seq.kv_len:
            raise ValueError(f"cannot truncate kv_len {seq.kv_len} to {new_kv_len}")
        freed = blocks_to_free(seq.block_table, new_kv_len, self.block_size)
        if freed:
            self.pool.free(freed)
            del seq.block_table[len(seq.block_table) - len(freed):]
        seq.kv_len = new_kv_len

    def resize(self, seq: "Sequence", new_kv_len: int) -> bool:
        """Set the device KV length, freeing or allocating blocks (new slots hold nothing until written); False
        (nothing changed) if the pool is short."""
        if new_kv_len <= seq.kv_len:
            self.truncate(seq, new_kv_len)
            return True
        if not self.allocate_slots(seq, new_kv_len - seq.kv_len):
            return False
        seq.kv_len = new_kv_len
        return True

    def full_reserve(self, seq: "Sequence", length: int) -> bool:
        """Host blocks for `length` full-tier slots; False (nothing changed) if the host store is short."""
        tier = self._own_tier(seq)
        need = -(-length // self.block_size) - len(tier.block_table)
        if need <= 0:
            return True
        if self.host_pool is None or need > self.host_pool.num_free:
            return False
        tier.block_table.extend(self.host_pool.allocate(need))
        return True

    def full_truncate(self, seq: "Sequence", length: int) -> None:
        tier = self._own_tier(seq)
        tier.length = length
        keep = -(-length // self.block_size)
        if len(tier.block_table) > keep:
            self.host_pool.free(tier.block_table[keep:])
            del tier.block_table[keep:]

    def _slots(self, table: list[int], start: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        p = torch.arange(start, start + n)
        return (torch.tensor(table, dtype=torch.long)[p // self.block_size].to(device),
                (p % self.block_size).to(device))

    def full_append_from_device(self, seq: "Sequence", device_start: int, n: int) -> bool:
        """Copy device slots [device_start, +n) (exact K/V: nothing compressed yet) to the end of the full tier."""
        if n <= 0:
            return True
        tier = self._own_tier(seq)
        if not self.full_reserve(seq, tier.length + n):
            return False
        db, do = self._slots(seq.block_table, device_start, n, self.kv_cache.data.device)
        hb, ho = self._slots(tier.block_table, tier.length, n, "cpu")
        self.host[:, hb, :, ho] = self.kv_cache.data[:, db, :, do].to("cpu")
        tier.length += n
        return True

    def device_from_full(self, seq: "Sequence", full_start: int, device_start: int, n: int) -> None:
        """Overwrite device slots [device_start, +n) with full-tier slots [full_start, +n) (verified K/V)."""
        dev = self.kv_cache.data.device
        hb, ho = self._slots(self.full_tier(seq).block_table, full_start, n, "cpu")
        db, do = self._slots(seq.block_table, device_start, n, dev)
        self.kv_cache.data[:, db, :, do] = self.host[:, hb, :, ho].to(dev)

    def full_tier_layers(self) -> list[torch.Tensor]:
        """Per-layer views of the host store in the device cache's layout, for the verification forward. On CPU the
        two tiers are two tensors and attention reads the host store in place; a GPU would stage the sequence's
        full-tier blocks into device blocks first (`stage_full`)."""
        if self.host is None:
            raise ValueError("lossless mode needs a host store: set lossless_host_memory or swap_space")
        if self.kv_cache.data.device.type != "cpu":
            raise NotImplementedError("verification on CUDA stages the full tier: use stage_full")
        return list(self.host.unbind(0))

    def stage_full(self, tables: list[list[int]]) -> tuple[list[torch.Tensor], list[list[int]], Callable[[], None]]:
        """Device copies of the given full-tier blocks (for a GPU's verification forward): per-layer views of a
        staging tensor, the tables renumbered into it, and a function writing the staged blocks back to host."""
        flat = [b for t in tables for b in t]
        idx = torch.tensor(flat, dtype=torch.long)
        staged = self.host[:, idx].to(self.kv_cache.data.device, non_blocking=True)
        renum, k = [], 0
        for t in tables:
            renum.append(list(range(k, k + len(t))))
            k += len(t)

        def write_back() -> None:
            self.host[:, idx] = staged.to("cpu")

        return list(staged.unbind(0)), renum, write_back

    @property
    def full_tier_bytes(self) -> int:
        if self.host_pool is None:
            return 0
        per_block = self.host[:, 0].numel() * self.host.element_size()
        return per_block * self.host_pool.num_used

    # -- compression --------------------------------------------------------------------------------------
    def _gather(self, seq: "Sequence", start: int, length: int, which: int) -> torch.Tensor:
        kv = self.kv_cache
        bs = self.block_size
        slots = torch.arange(start, start + length)
        table = torch.tensor(seq.block_table, dtype=torch.long)
        dev = kv.data.device
        out = kv.data[:, table[slots // bs].to(dev), which, (slots % bs).to(dev)].transpose(1, 2)
        # scorers see the values attention sees: 8-bit rows dequantized with their own scales
        return kv.format.dequantize(out, self.compute_dtype, keys=which == 0)

    def gather_keys(self, seq: "Sequence", start: int, length: int) -> torch.Tensor:
        """Keys of KV slots [start, start + length), all layers: [L, Hkv, length, D]."""
        return self._gather(seq, start, length, 0)

    def gather_values(self, seq: "Sequence", start: int, length: int) -> torch.Tensor:
        """Values of KV slots [start, start + length), all layers: [L, Hkv, length, D]."""
        return self._gather(seq, start, length, 1)

    def compact(self, jobs: list[CompactionJob]) -> list[int]:
        """Apply compactions (one batched gather/scatter), shrink KV lengths, free whole blocks past the new ends. A
        job carrying ``new_keys`` / ``new_values`` (merging) has those written into its kept slots. Returns the
        number of blocks freed per job."""
        if not jobs:
            return []
        bs = self.block_size
        for job in jobs:
            for b in job.seq.block_table[job.region_start // bs:]:
                if self.pool.ref_counts[b] != 1 or self.pool.is_cached(b):
                    raise RuntimeError(f"compaction would rewrite shared or cached block {b} of sequence "
                                       f"{job.seq.request_id}")
        new_lens = self.compact_data(jobs)
        freed_counts = []
        for job, new_len in zip(jobs, new_lens):
            seq = job.seq
            freed = blocks_to_free(seq.block_table, new_len, bs)
            if freed:
                self.pool.free(freed)
                del seq.block_table[len(seq.block_table) - len(freed):]
            seq.kv_len = new_len
            freed_counts.append(len(freed))
        return freed_counts

    def compact_data(self, jobs: list[CompactionJob]) -> list[int]:
        """The data movement of `compact` alone (no block is freed, no table or length changes): what a
        tensor-parallel worker runs on its KV shard while rank 0's `compact` keeps the books. Returns the new
        KV lengths."""
        return compact_batch(self.kv_cache.data, jobs, check_indices=False)

    # -- checks -------------------------------------------------------------------------------------------
    def check_invariants(self, running: Seq["Sequence"], waiting: Seq["Sequence"] = ()) -> None:
        """Pool invariants; every reference is held by exactly the tables that list the block; each running
        sequence holds exactly ceil(kv_len / block_size) blocks; waiting sequences hold none."""
        self.pool.check_invariants()
        _refs_match(Counter(b for seq in running for b in seq.block_table), self.pool, "block")
        for seq in running:
            assert len(seq.block_table) == -(-seq.kv_len // self.block_size), (
                f"{seq.request_id}: {len(seq.block_table)} blocks for kv_len {seq.kv_len}")
            assert len(set(seq.block_table)) == len(seq.block_table), f"{seq.request_id}: a block listed twice"
            assert seq.kv_len <= seq.num_computed_tokens
            protected = self._cacheable_tokens(seq) // self.block_size
            for i, b in enumerate(seq.block_table):
                if self.pool.ref_counts[b] > 1 or self.pool.is_cached(b):
                    assert i < protected, f"{seq.request_id}: shared or cached block {b} past its protected prefix"
        host_refs = Counter(b for seq in waiting for b in seq.host_block_table)
        live = {seq.seq_id: seq for seq in (*running, *waiting)}
        assert set(self._full) <= set(live), f"full tiers of sequences no longer live: {set(self._full) - set(live)}"
        for sid, tier in self._full.items():
            host_refs.update(tier.block_table)
            assert len(tier.block_table) == -(-tier.length // self.block_size), (
                f"{live[sid].request_id}: {len(tier.block_table)} full-tier blocks for {tier.length} slots")
        for seq in waiting:
            assert not seq.block_table, f"waiting {seq.request_id} holds KV blocks"
            if seq.host_block_table:
                assert len(seq.host_block_table) == -(-seq.kv_len // self.block_size), f"{seq.request_id}: host table"
            else:
                assert seq.kv_len == 0, f"waiting {seq.request_id} has a KV length but no blocks"
        if self.host_pool is not None:
            self.host_pool.check_invariants()
            _refs_match(host_refs, self.host_pool, "host block")


def _refs_match(refs: Counter, pool: BlockPool, what: str) -> None:
    """Every block's ref count equals the number of tables listing it: checked for the listed blocks, and the
    totals agree (ref counts are >= 0, checked by the pool), so no unlisted block has a reference."""
    rc = pool.ref_counts
    for b, n in refs.items():
        assert 0 <= b < len(rc) and rc[b] == n, (
            f"{what} {b}: ref count {rc[b] if 0 <= b < len(rc) else None} but {n} tables hold it")
    total = pool.num_references()
    assert total == sum(refs.values()), f"{what}s: {total} references counted but {sum(refs.values())} in tables"
