"""A prefix cache that spills to host memory and disk (chapter 12): `LLM(..., kv_offload="host")`, or
`kv_offload="disk", kv_offload_dir=PATH` for host memory first, then files there.

The hashed prefix cache (paging.py) forgets a block when it evicts it. `TieredBlockManager` first packs it
(`pack.pack`) into the host tier of a `tiers.TierStore`, under the block's hash, which names its whole prefix; when
host memory is full, the least recently used blocks move to files, and off the last tier they are forgotten. When a
new request's prefix continues past the blocks found in the pool, the block manager keeps walking the hash chain
through the tiers: each block found there takes a free pool block, and its buffer is queued to be copied back
(`unpack`) before the step computes anything. The runner does that at the start of `execute` (its one hook), and
only then is the block registered in the prefix cache: a step that fails before the copy leaves nothing cached
that was never written. Those tokens count as computed, as pool hits do: `num_cached_tokens` covers both, and
`tier_hits` says how many came from host memory and how many from disk (the request's metrics carry them).

What it costs and buys: a block copied back moves 2 x layers x kv_heads x head_dim x dtype bytes per token over
the link (`pack.bytes_per_token`) instead of recomputing a prefill of those tokens.

Both prefix caches have tiers: `TieredBlockManager` (hashed blocks) and `TieredRadixBlockManager` (the radix tree,
prefix_cache="radix"), keyed alike by the hash chain of a block's whole prefix.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from ..paging import BlockManager, hash_block
from ..prefix.radix_cache import RadixBlockManager
from .pack import pack, unpack
from .tiers import TierStore

KV_OFFLOADS = ("host", "disk")


@dataclass(frozen=True)
class OffloadSettings:
    kind: str                   # "host" or "disk"
    directory: str | None       # kind "disk": where the files go (a directory of the store's own inside it)
    host_blocks: int | None     # None: as many blocks as the pool
    disk_blocks: int | None     # None: four times the host tier


def check_kv_offload(config) -> None:
    """EngineConfig's kv_offload knobs (see `LLM`), each error naming its argument."""
    kind, directory = config.kv_offload, config.kv_offload_dir
    if kind is not None and kind not in KV_OFFLOADS:
        raise ValueError(f"kv_offload must be one of {KV_OFFLOADS} or None, got {kind!r}")
    for name in ("kv_offload_host_blocks", "kv_offload_disk_blocks"):
        value = getattr(config, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
    if kind is None:
        given = [n for n in ("kv_offload_dir", "kv_offload_host_blocks", "kv_offload_disk_blocks")
                 if getattr(config, n) is not None]
        if given:
            raise ValueError(f"{given[0]} sizes a tier of the tiered prefix cache; set kv_offload='host' or 'disk'")
        return
    if kind == "disk" and directory is None:
        raise ValueError("kv_offload='disk' keeps blocks in files: give kv_offload_dir=PATH (a directory)")
    if kind == "host":
        for name in ("kv_offload_dir", "kv_offload_disk_blocks"):
            if getattr(config, name) is not None:
                raise ValueError(f"{name} is for kv_offload='disk'; kv_offload='host' keeps blocks in host memory only")
    if directory is not None:
        if not isinstance(directory, (str, os.PathLike)):
            raise ValueError(f"kv_offload_dir must be a path, got {directory!r}")
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(f"kv_offload_dir must be a directory; {os.fspath(directory)!r} is a file")
    if config.kv_cache != "paged" or config.enable_prefix_caching is False:
        raise ValueError(f"kv_offload={kind!r} extends the prefix cache of the paged pool: it needs kv_cache='paged' "
                         f"and enable_prefix_caching True or None, got kv_cache={config.kv_cache!r}, "
                         f"enable_prefix_caching={config.enable_prefix_caching!r}")
    if config.block_manager is not None:
        raise ValueError(f"kv_offload={kind!r} extends the engine's own prefix caches; block_manager=... has no tiers")
    if config.num_ranks != 1:
        raise ValueError(f"kv_offload={kind!r} is not built for a model split over processes "
                         "(tensor_parallel_size or pipeline_parallel_size > 1)")


def tiered_block_manager(config):
    """What EngineConfig.block_manager_class() gives with kv_offload set: called as (num_blocks, block_size,
    enable_prefix_caching), as a block manager class is, it makes a TieredBlockManager with the config's tiers."""
    settings = OffloadSettings(config.kv_offload, None if config.kv_offload_dir is None else
                               os.fspath(config.kv_offload_dir), config.kv_offload_host_blocks,
                               config.kv_offload_disk_blocks)
    kind = TieredRadixBlockManager if config.prefix_cache == "radix" else TieredBlockManager
    return functools.partial(kind, offload=settings)


class _Tiers:
    """What both tiered block managers share: the store, the copies back queued for the next step, and saving an
    evicted block. `tier_hits`: the tokens the last `allocate_cached` found in host memory and on disk. The pool itself
    (`kv_cache`) is handed over by the runner (`load_from_tiers`) before the first step: no block is cached, so none
    evicted, before a step has run."""

    def _init_tiers(self, num_blocks: int, offload: OffloadSettings) -> None:
        host = offload.host_blocks or num_blocks
        disk = (offload.disk_blocks or 4 * host) if offload.kind == "disk" else 0
        self.tiers = TierStore(host, disk, offload.directory if disk else None)
        self.kv_cache = None
        self.loads: dict[Hashable, list[tuple[bytes, object, int]]] = {}  # seq -> (hash, buffer, pool block)
        self.tier_hits = (0, 0)
        self.saving = True

    def _walk_tiers(self, seq_id: Hashable, token_ids: Sequence[int], key: bytes | None) -> list[bytes]:
        """Past the pool's hits, which end at a block boundary with hash `key`: each next block of the prefix is
        shared if the pool still caches it (`_share`), or found in a tier and given a free block, its copy back
        queued; stops at the first miss, at the last token's block, or when no block is left. Every buffer is in
        hand before any block is taken: taking one may evict, and so save, a block, which may push a block this walk
        found out of its tier. Returns the hashes of the blocks it added to the sequence's table."""
        table, size = self.block_tables[seq_id], self.block_size
        found: list[tuple[bytes, int | None, tuple | None]] = []  # (hash, pool block to share, (buffer, tier))
        to_take = 0
        for i in range(len(table), (len(token_ids) - 1) // size):
            key = hash_block(key, token_ids[i * size:(i + 1) * size])
            block = self._share(key)
            got = None
            if block is None:
                got = self.tiers.get(key) if key in self.tiers and self.num_free_blocks > to_take else None
                if got is None:
                    break
                to_take += 1
            found.append((key, block, got))
        loads, tokens = [], {"host": 0, "disk": 0}
        for key, block, got in found:
            if block is None:
                block = self._take_block()  # never a block this table holds
                loads.append((key, got[0], block))
                tokens[got[1]] += size
            table.append(block)
        if loads:
            self.loads[seq_id] = loads
        self.tier_hits = (tokens["host"], tokens["disk"])
        return [key for key, _, _ in found]

    def load_from_tiers(self, kv_cache) -> None:
        """The runner's hook, before each step computes: copy every queued block back into its pool block; only then
        does the prefix cache take it in (`_loaded`)."""
        self.kv_cache = kv_cache
        while self.loads:
            seq_id, loads = self.loads.popitem()
            for key, buffer, block in loads:
                unpack(kv_cache, buffer, [block])
                self._loaded(seq_id, key, block)

    def _save(self, key: bytes, block: int) -> None:
        if not self.saving:
            return
        if self.tiers.tier(key) == "host":  # copied back from there earlier: the same keys and values
            self.tiers.touch(key)
            return
        if self.kv_cache is None:
            raise RuntimeError("a cached block is evicted before any step ran: the runner never called load_from_tiers")
        self.tiers.put(key, pack(self.kv_cache, [block], pin_memory=self.kv_cache.data.is_cuda))

    def free(self, seq_id: Hashable) -> None:
        """A sequence freed before its step ran (preempted, aborted, a failed step) never gets its copies back, and
        its blocks never enter the prefix cache: they return to the free list as plain blocks."""
        self.loads.pop(seq_id, None)
        super().free(seq_id)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds, in the pool and in the tiers; returns how many pool blocks."""
        self.saving = False  # what is dropped is not saved
        try:
            dropped = super().reset_prefix_cache()
        finally:
            self.saving = True
        self.tiers.clear()
        return dropped


class TieredBlockManager(_Tiers, BlockManager):
    """The hashed prefix cache (paging.py) with tiers below the pool: an evicted block is saved under its hash, and a
    prefix that continues past the pool's hits continues through the tiers (`_walk_tiers`)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, *,
                 offload: OffloadSettings):
        if not enable_prefix_caching:
            raise ValueError("a tiered prefix cache is a prefix cache: it needs enable_prefix_caching=True")
        super().__init__(num_blocks, block_size, True)
        self._init_tiers(num_blocks, offload)

    def allocate_cached(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """The pool's hits, then the blocks found in the tiers; returns the tokens the sequence need not compute."""
        super().allocate_cached(seq_id, token_ids)
        hashes = self.seq_hashes.get(seq_id, [])
        found = self._walk_tiers(seq_id, token_ids, hashes[-1] if hashes else None)
        if found:
            self.seq_hashes[seq_id] = hashes + found
        return len(self.block_tables[seq_id]) * self.block_size

    def _share(self, key: bytes) -> int | None:
        """A block the pool caches after one it did not (evicted first): held, as the pool's hits are."""
        block = self.cached_blocks.get(key)
        if block is not None:
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
        return block

    def _loaded(self, seq_id: Hashable, key: bytes, block: int) -> None:
        if key not in self.cached_blocks and self.block_hash[block] is None:  # else: registered meanwhile
            self.cached_blocks[key], self.block_hash[block] = block, key

    def _take_block(self) -> int:
        if not self.free_blocks and self.evictable:  # about to evict: the least recently released block goes down
            victim = next(iter(self.evictable))
            self._save(self.block_hash[victim], victim)
        return super()._take_block()


class TieredRadixBlockManager(_Tiers, RadixBlockManager):
    """The radix tree (prefix/radix_cache.py) with tiers below the pool. A node's `block_hash` is already a hash of its
    whole path (the hashed cache's chain, for full blocks), so an evicted full block is saved under it. A match that
    ends at a block boundary continues through the tiers; the blocks found join the tree when the sequence's
    computed blocks do (after its step, or when it is freed), counted as computed once copied back. A partly
    filled leaf is not saved: the next request would have to know its length to name it."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, *,
                 offload: OffloadSettings):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self._init_tiers(num_blocks, offload)

    def allocate_cached(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        matched = super().allocate_cached(seq_id, token_ids)
        if matched % self.block_size:  # ends inside a block the sequence copies on its first write
            self.tier_hits = (0, 0)
            return matched
        node, _ = self.in_tree[seq_id]
        key = self.block_hash[node.block] if node.block is not None else None
        return matched + len(self._walk_tiers(seq_id, token_ids, key)) * self.block_size

    def _share(self, key: bytes) -> None:
        return None  # a tree has no block below one it lacks

    def _loaded(self, seq_id: Hashable, key: bytes, block: int) -> None:
        tokens, n = self.computed[seq_id]  # written now: a free() from here on puts it in the tree
        self.computed[seq_id] = (tokens, n + self.block_size)

    def _remove(self, node) -> None:
        if len(node.tokens) == self.block_size:
            self._save(self.block_hash[node.block], node.block)
        super()._remove(node)
