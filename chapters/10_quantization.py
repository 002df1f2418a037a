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
# # 10 · Quantization: fewer bits per weight, fewer bytes per token
#
# Every chapter so far changed how often the weights are read, or how many tokens one reading serves. None
# changed the weights themselves. A decode step at batch 1 reads every weight once to produce one token
# (chapter 02), so its time is roughly model bytes / memory bandwidth. Store each weight in 4 bits instead of
# 32 and a step reads an eighth of the bytes: decoding speeds up almost in proportion, as long as it stays
# memory-bound. The textbook (chapter 00 introduces it) closes its serving chapter by pointing here: its
# next chapter "targets bits per parameter, INT8, INT4, NF4, AWQ, GPTQ", and "quantization stacks
# multiplicatively with the inference-stack optimizations here, often giving another 2 to 4× throughput
# improvement on top".
#
# This course's model is already quantized on disk: every linear layer of the embedded GGUF is **Q4_1**
# (blocks of 32 four-bit codes, each block with an fp16 scale and an fp16 minimum) and the tied embedding is
# **Q8_0**. Until now the loader dequantized all of it to fp32. Here we keep the 4-bit codes.
#
# This chapter:
#
# 1. counts bits per weight and bytes per token, and puts them on this machine's roofline;
# 2. looks at one weight matrix: its values, the int4 grid each group of 32 sits on, and the group scales;
# 3. measures fp32, bf16, int8 and int4 side by side: tok/s at batch 1 and 16, memory, perplexity and agreement
#    with the fp32 model (and llama.cpp on the same file, where it is installed);
# 4. explains NF4, AWQ and GPTQ by what each one changes, with NF4's grid measured on real weights;
# 5. sets the textbook's "another 2 to 4×" beside the multiple measured here, and says why they differ;
# 6. (optional) quantizes the scales themselves, the idea QLoRA calls double quantization, and measures what
#    it saves and what it costs on this model's weights;
# 7. ends with the "what you measured" table and exercises (an int4 draft model, the group size, the LM head).

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
import copy
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
from tqdm.auto import tqdm

import mini_engine as me
from mini_engine import formulas
from mini_engine.course import quality
from mini_engine.course.devices import default_device, pick, warm_up
from mini_engine.course.hardware import describe_machine, matmul_floor_tok_s, measure_ceilings
from mini_engine.bench.paging import time_decode_steps
from mini_engine.quant import from_scales_and_zeros, quantize_int4, weight_bytes

device = default_device()
# The quantized models' activations: W8A16 and W4A16, the "16" is the activations' bits. On a GPU the course's
# 16-bit type for it (fp16 on a T4, which has no bf16 tensor math: the "bf16" row below is fp16 there); on a CPU,
# where the course's dtype is fp32, bf16.
act_dtype = me.default_dtype(device)
if act_dtype == "float32":
    act_dtype = "bfloat16"
VARIANTS = {  # name -> load_model arguments (bf16 is the fp32 model's copy, cast)
    "fp32": dict(dtype="float32"),
    "int8": dict(dtype=act_dtype, quantization="int8"),
    "int4": dict(dtype=act_dtype, quantization="int4"),
}
models = {}
for name, kwargs in tqdm(VARIANTS.items(), desc="loading"):
    models[name], tok = me.load_model("smollm2-135m", device=device, **kwargs)
models = {"fp32": models["fp32"], "bf16": copy.deepcopy(models["fp32"]).to(getattr(torch, act_dtype)),
          "int8": models["int8"], "int4": models["int4"]}
NEW = pick(32, 128, device)    # tokens per single-stream run
BATCH = 16                     # sequences per decode step, beside one
print(describe_machine(device))
print(f"device: {device}; the quantized models compute with {act_dtype} activations, like the bf16 model")
print(models["int4"].layers[0].self_attn.qkv_proj)

# %% [markdown]
# ## 1. Bits per weight, bytes per token
#
# A quantized format stores each weight as a small integer code plus, for each **group** of weights, the
# numbers that turn codes back into values: a scale, and sometimes a zero point or a minimum. Their cost is
# spread over the group, so bits per weight = code bits + (scale bits + zero bits) / group size
# (`formulas.bits_per_weight`):

# %%
FORMATS = [  # name, bits per weight, what it is
    ("fp32", formulas.bits_per_weight(32), "the dequantized GGUF (this course until now)"),
    ("bf16 / fp16", formulas.bits_per_weight(16), "the usual checkpoint"),
    ("int8, a scale per row", formulas.bits_per_weight(8, 576, 16), "this chapter's int8 (rows of 576)"),
    ("Q8_0", formulas.bits_per_weight(8, 32, 16), "llama.cpp; the GGUF's embedding"),
    ("Q4_1 = int4, groups of 32", formulas.bits_per_weight(4, 32, 16, 16), "the GGUF's linear layers; our int4"),
    ("int4, groups of 128 (AWQ, GPTQ)", formulas.bits_per_weight(4, 128, 16, 4), "fp16 scale, 4-bit zero"),
    ("NF4, blocks of 64 (QLoRA)", formulas.bits_per_weight(4, 64, 32), "an fp32 absmax per block"),
]
cfg = models["fp32"].config
print(f"SmolLM2-135M: {cfg.num_params / 1e6:.1f}M parameters (the tied embedding counted once)")
print(f"{'format':<34}{'bits/weight':>12}{'weights MB':>12}   what")
for name, bits, what in FORMATS:
    print(f"{name:<34}{bits:>12.2f}{formulas.weight_bytes(cfg, bits / 8) / 1e6:>12.1f}   {what}")

# %% [markdown]
# Now the roofline (chapter 02). A decode step moves the weights once, plus each sequence's keys and values and
# a little activation traffic; quantizing the weights shrinks only the first term (`formulas.decode_bytes(...,
# weight_bits=...)`; the KV cache stays in the activations' dtype). On a memory-bound step the ceiling is
# bandwidth / bytes per step, so 32 → 5 bits should approach a 6.4× faster step, less what the KV cache and
# the arithmetic cost. The arithmetic does not shrink: int4 weights are multiplied as floats after all.
# Below, the ceilings on this machine's measured bandwidth and compute, at batch 1 and at batch 16:

# %%
ceil = measure_ceilings(device, torch.float32, quick=True)
# The compute roof: the faster of a plain square matmul and the model's own products at 256 rows (as in
# chapter 09: on a CPU the model's products can run faster than one large square matmul).
products_flops = formulas.matmul_flops(cfg, 1) * matmul_floor_tok_s(models["fp32"], 256)
roof = dict(peak_flops=max(ceil.peak_flops, products_flops), peak_bw=ceil.peak_bw)
CONTEXT = 64  # about the length of this chapter's prompts plus their answers
print(f"measured: {ceil.peak_bw / 1e9:.1f} GB/s, {roof['peak_flops'] / 1e9:.0f} GFLOP/s (fp32; plain matmul "
      f"{ceil.peak_flops / 1e9:.0f}); ridge point {roof['peak_flops'] / ceil.peak_bw:.1f} FLOP/byte")
bits_of = {"fp32": 32, "bf16": 16, "int8": formulas.bits_per_weight(8, 576, 16),
           "int4": formulas.bits_per_weight(4, 32, 16, 16)}
act_bytes = {"fp32": 4, "bf16": 2, "int8": 2, "int4": 2}  # the K/V cache and activations
ceilings = {}
print(f"{'weights':<8}{'bits':>6}{'MB/token, b=1':>15}{'tok/s ceiling, b=1':>20}{'bound':>9}{'b=16':>8}{'bound':>9}")
for name, bits in bits_of.items():
    per_tok = formulas.decode_bytes_per_token(cfg, 1, CONTEXT, act_bytes[name], weight_bits=bits)
    ceilings[name] = [formulas.predicted_decode_tok_s(cfg, b, CONTEXT, act_bytes[name], **roof, weight_bits=bits)
                      for b in (1, BATCH)]
    bound = [formulas.roofline_bound(formulas.decode_flops(cfg, CONTEXT, b),
                                     formulas.decode_bytes(cfg, b, CONTEXT, act_bytes[name], bits), **roof)
             for b in (1, BATCH)]
    print(f"{name:<8}{bits:>6.2f}{per_tok / 1e6:>15.1f}{ceilings[name][0]:>20.0f}{bound[0]:>9}"
          f"{ceilings[name][1]:>8.0f}{bound[1]:>9}")

batches = np.arange(1, 65)
fig, ax = plt.subplots(figsize=(7, 3.2))
for name, bits in bits_of.items():
    ax.plot(batches, formulas.predicted_decode_tok_s(cfg, batches, CONTEXT, act_bytes[name], **roof,
                                                     weight_bits=bits), label=f"{name} ({bits:.1f} bits)")
ax.set(xlabel="batch (sequences per decode step)", ylabel="ceiling, tok/s", yscale="log",
       title="Decode ceilings on this machine's roofline")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# Two regimes. At batch 1 the step is memory-bound: the ceiling is proportional to 1 / bytes, so int4's is
# almost 32 / 5 times fp32's, unless it meets the compute roof first (on a CPU, whose ridge point is low, int4
# at batch 1 can: the "bound" column). As the batch grows, the same weight read serves more tokens, the arithmetic per
# byte rises, and past the ridge point every format meets the same compute roof: quantized weights no longer
# help, because the FLOPs are the same. On a CPU the ridge is low (a few FLOP per byte), so that happens at a
# batch of a few sequences; on an A100 (about 150 FLOP per byte) it takes a batch of a hundred or more. The
# curves are ceilings; section 3 measures what the engine reaches.
#
# The same arithmetic under sliders, for the GPUs the course names (published peaks: dense 16-bit tensor-core
# FLOP/s and memory bandwidth) and this CPU (its ceilings measured above). Bits per weight is the slider: the
# left plot splits the bytes a decode step moves per token into the weights' share, which the bits shrink and
# the batch divides, and the rest (keys, values, activations), which neither touches; the right one is each
# machine's ceiling. It opens on Llama-7B, the model the textbook's GPU numbers are about; the menu has this
# chapter's SmolLM2-135M too. Things to find: at batch 1 every GPU gains almost 4× from 16 bits to 4, and the
# gain melts as the batch and the context grow; the CPU's low ridge makes its step compute-bound at a few bits
# ("compute-bound below" in the table), where fewer bits buy nothing more.

# %%
from IPython.display import display

from mini_engine.course.rooflines import GPU_ROOFS, Roof
from mini_engine.course.widgets import quant_roofline_widget

machines = {**GPU_ROOFS, "this CPU": Roof("this CPU (measured)", roof["peak_flops"], roof["peak_bw"])}
display(quant_roofline_widget(machines, model="llama-7b", bits=4.0, batch=1, context=1024))

# %% [markdown]
# ## 2. One weight matrix and its int4 grid
#
# Layer 0's fused query-key-value projection, as the fp32 model holds it (the GGUF's Q4_1 blocks dequantized),
# and the same layer in the int4 model (the same codes, repacked for torch's int4 kernel). Left: the values of
# the whole matrix. Middle: the first 96 weights of one row, three groups of 32, with the 16 levels of each
# group's grid, w = (q − 8) · scale + zero. Right: the scale of every group in a corner of the matrix.

# %%
W = models["fp32"].layers[0].self_attn.qkv_proj.weight.detach().float().cpu()
q4 = models["int4"].layers[0].self_attn.qkv_proj
codes = q4.codes().cpu()
scales, zeros = (t.float().cpu() for t in from_scales_and_zeros(q4.scales))
W4 = q4.dequantize(torch.float32).cpu()
row = int(W.abs().amax(dim=1).argmax())  # the row with the largest weight: its groups differ the most
print(f"matrix {tuple(W.shape)}, {W.numel():,} weights in {scales.numel():,} groups of {q4.group_size}; "
      f"row {row} shown")
print(f"distinct values in row {row}'s first group: {W[row, :32].unique().numel()} (at most 16 codes)")
step_error = ((W - W4).abs().view(W.shape[0], -1, q4.group_size) / scales[..., None]).amax()
print(f"largest |fp32 weight - int4 weight|: {(W - W4).abs().max():.2e}, at most {step_error:.3f} of its group's "
      f"step (the int4 model's scales and zeros are rounded to bf16)")

fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
axes[0].hist(W.flatten().numpy(), bins=200, color="tab:blue")
axes[0].set(yscale="log", xlabel="weight value", ylabel="count", title="all weights of the matrix")
cols = np.arange(96)
for g in range(3):
    levels = (np.arange(16) - 8) * scales[row, g].item() + zeros[row, g].item()
    for v in levels:
        axes[1].plot([32 * g - 0.5, 32 * g + 31.5], [v, v], color="0.85", lw=0.8, zorder=0)
axes[1].scatter(cols, W[row, :96].numpy(), s=10, color="tab:blue", label="fp32 (dequantized GGUF)", zorder=2)
axes[1].scatter(cols, W4[row, :96].numpy(), s=28, facecolors="none", edgecolors="tab:red", label="int4 model",
                zorder=3)
for g in (1, 2):
    axes[1].axvline(32 * g - 0.5, color="k", lw=0.6)
axes[1].set(xlabel="column (3 groups of 32)", ylabel="weight", title=f"row {row}: each group's 16 levels")
axes[1].legend(fontsize=7, loc="lower left")
im = axes[2].imshow(scales[:64, :18].numpy(), aspect="auto", cmap="viridis")
axes[2].set(xlabel="group (32 columns each)", ylabel="row", title="group scales, rows 0-63")
plt.colorbar(im, ax=axes[2])
plt.tight_layout()
plt.show()

# %% [markdown]
# What the picture says:
#
# - The values form a narrow bell with long tails: most weights are small, a few are large. A single grid for
#   the whole matrix would have to stretch over the tails and leave the bell with a handful of levels.
# - Each group of 32 gets its own grid, spanning its own minimum to maximum, so the step adapts to the group.
#   Every fp32 value sits exactly on a level: this checkpoint was *quantized before we ever saw it*, and the
#   fp32 model we have been running is its dequantized copy. The int4 model's values (red rings) coincide.
# - The scales vary a lot between groups and rows (the colour map): that variation is what a per-group
#   scale buys over a per-row or per-tensor one.
#
# What a coarser grid costs, measured on this matrix: re-quantize it round-to-nearest with one grid per
# group of 32, 64 and 192 weights, per row, and for the whole tensor (the RMS error is relative to the weights'
# RMS):

# %%
def rel_rms(a, b):
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def rtn_int4(w, group):
    """Round-to-nearest int4 (min-max per group) of w, dequantized, with fp32 scales."""
    q, s, z = quantize_int4(w, group, torch.float32)
    return ((q.view(w.shape[0], -1, group).float() - 8) * s[..., None] + z[..., None]).view(w.shape)


grids = {"groups of 32": rtn_int4(W, 32), "groups of 64": rtn_int4(W, 64), "groups of 192": rtn_int4(W, 192),
         "one per row": rtn_int4(W, W.shape[1]),
         "one for the tensor": rtn_int4(W.flatten()[None], W.numel()).view(W.shape)}
for name, w in grids.items():
    print(f"int4, {name:<20} relative RMS error {rel_rms(w, W):.4f}")

# %% [markdown]
# Groups of 32 re-quantize the matrix almost exactly (its values are already on such grids); wider grids
# lose more and more. This is the trade every format in section 4 makes: smaller groups cost more bits for
# scales and buy precision.
#
# ## 3. fp32, bf16, int8 and int4, measured
#
# Four copies of the model: fp32 and bf16 (all weights in that dtype), int8 (every product's weights as int8
# with one scale per row, quantized at load from the fp32 weights) and int4 (the GGUF's Q4_1 codes repacked;
# the tied embedding / LM head is int8 per row in both quantized models, see `mini_engine/quant/__init__.py`).
# The quantized models compute in bf16 like the bf16 model, so the bf16 row and theirs differ only in how the
# weights are stored (`load_model(..., dtype="float32", quantization="int4")` keeps fp32 activations; it is what
# `python -m mini_engine bench --quantization int4` runs). Their products run PyTorch's int4 and int8 kernels,
# which read the codes and scales as stored and turn them into values inside the product (on a CPU the
# optional backend may run the same products in faster forms of its own: appendix [A1](A1_fast_on_a_cpu.ipynb)).
#
# Speed: decode tok/s of one stream (tokens after the first, greedy), and of a decode step of 16 sequences (the
# whole model, attention included, each sequence at section 1's context): the step whose ceilings section 1
# computed. Quality: perplexity on the course's fixed text (`quality.PERPLEXITY_TEXT`)
# and greedy agreement with the fp32 model, teacher-forced: the fp32 model's greedy continuation of each chat
# prompt is fed to both models and we count the positions where their next-token choices agree.

# %%
GREEDY = me.SamplingParams(temperature=0.0, ignore_eos=True)
prompts = quality.chat_prompt_ids(tok)
single_prompt = prompts[0]
quality_prompts = prompts[:pick(4, len(prompts), device)]
QUALITY_NEW = pick(24, 32, device)


def decode_tok_s(model, prompt, n):
    """One stream, greedy: tokens/s after the first token (the prefill is timed apart)."""
    stamps = []
    me.generate_cached(model, prompt, n, GREEDY, on_token=lambda _t: stamps.append(time.perf_counter()))
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def batch_tok_s(model, batch):
    """tok/s of decode steps of `batch` sequences at CONTEXT positions each (median of 7, random keys and values:
    a step's cost does not depend on them)."""
    return batch / time_decode_steps(model, batch, CONTEXT, block_sizes=())["contiguous"]


# Every row count the measurements bring: one token, the batch, a prompt and its answer (under 64 tokens) and the
# perplexity text (256 and more). Any one-time choices for each are made now, off the clock.
ROWS = (1, BATCH, 64, 256)
reference = quality.reference_greedy(models["fp32"], quality_prompts, QUALITY_NEW)
measured = {}
for name, m in tqdm(models.items(), desc="measuring"):
    warm_up(m, ROWS)
    decode_tok_s(m, single_prompt, 4)  # warm-up: first-use costs stay off the clock
    agree = quality.greedy_agreement(m, models["fp32"], quality_prompts, QUALITY_NEW, reference_tokens=reference)
    measured[name] = dict(
        mib=weight_bytes(m) / 2**20,
        b1=decode_tok_s(m, single_prompt, NEW),
        b16=batch_tok_s(m, BATCH),
        floor=matmul_floor_tok_s(m, 1),
        ppl=quality.perplexity(m, tok),
        agree=agree,
    )
bf16_mib = measured["bf16"]["mib"]
print(f"{'weights':<8}{'MiB':>7}{'% bf16':>8}{'tok/s b=1':>11}{'x fp32':>8}{'tok/s b=16':>12}{'x fp32':>8}"
      f"{'products floor':>16}{'perplexity':>12}{'agreement':>11}{'max |dlogit|':>14}")
for name, r in measured.items():
    f = measured["fp32"]
    print(f"{name:<8}{r['mib']:>7.1f}{100 * r['mib'] / bf16_mib:>7.1f}%{r['b1']:>11.1f}{r['b1'] / f['b1']:>7.2f}x"
          f"{r['b16']:>12.1f}{r['b16'] / f['b16']:>7.2f}x{r['floor']:>16.1f}{r['ppl']:>12.2f}"
          f"{100 * r['agree'].rate:>10.1f}%{r['agree'].max_logit_diff:>14.3f}")
print(f"(agreement: {measured['fp32']['agree'].positions} positions over {len(quality_prompts)} prompts; "
      f"products floor: the weight products alone, chained, at batch 1, in tok/s)")

# %%
names = list(measured)
fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
colors = ["tab:gray", "tab:blue", "tab:orange", "tab:red"]
axes[0].bar(names, [measured[n]["mib"] for n in names], color=colors)
axes[0].set(ylabel="MiB", title="weights in memory")
x = np.arange(len(names))
axes[1].bar(x - 0.2, [measured[n]["b1"] / measured["fp32"]["b1"] for n in names], 0.4, label="batch 1",
            color=colors)
axes[1].bar(x + 0.2, [measured[n]["b16"] / measured["fp32"]["b16"] for n in names], 0.4, label=f"batch {BATCH}",
            color=colors, alpha=0.45, hatch="//")
axes[1].axhline(1, color="k", lw=0.8)
axes[1].set(xticks=x, xticklabels=names, ylabel="tok/s / fp32's", title="speed (solid: batch 1, hatched: 16)")
axes[2].bar(names, [measured[n]["ppl"] for n in names], color=colors)
axes[2].set(ylabel="perplexity", title="perplexity on the course's text", ylim=(0, None))
plt.tight_layout()
plt.show()

# %% [markdown]
# llama.cpp runs the same GGUF file with its own Q4_1 kernels. Where `llama-cpp-python` is installed (it is
# optional), it runs the same prompt on the same number of threads, one stream:

# %%
from mini_engine.bench.runs import llama_cpp_available, run_llama_cpp_isolated

llama_tok_s = None
row = run_llama_cpp_isolated(single_prompt, NEW) if device == "cpu" and llama_cpp_available() else None
if row is not None:
    llama_tok_s = 1 / row.tpot[0]
    print(f"{row.system}: {llama_tok_s:.1f} tok/s after the first token; our int4: {measured['int4']['b1']:.1f} "
          f"({measured['int4']['b1'] / llama_tok_s:.2f}x)")
elif device == "cpu" and llama_cpp_available():
    print("no llama.cpp row: it crashed on this machine (said above)")
else:
    print("skipped: llama-cpp-python is not installed (or this is not a CPU run)")

# %% [markdown]
# How to read the table (your numbers are above; the reasons do not depend on them):
#
# - **Memory**: int4 takes about a third of bf16's bytes, not a quarter: Q4_1 costs 5 bits a weight (a 16-bit
#   scale and a 16-bit minimum per 32), and the LM head, a fifth of the model, stays int8 (exercise 3).
# - **Batch 1** gains several times over fp32, because the step is memory-bound and reads 6× fewer bytes of
#   weights. It gains less than the products alone do (compare the "products floor" column): attention, the
#   norms, sampling and Python's bookkeeping per step are not quantized, and they are a larger share of a
#   faster step (Amdahl's law). bf16 sits in between; on CPUs without bf16 arithmetic it can even be slower
#   than fp32.
# - **Batch 16**: on a CPU, int4 usually gains much less, or nothing. Quantization saves bytes, and bytes set
#   the speed only while a step is memory-bound. As the ceilings of section 1 predicted, 16 rows make a CPU
#   step compute-bound, and an int4 product also has to turn its codes back into numbers before it
#   multiplies: arithmetic a float product does not do. int8 may hold up better (compare its row): once the
#   arithmetic, not the bytes, sets the speed, which format wins is a fact about the kernels and this machine,
#   not about the bits. A GPU's ridge point is far higher, so there a step of 16 rows is still memory-bound and
#   int4 keeps paying at batch 16. (How the kernels turn codes back into numbers, on a GPU and on a CPU:
#   `mini_engine/kernels/quant_matmul.py` and appendix [A1](A1_fast_on_a_cpu.ipynb).)
# - **Quality**: int4 keeps the checkpoint's own 4-bit codes, so against the dequantized fp32 model (which holds
#   the same values) it differs only by the bf16 scales, the bf16 activations (compare the bf16 row) and the
#   int8 head. int8 per row can come out *worse* than int4 here: it re-quantizes weights that sat on 4-bit
#   grids of 32 with one scale for a whole row, and its 255 levels do not include the old ones. More bits do
#   not guarantee less error; the grid has to fit the weights. What 4 bits cost against the original bf16
#   checkpoint cannot be measured here: that checkpoint is not in the GGUF.
#
# ## 4. NF4, AWQ and GPTQ: what each one changes
#
# Every weight-only format above rounds each weight to the nearest level of a uniform grid. The three names
# the textbook lists keep the idea and change one piece of it:
#
# | method | what it changes | storage | needs | runs on |
# | --- | --- | --- | --- | --- |
# | int8 / int4, round to nearest (RTN) | nothing: uniform grid per row or group | 8 or 4 bits + scales | nothing | any int kernel (this chapter) |
# | **NF4** (QLoRA, 2023) | **the grid**: 16 levels at the quantiles of a normal distribution, dense near 0 where most weights are, scaled by each block's absmax | 4 bits + absmax per 64 (4.127 bits with "double quantization" of the absmaxes) | nothing | a lookup-table dequantize (bitsandbytes); made for fine-tuning adapters on a frozen 4-bit model |
# | **AWQ** (Lin et al. 2023) | **which weights are protected**: it starts from the observation that keeping ~1% of the input channels, those that meet large activations, in fp16 saves most of the quality; instead it scales *every* input channel by s = s_X^α before rounding (s_X its mean activation size, α in [0, 1] found by a grid search per layer; §3.2) and the activations down by s to match, so the salient channels' relative error shrinks | int4, groups of 128 | a few hundred calibration samples to measure activation sizes | the ordinary W4A16 kernel: the scaling is folded into the weights |
# | **GPTQ** (2022) | **how rounding errors are placed**: columns are quantized one at a time, and each one's rounding error is pushed onto the columns not yet quantized, weighted by the inverse Hessian of the layer's inputs, so the layer's *output* error is minimised rather than each weight's | int4 (or 3), groups of 128 | calibration samples; minutes to hours per model | the ordinary W4A16 kernel |
#
# So NF4 changes the levels, AWQ the scales, GPTQ the codes; none of them changes the bytes read per token
# by much (all are 4.1-4.5 bits), and AWQ and GPTQ produce weights that the same W4A16 kernel runs. They
# matter for quality at 4 bits (and at 3), where RTN starts to hurt on large models.
#
# NF4's grid, measured: NF4 assumes weights are roughly normal within a block. Here is the error of
# symmetric 4-bit quantization on blocks of 64 with the uniform grid against NF4's levels, on a slice of the
# embedding table (stored as Q8_0, codes -127 to 127 times a scale per 32 weights, 255 levels, so its values are
# close to continuous; the decoder's matrices are already on 4-bit grids and would favour the uniform one):

# %%
NF4 = torch.tensor([-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
                    0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0])  # QLoRA's levels (rounded)
UNIFORM = torch.arange(-7, 8) / 7.0  # symmetric int4: 15 levels, -7..7 times absmax / 7


def absmax_quantize(w, levels, block=64):
    """Each block of `block` weights scaled by its absmax, every weight rounded to the nearest level."""
    blocks = w.reshape(-1, block)
    absmax = blocks.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    nearest = (blocks / absmax)[..., None].sub(levels).abs().argmin(dim=-1)
    return (levels[nearest] * absmax).view(w.shape)


E = models["fp32"].embed_tokens.weight.detach().float().cpu()[:4096]
for name, levels in (("uniform int4 (symmetric)", UNIFORM), ("NF4", NF4)):
    print(f"{name:<26} blocks of 64: relative RMS error {rel_rms(absmax_quantize(E, levels), E):.4f}")
print(f"asymmetric int4 (Q4_1-like), groups of 32 (5 bits/weight): {rel_rms(rtn_int4(E, 32), E):.4f}")

# %% [markdown]
# NF4 wins against the uniform grid at the same bits because it puts its levels where the weights are. The
# asymmetric grid with groups of 32 (Q4_1's form) does better still, but pays 5 bits a weight against NF4's
# 4.5: the same trade as in section 2.
#
# ## 5. The textbook's "another 2 to 4×", beside what was measured here
#
# The textbook's claim ("another 2 to 4× throughput improvement on top" of the serving stack) is about a
# serving stack on a GPU, and its arithmetic is the roofline's: below, Llama-7B on an A100-80GB (as in chapter
# 09), fp16 against int4 in groups of 128, at batch 1 and 16 with 1,024 tokens of context. The KV cache stays
# fp16, so the larger the batch and the context, the smaller the share of the bytes that int4 shrinks.

# %%
A100 = dict(peak_flops=312e12, peak_bw=2.039e12)
int4_bits = formulas.bits_per_weight(4, 128, 16, 4)
print(f"Llama-7B on an A100-80GB, 1,024 tokens of context: fp16 vs int4 ({int4_bits:.2f} bits) ceilings")
a100 = {}
for b in (1, 16, 64):
    fp16, int4 = (formulas.predicted_decode_tok_s("llama-7b", b, 1024, 2, **A100, weight_bits=w)
                  for w in (16, int4_bits))
    a100[b] = int4 / fp16
    print(f"batch {b:3d}: {fp16:7.0f} -> {int4:7.0f} tok/s, {int4 / fp16:.2f}x")
book_vs_here = [("the textbook: quantization on top of the serving stack", "2-4x"),
                ("A100 roofline, Llama-7B int4 vs fp16, batch 1 / 16 / 64",
                 " / ".join(f"{a100[b]:.2f}x" for b in (1, 16, 64))),
                ("measured here, int4 vs fp32, batch 1", f"{measured['int4']['b1'] / measured['fp32']['b1']:.2f}x"),
                ("measured here, int4 vs bf16, batch 1", f"{measured['int4']['b1'] / measured['bf16']['b1']:.2f}x"),
                (f"measured here, int4 vs fp32, batch {BATCH}",
                 f"{measured['int4']['b16'] / measured['fp32']['b16']:.2f}x")]
for k, v in book_vs_here:
    print(f"{k:<58}{v}")

# %% [markdown]
# The textbook's range falls out of the roofline: close to 4× against fp16 while the weights dominate the bytes
# (batch 1, short contexts), about 2× once the batch's KV reads are as large as the weights. Measured here,
# against fp32 (4 bytes → 5/8 of a byte per weight with the scales) and bf16, batch 1 gains a multiple in or near
# that range, and batch 16 does not: a CPU step of 16 rows is compute-bound, where the roofline promises
# quantization nothing. On a GPU, whose ridge point is some 50 times higher, batch 16 is still memory-bound and
# the gain holds. That is the honest reading of "on top": quantization multiplies with the serving stack while
# steps stay memory-bound, and as batching makes them compute-bound, the weights' bytes stop being the cost.
#
# `python -m mini_engine bench --quantization int4` measures the same at full size (HF transformers, our fp32
# and int4 rows, the compiled decode step, llama.cpp on the same file); `benchmarks/RESULTS.md` holds a run.
#
# ## 6. Quantizing the scales themselves (optional)
#
# > **An optional section.** The chapter's argument is complete above. This one looks at the bits a format
# > spends beyond its codes, and at one known way to spend fewer.
#
# Q4_1 stores, for each group of 32 weights, a 16-bit scale d and a 16-bit minimum m: 32 bits per 32 weights, a
# whole bit per weight on top of the codes' 4, and a fifth of the decoder's bytes. But scales are numbers like
# any others, and numbers can be quantized. QLoRA (2023) did it for NF4 and called it **double quantization**:
# its fp32 absmax constants, one per block of 64 weights, are quantized again to 8 bits in blocks of 256, which
# takes them from half a bit per weight to about an eighth.
#
# The same idea applied to Q4_1: each row keeps one fp32 factor for its d's and one for its m's, and each
# group stores its d and m as 8-bit codes of those factors, d ≈ d_code · f_d[row] and m ≈ m_code · f_m[row]
# (`quant.compact_scales`). That is 16 bits per group instead of 32: 4.5 bits a weight, plus the two fp32 factors
# of each row, which the cell counts too. Exercise 2 reaches about the same bits another way: groups of 64 with
# 16-bit scales. Which costs less precision? Both, and the
# checkpoint's own groups of 32 with 16-bit scales, measured on a sample of the decoder's matrices (every tenth
# layer), against the fp32 weights:

# %%
from mini_engine.quant import Int4Linear, dequantize_int4, expand_compact_scales, quantize_int4_compact


def int4_16bit_scales(w, group):
    """Round-to-nearest int4 per group, scale and zero in bf16: (the weights it gives back, bytes of scales)."""
    q, scale, zero = quantize_int4(w, group, torch.bfloat16)
    return dequantize_int4(q, scale, zero, group), scale.nbytes + zero.nbytes


def int4_8bit_scales(w, group=32):
    """The same grid per group, its d and m stored as 8-bit codes of two factors per row."""
    q, scales = quantize_int4_compact(w, group)
    d, m = expand_compact_scales(scales, w.shape[0], w.shape[1] // group)
    return (q.view(w.shape[0], -1, group).float() * d[..., None] + m[..., None]).view(w.shape), scales.nbytes


sample = [lin.weight.detach().float().cpu() for layer in models["fp32"].layers[::10]
          for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
sample_flat = torch.cat([w.flatten() for w in sample])
SCALE_WAYS = {"groups of 32, 16-bit scales (Q4_1)": lambda w: int4_16bit_scales(w, 32),
              "groups of 32, 8-bit scales": int4_8bit_scales,
              "groups of 64, 16-bit scales": lambda w: int4_16bit_scales(w, 64)}
scale_rows = {}
for name, way in SCALE_WAYS.items():
    approx, scale_bytes = zip(*(way(w) for w in sample))
    scale_rows[name] = (4 + 8 * sum(scale_bytes) / sample_flat.numel(),
                        rel_rms(torch.cat([a.flatten() for a in approx]), sample_flat))
print(f"{len(sample)} matrices, {sample_flat.numel() / 1e6:.1f}M weights")
for name, (bits, error) in scale_rows.items():
    print(f"{name:<36}{bits:6.2f} bits a weight, relative RMS error {error:.4f}")

# The whole int4 model with 8-bit scales: its decoder's scales shrink from 4 bytes a group to 2, plus 8 a row.
saved = sum(m.nbytes - m.qweight.nbytes - (2 * (m.in_features // 32) + 8) * m.out_features
            for m in models["int4"].modules() if isinstance(m, Int4Linear))
int4_share = weight_bytes(models["int4"]) / (bf16_mib * 2**20)
compact_share = (weight_bytes(models["int4"]) - saved) / (bf16_mib * 2**20)
print(f"the int4 model: {100 * int4_share:.1f}% of bf16's bytes; with 8-bit scales: {100 * compact_share:.1f}%")

# %% [markdown]
# On these weights, quantizing the scales costs far less precision than widening the groups, at about the same
# bits. An 8-bit code of d is off by at most a 510th of the row's largest d (and one of m by a 254th of the
# row's largest |m|), small beside the steps of most groups, so most weights stay close to the level they were
# stored on. Groups of 64 put two of the checkpoint's groups, whose ranges differ (the scale map of section 2),
# under one grid, and move many weights to other levels. The codes do not change at all; a kernel that reads
# such scales rebuilds d and m with one multiply each per group of 32 weights, cheap beside the group's 32
# multiply-adds.
#
# Production formats make the same move: llama.cpp's k-quants (Q4_K, 4.5 bits a weight) store each group's
# scale and minimum in 6 bits inside super-blocks of 256 weights, and QLoRA stores NF4's constants in 8 bits.
# The other large cost beyond the codes is the LM head, kept in int8 here: exercise 3 tries it in int4.
#
# ## What you measured

# %%
f32 = measured["fp32"]
summary = [
    ("bits per weight: fp32, bf16, int8 per row, Q4_1 int4", ", ".join(f"{b:.2f}" for b in bits_of.values())),
    ("machine: bandwidth, fp32 matmul", f"{ceil.peak_bw / 1e9:.1f} GB/s, {ceil.peak_flops / 1e9:.0f} GFLOP/s"),
    ("roofline ceiling at batch 1: int4 / fp32", f"{ceilings['int4'][0] / ceilings['fp32'][0]:.2f}x"),
    ("int4 re-quantized, rel. RMS error: groups of 32 / 64 / 192 / per row / per tensor",
     " / ".join(f"{rel_rms(w, W):.3f}" for w in grids.values())),
    *((f"{n}: weights MiB (% of bf16)", f"{r['mib']:.1f} ({100 * r['mib'] / bf16_mib:.1f}%)")
      for n, r in measured.items()),
    *((f"{n}: tok/s batch 1 (x fp32), batch {BATCH} (x fp32)",
       f"{r['b1']:.1f} ({r['b1'] / f32['b1']:.2f}x), {r['b16']:.1f} ({r['b16'] / f32['b16']:.2f}x)")
      for n, r in measured.items()),
    *((f"{n}: perplexity, greedy agreement with fp32, max |dlogit|",
       f"{r['ppl']:.2f}, {100 * r['agree'].rate:.1f}%, {r['agree'].max_logit_diff:.3f}") for n, r in measured.items()),
    *((f"int4 {name}: bits a weight, rel. RMS error", f"{bits:.2f}, {error:.4f}") for name, (bits, error)
      in scale_rows.items()),
    ("llama.cpp (same GGUF, same threads), batch 1",
     f"{llama_tok_s:.1f} tok/s; our int4 {measured['int4']['b1'] / llama_tok_s:.2f}x" if llama_tok_s
     else "not installed"),
    ("NF4 vs uniform int4 (blocks of 64), rel. RMS error on the embedding",
     f"{rel_rms(absmax_quantize(E, NF4), E):.4f} vs {rel_rms(absmax_quantize(E, UNIFORM), E):.4f}"),
    *book_vs_here,
]
width = max(len(k) for k, _ in summary)
for k, v in summary:
    print(f"{k:<{width}}  {v}")

# %% [markdown]
# ## Exercises: predict, then run
#
# Write your prediction down before you run each cell; the answer under it says what you should see and why.
#
# **1. The int4 model as a draft for the fp32 target.** Chapter 06 found the bf16 copy a poor draft: it agreed
# almost always but cost nearly as much as the target. The int4 copy agrees about as often and is several
# times cheaper at batch 1. Predict α and the speedup of draft-model speculation (k = 4) over plain fp32
# decoding, on a prompt that asks for new text.

# %%
from mini_engine.speculative import DraftModelProposer

target, draft = models["fp32"], models["int4"]
spec_prompt = prompts[2]
for m in (target, draft): warm_up(m, 8)  # one-time choices for steps of up to 8 tokens, made now, off the clock
plain_s = 1 / decode_tok_s(target, spec_prompt, NEW)
stamps = []
spec_out, spec_stats = me.generate_speculative(
    target, spec_prompt, DraftModelProposer(draft, cfg.vocab_size, max_len=len(spec_prompt) + NEW + 8), k=4,
    max_new_tokens=NEW, params=GREEDY, on_token=lambda _t: stamps.append(time.perf_counter()))
spec_s = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
draft_cost = measured["fp32"]["b1"] / measured["int4"]["b1"]
print(f"int4 draft, k = 4: α = {spec_stats.alpha:.2f}, {spec_stats.tokens_per_step:.2f} tokens per target pass; "
      f"{plain_s / spec_s:.2f}x vs plain fp32 decoding")
print(f"formula with draft_cost = {draft_cost:.2f} (a step of int4 / fp32): "
      f"{formulas.speculative_speedup(4, spec_stats.alpha, draft_cost):.2f}x")
print(f"same tokens as plain greedy: {spec_out == me.generate_cached(target, spec_prompt, NEW, GREEDY)}")

# %% [markdown]
# <details><summary>Answer</summary>
#
# α is near 1: the int4 model agrees with the fp32 one on almost every greedy choice, as the agreement column
# said. The speedup is then set by the cost of a round: k draft steps at c = (int4 step / fp32 step) each plus
# one verify pass, so at most (k + 1) / (1 + k·c), the formula printed above. The measured figure falls short
# of it by the verify pass's extra cost (five rows through a CPU's products cost more than one, chapter 06) and
# the draft's own bookkeeping. Against chapter 06's bf16 draft, the int4 draft is the better one on both
# counts: it agrees as often and costs a fraction of a step. A quantized copy of the target is a natural draft:
# the same tokenizer, α near 1, and a cost set by its bits.
# </details>
#
# **2. Group size.** Load the model with int4 groups of 64 instead of 32, quantized at load (round to nearest)
# from the dequantized weights. (128, AWQ's and GPTQ's usual size, does not divide this model's rows of 576.)
# Predict the weights' memory and the perplexity against the Q4_1 model's.

# %%
g64, _ = me.load_model("smollm2-135m", device=device, dtype=act_dtype, quantization="int4", group_size=64)
print(f"int4, groups of 64: {weight_bytes(g64) / 2**20:.1f} MiB ({100 * weight_bytes(g64) / 2**20 / bf16_mib:.1f}% "
      f"of bf16), perplexity {quality.perplexity(g64, tok):.2f}, "
      f"{quality.greedy_agreement(g64, models['fp32'], quality_prompts, QUALITY_NEW, reference_tokens=reference)}")
print(f"int4, Q4_1 (groups of 32): {measured['int4']['mib']:.1f} MiB, perplexity {measured['int4']['ppl']:.2f}; "
      f"fp32 {measured['fp32']['ppl']:.2f}")
print(f"the decoder's bits a weight: {formulas.bits_per_weight(4, 64, 16, 16):.1f} in groups of 64 with a bf16 scale "
      f"and zero, {formulas.bits_per_weight(4, 32, 16, 16):.1f} for Q4_1")
del g64

# %% [markdown]
# <details><summary>Answer</summary>
#
# The decoder shrinks from 5 to 4.5 bits a weight (a bf16 scale and zero per 64), a tenth of its bytes, and the
# quality falls sharply (perplexity up by about a third and agreement under 80% in our run): each new group of
# 64 must cover two Q4_1 groups with one grid, and neighbouring groups' ranges differ (the scale map of
# section 2), so weights move off the levels they were stored on; section 2's relative error went from 0 to 9%
# of the weights' size. Re-quantizing an already quantized checkpoint is the worst case for round to nearest.
# This is the trade GPTQ and AWQ exist for: at groups of 64 or 128 they recover much of what round to nearest
# loses, with calibration data this course does not use.
# </details>
#
# **3. The LM head.** The tied embedding / LM head is 28.3M of the 134.5M weights and is read whole at every
# step. Load the int4 model with the head in int4 (groups of 32) instead of int8. Predict the memory, as a
# share of bf16's, and the perplexity.

# %%
head4, _ = me.load_model("smollm2-135m", device=device, dtype=act_dtype, quantization="int4", head="int4")
print(f"int4 with an int4 head: {weight_bytes(head4) / 2**20:.1f} MiB "
      f"({100 * weight_bytes(head4) / 2**20 / bf16_mib:.1f}% of bf16), perplexity {quality.perplexity(head4, tok):.2f}, "
      f"{quality.greedy_agreement(head4, models['fp32'], quality_prompts, QUALITY_NEW, reference_tokens=reference)}")
print(f"int4 with the int8 head: {measured['int4']['mib']:.1f} MiB "
      f"({100 * measured['int4']['mib'] / bf16_mib:.1f}%), perplexity {measured['int4']['ppl']:.2f}")
print(f"Q4_1's {formulas.bits_per_weight(4, 32, 16, 16):.0f} bits a weight against bf16's 16: "
      f"{100 * formulas.bits_per_weight(4, 32, 16, 16) / 16:.2f}% whatever the head")
del head4

# %% [markdown]
# <details><summary>Answer</summary>
#
# Memory falls by about 10 MiB, to a little over 31% of bf16's: the decoder's 5 bits a weight alone are
# 31.25% whatever the head (section 6 shrinks the scales instead).
# Perplexity rises by several percent and agreement drops to the 80s: the embedding's rows spread wider than
# the decoder's, and the head's errors land directly on the logits. The head is a fifth of the bytes and most
# of the quality loss, which is why many quantization schemes (llama.cpp's Q4 files among them) keep the
# embedding and output layers at higher precision.
# </details>
#
# **4. When does int4 stop paying on a GPU?** Using `formulas.predicted_decode_tok_s`, find the batch at which
# int4's ceiling advantage over fp16 falls below 1.5× for Llama-7B on an A100 with 1,024 and with 4,096 tokens
# of context.

# %%
for context in (1024, 4096):
    b = np.arange(1, 257)
    ratio = (formulas.predicted_decode_tok_s("llama-7b", b, context, 2, **A100, weight_bits=int4_bits)
             / formulas.predicted_decode_tok_s("llama-7b", b, context, 2, **A100))
    below = b[ratio < 1.5]
    print(f"context {context}: int4 / fp16 ceiling {ratio[0]:.2f}x at batch 1, below 1.5x from batch "
          f"{below[0] if len(below) else 'never (up to 256)'}")

# %% [markdown]
# <details><summary>Answer</summary>
#
# Long before the step turns compute-bound, the KV cache takes over the bytes: every sequence reads its own
# keys and values, in fp16, at every step, and int4 weights do nothing for them. The longer the context, the
# sooner (in batch) that happens. This is why serving engines quantize the KV cache too (FP8 KV in vLLM and
# TensorRT-LLM), and why the textbook's "2 to 4×" is a range and not a constant.
# </details>
#
# **Lab.** [Lab 10](../labs/lab10_notebook.ipynb) has you write group-wise int4 quantize / dequantize, the
# nibble packing, the int4 product and the Q4_1 repacking, graded against the reference.
