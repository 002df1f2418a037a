"""Attention backends and the one metadata object a forward step carries.

Tokens of a step are packed: the step holds `query_lens[i]` new tokens of sequence i, laid end to end
(no padding). Sequence i attends to its first `context_lens[i]` positions: what the cache already holds
plus the new tokens. With no cache (`slots is None`) a sequence attends to its new tokens only.

Two caches (kv_cache.py): the contiguous one, where sequence i owns row `slots[i]`, and the paged one, where
`block_tables[i]` lists the blocks holding its positions in order.

Decodes over the paged cache on a CPU (`paged_decode_torch`) take the faster of two forms on this machine. The
C kernel `cpu_kernels.paged_decode` (csrc/paged_decode.c, the CPU twin of the Triton kernel) reads each
sequence's blocks in place, asking for the next block while it reads the current one. The PyTorch forms copy
each sequence's blocks out of the pool (`index_select` on the block ids, once per layer) and call SDPA as the
contiguous path does. The forms measured for one layer's decode (16 sequences, SmolLM2's 9 query and 3 KV heads
of 64, fp32, two threads of a quiet AMD EPYC with AVX-512; shuffled block tables), contexts of 128 / 1024
positions: contiguous slice 0.14 / 0.83 ms; `index_select` gather 0.19 / 2.08 ms; advanced indexing
(`pool[block_tables]`) 0.27 / 3.78 ms; views of contiguous block runs with one SDPA call per sequence 0.44 /
1.51 ms, and only when a sequence's blocks are consecutive, which decodes growing side by side make rare;
torch.compile of a fused gather-and-reduce 0.15 / 1.80 ms, but compiled anew for each context length (3-4 s
each), which a serving engine meets at every step. The copy reads the cached keys and values a second time:
copying a few sequences at a time keeps each copy in the CPU's cache until SDPA reads it (16 sequences of 1,024
positions: 1.71 ms four at a time against 2.14 ms all at once), but the copy and SDPA still cannot overlap.
The C kernel, measured later over 30 layers' pools (so that it reads from memory): 0.08 / 0.75 ms, against
0.17 / 1.1 ms for the contiguous cache's SDPA in the same run (without its prefetch of the next block, 1.6 ms
at 1,024 positions). Prefill chunks and a speculative step's verify chunks choose the same way between a copy
with SDPA and the kernel's chunk variant (`prefill_form`, `verify_form`), which tiles 16 query rows into the
lanes of a vector as FlashAttention tiles them into a GPU's threads: 2-7x faster than the copy with SDPA here.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .backends.cpu.autotune import TUNER, Autotuner, counting_mode_active, row_bucket
from .backends.cpu.cpu_kernels import (contiguous_decode, contiguous_decode_supported, load_torch_ops, paged_chunk, paged_decode,
                          paged_decode_supported)
from .paging import slot_mapping as block_slot_mapping

BACKENDS = ("naive", "torch", "triton")
IN_PLACE = "in place (C)"  # the autotuned form that reads a paged pool through the C kernels (cpu_kernels.py)


def resolve_backend(name: str, device) -> str:
    """"auto" means the Triton kernels on a GPU and PyTorch's SDPA on a CPU (where Triton only interprets)."""
    if name == "auto":
        return "triton" if str(device).startswith("cuda") else "torch"
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be 'auto' or one of {BACKENDS}, got {name!r}")
    return name


@dataclass
class DecodeGroup:
    """The sequences of a step that bring one new token each, prepared once per step. Every layer reads the
    same rows, and on a CPU a decode step is dominated by per-op overhead, so slicing and masking are decided
    here once rather than in each of the model's layers."""
    tokens: slice | torch.Tensor   # their rows in the packed step; slice(None) when the step is all decodes
    slots: slice | torch.Tensor | None  # contiguous cache: the slots read, a slice (a view) or, rarely, a gather
    rows: torch.Tensor | None      # where each decode sits among the slots read; None: one slot per decode
    max_context: int               # key positions read per slot: the group's longest context
    mask: torch.Tensor | None      # [slots read,1,1,max_context] True within a slot's context; None: all full
    block_tables: torch.Tensor | None = None  # paged cache: [decodes, blocks of the longest context] int32
    context_lens: torch.Tensor | None = None  # [decodes] int32, for the C kernels (paged, and contiguous)
    # Paged cache: each row's context, so that the few sequences copied at a time read only their own longest
    # context (`paged_decode_torch`); a compiled step sorts its rows by length for that. None: every copy
    # reads max_context.
    lens: list[int] | None = None
    slot_ids: torch.Tensor | None = None  # contiguous cache: each decode's slot [decodes] int32, for the C kernel
    # the form of the attention (`paged_decode_form`, `contiguous_decode_form`), decided at the step's first layer
    # and kept for the others, keyed by (backend, FLOP counting)
    forms: dict[tuple, str] = field(default_factory=dict)

    def form(self, backend: str, decide) -> str:
        """The step's form for `backend`: decide() the first time, then kept."""
        key = (backend, counting_mode_active())
        form = self.forms.get(key)
        if form is None:
            form = self.forms[key] = decide()
        return form

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
        width = -(-max(lens) // block_size)
        # Shorter tables are padded with block 0: those positions lie past the sequence's context, so they
        # are masked (torch) or never read (the paged kernel), but the index stays a real block.
        tables = [block_tables[i][:width] + [0] * (width - len(block_tables[i][:width])) for i in seqs]
        return cls(tokens, None, None, max(lens), cls._mask(lens, device),
                   torch.tensor(tables, dtype=torch.int32, device=device),
                   torch.tensor(lens, dtype=torch.int32, device=device))

    @classmethod
    def build(cls, query_lens, context_lens, slots, device) -> "DecodeGroup | None":
        seqs, tokens = cls._seqs_and_tokens(query_lens, device)
        if not seqs:
            return None
        group_slots, lens = [slots[i] for i in seqs], [context_lens[i] for i in seqs]
        kernel_inputs = {}  # for the CPU's C kernel only (`contiguous_decode_form`)
        if torch.device(device).type == "cpu":
            kernel_inputs = {"slot_ids": torch.tensor(group_slots, dtype=torch.int32),
                             "context_lens": torch.tensor(lens, dtype=torch.int32)}
        lo, hi = min(group_slots), max(group_slots) + 1
        rows = None
        if group_slots == list(range(lo, hi)):  # the scheduler's usual order: a view of the cache, no copy
            slot_index = slice(lo, hi)
        elif hi - lo <= 2 * len(seqs):
            # Gaps (slots whose requests are prefilling or gone): copying the rows out of the cache costs more
            # than reading the whole range as a view and dropping the extra rows' results.
            slot_index, rows = slice(lo, hi), torch.tensor([s - lo for s in group_slots], device=device)
            range_lens = [1] * (hi - lo)
            for s, n in zip(group_slots, lens):
                range_lens[s - lo] = n
            lens = range_lens
        else:
            slot_index = torch.tensor(group_slots, device=device)
        return cls(tokens, slot_index, rows, max(lens), cls._mask(lens, device), **kernel_inputs)

    @classmethod
    def from_tensors(cls, context_lens: torch.Tensor, length: int, slots: torch.Tensor | None = None,
                     block_tables: torch.Tensor | None = None) -> "DecodeGroup":
        """A step of decodes only, from tensors alone (a compiled graph's inputs): context_lens [S], and the
        contiguous cache's `slots` [S] or the paged cache's `block_tables` [S, W] (int32). Every row reads the
        same `length` key positions (the cache's length, or W blocks), masked past its own context; on a CPU the
        operator that runs the attention reads only what the rows need (`_decode_attention_op`)."""
        # int32 for the C kernels, converted here once per step rather than in each layer's call.
        context_lens = context_lens.to(torch.int32)
        mask = (torch.arange(length, device=context_lens.device) < context_lens[:, None])[:, None, None, :]
        return cls(slice(None), slots, None, length, mask, block_tables, context_lens,
                   slot_ids=None if slots is None else slots.to(torch.int32))

    @property
    def is_whole_step(self) -> bool:
        return isinstance(self.tokens, slice)


# Chunks of up to this many tokens over a cached context are attended together, like decodes (`VerifyGroup`): a
# speculative chunk is a request's last token and its k drafts. Longer chunks are prefills, attended one by one.
MAX_VERIFY_TOKENS = 16


@dataclass
class VerifyGroup:
    """The step's short multi-token chunks (2 to MAX_VERIFY_TOKENS tokens): on a speculative step, each decoding
    request's last token and its drafts. Attended one by one, as prefill chunks are, they cost one SDPA call and
    one copy of the context per sequence and per layer, and a speculative step at batch 16 spent more time there
    than in its decode. Padded to the longest chunk (Q tokens), they go through one call as decodes do, each
    query row masked to the positions before it."""
    seqs: list[int]                # the chunks' places in the step
    tokens: torch.Tensor           # [S*Q] packed row of each padded query (padding repeats the chunk's last row)
    valid: torch.Tensor            # [n] where the step's real query rows sit among the S*Q padded ones
    packed: torch.Tensor           # [n] their rows in the packed step, in the same order
    query_len: int                 # Q
    slots: torch.Tensor | None     # contiguous cache: [S] the sequences' slots
    block_tables: torch.Tensor | None  # paged cache: [S, blocks of the longest context] int32
    max_context: int               # key positions read per sequence
    mask: torch.Tensor             # [S,1,Q,1,max_context] True where query row j of sequence s may look
    visible: torch.Tensor | None = None  # [S, Q] int32: how many positions query row j sees (the C kernel's mask)

    @classmethod
    def build(cls, query_lens, context_lens, slots, block_tables, device) -> "VerifyGroup | None":
        seqs = [i for i, n in enumerate(query_lens) if 1 < n <= MAX_VERIFY_TOKENS]
        if not seqs:
            return None
        starts = list(itertools.accumulate(query_lens, initial=0))
        width = max(query_lens[i] for i in seqs)
        tokens, valid, packed, sees = [], [], [], []
        for s, i in enumerate(seqs):
            n, first = query_lens[i], context_lens[i] - query_lens[i]
            tokens += [starts[i] + min(j, n - 1) for j in range(width)]
            valid += range(s * width, s * width + n)
            packed += range(starts[i], starts[i] + n)
            sees.append([first + min(j, n - 1) + 1 for j in range(width)])  # query j sees positions < this
        max_context = max(context_lens[i] for i in seqs)
        mask = torch.arange(max_context, device=device) < torch.tensor(sees, device=device)[..., None]
        tables = None
        if block_tables is not None:
            blocks = max(len(block_tables[i]) for i in seqs)
            tables = torch.tensor([block_tables[i] + [0] * (blocks - len(block_tables[i])) for i in seqs],
                                  dtype=torch.int32, device=device)
        return cls(seqs, torch.tensor(tokens, device=device), torch.tensor(valid, device=device),
                   torch.tensor(packed, device=device), width,
                   None if slots is None else torch.tensor([slots[i] for i in seqs], device=device),
                   tables, max_context, mask[:, None, :, None, :], torch.tensor(sees, dtype=torch.int32, device=device))


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
    block_tables: torch.Tensor | None = None  # paged cache: [S, longest table] int32, padded with block 0
    verify: VerifyGroup | None = None  # the short multi-token chunks (speculative ones), cached steps only
    # paged cache: prefill chunk i's block table [1, W] and what each of its queries sees, visible [1, n] int32 (the
    # C kernel's arguments), built with the step so that every layer passes the same tensors; chunks of up to
    # MAX_VERIFY_TOKENS go through `verify` instead
    chunk_tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # prefill chunk i's attention form (`prefill_form`), decided at the step's first layer and kept for the others,
    # keyed by (i, backend, FLOP counting): every layer has the same shapes, and the tuner's lookup is Python a
    # layer cannot afford at 32 tokens
    chunk_forms: dict[tuple, str] = field(default_factory=dict)

    @property
    def has_cache(self) -> bool:
        return self.slot_mapping is not None

    @classmethod
    def decode_only(cls, positions: torch.Tensor, slot_mapping: torch.Tensor, group: DecodeGroup,
                    logits_indices: torch.Tensor | None = None) -> "AttentionMetadata":
        """Tensors only, for a compiled decode step: one new token per row at `positions` [S], its keys and
        values written at `slot_mapping` [S] (a contiguous cache's slot, at the token's position; a paged
        cache's pool row), attention as `group` says (`DecodeGroup.from_tensors`), logits of the rows
        `logits_indices` (None: every row, in order). The Python lists stay empty: `LlamaModel.forward` checks
        them, and its checks run before a compiled step, outside it."""
        return cls([], [], positions, None, slot_mapping, logits_indices, group, group.block_tables)

    @classmethod
    def build(cls, query_lens, context_lens=None, slots=None, device="cpu", last_only=False,
              block_tables: list[list[int]] | None = None, block_size: int | None = None):
        """`slots` for the contiguous cache, or `block_tables` (each covering its context) and `block_size`
        for the paged one; neither for a step without a cache."""
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
        slot_mapping = decode = tables = verify = None
        chunk_tables = {}
        if slots is not None:
            slot_mapping = torch.tensor([s for s, q in zip(slots, query_lens) for _ in range(q)], device=device)
            decode = DecodeGroup.build(query_lens, context_lens, slots, device)
        if block_tables is not None:
            if len(block_tables) != len(query_lens):
                raise ValueError("block_tables must have one table per sequence")
            slot_mapping = torch.tensor([s for t, q, c in zip(block_tables, query_lens, context_lens)
                                         for s in block_slot_mapping(t, c - q, c, block_size)],
                                        dtype=torch.int32, device=device)  # int32: the KV-store kernel's type
            decode = DecodeGroup.build_paged(query_lens, context_lens, block_tables, block_size, device)
            width = max(len(t) for t in block_tables)
            tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32,
                                  device=device)
            chunk_tables = {i: (tables[i:i + 1], torch.arange(c - q + 1, c + 1, dtype=torch.int32, device=device)[None])
                            for i, (q, c) in enumerate(zip(query_lens, context_lens)) if q > MAX_VERIFY_TOKENS}
        if slot_mapping is not None:
            verify = VerifyGroup.build(query_lens, context_lens, slots, block_tables, device)
        logits_indices = None
        if last_only:
            logits_indices = torch.tensor(list(itertools.accumulate(query_lens)), device=device) - 1
        return cls(list(query_lens), context_lens, positions, None if slots is None else list(slots),
                   slot_mapping, logits_indices, decode, tables, verify, chunk_tables)


def attention_in_fp32(kind: str, fn, q, k, v, tuner: Autotuner = TUNER) -> bool:
    """Whether bf16/fp16 attention `fn(q, k, v)` runs faster converted to fp32 on this CPU, measured once per
    shape bucket. It depends on the CPU and the shape: on an AVX-512 BF16 EPYC a single decode over 1,024
    positions ran 6x faster in fp32, a batch of 16 decodes 3x slower. fp32 softmax is at least as exact, so
    either answer keeps the results. kind names the call ("decode", "prefill", ...) sharing a decision."""
    if q.device.type != "cpu" or q.dtype == torch.float32:
        return False
    if torch.compiler.is_compiling() or counting_mode_active():
        return False  # a graph traced through here (not a decode step: see decode_attention) keeps the dtype
    key = (kind, str(q.dtype), row_bucket(q.shape[0]), q.shape[1], k.shape[1], row_bucket(q.shape[2], 1 << 20),
           row_bucket(k.shape[2], 1 << 20), q.shape[3])
    return tuner.choose("attention", key, lambda: {"native": lambda: fn(q, k, v),
                                                   "fp32": lambda: run_attention(True, fn, q, k, v)}) == "fp32"


def run_attention(fp32: bool, fn, q, k, v):
    """fn(q, k, v), in fp32 when asked; the result in q's dtype."""
    return fn(q.float(), k.float(), v.float()).to(q.dtype) if fp32 else fn(q, k, v)


def _sdpa(q, k, v, causal_offset: int | None, backend: str):
    """q [B,Hq,Nq,D], k/v [B,Hkv,Nk,D]. causal_offset: query i sees keys j <= i + offset (None: all keys)."""
    def fn(q, k, v):
        return _sdpa_math(q, k, v, causal_offset, backend)
    return run_attention(attention_in_fp32("sdpa" if causal_offset is None else "causal", fn, q, k, v), fn, q, k, v)


def _naive_attention(q, k, v, mask):
    """Materialise the full scores matrix (the O(N^2) memory FlashAttention removes, chapter 05) as two
    explicit products, whose FLOPs chapter 02 counts. mask: bool, True = attend, broadcast; None = all."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def _sdpa_math(q, k, v, causal_offset: int | None, backend: str):
    n_q, n_k = q.shape[2], k.shape[2]
    if backend == "naive":
        mask = None
        if causal_offset is not None:
            mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(causal_offset)
        return _naive_attention(q, k, v, mask)
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


def gather_blocks(pool: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` positions of each sequence, copied out of a paged pool [num_blocks, block_size,
    Hkv, D] through its block table (block_tables [S, >= ⌈length / block_size⌉]): [S, Hkv, length, D]."""
    width = -(-length // pool.shape[1])
    tables = block_tables[:, :width]
    rows = pool.index_select(0, tables.flatten())  # one copy of exactly the blocks read
    return rows.view(tables.shape[0], width * pool.shape[1], *pool.shape[2:])[:, :length].transpose(1, 2)


def _context(cache, meta: AttentionMetadata, i: int) -> torch.Tensor:
    """Sequence i's cached keys (or values), its whole context: [1, Hkv, context_len, D]."""
    ctx = meta.context_lens[i]
    if meta.block_tables is not None:
        return gather_blocks(cache, meta.block_tables[i:i + 1], ctx)
    slot = meta.slots[i]
    return cache[slot:slot + 1, :, :ctx]  # a view: no copy of the cache


def attention_with_cache(q, k_cache, v_cache, meta: AttentionMetadata, backend: str):
    """Attend packed queries q [T,Hq,D] to cached keys/values (already written): a contiguous cache's
    k_cache [slots,Hkv,max_len,D], or a paged pool's [num_blocks,block_size,Hkv,D] with the step's block
    tables. Single-token queries (decodes) go through `decode_attention` together; prefill chunks one by
    one, or in one FlashAttention launch on the triton backend."""
    if meta.decode is not None and meta.decode.is_whole_step:
        return decode_attention(q, k_cache, v_cache, meta.decode, backend)
    if meta.decode is None and meta.verify is None and len(meta.query_lens) == 1 and meta.query_lens[0] > 1 \
            and backend != "triton":  # one prefill chunk alone: its output is the step's, no copy into `out`
        return prefill_chunk_attention(q, k_cache, v_cache, meta, 0, backend)
    out = torch.empty_like(q)
    if meta.decode is not None:
        out[meta.decode.tokens] = decode_attention(q, k_cache, v_cache, meta.decode, backend)
    starts = [0, *itertools.accumulate(meta.query_lens)]
    chunks = [i for i, n in enumerate(meta.query_lens) if n > 1]
    if meta.verify is not None and backend != "triton":  # the triton backend attends them with the prefills
        out[meta.verify.packed] = verify_attention(q, k_cache, v_cache, meta.verify, backend)
        chunks = [i for i in chunks if i not in meta.verify.seqs]
    if backend == "triton" and chunks:
        # All prefill chunks in one kernel launch, each attending to its whole cached context.
        q_lens = [meta.query_lens[i] for i in chunks]
        k_lens = [meta.context_lens[i] for i in chunks]
        ks = torch.cat([_context(k_cache, meta, i)[0].transpose(0, 1) for i in chunks])
        vs = torch.cat([_context(v_cache, meta, i)[0].transpose(0, 1) for i in chunks])
        qs = torch.cat([q[starts[i]:starts[i + 1]] for i in chunks])
        for i, part in zip(chunks, _flash_varlen(qs, ks, vs, q_lens, k_lens).split(q_lens)):
            out[starts[i]:starts[i + 1]] = part
        return out
    for i in chunks:
        out[starts[i]:starts[i + 1]] = prefill_chunk_attention(q[starts[i]:starts[i + 1]], k_cache, v_cache, meta,
                                                               i, backend)
    return out


def prefill_chunk_attention(q, k_cache, v_cache, meta: AttentionMetadata, i: int, backend: str,
                            form: str | None = None):
    """Sequence i's prefill chunk q [n,Hq,D] against its whole cached context (the chunk's own keys written):
    [n,Hq,D]. On a paged cache on a CPU, the C kernel that reads the pool in place (`cpu_kernels.paged_chunk`)
    competes with a copy of the context + SDPA (`prefill_form`); `form` forces one of the two."""
    n, ctx = meta.query_lens[i], meta.context_lens[i]
    if i in meta.chunk_tables and form is None:
        key = (i, backend, counting_mode_active())
        form = meta.chunk_forms.get(key)
        if form is None:
            form = meta.chunk_forms[key] = prefill_form(q, k_cache, v_cache, meta, i, backend)
    if i in meta.chunk_tables and form == IN_PLACE:
        tables, visible = meta.chunk_tables[i]
        return paged_chunk(q.unsqueeze(0), k_cache, v_cache, tables, visible)[0]
    qs = q.transpose(0, 1).unsqueeze(0)  # [1,Hq,n,D]
    ks, vs = _context(k_cache, meta, i), _context(v_cache, meta, i)
    return _sdpa(qs, ks, vs, ctx - n, backend)[0].transpose(0, 1)


def prefill_form(q, k_cache, v_cache, meta: AttentionMetadata, i: int, backend: str,
                 tuner: Autotuner = TUNER) -> str:
    """"copy" or IN_PLACE for sequence i's prefill chunk, timed per (dtype, chunk length, context) bucket on a
    paged cache on a CPU; "copy" anywhere else. On a 2-core AMD EPYC (Zen 5), one layer of SmolLM2 over the 30
    layers' pools: a 32-token chunk after 1,024 cached positions 0.32 ms in place against 0.77 ms copied; a
    512-token chunk over 1,024 positions 3.2 against 7.0 ms. On a Zen 3 EPYC (AVX2 only): 0.95 against 1.34
    ms, and 10.3 against 15.4 ms (`bench --workload prefix` prints both)."""
    key = (row_bucket(q.shape[0], 1 << 20), row_bucket(meta.context_lens[i], 1 << 20))
    return _copy_or_in_place("paged_prefill", key, q, k_cache, v_cache, backend, tuner,
                             lambda form: prefill_chunk_attention(q, k_cache, v_cache, meta, i, backend, form))


def _copy_or_in_place(op: str, key: tuple, q, k_cache, v_cache, backend: str, tuner: Autotuner, run) -> str:
    """"copy" or IN_PLACE for a chunk op on a paged cache, timed by `tuner` per (dtype, *key, pool shape) with
    `run(form)` running each form; "copy" wherever the C kernel cannot run (not the torch backend, not a CPU,
    not fp32, no compiler) or FLOPs are being counted."""
    if (backend != "torch" or q.device.type != "cpu" or counting_mode_active()
            or not paged_decode_supported(q, k_cache, v_cache)):
        return "copy"
    return tuner.choose(op, (str(q.dtype), *key, k_cache.shape[1:]),
                        lambda: {form: (lambda form=form: run(form)) for form in ("copy", IN_PLACE)})


def decode_attention(q, k_cache, v_cache, group: DecodeGroup, backend: str = "torch"):
    """One query token per sequence against its cached keys/values, all sequences in one call: SDPA, or on
    the naive backend the two explicit products (whose FLOPs chapter 02 counts). Positions past a sequence's
    own context are masked out. On the triton backend a paged cache is read in place by the paged decode
    kernel, which follows the block tables itself; a contiguous cache goes through SDPA (a decode's scores
    are one row per head, not the N x N matrix FlashAttention avoids). On a CPU, C kernels read either cache
    in place where they measure faster (`paged_decode_form`, `contiguous_decode_form`).

    In a graph being compiled for a CPU this code runs as it is, eagerly, through the operator
    `mini_engine::decode_attention` (see `_decode_attention_op`), or, on the contiguous cache where the C kernel
    wins, through the C++ operator `mini_engine_cpp::contiguous_decode` (no Python per layer:
    `_graph_reads_in_place`)."""
    if q.device.type == "cpu" and torch.compiler.is_compiling():
        if group.block_tables is None and _graph_reads_in_place(q.shape[0], q.shape[1], k_cache.shape[1],
                                                                 q.shape[2], str(q.dtype), backend):
            return torch.ops.mini_engine_cpp.contiguous_decode(q, k_cache, v_cache, group.slot_ids, group.context_lens)
        return torch.ops.mini_engine.decode_attention(q, k_cache, v_cache, group.mask, group.context_lens,
                                                      group.slots, group.block_tables, backend)
    if backend == "triton" and group.block_tables is not None:
        from .kernels import paged_decode_attention  # imported here: only this backend needs triton
        return paged_decode_attention(q[group.tokens], k_cache, v_cache, group.block_tables, group.context_lens)
    qs = q[group.tokens]  # [S,Hq,D]
    if group.block_tables is not None:
        return paged_decode_torch(qs, k_cache, v_cache, group, backend)
    if group.form(backend, lambda: contiguous_decode_form(qs, k_cache, v_cache, group, backend)) == IN_PLACE:
        return contiguous_decode(qs, k_cache, v_cache, group.slot_ids, group.context_lens)
    return _contiguous_sdpa(qs, k_cache, v_cache, group, backend)


def _contiguous_sdpa(qs, k_cache, v_cache, group: DecodeGroup, backend: str):
    """Decode attention on the contiguous cache: the slots' keys and values sliced out (a view when the slots
    are adjacent), then SDPA."""
    k = k_cache[group.slots, :, :group.max_context]  # [slots read,Hkv,L,D]
    v = v_cache[group.slots, :, :group.max_context]
    if group.rows is not None:  # place each query at its slot's row; the other rows compute unused results
        qs = qs.new_zeros(k.shape[0], *qs.shape[1:]).index_copy_(0, group.rows, qs)
    o = _decode_sdpa(qs.unsqueeze(2), k, v, group.mask, backend)
    return o if group.rows is None else o[group.rows]


def contiguous_decode_form(qs, k_cache, v_cache, group: DecodeGroup, backend: str, tuner: Autotuner = TUNER) -> str:
    """"sdpa" or IN_PLACE (the C kernel reading the contiguous cache in place, `cpu_kernels.contiguous_decode`),
    timed per (dtype, sequences, context) bucket on a CPU; "sdpa" anywhere else, on the naive backend (chapter
    02 counts its explicit products) and under FLOP counters. On a 2-core AMD EPYC (Zen 3), one layer of
    SmolLM2, one sequence of 100 positions: about 25 us in place against 30-60 us for SDPA; 16 sequences, 96
    against 160-250 us."""
    if (backend != "torch" or qs.device.type != "cpu" or counting_mode_active() or group.slot_ids is None
            or not contiguous_decode_supported(qs, k_cache, v_cache)):
        return "sdpa"
    key = (str(qs.dtype), row_bucket(qs.shape[0]), row_bucket(group.max_context, 1 << 20), k_cache.shape[1:])
    return tuner.choose("contiguous_decode", key, lambda: {
        "sdpa": lambda: _contiguous_sdpa(qs, k_cache, v_cache, group, backend),
        IN_PLACE: lambda: contiguous_decode(qs, k_cache, v_cache, group.slot_ids, group.context_lens)})


# A compiled step on the contiguous cache serves every cache length, so `_graph_reads_in_place` times the two
# forms at one length: the middle of the lengths it was measured at (48-256 positions on a Zen 3 EPYC, where the
# C kernel won at each by 1.4-1.7x).
GRAPH_CONTEXT = 128


@torch._dynamo.assume_constant_result
def _graph_reads_in_place(rows: int, heads: int, kv_heads: int, head_dim: int, dtype: str, backend: str) -> bool:
    """Run (not traced) while a decode step on the contiguous cache is compiled for a CPU: whether the graph
    attends through the C++ operator that reads the cache in place, rather than the Python operator, which
    picks its form per call. True where the operator is built and the C kernel beats SDPA here
    (`contiguous_decode_form`, timed on `rows` sequences of GRAPH_CONTEXT positions)."""
    if dtype != str(torch.float32) or backend != "torch" or not load_torch_ops():
        return False
    q = torch.randn(rows, heads, head_dim)
    k_cache, v_cache = torch.randn(2, rows, kv_heads, GRAPH_CONTEXT, head_dim).unbind(0)
    group = DecodeGroup.build([1] * rows, [GRAPH_CONTEXT] * rows, list(range(rows)), q.device)
    return contiguous_decode_form(q, k_cache, v_cache, group, backend) == IN_PLACE


def verify_attention(q, k_cache, v_cache, group: VerifyGroup, backend: str = "torch", form: str | None = None):
    """The short chunks of `group`, padded to Q query rows each, in one call: [n real rows, Hq, D], in the
    order of `group.packed`. As in `_decode_sdpa`, the query heads sharing a KV head become that head's rows
    (here Q x Hq/Hkv of them), so SDPA reads each KV head once. On a paged cache on a CPU, the C kernel that
    reads the pool in place (`cpu_kernels.paged_chunk`) competes with the copy + SDPA (`verify_form`); `form`
    forces one of the two."""
    s, n_q = len(group.seqs), group.query_len
    if group.block_tables is not None and (form or verify_form(q, k_cache, v_cache, group, backend)) == IN_PLACE:
        qs = q[group.tokens].view(s, n_q, *q.shape[1:])
        out = paged_chunk(qs, k_cache, v_cache, group.block_tables, group.visible)
        return out.view(s * n_q, *q.shape[1:])[group.valid]
    if group.block_tables is not None:
        k = gather_blocks(k_cache, group.block_tables, group.max_context)  # [S,Hkv,L,D]
        v = gather_blocks(v_cache, group.block_tables, group.max_context)
    else:
        k = k_cache[group.slots, :, :group.max_context]
        v = v_cache[group.slots, :, :group.max_context]
    (hq, d), hkv = q.shape[1:], k.shape[1]
    g = hq // hkv
    qs = q[group.tokens].view(s, n_q, hkv, g, d).transpose(1, 2).reshape(s, hkv, n_q * g, d)
    mask = group.mask.expand(s, 1, n_q, g, group.max_context).reshape(s, 1, n_q * g, group.max_context)

    def fn(q, k, v):
        if backend == "naive":
            return _naive_attention(q, k, v, mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    o = run_attention(attention_in_fp32("verify", fn, qs, k, v), fn, qs, k, v)  # [S,Hkv,Q*g,D]
    o = o.view(s, hkv, n_q, g, d).transpose(1, 2).reshape(s * n_q, hq, d)
    return o[group.valid]


def verify_form(q, k_cache, v_cache, group: VerifyGroup, backend: str, tuner: Autotuner = TUNER) -> str:
    """"copy" (the sequences' blocks copied out of the pool, then SDPA) or IN_PLACE (the C kernel), timed per
    (dtype, chunks, chunk length, context) bucket on a paged cache on a CPU; "copy" anywhere else."""
    key = (row_bucket(len(group.seqs)), group.query_len, row_bucket(group.max_context, 1 << 20))
    return _copy_or_in_place("paged_verify", key, q, k_cache, v_cache, backend, tuner,
                             lambda form: verify_attention(q, k_cache, v_cache, group, backend, form))


def _decode_sdpa(q, k, v, mask, backend: str):
    """q [S,Hq,1,D] against k/v [S,Hkv,L,D], positions where `mask` is False left out: [S,Hq,D].
    A decode has one query per head, so the Hq/Hkv query heads that share a KV head are passed to SDPA as that
    head's query rows, [S,Hkv,Hq/Hkv,D]: every row may see every position (no causal mask within a decode), and
    SDPA reads each KV head once instead of expanding keys and values for GQA (about 20% faster on a CPU)."""
    s, hq, _, d = q.shape
    q = q.view(s, k.shape[1], hq // k.shape[1], d)

    def fn(q, k, v):
        if backend == "naive":
            return _naive_attention(q, k, v, mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return run_attention(attention_in_fp32("decode", fn, q, k, v), fn, q, k, v).reshape(s, hq, d)


def paged_decode_torch(qs, k_cache, v_cache, group: DecodeGroup, backend: str = "torch", chunk: int | None = None):
    """Decode attention through block tables on a CPU, in the form measured fastest here (`paged_decode_form`):
    the C kernel that reads the pool in place (`cpu_kernels.paged_decode`), or a copy of the sequences' blocks
    out of the pool (`gather_blocks`) with SDPA on the copy. The copy is written once and read once more, so a
    long context costs a second pass over its keys and values. Done for a few sequences at a time, the copy is
    still in the CPU's cache when SDPA reads it, and that second pass comes almost free. `chunk` forces the copy
    with that many sequences per copy.
    With `group.lens`, each copy reads only its own longest context: with rows sorted by length, on a batch of
    mixed lengths, far fewer positions than the batch's longest for every row."""
    n = qs.shape[0]
    if chunk is None:
        form = group.form(backend, lambda: paged_decode_form(qs, k_cache, v_cache, group, backend))
        if form == IN_PLACE:
            return paged_decode(qs, k_cache, v_cache, group.block_tables, group.context_lens)
        chunk = int(form.split()[0])
    outs = []
    for a in range(0, n, chunk):
        rows = slice(a, a + chunk)
        length, mask = group.max_context, None if group.mask is None else group.mask[rows]
        if group.lens is not None:
            part = group.lens[rows]
            length = max(part)
            mask = None if min(part) == length else mask[..., :length]
        k = gather_blocks(k_cache, group.block_tables[rows], length)  # [chunk,Hkv,L,D]
        v = gather_blocks(v_cache, group.block_tables[rows], length)
        outs.append(_decode_sdpa(qs[rows].unsqueeze(2), k, v, mask, backend))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def paged_decode_form(qs, k_cache, v_cache, group: DecodeGroup, backend: str, tuner: Autotuner = TUNER) -> str:
    """How `paged_decode_torch` attends, timed per (dtype, sequences, context) bucket: the C kernel reading the
    pool in place (fp32, where it builds), or the copy with all sequences at once (the plain form) or 8, 4, 2 or
    1 at a time. On a 2-core AMD EPYC (Zen 5, 32 MiB L3), one layer of 16 sequences of 1,024 positions: the
    kernel 0.75 ms, the copy 1.7-1.9 ms (best 2 or 4 at a time), the contiguous cache's SDPA 1.1 ms; of 128
    positions: 0.08, 0.24-0.6 and 0.17 ms. The naive backend keeps its explicit products (chapter 02 counts
    their FLOPs), and so do FLOP counters."""
    n = qs.shape[0]
    if qs.device.type != "cpu" or counting_mode_active():
        return f"{n} at a time"
    kernel = backend == "torch" and group.context_lens is not None and paged_decode_supported(qs, k_cache, v_cache)
    if n == 1 and not kernel:
        return "1 at a time"
    sizes = [n] + [c for c in (8, 4, 2, 1) if c < n]
    key = (str(qs.dtype), row_bucket(n), row_bucket(group.max_context, 1 << 20), k_cache.shape[1:])
    key += () if group.lens is None else ("own lengths",)
    key += ("kernel",) if kernel else ()

    def candidates():
        forms = {f"{c} at a time": (lambda c=c: paged_decode_torch(qs, k_cache, v_cache, group, backend, c))
                 for c in sizes}
        if kernel:
            forms[IN_PLACE] = lambda: paged_decode(qs, k_cache, v_cache, group.block_tables, group.context_lens)
        return forms
    return tuner.choose("paged_decode", key, candidates)


# ---------------------------------------------------------------- decode attention inside a compiled graph

def _decode_attention_op(q, k_cache, v_cache, mask, context_lens, slots, block_tables, backend: str):
    """What `mini_engine::decode_attention` runs: `decode_attention` itself, eagerly, on a DecodeGroup rebuilt
    from the graph's tensors. A compiled decode step on a CPU attends this way because, measured on a 2-core
    EPYC for 16 sequences of 30-487 positions (one layer, one thread), the eager forms beat what Inductor makes
    of the same code: its gather loop plus one SDPA over every row took 1.35 ms, the eager block copy with SDPA
    a few sequences at a time 0.99 ms, and that copy over rows sorted by length, each group reading only its own
    longest context (`DecodeGroup.lens`, what a compiled step's rows are), 0.60 ms.
    mask [S,1,1,L] (True within each row's context), context_lens [S]; the contiguous cache's slots [S] or the
    paged cache's block_tables [S, W]."""
    lens = context_lens.tolist()
    if block_tables is None:
        group = _contiguous_group(slots, context_lens, lens, q.device)
    else:
        group = DecodeGroup(slice(None), None, None, max(lens), mask, block_tables, context_lens, lens)
    return decode_attention(q, k_cache, v_cache, group, backend)


_LAST_GROUP: list = [None, None, None]  # (slots, context_lens, DecodeGroup) of the last call: its 29 other layers


def _contiguous_group(slots, context_lens, lens, device) -> DecodeGroup:
    """The eager steps' DecodeGroup for these slots (a view of the cache when the slots are adjacent), built once
    per step: every layer of a graph passes the same two input tensors, held here so that identity means the same
    values."""
    if _LAST_GROUP[0] is not slots or _LAST_GROUP[1] is not context_lens:
        _LAST_GROUP[:] = slots, context_lens, DecodeGroup.build([1] * len(lens), lens, slots.tolist(), device)
    return _LAST_GROUP[2]


def _register_decode_op():
    """`torch.ops.mini_engine.decode_attention`: opaque to the compiler, which only needs the output's shape."""
    try:
        lib = torch.library.Library("mini_engine", "FRAGMENT")
        lib.define("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor mask, Tensor context_lens, "
                   "Tensor? slots, Tensor? block_tables, str backend) -> Tensor")
        lib.impl("decode_attention", _decode_attention_op, "CPU")
        torch.library.register_fake("mini_engine::decode_attention", lib=lib)(
            lambda q, k_cache, v_cache, mask, context_lens, slots, block_tables, backend: torch.empty_like(q))
    except (RuntimeError, AttributeError):  # defined twice (a reloaded module)
        return None
    return lib


_DECODE_OP = _register_decode_op()
