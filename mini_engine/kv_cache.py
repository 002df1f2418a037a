"""The contiguous KV cache: every sequence slot reserves room for `max_len` positions up front.

Layout follows the seed chapter: [layers, K/V, slots (batch), kv_heads, positions, head_dim]. Simple and
fast to index, but a slot's unused tail is wasted memory: the "before" picture for PagedAttention.
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

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of layer i: [slots, kv_heads, max_len, head_dim] each."""
        return self._layers[i]

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor, slot_mapping, positions) -> None:
        """Store the new tokens' keys/values (k/v [T,Hkv,D]) at (slot, position) of layer i.
        The caller checks positions < max_len once per step (see LlamaModel.forward)."""
        k_cache, v_cache = self._layers[i]
        k_cache[slot_mapping, :, positions] = k
        v_cache[slot_mapping, :, positions] = v
