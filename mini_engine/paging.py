"""Paged KV memory (PagedAttention, Kwon et al. 2023; chapter 07) and automatic prefix caching (chapter 08):
the bookkeeping, in pure Python with no tensors.

The KV pool is `num_blocks` blocks of `block_size` positions. A sequence owns a *block table*, its blocks in
order, and writes position p to cache row (slot) `block_table[p // block_size] * block_size + p % block_size`.
Blocks are taken as positions are needed: a sequence wastes at most the tail of its last block, where a
contiguous cache reserves `max_model_len` positions per sequence. `ref_counts[b]`: the tables holding b.

Prefix caching: attention is causal, so a block's keys and values depend only on the tokens up to its end.
A full computed block is registered under a hash of its tokens chained with its parent's hash (so it names
the whole prefix); a new sequence takes a reference on every leading block found instead of computing it,
except the one holding its last token, whose logits the step needs. A registered block nobody holds stays
cached but *evictable*: counted as free, reused (least recently released first) only when none is free.

Parallel sampling: `fork` gives each sample a table holding the prompt's blocks. Before a sequence writes
into a block another table holds, `copy_on_write` gives it a fresh one and returns the (src, dst) pair the
KV cache must copy first: a block is written only while exactly one table holds it.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """SHA-256 over the parent's hash and the token ids: stable across processes, unlike Python's `hash()`."""
    return hashlib.sha256((parent_hash or b"") + array("q", token_ids).tobytes()).digest()


def block_hashes(token_ids: Sequence[int], block_size: int, parents: Sequence[bytes] = ()) -> list[bytes]:
    """Hashes of every full block of `token_ids`, continuing the chain from the known `parents`."""
    hashes = list(parents)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[start:start + block_size]))
    return hashes


class BlockManager:
    """The free list, a block table per sequence (any hashable id), reference counts and the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.free_blocks: deque[int] = deque(range(num_blocks))  # freed to the back, taken from the front
        self.ref_counts = [0] * num_blocks
        self.block_tables: dict[Hashable, list[int]] = {}
        # A block is held, free or evictable; if cached, cached_blocks[h] == b and block_hash[b] == h.
        self.evictable: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self.cached_blocks: dict[bytes, int] = {}
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.seq_hashes: dict[Hashable, list[bytes]] = {}  # hashes of each sequence's full computed blocks
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ⌈num_tokens / block_size⌉

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The sequence's blocks in position order (empty when it has none). Read it; do not change it."""
        return self.block_tables.get(seq_id, [])

    def num_new_blocks(self, seq_id: Hashable, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self.block_table(seq_id)))

    def can_allocate(self, seq_id: Hashable, num_tokens: int) -> bool:
        return self.num_new_blocks(seq_id, num_tokens) <= self.num_free_blocks

    def capacity(self, seq_id: Hashable, start: int | None = None) -> int:
        """The most positions the sequence could hold now: its blocks and every free one, less one for each
        block it shares at or after position `start` (the next it writes), since writing there copies it."""
        table = self.block_table(seq_id)
        shared = 0 if start is None else len(self._shared(table, start, len(table) * self.block_size))
        return (len(table) + self.num_free_blocks - shared) * self.block_size

    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """A new block table of fresh blocks for `num_tokens` positions (no cache lookup; see `allocate_cached`)."""
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table; grow it with append_slots")
        self._check_room(seq_id, num_tokens)
        self.block_tables[seq_id] = []
        return self.append_slots(seq_id, num_tokens)

    def append_slots(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Grow the sequence's table to hold `num_tokens` positions in all, taking every block it crosses into."""
        if seq_id not in self.block_tables:
            raise ValueError(f"sequence {seq_id!r} has no block table; allocate one first")
        self._check_room(seq_id, num_tokens)
        table = self.block_tables[seq_id]
        for _ in range(self.num_new_blocks(seq_id, num_tokens)):
            table.append(self._take_block())
        return table

    def _take_block(self) -> int:
        """A block for new data, with one holder: the longest free, else the least recently released cached one."""
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.cached_blocks[self.block_hash[block]]
            self.block_hash[block] = None
            self.num_evictions += 1
        if self.ref_counts[block] != 0:
            raise RuntimeError(f"block {block} was free but has {self.ref_counts[block]} holders")
        self.ref_counts[block] = 1
        return block

    def _check_room(self, seq_id: Hashable, num_tokens: int) -> None:
        if not self.can_allocate(seq_id, num_tokens):
            raise RuntimeError(f"sequence {seq_id!r} needs {self.num_new_blocks(seq_id, num_tokens)} more blocks for "
                               f"{num_tokens} positions but only {self.num_free_blocks} are free; check can_allocate "
                               "first")

    def free(self, seq_id: Hashable) -> None:
        """Drop the sequence's table: a block nobody holds any more becomes free, or evictable if cached."""
        table = self.block_tables.pop(seq_id)
        self.seq_hashes.pop(seq_id, None)
        if any(self.ref_counts[b] < 1 for b in table):
            raise RuntimeError(f"a block of sequence {seq_id!r} has no holder left to release")
        uncached = []
        for block in reversed(table):  # tail first: it is evicted first, being useless without the head
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is not None:
                    self.evictable[block] = None
                else:
                    uncached.append(block)
        self.free_blocks.extend(reversed(uncached))  # plain free blocks keep the table's order

    def trim(self, seq_id: Hashable, num_tokens: int) -> int:
        """Speculative rollback: release the blocks past the first `num_tokens` positions. Returns how many."""
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

    def fork(self, parent_id: Hashable, child_id: Hashable) -> list[int]:
        """Give `child_id` a table holding every block of `parent_id`'s, each gaining a holder. Returns it."""
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id!r} already has a block table")
        table = list(self.block_tables[parent_id])
        for block in table:
            self.ref_counts[block] += 1
        self.block_tables[child_id] = table
        if parent_id in self.seq_hashes:
            self.seq_hashes[child_id] = list(self.seq_hashes[parent_id])
        return table

    def _shared(self, table: list[int], start: int, end: int) -> list[int]:
        """Indices in `table` of the blocks of positions start .. end − 1 that another table holds too."""
        last = min(len(table), self.blocks_for(end))
        return [i for i in range(start // self.block_size, last) if self.ref_counts[table[i]] > 1]

    def copy_on_write(self, seq_id: Hashable, start: int, end: int) -> list[tuple[int, int]]:
        """Before the sequence writes positions start .. end − 1, replace each block there that another table
        holds by a fresh one, in this table only. Returns the (src, dst) pairs to copy before the write."""
        table = self.block_tables[seq_id]
        shared = self._shared(table, start, end)
        if len(shared) > self.num_free_blocks:
            raise RuntimeError(f"sequence {seq_id!r} must copy {len(shared)} shared blocks but only "
                               f"{self.num_free_blocks} are free; check capacity(seq_id, start) first")
        copies = []
        for i in shared:
            src, dst = table[i], self._take_block()
            self.ref_counts[src] -= 1  # still >= 1: another table holds it
            table[i] = dst
            copies.append((src, dst))
        return copies

    def lookup(self, token_ids: Sequence[int]) -> list[int]:
        """The cached blocks `token_ids` starts with, up to the first miss and never the last token's. Read-only."""
        if not self.enable_prefix_caching:
            return []
        hits, parent, size = [], None, self.block_size
        for i in range((len(token_ids) - 1) // size):  # one block at a time: a miss stops the hashing
            parent = hash_block(parent, token_ids[i * size:(i + 1) * size])
            block = self.cached_blocks.get(parent)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_cached_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens of `token_ids` a new sequence would take from the cache: here whole blocks. (A radix tree's match
        may end inside its last block, which the sequence shares until its first write copies it.)"""
        return len(self.lookup(token_ids)) * self.block_size

    def num_evictable(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` are evictable: a hit on one takes it out of the free count."""
        return sum(1 for b in blocks if b in self.evictable)

    def allocate_cached(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """A new table of the cached blocks `token_ids` starts with, each held once more; returns their tokens."""
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
        """Register the full blocks of the first `num_computed` tokens, whose keys and values are written. A hash
        already cached (the same prefix computed by another sequence this step) keeps its first block."""
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
        """Forget every evictable block (they become free); held blocks keep their hashes. Returns how many."""
        dropped = list(self.evictable)
        for block in dropped:
            del self.cached_blocks[self.block_hash[block]]
            self.block_hash[block] = None
            self.free_blocks.append(block)
        self.evictable.clear()
        return len(dropped)

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        return slot_mapping(self.block_tables[seq_id], start, end, self.block_size)


def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache rows (slots) where the keys and values of positions start .. end − 1 go."""
    if end > len(block_table) * block_size:
        raise ValueError(f"positions up to {end} need {-(-end // block_size)} blocks; the block table holds "
                         f"{len(block_table)}")
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
