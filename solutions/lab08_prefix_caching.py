"""Lab 08: prefix caching, so requests that open with the same tokens share their KV blocks.

Requests often start alike: a system prompt, a few worked examples, a document asked several questions.
Attention is causal, so the keys and values of a prompt's first tokens depend on those tokens alone: a
second request with the same start can read the first one's KV blocks instead of computing them again.
The engine finds such blocks by hashing full blocks of tokens, and keeps them after their request ends
in case another one asks. You write the pieces that make it work:
  1. `hash_block` and `block_hashes`: the hash chain. A full block's hash covers its tokens and its
     parent block's hash, so it names the whole prefix up to the block's end, not just its own tokens.
     A partial last block is not hashed: more tokens will be written into it.
  2. `PrefixCache.lookup`: the cached blocks a new prompt starts with, each taking a reference.
  3. `PrefixCache.free` and `release`: a block whose last holder lets go stays cached, but evictable.
  4. `PrefixCache.allocate`: a free block if there is one, else the least recently used evictable block,
     whose old hash must then be forgotten.
  5. `PrefixCache.cache_full_blocks`: after a prefill has written a prompt's KV, register its full blocks.
  6. `PrefixCache.admit`: a new request's block table, cached blocks first, then fresh ones.
  7. `RadixBlockTree`: the same pool with SGLang's radix tree as its prefix cache instead of hashes. You write
     `match` (the longest cached prefix, in whole blocks), `insert` (a request's computed blocks), `lock` and
     `unlock` (the path a running request uses, SGLang's `lock_ref`: a node in use is never evicted) and
     `evict` (the least recently used unlocked leaf). The engine runs it: `LLM(..., block_manager=RadixBlockTree)`.

Fill in every function marked TODO in labs/lab08_prefix_caching.py, then grade your work with

    pytest tests/labs/test_lab08.py --impl=labs

Pure Python, like lab 07: no tensors, and nothing from the engine's own paging but `EngineBlockManager`
(given), which runs the engine's pool on your PrefixCache and your hashes, and the pool that `RadixBlockTree`
extends. The lab notebook serves requests with the real engine on each, `LLM(..., block_manager=...)`, and
checks that they come out, and hit the cache, as with the engine's own; nothing from mini_engine.prefix (the
engine's own tree) may be used.
"""
from __future__ import annotations

import hashlib  # hash_block: a cryptographic digest
from array import array  # hash_block: token ids as bytes of one width
from collections import OrderedDict, deque
from collections.abc import Sequence

from mini_engine import paging


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The hash of one full block: a SHA-256 digest (Python's hashlib) of its parent block's hash (nothing for the
    first block) followed by its token ids as bytes, every id the same width so that no two lists of ids give the
    same bytes (Python's `array` module turns a list of ints into such bytes). Returns the 32-byte digest.

    Why not Python's `hash()`: it has 64 bits and is not built to resist chosen inputs, and a collision would
    hand one prompt another prompt's keys and values. A cryptographic hash makes that practically impossible."""
    data = (parent_hash or b"") + array("q", token_ids).tobytes()
    return hashlib.sha256(data).digest()


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The hash of each FULL block of `token_ids` (len // block_size of them), in order: block i hashes
    tokens[i * block_size : (i + 1) * block_size] with block i - 1's hash as its parent (None for block 0)."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[start:start + block_size]))
    return hashes


class PrefixCache:
    """A pool of `num_blocks` KV blocks of `block_size` token slots that remembers which prefix each full block
    holds.

    State (given). Every block is in exactly one of three places:
      - held: `ref_counts[b] > 0`, in the block tables of that many requests;
      - `free_blocks`: nobody holds it and it caches nothing (oldest first);
      - `evictable`: nobody holds it but it still caches a prefix; the keys are block ids, least recently
        used first (an OrderedDict used as an ordered set: its values are None).
    A cached block, held or evictable, is registered both ways: `cached_blocks[h] == b` and `block_hash[b] == h`;
    `block_hash[b]` is None for a block that caches nothing."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.ref_counts: list[int] = [0] * num_blocks
        self.cached_blocks: dict[bytes, int] = {}
        self.block_hash: list[bytes | None] = [None] * num_blocks

    def num_available(self) -> int:
        """Blocks a request could be given now: the free ones and the evictable ones."""
        return len(self.free_blocks) + len(self.evictable)

    def allocate(self) -> int:
        """A block for new data, with one holder (ref count 1): the oldest free block if there is one; otherwise
        the least recently used evictable block, whose hash is forgotten first (both ways) since its contents
        are about to be overwritten. Raises RuntimeError when every block is held."""
        if self.free_blocks:
            block = self.free_blocks.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            del self.cached_blocks[self.block_hash[block]]
            self.block_hash[block] = None
        else:
            raise RuntimeError("every KV block is held by a running request")
        self.ref_counts[block] = 1
        return block

    def free(self, block_id: int) -> None:
        """Drop one holder. When the last one lets go, a cached block joins the END of `evictable` (the most
        recently used: its prefix may be asked for again) and any other block the end of `free_blocks`.
        Raises ValueError for a block nobody holds (a double free), changing nothing."""
        if self.ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} has no holder to release (double free)")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            if self.block_hash[block_id] is not None:
                self.evictable[block_id] = None
            else:
                self.free_blocks.append(block_id)

    def release(self, block_ids: list[int]) -> None:
        """A request finished (or was preempted): free each block of its table, LAST block first. Its tail then
        becomes evictable before its head, so under pressure the tail goes first: a block's prefix is only
        usable while every block before it is still cached."""
        for block in reversed(block_ids):
            self.free(block)

    def lookup(self, token_ids: Sequence[int]) -> list[int]:
        """The blocks holding the longest cached prefix of `token_ids`: block i is a hit while the hash of the
        prompt's block i is in `cached_blocks`; stop at the first miss. At most (len - 1) // block_size blocks:
        the prompt's last token is always left to compute, since its logits give the first output token.
        Each hit gains a holder (an evictable one leaves `evictable`: it is in use again)."""
        max_hits = (len(token_ids) - 1) // self.block_size
        hits = []
        for h in block_hashes(token_ids, self.block_size)[:max_hits]:
            block = self.cached_blocks.get(h)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
            hits.append(block)
        return hits

    def cache_full_blocks(self, token_ids: Sequence[int], block_ids: list[int]) -> None:
        """Register the full blocks of a request whose KV for `token_ids` is now written (after its prefill
        step, never before: a lookup must not find a block still being filled). Block i of the table caches the
        prefix of hash block_hashes(token_ids)[i], unless that hash is cached already (a hit, or an identical
        prompt that got there first: keep the first copy, this block then stays uncached)."""
        for block, h in zip(block_ids, block_hashes(token_ids, self.block_size)):
            if h not in self.cached_blocks:
                self.cached_blocks[h] = block
                self.block_hash[block] = h

    def admit(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """A new request's block table for its prompt, and how many of its tokens are already computed: the
        blocks `lookup` finds, then freshly allocated blocks up to ceil(len / block_size). All or nothing:
        when the pool cannot supply the fresh blocks, release the hits and raise RuntimeError, leaving every
        ref count as it was. Returns (block_ids, num_cached_tokens)."""
        hits = self.lookup(token_ids)
        # Hits taken from `evictable` are no longer available: count after the lookup, not before.
        needed = -(-len(token_ids) // self.block_size) - len(hits)
        if needed > self.num_available():
            self.release(hits)
            raise RuntimeError(f"{needed} fresh blocks needed, {self.num_available()} available")
        return hits + [self.allocate() for _ in range(needed)], len(hits) * self.block_size


class EngineBlockManager(paging.BlockManager):
    """Given: the engine's block manager (mini_engine/paging.py) with your PrefixCache as its pool and prefix
    cache, for `LLM(..., block_manager=EngineBlockManager)`. The engine reads your pool (`free_blocks`,
    `evictable`, `ref_counts`, `cached_blocks`, `block_hash`); a new request takes its cached blocks through your
    `lookup`, every other block through your `allocate`; its full blocks are registered by your
    `cache_full_blocks` as its prefill and decode write them; a finished or preempted request gives its blocks
    back through your `release`. The hashes are yours too: admission plans with `hashes` (your block_hashes)."""
    cache_class = PrefixCache
    hashes = staticmethod(block_hashes)

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.cache = self.cache_class(num_blocks, block_size)
        c = self.cache
        self.free_blocks, self.evictable, self.ref_counts = c.free_blocks, c.evictable, c.ref_counts
        self.cached_blocks, self.block_hash = c.cached_blocks, c.block_hash
        self.num_full: dict = {}  # request id -> its full blocks registered so far

    def _take_block(self) -> int:
        """A block for new data: your `allocate` (which evicts when no block is free)."""
        self.num_evictions += not self.free_blocks and bool(self.evictable)
        return self.cache.allocate()

    def lookup(self, token_ids) -> list[int]:
        """The cached blocks `token_ids` starts with, not taken (admission plans with them): your hashes, looked
        up in your cache up to the first miss, never the block of the last token."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for h in self.hashes(token_ids, self.block_size)[:(len(token_ids) - 1) // self.block_size]:
            if h not in self.cached_blocks:
                break
            hits.append(self.cached_blocks[h])
        return hits

    def allocate_cached(self, seq_id, token_ids) -> int:
        """Admission: a table of the cached blocks the prompt starts with, taken by your `lookup`."""
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table")
        hits = self.cache.lookup(token_ids) if self.enable_prefix_caching else []
        self.block_tables[seq_id], self.num_full[seq_id] = list(hits), len(hits)
        return len(hits) * self.block_size

    def cache_blocks(self, seq_id, token_ids, num_computed: int) -> None:
        """After a step: your `cache_full_blocks` registers the request's blocks that became full and written."""
        full = num_computed // self.block_size
        if self.enable_prefix_caching and seq_id in self.block_tables and full > self.num_full.get(seq_id, 0):
            self.cache.cache_full_blocks(token_ids[:full * self.block_size], self.block_tables[seq_id])
            self.num_full[seq_id] = full

    def free(self, seq_id) -> None:
        """The request finished or was preempted: your `release` gives its blocks back."""
        self.num_full.pop(seq_id, None)
        self.seq_hashes.pop(seq_id, None)
        self.cache.release(self.block_tables.pop(seq_id))


# ---------------------------------------------------------------- part 7: SGLang's radix tree, over blocks

class RadixNode:
    """Given. One node of the radix tree: one FULL KV block, `block`, whose `tokens` (block_size token ids) follow the
    tokens of the path from the root. `children` are keyed by their tokens (a tuple). `lock_ref` counts the running
    requests whose path passes through this node (SGLang's `lock_ref`): a node with lock_ref > 0 is in use and must
    not be evicted. `last_used` is the tree's clock when a lock or unlock last passed through the node."""

    def __init__(self, tokens: tuple[int, ...], block: int | None, parent: RadixNode | None):
        self.tokens, self.block, self.parent = tuple(tokens), block, parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_ref = 0
        self.last_used = 0


class RadixBlockTree(paging.BlockManager):
    """Part 7. SGLang's RadixAttention keeps its prefix cache as a radix tree over token ids (Zheng et al. 2024); here
    the tree is over the engine's real KV blocks, and the engine runs it: `LLM(..., block_manager=RadixBlockTree)`.
    Each node owns one full block; a path from the root spells a prefix, block by block, so a prompt's cached blocks
    are the path its tokens walk. A match here ends at a block boundary. (SGLang at a page size of 1 matches any
    token; the engine's own tree, mini_engine/prefix/radix_cache.py, also shares a partly matched last block and
    copies it on the first write.)

    State (given), beside paging.BlockManager's pool: `root` (no block), `clock`, `node_of` (block -> its node, for
    every block in the tree) and `locked` (request -> the deepest node of its path, which it holds locked).
    `ref_counts[b]` counts the block tables holding b, as in the engine; a block in the tree that no running request
    locks is in `evictable` (so the engine counts it as free), and leaves the pool only through `evict`.

    Given: how the engine's calls (lookup, allocate_cached, cache_blocks, free, fork, taking a block) become calls of
    your `match`, `insert`, `lock`, `unlock` and `evict`."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if not enable_prefix_caching:
            raise ValueError("enable_prefix_caching must be True: the radix tree is a prefix cache")
        super().__init__(num_blocks, block_size, True)
        self.root = RadixNode((), None, None)
        self.clock = 0
        self.node_of: dict[int, RadixNode] = {}
        self.locked: dict = {}  # request id -> the deepest node of its path in the tree (the root: none)
        self.num_full: dict = {}  # request id -> its full computed blocks offered to the tree so far

    def match(self, token_ids: Sequence[int]) -> list[RadixNode]:
        """The nodes holding the longest cached prefix of `token_ids`, root's child first: walk down one FULL block
        of tokens at a time, into the child keyed by that block's tokens, and stop at the first block no child
        holds. Never the block of the prompt's last token (at most (len - 1) // block_size nodes): its logits give
        the first output token. Changes nothing: the engine asks several times before it admits a request."""
        path, node, size = [], self.root, self.block_size
        for start in range(0, (len(token_ids) - 1) // size * size, size):
            node = node.children.get(tuple(token_ids[start:start + size]))
            if node is None:
                break
            path.append(node)
        return path

    def insert(self, token_ids: Sequence[int], block_ids: list[int]) -> RadixNode:
        """Put a request's computed full blocks in the tree: `block_ids[i]` holds tokens i * block_size up to (i + 1) *
        block_size of `token_ids` (whole blocks only). Walk down from the root, one block at a time: a missing child
        becomes a new node holding the request's block (in `node_of`, and unlocked, so in `evictable`); a child that
        holds these tokens already is kept as it is, even in another block (the same prefix computed twice at once:
        the first copy stays, as in PrefixCache), and the walk goes on below it. Returns the last node of the walk
        (the root for no blocks): the given code locks the path to it."""
        node, size = self.root, self.block_size
        for i, block in enumerate(block_ids):
            tokens = tuple(token_ids[i * size:(i + 1) * size])
            child = node.children.get(tokens)
            if child is None:
                child = node.children[tokens] = RadixNode(tokens, block, node)
                self.node_of[block] = child
                self.evictable[block] = None
            node = child
        return node

    def lock(self, node: RadixNode) -> None:
        """A running request uses the path from the root to `node`: advance `clock` by one, then on every node of the
        path (not the root) add one to `lock_ref` and stamp `last_used`. A node locked for the first time leaves
        `evictable`."""
        self.clock += 1
        while node is not self.root:
            node.lock_ref += 1
            node.last_used = self.clock
            self.evictable.pop(node.block, None)
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """The request that locked the path to `node` lets go: advance `clock`, then on every node of the path take
        one from `lock_ref` and stamp `last_used`; a node nobody locks any more joins `evictable`. Raises ValueError,
        changing nothing, if a node of the path is not locked."""
        path = []
        while node is not self.root:
            if node.lock_ref == 0:
                raise ValueError(f"block {node.block} is not locked: unlock without a lock")
            path.append(node)
            node = node.parent
        self.clock += 1
        for node in path:
            node.lock_ref -= 1
            node.last_used = self.clock
            if node.lock_ref == 0:
                self.evictable[node.block] = None

    def evict(self) -> int:
        """Take the least recently used unlocked LEAF (no children, lock_ref 0) out of the tree and return its block
        (out of `node_of` and `evictable`; the caller reuses it). Only leaves: a prefix is reachable only while
        every block before it is cached, so a trunk goes after its branches. Raises RuntimeError if none."""
        leaves = [self.node_of[b] for b in self.evictable if not self.node_of[b].children]
        if not leaves:
            raise RuntimeError("no unlocked leaf to evict: every cached block is in use")
        leaf = min(leaves, key=lambda n: n.last_used)
        del leaf.parent.children[leaf.tokens], self.node_of[leaf.block], self.evictable[leaf.block]
        return leaf.block

    # ------------------------------------------------------------ given: the engine's calls, on your tree

    def lookup(self, token_ids) -> list[int]:
        """The cached blocks `token_ids` starts with (admission plans with them; nothing taken)."""
        return [node.block for node in self.match(token_ids)]

    def num_cached_tokens(self, token_ids) -> int:
        return len(self.match(token_ids)) * self.block_size

    def allocate_cached(self, seq_id, token_ids) -> int:
        """Admission: a table of the matched blocks, each held once more, their path locked."""
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table")
        path = self.match(token_ids)
        self.locked[seq_id] = path[-1] if path else self.root
        self.lock(self.locked[seq_id])
        for node in path:
            self.ref_counts[node.block] += 1
        self.block_tables[seq_id], self.num_full[seq_id] = [node.block for node in path], len(path)
        return len(path) * self.block_size

    def cache_blocks(self, seq_id, token_ids, num_computed: int) -> None:
        """After a step: the request's full computed blocks go into the tree, and its lock moves down to the new end
        of its path (locked before the old lock is let go, so the path is never unlocked in between)."""
        full = num_computed // self.block_size
        if seq_id not in self.block_tables or full <= self.num_full.get(seq_id, 0):
            return
        node = self.insert(token_ids[:full * self.block_size], self.block_tables[seq_id][:full])
        self.lock(node)
        self.unlock(self.locked.get(seq_id, self.root))
        self.locked[seq_id], self.num_full[seq_id] = node, full

    def free(self, seq_id) -> None:
        """The request finished or was preempted: unlock its path; its blocks outside the tree are free again."""
        table = self.block_tables.pop(seq_id)
        self.num_full.pop(seq_id, None)
        self.unlock(self.locked.pop(seq_id, self.root))
        uncached = []
        for block in table:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0 and block not in self.node_of:
                uncached.append(block)
        self.free_blocks.extend(uncached)

    def fork(self, parent_id, child_id) -> list[int]:
        """Parallel samples share the parent's blocks: each locks the parent's path too."""
        table = super().fork(parent_id, child_id)
        self.locked[child_id] = self.locked.get(parent_id, self.root)
        self.lock(self.locked[child_id])
        self.num_full[child_id] = self.num_full.get(parent_id, 0)
        return table

    def _take_block(self) -> int:
        """A block for new data: a free one, else the block your `evict` frees."""
        if not self.free_blocks:
            block = self.evict()
            if self.ref_counts[block]:  # the engine would overwrite a block a running request reads
                raise RuntimeError(f"evict took block {block}, which a running request holds: only leaves with "
                                   "lock_ref 0 may go")
            self.free_blocks.append(block)
            self.num_evictions += 1
        return super()._take_block()

    def reset_prefix_cache(self) -> int:
        """Evict every unlocked node (leaves first, as `evict` takes them). Returns how many blocks were freed."""
        dropped = 0
        while self.evictable:
            self.free_blocks.append(self.evict())
            dropped += 1
        return dropped
