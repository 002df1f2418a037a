"""Lab 07: paged KV memory, the bookkeeping and the attention behind PagedAttention.

A contiguous KV cache reserves max_model_len slots for every request up front. A paged cache instead
cuts one pool into blocks of `block_size` token slots and gives a sequence a new block only when it
needs one, as an operating system hands out memory pages. You write the pieces that make it work:
  1. `BlockAllocator`: the pool's free list and a reference count per block (a block two sequences
     share, such as a common prompt prefix, returns to the pool only when both let go of it);
  2. `BlockTable`: one sequence's blocks in order; appending tokens takes a new block every block_size
     tokens, and position p lives in block block_ids[p // block_size] at offset p % block_size;
  3. `slot_mapping`: for one engine step, where each new token's key and value go in the pool:
     slot = block_id * block_size + offset;
  4. `store_kv` and `paged_attention`: the tensor side. Write a step's keys and values through the slot
     mapping, and let each sequence's query attend to its context read back through its block table;
  5. `preempt` and `make_room`: when a sequence needs a block and none is free, the most recently admitted
     sequence gives all of its blocks back and later recomputes them (recompute preemption).

Parts 1, 2, 3 and 5 are the lab: a week's work. Part 4, the tensor side, is OPTIONAL (marked so below): the
grader skips its tests while `store_kv` and `paged_attention` are not written, and grades them once they are.

Fill in every function marked TODO in labs/lab07_paging.py, then grade your work with

    pytest tests/labs/test_lab07.py --impl=labs

The bookkeeping is pure Python, like the engine's own block manager. `EngineBlockManager` (given) runs the
engine's pool on your allocator and block tables, and its preemption on your `make_room` and `preempt`: the
lab notebook ends by serving requests with the real engine, `LLM(..., block_manager=EngineBlockManager)`, and
checks they come out as with the engine's own.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from mini_engine import paging


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
        # TODO: what does the pool hold right now?
        raise NotImplementedError("lab07 can_allocate: not written yet (see its docstring)")

    def allocate(self) -> int:
        """Take the oldest free block, give it one holder (ref count 1) and return its id.
        Raises RuntimeError when no block is free."""
        # TODO: think about which end of free_blocks is the oldest, and what a taken block's count must say.
        raise NotImplementedError("lab07 allocate: not written yet (see its docstring)")

    def share(self, block_id: int) -> None:
        """Add a holder to a block in use (a second sequence reading the same prefix).
        Raises ValueError for a free block: sharing one would hand out memory the pool may give away."""
        # TODO: what makes sharing a block unsafe, and what records one more holder?
        raise NotImplementedError("lab07 share: not written yet (see its docstring)")

    def free(self, block_id: int) -> None:
        """Drop one holder; the block returns to the end of `free_blocks` when its last holder lets go.
        Raises ValueError for a block that is already free (a double free), leaving its count at 0."""
        # TODO: think about a shared block (when does it really become free?) and about a double free (check
        #       before you change anything).
        raise NotImplementedError("lab07 free: not written yet (see its docstring)")


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
        # TODO: how many blocks do num_tokens + num_new_tokens positions fill, and how many do you hold already?
        #       Mind the rounding: 5 positions in blocks of 4 fill 2 blocks.
        raise NotImplementedError("lab07 blocks_needed: not written yet (see its docstring)")

    def append_tokens(self, num_new_tokens: int, allocator: BlockAllocator) -> list[int]:
        """Claim `num_new_tokens` more positions (a prompt at prefill, 1 at decode, 1 + k when speculating),
        allocating the new blocks they need from `allocator`. All or nothing: when the pool cannot supply
        every block, raise RuntimeError having taken none and changed nothing. Returns the new block ids."""
        # TODO: "all or nothing": what must you know before you take the first block?
        raise NotImplementedError("lab07 append_tokens: not written yet (see its docstring)")

    def slot(self, position: int) -> int:
        """The pool slot of a claimed position: block_id * block_size + offset.
        Raises IndexError for a position outside [0, num_tokens)."""
        # TODO: the class docstring says where position p lives; the module docstring how that becomes a slot.
        raise NotImplementedError("lab07 slot: not written yet (see its docstring)")

    def release(self, allocator: BlockAllocator) -> None:
        """The sequence is finished (or preempted): free every block it holds and empty the table."""
        # TODO: every block goes back through the allocator (which knows about shared blocks); then the table is
        #       as new.
        raise NotImplementedError("lab07 release: not written yet (see its docstring)")


def slot_mapping(tables: list[BlockTable], num_new_tokens: list[int]) -> list[int]:
    """One step's slot mapping, the packed list the KV-store kernel reads: for each sequence in order, the
    slots of its last `num_new_tokens[i]` positions (the tokens this step computes, already claimed with
    `append_tokens`), oldest first."""
    # TODO: which positions does a step compute for a sequence that has claimed num_tokens, n of them new?
    raise NotImplementedError("lab07 slot_mapping: not written yet (see its docstring)")


def store_kv(cache: torch.Tensor, slots: list[int], values: torch.Tensor) -> None:
    """OPTIONAL (part 4). Write one step's keys (or values) into the paged `cache` [num_blocks, block_size, H, D]:
    row t of `values` [T, H, D] goes to slot slots[t], that is block slots[t] // block_size at offset
    slots[t] % block_size (what the engine's KV-store kernel does in every layer at every step)."""
    # TODO: a slot names a block and an offset in it. Tensor indexing can write many rows at once.
    raise NotImplementedError("lab07 store_kv: not written yet (see its docstring)")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    tables: list[BlockTable]) -> torch.Tensor:
    """OPTIONAL (part 4). Decode attention through block tables: each sequence's one new query attends to its
    whole context, read out of the paged pool through the sequence's block table.

    q [S, Hq, D]: one query per sequence; k_cache, v_cache [num_blocks, block_size, Hkv, D]; tables[s]: the
    BlockTable of sequence s, whose first num_tokens positions are its context (the newest token's key and
    value included: `store_kv` wrote them before attention runs). Grouped-query attention: Hq is a multiple of
    Hkv, and query head h reads KV head h // (Hq // Hkv). Returns [S, Hq, D] in q's dtype: for each sequence
    and head, softmax(q · kᵀ / √D) · v over the context, computed in fp32."""
    # TODO: for each sequence, gather its context's keys and values: its blocks, in table order, laid end to end,
    #       then cut to num_tokens (the last block is rarely full). Then ordinary attention for one query; think
    #       about how the Hq query heads meet the Hkv key heads. torch.einsum or matmul, softmax on the last axis.
    raise NotImplementedError("lab07 paged_attention: not written yet (see its docstring)")


@dataclass
class Sequence:
    """Given: one request as a scheduler sees it. `token_ids`: its prompt and its output so far; `num_computed`:
    how many of them have their keys and values in the cache (its next chunk runs the rest); `table`: its
    blocks; `num_preemptions`: how often it was preempted."""
    seq_id: int
    token_ids: list[int]
    table: BlockTable
    num_computed: int = 0
    num_preemptions: int = 0


def preempt(seq: Sequence, running: list[Sequence], waiting: list[Sequence], allocator: BlockAllocator) -> None:
    """Recompute preemption of a running sequence, so that its blocks can serve the others: its keys and values
    are dropped, not saved anywhere. Give every block back, forget what it had computed (once readmitted it
    recomputes its prompt and its output so far, all in one prefill), move it from `running` to the FRONT of
    `waiting` (it arrived before anyone still waiting) and count the preemption."""
    # TODO: five pieces of bookkeeping, all in the docstring. Which of your BlockTable methods gives blocks back?
    raise NotImplementedError("lab07 preempt: not written yet (see its docstring)")


def make_room(seq: Sequence, num_new_tokens: int, running: list[Sequence], waiting: list[Sequence],
              allocator: BlockAllocator) -> bool:
    """Before the running `seq` claims `num_new_tokens` more positions: while the pool cannot supply the blocks
    that claim takes (none while its last block has room; several for a long claim), preempt the most recently
    admitted running sequence that holds any block (`running` is in admission order); that may be `seq` itself,
    and is, once no sequence admitted after it holds a block. Returns True when `seq` can now claim its
    positions, False when it was preempted itself. A pool with room preempts nobody. When no running sequence
    holds a block at all, preempting frees nothing: raise RuntimeError saying that the claim cannot fit."""
    # TODO: which sequence is the victim when several hold blocks, and when must you stop? A victim that holds no
    #       block frees nothing. Your BlockTable and BlockAllocator already answer "is there room for THIS claim?".
    raise NotImplementedError("lab07 make_room: not written yet (see its docstring)")


class EngineBlockManager(paging.BlockManager):
    """Given: the engine's block manager (mini_engine/paging.py) running on your BlockAllocator and BlockTables,
    and its preemption on your make_room and preempt, for `LLM(..., block_manager=EngineBlockManager,
    enable_prefix_caching=False)`. The engine reads your pool (`free_blocks`, `ref_counts`) and each request's
    `block_ids`; a request's blocks come from your `append_tokens`, and a finished request gives them back through
    your `release`. When a request finds no room for its next token, the engine calls `make_room` below (its hook,
    `Scheduler._make_room`): your make_room picks the victims and your preempt gives their blocks back. Prefix
    caching (lab 08), parallel sampling and speculative rollback need more than lab 07 builds: they are refused."""
    allocator_class = BlockAllocator
    table_class = BlockTable
    make_room_function = staticmethod(make_room)  # the grader swaps in your functions under its watch

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if enable_prefix_caching:
            raise ValueError("enable_prefix_caching: lab 07's block manager has no prefix cache (that is lab 08); "
                             "pass enable_prefix_caching=False")
        super().__init__(num_blocks, block_size)
        self.allocator = self.allocator_class(num_blocks)
        self.free_blocks, self.ref_counts = self.allocator.free_blocks, self.allocator.ref_counts
        self.tables: dict = {}  # request id -> its BlockTable
        self.preempted: list = []  # the request ids your make_room preempted, in order

    def allocate_cached(self, seq_id, token_ids) -> int:
        """Admission: an empty table (nothing is cached in lab 07)."""
        self.tables[seq_id] = self.table_class(self.block_size)
        self.block_tables[seq_id] = []
        return 0

    def allocate(self, seq_id, num_tokens: int) -> list[int]:
        """A new table holding `num_tokens` positions."""
        self.allocate_cached(seq_id, ())
        return self.append_slots(seq_id, num_tokens)

    def append_slots(self, seq_id, num_tokens: int) -> list[int]:
        """Grow the request's table to hold `num_tokens` positions in all."""
        table = self.tables[seq_id]
        table.append_tokens(num_tokens - table.num_tokens, self.allocator)
        self.block_tables[seq_id] = list(table.block_ids)
        return self.block_tables[seq_id]

    def free(self, seq_id) -> None:
        """The request finished or was preempted: all its blocks go back to your pool."""
        self.tables.pop(seq_id).release(self.allocator)
        del self.block_tables[seq_id]

    def slot_mapping(self, seq_id, start: int, end: int) -> list[int]:
        """The slots of positions start .. end - 1, from your table."""
        return [self.tables[seq_id].slot(p) for p in range(start, end)]

    def fork(self, parent_id, child_id) -> list[int]:
        """Parallel sampling's shared blocks: not part of lab 07."""
        raise ValueError("n: lab 07's block manager does not share blocks between samples; use n=1")

    def trim(self, seq_id, num_tokens: int) -> int:
        """Speculative rollback: not part of lab 07."""
        raise ValueError("speculative: lab 07's block manager does not roll drafts back; run without speculation")

    def make_room(self, scheduler, request) -> None:
        """The engine's preemption hook, called when `request` has no room for its next token: your make_room runs
        on the running requests (seen as Sequences with your tables), then the engine preempts your victims from
        its own queue (their slots and status) in the order your preempt queued them."""
        engine_requests = {r.request_id: r for r in scheduler.running}
        seqs = {i: Sequence(i, r.tokens, self.tables[i], r.num_computed, r.num_preemptions)
                for i, r in engine_requests.items()}
        running, waiting = list(seqs.values()), []
        kept = self.make_room_function(seqs[request.request_id], 1, running, waiting, self.allocator)
        if {s.seq_id for s in waiting} != set(seqs) - {s.seq_id for s in running}:
            raise RuntimeError("preempt must move each victim from running to waiting; after your make_room, running "
                               f"holds {[s.seq_id for s in running]} and waiting {[s.seq_id for s in waiting]}")
        for seq in reversed(waiting):  # your preempt queued each victim first: the first preempted is last
            r = engine_requests[seq.seq_id]
            if seq.table.block_ids or seq.num_computed or seq.num_preemptions != r.num_preemptions + 1:
                raise RuntimeError(f"your preempt of request {r.request_id} left it holding blocks "
                                   f"{seq.table.block_ids}, num_computed {seq.num_computed}, num_preemptions "
                                   f"{seq.num_preemptions} (was {r.num_preemptions}): see preempt's docstring")
            scheduler.preempt(r)
            self.preempted.append(r.request_id)
        seq = seqs[request.request_id]
        stays = seq in running
        if kept is not stays or stays and not self.allocator.can_allocate(seq.table.blocks_needed(1)):
            raise RuntimeError(f"your make_room returned {kept} for request {request.request_id}, which "
                               f"{'is still running' if stays else 'it preempted'} with {self.allocator.num_free()} "
                               "blocks free: True means it can now claim its next position, False that it went")
