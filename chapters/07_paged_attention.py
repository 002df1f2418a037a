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
# # 07 · PagedAttention: blocks instead of reservations
#
# The engine of chapter 04 gives every running request a *slot*: room for `max_model_len` tokens of keys
# and values, reserved when the request starts, because nobody knows how long its answer will be. Most
# answers are far shorter than the limit, so most of that memory is reserved and never written, and the
# number of slots, not the memory actually used, caps how many requests run at once.
#
# PagedAttention (Kwon et al., 2023, the paper behind vLLM) borrows the operating system's answer: cut the
# KV memory into fixed-size **blocks** (pages) of `block_size` tokens, give a request a new block only when
# its tokens fill the last one, and keep a **block table** per request listing its blocks in order, so
# attention can find position `p` in block `block_table[p // block_size]` at offset `p % block_size`. A
# request then wastes at most the unused tail of its last block.
#
# This chapter:
#
# 1. defines the two kinds of waste, internal and external fragmentation, and explores them on paper, with
#    pictures and sliders;
# 2. reads the block manager, the bookkeeping behind it (you build it yourself in lab 07);
# 3. watches the block pool of the real engine as requests arrive, grow, finish and get preempted;
# 4. serves one workload from the contiguous cache and from the paged one *at the same KV memory*;
# 5. makes the pool too small on purpose: requests are preempted and recomputed, and no output changes;
# 6. measures the block-size trade-off;
# 7. discusses the other way to preempt: swapping blocks to host memory; exercises close the chapter.

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
import inspect
import os

import torch

# The triton backend runs its kernels in Triton's interpreter without a GPU: set before triton is imported.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import display
from matplotlib.colors import ListedColormap
from tqdm.auto import tqdm

import mini_engine as me
from mini_engine import formulas, simulate
from mini_engine.bench.runs import ServingWorkload, run_engine
from mini_engine.bench.paging import time_decode_steps
from mini_engine.course.devices import default_device, fitting, pick, warm_up
from mini_engine.engine import LLM, LLMEngine
from mini_engine.course.hardware import describe_machine
from mini_engine.course.metrics import percentile
from mini_engine.paging import BlockManager
from mini_engine.course.widgets import draw_kv_layout, fragmentation_widget, kv_layout_legend

device = default_device()
dtype = me.default_dtype(device)
model, tok = me.load_model("smollm2-135m", device=device, dtype=dtype)
per_token = formulas.kv_bytes_per_token_for(model.config, model.dtype.itemsize)
warm_up(model, 512)  # one-time choices for steps of up to 512 tokens, made now, off the clock
print(describe_machine(device))
print(f"device: {device}, dtype: {dtype}; KV cache: {per_token / 1024:.0f} KiB per token")

# %% [markdown]
# ## 1. On paper: what reservation wastes
#
# Memory allocators waste memory in two ways, and both have names:
#
# * **Internal fragmentation**: memory handed to a request that the request never uses. It sits *inside* an
#   allocation, so nobody else can have it. A request that reserves 2,048 positions and ends after 300 wastes
#   1,748 of them.
# * **External fragmentation**: free memory that no request can use, because it lies *between* allocations
#   in pieces each too small for the next one. The free total is large enough; no single piece is.
#
# The textbook (chapter 00 introduces it) describes the second one: "A naive KV cache allocator reserves a
# contiguous memory block per sequence, sized for the maximum context that sequence might reach. Sequences
# arrive and finish at different times with different actual lengths, so the freed-up blocks are different
# sizes than the incoming ones need, classic memory fragmentation". At scale "the GPU ends up unable to admit
# new requests despite having plenty of total free memory". Its summary puts the total: paging "replaces
# contiguous max-length reservation, cutting waste from 60–80% to ≤15 tokens per request and buying ~8×
# concurrency". Kwon et al. (2023), who introduced PagedAttention, counted three kinds of waste in the
# serving systems before theirs: slots reserved for tokens a request will write later, internal
# fragmentation, and external fragmentation left by the allocator; only about 20 to 40% of the KV memory held
# tokens.
#
# A fixed KV budget (in token slots), a queue of requests whose final lengths follow some mix, and two ways
# to hold them. Contiguous: each request reserves `max_model_len` slots. Paged: each request holds
# ⌈length / block_size⌉ blocks. The simulator (`simulate.simulate_kv_budget`) admits requests in order until
# the next one does not fit, and counts. With a chat-like mix averaging 512 tokens against 2048-token
# reservations:

# %%
run = simulate.simulate_kv_budget(budget_tokens=64 * 2048, max_model_len=2048, block_size=16, mix="lognormal",
                                  mean_len=512)
print(f"contiguous: {run.contiguous_fit} requests at once, {100 * run.waste_fraction_contiguous:.0f}% of each "
      f"reservation empty on average (internal fragmentation)")
print(f"paged (16): {run.paged_fit} requests at once ({run.concurrency_multiple:.1f}x), "
      f"{run.waste_paged_tokens.mean():.1f} slots wasted per request ({100 * run.waste_fraction_paged:.1f}%), "
      f"at most {run.waste_paged_tokens.max()}")
sim_summary = (run.waste_fraction_contiguous, run.waste_fraction_paged, run.concurrency_multiple)

# %% [markdown]
# That is the first admission. Over time requests finish and others take their place, and the picture
# changes. `simulate.simulate_kv_layouts` serves a queue first come, first served from the same budget, each
# request writing one token a step, and lets us look at the memory at one moment. Two contiguous policies:
# every request reserves `max_model_len` (what this engine's contiguous cache does), or each reserves what it
# asks for, its prompt plus its `max_tokens`, drawn here as twice its final length. Below, a budget of 16
# reservations, at the moment the most free memory was stranded (or halfway, when none was):

# %%
picture = dict(budget_tokens=16 * 2048, max_model_len=2048, block_size=16, mix="lognormal", mean_len=512)
layouts = {reserve: simulate.simulate_kv_layouts(**picture, reserve=reserve) for reserve in simulate.RESERVATIONS}
fig, ax = plt.subplots(figsize=(11, 2.8))
rows = [("paged, blocks of 16", layouts["max_model_len"][1]), ("contiguous, max_model_len each",
        layouts["max_model_len"][0]), ("contiguous, as asked", layouts["per request"][0])]
for row, (name, lay) in enumerate(rows):
    halfway = np.searchsorted(lay.events[:, 0], lay.filling_until // 2)
    moment = lay.stranded.argmax() if lay.stranded.max() > 0 else halfway
    step_shown = int(lay.events[moment, 0])
    draw_kv_layout(ax, row, lay, step_shown)
    print(f"{name:<31} step {step_shown:4d}: {len(lay.snapshot(step_shown)[0]):3d} requests running, "
          f"{100 * lay.internal_waste_fraction:4.1f}% of held slots never filled, "
          f"{lay.stranded[moment]:5d} free slots stranded")
ax.set(yticks=range(len(rows)), xlim=(0, picture["budget_tokens"]), ylim=(-0.5, len(rows) + 0.4),
       xlabel="KV slots (tokens)", title="One KV budget at one moment under three layouts")
ax.set_yticklabels([name for name, _ in rows], fontsize=8)
ax.legend(handles=kv_layout_legend(), fontsize=7, loc="upper center", ncol=5, frameon=False)
plt.tight_layout()
plt.show()

# %% [markdown]
# Start with the middle strip. With `max_model_len` reserved for everyone, red dominates: most of every
# reservation is internal fragmentation. There is no external fragmentation, because every reservation has the
# same size, and a freed one always fits the next request exactly. Reserving what each request asks for (the
# top strip) cuts the red, but reservations now differ in size, requests leave in another order than they
# came, and the free slots end up in holes between reservations (dark), each too small for the request at the
# head of the queue although together they would hold it: external fragmentation, the textbook's "unable to
# admit new requests despite having plenty of total free memory". The paged strip (its blocks drawn side by
# side; in the pool they lie anywhere) has neither: a request wastes at most the tail of its last block, and
# any free block serves any request.
#
# The widget runs the same comparison on a budget you choose. Things to find: the waste figures of the
# textbook follow from how long answers are compared with the reservation (move `mean length` and
# `max_model_len`; `max_model_len` 4096 with the chat mix wastes nearly 90%); `reserve` "per request" trades
# internal for external fragmentation; a large block brings back internal fragmentation inside the last block.
# The requests running at once over time (right) come out lower than at the first admission above, for
# paging most of all: long requests stay longer, so at any moment the running requests are longer than the
# queue's average. That is why the textbook's "~8× concurrency" is a best case, and the 2 to 4× of its
# chapter the more common one.

# %%
display(fragmentation_widget())

# %% [markdown]
# ## 2. The block manager
#
# `mini_engine/paging.py` is pure Python, no tensors: a free list, one block table per request, and a
# reference count per block (how many tables hold it: one, until prefix caching in chapter 08 lets requests
# share full blocks). A prompt chunk takes the blocks its tokens fill, a decode a new block every
# `block_size` tokens, and a finished request gives them all back. Lab 07 asks you to write the same pieces.

# %%
print(inspect.getsource(BlockManager.append_slots))
bm = BlockManager(num_blocks=8, block_size=4)
bm.allocate("a", 6)             # a 6-token prompt: blocks 0 and 1
bm.allocate("b", 3)             # another request's 3 tokens: block 2
bm.append_slots("a", 9)         # "a" decodes to 9 tokens: its 9th needs a third block
print("block tables:", dict(bm.block_tables), "free:", list(bm.free_blocks))
print("slots of a's positions 0-8:", bm.slot_mapping("a", 0, 9), " (slot = block * 4 + offset)")

# %% [markdown]
# The engine now runs on this cache by default (`kv_cache="paged"`; the prefix caching it also turns on is
# chapter 08's subject, and this chapter's runs switch it off to see paging alone). The model writes each
# new token's keys and values to its slot (`slot_mapping`), and attention reads each request's context
# through its block table: on a GPU the Triton kernel `paged_decode_attention` follows the table itself; on
# a CPU the blocks are copied out first, or read in place where the optional CPU backend does that faster
# (section 6 measures the cost of a paged step).

# %%
llm = LLM.from_model(model, tok, max_model_len=512)
print(llm)
question = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
out = llm.generate([question], me.SamplingParams(max_tokens=20), use_tqdm=False)[0]
print(repr(out.text), f"| blocks free after the run: {llm.engine.num_free_blocks} of {llm.engine.num_kv_blocks}")

# %% [markdown]
# ## 3. Watching the pool
#
# A small pool on the real model: six requests arrive over the first steps, each answer longer than its
# prompt. `LLMEngine.block_pool()` says, between two steps, which request holds each block. When a running
# request needs a block and none is free, the engine **preempts** the most recently admitted request: its
# blocks go back to the pool, it goes back to the front of the queue, and when it is readmitted it
# recomputes its prompt and its output so far in one prefill.

# %%
pool_blocks, pool_block_size = 24, 8
rng = np.random.default_rng(7)
arrivals = {0: [(30, 24), (20, 36)], 2: [(26, 20)], 4: [(18, 30)], 7: [(24, 26)], 10: [(12, 34)]}  # (prompt, output)
engine = LLMEngine.from_model(model, tok, num_kv_blocks=pool_blocks, block_size=pool_block_size, max_num_seqs=6,
                              max_model_len=256, chunked_prefill_tokens=32, enable_prefix_caching=False)
history = []  # (snapshot after the step, ids finished in it)
step = 0
while engine.has_unfinished() or step <= max(arrivals):
    for prompt_len, out_len in arrivals.get(step, []):
        engine.add_request(rng.integers(1000, 20000, prompt_len).tolist(),
                           me.SamplingParams(max_tokens=out_len, ignore_eos=True))
    finished = [o.request_id for o in engine.step()]
    history.append((engine.block_pool(), finished))
    step += 1
print(f"{step} steps, {history[-1][0].num_preemptions} preemptions, "
      f"{history[-1][0].num_free_blocks} of {pool_blocks} blocks free at the end")


# %%
def pick_frames(history):
    """Steps worth a picture: the first admissions, the step before the first preemption, the preemption, the
    first finish, the preempted request back in the pool, and the end."""
    def first(test, start=0):
        return next((i for i in range(start, len(history)) if test(*history[i])), None)

    frames = {0: "requests arrive: each prompt takes the blocks it fills"}
    i_pre = first(lambda snap, _: snap.num_preemptions > 0)
    if i_pre is not None:
        before, after = history[i_pre - 1][0], history[i_pre][0]
        victim = min(set(after.waiting) - set(before.waiting))
        frames[i_pre - 1] = f"{before.num_free_blocks} block(s) free, requests still growing"
        frames[i_pre] = f"request {victim} preempted: its blocks are back in the pool"
        back = first(lambda snap, _: victim in snap.owners, i_pre)
        if back is not None:
            frames[back] = f"request {victim} readmitted: recomputing prompt + output"
    i_fin = first(lambda _, finished: bool(finished))
    frames[i_fin] = f"request {history[i_fin][1][0]} finished: its blocks are free"
    frames[len(history) - 1] = "all done: every block free"
    return sorted(frames.items())


def draw_pool(ax, snap, title, columns=8):
    """One block per cell: a colour per request, grey when free; the number is the request id."""
    owners = np.array([-1 if o is None else o for o in snap.owners])
    colours = ListedColormap(["#dddddd"] + [plt.cm.tab10(i % 10) for i in range(10)])
    grid = np.where(owners < 0, 0, owners % 10 + 1).reshape(-1, columns)
    ax.imshow(grid, cmap=colours, vmin=0, vmax=10)
    for b, owner in enumerate(owners):
        if owner >= 0:
            ax.text(b % columns, b // columns, str(owner), ha="center", va="center", fontsize=8, color="white")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(f"step {snap.step}: {title}", fontsize=8)


frames = pick_frames(history)
fig, axes = plt.subplots(2, (len(frames) + 1) // 2, figsize=(12, 5))
for ax, (i, title) in zip(axes.flat, frames):
    draw_pool(ax, history[i][0], title)
for ax in axes.flat[len(frames):]:
    ax.axis("off")
fig.suptitle(f"{pool_blocks} blocks of {pool_block_size} positions; each colour one request, grey free")
plt.tight_layout()
plt.show()

# %% [markdown]
# A request's blocks are scattered over the pool (whatever was free when it needed one), which is exactly
# what the block table is for. Nothing is reserved ahead: a request holds the blocks its tokens fill.
#
# ## 4. The same memory, two caches
#
# The serving workload of chapter 04 (random prompts, `ignore_eos`, lengths uniform in a range, every
# request queued at once), served twice with the same KV memory: the contiguous cache as `slots` slots of
# `max_model_len` positions, and the paged cache as the same bytes in blocks of 16, admitting requests as
# long as their blocks fit.

# %%
max_len = pick(cpu=512, gpu=2048, device=device)
# The most slots whose cache fits this device's free memory (`fitting` prints any size it leaves out).
slots = fitting(pick(cpu=[4], gpu=[16, 8, 4], device=device),
                lambda s: formulas.kv_cache_bytes_for(model, max_len, s, model.dtype.itemsize), device, "slots")[0]
work = ServingWorkload.uniform(pick(cpu=16, gpu=256, device=device), 8, pick(cpu=56, gpu=256, device=device),
                               vocab=model.config.vocab_size)
num_blocks = slots * max_len // 16
run_engine(model, tok, "continuous", ServingWorkload.uniform(2, 4, 8, seed=1), 2)  # warm-up, not measured
serving = {}
for kv_cache in tqdm(["contiguous", "paged"], desc="serving"):
    serving[kv_cache] = run_engine(
        model, tok, "continuous", work, slots if kv_cache == "contiguous" else None, name=kv_cache,
        kv_cache=kv_cache, max_model_len=max_len, enable_prefix_caching=False,
        **({"num_kv_blocks": num_blocks} if kv_cache == "paged" else {}))
print(f"{work.name}: KV memory {serving['paged'].kv_bytes / 2**20:.0f} MiB for both ({slots} slots x {max_len} "
      f"positions = {num_blocks} blocks of 16)")
print(f"{'cache':>10} {'peak reqs':>9} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}")
for name, r in serving.items():
    print(f"{name:>10} {r.peak_running:9d} {r.tok_s:7.1f} {percentile(r.ttft, 50):8.2f}s {percentile(r.ttft, 99):8.2f}s "
          f"{percentile(r.tpot, 50) * 1e3:7.0f}ms {percentile(r.tpot, 99) * 1e3:7.0f}ms")
c, p = serving["contiguous"], serving["paged"]
print(f"paged / contiguous: {p.peak_running / c.peak_running:.1f}x the requests at once, {p.tok_s / c.tok_s:.2f}x "
      f"the tokens/s, TTFT p50 {percentile(c.ttft, 50) / percentile(p.ttft, 50):.1f}x lower")

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.2))
left.bar(list(serving), [r.peak_running for r in serving.values()], color=["C3", "C2"])
left.set(ylabel="requests", title="peak concurrent requests")
right.bar(list(serving), [r.tok_s for r in serving.values()], color=["C3", "C2"])
right.set(ylabel="tokens/s", title=f"throughput, same {serving['paged'].kv_bytes / 2**20:.0f} MiB of KV")
plt.tight_layout()
plt.show()

# %% [markdown]
# The contiguous cache can never run more than its slots, however short the requests. The paged pool runs
# every request whose blocks fit, so the batch is larger and each step's read of the weights is shared by
# more requests: that is where the throughput comes from, and the shorter queue is where the time to first
# token goes down. Each running request now decodes a little more slowly (TPOT), because each step carries
# more requests.

# %% [markdown]
# ## 5. A pool too small: preemption
#
# Now the same requests with a pool far smaller than they need together. Some sample (temperature 0.8,
# each with its own seed), the others are greedy. Every request that gets preempted drops its blocks and
# later recomputes; its random stream is kept, so its output must be exactly the one it gets when nothing is
# preempted. Both runs use the model in fp32: in bf16 a step of another shape (a smaller prefill chunk, a
# different batch) rounds differently, enough to flip a near-tie (chapter 06) and hide what is checked here.

# %%
n_pre = pick(cpu=10, gpu=128, device=device)
prompts = work.prompts[:n_pre]
params = [me.SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.8 if i % 3 == 0 else 0.0, seed=i)
          for i, n in enumerate(work.output_lens[:n_pre])]
small = pick(cpu=12, gpu=96, device=device)
exact = model if model.dtype == torch.float32 else copy.deepcopy(model).float()
roomy_llm = LLM.from_model(exact, tok, num_kv_blocks=num_blocks, max_model_len=max_len, enable_prefix_caching=False)
tight_llm = LLM.from_model(exact, tok, num_kv_blocks=small, max_model_len=max_len, chunked_prefill_tokens=64,
                           enable_prefix_caching=False)
roomy = roomy_llm.generate(prompts, params, use_tqdm=False)
tight = tight_llm.generate(prompts, params, use_tqdm=False)
preempted = [o for o in tight if o.metrics.num_preemptions]
identical = all(a.token_ids == b.token_ids for a, b in zip(tight, roomy))
print(f"pool of {small} blocks (vs {num_blocks}): {sum(o.metrics.num_preemptions for o in tight)} preemptions "
      f"of {len(preempted)} requests ({sum(params[o.request_id - tight[0].request_id].temperature > 0 for o in preempted)}"
      f" of them sampling); outputs identical to the roomy run: {identical}")
print(f"blocks free afterwards: {tight_llm.engine.num_free_blocks} of {tight_llm.engine.num_kv_blocks}")

# %% [markdown]
# Preemption trades time for memory: the preempted requests compute their tokens twice, and the steps that
# recompute them are prefill steps. The engine keeps the damage small: it preempts only when a step needs a
# block and none is free, a prompt chunk first shrinks to the free blocks, and a waiting request is admitted
# only once the pool can hold its whole prompt and still leave one free block for each running request to
# grow into (without that headroom, chapter 04's workload on four slots' memory saw ten times the
# preemptions).
#
# ## 6. The block size
#
# Small blocks waste less (at most `block_size − 1` positions per request), so more requests fit; large
# blocks mean fewer, larger pieces to look up (and to copy, where the copy wins), and a longer unused tail to
# read past. The same workload again, on a pool of a quarter of section 4's memory (so that the pool, not the
# queue, limits the batch), at five block sizes: the positions wasted follow from the requests' lengths; the
# requests that ran at once, the throughput and the cost of one decode step (a batch at a long context,
# through shuffled block tables of each size, against the contiguous cache) are measured.

# %%
sizes = [1, 4, 16, 64, 256]
lengths = np.array([len(p) + n for p, n in zip(work.prompts, work.output_lens)])
sweep_tokens = slots * max_len // 4
sweep = {b: run_engine(model, tok, "continuous", work, None, name=f"block {b}", num_kv_blocks=sweep_tokens // b,
                       block_size=b, max_model_len=max_len, enable_prefix_caching=False)
         for b in tqdm(sizes, desc="block sizes")}
context = pick(cpu=512, gpu=2048, device=device)
batch = fitting(pick(cpu=[8], gpu=[32, 16, 8], device=device),  # a contiguous cache and a paged pool at once
                lambda b: 2 * formulas.kv_cache_bytes_for(model, context, b, model.dtype.itemsize), device, "batch")[0]
step_s = time_decode_steps(model, batch, context, block_sizes=sizes)
block_rows = [(b, float(formulas.paged_waste_tokens(lengths, b).mean()), sweep[b].peak_running, sweep[b].tok_s,
               step_s[b] / step_s["contiguous"]) for b in sizes]
print(f"pool of {sweep_tokens} positions; decode step: {batch} sequences x {context} positions, contiguous "
      f"{step_s['contiguous'] * 1e3:.1f} ms")
for b, waste, peak, tok_s, ratio in block_rows:
    print(f"block {b:4d}: {waste:6.1f} positions wasted per request, {peak:3d} requests at once, {tok_s:6.1f} tok/s, "
          f"decode step {step_s[b] * 1e3:6.1f} ms ({ratio:.2f}x contiguous)")

fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
for ax, column, title in ((axes[0], 1, "positions wasted per request"), (axes[1], 2, "requests at once"),
                          (axes[2], 4, f"decode step, paged / contiguous\n{batch} sequences x {context} positions")):
    ax.plot(sizes, [r[column] for r in block_rows], "o-")
    ax.set(xscale="log", xlabel="block size", title=title)
axes[2].axhline(1, color="k", lw=0.8)
plt.tight_layout()
plt.show()

# %% [markdown]
# What the last panel means for paging: a paged step reads the same keys and values as a contiguous one, only
# from blocks scattered through the pool. Where it costs more, the difference is the price of finding those
# blocks through the block table, which is what an attention kernel that reads them in place keeps small (the
# GPU's Triton kernel does; appendix [A1](A1_fast_on_a_cpu.ipynb) shows the CPU's). Paging is not a speed-up
# of the step: its gain is the memory it does not reserve, measured earlier in this chapter.
#
# ## 7. The other preemption: swapping to host memory
#
# Recompute is not the only way to free a request's blocks. vLLM also offered **swapping**: copy the
# preempted request's blocks to CPU memory, and copy them back when it resumes, so nothing is computed
# twice. Which is cheaper depends on sizes. Swapping moves every KV byte of the request across the PCIe bus
# twice (SmolLM2 in bf16 keeps 22.5 KiB per token, about 23 MB for a 1,000-token request: the cell below
# prices it), in many small transfers when blocks are small; recompute costs one prefill of the request's
# tokens, which a GPU runs at high arithmetic intensity. The PagedAttention paper measured swapping to be the
# slower of the two with small blocks and the two close at 16–64 tokens per block; recompute also needs no
# host memory pool and no bookkeeping of where each block went, and vLLM's current engine preempts by
# recompute only.
#
# This course's engine recomputes, for those reasons and one more: on a CPU the "device" memory already is
# host memory, so there is nowhere cheaper to swap to.

# %%
bf16_token = formulas.kv_bytes_per_token_for(model.config, 2)  # bf16 whatever this machine runs in
swap_request = 1000 * bf16_token
print(f"SmolLM2's keys and values in bf16: {bf16_token:,.0f} B = {bf16_token / 1024:.1f} KiB per token; "
      f"a 1,000-token request: {swap_request / 1e6:.1f} MB")
# PCIe 4 x16 moves 31.5 GB/s each way by specification (16 GT/s x 16 lanes, 128b/130b); ~25 GB/s is typical.
for label, bandwidth in (("the PCIe 4 x16 specification", 31.5e9), ("a typical measured PCIe 4 x16", 25e9)):
    print(f"swapped out and back in at {label}'s {bandwidth / 1e9:.1f} GB/s per direction: "
          f"{2 * swap_request / bandwidth * 1e3:.1f} ms at best, before the cost of many small copies")

# %% [markdown]
# ## What you measured

# %%
summary = [
    ("simulator, chat mix vs 2048 reservations: waste contiguous / paged",
     f"{100 * sim_summary[0]:.0f}% / {100 * sim_summary[1]:.1f}%"),
    ("simulator: requests at once, paged / contiguous", f"{sim_summary[2]:.1f}x"),
    ("simulator, reserving as asked: free slots stranded at worst (external)",
     f"{layouts['per request'][0].stranded.max()} of {picture['budget_tokens']}"),
    (f"pool picture: {pool_blocks} blocks of {pool_block_size}", f"{len(history)} steps, "
     f"{history[-1][0].num_preemptions} preemptions, {history[-1][0].num_free_blocks} blocks free at the end"),
    *((f"{work.name}, {name}: peak requests, tok/s", f"{r.peak_running}, {r.tok_s:.1f}") for name, r in serving.items()),
    *((f"{name}: TTFT p50 / p99, TPOT p50 / p99", f"{percentile(r.ttft, 50):.2f} / {percentile(r.ttft, 99):.2f} s, "
       f"{percentile(r.tpot, 50) * 1e3:.0f} / {percentile(r.tpot, 99) * 1e3:.0f} ms") for name, r in serving.items()),
    ("paged / contiguous at equal memory: concurrency, tok/s",
     f"{p.peak_running / c.peak_running:.1f}x, {p.tok_s / c.tok_s:.2f}x"),
    (f"pool of {small} blocks: preemptions, outputs identical",
     f"{sum(o.metrics.num_preemptions for o in tight)}, {identical}"),
    *((f"block {b}: waste per request, requests at once, tok/s, step vs contiguous",
       f"{w:.1f} positions, {peak}, {tok_s:.1f}, {ratio:.2f}x") for b, w, peak, tok_s, ratio in block_rows),
]
width = max(len(k) for k, _ in summary)
for k, v in summary:
    print(f"{k:<{width}}  {v}")

# %% [markdown]
# ## Exercises: predict, then run
#
# Write your prediction down before you run each cell; the answer under it says what you should see and why.
# Each cell takes a few seconds.
#
# **1. One request's blocks.** A request with a 44-token prompt has run its prefill and 6 decode steps. How
# many blocks does it hold with blocks of 4, 16 and 64 positions, and how many of their positions are empty?
# Work it out with `formulas.blocks_needed` and `formulas.paged_waste_tokens`, then read its block table off
# the engine. How many positions would a contiguous slot of `max_model_len=256` leave empty?

# %%
ex_rng = np.random.default_rng(0)
P, decode_steps = 44, 6
one_prompt = ex_rng.integers(1000, 20000, P).tolist()
for b in (4, 16, 64):
    one = LLMEngine.from_model(model, tok, num_kv_blocks=256 // b, block_size=b, max_num_seqs=1, max_model_len=256,
                               enable_prefix_caching=False)
    rid = one.add_request(one_prompt, me.SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(1 + decode_steps):  # the prefill, then the decode steps
        one.step()
    snap = one.block_pool()
    held, written = len(snap.block_tables[rid]), snap.num_computed[rid]
    print(f"blocks of {b:2d}: {written} positions written into {held:2d} of them, {held * b - written:2d} positions "
          f"empty (formula: {formulas.blocks_needed(P + decode_steps, b)} blocks, "
          f"{formulas.paged_waste_tokens(P + decode_steps, b)} empty)")
    one.abort_request(rid)  # the request is not needed further: its blocks go back to the pool
print(f"a contiguous slot of 256 positions: {256 - written} empty")

# %% [markdown]
# <details><summary>Answer</summary>
#
# The prefill writes the 44 prompt positions and each decode step one more: 50. The request holds
# ⌈50 / block_size⌉ blocks: 13 of 4 (2 positions empty), 4 of 16 (14 empty), 1 of 64 (14 empty). Only the
# tail of the last block is ever empty, so the waste is always under one block, and it depends on where the
# length falls inside a block, not on the length: blocks of 16 and of 64 waste the same here. The contiguous
# slot holds all 256 positions from the first step, 206 of them empty, and the emptier the longer
# `max_model_len` is. Smaller blocks waste less; section 6 measured what they cost instead.
# </details>
#
# **2. Fragmentation in the pool.** Section 3's pool had blocks of 8. Between two steps, how many positions of
# a running request's blocks are empty, on average over that run? And how many would a contiguous slot of
# `max_model_len=256` leave empty? The snapshots recorded in `history` hold every running request's block
# table and the positions it has written.

# %%
pairs = [(len(snap.block_tables[r]) * snap.block_size, n)  # (positions held, positions written)
         for snap, _ in history for r, n in snap.num_computed.items() if r in snap.block_tables]
empty = np.array([held - n for held, n in pairs])
print(f"{len(pairs)} (step, request) pairs: {empty.mean():.2f} positions empty per request on average, "
      f"predicted (block_size - 1) / 2 = {(pool_block_size - 1) / 2}; "
      f"{100 * empty.sum() / sum(held for held, _ in pairs):.0f}% of the positions held")
print(f"a contiguous slot of 256: {np.mean([256 - n for _, n in pairs]):.0f} positions empty per request on average")

# %% [markdown]
# <details><summary>Answer</summary>
#
# Close to 3.5, that is (8 − 1) / 2. A request's length grows by one position a step (or by a chunk while it
# prefills), so the filled part of its last block runs through 1, 2, …, 8 positions again and again, and the
# empty tail takes each value from 7 down to 0 about equally often: (block_size − 1) / 2 on average, whatever
# the requests' lengths. That is all the paged cache wastes. Here the requests are short, a few blocks each,
# so even 3.5 positions are a noticeable share of what they hold; for requests of a thousand tokens it is a
# fraction of a percent. The contiguous slot wastes `max_model_len` minus the length, over two hundred
# positions per request here, and more for every position `max_model_len` grows.
# </details>
#
# **3. Preemption by hand.** Two greedy requests arrive together, each with an 8-token prompt and 8 new
# tokens, on a pool of 6 blocks of 4 positions, then on a pool of 12. Predict for each pool: is a request
# preempted, which one, after how many written positions, and how many positions does the engine compute in
# all? Are the outputs the same?

# %%
pair = [ex_rng.integers(1000, 20000, 8).tolist() for _ in range(2)]
pair_outputs = {}
for blocks in (6, 12):
    two = LLMEngine.from_model(model, tok, num_kv_blocks=blocks, block_size=4, max_num_seqs=2, max_model_len=64,
                               enable_prefix_caching=False, record_trace=True)
    rids = [two.add_request(p, me.SamplingParams(max_tokens=8, ignore_eos=True)) for p in pair]
    before, outputs, events = two.block_pool(), {}, []
    while two.has_unfinished():
        outputs.update((o.request_id, o.token_ids) for o in two.step())
        after = two.block_pool()
        # A request that was running before the step and is queued after it was preempted in the step.
        events += [f"request {r} preempted in step {after.step} after {before.num_computed[r]} positions"
                   for r in after.waiting if r in before.num_computed]
        before = after
    computed = sum(n for step_record in two.trace for _, _, n, _ in step_record.chunks)
    pair_outputs[blocks] = [outputs[r] for r in rids]
    print(f"{blocks:2d} blocks: {computed} positions computed in {len(two.trace)} steps; "
          + ("; ".join(events) or "nobody preempted"))
print(f"same outputs on both pools: {pair_outputs[6] == pair_outputs[12]}")

# %% [markdown]
# <details><summary>Answer</summary>
#
# Each request writes 15 positions (its 8 prompt tokens and 7 of its new tokens: the last token is sampled
# but never fed back), so 4 blocks; the two need 8 blocks together. On 12 blocks nothing is preempted and the
# engine computes 2 × 15 = 30 positions. On 6 blocks the two grow in step: after 12 positions each they hold 3
# blocks each, the whole pool, and both need a fourth for the next decode. The older request makes room by
# preempting the newest, request 1, which drops its 12 written positions. Request 0 finishes; request 1 is
# readmitted once the pool can hold its prompt and its output so far (8 + 5 tokens), recomputes them in one
# prefill step and decodes the rest: 15 + 12 + 15 = 42 positions, 12 of them computed twice. Those 12 took five
# steps the first time and one step to recompute, since a prefill computes many positions in one pass. The
# outputs are the same: recompute rebuilds exactly the keys and values that were dropped. Preempting the
# newest means the oldest request always makes progress, so two requests cannot keep preempting each other.
# </details>
#
# **Lab.** [Lab 07](../labs/lab07_notebook.ipynb) has you build this chapter's paging yourself: the block
# allocator, the block tables and their slot mapping, attention that reads keys and values through a block
# table, and preemption by recompute.
