"""A whole decode step as one compiled graph: how the cached decode step gets close to its weight products.

Chapter 03 measures an eager decode step on a CPU: the weight products are about two thirds of it, and
the rest is some 40 small kernels per layer (RMSNorm, RoPE, the cache write, residual adds, SiLU times
up), each paying dispatch and Python costs larger than its arithmetic. `torch.compile(fullgraph=True)`
traces the step once; Inductor fuses those small ops into a few C++ loops per layer and calls the products
as before. This is gpt-fast's `decode_one_token`, and the CPU counterpart of vLLM's CUDA graphs.

What is traced is the model's own code: `LlamaModel.run`, its layers, `Attention.forward` and the attention
functions of attention.py, given a step described by tensors alone (`AttentionMetadata.decode_only`). A change
to the model is a change to the compiled step; there is no second copy of the decode step to keep in sync.
The pieces that make the model's code traceable as one graph:
- the step's metadata holds no Python lists or ints that change from step to step: tokens, positions, the
  rows written, the contiguous cache's slots or the paged cache's block tables, and a mask [S,1,1,L] over the
  L key positions every row reads (True within the row's own context). On a CPU L is the step's longest
  context, a dynamic size of the graph (`torch._dynamo.mark_dynamic`), so one graph serves every context
  length; on a GPU it is fixed at the longest a sequence may reach, as CUDA graphs need static shapes, and
  the paged kernel reads only each row's own context anyway.
- the cache write is one indexed store into the cache's base tensor (`kv_cache._store`), not a store through
  per-layer views, which the compiler would keep consistent by copying the whole cache at every layer.
- the product forms are the tuned ones (`products`), a packed form reached through a custom operator.
A new batch size, dtype, model or cache compiles a new graph; the first call of each compiles (a minute for
SmolLM2 on a 2-core CPU with a cold Inductor cache, a few seconds with a warm one).

Two users. `compiled_decode_step` is `generate.decode_step` compiled, for the plain loops (`generate_cached(...,
compile=True)`): one graph per batch size met. `CompiledDecode` is the serving engine's (`LLM(compile=True)`):
a step's decodes are padded up to the next batch-size bucket (1, 2, 4, ... up to max_num_seqs), so a handful of
graphs serve every step; the padded rows write into a scratch slot or block that no sequence reads, and their
logits are dropped.
"""
from __future__ import annotations

import functools
import time

import torch

from .attention import AttentionMetadata, DecodeGroup


def decode_graph(model, kv_cache, backend: str, tokens, positions, slot_mapping, context_lens, slots=None,
                 mask=None, block_tables=None, block_size: int | None = None) -> torch.Tensor:
    """The function torch.compile traces: a decode-only step of the model's own forward (`LlamaModel.run`),
    from tensors alone. tokens, positions, slot_mapping, context_lens: [S]; then the contiguous cache's slots
    [S] and mask [S,1,1,L], or the paged cache's block_tables [S, W] (see `DecodeGroup.from_tensors`). Logits
    [S, vocab]. Run uncompiled, it is an ordinary eager decode step."""
    group = DecodeGroup.from_tensors(context_lens, slots, mask, block_tables, block_size)
    return model.run(tokens, AttentionMetadata.decode_only(positions, slot_mapping, group), kv_cache, backend)


# Every graph of `decode_graph` hangs off one code object, and Dynamo stops compiling a code object after 8
# graphs by default: buckets x caches x models x dtypes reach that in one process (the test suite does).
_RECOMPILE_LIMIT = 64


@functools.cache
def _compiled(device_type: str):
    # Built on first use: importing and configuring torch.compile costs seconds that eager runs need not pay.
    # On a GPU, reduce-overhead mode replays each graph as a CUDA graph (one launch for the whole step).
    mode = "reduce-overhead" if device_type == "cuda" else None
    return torch.compile(decode_graph, fullgraph=True, dynamic=False, mode=mode)


def _run_graph(model, kv_cache, backend: str, *args, dynamic_len: bool, **kwargs) -> torch.Tensor:
    """decode_graph(model, kv_cache, backend, *args, **kwargs), compiled. dynamic_len: the key length (the
    mask's, or the block tables' width) is a size of the graph, so that one graph serves every length."""
    if dynamic_len:
        for name, dim in (("mask", 3), ("block_tables", 1)):
            if kwargs.get(name) is not None:
                torch._dynamo.mark_dynamic(kwargs[name], dim)
    limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
    with torch.inference_mode(), torch._dynamo.config.patch(recompile_limit=limit):
        return _compiled(model.device.type)(model, kv_cache, backend, *args, **kwargs)


def _key_len(longest: int, limit: int) -> int:
    """Key positions read on a CPU: the longest context, but at least 2 (Dynamo specialises sizes 0 and 1,
    which would compile a graph of their own) unless the cache is shorter."""
    return min(max(longest, 2), limit)


@torch.inference_mode()
def compiled_decode_step(model, kv_cache, tokens: list[int], context_lens: list[int], slots: list[int]
                         ) -> torch.Tensor:
    """`generate.decode_step` through a compiled graph (the model's own decode step, traced): same arguments
    (a contiguous cache), same logits [B, vocab] (to rounding: fused kernels sum in another order)."""
    if not len(tokens) == len(context_lens) == len(slots):
        raise ValueError("tokens, context_lens and slots need one entry per sequence")
    model.check_last_position(max(context_lens) - 1, kv_cache)
    if min(context_lens) < 1:
        raise ValueError(f"context_lens must be >= 1 (they count the new token), got {min(context_lens)}")
    device = model.device
    lens = torch.tensor(context_lens, device=device)
    slot_ids = torch.tensor(slots, device=device)
    cuda = device.type == "cuda"
    length = kv_cache.max_len if cuda else _key_len(max(context_lens), kv_cache.max_len)
    mask = (torch.arange(length, device=device) < lens[:, None])[:, None, None, :]
    return _run_graph(model, kv_cache, model.attention_backend, torch.tensor(tokens, device=device), lens - 1,
                      slot_ids, lens, dynamic_len=not cuda, slots=slot_ids, mask=mask)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes that get a graph: powers of two below max_num_seqs, and max_num_seqs itself."""
    return [b for b in (1 << i for i in range(max_num_seqs.bit_length())) if b < max_num_seqs] + [max_num_seqs]


class CompiledDecode:
    """The serving engine's decode-only steps, one compiled graph per batch-size bucket (`decode_buckets`).

    `scratch` is a cache row no sequence owns, for the padded rows: a slot of the contiguous cache, or a block
    of the paged pool that the block manager never hands out (the engine allocates one more than it manages).
    `compile_seconds` adds up the first call of each bucket, which compiles (and runs one step, a few tens of
    milliseconds): the one-time cost, reported apart from any rate."""

    def __init__(self, model, kv_cache, backend: str, max_num_seqs: int, scratch: int,
                 block_size: int | None = None, max_model_len: int | None = None):
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.buckets = decode_buckets(max_num_seqs)
        self.scratch, self.block_size = scratch, block_size
        self.paged = block_size is not None
        self.device = model.device
        self.static_len = self.device.type == "cuda"  # CUDA graphs: every size fixed
        longest = max_model_len or kv_cache.max_len
        self.max_blocks = -(-longest // block_size) if self.paged else None
        self.max_len = self.max_blocks * block_size if self.paged else longest
        self.compile_seconds = 0.0
        self.compiled_buckets: set[int] = set()
        self.num_steps = 0  # steps run through a graph (warm-up included)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def __call__(self, tokens: list[int], positions: list[int], rows: list, size: int | None = None
                 ) -> torch.Tensor:
        """Logits [len(tokens), vocab] of a decode-only step: token i at position positions[i] of sequence i,
        whose cache rows are rows[i] (contiguous: its slot; paged: its block table), run as the graph of
        batch size `size` (default: the smallest bucket that holds them)."""
        n = len(tokens)
        size = size or self.bucket(n)
        pad, device = size - n, self.device
        lens = [p + 1 for p in positions] + [1] * pad  # a padded row reads position 0 of the scratch row
        lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
        ids = torch.tensor(list(tokens) + [0] * pad, device=device)
        pos = torch.tensor(list(positions) + [0] * pad, device=device)
        if self.paged:
            bs = self.block_size
            width = self.max_blocks if self.static_len else max(2, -(-max(lens) // bs))
            tables = [t[:width] + [self.scratch] * (width - len(t[:width])) for t in rows]
            tables += [[self.scratch] * width] * pad
            slot_mapping = [t[p // bs] * bs + p % bs for t, p in zip(rows, positions)] + [self.scratch * bs] * pad
            where = torch.tensor(slot_mapping, dtype=torch.int32, device=device)
            kwargs = {"block_tables": torch.tensor(tables, dtype=torch.int32, device=device), "block_size": bs}
        else:
            length = self.max_len if self.static_len else _key_len(max(lens), self.max_len)
            where = torch.tensor(list(rows) + [self.scratch] * pad, device=device)
            mask = (torch.arange(length, device=device) < lens_t[:, None])[:, None, None, :]
            kwargs = {"slots": where, "mask": mask}
        first = size not in self.compiled_buckets
        t0 = time.perf_counter()
        logits = _run_graph(self.model, self.kv_cache, self.backend, ids, pos, where, lens_t,
                            dynamic_len=not self.static_len, **kwargs)
        if first:
            self.compiled_buckets.add(size)
            self.compile_seconds += time.perf_counter() - t0
        self.num_steps += 1
        return logits[:n] if pad else logits

    def warmup(self) -> float:
        """Compile every bucket not compiled yet, each with a step of one row on the scratch row plus padding
        (nothing outside the scratch row is written); returns the seconds it took."""
        t0 = time.perf_counter()
        for size in self.buckets:
            if size not in self.compiled_buckets:
                self([0], [0], [[self.scratch]] if self.paged else [self.scratch], size=size)
        return time.perf_counter() - t0
