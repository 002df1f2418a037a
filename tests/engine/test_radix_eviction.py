"""The radix tree's eviction in O(log n) (issue 59, item 3): unheld leaves in a set and a heap by last use.

A hypothesis state machine runs the same sequences on the tree and on a reference that answers by brute force
(eviction: scan every node for the least recently used unheld leaf; matching: compare against every child), in a
small pool so that evictions run, and checks that both make the same choices and that the set of leaves is exactly
the unheld childless nodes. A timing-free count (heap entries examined per eviction) stays bounded as the pool grows
from 256 to 8192 blocks, where the old scan examined every evictable block for each block it freed."""
import math
import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mini_engine.prefix.radix_cache import RadixBlockManager, common_prefix


class BruteForceTree(RadixBlockManager):
    """The reference: no leaf set, no heap, no remembered match; every question answered by a full scan."""

    def _match(self, token_ids):
        path, node, matched, size, limit = [], self.root, 0, self.block_size, len(token_ids) - 1
        while matched < limit:
            want = tuple(token_ids[matched:matched + size])
            child = node.children.get(want)
            if child is not None and len(want) == size and matched + size <= limit:
                path.append(child)
                node, matched = child, matched + size
                continue
            best = max(node.children.values(), key=lambda c: common_prefix(c.tokens, want), default=None)
            n = min(common_prefix(best.tokens, want), limit - matched) if best else 0
            if n:
                path.append(best)
                matched += n
            break
        return path, matched

    def _evict_one(self):
        leaves = [n for n in self.node_of.values() if not n.children and self.ref_counts[n.block] == 1]
        assert leaves, "no evictable leaf"
        self._remove(min(leaves, key=lambda n: n.last_used))
        self.num_evictions += 1


def shape(bm):
    """The tree as {path of token tuples: block} and every table: equal for two managers that chose alike."""
    def path(node):
        return () if node.parent is None else path(node.parent) + (node.tokens,)
    return {path(n): b for b, n in bm.node_of.items()}, {s: list(t) for s, t in bm.block_tables.items()}


class EvictionMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(3, 10), block_size=st.integers(1, 4))
    def make(self, num_blocks, block_size):
        self.fast, self.ref = RadixBlockManager(num_blocks, block_size), BruteForceTree(num_blocks, block_size)
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0

    def both(self, method, *args):
        results = [getattr(bm, method)(*args) for bm in (self.fast, self.ref)]
        assert results[0] == results[1], f"{method}{args}: {results[0]} != {results[1]}"
        return results[0]

    @rule(length=st.integers(1, 12), alphabet=st.integers(1, 3), data=st.data())
    def add(self, length, alphabet, data):
        toks = data.draw(st.lists(st.integers(0, alphabet - 1), min_size=length, max_size=length))
        bm = self.fast
        hits, cached = self.both("lookup", toks), self.both("num_cached_tokens", toks)
        if bm.blocks_for(len(toks)) - cached // bm.block_size > bm.num_free_blocks - bm.num_evictable(hits):
            return
        self.next_id += 1
        seq = self.next_id
        self.both("allocate_cached", seq, toks)
        self.both("copy_on_write", seq, cached, len(toks))
        self.both("append_slots", seq, len(toks))
        self.both("cache_blocks", seq, toks, len(toks))
        self.tokens[seq] = toks

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), more=st.integers(1, 4))
    def grow(self, data, more):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        n = len(self.tokens[seq])
        if self.fast.capacity(seq, n) - n < more:
            return
        toks = self.tokens[seq] + data.draw(st.lists(st.integers(0, 2), min_size=more, max_size=more))
        self.both("copy_on_write", seq, n, len(toks))
        self.both("append_slots", seq, len(toks))
        self.both("cache_blocks", seq, toks, len(toks))
        self.tokens[seq] = toks

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.both("free", seq)
        del self.tokens[seq]

    @rule()
    def reset(self):
        self.both("reset_prefix_cache")

    @invariant()
    def same_choices_and_exact_leaves(self):
        if not hasattr(self, "fast"):
            return
        fast = self.fast
        assert shape(fast) == shape(self.ref) and fast.num_evictions == self.ref.num_evictions
        assert list(fast.free_blocks) == list(self.ref.free_blocks) and fast.ref_counts == self.ref.ref_counts
        leaves = {n for n in fast.node_of.values() if not n.children and fast.ref_counts[n.block] == 1}
        assert fast.leaves == leaves, "the leaf set must be exactly the unheld childless nodes"
        live = {n for stamp, _, _, n in fast.heap if n in leaves and stamp == n.stamp}
        assert live == leaves, "every evictable leaf has a true entry in the heap"
        assert len(fast.heap) <= 2 * len(fast.leaves) + 64, "stale entries are compacted away"


TestEvictionMachine = EvictionMachine.TestCase
TestEvictionMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def churn(num_blocks: int, block_size: int = 4, seed: int = 0) -> RadixBlockManager:
    """A pool under pressure: hundreds of distinct prefixes, each request a prefix and a tail of its own, computed
    and freed, so that every request past the first few hundred evicts."""
    rng = random.Random(seed)
    bm = RadixBlockManager(num_blocks, block_size)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(8, 40))] for _ in range(300)]
    for seq in range(3 * num_blocks // 8):
        toks = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 20))]
        cached = bm.allocate_cached(seq, toks)
        bm.copy_on_write(seq, cached, len(toks))
        bm.append_slots(seq, len(toks))
        bm.cache_blocks(seq, toks, len(toks))
        bm.free(seq)
    return bm


def test_heap_entries_examined_per_eviction_stay_bounded_as_the_pool_grows():
    per_eviction = {}
    for n in (256, 1024, 4096, 8192):
        bm = churn(n)
        assert bm.num_evictions > n // 8, f"{n} blocks: the workload should evict"
        per_eviction[n] = bm.eviction_visits / bm.num_evictions
        # Each examined entry is one heap pop, O(log n): amortized O(1) entries per eviction is O(log n) work.
        assert per_eviction[n] <= 3 <= math.log2(n), f"{n} blocks: {per_eviction[n]:.2f} heap entries per eviction"
    print("\nheap entries examined per eviction, by pool size:",
          {n: round(v, 2) for n, v in per_eviction.items()})
