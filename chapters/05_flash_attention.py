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
# # 05 · FlashAttention
#
# Attention as written, `softmax(Q Kᵀ / √d) V`, builds an N × N matrix of scores for every head, keeps
# it in memory while the softmax runs over each row, then multiplies it by V and throws it away. Only
# the N × d output survives. FlashAttention (Dao, Fu, Ermon, Rudra and Ré, 2022) computes the same output
# without ever storing that matrix: it walks over K and V in tiles that fit in on-chip memory and merges each
# tile into a running answer with an *online softmax* (Milakov and Gimelshein, 2018, "Online normalizer
# calculation for softmax").
#
# Same FLOPs, same result (to rounding), but O(N) extra memory instead of O(N²), and far fewer trips
# to slow memory. This chapter:
#
# 1. measures how the naive N × N scores grow;
# 2. derives the online softmax step by step in NumPy, with a slider to watch it converge;
# 3. reads the Triton kernel in `mini_engine/kernels/flash_attention.py` block by block and checks it
#    against the materialised reference;
# 4. uses the same online softmax for decode: Flash Decoding splits one query's long context over the
#    whole GPU and merges the pieces exactly;
# 5. times it: against naive attention and PyTorch's SDPA on a GPU; on a CPU, SDPA against naive.
#
# An aside after section 3 says what FlashAttention-2 changed, and exercises close the chapter. What the
# kernel becomes on each GPU (its instructions, registers and shared memory) is the subject of the optional
# appendix [A2](A2_triton_to_gpu_instructions.ipynb).
#
# **What needs a GPU.** Two measurements in this chapter only mean something on a GPU: the allocator's
# *peak* memory of naive attention against the kernel (section 1), and the kernel's speed in TFLOP/s
# against SDPA and naive attention (section 5). Without a GPU, Triton's interpreter runs the kernel as
# NumPy: the results are exact, the timings are not the kernel's. On a CPU the chapter shows, in their
# place, what the interpreter does measure: the memory the kernel allocates, its correctness, and what
# one interpreted call costs. Everything else (the sizes, the online softmax, the correctness checks and
# Flash Decoding's merge) runs the same everywhere. The next cell says which case this is.

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
import os

import torch

# Without a GPU, Triton kernels run in Triton's interpreter (NumPy underneath). Triton reads this
# variable when a kernel is defined, so it must be set before the kernel module is imported.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import importlib
import inspect

import matplotlib.pyplot as plt
import numpy as np
import torch.nn.functional as F
from IPython.display import display

from mini_engine import PRESETS
from mini_engine.course.devices import default_device, default_dtype, fitting, pick, sdpa_backend, timed
from mini_engine.course.formulas import human_bytes
from mini_engine.kernels import attention_reference, flash_attention, flash_attention_varlen
from mini_engine.course.online_softmax import online_softmax_states, online_softmax_stepper, softmax_attention

# The kernel module itself (the package's attribute of the same name is the function flash_attention).
fa = importlib.import_module("mini_engine.kernels.flash_attention")

device = default_device()
# The GPU's 16-bit dtype: bf16 from compute capability 8.0 (A100, L4, H100), fp16 below (T4). float32 on a CPU.
dtype = getattr(torch, default_dtype(device))
print(f"device: {device}; Triton kernels {'in the interpreter' if fa.INTERPRETED else 'compiled for the GPU'}")
for what, where in (("peak memory, naive vs kernel (section 1)", "GPU allocator" if device == "cuda" else
                     "needs a GPU; here: torch allocations of an interpreted call instead"),
                    ("kernel TFLOP/s vs SDPA and naive (section 5)", "measured on this GPU" if device == "cuda" else
                     "needs a GPU; here: one interpreted call, timed for scale"),
                    ("kernel vs reference, Flash Decoding's merge", "runs here")):
    print(f"  {what:<50} {where}")

# %% [markdown]
# ## 1. The N × N problem
#
# For one layer and one sequence, naive attention holds `heads × N × N` scores, and the softmax of
# them (another tensor the same size) before multiplying by V. Everything else it keeps (Q, K, V and
# the output) is `heads × N × d`: linear in N. Here are the bytes for the course's model and for a
# Llama-7B-sized layer (32 heads of 128 dims, bf16).

# %%
def score_bytes(heads, n, dtype_bytes):
    """One layer, one sequence: the N x N scores that naive attention materialises."""
    return heads * n * n * dtype_bytes


def linear_bytes(heads, n, head_dim, dtype_bytes):
    """What FlashAttention keeps instead: the output, plus a running max and sum per query (fp32)."""
    return heads * n * (head_dim * dtype_bytes + 2 * 4)


lengths = np.array([2 ** p for p in range(9, 18)])  # 512 ... 131072
fig, ax = plt.subplots(figsize=(7, 4))
for name, dtype_bytes, style in (("smollm2-135m", 4, "-"), ("llama-7b", 2, "--")):
    cfg = PRESETS[name]
    ax.loglog(lengths, score_bytes(cfg.num_heads, lengths, dtype_bytes), "r" + style,
              label=f"{name}: naive scores, O(N²)")
    ax.loglog(lengths, linear_bytes(cfg.num_heads, lengths, cfg.head_dim, dtype_bytes), "b" + style,
              label=f"{name}: FlashAttention, O(N)")
ax.axhline(80 * 2**30, color="gray", lw=0.8)
ax.text(lengths[0], 80 * 2**30 * 1.3, "80 GiB: a whole A100/H100", fontsize=8)
ax.set(xlabel="sequence length N", ylabel="bytes per layer, per sequence",
       title="attention's working memory")
ax.legend(fontsize=8)
plt.show()

llama = PRESETS["llama-7b"]
for n in (4096, 32768, 131072):
    print(f"llama-7b, N = {n:6d}: naive scores {human_bytes(score_bytes(llama.num_heads, n, 2)):>10}   "
          f"flash {human_bytes(linear_bytes(llama.num_heads, n, llama.head_dim, 2)):>10}")

# %% [markdown]
# The textbook the course accompanies (chapter 00) gives its own example, one head at N = 8192 in 2-byte
# numbers (fp16 or bf16): "For a sequence of length N = 8192, that intermediate has 67M entries, occupying
# 134 MB in BF16." Its megabytes are decimal.

# %%
n_book = 8192
print(f"N = {n_book}: N² = {n_book * n_book:,} scores per head (about {n_book * n_book / 1e6:.0f}M); "
      f"at 2 bytes each {score_bytes(1, n_book, 2) / 1e6:.0f} MB = {human_bytes(score_bytes(1, n_book, 2))} per head")
print(f"llama-7b's {llama.num_heads} heads in one layer: {human_bytes(score_bytes(llama.num_heads, n_book, 2))} of scores, "
      f"against {human_bytes(linear_bytes(llama.num_heads, n_book, llama.head_dim, 2))} for what FlashAttention keeps")

# %% [markdown]
# Those are formulas. Now measure: run naive attention step by step on real tensors (the shapes of
# one SmolLM2 layer, 9 heads of 64 dims) and record the size of every intermediate it allocates: the
# scores, the causal mask, the masked scores and their softmax (three fp32 N × N tensors per head).
# The kernel, in contrast, allocates its output and nothing else.

# %%
def naive_attention_traced(q, k, v):
    """Causal attention the textbook way; returns the output and the bytes of each intermediate."""
    n = q.shape[-2]
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    masked = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(masked, dim=-1)
    out = probs @ v
    sizes = {name: t.element_size() * t.nelement() for name, t in
             (("scores", scores), ("mask", mask), ("masked", masked), ("probs", probs))}
    return out, sizes


smol = PRESETS["smollm2-135m"]
mem_rows = []
# On a GPU the largest N may not fit: three fp32 N x N tensors per head and the mask. Left out, with the reason.
for n in fitting(pick(cpu=[256, 512, 1024, 2048], gpu=[1024, 2048, 4096, 8192], device=device),
                 lambda n: 3 * score_bytes(smol.num_heads, n, 4) + n * n, device, "N"):
    q, k, v = (torch.randn(1, smol.num_heads, n, smol.head_dim, device=device) for _ in range(3))
    out, sizes = naive_attention_traced(q, k, v)
    mem_rows.append((n, sum(sizes.values()), sizes["scores"], out.element_size() * out.nelement()))
    print(f"N = {n:5d}: naive intermediates {human_bytes(mem_rows[-1][1]):>10} "
          f"(scores alone {human_bytes(sizes['scores']):>10}, = 9·N²·4 B: "
          f"{sizes['scores'] == score_bytes(smol.num_heads, n, 4)});  output {human_bytes(mem_rows[-1][3]):>9}")
del q, k, v, out

# %% [markdown]
# On a GPU we can also ask the allocator for its peak, which counts everything, not only what we
# chose to record. On a CPU PyTorch keeps no such counter, so the tensor sizes above are the measurement.

# %%
peak_rows = []
if device == "cuda":
    def naive_bytes(n):
        """Naive attention in `dtype` holds up to three heads x N x N tensors at once (the scores beside their
        masked copy and its softmax) and two boolean N x N masks: about 14 GiB at N = 16384, more than a T4 has."""
        return 3 * score_bytes(smol.num_heads, n, dtype.itemsize) + 2 * n * n

    def peak_memory(fn):
        """Bytes the allocator's peak rose by while fn() ran."""
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    sizes = [2048, 4096, 8192, 16384]
    naive_sizes = fitting(sizes, naive_bytes, device, "N (naive attention)")  # the kernel itself needs O(N)
    for n in sizes:
        q, k, v = (torch.randn(1, smol.num_heads, n, smol.head_dim, device=device, dtype=dtype) for _ in range(3))
        naive = peak_memory(lambda: attention_reference(q, k, v, True, upcast=False)) if n in naive_sizes else None
        peaks = [naive, peak_memory(lambda: flash_attention(q, k, v))]
        peak_rows.append((n, *peaks))
        naive_peak = "skipped" if peaks[0] is None else human_bytes(peaks[0])
        print(f"N = {n:5d}: peak extra memory naive {naive_peak:>10}   flash {human_bytes(peaks[1]):>10}")
        del q, k, v
else:
    # No GPU allocator to ask. The profiler still records every torch allocation on the CPU: the kernel's
    # tiles live in the interpreter's NumPy arrays (tile-sized), its outputs in torch tensors.
    from torch.profiler import ProfilerActivity, profile

    print("no GPU: the allocator's peak needs one. Instead, the torch memory each call allocates on this CPU "
          "(the kernel in Triton's interpreter), one head of 64 dims:")
    for n in (128, 256):
        q, k, v = (torch.randn(1, 1, n, 64) for _ in range(3))
        allocated = []
        for fn in (lambda: attention_reference(q, k, v, True, upcast=False), lambda: flash_attention(q, k, v)):
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                fn()
            allocated.append(sum(e.self_cpu_memory_usage for e in prof.key_averages() if e.self_cpu_memory_usage > 0))
        peak_rows.append((n, *allocated))
        print(f"N = {n:4d}: naive allocates {human_bytes(allocated[0]):>10}, the kernel {human_bytes(allocated[1]):>10} "
              f"(its output alone: {human_bytes(q.nelement() * 4)})")
    print(f"doubling N: naive x{peak_rows[1][1] / peak_rows[0][1]:.1f}, kernel x{peak_rows[1][2] / peak_rows[0][2]:.1f}")
    del q, k, v

# %%
fig, ax = plt.subplots(figsize=(6, 3.6))
ns = np.array([r[0] for r in mem_rows])
ax.loglog(ns, [r[1] for r in mem_rows], "ro", label="naive: measured intermediates")
ax.loglog(ns, [r[3] for r in mem_rows], "bs", label="output (all the kernel allocates)")
ax.loglog(ns, 3 * score_bytes(smol.num_heads, ns, 4) + ns ** 2, "r:", label="3 · heads · N² · 4 B + N² (mask)")
ax.loglog(ns, smol.num_heads * ns * smol.head_dim * 4.0, "b:", label="heads · N · d · 4 B")
if peak_rows:
    how = "GPU peak" if device == "cuda" else "allocated (interpreter)"
    ax.loglog([r[0] for r in peak_rows if r[1]], [r[1] for r in peak_rows if r[1]], "r^", label=f"naive: {how}")
    ax.loglog([r[0] for r in peak_rows], [r[2] for r in peak_rows], "b^", label=f"flash: {how}")
ax.set_xscale("log", base=2)
ax.set(xlabel="N", ylabel="bytes", title="one layer of SmolLM2: measured")
ax.legend(fontsize=8)
plt.show()
print(f"doubling N from {ns[-2]} to {ns[-1]}: naive intermediates x{mem_rows[-1][1] / mem_rows[-2][1]:.1f}, "
      f"output x{mem_rows[-1][3] / mem_rows[-2][3]:.1f}")

# %% [markdown]
# ### Where the bytes go: SRAM tiles and HBM traffic
#
# Memory size is half the story; the other half is traffic. A GPU keeps its big tensors in device memory
# (tens of GB: HBM on a data-centre GPU such as the A100 or H100, at a few TB/s; GDDR6 on a T4 or L4, at about
# 300 GB/s) and computes out of on-chip SRAM (shared memory and registers: a few hundred KB per
# multiprocessor, an order of magnitude faster). This chapter, like the FlashAttention paper, calls device
# memory HBM; on a T4 or L4, read GDDR6. Naive attention sends the N × N scores S and probabilities P through
# HBM: written, read back, written again, read again. The tiled kernel
# keeps a Q tile in SRAM, streams K and V tiles past it, and the only score tile that ever exists is the
# `BLOCK_M × BLOCK_N` one in registers. `formulas.attention_hbm_bytes` counts both, per head:

# %%
from mini_engine.course.formulas import attention_hbm_bytes

fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1.15, 1]})
rect = lambda ax, x, y, w, h, color, text, **kw: (ax.add_patch(plt.Rectangle((x, y), w, h, color=color, alpha=0.55, **kw)),
                                                 ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8))
left.add_patch(plt.Rectangle((0, 0), 10, 6.2, fill=False, lw=1.5))
left.text(0.2, 5.85, "HBM (device memory)", fontsize=9, weight="bold")
for i, name in enumerate("QKVO"):
    rect(left, 0.4 + i * 1.0, 0.5, 0.6, 4.8, "C0" if name != "O" else "C2", f"{name}\nN×d")
rect(left, 4.6, 2.6, 2.4, 2.6, "C3", "S = QKᵀ\nN×N\n(naive only)")
rect(left, 7.3, 2.6, 2.4, 2.6, "C3", "P = softmax(S)\nN×N\n(naive only)")
left.add_patch(plt.Rectangle((4.6, 0.3), 5.1, 1.9, fill=False, lw=1.5, ls="--"))
left.text(4.75, 1.9, "SRAM (on chip), one program", fontsize=8, weight="bold")
rect(left, 4.8, 0.45, 1.0, 1.0, "C0", "Q tile")
rect(left, 6.0, 0.45, 0.7, 1.0, "C1", "K, V\ntile")
rect(left, 6.9, 0.45, 1.0, 1.0, "C3", "S tile")
rect(left, 8.1, 0.45, 1.4, 1.0, "C2", "acc, m, l")
left.annotate("", xy=(4.8, 1.0), xytext=(0.7, 0.8), arrowprops=dict(arrowstyle="->", color="C0"))
left.annotate("", xy=(6.3, 1.45), xytext=(1.7, 3.0), arrowprops=dict(arrowstyle="->", color="C1"))
left.text(2.4, 1.05, "read once", fontsize=7, color="C0")
left.text(2.9, 2.15, "streamed past each\nQ tile, tile by tile", fontsize=7, color="C1")
left.set(xlim=(-0.1, 10.1), ylim=(-0.1, 6.3), xticks=[], yticks=[], title="What lives where")
n_axis = np.array([2 ** p for p in range(9, 16)])
for d, style in ((64, "-"), (128, "--")):
    right.loglog(n_axis, attention_hbm_bytes(n_axis, d, 2), "r" + style, label=f"naive, d = {d}")
    right.loglog(n_axis, attention_hbm_bytes(n_axis, d, 2, block_m=128), "b" + style, label=f"tiled, BLOCK_M = 128, d = {d}")
right.set_xscale("log", base=2)
right.set(xlabel="N", ylabel="bytes moved per head (fp16)", title="HBM traffic of one head")
right.legend(fontsize=8)
plt.tight_layout()
plt.show()
for d in (64, 128):
    naive_b, tiled_b = attention_hbm_bytes(n_book, d, 2), attention_hbm_bytes(n_book, d, 2, block_m=128)
    print(f"N = {n_book}, d = {d}: naive {human_bytes(naive_b)}, tiled {human_bytes(tiled_b)} per head "
          f"({naive_b / tiled_b:.1f}x less traffic)")

# %% [markdown]
# Both curves grow as N², because every query still meets every key. The tiled kernel's N² term is
# K and V read once per query tile, so it shrinks as tiles grow and as `d` shrinks relative to the tile;
# the naive one carries four N × N passes whatever the tile. What the picture does not show is that the
# naive kernel's traffic also comes in separate launches (a matmul, a softmax, another matmul), each of
# which waits on HBM, where the fused kernel overlaps its loads with its tensor-core work.

# %% [markdown]
# ## 2. Online softmax, step by step
#
# Take one query. Its output is a weighted average of the value rows, with weights
# `softmax(s)`, where `s` holds its N scores:
#
# $$o = \frac{\sum_j e^{s_j - m}\, v_j}{\sum_j e^{s_j - m}}, \qquad m = \max_j s_j .$$
#
# Subtracting the max `m` keeps `exp` from overflowing and does not change the ratio. It also seems to
# force us to see *every* score before computing anything. It does not. Split the keys into tiles and
# keep three running quantities: the max so far `m`, the denominator so far `l`, the numerator so far
# `acc`. When a new tile arrives with a larger max `m'`, everything accumulated so far was computed
# relative to the old `m`; multiplying it by `exp(m − m')` re-expresses it relative to `m'`:
#
# $$m' = \max(m, \max_{j \in \text{tile}} s_j), \quad
#   l' = l\,e^{m - m'} + \sum_{j \in \text{tile}} e^{s_j - m'}, \quad
#   acc' = acc\,e^{m - m'} + \sum_{j \in \text{tile}} e^{s_j - m'} v_j .$$
#
# After any number of tiles, `acc / l` is the exact attention output over the keys seen so far. The running
# max and denominator are Milakov and Gimelshein's online softmax (2018), which computes softmax's
# normaliser in one pass over the scores instead of two; FlashAttention carries the numerator `acc` along
# with them, so the output needs no second pass either. Check that with two tiles by hand first.

# %%
rng = np.random.default_rng(0)
s = rng.normal(scale=2.0, size=8)
V = rng.normal(size=(8, 3))

# Tile 1: keys 0-3. Nothing to rescale yet.
m1 = s[:4].max()
l1 = np.exp(s[:4] - m1).sum()
acc1 = np.exp(s[:4] - m1) @ V[:4]
print("after tile 1:", acc1 / l1, " exact over keys 0-3:", softmax_attention(s[:4], V[:4]))

# Tile 2: keys 4-7. Raise the max if needed, shrink the old sums to match, add the new tile.
m2 = max(m1, s[4:].max())
l2 = l1 * np.exp(m1 - m2) + np.exp(s[4:] - m2).sum()
acc2 = acc1 * np.exp(m1 - m2) + np.exp(s[4:] - m2) @ V[4:]
print("after tile 2:", acc2 / l2, " exact over all keys:", softmax_attention(s, V))
print(f"max moved from {m1:.3f} to {m2:.3f}: old sums were scaled by exp(m1 - m2) = {np.exp(m1 - m2):.3f}")

# %% [markdown]
# `mini_engine.course.online_softmax` runs the same recurrence for any number of tiles and yields the state
# after each one. Every intermediate state is the exact answer for its prefix; the last one is the
# exact answer, full stop.

# %%
n, tile = 48, 8
scores = rng.normal(scale=2.0, size=n)
values = rng.normal(size=(n, 6))
exact = softmax_attention(scores, values)
print(f"{'tiles':>5} {'keys seen':>9} {'m':>7} {'l':>8} {'|acc/l - exact(prefix)|':>24} {'|acc/l - exact(all)|':>21}")
for st in online_softmax_states(scores, values, tile):
    prefix_error = np.abs(st.output - softmax_attention(scores[:st.seen], values[:st.seen])).max()
    print(f"{st.tiles:5d} {st.seen:9d} {float(st.m):7.3f} {float(st.l):8.3f} {prefix_error:24.1e} "
          f"{np.abs(st.output - exact).max():21.3f}")
online_error = np.abs(st.output - exact).max()

# %% [markdown]
# Step through it: the slider picks how many tiles have been read. Watch the running max jump when a
# tile holds a larger score (the old part of `l` is then scaled down by `exp(m − m')` before the new
# terms are added), and the bars of the running output settle on the exact answer (the black marks)
# at the last tile.

# %%
display(online_softmax_stepper(n=48, tile=8))

# %% [markdown]
# ## 3. The Triton kernel, block by block
#
# The kernel in `mini_engine/kernels/flash_attention.py` runs that recurrence for a whole tile of
# queries at once. The launch grid has one program per (tile of `BLOCK_M` queries, query head,
# sequence). Each program:
#
# 1. loads its `BLOCK_M × d` tile of Q once, and keeps it on chip for the whole loop;
# 2. loops over K and V in tiles of `BLOCK_N` keys: one `tl.dot` for the scores, the online-softmax
#    update, a second `tl.dot` to add `p · V` into the fp32 accumulator;
# 3. divides by `l` and writes its `BLOCK_M × d` output tile. No N × N tensor is ever stored.
#
# Here is the loop body:

# %%
# `.fn` is the Python function under the @triton.jit decorator (compiled or interpreted).
print(inspect.getsource(fa._attn_fwd_inner.fn))

# %% [markdown]
# A few things to notice:
#
# - `exp2` instead of `exp`: the scores are pre-multiplied by `log2(e)`, so `2^x` equals the `e^y` we
#   want, and `exp2` is a single GPU instruction.
# - `MASKED` is a compile-time constant. The program calls the loop twice: first over tiles that every
#   query in its tile may fully see (no mask work at all), then over the few tiles that cross the causal
#   diagonal or the end of the sequence. Tiles wholly above the diagonal are never loaded.
# - `p` is cast back to fp16/bf16 before the second product, so both products run on tensor cores,
#   while `acc`, `l` and `m` stay fp32.
#
# And the program around the loop: where its queries start, the GQA head mapping (`off_h // group_size`:
# K and V are never copied per query head), the two loop ranges, and the final division.

# %%
source = inspect.getsource(fa._attn_fwd.fn)
print(source[source.index("    start_m = "):])

# %% [markdown]
# The wrapper picks tile sizes per GPU (appendix [A2](A2_triton_to_gpu_instructions.ipynb) shows what it
# picks on a T4, an A100 and an H100, and why). In the interpreter they are small, 16 × 16, which keeps the
# short test sequences spread over several tiles.

# %%
print("interpreter:", fa.launch_config(64, torch.float32, None))

# %% [markdown]
# ### Is it right?
#
# Compare with `attention_reference`, which materialises the scores in fp32, at lengths that are not
# multiples of the tile size, with grouped-query heads, with more keys than queries (a prefill chunk
# that continues a cached context: the queries are the *last* positions), and in bf16. On a CPU this
# runs in the interpreter, so the shapes stay small; on a GPU they are real.

# %%
checks = [
    # batch, q heads, kv heads, Nq, Nk, head_dim, causal, dtype
    (1, 4, 4, 100, 100, 64, True, torch.float32),
    (1, 9, 3, 77, 77, 64, True, torch.float32),       # SmolLM2's 9 query heads on 3 KV heads
    (1, 4, 1, 17, 120, 32, True, torch.float32),      # 17 new tokens after 103 cached ones
    (2, 4, 2, 50, 70, 32, False, torch.float32),
    (1, 4, 2, 64, 64, 64, True, torch.bfloat16),
]
if device == "cuda":
    checks = [(b, hq, hkv, nq * 40, nk * 40, d, c, dtype) for b, hq, hkv, nq, nk, d, c, _ in checks]
print(f"{'B':>2} {'Hq/Hkv':>7} {'Nq':>5} {'Nk':>5} {'D':>4} {'causal':>6} {'dtype':>9} "
      f"{'max |kernel - reference|':>25}")
kernel_errors = []
for b, hq, hkv, nq, nk, d, causal, dt in checks:
    error = fa.max_error_vs_reference(b, hq, hkv, nq, nk, d, causal, dt, device)
    kernel_errors.append((dt, error))
    print(f"{b:2d} {f'{hq}/{hkv}':>7} {nq:5d} {nk:5d} {d:4d} {str(causal):>6} {str(dt)[6:]:>9} {error:25.1e}")

# %% [markdown]
# The engine's prefill does not pad: it packs the new tokens of every sequence back to back and
# calls `flash_attention_varlen` with cumulative lengths. Each sequence gets its own bottom-right
# causal mask over its own keys.

# %%
q_lens, k_lens = [5, 1, 40], [5, 30, 64]  # a fresh prompt, one decode-like token, a chunk after 24 cached
gen = torch.Generator().manual_seed(0)
q = torch.randn(sum(q_lens), 9, 64, generator=gen).to(device)
k, v = (torch.randn(sum(k_lens), 3, 64, generator=gen).to(device) for _ in range(2))
cu_q = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32, device=device)
cu_k = torch.tensor([0, *np.cumsum(k_lens)], dtype=torch.int32, device=device)
packed_out = flash_attention_varlen(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), causal=True)
varlen_error = (packed_out - fa.attention_reference_varlen(q, k, v, cu_q, cu_k, causal=True)).abs().max().item()
print(f"packed prefill of {len(q_lens)} sequences, {sum(q_lens)} query tokens: max error {varlen_error:.1e}")

# %% [markdown]
# ### Aside: what FlashAttention-2 changed
#
# FlashAttention-2 (Dao, 2023) keeps the tiles and the online softmax and reorganises the work around
# them; the textbook credits it with "roughly another 2× on top of FA-1", the first version. Three changes
# matter. First, fewer operations that are not matrix products: version 1 rescaled its output tile by the running
# denominator after every K/V tile, version 2 keeps the accumulator unnormalised and divides by `l` once
# at the end (our kernel's final division above). On a GPU whose tensor cores do matrix products an
# order of magnitude faster than anything else, every non-matmul operation in the inner loop is
# expensive. Second, more parallelism: version 1 gave each (sequence, head) one thread block, which left
# most of the GPU idle when a long sequence came with a small batch; version 2 also splits the queries
# into tiles, one program each, as our launch grid does (query tile, head, sequence). Third, the split
# of work inside a program: version 1 divided K and V among the warps, so the warps had to merge their
# partial softmax results through shared memory; version 2 divides the *queries* among warps, so each
# warp finishes its own rows without talking to the others. For causal attention it also skips tiles
# that lie wholly above the diagonal, as our kernel's two loop ranges do.

# %% [markdown]
# ### From Python to the GPU
#
# On a GPU, Triton compiles this Python into the GPU's own instructions, and the tile sizes decide what the
# compiled program needs. Every K/V tile loaded is reused by `BLOCK_M` queries, so larger tiles move fewer
# bytes; but a tile's running state must fit in the registers and shared memory the chip gives one program,
# and those limits differ from one GPU to the next. The optional appendix
# [A2](A2_triton_to_gpu_instructions.ipynb) compiles this kernel for a T4, an A100 and an H100 on any machine,
# reads the instructions its loop becomes on each (asynchronous copies, tensor-core products, a hardware
# `exp2`), and shows what happens when a tile asks for more registers than a thread has.

# %% [markdown]
# ## 4. Flash Decoding: one query, a long context
#
# Everything so far had many queries, a prompt's worth. A decode step (chapter 02) brings one new query per
# sequence, which attends to every key in the cache. The launch grid then has a single tile of queries per
# head and sequence, so one program each. A GPU runs programs on its *streaming multiprocessors* (SMs):
# dozens of independent processors, each with its own registers and shared memory, each running the programs
# it is given. At batch 1, SmolLM2's decode attention is 9 programs, one per query head (the engine's decode
# kernel, which chapter 07 reads, even gives the 3 query heads that share a KV head a single program: 3). An
# A100 has 108 SMs. Each of the few programs walks the whole context alone while most of the chip waits, and
# the longer the context, the longer they walk: decode attention reads the most exactly when it uses the chip
# the least.
#
# **Flash Decoding** (Dao, Haziza, Massa and Sizov, 2023) splits the keys and values as well. Each chunk of the
# context becomes a program of its own, which runs section 2's recurrence over its chunk from an empty state
# and writes out the state it ends with: its running max `m`, its sum `l` and its numerator `acc`. No chunk
# waits for another. A short second pass merges the chunks with section 2's rescaling: bring every chunk's `l`
# and `acc` to the largest `m` by the factor `exp(m_chunk − m_all)`, then add. The answer is exact; only the
# order of the additions changes. Matrix-multiply libraries know the same move as *split-K*: when the dimension
# being summed over is long and the others are short, split the sum among programs and add up their partial
# results at the end. The textbook lists Flash Decoding among the decode optimisations, which "target memory
# bandwidth and unused compute": this is the unused compute.
#
# Here it is for one decode step of one SmolLM2 KV head: its 3 query heads (one row of scores each) against
# 4,096 cached keys, in 8 chunks, each chunk's state computed on its own:

# %%
fd_rng = np.random.default_rng(1)
fd_context, fd_chunk = 4096, 512
group = smol.num_heads // smol.num_kv_heads  # query heads that read the same KV head
fd_scores = fd_rng.normal(scale=2.0, size=(group, fd_context))  # one query per head: one row of scores each
fd_values = fd_rng.normal(size=(fd_context, smol.head_dim))

# Pass 1: one work unit per chunk, each from an empty state. On a GPU they would all run at once.
partials = [list(online_softmax_states(fd_scores[:, a:a + fd_chunk], fd_values[a:a + fd_chunk], tile=64))[-1]
            for a in range(0, fd_context, fd_chunk)]
# Pass 2: every chunk's sums brought to the largest max, then added.
m_all = np.max([p.m for p in partials], axis=0)
l_all = sum(p.l * np.exp(p.m - m_all) for p in partials)
acc_all = sum(p.acc * np.exp(p.m - m_all)[:, None] for p in partials)
fd_chunks = len(partials)
split_error = np.abs(acc_all / l_all[:, None] - softmax_attention(fd_scores, fd_values)).max()
for i, p in enumerate(partials[:3]):
    print(f"chunk {i}: its max per head {np.round(p.m, 2)}, its sums scaled by {np.round(np.exp(p.m - m_all), 3)}")
print(f"...\n{fd_chunks} chunks merged vs one softmax over all {fd_context} keys: max difference {split_error:.1e}")

# %% [markdown]
# How many programs does a decode step give a GPU? One per sequence and KV head, as the engine's kernel
# launches it, against the SMs of three GPUs (`mini_engine.kernels.gpus` describes them), with and without
# splitting each context into 8 chunks:

# %%
from mini_engine.kernels.gpus import A100, H100, T4

fd_batches = [1, 2, 4, 8, 16, 32, 64]
print(f"{'batch':>5} {'programs':>9} {f'in {fd_chunks} chunks':>12}   SMs with work: " +
      "   ".join(f"{g.name.split()[-1]} ({g.num_sms})" for g in (T4, A100, H100)))
for batch in fd_batches:
    units = batch * smol.num_kv_heads
    busy = "   ".join(f"{min(units, g.num_sms):3d} -> {min(units * fd_chunks, g.num_sms):3d}" for g in (T4, A100, H100))
    print(f"{batch:5d} {units:9d} {units * fd_chunks:12d}   {busy}")
state_bytes = group * (smol.head_dim + 2) * 4  # per chunk and KV head: acc, m and l in fp32
chunk_bytes = 2 * fd_chunk * smol.head_dim * 2  # the chunk's keys and values, read once, in bf16
print(f"\nwhat a split costs: each chunk writes {state_bytes} B of state for the {chunk_bytes / 1024:.0f} KiB of keys "
      f"and values it reads ({state_bytes / chunk_bytes:.1%} more traffic), and a second, short launch merges them")
fill_batch = -(-A100.num_sms // smol.num_kv_heads)  # the first batch whose unsplit step has a program per SM
fa_programs = 0.8 * 2 * A100.num_sms  # FlashAttention-2's num_splits_heuristic: 1 split from 80% of 2 per SM
vllm_v2_batch = 512 // smol.num_heads  # vLLM's V2 kernel (past 512 tokens) while seqs × query heads <= 512
print(f"A100: every SM has an unsplit program from batch {fill_batch}; FlashAttention-2 may split below "
      f"{fa_programs:.0f} programs (batch {-(-fa_programs // smol.num_kv_heads) - 1:.0f} and less); vLLM picks its V2 "
      f"kernel for contexts over 512 tokens up to batch {vllm_v2_batch} ({smol.num_heads} query heads)")

fig, ax = plt.subplots(figsize=(6, 3.2))
for chunks, style in ((1, "o-"), (fd_chunks, "s--")):
    ax.plot(fd_batches, [min(b * smol.num_kv_heads * chunks, A100.num_sms) / A100.num_sms for b in fd_batches],
            style, label="one program per sequence and KV head" if chunks == 1 else f"context split in {chunks}")
ax.set(xscale="log", xlabel="decode batch", ylabel="share of the A100's SMs with work",
       title="SmolLM2's decode attention on an A100", ylim=(0, 1.05))
ax.set_xticks(fd_batches, [str(b) for b in fd_batches])
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# At batch 1 the unsplit step gives 3 of the A100's 108 SMs something to do; split in 8, it gives 24, and each
# of them reads an eighth of the context: the step draws on far more of the memory bandwidth than 3 SMs can
# use. The price is small: under a kilobyte of state per chunk against the 128 KiB of keys and values it
# reads, and one short merge. From batch 36 on (3 KV heads each), the unsplit step already has a program for
# every SM of an A100 (the cell's last line), but that does not end the gain: an SM runs several programs at
# once, and more of them hide more of the memory latency. FlashAttention-2's decode path
# (`num_splits_heuristic` in flash-attn's `csrc/flash_attn/flash_api.cpp`) counts two programs per SM and
# considers splitting while the unsplit programs are fewer than 80% of that, about 173 on an A100: up to
# batch 57 of SmolLM2's. So Flash Decoding pays exactly
# where chapter 02 found batching pays least: few sequences, long contexts. vLLM's own paged-attention kernels
# make the same choice: its V2 kernel splits the context into partitions of 512 tokens, and vLLM runs it for
# contexts over 8,192 tokens, and for contexts over 512 whenever sequences × query heads is at most 512 (up to
# batch 56 for SmolLM2's 9 heads), its unsplit V1 kernel otherwise. The course's decode kernel keeps one
# program per sequence and KV head, which is simpler to read. On a CPU the question does not arise in this
# form: a handful of cores is filled by a handful of (sequence, head) pairs.

# %% [markdown]
# ## 5. Speed
#
# On a GPU, naive attention writes the N × N scores to memory, reads them back for the softmax, writes
# the probabilities and reads them again for the product with V: at long N it spends its time moving
# bytes. The fused kernel does the same FLOPs with each Q, K, V tile read once per pass over it. We
# measure TFLOP/s for the three (our kernel, PyTorch's SDPA, and naive) across N. SDPA runs its own
# FlashAttention kernel where the GPU has one (compute capability 8.0 and up), and its memory-efficient
# kernel on older GPUs such as a T4. Expect naive to fall behind as N grows (2–4× is typical) and to outgrow
# the GPU's memory first (a length it cannot hold is skipped, with the reason), and our Triton kernel to land
# within reach of SDPA's hand-tuned CUDA kernel.
# `benchmarks/bench_attention.py` prints the same comparison as a table, across head sizes and dtypes.

# %%
speed_rows = []
if device == "cuda":
    import triton
    from torch.nn.attention import sdpa_kernel

    backend = sdpa_backend(device, dtype)
    print(f"SDPA's kernel on this GPU (compute capability {torch.cuda.get_device_capability()}): {backend.name}")

    def sdpa_tflops(q, k, v):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        seconds = triton.testing.do_bench(run) * 1e-3
        return fa.attention_flops(*q.shape[:3], k.shape[2], q.shape[3], True) / seconds / 1e12

    def batch_for(n):
        return max(1, 2 ** 17 // (16 * n))  # the same number of query tokens in flight at every N

    sizes = [1024, 2048, 4096, 8192, 16384]
    naive_sizes = fitting(sizes, lambda n: 3 * score_bytes(16 * batch_for(n), n, dtype.itemsize) + 2 * n * n,
                          device, "N (naive attention)")
    for n in sizes:
        q, k, v = (torch.randn(batch_for(n), 16, n, 64, device=device, dtype=dtype) for _ in range(3))
        tflops = {"triton": fa.benchmark_tflops("triton", q, k, v, causal=True), "sdpa": sdpa_tflops(q, k, v),
                  "naive": fa.benchmark_tflops("naive", q, k, v, causal=True) if n in naive_sizes else None}
        speed_rows.append((n, tflops))
        print(f"N = {n:5d}: " + "  ".join(f"{p} {'skipped' if t is None else f'{t:6.1f}'}" for p, t in tflops.items())
              + " TFLOP/s")
        del q, k, v
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for provider, style in (("triton", "o-"), ("sdpa", "s-"), ("naive", "^-")):
        points = [(n, t[provider]) for n, t in speed_rows if t[provider] is not None]
        ax.semilogx(*zip(*points), style, base=2, label=provider)
    ax.set(xlabel="N", ylabel="TFLOP/s", title=f"causal attention, head_dim 64, {str(dtype)[6:]}")
    ax.legend()
    plt.show()
else:
    print("No GPU here. Triton's interpreter runs the kernel as NumPy, one program at a time, so timing it "
          "would measure Python, not the kernel. One small call, for scale:")
    q, k, v = (torch.randn(1, 1, 128, 64) for _ in range(3))
    interp_out, interp_s = timed(lambda: flash_attention(q, k, v))
    interp_error = (interp_out - attention_reference(q, k, v, True)).abs().max().item()
    print(f"  interpreter, 1 head x 128 tokens: {interp_s:.2f} s, for about "
          f"{fa.attention_flops(1, 1, 128, 128, 64, True) / 1e6:.0f} MFLOP "
          f"({fa.attention_flops(1, 1, 128, 128, 64, True) / interp_s / 1e9:.2f} GFLOP/s: Python's speed, not the "
          f"kernel's); max error vs the reference {interp_error:.1e}")
    print("  The TFLOP/s plot of this section needs a GPU (on Colab: Runtime > Change runtime type > GPU).")

# %% [markdown]
# What *can* be measured on a CPU is the same contrast between PyTorch's fused CPU kernel
# (`scaled_dot_product_attention`, which on CPU also works tile by tile with an online softmax) and the
# naive version that materialises the scores. Same shapes as one SmolLM2 layer, fp32, causal.

# %%
def best_time(fn, repeats=3):
    return min(timed(fn, device)[1] for _ in range(repeats))


cpu_rows = []
for n in fitting(pick(cpu=[256, 512, 1024, 2048], gpu=[1024, 2048, 4096, 8192], device=device),
                 lambda n: 3 * score_bytes(smol.num_heads, n, 4) + 2 * n * n, device, "N"):
    q, k, v = (torch.randn(1, smol.num_heads, n, smol.head_dim, device=device) for _ in range(3))
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, is_causal=True),
                               attention_reference(q, k, v, True), atol=1e-4, rtol=1e-4)
    t_sdpa = best_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    t_naive = best_time(lambda: attention_reference(q, k, v, True, upcast=False))
    cpu_rows.append((n, t_sdpa, t_naive))
    print(f"N = {n:5d}: SDPA {t_sdpa * 1e3:7.1f} ms   naive {t_naive * 1e3:7.1f} ms   "
          f"naive/SDPA {t_naive / t_sdpa:4.1f}x")

fig, ax = plt.subplots(figsize=(6, 3.6))
ax.loglog([r[0] for r in cpu_rows], [r[1] * 1e3 for r in cpu_rows], "o-", label="SDPA (fused)")
ax.loglog([r[0] for r in cpu_rows], [r[2] * 1e3 for r in cpu_rows], "^-", label="naive (materialised)")
ax.set_xscale("log", base=2)
ax.set(xlabel="N", ylabel="ms", title=f"causal attention on {device}, 9 heads × 64, fp32")
ax.legend()
plt.show()

# %% [markdown]
# The same loop, tiles of keys and values streamed past a running max and a running sum, works on a CPU too.
# The optional appendix [A1](A1_fast_on_a_cpu.ipynb) shows the engine's CPU version of it and measures it.

# %% [markdown]
# ## What you measured

# %%
n_last, naive_bytes, _, out_bytes = mem_rows[-1]
worst = {dt: max(e for d, e in kernel_errors if d == dt) for dt, _ in kernel_errors}
summary = [
    (f"naive intermediates at N = {n_last}", human_bytes(naive_bytes)),
    (f"kernel allocation at N = {n_last}", f"{human_bytes(out_bytes)} (the output)"),
    ("llama-7b scores at N = 131072", human_bytes(score_bytes(llama.num_heads, 131072, 2)) + " per layer"),
    ("online softmax (NumPy) vs exact", f"{online_error:.1e}"),
    *((f"kernel vs reference, {str(dt)[6:]}", f"{e:.1e}") for dt, e in worst.items()),
    ("packed (varlen) prefill vs reference", f"{varlen_error:.1e}"),
    (f"Flash Decoding, {fd_chunks} chunks merged vs one softmax", f"{split_error:.1e}"),
    (f"{device}: naive / SDPA time at N = {cpu_rows[-1][0]}", f"{cpu_rows[-1][2] / cpu_rows[-1][1]:.1f}x"),
]
if speed_rows:
    n_top, top = speed_rows[-1]
    summary.append((f"GPU TFLOP/s at N = {n_top}: ours / SDPA", f"{top['triton']:.0f} / {top['sdpa']:.0f}"))
for name, value in summary:
    print(f"{name:<40} {value}")


# %% [markdown]
# ## Exercises: predict, then run
#
# Write your prediction down before you run each cell; the answer under it says what you should see
# and why. Each cell takes a few seconds.
#
# **1. The tile size of the online softmax.** Run section 2's recurrence over the same 48 scores with
# tiles of 1, 4, 16 and 48 keys. Does the final output depend on the tile size? How many times can the
# running max move?

# %%
for tile_size in (1, 4, 16, 48):
    states = list(online_softmax_states(scores, values, tile_size))
    moves = sum(1 for a, b in zip(states, states[1:]) if b.m != a.m)
    print(f"tile {tile_size:2d}: {len(states):2d} tiles, running max moved {moves:2d} times, "
          f"|output - exact| = {np.abs(states[-1].output - exact).max():.1e}")

# %% [markdown]
# <details><summary>Answer</summary>
#
# The final output is the exact softmax-weighted average for every tile size, up to float rounding: the
# rescaling by `exp(m − m')` makes the order and grouping of the keys irrelevant. The running max can
# move at most once per tile after the first (it moves only when a tile holds a new largest score), so
# small tiles see more moves, and one tile holding everything sees none: that is the ordinary softmax.
# Tile size is a hardware choice (what fits in SRAM and registers), never a numerical one.
# </details>
#
# **2. The engine's attention backend.** The engine takes `attention_backend="naive"` (scores
# materialised, as in section 1) or `"torch"` (PyTorch's fused SDPA). Serve one request with a 512-token
# prompt both ways. Will the tokens match? Which has the shorter time to first token, and does the gap
# stay the same for the decode steps that follow?

# %%
import mini_engine as me
from mini_engine.engine import LLM

backend_model, backend_tok = me.load_model("smollm2-135m", device=device, dtype=me.default_dtype(device))
long_prompt = np.random.default_rng(0).integers(1000, 20000, size=512).tolist()
backend_runs = {}
for backend in ("naive", "torch"):
    backend_llm = LLM.from_model(backend_model, backend_tok, kv_cache="contiguous", max_num_seqs=1, max_model_len=600,
                                 attention_backend=backend)
    backend_llm.generate([long_prompt[:8]], me.SamplingParams(max_tokens=1), use_tqdm=False)  # warm-up
    out = backend_llm.generate([long_prompt], me.SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    backend_runs[backend] = out
    print(f"{backend:>6}: TTFT {out.metrics.ttft_s * 1e3:6.0f} ms, TPOT {out.metrics.tpot_s * 1e3:5.1f} ms, "
          f"tokens {out.token_ids}")
print(f"same tokens: {backend_runs['naive'].token_ids == backend_runs['torch'].token_ids}; TTFT naive / torch: "
      f"{backend_runs['naive'].metrics.ttft_s / backend_runs['torch'].metrics.ttft_s:.1f}x, TPOT: "
      f"{backend_runs['naive'].metrics.tpot_s / backend_runs['torch'].metrics.tpot_s:.1f}x")
del backend_model

# %% [markdown]
# <details><summary>Answer</summary>
#
# The tokens match: both backends compute the same attention, and their float rounding differs far too
# little to swap a greedy choice (only a near-tie between two candidates could flip). The prefill is where they differ:
# 512 queries against 512 keys in 30 layers, for which the naive backend writes and reads the
# 9 × 512 × 512 scores, their mask and their softmax in every layer. A decode step has one query per
# sequence, so its "N × N" matrix is a single row of scores and there is little for a fused kernel to
# save: the decode times are close, and which backend wins there depends on the machine. FlashAttention's
# win is a prefill (and long-context) win. A decode step's cost is reading the weights and the KV cache, once
# each per step, and no arrangement of attention's arithmetic reads fewer of those bytes (section 4's Flash
# Decoding spreads the reads over the whole GPU; it does not shrink them). What does shrink them is fewer bytes
# per cached token (grouped-query attention, chapter 03; narrower numbers, chapter 10) or more tokens served
# by each read (batching, chapter 04; speculative decoding, chapter 06). Chapter 07's paged cache is not among
# them: it reads the same bytes, and what it removes is the memory a contiguous cache reserves for tokens that
# never come, so that more sequences fit in one batch (Kwon et al. 2023, the vLLM paper).
# </details>
#
# **3. A bigger query tile.** In the tiled kernel each query tile reads all of K and V once. At N = 8192
# and d = 128, how does the HBM traffic of one head change when `BLOCK_M` goes from 64 to 128? And
# what would a tile of all 8192 queries move?

# %%
for block in (64, 128, 8192):
    print(f"BLOCK_M = {block:5d}: {human_bytes(attention_hbm_bytes(n_book, 128, 2, block_m=block)):>10} per head "
          f"(naive: {human_bytes(attention_hbm_bytes(n_book, 128, 2))})")

# %% [markdown]
# <details><summary>Answer</summary>
#
# Almost halves: the K and V reads, which dominate, happen once per query tile, and doubling the tile
# halves the number of tiles (Q and O are read and written once either way). A single tile of every
# query would read K and V once, the minimum possible: 4 · N · d numbers. It cannot be done, because the
# tile must fit in registers and shared memory (appendix A2 shows those limits): the kernel's tile sizes are
# the compromise between traffic and what the chip can hold.
# </details>
#
# **4. Why subtract the max?** Add 1000 to every score. Softmax does not change when all scores shift by
# the same amount. What does a softmax *without* the max subtraction return, and what does the online
# softmax return?

# %%
shifted = scores + 1000.0
with np.errstate(over="ignore", invalid="ignore"):
    weights_plain = np.exp(shifted) / np.exp(shifted).sum()
    plain_out = weights_plain @ values
online_out = list(online_softmax_states(shifted, values, tile))[-1].output
print(f"exp(1000 + s) overflows float64: {np.isinf(np.exp(shifted)).all()}; plain softmax output: {plain_out[:3]}")
print(f"online softmax of the shifted scores vs exact of the originals: {np.abs(online_out - exact).max():.1e}")
fp16_max = float(np.finfo(np.float16).max)
print(f"fp16's largest number {fp16_max:,.0f} = exp({np.log(fp16_max):.1f}): a score above that overflows exp in fp16")

# %% [markdown]
# <details><summary>Answer</summary>
#
# `exp(1000)` is larger than any float can hold, so every exponential is `inf` and the ratio `inf / inf`
# is `nan`: the plain formula returns garbage. The online softmax subtracts the running max before
# exponentiating, so its largest exponent is `exp(0) = 1`, and it returns the same output as for the
# unshifted scores. In fp16 the danger starts far sooner, at the modest score the last line prints,
# which is why every attention kernel tracks `m`.
# </details>
#
# **Lab.** [Lab 05](../labs/lab05_notebook.ipynb) has you write the online softmax in NumPy, then the same
# update as the body of a Triton kernel's loop over K/V tiles, checked against the materialised reference.
