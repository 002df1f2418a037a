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
# # 03 · The KV cache
#
# Chapter 01's loop runs the whole sequence through the model at every step. Most of that work produces
# numbers it has already produced: in every layer, the key and value vectors of a past token depend only
# on that token and the ones before it, and none of them has changed since the last step. The **KV
# cache** keeps those vectors, so each step computes K and V for the new token only and reads the rest.
#
# This chapter counts the redundancy, builds the cache, proves that it changes nothing in the output,
# measures the speedup against the formula, and then looks at the price: memory, which grows with
# every token of every sequence, and which grouped-query attention (GQA) cuts at the source. An aside at
# the end looks at what else a cached step spends its time on; exercises close the chapter.

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
import inspect
import time

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import display

import mini_engine as me
from mini_engine import formulas
from mini_engine.config import PRESETS
from mini_engine.course.devices import default_device, pick, synchronize
from mini_engine.compiled_decode import cache_length, graphs_compiled
from mini_engine.generate import decode_step, prefill
from mini_engine.course.hardware import describe_machine, measure_ceilings
from mini_engine.kv_cache import ContiguousKVCache
from mini_engine.course.widgets import kv_memory_widget

device = default_device()
dtype = me.default_dtype(device)
model, tok = me.load_model("smollm2-135m", device=device, dtype=dtype)
cfg = model.config
nbytes = model.dtype.itemsize
print(f"device: {device}, dtype: {dtype}, {cfg.num_layers} layers, {cfg.num_heads} query heads, "
      f"{cfg.num_kv_heads} KV heads of {cfg.head_dim} dims")

# %% [markdown]
# ## The redundancy, counted
#
# Every layer computes K and V with one matmul, `qkv_proj` (queries, keys and values fused). A forward
# hook on the first layer's `qkv_proj` records how many token rows it processes, and keeps the keys it
# produced, while the naive loop generates a few tokens.

# %%
prompt_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me a fun fact about octopuses."}]))
P = len(prompt_ids)
q_size = cfg.num_heads * cfg.head_dim
kv_size = cfg.num_kv_heads * cfg.head_dim
calls = []  # (rows processed, keys before RoPE) per call of layer 0's qkv_proj


def record(_module, _inputs, output):
    calls.append((output.shape[0], output[:, q_size:q_size + kv_size].clone()))


hook = model.layers[0].self_attn.qkv_proj.register_forward_hook(record)
steps = pick(cpu=8, gpu=32, device=device)
me.generate_naive(model, prompt_ids, steps, me.SamplingParams(max_tokens=steps, ignore_eos=True))
naive_rows = [n for n, _ in calls]
naive_keys = [k for _, k in calls]
calls.clear()
me.generate_cached(model, prompt_ids, steps, me.SamplingParams(max_tokens=steps, ignore_eos=True))
cached_rows = [n for n, _ in calls]
hook.remove()

distinct = P + steps - 1  # the last new token is never fed back, so its K/V are never needed
print(f"prompt {P} tokens, {steps} new tokens")
print(f"naive : rows per step {naive_rows}: {sum(naive_rows)} K/V rows for {distinct} distinct positions "
      f"-> {sum(naive_rows) - distinct} recomputed ({sum(naive_rows) / distinct:.1f}x the work)")
print(f"cached: rows per step {cached_rows}: {sum(cached_rows)} K/V rows, each position exactly once")
drift = max(float((old - new[:len(old)]).abs().max()) for old, new in zip(naive_keys, naive_keys[1:]))
print(f"keys of old positions change between consecutive naive steps by at most {drift:.1e}: "
      f"every step recomputes numbers it already had")

# %% [markdown]
# Over a whole generation this is the O(N²) versus O(N) of chapter 01: step *s* of the naive loop pushes
# all *P + s* tokens through the projections (and all the MLPs), the cached loop only the new one.
#
# ## Building the cache
#
# `ContiguousKVCache` is one tensor, laid out `[layers, K/V, slots, kv_heads, positions, head_dim]`: for
# every layer a K and a V plane, one slot per sequence in the batch, and room for `max_len` positions
# reserved up front (chapter 07 replaces that reservation with pages).

# %%
cache = ContiguousKVCache(cfg, num_slots=2, max_len=64, device=device, dtype=model.dtype)
for name, size in zip(["layers", "K/V", "slots (batch)", "kv_heads", "positions", "head_dim"], cache.data.shape):
    print(f"{name:>14}: {size}")
print(f"{cache.nbytes / 2**20:.1f} MiB reserved = {cache.data.numel():,} numbers x {nbytes} bytes")
print(inspect.getsource(ContiguousKVCache.write))

# %% [markdown]
# The model writes each layer's new keys and values at `(slot, position)` and then attends to the
# slot's first `context_len` positions. `prefill` fills positions `0 .. P−1` in one pass; every
# `decode_step` feeds one token and fills one more position (their code is in chapter 02). Let us fill
# slot 0 with the prompt, decode three tokens, and look at which positions hold something.

# %%
logits = prefill(model, cache, [prompt_ids], [0])
filled_after = [int((cache.data[:, :, 0].abs().sum(dim=(0, 1, 2, 4)) != 0).sum())]
token = int(logits[0].argmax())
for i in range(3):
    logits = decode_step(model, cache, [token], [P + i + 1], [0])
    filled_after.append(int((cache.data[:, :, 0].abs().sum(dim=(0, 1, 2, 4)) != 0).sum()))
    token = int(logits[0].argmax())
print(f"positions filled in slot 0 after the prefill and each decode step: {filled_after}")

fig, ax = plt.subplots(figsize=(8, 1.8))
# K of KV head 0 in every layer, rows grouped by slot: [slots, layers, positions]
filled = cache.data[:, 0, :, 0].abs().sum(-1).transpose(0, 1).reshape(-1, cache.max_len).cpu() != 0
ax.imshow(filled, aspect="auto", cmap="Blues", interpolation="nearest")
ax.set(xlabel="position", ylabel="slot 0 | slot 1", yticks=[],
       title=f"K of head 0, every layer: slot 0 holds {filled_after[-1]} positions, slot 1 is empty")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Identical output
#
# The cache is a pure optimisation: the keys and values it hands back are the ones the naive loop would
# recompute, so greedy decoding must pick exactly the same tokens. The naive run below also provides
# the timings for the next section.

# %%
new_tokens = pick(cpu=32, gpu=256, device=device)
params = me.SamplingParams(max_tokens=new_tokens, ignore_eos=True)


def run(generate):
    """Generate `new_tokens` tokens; return them with the seconds elapsed when each arrived."""
    stamps = []
    synchronize(device)
    start = time.perf_counter()
    out = generate(model, prompt_ids, new_tokens, params, on_token=lambda _t: stamps.append(time.perf_counter()))
    return out, np.array(stamps) - start


me.generate_cached(model, prompt_ids, 2)  # warm-up
naive_out, naive_t = run(me.generate_naive)
cached_out, cached_t = run(me.generate_cached)
print("naive :", repr(tok.decode(naive_out)))
print("cached:", repr(tok.decode(cached_out)))
print(f"identical tokens: {naive_out == cached_out}")
print(describe_machine(device))  # what the timings below ran on

other = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
same = me.generate_naive(model, other, 16) == me.generate_cached(model, other, 16)
print(f"a second prompt, 16 tokens: identical tokens: {same}")

# %% [markdown]
# ## The speedup, measured and predicted
#
# The stamps give the time to reach every length *T*, so one run of each loop measures the speedup at
# all lengths up to `new_tokens`. Two predictions to compare it with:
#
# * the **FLOP ratio**, `formulas.naive_generation_flops / formulas.cached_generation_flops`: what the
#   speedup would be if time were proportional to arithmetic;
# * the **roofline ratio**: every step priced at `max(FLOPs / peak, bytes / bandwidth)` with this
#   machine's ceilings (chapter 02), because a cached step is memory-bound: it costs a full read of the
#   weights however little arithmetic it does.

# %%
ceil = measure_ceilings(device, model.dtype)


def roofline(flops, moved):
    return formulas.roofline_time(flops, moved, ceil.peak_flops, ceil.peak_bw)


# Step s of the naive loop is a prefill of P + s tokens; the cached loop prefills once, then decodes.
long = np.arange(1, 4097)  # predictions reach further than the measurement
seq = P + long - 1
naive_step = roofline(formulas.prefill_flops(cfg, seq), formulas.prefill_bytes(cfg, seq, nbytes))
cached_step = np.where(long == 1, naive_step[0],
                       roofline(formulas.decode_flops(cfg, seq), formulas.decode_bytes(cfg, 1, seq, nbytes)))
roofline_long = np.cumsum(naive_step) / np.cumsum(cached_step)
flop_long = formulas.naive_generation_flops(cfg, P, long) / formulas.cached_generation_flops(cfg, P, long)
lengths = long[:new_tokens]
roofline_ratio, flop_ratio = roofline_long[:new_tokens], flop_long[:new_tokens]
measured = naive_t / cached_t

checkpoints = [t for t in (1, 2, 4, 8, 16, 32, 64, 128, 256) if t <= new_tokens]
print(f"prompt {P} tokens; naive {new_tokens / naive_t[-1]:.1f} tok/s, cached {new_tokens / cached_t[-1]:.1f} tok/s")
print(f"{'T':>5}{'naive s':>10}{'cached s':>10}{'measured':>10}{'roofline':>10}{'FLOPs':>10}")
for t in checkpoints:
    i = t - 1
    print(f"{t:5d}{naive_t[i]:10.2f}{cached_t[i]:10.2f}{measured[i]:9.1f}x{roofline_ratio[i]:9.1f}x{flop_ratio[i]:9.1f}x")

# %%
fig, ax = plt.subplots(figsize=(7, 3.8))
ax.plot(lengths, measured, "o", ms=3, label="measured on this machine")
ax.plot(long, roofline_long, "-", label="roofline prediction (this machine's ceilings)")
ax.plot(long, flop_long, "--", label="FLOP ratio (formula)")
ax.set(xscale="log", yscale="log", xlabel=f"tokens generated after a {P}-token prompt",
       ylabel="naive time / cached time", title="KV cache speedup grows with the length")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# Time is not arithmetic. Without a cache each step is a prefill of the whole sequence, which keeps the
# arithmetic units busy; with one, each step is a decode, which does far less arithmetic but still reads
# every weight, so it waits on memory. The cache therefore saves less time than it saves FLOPs, and the
# roofline, which prices both, should land much nearer the measurement than the FLOP ratio:

# %%
T = new_tokens - 1
closer = "roofline" if abs(np.log(measured[T] / roofline_ratio[T])) < abs(np.log(measured[T] / flop_ratio[T])) else "FLOP"
print(f"at {new_tokens} tokens: measured {measured[T]:.1f}x, roofline {roofline_ratio[T]:.1f}x, FLOPs {flop_ratio[T]:.1f}x"
      f" -> the {closer} prediction is closer")
print(f"predicted at 1024 tokens: roofline {roofline_long[1023]:.0f}x, FLOPs {flop_long[1023]:.0f}x")

# %% [markdown]
# Both ratios keep growing with the length, because the naive loop's attention work is O(N³) in total.
# The textbook calls the cache "an ~700× speedup over re-computing past tokens", from one example: "Summed
# across a 1024-token decode, the total attention work collapses from Σi² ≈ 3.6 × 10⁸ to Σi ≈ 5.2 × 10⁵,
# roughly a 700× reduction in attention FLOPs". Its 700× counts attention alone; the whole model's FLOPs
# at the same length, weight products included, give a smaller ratio:

# %%
print(f"1024 tokens from a 1-token prompt: {formulas.naive_generation_flops(cfg, 1, 1024) / formulas.cached_generation_flops(cfg, 1, 1024):.0f}x "
      f"fewer FLOPs in total; attention alone: Σi²/Σi = {formulas.attention_work_ratio(1024):.0f}x")

# %% [markdown]
# ## The price: memory that grows with every token
#
# Each token adds one key and one value vector per KV head in every layer:
# `2 · layers · kv_heads · head_dim · bytes` per token, `formulas.kv_bytes_per_token`. We generate with a
# cache reserved for more than we need and measure, at every token, the bytes of the positions that are
# actually filled (a copy of just those positions).

# %%
grow_tokens = pick(cpu=48, gpu=512, device=device)
reserve = P + grow_tokens + pick(cpu=64, gpu=512, device=device)
grow_cache = ContiguousKVCache(cfg, 1, reserve, device, model.dtype)
filled_bytes = []


def measure(_token):
    filled = int((grow_cache.data.abs().sum(dim=(0, 1, 2, 3, 5)) != 0).sum())
    filled_bytes.append((filled, grow_cache.data[..., :filled, :].clone().nbytes))


me.generate_cached(model, prompt_ids, grow_tokens, me.SamplingParams(max_tokens=grow_tokens, ignore_eos=True),
                   on_token=measure, kv_cache=grow_cache)
positions, used = map(np.array, zip(*filled_bytes))
predicted = formulas.kv_cache_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, positions, 1, nbytes)
print(f"per token: {formulas.kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, nbytes):,} bytes "
      f"({nbytes}-byte numbers)")
print(f"filled positions went {positions[0]} -> {positions[-1]}; measured bytes equal the formula at every step: "
      f"{bool(np.all(used == predicted))}")
print(f"reserved up front: {grow_cache.nbytes / 2**20:.2f} MiB for {reserve} positions; "
      f"used at the end: {used[-1] / 2**20:.2f} MiB ({100 * used[-1] / grow_cache.nbytes:.0f}%)")

# %%
fig, ax = plt.subplots(figsize=(6.5, 3.4))
ax.plot(positions, used / 2**20, "o", ms=3, label="measured: bytes of the filled positions")
ax.plot(positions, predicted / 2**20, "-", label="formulas.kv_cache_bytes")
ax.axhline(grow_cache.nbytes / 2**20, color="grey", ls="--", label=f"reserved for {reserve} positions")
ax.set(xlabel="tokens in the cache", ylabel="MiB", ylim=(0, None), title="KV cache memory grows linearly")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Grouped-query attention: a smaller cache at the source
#
# Only keys and values are cached, so the cache scales with the number of **KV heads**, not query heads.
# SmolLM2 has 9 query heads sharing 3 KV heads (each KV head serves a group of 3 query heads): its
# fused projection produces 9 + 3 + 3 heads of 64 dims per token. An otherwise identical model with one
# KV head per query head (multi-head attention, MHA) would need a cache three times as large. At the other
# extreme, multi-query attention (MQA; Shazeer 2019, "Fast Transformer Decoding: One Write-Head is All You
# Need") shares a single KV head among all the query heads; grouped-query attention (GQA; Ainslie et al.
# 2023) sits between the two. We allocate the three caches for the same 1024 tokens:

# %%
print(f"qkv_proj weight {tuple(model.layers[0].self_attn.qkv_proj.weight.shape)} = "
      f"({cfg.num_heads} + {cfg.num_kv_heads} + {cfg.num_kv_heads}) x {cfg.head_dim} outputs from {cfg.hidden_size} inputs")
sizes = {}
for label, kv_heads in (("MHA", cfg.num_heads), ("GQA (SmolLM2)", cfg.num_kv_heads), ("MQA", 1)):
    variant = dataclasses.replace(cfg, num_kv_heads=kv_heads)
    sizes[label] = ContiguousKVCache(variant, 1, 1024, device, model.dtype).nbytes
    print(f"{label:>14}: {kv_heads} KV heads -> {sizes[label] / 2**20:6.1f} MiB for 1024 tokens "
          f"(formula {formulas.kv_cache_bytes_for(cfg, 1024, 1, nbytes, kv_heads) / 2**20:6.1f})")
gqa_saving = sizes["MHA"] / sizes["GQA (SmolLM2)"]
print(f"GQA cache is {gqa_saving:.0f}x smaller than MHA's")

# %% [markdown]
# ## At scale: the textbook's numbers
#
# The textbook applies the same formula to larger models, in 2-byte numbers, one sequence: Llama-7B at 4K
# context "gives roughly 2 GB per sequence", and Llama-70B at 128K, "with the true GQA count of H = 8 KV
# heads, the number jumps to roughly 40 GB per sequence; with the full 64 query heads (no GQA) it would be
# roughly 320 GB". Llama-7B keeps a KV head per query head; the two Llama-70B rows are the same model with
# its 8 GQA KV heads and with all 64. (The textbook's "GB" are binary gigabytes, GiB: its 2 GB is exactly 2
# GiB.)

# %%
contexts = [1024, 4096, 32768, 131072]
print(f"{'model':<15}{'KV heads':>9}{'MiB/token':>10}" + "".join(f"{c // 1024:>8}K" for c in contexts) + "  (GiB)")
for name in ("llama-7b", "llama-2-13b", "llama-70b-gqa", "llama-70b-mha"):
    per_token = formulas.kv_bytes_per_token_for(name, 2)
    row = "".join(f"{formulas.kv_cache_bytes_for(name, c, 1, 2) / 2**30:9.2f}" for c in contexts)
    print(f"{name:<15}{PRESETS[name].num_kv_heads:>9}{per_token / 2**20:10.3f}{row}")

# %% [markdown]
# The cache, not the weights, decides how many requests a GPU serves at once. On an 80 GB card (80 GiB),
# after the fp16 weights, each request reserves its KV cache for its full length:

# %%
gpu = 80 * 2**30
big_models = ("llama-7b", "llama-2-13b", "llama-70b-gqa", "llama-70b-mha")
fits = {(name, n): formulas.max_concurrent_requests(gpu, formulas.weight_bytes(name, 2),
                                                   formulas.kv_cache_bytes_for(name, n, 1, 2))
        for name in big_models for n in (2048, 4096)}
print(f"{'model':<15}{'weights GiB':>12}{'2K requests':>12}{'4K requests':>12}")
for name in big_models:
    weights = formulas.weight_bytes(name, 2)
    print(f"{name:<15}{weights / 2**30:12.1f}{fits[name, 2048]:12d}{fits[name, 4096]:12d}")

# %% [markdown]
# Llama-2-13B is the textbook's example: its cache takes "~0.78 MB/token", and it, "not the weights, caps
# how many requests a GPU holds (~35 on an 80 GB A100)": the 2K row above
# (`formulas.max_concurrent_requests` spells out the assumptions). A 70B model does not fit on one such
# card at all: its fp16 weights alone exceed 80 GiB, which is why it is sharded across GPUs.
#
# ### The textbook's GQA case: a 13B model with 8 KV heads instead of 40
#
# The textbook says that cutting the KV heads "shrinks KV proportionally while keeping full query heads for
# quality; a 5× cut buys ~5× concurrency, baked in at training time". The last words matter. The KV heads
# are part of the trained model, not a serving setting: the key and value projections of a GQA model have
# one output per KV head, and the query heads of a group learned to read the same keys. Llama-2-13B was
# trained with 40 KV heads, so running it with 8 means building a new model. Ainslie et al. (2023, "GQA:
# Training Generalized Multi-Query Transformer Models from Multi-Head Checkpoints") show how: average the
# key and value projections of each group of heads into one, then *up-train*, that is, continue
# pre-training for a small fraction (5%) of the original budget so the model recovers its quality; or
# train with GQA from the start, as Llama-2-70B and SmolLM2 were. What follows prices such a model, a
# Llama-2-13B up-trained to 8 KV heads (each shared by 5 of its 40 query heads): its K and V projections
# shrink, so the weights get a little lighter, and the rest of its shape is the same. The memory arithmetic
# is exact; whether the up-trained model answers as well is a question for its training, not for this
# formula.

# %%
mha13 = PRESETS["llama-2-13b"]
gqa13 = dataclasses.replace(mha13, num_kv_heads=8)
for n in (2048, 4096):
    fits["llama-2-13b-gqa8", n] = formulas.max_concurrent_requests(
        gpu, formulas.weight_bytes(gqa13, 2), formulas.kv_cache_bytes_for(gqa13, n, 1, 2))
kv_cut = formulas.kv_bytes_per_token_for(mha13, 2) / formulas.kv_bytes_per_token_for(gqa13, 2)
gqa_gain = fits["llama-2-13b-gqa8", 2048] / fits["llama-2-13b", 2048]
print(f"KV heads {mha13.num_kv_heads} -> {gqa13.num_kv_heads}: KV per token "
      f"{formulas.kv_bytes_per_token_for(mha13, 2) / 2**20:.3f} -> {formulas.kv_bytes_per_token_for(gqa13, 2) / 2**20:.3f} MiB "
      f"({kv_cut:.0f}x smaller); weights {formulas.weight_bytes(mha13, 2) / 2**30:.1f} -> "
      f"{formulas.weight_bytes(gqa13, 2) / 2**30:.1f} GiB")
print(f"2K-token requests on 80 GiB: {fits['llama-2-13b', 2048]} -> {fits['llama-2-13b-gqa8', 2048]} "
      f"({gqa_gain:.1f}x); 4K-token requests: {fits['llama-2-13b', 4096]} -> {fits['llama-2-13b-gqa8', 4096]} "
      f"({fits['llama-2-13b-gqa8', 4096] / fits['llama-2-13b', 4096]:.1f}x)")

# %% [markdown]
# The gain is the KV cut, rounded down to whole requests, plus a little from the lighter weights. The
# table as a chart, with the GQA variant beside the model it came from:

# %%
order = ("llama-7b", "llama-2-13b", "llama-2-13b-gqa8", "llama-70b-gqa", "llama-70b-mha")
x = np.arange(len(order))
fig, ax = plt.subplots(figsize=(8, 3.4))
for i, (n, color) in enumerate(((2048, "C0"), (4096, "C1"))):
    counts = [fits[name, n] for name in order]
    bars = ax.bar(x + (i - 0.5) * 0.38, counts, 0.38, color=color, label=f"{n // 1024}K-token requests")
    ax.bar_label(bars, labels=[str(c) if c else "0: weights\ndo not fit" for c in counts], fontsize=7)
labels = [n.replace("-gqa8", "\n8 KV heads, up-trained") for n in order]  # that one is a model to train
ax.set(xticks=x, xticklabels=labels, ylabel="requests that fit",
       title="Concurrent requests on an 80 GiB GPU beside fp16 weights")
ax.tick_params(axis="x", labelsize=8)
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Slider: the KV memory calculator
#
# Pick a model (the textbook's examples and SmolLM2), a context length, a batch, a dtype and a number of
# KV heads (MHA, GQA or MQA groupings of the model's query heads; any number other than the model's own
# describes a differently trained model, as above). The table under the controls reproduces the
# textbook's per-sequence numbers quoted above (2 GB, 40 GB, 320 GB); the right plot shows how many
# requests fit beside the weights.

# %%
display(kv_memory_widget("llama-2-13b", gpu_gib=80.0))

# %% [markdown]
# ## Aside: per-step overheads (optional)
#
# > **An aside.** The chapter's argument is complete above: the cache removes the recomputation, costs
# > memory that grows with every token, and GQA shrinks that memory. This aside looks at something else:
# > what a cached decode step spends its time on besides the weight products, and how compiling the
# > step removes most of it. It contains the chapter's only slow cell (a `torch.compile` run).
#
# ### How close is a cached step to the floor?
#
# A cached decode step must at least read every weight once. `hardware.matmul_floor_tok_s` times the
# model's weight products alone, chained, with nothing else: the fastest an eager decoder computing them
# could go. The gap to a real step is attention, the norms, RoPE, the cache writes and, on a CPU, the fixed
# cost of launching some forty small operations per layer, each of which touches only a few kilobytes.

# %%
from mini_engine.course.hardware import matmul_floor_tok_s

step_s = float(np.median(np.diff(cached_t)))  # one decode step, from the stamps above
floor_s = 1 / matmul_floor_tok_s(model, 1)
print(f"a cached decode step: {step_s * 1e3:.1f} ms; the weight products alone: {floor_s * 1e3:.1f} ms "
      f"({100 * floor_s / step_s:.0f}% of the step); everything else: {(step_s - floor_s) * 1e3:.1f} ms")
fig, ax = plt.subplots(figsize=(6, 1.6))
ax.barh([0], [floor_s * 1e3], label="weight products (the floor)")
ax.barh([0], [(step_s - floor_s) * 1e3], left=[floor_s * 1e3], label="everything else")
ax.set(yticks=[], xlabel="ms per decode step", title=f"One cached decode step, {dtype} on {device}")
ax.legend(fontsize=8, loc="lower right")
plt.tight_layout()
plt.show()

# %% [markdown]
# ### Closing the gap: the whole step as one compiled graph
#
# None of the "everything else" is heavy arithmetic: per layer, two RMSNorms, RoPE, the cache write, the
# residual adds and SiLU times up, each a separate kernel that reads and writes a few kilobytes, called
# from Python. `torch.compile` removes that cost: it traces a decode step once into a graph, and Inductor
# fuses the small operations into a handful of C++ loops per layer, leaving the products as they are.
# (gpt-fast does this on GPUs; vLLM's CUDA graphs attack the same launch cost.)
#
# What is traced is the model's own code (`LlamaModel.run`, its layers and attention), handed a step
# described by tensors only (`compiled_decode.decode_graph`): there is no second copy of the decode step.
# Its one design choice is shapes that do not change from step to step: every sequence reads the same
# number of key positions (the cache's whole length, rounded up to a power of two so that runs of nearby
# lengths share one graph) and masks what lies past its own context, so the graph compiled at the first step
# serves every later step. The first call compiles (about a minute on a 2-core CPU); the tokens must not
# change, and the timed run must compile nothing: the count of graphs Dynamo compiled during it says so. So
# the warm-up decodes two tokens into the cache the timed run then uses, sized for the timed run (on a GPU,
# the CUDA graph recorded at the warm-up replays on that same cache's addresses).

# %%
t0 = time.perf_counter()
timed_length = cache_length(P + new_tokens, cfg.max_position_embeddings)  # the timed run's cache: a graph size
warm_cache = ContiguousKVCache(cfg, 1, timed_length, device, model.dtype)
me.generate_cached(model, prompt_ids, 2, kv_cache=warm_cache, compile=True)  # compiles the step
compile_s = time.perf_counter() - t0
graphs_before = graphs_compiled()
compiled_out, compiled_t = run(lambda *a, **kw: me.generate_cached(*a, **kw, kv_cache=warm_cache, compile=True))
compiled_step_s = float(np.median(np.diff(compiled_t)))
print(f"compiling took {compile_s:.0f} s, once; identical tokens: {compiled_out == cached_out}; "
      f"graphs compiled during the timed run: {graphs_compiled() - graphs_before}")
print(f"decode step: eager {step_s * 1e3:.1f} ms, compiled {compiled_step_s * 1e3:.1f} ms "
      f"({step_s / compiled_step_s:.2f}x faster); the weight products alone: {floor_s * 1e3:.1f} ms")
fig, ax = plt.subplots(figsize=(6, 2))
for row, total in enumerate([compiled_step_s, step_s]):
    ax.barh([row], [floor_s * 1e3], color="C0", label="weight products (the floor)" if row == 0 else None)
    ax.barh([row], [(total - floor_s) * 1e3], left=[floor_s * 1e3], color="C1",
            label="everything else" if row == 0 else None)
ax.set(yticks=[0, 1], yticklabels=["compiled", "eager"], xlabel="ms per decode step",
       title=f"Eager vs compiled decode step, {dtype} on {device}")
ax.legend(fontsize=8, loc="lower right")
plt.tight_layout()
plt.show()

# %% [markdown]
# On a CPU the compiled step can even beat the "floor": that floor is timed eagerly, and each of its 121
# products (four per layer and the vocabulary projection) still pays its own Python call and dispatch,
# which the compiled graph does not. The products' arithmetic and memory traffic are unchanged; only the
# overhead around them went. On a GPU the same overhead is kernel launches, which is why serving engines
# capture their decode steps in CUDA graphs.

# %% [markdown]
# ## What you measured

# %%
summary = [
    (f"naive K/V rows, {steps} tokens", f"{sum(naive_rows)} for {distinct} positions ({sum(cached_rows)} with the cache)"),
    ("cached == naive tokens", f"{naive_out == cached_out and same}"),
    ("naive / cached speed", f"{new_tokens / naive_t[-1]:.1f} / {new_tokens / cached_t[-1]:.1f} tok/s"),
    ("decode step / weight products alone", f"{step_s * 1e3:.1f} / {floor_s * 1e3:.1f} ms"),
    ("compiled decode step", f"{compiled_step_s * 1e3:.1f} ms, same tokens: {compiled_out == cached_out}"),
    (f"speedup at {new_tokens} tokens", f"{measured[-1]:.1f}x measured, {roofline_ratio[-1]:.1f}x roofline, "
                                        f"{flop_ratio[-1]:.1f}x FLOPs"),
    ("KV bytes per token (SmolLM2)", f"{formulas.kv_bytes_per_token_for(cfg, nbytes):,} B in {dtype}"),
    (f"cache after {positions[-1]} positions", f"{used[-1] / 2**20:.2f} MiB measured = formula: {bool(np.all(used == predicted))}"),
    ("GQA vs MHA cache", f"{gqa_saving:.0f}x smaller"),
    ("Llama-2-13B 2K requests on 80 GiB", f"{fits['llama-2-13b', 2048]}"),
    ("... with 8 KV heads instead of 40", f"{fits['llama-2-13b-gqa8', 2048]} ({gqa_gain:.1f}x)"),
]
for k, v in summary:
    print(f"{k:<34} {v}")


# %% [markdown]
# ## Exercises: predict, then run
#
# Write your prediction down before you run each cell; the answer under it says what you should see
# and why. Each cell takes a few seconds.
#
# **1. A longer prompt.** The hook at the start of the chapter counted the K/V rows layer 0 computes
# while each loop generates `steps` tokens. Double the prompt's length (same number of new tokens): how
# many rows does the naive loop compute now, and how many does the cached loop compute?

# %%
double_prompt = prompt_ids + prompt_ids  # twice the tokens; only their number matters here
rows_2p = {}
for name, generate in (("naive", me.generate_naive), ("cached", me.generate_cached)):
    seen = []
    hook = model.layers[0].self_attn.qkv_proj.register_forward_hook(lambda _m, _i, out: seen.append(out.shape[0]))
    generate(model, double_prompt, steps, me.SamplingParams(max_tokens=steps, ignore_eos=True))
    hook.remove()
    rows_2p[name] = sum(seen)
P2 = len(double_prompt)
print(f"prompt {P} -> {P2} tokens, {steps} new tokens each time")
print(f"naive : {sum(naive_rows)} -> {rows_2p['naive']} rows "
      f"(formula steps·P + steps·(steps-1)/2 = {steps * P2 + steps * (steps - 1) // 2})")
print(f"cached: {sum(cached_rows)} -> {rows_2p['cached']} rows (formula P + steps - 1 = {P2 + steps - 1})")

# %% [markdown]
# <details><summary>Answer</summary>
#
# Step *s* of the naive loop pushes all *P + s* tokens through the projections, so its total is
# `steps · P + steps · (steps − 1) / 2`: doubling *P* adds another `steps · P` rows, one extra prompt's
# worth per generated token. The cached loop computes every position once, *P + steps − 1* rows (the
# last token is never fed back), so it grows only by the extra prompt tokens themselves. The longer the
# prompt, the larger the share of the naive loop's work that is pure repetition.
# </details>
#
# **2. What a contiguous cache reserves.** The serving engine of chapter 04 can keep its keys and values
# in a contiguous cache (`kv_cache="contiguous"`), one slot per sequence, each reserved for
# `max_model_len` positions. Predict the memory it holds for `max_num_seqs=4, max_model_len=256`; then
# with `max_model_len=512`; then with 8 sequences of 512. And what fraction of the first one does one
# request with this chapter's prompt and a 16-token answer fill?

# %%
for seqs, length in ((4, 256), (4, 512), (8, 512)):
    engine_llm = me.LLM.from_model(model, tok, kv_cache="contiguous", max_num_seqs=seqs, max_model_len=length)
    print(f"max_num_seqs={seqs}, max_model_len={length}: {engine_llm.engine.kv_cache_bytes / 2**20:6.1f} MiB held "
          f"(formula {formulas.kv_cache_bytes_for(cfg, length, seqs, nbytes) / 2**20:6.1f} MiB)")
small = me.LLM.from_model(model, tok, kv_cache="contiguous", max_num_seqs=4, max_model_len=256)
answer = small.generate([prompt_ids], me.SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
touched = P + len(answer.token_ids)
print(f"one request of {P} + {len(answer.token_ids)} tokens touches at most {touched} of the "
      f"{4 * 256} reserved positions: {100 * touched / (4 * 256):.0f}% of the cache")

# %% [markdown]
# <details><summary>Answer</summary>
#
# The reservation is `kv_cache_bytes(layers, kv_heads, head_dim, max_model_len, max_num_seqs, bytes)`:
# it is fixed when the engine starts and does not depend on what the requests need, so doubling either
# `max_model_len` or `max_num_seqs` doubles it. A single short request fills a small corner of it: the
# rest is held but empty. That waste is what the paged cache of chapter 07 removes.
# </details>
#
# **3. A narrower dtype.** Run the same engine on the model in another dtype (bfloat16 if this chapter
# runs in float32, float32 if it runs in a 16-bit dtype). How do the bytes of its cache change? Does greedy
# decoding still produce the same 24 tokens?

# %%
other_dtype = "bfloat16" if dtype == "float32" else "float32"
other_model, _ = me.load_model("smollm2-135m", device=device, dtype=other_dtype)
dtype_runs = {}
for name, m in ((dtype, model), (other_dtype, other_model)):
    engine_llm = me.LLM.from_model(m, tok, kv_cache="contiguous", max_num_seqs=1, max_model_len=256)
    out = engine_llm.generate([prompt_ids], me.SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    dtype_runs[name] = (engine_llm.engine.kv_cache_bytes, out.token_ids)
    print(f"{name:>9}: cache {engine_llm.engine.kv_cache_bytes / 2**20:5.2f} MiB, {tok.decode(out.token_ids)!r}")
(bytes_a, ids_a), (bytes_b, ids_b) = dtype_runs.values()
diverge = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), None)
print(f"cache bytes {dtype} / {other_dtype}: {bytes_a / bytes_b:.1f}x; identical tokens: {ids_a == ids_b}"
      + ("" if diverge is None else f" (first difference at token {diverge})"))
del other_model

# %% [markdown]
# <details><summary>Answer</summary>
#
# The cache holds one number per (layer, K/V, head, position, dim), so its bytes scale with the bytes per
# number: bfloat16 (or float16) needs half of float32's. The tokens are another matter. bfloat16 keeps 8 bits
# of mantissa (float16 11) against float32's 24, so weights, activations, keys and values are all rounded: when two
# candidate tokens have close scores, the rounding can swap them, and from that token on the two texts
# go their own ways. They may agree for all 24 tokens, or part ways early; either way both are valid
# greedy decodes of slightly different models. That is why the chapter compared naive and cached loops
# in the *same* dtype: the cache itself changes nothing.
# </details>
#
# **4. When does the cache outweigh the model?** At what context length does one sequence's KV cache take
# as much memory as SmolLM2's weights (in this chapter's dtype)? And for a batch of 16 sequences?

# %%
weights_here = sum(p.numel() * p.element_size() for p in model.parameters())
per_token_here = formulas.kv_bytes_per_token_for(cfg, nbytes)
break_even = weights_here / per_token_here
print(f"weights {weights_here / 2**20:.0f} MiB, KV {per_token_here:,} B per token: equal at {break_even:,.0f} tokens "
      f"for one sequence, {break_even / 16:,.0f} tokens each for 16 (the model allows {cfg.max_position_embeddings:,})")

# %% [markdown]
# <details><summary>Answer</summary>
#
# Both sides scale with the bytes per number, so the dtype cancels: the length is the parameter count
# divided by `2 · layers · kv_heads · head_dim`. For SmolLM2 it lies past the end of the model's own
# context window, so one sequence never outweighs the model: with only 3 KV heads (GQA), its cache is
# small for its size. A batch divides the length by the batch size, and 16 sequences pass it at lengths
# well inside the window. At serving scale the cache, not the weights, fills the memory, which is why
# it decides how many requests a GPU serves.
# </details>
#
# **Lab.** [Lab 03](../labs/lab03_notebook.ipynb) has you write the pieces of this chapter yourself: the
# memory formula and how many requests fit, one cached attention step, and the cached generation loop.
