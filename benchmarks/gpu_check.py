"""The Python part of benchmarks/gpu_check.sh: the engine's answers checked on a GPU, then one table of speeds.

    python benchmarks/gpu_check.py [--dry] [--budget SECONDS] [--parts PART ...]

It needs torch, triton and transformers, nothing else: no network, no `gguf`, no model weights. The model is
SmolLM2-135M's shape (30 layers, 9 query and 3 KV heads of 64) with random weights: whether two paths of the
engine agree, and how fast they run, does not depend on the weights' values. Every check prints a line and
counts; the exit status is 1 if any failed:
  - the kernel tests (tests/kernels) and the engine's tests of its kernels on a GPU (the quantized layers' Triton
    products, the Triton attention backend), natively;
  - the Triton attention backend against the torch one, step by step through the engine's caches (contiguous and
    paged: a prefill in two chunks, a decode step, a verify step of speculative decoding; logits and the cache's
    contents), in fp16 and, where the GPU has it, bf16; then whole requests through LLM, n-gram speculation on;
  - host syncs per engine step: counted, and no more of them with more layers or with more sampled rows;
  - LLM(compile=True) against the eager engine on the serving workload, request by request; its timed run's
    decode steps through the compiled graphs, and on a GPU replayed as CUDA graphs: none skipped, by Inductor's
    counter (with the reasons it logged).
Then one table: FlashAttention against SDPA (the fused kernel this GPU has) at N = 1k-16k, paged decode
attention's bandwidth against the GPU's peak, the serving workload eager against compiled, and vLLM on the same
workload and weights where vLLM is installed. Parts the time budget cannot fit are skipped, with a line saying so;
a part that raises (a kernel that does not compile, an out-of-memory) is a failed check with its traceback, and
the parts after it still run, so that one run on a lent GPU reports all it can.

--dry runs all of it on the CPU at tiny sizes, the kernels in Triton's interpreter, so that CI keeps this script
working (tests/test_gpu_check.py); its timings measure nothing. Greedy tokens are compared with a tie tolerance:
equal, or parted where the reference's two candidates scored within a rounding error of each other.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (here, or by the engine's kernels)
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import triton  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import bench_attention  # noqa: E402
from mini_engine.attention import AttentionMetadata  # noqa: E402
from mini_engine.bench.runs import ServingWorkload, hf_from_model, run_serving_rung  # noqa: E402
from mini_engine.config import PRESETS, ModelConfig  # noqa: E402
from mini_engine.course.devices import default_dtype, sdpa_backend  # noqa: E402
from mini_engine.engine import LLM  # noqa: E402
from mini_engine.kernels.paged_attention import (  # noqa: E402
    kv_bytes_read, paged_decode_attention, paged_decode_attention_reference, random_paged_inputs)
from mini_engine.kv_cache import ContiguousKVCache, PagedKVCache  # noqa: E402
from mini_engine.model import LlamaModel  # noqa: E402
from mini_engine.sampling import SamplingParams  # noqa: E402

# The gap between two candidate tokens, relative to the largest logit, under which a different greedy choice
# counts as a near-tie: a few times what rounding moves the logits by in that dtype (SmolLM2's shape, random
# weights, against fp32: at most 2e-3 in fp16, 1.6e-2 in bf16).
TIE_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 4e-2, torch.float32: 1e-4}
# The Triton backend's distance from the fp32 answer may be this many times the torch backend's, in the same
# dtype, plus a floor: it must be about as accurate, whatever rounding the dtype brings.
ERROR_RATIO, ERROR_FLOOR = 3.0, 1e-3


@dataclass(frozen=True)
class Sizes:
    config: ModelConfig
    prompt_lens: tuple[int, ...]    # the step-by-step backend check's three prompts
    requests: int                   # the serving workload: requests, their lengths, the batch
    lengths: tuple[int, int]
    batch: int
    attention_lens: tuple[int, ...]  # FlashAttention against SDPA
    heads: int
    tokens_in_flight: int
    paged: tuple[tuple[int, int], ...]  # paged decode: (sequences, context) pairs
    new_tokens: int = 16            # per request, where whole requests go through LLM.generate
    block_size: int = 16


GPU_SIZES = Sizes(PRESETS["smollm2-135m"], (300, 77, 513), 64, (16, 256), 16, (1024, 2048, 4096, 8192, 16384),
                  16, 1 << 18, ((16, 1024), (64, 1024), (16, 4096), (64, 4096)))
# The same shapes' proportions, small enough for Triton's interpreter: GQA 3:1, lengths off the block grid.
DRY_SIZES = Sizes(ModelConfig(vocab_size=256, hidden_size=48, intermediate_size=64, num_layers=2, num_heads=3,
                              num_kv_heads=1, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True),
                  (13, 7, 21), 4, (4, 12), 1, (48, 80), 2, 1 << 8, ((2, 40),), new_tokens=6, block_size=8)


class Report:
    """Each check's verdict, printed as it comes; `failed` counts the wrong answers."""

    def __init__(self):
        self.failed = 0
        self.start = time.perf_counter()

    def section(self, title: str) -> None:
        print(f"== {title} ({time.perf_counter() - self.start:.0f} s so far)", flush=True)

    def check(self, ok: bool, what: str, detail: str = "") -> bool:
        self.failed += not ok
        print(f"  {'ok  ' if ok else 'FAIL'} {what}{': ' + detail if detail else ''}", flush=True)
        return ok


def random_model(config: ModelConfig, device: str, dtype: torch.dtype, seed: int = 0) -> LlamaModel:
    """The shape with random weights: the embeddings small, N(0, 0.02) as transformers initialises a Llama, the
    linear layers PyTorch's default (outputs of order one), so that what the layers add, which depends on the
    context, outweighs a token's own embedding in the last hidden state. (With the embeddings of order one,
    the tied output layer would pick the input token again at every position, whatever attention did.)"""
    torch.manual_seed(seed)
    model = LlamaModel(config)
    torch.nn.init.normal_(model.embed_tokens.weight, std=0.02)
    return model.to(device=device, dtype=dtype).eval()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()


# ---------------------------------------------------------------- the kernel tests


def run_kernel_tests(report: Report, dry: bool, timeout_s: float) -> None:
    """tests/kernels natively on the GPU, real sizes included, and the engine's tests of its kernels on a GPU:
    the quantized layers' Triton products (eager and in a compiled step) and the Triton attention backend. Left
    out: the ahead-of-time compilation for a T4, an A100 and an H100 (every `make test` checks it, with no GPU
    needed) and the online-softmax widget (not a kernel; ipywidgets). A dry run keeps the tests named for a GPU
    (skipped on a CPU, or in the interpreter): it proves that they still collect and import here."""
    report.section("the kernel tests: tests/kernels, and the engine's on a GPU")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "--durations=5", "-p", "no:cacheprovider", "tests/kernels",
           "--ignore=tests/kernels/test_aot.py", "--ignore=tests/kernels/test_online_softmax.py",
           "tests/engine/test_quant_gpu.py", "tests/engine/test_triton_backend.py"]
    if timeout_s < 30:
        report.check(False, "kernel tests", f"not run: {max(timeout_s, 0):.0f} s left in the budget")
        return
    try:
        rc = subprocess.run(cmd + (["-k", "gpu"] if dry else []), cwd=ROOT, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        report.check(False, "kernel tests", f"not done within {timeout_s:.0f} s")
        return
    report.check(rc == 0, "kernel tests", f"pytest exit status {rc}")


# ---------------------------------------------------------------- the attention backends, step by step


def engine_steps(model, backend: str, kv_cache: str, prompt_lens, block_size: int) -> list[torch.Tensor]:
    """Logits of the steps the engine takes, through its cache: three prompts prefilled in two chunks (the second
    attends to keys the first wrote), a decode step for all three, a verify step (five tokens each: one new and
    four drafts, as speculative decoding checks them); last, the cache's contents."""
    config, device = model.config, model.device
    gen = torch.Generator().manual_seed(1)
    total = [n + 1 + 5 for n in prompt_lens]
    tokens = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in total]
    if kv_cache == "contiguous":
        cache = ContiguousKVCache(config, len(total), max(total), device, model.dtype)
        where = {"slots": list(range(len(total)))}
    else:
        needed = [-(-n // block_size) for n in total]
        order = torch.randperm(sum(needed) + 2, generator=gen).tolist()  # shuffled, as a used pool leaves them
        tables = [order[sum(needed[:i]):sum(needed[:i + 1])] for i in range(len(total))]
        cache = PagedKVCache(config, sum(needed) + 2, block_size, device, model.dtype)
        where = {"block_tables": tables, "block_size": block_size}
    first = [n // 2 for n in prompt_lens]
    steps = [(first, first), ([n - f for n, f in zip(prompt_lens, first)], list(prompt_lens)),
             ([1] * 3, [n + 1 for n in prompt_lens]), ([5] * 3, total)]
    out = []
    for query_lens, context_lens in steps:
        meta = AttentionMetadata.build(query_lens, context_lens, device=device, **where)
        ids = torch.tensor([t for seq, q, c in zip(tokens, query_lens, context_lens) for t in seq[c - q:c]],
                           device=device)
        with torch.no_grad():
            out.append(model(ids, meta, cache, backend=backend))
    return out + [cache.data]


def near_tie(model, prompt: list[int], got: list[int], want: list[int], tolerance: float) -> tuple[bool, str]:
    """Equal, or parted where the reference's two candidates scored within `tolerance` of its largest logit."""
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None:
        return (len(got) == len(want)), f"{len(got)} tokens against {len(want)}"
    with torch.no_grad():
        logits = model(torch.tensor([prompt + want[:i]], device=model.device), backend="torch", last_only=True)[0, -1]
    gap = (logits[want[i]] - logits[got[i]]).abs().item() / logits.abs().max().item()
    return gap <= tolerance, f"parted at token {i}, candidates {gap:.1e} of the largest logit apart"


def compare_outputs(model, prompts, got, want, tolerance: float) -> tuple[bool, str]:
    """Request by request: the same greedy tokens, or a near-tie where they part."""
    verdicts = [near_tie(model, p, a, b, tolerance) for p, a, b in zip(prompts, got, want)]
    same = sum(a == b for a, b in zip(got, want))
    bad = [why for ok, why in verdicts if not ok]
    others = f"; not a near-tie: {bad[0]}" if bad else "; the others part at near-ties" if same < len(got) else ""
    return not bad, f"{same}/{len(got)} requests identical{others}"


def check_backends(report: Report, sizes: Sizes, device: str, dtypes: list[torch.dtype]) -> None:
    """Each step's logits (and the cache) from both backends against the torch backend in fp32 on the same
    weights: the Triton backend's error may not exceed a few times the torch backend's."""
    report.section("the Triton attention backend against the torch backend")
    for dtype in dtypes:
        model = random_model(sizes.config, device, dtype)
        exact = copy.deepcopy(model).float()
        name = str(dtype).removeprefix("torch.")
        for kv_cache in ("contiguous", "paged"):
            want = engine_steps(exact, "torch", kv_cache, sizes.prompt_lens, sizes.block_size)
            runs = [engine_steps(model, b, kv_cache, sizes.prompt_lens, sizes.block_size) for b in ("torch", "triton")]
            for what, w, t, g in zip(("prefill chunk 1", "prefill chunk 2", "decode", "verify", "cache"), want, *runs):
                ours, theirs = relative_error(g, w), relative_error(t, w)
                report.check(ours <= ERROR_RATIO * theirs + ERROR_FLOOR, f"{name} {kv_cache} {what}",
                             f"triton {ours:.1e}, torch {theirs:.1e} from fp32 (of the largest value)")
        del exact
        # Whole requests through LLM: prompts that repeat themselves, so that n-gram speculation drafts and verifies.
        gen = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, sizes.config.vocab_size, (n // 3,), generator=gen).tolist() * 3
                   for n in sizes.prompt_lens]
        params = SamplingParams(max_tokens=sizes.new_tokens, ignore_eos=True)
        for kv_cache in ("contiguous", "paged"):
            outs = {b: [o.token_ids for o in LLM.from_model(
                model, attention_backend=b, kv_cache=kv_cache, max_num_seqs=4, block_size=sizes.block_size,
                speculative={"method": "ngram", "k": 4}).generate(prompts, params, use_tqdm=False)]
                for b in ("torch", "triton")}
            ok, detail = compare_outputs(model, prompts, outs["triton"], outs["torch"], TIE_TOLERANCE[dtype])
            report.check(ok, f"{name} {kv_cache} LLM.generate, n-gram speculation", detail)
        del model


# ---------------------------------------------------------------- host syncs


class _ScalarReads(TorchDispatchMode):
    """Counts the operations that make the host wait for a GPU's answer: a scalar read (`.item()`, `int(t)`) or
    an output whose size depends on the data."""
    WAITING = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique_consecutive"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func._schema.name in self.WAITING
        return func(*args, **(kwargs or {}))


def count_host_syncs(fn, device: str) -> int:
    """How often fn() makes the host wait. On a GPU: every synchronising CUDA call torch's sync debug mode
    reports (a copy from or to pageable host memory, a scalar read, an explicit synchronize). On a CPU nothing
    waits; what is counted there is what would on a GPU: scalar reads and data-sized outputs."""
    if not device.startswith("cuda"):
        with _ScalarReads() as counter:
            fn()
        return counter.count
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def syncs_per_step(config: ModelConfig, device: str, dtype: torch.dtype, rows: int, decode_steps: int = 4):
    """Host syncs of one engine step: (the prefill step's, the mean of the decode steps'), `rows` requests
    sampled at temperature 0.8, each with its own seed, on the paged cache and the backend a GPU runs."""
    model = random_model(config, device, dtype)
    llm = LLM.from_model(model, attention_backend="triton", max_num_seqs=max(rows, 1), max_model_len=64)
    for i in range(rows):
        llm.engine.add_request(list(range(3 + i, 15 + i)), SamplingParams(temperature=0.8, seed=i, max_tokens=8,
                                                                          ignore_eos=True))
    counts = [count_host_syncs(llm.engine.step, device) for _ in range(1 + decode_steps)]
    return counts[0], sum(counts[1:]) / decode_steps


def check_host_syncs(report: Report, sizes: Sizes, device: str, dtype: torch.dtype) -> dict:
    report.section("host syncs per engine step (the host waiting for the device)")
    one, two = (replace(sizes.config, num_layers=n) for n in (1, 2))
    base = syncs_per_step(one, device, dtype, rows=2)
    layers = syncs_per_step(two, device, dtype, rows=2)
    rows = syncs_per_step(one, device, dtype, rows=6)
    full = syncs_per_step(sizes.config, device, dtype, rows=sizes.batch)
    report.check(layers == base, "no sync inside a layer", f"prefill/decode step: {base[0]}/{base[1]:g} with one "
                 f"layer, {layers[0]}/{layers[1]:g} with two")
    report.check(rows[1] == base[1], "no sync per sampled row", f"decode step: {base[1]:g} with 2 rows sampled, "
                 f"{rows[1]:g} with 6")
    print(f"  {sizes.config.num_layers} layers, {sizes.batch} requests sampled: {full[0]} syncs in the prefill step, "
          f"{full[1]:g} per decode step")
    return {"prefill": full[0], "decode": full[1]}


# ---------------------------------------------------------------- the compiled engine and the serving workload


class CudagraphSkips(logging.Handler):
    """While inside: Inductor's count of the graphs it meant to run as CUDA graphs and ran without them
    (`torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]`), and the reasons it logged ("skipping
    cudagraphs due to ...", which TORCH_LOGS=cudagraphs prints too)."""

    def __enter__(self):
        from torch._inductor.cudagraph_utils import cudagraphs_log

        self.log, self.reasons, self.count = cudagraphs_log, [], 0
        self.log.addHandler(self)
        self.before = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
        return self

    def emit(self, record: logging.LogRecord) -> None:
        self.reasons.append(record.getMessage())

    def __exit__(self, *exc):
        self.log.removeHandler(self)
        self.count = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] - self.before
        return False


def check_compiled(report: Report, sizes: Sizes, device: str, dtype: torch.dtype, left) -> dict:
    """The serving workload on the eager engine and on LLM(compile=True): the same tokens, both rows timed, and
    on a GPU every compiled step replayed as a CUDA graph (none skipped, by Inductor's counter). `left()`: the
    seconds left for it."""
    report.section("LLM(compile=True) against the eager engine, on the serving workload")
    model = random_model(sizes.config, device, dtype)
    work = ServingWorkload.uniform(sizes.requests, *sizes.lengths, vocab=sizes.config.vocab_size)
    warm = ServingWorkload.uniform(2, 4, 8, vocab=sizes.config.vocab_size, seed=1)
    run_serving_rung(model, None, "continuous", warm, sizes.batch, print_fn=lambda *a: None)  # first-use costs
    rows = {"eager": run_serving_rung(model, None, "continuous", work, sizes.batch, name="eager engine")}
    if left() < 60:
        print(f"  skipped: {left():.0f} s left in the time budget, too few to compile")
        return {"model": model, "work": work, **rows}
    try:
        with CudagraphSkips() as skips:  # compiling (the warm-up) and the timed run
            rows["compiled"] = run_serving_rung(model, None, "compiled-engine", work, sizes.batch,
                                                name="compiled engine", print_fn=lambda m: print(f"  {m}"))
    except Exception as e:  # a graph compiled inside the timed run, or one that failed to compile: eager stays
        traceback.print_exc()
        report.check(False, "compiled engine", f"{type(e).__name__}: {e}")
        return {"model": model, "work": work, **rows}
    graph_steps = rows["compiled"].graph_steps
    print(f"  {graph_steps} steps of the timed run went through a compiled graph; CUDA graphs skipped "
          f"(Inductor's counters['inductor']['cudagraph_skips']): {skips.count}")
    report.check(graph_steps > 0, "LLM(compile=True) runs its decode steps through the compiled graphs")
    if device == "cuda":
        report.check(skips.count == 0, "LLM(compile=True) replays its decode steps as CUDA graphs",
                     "; ".join(dict.fromkeys(skips.reasons)) or f"{skips.count} graph(s) skipped")
    else:
        print("  (a CPU has no CUDA graphs: not checked)")
    ok, detail = compare_outputs(model, work.prompts, rows["compiled"].token_ids, rows["eager"].token_ids,
                                 TIE_TOLERANCE[dtype])
    report.check(ok, "LLM(compile=True) against eager, greedy", detail)
    return {"model": model, "work": work, **rows}


VLLM_SCRIPT = """
import json, sys, time
from vllm import LLM, SamplingParams
folder, dtype, work, out = sys.argv[1:]
work = json.load(open(work))
llm = LLM(model=folder, dtype=dtype, skip_tokenizer_init=True, gpu_memory_utilization=0.5, seed=0,
          max_model_len=work["max_model_len"], max_num_seqs=work["batch"])
prompts = [{"prompt_token_ids": p} for p in work["prompts"]]
params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in work["outputs"]]
llm.generate(prompts[:2], params[:2], use_tqdm=False)
t0 = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
seconds = time.perf_counter() - t0
json.dump({"seconds": seconds, "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}, open(out, "w"))
"""


def run_vllm(model, work: ServingWorkload, batch: int, dtype: torch.dtype, budget_s: float) -> tuple[float, str]:
    """vLLM on the same weights and workload, in a process of its own (it keeps its GPU memory until it exits):
    (tokens/s, "") or (None, why not). Without vLLM, the HF folder it would read is still written and read back,
    so the export cannot rot."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        hf_from_model(model).save_pretrained(folder)
        written = sum(f.stat().st_size for f in folder.iterdir())
        if importlib.util.find_spec("vllm") is None:
            return None, f"vLLM is not installed (its HF folder was written: {written / 2**20:.1f} MiB)"
        if not torch.cuda.is_available():
            return None, "vLLM runs on a GPU only"
        spec = {"prompts": work.prompts, "outputs": work.output_lens, "batch": batch, "max_model_len": work.longest}
        (Path(tmp) / "work.json").write_text(json.dumps(spec))
        out = Path(tmp) / "out.json"
        try:
            done = subprocess.run([sys.executable, "-c", VLLM_SCRIPT, str(folder), str(dtype).removeprefix("torch."),
                                   str(Path(tmp) / "work.json"), str(out)], capture_output=True, text=True,
                                  timeout=max(budget_s, 1))
        except subprocess.TimeoutExpired:
            return None, f"vLLM did not finish within the {budget_s:.0f} s left"
        if done.returncode != 0 or not out.exists():
            return None, f"vLLM failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}"
        result = json.loads(out.read_text())
        return result["tokens"] / result["seconds"], ""


# ---------------------------------------------------------------- kernels: speed


def peak_bandwidth() -> float | None:
    """The GPU's memory bandwidth from its datasheet figures, as the driver reports them: two transfers per
    memory clock (DDR) times the bus width. None where the driver does not say (or on a CPU)."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None


def paged_decode_bandwidth(report: Report, seqs: int, context: int, sizes: Sizes, device: str,
                           dtype: torch.dtype) -> float:
    """GB/s of K/V the paged decode kernel reads at SmolLM2's heads, after checking it against the reference."""
    c = sizes.config
    inputs = random_paged_inputs([context] * seqs, c.num_heads, c.num_kv_heads, c.head_dim, sizes.block_size,
                                 dtype, device)
    expected = paged_decode_attention_reference(*inputs)
    error = (paged_decode_attention(*inputs).float() - expected.float()).abs().max().item()
    report.check(error <= bench_attention.TOLERANCE[dtype], f"paged decode, {seqs} x {context}",
                 f"max |kernel - reference| = {error:.1e}")
    ms = bench_attention.time_ms(lambda: paged_decode_attention(*inputs), device)
    return kv_bytes_read(inputs[4], inputs[1]) / (ms * 1e-3) / 1e9


def copy_bandwidth(device: str, num_bytes: int = 1 << 28) -> float:
    """GB/s of a device-to-device copy (read and write both counted): what the memory sustains in practice."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench_attention.time_ms(lambda: dst.copy_(src), device)
    return 2 * num_bytes / (ms * 1e-3) / 1e9


# ---------------------------------------------------------------- the run


def environment(device: str, dry: bool) -> list[torch.dtype]:
    """Print what this runs on; return the dtypes to check (fp16, and bf16 where the GPU multiplies it; a dry
    run, fp16 alone)."""
    print(f"== python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"CUDA {torch.version.cuda or '-'}")
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        print(f"== GPU: {props.name}, compute capability {props.major}.{props.minor}, "
              f"{props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs; the course's dtype here: "
              f"{default_dtype(device)}; SDPA's kernel: {sdpa_backend(device, torch.float16).name}")
    else:
        print("== dry run on the CPU: tiny sizes, the kernels in Triton's interpreter; the times measure nothing")
    return [torch.float16] + ([torch.bfloat16] if default_dtype(device) == "bfloat16" else [])


class OutOfTime(BaseException):
    """SIGTERM, from the shell script's `timeout`: stop where the run is and print what it measured. A
    BaseException, so that no `except Exception` on the way (Inductor has some) swallows it."""


def _out_of_time(signum, frame):
    raise OutOfTime


def guarded(report: Report, what: str, part) -> list[tuple]:
    """`part()`'s table rows. A part that raises (a kernel that does not compile on this GPU, an out-of-memory) is
    a failed check, printed with its traceback, and the parts after it still run: one run on a lent GPU reports
    all it can. OutOfTime is a BaseException: it still stops the run."""
    try:
        return part() or []
    except Exception as e:
        traceback.print_exc()
        report.check(False, what, f"{type(e).__name__}: {e}")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # what the failed part held (an out-of-memory's tensors) goes back to the GPU
    return []


def host_sync_rows(report: Report, sizes: Sizes, device: str, dtype: torch.dtype) -> list[tuple]:
    syncs = check_host_syncs(report, sizes, device, dtype)
    return [("host syncs per step", f"{sizes.config.num_layers} layers, {sizes.batch} requests",
             f"{syncs['decode']:g} per decode step", f"{syncs['prefill']} in the prefill step", "-")]


def attention_rows(report: Report, sizes: Sizes, device: str, dtypes: list[torch.dtype], left) -> list[tuple]:
    """FlashAttention against SDPA (the fused kernel this GPU has), causal, each size checked first."""
    report.section(f"speed, {left():.0f} s of the budget left: FlashAttention against SDPA")
    rows = []
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        for n in sizes.attention_lens:
            if left() < 60:
                print(f"  FlashAttention at N = {n}, {name}: skipped, {left():.0f} s left in the budget")
                continue
            r = bench_attention.compare(n, sizes.config.head_dim, dtype, True, device, sizes.heads,
                                        sizes.tokens_in_flight, naive=False)
            report.check(r["ok"], f"FlashAttention, N = {n}, {name}",
                         f"max |kernel - reference| = {r['ours_error']:.1e} (SDPA's: {r['sdpa_error']:.1e})")
            rows.append((f"FlashAttention / SDPA ({r['sdpa_kernel'].lower()})",
                         f"{name} N={n} d={sizes.config.head_dim} {r['batch']}x{r['heads']}",
                         f"{r['ours']:.3g} TFLOP/s", f"{r['sdpa']:.3g} TFLOP/s", f"{r['ours'] / r['sdpa']:.2f}x"))
    return rows


def bandwidth_rows(report: Report, sizes: Sizes, device: str, dtype: torch.dtype, left) -> list[tuple]:
    """Paged decode attention's K/V bandwidth, and a plain copy's, against the GPU's peak."""
    peak = peak_bandwidth()

    def of_peak(gbs):
        return (f"{peak / 1e9:.0f} GB/s", f"{gbs * 1e9 / peak:.0%}") if peak else ("unknown", "-")

    copy = copy_bandwidth(device, 1 << 28 if device.startswith("cuda") else 1 << 20)
    rows = [("device copy / peak", "read + write", f"{copy:.3g} GB/s", *of_peak(copy))]
    for seqs, context in sizes.paged:
        if left() < 30:
            print(f"  paged decode, {seqs} x {context}: skipped, {left():.0f} s left in the budget")
            continue
        gbs = paged_decode_bandwidth(report, seqs, context, sizes, device, dtype)
        rows.append(("paged decode / peak", f"{str(dtype).removeprefix('torch.')} {seqs} seqs x {context} ctx",
                     f"{gbs:.3g} GB/s", *of_peak(gbs)))
    return rows


def serving_rows(report: Report, sizes: Sizes, device: str, dtype: torch.dtype, left) -> list[tuple]:
    """The compiled engine checked against eager on the serving workload, both timed; vLLM beside them."""
    serving = check_compiled(report, sizes, device, dtype, lambda: left() - 60)  # a minute kept for vLLM
    work, eager, compiled = serving["work"], serving["eager"], serving.get("compiled")
    setting = f"{work.name}, batch {sizes.batch}"
    rows = [("serving: compiled / eager", setting, f"{compiled.tok_s:.3g} tok/s" if compiled else "skipped",
             f"{eager.tok_s:.3g} tok/s", f"{compiled.tok_s / eager.tok_s:.2f}x" if compiled else "-")]
    vllm, why = run_vllm(serving["model"], work, sizes.batch, dtype, left() - 10)
    best = compiled or eager
    rows.append(("serving: ours / vLLM", setting, f"{best.tok_s:.3g} tok/s ({'compiled' if compiled else 'eager'})",
                 f"{vllm:.3g} tok/s" if vllm else why, f"{best.tok_s / vllm:.2f}x" if vllm else "-"))
    return rows


# In the order they run. The kernel tests go last, with what is left of the budget (at most 210 s): the engine's
# checks go through the same kernels, and the speeds can be measured nowhere but on the GPU.
PARTS = ("backends", "syncs", "attention", "bandwidth", "serving", "kernel-tests")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="on the CPU, at tiny sizes (what CI runs)")
    parser.add_argument("--budget", type=float, default=450, help="seconds this run may take (parts past it skip)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS,
                        help="run only these parts (to finish on a second run what the budget cut from the first)")
    args = parser.parse_args(argv)
    if args.dry == torch.cuda.is_available():
        print("--dry runs on a CPU (CUDA_VISIBLE_DEVICES= hides the GPU); without it this needs a GPU")
        return 2
    device, sizes = ("cpu", DRY_SIZES) if args.dry else ("cuda", GPU_SIZES)
    report = Report()
    left = lambda: args.budget - (time.perf_counter() - report.start)  # noqa: E731
    dtypes = environment(device, args.dry)
    dtype = getattr(torch, default_dtype(device))  # the course's dtype here: float32 in a dry run
    signal.signal(signal.SIGTERM, _out_of_time)
    rows = []  # (measure, setting, ours, reference, ratio)
    parts = {"backends": lambda: check_backends(report, sizes, device, dtypes),
             "syncs": lambda: host_sync_rows(report, sizes, device, dtype),
             "attention": lambda: attention_rows(report, sizes, device, dtypes, left),
             "bandwidth": lambda: bandwidth_rows(report, sizes, device, dtype, left),
             "serving": lambda: serving_rows(report, sizes, device, dtype, left),
             "kernel-tests": lambda: run_kernel_tests(report, args.dry, min(210.0, left() - 15))}
    try:
        for name in PARTS:
            if name in args.parts:
                rows += guarded(report, name, parts[name])
    except OutOfTime:
        report.check(False, "the time budget", "stopped by the shell script's timeout; the table holds what was done")
    gpu = torch.cuda.get_device_name() if device == "cuda" else "no GPU (dry run)"
    print(f"\n{gpu}, torch {torch.__version__}, triton {triton.__version__}, {str(dtype).removeprefix('torch.')}; "
          f"{time.perf_counter() - report.start:.0f} s")
    if rows:
        bench_attention.print_table(["measure", "setting", "ours", "reference", "ratio"], [list(r) for r in rows])
    print(f"\n{report.failed} check(s) failed" if report.failed else "\nevery check passed")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
