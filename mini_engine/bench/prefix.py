"""`python -m mini_engine bench --workload prefix`: automatic prefix caching on against off, in one run.

- TTFT with a shared prefix: requests of one long shared prefix (a system prompt, 1,024 tokens by default)
  followed by a short question of their own (32 tokens), sent one at a time after one request has put the
  prefix in the cache, so each TTFT is that request's prefill alone. Reported: TTFT p50 and p99, prompt
  tokens computed, hit rate, and the TTFT ratio beside the FLOP ratio the formula predicts.
- Throughput on that workload: every request queued at once, each generating `output_len` tokens.
- The chapter-04 serving workload (random prompts, nothing shared): prefix caching must cost nothing
  measurable there. Both engines run twice, alternated, and the faster run of each is kept.
- On a CPU, one layer's attention for the cached request's chunk and for the uncached one's last full chunk,
  through the C kernel that reads the paged pool in place and through the copy + SDPA it replaces
  (`bench_paging.time_prefill_chunk_forms`).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from .runs import Row, ServingWorkload, format_table, run_engine
from ..course.metrics import percentile
from ..sampling import SamplingParams


@dataclass(frozen=True)
class SharedPrefixWorkload:
    prefix: list[int]
    questions: list[list[int]]
    warm_question: list[int]   # the request that puts the prefix in the cache (not measured)

    @classmethod
    def random(cls, n: int, prefix_len: int = 1024, question_len: int = 32, vocab: int = 49152, seed: int = 0):
        """Random token ids (nothing in the cost depends on which): one prefix, n + 1 distinct questions."""
        rng = random.Random(seed)
        draw = lambda k: [rng.randrange(vocab) for _ in range(k)]  # noqa: E731
        return cls(draw(prefix_len), [draw(question_len) for _ in range(n)], draw(question_len))

    @property
    def prompts(self) -> list[list[int]]:
        return [self.prefix + q for q in self.questions]


@dataclass(frozen=True)
class PrefixRun:
    """One engine over the shared-prefix workload."""
    caching: bool
    ttft: list[float]          # seconds, per measured request
    prompt_tokens: int         # prompt tokens of the measured requests
    cached_tokens: int         # of those, served from the prefix cache
    output_tokens: int
    seconds: float             # wall time of the measured requests
    steps: list[list[tuple[int, float]]]  # per measured request: (tokens computed, seconds) of each step it ran in

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens the engine computed (a preempted request's recompute is not counted)."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds


def run_shared_prefix(model, tok, work: SharedPrefixWorkload, caching: bool, max_tokens: int = 1,
                      one_at_a_time: bool = True, progress: bool = False, **engine_kwargs) -> PrefixRun:
    """Serve `work` on a fresh engine with prefix caching on or off, after one unmeasured request that puts
    the prefix in the cache. one_at_a_time: each request alone (its TTFT is its prefill); otherwise all at once."""
    from tqdm.auto import tqdm

    from ..engine import LLM, request_steps

    longest = len(work.prefix) + max(len(q) for q in work.questions + [work.warm_question]) + max_tokens
    engine_kwargs = {"max_model_len": longest, **engine_kwargs}
    llm = LLM.from_model(model, tok, enable_prefix_caching=caching, record_trace=True, **engine_kwargs)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llm.generate([work.prefix + work.warm_question], params, use_tqdm=False)
    t0 = time.perf_counter()
    if one_at_a_time:
        outs = [llm.generate([p], params, use_tqdm=False)[0]
                for p in tqdm(work.prompts, desc=f"one at a time, caching {'on' if caching else 'off'}",
                              disable=not progress)]
    else:
        outs = llm.generate(work.prompts, params, use_tqdm=progress)
    seconds = time.perf_counter() - t0
    return PrefixRun(caching, [o.metrics.ttft_s for o in outs], sum(len(o.prompt_token_ids) for o in outs),
                     sum(o.num_cached_tokens for o in outs), sum(len(o.token_ids) for o in outs), seconds,
                     [request_steps(llm.engine.trace, o.request_id) for o in outs])


def predicted_ttft_ratio(model, prefix_len: int, question_len: int, block_size: int) -> float:
    """The FLOP ratio of a request with and without the cached prefix (formulas.prefix_cache_savings)."""
    from ..course.formulas import prefix_cache_savings
    return float(prefix_cache_savings(prefix_len, question_len, 2, model.config, block_size).ttft_ratio)


def bench_prefix(requests: int, device: str, dtype: str, prefix_len: int = 1024, question_len: int = 32,
                 output_len: int = 32, serving_requests: int | None = None, batch: int = 16, block_size: int = 16,
                 low: int = 16, high: int = 256, tune_rows=tuple(1 << i for i in range(10)), progress: bool = True,
                 print_fn=print) -> dict:
    """All three measurements; returns {"ttft": (off, on), "throughput": (off, on), "serving": (off, on)}."""
    from .paging import time_prefill_chunk_forms
    from ..course.hardware import describe_machine
    from ..backends.cpu import warm_up
    from ..loading.loader import load_model

    model, tok = load_model("smollm2-135m", device=device, dtype=dtype)
    warm_up(model, list(tune_rows))  # by default every row count a step of up to 512 tokens meets
    work = SharedPrefixWorkload.random(requests, prefix_len, question_len, vocab=model.config.vocab_size)
    common = {"block_size": block_size, "max_num_seqs": batch}
    warm = SharedPrefixWorkload.random(1, 64, 8, vocab=model.config.vocab_size, seed=1)
    run_shared_prefix(model, tok, warm, True, **common)
    ttft = tuple(run_shared_prefix(model, tok, work, c, progress=progress, **common) for c in (False, True))
    thru = tuple(run_shared_prefix(model, tok, work, c, max_tokens=output_len, one_at_a_time=False,
                                   progress=progress, **common) for c in (False, True))
    serving_work = ServingWorkload.uniform(serving_requests or requests, low, high, vocab=model.config.vocab_size)
    best: dict[bool, Row] = {}
    for _ in range(2):
        for c in (False, True):
            row = run_engine(model, tok, "continuous", serving_work, batch, enable_prefix_caching=c,
                             name=f"mini_engine prefix caching {'on' if c else 'off'}", progress=progress)
            if c not in best or row.seconds < best[c].seconds:
                best[c] = row
    serving = (best[False], best[True])
    # The cached request's chunk, and the uncached one's last full chunk (chunked prefill of 512 tokens).
    total = prefix_len + question_len
    chunk_shapes = dict.fromkeys([(question_len, total), (min(512, total), min(1024, total))])
    chunk_forms = {shape: forms for shape in chunk_shapes
                   if (forms := time_prefill_chunk_forms(model, *shape, block_size=block_size))}

    print_fn(describe_machine(device))
    print_fn(f"device={device} dtype={dtype} threads={torch.get_num_threads()} block_size={block_size} "
             f"max_num_seqs={batch}; a shared prefix of {prefix_len} random tokens, questions of {question_len}")
    print_fn(f"TTFT, {requests} requests one at a time after one that fills the cache (output 1 token):")
    for r in ttft:
        print_fn(f"  caching {'on ' if r.caching else 'off'}: TTFT p50 {percentile(r.ttft, 50) * 1e3:8.1f} ms, "
                 f"p99 {percentile(r.ttft, 99) * 1e3:8.1f} ms; prompt tokens computed {r.computed_tokens} of "
                 f"{r.prompt_tokens}, hit rate {r.hit_rate:.1%}")
    measured = percentile(ttft[0].ttft, 50) / percentile(ttft[1].ttft, 50)
    predicted = predicted_ttft_ratio(model, prefix_len, question_len, block_size)
    print_fn(f"  TTFT p50 off / on: {measured:.1f}x measured; {predicted:.1f}x predicted by the FLOP ratio "
             "(formulas.prefix_cache_savings)")
    # The request with the median cached TTFT, step by step on both engines: the uncached prompt is chunked
    # (`max_num_batched_tokens`), the cached one is its question alone.
    median = sorted(range(len(ttft[1].ttft)), key=ttft[1].ttft.__getitem__)[len(ttft[1].ttft) // 2]
    for r in ttft:
        print_fn(f"  request {median}, caching {'on ' if r.caching else 'off'}: " + "; ".join(
            f"{n} tokens in {sec * 1e3:.1f} ms ({sec * 1e3 / n:.2f} ms a token)" for n, sec in r.steps[median]))
    if chunk_forms:
        print_fn(f"one layer's attention for a prefill chunk over the paged cache (median over the "
                 f"{model.config.num_layers} layers' pools): the C kernel reading the pool in place against the "
                 "copy + SDPA it replaces")
        for (n, ctx), t in chunk_forms.items():
            kernel, copy = t["in place (C)"] * 1e3, t["copy + SDPA"] * 1e3
            print_fn(f"  {n:4d} tokens over {ctx:5d} positions: in place {kernel:6.3f} ms, copy + SDPA {copy:6.3f} ms "
                     f"({copy / kernel:.2f}x the kernel)")
    print_fn(f"Throughput, {requests} requests queued at once, {output_len} output tokens each:")
    for r in thru:
        print_fn(f"  caching {'on ' if r.caching else 'off'}: {r.tok_s:7.1f} output tok/s ({r.seconds:.2f} s), "
                 f"TTFT p50 {percentile(r.ttft, 50) * 1e3:.0f} ms, hit rate {r.hit_rate:.1%}")
    print_fn(f"  on / off: {thru[1].tok_s / thru[0].tok_s:.2f}x output tokens/s")
    print_fn(f"The serving workload (nothing shared), {serving_work.name}, batch {batch}, "
             "faster of two alternated runs each; ratio vs first row:")
    print_fn(format_table(list(serving), serving[0]))
    print_fn(f"  on / off: {serving[1].tok_s / serving[0].tok_s:.3f}x tokens/s")
    return {"ttft": ttft, "throughput": thru, "serving": serving, "ttft_ratio": measured,
            "predicted_ttft_ratio": predicted}
