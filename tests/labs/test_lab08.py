"""Grades lab 08 (prefix caching: the block hash chain, lookups that take references, LRU eviction) in either tree.

    pytest tests/labs/test_lab08.py --impl=labs        # your work
    pytest tests/labs/test_lab08.py --impl=solutions   # the reference answers

The random-workload tests (hypothesis) check the pool's bookkeeping after every step: each block held, free or
evictable, never two of them; ref counts equal to the requests holding a block; no held block ever handed to
someone else. The last tests serve requests that share a system prompt with the real engine, `LLM`, running its
pool and prefix cache on your PrefixCache and your hashes.
"""
import importlib
import random
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mini_engine as me
from mini_engine import paging
from mini_engine.engine import LLM
from mini_engine.prefix import radix_cache

LAB = "lab08_prefix_caching"
# The engine's block manager already hashes blocks and keeps a prefix cache: calling it fails the test.
# Part 7's tree: the engine's radix tree (mini_engine.prefix) already matches, inserts and evicts.
SHORTCUTS = {"hash_block": [paging], "block_hashes": [paging], "PrefixCache": [paging], "RadixTree": [radix_cache]}
# Part 7, the radix tree, is optional: its tests are skipped while these are not written (and graded once they are).
OPTIONAL = pytest.mark.optional("match", "insert", "evict")
B = 4  # block size of most tests: small enough to count blocks by hand


def try_admit(cache, token_ids):
    """`admit`, or None when the pool is too full (RuntimeError); a TODO's NotImplementedError is no full pool."""
    try:
        return cache.admit(token_ids)
    except NotImplementedError:
        raise
    except RuntimeError:
        return None


def served(cache, token_ids):
    """One request's life: admitted, prefilled (its full blocks registered), finished. Returns its cached tokens."""
    blocks, num_cached = cache.admit(token_ids)
    cache.cache_full_blocks(token_ids, blocks)
    cache.release(blocks)
    return num_cached


# ---------------------------------------------------------------- the hash chain

def test_hash_block_digests_the_parent_and_the_tokens(impl):
    h = impl.hash_block(None, [1, 2, 3, 4])
    assert isinstance(h, bytes) and len(h) >= 16, \
        f"return a strong hash's digest as bytes (SHA-256 gives 32), got {type(h).__name__} {h!r:.40}"
    assert impl.hash_block(None, [1, 2, 3, 4]) == h, "the same block must always hash the same"
    assert impl.hash_block(None, (1, 2, 3, 4)) == h, "a tuple and a list of the same tokens must hash the same"
    assert impl.hash_block(None, [1, 2, 3, 5]) != h, "the hash must cover every token"
    assert impl.hash_block(None, [2, 1, 3, 4]) != h, "the hash must cover the tokens' order"
    assert impl.hash_block(h, [1, 2, 3, 4]) != h, "the hash must cover the parent's hash"
    other_parent = impl.hash_block(None, [9, 9, 9, 9])
    assert impl.hash_block(h, [5, 6, 7, 8]) != impl.hash_block(other_parent, [5, 6, 7, 8]), \
        "the same tokens after different parents must hash differently"


def test_block_hashes_cover_full_blocks_only(impl):
    tokens = list(range(100, 118))
    assert [len(impl.block_hashes(tokens[:n], B)) for n in (0, 3, 4, 5, 16, 18)] == [0, 0, 1, 1, 4, 4], \
        "one hash per FULL block: len(token_ids) // block_size; a partial last block is not hashed"
    hashes = impl.block_hashes(tokens, B)
    assert hashes[0] == impl.hash_block(None, tokens[:4]), "block 0 has no parent: hash_block(None, its tokens)"
    for i in range(1, 4):
        assert hashes[i] == impl.hash_block(hashes[i - 1], tokens[4 * i:4 * i + 4]), \
            f"block {i} must be hash_block(hash of block {i - 1}, its own {B} tokens)"


def test_prompts_share_block_hashes_exactly_as_far_as_they_share_blocks(impl):
    system = list(range(10))  # 10 shared tokens: 2 full blocks of 4, and half of a third
    a, b = impl.block_hashes(system + [50, 51, 52, 53, 60, 61], B), impl.block_hashes(system + [70, 71, 72, 73], B)
    assert a[:2] == b[:2], "prompts with the same first 8 tokens must have the same first 2 block hashes"
    assert a[2] != b[2], "block 2 holds different tokens in the two prompts"
    c = impl.block_hashes(system[:4] + [0] * 4 + system[8:] + [50, 51, 52, 53, 60, 61], B)
    assert c[0] == a[0] and c[2] != a[2] and c[3] != a[3], \
        "after the first different block every later hash differs, even where the tokens agree again"


@settings(max_examples=50, deadline=None)
@given(first=st.lists(st.integers(0, 49151), min_size=B, max_size=B),
       second=st.lists(st.integers(0, 49151), min_size=B, max_size=B),
       block=st.lists(st.integers(0, 49151), min_size=B, max_size=B))
def test_equal_blocks_behind_different_prefixes_hash_differently(impl, first, second, block):
    a, b = impl.block_hashes(first + block, B), impl.block_hashes(second + block, B)
    if first == second:
        assert a == b, "equal prompts must have equal block hashes"
    else:
        assert a[1] != b[1], (f"block {block} after {first} and after {second} got the same hash: its KV differs "
                              "(attention saw other tokens), so the hash must include the parent's")


# ---------------------------------------------------------------- references, free list, eviction

def test_allocate_takes_the_oldest_free_block_with_one_holder(impl):
    cache = impl.PrefixCache(3, B)
    assert [cache.allocate() for _ in range(3)] == [0, 1, 2], "take blocks from the left of free_blocks"
    assert cache.ref_counts == [1, 1, 1], "a freshly allocated block has exactly one holder"
    with pytest.raises(RuntimeError):
        cache.allocate()  # every block held: must raise RuntimeError
    assert cache.num_available() == 0


def test_a_released_cached_block_stays_cached_but_evictable(impl):
    cache = impl.PrefixCache(8, B)
    prompt = list(range(10))  # 2 full blocks and 2 tokens of a third
    blocks, num_cached = cache.admit(prompt)
    assert (blocks, num_cached) == ([0, 1, 2], 0), "an empty cache: no hit, 3 fresh blocks for 10 tokens"
    cache.cache_full_blocks(prompt, blocks)
    assert set(cache.cached_blocks.values()) == {0, 1}, "only the 2 full blocks are cached, not the partial one"
    assert cache.block_hash[0] == impl.block_hashes(prompt, B)[0] and cache.block_hash[2] is None
    cache.release(blocks)
    assert cache.ref_counts[:3] == [0, 0, 0]
    assert list(cache.evictable) == [1, 0], \
        "nobody holds the cached blocks now: they join evictable, released LAST block first (1, then 0)"
    assert 2 in cache.free_blocks and 0 not in cache.free_blocks and 1 not in cache.free_blocks, \
        "an uncached block goes back to free_blocks; a cached one stays out of it (it is evictable instead)"
    assert cache.num_available() == 8, "free and evictable blocks can all be given to a request"
    assert served(cache, prompt) == 8, "the same prompt again must find its 2 cached blocks: 8 tokens"


def test_a_double_free_is_an_error_and_counts_never_go_negative(impl):
    cache = impl.PrefixCache(2, B)
    block = cache.allocate()
    cache.free(block)
    with pytest.raises(ValueError):
        cache.free(block)  # freeing a block nobody holds must raise ValueError
    assert cache.ref_counts[block] == 0, "a rejected double free must leave the count at 0, not -1"
    assert list(cache.free_blocks).count(block) == 1, "a rejected double free must not list the block twice"


def test_hand_computed_hits_of_a_64_token_prompt(impl):
    cache = impl.PrefixCache(16, 16)
    prompt = list(range(1000, 1064))
    assert served(cache, prompt[:50]) == 0, "nothing is cached yet"  # caches 3 full blocks: tokens 0-47
    blocks, num_cached = cache.admit(prompt)
    assert num_cached == 48, f"the first 48 of 64 tokens are cached in blocks of 16: 3 hits, got {num_cached} tokens"
    assert blocks[:3] == [0, 1, 2] and len(blocks) == 4, "the table is the 3 cached blocks, then 1 fresh block"
    cache.cache_full_blocks(prompt, blocks)
    cache.release(blocks)  # now all 4 blocks of the prompt are cached
    last_block = blocks[3]
    blocks, num_cached = cache.admit(prompt)
    assert num_cached == 48, ("a full hit must still compute the last token (its logits give the first output "
                              f"token): at most (64 - 1) // 16 = 3 blocks hit, got {num_cached} tokens")
    assert blocks[:3] == [0, 1, 2] and blocks[3] != last_block, "the 4th block is recomputed into a fresh block"


def test_lookup_takes_a_reference_on_every_hit(impl):
    cache = impl.PrefixCache(8, B)
    prompt = list(range(9))
    first, _ = cache.admit(prompt)
    cache.cache_full_blocks(prompt, first)  # the first request is still running
    second, num_cached = cache.admit(prompt)
    assert num_cached == 8 and second[:2] == first[:2], "a running request's cached blocks are hits too"
    assert [cache.ref_counts[b] for b in first] == [2, 2, 1], "two requests hold the 2 shared blocks"
    cache.release(first)
    assert [cache.ref_counts[b] for b in second[:2]] == [1, 1] and not cache.evictable, \
        "the second request still holds the shared blocks: they are not evictable yet"
    cache.release(second)
    available = cache.num_available()
    hits = cache.lookup(prompt)
    assert hits == second[:2], "lookup returns the blocks of the longest cached prefix"
    assert not cache.evictable and cache.num_available() == available - 2, \
        "a hit on an evictable block takes it out of evictable: it is in use again and no longer available"


def test_lookup_stops_at_the_first_missing_block(impl):
    cache = impl.PrefixCache(4, B)
    prompt = list(range(13))  # blocks 0, 1, 2 full and one token in block 3
    blocks, _ = cache.admit(prompt)
    cache.cache_full_blocks(prompt, blocks)
    for block in (3, 1, 0, 2):  # released out of order: evictable becomes 1, 0, 2 (least recently used first)
        cache.free(block)
    assert list(cache.evictable) == [1, 0, 2], "a block whose last holder lets go joins the END of evictable"
    assert cache.allocate() == 3, "a free block is used before any cached one is evicted"
    assert cache.allocate() == 1, "with no free block, evict the least recently used evictable block (1)"
    assert 1 not in cache.cached_blocks.values() and cache.block_hash[1] is None, \
        "an evicted block's hash must be forgotten both ways: its contents are about to be overwritten"
    assert cache.lookup(prompt) == [0], \
        "block 1 of the prompt is no longer cached: the hit stops there, even though block 2 still is"


def test_eviction_is_least_recently_used_first(impl):
    cache = impl.PrefixCache(4, B)
    a, b = list(range(100, 105)), list(range(200, 205))  # one full block each, plus a token
    served(cache, a)
    served(cache, b)  # a's block is now the least recently used
    assert served(cache, a) == 4, "a's block is still cached"  # ... and now b's is the least recently used
    served(cache, list(range(300, 309)))  # needs 3 blocks: the 2 free ones, then one eviction
    assert served(cache, a) == 4, "a was used more recently than b: b's block must have been evicted, not a's"
    assert served(cache, b) == 0, "b's block was the least recently used: it is the one evicted"


def test_an_evicted_block_is_never_a_stale_hit(impl):
    cache = impl.PrefixCache(2, B)
    a, b = list(range(5)), list(range(50, 55))
    served(cache, a)  # block 0 caches a's first 4 tokens
    blocks, _ = cache.admit(b)  # takes free block 1, then evicts block 0 for its second block
    assert sorted(blocks) == [0, 1]
    cache.cache_full_blocks(b, blocks)
    assert cache.lookup(a) == [], "block 0 now holds b's tokens: a lookup of a must miss, not return block 0"
    assert cache.lookup(b) == blocks[:1]


def test_admit_is_all_or_nothing(impl):
    cache = impl.PrefixCache(4, B)
    shared = list(range(8))
    held, _ = cache.admit(shared + [8])  # 3 blocks held by a running request
    cache.cache_full_blocks(shared + [8], held)
    with pytest.raises(RuntimeError):
        cache.admit(shared + list(range(20, 29)))  # 2 hits, but 3 fresh blocks needed and 1 available
    assert [cache.ref_counts[b] for b in held] == [1, 1, 1], \
        "a failed admit must give back the references its lookup took on the hits"
    assert cache.num_available() == 1, "a failed admit must not take or leak any block"
    blocks, num_cached = cache.admit(shared + [30])
    assert num_cached == 8 and len(blocks) == 3, "2 hits and 1 fresh block fit"


def test_identical_prompts_admitted_together_keep_one_cached_copy(impl):
    cache = impl.PrefixCache(8, B)
    prompt = list(range(9))
    first, _ = cache.admit(prompt)
    second, num_cached = cache.admit(prompt)  # same step: nothing registered yet, so no hit
    assert num_cached == 0 and not set(first) & set(second)
    cache.cache_full_blocks(prompt, first)
    cache.cache_full_blocks(prompt, second)
    assert sorted(cache.cached_blocks.values()) == first[:2], \
        "the first copy registered keeps the hashes; the duplicate's blocks stay uncached"
    assert all(cache.block_hash[b] is None for b in second), "a block is cached only if cached_blocks points at it"
    cache.release(second)
    assert set(second) <= set(cache.free_blocks), "the duplicate's uncached blocks go back to free_blocks"
    assert cache.admit(prompt)[0][:2] == first[:2]


# ---------------------------------------------------------------- random workloads

def check_pool(cache, tables):
    """The pool's invariants, given the running requests' block tables."""
    holders = [0] * cache.num_blocks
    for table in tables:
        for block in table:
            holders[block] += 1
    assert cache.ref_counts == holders, f"ref counts {cache.ref_counts} differ from the holders {holders}"
    free, evictable = list(cache.free_blocks), list(cache.evictable)
    held = [b for b in range(cache.num_blocks) if holders[b]]
    assert sorted(free + evictable + held) == list(range(cache.num_blocks)), \
        "each block must be in exactly one place: held, free_blocks or evictable"
    assert all(cache.block_hash[b] is not None for b in evictable), "only cached blocks are evictable"
    assert all(cache.block_hash[b] is None for b in free), "a block in free_blocks caches nothing"
    assert {b: h for b, h in enumerate(cache.block_hash) if h is not None} == \
        {b: h for h, b in cache.cached_blocks.items()}, "cached_blocks and block_hash must mirror each other"


workloads = st.lists(st.tuples(st.sampled_from(["admit", "release"]), st.integers(0, 3), st.integers(0, 11),
                               st.integers(0, 99)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(steps=workloads)
def test_random_workloads_keep_the_books_and_return_every_count_to_zero(impl, steps):
    cache = impl.PrefixCache(10, B)
    prefixes = [[], list(range(9)), list(range(4)) + [7] * 6, list(range(100, 113))]
    tables = []
    for action, prefix, extra, pick in steps:
        if action == "admit":
            prompt = prefixes[prefix] + [500 + pick] * (1 + extra % 6)
            admitted = try_admit(cache, prompt)
            if admitted:
                blocks, num_cached = admitted
                assert len(blocks) == -(-len(prompt) // B), "a table holds ceil(len / block_size) blocks"
                assert num_cached % B == 0 and num_cached < len(prompt), \
                    "cached tokens come in whole blocks and never include the prompt's last token"
                cache.cache_full_blocks(prompt, blocks)
                tables.append(blocks)
        elif tables:
            cache.release(tables.pop(pick % len(tables)))
        check_pool(cache, tables)
    for table in tables:
        cache.release(table)
    assert cache.ref_counts == [0] * cache.num_blocks, "after every request is released, every ref count is 0"
    assert cache.num_available() == cache.num_blocks


@settings(max_examples=60, deadline=None)
@given(steps=workloads)
def test_no_block_is_evicted_while_a_request_holds_it(impl, steps):
    cache = impl.PrefixCache(6, B)
    running = []  # (block table, the hashes its cached blocks had when it was admitted)
    for action, prefix, extra, pick in steps:
        if action == "admit":
            prompt = list(range(prefix * 4)) + [500 + pick] * (1 + extra)
            admitted = try_admit(cache, prompt)
            if not admitted:
                continue
            blocks, _ = admitted
            cache.cache_full_blocks(prompt, blocks)
            running.append((blocks, {b: cache.block_hash[b] for b in blocks if cache.block_hash[b] is not None}))
        elif running:
            cache.release(running.pop(pick % len(running))[0])
        for blocks, hashes in running:
            assert all(cache.ref_counts[b] > 0 for b in blocks), "a running request's block lost its holder"
            assert all(cache.block_hash[b] == h for b, h in hashes.items()), \
                "a running request's cached block was evicted (allocate may only evict blocks nobody holds)"


# ---------------------------------------------------------------- part 7 (optional): the radix tree

def runs_below(node):
    """{first token: run} of a node's children, to compare a tree's shape with one drawn by hand."""
    return {t: child.tokens for t, child in node.children.items()}


@OPTIONAL
def test_radix_match_ends_at_any_token(impl):
    tree = impl.RadixTree()
    assert tree.match([1, 2, 3]) == 0, "an empty tree holds nothing"
    tree.insert([1, 2, 3, 4, 5])
    for tokens, expected in (([1, 2, 3, 4, 5, 6], 5), ([1, 2, 3, 9], 3), ([1, 2, 3, 4, 5], 5), ([7, 1], 0),
                             ([1], 1), ([], 0)):
        got = tree.match(tokens)
        assert got == expected, (f"after insert([1, 2, 3, 4, 5]), match({tokens}) must be {expected} (the leading "
                                 f"tokens the tree holds, ending at any token), got {got}")
    assert runs_below(tree.root) == {1: (1, 2, 3, 4, 5)}, "match must not change the tree"


@OPTIONAL
def test_radix_insert_splits_a_run_where_two_sequences_part(impl):
    tree = impl.RadixTree()
    assert tree.insert([1, 2, 3, 4]) == 0, "insert returns how many leading tokens the tree held already: 0 at first"
    assert runs_below(tree.root) == {1: (1, 2, 3, 4)}, "the first sequence is one leaf under the root, one run"
    assert tree.insert([1, 2, 5]) == 2, "insert([1, 2, 5]) after [1, 2, 3, 4]: 2 tokens were there already"
    assert runs_below(tree.root) == {1: (1, 2)}, \
        "the run (1, 2, 3, 4) must be split where [1, 2, 5] parts from it: (1, 2) above, (3, 4) below"
    trunk = tree.root.children[1]
    assert runs_below(trunk) == {3: (3, 4), 5: (5,)}, f"under (1, 2): (3, 4) and the new leaf (5,), got {runs_below(trunk)}"
    assert trunk.parent is tree.root and all(c.parent is trunk for c in trunk.children.values()), \
        "a split must set the parents: the upper part's is the old node's parent, the lower part's the upper part"
    assert tree.num_tokens() == 5, "shared tokens are stored once: 1, 2, 3, 4 and 5"
    assert tree.insert([1, 2]) == 2 and tree.num_tokens() == 5, "inserting what the tree holds adds nothing"
    assert tree.insert([1, 2, 3, 4, 6, 7]) == 4 and runs_below(trunk.children[3]) == {6: (6, 7)}, \
        "a sequence that goes on past a leaf's run hangs its new tokens below that leaf"
    assert tree.match([1, 2, 3, 4, 6, 7, 8]) == 6 and tree.match([1, 2, 5, 5]) == 3


@OPTIONAL
def test_radix_match_and_insert_stamp_their_path(impl):
    tree = impl.RadixTree()
    tree.insert([1, 2, 3])
    tree.insert([1, 2, 9])
    trunk = tree.root.children[1]
    a, b = trunk.children[3], trunk.children[9]
    assert b.last_used > a.last_used, "each insert advances the clock and stamps the nodes on its path"
    assert trunk.last_used == b.last_used, "the shared part (1, 2) is on the second insert's path: stamp it too"
    tree.match([1, 2, 3, 7])
    assert a.last_used > b.last_used and trunk.last_used == a.last_used, \
        "match stamps every node it enters: (1, 2) and (3,) were just used, (9,) was not"


@OPTIONAL
def test_radix_evict_takes_least_recently_used_leaves_and_keeps_the_shared_trunk(impl):
    tree = impl.RadixTree()
    for tokens in ([1, 2, 3, 4], [1, 2, 5, 6], [9, 9]):
        tree.insert(tokens)
    tree.match([1, 2, 3, 4])  # (1, 2) and (3, 4) used last; the leaf (5, 6) the longest ago
    assert tree.evict(1) == 2 and tree.match([1, 2, 5, 6]) == 2 and tree.match([1, 2, 3, 4]) == 4, \
        "evict(1) must remove the least recently used leaf, (5, 6): 2 tokens, the trunk (1, 2) stays"
    tree.match([1, 2, 3, 4])
    assert tree.evict(3) == 4, "evict(3): (9, 9), then the oldest leaf left, (3, 4): 4 tokens, at least 3"
    assert tree.match([9, 9]) == 0 and tree.match([1, 2, 3]) == 2, "(1, 2) outlived its branches"
    assert tree.evict(100) == 2 and tree.num_tokens() == 0 and tree.root.children == {}, \
        "a parent whose children all went is a leaf: evict(100) removes (1, 2) too, then stops at an empty tree"
    assert tree.evict(1) == 0, "an empty tree frees nothing"


@OPTIONAL
@pytest.mark.parametrize("seed", range(4))
def test_radix_tree_against_a_list_of_sequences(impl, seed):
    """Random inserts, matches and evictions over a 4-token alphabet, so sequences share prefixes and part anywhere:
    match is the longest prefix shared with a stored sequence, and the tree stores every distinct prefix once.
    (Seeded loops, not hypothesis: an unwritten optional part must skip the test, not fail it.)"""
    rng = random.Random(seed)
    tree, stored = impl.RadixTree(), []
    for _ in range(120):
        action = rng.choices(["insert", "match", "evict"], weights=[5, 4, 1])[0]
        tokens = [rng.randrange(4) for _ in range(rng.randrange(9))]
        best = max((next((i for i, (x, y) in enumerate(zip(s, tokens)) if x != y), min(len(s), len(tokens)))
                    for s in stored), default=0)
        if action == "insert":
            assert tree.insert(tokens) == best, f"insert({tokens}) with {stored} stored must return {best}"
            stored.append(tokens)
        elif action == "match":
            assert tree.match(tokens) == best, f"match({tokens}) with {stored} stored must be {best}"
        else:
            before = tree.num_tokens()
            freed = tree.evict(len(tokens))
            assert tree.num_tokens() == before - freed and (freed >= len(tokens) or tree.num_tokens() == 0), \
                f"evict({len(tokens)}) freed {freed} of {before} tokens: at least what was asked, or everything"
            stored = [s[:tree.match(s)] for s in stored]  # what is left of each (match is checked by itself)
        assert tree.num_tokens() == len({tuple(s[:i]) for s in stored for i in range(1, len(s) + 1)}), \
            "the tree must store each distinct prefix's last token once: shared runs are never duplicated"


# ---------------------------------------------------------------- your prefix cache in the real engine

def engine_block_manager(impl):
    """The given EngineBlockManager on the (graded) PrefixCache and block_hashes of `impl`."""
    return type("Graded", (impl.EngineBlockManager,), {"cache_class": impl.PrefixCache,
                                                        "hashes": staticmethod(impl.block_hashes)})


@pytest.fixture(scope="module")
def shop_prompts(real_model):
    """Chapter 08's workload, smaller: one long system prompt, short questions behind it."""
    _, tok = real_model
    rules = [f"Rule {i}: when a customer asks about item {i}, give the price in euros and the warranty of "
             f"{i % 3 + 1} years." for i in range(8)]
    system = "You are the assistant of a bicycle shop. Follow these rules.\n" + "\n".join(rules)
    asks = ["Do you fix flat tyres?", "Are you open on Sunday?", "How much is a new chain?", "Can I rent a bike?",
            "Do you sell helmets?", "Where is the shop?", "Is item 3 in stock?"]
    return [tok.encode(tok.apply_chat_template([{"role": "system", "content": system},
                                                {"role": "user", "content": q}])) for q in asks]


def test_the_engine_serves_requests_with_your_prefix_cache(impl, real_model, shop_prompts):
    """The first request computes the system prompt; the next three, served together, find it in your cache; then
    one of them again (it finds its own question's block too) with three new questions, which need more blocks
    than are free: cached blocks are evicted. Every output, and every count of cached tokens, must be what the
    engine's own block manager gives."""
    model, tok = real_model
    params = me.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    kwargs = dict(block_size=16, max_num_seqs=4, num_kv_blocks=20, max_model_len=max(map(len, shop_prompts)) + 4)
    runs = {}
    for name, manager in (("yours", engine_block_manager(impl)), ("own", None)):
        llm = LLM.from_model(model, tok, block_manager=manager, **kwargs)
        outs = [o for batch in (shop_prompts[:1], shop_prompts[1:4], shop_prompts[1:2] + shop_prompts[4:])
                for o in llm.generate(batch, params, use_tqdm=False)]
        runs[name] = (outs, llm.engine.scheduler.blocks)
    (own, own_blocks), (yours, your_blocks) = runs["own"], runs["yours"]
    assert [o.token_ids for o in yours] == [o.token_ids for o in own], \
        "the engine on your prefix cache must give the tokens it gives on its own"
    cached = [o.num_cached_tokens for o in yours]
    assert cached == [o.num_cached_tokens for o in own], (
        f"prompt tokens served from your cache per request: {cached}; the engine's own cache serves "
        f"{[o.num_cached_tokens for o in own]}: check lookup (longest cached prefix, never the last token), "
        "cache_full_blocks, and which block allocate evicts")
    assert cached[0] == 0 and min(cached[1:]) > 0, "the system prompt is computed once, then found in the cache"
    assert cached[4] > cached[1], "a question asked again also finds the block its question began in"
    assert your_blocks.num_evictions == own_blocks.num_evictions > 0, "the last four requests evict cached blocks"
    assert your_blocks.num_free_blocks == 20 and all(n == 0 for n in your_blocks.cache.ref_counts), \
        "every block is back in your pool at the end"


# ---------------------------------------------------------------- the guards (see conftest.py)

solution = importlib.import_module(f"solutions.{LAB}")  # what a hand-off may build on besides the engine


def engine_view(cache, **tables):
    """The engine's block manager's fields, over the prefix cache's own."""
    return types.SimpleNamespace(free_blocks=cache.free_blocks, evictable=cache.evictable, ref_counts=cache.ref_counts,
                                 cached_blocks=cache.cached_blocks, block_hash=cache.block_hash, block_tables=tables,
                                 seq_hashes={}, block_size=cache.block_size, enable_prefix_caching=True)


class AllocateByTheEngine(solution.PrefixCache):
    def allocate(self):  # the engine's block manager keeps the same fields
        return paging.BlockManager._take_block(self)


class FreeByTheEngine(solution.PrefixCache):
    def free(self, block_id):
        if self.ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} has no holder")
        paging.BlockManager.free(engine_view(self, seq=[block_id]), "seq")


class ReleaseByTheEngine(solution.PrefixCache):
    def release(self, block_ids):
        paging.BlockManager.free(engine_view(self, seq=list(block_ids)), "seq")


class LookupByTheEngine(solution.PrefixCache):
    def lookup(self, token_ids):
        hits = paging.BlockManager.lookup(engine_view(self), token_ids)
        for block in hits:
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
        return hits


class CacheFullBlocksByTheEngine(solution.PrefixCache):
    def cache_full_blocks(self, token_ids, block_ids):
        paging.BlockManager.cache_blocks(engine_view(self, seq=list(block_ids)), "seq", token_ids, len(token_ids))


class AdmitByTheEngine(solution.PrefixCache):
    def admit(self, token_ids):
        hits = self.lookup(token_ids)
        needed = paging.BlockManager.blocks_for(self, len(token_ids)) - len(hits)
        if needed > self.num_available():
            self.release(hits)
            raise RuntimeError(f"{needed} fresh blocks needed")
        return hits + [self.allocate() for _ in range(needed)], len(hits) * self.block_size


class MatchByTheEngine(solution.RadixTree):
    def match(self, token_ids):  # the engine's tree's comparison of a run with the tokens
        self.clock += 1
        node, matched = self.root, 0
        while matched < len(token_ids) and token_ids[matched] in node.children:
            node = node.children[token_ids[matched]]
            node.last_used = self.clock
            n = radix_cache.common_prefix(node.tokens, token_ids[matched:])
            matched += n
            if n < len(node.tokens):
                break
        return matched


class InsertByTheEngine(solution.RadixTree):
    def insert(self, token_ids):  # the engine's block tree at a block size of 1 finds the match
        engine_tree = radix_cache.RadixBlockManager(num_blocks=len(token_ids) + 1, block_size=1)
        engine_tree.num_cached_tokens(list(token_ids) + [-1])
        return super().insert(token_ids)


class EvictByTheEngine(solution.RadixTree):
    def evict(self, num_tokens):  # the engine's least-recently-used leaf choice, on a view of this tree
        freed = 0
        while freed < num_tokens and self.root.children:
            nodes, stack = {}, [self.root]
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                if node is not self.root:
                    nodes[id(node)] = node
            removed = []
            view = types.SimpleNamespace(evictable=dict.fromkeys(nodes), node_of=nodes, num_evictions=0,
                                         _remove=removed.append)
            radix_cache.RadixBlockManager._evict_one(view)
            del removed[0].parent.children[removed[0].tokens[0]]
            freed += len(removed[0].tokens)
        return freed


# Each part of the lab handed to something that already does it, and a grading test that must fail it.
HAND_OFFS = [
    ("hash_block", paging.hash_block, test_hash_block_digests_the_parent_and_the_tokens, {}),
    ("block_hashes", lambda token_ids, block_size: paging.block_hashes(token_ids, block_size),
     test_block_hashes_cover_full_blocks_only, {}),
    ("PrefixCache.allocate", AllocateByTheEngine, test_allocate_takes_the_oldest_free_block_with_one_holder, {}),
    ("PrefixCache.free", FreeByTheEngine, test_a_double_free_is_an_error_and_counts_never_go_negative, {}),
    ("PrefixCache.release", ReleaseByTheEngine, test_a_released_cached_block_stays_cached_but_evictable, {}),
    ("PrefixCache.lookup", LookupByTheEngine, test_lookup_takes_a_reference_on_every_hit, {}),
    ("PrefixCache.cache_full_blocks", CacheFullBlocksByTheEngine, test_hand_computed_hits_of_a_64_token_prompt, {}),
    ("PrefixCache.admit", AdmitByTheEngine, test_admit_is_all_or_nothing, {}),
    ("RadixTree.match", MatchByTheEngine, test_radix_match_ends_at_any_token, {}),
    ("RadixTree.insert", InsertByTheEngine, test_radix_insert_splits_a_run_where_two_sequences_part, {}),
    ("RadixTree.evict", EvictByTheEngine, test_radix_evict_takes_least_recently_used_leaves_and_keeps_the_shared_trunk,
     {}),
]


def test_every_part_of_the_lab_has_a_hand_off_check(asked_for):
    missing = set(asked_for(LAB)) - {part for part, *_ in HAND_OFFS}
    assert not missing, f"parts of the lab with no hand-off check above: {sorted(missing)}"


@pytest.mark.parametrize("part,replacement,test,args", HAND_OFFS,
                         ids=[f"{part}-{i}" for i, (part, *_) in enumerate(HAND_OFFS)])
def test_the_grader_fails_a_part_handed_off(hand_off, part, replacement, test, args):
    hand_off(part, replacement, test, **args)


# ---------------------------------------------------------------- wrong answers, and the one line each prints

class InsertWithoutSplitting(solution.RadixTree):
    def insert(self, token_ids):  # where the sequence parts from a run, the new tokens replace the run
        self.clock += 1
        node, matched = self.root, 0
        while matched < len(token_ids) and token_ids[matched] in node.children:
            child = node.children[token_ids[matched]]
            n = solution._agree(child.tokens, token_ids[matched:])
            if n < len(child.tokens):
                break
            child.last_used = self.clock
            node, matched = child, matched + n
        if matched < len(token_ids):
            leaf = solution.RadixNode(tuple(token_ids[matched:]), node)
            leaf.last_used = self.clock
            node.children[leaf.tokens[0]] = leaf
        return matched


class MatchWithoutStamping(solution.RadixTree):
    def match(self, token_ids):
        clock, stamps = self.clock, {}
        stack = [self.root]
        while stack:
            node = stack.pop()
            stamps[node] = node.last_used
            stack.extend(node.children.values())
        matched = super().match(token_ids)
        for node, stamp in stamps.items():
            node.last_used = stamp
        self.clock = clock + 1
        return matched


# A wrong part, a grading test, and the one line that test must print for it (a regular expression).
WRONG_ANSWERS = [
    ({"RadixTree": InsertWithoutSplitting}, test_radix_insert_splits_a_run_where_two_sequences_part,
     r"insert\(\[1, 2, 5\]\) after \[1, 2, 3, 4\]: 2 tokens were there already.*"),
    ({"RadixTree": MatchWithoutStamping}, test_radix_match_and_insert_stamp_their_path,
     r"match stamps every node it enters: \(1, 2\) and \(3,\) were just used, \(9,\) was not.*"),
]


@pytest.mark.parametrize("replacements,test,line", WRONG_ANSWERS,
                         ids=[f"{t.__name__.removeprefix('test_')}-{i}" for i, (_, t, _) in enumerate(WRONG_ANSWERS)])
def test_a_wrong_answer_fails_with_one_line_that_says_what_to_fix(wrong_answer, replacements, test, line):
    wrong_answer(test, replacements, line)
