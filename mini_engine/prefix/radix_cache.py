"""A radix-tree prefix cache over KV blocks, after SGLang's RadixAttention (Zheng et al. 2024), as a
`paging.BlockManager`: `LLM(enable_prefix_caching=True, prefix_cache="radix")` (chapter 08, section 7).

Three designs meet a shared prefix that ends inside a block (a page) of B tokens:

- vLLM's hashed blocks (paging.py here): each *full* block is named by a hash of its whole prefix and a partly filled
  block is never cached, so a hit is a whole number of blocks: a 300-token system prompt in blocks of 16 reuses 288
  tokens, and a conversation's next turn recomputes the previous answer's last partial block.
- SGLang's RadixCache: a tree over token ids whose matches end at any token when its page size is 1. With pages
  larger than 1, `match_prefix` cuts the key to whole pages (`len(key) // self.page_size * self.page_size`) and a
  finished request enters the tree in whole pages ("free the unaligned tail"): it loses what hashed blocks lose.
- This module, the engine's own design (not SGLang's): blocks of B tokens, and a match that may still end at any
  token. The partly matched last block is shared too and copied on the new sequence's first write into it (the
  copy-on-write of parallel sampling: the tree holds a reference of its own on every block it owns, so no block in
  the tree is ever written in place), and a finished sequence enters with its last partial block. It loses nothing
  to the block boundary, for one block copy per hit that ends inside a block (`course.prefix_designs` counts all
  three on chapter 08's workloads).

The tree: each node owns one KV block and the tokens written in it, after the tokens of the path from the root. A
full block's node has a child for every block that followed it in some sequence; a partly filled block (the end of a
finished sequence) is a leaf. A match walks the tree a block at a time. (SGLang's nodes hold runs of any length and
split at any token; one block per node keeps a reference count per block exact and eviction a block at a time, at
the price of a few sibling leaves that share leading tokens.)

When blocks enter the tree: each full block once a step has written it (so requests running together share), and
a sequence's whole computed prefix, last partial block included, when it is freed (finished, preempted or aborted),
so the next turn of a conversation finds the previous answer. Eviction takes a leaf no block table holds, least
recently used first, so a trunk that many branches share outlives them. The unheld leaves are kept in a set and in
a heap by last use (stale entries are skipped as they surface), so an eviction costs O(log n), not a scan of the
tree; `eviction_visits` counts the heap entries examined.

The bookkeeping rests on one property: the blocks of a table that are in the tree are its first ones, a path from
the root. So a node no table holds has no held node below it, and `evictable` (every tree block only the tree
holds) counts exactly the blocks that evicting leaves, one after another, can free.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence

from ..paging import BlockManager, hash_block


class Node:
    """One block of the tree: `tokens` are those written in `block` (block_size of them, or fewer in a leaf)."""
    __slots__ = ("tokens", "block", "parent", "children", "by_first", "last_used", "stamp")

    def __init__(self, tokens: tuple[int, ...], block: int | None, parent: Node | None):
        self.tokens, self.block, self.parent = tokens, block, parent
        self.children: dict[tuple[int, ...], Node] = {}  # by their tokens
        self.by_first: dict[int, list[Node]] = {}  # the same children by their first token (a match ending inside)
        self.last_used = 0
        self.stamp = -1  # last_used when last pushed on the eviction heap


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class RadixBlockManager(BlockManager):
    """The pool of paging.BlockManager with a radix tree of blocks as its prefix cache. `ref_counts[b]` counts the
    tables holding b plus one if the tree owns it; `block_hash[b]` is set exactly for the tree's blocks (a hash of
    the node's path, so whatever asks "is b cached?" reads the same field as with the hashed cache)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if not enable_prefix_caching:
            raise ValueError("the radix tree is a prefix cache: it needs enable_prefix_caching=True")
        super().__init__(num_blocks, block_size, True)
        self.root = Node((), None, None)
        self.node_of: dict[int, Node] = {}  # every block the tree owns -> its node
        self.computed: dict[Hashable, tuple[Sequence[int], int]] = {}  # sequence -> (its tokens, how many computed)
        self.in_tree: dict[Hashable, tuple[Node | None, int]] = {}  # sequence -> (its deepest tree node, depth)
        self.clock = itertools.count(1)  # ticks for least recently used
        self.leaves: set[Node] = set()  # the evictable leaves: in the tree, no children, no table holds them
        self.heap: list[tuple[int, int, int, Node]] = []  # (stamp, block, tick, node); stale entries skipped
        self.ticks = itertools.count()
        self.eviction_visits = 0  # heap entries examined by evictions (a timing-free cost)
        self.version = 0  # bumped whenever the tree changes shape: a remembered match is good until then
        self.matches: dict[int, tuple[Sequence[int], int, tuple[list[Node], int]]] = {}

    # ------------------------------------------------------------------ matching

    def _match(self, token_ids: Sequence[int]) -> tuple[list[Node], int]:
        """The nodes a new sequence of `token_ids` can share, root first, and how many of its tokens they hold:
        never its last token, whose logits the step needs. The scheduler asks several times per admission with
        the same list: the answer is remembered until the tree changes (the list must not change meanwhile)."""
        memo = self.matches.get(id(token_ids))
        if memo is not None and memo[0] is token_ids and memo[1] == self.version:
            return memo[2]
        if len(self.matches) > 1024 or next(iter(self.matches.values()), (0, self.version))[1] != self.version:
            self.matches.clear()  # entries are all of one version: stale together
        path, node, matched, size = [], self.root, 0, self.block_size
        limit = len(token_ids) - 1
        while matched < limit:
            want = tuple(token_ids[matched:matched + size])
            child = node.children.get(want)
            if child is not None and len(want) == size and matched + size <= limit:
                path.append(child)
                node, matched = child, matched + size
                continue
            # The match ends inside this block: take the child agreeing longest with the tokens, if any does.
            best = max(node.by_first.get(want[0], ()), key=lambda c: common_prefix(c.tokens, want), default=None)
            n = min(common_prefix(best.tokens, want), limit - matched) if best else 0
            if n:
                path.append(best)
                matched += n
            break
        self.matches[id(token_ids)] = (token_ids, self.version, (path, matched))  # keeps the list, so its id
        return path, matched

    def lookup(self, token_ids: Sequence[int]) -> list[int]:
        """The blocks a new sequence of `token_ids` would share (the last maybe partly matched). Read-only."""
        return [node.block for node in self._match(token_ids)[0]]

    def num_cached_tokens(self, token_ids: Sequence[int]) -> int:
        return self._match(token_ids)[1]

    def allocate_cached(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """A new table of the matched blocks, each held once more; returns the tokens they serve."""
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table")
        path, matched = self._match(token_ids)
        now = next(self.clock)
        for node in path:
            self._hold(node.block)
            node.last_used = now
        self.block_tables[seq_id] = [node.block for node in path]
        self.computed[seq_id] = (token_ids, matched)
        full = matched // self.block_size  # a partly matched last block is copied: the sequence's own is not the tree's
        self.in_tree[seq_id] = (path[full - 1] if full else self.root, full)
        return matched

    # ------------------------------------------------------------------ insertion

    def cache_blocks(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int) -> None:
        """After a step: remember what the sequence has computed, and put its full blocks in the tree now, so that
        requests running at the same time share them."""
        if seq_id not in self.block_tables:
            return
        self.computed[seq_id] = (token_ids, num_computed)
        self._insert(seq_id, num_computed // self.block_size * self.block_size)

    def _insert(self, seq_id: Hashable, end: int) -> None:
        """Put the blocks holding the sequence's first `end` computed tokens in the tree, from where its last
        insertion stopped. Where the tree holds the same tokens in another block (the same prefix computed twice at
        once), the table takes the tree's block and frees its own, so its tree blocks stay one path from the root."""
        node, depth = self.in_tree.get(seq_id, (self.root, 0))
        if node is None:
            return
        tokens, table, size = self.computed[seq_id][0], self.block_tables[seq_id], self.block_size
        now = next(self.clock)
        for i in range(depth, self.blocks_for(end)):
            want = tuple(tokens[i * size:min(end, (i + 1) * size)])
            child = node.children.get(want)
            if child is None:
                siblings = node.by_first.get(want[0], ())
                if any(c.tokens[:len(want)] == want for c in siblings):
                    break  # a partial last block whose tokens a longer block in the tree holds already
                for leaf in [c for c in siblings if want[:len(c.tokens)] == c.tokens]:
                    self._remove(leaf)  # a shorter partial leaf this block extends holds nothing it lacks
                child = self._add(node, want, table[i])
            elif child.block != table[i]:
                if self.ref_counts[table[i]] > 1:  # forked samples hold it too: leave them, and stop here
                    node = None
                    break
                self._hold(child.block)
                self._drop(table[i])
                table[i] = child.block
            child.last_used = now
            node, depth = child, i + 1
        self.in_tree[seq_id] = (node, depth)

    def _add(self, parent: Node, tokens: tuple[int, ...], block: int) -> Node:
        node = Node(tokens, block, parent)
        parent.children[tokens] = node
        parent.by_first.setdefault(tokens[0], []).append(node)
        self.node_of[block] = node
        self.version += 1
        self._refresh(parent)  # a parent with a child is no leaf
        key = hash_block(self.block_hash[parent.block] if parent.block is not None else None, tokens)
        self.cached_blocks[key], self.block_hash[block] = block, key
        self._hold(block)  # the tree's own reference
        return node

    def _remove(self, node: Node) -> None:
        """Take a leaf out of the tree and drop the tree's reference on its block."""
        parent, self.version = node.parent, self.version + 1
        del parent.children[node.tokens]
        siblings = parent.by_first[node.tokens[0]]
        siblings.remove(node)
        if not siblings:
            del parent.by_first[node.tokens[0]]
        self.leaves.discard(node)
        del self.node_of[node.block]
        del self.cached_blocks[self.block_hash[node.block]]
        self.block_hash[node.block] = None
        self.evictable.pop(node.block, None)
        self._drop(node.block)
        self._refresh(parent)  # its last child gone, an unheld parent is an evictable leaf now

    def _refresh(self, node: Node) -> None:
        """Keep `leaves` and the heap true for one node after its holders or its children changed."""
        if node.block is None or self.node_of.get(node.block) is not node:
            return
        if node.children or self.ref_counts[node.block] != 1:
            self.leaves.discard(node)
        elif node not in self.leaves or node.stamp != node.last_used:
            self.leaves.add(node)
            node.stamp = node.last_used
            heapq.heappush(self.heap, (node.stamp, node.block, next(self.ticks), node))
            if len(self.heap) > 2 * len(self.leaves) + 64:  # mostly stale: rebuild, O(n) once per n pushes
                self.heap = [(n.stamp, n.block, next(self.ticks), n) for n in self.leaves]
                heapq.heapify(self.heap)

    # ------------------------------------------------------------------ references

    def _hold(self, block: int) -> None:
        self.ref_counts[block] += 1
        self.evictable.pop(block, None)  # a table holds it now
        if block in self.node_of:
            self._refresh(self.node_of[block])

    def _drop(self, block: int) -> None:
        """One holder fewer: a block nobody holds is free; a tree block only the tree holds is evictable."""
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks.append(block)
        elif self.ref_counts[block] == 1 and block in self.node_of:
            self.evictable[block] = None
            self._refresh(self.node_of[block])

    def free(self, seq_id: Hashable) -> None:
        """Insert everything the sequence computed, its last partial block too, then drop its table."""
        if seq_id in self.computed:
            self._insert(seq_id, self.computed[seq_id][1])
        del self.computed[seq_id], self.in_tree[seq_id]  # raises for an unknown sequence, as the table's pop would
        table = self.block_tables.pop(seq_id)
        now = next(self.clock)
        for block in reversed(table):
            if block in self.node_of:
                self.node_of[block].last_used = now  # released now: used as recently as anything
            self._drop(block)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> list[int]:
        table = super().fork(parent_id, child_id)  # the parent holds these blocks: none is evictable
        self.computed[child_id], self.in_tree[child_id] = self.computed[parent_id], self.in_tree[parent_id]
        return table

    def copy_on_write(self, seq_id: Hashable, start: int, end: int) -> list[tuple[int, int]]:
        copies = super().copy_on_write(seq_id, start, end)
        for src, _ in copies:
            if self.ref_counts[src] == 1 and src in self.node_of:
                self.evictable[src] = None  # only the tree holds the original now
                self._refresh(self.node_of[src])
        if copies:
            # The copy runs with the step. Until then the new block holds nothing: a preemption in this very step
            # must not insert it, so the sequence counts as computed up to the copied block only.
            tokens, n = self.computed[seq_id]
            self.computed[seq_id] = (tokens, min(n, start // self.block_size * self.block_size))
        return copies

    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        table = super().allocate(seq_id, num_tokens)
        self.computed[seq_id], self.in_tree[seq_id] = ([], 0), (self.root, 0)
        return table

    # ------------------------------------------------------------------ eviction

    def _take_block(self) -> int:
        if not self.free_blocks:
            self._evict_one()
        return super()._take_block()

    def _evict_one(self) -> None:
        """Free the least recently used leaf no table holds: the heap's first entry that is still true."""
        while self.heap:
            stamp, _, _, node = heapq.heappop(self.heap)
            self.eviction_visits += 1
            if node in self.leaves and stamp == node.stamp:
                self._remove(node)
                self.num_evictions += 1
                return
        raise RuntimeError("no free block and no evictable leaf: check can_allocate first")

    def reset_prefix_cache(self) -> int:
        """Drop every node no table holds (leaves first); held paths stay. Returns how many blocks were dropped."""
        dropped = 0
        while self.leaves:  # in rounds, each in block order (a set's own order would vary from run to run)
            for leaf in sorted(self.leaves, key=lambda n: n.block):
                self._remove(leaf)  # its parent may join the leaves of the next round
                dropped += 1
        if self.evictable:
            raise RuntimeError("an unheld node has held nodes below it")
        self.heap = []
        return dropped
