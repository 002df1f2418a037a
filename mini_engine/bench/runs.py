"""`python -m mini_engine bench`: each rung of the ladder and HF transformers on one workload, in one run.

Every row is measured in the same process on the same prompts, so the ratio column compares like with like.
Two workloads: one chat prompt streamed by one request (rungs `naive`, `cached`, `compiled`), and the serving workload
(rungs `static`, `dynamic`, `continuous`, and `compiled-engine`: continuous with LLM(compile=True)): N requests
with prompt and output lengths uniform in a range, ignore_eos, served by our engine under each policy and by HF
transformers' static batched `generate`. Compiling is a one-time cost, like vLLM's CUDA-graph capture: it is
done before a compiled row's clock starts, and printed apart.

`quantization="int4"` (or "int8", chapter 10) adds the quantized model's rows beside the float ones in the same
run: one stream cached, compiled and compiled with the C++ wrapper, and llama.cpp (llama-cpp-python, when it is
installed) decoding the same GGUF file with the same prompt tokens and thread count; on the serving workload,
each rung with the quantized model.
"""
from __future__ import annotations

import functools
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

import torch

from ..generate import generate_cached, generate_naive
from ..course.hardware import describe_machine, matmul_floor_tok_s
from ..backends.cpu import format_tuned_forms, warm_up
from ..course.metrics import TokenTimer, percentile
from ..sampling import SamplingParams

SINGLE_STREAM_RUNGS = ("naive", "cached", "compiled")
SERVING_RUNGS = ("continuous", "static", "dynamic", "compiled-engine", "compiled-engine-max-autotune")
DEFAULT_SERVING_RUNGS = SERVING_RUNGS[:3]  # compiled-engine compiles for minutes: asked for by name

BENCH_PROMPT = [{"role": "user", "content": "Explain, step by step, how a bicycle stays upright while moving."}]


@dataclass
class Row:
    system: str
    workload: str
    tokens: int
    seconds: float
    ttft: list[float]
    tpot: list[float]
    kv_bytes: int | None = None
    peak_running: int | None = None   # serving: most requests admitted at once
    num_preemptions: int = 0          # serving, paged cache: requests sent back to recompute
    compile_s: float | None = None    # compiled rows: the one-time compile, before `seconds` started
    token_ids: list[list[int]] | None = field(default=None, repr=False)  # serving: each request's output
    graph_steps: int | None = None    # compiled rows: steps of the timed run that went through a compiled graph

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def _single_stream(name, workload, fn, device) -> Row:
    timer = TokenTimer(device).begin()
    out = fn(timer.on_token)
    return Row(name, workload, len(out), timer.e2e_s, [timer.ttft_s], [timer.tpot_s])


def run_mini(model, rung: str, prompt: list[int], new_tokens: int, print_fn=print, label: str = "") -> Row:
    """One stream of `rung` ("naive", "cached", "compiled" or "compiled-cpp": the C++-wrapper graph); `label`
    names the weights in the row (e.g. "int4")."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    loop = {"naive": generate_naive, "cached": generate_cached,
            "compiled": functools.partial(generate_cached, compile=True),
            "compiled-cpp": functools.partial(generate_cached, compile="cpp")}[rung]
    name = f"mini_engine {label + ' ' if label else ''}{rung}"
    if rung.startswith("compiled"):  # compiling is a one-time cost, like vLLM's CUDA-graph capture: timed apart
        t0 = time.perf_counter()
        loop(model, prompt, 2, SamplingParams(max_tokens=2, ignore_eos=True))
        print_fn(f"{name}: the first call compiled the decode step in {time.perf_counter() - t0:.1f} s "
                 "(not in its row)")
    row = _single_stream(name, f"1 x {len(prompt)}+{new_tokens}",
                         lambda cb: loop(model, prompt, new_tokens, params, on_token=cb), str(model.device))
    if rung != "naive":
        from ..course.formulas import kv_cache_bytes
        c = model.config
        row.kv_bytes = kv_cache_bytes(c.num_layers, c.num_kv_heads, c.head_dim, len(prompt) + new_tokens, 1,
                                      model.dtype.itemsize)
    return row


def load_hf(device: str, dtype: torch.dtype, model=None):
    """HF transformers' Llama (its modeling code, its `generate`): the reference every rung is compared with.
    With `model` (float weights), HF's model is built holding the same weights: they are the floats
    transformers' own GGUF loader gives (tests/engine/test_hf_equivalence.py checks every tensor), and building
    takes a second where that loader, which parses the file and converts its tokenizer, took 15-25 s on a
    2-core CPU. Without `model`, transformers loads the embedded GGUF itself."""
    import transformers

    transformers.logging.set_verbosity_error()
    if model is not None and model.quantization is None:
        return hf_from_model(model).to(device=device, dtype=dtype).eval()
    from ..loading.loader import embedded_gguf_path
    path = embedded_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return hf.to(device).eval()


def hf_from_model(model):
    """transformers' LlamaForCausalLM with `model`'s config and weights (fp32, on the CPU): the fused q/k/v and
    gate/up products split back into HF's separate ones."""
    import transformers

    c = model.config
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta})
    weights = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight}
    if not c.tie_word_embeddings:
        weights["lm_head.weight"] = model.lm_head.weight
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        weights.update(zip([p + f"self_attn.{n}_proj.weight" for n in "qkv"],
                           layer.self_attn.qkv_proj.weight.split([q, kv, kv])))
        weights.update(zip([p + f"mlp.{n}_proj.weight" for n in ("gate", "up")],
                           layer.mlp.gate_up_proj.weight.chunk(2)))
        weights[p + "self_attn.o_proj.weight"] = layer.self_attn.o_proj.weight
        weights[p + "mlp.down_proj.weight"] = layer.mlp.down_proj.weight
        weights[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        weights[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    hf = transformers.LlamaForCausalLM(config)
    hf.load_state_dict({k: w.detach().float().cpu() for k, w in weights.items()}, strict=not c.tie_word_embeddings)
    if c.tie_word_embeddings:
        hf.tie_weights()
    return hf


def run_hf(hf, prompt: list[int], new_tokens: int, use_cache: bool) -> Row:
    """HF `generate`, greedy, no early stop; a streamer-like hook times each token."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    device = str(hf.device)
    timer = TokenTimer(device)

    class Stamp(StoppingCriteria):  # called once per generated token: a cheap way to time each one
        def __call__(self, input_ids, scores, **kwargs):
            timer.on_token()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    ids = torch.tensor([prompt], device=hf.device)
    timer.begin()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, use_cache=use_cache,
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                          stopping_criteria=StoppingCriteriaList([Stamp()]))
    tag = "cached" if use_cache else "no cache"
    return Row(f"HF transformers ({tag})", f"1 x {len(prompt)}+{new_tokens}", out.shape[1] - len(prompt),
               timer.e2e_s, [timer.ttft_s], [timer.tpot_s])


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def run_llama_cpp(prompt: list[int], new_tokens: int, threads: int | None = None, repeats: int = 2) -> Row:
    """llama.cpp (llama-cpp-python) on the embedded GGUF file itself, greedy (top_k=1), the same prompt token
    ids (the GGUF's vocabulary is ours), `threads` threads for prefill and decode (default: torch's). The best
    of `repeats` runs after a warm-up, as our rows are measured after theirs."""
    import llama_cpp

    from ..loading.loader import embedded_gguf_path
    threads = threads or torch.get_num_threads()
    llm = llama_cpp.Llama(model_path=str(embedded_gguf_path()), n_threads=threads, n_threads_batch=threads,
                          n_ctx=max(512, len(prompt) + new_tokens + 8), verbose=False)

    def once(n):
        # llama-cpp-python keeps the last prompt's KV cache and, given the same prompt again, evaluates only its
        # last token: emptied here, so that its TTFT holds the whole prefill, as our rows' TTFT does.
        llm.reset()
        timer = TokenTimer("cpu").begin()
        out = []
        for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):  # never stops by itself (no EOS check)
            timer.on_token()
            out.append(token)
            if len(out) == n:
                break
        return out, timer
    once(4)
    best = None
    for _ in range(repeats):
        out, timer = once(new_tokens)
        if best is None or timer.e2e_s < best[1].e2e_s:
            best = (out, timer)
    out, timer = best
    return Row(f"llama.cpp Q4_1 GGUF ({threads} thr)", f"1 x {len(prompt)}+{new_tokens}", len(out), timer.e2e_s,
               [timer.ttft_s], [timer.tpot_s])


def in_child_process(fn, *args):
    """fn(*args) in a fresh (spawned) Python process, its result returned here. A crash in native code there (a
    segmentation fault in a third-party library) raises RuntimeError here instead of ending this process."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(fn, *args).result()
        except BrokenProcessPool as e:
            raise RuntimeError(f"{getattr(fn, '__name__', fn)} crashed its process") from e


def run_llama_cpp_isolated(prompt: list[int], new_tokens: int, threads: int | None = None,
                           print_fn=print) -> Row | None:
    """`run_llama_cpp` in a child process, with this process's thread count: a llama.cpp build that crashes on
    this machine costs its row, not the bench (llama-cpp-python 0.3.36 built on a 2-core Xeon with AMX crashed
    with a segmentation fault in `ggml_backend_amx_mul_mat` on a 40-token prompt, while its own one-token
    completions ran; built with GGML_NATIVE=OFF and AMX left out, it ran)."""
    try:
        return in_child_process(run_llama_cpp, prompt, new_tokens, threads or torch.get_num_threads())
    except RuntimeError as e:
        print_fn(f"llama.cpp: no row ({e}: the installed llama-cpp-python fails on this machine)")
        return None


def format_table(rows: list[Row], baseline: Row | None) -> str:
    head = (f"{'system':<30} {'workload':<18} {'tokens':>6} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'TPOT p50':>9} {'TPOT p99':>9} {'peak KV':>9} {'ratio':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        kv = f"{r.kv_bytes / 2**20:.1f}MiB" if r.kv_bytes else "-"
        ratio = f"{r.tok_s / baseline.tok_s:.2f}x" if baseline else "-"
        lines.append(f"{r.system:<30} {r.workload:<18} {r.tokens:>6} {r.tok_s:>8.2f} "
                     f"{percentile(r.ttft, 50) * 1e3:>7.1f}ms {percentile(r.ttft, 99) * 1e3:>7.1f}ms "
                     f"{percentile(r.tpot, 50) * 1e3:>7.1f}ms {percentile(r.tpot, 99) * 1e3:>7.1f}ms "
                     f"{kv:>9} {ratio:>7}")
    return "\n".join(lines)


def bench(rungs: list[str], new_tokens: int, device: str, dtype: str, with_hf: bool = True, warmup: bool = True,
          hf_dtype: str | None = None, print_fn=print, quantization: str | None = None,
          with_llama_cpp: bool = True) -> list[Row]:
    """Single stream: HF transformers (in `hf_dtype`, default the same dtype) then our rungs, one prompt. With
    `quantization`, the quantized model's cached and compiled rows follow (its compiled rung also with the C++
    wrapper), then llama.cpp on the same GGUF when llama-cpp-python is installed (`with_llama_cpp`)."""
    from ..loading.loader import load_model

    model, tok = load_model("smollm2-135m", device=device, dtype=dtype)
    prompt = tok.encode(tok.apply_chat_template(BENCH_PROMPT))
    if warmup:  # first calls pay for allocator growth, lazy init and tuning; keep them out of the numbers
        warm_up(model, (1, len(prompt)))
        generate_cached(model, prompt, 4, SamplingParams(max_tokens=4, ignore_eos=True))
    rows = []
    if with_hf:
        try:
            hf = load_hf(device, getattr(torch, hf_dtype) if hf_dtype else model.dtype, model)
        except ImportError:
            print_fn("transformers is not installed: HF rows skipped (pip install -e '.[dev]')")
        else:
            for use_cache in ([False] if rungs == ["naive"] else [False, True]):
                if not use_cache and "naive" not in rungs:
                    continue
                if warmup:  # HF's first call pays for lazy init too: warm it as ours is warmed
                    run_hf(hf, prompt, 4, use_cache)
                rows.append(run_hf(hf, prompt, new_tokens, use_cache))
            del hf
    for rung in rungs:
        rows.append(run_mini(model, rung, prompt, new_tokens, print_fn))
    float_rows = rows[len(rows) - len(rungs):]
    quant_rows = []
    if quantization is not None:
        qmodel, _ = load_model("smollm2-135m", device=device, dtype=dtype, quantization=quantization)
        if warmup:
            warm_up(qmodel, (1, len(prompt)))
            generate_cached(qmodel, prompt, 4, SamplingParams(max_tokens=4, ignore_eos=True))
        qrungs = [r for r in rungs if r != "naive"]
        if "compiled" in qrungs and device == "cpu":
            qrungs.append("compiled-cpp")
        quant_rows = [run_mini(qmodel, rung, prompt, new_tokens, print_fn, label=quantization) for rung in qrungs]
        rows += quant_rows
        if with_llama_cpp and device == "cpu":
            if llama_cpp_available():
                rows += [r for r in [run_llama_cpp_isolated(prompt, new_tokens, print_fn=print_fn)] if r]
            else:
                print_fn("llama-cpp-python is not installed: no llama.cpp row (pip install llama-cpp-python builds "
                         "it from source in about five minutes)")
    baseline = rows[0] if rows else None
    print_fn(describe_machine(device))
    print_fn(f"device={device} dtype={dtype} threads={torch.get_num_threads()} "
             f"prompt={len(prompt)} tokens, new={new_tokens} tokens (greedy, ignore_eos); ratio vs first row")
    print_fn(format_table(rows, baseline))
    by_name = {r.system: r for r in rows}
    naive, hf_cached = by_name.get("mini_engine naive"), by_name.get("HF transformers (cached)")
    for rung in ("cached", "compiled"):
        row = by_name.get(f"mini_engine {rung}")
        if row and hf_cached:
            print_fn(f"mini_engine {rung} ({dtype}) / HF cached ({hf_dtype or dtype}): "
                     f"{row.tok_s / hf_cached.tok_s:.2f}x")
        if row and naive:
            print_fn(f"mini_engine {rung} / mini_engine naive: {row.tok_s / naive.tok_s:.2f}x")
    cached, compiled = by_name.get("mini_engine cached"), by_name.get("mini_engine compiled")
    if cached and compiled:
        print_fn(f"mini_engine compiled / mini_engine cached: {compiled.tok_s / cached.tok_s:.2f}x")
    if quant_rows:
        print_quantized(model, qmodel, quant_rows, float_rows, by_name, dtype, print_fn)
    print_floors(model, 1, float_rows, print_fn)
    if quant_rows:
        print_floors(qmodel, 1, quant_rows, print_fn)
    print_fn("forms measured fastest on this machine (autotune; MINI_ENGINE_FORMS pins them):\n"
             + format_tuned_forms())
    return rows


def print_quantized(model, qmodel, quant_rows: list[Row], float_rows: list[Row], by_name: dict, dtype: str,
                    print_fn=print) -> None:
    """The quantized rows against HF cached, our float rows and llama.cpp; the weights' bytes against bf16's."""
    from ..quant import weight_bytes
    hf = by_name.get("HF transformers (cached)")
    llama = next((r for r in by_name.values() if r.system.startswith("llama.cpp")), None)
    floats = {r.system.removeprefix("mini_engine "): r for r in float_rows}
    for r in quant_rows:
        rung = r.system.split()[-1]
        parts = [f"{r.system}: {r.tok_s:.1f} tok/s"]
        if hf:
            parts.append(f"{r.tok_s / hf.tok_s:.2f}x HF cached ({hf.tok_s:.1f})")
        if llama:
            parts.append(f"{r.tok_s / llama.tok_s:.2f}x llama.cpp ({llama.tok_s:.1f})")
        same = floats.get(rung) or floats.get(rung.removesuffix("-cpp"))
        if same:
            parts.append(f"{r.tok_s / same.tok_s:.2f}x mini_engine {dtype} {same.system.split()[-1]}")
        print_fn(", ".join(parts))
    ours, bf16 = weight_bytes(qmodel), weight_bytes(model) * 2 // model.dtype.itemsize
    print_fn(f"weights: {qmodel.quantization} model {ours / 2**20:.1f} MiB = {100 * ours / bf16:.1f}% of the bf16 "
             f"model's {bf16 / 2**20:.1f} MiB (the {model.dtype} model here: {weight_bytes(model) / 2**20:.1f} MiB)")


def print_floors(model, batch: int, rows: list[Row], print_fn=print) -> None:
    """Each row as a fraction of the matmul floor: the engine's own products, and F.linear's (HF's form)."""
    ours, plain = matmul_floor_tok_s(model, batch), matmul_floor_tok_s(model, batch, plain=True)
    dtype = str(model.dtype).removeprefix("torch.") + (f", {model.quantization} weights" if model.quantization else "")
    print_fn(f"{dtype} matmul floor at batch {batch} (the weight products alone, chained): {ours:.1f} tok/s with "
             f"the engine's products, {plain:.1f} tok/s with F.linear")
    for r in rows:
        print_fn(f"{r.system}: {100 * r.tok_s / ours:.0f}% of the engine-product floor, "
                 f"{100 * r.tok_s / plain:.0f}% of the F.linear floor")


# ---------------------------------------------------------------- the serving workload


@dataclass(frozen=True)
class ServingWorkload:
    prompts: list[list[int]]
    output_lens: list[int]

    @classmethod
    def uniform(cls, n: int, low: int = 16, high: int = 256, vocab: int = 49152, seed: int = 0) -> "ServingWorkload":
        """nano-vllm's offline benchmark: random token ids, prompt and output lengths uniform in [low, high]."""
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(low, high + 1, (2, n), generator=g).tolist()
        prompts = [torch.randint(0, vocab, (n_in,), generator=g).tolist() for n_in in lens[0]]
        return cls(prompts, lens[1])

    @property
    def name(self) -> str:
        ins, outs = [len(p) for p in self.prompts], self.output_lens
        return f"{len(ins)} x {min(ins)}-{max(ins)}+{min(outs)}-{max(outs)}"

    @property
    def longest(self) -> int:
        return max(len(p) + n for p, n in zip(self.prompts, self.output_lens))


def run_engine(model, tok, policy: str, work: ServingWorkload, batch: int | None, chunk: int | None = 512,
               name: str | None = None, progress: bool = False, **engine_kwargs) -> Row:
    """Our engine, every request queued at once; TTFT therefore includes the time spent waiting for a slot.
    `engine_kwargs` go to the engine (kv_cache, num_kv_blocks, max_model_len: the workload's longest request
    by default; compile=True compiles every batch-size bucket before the clock starts, the row's `compile_s`);
    `progress` shows vLLM's progress bar over requests."""
    from ..engine import LLM

    engine_kwargs = {"max_model_len": work.longest, **engine_kwargs}
    llm = LLM.from_model(model, tok, scheduling=policy, max_num_seqs=batch, chunked_prefill_tokens=chunk,
                         record_trace=True, **engine_kwargs)
    compile_s = llm.warmup(progress) if llm.config.compile else None
    compiled = llm.engine.runner.compiled
    steps_before = compiled.num_steps if compiled else 0  # the warm-up's
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in work.output_lens]
    t0 = time.perf_counter()
    outs = llm.generate(work.prompts, params, use_tqdm=progress)
    seconds = time.perf_counter() - t0
    if compile_s is not None and llm.engine.compile_seconds > compile_s:
        raise RuntimeError("a decode graph compiled inside the timed run: the compiled row would include it")
    return Row(name or f"mini_engine {policy}", work.name, sum(len(o.token_ids) for o in outs), seconds,
               [o.metrics.ttft_s for o in outs], [o.metrics.tpot_s for o in outs], llm.engine.kv_cache_bytes,
               max(r.num_running for r in llm.engine.trace), sum(o.metrics.num_preemptions for o in outs),
               compile_s, [list(o.token_ids) for o in outs], compiled.num_steps - steps_before if compiled else None)


def run_serving_rung(model, tok, rung: str, work: ServingWorkload, batch: int, progress: bool = False,
                     print_fn=print, name: str | None = None, **engine_kwargs) -> Row:
    """A serving rung: a scheduling policy, or `compiled-engine` (continuous, compile=True), or
    `compiled-engine-max-autotune` (continuous, compile="max-autotune")."""
    name = name or f"mini_engine {rung}"
    compile = {"compiled-engine": True, "compiled-engine-max-autotune": "max-autotune"}.get(rung)
    if compile is None:
        return run_engine(model, tok, rung, work, batch, name=name, progress=progress, **engine_kwargs)
    row = run_engine(model, tok, "continuous", work, batch, name=name, progress=progress, compile=compile,
                     **engine_kwargs)
    print_fn(f"{name}: compiling the decode graphs (one per batch-size bucket up to {batch}) "
             f"took {row.compile_s:.1f} s before its run (not in its row)")
    return row


def run_hf_static(hf, work: ServingWorkload, batch: int, kv_bytes_per_token: int, progress: bool = False) -> Row:
    """HF `generate` over batches of `batch` requests in arrival order, prompts left-padded to the longest of
    their batch, every batch decoding until its longest output is done. Only the tokens each request asked
    for are counted (the rest is the padding cost); a request's TPOT ends at its own last token."""
    from tqdm.auto import tqdm
    from transformers import StoppingCriteria, StoppingCriteriaList

    stamps: list[float] = []

    class Stamp(StoppingCriteria):  # called once per decoding step of the whole batch
        def __call__(self, input_ids, scores, **kwargs):
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    ttft, tpot, peak_kv, tokens = [], [], 0, 0
    t0 = time.perf_counter()
    for first in tqdm(range(0, len(work.prompts), batch), desc="HF static batches", disable=not progress):
        prompts, lens = work.prompts[first:first + batch], work.output_lens[first:first + batch]
        width, new = max(len(p) for p in prompts), max(lens)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=hf.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=hf.device)
        stamps.clear()
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                        pad_token_id=0, stopping_criteria=StoppingCriteriaList([Stamp()]))
        for n in lens:
            ttft.append(stamps[0] - t0)
            tpot.append((stamps[n - 1] - stamps[0]) / (n - 1) if n > 1 else float("nan"))
        tokens += sum(lens)
        peak_kv = max(peak_kv, len(prompts) * (width + new) * kv_bytes_per_token)  # its cache grows to this
    return Row("HF transformers static batch", work.name, tokens, time.perf_counter() - t0, ttft, tpot, peak_kv)


def bench_serving(rungs: list[str], requests: int, batch: int, device: str, dtype: str, with_hf: bool = True,
                  low: int = 16, high: int = 256, print_fn=print, progress: bool = True,
                  kv_cache: str = "paged", quantization: str | None = None) -> list[Row]:
    """The serving workload on every rung (our engine on `kv_cache`: chapter 04 ran it on "contiguous"), and
    HF transformers' static batches first unless with_hf=False; with `quantization`, each rung again with the
    quantized model, in the same run."""
    from ..course.formulas import kv_bytes_per_token
    from ..loading.loader import load_model

    model, tok = load_model("smollm2-135m", device=device, dtype=dtype)
    work = ServingWorkload.uniform(requests, low, high, vocab=model.config.vocab_size)
    warm = ServingWorkload.uniform(2, 4, 8, vocab=model.config.vocab_size, seed=1)
    # Allocator growth, lazy init and tuning stay out of the numbers: every product form a step of up to
    # 256 rows can meet is decided now.
    warm_up(model, [1 << i for i in range(9)])
    run_engine(model, tok, "continuous", warm, batch, kv_cache=kv_cache)
    rows = []
    if with_hf:
        try:
            hf = load_hf(device, model.dtype, model)
        except ImportError:
            print_fn("transformers is not installed: HF row skipped (pip install -e '.[dev]')")
        else:
            c = model.config  # the same weights as ours, so the same KV bytes per token
            per_token = kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, model.dtype.itemsize)
            run_hf_static(hf, warm, batch, per_token)
            rows.append(run_hf_static(hf, work, batch, per_token, progress))
            del hf
    float_rows = [run_serving_rung(model, tok, rung, work, batch, progress, print_fn, kv_cache=kv_cache)
                  for rung in rungs]
    rows += float_rows
    quant_rows = []
    if quantization is not None:
        qmodel, _ = load_model("smollm2-135m", device=device, dtype=dtype, quantization=quantization)
        warm_up(qmodel, [1 << i for i in range(9)])
        run_engine(qmodel, tok, "continuous", warm, batch, kv_cache=kv_cache)
        quant_rows = [run_serving_rung(qmodel, tok, rung, work, batch, progress, print_fn, kv_cache=kv_cache,
                                       name=f"mini_engine {quantization} {rung}") for rung in rungs]
        rows += quant_rows
    print_fn(describe_machine(device))
    print_fn(f"device={device} dtype={dtype} threads={torch.get_num_threads()} workload: {requests} requests, "
             f"prompt and output lengths uniform in {low}-{high} (seed 0), ignore_eos, batch {batch}, "
             f"{kv_cache} KV cache; ratio vs first row")
    print_fn(format_table(rows, rows[0] if rows else None))
    by_name = {r.system: r for r in rows}
    eager = by_name.get("mini_engine continuous")
    if eager:
        for r in float_rows:
            if r.compile_s is not None:
                print_fn(f"{r.system} / continuous: {r.tok_s / eager.tok_s:.2f}x "
                         f"(compile {r.compile_s:.1f} s, once, not in the rate)")
        # A faster rung counts only if it said the same thing: greedy tokens, request by request.
        for r in float_rows:
            if r is not eager:
                same = sum(a == b for a, b in zip(r.token_ids, eager.token_ids))
                print_fn(f"{r.system}: {same}/{len(r.token_ids)} requests with the same greedy tokens as continuous")
    for f, q in zip(float_rows, quant_rows):
        print_fn(f"{q.system} / {f.system} ({dtype}): {q.tok_s / f.tok_s:.2f}x")
    print_floors(model, batch, float_rows, print_fn)
    if quant_rows:
        print_floors(qmodel, batch, quant_rows, print_fn)
    return rows
