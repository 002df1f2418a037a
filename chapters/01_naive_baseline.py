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
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import display

import mini_engine as me
from mini_engine import formulas
from mini_engine.devices import default_device, pick, synchronize
from mini_engine.hardware import measure_ceilings
from mini_engine.widgets import naive_cost_widget

device = default_device()
dtype = "float32" if device == "cpu" else "bfloat16"
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

lengths = pick(cpu=[8, 32, 64, 128, 192, 256, 384], gpu=[64, 256, 512, 1024, 2048, 4096, 8192], device=device)


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
crossover = formulas.matmul_flops(cfg, 1) / formulas.attention_flops(cfg, 1, 1)
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
for total in (64, 256, 1024):
    t_naive = formulas.naive_generation_flops(cfg, len(prompt_ids), total) / achieved
    t_cached = formulas.cached_generation_flops(cfg, len(prompt_ids), total) / achieved
    print(f"{total:5d} tokens: naive ≈ {t_naive:8.1f} s   with a KV cache (compute only) ≈ {t_cached:6.1f} s")
print(f"attention work ratio Σi²/Σi at 1024 tokens: {formulas.attention_work_ratio(1024):.0f}×")

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
]
for k, v in summary:
    print(f"{k:<28} {v}")
