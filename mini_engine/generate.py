"""The plain generation loops: full recompute (chapter 01) and the KV-cached loop (chapter 03)."""
from __future__ import annotations

import torch

from .attention import AttentionMetadata
from .compiled_decode import compiled_decode_step
from .kv_cache import ContiguousKVCache
from .sampling import SamplingParams, make_generator, sample


def _check(model, prompt_ids, max_new_tokens):
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids must not be empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    limit = model.config.max_position_embeddings
    if len(prompt_ids) + max_new_tokens > limit:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"{limit} positions")


def _stops(model, params: SamplingParams, eos_token_id):
    if params.ignore_eos:
        return set(params.stop_token_ids)
    eos = model.config.eos_token_id if eos_token_id is None else eos_token_id
    return set(params.stop_token_ids) | ({eos} if eos is not None else set())


def generate_naive(model, prompt_ids: list[int], max_new_tokens: int = 32, params: SamplingParams | None = None,
                   eos_token_id: int | None = None, on_token=None) -> list[int]:
    """Full recompute: every step runs the whole sequence so far through every layer. Returns the new tokens
    (a stop token, when hit, is included as the last one). `on_token(token)` is called as each one arrives."""
    params = params or SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    _check(model, prompt_ids, max_new_tokens)
    stops, gen = _stops(model, params, eos_token_id), make_generator(params, model.device)
    seq, out = list(prompt_ids), []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([seq], device=model.device), last_only=True)[0]  # O(len(seq)) work, every step
        token = sample(logits, [params], [gen])[0]
        out.append(token)
        seq.append(token)
        if on_token:
            on_token(token)
        if token in stops:
            break
    return out


def prefill(model, kv_cache, prompts: list[list[int]], slots: list[int]) -> torch.Tensor:
    """Run all prompts at once (packed), filling their cache slots; logits of each prompt's last token."""
    meta = AttentionMetadata.build([len(p) for p in prompts], slots=slots, device=model.device, last_only=True)
    ids = torch.tensor([t for p in prompts for t in p], device=model.device)
    return model(ids, meta, kv_cache)


def decode_step(model, kv_cache, tokens: list[int], context_lens: list[int], slots: list[int]) -> torch.Tensor:
    """One new token per sequence against the cache; context_lens count the cache plus that token."""
    meta = AttentionMetadata.build([1] * len(tokens), context_lens, slots, device=model.device)
    return model(torch.tensor(tokens, device=model.device), meta, kv_cache)


def generate_cached(model, prompt_ids: list[int], max_new_tokens: int = 32, params: SamplingParams | None = None,
                    eos_token_id: int | None = None, on_token=None, kv_cache: ContiguousKVCache | None = None,
                    compile: bool = False) -> list[int]:
    """Prefill once, then decode one token per step against the KV cache. Same tokens as `generate_naive`.
    compile=True runs each decode step as one compiled graph (`compiled_decode`; the first call compiles)."""
    return generate_batch(model, [prompt_ids], max_new_tokens, params, eos_token_id,
                          on_token=on_token, kv_cache=kv_cache, compile=compile)[0]


def generate_batch(model, prompts: list[list[int]], max_new_tokens: int = 32, params: SamplingParams | None = None,
                   eos_token_id: int | None = None, on_token=None, kv_cache: ContiguousKVCache | None = None,
                   compile: bool = False) -> list[list[int]]:
    """Cached generation for several prompts decoded together, one slot each: every decode step reads the
    weights once for the whole batch. A finished sequence drops out of the batch. `on_token` streams only
    when there is a single prompt (it is how `generate_cached` streams). compile=True: decode steps run as
    one compiled graph, compiled anew for each batch size met (sequences that stop early shrink it)."""
    params = params or SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    if not prompts:
        raise ValueError("prompts must not be empty")
    for p in prompts:
        _check(model, p, max_new_tokens)
    longest = max(len(p) for p in prompts) + max_new_tokens
    if kv_cache is None:
        kv_cache = ContiguousKVCache(model.config, len(prompts), longest, model.device, model.dtype)
    elif kv_cache.num_slots < len(prompts) or kv_cache.max_len < longest:
        raise ValueError(f"kv_cache too small: need {len(prompts)} slots of {longest} positions")
    stops = _stops(model, params, eos_token_id)
    step = compiled_decode_step if compile else decode_step
    gens = [make_generator(params, model.device) for _ in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    logits = prefill(model, kv_cache, prompts, active)
    while True:
        tokens = sample(logits, [params] * len(active), [gens[i] for i in active])
        still = []
        for i, tok in zip(active, tokens):
            outs[i].append(tok)
            if on_token and len(prompts) == 1:
                on_token(tok)
            if tok not in stops and len(outs[i]) < max_new_tokens:
                still.append(i)
        if not still:
            return outs
        active = still
        logits = step(model, kv_cache, [outs[i][-1] for i in active],
                      [len(prompts[i]) + len(outs[i]) for i in active], active)
