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
# # Lab 03 · The KV cache
#
# Open `labs/lab03_kv_cache.py` and fill in the four functions marked `TODO`: the cache-size formula,
# how many requests fit on a GPU, one cached attention step, and the cached generation loop. This
# notebook tries each one against the engine and then runs the grader:
#
#     pytest tests/labs/test_lab03.py --impl=labs
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
import time
from pathlib import Path

ROOT = Path.cwd().parent if Path.cwd().name == "labs" else Path.cwd()
sys.path.insert(0, str(ROOT))
import labs.lab03_kv_cache as lab

importlib.reload(lab)  # pick up your latest edits

import torch

import mini_engine as me
from mini_engine.config import PRESETS
from mini_engine.kv_cache import ContiguousKVCache

model, tok = me.load_model("smollm2-135m")


def attempt(what, fn):
    """Run one of your functions; a TODO that is still open is reported, not raised."""
    try:
        result = fn()
    except NotImplementedError as err:
        print(f"{what}: not implemented yet ({err})")
        return None
    print(f"{what}: {result}")
    return result


# %% [markdown]
# ## 1. How big is the cache?
# A real `ContiguousKVCache` knows its own size; your formula should agree, and reproduce the textbook the course
# accompanies: Llama-7B at 4K context needs "roughly 2 GB per sequence", Llama-70B at 128K "roughly 40 GB" with its
# 8 KV heads ("roughly 320 GB" with all 64), and the KV cache "caps how many requests a GPU holds (~35 on an 80 GB
# A100)" for Llama-2-13B.

# %%
real = ContiguousKVCache(model.config, 2, 300, dtype=torch.float32)
attempt(f"SmolLM2, 2 x 300 tokens, fp32 (a real cache holds {real.nbytes:,} bytes)",
        lambda: f"{lab.kv_cache_bytes(model.config, 300, 2, 4):,} bytes")
for name, n in (("llama-7b", 4096), ("llama-70b-gqa", 131072), ("llama-70b-mha", 131072)):
    attempt(f"{name} at {n} tokens, fp16", lambda name=name, n=n: f"{lab.kv_cache_bytes(PRESETS[name], n) / 2**30:g} GiB")
fits = attempt("Llama-2-13B, 2048-token requests on 80 GiB (the textbook: ~35)",
               lambda: lab.max_concurrent_requests(PRESETS["llama-2-13b"], 80 * 2**30, 2048))

# %% [markdown]
# ## 2. One cached attention step
# Feed a random sequence through your `decode_attention` one token at a time: the result should be
# causal attention over the whole sequence.

# %%
heads, kv_heads, n, d = 9, 3, 10, 64
q, k, v = torch.randn(n, heads, d), torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
k_cache, v_cache = torch.zeros(kv_heads, n, d), torch.zeros(kv_heads, n, d)
expected = torch.nn.functional.scaled_dot_product_attention(
    q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True).transpose(0, 1)
error = attempt("max difference from causal attention",
                lambda: float((torch.stack([lab.decode_attention(q[i], k[i], v[i], k_cache, v_cache, i)
                                            for i in range(n)]) - expected).abs().max()))

# %% [markdown]
# ## 3. The cached loop
# Same tokens as full recompute, in a fraction of the time.

# %%
prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
t0 = time.perf_counter()
reference = me.generate_naive(model, prompt, 12)
naive_s = time.perf_counter() - t0
print(f"full recompute: {tok.decode(reference)!r} in {naive_s:.2f} s")
t0 = time.perf_counter()
mine = attempt("your cached_generate", lambda: lab.cached_generate(model, prompt, 12, eos_token_id=tok.eos_token_id))
if mine is not None:
    print(f"{tok.decode(mine)!r} in {time.perf_counter() - t0:.2f} s:",
          "same tokens" if mine == reference else "DIFFERENT tokens")

# %% [markdown]
# ## 4. Grade

# %%
import pytest

code = pytest.main([str(ROOT / "tests/labs/test_lab03.py"), "--impl=labs", "-q", "--no-header",
                    "-p", "no:cacheprovider", "--rootdir", str(ROOT)])
print("all tests pass: well done!" if code == 0 else "some tests still fail: read the messages above")
