"""Grades lab 07 (paged KV memory: block allocator, block tables, slot mapping) in either tree.

    pytest tests/labs/test_lab07.py --impl=labs        # your work
    pytest tests/labs/test_lab07.py --impl=solutions   # the reference answers

The last tests store keys and values in a real tensor cache through your slot mappings and read them
back through your block tables: a sequence must get back exactly what it wrote, whatever its neighbours do.
"""
import random

import pytest
import torch

LAB = "lab07_paging"


def grown(impl, block_size, steps, num_blocks=64):
    """A pool and one table per sequence, grown by `steps`: (sequence index, new tokens) in order."""
    allocator = impl.BlockAllocator(num_blocks)
    tables = [impl.BlockTable(block_size) for _ in range(1 + max(s for s, _ in steps))]
    for seq, n in steps:
        tables[seq].append_tokens(n, allocator)
    return allocator, tables


def test_allocate_hands_out_every_block_once(impl):
    pool = impl.BlockAllocator(4)
    assert pool.can_allocate(4) and not pool.can_allocate(5), "can_allocate(n): are n blocks free right now?"
    blocks = [pool.allocate() for _ in range(4)]
    assert sorted(blocks) == [0, 1, 2, 3], f"4 allocations from a pool of 4 must give blocks 0-3 once each, got {blocks}"
    assert blocks == [0, 1, 2, 3], "take blocks from the left of free_blocks (the oldest free block first)"
    assert pool.ref_counts == [1, 1, 1, 1], "a freshly allocated block has exactly one holder: ref count 1"
    assert pool.num_free() == 0 and pool.can_allocate(0) and not pool.can_allocate(1)
    with pytest.raises(RuntimeError):
        pool.allocate()  # "allocate from an empty pool must raise RuntimeError"


def test_free_returns_a_block_to_the_end_of_the_free_list(impl):
    pool = impl.BlockAllocator(3)
    first, second = pool.allocate(), pool.allocate()
    pool.free(first)
    assert pool.ref_counts[first] == 0 and pool.num_free() == 2, "freeing the only holder makes the block free"
    assert list(pool.free_blocks) == [2, first], "a freed block goes to the END of free_blocks (reused last)"
    assert pool.allocate() == 2 and pool.allocate() == first, "allocation order: oldest free block first"
    assert second not in pool.free_blocks


def test_a_double_free_is_an_error_and_counts_never_go_negative(impl):
    pool = impl.BlockAllocator(2)
    block = pool.allocate()
    pool.free(block)
    with pytest.raises(ValueError):
        pool.free(block)  # freeing a free block must raise ValueError
    assert pool.ref_counts[block] == 0, "a rejected double free must leave the count at 0, not -1"
    assert list(pool.free_blocks).count(block) == 1, "a rejected double free must not list the block twice"


def test_a_shared_block_is_freed_by_its_last_holder(impl):
    pool = impl.BlockAllocator(2)
    block = pool.allocate()
    pool.share(block)
    assert pool.ref_counts[block] == 2, "share() adds one holder"
    pool.free(block)
    assert pool.ref_counts[block] == 1 and block not in pool.free_blocks, \
        "with one holder left the block stays in use: do not put it back in free_blocks yet"
    pool.free(block)
    assert pool.ref_counts[block] == 0 and block in pool.free_blocks, "the last holder's free returns it to the pool"
    with pytest.raises(ValueError):
        pool.share(block)  # sharing a free block must raise ValueError


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
    assert table.num_tokens == 13 and pool.num_free() == 12


def test_one_append_can_cross_several_block_boundaries(impl):
    # A prefill claims a whole prompt at once, a speculative step 1 + k tokens: both can need many blocks.
    pool = impl.BlockAllocator(16)
    table = impl.BlockTable(4)
    assert len(table.append_tokens(10, pool)) == 3, "10 tokens in blocks of 4: 3 new blocks"
    assert len(table.append_tokens(7, pool)) == 2, "17 tokens: 5 blocks, so 2 more (not 1: two boundaries crossed)"
    assert table.num_tokens == 17 and len(table.block_ids) == 5
    assert table.append_tokens(3, pool) == [], "20 tokens still fit in 5 blocks: no new block"


def test_append_is_all_or_nothing(impl):
    pool = impl.BlockAllocator(4)
    table = impl.BlockTable(4)
    table.append_tokens(6, pool)  # 2 blocks
    with pytest.raises(RuntimeError):
        table.append_tokens(11, pool)  # 17 tokens need 5 blocks: 3 more, 2 free: must raise RuntimeError
    assert pool.num_free() == 2, "a failed append must not keep (or leak) any block it took: check first"
    assert table.num_tokens == 6 and len(table.block_ids) == 2, "a failed append must leave the table unchanged"


def test_slot_of_a_position(impl):
    pool = impl.BlockAllocator(8)
    for _ in range(5):
        pool.allocate()  # blocks 0-4 taken by someone else: this table gets 5, 6, 7
    table = impl.BlockTable(4)
    table.append_tokens(10, pool)
    assert table.block_ids == [5, 6, 7]
    assert [table.slot(p) for p in (0, 3, 4, 9)] == [20, 23, 24, 29], \
        "slot = block_ids[p // block_size] * block_size + p % block_size"
    for position in (10, -1):
        with pytest.raises(IndexError):
            table.slot(position)  # positions outside [0, num_tokens) must raise IndexError


def test_release_frees_every_block(impl):
    pool, (a, b) = grown(impl, 4, [(0, 9), (1, 3), (0, 4)], num_blocks=8)
    pool.share(a.block_ids[0])  # another sequence shares a's first block
    a.release(pool)
    assert a.block_ids == [] and a.num_tokens == 0, "release empties the table"
    assert pool.num_free() == 8 - 1 - 1, "all of a's blocks are free again except the shared one (and b's)"
    b.release(pool)
    assert pool.num_free() == 7


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
    assert all(0 <= s < 128 * 8 for s in slots)


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
        assert torch.equal(impl.gather_kv(cache, table), written[i]), (
            f"sequence {i} reads back other keys than it wrote: are slot_mapping's slots the table's LAST positions, "
            "in order, and does each new block come from the allocator?")
