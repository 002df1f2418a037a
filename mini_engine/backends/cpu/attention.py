"""The CPU backend's attention: the core's `TorchAttention` with faster forms where they measure faster here.

- The C kernels read a cache in place (`cpu_kernels.paged_decode`, `paged_chunk`, `contiguous_decode`), where the
  core copies a paged sequence's blocks out of the pool before SDPA reads them a second time.
- A paged decode may instead copy a few sequences at a time, so that each copy is still in the CPU's cache when
  SDPA reads it.
- bf16/fp16 attention may run faster converted to fp32 on a CPU without bf16 arithmetic.
- A speculative step's short chunks are attended together (`VerifyGroup`), not one call per sequence.
- The paged cache's write is one fused operator (`layer_ops.store_rows`).
Which form wins depends on the CPU, the shape and the dtype, so each is timed on first use by the tuner
(`autotune`) and the choice kept; FLOP counters and anything that is not fp32 on a CPU get the core's forms.
Each step decides its forms once, at its first layer, and keeps them in `meta.extras` for the other layers.

Inside a graph being compiled (`LLM(compile=True)`), the decode attention runs eagerly through the operator
`mini_engine::decode_attention`: measured on a 2-core EPYC for 16 sequences of 30-487 positions, the eager forms
beat what Inductor made of the traced gather-and-SDPA (0.60-0.99 ms a layer against 1.35 ms). On the contiguous
cache, where the C kernel wins, the graph calls the C++ operator `mini_engine_cpp::contiguous_decode` directly.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ...attention import AttentionMetadata, DecodeGroup, TorchAttention, gather_blocks
from .autotune import TUNER, Autotuner, counting_mode_active, row_bucket
from .cpu_kernels import (contiguous_decode, contiguous_decode_supported, load_torch_ops, paged_chunk, paged_decode,
                          paged_decode_supported)
from .layer_ops import store_rows

IN_PLACE = "in place (C)"  # the form that reads a cache through the C kernels


# Chunks of up to this many tokens over a cached context are attended together, like decodes (`VerifyGroup`): a
# speculative chunk is a request's last token and its k drafts. Longer chunks are prefills, attended one by one.
MAX_VERIFY_TOKENS = 16


@dataclass
class VerifyGroup:
    """The step's short multi-token chunks (2 to MAX_VERIFY_TOKENS tokens): on a speculative step, each decoding
    request's last token and its drafts. Attended one by one, as the core attends prefill chunks, they cost one
    call and one copy of the context per sequence and per layer, which on a CPU cost a speculative step at batch
    16 more than its decodes. Padded to the longest chunk (Q tokens), they go through one call as decodes do,
    each query row masked to the positions before it."""
    seqs: list[int]                # the chunks' places in the step
    tokens: torch.Tensor           # [S*Q] packed row of each padded query (padding repeats the chunk's last row)
    valid: torch.Tensor            # [n] where the step's real query rows sit among the S*Q padded ones
    packed: torch.Tensor           # [n] their rows in the packed step, in the same order
    query_len: int                 # Q
    slots: torch.Tensor | None     # contiguous cache: [S] the sequences' slots
    block_tables: torch.Tensor | None  # paged cache: [S, W] int32, the step's padded tables
    max_context: int               # key positions read per sequence
    mask: torch.Tensor             # [S,1,Q,1,max_context] True where query row j of sequence s may look
    visible: torch.Tensor          # [S, Q] int32: how many positions query row j sees (the C kernel's mask)

    @classmethod
    def build(cls, meta: AttentionMetadata, device) -> "VerifyGroup | None":
        query_lens, context_lens = meta.query_lens, meta.context_lens
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
        index = torch.tensor(seqs, device=device)
        return cls(seqs, torch.tensor(tokens, device=device), torch.tensor(valid, device=device),
                   torch.tensor(packed, device=device), width,
                   None if meta.slots is None else torch.tensor([meta.slots[i] for i in seqs], device=device),
                   None if meta.block_tables is None else meta.block_tables[index], max_context,
                   mask[:, None, :, None, :], torch.tensor(sees, dtype=torch.int32, device=device))


def attention_in_fp32(kind: str, fn, q, k, v, tuner: Autotuner = TUNER) -> bool:
    """Whether bf16/fp16 attention `fn(q, k, v)` runs faster converted to fp32 on this CPU, measured once per
    shape bucket (on an AVX-512 BF16 EPYC a single decode over 1,024 positions ran 6x faster in fp32, a batch of
    16 decodes 3x slower). fp32 softmax is at least as exact, so either answer keeps the results."""
    if q.device.type != "cpu" or q.dtype == torch.float32 or torch.compiler.is_compiling() or counting_mode_active():
        return False
    key = (kind, str(q.dtype), row_bucket(q.shape[0]), q.shape[1], k.shape[1], row_bucket(q.shape[2], 1 << 20),
           row_bucket(k.shape[2], 1 << 20), q.shape[3])
    return tuner.choose("attention", key, lambda: {"native": lambda: fn(q, k, v),
                                                   "fp32": lambda: run_attention(True, fn, q, k, v)}) == "fp32"


def run_attention(fp32: bool, fn, q, k, v):
    """fn(q, k, v), in fp32 when asked; the result in q's dtype."""
    return fn(q.float(), k.float(), v.float()).to(q.dtype) if fp32 else fn(q, k, v)


def _memo(meta: AttentionMetadata, key, decide):
    """meta.extras[key], decided at the step's first layer (`decide()`) and kept for the others."""
    key = (key, counting_mode_active())
    if key not in meta.extras:
        meta.extras[key] = decide()
    return meta.extras[key]


def _step_tensors(meta: AttentionMetadata, key, build):
    """`_memo` for the tensors a step's C kernel calls share, built outside inference mode: a tensor made inside
    it keeps no version counter, so the kernels' input checks (`cpu_kernels._check_tables`), which remember a
    checked tensor by identity and version, checked it again at every layer (30 checks a step, each a few small
    ops and host reads: 4% of the n-gram rung's time)."""
    with torch.inference_mode(False):
        return _memo(meta, key, build)


class CpuAttention(TorchAttention):
    def __init__(self, tuner: Autotuner = TUNER):
        super().__init__()
        self.tuner = tuner

    def store(self, kv_cache, layer: int, k, v, meta: AttentionMetadata) -> None:
        if meta.block_tables is None or torch.compiler.is_compiling():
            return super().store(kv_cache, layer, k, v, meta)
        k_pool, v_pool = kv_cache.layer(layer)  # one row per slot: block * block_size + offset
        store_rows(k, v, k_pool.view(-1, *k_pool.shape[2:]), v_pool.view(-1, *v_pool.shape[2:]), meta.slot_mapping)

    def attend(self, q, k, v, mask=None, is_causal: bool = False):
        def fn(q, k, v):
            return TorchAttention.attend(self, q, k, v, mask, is_causal)
        return run_attention(attention_in_fp32("causal" if is_causal else "attend", fn, q, k, v, self.tuner),
                             fn, q, k, v)

    # ------------------------------------------------------------------ decodes

    def decode(self, q, k_cache, v_cache, group: DecodeGroup, meta: AttentionMetadata):
        if torch.compiler.is_compiling():
            return self._decode_in_graph(q, k_cache, v_cache, group)
        return self.decode_eagerly(q, k_cache, v_cache, group, meta)

    def decode_eagerly(self, q, k_cache, v_cache, group: DecodeGroup, meta: AttentionMetadata):
        """`decode` outside a graph; also what `mini_engine::decode_attention` runs, which is timed while a
        graph is being traced (`_graph_reads_in_place`), where `decode` would take the graph's branch again."""
        qs = q[group.tokens]
        if group.block_tables is not None:
            form = _memo(meta, "paged decode", lambda: self.paged_decode_form(qs, k_cache, v_cache, group))
            return self.paged_decode(qs, k_cache, v_cache, group, form)
        inputs = _step_tensors(meta, "contiguous decode inputs", lambda: _contiguous_inputs(meta))
        form = _memo(meta, "contiguous decode", lambda: self.contiguous_decode_form(q, k_cache, v_cache, group,
                                                                                     meta, inputs))
        if form == IN_PLACE:
            return contiguous_decode(qs, k_cache, v_cache, *inputs)
        return super().decode(q, k_cache, v_cache, group, meta)

    def contiguous_decode_form(self, q, k_cache, v_cache, group, meta, inputs) -> str:
        """"sdpa" or IN_PLACE, timed per (dtype, sequences, context) bucket; "sdpa" under FLOP counters."""
        qs = q[group.tokens]
        if counting_mode_active() or not contiguous_decode_supported(qs, k_cache, v_cache):
            return "sdpa"
        key = (str(qs.dtype), row_bucket(qs.shape[0]), row_bucket(group.max_context, 1 << 20), k_cache.shape[1:])
        sdpa = TorchAttention.decode
        return self.tuner.choose("contiguous_decode", key, lambda: {
            "sdpa": lambda: sdpa(self, q, k_cache, v_cache, group, meta),
            IN_PLACE: lambda: contiguous_decode(qs, k_cache, v_cache, *inputs)})

    def paged_decode(self, qs, k_cache, v_cache, group: DecodeGroup, form: str, lens: list[int] | None = None):
        """Decode attention through block tables: the C kernel in place, or the sequences' blocks copied out of
        the pool `form` = "c at a time" sequences per copy, SDPA on each copy. With `lens` (each row's context,
        rows sorted longest first) each copy reads only its own longest context."""
        if form == IN_PLACE:
            return paged_decode(qs, k_cache, v_cache, group.block_tables, group.context_lens)
        chunk, outs = int(form.split()[0]), []
        for a in range(0, qs.shape[0], chunk):
            rows = slice(a, a + chunk)
            length, mask = group.max_context, None if group.mask is None else group.mask[rows]
            if lens is not None:
                part = lens[rows]
                length = max(part)
                mask = None if min(part) == length else mask[..., :length]
            k = gather_blocks(k_cache, group.block_tables[rows], length)  # [chunk,Hkv,L,D]
            v = gather_blocks(v_cache, group.block_tables[rows], length)
            s, hq, d = qs[rows].shape
            outs.append(self.attend(qs[rows].view(s, k.shape[1], hq // k.shape[1], d), k, v, mask).reshape(s, hq, d))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def paged_decode_form(self, qs, k_cache, v_cache, group: DecodeGroup, lens: list[int] | None = None) -> str:
        """The C kernel in place (fp32, where it builds) or the copy with all sequences at once (the core's
        form) or 8, 4, 2 or 1 at a time, timed per (dtype, sequences, context) bucket. On a 2-core AMD EPYC
        (Zen 5), one layer of 16 sequences of 1,024 positions: the kernel 0.75 ms, the copy 1.7-1.9 ms."""
        n = qs.shape[0]
        if counting_mode_active():
            return f"{n} at a time"
        kernel = group.context_lens is not None and paged_decode_supported(qs, k_cache, v_cache)
        if n == 1 and not kernel:
            return "1 at a time"
        sizes = [n] + [c for c in (8, 4, 2, 1) if c < n]
        key = (str(qs.dtype), row_bucket(n), row_bucket(group.max_context, 1 << 20), k_cache.shape[1:])
        key += () if lens is None else ("own lengths",)
        key += ("kernel",) if kernel else ()

        def candidates():
            forms = {f"{c} at a time": (lambda c=c: self.paged_decode(qs, k_cache, v_cache, group, f"{c} at a time",
                                                                      lens)) for c in sizes}
            if kernel:
                forms[IN_PLACE] = lambda: self.paged_decode(qs, k_cache, v_cache, group, IN_PLACE)
            return forms
        return self.tuner.choose("paged_decode", key, candidates)

    def _decode_in_graph(self, q, k_cache, v_cache, group: DecodeGroup):
        if group.block_tables is None and _graph_reads_in_place(q.shape[0], q.shape[1], k_cache.shape[1],
                                                                 q.shape[2], str(q.dtype)):
            return torch.ops.mini_engine_cpp.contiguous_decode(q, k_cache, v_cache, group.slots.to(torch.int32),
                                                               group.context_lens)
        return torch.ops.mini_engine.decode_attention(q, k_cache, v_cache, group.mask, group.context_lens,
                                                      group.slots, group.block_tables)

    # ------------------------------------------------------------------ chunks on the paged cache

    def chunks(self, q, k_cache, v_cache, meta: AttentionMetadata, chunks: list[int], out) -> None:
        group = _step_tensors(meta, "verify group", lambda: VerifyGroup.build(meta, q.device))
        if group is not None:
            out[group.packed] = self.verify(q, k_cache, v_cache, group, meta)
            chunks = [i for i in chunks if i not in group.seqs]
        super().chunks(q, k_cache, v_cache, meta, chunks, out)

    def verify(self, q, k_cache, v_cache, group: VerifyGroup, meta: AttentionMetadata, form: str | None = None):
        """The short chunks, padded to Q query rows each, in one call: [n real rows, Hq, D] in the order of
        `group.packed`: on a paged cache the C kernel in place or the copy, timed; else the copy."""
        s, n_q = len(group.seqs), group.query_len
        if group.block_tables is not None and form is None:
            key = (row_bucket(s), n_q, row_bucket(group.max_context, 1 << 20))
            form = _memo(meta, "verify", lambda: self._copy_or_in_place(
                "paged_verify", key, q, k_cache, v_cache, lambda f: self.verify(q, k_cache, v_cache, group, meta, f)))
        if form == IN_PLACE:
            out = paged_chunk(q[group.tokens].view(s, n_q, *q.shape[1:]), k_cache, v_cache, group.block_tables,
                              group.visible)
            return out.view(s * n_q, *q.shape[1:])[group.valid]
        if group.block_tables is not None:
            k = gather_blocks(k_cache, group.block_tables, group.max_context)  # [S,Hkv,L,D]
            v = gather_blocks(v_cache, group.block_tables, group.max_context)
        else:
            k = k_cache[group.slots, :, :group.max_context]
            v = v_cache[group.slots, :, :group.max_context]
        (hq, d), hkv = q.shape[1:], k.shape[1]
        g = hq // hkv  # as in `decode`, the query heads sharing a KV head become that head's Q x g rows
        qs = q[group.tokens].view(s, n_q, hkv, g, d).transpose(1, 2).reshape(s, hkv, n_q * g, d)
        mask = group.mask.expand(s, 1, n_q, g, group.max_context).reshape(s, 1, n_q * g, group.max_context)
        o = self.attend(qs, k, v, mask)  # [S,Hkv,Q*g,D]
        return o.view(s, hkv, n_q, g, d).transpose(1, 2).reshape(s * n_q, hq, d)[group.valid]

    def prefill_chunk(self, q, k_cache, v_cache, meta: AttentionMetadata, i: int, form: str | None = None):
        if meta.block_tables is None:
            return super().prefill_chunk(q, k_cache, v_cache, meta, i)
        if form is None:
            key = (row_bucket(q.shape[0], 1 << 20), row_bucket(meta.context_lens[i], 1 << 20))
            form = _memo(meta, ("prefill", i), lambda: self._copy_or_in_place(
                "paged_prefill", key, q, k_cache, v_cache, lambda f: self.prefill_chunk(q, k_cache, v_cache, meta, i, f)))
        if form != IN_PLACE:
            return super().prefill_chunk(q, k_cache, v_cache, meta, i)
        n, ctx = meta.query_lens[i], meta.context_lens[i]  # query j sees ctx - n + 1 + j positions: once a step
        table, visible = _step_tensors(meta, ("chunk", i), lambda: (
            meta.block_tables[i:i + 1], torch.arange(ctx - n + 1, ctx + 1, dtype=torch.int32)[None]))
        return paged_chunk(q.unsqueeze(0), k_cache, v_cache, table, visible)[0]

    def _copy_or_in_place(self, op: str, key: tuple, q, k_cache, v_cache, run) -> str:
        """"copy" (the core's form) or IN_PLACE, timed per (dtype, *key, pool shape) with `run(form)`; "copy"
        wherever the C kernel cannot run or FLOPs are being counted."""
        if counting_mode_active() or not paged_decode_supported(q, k_cache, v_cache):
            return "copy"
        return self.tuner.choose(op, (str(q.dtype), *key, k_cache.shape[1:]),
                                 lambda: {form: (lambda form=form: run(form)) for form in ("copy", IN_PLACE)})


def _contiguous_inputs(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The contiguous-cache C kernel's arguments for the step's decodes: their slots and context lengths, int32."""
    decodes = [i for i, n in enumerate(meta.query_lens) if n == 1]
    return (torch.tensor([meta.slots[i] for i in decodes], dtype=torch.int32),
            torch.tensor([meta.context_lens[i] for i in decodes], dtype=torch.int32))


# A compiled step on the contiguous cache serves every cache length, so `_graph_reads_in_place` times the two
# operators at one length, a middle one of the lengths the chapters decode at.
GRAPH_CONTEXT = 128


@torch._dynamo.assume_constant_result
def _graph_reads_in_place(rows: int, heads: int, kv_heads: int, head_dim: int, dtype: str) -> bool:
    """Run (not traced) while a decode step on the contiguous cache is compiled: whether the graph attends
    through the C++ operator that reads the cache in place, or through `mini_engine::decode_attention`. The two
    operators themselves are timed, on `rows` sequences of GRAPH_CONTEXT positions: the second pays for
    Python on every layer (the step's metadata, the form's lookup) besides its attention, so timing only the
    eager attention forms, which often tie within noise, picked it where it ran each layer 4x slower."""
    if dtype != str(torch.float32) or not load_torch_ops():
        return False
    register_decode_op()
    q = torch.randn(rows, heads, head_dim)
    k_cache, v_cache = torch.randn(2, rows, kv_heads, GRAPH_CONTEXT, head_dim).unbind(0)
    slots = torch.arange(rows)
    group = DecodeGroup.from_tensors(torch.full((rows,), GRAPH_CONTEXT), GRAPH_CONTEXT, slots)
    slots32 = slots.to(torch.int32)
    key = (dtype, row_bucket(rows), heads, k_cache.shape[1:])
    return TUNER.choose("graph_contiguous_decode", key, lambda: {
        "operator": lambda: torch.ops.mini_engine.decode_attention(q, k_cache, v_cache, group.mask,
                                                                   group.context_lens, slots, None),
        IN_PLACE: lambda: torch.ops.mini_engine_cpp.contiguous_decode(q, k_cache, v_cache, slots32,
                                                                      group.context_lens)}) == IN_PLACE


# ---------------------------------------------------------------- decode attention inside a compiled graph

def _decode_attention_op(q, k_cache, v_cache, mask, context_lens, slots, block_tables):
    """What `mini_engine::decode_attention` runs: the eager decode on a DecodeGroup rebuilt from the graph's
    tensors. mask [S,1,1,L] (True within each row's context), context_lens [S]; the contiguous cache's slots [S]
    or the paged cache's block_tables [S, W]. A compiled paged step's rows come sorted longest context first
    (`CompiledDecode`), so each copy of a few sequences reads about its own context."""
    lens = context_lens.tolist()
    attention = CpuAttention()
    if block_tables is None:
        meta = _contiguous_meta(slots, context_lens, lens)
        return attention.decode_eagerly(q, k_cache, v_cache, meta.decode, meta)
    group = DecodeGroup(slice(None), None, max(lens), mask, block_tables, context_lens)
    return attention.paged_decode(q, k_cache, v_cache, group,
                                  attention.paged_decode_form(q, k_cache, v_cache, group, lens), lens)


_LAST_STEP: list = [None, None, None]  # (slots, context_lens, AttentionMetadata) of the last call: its other layers


def _contiguous_meta(slots, context_lens, lens) -> AttentionMetadata:
    """The eager step's metadata for these decodes, built once per step: every layer of a graph passes the same
    two input tensors, held here so that identity means the same values."""
    if _LAST_STEP[0] is not slots or _LAST_STEP[1] is not context_lens:
        _LAST_STEP[:] = slots, context_lens, AttentionMetadata.build([1] * len(lens), lens, slots.tolist(),
                                                                     device=slots.device)
    return _LAST_STEP[2]


def register_decode_op():
    """`torch.ops.mini_engine.decode_attention`: opaque to the compiler, which only needs the output's shape.
    Called once by `install`; a second call finds it defined."""
    if hasattr(torch.ops.mini_engine, "decode_attention"):
        return
    lib = torch.library.Library("mini_engine", "FRAGMENT")
    lib.define("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor mask, Tensor context_lens, "
               "Tensor? slots, Tensor? block_tables) -> Tensor")
    lib.impl("decode_attention", _decode_attention_op, "CPU")
    torch.library.register_fake("mini_engine::decode_attention", lib=lib)(
        lambda q, k_cache, v_cache, mask, context_lens, slots, block_tables: torch.empty_like(q))
    _LIBS.append(lib)


_LIBS: list = []  # a Library unregisters its operators when collected: kept for the process's life
