"""`python -m mini_engine bench --workload paging`: the paged KV cache against the contiguous one, in one run.

- Serving at equal KV memory: the serving workload (`bench.ServingWorkload`) with `max_model_len` 2048. The
  contiguous cache gets `batch` slots of max_model_len positions; the paged pool gets the same bytes as
  blocks, and admits requests as long as their blocks fit (up to the engine's default max_num_seqs).
  Reported: tokens/s, TTFT and TPOT, peak concurrent requests, preemptions.
- One decode step at equal batch: `batch` sequences at each context length, read from the contiguous cache
  (a slice of its slots) and from the paged pool (through shuffled block tables, the worst case for
  locality). The forms are timed in alternation and the medians compared.
- On a CPU, the paged decode's attention forms side by side (`time_paged_decode_forms`): one layer's
  attention for the same batch and contexts, through the C kernel that reads the pool in place and through the
  copy of the blocks with SDPA (the form it replaces), beside the contiguous cache's SDPA.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..attention import AttentionMetadata, TorchAttention
from ..backends.cpu.attention import IN_PLACE, CpuAttention
from ..backends.cpu.cpu_kernels import paged_decode, paged_decode_supported
from .runs import Row, ServingWorkload, format_table, run_engine
from ..course.devices import synchronize
from ..kv_cache import ContiguousKVCache, PagedKVCache


def decode_step_inputs(model, batch: int, context: int, block_size: int | None, seed: int = 0, query_len: int = 1):
    """(cache, metadata) for one decode step of `batch` sequences at `context` positions each, the new token
    included (or `query_len` new tokens each: a prefill chunk's step): the contiguous cache (block_size None), or
    a paged pool of exactly the blocks needed, handed out in a shuffled order. The cache holds random keys and
    values: a step's cost does not depend on them."""
    g = torch.Generator().manual_seed(seed)
    lens, ctx = [query_len] * batch, [context] * batch
    if block_size is None:
        cache = ContiguousKVCache(model.config, batch, context, model.device, model.dtype)
        meta = AttentionMetadata.build(lens, ctx, list(range(batch)), device=model.device)
    else:
        per_seq = -(-context // block_size)
        cache = PagedKVCache(model.config, batch * per_seq, block_size, model.device, model.dtype)
        order = torch.randperm(batch * per_seq, generator=g).tolist()
        tables = [order[i * per_seq:(i + 1) * per_seq] for i in range(batch)]
        meta = AttentionMetadata.build(lens, ctx, device=model.device, block_tables=tables, block_size=block_size)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g).to(cache.data.dtype))
    return cache, meta


def time_decode_steps(model, batch: int, context: int, block_sizes=(16,), repeats: int = 7) -> dict:
    """Median seconds of one decode step (the whole model): {"contiguous": s, block_size: s, ...}. Every
    form runs once per round, round after round, so a machine whose load changes affects all alike."""
    inputs = {"contiguous": decode_step_inputs(model, batch, context, None)}
    inputs.update((b, decode_step_inputs(model, batch, context, b)) for b in block_sizes)
    tokens = torch.randint(0, model.config.vocab_size, (batch,), device=model.device)
    return median_alternated({form: (lambda cache=cache, meta=meta: model(tokens, meta, cache))
                              for form, (cache, meta) in inputs.items()}, repeats, model.device)


def median_alternated(forms: dict, repeats: int, device="cpu") -> dict:
    """{name: median seconds of fn()} over `repeats` rounds, each running every form once in turn (so that a
    machine whose load changes affects all alike), after one round that warms them up."""
    times: dict = {name: [] for name in forms}
    for i in range(repeats + 1):
        for name, fn in forms.items():
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            if i:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def time_paged_decode_forms(model, batch: int, context: int, block_size: int = 16, repeats: int = 7) -> dict:
    """Median seconds of one layer's decode attention, {"in place (C)": s, "copy + SDPA": s, "contiguous": s},
    each form run over every layer's pool in turn (so that, as in a step, the keys and values come from memory)
    and divided by the layers: the C kernel, the copy of the blocks with SDPA (the best number of sequences per
    copy), and SDPA on the contiguous cache's slots. {} where the kernel cannot run (not a CPU, not fp32, or
    no C compiler)."""
    paged, meta = decode_step_inputs(model, batch, context, block_size)
    contiguous, cmeta = decode_step_inputs(model, batch, context, None)
    c = model.config
    q = torch.randn(batch, c.num_heads, c.head_dim, device=model.device, dtype=model.dtype)
    layers = range(c.num_layers)
    if not paged_decode_supported(q, *paged.layer(0)):
        return {}
    group, cpu = meta.decode, CpuAttention()
    chunks = [n for n in (batch, 8, 4, 2, 1) if n <= batch]

    def copy_form(n):
        return lambda: [cpu.paged_decode(q, *paged.layer(i), group, f"{n} at a time") for i in layers]

    def contiguous_form():
        for i in layers:
            TorchAttention.decode(cpu, q, *contiguous.layer(i), cmeta.decode, cmeta)
    forms = {"in place (C)": lambda: [paged_decode(q, *paged.layer(i), group.block_tables, group.context_lens)
                                      for i in layers],
             **{f"copy {n}": copy_form(n) for n in dict.fromkeys(chunks)},
             "contiguous": contiguous_form}
    medians = {name: t / len(layers) for name, t in median_alternated(forms, repeats).items()}
    copies = {name: t for name, t in medians.items() if name.startswith("copy")}
    return {"in place (C)": medians["in place (C)"], "copy + SDPA": min(copies.values()),
            "contiguous": medians["contiguous"]}


def time_prefill_chunk_forms(model, chunk: int, context: int, block_size: int = 16, repeats: int = 7) -> dict:
    """Median seconds of one layer's attention for one prefill chunk of `chunk` tokens whose context (cached
    prefix and the chunk) is `context` positions, {"in place (C)": s, "copy + SDPA": s}, over every layer's pool
    in turn as `time_paged_decode_forms` does. {} where the kernel cannot run."""
    paged, meta = decode_step_inputs(model, 1, context, block_size, query_len=chunk)
    c = model.config
    q = torch.randn(chunk, c.num_heads, c.head_dim, device=model.device, dtype=model.dtype)
    if not paged_decode_supported(q, *paged.layer(0)):
        return {}
    layers = range(c.num_layers)
    cpu = CpuAttention()
    forms = {name: (lambda form=form: [cpu.prefill_chunk(q, *paged.layer(i), meta, 0, form) for i in layers])
             for name, form in (("in place (C)", IN_PLACE), ("copy + SDPA", "copy"))}
    return {name: t / len(layers) for name, t in median_alternated(forms, repeats).items()}


def bench_paging(requests: int, batch: int, device: str, dtype: str, max_model_len: int = 2048, low: int = 16,
                 high: int = 256, block_size: int = 16, contexts=(128, 1024), progress: bool = True,
                 print_fn=print) -> tuple[list[Row], dict[int, tuple[float, float]]]:
    """Both measurements; returns the serving rows (contiguous, paged) and {context: (contiguous s, paged s)}."""
    from tqdm.auto import tqdm

    from ..course.hardware import describe_machine

    from ..backends.cpu import warm_up
    from ..loading.loader import load_model

    model, tok = load_model("smollm2-135m", device=device, dtype=dtype)
    work = ServingWorkload.uniform(requests, low, high, vocab=model.config.vocab_size)
    if max_model_len < work.longest:
        raise ValueError(f"max_model_len {max_model_len} is shorter than the workload's longest request ({work.longest})")
    # Product-form tuning and lazy init stay out of the numbers: every row count a step can meet, decided now.
    warm_up(model, [1 << i for i in range(10)])
    warm = ServingWorkload.uniform(2, 4, 8, vocab=model.config.vocab_size, seed=1)
    run_engine(model, tok, "continuous", warm, 2, max_model_len=max_model_len)
    num_kv_blocks = -(-batch * max_model_len // block_size)  # the contiguous cache's bytes, as blocks
    rows = [run_engine(model, tok, "continuous", work, batch, name="mini_engine contiguous", progress=progress,
                       kv_cache="contiguous", max_model_len=max_model_len),
            run_engine(model, tok, "continuous", work, None, name="mini_engine paged", progress=progress,
                       kv_cache="paged", num_kv_blocks=num_kv_blocks, block_size=block_size,
                       max_model_len=max_model_len, enable_prefix_caching=False)]  # paging alone
    steps = {c: time_decode_steps(model, batch, c, (block_size,)) for c in tqdm(contexts, desc="decode steps",
                                                                                disable=not progress)}
    steps = {c: (t["contiguous"], t[block_size]) for c, t in steps.items()}
    forms = {c: time_paged_decode_forms(model, batch, c, block_size) for c in contexts}
    print_fn(describe_machine(device))
    print_fn(f"device={device} dtype={dtype} threads={torch.get_num_threads()} workload: {requests} requests, prompt and "
             f"output lengths uniform in {low}-{high} (seed 0), ignore_eos, max_model_len {max_model_len}; KV memory "
             f"of {batch} contiguous slots for both ({num_kv_blocks} blocks of {block_size}); ratio vs first row")
    print_fn(format_table(rows, rows[0]))
    contiguous, paged = rows
    for r in rows:
        print_fn(f"{r.system}: peak {r.peak_running} concurrent requests, {r.num_preemptions} preemptions")
    print_fn(f"paged / contiguous: {paged.peak_running / contiguous.peak_running:.2f}x peak concurrent requests, "
             f"{paged.tok_s / contiguous.tok_s:.2f}x tokens/s")
    print_fn(f"one decode step of {batch} sequences (median of alternated runs):")
    for c, (t_contiguous, t_paged) in steps.items():
        print_fn(f"  context {c:5d}: contiguous {t_contiguous * 1e3:7.1f} ms, paged {t_paged * 1e3:7.1f} ms, "
                 f"paged / contiguous {t_paged / t_contiguous:.2f}x")
    if all(forms.values()):
        print_fn(f"one layer's paged decode attention, {batch} sequences (median over the {model.config.num_layers} "
                 "layers' pools): the C kernel reading the pool in place against the copy + SDPA it replaces")
        for c, t in forms.items():
            print_fn(f"  context {c:5d}: in place {t['in place (C)'] * 1e3:6.3f} ms, copy + SDPA "
                     f"{t['copy + SDPA'] * 1e3:6.3f} ms ({t['copy + SDPA'] / t['in place (C)']:.2f}x the kernel), "
                     f"contiguous SDPA {t['contiguous'] * 1e3:6.3f} ms")
    return rows, steps
