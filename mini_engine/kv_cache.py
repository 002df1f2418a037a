"""The two KV caches the engine can run on.

`ContiguousKVCache`: every sequence slot reserves room for `max_len` positions up front. Layout follows the
seed chapter: [layers, K/V, slots (batch), kv_heads, positions, head_dim]. Simple and fast to index, but a
slot's unused tail is wasted memory: the "before" picture for PagedAttention.

`PagedKVCache` (chapter 07): one pool of fixed-size blocks, [layers, K/V, num_blocks, block_size, kv_heads,
head_dim]; which blocks hold which sequence is the block tables' business (`paging.BlockManager`), so the
cache itself only stores rows. A token's heads sit side by side, the layout the paged kernels read.
"""
from __future__ import annotations

import torch

from .config import ModelConfig


class ContiguousKVCache:
    def __init__(self, config: ModelConfig, num_slots: int, max_len: int, device="cpu", dtype=torch.float32):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        self.num_slots, self.max_len = num_slots, max_len
        self.data = torch.zeros(config.num_layers, 2, num_slots, config.num_kv_heads, max_len, config.head_dim,
                                device=device, dtype=dtype)
        # Views made once: slicing the big tensor anew on every layer of every step is measurable overhead.
        self._layers = [(self.data[i, 0], self.data[i, 1]) for i in range(config.num_layers)]
        self._layer_ids = _layer_ids(config.num_layers, device)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of layer i: [slots, kv_heads, max_len, head_dim] each."""
        if torch.compiler.is_compiling():
            return self.data[i, 0], self.data[i, 1]  # views taken in the graph (see _store)
        return self._layers[i]

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor, slot_mapping, positions) -> None:
        """Store the new tokens' keys/values (k/v [T,Hkv,D]) at (slot, position) of layer i. The caller checks
        positions < max_len once per step (see LlamaModel.forward)."""
        if torch.compiler.is_compiling():
            _store(self.data, self._layer_ids[i], k, v, slot_mapping, slice(None), positions)
            return
        k_cache, v_cache = self._layers[i]
        k_cache[slot_mapping, :, positions] = k
        v_cache[slot_mapping, :, positions] = v


class PagedKVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, device="cpu", dtype=torch.float32):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        # Zeros, not empty: the CPU path reads whole blocks and masks the positions past a context, and a
        # masked NaN would still poison the weighted sum (0 * NaN).
        self.data = torch.zeros(config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim,
                                device=device, dtype=dtype)
        self._layers = [(self.data[i, 0], self.data[i, 1]) for i in range(config.num_layers)]
        self._layer_ids = _layer_ids(config.num_layers, device)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def max_len(self) -> int:
        """The most positions one sequence can hold: the whole pool."""
        return self.num_blocks * self.block_size

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of layer i: [num_blocks, block_size, kv_heads, head_dim] each."""
        if torch.compiler.is_compiling():
            return self.data[i, 0], self.data[i, 1]  # views taken in the graph (see _store)
        return self._layers[i]

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


def _layer_ids(num_layers: int, device) -> list[torch.Tensor]:
    """Each layer's index as a tensor of its own, for `_store`."""
    return [torch.tensor(i, device=device) for i in range(num_layers)]


def _store(data: torch.Tensor, layer: torch.Tensor | int, k: torch.Tensor, v: torch.Tensor, *where) -> None:
    """Inside a compiled graph: write a layer's new keys and values (k/v [T,Hkv,D]) with ONE indexed store into
    the cache's base tensor, at data[layer, K or V, *where] (where: each token's row, as index tensors [T] and
    slices).
    Written through per-layer views, as the eager steps do, the compiler would copy the whole cache at every
    layer to keep the views consistent (measured: 0.27 ms a layer for a 116-position cache); a store into the
    graph's input itself is done in place.
    `layer` is a 0-d tensor, one per layer (`_layer_ids`), so a graph input: with the index as a Python int, the
    layer's offset into the cache was a constant of the generated code, and every layer's store kernel differed
    from the others by that number alone, and Inductor compiled 30 copies of it. With the index an input, one
    kernel serves every layer. On a 2-core EPYC (Zen 3), a cold compile of the fp32 decode step generated 35 C++
    files in 74-81 s with an int, and 6 in 57-63 s with a tensor; the compiled step runs as fast
    (`benchmarks/bench_compile.py`, which compiles it both ways: an int `layer` is the way this replaced)."""
    t = k.shape[0]
    kv = torch.arange(2, device=k.device)[:, None].expand(2, t)  # K then V, for each token
    index = layer.expand(2, t) if isinstance(layer, torch.Tensor) else torch.full_like(kv, layer)
    data[(index, kv, *(w if isinstance(w, slice) else w.expand(2, t) for w in where))] = \
        torch.stack([k, v])
