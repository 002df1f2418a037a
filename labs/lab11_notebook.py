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
# # Lab 11 · Tensor parallelism: column- and row-parallel layers, heads, the vocabulary
#
# Open `labs/lab11_tensor_parallel.py` and fill in the functions marked `TODO`: `column_shard` and
# `column_parallel_linear` (which dimension of W is cut; no communication), `row_shard` and `row_parallel_linear`
# (the other dimension, and where the one all-reduce goes), `qkv_shard` (the attention split by heads, KV heads
# too) and `vocab_parallel_embedding` (each rank looks up only its vocabulary range). This notebook runs every
# rank's shard of SmolLM2-135M's real layers in this one process and checks that the shards, joined or summed,
# give the full layer; then it serves real requests with YOUR layers in three real ranks (processes joined by
# torch.distributed) and compares the tokens with the one-process engine; and finally it runs the grader, the
# same tests CI runs against the reference solution:
#
#     pytest tests/labs/test_lab11.py --impl=labs
#
# Re-run the notebook after each edit (the first cell reloads your module). Chapter 11 explains the cuts.

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
import sys
from pathlib import Path

ROOT = Path.cwd().parent if Path.cwd().name == "labs" else Path.cwd()
sys.path.insert(0, str(ROOT))
import labs.lab11_tensor_parallel as lab

importlib.reload(lab)  # pick up your latest edits

import torch
import torch.nn.functional as F

import mini_engine as me

RANKS = 3


def attempt(part, fn):
    """Run one part of the lab; say which TODO is still open instead of stopping the notebook."""
    try:
        return fn()
    except NotImplementedError as err:
        print(f"{part}: not implemented yet: {err}")
    except RuntimeError as err:  # a rank's step failed: a TODO in a rank is the usual cause
        if not isinstance(err.__cause__, NotImplementedError):
            raise
        print(f"{part}: not implemented yet: {err.__cause__}")
    return None


# The plain modules (no CPU backend), as the ranks run them, so that one process and three give the same sums.
model, tokenizer = me.load_model("smollm2-135m", device="cpu", dtype="float32", cpu_backend=False)
cfg = model.config
print(f"SmolLM2-135M: {cfg.num_heads} query heads, {cfg.num_kv_heads} KV heads of {cfg.head_dim}, hidden "
      f"{cfg.hidden_size}, MLP width {cfg.intermediate_size}, vocabulary {cfg.vocab_size}; {RANKS} ranks")

# %% [markdown]
# ## 1. Column, then row: layer 0's MLP in three shards
# The MLP is `down(silu(gate x) * up x)`. gate and up are column-parallel: each rank computes its third of the
# 1,536 MLP columns from the whole x, with nothing exchanged, and SwiGLU works column by column, so it runs on the
# rank's own columns. down is row-parallel: each rank multiplies its third of the columns by its third of down's
# inputs and gets a partial output of the full width; the sum over the ranks (the all-reduce) is the MLP's output.
# Here the ranks are three iterations of a loop, and the sum is Python's.

# %%
x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
mlp = model.layers[0].mlp
gate, up = mlp.gate_up_proj.weight.chunk(2)
down = mlp.down_proj.weight


def mlp_in_shards():
    partials = []
    for rank in range(RANKS):
        g = lab.column_parallel_linear(x, lab.column_shard(gate, rank, RANKS))
        u = lab.column_parallel_linear(x, lab.column_shard(up, rank, RANKS))
        partials.append(lab.row_parallel_linear(F.silu(g) * u, lab.row_shard(down, rank, RANKS)))
        print(f"rank {rank}: gate/up shards {tuple(lab.column_shard(gate, rank, RANKS).shape)}, down shard "
              f"{tuple(lab.row_shard(down, rank, RANKS).shape)}, partial output {tuple(partials[-1].shape)}")
    return partials


partials = attempt("column then row", mlp_in_shards)
if partials:
    with torch.no_grad():
        full = mlp(x)
    error = ((sum(partials) - full).abs().max() / full.abs().max()).item()  # a split sum adds in another order
    print(f"sum of the partials vs the full MLP: max |diff| = {error:.1e} of the largest output")
    print("column then row gives the full MLP:", error < 1e-5)

# %% [markdown]
# ## 2. Attention, split by heads
# q, k and v are one fused projection, `[q; k; v]`, 9 query heads then 3 KV heads twice, 64 rows a head. A rank
# must own whole heads, and the KV head its query heads read (grouped-query attention: query heads 0-2 read KV
# head 0, 3-5 head 1, 6-8 head 2), so that attention runs on each rank alone. At three ranks each holds 3 query
# heads and 1 KV head.

# %%
attn = model.layers[0].self_attn
d = cfg.head_dim


def heads_in_shards():
    with torch.no_grad():
        q, k, v = F.linear(x, attn.qkv_proj.weight).split([cfg.num_heads * d, cfg.num_kv_heads * d,
                                                           cfg.num_kv_heads * d], dim=-1)
    hq, hkv, worst = cfg.num_heads // RANKS, cfg.num_kv_heads // RANKS, 0.0
    for rank in range(RANKS):
        shard = lab.qkv_shard(attn.qkv_proj.weight, cfg.num_heads, cfg.num_kv_heads, d, rank, RANKS)
        mine = lab.column_parallel_linear(x, shard)
        want = torch.cat([q[:, rank * hq * d:(rank + 1) * hq * d], k[:, rank * hkv * d:(rank + 1) * hkv * d],
                          v[:, rank * hkv * d:(rank + 1) * hkv * d]], dim=-1)
        error = (mine - want).abs().max().item() if mine.shape == want.shape else float("inf")
        worst = max(worst, error)
        print(f"rank {rank}: shard {tuple(shard.shape)}: query heads {rank * hq}-{(rank + 1) * hq - 1}, KV head "
              f"{rank * hkv}; max |diff| from the full projection's heads = {error:.1e}")
    return worst


worst = attempt("attention by heads", heads_in_shards)
if worst is not None:
    print("every rank projects exactly its own heads:", worst < 1e-4)

# %% [markdown]
# ## 3. The vocabulary-parallel embedding
# The table has 49,152 rows: each rank holds 16,384 of them. A prompt's ids fall in different ranks' ranges; a
# rank gives its rows for its ids and zeros for the others', and the all-reduce (here, a sum) puts every row
# together.

# %%
ids = torch.tensor(tokenizer.encode("Tensor parallelism splits one model across ranks"))
table = model.embed_tokens.weight
rows = cfg.vocab_size // RANKS


def embedding_in_shards():
    parts = [lab.vocab_parallel_embedding(ids, lab.column_shard(table, rank, RANKS), rank * rows)
             for rank in range(RANKS)]
    for rank, part in enumerate(parts):
        held = part.abs().sum(-1) > 0
        print(f"rank {rank} (ids {rank * rows}-{(rank + 1) * rows - 1}) holds {int(held.sum())} of the "
              f"{len(ids)} tokens: {ids[held].tolist()}")
    return parts


parts = attempt("vocabulary-parallel embedding", embedding_in_shards)
if parts:
    error = (sum(parts) - F.embedding(ids, table)).abs().max().item()
    print(f"sum of the ranks' parts vs the full lookup: max |diff| = {error:.1e}")
    print("the ranks' parts sum to the full embedding:", error == 0)

# %% [markdown]
# ## 4. Your layers serve real requests at three ranks
# `mini_engine.parallel` builds each rank from the engine's layers, or, through its hook, from a module you name:
# `ParallelModel(model, 3, layers=...)` cuts every weight of the real model with your `column_shard`, `row_shard`
# and `qkv_shard` (the given `split_rows`, `split_columns` and `split_qkv` at the bottom of your lab file), and
# every rank runs its forward passes through your `column_parallel_linear`, `row_parallel_linear` and
# `vocab_parallel_embedding` (the given layer classes there), meeting the other ranks at YOUR all-reduces. Ranks 1
# and 2 are processes of their own, joined by torch.distributed (gloo, over 127.0.0.1); the engine's scheduler
# and sampler stay in this process, rank 0. The same greedy requests go through the one-process engine: the tokens
# must be the same. (The LM head stays the engine's: each rank's logits of its range, gathered on rank 0.)

# %%
from mini_engine.parallel import ParallelModel

prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in
           ("What is the capital of France?", "Name three prime numbers.", "Why is the sea salty?")]
greedy = me.SamplingParams(temperature=0.0, max_tokens=16)
knobs = dict(num_kv_blocks=64, block_size=16)


def serve_with_your_layers():
    ranks = ParallelModel(model, RANKS, layers=lab.__name__)  # every rank imports your module by this name
    try:
        print(ranks)
        llm = me.LLM.from_model(ranks, tokenizer, **knobs)
        return llm.generate(prompts, greedy, use_tqdm=False), ranks.comm.calls
    finally:
        ranks.shutdown()


served = attempt("your layers at three ranks", serve_with_your_layers)
if served:
    yours, all_reduces = served
    one = me.LLM.from_model(model, tokenizer, **knobs).generate(prompts, greedy, use_tqdm=False)
    for a, b in zip(one, yours):
        print(f"one process: {a.text[:60]!r}\nthree ranks: {b.text[:60]!r}")
    print(f"rank 0 met the other ranks {all_reduces} times (all-reduces and logit gathers)")
    print("your three ranks give the one-process engine's tokens:",
          [a.token_ids for a in one] == [b.token_ids for b in yours])

# %% [markdown]
# ## 5. Grade
# The grader prints a dot per passing test and, for each failing one, one line that says what to fix (a part not
# written yet: the line of its TODO and a hint). Its slow check, three real ranks running your layers together,
# runs last and says what it does before it starts.

# %%
import pytest

code = pytest.main([str(ROOT / "tests/labs/test_lab11.py"), "--impl=labs", "-q", "--no-header",
                    "-p", "no:cacheprovider", "--rootdir", str(ROOT)])
print("all tests pass: well done!" if code == 0 else "some tests still fail: read the messages above")
