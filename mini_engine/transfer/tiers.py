"""The lower tiers of a tiered prefix cache (chapter 12): packed blocks (`pack.pack`) kept in host memory and, when
that fills, in files. Each tier is bounded and least recently used first out: a block pushed out of host memory goes
to disk (when there is a disk tier), one pushed off disk is forgotten. Keys name a block's whole prefix (the hashed
cache's block hash), so whatever is found continues a request's prefix exactly.

A file is checked when it is read (`pack.read_header`: its length and its payload's CRC-32), so a file that is
missing, truncated or corrupted is a miss, never wrong keys and values; the entry is forgotten. Each store writes
into a directory of its own inside `directory` (removed when the store goes), so two engines sharing a directory
never read each other's files.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .pack import KVBufferError, read_header


@dataclass
class TierStats:
    """What the tiers did since the store was made (or cleared)."""
    saves: int = 0          # blocks put into host memory
    host_hits: int = 0      # blocks found in host memory
    disk_hits: int = 0      # blocks found on disk, their files intact
    demotions: int = 0      # blocks moved from host memory to disk
    drops: int = 0          # blocks forgotten: pushed out of the last tier, or a file that could not be written
    bad_files: int = 0      # files missing, truncated or corrupted when read: misses


class TierStore:
    """Two LRU tiers of packed blocks: `host_blocks` in host memory, then `disk_blocks` files in `directory`
    (disk_blocks=0: no disk tier). A key lives in one tier at a time."""

    def __init__(self, host_blocks: int, disk_blocks: int = 0, directory: str | os.PathLike | None = None):
        if not isinstance(host_blocks, int) or host_blocks < 1:
            raise ValueError(f"host_blocks must be an int >= 1, got {host_blocks!r}")
        if not isinstance(disk_blocks, int) or disk_blocks < 0:
            raise ValueError(f"disk_blocks must be an int >= 0, got {disk_blocks!r}")
        if disk_blocks and directory is None:
            raise ValueError("a disk tier (disk_blocks > 0) needs a directory")
        self.host_blocks, self.disk_blocks = host_blocks, disk_blocks
        self.host: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # least recently used first
        self.disk: OrderedDict[bytes, None] = OrderedDict()
        self.stats = TierStats()
        self.directory = None
        if disk_blocks:
            os.makedirs(directory, exist_ok=True)
            self.directory = tempfile.mkdtemp(prefix="mini_engine-kv-", dir=directory)
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.directory, True)

    def __contains__(self, key: bytes) -> bool:
        return key in self.host or key in self.disk

    def __len__(self) -> int:
        return len(self.host) + len(self.disk)

    def tier(self, key: bytes) -> str | None:
        """"host", "disk" or None: where the key is (a disk entry's file is checked only when read)."""
        return "host" if key in self.host else "disk" if key in self.disk else None

    def path(self, key: bytes) -> str:
        return os.path.join(self.directory, key.hex() + ".kv")

    def put(self, key: bytes, buffer: torch.Tensor) -> None:
        """Keep a packed block in host memory (the most recently used), pushing the least recently used ones down."""
        if key in self.disk:  # in use again: it moves up, and its file goes
            self._forget_file(key)
        self.host[key] = buffer
        self.host.move_to_end(key)
        self.stats.saves += 1
        while len(self.host) > self.host_blocks:
            self._demote(*self.host.popitem(last=False))

    def touch(self, key: bytes) -> None:
        """Mark a key used now (it leaves its tier last)."""
        (self.host if key in self.host else self.disk).move_to_end(key)

    def get(self, key: bytes) -> tuple[torch.Tensor, str] | None:
        """(the packed block, "host" or "disk"), or None: not here, or its file missing or damaged (then forgotten)."""
        if key in self.host:
            self.host.move_to_end(key)
            self.stats.host_hits += 1
            return self.host[key], "host"
        if key not in self.disk:
            return None
        try:
            with open(self.path(key), "rb") as f:
                data = bytearray(f.read())
            buffer = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            read_header(buffer)  # the whole file is there and its payload matches its CRC-32
        except (OSError, KVBufferError):
            self.stats.bad_files += 1
            self._forget_file(key)
            return None
        self.disk.move_to_end(key)
        self.stats.disk_hits += 1
        return buffer, "disk"

    def clear(self) -> None:
        for key in list(self.disk):
            self._forget_file(key)
        self.host.clear()

    def _demote(self, key: bytes, buffer: torch.Tensor) -> None:
        """A block pushed out of host memory: to a file (written whole, then renamed), or forgotten."""
        if not self.disk_blocks:
            self.stats.drops += 1
            return
        path = self.path(key)
        try:
            with open(path + ".tmp", "wb") as f:
                f.write(buffer.numpy())
            os.replace(path + ".tmp", path)  # a reader never sees half a file under the real name
        except OSError:  # a full or read-only disk: the block is lost to the cache, nothing else
            self.stats.drops += 1
            return
        self.disk[key] = None
        self.stats.demotions += 1
        while len(self.disk) > self.disk_blocks:
            self._forget_file(next(iter(self.disk)))
            self.stats.drops += 1

    def _forget_file(self, key: bytes) -> None:
        del self.disk[key]
        try:
            os.remove(self.path(key))
        except OSError:
            pass  # already gone: forgetting it is all that is left to do
