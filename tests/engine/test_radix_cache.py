"""SGLang's radix tree as the prefix cache (chapter 08, second half): the block manager on its own (examples, then a
hypothesis state machine of add, grow, speculate, fork, finish/abort/preempt and a preemption inside a step, with a
small pool so that eviction runs, against a model of every block's contents), cache-aware admission order, the
config's checks, the server's flag, and the engine on the real model: a 300-token shared prompt, a conversation's
second turn, and outputs equal to the uncached engine's."""
import contextlib
import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import mini_engine as me
from mini_engine.__main__ import build_parser
from mini_engine.bench.server import serve_args
from mini_engine.engine import LLM
from mini_engine.engine_config import EngineConfig
from mini_engine.paging import BlockManager
from mini_engine.prefix.radix_cache import RadixBlockManager
from mini_engine.scheduler import CacheAwarePolicy, Request, Scheduler, make_policy
from tests.engine.block_checks import record_write

pytestmark = pytest.mark.usefixtures("one_thread")


def run_seq(bm, seq, tokens):
    """What the scheduler does for a new sequence that runs its prompt in one step and is then freed: take the
    matched blocks, copy the partly matched one, compute the rest. Returns the tokens served from the cache."""
    cached = bm.allocate_cached(seq, tokens)
    bm.copy_on_write(seq, cached, len(tokens))
    bm.append_slots(seq, len(tokens))
    bm.cache_blocks(seq, tokens, len(tokens))
    return cached


# ---------------------------------------------------------------- the tree on its own

def test_a_match_ends_at_any_token_and_the_partial_block_is_copied_on_first_write():
    bm = RadixBlockManager(num_blocks=8, block_size=4)
    a = list(range(100, 111))                                  # 11 tokens: blocks of 4, 4, 3
    run_seq(bm, "a", a)
    assert bm.num_cached_blocks == 2, "full blocks enter the tree while the sequence runs"
    bm.free("a")
    assert bm.num_cached_blocks == 3, "the last partial block enters when the sequence is freed"
    b = a[:10] + [7, 8, 9]                                      # shares 10 tokens: two blocks and 2 of the third
    assert bm.num_cached_tokens(b) == 10 and BlockManager(8, 4, True).num_cached_tokens(b) == 0
    tree_blocks = bm.lookup(b)
    assert bm.allocate_cached("b", b) == 10 and bm.block_table("b") == tree_blocks
    assert bm.ref_counts[tree_blocks[2]] == 2, "the partly matched block: held by the tree and by b"
    [(src, dst)] = bm.copy_on_write("b", 10, 13)
    assert src == tree_blocks[2] and bm.block_table("b") == tree_blocks[:2] + [dst] and bm.ref_counts[src] == 1
    assert src in bm.evictable, "only the tree holds the original now"


def test_at_least_one_prompt_token_is_computed():
    bm = RadixBlockManager(num_blocks=8, block_size=4)
    a = list(range(8))
    run_seq(bm, "a", a)
    bm.free("a")
    assert bm.num_cached_tokens(a) == 7, "a whole cached prompt still computes its last token"
    assert bm.num_cached_tokens(a[:5]) == 4 and bm.num_cached_tokens(a[:1]) == 0
    assert run_seq(bm, "again", a) == 7
    bm.free("again")
    assert bm.num_cached_blocks == 2, "the recomputed block duplicated the tree's: the table took the tree's"
    assert bm.num_free_blocks == 8 and not any(bm.ref_counts[b] for b in bm.free_blocks)


def test_a_conversation_turn_reuses_the_previous_prompt_and_answer():
    bm = RadixBlockManager(num_blocks=16, block_size=4)
    turn1 = list(range(10))
    run_seq(bm, 1, turn1)
    answer = [50, 51, 52, 53, 54]
    tokens = turn1 + answer
    for n in range(len(turn1), len(tokens)):                  # decode: one token a step; the last is never fed
        bm.copy_on_write(1, n, n + 1)
        bm.append_slots(1, n + 1)
        bm.cache_blocks(1, tokens[:n + 1], n + 1)
    bm.free(1)
    turn2 = tokens + [60, 61]
    assert bm.num_cached_tokens(turn2) == len(tokens)           # 15: the prompt and the answer
    assert BlockManager(16, 4, True).num_cached_tokens(turn2) == 0


def test_eviction_takes_unheld_leaves_least_recently_used_first_and_the_trunk_outlives_them():
    bm = RadixBlockManager(num_blocks=6, block_size=2)
    trunk = [1, 2, 3, 4]
    for i, seq in enumerate(("x", "y")):                       # two branches of one trunk: 2 + 1 + 1 blocks
        run_seq(bm, seq, trunk + [10 + i, 20 + i])
        bm.free(seq)
    x_leaf, y_leaf = bm.lookup(trunk + [10, 20, 0])[2], bm.lookup(trunk + [11, 21, 0])[2]
    run_seq(bm, "x2", trunk + [10, 20, 9])                      # x's branch used again: y's is the older leaf
    bm.free("x2")
    assert bm.num_free_blocks == 6 and len(bm.free_blocks) == 1
    bm.allocate("new", 4)                                       # a fresh block from the free list, then one eviction
    assert y_leaf not in bm.node_of and x_leaf in bm.node_of and bm.num_evictions == 1
    bm.append_slots("new", 8)                                   # then x2's partial leaf [9], then x's; the trunk stays
    assert x_leaf not in bm.node_of and bm.num_evictions == 3 and bm.num_cached_tokens(trunk + [5]) == 4
    bm.free("new")
    assert bm.reset_prefix_cache() == 2 and bm.num_free_blocks == 6 and not bm.node_of


def test_two_copies_of_one_prefix_computed_at_once_leave_one_in_the_tree():
    bm = RadixBlockManager(num_blocks=8, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    for seq in ("a", "b"):                                      # admitted in the same step: neither hits
        assert bm.allocate_cached(seq, prompt) == 0
        bm.append_slots(seq, 5)
    for seq in ("a", "b"):
        bm.cache_blocks(seq, prompt, 5)
    assert bm.block_table("a")[:2] == bm.block_table("b")[:2], "b took the tree's copies and freed its own"
    assert bm.num_cached_blocks == 2 and len(bm.free_blocks) == 8 - 4
    for seq in ("a", "b"):
        bm.free(seq)
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 8


def test_a_duplicate_block_that_forked_samples_share_stays_out_of_the_tree():
    bm = RadixBlockManager(num_blocks=8, block_size=2)
    run_seq(bm, "a", [1, 2, 3])
    bm.fork("a", "a2")                                          # the samples share a's partial block [3]
    run_seq(bm, "c", [1, 2, 3])                                 # the same tokens, computed again into c's own block
    bm.free("c")                                                # the tree now holds [3] in c's block
    shared = bm.block_table("a")[1]
    bm.free("a")                                                # a's duplicate is a2's too: a2 keeps it, out of the tree
    assert shared not in bm.node_of and bm.ref_counts[shared] == 1 and bm.block_table("a2")[1] == shared
    bm.free("a2")
    assert bm.num_free_blocks == 8 and shared in bm.free_blocks and bm.num_cached_blocks == 2


def test_a_preemption_after_copy_on_write_in_the_same_step_caches_no_unwritten_block():
    bm = RadixBlockManager(num_blocks=8, block_size=4)
    run_seq(bm, "a", [1, 2, 3, 4, 5, 6])
    bm.free("a")
    b = [1, 2, 3, 4, 5, 6, 7]
    assert bm.allocate_cached("b", b) == 6
    [(src, dst)] = bm.copy_on_write("b", 6, 7)                  # the copy would run with the step...
    bm.append_slots("b", 7)
    bm.free("b")                                                # ...but b is preempted before it runs
    assert dst not in bm.node_of and dst in bm.free_blocks and src in bm.node_of


def test_radix_needs_prefix_caching_and_is_refused_with_another_block_manager():
    with pytest.raises(ValueError, match="enable_prefix_caching=True"):
        RadixBlockManager(8, 4, enable_prefix_caching=False)


# ---------------------------------------------------------------- hypothesis: the invariants

class RadixPoolMachine(RuleBasedStateMachine):
    """Random sequences over a tiny alphabet (so prefixes repeat) in a small pool (so eviction runs). A model of
    every block's contents (the whole prefix each written slot saw) checks that a hit hands out exactly the
    keys/values the new sequence would have computed and that nothing writes into a block another table or the tree
    holds; the invariants check that every block is free, evictable or held, that reference counts are exact, and
    that each table's tree blocks are a path from the root."""

    @initialize(num_blocks=st.integers(2, 12), block_size=st.integers(1, 4))
    def make(self, num_blocks, block_size):
        self.bm = RadixBlockManager(num_blocks, block_size)
        self.tokens: dict[int, list[int]] = {}    # live sequences: their computed tokens
        self.content: dict[int, list] = {}        # block -> per slot, the prefix whose KV it holds
        self.forked: set[int] = set()             # sequences sharing blocks with a fork (never speculate)
        self.next_id = 0

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    def _step(self, seq, new_tokens, run=True):
        """Plan a chunk of `new_tokens` for seq (copy-on-write, then blocks); `run`: the step runs (copies, writes)."""
        bm, n = self.bm, len(self.tokens[seq])
        copies = bm.copy_on_write(seq, n, n + len(new_tokens))
        bm.append_slots(seq, n + len(new_tokens))
        if run:
            for src, dst in copies:
                self.content[dst] = list(self.content[src])
            self.tokens[seq] += new_tokens
            record_write(bm, self.content, self.tokens[seq], seq, n, n + len(new_tokens))

    def _fits(self, seq, num_new):
        return self.bm.capacity(seq, len(self.tokens[seq])) - len(self.tokens[seq]) >= num_new

    @rule(length=st.integers(1, 12), alphabet=st.integers(1, 3), run=st.booleans(), data=st.data())
    def add(self, length, alphabet, run, data):
        toks = data.draw(st.lists(st.integers(0, alphabet - 1), min_size=length, max_size=length))
        bm = self.bm
        hits, cached = bm.lookup(toks), bm.num_cached_tokens(toks)
        if bm.blocks_for(len(toks)) - cached // bm.block_size > bm.num_free_blocks - bm.num_evictable(hits):
            return
        seq = self._new_id()
        assert bm.allocate_cached(seq, toks) == cached < len(toks) and bm.block_table(seq) == hits
        for p in range(cached):
            assert self.content[hits[p // bm.block_size]][p % bm.block_size] == tuple(toks[:p + 1]), \
                "a hit served another prefix's keys and values"
        self.tokens[seq] = toks[:cached]
        self._step(seq, toks[cached:], run)
        if run:
            bm.cache_blocks(seq, self.tokens[seq], len(self.tokens[seq]))
        else:  # preempted inside the step that planned its first chunk: its copy and writes never happen
            bm.free(seq)
            del self.tokens[seq]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), more=st.integers(1, 5))
    def grow(self, data, more):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        if self._fits(seq, more):
            self._step(seq, data.draw(st.lists(st.integers(0, 2), min_size=more, max_size=more)))
            self.bm.cache_blocks(seq, self.tokens[seq], len(self.tokens[seq]))

    @precondition(lambda self: set(self.tokens) - self.forked)
    @rule(data=st.data(), k=st.integers(1, 4))
    def speculate(self, data, k):
        """A decode with k drafts: all k + 1 written, `accepted` kept, the blocks past them trimmed."""
        seq = data.draw(st.sampled_from(sorted(set(self.tokens) - self.forked)))
        if not self._fits(seq, 1 + k):
            return
        n = len(self.tokens[seq])
        self._step(seq, data.draw(st.lists(st.integers(0, 2), min_size=1 + k, max_size=1 + k)))
        keep = n + 1 + data.draw(st.integers(0, k))
        self.tokens[seq] = self.tokens[seq][:keep]
        self.bm.cache_blocks(seq, self.tokens[seq], keep)
        self.bm.trim(seq, keep)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self._new_id()
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.forked |= {parent, child}

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), run=st.booleans())
    def free(self, data, run):
        """Finish, abort or preempt between steps (run), or preempt inside a step after planning a chunk."""
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        if not run and self._fits(seq, 1):
            self._step(seq, [0], run=False)
        self.bm.free(seq)
        del self.tokens[seq]

    @rule()
    def reset(self):
        self.bm.reset_prefix_cache()

    @invariant()
    def pool_is_consistent(self):
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        tables = [b for t in bm.block_tables.values() for b in t]
        tree, free, evictable = set(bm.node_of), list(bm.free_blocks), list(bm.evictable)
        assert len(set(free)) == len(free) and not set(free) & (set(tables) | tree), "a held block is free"
        assert set(free) | set(tables) | tree == set(range(bm.num_blocks)), "a block went missing"
        for block in range(bm.num_blocks):
            assert bm.ref_counts[block] == tables.count(block) + (block in tree), f"block {block}'s count is off"
        assert set(evictable) == tree - set(tables), "evictable must be exactly the tree's unheld blocks"
        assert bm.num_free_blocks == len(free) + len(evictable)
        assert {b for b, h in enumerate(bm.block_hash) if h} == tree == set(bm.cached_blocks.values())
        for block, node in bm.node_of.items():
            assert node.block == block and node.parent.children[node.tokens] is node
            assert len(node.tokens) == bm.block_size or not node.children, "a partial block is a leaf"
        for seq, table in bm.block_tables.items():  # its tree blocks: the first ones, a path from the root
            depth = next((i for i, b in enumerate(table) if b not in tree), len(table))
            assert not tree & set(table[depth:]), f"sequence {seq} holds a tree block after one of its own"
            path = [bm.root] + [bm.node_of[b] for b in table[:depth]]
            assert all(node.parent is up for up, node in zip(path, path[1:])), f"{seq}'s tree blocks are no path"

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in list(self.tokens):
            self.bm.free(seq)
        assert not self.bm.block_tables and self.bm.num_free_blocks == self.bm.num_blocks
        assert [self.bm.ref_counts[b] for b in range(self.bm.num_blocks)] == \
            [int(b in self.bm.node_of) for b in range(self.bm.num_blocks)], "only the tree holds blocks"
        self.bm.reset_prefix_cache()
        assert sorted(self.bm.free_blocks) == list(range(self.bm.num_blocks)) and not self.bm.node_of
        assert not any(self.bm.ref_counts) and not self.bm.root.children


TestRadixPoolMachine = RadixPoolMachine.TestCase
TestRadixPoolMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


# ---------------------------------------------------------------- cache-aware scheduling

def test_cache_aware_admission_takes_the_longest_cached_prefix_first_and_arrival_order_when_the_queue_is_long():
    params = me.SamplingParams(max_tokens=4)
    shared = list(range(100, 140))

    def admitted(policy, num_waiting):
        bm = RadixBlockManager(num_blocks=64, block_size=4)
        run_seq(bm, "warm", shared + [1])
        bm.free("warm")
        sched = Scheduler(policy, num_slots=1, max_model_len=256, token_budget=512, block_manager=bm)
        for i in range(num_waiting):  # the first shares nothing, the last shares 40 tokens
            prompt = ([7] * 20 if i == 0 else shared[:10 * min(i, 4)]) + [500 + i] * 3
            sched.add(Request(i, prompt, params, frozenset(), arrival_time=float(i)))
        return [c.request.request_id for c in sched.schedule(now=10.0)]

    assert admitted(make_policy("continuous", 1), 5) == [0]
    assert admitted(make_policy("cache_aware", 1), 5) == [4]
    assert admitted(CacheAwarePolicy(max_ranked=4), 5) == [0], "a queue over max_ranked goes in arrival order"


# ---------------------------------------------------------------- config and server

def test_the_prefix_cache_is_checked_by_name():
    assert EngineConfig().prefix_cache == "hashed"
    assert EngineConfig(prefix_cache="radix").block_manager_class() is RadixBlockManager
    assert EngineConfig().block_manager_class() is BlockManager
    with pytest.raises(ValueError, match="prefix_cache"):
        EngineConfig(prefix_cache="trie")
    with pytest.raises(ValueError, match="prefix_cache='radix'.*enable_prefix_caching"):
        EngineConfig(prefix_cache="radix", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="prefix_cache='radix'.*kv_cache"):
        EngineConfig(prefix_cache="radix", kv_cache="contiguous")
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(prefix_cache="radix", block_manager=BlockManager)
    with pytest.raises(ValueError, match="scheduling"):
        EngineConfig(scheduling="longest_prefix")
    assert EngineConfig(scheduling="cache_aware").scheduling == "cache_aware"


def test_the_server_takes_prefix_cache_radix(monkeypatch):
    args = build_parser().parse_args(["serve", "--prefix-cache", "radix"])
    assert args.prefix_cache == "radix" and build_parser().parse_args(["serve"]).prefix_cache == "hashed"
    assert serve_args("cpu", "float32", {"prefix_cache": "radix"})[-2:] == ["--prefix-cache", "radix"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--prefix-cache", "trie"])
    made = {}
    # A stand-in engine: the server enters it as a context, so that a tensor-parallel engine's ranks end with it.
    monkeypatch.setattr(me, "LLM", lambda *a, **kw: made.update(kw) or contextlib.nullcontext())
    monkeypatch.setattr("mini_engine.serving.server.serve", lambda *a, **kw: None)
    from mini_engine.__main__ import main
    main(["serve", "--prefix-cache", "radix"])
    assert made["prefix_cache"] == "radix"


# ---------------------------------------------------------------- the engine on the real model

ENGINE = {"block_size": 16, "max_num_seqs": 4, "max_model_len": 512, "chunked_prefill_tokens": 512}


@pytest.fixture(scope="module")
def engines(real, guard_writes):
    model, tok = real
    return {name: guard_writes(LLM.from_model(model, tok, **ENGINE, **kw)) if kw.get("enable_prefix_caching", True)
            else LLM.from_model(model, tok, **ENGINE, **kw)
            for name, kw in (("radix", {"prefix_cache": "radix"}), ("hashed", {}),
                             ("off", {"enable_prefix_caching": False}))}


def run(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def test_a_300_token_shared_prompt_reuses_299_tokens_with_radix_and_288_with_hashed_blocks(engines, real,
                                                                                              assert_greedy_match):
    rng = random.Random(3)
    shared = [rng.randrange(200, 9000) for _ in range(300)]
    first, second = shared + [rng.randrange(200, 9000) for _ in range(12)], shared + [rng.randrange(200, 9000)]
    params = me.SamplingParams(max_tokens=4, ignore_eos=True)
    outs = {}
    for name, llm in engines.items():
        llm.reset_prefix_cache()
        if name != "off":
            run(llm, [first], params)
        outs[name] = run(llm, [second], params)[0]
    assert outs["radix"].num_cached_tokens >= 299 and outs["hashed"].num_cached_tokens <= 288
    assert outs["off"].num_cached_tokens == 0
    print(f"\n300 shared tokens: radix reused {outs['radix'].num_cached_tokens}, hashed {outs['hashed'].num_cached_tokens}")
    for name in ("radix", "hashed"):
        assert_greedy_match(real[0], second, outs[name].token_ids, outs["off"].token_ids)


def test_a_conversations_second_turn_reuses_the_first_turns_prompt_and_answer(engines, real, assert_greedy_match):
    tok = real[1]
    turn1 = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe."}]))
    params = me.SamplingParams(max_tokens=12, ignore_eos=True)
    outs = {}
    for name, llm in engines.items():
        llm.reset_prefix_cache()
        answer = run(llm, [turn1], params)[0].token_ids
        turn2 = turn1 + answer + tok.encode("<|im_end|>\n<|im_start|>user\nAnd two in Asia?<|im_end|>\n")
        outs[name] = (turn2, run(llm, [turn2], params)[0])
    turn2, radix = outs["radix"]
    assert radix.num_cached_tokens == len(turn1) + 12 - 1, "prompt and answer (its last token was never fed)"
    assert outs["hashed"][1].num_cached_tokens == (len(turn1) + 11) // 16 * 16
    print(f"\nsecond turn of {len(turn2)} tokens: radix reused {radix.num_cached_tokens}, "
          f"hashed {outs['hashed'][1].num_cached_tokens}")
    for name in ("radix", "hashed"):
        assert_greedy_match(real[0], outs[name][0], outs[name][1].token_ids, outs["off"][1].token_ids)


def test_real_model_outputs_with_the_radix_tree_equal_the_uncached_engines(engines, real, assert_greedy_match):
    from tests.engine.test_prefix_caching import shared_prefix_stream
    prompts = shared_prefix_stream(random.Random(0), 6, 16)
    params = me.SamplingParams(max_tokens=4, ignore_eos=True)
    waves = (prompts[:4], prompts[4:])
    radix = [o for w in waves for o in run(engines["radix"], w, params)]
    off = [o for w in waves for o in run(engines["off"], w, params)]
    assert sum(o.num_cached_tokens for o in radix) > 0
    assert any(o.num_cached_tokens % 16 for o in radix), "some match ends inside a block"
    for prompt, a, b in zip(prompts, radix, off):
        assert_greedy_match(real[0], prompt, a.token_ids, b.token_ids)
    blocks = engines["radix"].engine.scheduler.blocks
    assert not blocks.block_tables and engines["radix"].engine.num_free_blocks == blocks.num_blocks


@pytest.mark.parametrize("scheduling", ["continuous", "cache_aware"])
def test_radix_with_preemption_sampling_forks_and_aborts_changes_no_output(tiny_model, guard_writes, scheduling):
    """A tiny model in a pool so small that requests are preempted and the tree evicts: greedy and seeded samples,
    n = 2 forks and an aborted request, against an uncached engine with room to spare."""
    model = tiny_model(1)
    rng = random.Random(2)
    roots = [[rng.randrange(128) for _ in range(40)] for _ in range(2)]
    prompts = [rng.choice(roots)[:rng.randint(1, 40)] + [rng.randrange(128) for _ in range(rng.randint(0, 8))]
               for _ in range(40)]
    prompts = [p or [1] for p in prompts]
    params = [me.SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=True, n=1 + (i % 7 == 0),
                                temperature=rng.choice([0.0, 0.0, 1.0]), seed=i) for i in range(len(prompts))]
    free = run(LLM.from_model(model, max_num_seqs=12, num_kv_blocks=400, enable_prefix_caching=False),
               prompts, params)
    llm = guard_writes(LLM.from_model(model, max_num_seqs=12, num_kv_blocks=16, block_size=8,
                                      chunked_prefill_tokens=32, prefix_cache="radix", scheduling=scheduling))
    engine = llm.engine
    doomed = engine.add_request(prompts[0] * 3, me.SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request(doomed)
    tight = run(llm, prompts, params)
    assert any(o.metrics.num_preemptions for o in tight), "a pool this small should force preemptions"
    assert any(o.num_cached_tokens % 8 for o in tight), "and matches should end inside blocks"
    assert engine.scheduler.blocks.num_evictions > 0, "the tree evicted leaves under pressure"
    for i, (a, b) in enumerate(zip(tight, free)):
        assert [s.token_ids for s in a.outputs] == [s.token_ids for s in b.outputs], f"request {i} changed"
    blocks = engine.scheduler.blocks
    assert not blocks.block_tables and engine.num_free_blocks == engine.num_kv_blocks == 16, "a block leaked"
    assert all(blocks.ref_counts[b] == (b in blocks.node_of) for b in range(16))
    assert "prefix caching on (radix)" in repr(llm)
