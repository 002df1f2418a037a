"""Paged KV memory (PagedAttention, Kwon et al. 2023): the bookkeeping, in pure Python with no tensors.

The KV pool is `num_blocks` blocks of `block_size` token positions each. A sequence owns a *block table*,
the list of its blocks in order: its position p lives in block `block_table[p // block_size]` at offset
`p % block_size`, so the cache row its keys and values are written to is

    slot = block_table[p // block_size] * block_size + p % block_size

Blocks are taken only as positions are needed, so a sequence wastes at most the unused tail of its last
block, where a contiguous cache reserves `max_model_len` positions for every sequence up front.

Every block carries a reference count: the number of block tables that hold it. Here each block has one
owner (count 1 while used, 0 while free); prefix caching (chapter 08) will let several tables share a full
block, which then returns to the free list only when its last holder lets go.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Hashable


class BlockManager:
    """The free list, one block table per sequence (keyed by any hashable id) and the reference counts."""

    def __init__(self, num_blocks: int, block_size: int):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        # A queue: a freed block goes to the back, so the blocks handed out next are the longest free (prefix
        # caching will want exactly that order, to keep recently freed contents around the longest).
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.block_tables: dict[Hashable, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

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

    def capacity(self, seq_id: Hashable) -> int:
        """The most positions the sequence could hold now: its blocks plus every free one."""
        return (len(self.block_table(seq_id)) + self.num_free_blocks) * self.block_size

    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """A new block table holding `num_tokens` positions, for a sequence that has none. Returns it."""
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
            block = self.free_blocks.popleft()
            self.ref_counts[block] = 1  # a block taken from the free list starts with exactly one holder
            table.append(block)
        return table

    def _check_room(self, seq_id: Hashable, num_tokens: int) -> None:
        if not self.can_allocate(seq_id, num_tokens):
            raise RuntimeError(f"sequence {seq_id!r} needs {self.num_new_blocks(seq_id, num_tokens)} more blocks for "
                               f"{num_tokens} positions but only {self.num_free_blocks} are free; check can_allocate "
                               "first")

    def free(self, seq_id: Hashable) -> None:
        """Drop the sequence's table (it finished or was preempted): each of its blocks loses a holder, and
        a block nobody holds any more goes back to the free list."""
        for block in self.block_tables.pop(seq_id):
            if self.ref_counts[block] < 1:
                raise RuntimeError(f"block {block} of sequence {seq_id!r} has no holder left to release")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Cache rows (slots) of positions start .. end − 1 of the sequence, where their keys/values go."""
        return slot_mapping(self.block_tables[seq_id], start, end, self.block_size)


def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache rows of positions start .. end − 1 of a sequence with this block table (see the module's doc)."""
    if end > len(block_table) * block_size:
        raise ValueError(f"positions up to {end} need {-(-end // block_size)} blocks; the block table holds "
                         f"{len(block_table)}")
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
