"""The block allocator on its own (pure Python): examples, then a hypothesis state machine that runs random
sequences of allocate / append / free / preempt-and-readmit and checks the pool's invariants after each."""
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mini_engine.paging import BlockManager


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
