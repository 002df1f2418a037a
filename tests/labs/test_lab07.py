"""Grades lab 07 (paged KV memory: block allocator, block tables, slot mapping, paged attention, recompute
preemption) in either tree.

    pytest tests/labs/test_lab07.py --impl=labs        # your work
    pytest tests/labs/test_lab07.py --impl=solutions   # the reference answers

The tensor tests store keys and values in a real tensor cache through your slot mappings and read them back
through your block tables: a sequence must get back exactly what it wrote, whatever its neighbours do, and
attention through the tables must equal attention over the same keys kept contiguously (part 4, optional: its
tests are skipped while it is not written). The last tests, run after the others, serve requests with the real
engine, `LLM`, running its paged pool on your allocator and block tables and its preemption on your make_room and
preempt.
"""
import contextlib
import importlib
import random
import re
import sys
import types
from pathlib import Path

import jupytext
import pytest
import torch

import mini_engine as me
from mini_engine import attention, formulas, paging, scheduler
from mini_engine.bench.runs import ServingWorkload
from mini_engine.engine import LLM
from mini_engine.kernels import kv_store, paged_attention as engine_paged_attention

LAB = "lab07_paging"
NOTEBOOK = Path(__file__).resolve().parents[2] / "labs" / "lab07_notebook.py"
# The engine's block manager, attention and scheduler already do these jobs: calling them fails the test.
# The course's formulas (chapter 07's blocks_needed among them) do some of the counting: handing it to them fails too.
SHORTCUTS = {"BlockAllocator": [paging, formulas], "BlockTable": [paging, formulas], "slot_mapping": [paging, formulas],
             "store_kv": [kv_store, paging], "paged_attention": [attention, engine_paged_attention, paging],
             "preempt": [scheduler, paging], "make_room": [scheduler, paging]}


# Part 4, the tensor side, is optional: its tests are skipped while these are not written (and graded once they are).
OPTIONAL = pytest.mark.optional("store_kv", "paged_attention")


def grown(impl, block_size, steps, num_blocks=64):
    """A pool and one table per sequence, grown by `steps`: (sequence index, new tokens) in order."""
    allocator = impl.BlockAllocator(num_blocks)
    tables = [impl.BlockTable(block_size) for _ in range(1 + max(s for s, _ in steps))]
    for seq, n in steps:
        tables[seq].append_tokens(n, allocator)
    return allocator, tables


def test_allocate_hands_out_every_block_once(impl, must_raise):
    pool = impl.BlockAllocator(4)
    assert pool.can_allocate(4) and not pool.can_allocate(5), "can_allocate(n): are n blocks free right now?"
    blocks = [pool.allocate() for _ in range(4)]
    assert sorted(blocks) == [0, 1, 2, 3], f"4 allocations from a pool of 4 must give blocks 0-3 once each, got {blocks}"
    assert blocks == [0, 1, 2, 3], "take blocks from the left of free_blocks (the oldest free block first)"
    assert pool.ref_counts == [1, 1, 1, 1], "a freshly allocated block has exactly one holder: ref count 1"
    assert pool.num_free() == 0 and pool.can_allocate(0) and not pool.can_allocate(1), \
        "with every block taken: num_free() is 0, can_allocate(0) is True and can_allocate(1) False"
    with must_raise(RuntimeError, "allocate() on a pool with no free block must raise RuntimeError saying so "
                                  "(check before you take)"):
        pool.allocate()


def test_free_returns_a_block_to_the_end_of_the_free_list(impl):
    pool = impl.BlockAllocator(3)
    first, second = pool.allocate(), pool.allocate()
    pool.free(first)
    assert pool.ref_counts[first] == 0 and pool.num_free() == 2, "freeing the only holder makes the block free"
    assert list(pool.free_blocks) == [2, first], "a freed block goes to the END of free_blocks (reused last)"
    assert pool.allocate() == 2 and pool.allocate() == first, "allocation order: oldest free block first"
    assert second not in pool.free_blocks, f"block {second} is still held: it must not be in free_blocks"


def test_a_double_free_is_an_error_and_counts_never_go_negative(impl, must_raise):
    pool = impl.BlockAllocator(2)
    block = pool.allocate()
    pool.free(block)
    with must_raise(ValueError, "freeing a block that is already free (a double free) must raise ValueError"):
        pool.free(block)
    assert pool.ref_counts[block] == 0, "a rejected double free must leave the count at 0, not -1"
    assert list(pool.free_blocks).count(block) == 1, "a rejected double free must not list the block twice"


def test_a_shared_block_is_freed_by_its_last_holder(impl, must_raise):
    pool = impl.BlockAllocator(2)
    block = pool.allocate()
    pool.share(block)
    assert pool.ref_counts[block] == 2, "share() adds one holder"
    pool.free(block)
    assert pool.ref_counts[block] == 1 and block not in pool.free_blocks, \
        "with one holder left the block stays in use: do not put it back in free_blocks yet"
    pool.free(block)
    assert pool.ref_counts[block] == 0 and block in pool.free_blocks, "the last holder's free returns it to the pool"
    with must_raise(ValueError, "sharing a free block must raise ValueError (the pool may hand it out any time)"):
        pool.share(block)


def test_random_allocations_and_frees_never_leak(impl):
    rng = random.Random(0)
    pool, held = impl.BlockAllocator(8), []  # held: one entry per holder
    for _ in range(500):
        action = rng.random()
        if action < 0.4 and pool.can_allocate(1):
            held.append(pool.allocate())
        elif action < 0.55 and held:
            block = rng.choice(held)
            pool.share(block)
            held.append(block)
        elif held:
            pool.free(held.pop(rng.randrange(len(held))))
        for b in range(8):
            assert pool.ref_counts[b] == held.count(b), f"block {b}: ref count {pool.ref_counts[b]}, holders {held.count(b)}"
        assert sorted(pool.free_blocks) == [b for b in range(8) if b not in held], \
            "free_blocks must list exactly the blocks nobody holds, each once"


def test_blocks_needed(impl):
    table = impl.BlockTable(4)
    assert [table.blocks_needed(n) for n in (0, 1, 4, 5, 9)] == [0, 1, 1, 2, 3], \
        "an empty table with blocks of 4 needs ceil(n / 4) blocks for n tokens"
    table.block_ids, table.num_tokens = [7, 2], 6
    assert [table.blocks_needed(n) for n in (1, 2, 3, 6)] == [0, 0, 1, 1], \
        "6 tokens in 2 blocks of 4: 2 more fit in the last block; the 3rd needs a new one"


def test_a_new_block_every_block_size_tokens(impl):
    pool = impl.BlockAllocator(16)
    table = impl.BlockTable(4)
    counts = []
    for _ in range(13):  # one decode step at a time
        table.append_tokens(1, pool)
        counts.append(len(table.block_ids))
    assert counts == [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4], \
        f"with blocks of 4, tokens 1, 5, 9 and 13 each start a new block; blocks held after each token: {counts}"
    assert table.num_tokens == 13 and pool.num_free() == 12, \
        f"13 tokens claimed one at a time hold 4 blocks: num_tokens 13 and 12 of 16 free, got {table.num_tokens} " \
        f"and {pool.num_free()}"


def test_one_append_can_cross_several_block_boundaries(impl):
    # A prefill claims a whole prompt at once, a speculative step 1 + k tokens: both can need many blocks.
    pool = impl.BlockAllocator(16)
    table = impl.BlockTable(4)
    assert len(table.append_tokens(10, pool)) == 3, "10 tokens in blocks of 4: 3 new blocks"
    assert len(table.append_tokens(7, pool)) == 2, "17 tokens: 5 blocks, so 2 more (not 1: two boundaries crossed)"
    assert table.num_tokens == 17 and len(table.block_ids) == 5, "after 10 + 7 tokens: num_tokens 17 in 5 blocks"
    assert table.append_tokens(3, pool) == [], "20 tokens still fit in 5 blocks: no new block"


def test_append_is_all_or_nothing(impl, must_raise):
    pool = impl.BlockAllocator(4)
    table = impl.BlockTable(4)
    table.append_tokens(6, pool)  # 2 blocks
    with must_raise(RuntimeError, "claiming 11 more tokens (17 in all: 5 blocks, 3 new) with 2 blocks free must "
                                  "raise RuntimeError"):
        table.append_tokens(11, pool)
    assert pool.num_free() == 2, "a failed append must not keep (or leak) any block it took: check first"
    assert table.num_tokens == 6 and len(table.block_ids) == 2, "a failed append must leave the table unchanged"


def test_slot_of_a_position(impl, must_raise):
    pool = impl.BlockAllocator(8)
    for _ in range(5):
        pool.allocate()  # blocks 0-4 taken by someone else: this table gets 5, 6, 7
    table = impl.BlockTable(4)
    table.append_tokens(10, pool)
    assert table.block_ids == [5, 6, 7], f"blocks 0-4 are taken: 10 tokens get blocks [5, 6, 7], got {table.block_ids}"
    assert [table.slot(p) for p in (0, 3, 4, 9)] == [20, 23, 24, 29], \
        "slot = block_ids[p // block_size] * block_size + p % block_size"
    for position in (10, -1):
        with must_raise(IndexError, f"slot({position}) of a table holding positions 0-9 must raise IndexError"):
            table.slot(position)


def test_release_frees_every_block(impl):
    pool, (a, b) = grown(impl, 4, [(0, 9), (1, 3), (0, 4)], num_blocks=8)
    pool.share(a.block_ids[0])  # another sequence shares a's first block
    a.release(pool)
    assert a.block_ids == [] and a.num_tokens == 0, "release empties the table"
    assert pool.num_free() == 8 - 1 - 1, "all of a's blocks are free again except the shared one (and b's)"
    b.release(pool)
    assert pool.num_free() == 7, "after b's release only the shared block is held: 7 of 8 free"


def test_slot_mapping_of_a_mixed_step(impl):
    # Sequence 0 prefills 6 tokens; sequence 1, which had 4, decodes 1; sequence 2, which had 3, decodes 1.
    pool, tables = grown(impl, 4, [(1, 4), (2, 3)], num_blocks=16)
    for seq, n in ((0, 6), (1, 1), (2, 1)):
        tables[seq].append_tokens(n, pool)
    mapping = impl.slot_mapping(tables, [6, 1, 1])
    expected = [tables[0].slot(p) for p in range(6)] + [tables[1].slot(4), tables[2].slot(3)]
    assert mapping == expected, ("one flat list: each sequence's new positions (its LAST n), sequences in order; "
                                 f"got {mapping}, expected {expected}")
    assert tables[1].block_ids[1] * 4 == mapping[6], "sequence 1's 5th token starts its second block"


def test_interleaved_sequences_never_share_a_slot(impl):
    rng = random.Random(1)
    steps = [(rng.randrange(5), rng.choice([1, 1, 1, 7])) for _ in range(80)]
    _, tables = grown(impl, 8, steps, num_blocks=128)
    slots = [t.slot(p) for t in tables for p in range(t.num_tokens)]
    assert len(slots) == len(set(slots)), "two positions (of one sequence or two) were given the same slot"
    assert all(0 <= s < 128 * 8 for s in slots), "every slot must lie in the pool: 0 <= slot < num_blocks * block_size"


def read_back(cache, table):
    """A sequence's rows of a paged cache, position by position, through its table's slots."""
    return cache.view(-1, *cache.shape[2:])[[table.slot(p) for p in range(table.num_tokens)]]


@OPTIONAL
def test_store_kv_writes_each_row_at_its_slot(impl):
    cache = torch.zeros(4, 4, 2, 3)
    values = torch.arange(3 * 2 * 3, dtype=torch.float32).view(3, 2, 3) + 1
    impl.store_kv(cache, [13, 2, 7], values)
    assert torch.equal(cache[3, 1], values[0]) and torch.equal(cache[0, 2], values[1]) and \
        torch.equal(cache[1, 3], values[2]), "slot s is block s // block_size, offset s % block_size"
    assert int((cache != 0).any(-1).any(-1).sum()) == 3, "write exactly the rows of the given slots, nothing else"


@OPTIONAL
def test_keys_round_trip_through_a_paged_cache(impl):
    """Several sequences grow step by step, interleaved; each step's keys are stored through your slot mapping
    and every sequence is read back through its block table: it must get exactly the keys it wrote."""
    rng, block_size, heads, head_dim = random.Random(2), 4, 2, 8
    pool = impl.BlockAllocator(32)
    tables = [impl.BlockTable(block_size) for _ in range(4)]
    cache = torch.full((32, block_size, heads, head_dim), float("nan"))
    written = [torch.empty(0, heads, head_dim) for _ in tables]
    for step in range(12):
        running = [i for i in range(4) if rng.random() < 0.7] or [0]
        counts = [rng.choice([5, 9]) if tables[i].num_tokens == 0 else 1 for i in running]  # prefill, then decode
        for i, n in zip(running, counts):
            tables[i].append_tokens(n, pool)
        keys = torch.randn(sum(counts), heads, head_dim)
        impl.store_kv(cache, impl.slot_mapping([tables[i] for i in running], counts), keys)
        for i, chunk in zip(running, keys.split(counts)):
            written[i] = torch.cat([written[i], chunk])
    for i, table in enumerate(tables):
        assert torch.equal(read_back(cache, table), written[i]), (
            f"sequence {i} reads back other keys than it wrote: are slot_mapping's slots the table's LAST positions, "
            "in order, and does each new block come from the allocator?")


def dense_attention(q, k, v):
    """Reference: one query per sequence [Hq, D] over contiguous keys and values [n, Hkv, D]."""
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).transpose(0, 1), v.repeat_interleave(group, 1).transpose(0, 1)
    return torch.nn.functional.scaled_dot_product_attention(q[:, None], k, v)[:, 0]


@OPTIONAL
@pytest.mark.parametrize("heads_q, heads_kv", [(4, 4), (6, 2)])
def test_paged_attention_equals_attention_over_contiguous_keys(impl, heads_q, heads_kv):
    gen, block_size, head_dim = torch.Generator().manual_seed(3), 4, 8
    pool = impl.BlockAllocator(40)
    tables = [impl.BlockTable(block_size) for _ in range(3)]
    k_cache = torch.full((40, block_size, heads_kv, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    keys, values = [[] for _ in tables], [[] for _ in tables]
    for step in range(7):  # prefills of 6, 9 and 1 tokens, then decodes, interleaved in one pool
        counts = [(6, 9, 1)[i] if step == 0 else 1 for i in range(3)]
        for table, n in zip(tables, counts):
            table.append_tokens(n, pool)
        k, v = (torch.randn(sum(counts), heads_kv, head_dim, generator=gen) for _ in range(2))
        slots = impl.slot_mapping(tables, counts)
        impl.store_kv(k_cache, slots, k)
        impl.store_kv(v_cache, slots, v)
        for i, (k_i, v_i) in enumerate(zip(k.split(counts), v.split(counts))):
            keys[i].append(k_i)
            values[i].append(v_i)
    q = torch.randn(3, heads_q, head_dim, generator=gen)
    out = impl.paged_attention(q, k_cache, v_cache, tables)
    assert out.shape == q.shape, f"one output row per sequence and query head: expected {tuple(q.shape)}"
    for i in range(3):
        expected = dense_attention(q[i], torch.cat(keys[i]), torch.cat(values[i]))
        error = (out[i] - expected).abs().max().item()
        assert error < 1e-5, (
            f"sequence {i} ({tables[i].num_tokens} tokens in blocks {tables[i].block_ids}): paged attention differs "
            f"from attention over its keys kept contiguously by {error:.2g}. Read its blocks in table order, stop at "
            "num_tokens (rows past it hold NaN here), scale by 1/sqrt(D), and let query head h read KV head "
            "h // (Hq // Hkv)")


@OPTIONAL
def test_paged_attention_returns_the_dtype_it_was_given(impl):
    """bfloat16 queries and caches (a GPU's dtype): the result comes back in bfloat16, computed in fp32."""
    gen = torch.Generator().manual_seed(4)
    _, tables = grown(impl, 4, [(0, 7), (1, 3), (0, 1), (1, 6)], num_blocks=16)
    k_cache, v_cache = (torch.randn(16, 4, 2, 8, generator=gen).bfloat16() for _ in range(2))
    q = torch.randn(2, 6, 8, generator=gen).bfloat16()
    out = impl.paged_attention(q, k_cache, v_cache, tables)
    assert out.dtype == torch.bfloat16, (f"bfloat16 inputs gave {out.dtype} back: return the result in q's dtype "
                                         "(compute in fp32, then convert)")
    for i, table in enumerate(tables):
        k, v = (read_back(c, table).float() for c in (k_cache, v_cache))
        error = (out[i].float() - dense_attention(q[i].float(), k, v)).abs().max().item()
        assert error < 2e-2, (f"sequence {i}: bfloat16 paged attention differs from fp32 attention over the same keys "
                              f"by {error:.2g}: compute the scores, softmax and sum in fp32")


# ---------------------------------------------------------------- recompute preemption

def admitted(impl, pool, specs, block_size=4):
    """Running sequences (in admission order), each with `tokens` positions claimed and computed."""
    running = []
    for seq_id, tokens in enumerate(specs):
        seq = impl.Sequence(seq_id, list(range(tokens)), impl.BlockTable(block_size))
        seq.table.append_tokens(tokens, pool)
        seq.num_computed = tokens
        running.append(seq)
    return running


def test_preempt_gives_everything_back_and_queues_the_sequence_first(impl):
    pool = impl.BlockAllocator(8)
    a, b = admitted(impl, pool, [6, 5])
    pool.share(a.table.block_ids[0])  # someone else also reads a's first block
    late = impl.Sequence(9, [1, 2, 3], impl.BlockTable(4))
    running, waiting = [a, b], [late]
    impl.preempt(a, running, waiting, pool)
    assert running == [b] and waiting == [a, late], \
        "take the sequence out of running and put it FIRST in waiting (it arrived before the others waiting)"
    assert a.table.block_ids == [] and a.table.num_tokens == 0, "its table is emptied: every block given back"
    assert pool.num_free() == 8 - 2 - 1, "its blocks are free again, except the one someone else still holds"
    assert a.num_computed == 0 and a.token_ids == list(range(6)), \
        "it forgets what it computed (it will recompute), but keeps its tokens: prompt and output so far"
    assert a.num_preemptions == 1, "count the preemption"


def test_make_room_preempts_the_latest_admitted_holder(impl):
    pool = impl.BlockAllocator(6)
    a, b, c, d = admitted(impl, pool, [4, 4, 4, 0])  # one block each for a, b, c; d holds none yet
    for _ in range(3):
        pool.allocate()  # the pool is now full: 6 of 6 taken
    running, waiting = [a, b, c, d], []
    assert impl.make_room(a, 1, running, waiting, pool), "a keeps running once a block is free"
    assert waiting == [c] and running == [a, b, d], \
        "the victim is the most recently admitted sequence that holds a block (c: d holds none)"
    assert pool.num_free() == 1, "c's one block is free again"
    assert impl.make_room(a, 1, running, waiting, pool) and waiting == [c], "with room, preempt nobody"
    a.table.append_tokens(1, pool)
    assert impl.make_room(a, 4, running, waiting, pool), "a needs one more block: b goes"
    assert waiting == [b, c] and running == [a, d], \
        f"b, the latest holder left, goes first in waiting: expected waiting [b, c], running [a, d]"


def test_make_room_preempts_nobody_while_the_last_block_has_room(impl):
    pool = impl.BlockAllocator(4)
    a, b = admitted(impl, pool, [5, 4])  # a: 5 positions in 2 blocks (room for 3 more), b: 1 block
    pool.allocate()  # the pool is full
    running, waiting = [a, b], []
    assert impl.make_room(a, 3, running, waiting, pool) is True and waiting == [], (
        "a holds 5 positions in 2 blocks of 4, so 3 more fit in its last block: that claim needs no new block and "
        "preempts nobody, even with no block free. Ask how many blocks THIS claim needs, not whether one is free")


def test_make_room_frees_every_block_a_long_claim_needs(impl):
    pool = impl.BlockAllocator(6)
    a, b, c = admitted(impl, pool, [4, 4, 4])  # one block each: 3 free
    running, waiting = [a, b, c], []
    assert impl.make_room(a, 17, running, waiting, pool) is True and waiting == [b, c], (
        "a claims 17 more positions (21 in all: 6 blocks of 4, 5 of them new) with 3 blocks free: preempt c, then b "
        f"(latest admitted first) until all 5 can be had; got waiting {[s.seq_id for s in waiting]} (ids: b 1, c 2)")
    assert pool.can_allocate(a.table.blocks_needed(17)), "after make_room returns True the whole claim must fit"


@contextlib.contextmanager
def returns_within(what: str, max_lines: int = 200_000):
    """Fail in one line, instead of hanging the grader, when the code in the block runs more than `max_lines`
    lines of Python (an endless loop)."""
    count = 0

    class Endless(BaseException):  # not an Exception: no `except Exception` in the code under test stops it
        pass

    def trace(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
            if count > max_lines:
                raise Endless
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        yield
    except Endless:
        pytest.fail(f"{what} never returned (stopped after {max_lines:,} lines of Python)", pytrace=False)
    finally:
        sys.settrace(previous)


def test_make_room_with_no_block_held_anywhere_says_so(impl, must_raise):
    pool = impl.BlockAllocator(2)
    seq = impl.Sequence(0, [1, 2, 3], impl.BlockTable(4))
    running, waiting = [seq], []
    with returns_within("make_room (a claim larger than the pool, no block held by anyone: preempting frees "
                        "nothing there, so raise RuntimeError)"), \
            must_raise(RuntimeError, "a claim of 9 positions (3 blocks of 4) with 2 free and no block held by any "
                                     "running sequence cannot fit, and preempting frees nothing: make_room must raise "
                                     "RuntimeError saying so"):
        impl.make_room(seq, 9, running, waiting, pool)


def test_make_room_may_preempt_the_sequence_itself(impl):
    pool = impl.BlockAllocator(3)
    a, b = admitted(impl, pool, [4, 8])
    running, waiting = [a, b], []
    assert impl.make_room(a, 1, running, waiting, pool) and waiting == [b], "b, admitted later, goes first"
    b2 = admitted(impl, pool, [8])[0]  # someone else takes the blocks b gave back
    running.insert(0, b2)  # ... and was admitted before a
    assert impl.make_room(a, 9, running, waiting, pool) is False, "a is the latest holder: it preempts itself"
    assert waiting[0] is a and a not in running and a.num_computed == 0, \
        "a preempted itself: it goes first in waiting, out of running, with num_computed 0"


def test_preemption_under_pressure_loses_no_block_and_recomputes_everything(impl):
    """A small scheduler (prefill whole prompts, then decode one token a step) on a pool too small for everyone:
    sequences get preempted, readmitted and recomputed; the books stay right after every step."""
    rng, block_size = random.Random(5), 4
    pool = impl.BlockAllocator(10)
    waiting = [impl.Sequence(i, list(range(rng.randrange(3, 12))), impl.BlockTable(block_size)) for i in range(6)]
    running, target, computed = [], {s.seq_id: len(s.token_ids) + 10 for s in waiting}, {}
    for step in range(200):
        for seq in list(running):  # decode: one new token each, oldest first
            if seq in running and impl.make_room(seq, 1, running, waiting, pool):
                seq.table.append_tokens(1, pool)
                seq.token_ids.append(step)
                seq.num_computed += 1
                computed[seq.seq_id] = computed.get(seq.seq_id, 0) + 1
        for seq in [s for s in running if len(s.token_ids) >= target[s.seq_id]]:
            seq.table.release(pool)
            running.remove(seq)
        while waiting and pool.can_allocate(waiting[0].table.blocks_needed(len(waiting[0].token_ids) + 1)):
            seq = waiting.pop(0)  # (re)admission recomputes prompt and output so far in one prefill
            seq.table.append_tokens(len(seq.token_ids), pool)
            computed[seq.seq_id] = computed.get(seq.seq_id, 0) + len(seq.token_ids) - seq.num_computed
            seq.num_computed = len(seq.token_ids)
            running.append(seq)
        held = sum(len(s.table.block_ids) for s in running)
        assert pool.num_free() + held == 10 and all(not s.table.block_ids for s in waiting), \
            "every block is either free or in exactly one running sequence's table"
        if not running and not waiting:
            break
    assert not running and not waiting, "every sequence finished"
    preempted = [s for s in target if computed[s] > target[s]]
    assert preempted, "the pool is too small: some sequence must have been preempted and recomputed"


# ---------------------------------------------------------------- your block manager in the real engine

def engine_block_manager(impl):
    """The given EngineBlockManager on the (graded) BlockAllocator and BlockTable of `impl`."""
    return type("Graded", (impl.EngineBlockManager,), {"allocator_class": impl.BlockAllocator,
                                                        "table_class": impl.BlockTable,
                                                        "make_room_function": staticmethod(impl.make_room)})


@pytest.mark.engine("6 requests through the real engine on your blocks and your preemption, then on the engine's "
                    "own, to compare")
def test_the_engine_serves_requests_with_your_block_manager(impl, real_model):
    """A pool too small for the requests together: the engine preempts and recomputes, on your blocks and with your
    make_room and preempt, and every output is the one the engine's own block manager gives (greedy ones and seeded
    sampled ones alike)."""
    model, tok = real_model
    work = ServingWorkload.uniform(6, 8, 20, vocab=model.config.vocab_size, seed=3)
    params = [me.SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8 if i % 3 == 0 else 0.0, seed=i)
              for i in range(len(work.prompts))]
    kwargs = dict(num_kv_blocks=9, block_size=8, max_num_seqs=4, enable_prefix_caching=False, chunked_prefill_tokens=32)
    llm = LLM.from_model(model, tok, block_manager=engine_block_manager(impl), **kwargs)
    yours = llm.generate(work.prompts, params, use_tqdm=False)
    own = LLM.from_model(model, tok, **kwargs).generate(work.prompts, params, use_tqdm=False)
    assert [o.token_ids for o in yours] == [o.token_ids for o in own], \
        "the engine on your block manager must give the tokens it gives on its own"
    assert [o.metrics.num_preemptions for o in yours] == [o.metrics.num_preemptions for o in own], \
        "your blocks must run out exactly when the engine's do: take a block only when a position needs one"
    assert sum(o.metrics.num_preemptions for o in own) > 0, "the pool is small enough to preempt"
    blocks = llm.engine.scheduler.blocks
    assert len(blocks.preempted) == sum(o.metrics.num_preemptions for o in yours), \
        "every preemption in the engine must be one your make_room chose"
    assert blocks.allocator.num_free() == 9 and blocks.tables == {}, "every block is back in your pool at the end"


def run_scheduler(manager):
    """The engine's scheduler, with no model: three requests of 4 prompt tokens and 8 new ones each on a pool of 5
    blocks of 4 (9 blocks wanted in all). Every step's chunks, as (request, first position, tokens)."""
    sched = scheduler.Scheduler(scheduler.ContinuousPolicy(), 4, 64, None, manager)
    for i in range(3):
        sched.add(scheduler.Request(i, [i + 1] * 4, me.SamplingParams(max_tokens=8, ignore_eos=True), frozenset(), 0.0))
    steps = []
    while sched.has_unfinished() and len(steps) < 100:
        chunks = sched.schedule(float(len(steps)))
        steps.append([(c.request.request_id, c.start, c.num_tokens) for c in chunks])
        sched.update(chunks, [7] * len(sched.samplers(chunks)), float(len(steps)))
    return steps, sched.num_preemptions


def test_the_engines_scheduler_preempts_with_your_make_room(impl):
    """The engine's scheduler on your blocks: when a request finds no room, its hook asks your make_room whom to
    preempt (your preempt gives the blocks back); every step must run what it runs on the engine's own."""
    manager = engine_block_manager(impl)(5, 4)
    yours, preempted = run_scheduler(manager)
    own, engine_preempted = run_scheduler(paging.BlockManager(5, 4))
    assert engine_preempted > 0 and manager.preempted, "the pool is small enough to preempt, through your make_room"
    assert (yours, preempted) == (own, engine_preempted), (
        f"with your make_room the scheduler preempted {preempted} times, on its own {engine_preempted}; the first "
        f"step that differs: {next(((i, a, b) for i, (a, b) in enumerate(zip(yours, own)) if a != b), None)} "
        "(step, yours, the engine's: (request, first position, tokens)). Preempt the latest admitted holder")
    assert manager.allocator.num_free() == 5 and manager.tables == {}, "every block is back in your pool at the end"


@pytest.mark.engine("lab 07's notebook, every section but its grader, on the reference solution")
def test_the_notebook_serves_requests_with_the_students_preemption(reference, capsys):
    """The lab notebook as a student who finished the lab runs it (the solution in place of labs/): its sections,
    the real engine on the student's blocks and preemption included, print what they promise."""
    cells = [c.source for c in jupytext.read(NOTEBOOK).cells if c.cell_type == "code"]
    namespace = {"__name__": "lab07_notebook"}
    for source in cells[:-1]:  # all but the grader (the Colab setup does nothing here)
        exec(compile(source, str(NOTEBOOK), "exec"), namespace)
        namespace["lab"] = reference  # in place of `import labs.lab07_paging as lab`
    shown = capsys.readouterr().out
    assert "not implemented yet" not in shown, shown
    for line in ("paged attention equals contiguous attention: True", "every output equals the engine's own: True",
                 "blocks free in your pool afterwards: 12 of 12",
                 "your paged attention reads the engine's real keys and values: True"):
        assert line in shown, f"the notebook does not print {line!r}:\n{shown}"
    preempted = re.search(r"requests your make_room preempted, in order: (\[.*\])", shown)
    assert preempted and eval(preempted.group(1)), f"the student's make_room chose no preemption:\n{shown}"


# ---------------------------------------------------------------- the guards (see conftest.py)

solution = importlib.import_module(f"solutions.{LAB}")  # what a hand-off may build on besides the engine


def engine_view(allocator, **tables):
    """The engine's block manager's fields, over the allocator's own free list and counts."""
    return types.SimpleNamespace(free_blocks=allocator.free_blocks, ref_counts=allocator.ref_counts,
                                 evictable={}, block_tables=tables, seq_hashes={},
                                 block_hash=[None] * len(allocator.ref_counts))


class CanAllocateByTheEngine(solution.BlockAllocator):
    def can_allocate(self, num_blocks):
        return num_blocks <= paging.BlockManager.num_free_blocks.fget(engine_view(self))


class AllocateByTheEngine(solution.BlockAllocator):
    def allocate(self):  # the engine's block manager takes blocks from the same two fields
        return paging.BlockManager._take_block(self)


class ShareByTheEngine(solution.BlockAllocator):
    def share(self, block_id):
        if self.ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is free")
        paging.BlockManager.fork(engine_view(self, owner=[block_id]), "owner", "sharer")


class FreeByTheEngine(solution.BlockAllocator):
    def free(self, block_id):
        if self.ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is already free")
        paging.BlockManager.free(engine_view(self, seq=[block_id]), "seq")


class BlocksNeededByTheEngine(solution.BlockTable):
    def blocks_needed(self, num_new_tokens):
        return paging.BlockManager.blocks_for(self, self.num_tokens + num_new_tokens) - len(self.block_ids)


class BlocksNeededByTheFormulas(solution.BlockTable):
    def blocks_needed(self, num_new_tokens):  # chapter 07's exercise shows this function
        return int(formulas.blocks_needed(self.num_tokens + num_new_tokens, self.block_size)) - len(self.block_ids)


class AppendByTheEngine(solution.BlockTable):
    def append_tokens(self, num_new_tokens, allocator):
        view = engine_view(allocator, seq=self.block_ids)
        view.num_blocks, view.block_size = allocator.num_blocks, self.block_size
        view.num_free_blocks = allocator.num_free()
        for name in ("blocks_for", "block_table", "num_new_blocks", "can_allocate", "_check_room", "_take_block"):
            setattr(view, name, getattr(paging.BlockManager, name).__get__(view))
        before = len(self.block_ids)
        paging.BlockManager.append_slots(view, "seq", self.num_tokens + num_new_tokens)
        self.num_tokens += num_new_tokens
        return self.block_ids[before:]


class SlotByTheEngine(solution.BlockTable):
    def slot(self, position):
        if not 0 <= position < self.num_tokens:
            raise IndexError(position)
        return paging.slot_mapping(self.block_ids, position, position + 1, self.block_size)[0]


class ReleaseByTheEngine(solution.BlockTable):
    def release(self, allocator):
        paging.BlockManager.free(engine_view(allocator, seq=self.block_ids), "seq")
        self.block_ids, self.num_tokens = [], 0


def slot_mapping_by_the_engine(tables, num_new_tokens):
    return [slot for t, n in zip(tables, num_new_tokens)
            for slot in paging.slot_mapping(t.block_ids, t.num_tokens - n, t.num_tokens, t.block_size)]


def paged_attention_by_the_engine(q, k_cache, v_cache, tables):
    width = max(len(t.block_ids) for t in tables)
    block_tables = torch.tensor([t.block_ids + [0] * (width - len(t.block_ids)) for t in tables], dtype=torch.int32)
    context_lens = torch.tensor([t.num_tokens for t in tables], dtype=torch.int32)
    return engine_paged_attention.paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens)


def preempt_by_the_engine(seq, running, waiting, allocator):
    """The engine's scheduler does the bookkeeping, on a stand-in for itself."""
    def release(r):
        running.remove(r)
        r.table.release(allocator)
    seq.status, seq.spec_token_ids = scheduler.RequestStatus.RUNNING, []
    scheduler.Scheduler.preempt(types.SimpleNamespace(waiting=waiting, num_preemptions=0, _release=release), seq)


def make_room_by_the_engine(seq, num_new_tokens, running, waiting, allocator):
    """The solution's loop, but the engine's block manager counts the blocks needed."""
    while (paging.BlockManager.blocks_for(seq.table, seq.table.num_tokens + num_new_tokens)
           - len(seq.table.block_ids) > allocator.num_free()):
        victim = next(v for v in reversed(running) if v is seq or v.table.block_ids)
        solution.preempt(victim, running, waiting, allocator)
        if victim is seq:
            return False
    return True


# Each part of the lab handed to something that already does it, and a grading test that must fail it.
HAND_OFFS = [
    ("BlockAllocator.can_allocate", CanAllocateByTheEngine, test_allocate_hands_out_every_block_once, {}),
    ("BlockAllocator.allocate", AllocateByTheEngine, test_allocate_hands_out_every_block_once, {}),
    ("BlockAllocator.share", ShareByTheEngine, test_a_shared_block_is_freed_by_its_last_holder, {}),
    ("BlockAllocator.free", FreeByTheEngine, test_free_returns_a_block_to_the_end_of_the_free_list, {}),
    ("BlockTable.blocks_needed", BlocksNeededByTheEngine, test_blocks_needed, {}),
    ("BlockTable.blocks_needed", BlocksNeededByTheFormulas, test_blocks_needed, {}),
    ("BlockTable.append_tokens", AppendByTheEngine, test_a_new_block_every_block_size_tokens, {}),
    ("BlockTable.slot", SlotByTheEngine, test_slot_of_a_position, {}),
    ("BlockTable.release", ReleaseByTheEngine, test_release_frees_every_block, {}),
    ("slot_mapping", slot_mapping_by_the_engine, test_slot_mapping_of_a_mixed_step, {}),
    ("store_kv", lambda cache, slots, values: kv_store.store_kv_cache_reference(
        values, values, cache, cache, torch.tensor(slots)), test_store_kv_writes_each_row_at_its_slot, {}),
    ("paged_attention", paged_attention_by_the_engine, test_paged_attention_equals_attention_over_contiguous_keys,
     {"heads_q": 6, "heads_kv": 2}),
    ("preempt", preempt_by_the_engine, test_preempt_gives_everything_back_and_queues_the_sequence_first, {}),
    ("make_room", make_room_by_the_engine, test_make_room_preempts_the_latest_admitted_holder, {}),
]


def test_every_part_of_the_lab_has_a_hand_off_check(asked_for):
    missing = set(asked_for(LAB)) - {part for part, *_ in HAND_OFFS}
    assert not missing, f"parts of the lab with no hand-off check above: {sorted(missing)}"


@pytest.mark.parametrize("part,replacement,test,args", HAND_OFFS,
                         ids=[f"{part}-{i}" for i, (part, *_) in enumerate(HAND_OFFS)])
def test_the_grader_fails_a_part_handed_off(hand_off, part, replacement, test, args):
    hand_off(part, replacement, test, **args)


# ---------------------------------------------------------------- wrong answers, and the one line each prints

class AllocateWithoutACheck(solution.BlockAllocator):
    def allocate(self):
        block = self.free_blocks.popleft()
        self.ref_counts[block] = 1
        return block


class FreeWithoutACheck(solution.BlockAllocator):
    def free(self, block_id):
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_blocks.append(block_id)


def make_room_while_no_block_is_free(seq, num_new_tokens, running, waiting, allocator):
    """Asks whether one block is free, not whether this claim fits."""
    while not allocator.can_allocate(1):
        victim = next(v for v in reversed(running) if v is seq or v.table.block_ids)
        solution.preempt(victim, running, waiting, allocator)
        if victim is seq:
            return False
    return True


def make_room_skipping_empty_victims(seq, num_new_tokens, running, waiting, allocator):
    """Preempts only holders of blocks, and waits for one to appear when there is none: forever."""
    while not allocator.can_allocate(seq.table.blocks_needed(num_new_tokens)):
        holders = [v for v in running if v.table.block_ids]
        if holders:
            solution.preempt(holders[-1], running, waiting, allocator)
            if holders[-1] is seq:
                return False
    return True


def make_room_preempting_for_nothing(seq, num_new_tokens, running, waiting, allocator):
    """Preempts `seq` itself though that frees nothing, and says False: the caller would requeue it forever."""
    while not allocator.can_allocate(seq.table.blocks_needed(num_new_tokens)):
        victim = next(v for v in reversed(running) if v is seq or v.table.block_ids)
        solution.preempt(victim, running, waiting, allocator)
        if victim is seq:
            return False
    return True


PREEMPT_WITHOUT_COUNTING = """
def preempt(seq, running, waiting, allocator):
    seq.table.release(allocator)
    seq.num_computed = 0
    running.remove(seq)
    waiting.insert(0, seq)
"""  # as source: the solution's make_room, which the engine's hook runs, then calls it


def paged_attention_in_fp32(q, k_cache, v_cache, tables):
    return solution.paged_attention(q.float(), k_cache.float(), v_cache.float(), tables)


# A wrong part, a grading test, and the one line that test must print for it (a regular expression).
WRONG_ANSWERS = [
    ({"BlockAllocator": AllocateWithoutACheck}, test_allocate_hands_out_every_block_once,
     r"allocate\(\) on a pool with no free block must raise RuntimeError saying so \(check before you take\); "
     r"yours raised IndexError: pop from an empty deque"),
    ({"BlockAllocator": FreeWithoutACheck}, test_a_double_free_is_an_error_and_counts_never_go_negative,
     r"freeing a block that is already free \(a double free\) must raise ValueError; yours raised nothing"),
    ({"make_room": make_room_while_no_block_is_free}, test_make_room_preempts_nobody_while_the_last_block_has_room,
     r"a holds 5 positions in 2 blocks of 4, so 3 more fit in its last block: .* Ask how many blocks THIS claim "
     r"needs, not whether one is free"),
    ({"make_room": make_room_while_no_block_is_free}, test_make_room_frees_every_block_a_long_claim_needs,
     r"a claims 17 more positions .* until all 5 can be had; got waiting \[\] .*"),
    ({"make_room": make_room_skipping_empty_victims}, test_make_room_with_no_block_held_anywhere_says_so,
     r"make_room \(a claim larger than the pool, .*\) never returned \(stopped after 200,000 lines of Python\)"),
    ({"make_room": make_room_preempting_for_nothing}, test_make_room_with_no_block_held_anywhere_says_so,
     r"a claim of 9 positions .* make_room must raise RuntimeError saying so; yours raised nothing"),
    ({"paged_attention": paged_attention_in_fp32}, test_paged_attention_returns_the_dtype_it_was_given,
     r"bfloat16 inputs gave torch.float32 back: return the result in q's dtype \(compute in fp32, then convert\)"),
    ({"preempt": PREEMPT_WITHOUT_COUNTING}, test_the_engines_scheduler_preempts_with_your_make_room,
     r"RuntimeError: your preempt of request \d left it holding blocks \[\], num_computed 0, num_preemptions 0 "
     r"\(was 0\): see preempt's docstring \(raised at \S*lab07_paging\S*:\d+ in make_room\(\)\)"),
]


@pytest.mark.parametrize("replacements,test,line", WRONG_ANSWERS,
                         ids=[f"{t.__name__.removeprefix('test_')}-{i}" for i, (_, t, _) in enumerate(WRONG_ANSWERS)])
def test_a_wrong_answer_fails_with_one_line_that_says_what_to_fix(wrong_answer, replacements, test, line):
    wrong_answer(test, replacements, line)
