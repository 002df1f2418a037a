"""`python -m mini_engine bench --workload radix`: vLLM's hashed blocks against SGLang's radix tree, and arrival
order against cache-aware scheduling, on three workloads with shared structure (chapter 08, second half).

- conversation: several users, each holding a multi-turn chat behind one shared system prompt. Every turn's prompt
  is the previous prompt, its answer and a new question; all users' turn t are sent together, turn t + 1 once
  they are answered.
- few-shot: a few tasks, each a block of worked examples, and many questions, each behind its task's examples; the
  questions arrive together, the tasks interleaved (as requests from different users do).
- branching: a few contexts (a document, a story so far) and several continuations of each (different
  instructions, or samples to pick from), arriving together, the contexts interleaved; then each branch continued
  once more after its answer (a tree of thoughts two levels deep).

Token ids are random (nothing in the cost depends on which), and the lengths too, so prefixes end at random points
of a block, as real ones do. Every engine (hashed / radix × arrival / cache-aware) serves the same workload in
the same run; a conversation's later turns hold the answers each engine generated (greedy, so the same ones).
Reported per workload and engine: prompt tokens served from the cache, also as a share of the ideal (every prompt
token some earlier request computed, never a prompt's last token), TTFT p50 and output tokens per second; then the
ratios radix / hashed and cache-aware / arrival order.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from ..course.metrics import percentile
from ..prefix.radix_cache import common_prefix
from ..sampling import SamplingParams

ENGINES = (("hashed", "continuous"), ("radix", "continuous"), ("hashed", "cache_aware"), ("radix", "cache_aware"))
ORDER = {"continuous": "arrival", "cache_aware": "cache-aware"}


@dataclass(frozen=True)
class StructuredWorkload:
    """Requests sent in rounds: `first` at once; then each follow-up round at once, after the previous round has
    finished, its request i being the previous round's request i, that request's answer and `follow_ups[r][i]`.
    A workload without follow-ups is one round."""
    name: str
    first: list[list[int]]
    follow_ups: list[list[list[int]]]
    output_len: int

    @classmethod
    def conversation(cls, users: int = 3, turns: int = 4, system_len: tuple[int, int] = (40, 72),
                     question_len: tuple[int, int] = (10, 30), output_len: int = 20, vocab: int = 49152, seed: int = 0):
        rng = random.Random(seed)
        draw = lambda n: [rng.randrange(vocab) for _ in range(rng.randint(*n))]  # noqa: E731
        system = draw(system_len)
        return cls("conversation", [system + draw(question_len) for _ in range(users)],
                   [[draw(question_len) for _ in range(users)] for _ in range(turns - 1)], output_len)

    @classmethod
    def few_shot(cls, tasks: int = 3, questions: int = 4, examples_len: tuple[int, int] = (120, 200),
                 question_len: tuple[int, int] = (10, 30), output_len: int = 8, vocab: int = 49152, seed: int = 1):
        rng = random.Random(seed)
        draw = lambda n: [rng.randrange(vocab) for _ in range(rng.randint(*n))]  # noqa: E731
        examples = [draw(examples_len) for _ in range(tasks)]
        return cls("few-shot", [examples[t] + draw(question_len) for _ in range(questions) for t in range(tasks)],
                   [], output_len)

    @classmethod
    def branching(cls, contexts: int = 2, branches: int = 4, context_len: tuple[int, int] = (160, 260),
                  instruction_len: tuple[int, int] = (4, 16), depth: int = 2, output_len: int = 16, vocab: int = 49152,
                  seed: int = 2):
        """Each branch is continued `depth` times: a tree of thoughts, each continuation a new instruction after
        the branch's last answer."""
        rng = random.Random(seed)
        draw = lambda n: [rng.randrange(vocab) for _ in range(rng.randint(*n))]  # noqa: E731
        docs = [draw(context_len) for _ in range(contexts)]
        first = [docs[c] + draw(instruction_len) for _ in range(branches) for c in range(contexts)]
        return cls("branching", first, [[draw(instruction_len) for _ in first] for _ in range(depth - 1)], output_len)

    @property
    def num_requests(self) -> int:
        return len(self.first) * (1 + len(self.follow_ups))

    def longest(self) -> int:
        """An upper bound on any request's tokens (for max_model_len)."""
        per_round = self.output_len + max((max(map(len, r)) for r in self.follow_ups), default=0)
        return max(map(len, self.first)) + len(self.follow_ups) * per_round + self.output_len


def ideal_reuse(prompts: list[list[int]], computed: list[list[int]]) -> list[int]:
    """Per request, in arrival order: the prompt tokens some earlier request computed (`computed[j]`: request j's
    prompt and output but its last token, whose keys and values nobody computes), never the prompt's last token.
    What a cache that kept everything, at the granularity of one token, would serve."""
    return [min(len(p) - 1, max((common_prefix(p, c) for c in computed[:k]), default=0)) for k, p in enumerate(prompts)]


@dataclass(frozen=True)
class StructuredRun:
    """One engine over one workload: every request in arrival order."""
    workload: str
    cache: str                 # "hashed" | "radix"
    scheduling: str            # "continuous" (arrival order) | "cache_aware"
    prompts: list[list[int]]
    outputs: list[list[int]]
    cached: list[int]          # prompt tokens served from the prefix cache, per request
    ttft: list[float]
    seconds: float             # wall time of the whole workload
    num_evictions: int
    num_kv_blocks: int         # the pool's blocks (by default max_num_seqs requests of max_model_len)

    @property
    def name(self) -> str:
        return f"{self.cache}, {ORDER[self.scheduling]}"

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def reused(self) -> int:
        return sum(self.cached)

    @property
    def ideal(self) -> int:
        return sum(ideal_reuse(self.prompts, [p + o[:-1] for p, o in zip(self.prompts, self.outputs)]))

    @property
    def share_of_ideal(self) -> float:
        return self.reused / self.ideal if self.ideal else 1.0

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.reused

    @property
    def tok_s(self) -> float:
        return sum(map(len, self.outputs)) / self.seconds


def run_structured(model, tok, work: StructuredWorkload, cache: str = "radix", scheduling: str = "continuous",
                   **engine_kwargs) -> StructuredRun:
    """Serve `work` on a fresh engine with prefix caching on: `cache` "hashed" or "radix", `scheduling`
    "continuous" (arrival order) or "cache_aware". Greedy, `work.output_len` tokens a request."""
    from ..engine import LLM

    engine_kwargs = {"max_model_len": work.longest(), **engine_kwargs}
    llm = LLM.from_model(model, tok, enable_prefix_caching=True, prefix_cache=cache, scheduling=scheduling,
                         **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=work.output_len, ignore_eos=True)
    prompts, outs = list(work.first), []
    t0 = time.perf_counter()
    for r in range(1 + len(work.follow_ups)):
        if r:
            last = outs[-len(prompts):]
            prompts = [list(o.prompt_token_ids) + o.token_ids + q for o, q in zip(last, work.follow_ups[r - 1])]
        outs += llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return StructuredRun(work.name, cache, scheduling, [list(o.prompt_token_ids) for o in outs],
                         [list(o.token_ids) for o in outs], [o.num_cached_tokens for o in outs],
                         [o.metrics.ttft_s for o in outs], seconds, llm.engine.scheduler.blocks.num_evictions,
                         llm.engine.num_kv_blocks)


def workloads(vocab: int, scale: int = 1) -> list[StructuredWorkload]:
    """The three workloads; `scale` multiplies the number of users, questions and branches."""
    return [StructuredWorkload.conversation(users=3 * scale, vocab=vocab),
            StructuredWorkload.few_shot(questions=4 * scale, vocab=vocab),
            StructuredWorkload.branching(branches=4 * scale, vocab=vocab)]


def format_runs(runs: list[StructuredRun]) -> str:
    """One table: a row per workload and engine, then the ratios of each workload."""
    header = (f"{'workload':<13}{'engine':<21}{'requests':>9}{'prompt tok':>11}{'reused':>8}{'ideal':>7}"
              f"{'of ideal':>9}{'TTFT p50':>10}{'out tok/s':>10}{'evicted':>8}")
    lines = [header, "-" * len(header)]
    for r in runs:
        lines.append(f"{r.workload:<13}{r.name:<21}{len(r.prompts):>9}{r.prompt_tokens:>11}{r.reused:>8}{r.ideal:>7}"
                     f"{r.share_of_ideal:>9.1%}{percentile(r.ttft, 50) * 1e3:>8.0f}ms{r.tok_s:>10.1f}"
                     f"{r.num_evictions:>8}")
    lines += ["", "ratios in the same run (reused tokens, TTFT p50 as before / after: > 1 is faster, output tok/s):"]
    by = {(r.workload, r.cache, r.scheduling): r for r in runs}
    for w in dict.fromkeys(r.workload for r in runs):
        for label, a, b in (("radix / hashed, arrival order", ("hashed", "continuous"), ("radix", "continuous")),
                            ("radix / hashed, cache-aware", ("hashed", "cache_aware"), ("radix", "cache_aware")),
                            ("cache-aware / arrival, hashed", ("hashed", "continuous"), ("hashed", "cache_aware")),
                            ("cache-aware / arrival, radix", ("radix", "continuous"), ("radix", "cache_aware"))):
            if (w, *a) in by and (w, *b) in by:
                x, y = by[(w, *a)], by[(w, *b)]
                lines.append(f"  {w:<13}{label:<31} reused {y.reused / max(x.reused, 1):5.2f}x   TTFT "
                             f"{percentile(x.ttft, 50) / percentile(y.ttft, 50):5.2f}x   tok/s {y.tok_s / x.tok_s:5.2f}x")
    return "\n".join(lines)


def bench_radix(device: str, dtype: str, scale: int = 1, block_size: int = 16, batch: int = 4,
                num_kv_blocks: int | None = None, engines=ENGINES, tune_rows=tuple(1 << i for i in range(10)),
                progress: bool = True, print_fn=print, model_and_tokenizer=None) -> list[StructuredRun]:
    """Every workload on every engine, in one run (engines alternated within each workload, after one unmeasured
    warm-up run); prints the table and returns the runs."""
    from tqdm.auto import tqdm

    from ..course.hardware import describe_machine

    if model_and_tokenizer is None:
        from ..backends.cpu import warm_up
        from ..loading.loader import load_model

        model, tok = load_model("smollm2-135m", device=device, dtype=dtype)
        warm_up(model, list(tune_rows))
    else:
        model, tok = model_and_tokenizer
    common = {"block_size": block_size, "max_num_seqs": batch, "num_kv_blocks": num_kv_blocks}
    works = workloads(model.config.vocab_size, scale)
    run_structured(model, tok, StructuredWorkload.few_shot(tasks=1, questions=2, vocab=model.config.vocab_size),
                   **common)  # warm-up: the first steps at new shapes pay one-time costs
    runs = []
    with tqdm(total=len(works) * len(engines), desc="radix bench", disable=not progress) as bar:
        for work in works:
            for cache, scheduling in engines:
                runs.append(run_structured(model, tok, work, cache, scheduling, **common))
                bar.update(1)
    print_fn(describe_machine(device))
    print_fn(f"device={device} dtype={dtype} threads={torch.get_num_threads()} block_size={block_size} "
             f"max_num_seqs={batch} num_kv_blocks={num_kv_blocks or 'default'}; greedy, random token ids")
    for work in works:
        pool = next(r.num_kv_blocks for r in runs if r.workload == work.name)
        print_fn(f"  {work.name}: {len(work.first)} requests a round, {1 + len(work.follow_ups)} round(s), "
                 f"{work.output_len} output tokens each; a pool of {pool} blocks")
    same = all(r.outputs == next(s for s in runs if s.workload == r.workload).outputs for r in runs)
    print_fn(format_runs(runs))
    print_fn(f"outputs identical across the engines of each workload: {same}")
    return runs
