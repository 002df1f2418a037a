"""The block allocator on its own (pure Python): examples, then a hypothesis state machine that runs random
sequences of allocate / append / free / preempt-and-readmit and checks the pool's invariants after each; and
the same for parallel sampling (fork, copy-on-write), with a model of every block's contents."""
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mini_engine.paging import BlockManager
from tests.engine.block_checks import record_write


def test_blocks_are_taken_as_positions_are_needed():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 5) == [0, 1], "5 positions fill one block and start a second"
    assert bm.append_slots("a", 8) == [0, 1], "positions 6-8 fit in the second block"
    assert bm.append_slots("a", 9) == [0, 1, 2], "the ninth position needs a third block"
    assert bm.allocate("b", 1) == [3]
    assert bm.num_free_blocks == 4 and bm.ref_counts[:5] == [1, 1, 1, 1, 0]


def test_a_multi_token_append_crosses_several_blocks():
    """A step that adds several tokens (a prompt chunk, or 1 + k speculative tokens) takes every block it
    crosses into, not one per step."""
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", 3)
    assert bm.num_new_blocks("a", 3 + 6) == 2
    assert bm.append_slots("a", 9) == [0, 1, 2]
    assert bm.slot_mapping("a", 2, 9) == [2, 3, 4, 5, 6, 7, 8]


def test_slot_mapping_follows_the_block_table():
    bm = BlockManager(num_blocks=6, block_size=4)
    bm.allocate("x", 4)   # block 0
    bm.allocate("y", 4)   # block 1
    bm.append_slots("x", 6)  # block 2: x's positions 4 and 5
    assert bm.block_table("x") == [0, 2]
    assert bm.slot_mapping("x", 0, 6) == [0, 1, 2, 3, 8, 9], "slot = block_table[p // 4] * 4 + p % 4"
    with pytest.raises(ValueError, match="need 3 blocks; the block table holds 2"):
        bm.slot_mapping("x", 0, 9)


def test_freed_blocks_return_to_the_back_of_the_free_list():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 4)   # blocks 0, 1
    bm.allocate("b", 2)   # block 2
    bm.free("a")
    assert list(bm.free_blocks) == [3, 0, 1] and bm.ref_counts == [0, 0, 1, 0]
    assert bm.allocate("c", 3) == [3, 0], "the longest-free blocks go first"


def test_running_out_and_misuse_are_errors():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert bm.can_allocate("a", 8) and not bm.can_allocate("a", 9)
    assert bm.capacity("a") == 8
    bm.allocate("a", 5)
    assert bm.capacity("a") == 8 and not bm.can_allocate("b", 5)
    with pytest.raises(RuntimeError, match="only 0 are free"):
        bm.allocate("b", 5)
    assert "b" not in bm.block_tables, "a failed allocation leaves no table behind"
    with pytest.raises(ValueError, match="already has a block table"):
        bm.allocate("a", 1)
    with pytest.raises(ValueError, match="no block table"):
        bm.append_slots("zzz", 1)


@pytest.mark.parametrize("kwargs,match", [({"num_blocks": 0}, "num_blocks"), ({"block_size": 0}, "block_size"),
                                          ({"block_size": 2.5}, "block_size")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockManager(**{"num_blocks": 4, "block_size": 4, **kwargs})


class PoolMachine(RuleBasedStateMachine):
    """Random workloads against a model of what each sequence should hold: its length in positions."""

    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 5))
    def make(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size)
        self.lengths: dict[int, int] = {}     # live sequences: positions each one holds
        self.preempted: dict[int, int] = {}   # sequences sent back to recompute, with their lengths
        self.next_id = 0

    def _grow(self, seq, num_tokens):
        if self.bm.can_allocate(seq, num_tokens):
            (self.bm.append_slots if seq in self.lengths else self.bm.allocate)(seq, num_tokens)
            self.lengths[seq] = num_tokens
        else:
            free = list(self.bm.free_blocks)
            with pytest.raises(RuntimeError):
                (self.bm.append_slots if seq in self.lengths else self.bm.allocate)(seq, num_tokens)
            assert list(self.bm.free_blocks) == free, "a failed allocation must take nothing"
            assert (seq in self.bm.block_tables) == (seq in self.lengths), "a failed allocation left a table"

    @rule(num_tokens=st.integers(1, 20))
    def allocate(self, num_tokens):
        seq, self.next_id = self.next_id, self.next_id + 1
        self._grow(seq, num_tokens)

    @precondition(lambda self: self.lengths)
    @rule(data=st.data(), more=st.integers(0, 9))
    def append(self, data, more):
        seq = data.draw(st.sampled_from(sorted(self.lengths)))
        self._grow(seq, self.lengths[seq] + more)

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.lengths)))
        self.bm.free(seq)
        del self.lengths[seq]

    @precondition(lambda self: self.lengths)
    @rule()
    def preempt_newest(self):
        seq = max(self.lengths)
        self.bm.free(seq)
        self.preempted[seq] = self.lengths.pop(seq)

    @precondition(lambda self: self.preempted)
    @rule()
    def readmit(self):
        seq = min(self.preempted)
        if self.bm.can_allocate(seq, self.preempted[seq]):  # recompute: the whole length again
            self.lengths[seq] = self.preempted.pop(seq)
            self.bm.allocate(seq, self.lengths[seq])

    @invariant()
    def pool_is_consistent(self):
        bm = self.bm
        held = [b for table in bm.block_tables.values() for b in table]
        free = list(bm.free_blocks)
        assert len(free) == len(set(free)), "a block is on the free list twice"
        assert len(set(held)) + len(free) == bm.num_blocks, "free + used != total"
        assert not set(free) & set(held), "a free block is also in a block table"
        assert all(c >= 0 for c in bm.ref_counts), "a negative reference count"
        for block in range(bm.num_blocks):
            assert bm.ref_counts[block] == held.count(block), \
                f"block {block} is in {held.count(block)} tables but its count says {bm.ref_counts[block]}"
        assert set(bm.block_tables) == set(self.lengths), "tables and live sequences differ"
        for seq, n in self.lengths.items():
            assert len(bm.block_table(seq)) == bm.blocks_for(n), f"sequence {seq} holds the wrong number of blocks"

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in list(self.lengths):
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks and not self.bm.block_tables, "blocks left behind"
        assert sorted(self.bm.free_blocks) == list(range(self.bm.num_blocks))
        assert not any(self.bm.ref_counts)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# ---------------------------------------------------------------- parallel sampling: fork and copy-on-write

def test_fork_shares_every_block_and_copy_on_write_copies_only_the_shared_partial_one():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", 6)                                   # blocks 0 (full), 1 (2 of 4 positions)
    assert bm.fork("a", "b") == [0, 1] and bm.fork("a", "c") == [0, 1]
    assert bm.ref_counts[:2] == [3, 3] and bm.num_free_blocks == 6, "a fork takes no block"
    assert bm.capacity("b", 6) == (2 + 6 - 1) * 4, "writing at 6 must first copy the shared block 1"
    assert bm.copy_on_write("b", 6, 7) == [(1, 2)] and bm.block_table("b") == [0, 2]
    assert bm.copy_on_write("c", 6, 7) == [(1, 3)] and bm.block_table("c") == [0, 3]
    assert bm.copy_on_write("a", 6, 7) == [], "the last holder writes in place"
    assert bm.ref_counts[:4] == [3, 1, 1, 1], "the full prompt block stays shared"
    assert bm.copy_on_write("a", 8, 9) == [] and bm.append_slots("a", 9) == [0, 1, 4]
    for seq in ("a", "b", "c"):
        bm.free(seq)
    assert bm.num_free_blocks == 8 and not any(bm.ref_counts)


def test_copy_on_write_without_a_free_block_is_an_error_that_takes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.allocate("a", 6)
    bm.fork("a", "b")
    assert bm.capacity("b", 6) == 4 and bm.capacity("b") == 8, "no free block: the copy cannot be made"
    with pytest.raises(RuntimeError, match="must copy 1 shared blocks but only 0 are free"):
        bm.copy_on_write("b", 6, 7)
    assert bm.block_table("b") == [0, 1] and bm.ref_counts == [2, 2]
    with pytest.raises(ValueError, match="already has a block table"):
        bm.fork("a", "b")


class ForkMachine(RuleBasedStateMachine):
    """Parallel sampling on the block manager, with prefix caching on or off: random admissions (prompts from a
    tiny alphabet, so prefixes repeat), forks of live sequences, growth (copy-on-write first, the copies made
    in a model of every block's contents as the KV cache makes them), finishing and preemption. Checks that
    a block is written only while exactly one table holds it and the cache has not registered it, that every
    sequence reads back its own tokens through its table (no sample sees another's), that `capacity` is
    exactly what the copies and new blocks need, and that reference counts return to zero."""

    @initialize(num_blocks=st.integers(2, 12), block_size=st.integers(1, 4), caching=st.booleans())
    def make(self, num_blocks, block_size, caching):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.tokens: dict[int, list[int]] = {}   # live sequences: the tokens whose keys/values are written
        self.content: dict[int, list] = {}       # block -> per slot, the prefix whose KV it holds
        self.next_id = 0

    def _new_id(self):
        self.next_id += 1
        return self.next_id - 1

    def _write(self, seq, start, end):
        record_write(self.bm, self.content, self.tokens[seq], seq, start, end)

    def _grow(self, seq, new):
        """What a step does for seq: copy-on-write, take blocks, write, register full blocks. False: no room."""
        bm = self.bm
        start, end = len(self.tokens[seq]), len(self.tokens[seq]) + len(new)
        table = bm.block_table(seq)
        shared = [b for b in table[start // bm.block_size:] if bm.ref_counts[b] > 1]
        needed = len(shared) + bm.num_new_blocks(seq, end)
        assert (end <= bm.capacity(seq, start)) == (needed <= bm.num_free_blocks), "capacity is not exact"
        if needed > bm.num_free_blocks:
            return False
        for src, dst in bm.copy_on_write(seq, start, end):
            assert src in shared and bm.ref_counts[dst] == 1
            self.content[dst] = list(self.content[src])  # the KV cache's copy_blocks
        bm.append_slots(seq, end)
        self.tokens[seq] += new
        self._write(seq, start, end)
        bm.cache_blocks(seq, self.tokens[seq], end)
        return True

    @rule(length=st.integers(1, 10), alphabet=st.integers(1, 3), data=st.data())
    def admit(self, length, alphabet, data):
        toks = data.draw(st.lists(st.integers(0, alphabet - 1), min_size=length, max_size=length))
        bm = self.bm
        hits = bm.lookup(toks)
        if bm.blocks_for(len(toks)) - len(hits) > bm.num_free_blocks - bm.num_evictable(hits):
            return
        seq = self._new_id()
        cached = bm.allocate_cached(seq, toks)
        self.tokens[seq] = toks[:cached]
        assert self._grow(seq, toks[cached:]), "admission was sized for the whole prompt"

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(1, 3))
    def fork(self, data, n):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        free = self.bm.num_free_blocks
        for _ in range(n):
            child = self._new_id()
            assert self.bm.fork(parent, child) == self.bm.block_table(parent)
            self.tokens[child] = list(self.tokens[parent])
        assert self.bm.num_free_blocks == free, "a fork takes no block"

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), more=st.integers(1, 5))
    def grow(self, data, more):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self._grow(seq, data.draw(st.lists(st.integers(0, 2), min_size=more, max_size=more)))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish_or_preempt(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        others = {b for s, t in self.bm.block_tables.items() if s != seq for b in t}
        self.bm.free(seq)
        del self.tokens[seq]
        assert all(self.bm.ref_counts[b] > 0 for b in others), "a block another sequence holds was released"

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        held = [b for t in bm.block_tables.values() for b in t]
        free, evictable = set(bm.free_blocks), set(bm.evictable)
        assert set(held) | free | evictable == set(range(bm.num_blocks)) and not (free | evictable) & set(held)
        assert len(bm.free_blocks) == len(free) and not free & evictable
        for block in range(bm.num_blocks):
            assert bm.ref_counts[block] == held.count(block), f"block {block}: count != tables holding it"
        assert set(bm.block_tables) == set(self.tokens)
        for seq, toks in self.tokens.items():
            table = bm.block_table(seq)
            assert len(table) == bm.blocks_for(len(toks))
            for p in range(len(toks)):
                seen = self.content[table[p // bm.block_size]][p % bm.block_size]
                assert seen == tuple(toks[:p + 1]), f"sequence {seq} reads another sequence's KV at position {p}"

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in list(self.tokens):
            self.bm.free(seq)
        assert not any(self.bm.ref_counts), "reference counts did not return to zero"
        assert self.bm.num_free_blocks == self.bm.num_blocks and not self.bm.block_tables, "a block leaked"


TestForkMachine = ForkMachine.TestCase
TestForkMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
