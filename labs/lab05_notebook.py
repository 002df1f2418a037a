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
# # Lab 05 · FlashAttention, one tile at a time
#
# Open `labs/lab05_flash_attention.py` and fill in the two functions marked `TODO`:
#
# * Part 1, `online_softmax` (NumPy): the attention output from key tiles that arrive one at a time,
#   keeping only a running max, a running sum and a running output per query;
# * Part 2, `attention_tile_step` (Triton): the same update as the body of the FlashAttention kernel's
#   loop over K/V tiles. The kernel around it is given.
#
# This notebook tries each part, shows what "streaming" means in bytes, and then runs the grader, the
# same tests CI runs against the reference solution:
#
#     pytest tests/labs/test_lab05.py --impl=labs
#
# Re-run the notebook after each edit (the first cell reloads your module). Without a GPU the kernel
# runs in Triton's interpreter: correct, only slow, so the sizes here are small.

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
import os
from pathlib import Path

import torch

# Triton reads this when a kernel is defined: it must be set before your lab module is imported.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

ROOT = Path.cwd().parent if Path.cwd().name == "labs" else Path.cwd()
sys.path.insert(0, str(ROOT))
import labs.lab05_flash_attention as lab

importlib.reload(lab)  # pick up your latest edits

import tracemalloc

import numpy as np

from mini_engine.kernels.flash_attention import attention_reference
from mini_engine.course.online_softmax import softmax_attention

device = "cuda" if torch.cuda.is_available() else "cpu"
print(f"device: {device}; your kernel runs {'compiled' if device == 'cuda' else 'in the Triton interpreter'}")


def attempt(what, fn):
    """Run one of your functions; a TODO that is still open is reported, not raised."""
    try:
        result = fn()
    except NotImplementedError as err:
        print(f"{what}: not implemented yet ({err})")
        return None
    except Exception as err:  # inside a kernel a TODO arrives wrapped in Triton's own error
        if "NotImplementedError" not in f"{err!r} {err.__cause__!r}":
            raise
        print(f"{what}: not implemented yet")
        return None
    print(f"{what}: {result}")
    return result


def tiles(scores, values, size):
    """The key axis cut into tiles of `size` keys, as one-shot generators (each tile can be read once)."""
    starts = range(0, scores.shape[-1], size)
    return (scores[:, i:i + size] for i in starts), (values[i:i + size] for i in starts)


# %% [markdown]
# ## 1. Online softmax in NumPy
# Three query rows attend to 24 keys. Whatever the tile size, your running answer must equal the exact
# `softmax(S) @ V`, which needs the whole row of scores at once.

# %%
rng = np.random.default_rng(0)
scores, values = rng.normal(size=(3, 24)), rng.normal(size=(24, 4))
exact = softmax_attention(scores, values)
for size in (24, 8, 5, 1):
    attempt(f"tiles of {size:2d} keys, largest difference from the exact answer",
            lambda size=size: f"{np.abs(lab.online_softmax(*tiles(scores, values, size)) - exact).max():.1e}")

# Scores in the hundreds: exp(800) overflows float64, so only a running max keeps this finite.
big, big_values = rng.normal(scale=400.0, size=(2, 30)), rng.normal(size=(30, 4))
with np.errstate(over="ignore", invalid="ignore"):
    attempt("scores in the hundreds: every output finite",
            lambda: bool(np.isfinite(lab.online_softmax(*tiles(big, big_values, 10))).all()))

# %% [markdown]
# ## 2. What streaming buys
# A row of 100,000 keys, made one tile at a time. Gathering the tiles first (a list, a concatenate, one
# exact softmax) holds every score at once; folding each tile into `m`, `l` and `acc` holds one tile.
# `tracemalloc` measures the peak of what your function held; the grader checks the same thing.

# %%
queries, n_tiles, tile, dim = 4, 100, 1000, 8


def score_tiles():
    gen = np.random.default_rng(5)
    for _ in range(n_tiles):
        yield gen.normal(size=(queries, tile))


def value_tiles():
    gen = np.random.default_rng(6)
    for _ in range(n_tiles):
        yield gen.normal(size=(tile, dim))


def gather_then_softmax(score_tiles, value_tiles):
    """What online softmax replaces: every tile kept, then one exact softmax over the whole row."""
    return softmax_attention(np.concatenate(list(score_tiles), axis=1), np.concatenate(list(value_tiles)))


def peak_bytes(fn):
    tracemalloc.start()
    try:
        fn(score_tiles(), value_tiles())
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


print(f"all scores together: {queries * n_tiles * tile * 8 / 1e6:.1f} MB (float64)")
print(f"gather, then softmax: peak {peak_bytes(gather_then_softmax) / 1e6:.2f} MB")
mine = attempt("your online_softmax", lambda: f"peak {peak_bytes(lab.online_softmax) / 1e6:.2f} MB")

# %% [markdown]
# ## 3. The tile step inside a Triton kernel
# `run_tile_step` (given) runs your `attention_tile_step` once on a 16 × 16 tile. In the kernel, scores
# arrive already multiplied by `log2(e)`, so the weights are `exp2(qk - m)`; masked keys hold `-inf`.
# Compare with the same update written in PyTorch.

# %%
gen = torch.Generator().manual_seed(0)
qk, v = torch.randn(16, 16, generator=gen) * 3, torch.randn(16, 16, generator=gen)
qk[:, 12:] = float("-inf")  # four masked keys
acc, l_i, m_i = torch.zeros(16, 16), torch.zeros(16), torch.full((16,), -1e30)

m_new = torch.maximum(m_i, qk.max(dim=1).values)
p = torch.exp2(qk - m_new[:, None])
want = (acc * torch.exp2(m_i - m_new)[:, None] + p @ v, l_i * torch.exp2(m_i - m_new) + p.sum(1), m_new)
got = attempt("your tile step (acc, l_i, m_i), largest differences",
              lambda: [f"{(g.cpu() - w).abs().max():.1e}" for g, w in
                       zip(lab.run_tile_step(*(t.to(device) for t in (acc, l_i, m_i, qk, v))), want)])

# %% [markdown]
# ## 4. The whole kernel with your step
# `flash_attention` (given) loops your step over the K/V tiles of every query tile. It should match
# `softmax(Q Kᵀ / √d) V` with and without the causal mask.

# %%
gen = torch.Generator().manual_seed(1)
q, k, v = (torch.randn(1, 2, 50, 16, generator=gen).to(device) for _ in range(3))
for causal in (False, True):
    attempt(f"causal={causal!s:5}: largest difference from the reference",
            lambda causal=causal: f"{(lab.flash_attention(q, k, v, causal=causal) - attention_reference(q, k, v, causal)).abs().max():.1e}")

# %% [markdown]
# ## 5. Grade
# The grader prints one line per failing test, saying what to fix.

# %%
import pytest

code = pytest.main([str(ROOT / "tests/labs/test_lab05.py"), "--impl=labs", "-q", "--no-header",
                    "-p", "no:cacheprovider", "--rootdir", str(ROOT)])
print("all tests pass: well done!" if code == 0 else "some tests still fail: read the messages above")
