"""Paged KV memory (PagedAttention, Kwon et al. 2023) and automatic prefix caching (chapter 08): the
bookkeeping, in pure Python with no tensors.

The KV pool is `num_blocks` blocks of `block_size` token positions each. A sequence owns a *block table*,
the list of its blocks in order: its position p lives in block `block_table[p // block_size]` at offset
`p % block_size`, so the cache row its keys and values are written to is

    slot = block_table[p // block_size] * block_size + p % block_size

Blocks are taken only as positions are needed, so a sequence wastes at most the unused tail of its last
block, where a contiguous cache reserves `max_model_len` positions for every sequence up front.

Every block carries a reference count: the number of block tables that hold it.

Prefix caching (`enable_prefix_caching=True`). Attention is causal, so the keys and values of a block
depend only on the tokens up to its end. A FULL block whose keys and values are written is registered
under a hash of its tokens chained with its parent block's hash (SHA-256, so the hash names the whole
prefix up to the block's end, and two prompts collide only if SHA-256 does). A new sequence first looks
its tokens up (`lookup` / `allocate_cached`): every leading block found takes one more reference instead
of being computed. The lookup stops one token short of the end, in whole blocks, so the block holding the
last token is never a hit: it is recomputed into a block of the sequence's own, the step has logits to
sample from, and no sequence ever writes into a block another one holds (a registered block is full, and
writes go only to positions past what is computed).

A registered block whose last holder lets go stays cached but *evictable*: it counts as free, and is
handed out for new data only when the free list is empty, least recently released first (the sequence's
tail is released before its head, since a block is only useful while every block before it is cached).
Handing it out forgets its hash. `reset_prefix_cache` forgets every evictable block. The hash map holds
at most one entry per block, so it cannot grow without bound.

Parallel sampling and copy-on-write (`SamplingParams(n=...)`). The n samples of one prompt share its
prefill: when it is computed, `fork` gives each other sample a block table holding the same blocks (each
gains a holder). Full blocks stay shared for good, since nobody writes into them again. The prompt's last
block is usually partly filled, and every sample would write its own next token into it: before a
sequence writes positions its table shares with another one, `copy_on_write` gives it a fresh block in
that table alone and returns the (src, dst) pair whose keys and values the KV cache must copy before the
step writes. The last holder left writes in place. So a block is written only while exactly one table
holds it, and two samples never mix their tokens in one block.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """SHA-256 over the parent block's hash (nothing for a sequence's first block) and the block's token ids
    (signed 64-bit each). Stable across processes, unlike Python's salted `hash()`."""
    return hashlib.sha256((parent_hash or b"") + array("q", token_ids).tobytes()).digest()


def block_hashes(token_ids: Sequence[int], block_size: int, parents: Sequence[bytes] = ()) -> list[bytes]:
    """Hashes of every full block of `token_ids`, in order. `parents`: hashes of the first blocks already
    known (they are reused, and the chain goes on from the last of them)."""
    hashes = list(parents)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[start:start + block_size]))
    return hashes


class BlockManager:
    """The free list, one block table per sequence (keyed by any hashable id), the reference counts and,
    with `enable_prefix_caching`, the hash-to-block map of full computed blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        # A queue: a freed block goes to the back, so the blocks handed out next are the longest free.
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.block_tables: dict[Hashable, list[int]] = {}
        # Prefix caching. Every block is held (ref count > 0), in free_blocks (caches nothing), or in evictable
        # (nobody holds it but it caches a prefix; least recently released first). A cached block, held or
        # evictable, is registered both ways: cached_blocks[h] == b and block_hash[b] == h.
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.cached_blocks: dict[bytes, int] = {}
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.seq_hashes: dict[Hashable, list[bytes]] = {}  # hashes of each sequence's full computed blocks
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence could be given now: the free ones and the evictable cached ones."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, held or evictable."""
        return len(self.cached_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` positions: ⌈num_tokens / block_size⌉."""
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The sequence's blocks in position order (empty when it has none). Read it; do not change it."""
        return self.block_tables.get(seq_id, [])

    def num_new_blocks(self, seq_id: Hashable, num_tokens: int) -> int:
        """Blocks the sequence's table must gain to hold `num_tokens` positions in all."""
        return max(0, self.blocks_for(num_tokens) - len(self.block_table(seq_id)))

    def can_allocate(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Whether the free blocks can grow the sequence's table (empty if it has none) to `num_tokens`
        positions. Counts every block a multi-token step crosses into, not just one."""
        return self.num_new_blocks(seq_id, num_tokens) <= self.num_free_blocks

    def capacity(self, seq_id: Hashable, start: int | None = None) -> int:
        """The most positions the sequence could hold now: its blocks plus every free one, less one for each
        block it shares with another table at or after position `start` (the next it writes; by default past
        its blocks): writing there copies the block first (`copy_on_write`), which takes a free block."""
        table = self.block_table(seq_id)
        shared = 0 if start is None else len(self._shared(table, start, len(table) * self.block_size))
        return (len(table) + self.num_free_blocks - shared) * self.block_size

    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """A new block table holding `num_tokens` positions, for a sequence that has none, all of its blocks
        fresh (no cache lookup: see `allocate_cached`). Returns it."""
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table; grow it with append_slots")
        self._check_room(seq_id, num_tokens)
        self.block_tables[seq_id] = []
        return self.append_slots(seq_id, num_tokens)

    def append_slots(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Grow the sequence's table so it holds `num_tokens` positions in all, taking as many blocks as that
        crosses into (a chunk of a prompt, one decode token, or 1 + k speculative tokens). Returns the table."""
        if seq_id not in self.block_tables:
            raise ValueError(f"sequence {seq_id!r} has no block table; allocate one first")
        self._check_room(seq_id, num_tokens)
        table = self.block_tables[seq_id]
        for _ in range(self.num_new_blocks(seq_id, num_tokens)):
            table.append(self._take_block())
        return table

    def _take_block(self) -> int:
        """A block for new data, with one holder: the longest-free block, or when none is free the least
        recently released cached one, whose hash is forgotten (its contents are about to be overwritten)."""
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.cached_blocks[self.block_hash[block]]
            self.block_hash[block] = None
            self.num_evictions += 1
        if self.ref_counts[block] != 0:
            raise RuntimeError(f"block {block} was free but has {self.ref_counts[block]} holders")
        self.ref_counts[block] = 1  # a block taken for new data starts with exactly one holder
        return block

    def _check_room(self, seq_id: Hashable, num_tokens: int) -> None:
        if not self.can_allocate(seq_id, num_tokens):
            raise RuntimeError(f"sequence {seq_id!r} needs {self.num_new_blocks(seq_id, num_tokens)} more blocks for "
                               f"{num_tokens} positions but only {self.num_free_blocks} are free; check can_allocate "
                               "first")

    def free(self, seq_id: Hashable) -> None:
        """Drop the sequence's table (it finished or was preempted): each of its blocks loses a holder, last
        block first. A block nobody holds any more goes back to the free list, or, if it caches a prefix, to
        the back of the evictable queue (the most recently used)."""
        table = self.block_tables.pop(seq_id)
        self.seq_hashes.pop(seq_id, None)
        if any(self.ref_counts[b] < 1 for b in table):
            raise RuntimeError(f"a block of sequence {seq_id!r} has no holder left to release")
        uncached = []
        for block in reversed(table):  # the tail first: it goes before the head when blocks are evicted
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is not None:
                    self.evictable[block] = None
                else:
                    uncached.append(block)
        self.free_blocks.extend(reversed(uncached))  # plain free blocks keep the table's order

    def trim(self, seq_id: Hashable, num_tokens: int) -> int:
        """Speculative rollback: shrink the sequence's table to the blocks that hold its first `num_tokens`
        positions, the ones whose keys and values were kept. The blocks past them held only rejected drafts;
        they go back to the free list (they were never registered: `cache_blocks` hashes kept tokens only).
        Returns how many blocks were released."""
        table = self.block_tables[seq_id]
        keep = self.blocks_for(num_tokens)
        released = table[keep:]
        del table[keep:]
        for block in reversed(released):
            if self.block_hash[block] is not None:
                raise RuntimeError(f"block {block} past the kept tokens of {seq_id!r} is registered in the prefix cache")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        return len(released)

    # ------------------------------------------------------------ parallel sampling: fork, copy-on-write

    def fork(self, parent_id: Hashable, child_id: Hashable) -> list[int]:
        """Give `child_id` (no table yet) a block table holding every block of `parent_id`'s, each gaining a
        holder: a sample of the same prompt reads the parent's keys and values instead of computing them.
        Takes no block. Returns the child's table."""
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id!r} already has a block table")
        table = list(self.block_tables[parent_id])
        for block in table:
            self.ref_counts[block] += 1  # a held block: never free or evictable, so no list to update
        self.block_tables[child_id] = table
        if parent_id in self.seq_hashes:  # the same full blocks, already registered
            self.seq_hashes[child_id] = list(self.seq_hashes[parent_id])
        return table

    def _shared(self, table: list[int], start: int, end: int) -> list[int]:
        """Indices in `table` of the blocks holding positions start .. end − 1 that another table holds too."""
        last = min(len(table), self.blocks_for(end))
        return [i for i in range(start // self.block_size, last) if self.ref_counts[table[i]] > 1]

    def copy_on_write(self, seq_id: Hashable, start: int, end: int) -> list[tuple[int, int]]:
        """Before the sequence writes positions start .. end − 1: each block of its table there that another
        table also holds is replaced, in this table only, by a fresh block (the shared one loses a holder).
        Returns the (src, dst) block pairs; the KV cache must copy src's keys and values into dst before the
        step writes. Nothing to copy (the common case) returns []."""
        table = self.block_tables[seq_id]
        shared = self._shared(table, start, end)
        if len(shared) > self.num_free_blocks:
            raise RuntimeError(f"sequence {seq_id!r} must copy {len(shared)} shared blocks but only "
                               f"{self.num_free_blocks} are free; check capacity(seq_id, start) first")
        copies = []
        for i in shared:
            src, dst = table[i], self._take_block()
            self.ref_counts[src] -= 1  # still >= 1: another table holds it, so it stays held
            table[i] = dst
            copies.append((src, dst))
        return copies

    # ------------------------------------------------------------ prefix caching

    def lookup(self, token_ids: Sequence[int]) -> list[int]:
        """The cached blocks the sequence `token_ids` starts with, changing nothing: leading full blocks whose
        chained hash is registered, stopping at the first miss, and never the block holding the last token
        (at most (len − 1) // block_size blocks: that token's logits are needed). Empty without caching."""
        if not self.enable_prefix_caching:
            return []
        hits, parent, size = [], None, self.block_size
        for i in range((len(token_ids) - 1) // size):  # hashed one block at a time: a miss stops the work
            parent = hash_block(parent, token_ids[i * size:(i + 1) * size])
            block = self.cached_blocks.get(parent)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_evictable(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` are evictable: a hit on one takes it out of the free count."""
        return sum(1 for b in blocks if b in self.evictable)

    def allocate_cached(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """Start a block table for a sequence that has none with the cached blocks its tokens begin with
        (`lookup`), each taking a reference (an evictable one is in use again). Returns how many tokens they
        hold: the sequence computes from there, taking fresh blocks with `append_slots`."""
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table")
        hits = self.lookup(token_ids)
        for block in hits:
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
        self.block_tables[seq_id] = list(hits)
        if hits:
            self.seq_hashes[seq_id] = [self.block_hash[b] for b in hits]
        return len(hits) * self.block_size

    def cache_blocks(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the sequence's full blocks whose keys and values are now written: call after a step, with
        the tokens whose KV is in the cache (`num_computed` of `token_ids`), never for tokens still to be
        computed or verified. A block whose hash is cached already (an identical prefix computed by another
        sequence in the same step) stays unregistered: the first copy wins, and this one is freed as usual."""
        if not self.enable_prefix_caching or seq_id not in self.block_tables:
            return
        known = self.seq_hashes.get(seq_id, [])
        if (num_computed // self.block_size) <= len(known):
            return
        hashes = block_hashes(token_ids[:num_computed], self.block_size, known)
        table = self.block_tables[seq_id]
        for i in range(len(known), len(hashes)):
            block, h = table[i], hashes[i]
            if h not in self.cached_blocks and self.block_hash[block] is None:
                self.cached_blocks[h] = block
                self.block_hash[block] = h
        self.seq_hashes[seq_id] = hashes

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no sequence holds (they become plain free blocks); blocks in use
        keep their hashes. Returns how many were dropped."""
        dropped = list(self.evictable)
        for block in dropped:
            del self.cached_blocks[self.block_hash[block]]
            self.block_hash[block] = None
            self.free_blocks.append(block)
        self.evictable.clear()
        return len(dropped)

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Cache rows (slots) of positions start .. end − 1 of the sequence, where their keys/values go."""
        return slot_mapping(self.block_tables[seq_id], start, end, self.block_size)


def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache rows of positions start .. end − 1 of a sequence with this block table (see the module's doc)."""
    if end > len(block_table) * block_size:
        raise ValueError(f"positions up to {end} need {-(-end // block_size)} blocks; the block table holds "
                         f"{len(block_table)}")
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
