"""Lab 03: the KV cache: its size, one cached attention step, and the cached generation loop.

Fill in every function marked TODO in labs/lab03_kv_cache.py, then grade your work with

    pytest tests/labs/test_lab03.py --impl=labs

`config` is a `mini_engine` ModelConfig (num_layers, num_heads, num_kv_heads, head_dim, num_params).
For the loop you get the engine's own pieces, imported below: `ContiguousKVCache(config, num_slots,
max_len, device, dtype)`, `prefill(model, cache, prompts, slots)` and `decode_step(model, cache, tokens,
context_lens, slots)`; read their docstrings in mini_engine/generate.py.
"""
from __future__ import annotations

import torch

from mini_engine.generate import decode_step, prefill
from mini_engine.kv_cache import ContiguousKVCache


def kv_cache_bytes(config, seq_len: int, batch: int = 1, dtype_bytes: int = 2) -> int:
    """Bytes of the K and V a model keeps for `batch` sequences of `seq_len` tokens: every layer stores,
    for every token, one key and one value vector of head_dim numbers per KV head (not per query head)."""
    # TODO: chapter 03's section on the cache's memory: what does each layer keep per token?
    raise NotImplementedError("lab03 kv_cache_bytes: count the numbers the cache holds (keys and values, layers, KV "
                              "heads, tokens, sequences), then their bytes")


def max_concurrent_requests(config, gpu_bytes: int, seq_len: int, dtype_bytes: int = 2) -> int:
    """How many requests of `seq_len` tokens fit their KV cache in the memory a GPU has left beside the
    weights (config.num_params numbers of dtype_bytes each). Whole requests only; 0 if none fit."""
    # TODO: what do the weights leave, and what does one request need?
    raise NotImplementedError("lab03 max_concurrent_requests: how many whole requests fit in the memory the weights "
                              "leave (and when do none)?")


def decode_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, position: int) -> torch.Tensor:
    """One layer's attention for ONE new token of one sequence, against that sequence's cache.

    q [Hq, D] is the new token's query (RoPE applied), k_new / v_new [Hkv, D] its key and value;
    k_cache / v_cache [Hkv, max_len, D] hold the keys and values of positions 0 .. position - 1.

    1. Write k_new and v_new into the caches at `position` (in place: the next step needs them).
    2. Attend: softmax(q · Kᵀ / sqrt(D)) · V over positions 0 .. position (the new token included, nothing
       after it: that part of the cache is unused). With grouped-query attention Hq = g · Hkv, and query
       head h reads KV head h // g.
    Returns the output [Hq, D]. Raises ValueError if `position` is past the end of the cache.
    """
    # TODO: the next step reads this token's key and value from the cache; attention reads only filled positions.
    raise NotImplementedError("lab03 decode_attention: which cache positions hold data at this step, and which KV "
                              "head does each query head read?")


def cached_generate(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """Greedy generation with a KV cache: one `prefill` of the whole prompt (its last logits give the first
    token), then one `decode_step` per further token, each feeding only the newest token.

    Use a ContiguousKVCache with one slot (slot 0) big enough for prompt + new tokens, on the model's device
    and in its dtype. A decode step's context length counts the cached tokens plus the one being fed.
    Returns only the new tokens; stop after `max_new_tokens`, or right after emitting `eos_token_id`
    (included). Must produce exactly the tokens of full-recompute greedy generation.
    """
    # TODO: the docstring names the engine pieces to use; what context length does each decode step need?
    raise NotImplementedError("lab03 cached_generate: the prefill gives the first token; after it, what does each "
                              "decode_step feed the model, and with what context length?")
