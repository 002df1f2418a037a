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
# # A1 · Appendix: how the engine is made fast on a CPU (optional)
#
# The chapters teach ideas that hold on any machine: cache what you would recompute, share each read of the
# weights among many tokens, read fewer bytes. This appendix is about one machine, the CPU the course runs on by
# default, and about what the engine's optional CPU backend (`mini_engine/backends/cpu/`) does there. It never
# changes *what* is computed, only *how*: every form it uses gives the same numbers to rounding, and none is used
# unless it was measured faster on the machine that runs it. Start Python with `MINI_ENGINE_CPU_BACKEND=0` and
# the engine is plain PyTorch everywhere; the chapters' arguments do not change, only some of their numbers.
#
# This appendix:
#
# 1. says what a CPU core offers, and measures this one's ceilings;
# 2. computes one weight product in several equal ways, and shows how the engine picks one by timing them;
# 3. explains the product the engine uses for a batch's few rows: streaming the weights while computing;
# 4. reads attention in place from the paged cache, with chapter 05's online softmax in a core's vector lanes;
# 5. fuses the small operations between the products;
# 6. says what changes for quantized weights (chapter 10);
# 7. tells how threads cost a server a quarter of its speed, and how the kernels are built.
#
# It runs in a minute or two on a 2-core CPU, and on a machine with a GPU it measures the CPU all the same. The
# backend's own README (`mini_engine/backends/cpu/README.md`) goes further: every form, what it measured on three
# different CPUs, and what was tried and not kept.

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
from collections import Counter

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import mini_engine as me
from mini_engine.backends.cpu import format_tuned_forms, tuned_forms, warm_up
from mini_engine.course.hardware import cpu_info, describe_machine, matmul_floor_tok_s, measure_ceilings
from mini_engine.course.devices import default_device

device = default_device()
backend_on = os.environ.get("MINI_ENGINE_CPU_BACKEND", "1") != "0"
model, tok = me.load_model("smollm2-135m", device="cpu", dtype="float32")  # this appendix is about the CPU
cfg = model.config
print(describe_machine(device))
print(f"default device: {device}; everything below runs on the CPU, in float32")
print(f"CPU backend: {'on' if backend_on else 'off (MINI_ENGINE_CPU_BACKEND=0): every form below is plain PyTorch'}")

# %% [markdown]
# ## 1. What a CPU core offers
#
# Four facts decide everything below.
#
# - **Vector registers.** A core does its arithmetic on short vectors: one instruction multiplies and adds 8
#   float32 numbers in a 256-bit AVX2 register, or 16 in a 512-bit AVX-512 one (Arm's NEON: 4). Each position
#   of a vector is a *lane*. Some Intel CPUs add AMX, tiles of 16 rows that one instruction multiplies by a
#   block of weights.
# - **Caches.** Memory arrives in 64-byte lines through a few MiB of caches. A *prefetcher* in the hardware
#   fetches lines ahead of time when the addresses follow a pattern it can see, and a program can ask for
#   addresses it knows it will need (a prefetch hint).
# - **Pages.** The processor translates every address through page tables, 4 KiB at a time unless a program
#   asks for 2 MiB *huge pages*; a translation it has not cached costs a walk through those tables.
# - **Cores and threads.** A few cores share one memory bus. PyTorch spreads each large operation over them
#   with OpenMP, a team of worker threads.
#
# A core is built for arithmetic much more than for memory: its ridge point (chapter 02) is a few FLOPs per
# byte, so a decode step of a handful of rows is already compute-bound. This CPU's numbers:

# %%
info = cpu_info()
ceil = measure_ceilings("cpu", torch.float32, quick=True)
lanes = 16 if "AVX-512" in info.isa else 8 if "AVX2" in info.isa else 4 if "NEON" in info.isa else 1
print(f"{info.model}: {info.cores} cores; vector extensions {', '.join(info.isa) or 'none the engine uses'} "
      f"({lanes} float32 lanes at most)")
print(f"matmul {ceil.peak_flops / 1e9:.0f} GFLOP/s, memory {ceil.peak_bw / 1e9:.1f} GB/s: "
      f"ridge point {ceil.ridge_point:.1f} FLOP/byte")

# %% [markdown]
# ## 2. One product, several equal forms, and a tuner that picks one
#
# Every weight product `y = x Wᵀ` of the model can be computed in several ways that give the same numbers to
# rounding:
#
# - `linear`: PyTorch's `F.linear`, what HF transformers uses; it hands the product to a BLAS library (on x86,
#   PyTorch's wheels use Intel's MKL for float32);
# - `transposed`: `(W xᵀ)ᵀ`, the same sums with the operands swapped, which a BLAS may run through another
#   kernel;
# - `two_row`: a single row computed as two copies of itself, a matrix-matrix product (GEMM) instead of a
#   matrix-vector one (GEMV), whose code is tuned differently;
# - `linear_fp32` and the like: bfloat16 weights converted to float32 first (a CPU without bf16 arithmetic
#   converts anyway, often more slowly);
# - `onednn`: the oneDNN library's GEMM on a copy of the weight packed once into its own blocked layout (what
#   `torch.compile`'s weight prepacking does on a CPU), at the price of a second copy of the weight;
# - `c_f32`: the course's own C kernel, on a copy packed into panels (section 3).
#
# Which is fastest depends on the CPU, its instruction set, the library's version, the weight's shape and the
# number of rows: on the machines this course was measured on, one trick won on one CPU and lost clearly on
# another, and a packed form beat MKL on an AMD CPU, whose fast paths MKL does not take. So the engine does not
# guess. The first time a layer meets a new case (its weight's shape, a power-of-two bucket of row counts, its
# dtype), it times every candidate and keeps the fastest for the rest of the process, as Triton's `autotune`
# does for a kernel's launch settings. Three details make the timing honest:
#
# - Each form is timed on enough copies of the weight to stream them from memory, as a decode step streams
#   the model (about twice the last-level cache). On one weight that stays in cache, a form that repacks the
#   weight at every call (as MKL does) looks as fast as one that packed it once, and loses on the model.
# - Another form must beat `F.linear` by 3%, and in most timing rounds: noise keeps the plain form.
# - The choices are kept in a file per machine (`~/.cache/mini_engine`), named by what they depend on (the
#   CPU, PyTorch's version, the thread count, the backend's source), so the next notebook starts with them.
#
# `warm_up(model, rows)` makes these decisions now, off the clock. The chapters never call the backend
# themselves: the course's helper `mini_engine.course.devices.warm_up` calls it for them before they time
# anything, and does nothing where the backend is off or the model is on a GPU. A server the chapters start
# (chapter 09) is handed the same choices in a file (`mini_engine.bench.server.tuned_env`), so that its first
# requests do not make them again. The choices for one row (a decode step) and for 16 (a batch), with every
# candidate's best time over the copies:

# %%
t0 = time.perf_counter()
warm_up(model, (1, 16))
tune_s = time.perf_counter() - t0
print(f"decided in {tune_s:.1f} s (close to nothing where an earlier notebook on this machine decided them)")
for rows in (1, 16):
    print(f"\n{rows} row{'s' * (rows > 1)}:\n{format_tuned_forms(rows=rows)}")
chosen = {rows: Counter(r["form"] for r in tuned_forms() if r["op"] == "product" and r["case"][1] == rows)
          for rows in (1, 16)}

# %% [markdown]
# What the choice buys: the model's weight products alone, chained, with nothing else
# (`hardware.matmul_floor_tok_s`, chapter 03's "floor"), in the chosen forms and in plain `F.linear`:

# %%
floors = {b: (matmul_floor_tok_s(model, b), matmul_floor_tok_s(model, b, plain=True)) for b in (1, 16)}
for b, (ours, plain) in floors.items():
    print(f"batch {b:2d}: weight products alone {ours:7.1f} tok/s in the chosen forms, {plain:7.1f} in F.linear "
          f"({ours / plain:.2f}x)")

fig, ax = plt.subplots(figsize=(6, 2.4))
for i, (b, (ours, plain)) in enumerate(floors.items()):
    ax.barh([2 * i + 1, 2 * i], [plain, ours], color=["tab:gray", "tab:green"])
ax.set(yticks=range(4), yticklabels=["batch 1, chosen", "batch 1, F.linear", "batch 16, chosen", "batch 16, F.linear"],
       xlabel="tok/s of the weight products alone", title="The same products in the forms chosen here")
plt.tight_layout()
plt.show()

# %% [markdown]
# Where a ratio is well above 1, the library's plain product was far from the best this CPU can do at that row
# count: BLAS libraries tune their code for the shapes and processors they expect, and a skinny product of a few
# rows, on a processor of another vendor, is not always among them. Where it is close to 1, `F.linear` was about
# as good as any form. A ratio can even fall below 1: each form is chosen for one weight timed alone, the floor
# chains all 121 products back to back, and the machine may be busier or quieter than when the forms were timed.
# That is the limit of timing each product in isolation, and the reason the tuner demands a clear margin.
#
# ## 3. A product for a batch's few rows
#
# At one row a product reads every weight once and does two FLOPs with it: it waits on memory. At hundreds of
# rows it waits on arithmetic. The 4 to 64 rows of a batch's decode step, or of a short prefill chunk, sit in
# between: the whole weight must still stream from memory, and each part of it also carries real arithmetic.
# Neither alone sets the speed; how well a kernel overlaps the two does.
#
# That is what the `c_f32` form is for. Its C kernel lays the weight out once in *panels* (48 weight rows with
# AVX-512, 16 with AVX2), each stored column after column, so a few vector loads bring one column of a whole
# panel. It reads each panel from memory once, multiplies it by every row of `x` while its sums stay in
# registers, and meanwhile asks for the next panel with prefetch hints, since streaming and computing should
# happen at the same time. *How* it asks matters as much. A first version asked for the whole next panel while
# it worked on the first few rows, faster than memory could deliver; the requests queued, the arithmetic stalled
# behind them, and streaming and computing took turns. Spreading the same requests evenly over all the panel's
# work made the products at 16 and 33 rows much faster, with the same sums in the same order. The panels also
# sit in 2 MiB huge pages where Linux allows it, or a one-row product that streams them would pay a page-table
# walk every 4 KiB.
#
# The tables above say whether `c_f32` won any case on this machine; where it did not, the tuner kept another
# form, as it should.
#
# ## 4. Attention on a CPU
#
# **Decode.** A decode step reads every cached key and value of each sequence once. PyTorch's fused attention
# (SDPA) wants them side by side, so with the paged cache of chapter 07 the plain path first copies each
# sequence's blocks out of the pool and then reads the copy: the bytes cross memory twice. The backend's
# `paged_decode` kernel follows the block table and reads the blocks where they are. The hardware prefetcher
# cannot guess where the next block lies (scattering blocks is the point of paging), so the kernel asks for it
# while it reads the current one.
#
# **Prefill.** A prefill chunk attends many query tokens of one sequence, each to its own prefix: chapter 05's
# FlashAttention loop. A GPU gives each query row of a tile its own thread. A CPU core has vector lanes instead,
# so `paged_chunk` puts 16 query rows in them: one vector holds one key's score for 16 rows, and the running
# max, the rescaling and the running sum of the online softmax are lane-wise arithmetic, with no sum across
# lanes. Keys and values stream past 16 positions at a time, read where the block table says, and the cores
# share the work by (KV head, tile of 16 query rows). With AVX2 a tile of 16 rows is two 8-lane vectors, so each
# key or value loaded feeds two multiply-adds, and the sums are taken a few columns at a time to stay in AVX2's
# 16 registers (AVX-512 has 32). The kernel is compiled on this machine for its instruction set, as a GPU
# kernel's tiles are chosen for its GPU.
#
# The engine times each kernel against the PyTorch path for each range of batch and context sizes it meets, and
# keeps the faster. Here is the prefill kernel against SDPA on causal attention for one SmolLM2 layer (9 query heads
# sharing 3 KV heads), SDPA given keys and values already side by side, so that no copy counts against it:

# %%
from mini_engine.backends.cpu import cpu_kernels


def best_ms(fn, repeats=3):
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


chunk_rows = []
for n in (256, 1024):
    q = torch.randn(1, n, cfg.num_heads, cfg.head_dim)
    k_pool, v_pool = (torch.randn(n // 16, 16, cfg.num_kv_heads, cfg.head_dim) for _ in range(2))
    if not cpu_kernels.paged_decode_supported(q, k_pool, v_pool):
        print("skipped: the C kernels need a C compiler and a CPU they build for (or MINI_ENGINE_C_KERNELS=0)")
        break
    table = torch.randperm(n // 16, dtype=torch.int32)[None]  # blocks anywhere in the pool, as in a server
    visible = torch.arange(1, n + 1, dtype=torch.int32)[None]  # causal: token j sees positions 0..j
    k, v = (pool[table[0].long()].flatten(0, 1).transpose(0, 1)[None] for pool in (k_pool, v_pool))

    def kernel():
        return cpu_kernels.paged_chunk(q, k_pool, v_pool, table, visible)

    def sdpa():
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2)
    error = (kernel() - sdpa()).abs().max().item()
    chunk_rows.append((n, best_ms(sdpa), best_ms(kernel), error))
for n, t_sdpa, t_kernel, error in chunk_rows:
    print(f"N = {n:5d}: SDPA {t_sdpa:6.2f} ms, paged_chunk {t_kernel:6.2f} ms ({t_sdpa / t_kernel:.1f}x), "
          f"largest difference {error:.1e}")

# %% [markdown]
# Same FLOPs, same online softmax, and a different speed: the loop's layout decides how much of the core it
# uses. Where the kernel loses, the engine's timing keeps SDPA.
#
# ## 5. The small operations between the products
#
# Around its four weight products a layer does a dozen small operations: two RMSNorms, the rotary embedding of
# queries and keys, SiLU times up, the cache write, the residual adds. At a decode step's few rows each is nearly
# all dispatch and no arithmetic: a few microseconds of Python and of PyTorch's dispatcher, and PyTorch makes
# two to six operators of some of them. The weight products between them also push the dispatcher's own code
# and data out of the caches, so each call pays to bring them back. In eager float32 steps the backend runs the
# norms, the rotary embedding, SiLU times up and the cache write as one fused C operator each, as vLLM's
# `rms_norm` and `silu_and_mul` kernels do on a GPU. A compiled step (chapter 03) keeps PyTorch's operations instead: `torch.compile` fuses them itself, and
# better, together with their neighbours.
#
# ## 6. Quantized weights on a CPU
#
# PyTorch's int4 CPU kernel (chapter 10) takes bfloat16 activations and turns each tile of codes back into
# numbers again for every few rows of activations: right at one row, wasteful at 16, where a step is already
# compute-bound. (The course's Triton kernel for a GPU, `mini_engine/kernels/quant_matmul.py`, turns a tile
# back once for 16 to 64 rows, and a GPU's step of 16 rows is memory-bound anyway.) The backend adds int4 and int8 kernels of its own that keep float32 activations and read the
# same codes (on x86 CPUs with AVX2); they also run the 8-bit scales of chapter 10's optional section without
# first turning the weights back into floats. On Intel CPUs with AMX, a second pair turns each weight into bfloat16 once and feeds it
# to the tiles, 16 rows of activations per instruction: the arithmetic then costs so little that int4 is again
# limited by the weights' bytes at batch 16, as on a GPU. A compiled decode step calls all of them as C++
# operators registered with PyTorch, so it runs no Python at all.
#
# ## 7. Threads, and how the kernels are built
#
# PyTorch's OpenMP runtime keeps a team of worker threads that spin for a while after each parallel region, so
# that the next of a step's hundred-odd short products does not have to wake them. It keeps one team for each
# thread that runs parallel work. The first version of the course's server (chapter 09) loaded the model on the
# main thread and stepped the engine on a second one: two teams, on a machine whose cores one team already
# fills. The runtime then stops spinning between regions, every product waits for its workers to be woken, and
# the server streamed about a quarter fewer tokens per second than offline generation with the same engine,
# with nothing busy on the HTTP side. Stepping the engine on the thread that loaded the model fixed it.
#
# The C kernels are compiled on first use by the machine's C compiler, for this CPU (`-march=native`), and
# cached in `~/.cache/mini_engine`. They are linked against the OpenMP runtime PyTorch has already loaded, so
# their threads are PyTorch's threads: one team. They are compiled with `-ffast-math`, which lets the compiler
# vectorise `exp` and reorder sums, but never linked with it: linking with it would switch the whole process to
# flushing tiny numbers to zero, and every PyTorch operation after that would change its results.
# `MINI_ENGINE_C_KERNELS=0` turns the kernels off, and `MINI_ENGINE_FORMS="product=linear"` pins a form, which
# is how a benchmark times one form against another.
#
# ## What you measured

# %%
n_big, t_sdpa, t_kernel, _ = chunk_rows[-1] if chunk_rows else (1024, float("nan"), float("nan"), 0)
summary = [
    ("CPU", f"{info.model}, {info.cores} cores"),
    ("vector extensions, widest float32 vector", f"{', '.join(info.isa) or 'none'}; {lanes} lanes"),
    ("matmul, memory bandwidth, ridge point",
     f"{ceil.peak_flops / 1e9:.0f} GFLOP/s, {ceil.peak_bw / 1e9:.1f} GB/s, {ceil.ridge_point:.1f} FLOP/byte"),
    ("product forms for 1 and 16 rows: decided in", f"{tune_s:.1f} s"),
    *((f"forms chosen for {rows} row{'s' * (rows > 1)} (count of weight shapes)",
       ", ".join(f"{form} {count}" for form, count in c.most_common()) or "none (backend off)")
      for rows, c in chosen.items()),
    *((f"weight products alone, batch {b}: chosen forms / F.linear",
       f"{ours:.1f} / {plain:.1f} tok/s ({ours / plain:.2f}x)") for b, (ours, plain) in floors.items()),
    (f"causal prefill attention, N = {n_big}: SDPA / paged_chunk",
     f"{t_sdpa:.2f} / {t_kernel:.2f} ms ({t_sdpa / t_kernel:.1f}x)" if chunk_rows else "not run here"),
]
width = max(len(k) for k, _ in summary)
for k, v in summary:
    print(f"{k:<{width}}  {v}")

# %% [markdown]
# ## Exercise: predict, then run
#
# **In cache or from memory.** Time `F.linear` for one row against the first layer's gate-and-up weight
# (3,072 × 576 float32 numbers, about 7 MB) in two ways: the same weight again and again, and 32 copies of it in
# turn, so that each call must fetch its weight from main memory, as a decode step does. Which is faster, and
# by how much? Which of the two should the tuner time?

# %%
w = model.layers[0].mlp.gate_up_proj.weight.detach()
x1 = torch.randn(1, w.shape[1])
copies = w.expand(32, *w.shape).clone()  # 32 copies, about 226 MB: more than any cache


def per_call_us(weights, repeats=5):
    """Best time of one F.linear call, over `repeats` passes through `weights`, in microseconds."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for weight in weights:
            F.linear(x1, weight)
        best = min(best, (time.perf_counter() - t0) / len(weights))
    return best * 1e6


per_call_us([w] * 4)  # warm-up
hot, cold = per_call_us([w] * 32), per_call_us(list(copies))
print(f"the same weight every call: {hot:7.1f} us ({w.nbytes / hot / 1e3:5.1f} GB/s of weight read)")
print(f"32 copies in turn:          {cold:7.1f} us ({w.nbytes / cold / 1e3:5.1f} GB/s); "
      f"memory copy bandwidth measured above: {ceil.peak_bw / 1e9:.1f} GB/s")
print(f"from memory / in cache: {cold / hot:.1f}x")
del copies

# %% [markdown]
# <details><summary>Answer</summary>
#
# A one-row product does two FLOPs for every four-byte weight, so it runs at the speed its weight arrives. Where
# the weight fits in this CPU's caches, calling it again and again reads it from cache, which is faster than
# main memory; the copies force a trip to memory every time, and the rate they reach is close to the memory
# bandwidth measured in section 1. Where the last-level cache is smaller than the weight, both ways stream from
# memory and the two times are close. A decode step meets every weight once, cold, so the tuner times its
# candidates on copies: timed hot, forms that do extra work on the weight at every call would look cheaper than
# they are, and the choices would lose on the model.
# </details>
#
# **Back to the course.** This appendix has no lab; each chapter's numbers on a CPU already include what it
# describes.
