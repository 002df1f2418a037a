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
# # Lab 10 · int4 weights: group-wise quantization and the checkpoint's own Q4_1 blocks
#
# Open `labs/lab10_quantization.py` and fill in the functions marked `TODO`: `quantize_int4`,
# `dequantize_int4`, `pack_int4`, `unpack_int4`, `int4_matmul`, `repack_q4_1` and `compact_scales`. This
# notebook quantizes one of the model's weight matrices with your code and draws its int4 grid, measures the
# error against the group size, repacks the GGUF file's own 4-bit blocks and checks them against the `gguf`
# package, stores their scales in 8 bits, then runs the grader, the same tests CI runs against the reference
# solution:
#
#     pytest tests/labs/test_lab10.py --impl=labs
#
# Re-run the notebook after each edit (the first cell reloads your module).

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

    course_setup.install(home, lab=True)

# %%
import importlib
from pathlib import Path

ROOT = Path.cwd().parent if Path.cwd().name == "labs" else Path.cwd()
sys.path.insert(0, str(ROOT))
import labs.lab10_quantization as lab

importlib.reload(lab)  # pick up your latest edits

import gguf
import matplotlib.pyplot as plt
import numpy as np
import torch

from mini_engine.loading.loader import embedded_gguf_path


def attempt(part, fn):
    """Run one part of the lab; say which TODO is still open instead of stopping the notebook."""
    try:
        return fn()
    except NotImplementedError as err:
        print(f"{part}: not implemented yet: {err}")
        return None


def read(name):
    t = next(t for t in reader.tensors if t.name == name)
    n, k = (int(s) for s in reversed(t.shape))
    w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)).reshape(n, k)
    print(f"{name}: {n} x {k}, stored as {t.tensor_type.name} ({t.n_bytes / (n * k):.3f} bytes a weight)")
    return t, w


reader = gguf.GGUFReader(embedded_gguf_path())
# The token embedding is stored with 8 bits a weight (Q8_0): nearly float, so quantizing it to int4 shows the
# error int4 costs. Every linear layer is already 4-bit (Q4_1): part 3 repacks one of them.
_, E = read("token_embd.weight")
E = E[:4096]
tensor, W = read("blk.0.ffn_down.weight")
N, K = W.shape

# %% [markdown]
# ## 1. One row, its groups and its int4 grid
# Each group of 32 weights gets 16 levels, evenly spaced from its smallest weight to its largest. The dots are
# the first 128 weights of one embedding row; the grey lines are the 16 values its group can represent.

# %%
def draw_grid():
    row = E[1000:1001, :128]
    q, scales, zeros = lab.quantize_int4(row, group_size=32)
    back = lab.dequantize_int4(q, scales, zeros, group_size=32)
    fig, ax = plt.subplots(figsize=(9, 3.2))
    for g in range(4):
        levels = (torch.arange(16) - 8) * scales[0, g] + zeros[0, g]
        ax.hlines(levels, 32 * g - 0.5, 32 * g + 31.5, color="0.85", lw=0.8)
    ax.plot(row[0], ".", label="weight")
    ax.plot(back[0], "x", ms=4, label="int4 (nearest level)")
    ax.set(xlabel="column", ylabel="value", title="four groups of 32 weights and their 16 levels each")
    ax.legend(loc="upper right")
    plt.tight_layout()
    plt.show()
    return (back - row).abs().max().item()


err = attempt("quantize one row", draw_grid)
if err is not None:
    print(f"largest error on these 128 weights: {err:.2e} (at most half the spacing of their group's levels)")

# %% [markdown]
# ## 2. Group size: bits per weight against error
# A scale and a zero (16 bits each) per group cost 32 / group_size bits a weight on top of the 4-bit codes.
# Larger groups are cheaper, but one outlier then stretches the grid for more weights.

# %%
def sweep():
    rows = []
    for g in (32, 64, 192, 576):  # 576 = the whole row: one scale per row
        q, s, z = lab.quantize_int4(E, group_size=g)
        back = lab.dequantize_int4(q, s, z, group_size=g)
        rel = ((back - E).norm() / E.norm()).item()
        rows.append((g, 4 + 32 / g, rel))
        print(f"group {g:4d}: {4 + 32 / g:.2f} bits a weight, relative error {100 * rel:.2f}%")
    return rows


attempt("group size sweep", sweep)

# %% [markdown]
# ## 3. The checkpoint's own blocks
# This tensor is already 4-bit: Q4_1 stores w = d q + m per block of 32. Your `repack_q4_1` turns it into the
# codes, scales and zeros of part 1 without rounding anything, so dequantizing them gives the file's weights
# exactly, and `pack_int4` holds the codes in half the bytes.

# %%
def repack():
    q, s, z = lab.repack_q4_1(torch.from_numpy(np.array(tensor.data)), N, K)
    exact = torch.equal(lab.dequantize_int4(q, s, z, group_size=32), W)
    packed = lab.pack_int4(q)
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(0))
    gap = (lab.int4_matmul(x, packed, s, z, group_size=32) - x @ W.t()).abs().max().item()
    print(f"repacked exactly: {exact}; codes {packed.numel()} bytes (+ {2 * 2 * s.numel()} bytes of scales and zeros "
          f"at 16 bits each) for {N * K} weights; int4_matmul vs float product: max |diff| {gap:.1e}")


attempt("repack Q4_1", repack)

# %% [markdown]
# ## 4. The scales in 8 bits
# The codes are 4 bits a weight, but d and m cost 32 bits per block of 32: one more bit a weight, a fifth of the
# tensor. Your `compact_scales` stores them in 8 bits each with one factor per row; how far do the weights move?

# %%
def compact():
    q, s, z = lab.repack_q4_1(torch.from_numpy(np.array(tensor.data)), N, K)
    d, m = s, z - 8 * s
    d_codes, m_codes, fd, fm = lab.compact_scales(d, m)
    d8, m8 = d_codes.float() * fd[:, None], m_codes.float() * fm[:, None]
    small = lab.dequantize_int4(q, d8, m8 + 8 * d8, group_size=32)
    rel = ((small - W).pow(2).mean() / W.pow(2).mean()).sqrt().item()
    before, after = N * K / 2 + 4 * d.numel(), N * K / 2 + 2 * d.numel() + 8 * N
    print(f"bytes: {before:,.0f} -> {after:,.0f} ({8 * before / (N * K):.2f} -> {8 * after / (N * K):.2f} bits a "
          f"weight); the weights moved by {100 * rel:.2f}% of their RMS")


attempt("compact scales", compact)

# %% [markdown]
# ## 5. Grade
# The grader prints one line per test; a failing test says what to fix.

# %%
import pytest

code = pytest.main([str(ROOT / "tests/labs/test_lab10.py"), "--impl=labs", "-q", "--no-header",
                    "-p", "no:cacheprovider", "--rootdir", str(ROOT)])
print("all tests pass: well done!" if code == 0 else "some tests still fail: read the messages above")
