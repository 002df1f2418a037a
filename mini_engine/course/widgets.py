"""Sliders over the cost formulas and simulators: each widget is a thin view of `formulas` / `simulate`.

Every builder returns an `ipywidgets.VBox` (controls, a summary, the plot, an error area) without
displaying it; a notebook calls `display(widget)`. Plots are drawn on a standalone matplotlib `Figure`
(no pyplot state, nothing to close, nothing shown twice by the inline backend), rendered to PNG and
placed in an `ipywidgets.Image`, so they work in Jupyter, Colab and VS Code alike, and tests can watch
the picture change without a kernel.
"""
from __future__ import annotations

import io
from typing import Callable

import ipywidgets as W
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from . import formulas as F
from . import interconnects as I
from . import rooflines as R
from . import serving_sim as L
from . import simulate as S
from ..config import PRESETS

_SLIDER = dict(continuous_update=False, style={"description_width": "initial"})


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    return buf.getvalue()


def _figure(ncols: int, width: float = 10, height: float = 3.6) -> tuple[Figure, list]:
    # Fixed margins: constrained layout would more than double the cost of every redraw.
    fig = Figure(figsize=(width, height))
    fig.subplots_adjust(left=0.8 / width, right=1 - 0.2 / width, bottom=0.55 / height, top=1 - 0.35 / height,
                        wspace=0.3)
    return fig, list(fig.subplots(1, ncols, squeeze=False)[0])


def _live(controls: dict[str, W.Widget], render: Callable[..., tuple[str, Figure]]) -> W.VBox:
    """Wire controls to `render(**values) -> (summary html, figure)` and draw once."""
    summary, plot, errors = W.HTML(), W.Image(format="png"), W.Output()

    def draw():
        text, fig = render(**{name: w.value for name, w in controls.items()})
        summary.value, plot.value = text, _png(fig)

    def redraw(_change):
        errors.outputs = ()  # clear_output() would also print terminal escape codes outside a kernel
        with errors:  # in a notebook a failure is shown here instead of vanishing into the browser log
            draw()

    for w in controls.values():
        w.observe(redraw, names="value")
    draw()  # outside `errors`, so a widget that cannot draw fails loudly where it is built (and in CI)
    panel = W.Box(list(controls.values()), layout=W.Layout(flex_flow="row wrap"))
    return W.VBox([panel, summary, plot, errors])


def _model_dropdown(value: str) -> W.Dropdown:
    return W.Dropdown(options=list(PRESETS), value=value, description="model")


def _dtype_dropdown(value: str = "fp16") -> W.Dropdown:
    return W.Dropdown(options=list(F.DTYPE_BYTES), value=value, description="dtype")


def _si(x: float, unit: str) -> str:
    """1.2e15, 'FLOP' -> '1.20 PFLOP'."""
    for prefix, scale in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    cells = lambda tag, row: "".join(f"<{tag} style='padding:0 8px;text-align:right'>{c}</{tag}>" for c in row)
    body = "".join(f"<tr>{cells('td', r)}</tr>" for r in rows)
    return f"<table><tr>{cells('th', header)}</tr>{body}</table>"


# ---------------------------------------------------------------- chapter 01: naive vs cached cost

def _render_naive_cost(model: str, tokens: int):
    steps = np.arange(1, tokens + 1)  # step s runs over a sequence of s tokens (a 1-token prompt)
    naive_step = F.naive_step_flops(model, steps)
    cached_step = np.where(steps == 1, naive_step, F.decode_flops(model, steps))
    naive_total = F.naive_generation_flops(model, 1, steps)
    cached_total = F.cached_generation_flops(model, 1, steps)

    fig, (left, right) = _figure(2, 10, 3.6)
    left.plot(steps, naive_step, label="no cache: forward over all s tokens")
    left.plot(steps, cached_step, label="KV cache: one new token")
    left.set(xlabel="step s (sequence length)", ylabel="FLOPs in this step", yscale="log", title="per step")
    right.plot(steps, naive_total, label="no cache (O(N³) attention)")
    right.plot(steps, cached_total, label="KV cache (O(N²) attention)")
    right.set(xlabel="tokens generated N", ylabel="total FLOPs", xscale="log", yscale="log", title="in total")
    for ax in (left, right):
        ax.legend(fontsize=8)

    attn_naive = F.attention_flops(model, 1, np.sum(steps.astype(float) ** 2))
    text = (f"<b>{model}</b>, {tokens} tokens from a 1-token prompt: without a cache "
            f"{_si(naive_total[-1], 'FLOP')} ({100 * attn_naive / naive_total[-1]:.0f}% of it attention), "
            f"with a cache {_si(cached_total[-1], 'FLOP')}: <b>{naive_total[-1] / cached_total[-1]:.0f}×</b> "
            f"less work. Attention alone shrinks by Σi²/Σi = {F.attention_work_ratio(tokens):.0f}×.")
    return text, fig


def naive_cost_widget(model: str = "smollm2-135m", tokens: int = 1024) -> W.VBox:
    """Chapter 01: FLOPs of generating N tokens by full recompute vs with a KV cache."""
    return _live({"model": _model_dropdown(model),
                  "tokens": W.IntSlider(value=tokens, min=16, max=8192, step=16, description="tokens", **_SLIDER)},
                 _render_naive_cost)


# ---------------------------------------------------------------- chapter 02: roofline

def _render_roofline(model: str, batch: int, context: int, dtype: str, peak_flops: float, peak_bw: float):
    nbytes = F.DTYPE_BYTES[dtype]
    ridge = F.ridge_point(peak_flops, peak_bw)
    intensity = F.decode_intensity(model, batch, context, nbytes)
    flops = F.decode_flops(model, context, batch)
    moved = F.decode_bytes(model, batch, context, nbytes)
    step_s = F.roofline_time(flops, moved, peak_flops, peak_bw)
    bound = F.roofline_bound(flops, moved, peak_flops, peak_bw)
    prefill = F.prefill_intensity(model, context, nbytes)

    fig, (ax,) = _figure(1, 7.5, 4)
    x = np.logspace(-1, 5, 200)
    ax.plot(x, F.attainable_flops(x, peak_flops, peak_bw), color="k", label="roofline")
    ax.axvline(ridge, color="grey", ls="--", label=f"ridge {ridge:.0f} FLOP/B")
    batches = 2 ** np.arange(10)
    ib = F.decode_intensity(model, batches, context, nbytes)
    ax.plot(ib, F.attainable_flops(ib, peak_flops, peak_bw), "o", color="C0", alpha=0.3, label="decode, batch 1…512")
    ax.plot([intensity], [F.attainable_flops(intensity, peak_flops, peak_bw)], "o", color="C0", ms=10,
            label=f"decode, batch {batch}")
    ax.plot([prefill], [F.attainable_flops(prefill, peak_flops, peak_bw)], "s", color="C1", ms=8,
            label=f"prefill of {context} tokens")
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)", ylabel="attainable FLOP/s",
           title=f"{model}, {dtype}, context {context}")
    ax.legend(fontsize=8, loc="lower right")

    text = (f"Decode at batch {batch}: {intensity:.1f} FLOP/byte against a ridge of {ridge:.0f}, so it is "
            f"<b>{bound}-bound</b>. Roofline step time {step_s * 1e3:.2f} ms, "
            f"at most <b>{batch / step_s:,.0f} tok/s</b> in total ({1 / step_s:,.0f} tok/s per sequence). "
            f"A {context}-token prefill runs at {prefill:.0f} FLOP/byte.")
    return text, fig


def roofline_widget(peak_flops: float = 312e12, peak_bw: float = 2.039e12, model: str = "llama-7b") -> W.VBox:
    """Chapter 02: where a decode step sits on the roofline as the batch grows.

    Defaults are an A100-80GB SXM (312 TFLOP/s dense bf16, 2.04 TB/s); pass your own machine's measured
    ceilings. The peak is taken as given for every dtype: the dtype only changes the bytes moved.
    """
    controls = {"model": _model_dropdown(model),
                "batch": W.IntSlider(value=1, min=1, max=512, description="batch", **_SLIDER),
                "context": W.IntSlider(value=1024, min=1, max=32768, description="context", **_SLIDER),
                "dtype": _dtype_dropdown()}
    return _live(controls, lambda **v: _render_roofline(**v, peak_flops=peak_flops, peak_bw=peak_bw))


# ---------------------------------------------------------------- chapter 03: KV memory calculator

_TEXTBOOK_CONTEXTS = (1024, 4096, 32768, 131072)  # the columns of the textbook's KV-cache exercise


def _kv_head_options(model: str) -> list[tuple[str, int]]:
    """0 stands for the model's own KV heads; the others are every valid grouping of its query heads."""
    cfg = PRESETS[model]
    kinds = lambda d: "MHA" if d == cfg.num_heads else "MQA" if d == 1 else "GQA"
    divisors = [d for d in range(cfg.num_heads, 0, -1) if cfg.num_heads % d == 0]
    return [(f"as trained ({cfg.num_kv_heads})", 0)] + [(f"{d} ({kinds(d)})", d) for d in divisors]


def _render_kv_memory(model: str, context: int, batch: int, dtype: str, kv_heads: int, gpu_gib: float):
    nbytes = F.DTYPE_BYTES[dtype]
    heads = kv_heads or PRESETS[model].num_kv_heads
    per_token = F.kv_bytes_per_token_for(model, nbytes, heads)
    per_request = F.kv_cache_bytes_for(model, context, 1, nbytes, heads)
    weights = F.weight_bytes(model, nbytes)
    gpu = gpu_gib * F.GiB
    fits = F.max_concurrent_requests(gpu, weights, per_request)
    needed = weights + batch * per_request

    fig, (left, right) = _figure(2, 10, 3.6)
    contexts = 2 ** np.arange(8, 18)
    for name in PRESETS:
        left.plot(contexts, F.kv_cache_bytes_for(name, contexts, 1, nbytes) / F.GiB, marker=".", label=name)
    left.plot([context], [per_request / F.GiB], "ko", label=f"{model}, {heads} KV heads")
    left.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="KV GiB per sequence", title=dtype)
    left.legend(fontsize=7)
    requests = np.arange(0, max(2 * max(fits, batch), 8) + 1)
    right.fill_between(requests, 0, weights / F.GiB, color="grey", alpha=0.4, label="weights")
    right.plot(requests, (weights + requests * per_request) / F.GiB, label="weights + KV")
    right.axhline(gpu_gib, color="r", ls="--", label=f"GPU {gpu_gib:g} GiB")
    right.axvline(batch, color="k", lw=0.8, label=f"batch {batch}")
    right.plot([fits], [(weights + fits * per_request) / F.GiB], "o", color="C0", label=f"{fits} fit")
    right.set(xlabel="concurrent requests", ylabel="GiB", title=f"{model} at {context} tokens each")
    right.legend(fontsize=8)

    verdict = "fits" if needed <= gpu else "does <b>not</b> fit"
    book_rows = [[name] + [f"{F.kv_cache_bytes_for(name, c, 1, nbytes) / F.GiB:.2f}" for c in _TEXTBOOK_CONTEXTS]
                 for name in PRESETS]
    text = (f"KV cache: {per_token / F.MiB:.3f} MiB per token, {F.human_bytes(per_request)} per {context}-token "
            f"request, {F.human_bytes(batch * per_request)} for a batch of {batch}; weights "
            f"{F.human_bytes(weights)}. Total {F.human_bytes(needed)}: {verdict} in {gpu_gib:g} GiB. "
            f"<b>{fits}</b> such requests fit beside the weights."
            + _table(["KV GiB per sequence", "1K", "4K", "32K", "128K"], book_rows))
    return text, fig


def kv_memory_widget(model: str = "llama-2-13b", gpu_gib: float = 80.0) -> W.VBox:
    """Chapter 03: KV-cache bytes per token, per request and per batch, and how many requests fit.

    The "80 GB" A100/H100 cards hold 80 GiB, hence the GiB default. The table reproduces the textbook's figures
    (at fp16: Llama-7B "roughly 2 GB per sequence" at 4K; Llama-70B at 128K "roughly 40 GB" with its 8 GQA KV
    heads and "roughly 320 GB" with 64).
    """
    model_box = _model_dropdown(model)
    kv_heads = W.Dropdown(options=_kv_head_options(model), value=0, description="KV heads")
    # Registered before _live's observer, so the options match the new model by the time it redraws.
    model_box.observe(lambda change: setattr(kv_heads, "options", _kv_head_options(change["new"])), names="value")
    controls = {"model": model_box,
                "context": W.IntSlider(value=2048, min=256, max=131072, step=256, description="context", **_SLIDER),
                "batch": W.IntSlider(value=1, min=1, max=256, description="batch", **_SLIDER),
                "dtype": _dtype_dropdown(),
                "kv_heads": kv_heads,
                "gpu_gib": W.FloatSlider(value=gpu_gib, min=8, max=192, step=1, description="GPU GiB", **_SLIDER)}
    return _live(controls, _render_kv_memory)


# ---------------------------------------------------------------- chapter 04: batching

def _timeline_image(ax, run: S.BatchRun, steps: int, title: str):
    lanes = np.ma.masked_less(run.timeline.T, 0)  # idle lane-steps stay white
    ax.imshow(lanes % 20, aspect="auto", interpolation="nearest", cmap="tab20",
              extent=(0, run.steps, run.batch_size - 0.5, -0.5))
    ax.set(xlim=(0, steps), xlabel="step", ylabel="lane", title=f"{title}: {100 * run.utilisation:.0f}% busy")


def _render_batching(batch: int, spread: float, requests: int, mean: int = 100, seed: int = 0):
    lengths = S.sample_lengths(requests, mean, spread, seed)
    runs = static, continuous = S.simulate_static(lengths, batch), S.simulate_continuous(lengths, batch)

    fig, (left, right) = _figure(2, 10, 3.4)
    _timeline_image(left, static, static.steps, "static")
    _timeline_image(right, continuous, static.steps, "continuous")

    rows = [[r.policy, f"{100 * r.utilisation:.0f}%", r.steps, f"{r.tokens_per_step:.1f}",
             f"{r.mean_latency_steps:.0f}"] for r in runs]
    text = (f"{requests} requests waiting, lengths between {lengths.min()} and {lengths.max()}, {batch} lanes. "
            f"Continuous batching serves them in {static.steps / continuous.steps:.2f}× fewer steps:"
            + _table(["policy", "busy", "steps", "tokens/step", "mean latency (steps)"], rows))
    return text, fig


def batching_widget(batch: int = 8, spread: float = 1.0, requests: int = 64) -> W.VBox:
    """Chapter 04: lanes of a static batch wait for its longest request; continuous batching refills them."""
    controls = {"batch": W.IntSlider(value=batch, min=1, max=64, description="batch", **_SLIDER),
                "spread": W.FloatSlider(value=spread, min=0, max=1, step=0.05, description="length spread", **_SLIDER),
                "requests": W.IntSlider(value=requests, min=1, max=1000, description="requests", **_SLIDER)}
    return _live(controls, _render_batching)


# ---------------------------------------------------------------- chapter 06: speculative decoding

def _render_speculative(k: int, alpha: float, draft_cost: float, overhead: float):
    ks = np.arange(0, 17)
    fig, (left, right) = _figure(2, 10, 3.6)
    for a in (0.5, 0.6, 0.7, 0.8, 0.9):
        left.plot(ks, F.speculative_speedup(ks, a, draft_cost, overhead), color="grey", alpha=0.4)
        left.annotate(f"α={a}", (ks[-1], F.speculative_speedup(ks[-1], a, draft_cost, overhead)), fontsize=7)
    curve = F.speculative_speedup(ks, alpha, draft_cost, overhead)
    left.plot(ks, curve, color="C0", lw=2, label=f"α = {alpha:.2f}")
    left.plot([k], [F.speculative_speedup(k, alpha, draft_cost, overhead)], "o", color="C0", ms=9)
    left.axhline(1, color="k", lw=0.8)
    left.set(xlabel="draft tokens k", ylabel="speedup", title=f"draft cost {draft_cost:g}, overhead {overhead:g}")
    left.legend(fontsize=8)
    alphas = np.linspace(0, 1, 101)
    right.plot(alphas, F.expected_tokens_per_step(k, alphas), color="C1")
    right.plot([alpha], [F.expected_tokens_per_step(k, alpha)], "o", color="C1", ms=9)
    right.set(xlabel="acceptance rate α", ylabel="tokens per target pass", title=f"k = {k}")

    tokens, round_cost = F.expected_tokens_per_step(k, alpha), 1 + k * draft_cost + overhead
    best = int(ks[np.argmax(curve)])
    text = (f"k = {k}, α = {alpha:.2f}: {tokens:.2f} tokens per target pass for a round costing "
            f"{round_cost:.2f} target passes: <b>{F.speculative_speedup(k, alpha, draft_cost, overhead):.2f}×</b>. "
            f"The best k here is {best} ({curve[best]:.2f}×).")
    return text, fig


def speculative_widget(k: int = 4, alpha: float = 0.8, draft_cost: float = 0.02, overhead: float = 0.05) -> W.VBox:
    """Chapter 06: expected tokens per target pass and speedup as functions of k, α and the draft's cost."""
    controls = {"k": W.IntSlider(value=k, min=0, max=16, description="k", **_SLIDER),
                "alpha": W.FloatSlider(value=alpha, min=0, max=1, step=0.01, description="alpha", **_SLIDER),
                "draft_cost": W.FloatSlider(value=draft_cost, min=0, max=0.5, step=0.005, description="draft cost",
                                            readout_format=".3f", **_SLIDER),
                "overhead": W.FloatSlider(value=overhead, min=0, max=0.5, step=0.01, description="overhead", **_SLIDER)}
    return _live(controls, _render_speculative)


# ---------------------------------------------------------------- chapter 07: fragmentation

_LAYOUT_COLOURS = {"written": "C0", "later": "#9ecae1", "internal": "C3", "external": "#444444", "free": "#dddddd"}


def kv_layout_legend() -> list[Patch]:
    """Legend entries for `draw_kv_layout`'s colours."""
    names = {"written": "tokens written", "later": "held for later tokens", "internal": "held, never filled: internal",
             "external": "free, too small: external", "free": "free"}
    return [Patch(color=_LAYOUT_COLOURS[k], label=label) for k, label in names.items()]


def draw_kv_layout(ax, row: int, run: S.LayoutRun, step: int) -> None:
    """One layout's KV budget at `step` as a strip of slots: each running request's written tokens, the
    slots it will fill later, the slots it holds but never fills, and the free slots (dark where they are
    stranded: free, but in holes too small for the next request)."""
    ids, written = run.snapshot(step)
    if run.layout == "contiguous":
        at = run.offset[ids]
        spans = sorted(zip(at, at + run.held[ids]))
        holes, edge = [], 0
        for lo, hi in spans + [(run.budget_tokens, run.budget_tokens)]:
            if lo > edge:
                holes.append((edge, lo - edge))
            edge = hi
        stranded = run.stranded[np.searchsorted(run.events[:, 0], step, side="right") - 1] > 0
        ax.broken_barh(holes, (row - 0.35, 0.7), color=_LAYOUT_COLOURS["external" if stranded else "free"], lw=0)
    else:  # drawn packed; in the pool a request's blocks lie anywhere
        at = np.concatenate([[0], np.cumsum(run.held[ids])[:-1]]).astype(np.int64)
        used = int(run.held[ids].sum())
        ax.broken_barh([(used, run.budget_tokens - used)], (row - 0.35, 0.7), color=_LAYOUT_COLOURS["free"], lw=0)
    length = run.lengths[ids]
    for colour, lo, width in (("written", at, written), ("later", at + written, length - written),
                              ("internal", at + length, run.held[ids] - length)):
        ax.broken_barh(list(zip(lo, width)), (row - 0.35, 0.7), color=_LAYOUT_COLOURS[colour], lw=0)


def _render_fragmentation(budget_tokens: int, max_model_len: int, block_size: int, mix: str, mean_len: int,
                          reserve: str):
    contiguous, paged = S.simulate_kv_layouts(budget_tokens, max_model_len, block_size, mix, mean_len, reserve)
    # The picture's moment, while both layouts still have requests waiting: where the most free memory was
    # stranded, else halfway through.
    until = min(contiguous.filling_until, paged.filling_until)
    stranded = np.where(contiguous.events[:, 0] < until, contiguous.stranded, 0)
    step = int(contiguous.events[stranded.argmax(), 0]) if stranded.max() > 0 else until // 2

    fig, (left, right) = _figure(2, 10, 3.8)
    for row, run in enumerate((paged, contiguous)):
        draw_kv_layout(left, row, run, step)
    left.set(yticks=[0, 1], xlim=(0, budget_tokens), ylim=(-0.5, 2.4), xlabel=f"KV slots (tokens), step {step}",
             title="the budget at one moment")
    left.set_yticklabels([f"paged\n({block_size})", "contiguous"], fontsize=8)
    left.legend(handles=kv_layout_legend(), fontsize=7, loc="upper center", ncol=3, frameon=False)
    for run, colour in ((contiguous, "grey"), (paged, "C1")):
        steps, running = run.events[:, 0], run.events[:, 1]
        keep = steps <= run.filling_until
        right.step(steps[keep], running[keep], where="post", color=colour, label=run.layout)
    right.axvline(step, color="k", lw=0.6, ls=":")
    right.set(xlabel="step", ylabel="requests running", title="while requests wait")
    right.legend(fontsize=8)

    gain = paged.mean_running / contiguous.mean_running
    held = "its own max_model_len" if reserve == "max_model_len" else "what it asks for (2× its length here)"
    if contiguous.stranded.max() > 0:
        external = (f"Reservations differ in size, so free memory breaks into holes: <b>"
                    f"{100 * contiguous.stranded_time_fraction:.0f}%</b> of the time the next request waited "
                    f"although enough slots were free, up to {contiguous.stranded.max()} of them "
                    f"(<b>external fragmentation</b>).")
    else:
        external = ("Every reservation is the same size, so a freed one always fits the next request: no "
                    "external fragmentation.")
    text = (f"Contiguous: each request reserves {held}; <b>{100 * contiguous.internal_waste_fraction:.0f}%</b> "
            f"of the reserved slots never hold a token (<b>internal fragmentation</b>). {external} "
            f"Paged, {block_size}-token blocks: {100 * paged.internal_waste_fraction:.1f}% of the held slots "
            f"stay empty, never more than block_size − 1 = {block_size - 1} per request, and any free block "
            f"serves any request. Requests running at once, on average while others wait: "
            f"<b>{contiguous.mean_running:.0f}</b> contiguous, <b>{paged.mean_running:.0f}</b> paged "
            f"(<b>{gain:.1f}×</b>).")
    return text, fig


def fragmentation_widget(budget_tokens: int = 64 * 2048, max_model_len: int = 2048, block_size: int = 16,
                         mix: str = "lognormal", mean_len: int = 512, reserve: str = "max_model_len") -> W.VBox:
    """Chapter 07: one queue of requests served from a fixed KV budget, contiguous reservations against paged
    blocks (`simulate.simulate_kv_layouts`): the budget at one moment, and requests running over time.

    The defaults (a chat-like lognormal mix averaging 512 tokens, 2048-token reservations, 64 of them in the
    budget) leave about 78% of every reservation empty, inside the textbook's "waste from 60–80%", and paged
    blocks waste under one block per request, its "≤15 tokens per request". Reserving per request shows the
    external fragmentation that equal reservations cannot have.
    """
    controls = {"budget_tokens": W.IntSlider(value=budget_tokens, min=16384, max=1 << 19, step=16384,
                                             description="KV budget (tokens)", **_SLIDER),
                "max_model_len": W.IntSlider(value=max_model_len, min=256, max=16384, step=256,
                                             description="max_model_len", **_SLIDER),
                "block_size": W.Dropdown(options=[1, 8, 16, 32, 64, 128, 256], value=block_size, description="block"),
                "mix": W.Dropdown(options=list(S.LENGTH_MIXES), value=mix, description="length mix"),
                "mean_len": W.IntSlider(value=mean_len, min=16, max=4096, step=16, description="mean length",
                                        **_SLIDER),
                "reserve": W.Dropdown(options=list(S.RESERVATIONS), value=reserve, description="reserve")}
    return _live(controls, _render_fragmentation)


# ---------------------------------------------------------------- chapter 08: prefix caching

def _render_prefix_cache(model: str, prefix: int, suffix: int, requests: int, block_size: int, dtype: str,
                         peak_flops: float, peak_bw: float):
    saved = F.prefix_cache_savings(prefix, suffix, requests, model, block_size)
    gpu = dict(dtype_bytes=F.DTYPE_BYTES[dtype], peak_flops=peak_flops, peak_bw=peak_bw, block_size=block_size)
    without, with_hit = F.prefix_cache_ttft(model, prefix, suffix, **gpu)
    tail = prefix + suffix - saved.cached_tokens  # what a hit still computes
    bound = F.roofline_bound(F.prefill_flops(model, tail, saved.cached_tokens),
                             F.prefill_bytes(model, tail, gpu["dtype_bytes"], saved.cached_tokens), peak_flops, peak_bw)

    fig, (left, right) = _figure(2, 10, 3.4)
    n = np.arange(1, requests + 1, dtype=float)  # float: FLOP totals overflow int64 at large settings
    left.plot(n, n * (saved.flops_without / requests), label="no prefix cache")
    left.plot(n, F.prefill_flops(model, saved.cached_tokens) + n * F.prefill_flops(model, tail, saved.cached_tokens),
              label="prefix cached")
    left.set(xlabel="requests served", ylabel="prefill FLOPs", title=model)
    left.legend(fontsize=8)
    prefixes = np.unique(np.geomspace(1, max(prefix, 2) * 4, 60).astype(int))
    curve_without, curve_with = F.prefix_cache_ttft(model, prefixes, suffix, **gpu)
    right.plot(prefixes, F.prefix_cache_savings(prefixes, suffix, 1, model, block_size).ttft_ratio,
               label="FLOPs (compute-bound)")
    right.plot(prefixes, curve_without / curve_with, label="roofline")
    right.plot([prefix], [saved.ttft_ratio], "o", color="C0", ms=9)
    right.plot([prefix], [without / with_hit], "o", color="C1", ms=9)
    right.set(xscale="log", xlabel="shared prefix (tokens)", ylabel="TTFT without / with",
              title=f"suffix {suffix} tokens, blocks of {block_size}")
    right.legend(fontsize=8)

    text = (f"{requests} requests sharing a {prefix}-token prefix, {suffix} own tokens each, blocks of {block_size}: "
            f"a hit serves {saved.cached_tokens} of {prefix + suffix} prompt tokens (full blocks only, never the "
            f"last token); hit rate <b>{100 * saved.hit_rate:.0f}%</b>. {_si(saved.flops_skipped, 'FLOP')} of "
            f"{_si(saved.flops_without, 'FLOP')} prefill skipped "
            f"({100 * saved.flops_skipped / saved.flops_without:.0f}%); a cache hit cuts time to first token "
            f"by about <b>{saved.ttft_ratio:.0f}×</b> (compute-bound prefill). On the roofline "
            f"({peak_flops / 1e12:g} TFLOP/s, {peak_bw / 1e12:g} TB/s, {dtype}) TTFT goes from "
            f"{without * 1e3:.1f} ms to {with_hit * 1e3:.1f} ms, <b>{without / with_hit:.1f}×</b>: the "
            f"{tail}-token prefill left is {bound}-bound.")
    return text, fig


def prefix_cache_widget(model: str = "llama-2-13b", prefix: int = 2000, suffix: int = 50, requests: int = 1000,
                        block_size: int = 16, peak_flops: float = 312e12, peak_bw: float = 2.039e12) -> W.VBox:
    """Chapter 08's savings calculator: hit rate, FLOPs skipped and TTFT gained by caching a shared prefix.

    The textbook's "cuts TTFT ~40×" and "~52 PFLOP of redundant prefill across 1,000 requests" are the
    defaults' compute-bound figures (41×). The roofline TTFT uses an
    A100-80GB SXM unless told otherwise; there a 50-token suffix is memory-bound and the gain about 13×
    (see `formulas.prefix_cache_ttft`).
    """
    controls = {"model": _model_dropdown(model),
                "prefix": W.IntSlider(value=prefix, min=0, max=32768, step=50, description="shared prefix", **_SLIDER),
                "suffix": W.IntSlider(value=suffix, min=1, max=4096, description="own tokens", **_SLIDER),
                "requests": W.IntSlider(value=requests, min=1, max=10000, description="requests", **_SLIDER),
                "block_size": W.Dropdown(options=[1, 8, 16, 32, 64, 128, 256], value=block_size, description="block"),
                "dtype": _dtype_dropdown()}
    return _live(controls, lambda **v: _render_prefix_cache(**v, peak_flops=peak_flops, peak_bw=peak_bw))


_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _render_block_boundary(block_size: int, shared: int, matches: int):
    own = 32  # the request's own tokens after the shared prefix (they never change what a match serves)
    hashed = F.cached_prefix_tokens(shared + own, shared, block_size)
    radix = F.cached_prefix_tokens(shared + own, shared, 1)
    lost, mean = F.block_boundary_loss(shared + own, shared, block_size), F.expected_block_boundary_loss(block_size)

    fig, (left, right) = _figure(2, 10, 3.4)
    ends = np.arange(max(0, shared - 3 * block_size), shared + 3 * block_size + 1)  # three blocks either side
    left.plot(ends, F.block_boundary_loss(ends + own, ends, block_size), lw=1,
              label="whole pages (vLLM's blocks, SGLang above page 1)")
    left.axhline(mean, color="C1", ls="--", label=f"mean (B − 1) / 2 = {mean:g}")
    left.plot([shared], [lost], "o", color="C0", ms=8)
    left.set(xlabel="shared prefix (tokens)", ylabel="tokens lost per match",
             title=f"pages of {block_size}: matching at any token loses none")
    left.legend(fontsize=8, loc="upper left")
    sizes = np.array(_BLOCK_SIZES)
    right.plot(sizes, F.expected_block_boundary_loss(sizes), "o-", label="expected, prefixes ending anywhere")
    right.plot([block_size], [mean], "o", color="C3", ms=9)
    right.set(xscale="log", xlabel="block size (tokens)", ylabel="tokens lost per match",
              title="about half a block a match")
    right.set_xticks(sizes, [str(b) for b in sizes])
    right.legend(fontsize=8, loc="upper left")

    text = (f"A {shared}-token shared prefix in blocks of {block_size}: a cache of whole blocks (vLLM's hashed blocks, "
            f"or SGLang's tree with pages of {block_size}) serves {hashed} tokens, a match that ends at any token "
            f"(SGLang at page size 1, or this engine's shared partial block) {radix} (the prompt's own last token is "
            f"always computed): "
            f"<b>{lost}</b> tokens lost to the block boundary. Where shared prefixes end at random points, a match "
            f"loses (B − 1) / 2 = <b>{mean:g}</b> tokens on average, recomputed at every match: about "
            f"{matches * mean:,.0f} tokens over {matches:,} matches, {100 * mean / max(shared, 1):.1f}% of a "
            f"{shared}-token prefix each time. A conversation pays it every turn (its last answer ends anywhere); "
            "smaller blocks shrink it, at the price of a longer block table and smaller pieces of work for the "
            "attention kernel.")
    return text, fig


def block_boundary_widget(block_size: int = 16, shared: int = 300, matches: int = 1000) -> W.VBox:
    """Chapter 08's block-boundary slider: what whole blocks cost a prefix cache against a match ending at any token,
    for one shared prefix (`formulas.block_boundary_loss`) and on average over prefixes ending at random points
    (`formulas.expected_block_boundary_loss`: about half a block per match)."""
    controls = {"block_size": W.SelectionSlider(options=list(_BLOCK_SIZES), value=block_size, description="block size",
                                                **_SLIDER),
                "shared": W.IntSlider(value=shared, min=1, max=4096, description="shared prefix", **_SLIDER),
                "matches": W.IntSlider(value=matches, min=1, max=100000, description="matches", **_SLIDER)}
    return _live(controls, _render_block_boundary)


# ---------------------------------------------------------------- chapter 09: throughput against latency

_LOAD_BATCHES = (1, 4, 16, 64)  # the grey curves the chosen batch limit is compared with


def _load_rates(step_s: dict[int, float], tokens: int, prompt_s: float) -> np.ndarray:
    """Arrival rates from well below one place's capacity to past the largest batch's."""
    low = L.capacity(step_s, 1, tokens, prompt_s) / 4
    high = 1.5 * max(L.capacity(step_s, b, tokens, prompt_s) for b in (*_LOAD_BATCHES, max(step_s)))
    return np.geomspace(low, high, 20)


def _render_load(max_batch: int, rate: float, tokens: int, step_s: dict[int, float], prompt_s: float):
    rates = _load_rates(step_s, tokens, prompt_s)
    run = L.simulate_load(step_s, rate, max_batch, tokens, prompt_s)
    cap = L.capacity(step_s, max_batch, tokens, prompt_s)

    fig, (left, right) = _figure(2, 10, 3.6)
    for b in sorted({*_LOAD_BATCHES, max_batch}):
        curve = [L.simulate_load(step_s, r, b, tokens, prompt_s, requests=120) for r in rates]
        style = dict(color="C0", lw=2, label=f"max batch {b}") if b == max_batch else \
            dict(color="grey", alpha=0.45, lw=1)
        left.plot(rates, [c.tok_s for c in curve], **style)
        right.plot([c.tok_s for c in curve], [c.e2e_p50 for c in curve], **style)
        if b != max_batch:
            left.annotate(f"{b}", (rates[-1], curve[-1].tok_s), fontsize=7)
            right.annotate(f"{b}", (curve[-1].tok_s, curve[-1].e2e_p50), fontsize=7)
    left.plot([rate], [run.tok_s], "o", color="C1", ms=9)
    right.plot([run.tok_s], [run.e2e_p50], "o", color="C1", ms=9, label=f"{rate:.3g} req/s")
    left.set(xscale="log", xlabel="arrival rate (requests/s)", ylabel="output tokens/s",
             title="throughput (grey: other batch limits)")
    left.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    left.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x:g}"))
    left.xaxis.set_minor_formatter(NullFormatter())
    right.set(yscale="log", xlabel="output tokens/s", ylabel="end-to-end latency p50 (s)",
              title="latency against throughput")
    for ax in (left, right):
        ax.legend(fontsize=8)

    state = "below its capacity: requests rarely wait" if rate < 0.8 * cap else \
        "near its capacity: a burst makes requests wait" if rate < cap else \
        "past its capacity: the queue grows for as long as the load lasts"
    extrapolated = f" (measured up to batch {max(step_s)}, beyond it extrapolated)" if max_batch > max(step_s) else ""
    text = (f"{max_batch} places, {tokens} tokens per request: a step of {max_batch} takes "
            f"{L.step_seconds(step_s, max_batch) * 1e3:.1f} ms{extrapolated}, so the server sustains at most "
            f"<b>{cap:.2f} requests/s</b> ({cap * tokens:.0f} tok/s). At {rate:.3g} requests/s it is {state}: "
            f"<b>{run.tok_s:.0f} tok/s</b>, time to first token p50 {run.ttft_p50 * 1e3:.0f} ms (p99 "
            f"{run.ttft_p99 * 1e3:.0f} ms), end-to-end p50 <b>{run.e2e_p50:.2f} s</b>, {run.tpot_p50 * 1e3:.0f} ms "
            f"per token, {run.mean_batch:.1f} requests in an average step.")
    return text, fig


def load_widget(step_s: dict[int, float], prompt_s: float = 0.0, max_batch: int = 4, rate: float | None = None,
                tokens: int = 32) -> W.VBox:
    """Chapter 09: throughput and latency of a continuous-batching server as its batch limit and the arrival
    rate move (`serving_sim.simulate_load`), from measured decode step times `step_s` (batch -> seconds) and one
    prompt's prefill `prompt_s`. The rate starts at half the capacity of `max_batch` places."""
    rates = _load_rates(step_s, tokens, prompt_s)
    rate = rate or L.capacity(step_s, max_batch, tokens, prompt_s) / 2
    controls = {"max_batch": W.IntSlider(value=max_batch, min=1, max=64, description="max batch", **_SLIDER),
                "rate": W.FloatLogSlider(value=rate, base=10, min=np.log10(rates[0]), max=np.log10(rates[-1]),
                                         step=0.05, description="arrival rate (req/s)", readout_format=".3g",
                                         **_SLIDER),
                "tokens": W.IntSlider(value=tokens, min=8, max=512, step=8, description="tokens per request",
                                      **_SLIDER)}
    return _live(controls, lambda **v: _render_load(**v, step_s=step_s, prompt_s=prompt_s))


# ---------------------------------------------------------------- chapter 10: bits per weight on the roofline

def _render_quant_roofline(model: str, bits: float, batch: int, context: int, roofs: dict, kv_bytes: float):
    rows = R.quantized_decode_ceilings(model, bits, batch, context, kv_bytes, roofs)
    grid = np.linspace(2, 32, 121)
    per_token = F.decode_bytes_per_token(model, batch, context, kv_bytes, grid)
    weights = F.weight_bytes(model, grid / 8) / batch

    fig, (left, right) = _figure(2, 10, 3.6)
    left.fill_between(grid, 0, weights / F.GiB, color="C0", alpha=0.6, label="weights (shared by the batch)")
    left.fill_between(grid, weights / F.GiB, per_token / F.GiB, color="C3", alpha=0.5, label="K/V and activations")
    left.axvline(bits, color="k", lw=0.8)
    left.set(xlabel="bits per weight", ylabel="GiB moved per token", title=f"{model}, batch {batch}, context {context}")
    left.legend(fontsize=8, loc="upper left")
    for i, (name, roof) in enumerate(roofs.items()):
        curve = F.predicted_decode_tok_s(model, batch, context, kv_bytes, roof.peak_flops, roof.peak_bw, grid)
        right.plot(grid, curve, color=f"C{i}", label=name)
        right.plot([bits], [rows[i].tok_s], "o", color=f"C{i}")
    right.axvline(bits, color="k", lw=0.8)
    right.set(xscale="log", yscale="log", xlabel="bits per weight", ylabel="decode ceiling, tok/s",
              title="the roofline's ceiling")
    right.set_xticks([2, 4, 8, 16, 32], ["2", "4", "8", "16", "32"])
    right.xaxis.set_minor_formatter(NullFormatter())
    right.legend(fontsize=7)

    share = F.weight_bytes(model, bits / 8) / batch / rows[0].bytes_per_token
    table = _table(["machine", "TFLOP/s", "TB/s", "ceiling tok/s", "× 16-bit", "bound", "compute-bound below"],
                   [[name, f"{roof.peak_flops / 1e12:g}", f"{roof.peak_bw / 1e12:.3g}", f"{r.tok_s:,.0f}",
                     f"{r.speedup:.2f}×", r.bound, f"{r.bits_at_ridge:.1f} bits" if r.bits_at_ridge else "never"]
                    for (name, roof), r in zip(roofs.items(), rows)])
    text = (f"At {bits:g} bits per weight a decode step of {batch} sequence(s) moves "
            f"<b>{F.human_bytes(rows[0].bytes_per_token)} per token</b>, {100 * share:.0f}% of it weights. "
            f"Fewer bits raise the ceiling only while a step is memory-bound." + table)
    return text, fig


def quant_roofline_widget(roofs: dict | None = None, model: str = "llama-7b", bits: float = 4.0, batch: int = 1,
                          context: int = 1024, kv_bytes: float = 2) -> W.VBox:
    """Chapter 10: bits per weight against bytes per token and the decode ceiling on each machine's roofline
    (`rooflines.quantized_decode_ceilings`; default machines `rooflines.GPU_ROOFS`, add your own measured
    `rooflines.Roof`). The K/V cache and activations stay at `kv_bytes` bytes a value."""
    roofs = R.GPU_ROOFS if roofs is None else roofs
    controls = {"model": _model_dropdown(model),
                "bits": W.FloatSlider(value=bits, min=2, max=32, step=0.25, description="bits per weight", **_SLIDER),
                "batch": W.IntSlider(value=batch, min=1, max=256, description="batch", **_SLIDER),
                "context": W.IntSlider(value=context, min=16, max=32768, step=16, description="context", **_SLIDER)}
    return _live(controls, lambda **v: _render_quant_roofline(**v, roofs=roofs, kv_bytes=kv_bytes))


# ---------------------------------------------------------------- chapter 11: tensor parallelism

def _render_tensor_parallel(model: str, batch: int, ranks: int, system: str):
    sys_ = I.SYSTEMS[system]
    steps = [I.tensor_parallel_decode(sys_, model, batch, p) for p in range(1, 9)]
    st = steps[ranks - 1]
    ps = np.arange(1, 9)
    fig, (left, right) = _figure(2, 10, 3.6)
    compute = np.array([s.compute_s for s in steps]) * 1e3
    comm = np.array([s.communication_s for s in steps]) * 1e3
    left.bar(ps, compute, color="C0", label="compute per rank")
    left.bar(ps, comm, bottom=compute, color="C3", label="all-reduces")
    left.bar([ranks], [st.step_s * 1e3], fill=False, lw=2, edgecolor="k")
    left.set(xlabel="ranks p", ylabel="ms per decode step", title=f"{model}, batch {batch}")
    left.legend(fontsize=8)
    # One all-reduce by every algorithm at these ranks, over payloads from 1 KiB to 64 MiB.
    sizes = np.logspace(10, 26, 49, base=2)
    if ranks > 1:
        curves: dict[str, list[tuple[float, float]]] = {}  # vLLM's kernels each cover a range of sizes only
        for n in sizes:
            for name, sec in I.all_reduce_options(sys_, n, ranks).items():
                curves.setdefault(name, []).append((n, sec * 1e6))
        for i, (name, points) in enumerate(curves.items()):
            right.plot(*zip(*points), color=f"C{i}", label=name)
        right.axvline(st.payload_bytes, color="k", ls=":", lw=1)
        right.plot([st.payload_bytes], [st.all_reduce.seconds * 1e6], "ko")
        right.legend(fontsize=7)
    right.set(xscale="log", yscale="log", xlabel="payload (bytes)", ylabel="µs per all-reduce",
              title=f"one all-reduce at p = {ranks}, {sys_.link.name}")
    fits = st.weight_bytes_per_rank <= sys_.memory
    roof = sys_.roof
    text = (f"{model} ({st.collectives // 2} layers) at batch {batch}: one {roof.name} "
            f"({roof.peak_flops / 1e12:g} TFLOP/s, {roof.peak_bw / 1e12:.3g} TB/s) takes "
            f"<b>{st.one_rank_s * 1e3:.3f} ms</b> a step. ")
    if ranks == 1:
        text += "One rank: nothing to exchange."
    else:
        text += (f"On {ranks} of them, each computes {st.compute_s * 1e3:.3f} ms and spends "
                 f"{st.communication_s * 1e3:.3f} ms in {st.collectives} all-reduces of "
                 f"{st.payload_bytes / 1024:.1f} KiB, each {st.all_reduce.seconds * 1e6:.1f} µs by "
                 f"<b>{st.all_reduce.algorithm}</b>: <b>{st.speedup:.2f}×</b> one GPU's speed "
                 f"({st.communication_share:.0%} of the step communicating). ")
    heads = F.ModelShape.of(model).n_heads
    if heads % ranks:
        text += f"(vLLM would refuse {ranks} ranks: they must divide the {heads} query heads.) "
    text += (f"Each rank holds {st.weight_bytes_per_rank / 1e9:.1f} GB of 16-bit weights: "
             + (f"fits in its {sys_.memory / 1e9:.0f} GB." if fits else
                f"<b>does not fit</b> in its {sys_.memory / 1e9:.0f} GB."))
    return text, fig


def tensor_parallel_widget(model: str = "llama-70b-gqa", batch: int = 8, ranks: int = 4,
                           system: str = "H100 × NVLink 4 (NVSwitch)") -> W.VBox:
    """Chapter 11: compute per rank against communication per decode step (`interconnects.tensor_parallel_decode`),
    by model, batch, ranks and system: a GPU and its link chosen together, each GPU's own compute and bandwidth, and
    each all-reduce by the fastest algorithm known there (right: every algorithm's cost over payload sizes)."""
    controls = {"model": _model_dropdown(model),
                "batch": W.IntSlider(value=batch, min=1, max=256, description="batch", **_SLIDER),
                "ranks": W.IntSlider(value=ranks, min=1, max=8, description="ranks", **_SLIDER),
                "system": W.Dropdown(options=list(I.SYSTEMS), value=system, description="GPUs and link")}
    return _live(controls, _render_tensor_parallel)
