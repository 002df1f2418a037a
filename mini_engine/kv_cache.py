"""The two KV caches the engine can run on (chapter 03, and chapter 07 for the paged one).

`ContiguousKVCache`: every slot reserves `max_len` positions up front, [layers, K/V, slots, kv_heads, positions,
head_dim], the textbook's "typical layout" "(layers, 2, batch, heads, seq_len, head_dim)". Simple to index, but a
slot's unused tail is wasted: the "before" picture.
`PagedKVCache`: one pool of fixed-size blocks, [layers, K/V, num_blocks, block_size, kv_heads, head_dim]; which
blocks hold which sequence is the block tables' business (`paging.BlockManager`): the cache only stores rows.
"""
from __future__ import annotations

import torch

from .config import ModelConfig


class KVCache:
    """What both caches share: one zeroed tensor `data` [layers, K/V, ...] and each layer's two views of it. Zeros,
    not empty: the torch path reads whole blocks or slots and masks the positions past a context, and a masked
    NaN would still poison the weighted sum (0 * NaN)."""

    def __init__(self, config: ModelConfig, shape: tuple[int, ...], device, dtype):
        self.data = torch.zeros(config.num_layers, 2, *shape, device=device, dtype=dtype)
        # Views made once (slicing anew in every layer of every step costs), and each layer's index for `_store`.
        self._layers = [(self.data[i, 0], self.data[i, 1]) for i in range(config.num_layers)]
        self._layer_ids = [torch.tensor(i, device=device) for i in range(config.num_layers)]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of layer i (contiguous: [slots, kv_heads, max_len, head_dim]; paged: [num_blocks,
        block_size, kv_heads, head_dim])."""
        if torch.compiler.is_compiling():
            return self.data[i, 0], self.data[i, 1]  # views taken in the graph (see _store)
        return self._layers[i]


class ContiguousKVCache(KVCache):
    def __init__(self, config: ModelConfig, num_slots: int, max_len: int, device="cpu", dtype=torch.float32):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        self.num_slots, self.max_len = num_slots, max_len
        super().__init__(config, (num_slots, config.num_kv_heads, max_len, config.head_dim), device, dtype)

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor, slot_mapping, positions) -> None:
        """Store the new tokens' keys/values (k/v [T,Hkv,D]) at (slot, position) of layer i. The caller checks
        positions < max_len once per step (see LlamaModel.forward)."""
        if torch.compiler.is_compiling():
            _store(self.data, self._layer_ids[i], k, v, slot_mapping, slice(None), positions)
            return
        k_cache, v_cache = self._layers[i]
        k_cache[slot_mapping, :, positions] = k
        v_cache[slot_mapping, :, positions] = v


class PagedKVCache(KVCache):
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, device="cpu", dtype=torch.float32):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        super().__init__(config, (num_blocks, block_size, config.num_kv_heads, config.head_dim), device, dtype)

    @property
    def max_len(self) -> int:
        """The most positions one sequence can hold: the whole pool."""
        return self.num_blocks * self.block_size

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write (parallel sampling): every layer's keys and values of block src into block dst, for
        each (src, dst). All sources are read before any destination is written."""
        src, dst = (torch.tensor(ids, device=self.data.device) for ids in zip(*pairs))
        self.data[:, :, dst] = self.data[:, :, src]

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor, slot_mapping, positions=None) -> None:
        """Store the new tokens' keys/values (k/v [T,Hkv,D]) in their pool rows of layer i (`slot_mapping` [T],
        block * block_size + offset, from the block tables). `positions` is unused: a slot already says where a
        token goes."""
        rows = slot_mapping.long()
        blocks, offsets = rows // self.block_size, rows % self.block_size
        if torch.compiler.is_compiling():
            _store(self.data, self._layer_ids[i], k, v, blocks, offsets)
            return
        k_cache, v_cache = self._layers[i]
        k_cache[blocks, offsets] = k
        v_cache[blocks, offsets] = v


def _store(data: torch.Tensor, layer: torch.Tensor | int, k: torch.Tensor, v: torch.Tensor, *where) -> None:
    """Inside a compiled graph: write a layer's new keys and values (k/v [T,Hkv,D]) with ONE indexed store into
    the cache's base tensor, at data[layer, K or V, *where] (where: each token's row, as index tensors [T] and
    slices). Through per-layer views the compiler would copy the whole cache at every layer to keep them
    consistent. `layer` is a 0-d tensor (a graph input), so one store kernel serves every layer."""
    t = k.shape[0]
    kv = torch.arange(2, device=k.device)[:, None].expand(2, t)  # K then V, for each token
    index = layer.expand(2, t) if isinstance(layer, torch.Tensor) else torch.full_like(kv, layer)
    data[(index, kv, *(w if isinstance(w, slice) else w.expand(2, t) for w in where))] = \
        torch.stack([k, v])
