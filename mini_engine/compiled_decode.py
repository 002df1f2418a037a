"""A whole decode step as one compiled graph (chapters 03 and 09): gpt-fast's `decode_one_token`, and what vLLM's
CUDA graphs do. An eager decode step runs some 40 small kernels per layer around its weight products (RMSNorm,
RoPE, the cache write, residual adds, SwiGLU), each paying dispatch and Python costs larger than its arithmetic.
`torch.compile(fullgraph=True)` traces the step once and fuses them; on a GPU, reduce-overhead mode replays the
graph as a CUDA graph, one launch for the whole step.

What is traced is the model's own code (`LlamaModel.run`) given a step described by tensors alone
(`decode_graph`): a mask over the key positions each row may read replaces the Python lists,
so one graph serves every context length. `CompiledDecode` builds such steps for the plain loops
(`generate_cached(..., compile=True)`: one graph per batch size) and the serving engine (`LLM(compile=True)`:
steps padded up to a batch-size bucket, the padded rows writing a scratch row no sequence reads). The graphs live
on the model (`DecodeGraphs`); the first call of each compiles (a minute on a 2-core CPU with a cold cache).
"""
from __future__ import annotations

import contextlib
import time
import types

import torch

from .attention import AttentionMetadata, DecodeGroup
from .kv_cache import ContiguousKVCache


def decode_graph(model, kv_cache, backend: str, tokens, positions, slot_mapping, context_lens, slots=None,
                 block_tables=None, logits_order=None) -> torch.Tensor:
    """The function torch.compile traces: a decode-only step of the model's own forward (`LlamaModel.run`),
    from tensors alone. tokens, positions, slot_mapping, context_lens: [S]; the contiguous cache's slots [S] or
    the paged cache's block_tables [S, W] int32 (see `DecodeGroup.from_tensors`). Logits [S, vocab], of the rows
    in `logits_order` [S] when given (a permutation). Run uncompiled, it is an ordinary eager decode step."""
    # Every row reads the same key positions, a size of the graph: the cache's length (see cache_length), or W blocks.
    length = kv_cache.data.shape[4] if block_tables is None else block_tables.shape[1] * kv_cache.block_size
    group = DecodeGroup.from_tensors(context_lens, length, slots, block_tables)
    # Tensors only: the Python lists stay empty (LlamaModel.forward checks them, before a compiled step, outside it).
    meta = AttentionMetadata([], [], positions, None, slot_mapping, logits_order, group, block_tables)
    return model.run(tokens, meta, kv_cache, backend)


# Dynamo stops compiling a code object after 8 graphs by default: buckets x caches x dtypes reach that.
_RECOMPILE_LIMIT = 64
# compile="max-autotune" on a CPU: with freezing, the weights are constants of the graph, packed once at compile
# time for Inductor's own GEMM, which it times against ATen's for every product shape. Passed as torch.compile
# `options`, freezing was not applied (torch 2.13), so the settings are patched in around each call.
_MAX_AUTOTUNE_CPU = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
COMPILE_MODES = (True, "cpp", "max-autotune")


class DecodeGraphs(dict):
    """A model's compiled decode steps (`model.decode_graphs`), one per (mode, device type, dtype), each on its own
    copy of `decode_graph`'s code (Dynamo keeps graphs per code object: no graph is offered to another model or
    mode). A deep copy of the model starts with none: a "cpp" graph skips its guards on the model's modules."""

    def __init__(self):
        super().__init__()
        self.caches: dict[tuple, ContiguousKVCache] = {}  # the compiled plain loop's, by shape (`plain_cache`)

    def __deepcopy__(self, memo):
        return type(self)()

    def step(self, model, mode: bool | str):
        key = (mode, model.device.type, model.dtype)
        if key not in self:
            # On a GPU, reduce-overhead mode replays each graph as a CUDA graph (one launch for the whole step);
            # max-autotune is torch.compile's own mode there (Triton GEMM templates, then CUDA graphs).
            cuda = model.device.type == "cuda"
            options = {"mode": ("max-autotune" if mode == "max-autotune" else "reduce-overhead") if cuda else None}
            if mode == "cpp":
                options = {"options": {"cpp_wrapper": True,
                                       "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}}
            code = types.FunctionType(decode_graph.__code__.replace(), decode_graph.__globals__, "decode_graph",
                                      decode_graph.__defaults__)
            self[key] = torch.compile(code, fullgraph=True, dynamic=False, **options)
        return self[key]

    def run(self, model, mode: bool | str, *args, **kwargs) -> torch.Tensor:
        """decode_graph(model, *args, **kwargs) through the step compiled in `mode` (see COMPILE_MODES)."""
        step = self.step(model, mode)
        limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
        settings = contextlib.nullcontext()
        if mode == "max-autotune" and model.device.type == "cpu":
            from torch._inductor import config as inductor_config
            settings = inductor_config.patch(_MAX_AUTOTUNE_CPU)
        with torch.inference_mode(), torch._dynamo.config.patch(recompile_limit=limit), settings:
            return step(model, *args, **kwargs)


def graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process: read before and after a timed run, the recompiles inside it."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def cache_length(n: int, limit: int) -> int:
    """A contiguous cache's length for a compiled plain loop: n rounded up to a power of two (at least 256, at
    most `limit`). The length is a size of the graph, so runs of nearby lengths share one graph."""
    return min(limit, max(256, 1 << (n - 1).bit_length()))


def plain_cache(model, num_slots: int, n: int) -> ContiguousKVCache:
    """The compiled plain loop's cache for n positions (`cache_length`), one per shape kept on the model and zeroed
    for each run: a CUDA graph replays the address it recorded, so a new cache would record the graph anew."""
    caches = model.__dict__.setdefault("decode_graphs", DecodeGraphs()).caches
    key = (num_slots, cache_length(n, model.config.max_position_embeddings), model.device, model.dtype)
    if key not in caches:
        caches[key] = ContiguousKVCache(model.config, *key)
    caches[key].data.zero_()  # as a new one: nothing of the last run is left
    return caches[key]


def decode_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes that get a graph: powers of two below max_num_seqs, and max_num_seqs itself."""
    return [b for b in (1 << i for i in range(max_num_seqs.bit_length())) if b < max_num_seqs] + [max_num_seqs]


class CompiledDecode:
    """Decode-only steps through compiled graphs, one per batch-size bucket (`decode_buckets`). Every size in a
    graph is fixed: the batch and the key positions a row may read (`static_len`: the contiguous cache's length, or
    `max_model_len` in whole blocks). `scratch`: a cache slot or block no sequence owns, for padded rows. The paged
    cache's rows go longest context first, so an attention that copies a few sequences' blocks at a time (the CPU
    backend's) reads about each one's own context. `compile_seconds`: the first call of each bucket, apart."""

    def __init__(self, model, kv_cache, backend: str, max_num_seqs: int, scratch: int | None = None,
                 block_size: int | None = None, max_model_len: int | None = None, mode: bool | str = True):
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile must be False or one of {COMPILE_MODES}, got {mode!r}")
        self.model, self.kv_cache, self.backend, self.mode = model, kv_cache, backend, mode
        self.graphs = model.__dict__.setdefault("decode_graphs", DecodeGraphs())  # the CPU backend installs its own
        if model.device.type == "cuda":  # CUDA graphs replay fixed addresses: the cache must never move
            torch._dynamo.mark_static_address(kv_cache.data)
        self.buckets = decode_buckets(max_num_seqs)
        self.scratch, self.block_size, self.paged = scratch, block_size, block_size is not None
        # The key positions every row reads: the contiguous cache's length, or max_model_len in whole blocks.
        self.static_len = block_size * -(-(max_model_len or kv_cache.max_len) // block_size) if self.paged else \
            kv_cache.max_len
        self.compile_seconds = 0.0
        self.compiled_buckets: set[int] = set()
        self.num_steps = 0  # steps run through a graph (warm-up included)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def __call__(self, tokens: list[int], positions: list[int], rows: list, size: int | None = None
                 ) -> torch.Tensor:
        """Logits [len(tokens), vocab] of a decode-only step: token i at position positions[i] of sequence i,
        whose cache rows are rows[i] (contiguous: its slot; paged: its block table), run as the graph of
        batch size `size` (default: the smallest bucket that holds them; padding needs `scratch`)."""
        n = len(tokens)
        if not n == len(positions) == len(rows):
            raise ValueError("tokens, positions and rows need one entry per sequence")
        self.model.check_last_position(max(positions), self.kv_cache)
        size = size or self.bucket(n)
        pad, order = size - n, list(range(size))
        if self.paged:  # longest context first; the graph hands the logits back in the callers' order
            order[:n] = sorted(range(n), key=positions.__getitem__, reverse=True)
            tokens, positions, rows = ([x[i] for i in order[:n]] for x in (tokens, positions, rows))
        # A padded row reads and writes position 0 of the scratch slot or block, which no sequence owns.
        rows, lens = list(rows) + [[self.scratch] if self.paged else self.scratch] * pad, [p + 1 for p in positions]
        meta = AttentionMetadata.build([1] * size, lens + [1] * pad, None if self.paged else rows, self.model.device,
                                       block_tables=rows if self.paged else None, block_size=self.block_size,
                                       static_len=self.static_len, fill=self.scratch)
        ids = torch.tensor(list(tokens) + [0] * pad, device=self.model.device)
        back = torch.tensor(sorted(range(size), key=order.__getitem__), device=ids.device) if self.paged else None
        first, t0 = size not in self.compiled_buckets, time.perf_counter()
        logits = self.graphs.run(self.model, self.mode, self.kv_cache, self.backend, ids, meta.positions,
                                 meta.slot_mapping, meta.decode.context_lens, meta.decode.slots, meta.block_tables, back)
        if first:
            self.compiled_buckets.add(size)
            self.compile_seconds += time.perf_counter() - t0
        self.num_steps += 1
        return logits[:n] if pad else logits

    def warmup(self, progress: bool = False) -> float:
        """Compile every bucket not compiled yet, each with a step of one row on the scratch row plus padding
        (nothing outside the scratch row is written); returns the seconds it took. `progress`: a bar over
        the buckets (each can take a minute on a CPU with a cold Inductor cache)."""
        from tqdm.auto import tqdm
        t0 = time.perf_counter()
        todo = [size for size in self.buckets if size not in self.compiled_buckets]
        for size in tqdm(todo, desc="compiling decode graphs (batch buckets)", disable=not progress):
            self([0], [0], [[self.scratch]] if self.paged else [self.scratch], size=size)
        return time.perf_counter() - t0
