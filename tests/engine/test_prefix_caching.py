"""Automatic prefix caching (chapter 08): the block manager on its own (examples, then a hypothesis state
machine that models every block's contents), and the engine with caching on vs off: the same outputs on the
real model, the cached token counts the block arithmetic predicts, no write into a shared block, and prefix
hits together with preemption under a small pool."""
import hashlib
import random
from array import array

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import mini_engine as me
from mini_engine.engine import LLM, LLMEngine
from mini_engine.paging import BlockManager, block_hashes, hash_block
from tests.engine.block_checks import record_write


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- the block manager

def admit(bm: BlockManager, seq, tokens, num_computed=None):
    """What the scheduler does for a new sequence: take the cached blocks, then fresh ones for the rest, and
    register the full blocks once 'computed'. Returns the cached token count."""
    cached = bm.allocate_cached(seq, tokens)
    bm.append_slots(seq, len(tokens))
    bm.cache_blocks(seq, tokens, len(tokens) if num_computed is None else num_computed)
    return cached


def test_hash_is_stable_and_chained():
    assert hash_block(None, [1, 2, 3]) == hash_block(None, [1, 2, 3]), "no per-process salt"
    assert hash_block(b"p", [1, 2, 3]) == hashlib.sha256(b"p" + array("q", [1, 2, 3]).tobytes()).digest()
    same = [5, 6, 7, 8]
    a, b = block_hashes([1, 2, 3, 4] + same, 4), block_hashes([9, 2, 3, 4] + same, 4)
    assert a[1] != b[1], "equal blocks behind different prefixes must hash differently"
    assert block_hashes([1, 2, 3, 4, 5], 4) == a[:1], "a partial block is not hashed"


def test_num_cached_tokens_is_the_block_arithmetic():
    bm = BlockManager(num_blocks=32, block_size=16, enable_prefix_caching=True)
    base = list(range(100, 148))                    # 48 tokens: three full blocks
    assert admit(bm, "a", base + [1]) == 0
    assert admit(bm, "b", base + list(range(16))) == 48, "64-token prompt, first 48 computed by another"
    assert admit(bm, "c", base + list(range(16))) == 48, "identical 64-token prompt: its last block recomputes"
    assert bm.block_table("c")[:3] == bm.block_table("a")[:3] and bm.block_table("c")[3] != bm.block_table("b")[3]
    assert admit(bm, "d", base + list(range(16)) + [7]) == 64, "65 tokens: four full cached blocks"
    assert admit(bm, "e", base[:47]) == 32, "only full blocks, and never the last token's"
    assert [bm.ref_counts[x] for x in bm.block_table("a")] == [5, 5, 4, 1]


def test_a_disabled_cache_never_hits():
    bm = BlockManager(num_blocks=8, block_size=2)
    assert admit(bm, "a", [1, 2, 3, 4, 5]) == 0 and admit(bm, "b", [1, 2, 3, 4, 5]) == 0
    assert not bm.cached_blocks and not bm.lookup([1, 2, 3, 4, 5])


def test_released_cached_blocks_stay_free_but_evictable_least_recently_used_first():
    bm = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    admit(bm, "a", [1, 2, 3, 4])          # blocks 0, 1 (both cached)
    admit(bm, "b", [5, 6, 7])             # blocks 2, 3 (2 cached)
    bm.free("a")                          # tail first: 1 then 0 become evictable
    bm.free("b")                          # then 2; 3 caches nothing and goes to the free list
    assert list(bm.evictable) == [1, 0, 2] and bm.num_free_blocks == 6 and bm.num_cached_blocks == 3
    assert admit(bm, "c", [1, 2, 3, 4, 9]) == 4, "a hit takes evictable blocks back"
    assert list(bm.evictable) == [2] and bm.ref_counts[:2] == [1, 1]
    assert bm.block_table("c") == [0, 1, 4] and list(bm.free_blocks) == [5, 3]
    bm.allocate("d", 4)                   # the free list goes first: nothing is evicted
    assert bm.block_table("d") == [5, 3] and bm.num_evictions == 0 and list(bm.evictable) == [2]
    bm.free("c")                          # 4 (uncached) to the free list; then 1, 0 evictable
    assert list(bm.evictable) == [2, 1, 0] and list(bm.free_blocks) == [4]
    bm.allocate("e", 8)
    assert bm.block_table("e") == [4, 2, 1, 0], "free first, then evicted least recently released first"
    assert bm.num_evictions == 3 and not bm.evictable and not bm.cached_blocks, "eviction forgets the hash"


def test_eviction_forgets_the_hash_and_reset_drops_only_unheld_blocks():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    admit(bm, "a", [1, 2, 3])             # blocks 0 (cached) and 1
    admit(bm, "keep", [7, 8, 9])          # blocks 2 (cached) and 3
    bm.free("a")
    assert list(bm.evictable) == [0] and bm.lookup([1, 2, 3]) == [0]
    bm.allocate("x", 4)                   # block 1, then evicts 0
    assert bm.block_table("x") == [1, 0] and bm.lookup([1, 2, 3]) == [], "an evicted block's hash is forgotten"
    bm.free("x")
    admit(bm, "a2", [1, 2, 3])
    bm.free("a2")
    assert bm.lookup([1, 2, 3]) and bm.reset_prefix_cache() == 1
    assert not bm.evictable and all(bm.block_hash[b] is None for b in bm.free_blocks)
    assert bm.lookup([1, 2, 3]) == [], "a reset block is forgotten"
    assert bm.lookup([7, 8, 9]) == [2], "a held block keeps its hash across a reset"


def test_two_identical_prompts_in_one_step_keep_one_registered_copy():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    for seq in ("a", "b"):                # both looked up before either was computed: both miss
        assert bm.allocate_cached(seq, [1, 2, 3, 4, 5]) == 0
        bm.append_slots(seq, 5)
    for seq in ("a", "b"):
        bm.cache_blocks(seq, [1, 2, 3, 4, 5], 5)
    assert bm.num_cached_blocks == 2 and sorted(bm.cached_blocks.values()) == bm.block_table("a")[:2]
    bm.free("b")
    assert not set(bm.block_table("a")) & set(bm.free_blocks)
    assert all(bm.block_hash[b] is None for b in bm.free_blocks), "b's copies were never registered"


def test_a_block_is_cached_only_once_computed():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    bm.allocate_cached("a", [1, 2, 3, 4, 5])
    bm.append_slots("a", 5)
    assert bm.lookup([1, 2, 3, 4, 5]) == [], "allocated but not computed: nothing to share yet"
    bm.cache_blocks("a", [1, 2, 3, 4, 5], 3)
    assert bm.lookup([1, 2, 3, 4, 5]) == bm.block_table("a")[:1]
    bm.cache_blocks("a", [1, 2, 3, 4, 5], 5)
    assert bm.lookup([1, 2, 3, 4, 5]) == bm.block_table("a")[:2]


class CachingPoolMachine(RuleBasedStateMachine):
    """Random admissions (prompts from a tiny alphabet, so prefixes repeat), growth, finishing, preemption and
    resets. A model of every block's contents (the whole prefix each written slot saw) checks that a hit
    hands out exactly the keys/values the new sequence would have computed, that no sequence writes into a
    block another holds or the cache has registered, and that eviction takes the least recently released."""

    @initialize(num_blocks=st.integers(2, 12), block_size=st.integers(1, 4))
    def make(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
        self.tokens: dict[int, list[int]] = {}      # live sequences and their computed tokens
        self.content: dict[int, list] = {}          # block -> per slot, the prefix whose KV it holds
        self.released: list[int] = []               # model of the evictable order
        self.next_id = 0

    def _write(self, seq, start, end):
        record_write(self.bm, self.content, self.tokens[seq], seq, start, end)

    def _take(self, seq, total):
        """Grow seq to `total` positions, checking that evictions follow the model's LRU order."""
        bm = self.bm
        need = bm.num_new_blocks(seq, total)
        from_evictable = max(0, need - len(bm.free_blocks))
        expected = self.released[:from_evictable]
        bm.append_slots(seq, total)
        taken = bm.block_table(seq)[len(bm.block_table(seq)) - need:]
        assert [b for b in taken if b in expected] == expected, f"evicted {taken}, LRU order says {expected}"
        self.released = self.released[from_evictable:]

    @rule(length=st.integers(1, 12), alphabet=st.integers(1, 3), data=st.data())
    def admit(self, length, alphabet, data):
        toks = data.draw(st.lists(st.integers(0, alphabet - 1), min_size=length, max_size=length))
        bm, seq = self.bm, self.next_id
        self.next_id += 1
        hits = bm.lookup(toks)
        if bm.blocks_for(len(toks)) - len(hits) > bm.num_free_blocks - bm.num_evictable(hits):
            return
        cached = bm.allocate_cached(seq, toks)
        assert cached == len(hits) * bm.block_size < len(toks)
        self.released = [b for b in self.released if b not in hits]
        for i, block in enumerate(hits):
            for off in range(bm.block_size):
                p = i * bm.block_size + off
                assert self.content[block][off] == tuple(toks[:p + 1]), "a hit served another prefix's KV"
        self.tokens[seq] = toks
        self._take(seq, len(toks))
        self._write(seq, cached, len(toks))
        bm.cache_blocks(seq, toks, len(toks))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), more=st.integers(1, 5))
    def grow(self, data, more):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        bm = self.bm
        n = len(self.tokens[seq])
        if not bm.can_allocate(seq, n + more):
            return
        self.tokens[seq] += data.draw(st.lists(st.integers(0, 2), min_size=more, max_size=more))
        self._take(seq, n + more)
        self._write(seq, n, n + more)
        bm.cache_blocks(seq, self.tokens[seq], n + more)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish_or_preempt(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        table = list(self.bm.block_table(seq))
        held_by_others = {b for s, t in self.bm.block_tables.items() if s != seq for b in t}
        self.bm.free(seq)
        del self.tokens[seq]
        for block in reversed(table):
            if block not in held_by_others and self.bm.block_hash[block] is not None:
                self.released.append(block)
        for block in held_by_others & set(table):
            assert self.bm.ref_counts[block] > 0 and block not in self.bm.evictable, "a held block was released"

    @rule()
    def reset(self):
        self.bm.reset_prefix_cache()
        self.released = []

    @invariant()
    def pool_is_consistent(self):
        bm = self.bm
        if not hasattr(self, "bm"):
            return
        held = [b for t in bm.block_tables.values() for b in t]
        free, evictable = list(bm.free_blocks), list(bm.evictable)
        assert len(set(free)) == len(free) and not set(free) & set(evictable)
        assert set(held) | set(free) | set(evictable) == set(range(bm.num_blocks)), "a block went missing"
        assert not (set(free) | set(evictable)) & set(held), "a held block is free or evictable"
        assert bm.num_free_blocks == len(free) + len(evictable)
        for block in range(bm.num_blocks):
            assert bm.ref_counts[block] == held.count(block) >= 0
        assert all(bm.block_hash[b] is not None for b in evictable) and all(bm.block_hash[b] is None for b in free)
        assert {b: h for h, b in bm.cached_blocks.items()} == {b: h for b, h in enumerate(bm.block_hash) if h}
        assert evictable == self.released, "evictable order differs from the order blocks were released"

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in list(self.tokens):
            self.bm.free(seq)
        assert not any(self.bm.ref_counts), "reference counts did not return to zero"
        assert self.bm.num_free_blocks == self.bm.num_blocks and not self.bm.block_tables
        self.bm.reset_prefix_cache()
        assert sorted(self.bm.free_blocks) == list(range(self.bm.num_blocks)) and not self.bm.cached_blocks


TestCachingPoolMachine = CachingPoolMachine.TestCase
TestCachingPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# ---------------------------------------------------------------- the engine

def run(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def shared_prefix_stream(rng, n, block_size, vocab=(200, 9000)):
    """Prompts drawn from a few roots, each reusing a random-length prefix of one root (whole multiples of the
    block size among them) plus its own tail; one prompt repeats an earlier one exactly."""
    roots = [[rng.randrange(*vocab) for _ in range(96)] for _ in range(3)]
    prompts = []
    for i in range(n):
        root = rng.choice(roots)
        shared = rng.choice([rng.randint(1, 80), block_size * rng.randint(1, 5)])
        tail = 0 if shared % block_size == 0 and rng.random() < 0.5 else rng.randint(1, 20)
        prompts.append(root[:shared] + [rng.randrange(*vocab) for _ in range(tail)])
    prompts.insert(n // 2, list(prompts[1]))  # a full hit
    prompts.append(list(roots[0][:64]))       # a whole multiple of the block size, likely cached by now
    return prompts


def test_real_model_outputs_with_and_without_prefix_caching_are_equal(real, assert_greedy_match, guard_writes):
    model, tok = real
    rng = random.Random(0)
    prompts = shared_prefix_stream(rng, 14, 16)
    params = me.SamplingParams(max_tokens=6, ignore_eos=True)
    kwargs = {"max_num_seqs": 4, "max_model_len": 192, "chunked_prefill_tokens": 64, "block_size": 16}
    on = guard_writes(LLM.from_model(model, tok, enable_prefix_caching=True, **kwargs))
    off = LLM.from_model(model, tok, enable_prefix_caching=False, **kwargs)
    # Waves: later ones find earlier blocks released but still cached (evictable); the last is a full hit.
    prompts.append(list(prompts[2]))
    waves = (prompts[:8], prompts[8:-1], prompts[-1:])
    outs_on = [o for w in waves for o in run(on, w, params)]
    outs_off = [o for w in waves for o in run(off, w, params)]
    assert sum(o.num_cached_tokens for o in outs_on) > 0 and not any(o.num_cached_tokens for o in outs_off)
    assert outs_on[-1].num_cached_tokens == (len(prompts[-1]) - 1) // 16 * 16, "a full hit, short of the last token"
    for prompt, a, b in zip(prompts, outs_on, outs_off):
        assert a.num_cached_tokens % 16 == 0 and a.num_cached_tokens <= len(prompt) - 1
        if a.token_ids != b.token_ids:
            assert_greedy_match(model, prompt, a.token_ids, b.token_ids)
    engine = on.engine
    assert engine.num_free_blocks == engine.num_kv_blocks and not engine.scheduler.blocks.block_tables
    assert engine.scheduler.blocks.num_cached_blocks > 0, "released blocks stay cached"
    assert on.reset_prefix_cache() > 0 and engine.scheduler.blocks.num_cached_blocks == 0
    assert engine.num_free_blocks == engine.num_kv_blocks


def test_num_cached_tokens_on_the_engine(real, guard_writes):
    model, tok = real
    llm = guard_writes(LLM.from_model(model, tok, block_size=16, max_num_seqs=4, max_model_len=256))
    assert llm.config.enable_prefix_caching, "on by default with the paged cache"
    rng = random.Random(1)
    shared = [rng.randrange(200, 9000) for _ in range(48)]
    params = me.SamplingParams(max_tokens=2, ignore_eos=True)
    first = run(llm, [shared + [rng.randrange(200, 9000) for _ in range(10)]], params)[0]
    prompt = shared + [rng.randrange(200, 9000) for _ in range(16)]        # 64 tokens
    second = run(llm, [prompt], params)[0]
    third = run(llm, [prompt], params)[0]                                    # identical: a full hit
    assert (first.num_cached_tokens, second.num_cached_tokens, third.num_cached_tokens) == (0, 48, 48)
    assert third.token_ids == second.token_ids
    assert run(llm, [prompt + [5]], params)[0].num_cached_tokens == 64
    assert llm.engine.num_free_blocks == llm.engine.num_kv_blocks
    off = LLM.from_model(model, tok, block_size=16, max_num_seqs=4, max_model_len=256, enable_prefix_caching=False)
    assert run(off, [prompt], params)[0].token_ids == second.token_ids
    assert "prefix caching on" in repr(llm) and "prefix caching off" in repr(off)


def test_block_pool_shows_shared_blocks_and_their_reference_counts(real):
    model, tok = real
    engine = LLMEngine.from_model(model, tok, block_size=16, max_num_seqs=4, num_kv_blocks=32)
    system = list(range(300, 340))                               # 40 tokens: two full blocks
    engine.add_request(system + [1000], me.SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    ids = [engine.add_request(system + [2000 + i] * 3, me.SamplingParams(max_tokens=4)) for i in range(3)]
    engine.step()
    snap = engine.block_pool()
    heads = {snap.block_tables[i][:2] for i in ids}
    assert len(heads) == 1, "all three tables start with the same two cached blocks"
    assert [snap.ref_counts[b] for b in heads.pop()] == [3, 3] and all(snap.cached[b] for b in snap.block_tables[ids[0]][:2])
    while engine.has_unfinished():
        engine.step()
    assert engine.block_pool().num_free_blocks == 32


def test_prefix_hits_with_preemption_under_a_small_pool_change_no_output(tiny_model, guard_writes):
    model = tiny_model(1)
    rng = random.Random(2)
    roots = [[rng.randrange(128) for _ in range(40)] for _ in range(2)]
    prompts = [rng.choice(roots)[:rng.randint(1, 40)] + [rng.randrange(128) for _ in range(rng.randint(0, 8))]
               for _ in range(60)]
    prompts = [p or [1] for p in prompts]
    params = [me.SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=True,
                                temperature=rng.choice([0.0, 0.0, 1.0]), seed=i) for i in range(len(prompts))]
    free = run(LLM.from_model(model, max_num_seqs=12, num_kv_blocks=400, enable_prefix_caching=False),
               prompts, params)
    llm = guard_writes(LLM.from_model(model, max_num_seqs=12, num_kv_blocks=14, block_size=8,
                                      chunked_prefill_tokens=32))
    tight = run(llm, prompts, params)
    assert any(o.metrics.num_preemptions for o in tight), "a pool this small should force preemptions"
    assert sum(o.num_cached_tokens for o in tight) > 0, "and prefixes should hit"
    assert llm.engine.scheduler.blocks.num_evictions > 0, "cached blocks were evicted under pressure"
    for i, (a, b) in enumerate(zip(tight, free)):
        assert a.token_ids == b.token_ids, f"request {i} changed under prefix caching with preemption"
    blocks = llm.engine.scheduler.blocks
    assert not blocks.block_tables and not any(blocks.ref_counts), "a block leaked"
    assert llm.engine.num_free_blocks == llm.engine.num_kv_blocks == 14
    llm.reset_prefix_cache()
    assert len(blocks.free_blocks) == 14
