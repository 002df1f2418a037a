# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 · The naive baseline
#
# The simplest way to generate text is the way the maths is written: to pick token *n + 1*, run the whole
# sequence of *n* tokens through every layer and read the last position's scores. Then append the token
# and do it all again. Nothing is remembered between steps.
#
# This chapter measures what that costs on a real model, and builds the cost model that explains the
# measurements: every step is a full forward pass, so step *n* costs O(n) in the weight matmuls and O(n²)
# in attention, and generating *N* tokens costs O(N²) + O(N³) in total.

# %%
# Setup. On Colab: fetch the course from its repository and install it (the package, the model and,
# in a lab, the labs/, solutions/ and tests/ trees). Locally (make lab) all is installed: nothing to do.
import os
import subprocess
import sys

COURSE_URL = "https://github.com/llm-inference-course/mini-engine"  # set in tools/course_setup.py
if "google.colab" in sys.modules or "MINI_ENGINE_COURSE_URL" in os.environ:
    home = os.environ.setdefault("MINI_ENGINE_HOME", os.path.abspath("mini-engine"))
    if not os.path.isdir(home):
        url = os.environ.get("MINI_ENGINE_COURSE_URL", COURSE_URL)
        subprocess.run(["git", "clone", "-q", "--depth", "1", url, home], check=True)
    sys.path.insert(0, os.path.join(home, "tools"))
    import course_setup

    course_setup.install(home, lab=False)

# %%
import dataclasses
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import display

import mini_engine as me
from mini_engine import formulas
from mini_engine.course.devices import default_device, fitting, pick, synchronize, timed
from mini_engine.course.hardware import describe_machine, measure_ceilings
from mini_engine.course.widgets import naive_cost_widget

device = default_device()
dtype = me.default_dtype(device)
model, tok = me.load_model("smollm2-135m", device=device, dtype=dtype)
cfg = model.config
print(f"device: {device}, dtype: {dtype}")

# %% [markdown]
# ## The loop
#
# `generate_naive` is eight lines of real work. Read it: the line that matters is the forward pass over
# `seq`, the *whole* sequence so far, at every step.

# %%
import inspect

print(inspect.getsource(me.generate_naive))

# %%
prompt_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me a fun fact about octopuses."}]))
new_tokens = pick(cpu=48, gpu=256, device=device)
params = me.SamplingParams(max_tokens=new_tokens, ignore_eos=True)  # fixed length, so runs compare

stamps = []
synchronize(device)
t0 = time.perf_counter()
out = me.generate_naive(model, prompt_ids, new_tokens, params, on_token=lambda t: stamps.append(time.perf_counter()))
naive_s = time.perf_counter() - t0
naive_tok_s = len(out) / naive_s
print(tok.decode(out))
print(f"\n{len(out)} tokens in {naive_s:.2f} s = {naive_tok_s:.1f} tok/s (prompt {len(prompt_ids)} tokens)")
print(describe_machine(device))  # what that ran on

# %% [markdown]
# Each step takes a little longer than the one before, because each step's sequence is one token longer.

# %%
step_ms = np.diff([t0] + stamps) * 1e3
seq_lens = len(prompt_ids) + np.arange(len(out))
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(seq_lens, step_ms, ".-")
ax.set(xlabel="sequence length at this step", ylabel="ms per step", title="Naive decode: every step re-reads everything")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Time per step against sequence length
#
# To see the shape clearly we time single forward passes over sequences much longer than the prompt.
# The cost model says one pass over *n* tokens does `2·params·n` FLOPs in the matmuls plus
# `4·layers·heads·head_dim·n²` in attention. Turning FLOPs into time needs this machine's matmul rate, which
# we measure; the pass can also never beat the time to read the weights once (memory bandwidth).

# %%
ceil = measure_ceilings(device, model.dtype)
weight_bytes = sum(p.numel() for p in model.parameters()) * model.dtype.itemsize
print(f"matmul {ceil.peak_flops / 1e9:.1f} GFLOP/s, memory {ceil.peak_bw / 1e9:.1f} GB/s")

# A pass over n tokens holds n x vocab logits (with a copy for the temporaries): a length whose logits this GPU
# cannot hold is left out.
lengths = pick(cpu=[8, 32, 64, 128, 192, 256, 384], gpu=[64, 256, 512, 1024, 2048, 4096, 8192], device=device)
lengths = fitting(lengths, lambda n: 2 * n * cfg.vocab_size * model.dtype.itemsize, device, "n")


def time_forward(n: int, repeats: int = 2) -> float:
    x = torch.randint(100, 40000, (1, n), device=device)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        t = time.perf_counter()
        model(x)
        synchronize(device)
        best = min(best, time.perf_counter() - t)
    return best


time_forward(lengths[0])  # warm-up
measured = np.array([time_forward(n) for n in lengths])
flops = formulas.naive_step_flops(cfg, np.array(lengths))
predicted = np.maximum(flops / ceil.peak_flops, weight_bytes / ceil.peak_bw)
for n, m, p in zip(lengths, measured, predicted):
    print(f"n={n:5d}: measured {m * 1e3:8.1f} ms   predicted {p * 1e3:8.1f} ms   ({flops[lengths.index(n)] / m / 1e9:5.1f} GFLOP/s achieved)")

# %%
fig, ax = plt.subplots(figsize=(6, 3.4))
ax.plot(lengths, measured * 1e3, "o-", label="measured")
ax.plot(lengths, predicted * 1e3, "--", label="predicted: max(FLOPs / peak, weights / bandwidth)")
ax.set(xlabel="tokens in the forward pass", ylabel="ms", title="One naive step costs O(n) (+ O(n²) attention)")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# At the lengths a CPU can afford the matmul term (linear in *n*) dominates: the attention term
# `4·L·H·D·n²` only catches up with `2·params·n` once *n* reaches `params / (2·L·H·D)` tokens. That
# crossover, and the attention share at every length, come straight from the formulas:

# %%
crossover = formulas.attention_crossover_tokens(cfg)  # params / (2·L·H·D)
print(f"attention FLOPs equal matmul FLOPs at n ≈ {crossover:.0f} tokens for {cfg.num_layers} layers × "
      f"{cfg.num_heads} heads × {cfg.head_dim} dims")

# %% [markdown]
# ## The total: O(N³)
#
# Summing the steps: the naive loop pays for token 1 at every one of the N steps. The slider below shows
# the total FLOPs of generating N tokens with and without a cache (chapter 03 builds the cache), for this
# model and the presets of larger ones. Drag it to long lengths and watch the gap open.

# %%
display(naive_cost_widget("smollm2-135m", tokens=1024))

# %% [markdown]
# How long would the naive loop take on this machine to write a long answer? The measured per-step times
# follow the model, so we can extrapolate with it instead of waiting.

# %%
# Calibrate: achieved FLOP/s at the longest measured length, applied to whole generations.
achieved = flops[-1] / measured[-1]
nbytes = model.dtype.itemsize


def cached_roofline_s(prompt_len: int, total: int) -> float:
    """A cached generation priced step by step on the roofline: one prefill, then total − 1 decode steps,
    each the slower of its FLOPs at the achieved rate and its bytes (all weights + the K/V) at the bandwidth."""
    contexts = np.arange(prompt_len + 1, prompt_len + total)
    first = formulas.roofline_time(formulas.prefill_flops(cfg, prompt_len), formulas.prefill_bytes(cfg, prompt_len, nbytes),
                                   achieved, ceil.peak_bw)
    steps = formulas.roofline_time(formulas.decode_flops(cfg, contexts), formulas.decode_bytes(cfg, 1, contexts, nbytes),
                                   achieved, ceil.peak_bw)
    return first + float(np.sum(steps))


print(f"{'tokens':>6}  {'naive':>9}  {'KV cache, compute only':>23}  {'KV cache, on the roofline':>26}")
for total in (64, 256, 1024):
    t_naive = formulas.naive_generation_flops(cfg, len(prompt_ids), total) / achieved
    t_cached = formulas.cached_generation_flops(cfg, len(prompt_ids), total) / achieved
    print(f"{total:6d}  {t_naive:8.1f}s  {t_cached:22.1f}s  {cached_roofline_s(len(prompt_ids), total):25.1f}s")
print(f"attention work ratio Σi²/Σi at 1024 tokens: {formulas.attention_work_ratio(1024):.0f}×")

# %% [markdown]
# The middle column is an **optimistic bound**: it prices the cached loop by its FLOPs alone, as if the
# arithmetic units set the pace of every step. They do not. A cached decode step does only two FLOPs per
# weight but must still read every weight, and chapter 00 measured which of the two takes longer on this
# machine. The right column prices each step on the roofline instead (the slower of its FLOPs at the
# achieved rate and its bytes at the measured bandwidth), so it can only be slower. Chapter 03 builds the
# cache and measures where the real loop lands. The naive column has no such gap: every naive step
# pushes the whole sequence through the weights, enough tokens to keep the arithmetic busy.
#
# ## The textbook's "roughly 10⁹ redundant multiply-adds"
#
# The textbook this course accompanies (chapter 00 introduces it) says: "For a single 1024-token completion,
# the attention term alone contributes roughly 10⁹ redundant multiply-adds, on top of the far larger
# redundant weight-matmul cost from re-running every layer on every previous token at every step."
# *Redundant* means what the naive loop computes minus
# what a cache needs. At the step where the sequence holds *i* tokens, naive attention scores all *i*
# queries against *i* keys (*i²* pairs, counted over the full square as `formulas.attention_flops` does),
# while a cached step scores one query against *i* keys: *i² − i* pairs are repeats. Each pair costs two
# multiply-adds per dimension of a head (one in QKᵀ, one in PV). The formulas give the sum directly: feed
# them a model with no weights and a single layer, head and dimension, and subtract the cached total from
# the naive one.

# %%
completion = 1024  # from a one-token prompt, as the textbook's sums Σ i² and Σ i over i = 1..1024 assume
shape = formulas.ModelShape.of(cfg)


def redundant_macs(s) -> float:
    """Multiply-adds (FLOPs / 2) the naive loop spends beyond the cached loop over the whole completion."""
    return (formulas.naive_generation_flops(s, 1, completion) - formulas.cached_generation_flops(s, 1, completion)) / 2


unit = dataclasses.replace(shape, n_params=0, n_layers=1, n_heads=1, head_dim=1)  # attention only, one unit wide
per_unit = redundant_macs(unit)
attention_waste = redundant_macs(dataclasses.replace(shape, n_params=0))  # all layers, heads and dimensions
matmul_waste = redundant_macs(dataclasses.replace(shape, n_heads=0))      # the weight matmuls only
print(f"one layer, one head, one dimension: {per_unit:.2e} redundant multiply-adds "
      f"(10^{np.log10(per_unit):.1f}, the textbook's 'roughly 10^9')")
print(f"SmolLM2's {shape.n_layers} layers × {shape.n_heads} heads × {shape.head_dim} dims: "
      f"{attention_waste:.2e} in attention")
print(f"its weight matmuls, recomputed for every earlier token: {matmul_waste:.2e}, "
      f"{matmul_waste / attention_waste:.1f}× the attention's")

# %% [markdown]
# So the textbook's figure is the count for one unit of the model's width: the order of magnitude of
# Σ *i²*. A real model multiplies it by layers × heads × head dimension, and the weight matmuls, which
# the naive loop also recomputes for every earlier token, waste more still at this length, as the
# textbook says.
#
# ## A note on the textbook's ratios
#
# The same section of the textbook says that naive code on an A100 runs "somewhere around 5 to 10 tokens
# per second", and "the same model, same hardware, with a fully optimized inference stack: 200 to 500
# tokens per second. A 5 to 50× throughput gap". Its closing section says the combined effect is "roughly
# 5× to 10× throughput versus a naive baseline". Its own endpoints give neither:

# %%
naive_tok_s_book, optimised_tok_s_book = (5, 10), (200, 500)  # the textbook's ranges, tokens/s
low = optimised_tok_s_book[0] / naive_tok_s_book[1]   # slowest optimised stack over the fastest naive one
high = optimised_tok_s_book[1] / naive_tok_s_book[0]  # fastest over slowest
print(f"{optimised_tok_s_book[0]} / {naive_tok_s_book[1]} = {low:.0f}x  up to  "
      f"{optimised_tok_s_book[1]} / {naive_tok_s_book[0]} = {high:.0f}x")

# %% [markdown]
# Only part of the "5 to 50×" falls inside the range the textbook's own endpoints give, and none of the
# "5× to 10×" does, so at least two of the three figures cannot describe the same comparison. This
# course does not settle it by picking one: every ratio it reports is measured on one machine in one
# run, rung by rung, the cache in chapter 03 and the whole ladder in chapter 09. Exercise 5 below puts the
# same figures to a third test, the textbook's own price of a service.

# %% [markdown]
# ## What you measured

# %%
summary = [
    ("naive generation", f"{naive_tok_s:.1f} tok/s over {len(out)} tokens"),
    ("first / last step", f"{step_ms[1]:.0f} ms / {step_ms[-1]:.0f} ms"),
    (f"forward over {lengths[0]} tokens", f"{measured[0] * 1e3:.1f} ms"),
    (f"forward over {lengths[-1]} tokens", f"{measured[-1] * 1e3:.1f} ms"),
    ("achieved matmul rate", f"{achieved / 1e9:.1f} GFLOP/s of {ceil.peak_flops / 1e9:.1f} peak"),
    ("attention = matmul FLOPs at", f"{crossover:.0f} tokens"),
    ("redundant attention, 1,024 tokens", f"{per_unit:.1e} multiply-adds per layer, head and dim"),
]
for k, v in summary:
    print(f"{k:<34} {v}")

# %% [markdown]
# ## Exercises: predict, then run
#
# Write your prediction down before you run each cell; the answer under it says what you should see and
# why. Each cell takes a few seconds.
#
# **1. Four times the answer, no cache.** Generate 4 tokens and then 16 tokens with `generate_naive`
# from a 17-token prompt (the start of this chapter's). How many times longer does the second run take?

# %%
short_prompt = prompt_ids[:17]
runs = {}
for n in (4, 16):
    params_n = me.SamplingParams(max_tokens=n, ignore_eos=True)
    runs[n] = timed(lambda: me.generate_naive(model, short_prompt, n, params_n), device)[1]
    print(f"{n:3d} new tokens after {len(short_prompt)} prompt tokens: {runs[n]:.2f} s")
flop_ratio = (formulas.naive_generation_flops(cfg, len(short_prompt), 16)
              / formulas.naive_generation_flops(cfg, len(short_prompt), 4))
print(f"measured {runs[16] / runs[4]:.1f}x for 4x the tokens; the FLOP count grows {flop_ratio:.1f}x")

# %% [markdown]
# <details><summary>Answer</summary>
#
# More than four times. Step *s* pushes all *P + s − 1* tokens through the model, so the total work is
# a sum of growing sequence lengths: quadrupling the number of steps adds steps that are each longer
# than any of the first four. The FLOP ratio the cell prints is that sum. The measured ratio comes out
# near it when each step is compute-bound (a CPU, whose ridge point a few tokens already pass) and below it
# where short steps are paced by their weight read instead (a GPU). Chapter 00's exercise 4 did the
# same with the cache, and the time grew no faster than the tokens.
# </details>
#
# **2. A different attention.** The engine's `naive` attention backend computes the full *n × n* score
# matrix and its softmax explicitly, as the textbook formula is written; `torch` calls PyTorch's fused
# `scaled_dot_product_attention`. How much slower is a forward pass over 128 tokens with the naive one?

# %%
x128 = torch.randint(100, 40000, (1, 128), device=device)
backend_s = {}
for backend in ("torch", "naive"):
    model(x128, backend=backend)  # warm-up
    backend_s[backend] = min(timed(lambda: model(x128, backend=backend), device)[1] for _ in range(2))
    print(f"backend {backend:>5}: {backend_s[backend] * 1e3:7.1f} ms")
share = formulas.attention_flops(cfg, 128, 128) / formulas.prefill_flops(cfg, 128)
print(f"naive / torch: {backend_s['naive'] / backend_s['torch']:.2f}x; attention is {100 * share:.1f}% "
      f"of this pass's FLOPs (half of all FLOPs at {crossover:.0f} tokens)")

# %% [markdown]
# <details><summary>Answer</summary>
#
# Slower by a modest fraction at most. At 128 tokens attention is a small share of the pass's FLOPs:
# the weight matmuls, which both backends compute the same way, do almost all the work, so even a clumsy
# attention moves the total little. The share grows in proportion to *n*, reaching half at the crossover computed above; far
# beyond it, the naive backend's *n × n* matrices cost memory and time that grow quadratically, which is
# what FlashAttention (chapter 05) removes.
# </details>
#
# **3. The cache against its FLOP count.** Run the chapter's first request again with `generate_cached`
# (same prompt, same 48 tokens). The FLOP ratio says how much work the cache saves; predict the speedup
# you will measure.

# %%
cached_out, cached_s = timed(lambda: me.generate_cached(model, prompt_ids, new_tokens, params), device)
work_ratio = (formulas.naive_generation_flops(cfg, len(prompt_ids), len(out))
              / formulas.cached_generation_flops(cfg, len(prompt_ids), len(out)))
roofline_ratio = (formulas.naive_generation_flops(cfg, len(prompt_ids), len(out)) / achieved
                  / cached_roofline_s(len(prompt_ids), len(out)))
print(f"naive {naive_s:.2f} s, cached {cached_s:.2f} s: measured speedup {naive_s / cached_s:.1f}x")
print(f"FLOP ratio {work_ratio:.1f}x; priced on the roofline {roofline_ratio:.1f}x; same tokens: {cached_out == out}")

# %% [markdown]
# <details><summary>Answer</summary>
#
# Less than the FLOP ratio, and usually well below it. The ratio assumes a cached step costs only its
# FLOPs, but a cached step does so little arithmetic per weight that reading the weights sets its pace:
# this is the optimistic bound of the "compute only" column, and the roofline ratio, which prices those
# reads, comes closer to the measurement. The tokens are the same, since the cache changes only how
# much is recomputed. At 48 tokens the gain is modest; it grows with the length, because the naive
# loop's steps keep getting longer while the cached ones do not (chapter 03).
# </details>
#
# **4. Bigger models, later crossover.** Attention overtakes the weight matmuls at
# `params / (2 · layers · heads · head_dim)` tokens. Is that length shorter or longer for Llama-7B and
# Llama-2-13B than for SmolLM2?

# %%
for name in ("smollm2-135m", "llama-7b", "llama-2-13b", "llama-70b-gqa"):
    s = formulas.ModelShape.of(name)
    print(f"{name:<14} hidden {s.hidden_size:5d}: crossover {formulas.attention_crossover_tokens(name):7,.0f} tokens "
          f"({formulas.attention_crossover_tokens(name) / s.hidden_size:.1f} × hidden)")

# %% [markdown]
# <details><summary>Answer</summary>
#
# Longer, in proportion to the model's width. A standard layer holds about 12 · hidden² weights (4 in
# attention, 8 in the MLP), while its query heads span heads · head_dim = hidden, so the crossover is
# about six times the hidden size (a little more where a large vocabulary adds embedding weights, as in
# SmolLM2). Grouped-query attention changes nothing here: it shrinks the keys and values, not the
# queries. For the models people serve, prompts of a few thousand tokens are still in the linear regime,
# and attention's quadratic term matters mostly at long contexts.
# </details>
#
# **5. What a billion tokens a day costs.** The textbook prices the gap between naive and optimised
# serving: "A service handling one billion tokens per day on naive inference might need a hundred A100s; on
# a production stack, five." Take its own per-GPU rates from the section above (5 to 10 tokens/s naive, 200
# to 500 optimised) and predict how many A100s each stack needs for a billion tokens a day, spread evenly
# over the day. Do your counts agree with 100 and 5? If not, what rate per GPU would the textbook's counts
# need, and can one stream on an A100 reach it?

# %%
import math

A100 = dict(peak_flops=312e12, peak_bw=2.039e12)  # dense bf16 FLOP/s and HBM bytes/s, A100-80GB SXM
demand = 1e9 / (24 * 3600)  # tokens per second, a day's billion spread evenly
print(f"a billion tokens a day = {demand:,.0f} tokens/s on average")
stacks = {"naive": (naive_tok_s_book, 100), "optimised": (optimised_tok_s_book, 5)}  # (tok/s per A100, A100s)
for stack, ((slow, fast), book_gpus) in stacks.items():
    need = demand / book_gpus  # tok/s per A100 that the textbook's count of GPUs needs
    print(f"{stack:>9}: at {slow}-{fast} tok/s per A100, {math.ceil(demand / fast):,}-{math.ceil(demand / slow):,} "
          f"A100s; the textbook's {book_gpus} need {need:,.0f} tok/s each, {need / fast:.0f}x to {need / slow:.0f}x "
          f"its rate")
print(f"the textbook's two counts: 100 / 5 = {100 / 5:.0f}x; its rates: {low:.0f}x to {high:.0f}x")

# What one A100 can do at most with Llama-7B in fp16 (512-token prompts, 512 new tokens each), on the roofline:
naive_roof = formulas.generation_tok_s("llama-7b", 512, 512, 2, **A100, cache=False)
print(f"roofline, naive loop, one stream: {naive_roof:,.0f} tok/s")
print(f"a cached step reads all {formulas.weight_bytes('llama-7b', 2) / 1e9:.1f} GB of weights: "
      f"{A100['peak_bw'] / formulas.weight_bytes('llama-7b', 2):,.0f} tok/s at most for one stream")
for b in (1, 4, 16, 64):
    print(f"roofline, KV cache, batch {b:2d}: {formulas.generation_tok_s('llama-7b', 512, 512, 2, **A100, batch=b):,.0f} "
          f"tok/s in all")

# %% [markdown]
# <details><summary>Answer</summary>
#
# Far more GPUs than the textbook says, for both stacks. A billion tokens a day is about 11,600 tokens every
# second (the first line); at 5 to 10 tokens/s per A100 that takes over a thousand A100s, and at 200 to 500
# tokens/s a few dozen, not 100 and 5. The two counts are consistent with each other (their ratio, 20×, is the
# ratio of 200 to 10), but each needs more per GPU than the textbook's rates: the naive stack's 100 A100s need
# about 116 tokens/s each, 12 to 23 times its 5 to 10, and the optimised stack's 5 need about 2,300, 5 to 12
# times its 200 to 500 (the cell prints both). The roofline lines say which of those one A100 can deliver. No
# single naive stream gets near 116: recomputing the sequence makes every step compute-bound, and its ceiling
# for one stream is a few dozen tokens/s. One cached stream cannot pass about 150 (every token reads all 13.5
# GB of weights once); only a batch, whose streams share each weight read, reaches thousands of tokens/s in
# all. So the textbook's figures describe different things. Its 5 to 10 is one naive stream, what one user
# sees. Its 200 to 500 is more than one fp16 stream can reach at all, so it is the throughput of a batched
# server (or one stream with 4-bit weights or speculative decoding, chapters 10 and 06; chapter 04 makes the
# same point). And the 100 and 5 GPUs describe a server that batches many streams: the same mismatch as the
# ratios above. A real fleet also needs more than this average, since traffic peaks in the daytime and a GPU
# is sized for the peak. Chapter 04 builds the batching, and chapter 09 runs this arithmetic against the full
# engine.
# </details>
#
# **Lab.** [Lab 01](../labs/lab01_notebook.ipynb) has you write the naive decode loop and the FLOP
# counts of this chapter (weight matmuls, attention, a forward pass, a whole naive generation), graded
# by `tests/labs/test_lab01.py`.
