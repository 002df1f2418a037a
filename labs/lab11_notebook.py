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
# # Lab 11 · Tensor parallelism: the split attention block, the vocabulary-parallel head, the ring
#
# Open `labs/lab11_tensor_parallel.py` and fill in what is marked `TODO`: the two cuts of a weight (`column_shard`,
# `row_shard`); the attention block of one rank (`qkv_shard`: which rows of the fused [q; k; v] weight are its query
# heads and the KV heads they read; `ParallelAttention`: attention over those heads alone, and where its one
# all-reduce goes); the vocabulary-parallel embedding (`vocab_parallel_embedding`) and LM head
# (`ParallelLMHead.forward`, with its gather); and, optional, an all-reduce of your own made of a reduce-scatter and
# an all-gather (`reduce_scatter`, `all_gather`, `ring_all_reduce`). The MLP's layers are given there, as an example.
# This notebook runs every rank's shard of SmolLM2-135M's real layers in this one process and checks that the
# shards, joined or summed, give the full layer; then it serves real requests with YOUR layers in three real ranks
# (processes joined by torch.distributed) and compares the tokens with the one-process engine; it runs your ring on
# three threads; and finally it runs the grader, the same tests CI runs against the reference solution:
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
# 1,536 MLP columns from the whole x, with nothing exchanged, and SwiGLU (the MLP's silu(gate) * up) works column by
# column, so it runs on the rank's own columns. down is row-parallel: each rank multiplies its third of the columns
# by its third of down's inputs and gets a partial output of the full width; the sum over the ranks (the
# all-reduce) is the MLP's output. The layers are the given ones, with your cuts; the ranks are three iterations of
# a loop, and the sum is Python's.

# %%
x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
mlp = model.layers[0].mlp
gate, up = mlp.gate_up_proj.weight.chunk(2)
down = mlp.down_proj.weight


def mlp_in_shards():
    partials = []
    for rank in range(RANKS):
        g = lab.ColumnParallelLinear(lab.column_shard(gate, rank, RANKS))(x)
        u = lab.ColumnParallelLinear(lab.column_shard(up, rank, RANKS))(x)
        partials.append(lab.RowParallelLinear(lab.row_shard(down, rank, RANKS))(F.silu(g) * u))
        print(f"rank {rank}: gate/up shards {tuple(lab.column_shard(gate, rank, RANKS).shape)}, down shard "
              f"{tuple(lab.row_shard(down, rank, RANKS).shape)}, partial output {tuple(partials[-1].shape)}")
    return partials


with torch.no_grad():
    partials = attempt("column then row", mlp_in_shards)
    if partials:
        full = mlp(x)
        error = ((sum(partials) - full).abs().max() / full.abs().max()).item()  # a split sum adds in another order
        print(f"sum of the partials vs the full MLP: max |diff| = {error:.1e} of the largest output")
        print("column then row gives the full MLP:", error < 1e-5)

# %% [markdown]
# ## 2. The attention block, split by heads
# q, k and v are one fused projection, `[q; k; v]`, 9 query heads then 3 KV heads twice, 64 rows a head. A rank
# must own whole heads, and the KV head its query heads read (grouped-query attention: query heads 0-2 read KV
# head 0, 3-5 head 1, 6-8 head 2), so that attention runs on each rank alone. At three ranks each holds 3 query
# heads and 1 KV head. Here each rank's `ParallelAttention` (with no comm: its partial output) runs layer 0's real
# attention over two packed prompts, and the sum of the three is compared with the full block's output.

# %%
from mini_engine.attention import AttentionMetadata, TorchAttention
from mini_engine.model import rope_tables

attn = model.layers[0].self_attn
meta = AttentionMetadata.build([2, 3])  # two prompts of 2 and 3 tokens, packed: x's 5 rows
cos, sin = (angles[meta.positions, None] for angles in rope_tables(cfg))


def attention_in_shards():
    parts = []
    for rank in range(RANKS):
        block = lab.ParallelAttention(attn, rank, RANKS)
        parts.append(block(x, cos, sin, meta, 0, None, TorchAttention()))
        print(f"rank {rank}: {block.num_heads} query heads and {block.num_kv_heads} KV head(s); qkv_proj "
              f"{tuple(block.qkv_proj.weight.shape)}, o_proj {tuple(block.o_proj.weight.shape)}; partial output "
              f"{tuple(parts[-1].shape)}")
    return parts


with torch.no_grad():
    parts = attempt("the attention block", attention_in_shards)
    if parts:
        full = attn(x, cos, sin, meta, 0, None, TorchAttention())
        error = ((sum(parts) - full).abs().max() / full.abs().max()).item()
        print(f"sum of the ranks' blocks vs the full attention block: max |diff| = {error:.1e} of the largest output")
        print("the attention block split by heads gives the full block:", error < 1e-5)

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


with torch.no_grad():
    parts = attempt("vocabulary-parallel embedding", embedding_in_shards)
    if parts:
        error = (sum(parts) - F.embedding(ids, table)).abs().max().item()
        print(f"sum of the ranks' parts vs the full lookup: max |diff| = {error:.1e}")
        print("the ranks' parts sum to the full embedding:", error == 0)

# %% [markdown]
# ## 4. The vocabulary-parallel LM head
# SmolLM2's LM head is tied to the embedding: the logits are x times the same table. A rank holds its third of the
# rows, so it computes the logits of its third of the vocabulary: different columns of the whole [T, V], not terms
# of a sum. Only rank 0 samples, so only rank 0 needs them all: a gather, which moves each rank's third once, to
# one rank. An all-reduce of zero-padded [T, V] logits would give the same numbers, at the cost printed below.

# %%
h = torch.randn(4, cfg.hidden_size, generator=torch.Generator().manual_seed(1))


def head_in_shards():
    return [lab.ParallelLMHead(lab.column_shard(table, rank, RANKS))(h) for rank in range(RANKS)]


with torch.no_grad():
    parts = attempt("vocabulary-parallel LM head", head_in_shards)
    if parts:
        whole, full = torch.cat(parts, dim=-1), F.linear(h, table)
        print(f"each rank's logits: {[tuple(p.shape) for p in parts]}; joined {tuple(whole.shape)}")
        print(f"joined vs the full head: max |diff| = {(whole - full).abs().max().item():.1e}; the same next tokens:",
              torch.equal(whole.argmax(-1), full.argmax(-1)))
        part_bytes = parts[0].numel() * parts[0].element_size()
        # A ring all-reduce sends 2(p-1)/p of the whole from every rank; a gather, each other rank's part once.
        print(f"bytes sent per step at {RANKS} ranks: gather {(RANKS - 1) * part_bytes:,} in all; an all-reduce of "
              f"the padded [4, {cfg.vocab_size}] would send {2 * (RANKS - 1) * part_bytes:,} from EVERY rank")

# %% [markdown]
# ## 5. Your layers serve real requests at three ranks
# `mini_engine.parallel` builds each rank from the engine's layers, or, through its hook, from a module you name:
# `ParallelModel(model, 3, layers=...)` cuts every weight of the real model with your `column_shard`, `row_shard`
# and `qkv_shard` (the given `split_rows`, `split_columns` and `split_qkv` at the bottom of your lab file), and
# every rank runs its forward passes through your `ParallelAttention`, `vocab_parallel_embedding` and
# `ParallelLMHead` (and the given MLP layers), meeting the other ranks at YOUR all-reduces and gather. Ranks 1 and
# 2 are processes of their own, joined by torch.distributed (gloo, over 127.0.0.1); the engine's scheduler and
# sampler stay in this process, rank 0. The same greedy requests go through the one-process engine: the tokens must
# be the same. The engine logs every rank's collectives while the requests run (`collective_log`): a step costs one
# all-reduce for the embedding, two a layer (attention, MLP), and one gather of the logits.

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
        ranks.collective_log(True)
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        return outputs, ranks.collective_log(False)  # each rank's seconds in each collective, in order
    finally:
        ranks.shutdown()


served = attempt("your layers at three ranks", serve_with_your_layers)
if served:
    yours, logs = served
    one = me.LLM.from_model(model, tokenizer, **knobs).generate(prompts, greedy, use_tqdm=False)
    for a, b in zip(one, yours):
        print(f"one process: {a.text[:60]!r}\nthree ranks: {b.text[:60]!r}")
    per_step = 1 + 2 * cfg.num_layers + 1
    print(f"each rank took part in {[len(log) for log in logs]} collectives, {per_step} a forward pass "
          f"({len(logs[0]) / per_step:.0f} passes); rank 0 spent {sum(logs[0]):.2f} s in them")
    print("your three ranks give the one-process engine's tokens:",
          [a.token_ids for a in one] == [b.token_ids for b in yours])

# %% [markdown]
# ## 6. Optional: an all-reduce of your own
# An all-reduce is two halves. In a ring's reduce-scatter each rank passes one chunk to its neighbour at each of
# p - 1 steps, adding what arrives, until each rank holds one chunk of the sum; the all-gather then passes the
# finished chunks round the same ring. Each rank sends 2(p - 1)/p of the tensor in all, however many ranks there
# are: why the ring suits large payloads. Here three threads of this process play the ranks, and `sendrecv` passes
# a copy through a queue; the grader runs the same code on three real ranks too.

# %%
import queue
import threading


class ThreadRank:
    """One of `size` ranks played by a thread: sendrecv puts a copy in the receiver's queue and takes its own."""

    def __init__(self, rank, size, boxes):
        self.rank, self.size, self.boxes, self.sent = rank, size, boxes, 0

    def sendrecv(self, send, to, recv, source):
        self.sent += send.numel()
        self.boxes[self.rank, to].put(send.clone())
        recv.copy_(self.boxes[source, self.rank].get(timeout=10))


def ring_on_threads(tensors):
    boxes = {(a, b): queue.Queue() for a in range(RANKS) for b in range(RANKS)}
    comms, errors = [ThreadRank(r, RANKS, boxes) for r in range(RANKS)], []

    def run(r):
        try:
            lab.ring_all_reduce(tensors[r], comms[r])
        except Exception as err:  # raised again below, on the notebook's thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(RANKS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    if errors:
        raise errors[0]
    return comms


activations = [torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(r)) for r in range(RANKS)]
want = sum(a.clone() for a in activations)
comms = attempt("the ring (optional)", lambda: ring_on_threads(activations))
if comms:
    error = max((a - want).abs().max().item() for a in activations)
    print(f"every rank holds the sum: max |diff| = {error:.1e}")
    print(f"elements each rank sent: {[c.sent for c in comms]} of {want.numel()} "
          f"(2(p-1)/p = {2 * (RANKS - 1) / RANKS:.2f} of the tensor)")

# %% [markdown]
# ## 7. Grade
# The grader prints a dot per passing test and, for each failing one, one line that says what to fix (a part not
# written yet: the line of its TODO and a hint). Its slow check, three real ranks running your layers together,
# runs last and says what it does before it starts.

# %%
import pytest

code = pytest.main([str(ROOT / "tests/labs/test_lab11.py"), "--impl=labs", "-q", "--no-header",
                    "-p", "no:cacheprovider", "--rootdir", str(ROOT)])
print("all tests pass: well done!" if code == 0 else "some tests still fail: read the messages above")
