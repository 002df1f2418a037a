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
# # A2 · Appendix: from a Triton kernel to GPU instructions (optional)
#
# Chapter 05 wrote FlashAttention as a Triton kernel, a Python function that runs once per tile of queries, and
# checked its answers. This appendix follows that Python down to the instructions a GPU executes, and asks what
# each GPU needs in order to run it. Nothing here changes *what* the kernel computes; it decides how fast the
# kernel can run, and whether it can run at all on a given GPU.
#
# It needs no GPU. Triton can compile for a GPU that is not in the machine, so every cell below runs the same
# on a laptop and on Colab; on a machine with a GPU, that GPU is added to the comparison. This appendix:
#
# 1. says what a GPU's programs run on: warps, registers, shared memory, tensor cores;
# 2. compiles the kernel for a T4, an A100 and an H100 and reads what each one needs;
# 3. reads the instructions the kernel's inner loop became on each of them;
# 4. explains the tile sizes: why larger is better, and what stops them growing.
#
# It runs in about a minute on a 2-core CPU, most of it compiling (a second run reuses Triton's cache).

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
import os
import re

import torch

# Without a GPU, the course runs Triton kernels in Triton's interpreter; it must be chosen before a kernel module is
# imported. Compiling for a named GPU does not use it: `aot` compiles in fresh worker processes.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import importlib

from mini_engine.course.devices import default_device, default_dtype
from mini_engine.kernels import aot
from mini_engine.kernels.gpus import A100, H100, T4, GPUSpec

fa = importlib.import_module("mini_engine.kernels.flash_attention")  # the module, not the function of that name
device = default_device()
dtype = getattr(torch, default_dtype(device))
print(f"device: {device}" + (f" ({torch.cuda.get_device_name(0)}, compiled for it too)" if device == "cuda" else
                             ": the kernel is compiled for three GPUs that are not here"))

# %% [markdown]
# ## 1. What a GPU program runs on
#
# A Triton kernel is written for one *program*, and the launch runs many programs at once (chapter 05's grid:
# one per tile of queries, head and sequence). On an NVIDIA GPU a program is a *block* of threads, run by one of
# the GPU's *streaming multiprocessors* (SMs: 40 on a T4, 108 on an A100, 132 on an H100). Its threads come in
# *warps* of 32 that execute the same instruction together; `num_warps` says how many warps a program has. Three
# resources on an SM decide how a program can be built:
#
# - **Registers**, private to each thread and the fastest storage there is. A thread may hold at most 255 of
#   them (4 bytes each). Values that do not fit are *spilled* to local memory, which is device memory: slow.
# - **Shared memory**, on chip, 64 to 228 KiB per SM depending on the GPU, shared by the threads of a block. The
#   kernel stages its K and V tiles there; how much one block may take is set per GPU.
# - **Tensor cores**, units that multiply small matrix tiles in one instruction, an order of magnitude faster
#   than the ordinary multiply-add units (the "CUDA cores"). Which tile shapes and dtypes they take changes
#   from one GPU generation to the next.
#
# ## 2. What the kernel becomes on each GPU
#
# The wrapper chooses its tiles from a *description* of the GPU (`mini_engine.kernels.gpus.GPUSpec`: compute
# capability, shared memory per block, number of SMs), not from the GPU itself, so we can ask what it would
# launch on GPUs we do not have. Triton then compiles ahead of time for the named GPU: Python → Triton IR →
# PTX (NVIDIA's portable assembly) → `ptxas` (shipped with Triton) → a cubin, the machine code a T4 (sm_75),
# an A100 (sm_80) or an H100 (sm_90) runs. `mini_engine.kernels.aot` does that in worker processes, and reads
# off what each GPU needs to run the kernel: shared memory per block, registers per thread, and bytes spilled.
# CI runs the same check on every kernel of the course (`tests/kernels/test_aot.py`). Below: the dense causal
# kernel in each GPU's serving dtype (fp16 on a T4, which has no bf16; bf16 on the others), at SmolLM2's head
# size (64) and Llama's (128).

# %%
serving = [(T4, torch.float16), (A100, torch.bfloat16), (H100, torch.bfloat16)]
if device == "cuda":
    serving.append((GPUSpec.from_device(0), dtype))  # and the GPU in this machine
jobs = [(spec, gpu, aot.TRITON_DTYPES[dtype]) for gpu, dtype in serving
        for spec in fa.aot_specs(gpu, dtype) if spec.label.startswith("dense")]
# One experiment rides along: the A100 tile at d = 64 with 4 warps instead of the 8 the wrapper picks.
a100_64 = next(spec for spec, gpu, _ in jobs if gpu == A100 and spec.label.endswith("64"))
jobs.append((dataclasses.replace(a100_64, options=a100_64.options | {"num_warps": 4}), A100, "bf16"))
*builds, four_warps = aot.compile_all(jobs)


def products(ptx):
    """Which instruction computes tl.dot, and how many of them the kernel holds."""
    for opcode in ("wgmma.mma_async", "mma.sync", "fma.rn.f32"):
        if count := len(re.findall(rf"^\s*{re.escape(opcode)}", ptx, re.MULTILINE)):
            return f"{count} × {opcode}"


print(f"{'GPU':<22} {'dtype':>5} {'mask':>6} {'d':>4} {'tile':>7} {'warps':>5} {'stages':>6} {'smem KiB (of)':>14} "
      f"{'regs':>4} {'spill B':>7}  products in the PTX")
for b in builds:
    limit = next(gpu for gpu, _ in serving if gpu.name == b.gpu).shared_memory_per_block
    mask = "causal" if "causal" in b.label else "none"
    print(f"{b.gpu:<22} {b.dtype:>5} {mask:>6} {b.label.split()[-1]:>4} {b.tile:>7} {b.num_warps:>5} {b.num_stages:>6} "
          f"{b.shared_memory / 1024:>6.0f} ({limit // 1024:>3}) {b.registers:>6} {b.spill_bytes:>7}  "
          f"{products(b.ptx)}")

# %% [markdown]
# CI requires the `spill B` column to be 0 and the shared memory to stay within the limit in brackets.
#
# ## 3. The instructions
#
# Now the PTX itself, a few lines of it. On the A100 the inner loop is built from four kinds of instruction:

# %%
def first(ptx, opcode):
    return next(line.strip() for line in ptx.splitlines() if line.strip().startswith(opcode))


t4, a100, h100 = (next(b for b in builds if b.arch == arch and b.label.endswith("64")) for arch in (75, 80, 90))
for opcode, meaning in (
        ("cp.async.cg.shared.global", "copies 16 bytes of a K or V tile from device memory straight into shared "
                                      "memory, without waiting: the num_stages-deep prefetch pipeline"),
        ("ldmatrix.sync.aligned", "loads 8x8 fragments from shared memory into registers, laid out as the "
                                  "tensor cores want them"),
        ("mma.sync.aligned.m16n8k16", "one tensor-core product for one warp: a 16x16 bf16 tile times a 16x8 one, "
                                      "accumulated in fp32. Each of the 32 threads holds a share: 4 fp32 of the "
                                      "result, 4 registers (8 bf16) of A, 2 (4 bf16) of B"),
        ("ex2.approx", "the online softmax's exp2: a single hardware instruction")):
    print(f"{first(a100.ptx, opcode)}\n    -> {meaning}")
print(f"\nH100: {first(h100.ptx, 'wgmma.mma_async')}\n    -> Hopper's warpgroup product: 4 warps together "
      f"multiply a 64x16 tile by a 16x64 one, asynchronously. The 32 registers are this thread's share of the "
      f"64x64 fp32 result; the two 64-bit operands describe where A and B sit in shared memory")
print(f"\nT4: {products(t4.ptx)}, and no mma at all: {first(t4.ptx, 'fma.rn.f32')}\n    -> one multiply-add "
      f"per thread on the CUDA cores. Triton 3.x has no tensor-core path below sm_80 "
      f"(triton-lang/triton#5066), so on a T4 even fp16 products run as FMAs")

# %% [markdown]
# Read against chapter 05's loop: `cp.async` is the loads of K and V tiles, issued ahead so that memory and
# arithmetic overlap; `ldmatrix` and `mma` are the two `tl.dot` products; `ex2` is the `exp2` of the online
# softmax. The same Python became three different programs: asynchronous warpgroup products on an H100, warp-level
# tensor-core products on an A100, and plain multiply-adds on a T4.
#
# ## 4. Why these tile sizes
#
# A larger query tile (`BLOCK_M`) is better: every K/V tile fetched from device memory is reused by
# `BLOCK_M` queries, so the bytes moved per FLOP fall as it grows (chapter 05's exercise 3 counts them). Two
# limits stop it growing:
#
# - **Registers.** The fp32 accumulator (`BLOCK_M × d`) and the score tile (`BLOCK_M × BLOCK_N`) live
#   in registers for the whole loop, shared among `32 × num_warps` threads, and a thread has at most
#   255 registers. At 128 × (64 + 64) values, 4 warps would hold 128 per thread before counting the
#   operands: the experiment below compiles that configuration. The wrapper caps the values per thread
#   (80 with tensor cores) and takes 8 warps, or at d = 128 a narrower `BLOCK_N` (32).
# - **Shared memory.** The `cp.async` pipeline keeps `num_stages` K and V tiles in flight; the wrapper
#   tries 3 stages, then 2, and takes the first whose estimate fits the GPU: 3 on an A100 and an H100.
#
# A T4 gets small tiles for another reason: with FMA products each thread also holds operand values
# for every multiply-add it issues, so the cap is 24 values per thread. The same holds for fp32 inputs on
# any GPU, which the kernel multiplies exactly ("ieee"): tensor cores would round them to TF32. The
# budgets were found by compiling candidate tiles with `aot`, and CI checks every configuration of every
# kernel for spills and shared memory on each GPU the course names (these three and an L4). FMAs also cost a
# T4 most of its speed: NVIDIA rates it at 8.1 TFLOP/s for fp32 FMAs against 65 for fp16 tensor-core products.

# %%
print(f"A100, bf16, d = 64, tile {four_warps.tile}: {four_warps.num_warps} warps -> {four_warps.registers} registers, "
      f"{four_warps.spill_bytes} B spilled per thread;  {a100.num_warps} warps (the wrapper's choice) -> "
      f"{a100.registers} registers, {a100.spill_bytes} B spilled")

# %% [markdown]
# ## What you measured

# %%
summary = [(f"{b.gpu}, {b.dtype}, causal, d = {b.label.split()[-1]}",
            f"tile {b.tile}, {b.num_warps} warps, {b.num_stages} stages, {b.shared_memory // 1024} KiB shared, "
            f"{b.registers} registers, {b.spill_bytes} B spilled; {products(b.ptx)}") for b in builds
           if "causal" in b.label and not b.label.endswith(" 32")]
summary.append((f"A100, bf16, d = 64 with {four_warps.num_warps} warps",
                f"{four_warps.registers} registers, {four_warps.spill_bytes} B spilled"))
width = max(len(k) for k, _ in summary)
for k, v in summary:
    print(f"{k:<{width}}  {v}")

# %% [markdown]
# ## Exercise: predict, then run
#
# **A deeper pipeline.** The wrapper gives the A100's d = 128 kernel 3 stages: 3 pairs of K and V tiles in
# flight. Compile the same kernel with 5 stages. Predict how much shared memory each extra stage takes, and
# whether 5 stages still fit the A100's limit.

# %%
a100_128 = next(spec for spec, gpu, _ in jobs if gpu == A100 and spec.label.endswith("128"))
stages_3 = next(b for b in builds if b.gpu == A100.name and b.label.endswith("128"))
(stages_5,) = aot.compile_all([(dataclasses.replace(a100_128, options=a100_128.options | {"num_stages": 5}),
                                A100, "bf16")])
for b in (stages_3, stages_5):
    fits = "fits" if b.shared_memory <= A100.shared_memory_per_block else "does NOT fit"
    print(f"A100, d = 128, tile {b.tile}, {b.num_stages} stages: {b.shared_memory / 1024:.0f} KiB of shared memory "
          f"({fits} the {A100.shared_memory_per_block // 1024} KiB a block may take){', ' + b.error if b.error else ''}")
print(f"growth per extra stage: {(stages_5.shared_memory - stages_3.shared_memory) / 2 / 1024:.0f} KiB")

# %% [markdown]
# <details><summary>Answer</summary>
#
# Each stage holds one K tile and one V tile, `BLOCK_N × d` 2-byte numbers each: 2 × 32 × 128 × 2 bytes =
# 16 KiB, which is the step the cell prints. Five stages fit easily. The wrapper still stops at 3: a stage helps
# only while a load would otherwise keep the arithmetic waiting, and once the next tiles arrive before they are
# needed, more stages take shared memory and buy nothing. Where that point lies is a question for a timing on
# the GPU, not for the compiler, which can only say what fits.
# </details>
#
# **Back to the course.** This appendix has no lab; chapter 05's timings on a GPU are this code running.
