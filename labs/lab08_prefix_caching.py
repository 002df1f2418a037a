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
  7. OPTIONAL: `RadixTree.match`, `insert` and `evict`, SGLang's radix tree over token ids, whose match
     ends at any token rather than at a block boundary (its tests are skipped while it is not written).

Fill in every function marked TODO in labs/lab08_prefix_caching.py, then grade your work with

    pytest tests/labs/test_lab08.py --impl=labs

Pure Python, like lab 07: no tensors, and nothing from the engine's own paging but `EngineBlockManager`
(given), which runs the engine's pool on your PrefixCache and your hashes: the lab notebook ends by serving
requests with the real engine, `LLM(..., block_manager=EngineBlockManager)`, and checks that they come out,
and hit the cache, as with the engine's own.
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
    # TODO: what must go into the digest so that the same tokens behind another prefix hash differently, and how
    #       do the ids become bytes the same way every time, whether they come as a list or a tuple?
    raise NotImplementedError("lab08 hash_block: not written yet (see its docstring)")


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The hash of each FULL block of `token_ids` (len // block_size of them), in order: block i hashes
    tokens[i * block_size : (i + 1) * block_size] with block i - 1's hash as its parent (None for block 0)."""
    # TODO: which blocks are full, and which hash is each one's parent?
    raise NotImplementedError("lab08 block_hashes: not written yet (see its docstring)")


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
        # TODO: which block goes first, and what must be forgotten before a cached block's rows are overwritten?
        raise NotImplementedError("lab08 allocate: not written yet (see its docstring)")

    def free(self, block_id: int) -> None:
        """Drop one holder. When the last one lets go, a cached block joins the END of `evictable` (the most
        recently used: its prefix may be asked for again) and any other block the end of `free_blocks`.
        Raises ValueError for a block nobody holds (a double free), changing nothing."""
        # TODO: when does a block stop being held, and where does it go then? It depends on whether it caches a
        #       prefix.
        raise NotImplementedError("lab08 free: not written yet (see its docstring)")

    def release(self, block_ids: list[int]) -> None:
        """A request finished (or was preempted): free each block of its table, LAST block first. Its tail then
        becomes evictable before its head, so under pressure the tail goes first: a block's prefix is only
        usable while every block before it is still cached."""
        # TODO: the docstring says in which order, and why it matters under eviction.
        raise NotImplementedError("lab08 release: not written yet (see its docstring)")

    def lookup(self, token_ids: Sequence[int]) -> list[int]:
        """The blocks holding the longest cached prefix of `token_ids`: block i is a hit while the hash of the
        prompt's block i is in `cached_blocks`; stop at the first miss. At most (len - 1) // block_size blocks:
        the prompt's last token is always left to compute, since its logits give the first output token.
        Each hit gains a holder (an evictable one leaves `evictable`: it is in use again)."""
        # TODO: how many blocks may hit at most, and what does a hit on an evictable block change besides its count?
        raise NotImplementedError("lab08 lookup: not written yet (see its docstring)")

    def cache_full_blocks(self, token_ids: Sequence[int], block_ids: list[int]) -> None:
        """Register the full blocks of a request whose KV for `token_ids` is now written (after its prefill
        step, never before: a lookup must not find a block still being filled). Block i of the table caches the
        prefix of hash block_hashes(token_ids)[i], unless that hash is cached already (a hit, or an identical
        prompt that got there first: keep the first copy, this block then stays uncached)."""
        # TODO: a cached block is registered in two places. What if the same prefix is cached already?
        raise NotImplementedError("lab08 cache_full_blocks: not written yet (see its docstring)")

    def admit(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """A new request's block table for its prompt, and how many of its tokens are already computed: the
        blocks `lookup` finds, then freshly allocated blocks up to ceil(len / block_size). All or nothing:
        when the pool cannot supply the fresh blocks, release the hits and raise RuntimeError, leaving every
        ref count as it was. Returns (block_ids, num_cached_tokens)."""
        # TODO: count what is available only after the lookup (why?), and leave every count as it was on failure.
        raise NotImplementedError("lab08 admit: not written yet (see its docstring)")


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


# ---------------------------------------------------------------- part 7 (OPTIONAL): SGLang's radix tree

class RadixNode:
    """Given. One node of a radix tree over token ids: a run of `tokens` that follows the tokens of the path from the
    root. `children` are keyed by their first token (siblings never share one: they would share a run, and the tree
    keeps shared runs once). `last_used` is the tree's clock when a match or insert last passed through the node."""

    def __init__(self, tokens: tuple[int, ...], parent: RadixNode | None):
        self.tokens, self.parent = tuple(tokens), parent
        self.children: dict[int, RadixNode] = {}
        self.last_used = 0


class RadixTree:
    """OPTIONAL (part 7). SGLang's RadixAttention keeps its prefix cache as a radix tree over token ids instead of a
    map of hashed full blocks: a match may end at ANY token, not just at a block boundary, so a conversation's next
    turn finds the whole previous turn and a few-shot prompt its examples to the last token. (In the engine,
    mini_engine/prefix/radix_cache.py, each node also owns KV blocks and running requests hold the nodes they use;
    here the tree holds token ids alone.)

    Each call of `match` or `insert` first advances `clock` by one and stamps every node its path passes through
    (`last_used = clock`); `evict` removes least recently used LEAVES first, so a trunk that many branches share
    outlives them. Given: the root (an empty run) and `num_tokens`."""

    def __init__(self):
        self.root = RadixNode((), None)
        self.clock = 0

    def num_tokens(self) -> int:
        """Tokens stored in the tree: the sum of every node's run."""
        stack, total = [self.root], 0
        while stack:
            node = stack.pop()
            total += len(node.tokens)
            stack.extend(node.children.values())
        return total

    def match(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of `token_ids` the tree holds: walk down from the root, into the child keyed by the
        next token, as far as the child's run agrees with `token_ids`; a run that agrees only in part ends the match
        inside it. Stamps each node it enters, even in part. Changes nothing else."""
        # TODO: which child can continue the match, and what ends it: a missing child, or a run that disagrees?
        raise NotImplementedError("lab08 RadixTree.match: not written yet (see its docstring)")

    def insert(self, token_ids: Sequence[int]) -> int:
        """Store `token_ids`; returns how many of its leading tokens the tree held already. Where the sequence parts
        from a node's run partway, split the node in two first (the shared part above, the rest below it, keeping
        its children and its stamp), then hang the new tokens under the shared part as one new leaf. Stamps every
        node on the sequence's path, the new leaf too. Inserting what the tree holds already adds nothing."""
        # TODO: walk as match does; where the walk stops inside a run, what must the split keep, and where does the
        #       rest of token_ids go?
        raise NotImplementedError("lab08 RadixTree.insert: not written yet (see its docstring)")

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` tokens, or every token when the tree holds fewer: remove the least recently
        used leaf (a node without children, never the root), again and again; a parent whose last child went becomes
        a leaf itself. Returns how many tokens were removed."""
        # TODO: which nodes may go, in what order, and when do you stop?
        raise NotImplementedError("lab08 RadixTree.evict: not written yet (see its docstring)")
