"""Attention over a step's packed tokens, and the one metadata object a forward step carries (chapters 02-07).

Tokens of a step are packed: the step holds `query_lens[i]` new tokens of sequence i, laid end to end (no
padding). Sequence i attends to its first `context_lens[i]` positions: what the cache already holds plus the new
tokens. With no cache a sequence attends to its new tokens only.

With the contiguous cache sequence i owns row `slots[i]`; with the paged one (chapter 07) `block_tables[i]` lists
its blocks in order. The attention itself is a backend object, `TorchAttention` (SDPA, or chapter 02's two
explicit products) or `TritonAttention` (mini_engine/kernels), one per name in `LlamaModel.attention_backends`.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .paging import slot_mapping as block_slot_mapping

BACKENDS = ("naive", "torch", "triton")


def resolve_backend(name: str, device) -> str:
    """"auto" means the Triton kernels on a GPU and PyTorch's SDPA on a CPU (where Triton only interprets)."""
    if name == "auto":
        return "triton" if str(device).startswith("cuda") else "torch"
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be 'auto' or one of {BACKENDS}, got {name!r}")
    return name


@dataclass
class DecodeGroup:
    """The sequences of a step that bring one new token each, prepared once per step: every layer reads the same
    rows, so slicing and masking are decided here once rather than in each layer."""
    tokens: slice | torch.Tensor   # their rows in the packed step; slice(None) when the step is all decodes
    slots: slice | torch.Tensor | None  # contiguous cache: their slots, a slice (a view) when consecutive
    max_context: int               # key positions read per sequence: the group's longest context
    mask: torch.Tensor | None      # [S,1,1,max_context] True within a sequence's context; None: all full
    block_tables: torch.Tensor | None = None  # paged cache: [decodes, blocks of the longest context] int32
    context_lens: torch.Tensor | None = None  # [decodes] int32 (the paged kernel's argument)

    @staticmethod
    def _seqs_and_tokens(query_lens, device):
        seqs = [i for i, n in enumerate(query_lens) if n == 1]
        if len(seqs) == len(query_lens):
            return seqs, slice(None)
        starts = list(itertools.accumulate(query_lens, initial=0))
        return seqs, torch.tensor([starts[i] for i in seqs], device=device)

    @staticmethod
    def _mask(lens, device) -> torch.Tensor | None:
        longest = max(lens)
        if min(lens) == longest:
            return None
        mask = torch.arange(longest, device=device) < torch.tensor(lens, device=device)[:, None]
        return mask[:, None, None, :]

    @classmethod
    def build_paged(cls, query_lens, context_lens, block_tables, block_size: int, device) -> "DecodeGroup | None":
        seqs, tokens = cls._seqs_and_tokens(query_lens, device)
        if not seqs:
            return None
        lens = [context_lens[i] for i in seqs]
        tables = pad_tables([block_tables[i] for i in seqs], -(-max(lens) // block_size), device)
        return cls(tokens, None, max(lens), cls._mask(lens, device), tables,
                   torch.tensor(lens, dtype=torch.int32, device=device))

    @classmethod
    def build(cls, query_lens, context_lens, slots, device) -> "DecodeGroup | None":
        seqs, tokens = cls._seqs_and_tokens(query_lens, device)
        if not seqs:
            return None
        group_slots, lens = [slots[i] for i in seqs], [context_lens[i] for i in seqs]
        lo = group_slots[0]
        if group_slots == list(range(lo, lo + len(seqs))):  # the scheduler's usual order: a view, no copy
            slot_index = slice(lo, lo + len(seqs))
        else:
            slot_index = torch.tensor(group_slots, device=device)
        return cls(tokens, slot_index, max(lens), cls._mask(lens, device))

    @classmethod
    def from_tensors(cls, context_lens: torch.Tensor, length: int, slots: torch.Tensor | None = None,
                     block_tables: torch.Tensor | None = None) -> "DecodeGroup":
        """A step of decodes only, from tensors alone (a compiled graph's inputs): context_lens [S], and the
        contiguous cache's `slots` [S] or the paged cache's `block_tables` [S, W] (int32). Every row reads the
        same `length` key positions (the cache's length, or W blocks), masked past its own context."""
        context_lens = context_lens.to(torch.int32)
        mask = (torch.arange(length, device=context_lens.device) < context_lens[:, None])[:, None, None, :]
        return cls(slice(None), slots, length, mask, block_tables, context_lens)

    @property
    def is_whole_step(self) -> bool:
        return isinstance(self.tokens, slice)


def pad_tables(tables: list[list[int]], width: int, device, fill: int = 0) -> torch.Tensor:
    """Block tables cut or padded to `width` blocks with block `fill`, as one int32 tensor. Padding lies past each
    sequence's context, so it is masked (torch) or never read (the kernels), but the index stays a real block."""
    return torch.tensor([t[:width] + [fill] * (width - len(t[:width])) for t in tables], dtype=torch.int32,
                        device=device)


@dataclass
class AttentionMetadata:
    query_lens: list[int]
    context_lens: list[int]
    positions: torch.Tensor           # [T] absolute position of each packed token (drives RoPE)
    slots: list[int] | None = None    # contiguous cache: row of each sequence; None: no cache, or paged
    slot_mapping: torch.Tensor | None = None  # [T] where each token's keys/values are written (a slot's row,
    #                                           or with a paged cache a pool row: block * block_size + offset)
    logits_indices: torch.Tensor | None = None  # packed rows whose logits are wanted (None: all)
    decode: DecodeGroup | None = None  # the single-token sequences (cached steps only)
    block_tables: torch.Tensor | None = None  # paged cache: [S, W] int32, the tables padded to one width (build)
    # What an attention backend derives once per step and every layer reuses (its own keys; empty in the core).
    extras: dict = field(default_factory=dict)
    # build()'s arguments, plain lists: what a rank in another process rebuilds this from (chapter 11)
    built_from: dict | None = None

    @classmethod
    def build(cls, query_lens, context_lens=None, slots=None, device="cpu", last_only=False,
              block_tables: list[list[int]] | None = None, block_size: int | None = None, static_len=None, fill=0):
        """`slots` for the contiguous cache, or `block_tables` (each covering its context) and `block_size`
        for the paged one; neither for a step without a cache. `static_len`, a compiled decode step's: every row
        reads that many key positions (`DecodeGroup.from_tensors`), its block table padded to them with `fill`."""
        context_lens = list(query_lens) if context_lens is None else list(context_lens)
        if len(context_lens) != len(query_lens):
            raise ValueError("context_lens and query_lens must have one entry per sequence")
        if any(q < 1 or c < q for q, c in zip(query_lens, context_lens)):
            raise ValueError(f"each query_len must be >= 1 and <= its context_len: {query_lens} / {context_lens}")
        if slots is not None and block_tables is not None:
            raise ValueError("give slots (contiguous cache) or block_tables (paged cache), not both")
        # Built from Python lists in one call each: this runs every step, and small tensor ops add up.
        positions = torch.tensor([p for q, c in zip(query_lens, context_lens) for p in range(c - q, c)],
                                 device=device)
        slot_mapping = decode = tables = None
        if slots is not None:
            slot_mapping = torch.tensor([s for s, q in zip(slots, query_lens) for _ in range(q)], device=device)
        if block_tables is not None:
            if len(block_tables) != len(query_lens):
                raise ValueError("block_tables must have one table per sequence")
            slot_mapping = torch.tensor([s for t, q, c in zip(block_tables, query_lens, context_lens)
                                         for s in block_slot_mapping(t, c - q, c, block_size)],
                                        dtype=torch.int32, device=device)  # int32: the KV-store kernel's type
            width = static_len // block_size if static_len else max(len(t) for t in block_tables)
            tables = pad_tables(block_tables, width, device, fill)
        if static_len:  # a compiled step: the group its graph builds (compiled_decode.decode_graph)
            decode = DecodeGroup.from_tensors(torch.tensor(context_lens, dtype=torch.int32, device=device),
                                              static_len, None if tables is not None else slot_mapping, tables)
        elif slots is not None:
            decode = DecodeGroup.build(query_lens, context_lens, slots, device)
        elif tables is not None:
            decode = DecodeGroup.build_paged(query_lens, context_lens, block_tables, block_size, device)
        logits_indices = None
        if last_only:
            logits_indices = torch.tensor(list(itertools.accumulate(query_lens)), device=device) - 1
        built_from = dict(query_lens=list(query_lens), context_lens=context_lens, last_only=last_only,
                          slots=None if slots is None else list(slots), static_len=static_len, fill=fill,
                          block_tables=None if block_tables is None else [list(t) for t in block_tables],
                          block_size=block_size)
        return cls(list(query_lens), context_lens, positions, None if slots is None else list(slots),
                   slot_mapping, logits_indices, decode, tables, built_from=built_from)


def gather_blocks(pool: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` positions of each sequence, copied out of a paged pool [num_blocks, block_size,
    Hkv, D] through its block table (block_tables [S, >= ⌈length / block_size⌉]): [S, Hkv, length, D]."""
    width = -(-length // pool.shape[1])
    tables = block_tables[:, :width]
    rows = pool.index_select(0, tables.flatten())  # one copy of exactly the blocks read
    return rows.view(tables.shape[0], width * pool.shape[1], *pool.shape[2:])[:, :length].transpose(1, 2)


def naive_attention(q, k, v, mask):
    """Materialise the full scores matrix (the O(N^2) memory FlashAttention removes, chapter 05) as two
    explicit products, whose FLOPs chapter 02 counts. mask: bool, True = attend, broadcast; None = all."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


class TorchAttention:
    """Attention in plain PyTorch: SDPA, or with `naive` the two explicit products. Every method takes the
    step's metadata; q [T,Hq,D] and k/v [T,Hkv,D] are packed, a cache's layer is k_cache/v_cache (kv_cache.py)."""

    def __init__(self, naive: bool = False):
        self.naive = naive

    def __call__(self, q, k, v, meta: AttentionMetadata, kv_cache, layer: int):
        """One layer's attention: without a cache over the step's own tokens; with one, the new keys and values
        are written first, then every query attends to its whole context."""
        if kv_cache is None:
            return self.no_cache(q, k, v, meta)
        self.store(kv_cache, layer, k, v, meta)
        return self.with_cache(q, *kv_cache.layer(layer), meta)

    def store(self, kv_cache, layer: int, k, v, meta: AttentionMetadata) -> None:
        kv_cache.write(layer, k, v, meta.slot_mapping, meta.positions)

    def attend(self, q, k, v, mask=None, is_causal: bool = False):
        """q [B,Hq,Nq,D] against k/v [B,Hkv,Nk,D]; mask broadcast to [B,Hq,Nq,Nk], True = attend (None: all);
        is_causal: query i sees keys j <= i."""
        if self.naive:
            if is_causal:
                mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
            return naive_attention(q, k, v, mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                              enable_gqa=q.shape[1] != k.shape[1])

    def causal(self, q, k, v, offset: int):
        """Query i sees keys j <= i + offset: q [B,Hq,Nq,D], k/v [B,Hkv,Nk,D]."""
        n_q, n_k = q.shape[2], k.shape[2]
        if offset == 0 and n_q == n_k:
            return self.attend(q, k, v, is_causal=True)
        if n_q == 1 and offset >= n_k - 1:
            return self.attend(q, k, v)
        return self.attend(q, k, v, torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(offset))

    def no_cache(self, q, k, v, meta: AttentionMetadata):
        """Causal attention of each sequence over its own packed tokens."""
        lens = meta.query_lens
        if len(set(lens)) == 1:  # equal lengths: one batched call
            b, n = len(lens), lens[0]
            qb, kb, vb = (x.view(b, n, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
            return self.causal(qb, kb, vb, 0).transpose(1, 2).reshape(q.shape)
        return torch.cat([self.causal(*(x.transpose(0, 1).unsqueeze(0) for x in part), 0)[0].transpose(0, 1)
                          for part in zip(q.split(lens), k.split(lens), v.split(lens))])

    def with_cache(self, q, k_cache, v_cache, meta: AttentionMetadata):
        """Packed queries against their cached contexts (the new keys already written): the decodes together
        (`decode`), then each multi-token chunk on its own (`chunks`)."""
        if meta.decode is not None and meta.decode.is_whole_step:
            return self.decode(q, k_cache, v_cache, meta.decode, meta)
        chunks = [i for i, n in enumerate(meta.query_lens) if n > 1]
        if meta.decode is None and len(chunks) == 1:  # one prefill chunk alone: its output is
            return self.prefill_chunk(q, k_cache, v_cache, meta, 0)       # the step's, no copy into `out`
        out = torch.empty_like(q)
        if meta.decode is not None:
            out[meta.decode.tokens] = self.decode(q, k_cache, v_cache, meta.decode, meta)
        self.chunks(q, k_cache, v_cache, meta, chunks, out)
        return out

    def chunks(self, q, k_cache, v_cache, meta: AttentionMetadata, chunks: list[int], out) -> None:
        """The step's multi-token chunks (prefills, and a speculative step's last token plus drafts), into `out`."""
        starts = [0, *itertools.accumulate(meta.query_lens)]
        for i in chunks:
            out[starts[i]:starts[i + 1]] = self.prefill_chunk(q[starts[i]:starts[i + 1]], k_cache, v_cache, meta, i)

    def context(self, cache, meta: AttentionMetadata, i: int) -> torch.Tensor:
        """Sequence i's cached keys (or values), its whole context: [1, Hkv, context_len, D]."""
        ctx = meta.context_lens[i]
        if meta.block_tables is not None:
            return gather_blocks(cache, meta.block_tables[i:i + 1], ctx)
        return cache[meta.slots[i]:meta.slots[i] + 1, :, :ctx]  # a view: no copy of the cache

    def prefill_chunk(self, q, k_cache, v_cache, meta: AttentionMetadata, i: int):
        """Sequence i's chunk q [n,Hq,D] against its whole cached context: [n,Hq,D]."""
        offset = meta.context_lens[i] - meta.query_lens[i]
        ks, vs = self.context(k_cache, meta, i), self.context(v_cache, meta, i)
        return self.causal(q.transpose(0, 1).unsqueeze(0), ks, vs, offset)[0].transpose(0, 1)

    def decode(self, q, k_cache, v_cache, group: DecodeGroup, meta: AttentionMetadata):
        """One query token per sequence against its cached keys/values, all sequences in one call. A decode has
        one query per head, so the Hq/Hkv query heads that share a KV head are passed as that head's query rows
        [S,Hkv,Hq/Hkv,D]: every row sees every position of its context, and each KV head is read once."""
        qs = q[group.tokens]  # [S,Hq,D]
        if group.block_tables is not None:
            k = gather_blocks(k_cache, group.block_tables, group.max_context)  # [S,Hkv,L,D]
            v = gather_blocks(v_cache, group.block_tables, group.max_context)
        else:
            k = k_cache[group.slots, :, :group.max_context]  # [S,Hkv,L,D]
            v = v_cache[group.slots, :, :group.max_context]
        s, hq, d = qs.shape
        return self.attend(qs.view(s, k.shape[1], hq // k.shape[1], d), k, v, group.mask).reshape(s, hq, d)


class TritonAttention(TorchAttention):
    """The Triton kernels (imported on first use): FlashAttention over packed prefills and verify chunks, the paged
    decode kernel and the paged KV store. A decode on the contiguous cache goes through SDPA: its scores are one
    row per head, not the N x N matrix FlashAttention avoids."""

    def store(self, kv_cache, layer: int, k, v, meta: AttentionMetadata) -> None:
        if meta.block_tables is None or torch.compiler.is_compiling():
            return super().store(kv_cache, layer, k, v, meta)
        from .kernels import store_kv_cache
        store_kv_cache(k, v, *kv_cache.layer(layer), meta.slot_mapping)

    def flash(self, q, k, v, query_lens, key_lens, meta: AttentionMetadata):
        from .kernels import flash_attention_varlen

        def cu(lens):  # once a step, not once a layer: copying a list to a GPU makes the host wait
            key = ("cu_seqlens", *lens)
            if key not in meta.extras:
                meta.extras[key] = torch.tensor([0, *lens], device=q.device).cumsum(0).to(torch.int32)
            return meta.extras[key]
        return flash_attention_varlen(q, k, v, cu(query_lens), cu(key_lens), max(query_lens), max(key_lens),
                                      causal=True)

    def no_cache(self, q, k, v, meta: AttentionMetadata):
        return self.flash(q, k, v, meta.query_lens, meta.query_lens, meta)

    def decode(self, q, k_cache, v_cache, group: DecodeGroup, meta: AttentionMetadata):
        if group.block_tables is None:
            return super().decode(q, k_cache, v_cache, group, meta)
        from .kernels import paged_decode_attention
        return paged_decode_attention(q[group.tokens], k_cache, v_cache, group.block_tables, group.context_lens)

    def prefill_chunk(self, q, k_cache, v_cache, meta: AttentionMetadata, i: int):
        ks, vs = self.context(k_cache, meta, i)[0].transpose(0, 1), self.context(v_cache, meta, i)[0].transpose(0, 1)
        return self.flash(q, ks, vs, [meta.query_lens[i]], [meta.context_lens[i]], meta)

    def chunks(self, q, k_cache, v_cache, meta: AttentionMetadata, chunks: list[int], out) -> None:
        """Every multi-token chunk (prefills and verify chunks alike) in one FlashAttention launch, each
        attending to its whole cached context."""
        starts = [0, *itertools.accumulate(meta.query_lens)]
        q_lens = [meta.query_lens[i] for i in chunks]
        ks = torch.cat([self.context(k_cache, meta, i)[0].transpose(0, 1) for i in chunks])
        vs = torch.cat([self.context(v_cache, meta, i)[0].transpose(0, 1) for i in chunks])
        qs = torch.cat([q[starts[i]:starts[i + 1]] for i in chunks])
        parts = self.flash(qs, ks, vs, q_lens, [meta.context_lens[i] for i in chunks], meta).split(q_lens)
        for i, part in zip(chunks, parts):
            out[starts[i]:starts[i + 1]] = part


def make_backends() -> dict[str, TorchAttention]:
    """A model's attention backends by name (`LlamaModel.attention_backends`)."""
    return {"naive": TorchAttention(naive=True), "torch": TorchAttention(), "triton": TritonAttention()}


def attention_with_cache(q, k_cache, v_cache, meta: AttentionMetadata, backend: str = "torch"):
    """Packed queries q [T,Hq,D] against a cache layer's keys and values (already written): a contiguous cache's
    k_cache [slots,Hkv,max_len,D], or a paged pool's [num_blocks,block_size,Hkv,D] with the step's block tables."""
    return make_backends()[backend].with_cache(q, k_cache, v_cache, meta)
