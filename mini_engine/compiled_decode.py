"""A whole decode step as one compiled graph (chapters 03 and 09): gpt-fast's `decode_one_token`, and what vLLM's
CUDA graphs do. An eager decode step runs some 40 small kernels per layer around its weight products (RMSNorm,
RoPE, the cache write, residual adds, SwiGLU), each paying dispatch and Python costs larger than its arithmetic.
`torch.compile(fullgraph=True)` traces the step once and fuses them; on a GPU, reduce-overhead mode replays the
graph as a CUDA graph, one launch for the whole step.

What is traced is the model's own code (`LlamaModel.run`), not a copy, given a step described by tensors alone
(`AttentionMetadata.decode_only`): no Python lists or ints that change from step to step, and a mask over the key
positions each row may read (`DecodeGroup.from_tensors`), so one graph serves every context length. The cache
write is one indexed store into the cache's base tensor (`kv_cache._store`). A new batch size, dtype, model or
cache compiles a new graph; the first call of each compiles (a minute on a 2-core CPU with a cold cache).

Two users: `compiled_decode_step`, `generate.decode_step` compiled for the plain loops (`generate_cached(...,
compile=True)`, one graph per batch size); and `CompiledDecode`, the serving engine's (`LLM(compile=True)`),
which pads a step's decodes up to the next batch-size bucket so that a handful of graphs serve every step (the
padded rows write into a scratch slot or block no sequence reads). compile="cpp" compiles with Inductor's C++
wrapper (less overhead per step, twice the compile time); compile="max-autotune" lets Inductor write and time
the weight products too (on a CPU with frozen weights, `_MAX_AUTOTUNE_CPU`).
"""
from __future__ import annotations

import contextlib
import functools
import time
import types
import weakref

import torch

from .attention import AttentionMetadata, DecodeGroup, pad_tables


def decode_graph(model, kv_cache, backend: str, tokens, positions, slot_mapping, context_lens, slots=None,
                 block_tables=None, logits_order=None) -> torch.Tensor:
    """The function torch.compile traces: a decode-only step of the model's own forward (`LlamaModel.run`),
    from tensors alone. tokens, positions, slot_mapping, context_lens: [S]; the contiguous cache's slots [S] or
    the paged cache's block_tables [S, W] int32 (see `DecodeGroup.from_tensors`). Logits [S, vocab], of the rows
    in `logits_order` [S] when given (a permutation). Run uncompiled, it is an ordinary eager decode step."""
    if block_tables is not None:
        length = block_tables.shape[1] * kv_cache.block_size
    else:
        length = kv_cache.data.shape[4]  # the cache's positions: a size of the graph (see compiled_decode_step)
    group = DecodeGroup.from_tensors(context_lens, length, slots, block_tables)
    meta = AttentionMetadata.decode_only(positions, slot_mapping, group, logits_order)
    return model.run(tokens, meta, kv_cache, backend)


# Every graph of `decode_graph` hangs off one code object, and Dynamo stops compiling a code object after 8
# graphs by default: buckets x caches x models x dtypes reach that in one process (the test suite does).
_RECOMPILE_LIMIT = 64


# compile="max-autotune" on a CPU: with freezing, the weights are constants of the graph, packed once at compile
# time for Inductor's own GEMM, which it times against ATen's for every product shape. Passed as torch.compile
# `options`, freezing was not applied (torch 2.13), so the settings are patched in around each call.
_MAX_AUTOTUNE_CPU = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


def _fresh_decode_graph():
    """decode_graph on a copy of its code object. Dynamo keeps compiled graphs per code object: a step compiled
    with other settings on its own copy is never offered to a call of another (nor they to it)."""
    return types.FunctionType(decode_graph.__code__.replace(), decode_graph.__globals__, decode_graph.__name__,
                              decode_graph.__defaults__)


@functools.cache
def _compiled(device_type: str, max_autotune: bool = False):
    # Built on first use: configuring torch.compile costs seconds that eager runs need not pay. On a GPU,
    # reduce-overhead mode replays each graph as a CUDA graph (one launch for the whole step); max-autotune is
    # torch.compile's own mode there (Triton GEMM templates, then CUDA graphs), on a code object of its own.
    mode = ("max-autotune" if max_autotune else "reduce-overhead") if device_type == "cuda" else None
    return torch.compile(_fresh_decode_graph() if max_autotune else decode_graph, fullgraph=True, dynamic=False,
                         mode=mode)


def _run_graph(model, kv_cache, backend: str, *args, mode: bool | str = True, **kwargs) -> torch.Tensor:
    """decode_graph(model, kv_cache, backend, *args, **kwargs), compiled (mode="cpp": with the C++ wrapper;
    "max-autotune": with Inductor's own weight products, see _MAX_AUTOTUNE_CPU)."""
    limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
    settings = contextlib.nullcontext()
    if mode == "max-autotune":
        step = _compiled(model.device.type, max_autotune=True)
        if model.device.type == "cpu":
            from torch._inductor import config as inductor_config
            settings = inductor_config.patch(_MAX_AUTOTUNE_CPU)
    else:
        step = _compiled_cpp(model) if mode == "cpp" else _compiled(model.device.type)
    with torch.inference_mode(), torch._dynamo.config.patch(recompile_limit=limit), settings:
        return step(model, kv_cache, backend, *args, **kwargs)


_CPP_GRAPHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(dtype, device): compiled step}


def _compiled_cpp(model):
    """The step for this model, dtype and device, compiled with the C++ wrapper and without guards on the
    model's modules. Each one compiles a fresh copy of `decode_graph` (`_fresh_decode_graph`): with those guards
    skipped, a graph must never be offered to another model."""
    graphs = _CPP_GRAPHS.setdefault(model, {})
    key = (model.dtype, model.device)
    if key not in graphs:
        graphs[key] = torch.compile(_fresh_decode_graph(), fullgraph=True, dynamic=False, options={
            "cpp_wrapper": True, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
    return graphs[key]


COMPILE_MODES = (True, "cpp")


@torch.inference_mode()
def compiled_decode_step(model, kv_cache, tokens: list[int], context_lens: list[int], slots: list[int],
                         mode: bool | str = True) -> torch.Tensor:
    """`generate.decode_step` through a compiled graph (the model's own decode step, traced): same arguments
    (a contiguous cache), same logits [B, vocab] (to rounding: fused kernels sum in another order). One graph
    per batch size, dtype and model: the cache's length is a dynamic size of the graph, so that caches of any
    length share it. mode="cpp": the C++-wrapper graph (see the module's docstring)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be False, True or 'cpp', got {mode!r}")
    if not len(tokens) == len(context_lens) == len(slots):
        raise ValueError("tokens, context_lens and slots need one entry per sequence")
    model.check_last_position(max(context_lens) - 1, kv_cache)
    if min(context_lens) < 1:
        raise ValueError(f"context_lens must be >= 1 (they count the new token), got {min(context_lens)}")
    if kv_cache.max_len > 1 and model.device.type != "cuda":  # size 1 is always specialised; CUDA graphs: static
        torch._dynamo.mark_dynamic(kv_cache.data, 4)
    device = model.device
    lens = torch.tensor(context_lens, device=device)
    slot_ids = torch.tensor(slots, device=device)
    return _run_graph(model, kv_cache, model.attention_backend, torch.tensor(tokens, device=device), lens - 1,
                      slot_ids, lens, slots=slot_ids, mode=mode)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes that get a graph: powers of two below max_num_seqs, and max_num_seqs itself."""
    return [b for b in (1 << i for i in range(max_num_seqs.bit_length())) if b < max_num_seqs] + [max_num_seqs]


class CompiledDecode:
    """The serving engine's decode-only steps, one compiled graph per batch-size bucket (`decode_buckets`).

    Every size in a graph is fixed: the batch (its bucket) and the key positions every row may read (the
    contiguous cache's length, or `max_blocks` blocks of the paged cache's tables); each row's own context is
    a tensor. `scratch` is a cache row no sequence owns, for the padded rows: a slot of the contiguous cache, or
    a block of the paged pool that the block manager never hands out (the engine allocates one more than it
    manages). The paged cache's rows go in longest context first, so that an attention that copies a few
    sequences' blocks at a time (the CPU backend's) reads about each one's own context.
    `compile_seconds` adds up the first call of each bucket, which compiles (and runs one step, a few tens of
    milliseconds): the one-time cost, reported apart from any rate."""

    def __init__(self, model, kv_cache, backend: str, max_num_seqs: int, scratch: int,
                 block_size: int | None = None, max_model_len: int | None = None, mode: bool | str = True):
        self.model, self.kv_cache, self.backend, self.mode = model, kv_cache, backend, mode
        self.buckets = decode_buckets(max_num_seqs)
        self.scratch, self.block_size = scratch, block_size
        self.paged = block_size is not None
        self.device = model.device
        self.max_blocks = -(-(max_model_len or kv_cache.max_len) // block_size) if self.paged else None
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
        order = list(range(size))
        if self.paged:  # longest context first; the graph hands the logits back in the callers' order
            order[:n] = sorted(range(n), key=positions.__getitem__, reverse=True)
            tokens, positions, rows = ([x[i] for i in order[:n]] for x in (tokens, positions, rows))
            back = [0] * size
            for place, i in enumerate(order):
                back[i] = place
            kwargs = {"logits_order": torch.tensor(back, device=device)}
        else:
            kwargs = {}
        ids = torch.tensor(list(tokens) + [0] * pad, device=device)
        pos = torch.tensor(list(positions) + [0] * pad, device=device)
        lens = torch.tensor([p + 1 for p in positions] + [1] * pad, dtype=torch.int32, device=device)
        if self.paged:  # a padded row reads and writes position 0 of the scratch block
            bs, width = self.block_size, self.max_blocks
            slot_mapping = [t[p // bs] * bs + p % bs for t, p in zip(rows, positions)] + [self.scratch * bs] * pad
            where = torch.tensor(slot_mapping, dtype=torch.int32, device=device)
            kwargs["block_tables"] = pad_tables(list(rows) + [[]] * pad, width, device, fill=self.scratch)
        else:  # a padded row reads and writes position 0 of the scratch slot
            where = torch.tensor(list(rows) + [self.scratch] * pad, device=device)
            kwargs["slots"] = where
        first = size not in self.compiled_buckets
        t0 = time.perf_counter()
        logits = _run_graph(self.model, self.kv_cache, self.backend, ids, pos, where, lens, mode=self.mode,
                            **kwargs)
        if first:
            self.compiled_buckets.add(size)
            self.compile_seconds += time.perf_counter() - t0
        self.num_steps += 1
        return logits[:n] if pad else logits

    def warmup(self, progress: bool = False) -> float:
        """Compile every bucket not compiled yet, each with a step of one row on the scratch row plus padding
        (nothing outside the scratch row is written); returns the seconds it took. `progress`: a bar over
        the buckets (each can take a minute on a CPU with a cold Inductor cache)."""
        from tqdm import tqdm

        t0 = time.perf_counter()
        todo = [size for size in self.buckets if size not in self.compiled_buckets]
        for size in tqdm(todo, desc="compiling decode graphs (batch buckets)", disable=not progress):
            self([0], [0], [[self.scratch]] if self.paged else [self.scratch], size=size)
        return time.perf_counter() - t0
