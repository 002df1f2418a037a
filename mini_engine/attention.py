"""Attention backends and the one metadata object a forward step carries.

Tokens of a step are packed: the step holds `query_lens[i]` new tokens of sequence i, laid end to end
(no padding). Sequence i attends to its first `context_lens[i]` positions: what the cache already holds
plus the new tokens. With no cache (`slots is None`) a sequence attends to its new tokens only.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

BACKENDS = ("naive", "torch", "triton")


def resolve_backend(name: str, device) -> str:
    """"auto" means the Triton kernels on a GPU and PyTorch's SDPA on a CPU (where Triton only interprets)."""
    if name == "auto":
        return "triton" if str(device).startswith("cuda") else "torch"
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be 'auto' or one of {BACKENDS}, got {name!r}")
    return name


@dataclass
class AttentionMetadata:
    query_lens: list[int]
    context_lens: list[int]
    positions: torch.Tensor           # [T] absolute position of each packed token (drives RoPE)
    slots: list[int] | None = None    # cache row of each sequence; None: no cache
    slot_mapping: torch.Tensor | None = None  # [T] cache row of each token, for the cache write
    logits_indices: torch.Tensor | None = None  # packed rows whose logits are wanted (None: all)

    @classmethod
    def build(cls, query_lens, context_lens=None, slots=None, device="cpu", last_only=False):
        context_lens = list(query_lens) if context_lens is None else list(context_lens)
        if len(context_lens) != len(query_lens):
            raise ValueError("context_lens and query_lens must have one entry per sequence")
        if any(q < 1 or c < q for q, c in zip(query_lens, context_lens)):
            raise ValueError(f"each query_len must be >= 1 and <= its context_len: {query_lens} / {context_lens}")
        positions = torch.cat([torch.arange(c - q, c) for q, c in zip(query_lens, context_lens)]).to(device)
        slot_mapping = None
        if slots is not None:
            slot_mapping = torch.repeat_interleave(torch.tensor(slots), torch.tensor(query_lens)).to(device)
        logits_indices = None
        if last_only:
            logits_indices = (torch.tensor(query_lens).cumsum(0) - 1).to(device)
        return cls(list(query_lens), context_lens, positions, None if slots is None else list(slots),
                   slot_mapping, logits_indices)


def _upcast_on_cpu(q, k, v):
    """PyTorch's CPU attention kernels are 3-4x slower in bf16/fp16 than in fp32 at decode shapes (measured
    with torch 2.13); converting the few rows involved is cheaper, and fp32 softmax is more exact anyway."""
    if q.device.type == "cpu" and q.dtype != torch.float32:
        return q.float(), k.float(), v.float()
    return q, k, v


def _sdpa(q, k, v, causal_offset: int | None, backend: str):
    """q [B,Hq,Nq,D], k/v [B,Hkv,Nk,D]. causal_offset: query i sees keys j <= i + offset (None: all keys)."""
    dtype = q.dtype
    q, k, v = _upcast_on_cpu(q, k, v)
    return _sdpa_math(q, k, v, causal_offset, backend).to(dtype)


def _sdpa_math(q, k, v, causal_offset: int | None, backend: str):
    n_q, n_k = q.shape[2], k.shape[2]
    if backend == "naive":
        # Materialise the full scores matrix: the O(N^2) memory FlashAttention removes (chapter 05).
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        if causal_offset is not None:
            mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(causal_offset)
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
    gqa = q.shape[1] != k.shape[1]
    if causal_offset is None or n_q == 1 and causal_offset >= n_k - 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    if causal_offset == 0 and n_q == n_k:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(causal_offset)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def _flash_varlen(q, k, v, query_lens, key_lens):
    """The Triton FlashAttention kernel over packed sequences (imported here: only this backend needs triton,
    and TRITON_INTERPRET must be set before triton's first import to run it on CPU tensors)."""
    from .kernels import flash_attention_varlen

    def cu(lens):
        return torch.tensor([0, *lens], device=q.device).cumsum(0).to(torch.int32)
    return flash_attention_varlen(q, k, v, cu(query_lens), cu(key_lens), max(query_lens), max(key_lens), causal=True)


def attention_no_cache(q, k, v, meta: AttentionMetadata, backend: str):
    """Causal attention of each sequence over its own packed tokens. q [T,Hq,D], k/v [T,Hkv,D]."""
    lens = meta.query_lens
    if backend == "triton":
        return _flash_varlen(q, k, v, lens, lens)
    if len(set(lens)) == 1:  # equal lengths: one batched call
        b, n = len(lens), lens[0]
        qb, kb, vb = (x.view(b, n, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
        return _sdpa(qb, kb, vb, 0, backend).transpose(1, 2).reshape(q.shape)
    outs = [_sdpa(*(x.T.unsqueeze(0) for x in (qs, ks, vs)), 0, backend)[0].transpose(0, 1)
            for qs, ks, vs in zip(q.split(lens), k.split(lens), v.split(lens))]
    return torch.cat(outs)


def attention_with_cache(q, k_cache, v_cache, meta: AttentionMetadata, backend: str):
    """Attend packed queries q [T,Hq,D] to cached keys/values k_cache [slots,Hkv,max_len,D] (already written)."""
    out = torch.empty_like(q)
    starts = [0, *itertools.accumulate(meta.query_lens)]
    decodes = [i for i, n in enumerate(meta.query_lens) if n == 1]
    chunks = [i for i, n in enumerate(meta.query_lens) if n > 1]  # prefill chunks
    if len(decodes) == 1 and backend != "triton":
        chunks, decodes = sorted(chunks + decodes), []  # a lone decode reads its cache row as a view: no gather
    if decodes:
        _batched_decode(q, k_cache, v_cache, meta, decodes, starts, out, backend)
    if backend == "triton" and chunks:
        # All prefill chunks in one kernel launch, each attending to its whole cached context.
        q_lens = [meta.query_lens[i] for i in chunks]
        k_lens = [meta.context_lens[i] for i in chunks]
        ks = torch.cat([k_cache[meta.slots[i], :, :meta.context_lens[i]].transpose(0, 1) for i in chunks])
        vs = torch.cat([v_cache[meta.slots[i], :, :meta.context_lens[i]].transpose(0, 1) for i in chunks])
        qs = torch.cat([q[starts[i]:starts[i + 1]] for i in chunks])
        for i, part in zip(chunks, _flash_varlen(qs, ks, vs, q_lens, k_lens).split(q_lens)):
            out[starts[i]:starts[i + 1]] = part
        return out
    for i in chunks:
        n, ctx, slot = meta.query_lens[i], meta.context_lens[i], meta.slots[i]
        qs = q[starts[i]:starts[i + 1]].transpose(0, 1).unsqueeze(0)  # [1,Hq,n,D]
        ks = k_cache[slot:slot + 1, :, :ctx]                           # a view: no copy of the cache
        vs = v_cache[slot:slot + 1, :, :ctx]
        out[starts[i]:starts[i + 1]] = _sdpa(qs, ks, vs, ctx - n, backend)[0].transpose(0, 1)
    return out


def _batched_decode(q, k_cache, v_cache, meta, rows, starts, out, backend):
    """One call for all single-token queries: gather their cache rows up to the longest context, mask the rest."""
    slots = [meta.slots[i] for i in rows]
    lens = [meta.context_lens[i] for i in rows]
    ctx, longest = torch.tensor(lens, device=q.device), max(lens)
    if slots == list(range(slots[0], slots[0] + len(slots))):
        # Consecutive slots (the scheduler's usual order): a view of the cache, no copy of the rows.
        k = k_cache[slots[0]:slots[0] + len(slots), :, :longest]  # [S,Hkv,L,D]
        v = v_cache[slots[0]:slots[0] + len(slots), :, :longest]
    else:
        index = torch.tensor(slots, device=q.device)
        k, v = k_cache[index, :, :longest], v_cache[index, :, :longest]
    qi = torch.tensor([starts[i] for i in rows], device=q.device)
    qs, k, v = _upcast_on_cpu(q[qi].unsqueeze(2), k, v)  # qs [S,Hq,1,D]
    valid = torch.arange(longest, device=q.device)[None, :] < ctx[:, None]  # [S,L]
    mask = valid[:, None, None, :]
    if backend == "naive":
        rep = qs.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (qs @ k.transpose(-1, -2)) * qs.shape[-1] ** -0.5
        o = torch.softmax(scores.masked_fill(~mask, float("-inf")).float(), -1).to(qs.dtype) @ v
    else:  # torch, and triton until the paged decode kernel of chapter 07
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=qs.shape[1] != k.shape[1])
    out[qi] = o.squeeze(2).to(out.dtype)
