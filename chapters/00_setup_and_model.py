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
# # 00 · Setup and the model
#
# Every chapter of this course measures a real language model on the machine in front of you. This one
# gets the pieces on the table: the engine (`mini_engine`), the model (SmolLM2-135M-Instruct, a small
# Llama-family chat model that ships inside a Python package, so nothing is downloaded at run time), and
# the two numbers about your hardware that bound everything later: how fast it multiplies and how fast it
# moves bytes.

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
import torch

import mini_engine as me
from mini_engine import formulas
from mini_engine.devices import default_device
from mini_engine.hardware import cpu_info, describe_machine, format_tuned_forms, measure_ceilings, tune_products

device = default_device()
dtype = "float32" if device == "cpu" else "bfloat16"
print(f"device: {device}, dtype: {dtype}")
print(describe_machine(device))  # every measurement in this course depends on it: name it

# %% [markdown]
# ## Load the model
#
# The checkpoint is a GGUF file (the llama.cpp format), quantized to 4 bits. `load_model` reads it with the
# `gguf` package, dequantizes every tensor to floating point, rebuilds the tokenizer from the file's
# metadata, and returns a plain PyTorch module.

# %%
t0 = time.perf_counter()
model, tok = me.load_model("smollm2-135m", device=device, dtype=dtype)
load_s = time.perf_counter() - t0
cfg = model.config
print(f"loaded in {load_s:.1f} s; attention backend: {model.attention_backend} (\"auto\" picks triton on a GPU)")
print(cfg)

# %% [markdown]
# Nine query heads share three key/value heads: this is **grouped-query attention** (GQA), which will
# matter in chapter 03 because only the K/V heads are cached. The input embedding and the output
# projection share one matrix (tied embeddings).

# %%
n_params = sum(p.numel() for p in model.parameters())
bytes_per = torch.tensor([], dtype=model.dtype).element_size()
groups = {
    "embedding (tied with output)": model.embed_tokens.weight.numel(),
    "attention (q, k, v, o)": sum(l.self_attn.qkv_proj.weight.numel() + l.self_attn.o_proj.weight.numel()
                                  for l in model.layers),
    "MLP (gate, up, down)": sum(l.mlp.gate_up_proj.weight.numel() + l.mlp.down_proj.weight.numel()
                                for l in model.layers),
    "norms": sum(p.numel() for n, p in model.named_parameters() if "norm" in n),
}
for name, n in groups.items():
    print(f"{name:<30} {n / 1e6:7.2f} M  ({100 * n / n_params:4.1f} %)")
print(f"{'total':<30} {n_params / 1e6:7.2f} M  = {n_params * bytes_per / 2**20:.0f} MiB in {dtype}")

# %%
fig, ax = plt.subplots(figsize=(6, 3))
ax.barh(list(groups), [n / 1e6 for n in groups.values()], color=["#888", "#4C72B0", "#DD8452", "#55A868"])
ax.set_xlabel("parameters (millions)")
ax.set_title("Where SmolLM2-135M's parameters live")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Tokens
#
# The model never sees text, only integer token ids from a byte-level BPE vocabulary of 49,152 entries.
# A chat model also expects its conversation wrapped in a **chat template**.

# %%
text = "Inference optimization turns 5 tok/s into 500."
ids = tok.encode(text)
print(ids)
print([tok.decode([i]) for i in ids])
assert tok.decode(ids) == text  # the round trip is lossless

# %%
prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
print(prompt)
prompt_ids = tok.encode(prompt)
print(f"{len(prompt_ids)} tokens")

# %% [markdown]
# ## One forward pass
#
# A forward pass maps `[batch, tokens]` ids to `[batch, tokens, vocab]` logits: one next-token score
# vector for every position. Generation only needs the last one.

# %%
x = torch.tensor([prompt_ids], device=device)
model(x)  # warm-up
t0 = time.perf_counter()
logits = model(x)
forward_s = time.perf_counter() - t0
print(f"logits {tuple(logits.shape)} in {forward_s * 1e3:.1f} ms")
top = torch.topk(logits[0, -1].float().softmax(-1), 5)
for p, i in zip(top.values, top.indices):
    print(f"  {tok.decode([int(i)])!r:>12}  p={float(p):.3f}")

# %%
answer = me.generate_cached(model, prompt_ids, max_new_tokens=40, eos_token_id=tok.eos_token_id)
print(tok.decode(answer))

# %% [markdown]
# ## This machine's ceilings
#
# Two numbers bound every measurement in this course:
#
# * **peak FLOP/s**: how many floating-point operations per second a large matrix product reaches;
# * **memory bandwidth**: how many bytes per second move between main memory and the processor.
#
# Generating one token reads every weight once and does about two FLOPs per weight (one multiply-add).
# So a single stream can go no faster than `min(bandwidth / weight_bytes, peak_flops / (2 · params))`
# tokens per second. Let us measure both ceilings and see which one binds.

# %%
ceil = measure_ceilings(device, model.dtype)
print(f"matmul: {ceil.peak_flops / 1e9:8.1f} GFLOP/s   memory: {ceil.peak_bw / 1e9:6.1f} GB/s   "
      f"ridge point: {ceil.ridge_point:.1f} FLOP/byte")

weight_bytes = n_params * bytes_per
flops_token = formulas.flops_per_token(cfg, len(prompt_ids))
t_memory = weight_bytes / ceil.peak_bw
t_compute = flops_token / ceil.peak_flops
print(f"one decode step moves {weight_bytes / 2**20:.0f} MiB of weights -> {t_memory * 1e3:.1f} ms at best")
print(f"one decode step does {flops_token / 1e9:.2f} GFLOP            -> {t_compute * 1e3:.1f} ms at best")
best_tok_s = 1 / max(t_memory, t_compute)
print(f"=> memory-bound: at most {best_tok_s:.0f} tokens/s for one stream on this {device}")

# %%
fig, ax = plt.subplots(figsize=(6, 2.6))
ax.barh(["memory (read weights)", "compute (2 FLOPs/weight)"], [t_memory * 1e3, t_compute * 1e3],
        color=["#C44E52", "#4C72B0"])
ax.set_xlabel("ms per generated token (lower bound)")
ax.set_title("Decode is bounded by memory, not arithmetic")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## The engine measures its own products
#
# Every weight product `y = x Wᵀ` can be computed in several equal ways: PyTorch's `F.linear`, the
# transposed product `(W xᵀ)ᵀ`, a single row computed as two copies of itself (a GEMM instead of a GEMV),
# or bf16 weights converted to fp32 first. They give the same numbers to rounding, but which is fastest
# depends on the CPU: on an AMD EPYC with AVX2 the two-row trick was 1.3x faster than `F.linear`; on an
# Intel Xeon with AVX-512 BF16 the same trick was 2.6x *slower*. So the engine does not guess. The first
# time it meets a weight shape with a new number of rows, it times each candidate on this machine (over
# enough copies of the weight to stream them from memory, as decoding does) and keeps the fastest, as
# Triton's `autotune` does for kernels. An alternative must beat `F.linear` by 3% to be chosen.
# Here are the choices for one row (a decode step) and for 16 rows (a batch), on your machine:

# %%
if device == "cpu":
    t0 = time.perf_counter()
    tune_products(model, (1, 16))
    print(f"tuned in {time.perf_counter() - t0:.1f} s")
    print(format_tuned_forms())
else:
    print("on a GPU every product is F.linear (cuBLAS picks its own kernels)")

# %% [markdown]
# ## What you measured

# %%
summary = [
    ("device / dtype", f"{device} / {dtype}"),
    ("CPU", str(cpu_info())),
    ("parameters", f"{n_params / 1e6:.1f} M"),
    ("weights in memory", f"{weight_bytes / 2**20:.0f} MiB"),
    ("load time", f"{load_s:.1f} s"),
    (f"forward pass, {len(prompt_ids)} tokens", f"{forward_s * 1e3:.1f} ms"),
    ("matmul ceiling", f"{ceil.peak_flops / 1e9:.1f} GFLOP/s"),
    ("memory bandwidth", f"{ceil.peak_bw / 1e9:.1f} GB/s"),
    ("best possible decode speed", f"{best_tok_s:.0f} tok/s (memory-bound)"),
]
for k, v in summary:
    print(f"{k:<30} {v}")
