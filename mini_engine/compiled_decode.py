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
- the step's metadata holds no Python lists or ints that change from step to step, only tensors of sizes
  that do not change: tokens, positions, the rows written, each row's context length, the contiguous cache's
  slots or the paged cache's block tables padded to the most blocks a sequence may hold, and a mask over the
  key positions a row may read (`DecodeGroup.from_tensors`). One graph serves every context length.
- the cache write is one indexed store into the cache's base tensor (`kv_cache._store`), not a store through
  per-layer views, which the compiler would keep consistent by copying the whole cache at every layer; the
  layer's index is a tensor, so that all layers share one generated kernel rather than one each.
- the product forms are the tuned ones (`products`), a packed form reached through a custom operator.
- on a CPU the attention itself runs as the eager steps run it, through the custom operator
  `mini_engine::decode_attention` (see `attention._decode_attention_op` for the measurements that chose this):
  it reads each row's own context, where the traced form would read every position the shapes allow. On a
  GPU it is traced (the paged kernel reads only each row's context anyway), and reduce-overhead mode replays
  each graph as a CUDA graph.
A new batch size, dtype, model or cache compiles a new graph; the first call of each compiles (a minute for
SmolLM2 on a 2-core CPU with a cold Inductor cache, a few seconds with a warm one).

Two users. `compiled_decode_step` is `generate.decode_step` compiled, for the plain loops (`generate_cached(...,
compile=True)`): one graph per batch size met. `CompiledDecode` is the serving engine's (`LLM(compile=True)`):
a step's decodes are padded up to the next batch-size bucket (1, 2, 4, ... up to max_num_seqs), so a handful of
graphs serve every step; the padded rows write into a scratch slot or block that no sequence reads, and their
logits are dropped.

`compile="cpp"` (generate_cached(compile="cpp")) compiles the same step with Inductor's C++ wrapper: the
graph's few hundred kernel calls per step are made from generated C++ instead of generated Python, and
Dynamo skips its guards on the model's modules (each model, dtype and device gets a graph of its own, so none
is ever offered to another). Compiling takes about twice as long. It pays where the products are cheap:
for the int4 model (quant.py), whose 121 products take about 7 ms per token on one core of the CI machine,
the Python wrapper and the guards cost about 2 ms more per step: `bench --quantization int4` measured the
C++ wrapper at 116.4 tok/s against 97.9 with the Python one (one thread, load average 2, same run).

`LLM(compile="max-autotune")` (the serving engine's only) also hands the weight products to Inductor. At a
batch of 16 rows on a CPU, the products are most of a decode step, and neither a graph nor the tuned eager forms
change them. Under max-autotune with freezing (`_MAX_AUTOTUNE_CPU`), the weights are constants of the graph,
packed at compile time for Inductor's generated C++ GEMM, and Inductor times that GEMM against ATen's for each
product shape, keeping the faster. The graph then takes the plain product (`products._inductor_writes_products`).
Frozen means frozen: weights changed in place after compiling are not seen by the graphs (serve them anew).
Costs: compiling takes about twice as long (80-90 s a bucket against 30-40 s on a 2-core Zen 3, cold), and each
bucket's graph holds its own packed copy of the weights (about 640 MiB for the fp32 model). `bench --rung
compiled-engine-max-autotune` measured 1.23x and 1.31x the eager engine on the chapter-04 workload there, against
1.08x and 1.13x for compile=True (benchmarks/RESULTS.md).
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


@functools.cache
def _compiled(device_type: str):
    # Built on first use: importing and configuring torch.compile costs seconds that eager runs need not pay.
    # On a GPU, reduce-overhead mode replays each graph as a CUDA graph (one launch for the whole step).
    mode = "reduce-overhead" if device_type == "cuda" else None
    return torch.compile(decode_graph, fullgraph=True, dynamic=False, mode=mode)


# compile="max-autotune" on a CPU: Inductor writes the weight products itself. With freezing, the weights become
# constants of the graph, packed once at compile time into the blocked layout of its generated C++ GEMM
# (`CppMicroGemmFP32Vec` for fp32); max_autotune times that GEMM against ATen's for every product shape and
# keeps the faster. Passed to torch.compile as `options`, freezing was not applied (torch 2.13: the weights
# were packed again at every call, 2x slower than eager), so the settings are patched in around each call:
# a graph is compiled inside its first call.
_MAX_AUTOTUNE_CPU = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


def _fresh_decode_graph():
    """decode_graph on a copy of its code object. Dynamo keeps compiled graphs per code object: a step compiled
    with other settings on its own copy is never offered to a call of another (nor they to it)."""
    return types.FunctionType(decode_graph.__code__.replace(), decode_graph.__globals__, decode_graph.__name__,
                              decode_graph.__defaults__)


@functools.cache
def _compiled_max_autotune(device_type: str):
    # On a GPU: torch.compile's own mode (Triton GEMM templates, then CUDA graphs).
    mode = "max-autotune" if device_type == "cuda" else None
    return torch.compile(_fresh_decode_graph(), fullgraph=True, dynamic=False, mode=mode)


def _run_graph(model, kv_cache, backend: str, *args, mode: bool | str = True, **kwargs) -> torch.Tensor:
    """decode_graph(model, kv_cache, backend, *args, **kwargs), compiled (mode="cpp": with the C++ wrapper;
    "max-autotune": with Inductor's own weight products, see _MAX_AUTOTUNE_CPU)."""
    limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
    settings = contextlib.nullcontext()
    if mode == "max-autotune":
        step = _compiled_max_autotune(model.device.type)
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
    manages). The paged cache's rows go in longest context first, so that the attention, copying a few
    sequences' blocks at a time, reads about each one's own context (`DecodeGroup.lens`).
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
