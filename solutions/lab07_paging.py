"""Lab 07: paged KV memory, the bookkeeping behind PagedAttention.

A contiguous KV cache reserves max_model_len slots for every request up front. A paged cache instead
cuts one pool into blocks of `block_size` token slots and gives a sequence a new block only when it
needs one, as an operating system hands out memory pages. You write the three pieces that make it work:
  1. `BlockAllocator`: the pool's free list and a reference count per block (a block two sequences
     share, such as a common prompt prefix, returns to the pool only when both let go of it);
  2. `BlockTable`: one sequence's blocks in order; appending tokens takes a new block every block_size
     tokens, and position p lives in block block_ids[p // block_size] at offset p % block_size;
  3. `slot_mapping`: for one engine step, where each new token's key and value go in the pool:
     slot = block_id * block_size + offset.

Fill in every function marked TODO in labs/lab07_paging.py, then grade your work with

    pytest tests/labs/test_lab07.py --impl=labs

Pure Python: no tensors, like the engine's own block manager. `store_kv` and `gather_kv` (given) use your
slots and tables on a real tensor cache, so the notebook can check that attention through them equals
attention over a contiguous cache.
"""
from __future__ import annotations

from collections import deque

import torch


class BlockAllocator:
    """A pool of `num_blocks` KV blocks with ids 0 .. num_blocks - 1.

    State (given): `free_blocks`, the ids nobody holds, oldest first (allocate takes from the left, free
    appends on the right, so a freed block is reused as late as possible: chapter 08's prefix cache can
    still find its contents); `ref_counts[b]`, how many holders block b has (0 when free)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts: list[int] = [0] * num_blocks

    def num_free(self) -> int:
        """How many blocks are free."""
        return len(self.free_blocks)

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether `num_blocks` blocks could be allocated right now."""
        return num_blocks <= len(self.free_blocks)

    def allocate(self) -> int:
        """Take the oldest free block, give it one holder (ref count 1) and return its id.
        Raises RuntimeError when no block is free."""
        if not self.free_blocks:
            raise RuntimeError("no free KV block left in the pool")
        block = self.free_blocks.popleft()
        self.ref_counts[block] = 1
        return block

    def share(self, block_id: int) -> None:
        """Add a holder to a block in use (a second sequence reading the same prefix).
        Raises ValueError for a free block: sharing one would hand out memory the pool may give away."""
        if self.ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is free: only a block in use can be shared")
        self.ref_counts[block_id] += 1

    def free(self, block_id: int) -> None:
        """Drop one holder; the block returns to the end of `free_blocks` when its last holder lets go.
        Raises ValueError for a block that is already free (a double free), leaving its count at 0."""
        if self.ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is already free (double free)")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_blocks.append(block_id)


class BlockTable:
    """One sequence's KV blocks, in order. Position p is stored in block `block_ids[p // block_size]` at
    offset `p % block_size`.

    State (given): `block_size`; `block_ids`, the blocks it holds, in order; `num_tokens`, how many
    positions it has claimed so far (their keys and values are written, or about to be, this step)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.block_ids: list[int] = []
        self.num_tokens = 0

    def blocks_needed(self, num_new_tokens: int) -> int:
        """How many more blocks holding `num_new_tokens` more tokens takes: the blocks num_tokens +
        num_new_tokens positions fill, less those already held. 0 while the last block has room."""
        return -(-(self.num_tokens + num_new_tokens) // self.block_size) - len(self.block_ids)

    def append_tokens(self, num_new_tokens: int, allocator: BlockAllocator) -> list[int]:
        """Claim `num_new_tokens` more positions (a prompt at prefill, 1 at decode, 1 + k when speculating),
        allocating the new blocks they need from `allocator`. All or nothing: when the pool cannot supply
        every block, raise RuntimeError having taken none and changed nothing. Returns the new block ids."""
        needed = self.blocks_needed(num_new_tokens)
        if not allocator.can_allocate(needed):
            raise RuntimeError(f"{needed} blocks needed, {allocator.num_free()} free")
        new_blocks = [allocator.allocate() for _ in range(needed)]
        self.block_ids += new_blocks
        self.num_tokens += num_new_tokens
        return new_blocks

    def slot(self, position: int) -> int:
        """The pool slot of a claimed position: block_id * block_size + offset.
        Raises IndexError for a position outside [0, num_tokens)."""
        if not 0 <= position < self.num_tokens:
            raise IndexError(f"position {position} is outside the sequence's {self.num_tokens} tokens")
        return self.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def release(self, allocator: BlockAllocator) -> None:
        """The sequence is finished (or preempted): free every block it holds and empty the table."""
        for block in self.block_ids:
            allocator.free(block)
        self.block_ids, self.num_tokens = [], 0


def slot_mapping(tables: list[BlockTable], num_new_tokens: list[int]) -> list[int]:
    """One step's slot mapping, the packed list the KV-store kernel reads: for each sequence in order, the
    slots of its last `num_new_tokens[i]` positions (the tokens this step computes, already claimed with
    `append_tokens`), oldest first."""
    return [table.slot(p) for table, n in zip(tables, num_new_tokens)
            for p in range(table.num_tokens - n, table.num_tokens)]


def store_kv(cache: torch.Tensor, slots: list[int], values: torch.Tensor) -> None:
    """Given: write `values` [T, H, D] into `cache` [num_blocks, block_size, H, D] at `slots` (what the
    engine's KV-store kernel does for every layer)."""
    cache.view(-1, *cache.shape[2:])[torch.tensor(slots, dtype=torch.long)] = values


def gather_kv(cache: torch.Tensor, table: BlockTable) -> torch.Tensor:
    """Given: a sequence's keys or values out of the paged `cache`, its blocks in table order, laid end
    to end: [num_tokens, H, D] (what paged attention reads)."""
    blocks = cache[torch.tensor(table.block_ids, dtype=torch.long)]
    return blocks.flatten(0, 1)[:table.num_tokens]
