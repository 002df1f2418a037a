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
#
# **The textbook.** The course accompanies a textbook's part on inference efficiency, Part 3, "Inference
# Efficiency Core". Its thesis fits in one sentence: "decode is memory-bound, so the game is to read each
# weight from HBM as few times as possible and serve as many tokens as possible per read" (HBM, high-bandwidth
# memory, is the main memory of a data-centre GPU such as the A100 or H100; the T4 and L4 that Colab also offers
# use GDDR6, at 320 and 300 GB/s, and a CPU reads DRAM, but the thesis holds for any main memory). It then puts
# a number on each technique: a KV cache worth "an ~700× speedup over re-computing
# past tokens", continuous batching "lifting utilization ~50% → ~90%", PagedAttention "cutting waste from
# 60–80% to ≤15 tokens per request", prefix caching cutting "TTFT ~40×", and a 7B model on an A100 that runs
# at "5 to 10 tokens per second" naive and "200 to 500" on an optimised stack. You do not need the book.
# Whenever a chapter takes up one of these claims, it calls it "the textbook", quotes it, and then does one of
# three things: reproduces it on the real model, corrects it where the textbook's own numbers disagree, or
# explains which assumptions the figure rests on, so that you can tell when it applies to your machine.

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
from mini_engine.config import PRESETS
from mini_engine.course.devices import default_device, timed
from mini_engine.course.hardware import cpu_info, describe_machine, measure_ceilings

device = default_device()
dtype = me.default_dtype(device)  # float32 on a CPU; on a GPU bfloat16, or float16 where it has no bf16 (T4)
print(f"device: {device}, dtype: {dtype}")
print(describe_machine(device))  # every measurement in this course depends on it: name it

# %% [markdown]
# ## Load the model
#
# The checkpoint is a GGUF file (the llama.cpp format), quantized to 4 bits. `load_model` reads the file
# itself (`mini_engine/loading/gguf_file.py`: a header, the metadata, a table of tensors, then their bytes,
# about a hundred lines; the `gguf` package, llama.cpp's own reader, is kept only to check it in the tests),
# dequantizes every tensor to floating point, rebuilds the tokenizer from the file's metadata with the
# `tokenizers` library, and returns a plain PyTorch module.

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
# projection share one matrix (tied embeddings). Where do the parameters live?

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
embedding_share = groups["embedding (tied with output)"] / n_params
print(f"the embedding is {cfg.vocab_size:,} tokens × {cfg.hidden_size} = {embedding_share:.0%} of the model, "
      f"about 1/{1 / embedding_share:.0f}")
llama = PRESETS["llama-7b"]  # for scale: a 7B model, whose input and output matrices are separate
llama_embedding = llama.vocab_size * llama.hidden_size * (1 if llama.tie_word_embeddings else 2)
print(f"Llama-7B: {llama.vocab_size:,} tokens × {llama.hidden_size}, input and output matrices "
      f"{llama_embedding / llama.num_params:.1%} of its {llama.num_params / 1e9:.1f} B parameters")

# %% [markdown]
# The embedding is about a fifth of this model. That is a mark of a small model: the table has one row of
# `hidden` numbers per vocabulary entry, and a vocabulary of about 50,000 tokens costs the same whether the
# layers behind it are small or large, while the layers' share grows with hidden² · layers. In Llama-7B
# the embedding and its separate output matrix together are a few percent of the weights (the second line
# above). Here the one matrix serves twice: at the input, where each token looks up one row, and at the
# output, where every row scores the next token, so each decode step reads all of it like a layer's
# weights. Chapter 10 meets it again when it quantizes the weights.

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
logits, forward_s = timed(lambda: model(x), device)  # on a GPU it waits for the queued work, not only its launch
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
bound = formulas.roofline_bound(flops_token, weight_bytes, ceil.peak_flops, ceil.peak_bw)  # the busier unit
print(f"one decode step moves {weight_bytes / 2**20:.0f} MiB of weights -> {t_memory * 1e3:.1f} ms at best")
print(f"one decode step does {flops_token / 1e9:.2f} GFLOP            -> {t_compute * 1e3:.1f} ms at best")
print(f"its {flops_token / weight_bytes:.2f} FLOP per byte are {'below' if bound == 'memory' else 'above'} "
      f"the ridge point of {ceil.ridge_point:.1f}")
best_tok_s = 1 / max(t_memory, t_compute)
print(f"=> {bound}-bound: at most {best_tok_s:.0f} tokens/s for one stream on this {device}")

# %%
fig, ax = plt.subplots(figsize=(6, 2.6))
ax.barh(["memory (read weights)", "compute (2 FLOPs/weight)"], [t_memory * 1e3, t_compute * 1e3],
        color=["#C44E52", "#4C72B0"])
ax.set_xlabel("ms per generated token (lower bound)")
ax.set_title(f"One decode step on this {device} is {bound}-bound")
plt.tight_layout()
plt.show()

# %% [markdown]
# The longer bar sets the pace, and the verdict above is computed from your two measurements, not assumed.
# A decode step does two FLOPs (one multiply-add) with each weight it reads: half a FLOP per byte in
# float32, where a weight takes four bytes, and one in bfloat16. The **ridge point**, peak FLOP/s divided
# by bandwidth, is the intensity a computation needs to keep the arithmetic units busy. Only a machine
# whose ridge sat below one FLOP per byte could be compute-bound here, and processors are built the other
# way round: their arithmetic outruns their memory. Chapter 02 turns this into the roofline.
#
# ## The map of the course
#
# Each later chapter removes one cost from the loop you just ran. A request runs in two phases (chapter 02
# names them): **prefill**, one forward pass over the whole prompt, which sets the time to the first
# token, and **decode**, one forward pass per new token. Here is which phase each chapter speeds up and
# which bottleneck it attacks; the bar chart above told you which of the first two binds a single stream
# on your machine.
#
# | chapter | what it changes | phase | bottleneck it attacks |
# | --- | --- | --- | --- |
# | 01 naive baseline | nothing yet: the whole sequence is recomputed at every step | both | none: it measures the waste, O(N³) work for N tokens |
# | 02 prefill vs decode | nothing yet: it times the two phases and places each on the roofline | both | none: it says which of the two ceilings above binds each phase |
# | 03 KV cache | each position's keys and values are kept | decode | redundant compute, paid for in memory capacity |
# | 04 batching | several sequences advance in one decode step; finished ones leave and new ones join at every step | decode | memory bandwidth: one weight read serves the whole batch, and no slot of it idles |
# | 05 FlashAttention | attention runs in tiles held in on-chip memory | prefill (long prompts) | memory traffic and memory size of the N × N attention scores |
# | 06 speculative decoding | a small model drafts tokens, the large one checks them in one pass | decode | memory bandwidth: idle arithmetic verifies several tokens per weight read |
# | 07 PagedAttention | the cache lives in fixed-size blocks, allocated as needed | decode | memory capacity: cache reserved for tokens that never come |
# | 08 prefix caching | the cache of a prompt prefix seen before is reused | prefill | redundant compute across requests, hence the time to first token |
# | 09 the full stack | all of the above, behind an HTTP server | both | none new: it measures the whole ladder |
# | 10 quantization | weights stored in 8 or 4 bits | decode | memory bandwidth and capacity: fewer bytes per weight |
#
# The chapters teach ideas that hold on any machine. How this engine is made fast on a CPU in particular
# (computing the same products and the same attention in another order, chosen by timing them on your
# machine) is the subject of an optional appendix, [A1](A1_fast_on_a_cpu.ipynb), which you can read after any
# chapter.
#
# ## What you measured

# %%
summary = [
    ("device / dtype", f"{device} / {dtype}"),
    ("CPU", f"{cpu_info().model}, {cpu_info().cores} cores"),
    ("parameters", f"{n_params / 1e6:.1f} M"),
    ("weights in memory", f"{weight_bytes / 2**20:.0f} MiB"),
    ("load time", f"{load_s:.1f} s"),
    (f"forward pass, {len(prompt_ids)} tokens", f"{forward_s * 1e3:.1f} ms"),
    ("matmul ceiling", f"{ceil.peak_flops / 1e9:.1f} GFLOP/s"),
    ("memory bandwidth", f"{ceil.peak_bw / 1e9:.1f} GB/s"),
    ("best possible decode speed", f"{best_tok_s:.0f} tok/s ({bound}-bound)"),
]
for k, v in summary:
    print(f"{k:<30} {v}")

# %% [markdown]
# ## Exercises: predict, then run
#
# Write your prediction down before you run each cell; the answer under it says what you should see and
# why. Each cell takes a few seconds.
#
# **1. Sixty-four tokens in one pass.** A forward pass over one token and a forward pass over 64 tokens
# read exactly the same weights. How many times longer does the 64-token pass take: about the same, 64
# times longer, or something in between?

# %%
def pass_time(n: int) -> float:
    x = torch.randint(100, 40000, (1, n), device=device)
    model(x)  # warm-up
    return min(timed(lambda: model(x), device)[1] for _ in range(3))


pass_s = {n: pass_time(n) for n in (1, 64)}
roof_s = {n: formulas.roofline_time(formulas.prefill_flops(cfg, n), formulas.prefill_bytes(cfg, n, bytes_per),
                                    ceil.peak_flops, ceil.peak_bw) for n in pass_s}
for n in pass_s:
    print(f"{n:3d} tokens: {pass_s[n] * 1e3:7.1f} ms ({pass_s[n] / n * 1e3:6.2f} ms per token), "
          f"roofline bound {roof_s[n] * 1e3:6.1f} ms")
print(f"64 tokens / 1 token: measured {pass_s[64] / pass_s[1]:.1f}x, roofline {roof_s[64] / roof_s[1]:.1f}x")

# %% [markdown]
# <details><summary>Answer</summary>
#
# In between. The one-token pass pays for reading every weight and then does only two FLOPs with each, so
# it waits on memory. The other 63 tokens reuse weights that are already on their way to the arithmetic
# units: they add their FLOPs but almost no bytes. How far the ratio climbs depends on the ridge point. A
# machine with a low ridge (a CPU) becomes compute-bound after a handful of tokens, so 64 tokens cost a
# good fraction of 64 single passes; a machine with a high ridge (a GPU) runs 64 tokens in about the time
# of one. Either way the cost per token falls. That is the difference between prefill and decode, the
# subject of chapter 02.
# </details>
#
# **2. Half the bytes per weight.** Load the same model in another dtype (bfloat16 if this chapter runs in
# float32, float32 if it runs in a 16-bit dtype). Predict the memory its weights take, its memory-bound ceiling on
# decode speed, and the decode speed you will actually measure.

# %%
from mini_engine.course.hardware import measure_matmul_flops
from mini_engine.course.metrics import TokenTimer

other_dtype = "bfloat16" if dtype == "float32" else "float32"
other_model, _ = me.load_model("smollm2-135m", device=device, dtype=other_dtype)
decode_params = me.SamplingParams(max_tokens=16, ignore_eos=True)
dtype_rows = {}
for name, m in ((dtype, model), (other_dtype, other_model)):
    nbytes_m = sum(p.numel() * p.element_size() for p in m.parameters())
    # 512 x 512 on a CPU: a CPU without bf16 arithmetic multiplies bf16 slowly, and a larger matmul would take
    # many seconds to time
    flops_m = measure_matmul_flops(device, m.dtype, n=512 if device == "cpu" else 1024)
    me.generate_cached(m, prompt_ids, 4, decode_params)  # warm-up: first-use costs stay off the clock
    timer = TokenTimer(device).begin()
    ids_m = me.generate_cached(m, prompt_ids, 16, decode_params, on_token=timer.on_token)
    dtype_rows[name] = ids_m
    print(f"{name:>9}: weights {nbytes_m / 2**20:4.0f} MiB, ceilings {ceil.peak_bw / nbytes_m:5.0f} tok/s (memory) "
          f"and {flops_m / flops_token:5.0f} tok/s (matmul), measured {1 / timer.tpot_s:5.1f} tok/s")
same = dtype_rows[dtype] == dtype_rows[other_dtype]
print(f"same 16 tokens in both dtypes: {same}")
del other_model

# %% [markdown]
# <details><summary>Answer</summary>
#
# A 16-bit weight (bfloat16, or float16 on a GPU without bf16) takes two bytes instead of four, so the
# weights take half the memory and the memory-bound ceiling doubles: the same bandwidth now carries twice
# as many weights per second. Whether the measured speed follows depends on the arithmetic. On hardware
# that multiplies 16-bit numbers natively (recent GPUs, and CPUs with bf16 instructions) it rises too,
# though rarely by the full factor, since part of every step (attention, norms, Python between the
# kernels) does not shrink with the weights; a processor that converts each 16-bit product to float32 can
# gain little or even lose, and the matmul ceiling column shows which case you are in. The tokens may
# differ: a 16-bit number keeps far fewer mantissa bits, and when two candidates score almost equally,
# rounding can pick the other one.
# </details>
#
# **3. Tokens are not words.** Every cost in this course is counted per token. Which of these strings
# needs the most tokens for its length: English prose, the same sentence in French, a line of Python, or
# a 20-digit number?

# %%
samples = {
    "English": "The cat sat on the mat because it was warm.",
    "French": "Le chat s'est assis sur le tapis parce qu'il faisait chaud.",
    "Python": "for i in range(10):\n    print(i ** 2)",
    "digits": "31415926535897932384",
}
for name, s in samples.items():
    pieces = [tok.decode([i]) for i in tok.encode(s)]
    print(f"{name:<8}{len(s):4d} chars -> {len(pieces):3d} tokens ({len(s) / len(pieces):.1f} chars per token): "
          f"{pieces[:8]}")

# %% [markdown]
# <details><summary>Answer</summary>
#
# The number. A byte-level BPE vocabulary is learned from its training text: frequent words of that text
# become single tokens, rarer ones are cut into pieces. SmolLM2's vocabulary was learned mostly from
# English and code, so the English sentence is about one token per word, the French one is cut into
# syllable-sized pieces, and this tokenizer splits numbers into single digits. The same request therefore
# costs more compute, cache and time in a language or format the vocabulary covers less well.
# </details>
#
# **4. A longer answer.** `generate_cached` keeps the keys and values of earlier tokens (chapter 03 builds
# it). How much longer does it take to generate 32 tokens than 8 from the same prompt?

# %%
length_s = {n: timed(lambda: me.generate_cached(model, prompt_ids, n, me.SamplingParams(max_tokens=n, ignore_eos=True)),
                     device)[1] for n in (8, 32)}
for n, s in length_s.items():
    print(f"{n:3d} new tokens: {s:.2f} s")
print(f"32 / 8 tokens: {length_s[32] / length_s[8]:.1f}x for {32 / 8:.0f}x the tokens")

# %% [markdown]
# <details><summary>Answer</summary>
#
# A little under four times. Each new token costs one decode step, and a step costs about the same
# whatever its position (it reads the weights once), so the time grows in proportion to the number of
# tokens; the prompt's prefill is a fixed cost paid once, which keeps the ratio below four. Chapter 01
# removes the cache, and then every step costs more than the one before.
# </details>
#
# **Next.** This chapter has no lab. Continue with [chapter 01, the naive baseline](01_naive_baseline.ipynb),
# where the first lab has you write the generation loop that every later chapter speeds up.
