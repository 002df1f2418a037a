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
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * seq_len * batch * dtype_bytes


def max_concurrent_requests(config, gpu_bytes: int, seq_len: int, dtype_bytes: int = 2) -> int:
    """How many requests of `seq_len` tokens fit their KV cache in the memory a GPU has left beside the
    weights (config.num_params numbers of dtype_bytes each). Whole requests only; 0 if none fit."""
    free = gpu_bytes - config.num_params * dtype_bytes
    return max(0, free // kv_cache_bytes(config, seq_len, 1, dtype_bytes))


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
    if position >= k_cache.shape[1]:
        raise ValueError(f"position {position} is past the cache's {k_cache.shape[1]} positions")
    k_cache[:, position] = k_new
    v_cache[:, position] = v_new
    group = q.shape[0] // k_cache.shape[0]
    keys = k_cache[:, :position + 1].repeat_interleave(group, dim=0)    # [Hq, n, D]
    values = v_cache[:, :position + 1].repeat_interleave(group, dim=0)
    scores = (keys @ q.unsqueeze(-1)).squeeze(-1) * q.shape[-1] ** -0.5  # [Hq, n]
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return (weights.unsqueeze(1) @ values).squeeze(1)


def cached_generate(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """Greedy generation with a KV cache: one `prefill` of the whole prompt (its last logits give the first
    token), then one `decode_step` per further token, each feeding only the newest token.

    Use a ContiguousKVCache with one slot (slot 0) big enough for prompt + new tokens, on the model's device
    and in its dtype. A decode step's context length counts the cached tokens plus the one being fed.
    Returns only the new tokens; stop after `max_new_tokens`, or right after emitting `eos_token_id`
    (included). Must produce exactly the tokens of full-recompute greedy generation.
    """
    cache = ContiguousKVCache(model.config, 1, len(prompt_ids) + max_new_tokens, model.device, model.dtype)
    logits = prefill(model, cache, [prompt_ids], [0])
    out = []
    while True:
        token = int(logits[0].argmax())
        out.append(token)
        if token == eos_token_id or len(out) == max_new_tokens:
            return out
        logits = decode_step(model, cache, [token], [len(prompt_ids) + len(out)], [0])
