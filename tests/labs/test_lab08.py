"""Grades lab 08 (prefix caching: the block hash chain, lookups that take references, LRU eviction, and SGLang's radix
tree over blocks with locked paths) in either tree.

    pytest tests/labs/test_lab08.py --impl=labs        # your work
    pytest tests/labs/test_lab08.py --impl=solutions   # the reference answers

The random-workload tests (hypothesis) check the pool's bookkeeping after every step: each block held, free or
evictable, never two of them; ref counts equal to the requests holding a block (lock counts equal to the requests
using a node's path); no held block ever handed to someone else. The last tests serve requests with the real engine,
`LLM`, running its pool and prefix cache on your PrefixCache and your hashes, then on your RadixBlockTree: a
conversation, and a pool small enough to evict.
"""
import importlib
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
# Part 7's tree: the engine's radix tree (mini_engine.prefix) already matches, inserts, holds and evicts. (The tree
# builds on paging.BlockManager's pool, as the engine runs it, so only the engine's tree is off limits there.)
SHORTCUTS = {"hash_block": [paging], "block_hashes": [paging], "PrefixCache": [paging],
             "RadixBlockTree": [radix_cache]}
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


# ---------------------------------------------------------------- part 7: the radix tree over blocks

def hand_built(impl):
    """A tree drawn by hand (blocks of 4): (0 1 2 3) in block 5, below it (4 5 6 7) in block 2 with (8 9 10 11) in
    block 9 below that, and (4 5 6 9) in block 7."""
    tree = impl.RadixBlockTree(16, B)
    nodes = {}
    for block, parent, tokens in ((5, None, (0, 1, 2, 3)), (2, 5, (4, 5, 6, 7)), (9, 2, (8, 9, 10, 11)),
                                  (7, 5, (4, 5, 6, 9))):
        above = nodes[parent] if parent is not None else tree.root
        nodes[block] = above.children[tokens] = impl.RadixNode(tokens, block, above)
        tree.node_of[block], tree.evictable[block] = nodes[block], None
    return tree, nodes


def blocks_of(nodes):
    return [node.block for node in nodes]


def test_radix_match_walks_whole_blocks_and_never_the_last_token(impl):
    tree = impl.RadixBlockTree(16, B)
    assert tree.match(list(range(9))) == [], "an empty tree holds nothing: match must return []"
    tree, _ = hand_built(impl)
    for tokens, expected, why in (
            (list(range(13)), [5, 2, 9], "three whole blocks agree, and token 12 is left to compute"),
            (list(range(10)), [5, 2], "a block of which only 2 tokens agree is no hit: whole blocks only"),
            ([0, 1, 2, 3, 4, 5, 6, 9, 0], [5, 7], "after (0 1 2 3) the child keyed (4 5 6 9)"),
            ([0, 1, 2, 3, 4, 5, 6, 8, 0], [5], "no child of block 5 holds (4 5 6 8)"),
            ([1, 2, 3, 4, 5], [], "no child of the root holds (1 2 3 4)"),
            ([], [], "no tokens, no blocks")):
        got = blocks_of(tree.match(tokens))
        assert got == expected, f"match({tokens}) must give the nodes of blocks {expected} ({why}), got blocks {got}"
    got = blocks_of(tree.match(list(range(12))))
    assert got == [5, 2], ("match must leave the prompt's last token to compute (its logits give the first output "
                           f"token): at most (12 - 1) // 4 = 2 blocks for 12 tokens, got blocks {got}")
    assert tree.clock == 0 and all(n.lock_ref == 0 and n.last_used == 0 for n in tree.node_of.values()) \
        and set(tree.evictable) == {5, 2, 9, 7}, "match must change nothing: no lock, no stamp, no clock"


def test_radix_insert_hangs_one_node_per_full_block(impl):
    tree = impl.RadixBlockTree(16, B)
    end = tree.insert(list(range(8)), [3, 5])
    assert isinstance(end, impl.RadixNode) and (end.block, end.tokens) == (5, (4, 5, 6, 7)), \
        "insert(tokens 0..7, blocks [3, 5]) must return the last node of its walk: block 5, tokens (4, 5, 6, 7)"
    assert list(tree.root.children) == [(0, 1, 2, 3)], "one child of the root, keyed by its block's tokens (a tuple)"
    trunk = tree.root.children[(0, 1, 2, 3)]
    assert trunk.block == 3 and trunk.parent is tree.root and trunk.children == {(4, 5, 6, 7): end} \
        and end.parent is trunk, "block 3 below the root, block 5 below block 3, parents set"
    assert tree.node_of == {3: trunk, 5: end}, "node_of must map every block in the tree to its node"
    assert set(tree.evictable) == {3, 5} and trunk.lock_ref == end.lock_ref == 0, \
        "a new node is unlocked (lock_ref 0), so its block is in evictable until the given code locks it"
    assert tree.insert(list(range(8)), [3, 5]) is end and len(tree.node_of) == 2, \
        "inserting what the tree holds adds nothing and returns the same last node"
    branch = tree.insert([0, 1, 2, 3, 9, 9, 9, 9], [3, 8])
    assert branch.parent is trunk and set(trunk.children) == {(4, 5, 6, 7), (9, 9, 9, 9)}, \
        "a prompt that parts from the tree after block 3 hangs its next block below block 3"
    again = tree.insert(list(range(12)), [4, 6, 7])
    assert (again.block, again.parent) == (7, end) and set(tree.node_of) == {3, 5, 8, 7}, (
        "blocks 4 and 6 hold what blocks 3 and 5 hold already (the same prefix computed twice): keep the tree's "
        "copies, walk on below them, and hang block 7 below block 5")


def test_radix_lock_and_unlock_the_path_to_the_root(impl, must_raise):
    tree = impl.RadixBlockTree(16, B)
    end = tree.insert(list(range(8)), [3, 5])
    branch = tree.insert([0, 1, 2, 3, 9, 9, 9, 9], [3, 8])
    trunk = end.parent
    tree.lock(end)
    assert (trunk.lock_ref, end.lock_ref, branch.lock_ref) == (1, 1, 0), \
        "lock(node) adds one to lock_ref on every node from it up to the root's child, and on no other"
    assert set(tree.evictable) == {8}, "a locked node is in use: its block leaves evictable"
    assert tree.clock == 1 and trunk.last_used == end.last_used == 1 and branch.last_used == 0, \
        "lock advances the clock by one and stamps the path it locks"
    tree.lock(branch)
    assert (trunk.lock_ref, end.lock_ref, branch.lock_ref) == (2, 1, 1) and not tree.evictable, \
        "two requests use the trunk: lock_ref 2"
    tree.unlock(end)
    assert (trunk.lock_ref, end.lock_ref) == (1, 0) and set(tree.evictable) == {5}, \
        "unlock(node) takes one from the path; block 5 is unlocked (evictable), the trunk still used by the other"
    assert tree.clock == 3 and end.last_used == trunk.last_used == 3, "unlock advances the clock and stamps the path"
    tree.unlock(branch)
    assert set(tree.evictable) == {3, 5, 8} and trunk.lock_ref == 0, "nobody uses the tree now: all evictable"
    with must_raise(ValueError, "unlock of a path nobody locked must raise ValueError"):
        tree.unlock(end)
    assert (trunk.lock_ref, end.lock_ref) == (0, 0) and set(tree.evictable) == {3, 5, 8}, \
        "a rejected unlock must change nothing (no lock_ref below 0)"


def test_radix_evict_takes_the_least_recently_used_unlocked_leaf(impl, must_raise):
    tree = impl.RadixBlockTree(16, B)
    a = tree.insert(list(range(8)), [0, 1])
    b = tree.insert([0, 1, 2, 3, 9, 9, 9, 9], [0, 2])
    c = tree.insert([7] * 8, [3, 4])
    for node in (b, a, c):  # three requests, one after another: b's the longest ago
        tree.lock(node)
        tree.unlock(node)
    got = tree.evict()
    assert got == 2, f"evict must take the least recently used unlocked leaf, block 2, got {got}"
    assert 2 not in tree.node_of and 2 not in tree.evictable and set(a.parent.children) == {(4, 5, 6, 7)}, \
        "an evicted node leaves its parent's children, node_of and evictable"
    tree.lock(c)  # a request uses c's path again
    got = [tree.evict(), tree.evict()]
    assert got == [1, 0], (f"with c's path locked, evict must take block 1, then block 0 (a leaf once its last "
                           f"child went: a trunk goes after its branches), got {got}")
    with must_raise(RuntimeError, "evict with every cached block locked must raise RuntimeError"):
        tree.evict()
    tree.unlock(c)
    assert [tree.evict(), tree.evict()] == [4, 3] and not tree.root.children and not tree.node_of


def test_radix_evict_never_takes_a_locked_node(impl):
    tree = impl.RadixBlockTree(16, B)
    held, done = tree.insert([1] * 8, [0, 1]), tree.insert([2] * 8, [2, 3])
    tree.lock(held)  # a running request uses this path, locked before the other was used
    tree.lock(done)
    tree.unlock(done)
    got = tree.evict()
    assert got not in (0, 1), (f"evict took block {got}, which a running request has locked (lock_ref 1): only "
                               "leaves with lock_ref 0 may go")
    assert got == 3, f"block 3 is the only unlocked leaf: evict must take it, got {got}"


def served_by_tree(tree, seq, tokens, finish=True):
    """A request's life through the calls the engine makes: admitted, its prompt computed in one step, finished."""
    cached = tree.allocate_cached(seq, tokens)
    tree.append_slots(seq, len(tokens))
    tree.cache_blocks(seq, tokens, len(tokens))
    if finish:
        tree.free(seq)
    return cached


def test_radix_tree_serves_requests_through_the_engines_calls(impl):
    tree = impl.RadixBlockTree(8, B)
    system = list(range(100, 108))  # two blocks
    assert served_by_tree(tree, "a", system + [1, 2, 3]) == 0, "nothing is cached yet"
    assert tree.num_free_blocks == 8 and len(tree.node_of) == 2, \
        "a finished: its two full blocks stay in the tree (evictable), its partial block is free"
    assert served_by_tree(tree, "b", system + [4, 5, 6, 7, 8], finish=False) == 8, "b finds the system prompt"
    shared = blocks_of(tree.match(system + [0]))
    assert [tree.node_of[b].lock_ref for b in shared] == [1, 1] and tree.num_free_blocks == 4, \
        "b runs: the path it uses is locked, its 4 blocks are not free"
    assert served_by_tree(tree, "c", system + [4, 5, 6, 7, 9, 9], finish=False) == 12, \
        "c finds b's third block too, while b is running"
    assert [tree.node_of[b].lock_ref for b in shared] == [2, 2], "b and c both lock the system prompt's path"
    tree.free("b")
    tree.free("c")
    assert tree.num_free_blocks == 8 and all(n.lock_ref == 0 for n in tree.node_of.values())
    assert served_by_tree(tree, "d", list(range(200, 229))) == 0 and tree.num_evictions > 0, \
        "d needs all 8 blocks: the cached ones are evicted"
    assert tree.match(system + [4, 5, 6, 7, 0]) == [], "nothing of the system prompt is left"


def check_tree(tree, running, content):
    """The tree's invariants, given the running requests {id: tokens} and what each block holds."""
    on_path = {}
    for seq, node in tree.locked.items():
        while node is not tree.root:
            on_path[node.block] = on_path.get(node.block, 0) + 1
            node = node.parent
    for block, node in tree.node_of.items():
        assert node.lock_ref == on_path.get(block, 0), \
            f"block {block} has lock_ref {node.lock_ref}, but {on_path.get(block, 0)} running requests use its path"
        assert content[block] == tuple(tokens_of(node)), "a node's block holds other tokens than its path spells"
    assert set(tree.evictable) == {b for b, n in tree.node_of.items() if n.lock_ref == 0}, \
        "evictable must hold exactly the tree's blocks with lock_ref 0"
    assert not set(tree.free_blocks) & set(tree.node_of), "a block in the tree is not free"
    for seq, tokens in running.items():
        for i, block in enumerate(tree.block_tables[seq]):
            assert content[block] == tuple(tokens[:len(content[block])]) and len(content[block]) > i * B, (
                f"evict took block {block}, which a running request has locked: only leaves with lock_ref 0 may go")


def tokens_of(node):
    path = []
    while node.parent is not None:
        path[:0] = node.tokens
        node = node.parent
    return path


radix_workloads = st.lists(st.tuples(st.sampled_from(["admit", "admit", "step", "finish"]), st.integers(0, 3),
                                     st.integers(0, 9), st.integers(0, 99)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(steps=radix_workloads)
def test_radix_tree_keeps_its_invariants_under_a_small_pool(impl, steps):
    """Random requests over four prefixes on 8 blocks of 4: admitted when they fit (as the scheduler checks), grown
    a token per step, finished; every hit holds the tokens asked for, and no running request's block is evicted."""
    tree, running, content = impl.RadixBlockTree(8, B), {}, {}
    prefixes = [list(range(10)), list(range(10)) + [50, 51], [7] * 9, []]

    def compute(seq, start, end):
        tokens, table = running[seq], tree.block_tables[seq]
        for p in range(start, end):
            content[table[p // B]] = tuple(tokens[:p + 1])
        tree.cache_blocks(seq, tokens, end)

    for n, (action, prefix, extra, pick) in enumerate(steps):
        if action == "admit":
            prompt = prefixes[prefix] + [500 + pick] * (1 + extra % 5)
            hits = tree.lookup(prompt)
            for i, block in enumerate(hits):
                assert content[block] == tuple(prompt[:(i + 1) * B]), "a hit holds other tokens: a stale block"
            need = tree.blocks_for(len(prompt)) - len(hits)
            if need > tree.num_free_blocks - tree.num_evictable(hits):
                continue
            running[n] = prompt
            cached = tree.allocate_cached(n, prompt)
            assert cached == len(hits) * B
            tree.append_slots(n, len(prompt))
            compute(n, cached, len(prompt))
        elif running:
            seq = list(running)[pick % len(running)]
            if action == "finish":
                del running[seq]
                tree.free(seq)
            elif tree.can_allocate(seq, len(running[seq]) + 1):
                running[seq] = running[seq] + [600 + pick]
                tree.append_slots(seq, len(running[seq]))
                compute(seq, len(running[seq]) - 1, len(running[seq]))
        check_tree(tree, running, content)
    for seq in list(running):
        tree.free(seq)
    assert tree.num_free_blocks == 8 and not tree.block_tables and all(n.lock_ref == 0 for n in tree.node_of.values())


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


def chat_turn(tok, question):
    """A user turn in the chat template's markup, after the previous answer's tokens (chapter 08's `turn`)."""
    return tok.encode(f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


def serve_conversation(llm, tok, system, questions, params):
    """Two users chat behind one system prompt, their turns served together; each turn's prompt is the previous
    prompt, the answer the engine gave and the next question, as token ids. Returns every turn's outputs."""
    prompts = [tok.encode(tok.apply_chat_template([{"role": "system", "content": system},
                                                   {"role": "user", "content": q}])) for q in questions[0]]
    turns = []
    for t in range(len(questions)):
        if t:
            prompts = [list(o.prompt_token_ids) + o.token_ids + chat_turn(tok, q)
                       for o, q in zip(turns[-1], questions[t])]
        turns.append(llm.generate(prompts, params, use_tqdm=False))
    return turns


def test_the_engine_serves_a_conversation_with_your_radix_tree(impl, real_model):
    """Two users hold a three-turn conversation through the engine running your RadixBlockTree: every token, and every
    turn's cached tokens, must be what the engine gives on its own (its hashed blocks also reuse whole blocks)."""
    model, tok = real_model
    system = "You are the assistant of a bicycle shop. Answer in one short sentence."
    questions = [["Do you fix flat tyres?", "Can I rent a bike?"], ["How long does it take?", "For a weekend?"],
                 ["What does it cost?", "With a helmet?"]]
    params = me.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    runs = {}
    for name, manager in (("yours", impl.RadixBlockTree), ("own", None)):
        llm = LLM.from_model(model, tok, block_manager=manager, block_size=16, max_num_seqs=2, max_model_len=256)
        runs[name] = (serve_conversation(llm, tok, system, questions, params), llm.engine.scheduler.blocks)
    (own, _), (yours, tree) = runs["own"], runs["yours"]
    assert [[o.token_ids for o in turn] for turn in yours] == [[o.token_ids for o in turn] for turn in own], \
        "the engine on your radix tree must give the tokens it gives on its own"
    cached = [[o.num_cached_tokens for o in turn] for turn in yours]
    expected = [[o.num_cached_tokens for o in turn] for turn in own]
    assert cached == expected, (f"prompt tokens served from your tree per turn: {cached}; the engine's own cache "
                                f"serves {expected}: check match (whole blocks, never the last token) and insert")
    assert all(c > 0 for turn in cached[1:] for c in turn), "every later turn finds the conversation so far"
    assert tree.num_free_blocks == tree.num_blocks and all(n.lock_ref == 0 for n in tree.node_of.values()), \
        "every request finished: nothing is locked, every block is free or evictable"


def test_the_engine_evicts_from_your_radix_tree_under_a_small_pool(impl, real_model, shop_prompts):
    """Seven questions behind one system prompt, four at a time, on a pool too small to keep them all: your tree
    must evict unlocked leaves, and the tokens must be what the engine gives on its own."""
    model, tok = real_model
    params = me.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    kwargs = dict(block_size=16, max_num_seqs=4, num_kv_blocks=20, max_model_len=max(map(len, shop_prompts)) + 4)
    runs = {}
    for name, manager in (("yours", impl.RadixBlockTree), ("own", None)):
        llm = LLM.from_model(model, tok, block_manager=manager, **kwargs)
        outs = [o for batch in (shop_prompts[:1], shop_prompts[1:4], shop_prompts[1:2] + shop_prompts[4:])
                for o in llm.generate(batch, params, use_tqdm=False)]
        runs[name] = (outs, llm.engine.scheduler.blocks)
    (own, _), (yours, tree) = runs["own"], runs["yours"]
    assert [o.token_ids for o in yours] == [o.token_ids for o in own], \
        "the engine on your radix tree must give the tokens it gives on its own"
    cached = [o.num_cached_tokens for o in yours]
    assert cached[0] == 0 and min(cached[1:]) > 0, \
        f"the system prompt is computed once, then found in your tree; cached tokens per request: {cached}"
    assert tree.num_evictions > 0, "the last four requests need more blocks than are free: evict must run"
    assert tree.num_free_blocks == 20 and all(n.lock_ref == 0 for n in tree.node_of.values()), \
        "every request finished: nothing is locked, every block is free or evictable"


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


class MatchByTheEngine(solution.RadixBlockTree):
    def match(self, token_ids):  # the engine's tree compares each block's tokens
        path, node, size = [], self.root, self.block_size
        for start in range(0, (len(token_ids) - 1) // size * size, size):
            want = tuple(token_ids[start:start + size])
            node = next((c for c in node.children.values() if radix_cache.common_prefix(c.tokens, want) == size), None)
            if node is None:
                break
            path.append(node)
        return path


class InsertByTheEngine(solution.RadixBlockTree):
    def insert(self, token_ids, block_ids):  # the engine's tree says how much of the prompt it holds already
        engine_tree = radix_cache.RadixBlockManager(num_blocks=len(block_ids) + 1, block_size=self.block_size)
        engine_tree.num_cached_tokens(list(token_ids) + [-1])
        return super().insert(token_ids, block_ids)


class LockByTheEngine(solution.RadixBlockTree):
    def lock(self, node):  # the engine's tree takes the reference, on a view of each node's count
        self.clock += 1
        while node is not self.root:
            refs = [node.lock_ref]
            view = types.SimpleNamespace(ref_counts=refs, evictable={}, node_of={})
            radix_cache.RadixBlockManager._hold(view, 0)
            node.lock_ref, node.last_used = refs[0], self.clock
            self.evictable.pop(node.block, None)
            node = node.parent


class UnlockByTheEngine(solution.RadixBlockTree):
    def unlock(self, node):  # the engine's tree drops the reference (its counts include the tree's own: + 1)
        self.clock += 1
        while node is not self.root:
            refs, evictable = [node.lock_ref + 1], {}
            view = types.SimpleNamespace(ref_counts=refs, free_blocks=[], evictable=evictable, node_of={0: node},
                                         _refresh=lambda n: None)
            radix_cache.RadixBlockManager._drop(view, 0)
            node.lock_ref, node.last_used = refs[0] - 1, self.clock
            if evictable:
                self.evictable[node.block] = None
            node = node.parent


class EvictByTheEngine(solution.RadixBlockTree):
    def evict(self):  # the engine's least-recently-used leaf choice, on a view of this tree's unlocked leaves
        leaves = [self.node_of[b] for b in self.evictable if not self.node_of[b].children]
        for leaf in leaves:
            leaf.stamp = leaf.last_used
        removed = []
        view = types.SimpleNamespace(heap=sorted((n.last_used, n.block, i, n) for i, n in enumerate(leaves)),
                                     leaves=set(leaves), eviction_visits=0, num_evictions=0, _remove=removed.append)
        radix_cache.RadixBlockManager._evict_one(view)
        leaf = removed[0]
        del leaf.parent.children[leaf.tokens], self.node_of[leaf.block], self.evictable[leaf.block]
        return leaf.block


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
    ("RadixBlockTree.match", MatchByTheEngine, test_radix_match_walks_whole_blocks_and_never_the_last_token, {}),
    ("RadixBlockTree.insert", InsertByTheEngine, test_radix_insert_hangs_one_node_per_full_block, {}),
    ("RadixBlockTree.lock", LockByTheEngine, test_radix_lock_and_unlock_the_path_to_the_root, {}),
    ("RadixBlockTree.unlock", UnlockByTheEngine, test_radix_lock_and_unlock_the_path_to_the_root, {}),
    ("RadixBlockTree.evict", EvictByTheEngine, test_radix_evict_takes_the_least_recently_used_unlocked_leaf, {}),
]


def test_every_part_of_the_lab_has_a_hand_off_check(asked_for):
    missing = set(asked_for(LAB)) - {part for part, *_ in HAND_OFFS}
    assert not missing, f"parts of the lab with no hand-off check above: {sorted(missing)}"


@pytest.mark.parametrize("part,replacement,test,args", HAND_OFFS,
                         ids=[f"{part}-{i}" for i, (part, *_) in enumerate(HAND_OFFS)])
def test_the_grader_fails_a_part_handed_off(hand_off, part, replacement, test, args):
    hand_off(part, replacement, test, **args)


# ---------------------------------------------------------------- wrong answers, and the one line each prints

class EvictIgnoringLocks(solution.RadixBlockTree):
    def evict(self):  # the least recently used leaf, locked or not
        leaves = [node for node in self.node_of.values() if not node.children]
        if not leaves:
            raise RuntimeError("no leaf to evict")
        leaf = min(leaves, key=lambda n: n.last_used)
        del leaf.parent.children[leaf.tokens], self.node_of[leaf.block]
        self.evictable.pop(leaf.block, None)
        return leaf.block


class MatchThroughTheLastToken(solution.RadixBlockTree):
    def match(self, token_ids):  # every full block of the prompt, the last token's too
        return super().match(list(token_ids) + [-1])


# A wrong part, a grading test, and the one line that test must print for it (a regular expression). Each test here
# is deterministic: the hypothesis workload also catches EvictIgnoringLocks, but only on the examples it happens to
# draw, so it is not listed.
WRONG_ANSWERS = [
    ({"RadixBlockTree": EvictIgnoringLocks}, test_radix_evict_never_takes_a_locked_node,
     r"evict took block 1, which a running request has locked \(lock_ref 1\): only leaves with lock_ref 0 may go"),
    ({"RadixBlockTree": MatchThroughTheLastToken}, test_radix_match_walks_whole_blocks_and_never_the_last_token,
     r"match must leave the prompt's last token to compute.*"),
]


@pytest.mark.parametrize("replacements,test,line", WRONG_ANSWERS,
                         ids=[f"{t.__name__.removeprefix('test_')}-{i}" for i, (_, t, _) in enumerate(WRONG_ANSWERS)])
def test_a_wrong_answer_fails_with_one_line_that_says_what_to_fix(wrong_answer, replacements, test, line):
    wrong_answer(test, replacements, line)
