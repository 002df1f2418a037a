"""`python -m mini_engine bench --ladder`: one workload up every rung of the ladder, in one run (chapter 09).

Each rung adds one thing to the rung above it:

    hf               HF transformers' batched `generate` (static batches of `batch`, left-padded): the reference
    naive            full recompute, one request at a time (`generate_naive`)
    cached           + the KV cache (`generate_cached`), one request at a time
    compiled         + each decode step one compiled graph (`generate_cached(compile=True)`), one at a time
    static           the serving engine, static batching: `batch` requests at a time over a contiguous KV cache of
                     `batch` slots, the next batch only once the whole batch has finished
    continuous       + continuous batching: a finished request's slot is refilled at the next step
    paged            + the paged KV cache, given the same memory as blocks (more requests fit at once)
    prefix           + prefix caching (the shared system prompt is computed once)
    speculative      + n-gram speculative decoding (prompt lookup: it pays on input-grounded requests)
    compiled_engine  + the compiled engine step (`LLM(compile=True)`: decode-only steps as compiled graphs)

The workload (`LadderWorkload`) lets each rung show what it buys: every request opens with one long system
prompt (prefix caching), half of them ask for a given text back, repeated or proofread (n-gram speculation),
the other half are open questions, and output lengths are mixed (continuous batching against static batching,
paging). Greedy, with EOS honoured, so every rung's tokens can be compared with every other's.

Rungs that run one request at a time (naive, cached, compiled) run on a sample of the requests (the first
`sample`), one after another: their tokens/s is what one user at a time gets, and their TTFT is timed from each
request's own start. The batched rungs get every request at t = 0, so their TTFT includes waiting for a place
in the batch. Before anything is timed, the product forms are tuned for every row bucket a step can bring
(1 to 256) and each engine runs a short warm-up; compiling is a one-time cost, reported apart from the rates.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .speculative import GROUNDED_TASKS
from .speculative import QUESTIONS as SPEC_QUESTIONS
from .speculative import TEXTS as SPEC_TEXTS
from ..course.metrics import TokenTimer, percentile
from ..sampling import SamplingParams

RUNGS = ("hf", "naive", "cached", "compiled", "static", "continuous", "paged", "prefix", "speculative",
         "compiled_engine")
SINGLE_STREAM = ("naive", "cached", "compiled")
LABELS = {
    "hf": "HF transformers batched generate",
    "naive": "naive (no cache)",
    "cached": "KV cache",
    "compiled": "+ compiled decode step",
    "static": "static batching (contiguous)",
    "continuous": "+ continuous batching",
    "paged": "+ paged KV cache",
    "prefix": "+ prefix caching",
    "speculative": "+ speculative (n-gram)",
    "compiled_engine": "+ compiled engine step",
}
# What each rung adds, quoted from the textbook the course accompanies (chapter 00 introduces it; chapter 09
# sets the measured gains beside these).
TEXTBOOK_CLAIMS = {
    "naive": '"5 to 10 tokens per second" (a 7B model on an A100)',
    "cached": '"an ~700× speedup" (attention work over 1,024 tokens)',
    "compiled": "(not in the textbook: CUDA graphs / torch.compile remove per-kernel launch cost)",
    "static": "(batching itself: one weight read serves the whole batch)",
    "continuous": '"utilization ~50% → ~90% (≈1.8× more tokens/sec)"',
    "paged": '"waste from 60–80% to ≤15 tokens per request", "~8× concurrency"',
    "prefix": '"cuts TTFT ~40×" (a long shared prefix)',
    "speculative": '"~3.36 tokens per target step (2–3× lower latency)" at α = 0.8, k = 4',
    "compiled_engine": "(not in the textbook: vLLM captures CUDA graphs of its decode steps)",
    "hf": "",
}

SYSTEM_PROMPT = (
    "You are a careful, friendly assistant for a small public library. Follow these guidelines in every answer. "
    "Be accurate: if you are not sure of a fact, say so rather than guess. Be brief: answer in a few sentences "
    "unless the user asks for more, and do not repeat the question. When the user gives you a text to copy, repeat "
    "or correct, return the whole text, changing only what you were asked to change, and add nothing before or "
    "after it. Use plain words that a twelve-year-old could follow, and explain a technical word the first time you "
    "use it. Prefer a concrete example to a general statement. When you list steps, number them. When you recommend "
    "something, give one reason for it. Never invent book titles, authors, page numbers or quotations. Do not give "
    "medical, legal or financial advice: suggest asking a professional instead. Be polite but not flattering, and "
    "apologise only for your own mistakes. If a request is unclear, ask one short question to clarify it. Keep a "
    "calm, neutral tone, and answer in the language the user writes in.")
# Its first five sentences, the rules the requests lean on (about 100 tokens): chapter 09's CPU ladder, where every
# rung but prefix caching computes each request's system prompt again, and two cores take longer over sixteen
# long prompts than over their answers.
SHORT_SYSTEM_PROMPT = SYSTEM_PROMPT[:SYSTEM_PROMPT.index(" Use plain words")]
TEXTS = SPEC_TEXTS + [
    "A library card lets you borrow up to ten books at a time for three weeks. You can renew a loan twice online, "
    "unless another reader has reserved the book, and a late return costs ten cents a day.",
    "Bees visit flowers to collect nectar and pollen. As they move from flower to flower, pollen sticks to their "
    "bodies and rubs off on the next blossom, which is how many fruits and vegetables are pollinated.",
    "A rainbow appears when sunlight enters raindrops, bends, reflects off the back of each drop and bends again on "
    "the way out. Each colour bends by a slightly different amount, so the light spreads into a band.",
    "To change a flat tyre, loosen the wheel nuts, raise the car with the jack, remove the wheel and fit the spare. "
    "Tighten the nuts by hand, lower the car, then tighten them fully in a star pattern.",
    "Compound interest means that you earn interest on your interest. Save one hundred euros at five percent a "
    "year and you have one hundred and five after a year, and about one hundred and sixty-three after ten.",
]
QUESTIONS = SPEC_QUESTIONS + ["How do libraries decide which books to buy?",
                              "What is the difference between weather and climate?",
                              "Why do leaves change colour in autumn?"]
CHAT_STYLES = ("", " Answer in two sentences.")
GROUNDED_MAX_TOKENS = 96                 # the texts come back in 45-55 tokens, then EOS
CHAT_MAX_TOKENS = (32, 128, 64, 192)     # mixed lengths: request after request


@dataclass(frozen=True)
class LadderWorkload:
    """Chat prompts (token ids) that all open with SYSTEM_PROMPT; even requests are input-grounded (repeat or
    proofread a given text), odd ones open questions; each with its own max_tokens."""
    prompts: list[list[int]]
    max_tokens: list[int]
    kinds: list[str]            # "grounded" or "chat", per request
    shared_prefix_len: int      # leading tokens every prompt has in common

    @classmethod
    def build(cls, tok, requests: int, max_tokens_cap: int | None = None,
              system_prompt: str = SYSTEM_PROMPT, length_scale: float = 1.0) -> "LadderWorkload":
        """`requests` prompts. `length_scale` multiplies every request's max_tokens and keeps their mix (a smaller
        run on a CPU); `max_tokens_cap` caps them all and a shorter `system_prompt` shortens every prompt (a
        quick run, e.g. a smoke test)."""
        if requests < 1:
            raise ValueError(f"requests must be >= 1, got {requests}")
        if max_tokens_cap is not None and max_tokens_cap < 1:
            raise ValueError(f"max_tokens_cap must be >= 1, got {max_tokens_cap}")
        if not length_scale > 0:
            raise ValueError(f"length_scale must be > 0, got {length_scale!r}")
        grounded = [(task, text) for task in GROUNDED_TASKS for text in TEXTS]
        chat = [(q, style) for style in CHAT_STYLES for q in QUESTIONS]
        messages, max_tokens, kinds = [], [], []
        for i in range(requests):
            j = i // 2
            if i % 2 == 0:
                task, text = grounded[j % len(grounded)]
                user, limit, kind = task.format(text=text), GROUNDED_MAX_TOKENS, "grounded"
                round_ = j // len(grounded)
            else:
                question, style = chat[j % len(chat)]
                user, limit, kind = question + style, CHAT_MAX_TOKENS[j % len(CHAT_MAX_TOKENS)], "chat"
                round_ = j // len(chat)
            if round_:  # past the distinct combinations: another reader asks, so no two prompts are the same
                user = f"Reader {round_ + 1} asks: {user}"
            messages.append([{"role": "system", "content": system_prompt}, {"role": "user", "content": user}])
            limit = max(1, round(limit * length_scale))
            max_tokens.append(min(limit, max_tokens_cap or limit))
            kinds.append(kind)
        prompts = [tok.encode(tok.apply_chat_template(m)) for m in messages]
        shared = len(prompts[0])
        for p in prompts[1:]:
            shared = next((k for k, (a, b) in enumerate(zip(prompts[0][:shared], p)) if a != b), min(shared, len(p)))
        return cls(prompts, max_tokens, kinds, shared)

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def longest(self) -> int:
        return max(len(p) + n for p, n in zip(self.prompts, self.max_tokens))

    def describe(self) -> str:
        lens = [len(p) for p in self.prompts]
        limits = {kind: sorted({n for n, k in zip(self.max_tokens, self.kinds) if k == kind})
                  for kind in ("grounded", "chat")}
        n_grounded = self.kinds.count("grounded")
        return (f"{len(self)} requests: prompts {min(lens)}-{max(lens)} tokens sharing their first "
                f"{self.shared_prefix_len} (the system prompt), {n_grounded} input-grounded (repeat or proofread a "
                f"given text, max_tokens {'/'.join(map(str, limits['grounded'])) or '-'}), {len(self) - n_grounded} "
                f"open questions (max_tokens {'/'.join(map(str, limits['chat'])) or '-'}); greedy, EOS ends a request")


def default_size(device: str) -> dict:
    """The ladder's size on this device: requests, contiguous batch (HF's too), single-stream sample."""
    from ..course.devices import pick
    return pick({"requests": 32, "batch": 16, "sample": 2}, {"requests": 256, "batch": 64, "sample": 4}, device)


@dataclass
class LadderRow:
    rung: str
    requests: list[int]                      # which requests it ran (indices into the workload)
    outputs: dict[int, list[int]]            # request index -> output token ids
    seconds: float
    ttft: list[float]
    tpot: list[float]
    kv_bytes: int | None = None              # peak KV memory (see the table's footnote)
    compile_s: float | None = None           # one-time compile, not in `seconds`
    notes: str = ""
    engine: str = ""                         # the engine's repr (its configuration), for engine rungs
    peak_running: int = 1                    # most requests decoding or prefilling together
    stats: dict = field(default_factory=dict)  # engine rungs: prompt/cached tokens, drafts/accepted, preemptions

    @property
    def label(self) -> str:
        return LABELS[self.rung]

    @property
    def single_stream(self) -> bool:
        return self.rung in SINGLE_STREAM

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs.values())

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


def agreement(row: LadderRow, ref: LadderRow | None) -> tuple[int, int] | None:
    """(identical outputs, requests both ran); None when they share no request."""
    if ref is None or row is ref:
        return None
    shared = sorted(set(row.outputs) & set(ref.outputs))
    if not shared:
        return None
    return sum(row.outputs[i] == ref.outputs[i] for i in shared), len(shared)


def common_prefix_share(row: LadderRow, ref: LadderRow) -> float:
    """Over the requests both ran, the share of the reference's tokens that the row reproduces before the two
    first differ."""
    shared = sorted(set(row.outputs) & set(ref.outputs))
    total = sum(len(ref.outputs[i]) for i in shared)
    same = 0
    for i in shared:
        a, b = row.outputs[i], ref.outputs[i]
        same += next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same / total if total else 1.0


@dataclass
class LadderResult:
    rows: list[LadderRow]
    workload: LadderWorkload
    sample: list[int]
    device: str
    dtype: str
    batch: int
    machine: str
    tune_s: float
    engine_info: dict = field(default_factory=dict)
    wall_s: dict = field(default_factory=dict)   # rung -> seconds it took in all (warm-up and compiling included)

    def row(self, rung: str) -> LadderRow | None:
        return next((r for r in self.rows if r.rung == rung), None)

    @property
    def top(self) -> LadderRow:
        """The last rung that ran."""
        return self.rows[-1]

    def ratio(self, rung: str, base: str) -> float:
        a, b = self.row(rung), self.row(base)
        return a.tok_s / b.tok_s if a and b else float("nan")

    def table(self) -> str:
        first = self.rows[0] if self.rows else None
        naive, cached, continuous = self.row("naive"), self.row("cached"), self.row("continuous")
        head = (f"{'rung':<34} {'reqs':>4} {'tokens':>6} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
                f"{'TPOT p50':>9} {'TPOT p99':>9} {'peak KV':>9} {'ratio':>7} {'x naive':>7} {'=cached':>7} "
                f"{'=contin.':>8}")
        lines = [head, "-" * len(head)]
        for r in self.rows:
            label = r.label + (" *" if r.single_stream else "")
            kv = f"{r.kv_bytes / 2**20:.1f}MiB" if r.kv_bytes else "-"
            ms = [percentile(v, q) * 1e3 for v in (r.ttft, r.tpot) for q in (50, 99)]
            same = [agreement(r, ref) for ref in (cached, continuous)]
            same = [f"{s[0]}/{s[1]}" if s else "-" for s in same]
            lines.append(
                f"{label:<34} {len(r.requests):>4} {r.tokens:>6} {r.tok_s:>8.2f} "
                + " ".join(f"{v:>7.0f}ms" for v in ms)
                + f" {kv:>9} {r.tok_s / first.tok_s:>6.2f}x "
                + (f"{r.tok_s / naive.tok_s:>6.1f}x" if naive else f"{'-':>7}")
                + f" {same[0]:>7} {same[1]:>8}")
        return "\n".join(lines)

    def footnotes(self) -> str:
        s = ", ".join(map(str, self.sample))
        return "\n".join([
            f"* one request at a time, on a sample of the workload (requests {s}): tokens/s is the output tokens of "
            "the sample over its wall time, i.e. what ONE user at a time gets; TTFT is timed from each request's own "
            "start. The other rows serve all requests together (queued at t = 0, so their TTFT includes waiting for "
            "a place in the batch): their tokens/s is what all users get together.",
            "ratio: tokens/s over the first row's; x naive: over the naive row's (a batched rung against one user at "
            "a time: the gain a serving engine gives a machine, not one user).",
            "peak KV: memory the KV cache held at its busiest. Single stream: one request's cache; HF: its largest "
            "batch's padded cache; contiguous: every slot reserved at max_model_len (pinned whether used or not); "
            "paged rungs: the blocks held by requests at the busiest step (the pool itself has the contiguous "
            "cache's size).",
            "=cached / =contin.: requests whose output tokens equal the cached rung's (on the sample) / the continuous "
            "rung's (on all requests), out of those both ran. Greedy, so they should match; fp32 sums taken in another "
            "order can flip a near-tie (HF most often), after which the two continue differently.",
        ])

    def plot(self, path: str | Path | None = None):
        """A bar per rung: tokens/s on a log scale, labelled with the ratio to the naive rung. Saved to `path`
        when given; returns the figure."""
        import matplotlib.pyplot as plt

        rows = self.rows
        naive = self.row("naive")
        fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.4))
        y = list(range(len(rows)))[::-1]
        colors = ["tab:gray" if r.rung == "hf" else "tab:orange" if r.single_stream else "tab:blue" for r in rows]
        ax.barh(y, [r.tok_s for r in rows], color=colors)
        ax.set_yticks(y, [r.label + (" *" if r.single_stream else "") for r in rows])
        ax.set_xscale("log")
        for yi, r in zip(y, rows):
            text = f" {r.tok_s:.1f} tok/s" + (f", {r.tok_s / naive.tok_s:.1f}x naive" if naive else "")
            ax.text(r.tok_s, yi, text, va="center", fontsize=8)
        ax.set_xlim(right=max(r.tok_s for r in rows) * 8)
        ax.set_xlabel("output tokens/s (log scale)")
        ax.set_title(f"the ladder: {len(self.workload)} requests, {self.device} {self.dtype} "
                     "(* one request at a time, on a sample)", fontsize=10)
        fig.tight_layout()
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=120)
        return fig

    def batching_beside_textbook(self) -> str | None:
        """Continuous against static batching on the same places and requests, beside the textbook's claim
        (utilization "~50% → ~90%", "≈1.8× more tokens/sec"); None unless both rungs ran."""
        static, continuous = self.row("static"), self.row("continuous")
        if not (static and continuous):
            return None
        return (f"continuous / static batching, {self.batch} places, the same {len(self.workload)} requests: "
                f"{continuous.tok_s / static.tok_s:.2f}x tokens/s, places busy {static.stats['lanes_busy']:.0%} -> "
                f"{continuous.stats['lanes_busy']:.0%} (the textbook: utilization \"~50% → ~90%\", \"≈1.8×\")")

    def report(self) -> str:
        """Everything the bench prints: machine, workload, table, footnotes, compile times, agreement, the textbook's
        batching claim beside ours, targets."""
        top, naive, hf = self.top, self.row("naive"), self.row("hf")
        lines = [self.machine,
                 f"device={self.device} dtype={self.dtype} threads={torch.get_num_threads()}; workload: "
                 f"{self.workload.describe()}; contiguous batch {self.batch} (HF's static batches too)",
                 *(f"{k}: {v}" for k, v in self.engine_info.items()),
                 self.table(), self.footnotes()]
        compiled = [f"{r.label.lstrip('+ ')} {r.compile_s:.1f} s" for r in self.rows if r.compile_s is not None]
        lines.append(f"product forms tuned for row buckets 1-256 before any timing: {self.tune_s:.1f} s")
        if compiled:
            lines.append("compiling (one-time, in no row): " + "; ".join(compiled))
        if self.wall_s:
            lines.append("wall time per rung, warm-up and compiling included: "
                         + ", ".join(f"{rung} {t:.0f} s" for rung, t in self.wall_s.items()))
        for r in self.rows:
            ref = self.row("continuous") if not r.single_stream and r.rung != "continuous" else self.row("cached")
            same = agreement(r, ref)
            if same and same[0] < same[1]:
                lines.append(f"{r.label}: {same[0]}/{same[1]} outputs identical to {ref.label}'s; the rest agree on "
                             f"{common_prefix_share(r, ref):.0%} of the reference's tokens before they first differ")
        for r in self.rows:
            if r.notes:
                lines.append(f"{r.label}: {r.notes}")
        if self.batching_beside_textbook():
            lines.append(self.batching_beside_textbook())
        if naive:
            lines.append(f"top rung ({top.label}) / naive: {top.tok_s / naive.tok_s:.1f}x (target >= 25x)")
        if hf:
            lines.append(f"top rung ({top.label}) / HF transformers batched generate: {top.tok_s / hf.tok_s:.2f}x "
                         "(target >= 4x)")
        best = max(self.rows, key=lambda r: r.tok_s)
        if best is not top:
            lines.append(f"fastest rung: {best.label} ({best.tok_s:.1f} tok/s)")
        return "\n".join(lines)


# ---------------------------------------------------------------- the rungs


def run_hf(hf, work: LadderWorkload, batch: int, eos: int, kv_bytes_per_token: int, progress: bool) -> LadderRow:
    """HF `generate` over static batches of `batch` requests in arrival order, left-padded; a batch decodes until
    all its rows have hit EOS or the batch's largest max_tokens. Each request keeps the tokens up to its own
    max_tokens and EOS (the rest is what static batching wastes). TTFT counts from the start of the run."""
    from tqdm.auto import tqdm
    from transformers import StoppingCriteria, StoppingCriteriaList

    stamps: list[float] = []

    class Stamp(StoppingCriteria):  # called once per decoding step of the whole batch
        def __call__(self, input_ids, scores, **kwargs):
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    outputs, ttft, tpot, peak = {}, [], [], 0
    t0 = time.perf_counter()
    for first in tqdm(range(0, len(work), batch), desc="HF batches", disable=not progress):
        idx = list(range(first, min(first + batch, len(work))))
        prompts = [work.prompts[i] for i in idx]
        width, new = max(len(p) for p in prompts), max(work.max_tokens[i] for i in idx)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=hf.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=hf.device)
        stamps.clear()
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new, eos_token_id=eos,
                              pad_token_id=0, stopping_criteria=StoppingCriteriaList([Stamp()]))
        for row, i in enumerate(idx):
            tokens = out[row, width:].tolist()[:work.max_tokens[i]]
            if eos in tokens:
                tokens = tokens[:tokens.index(eos) + 1]
            outputs[i] = tokens
            n = len(tokens)
            ttft.append(stamps[0] - t0)
            tpot.append((stamps[n - 1] - stamps[0]) / (n - 1) if n > 1 else float("nan"))
        peak = max(peak, len(idx) * out.shape[1] * kv_bytes_per_token)  # prompt + new, padded
    return LadderRow("hf", list(range(len(work))), outputs, time.perf_counter() - t0, ttft, tpot, peak,
                     peak_running=min(batch, len(work)))


def run_single_stream(model, tok, work: LadderWorkload, sample: list[int], rung: str, progress: bool) -> LadderRow:
    """naive, cached or compiled, one request after another on the sample."""
    import functools

    from tqdm.auto import tqdm

    from ..compiled_decode import cache_length, graphs_compiled
    from ..course.formulas import kv_cache_bytes
    from ..generate import generate_cached, generate_naive
    from ..kv_cache import ContiguousKVCache

    loop = {"naive": generate_naive, "cached": generate_cached,
            "compiled": functools.partial(generate_cached, compile=True)}[rung]
    compile_s, caches = None, {}

    def length_of(i: int) -> int:  # the cache a compiled loop gives request i
        return cache_length(len(work.prompts[i]) + work.max_tokens[i], model.config.max_position_embeddings)

    if rung == "compiled":  # the first call compiles the decode step: a one-time cost, timed apart
        # The cache's length is a size of the graph (`cache_length`): one short run into a cache of each length
        # the timed requests get, so that none compiles on the clock; they reuse these caches (on a GPU the
        # CUDA graphs replay at the addresses they were recorded at).
        t0 = time.perf_counter()
        for length in sorted({length_of(i) for i in sample}):
            caches[length] = ContiguousKVCache(model.config, 1, length, model.device, model.dtype)
            loop(model, work.prompts[sample[0]][:8], 2, SamplingParams(max_tokens=2), kv_cache=caches[length])
        compile_s = time.perf_counter() - t0
    outputs, ttft, tpot, seconds = {}, [], [], 0.0
    graphs_before = graphs_compiled()
    for i in tqdm(sample, desc=LABELS[rung], disable=not progress):
        timer = TokenTimer(str(model.device)).begin()
        cache = {"kv_cache": caches[length_of(i)]} if caches else {}
        outputs[i] = loop(model, work.prompts[i], work.max_tokens[i], SamplingParams(max_tokens=work.max_tokens[i]),
                          eos_token_id=tok.eos_token_id, on_token=timer.on_token, **cache)
        seconds += timer.e2e_s
        ttft.append(timer.ttft_s)
        tpot.append(timer.tpot_s)
    kv = None
    if rung != "naive":
        c = model.config
        kv = max(kv_cache_bytes(c.num_layers, c.num_kv_heads, c.head_dim, len(work.prompts[i]) + work.max_tokens[i],
                                1, model.dtype.itemsize) for i in sample)
    notes = f"{graphs_compiled() - graphs_before} graphs compiled while timed" if rung == "compiled" else ""
    return LadderRow(rung, list(sample), outputs, seconds, ttft, tpot, kv, compile_s, notes)


def _track_peaks(engine) -> list[int]:
    """Wrap the scheduler so that [most blocks held by requests, most requests running, requests running summed
    over the steps, steps] are kept in the returned list (blocks stay 0 with the contiguous cache)."""
    scheduler, peak = engine.scheduler, [0, 0, 0, 0]
    schedule = scheduler.schedule

    def tracked(now):
        chunks = schedule(now)  # a chunk takes its blocks when it is scheduled
        if scheduler.blocks is not None:
            peak[0] = max(peak[0], scheduler.blocks.num_blocks - scheduler.blocks.num_free_blocks)
        peak[1] = max(peak[1], len(scheduler.running))
        if chunks:
            peak[2] += len(scheduler.running)
            peak[3] += 1
        return chunks
    scheduler.schedule = tracked
    return peak


def run_engine_rung(model, tok, work: LadderWorkload, rung: str, progress: bool, **engine_kwargs) -> LadderRow:
    """The serving engine with `engine_kwargs`, every request queued at once, after a short warm-up on the same
    engine (the prefix cache is emptied after it, so the measured run starts cold)."""
    from ..compiled_decode import graphs_compiled
    from ..engine import LLM
    from ..course.formulas import kv_bytes_per_token

    llm = LLM.from_model(model, tok, **engine_kwargs)
    compiled = engine_kwargs.get("compile", False)
    if compiled:
        llm.warmup(progress)  # every batch-size bucket's graph now, not on the clock
    llm.generate(work.prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # allocation, lazy init
    compile_s = llm.engine.compile_seconds if compiled else None  # every graph compiled so far
    llm.reset_prefix_cache()
    graphs_before = graphs_compiled()
    paged = llm.engine.scheduler.blocks is not None
    peak = _track_peaks(llm.engine)
    params = [SamplingParams(max_tokens=n) for n in work.max_tokens]
    t0 = time.perf_counter()
    outs = llm.generate(work.prompts, params, use_tqdm=progress)
    seconds = time.perf_counter() - t0
    c = llm.engine.config
    if paged:
        per_token = kv_bytes_per_token(model.config.num_layers, model.config.num_kv_heads, model.config.head_dim,
                                       model.dtype.itemsize)
        kv = peak[0] * c.block_size * per_token
    else:  # every slot is reserved whole
        kv = llm.engine.kv_cache_bytes
    stats = {"prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
             "cached_tokens": sum(o.num_cached_tokens for o in outs),
             "drafts": sum(o.metrics.num_draft_tokens for o in outs),
             "accepted": sum(o.metrics.num_accepted_tokens for o in outs),
             "preemptions": sum(o.metrics.num_preemptions for o in outs),
             "lanes_busy": peak[2] / max(peak[3], 1) / c.max_num_seqs}  # the share of the batch's places in use
    notes = [f"peak {peak[1]} requests at once"]
    if compiled:
        notes.append(f"{graphs_compiled() - graphs_before} graphs compiled while timed")
    if not paged:
        notes.append(f"{stats['lanes_busy']:.0%} of its {c.max_num_seqs} places busy in an average step")
    if c.enable_prefix_caching:
        notes.append(f"prefix-cache hit rate {stats['cached_tokens'] / stats['prompt_tokens']:.0%} of prompt tokens")
    if stats["drafts"]:
        notes.append(f"{stats['accepted']} of {stats['drafts']} drafts accepted "
                     f"({stats['accepted'] / stats['drafts']:.0%})")
    if stats["preemptions"]:
        notes.append(f"{stats['preemptions']} preemptions")
    row = LadderRow(rung, list(range(len(work))), {i: o.token_ids for i, o in enumerate(outs)}, seconds,
                    [o.metrics.ttft_s for o in outs], [o.metrics.tpot_s for o in outs], kv, compile_s,
                    "; ".join(notes), engine=repr(llm), peak_running=peak[1], stats=stats)
    del llm, outs
    gc.collect()
    return row


def engine_kwargs_for(rung: str, work: LadderWorkload, device: str, batch: int, block_size: int,
                      max_model_len: int | None, paged_max_num_seqs: int | None, k: int) -> dict:
    """Each engine rung's configuration: every one adds one thing to the one before it. max_model_len is the
    engine's default for the device (or the workload's longest request, if longer). The paged rungs get the
    contiguous cache's memory as blocks (`num_kv_blocks`) and the engine's default batch limit."""
    from ..engine_config import DEFAULT_LIMITS

    kind = "cuda" if device.startswith("cuda") else "cpu"
    length = max_model_len or max(DEFAULT_LIMITS[kind][1], work.longest)
    base = {"max_model_len": length, "chunked_prefill_tokens": 512}
    if rung in ("static", "continuous"):
        return {**base, "kv_cache": "contiguous", "max_num_seqs": batch, "scheduling": rung}
    paged = {**base, "kv_cache": "paged", "block_size": block_size, "num_kv_blocks": -(-batch * length // block_size),
             "max_num_seqs": paged_max_num_seqs, "enable_prefix_caching": False}
    steps = ["paged", "prefix", "speculative", "compiled_engine"]
    adds = {"prefix": {"enable_prefix_caching": True},
            "speculative": {"speculative": {"method": "ngram", "k": k, "ngram_min": 1, "ngram_max": 4}},
            "compiled_engine": {"compile": True}}
    for step in steps[1:steps.index(rung) + 1]:
        paged.update(adds[step])
    return paged


def bench_ladder(device: str = "cpu", dtype: str = "float32", requests: int | None = None, batch: int | None = None,
                 sample: int | None = None, rungs=RUNGS, k: int = 4, block_size: int = 16,
                 max_model_len: int | None = None, paged_max_num_seqs: int | None = None,
                 max_tokens_cap: int | None = None, system_prompt: str = SYSTEM_PROMPT, length_scale: float = 1.0,
                 plot: str | None = None,
                 model=None, tok=None, tune: bool = True, progress: bool = True, print_fn=print) -> LadderResult:
    """Run the ladder and print its report (and save the chart to `plot`). `model`/`tok`: weights already loaded
    (the notebook's); otherwise the embedded model is loaded. Sizes default by device (`default_size`);
    `length_scale` shortens every request's max_tokens and keeps their mix (`LadderWorkload.build`);
    `max_tokens_cap` and a short `system_prompt` make a quick run (a smoke test)."""
    from ..course.formulas import kv_bytes_per_token
    from ..course.hardware import describe_machine
    from ..backends.cpu import warm_up
    from ..loading.loader import load_model

    unknown = [r for r in rungs if r not in RUNGS]
    if unknown:
        raise ValueError(f"rungs: unknown {unknown}; choose from {list(RUNGS)}")
    rungs = [r for r in RUNGS if r in rungs]  # always in ladder order
    size = default_size(device)
    requests, batch, sample = (size[name] if value is None else value
                               for name, value in (("requests", requests), ("batch", batch), ("sample", sample)))
    if min(requests, batch, sample, k) < 1:
        raise ValueError("requests, batch, sample and k must be >= 1")
    if model is None:
        model, tok = load_model("smollm2-135m", device=device, dtype=dtype)
    device, dtype = str(model.device), str(model.dtype).removeprefix("torch.")
    work = LadderWorkload.build(tok, requests, max_tokens_cap, system_prompt, length_scale)
    sample_idx = list(range(min(sample, requests)))
    t0 = time.perf_counter()
    if tune:  # every row bucket a step can bring, 1 to 256 (`autotune.row_bucket`), decided before any timing
        warm_up(model, [1 << i for i in range(9)])
    tune_s = time.perf_counter() - t0
    rows: list[LadderRow] = []
    engine_info: dict = {}
    wall: dict[str, float] = {}
    for rung in rungs:
        started = time.perf_counter()
        if rung == "hf":
            try:
                from .runs import load_hf
                hf = load_hf(device, model.dtype, model)
            except ImportError:
                print_fn("transformers is not installed: HF row skipped (pip install -e '.[dev]')")
                continue
            c = model.config
            per_token = kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, model.dtype.itemsize)
            warm = LadderWorkload(work.prompts[:1], [2], work.kinds[:1], work.shared_prefix_len)
            run_hf(hf, warm, batch, tok.eos_token_id, per_token, False)  # HF's lazy init, as ours is warmed
            rows.append(run_hf(hf, work, batch, tok.eos_token_id, per_token, progress))
            del hf
            gc.collect()
        elif rung in SINGLE_STREAM:
            rows.append(run_single_stream(model, tok, work, sample_idx, rung, progress))
        else:
            kwargs = engine_kwargs_for(rung, work, device, batch, block_size, max_model_len, paged_max_num_seqs, k)
            row = run_engine_rung(model, tok, work, rung, progress, **kwargs)
            engine_info[LABELS[rung]] = row.engine
            rows.append(row)
        wall[rung] = time.perf_counter() - started
    result = LadderResult(rows, work, sample_idx, device, dtype, batch, describe_machine(device), tune_s, engine_info,
                          wall)
    print_fn(result.report())
    if plot:
        import matplotlib.pyplot as plt
        fig = result.plot(plot)
        plt.close(fig)
        print_fn(f"saved {plot}")
    return result
