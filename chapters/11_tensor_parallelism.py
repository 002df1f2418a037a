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
# # 11 · Tensor parallelism: one model split across ranks
#
# Every chapter so far ran the model in one process on one device. A serving engineer meets the next problem the
# day a model no longer fits: Llama-3-70B holds 140 GB of bf16 weights, and one H100 has 80 GB. Even when it fits,
# one device reads every weight once per decode step (chapter 02), so a step takes at least model bytes / one
# device's bandwidth. Split every weight matrix across p devices and each device holds and reads 1/p of the bytes:
# the model fits, and the weight-bound part of a step shrinks by p. The price is communication: the devices must
# exchange partial results inside every layer, over whatever joins them: **NVLink** (NVIDIA's direct GPU-to-GPU
# links, through NVSwitch chips on 8-GPU A100 and H100 boards), **PCIe** (the bus that joins a GPU to its host
# computer, and so to other GPUs in that host), or, between machines, **InfiniBand** or **Ethernet** network cards.
#
# This chapter builds that split, Megatron-LM's tensor parallelism (Shoeybi et al. 2019), into our engine and
# serves the real model with it, `LLM("smollm2-135m", tensor_parallel_size=3)`, as vLLM spells it. Three ranks
# are three real processes joined by `torch.distributed`.
#
# 1. why and how a linear layer is split: column-parallel, then row-parallel, one all-reduce a sub-layer;
# 2. what is split and what is replicated, and the memory each rank holds, measured;
# 3. the communication a step needs, as a formula with a widget: which all-reduce algorithm, on which GPUs and
#    links, and when splitting pays;
# 4. this machine's all-reduce, measured over payload sizes and fitted as latency + bytes / bandwidth;
# 5. one rank against three on the same requests: the same tokens, and the step times explained by the formula;
# 6. the memory win: each rank holds a share of the KV cache, so the same memory holds a larger batch, measured;
# 7. what an all-reduce is made of: a reduce-scatter and an all-gather, on the real ranks; and sequence
#    parallelism, which keeps the two halves apart to split the activations;
# 8. overlapping an all-reduce with compute that does not need it, measured;
# 9. vLLM's `tensor_parallel_size`, and pipeline parallelism measured: stages, micro-batches and the bubble; when
#    to prefer which, and why serving engines combine them; what you measured; exercises.
#
# Words this chapter uses. A **rank** is one of the cooperating processes, numbered 0 to p − 1 (here rank 0 is the
# engine's own process and the others are started for it); on GPUs each rank drives one GPU. A **collective** is an
# operation every rank calls together and that only completes when all have called it: an **all-reduce** adds one
# tensor from each rank and leaves the sum on every rank. Its **payload** is the bytes of that tensor on one rank.
# A **hop** is one message from a rank to its neighbour; an algorithm that needs many hops pays a link's latency
# many times. A **sub-layer** is one of the two halves of a transformer layer, attention and the MLP, each ending
# in one all-reduce when split; a **block** in this chapter is, as in chapters 07 and 08, a block of the KV cache.

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

import matplotlib.pyplot as plt
import numpy as np
import torch

from IPython.display import display
from tqdm.auto import tqdm

import mini_engine as me
from mini_engine import formulas
from mini_engine.config import PRESETS
from mini_engine.course import interconnects, widgets
from mini_engine.course.formulas import human_bytes
from mini_engine.course.ring_drawing import ring_all_reduce_image
from mini_engine.course.tp_drawing import tensor_parallel_split_image
from mini_engine.parallel import ColumnParallelLinear, RowParallelLinear, rank_config, shard_model
from mini_engine.parallel.collectives import check_collectives, collective_seconds, overlap_seconds
from mini_engine.parallel.layers import check_tensor_parallel_size, split_columns, split_gate_up
from mini_engine.parallel.measure import (all_reduce_seconds, decode_step_times, fit_latency_bandwidth,
                                          kv_blocks_within, largest_batch)
from mini_engine.parallel.pipeline import PipelineModel, format_bubbles, measure_bubble
from mini_engine.parallel.sequence import residual_bytes

RANKS = 3
# The ranks exchange results through a collective library: NCCL (NVIDIA's, between GPUs) or gloo (the CPU library
# PyTorch ships, which sends over TCP). NCCL wants one GPU per rank: with at least RANKS GPUs the ranks run there;
# with fewer (one on Colab) or none, they run on the CPU, over gloo.
device = "cuda" if torch.cuda.device_count() >= RANKS else "cpu"
print(f"ranks run on: {device} ({'NCCL' if device == 'cuda' else 'gloo over 127.0.0.1'}); "
      f"{torch.get_num_threads()} threads in this process")
model, tokenizer = me.load_model("smollm2-135m", device=device, dtype="float32", cpu_backend=False)
cfg = model.config
print(f"SmolLM2-135M: {cfg.num_heads} query heads, {cfg.num_kv_heads} KV heads, MLP width {cfg.intermediate_size}, "
      f"vocabulary {cfg.vocab_size}: each divisible by {RANKS}")

# %% [markdown]
# ## 1. Column, then row
#
# A linear layer computes y = x Wᵀ with W of shape [out, in] (how PyTorch's `nn.Linear` stores it). The names of
# the two cuts come from the Megatron-LM paper, which writes the same layer as Y = XA with A = Wᵀ of shape
# [in, out]: a *column* of A is one output, which in W is a *row*. So:
#
# - **column-parallel** (A's columns): cut W's rows, the outputs. Rank r computes y_r = x W_rᵀ, its slice of y,
#   from the whole x. No rank needs another's result: no communication.
# - **row-parallel** (A's rows): cut W's columns, the inputs. Rank r needs only its slice of x and computes a
#   *partial* y; the full y is the sum of the ranks' partials: one **all-reduce** (a sum that every rank receives).
#
# The trick is to chain them. The MLP's gate and up projections are column-parallel: rank r gets its third of
# the 1,536 MLP columns. The MLP's activation, SwiGLU, is silu(gate) × up, element by element (silu(z) =
# z · sigmoid(z)), so rank r can apply it to its own third of gate and up. That third
# is exactly the input slice the row-parallel down projection wants. So the whole MLP costs one all-reduce, at
# its end. Attention works the same way, cut by heads: q, k and v are column-parallel (rank r owns 3 of the 9
# query heads and the 1 KV head they read), attention runs per head with no exchange, and o_proj is
# row-parallel. Two all-reduces a layer, 60 for the model's 30 layers; the embedding, split by vocabulary rows,
# adds one more, and the logits, split the same way, one gather at the end: 61 all-reduces and a gather a step
# (the formula below keeps the 2L that grow with the model). The picture below is the whole cut, drawn
# from this model's sizes: blue is a rank's share of a split weight, grey what every rank holds whole, green the
# work a rank does on its own share, orange the collectives that join the ranks.

# %%
tensor_parallel_split_image(cfg, RANKS)

# %% [markdown]
# We check it on one layer's MLP, every rank's share run in this one process:

# %%
mlp = model.layers[0].mlp
x = torch.randn(4, cfg.hidden_size, device=device)
with torch.no_grad():
    full = mlp(x)
    partials = []
    for r in range(RANKS):
        gate_up = ColumnParallelLinear(split_gate_up(mlp.gate_up_proj.weight, r, RANKS))  # [2 x 512, 576]
        down = RowParallelLinear(split_columns(mlp.down_proj.weight, r, RANKS))            # [576, 512]
        gate, up = gate_up(x).chunk(2, dim=-1)
        partials.append(down(torch.nn.functional.silu(gate) * up))  # rank r's partial sum: no exchange so far
    print(f"rank shares: gate_up {tuple(gate_up.weight.shape)}, down {tuple(down.weight.shape)}")
    print(f"max |sum of the {RANKS} partials - full MLP| = {(sum(partials) - full).abs().max().item():.2e}"
          " (the all-reduce is this sum)")
    print(f"max |one partial - full MLP|     = {(partials[0] - full).abs().max().item():.2e}")

# %% [markdown]
# ## 2. What is split, what is replicated, and the memory a rank holds
#
# Split: q/k/v and o_proj (by heads), gate/up and down (by MLP columns), the embedding table and the LM head
# that shares it (by vocabulary: a rank looks up only the ids in its third of the 49,152 and the others give
# zeros, one more all-reduce; and each rank computes the logits of its third, gathered on rank 0, which samples).
# Replicated: the two RMSNorms of each layer and the final one (576 values each: splitting them would cost an
# exchange to save nothing), the RoPE tables, and the activations between sub-layers, which every rank holds whole.
#
# The KV cache splits with the heads: each rank keeps its one KV head's keys and values for every block. The block
# tables, which say which block holds which positions, are decided on rank 0 and shipped with every step, so they
# are the same on every rank. `shard_model` cuts a copy of the model the way each rank does:

# %%
def param_bytes(m):
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in m.parameters()}.values())


full_bytes = param_bytes(model)
shard = shard_model(copy.deepcopy(model), 0, RANKS)
rank_bytes = param_bytes(shard)
norm_bytes = sum(p.numel() * p.element_size() for n, p in shard.named_parameters() if "norm" in n)
kv_full = formulas.kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4)
kv_rank = formulas.kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads // RANKS, cfg.head_dim, 4)
print(f"weights, one process: {human_bytes(full_bytes)}; one rank of {RANKS}: {human_bytes(rank_bytes)} "
      f"({rank_bytes / full_bytes:.1%}; replicated norms: {human_bytes(norm_bytes)})")
print(f"KV cache per token: one process {human_bytes(kv_full)}, one rank {human_bytes(kv_rank)}")
del shard

# %% [markdown]
# ## 3. When does it pay? Communication against compute
#
# A decode step at batch b computes, on each of p ranks, 1/p of the products; its time falls as 1/p while the step
# is bound by reading weights. Each of its 2L all-reduces carries the sub-layer's output, b × h values: 2·h·b bytes in
# 16 bits, a few KB for one request. So
#
#   t_step ≈ t_one GPU / p + 2L · t_all-reduce(2·h·b bytes, p)
#
# The first term shrinks with p, because each rank computes on a device of its own; ranks that share one device
# share its compute too (section 5 meets this). The second term does not shrink, and what it costs depends on the
# **algorithm**, each a latency per collective plus bytes over the link's bandwidth B (one GPU's, each way):
#
# - **ring** (NCCL's default for large payloads): the ranks pass slices around a ring, a reduce-scatter then an
#   all-gather (section 7), 2(p − 1) steps that each pay a hop's latency: base + 2(p − 1) · hop + 2(p − 1)/p · n / B.
#   It moves the fewest bytes, and pays the most latencies.
# - NCCL runs the ring under one of three **protocols**. *Simple* waits for a whole chunk and a memory fence
#   before each hop; *LL* (low latency) sends 8-byte words that each carry 4 bytes of data and a 4-byte flag, so the
#   receiver knows data has landed without a fence: hops far cheaper, at half the bandwidth; *LL128* does the same on
#   128-byte lines (NVLink only). NCCL prices every pair from a model in its source and runs the cheapest.
# - **NVLS** (NVLink SHARP, on H100 boards): the NVSwitch itself adds the payloads, each GPU sends n and reads the
#   sum once: latency + n / (0.85 B) (NCCL's model takes 85% of the link for it).
# - **one-shot** (vLLM's custom all-reduce for payloads under 256-512 KB on NVLink, as vLLM shipped it until its
#   symmetric-memory all-reduce of late 2025 took over part of that range on H100s): every GPU reads every other
#   GPU's whole buffer at once, over the NVSwitch, and sums it itself: one latency, flat in p, + (p − 1) · n / B.
#
# The cell prints the constants: NCCL's model, quoted from its `tuning.cc`, and vLLM's kernel as SGLang's developers
# timed it (`mini_engine/course/interconnects.py` cites each source). Then it prices one all-reduce of decode's
# payload by each algorithm on each system, at 4 ranks, and names the fastest.

# %%
print("NCCL's model (src/graph/tuning.cc), µs: base latency per collective", interconnects.NCCL_BASE_US)
for kind, hops in interconnects.NCCL_HOP_US.items():
    print(f"  hop latency over {kind:8s}", hops)
print("  NVLS latency", interconnects.NCCL_NVLS_US, "µs; share of the bandwidth by protocol",
      {k: round(v, 3) for k, v in interconnects.NCCL_PROTOCOL_BANDWIDTH.items()})
print("vLLM's custom all-reduce of 4 KiB, measured, µs:",
      {gpu: {p: t[4096] for p, t in table.items()} for gpu, table in interconnects.VLLM_CUSTOM_ALL_REDUCE_US.items()})
print(f"  on GPUs {interconnects.VLLM_CUSTOM_SIZES} of one NVLink node, one-shot below 256-512 KiB, "
      f"payloads under {interconnects.VLLM_CUSTOM_MAX_BYTES // 2**20} MiB")
decode_payload = 8 * PRESETS["llama-70b-gqa"].hidden_size * 2  # Llama-70B, batch 8, 16-bit
print(f"\none all-reduce of {decode_payload // 1024} KiB (Llama-70B's sub-layer output at batch 8) among 4 GPUs:")
for name, system in interconnects.SYSTEMS.items():
    options = interconnects.all_reduce_options(system, decode_payload, 4)
    best = interconnects.all_reduce(system, decode_payload, 4)
    print(f"  {name:34s} " + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in options.items())
          + f" µs -> {best.algorithm}")

# %% [markdown]
# At decode's payloads every system's cheapest is a low-latency choice (NCCL's LL protocol, or vLLM's one-shot), about ten microseconds
# on NVLink; the ring's Simple protocol, with its 2(p − 1) full hops, costs about three times as much there. The
# bandwidths are the links' data-sheet peaks, so large payloads come out optimistic. The cell compares the model
# with the measurements it took its latencies from:

# %%
h100 = interconnects.SYSTEMS["H100 × NVLink 4 (NVSwitch)"]
for p, table in interconnects.VLLM_CUSTOM_ALL_REDUCE_US["H100"].items():
    row = ", ".join(f"{n // 1024 if n >= 1024 else n}{'K' if n >= 1024 else ' B'}: "
                    f"{t:.1f}/{interconnects.all_reduce(h100, n, p).seconds * 1e6:.1f}" for n, t in table.items())
    print(f"H100, {p} GPUs, vLLM measured / model µs  {row}")

# %% [markdown]
# Up to 32 KB the model is within a couple of microseconds of the measurements; at a megabyte it is several times
# too fast: the measured kernel ran without CUDA graphs and copied its input into a shared buffer first, and no
# kernel reaches a link's data-sheet peak. Decode's payloads sit at the left of that table, where the latency is
# the cost.
#
# Move the sliders. The dropdown picks GPUs and their link together: T4s in one host over PCIe, A100s and H100s on
# NVLink, or H100s in two machines over InfiniBand or Ethernet, each with its own compute and memory bandwidth for
# the one-GPU step (the roofline of chapter 02). The right panel prices one all-reduce by every algorithm over
# payload sizes, with the dot at this step's payload.

# %%
widgets.tensor_parallel_widget()

# %% [markdown]
# Two cases the widget shows, computed here: a 70B model at batch 8 on H100s, and SmolLM2 at batch 1 on each system.

# %%
for p in (2, 4, 8):
    st = interconnects.tensor_parallel_decode(h100, "llama-70b-gqa", 8, p)
    print(f"llama-70b-gqa, batch 8, {p} H100s on NVLink: {st.speedup:.2f}x one GPU's speed, "
          f"{st.communication_share:.0%} of the step communicating ({st.all_reduce.algorithm})")
print(f"smollm2-135m: {human_bytes(formulas.weight_bytes('smollm2-135m'))} of 16-bit weights, "
      f"{2 * cfg.num_layers} all-reduces of {cfg.hidden_size * 2} bytes a step at batch 1")
for name, system in interconnects.SYSTEMS.items():
    st = interconnects.tensor_parallel_decode(system, "smollm2-135m", 1, 3)
    print(f"  3 ranks, {name:34s}: one GPU {st.one_rank_s * 1e3:.3f} ms; 3 ranks {st.step_s * 1e3:.3f} ms, "
          f"all-reduces {st.all_reduce.seconds * 1e6:.1f} µs each: {st.step_s / st.one_rank_s:.1f}x slower")

# %% [markdown]
# A 70B model gains most of p at 2 and 4 GPUs, and less at 8, where its compute per rank has shrunk toward the
# all-reduces' fixed cost. SmolLM2 at batch 1 is *slower* on three GPUs than on one, on every system: a little on
# T4s, whose own step is slow, and several times on A100s and H100s, which read its weights in well under a
# millisecond, while its 60 all-reduces at the printed microseconds each cost several times that, however
# fast the link. Splitting pays when a rank's compute is long against the all-reduces' latency: wide, deep models,
# on fast links.

# %% [markdown]
# ## 4. This machine's all-reduce
#
# Our ranks are processes on one CPU, and gloo carries their all-reduces over the loopback interface (on a machine
# with a GPU per rank, NCCL carries them between the GPUs, and this section times that instead). We time one
# fp32 all-reduce among three fresh processes for payloads from 64 bytes to a few MB, and fit the line
# t = latency + bytes / bandwidth through the points. Each point is the mean of 100 calls, not the median: a
# step pays the sum of its all-reduces, slow calls included, and the mean is what a sum adds up.

# %%
payloads = [64, 1024, 2304, 9216, 36864, 147456, 589824, 2359296]
ar_s = all_reduce_seconds(payloads, RANKS, repeats=100, device=device)
latency, bandwidth = fit_latency_bandwidth(payloads, ar_s)
print(f"{'NCCL' if device == 'cuda' else 'gloo'} all-reduce among {RANKS} processes: latency {latency * 1e6:.0f} µs, bandwidth {bandwidth / 1e9:.2f} GB/s")
for n, s in zip(payloads, ar_s):
    print(f"  {human_bytes(n):>10}: {s * 1e6:8.0f} µs")
fig, ax = plt.subplots(figsize=(6.5, 3.4))
ax.loglog(payloads, np.array(ar_s) * 1e6, "o", label="measured (mean of 100)")
xs = np.logspace(0, np.log10(payloads[-1]), 100)
ax.loglog(xs, (latency + xs / bandwidth) * 1e6, "-", label="latency + bytes / bandwidth")
ax.axvline(cfg.hidden_size * 4, color="grey", ls=":", label="one decode token's sub-layer output (fp32)")
ax.set(xlabel="payload (bytes)", ylabel="µs per all-reduce", title=f"{'NCCL' if device == 'cuda' else 'gloo'}, {RANKS} ranks on this machine")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# A decode token's all-reduce carries 576 fp32 values, 2.3 KB: deep in the flat part of the curve, where the
# latency is everything. Loopback has no wire, but each hop still costs a system call and a wake-up of the
# receiving process. On a CPU with fewer cores than ranks it also waits for that process to be scheduled at all.
# That wait can dwarf the rest: three ranks, each with its own helper threads, share a few cores, so
# the latency you measure may be milliseconds, where a GPU link's is microseconds.
#
# ## 5. One rank against three, on the same requests
#
# Now the real thing: the engine with three ranks beside the one-process engine, both on the same plain modules,
# the same paged cache and the same greedy requests.

# %%
one = me.LLM.from_model(model, tokenizer, num_kv_blocks=256)
tp = me.LLM("smollm2-135m", device=device, tensor_parallel_size=RANKS, num_kv_blocks=256)
print(tp.engine.model)
prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in
           ("What is the capital of France?", "Name three prime numbers.", "Why is the sea salty?")]
greedy = me.SamplingParams(temperature=0.0, max_tokens=24)
a, b = one.generate(prompts, greedy, use_tqdm=False), tp.generate(prompts, greedy, use_tqdm=False)
print(f"same tokens: {[x.token_ids for x in a] == [y.token_ids for y in b]}")
print(f"rank 0's KV cache: {human_bytes(tp.engine.kv_cache_bytes)} (one process: {human_bytes(one.engine.kv_cache_bytes)})")
print("three ranks say:", repr(b[0].text[:80]))

# %% [markdown]
# Now the time of a decode step (every request bringing one token), at batch 1 and 16. For the three ranks we
# split rank 0's step three ways:
#
# - **computing**: its time outside any collective;
# - **communicating**: each collective's time on the rank that reached it last. That rank waited for nobody, so
#   its time is the exchange itself;
# - **waiting**: the rest of rank 0's time in collectives, spent waiting for a slower rank to arrive.
#
# The formula predicts the step from the constants fitted above: 61 all-reduces (the embedding's and two a layer)
# of b × 576 fp32 values and one gather of the logits, plus the compute. Our ranks share the cores that the one
# process used, so they do not divide its compute: the three thirds of each product run on the same cores, one
# after another or side by side, in about the one-process time. So the compute term here is the one-process
# step, not a third of it. With a GPU per rank it would be a third.

# %%
own_device = device == "cuda"  # a GPU per rank; on the CPU the ranks share the cores one process had
steps = {}
for batch in (1, 16):
    one_step = decode_step_times(one, batch, 16)
    tp_step = decode_step_times(tp, batch, 16)
    comm_s = (2 * cfg.num_layers + 1) * (latency + batch * cfg.hidden_size * 4 / bandwidth) + \
        latency + batch * cfg.vocab_size * 4 * (RANKS - 1) / RANKS / bandwidth
    compute_s = one_step.step_s / (RANKS if own_device else 1)
    steps[batch] = dict(one=one_step.step_s, tp=tp_step.step_s, parts=tp_step, comm=comm_s, compute=compute_s,
                        predicted=compute_s + comm_s)
    print(f"batch {batch:2d}: one process {one_step.step_s * 1e3:6.1f} ms, {RANKS} ranks "
          f"{tp_step.step_s * 1e3:6.1f} ms ({one_step.step_s / tp_step.step_s:.2f}x); "
          f"predicted {(compute_s + comm_s) * 1e3:.1f} ms")
    print(f"          communication: measured {tp_step.communication_s * 1e3:.1f} ms "
          f"({tp_step.communication_share:.0%} of the step), predicted {comm_s * 1e3:.1f} ms "
          f"({comm_s / (compute_s + comm_s):.0%}); waiting for a slower rank {tp_step.waiting_s * 1e3:.1f} ms")

fig, ax = plt.subplots(figsize=(8, 3.6))
labels, x = [], 0
for batch, st in steps.items():
    part = st["parts"]
    bars = [("1 process", [st["one"], 0, 0]),
            (f"{RANKS} ranks", [part.compute_s, part.communication_s, part.waiting_s]),
            ("predicted", [st["compute"], st["comm"], 0])]
    for name, (c, m, w) in bars:
        ax.bar(x, c * 1e3, color="tab:blue", label="computing" if x == 0 else None)
        ax.bar(x, m * 1e3, bottom=c * 1e3, color="tab:orange", label="communicating" if x == 1 else None)
        ax.bar(x, w * 1e3, bottom=(c + m) * 1e3, color="tab:grey",
               label="waiting for a slower rank" if x == 1 else None)
        labels.append(f"{name}\nbatch {batch}")
        x += 1
    x += 0.5
ax.set_xticks([i + (i // 3) * 0.5 for i in range(len(labels))], labels, fontsize=7)
ax.set(ylabel="ms per decode step", title="Where a decode step goes: one process against three ranks on this CPU")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# On a CPU (where the ranks run unless this machine has three GPUs; Colab's one GPU is not enough), three ranks
# are slower than one process, and the formula says why. SmolLM2 is small, so the whole
# step's products take tens of milliseconds. Splitting them over ranks that share the same cores saves none of
# that. Meanwhile the step pays 61 all-reduces, each at the latency measured above, and the fitted constants
# predict that communication closely. What the formula leaves out is the grey part. Three ranks on fewer than
# three cores never compute all at once: at any moment one of them waits for a core, and the others then wait
# for it at the next all-reduce. On GPUs joined by NVLink, each rank computes on its own device, an all-reduce of
# decode's payload costs what section 3 printed, and a 70B model's per-rank compute is milliseconds: the widget of
# section 3 shows the gain coming back.

# %% [markdown]
# ## 6. The memory win: a share of the KV cache each
#
# So far tensor parallelism has been about time. For a serving engine its larger gift is memory. Section 2 measured
# it: a rank holds a third of the weights and, because it keeps only its own KV heads, a third of every token's keys
# and values. On a GPU, the memory left after the weights is the KV cache, and the KV cache decides how many
# requests can run at once: a request whose blocks do not fit waits. So at p ranks the same memory on each GPU holds
# p times the tokens, and more, because each rank's weights shrink by p too and leave more room for the cache
# (exercise 6 works it out for a 70B model). And a decode step is bound by reading the weights, which the whole
# batch shares: a larger batch is more tokens a step for nearly the same step time. This holds however slow the
# links are, which is why tensor parallelism pays in serving even where one request's token gets no faster.
#
# We measure it on the engine. Fix a budget of bytes a rank may spend on keys and values. `kv_blocks_within` counts
# the blocks of 16 positions whose keys and values, every layer's, fit that budget: for one process (its 3 KV heads)
# and for one rank of three (its 1 KV head, `rank_config`). Each engine gets a pool of that many blocks, and the
# same burst of requests arrives at both at once; `largest_batch` reports the most requests the engine ran in one
# step. The three-rank engine is section 5's ranks with a new pool (`LLM.from_model` on the same model: the ranks
# build their share of a new cache when its first step arrives). After this cell the three ranks are done, and
# the cell shuts them down.

# %%
block_size, budget = 16, 4 * 2**20  # 4 MiB of keys and values a rank
blocks = {"1 process": kv_blocks_within(budget, cfg, block_size),
          f"{RANKS} ranks": kv_blocks_within(budget, rank_config(cfg, RANKS), block_size)}
burst = dict(requests=10, prompt_tokens=24, new_tokens=4)  # 28 positions: two blocks a request
knobs = dict(block_size=block_size, max_num_seqs=64, enable_prefix_caching=False)
budget_engines = {name: me.LLM.from_model(m, tokenizer, num_kv_blocks=blocks[name], **knobs)
                  for name, m in (("1 process", model), (f"{RANKS} ranks", tp.engine.model))}
largest = {name: largest_batch(llm, **burst) for name, llm in tqdm(budget_engines.items(), desc="bursts")}
tp.shutdown()  # the last use of the three ranks
print(f"after shutdown: {tp.engine.model}")
per_request = -(-(burst["prompt_tokens"] + burst["new_tokens"]) // block_size)
for name in blocks:
    print(f"{name:9s}: {blocks[name]:3d} blocks of {block_size} positions in {human_bytes(budget)} a rank "
          f"({blocks[name] * block_size} positions), room for {blocks[name] // per_request} requests of "
          f"{per_request} blocks; of {burst['requests']} arriving at once, at most {largest[name]} ran in one step")
print(f"{RANKS} ranks: {blocks[f'{RANKS} ranks'] / blocks['1 process']:.0f}x the blocks, "
      f"{largest[f'{RANKS} ranks'] / largest['1 process']:.1f}x the batch")

fig, axes = plt.subplots(1, 2, figsize=(7.5, 2.8))
for ax_, values, title in ((axes[0], blocks, f"KV blocks in {human_bytes(budget)} a rank"),
                           (axes[1], largest, f"largest batch of {burst['requests']} requests run")):
    bars = ax_.bar(list(values), list(values.values()), color=["tab:grey", "tab:blue"])
    ax_.bar_label(bars)
    ax_.set_title(title, fontsize=9)
fig.suptitle("The memory win: a rank holds 1 of SmolLM2's 3 KV heads", fontsize=10)
plt.tight_layout()
plt.show()

# %% [markdown]
# Three ranks hold about three times the blocks in the same bytes a rank (each budget is rounded down to whole
# blocks, so the ratio printed can be a little above or below three), and run
# the larger batch the printout shows. Where the batch run is below the room printed, the scheduler admitted a
# request only once it could see blocks for it, keeping room for the running ones to grow (a request that outgrows
# the pool is preempted, as chapter 07 showed). On a GPU this is the win that makes tensor parallelism worth its communication for serving: more
# requests in each step, each step reading every weight once for all of them.

# %% [markdown]
# ## 7. The collectives inside an all-reduce
#
# A ring all-reduce is two collectives in a row. A **reduce-scatter** leaves rank r with the sum of slice r of
# everyone's payload: p − 1 steps, each rank sending and receiving (p − 1)/p of the payload. An **all-gather** then
# hands every rank every summed slice: the same p − 1 steps and bytes. Together: 2(p − 1) hops and 2(p − 1)/p of
# the bytes, the ring all-reduce of section 3. The formulas, at this machine's fitted constants (section 4) and at
# NCCL's Simple ring on H100s (run as two collectives, the halves pay NCCL's base latency twice, where one
# all-reduce pays it once):

# %%
# Section 4 fitted a whole all-reduce's latency here: spread over the ring's 2(p - 1) hops, with no base of its own.
for label, hop, base, bw in (("this machine (gloo)", latency / (2 * (RANKS - 1)), 0.0, bandwidth),
                             ("H100 NVLink, NCCL Simple", interconnects.NCCL_HOP_US["NVLink"]["Simple"] * 1e-6,
                              interconnects.NCCL_BASE_US["Simple"] * 1e-6, 450e9)):
    for n in (cfg.hidden_size * 4, 64 * 2**20):
        rs = formulas.reduce_scatter_seconds(n, RANKS, hop, bw, base)
        ag = formulas.all_gather_seconds(n, RANKS, hop, bw, base)
        ar = formulas.ring_all_reduce_seconds(n, RANKS, hop, bw, base)
        print(f"{label:25s} {human_bytes(n):>10}: reduce-scatter {rs * 1e6:9.1f} µs + all-gather {ag * 1e6:9.1f} µs "
              f"= {(rs + ag) * 1e6:9.1f} µs; ring all-reduce {ar * 1e6:9.1f} µs")

# %% [markdown]
# A reduce-scatter is the all-reduce stopped halfway. With three ranks each holding a payload of three slices,
# rank 0 ends with slice 0 summed over the ranks, rank 1 with slice 1, rank 2 with slice 2: every rank has done a
# third of the adding, and holds a third of the answer. The all-gather then copies each rank's third to the others.
# Neither moves more than (p − 1)/p of the payload through any rank's link, which is why the ring is
# bandwidth-optimal; each pays p − 1 latencies, which is why small payloads go to other algorithms (section 3).
# The drawing runs the ring on three ranks, step by step: each cell names the ranks whose values of that slice the
# rank has summed so far, and the outlined cell is the one it just received from the rank before it in the ring.

# %%
display(ring_all_reduce_image(RANKS))

# %% [markdown]
# Two steps of reduce-scatter leave each rank one whole slice (dark), its own: rank r holds slice r. Two steps of
# all-gather pass the whole slices around the ring. In every step each rank sends one slice and receives one,
# a third of the payload, so each link stays busy and none carries more than the others.
#
# Now on real ranks. `check_collectives` starts three processes over gloo (NCCL where each rank has a GPU), gives
# each a random fp32 input of 7 × 5 values (35: not a multiple of 3, so the all-reduce made of halves pads it), and
# reports the largest difference, over the ranks, between: torch's all-reduce and the sum of the inputs; each
# rank's reduce-scatter and its slice of the sum; the all-gather and the inputs joined in rank order; and an
# all-reduce made of our reduce-scatter then all-gather (`all_reduce_from_halves`) and torch's. A sum taken in
# another order differs in the last bits of fp32, so expect about 1e-7, not zero; the all-gather is a copy. Then
# `collective_seconds` times each of the four over three payloads: one decode token's sub-layer output, sixteen
# tokens' and 256 tokens'.

# %%
errors = check_collectives(RANKS, shape=(7, 5), device=device)
for name, err in errors.items():
    print(f"{name:24s} largest difference {err:.1e}")
token_bytes = cfg.hidden_size * 4  # one token's sub-layer output, fp32
coll_payloads = [token_bytes * n for n in (1, 16, 256)]
coll_s = collective_seconds(coll_payloads, RANKS, repeats=20, device=device)
print(f"\nmean µs a call among {RANKS} ranks ({'NCCL' if device == 'cuda' else 'gloo'}):")
print(f"{'payload':>10} " + " ".join(f"{name:>23}" for name in coll_s) + "  halves / all_reduce")
for i, n in enumerate(coll_payloads):
    print(f"{human_bytes(n):>10} " + " ".join(f"{coll_s[name][i] * 1e6:23.0f}" for name in coll_s)
          + f"  {coll_s['all_reduce_from_halves'][i] / coll_s['all_reduce'][i]:19.1f}x")
fig, ax = plt.subplots(figsize=(7, 3.2))
width = 0.2
for j, name in enumerate(coll_s):
    ax.bar(np.arange(len(coll_payloads)) + (j - 1.5) * width, np.array(coll_s[name]) * 1e6, width, label=name)
ax.set_xticks(range(len(coll_payloads)), [f"{human_bytes(n)}\n({n // token_bytes} token(s))" for n in coll_payloads])
ax.set(ylabel="µs a call (mean)", yscale="log", title=f"The four collectives among {RANKS} ranks on this machine")
ax.legend(fontsize=7)
plt.show()

# %% [markdown]
# All four agree with their definitions to the last bits. Read the last column: our all-reduce made of two calls
# pays two calls' fixed costs (and a copy to pad and join) where torch's pays one, so at a decode token's payload,
# where the fixed cost is nearly everything (section 4's fit), it costs more than torch's one call. A real ring
# does the same two halves inside one call, with one fixed cost. The timings are this machine's and vary from run
# to run.
#
# ### Sequence parallelism: the same bytes, the activations split
#
# Look again at what tensor parallelism left whole (section 2): the residual stream between the sub-layers,
# [tokens, 576], and the RMSNorms applied to it. Every rank stores the same activations and does the same norm
# work: p copies of both. Korthikanti et al. (2022, "Reducing Activation Recomputation in Large Transformer
# Models") noticed that a norm, like the residual add, treats each token alone, so that part can be split along the
# tokens: rank r holds and normalises rows r·T/p ... (r + 1)·T/p of the residual stream. The exchanges change
# shape, not volume:
#
# - where a row-parallel layer (o_proj, down_proj) ended with an all-reduce, it now ends with a **reduce-scatter**:
#   each rank keeps the summed rows of its own tokens, the slice of the residual stream it holds;
# - before a column-parallel layer (qkv, gate_up), which needs every token, an **all-gather** hands it all rows.
#
# An all-reduce is a reduce-scatter and an all-gather, so the same bytes cross the links, in twice as many
# collectives; what a rank holds between the projections is a p-th. Megatron-LM calls this sequence parallelism
# (`--sequence-parallel`); here it is `LLM(..., tensor_parallel_size=3, sequence_parallel=True)`. Its win is largest
# in training, where every layer's activations are kept for the backward pass. At inference it shrinks the residual
# stream a rank holds during a long prefill, while the gathered input of each column-parallel layer is whole under
# both schemes and lives only for that product.
#
# The cell starts one sequence-parallel engine, checks its greedy tokens against the one process's of section 5,
# measures the largest residual-stream activation it holds on rank 0 during a prefill (`residual_bytes`: the largest
# input or output of a decoder layer, or input of a norm) against the one process's, which every plain
# tensor-parallel rank holds too (`tests/engine/test_sequence_parallel.py` checks the two equal), and times a decode
# step against section 5's plain three ranks.

# %%
sp = me.LLM("smollm2-135m", device=device, tensor_parallel_size=RANKS, sequence_parallel=True, num_kv_blocks=256)
sp_out = sp.generate(prompts, greedy, use_tqdm=False)
sp_same = [x.token_ids for x in a] == [z.token_ids for z in sp_out]
long_prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in
                ("Explain how a lighthouse keeper spent a winter night, step by step.",
                 "List the planets of the solar system and one fact about each.")]
resid = {"1 process (= a plain TP rank)": residual_bytes(one, long_prompts),
         f"sequence-parallel rank of {RANKS}": residual_bytes(sp, long_prompts)}
sp_step = decode_step_times(sp, 16, 4)
sp.shutdown()
print(f"same tokens as one process: {sp_same}")
for name, n in resid.items():
    print(f"largest residual-stream activation, {name:34s}: {human_bytes(n):>10} "
          f"({n // token_bytes} tokens x {cfg.hidden_size} fp32)")
tp16 = steps[16]["parts"]
print(f"decode step at batch 16: plain {RANKS} ranks {tp16.step_s * 1e3:.1f} ms, {tp16.collectives} collectives "
      f"({tp16.communication_s * 1e3:.1f} ms communicating); sequence-parallel {sp_step.step_s * 1e3:.1f} ms, "
      f"{sp_step.collectives} collectives ({sp_step.communication_s * 1e3:.1f} ms communicating)")

fig, axes = plt.subplots(1, 2, figsize=(8, 2.8))
bars = axes[0].barh(["1 process /\nplain TP rank", "sequence-\nparallel rank"], [n / 1024 for n in resid.values()],
                    color=["tab:grey", "tab:blue"])
axes[0].bar_label(bars, fmt="%.0f KiB")
axes[0].set_title("largest residual activation a rank holds", fontsize=9)
bars = axes[1].barh(["plain TP", "sequence-parallel"], [tp16.collectives, sp_step.collectives],
                    color=["tab:grey", "tab:blue"])
axes[1].bar_label(bars)
axes[1].set_title("collectives a decode step", fontsize=9)
plt.tight_layout()
plt.show()

# %% [markdown]
# The same tokens, a third of the residual stream on each rank (its rows rounded up to whole rows a rank), and the
# collective count the cell printed: each of the 2L all-reduces became a pair, plus the final norm's all-gather. At
# decode, a step of a few tokens, the activations are tiny and every extra collective pays a latency, so on a link
# where latency is the cost (this machine's, and decode's on any link, section 3) sequence parallelism buys nothing
# and costs collectives. It pays where activations are large: long prefills, and training.
#
# ## 8. Overlap: communicating while computing
#
# While an all-reduce runs, a rank's compute units wait for it, unless there is other work ready.
# `dist.all_reduce(t, async_op=True)` starts the collective and returns a handle at once; the program computes
# something else and calls `wait()` on the handle when it needs the sum. At best the pair then takes
# max(compute, communication) instead of their sum. The catch is the word *independent*. In a tensor-parallel
# layer the all-reduce after o_proj carries the very output that the next norm needs, so nothing in the same chain
# of layers can run under it. Engines find independent work by cutting the batch in two and running one half's
# all-reduce under the other half's matmuls (NanoFlow's nano-batches, Zhu et al. 2024), or by fusing the collective
# into the matmul that produces it, a tile sent as soon as it is computed.
#
# On a GPU, kernels queue on **streams**: those of one stream run in order, those of two streams may run at once.
# NCCL runs its collectives on a stream of its own, copying over NVLink with a few of the GPU's SMs (its
# multiprocessors), while the matmul on the default stream uses the rest; `wait()` only makes the default stream
# wait for an event of NCCL's stream, so the host never blocks. It hides communication when the two do not fight
# for the same SMs and memory bandwidth. On this CPU, gloo's collective runs on gloo's own thread while the rank's
# threads multiply, and three ranks with their gloo threads share two cores: overlap hides only what a free core can
# run, and it can lose when the threads take turns. `overlap_seconds` measures it on three fresh ranks: a matmul of
# 64 tokens through SmolLM2's MLP width (576 to 1,536) and an all-reduce of 64 tokens' sub-layer output that does not
# depend on it, alone, one after the other, and overlapped.

# %%
ov = overlap_seconds(RANKS, tokens=64, repeats=10, device=device)
best = max(ov.compute_s, ov.all_reduce_s)
print(f"matmul alone {ov.compute_s * 1e3:.1f} ms, all-reduce alone {ov.all_reduce_s * 1e3:.1f} ms")
print(f"serial {ov.serial_s * 1e3:.1f} ms, overlapped {ov.overlapped_s * 1e3:.1f} ms: gain {ov.gain:.2f}x "
      f"(at best max(matmul, all-reduce) = {best * 1e3:.1f} ms, {ov.serial_s / best:.2f}x)")
fig, ax = plt.subplots(figsize=(7, 2.2))
ax.barh("serial", ov.compute_s * 1e3, color="tab:green", label="matmul")
ax.barh("serial", ov.all_reduce_s * 1e3, left=ov.compute_s * 1e3, color="tab:orange", label="all-reduce")
ax.barh("overlapped", ov.overlapped_s * 1e3, color="tab:purple", label="both at once (measured)")
ax.barh("at best", ov.compute_s * 1e3, color="tab:green", height=0.35, align="edge")
ax.barh("at best", ov.all_reduce_s * 1e3, color="tab:orange", height=-0.35, align="edge")
ax.set(xlabel="ms (mean a step, rank 0)", title=f"An all-reduce under an independent matmul, {RANKS} ranks, {device}")
ax.legend(fontsize=7, loc="lower right")
plt.tight_layout()
plt.show()

# %% [markdown]
# The bottom bar is the two alone, end to end (the serial step measured beside them may differ by this machine's
# noise); the top bar is what perfect overlap would give; the middle one is what this machine did. On a CPU with
# fewer cores than threads, overlap moves work around more than it hides it: the gain printed is whatever the
# cores had spare. On GPUs, fused and nano-batched overlap recovers a real part of communication, at the cost of
# smaller matmuls (each half of a batch is less efficient than the whole) and more complex scheduling.

# %% [markdown]
# ## 9. vLLM, and pipeline parallelism
#
# vLLM's `LLM(model, tensor_parallel_size=p)` is what we built: Megatron's layers, one worker process per GPU,
# the scheduler on one driver, NCCL all-reduces, and for small payloads on NVLink its own custom all-reduce, the
# one-shot kernel of section 3 (a single step in which each GPU reads all the others' buffers directly), because
# of the latency term. It pays inside one machine, where NVLink joins the GPUs; p is usually 2, 4 or 8. vLLM asks
# less of p than this engine does: p must divide the query heads, but when p exceeds the KV heads each KV head is
# copied to p / (KV heads) ranks, and the vocabulary is padded to a multiple of 64 before it is cut. This engine
# asks p to divide the KV heads and the vocabulary too (exercise 3); both ask it to divide the MLP width.
#
# **Pipeline parallelism** (`pipeline_parallel_size`) splits the other way: rank r holds whole layers
# r·L/p ... (r+1)·L/p and passes the activations on once per step, so its activations cross p − 1 links a step
# (with the step's inputs sent to every stage and the logits sent back: a few more small messages) instead of 2L
# all-reduces, over slow links too (across machines). But one batch's step runs the stages one after another. To keep
# every stage busy, the batch is cut into **micro-batches**, smaller groups of requests that follow each other
# through the stages, so stage 1 works on the first while stage 0 starts the second. Filling and draining the pipe
# still leaves stages idle, the **bubble**: with p stages and m micro-batches of equal cost, a share
# (p − 1)/(m + p − 1) of the time (GPipe, Huang et al. 2019). Pipelining gains throughput, never one token's
# latency.

# %%
ms = np.arange(1, 17)
fig, ax = plt.subplots(figsize=(6.5, 3.2))
for stages in (2, 3, 4, 8):
    ax.plot(ms, formulas.pipeline_bubble(stages, ms) * 100, "o-", ms=3, label=f"{stages} stages")
ax.set(xlabel="micro-batches m", ylabel="idle share of the time (%)", title="The pipeline bubble, (p − 1)/(m + p − 1)")
ax.legend(fontsize=8)
plt.show()
print(f"{RANKS} stages: " + ", ".join(f"m = {m}: {formulas.pipeline_bubble(RANKS, m):.0%} idle" for m in (1, 2, 4, 8)))

# %% [markdown]
# ### Pipeline parallelism, measured
#
# `LLM(..., pipeline_parallel_size=3)` cuts SmolLM2's 30 layers into three stages of 10, each a process of its own
# that holds its layers and their part of the KV cache (all 3 KV heads, for its 10 layers: a third of the cache
# again, cut the other way). Stage 0 is this process and also holds the embedding; the last stage holds the final
# norm and the LM head. Every step, stage 0 sends the other stages the step's compact inputs (each sequence's
# lengths and block table), and each builds its own attention metadata from them. The activations pass from stage to
# stage with `torch.distributed`'s point-to-point `send` and `recv` (gloo here, NCCL between GPUs), and the last
# stage sends the logits back. `pipeline_micro_batches=m` cuts each step's sequences into m groups of about equal
# tokens. We build it from the model already loaded, `PipelineModel(model, 3, micro_batches=2)` under
# `LLM.from_model` (what `me.LLM("smollm2-135m", pipeline_parallel_size=3, pipeline_micro_batches=2)` builds, without
# loading the weights again), and check its greedy tokens against the one process's.
#
# Then the bubble. `measure_bubble` times one prefill step of 8 sequences of 32 tokens through the stages, in
# m = 1, 2, 4 and 8 micro-batches, each stage timestamping every micro-batch it computes. It reports three numbers:
#
# - **measured**: 1 − (the stages' busy time) / (3 × the step's time), the idle share of the stage-time;
# - **replayed**: the bubble that the same per-micro-batch times would give if each stage had a core of its own and
#   sending were free (GPipe's schedule replayed from the timestamps): the formula, except that real stages and
#   micro-batches are not all equal;
# - **from CPU**: the same as measured, counting only the CPU time each stage actually ran.
#
# On a 2-core machine three stages share two cores, so a "busy" stage may be waiting for a core: measured then
# comes out below what a core (or a GPU) per stage would show, and from CPU cannot fall below a third (1 − 2 cores /
# 3 stages). Replayed is the one to set beside the formula.

# %%
pp = me.LLM.from_model(PipelineModel(model, RANKS, micro_batches=2), tokenizer, num_kv_blocks=256)
print(pp.engine.model)
pp_out = pp.generate(prompts, greedy, use_tqdm=False)
pp_same = [x.token_ids for x in a] == [z.token_ids for z in pp_out]
print(f"same tokens as one process: {pp_same}")
bubbles = [measure_bubble(pp.engine.model, m, batch=8, prompt_len=32, repeats=1)
           for m in tqdm((1, 2, 4, 8), desc="micro-batches")]
pp.shutdown()
print(format_bubbles(bubbles))
measured_ms = [b.micro_batches for b in bubbles]
ax.plot(measured_ms, [b.measured * 100 for b in bubbles], "k*", ms=9, label=f"{RANKS} stages, measured here")
ax.plot(measured_ms, [b.replayed * 100 for b in bubbles], "kx", ms=8, mew=2,
        label=f"{RANKS} stages, replayed with a core each")
ax.set_title("The pipeline bubble: (p − 1)/(m + p − 1), and SmolLM2's 3 stages measured", fontsize=9)
ax.legend(fontsize=7)
display(fig)  # the bubble plot above, with the measurements on it

# %%
# The measured schedule itself: each bar is one micro-batch on one stage, from that stage's own timestamps.
fig, axes = plt.subplots(1, 2, figsize=(10, 2.8), sharey=True)
for ax, bubble in zip(axes, (bubbles[0], bubbles[2])):
    for stage, spans in enumerate(bubble.spans):
        ax.broken_barh([(start * 1e3, (end - start) * 1e3) for start, end in spans], (stage - 0.4, 0.8),
                       facecolors=[plt.cm.tab10(k) for k in range(len(spans))], edgecolor="white")
    ax.set(title=f"m = {bubble.micro_batches}: step {bubble.step_s * 1e3:.0f} ms, "
                 f"idle {bubble.measured:.0%} of stage-time",
           xlabel="ms from the step's start", yticks=range(bubble.stages),
           yticklabels=[f"stage {r}" for r in range(bubble.stages)])
    ax.invert_yaxis()
plt.tight_layout()
plt.show()

# %% [markdown]
# The same tokens as one process, through three processes that each hold a third of the layers. The two schedules
# drawn above are the bubble itself: with one micro-batch, the three stages' bars follow one another and each stage
# waits for the others' whole turn; with four, a stage starts its next micro-batch while the next stage works on the
# previous one (one colour is one micro-batch). By the formula,
# the bubble falls with m: with one micro-batch, two stages wait while the third works; with eight, the pipe is
# full for most of the step. The replayed points would sit on the 3-stage curve if every stage took the same time
# for every micro-batch; they stray from it by how unequal the measured times are (stage 0 also embeds, the last
# stage also computes the logits over the 49,152-word vocabulary, and on a shared CPU a stage's micro-batch takes
# longer while the others compute at once). The measured points are what this machine did: where stages share
# cores, idle time turns into slower compute, and a stage's timestamps also hold time it waited for a core; compare
# the busy and CPU milliseconds the table prints.
# Micro-batches are not free: a decode step reads every weight of a stage once per micro-batch, so on hardware
# bound by reading weights, m micro-batches cost nearly m reads of them. A serving engine can instead keep the pipe
# full with separate batches in flight, one per stage, rather than cut one batch thinner.
#
# **Tensor or pipeline?** Tensor parallelism cuts every layer: each rank reads a p-th of the weights, so one
# token's step gets faster, and each rank holds a p-th of every token's KV cache; but it puts 2L all-reduces on the
# critical path of every step, so it wants NVLink-class links, and p is limited by the heads. Pipeline parallelism
# cuts between layers: it sends one activation per micro-batch from a stage to the next, p − 1 transfers a step
# that tolerate slow links, and it too divides the weights and the KV cache by p; but one token still passes through
# every stage in turn, so its latency does not fall, and throughput needs the pipe kept full. Serving engines
# combine them: vLLM's documentation recommends, when a model needs more than one node, "the tensor parallel size
# [as] the number of GPUs in each node, and the pipeline parallel size [as] the number of nodes" (16 GPUs in 2
# nodes: tensor parallel 8, pipeline parallel 2). The 2L all-reduces of every step stay on the node's NVLink; only
# the activations between stages cross the slower network between nodes.

# %% [markdown]
# ## What you measured

# %%
summary = [
    ("ranks, where", f"{RANKS}, {device}"),
    ("weights: one process, one rank", f"{human_bytes(full_bytes)}, {human_bytes(rank_bytes)}"),
    ("KV per token: one process, one rank", f"{human_bytes(kv_full)}, {human_bytes(kv_rank)}"),
    ("all-reduce fit: latency, bandwidth", f"{latency * 1e6:.0f} µs, {bandwidth / 1e9:.2f} GB/s"),
    ("same greedy tokens, 1 vs 3 ranks", str([x.token_ids for x in a] == [y.token_ids for y in b])),
    *((f"batch {bt}: step one / {RANKS} ranks (speed ratio)",
       f"{s['one'] * 1e3:.1f} / {s['tp'] * 1e3:.1f} ms ({s['one'] / s['tp']:.2f}x)") for bt, s in steps.items()),
    *((f"batch {bt}: communication measured / predicted",
       f"{s['parts'].communication_s * 1e3:.1f} / {s['comm'] * 1e3:.1f} ms "
       f"({s['parts'].communication_share:.0%} / {s['comm'] / s['predicted']:.0%} of the step)")
      for bt, s in steps.items()),
    ("memory win: KV blocks in " + human_bytes(budget) + " a rank, 1 / 3 ranks",
     f"{blocks['1 process']} / {blocks[f'{RANKS} ranks']}"),
    ("memory win: largest batch run, 1 / 3 ranks", f"{largest['1 process']} / {largest[f'{RANKS} ranks']}"),
    ("reduce-scatter + all-gather vs all-reduce", f"largest difference {errors['all_reduce_from_halves']:.1e}"),
    (f"{human_bytes(token_bytes)}: all-reduce / from halves",
     f"{coll_s['all_reduce'][0] * 1e6:.0f} / {coll_s['all_reduce_from_halves'][0] * 1e6:.0f} µs"),
    ("sequence parallel: same tokens", str(sp_same)),
    ("residual stream a rank: plain TP / SP", " / ".join(human_bytes(n) for n in resid.values())),
    ("decode step, batch 16: plain TP / SP", f"{tp16.step_s * 1e3:.1f} / {sp_step.step_s * 1e3:.1f} ms "
                                             f"({tp16.collectives} / {sp_step.collectives} collectives)"),
    ("overlap: serial / overlapped (gain)",
     f"{ov.serial_s * 1e3:.1f} / {ov.overlapped_s * 1e3:.1f} ms ({ov.gain:.2f}x)"),
    ("pipeline, 3 stages: same tokens", str(pp_same)),
    *((f"bubble, m = {b.micro_batches}: formula / replayed / measured",
       f"{b.formula:.0%} / {b.replayed:.0%} / {b.measured:.0%}") for b in bubbles),
]
width = max(len(k) for k, _ in summary)
for k, v in summary:
    print(f"{k:<{width}}  {v}")

# %% [markdown]
# ## Exercises: predict, then run
#
# **1. Where the break-even lies.** Suppose each rank had a CPU of its own, as fast as this one, and the same
# links. With this machine's fitted latency and the one-process step time at batch 1, how much longer would a
# step's compute have to be for three ranks to break even? Predict, then compute it.

# %%
comm_b1 = steps[1]["comm"]
print(f"communication per step ≈ {comm_b1 * 1e3:.1f} ms; break-even when one process's step t satisfies "
      f"t = t/{RANKS} + comm, t = comm × {RANKS}/{RANKS - 1} = comm × {RANKS / (RANKS - 1):.2f} = "
      f"{comm_b1 * RANKS / (RANKS - 1) * 1e3:.1f} ms ({comm_b1 * RANKS / (RANKS - 1) / steps[1]['one']:.1f}x this "
      f"model's step)")

# %% [markdown]
# <details><summary>Answer</summary>
#
# Break-even is t = t/p + c, so t = c · p / (p − 1): the printed multiple of the communication for p = 3. The
# communication is dominated by its all-reduces' latencies, so it hardly depends on the model's width: only a model whose
# one-process step is at least the printed t breaks even. Ranks that share one CPU, as ours do, never break even:
# their compute is not divided at all. This is why tensor parallelism is used for big models on
# fast links, and why small ones are served by replicas instead (one whole copy per device, no communication).
# </details>
#
# **2. Batch.** In the widget, set llama-70b-gqa with 4 ranks, and move the batch from 1 to 256, first on
# H100s over NVLink, then on H100s in two nodes over 100 Gb/s Ethernet. Predict how the communication share
# changes on each.

# %%
for name in ("H100 × NVLink 4 (NVSwitch)", "H100 × 2 nodes, Ethernet 100 Gb/s"):
    print(name)
    for bt in (1, 8, 64, 256):
        st = interconnects.tensor_parallel_decode(interconnects.SYSTEMS[name], "llama-70b-gqa", bt, 4)
        print(f"  batch {bt:3d}: compute {st.compute_s * 1e3:6.2f} ms a rank, all-reduces "
              f"{st.communication_s * 1e3:6.2f} ms of {st.payload_bytes / 1024:5.0f} KiB each by "
              f"{st.all_reduce.algorithm:17s} ({st.communication_share:.0%} of the step, {st.speedup:.2f}x)")

# %% [markdown]
# <details><summary>Answer</summary>
#
# The share rises with the batch on both, slowly on NVLink and steeply over Ethernet. The compute grows slowly
# (a step is bound by reading the weights, which all rows share), while each all-reduce's payload, 2·h·b bytes,
# grows in proportion to the batch. On NVLink a payload costs little more than its latency until it nears a
# megabyte (the printed KiB), so the share grows slowly, mostly at the largest batches. Over Ethernet the
# link is far slower, so the bytes soon outweigh the latency: at the largest batch most of the step is
# communication, and tensor parallelism across two machines gains little. That is why it stays inside a node.
# </details>
#
# **3. Two ranks.** Try `me.LLM("smollm2-135m", tensor_parallel_size=2)`. What happens, and why? Which sizes
# would vLLM accept for this model, and for Llama-3-70B?

# %%
try:
    me.LLM("smollm2-135m", tensor_parallel_size=2)
except ValueError as e:
    print("ValueError:", e)


def vllm_accepts(c, p):
    """vLLM's rules: p divides the query heads (ModelConfig.verify_with_parallel_config) and the MLP width
    (MergedColumnParallelLinear); the KV heads divide among the ranks or are copied, p a multiple of them
    (QKVParallelLinear); the vocabulary, padded to a multiple of 64, divides (VocabParallelEmbedding)."""
    kv_ok = c.num_kv_heads % p == 0 if p < c.num_kv_heads else p % c.num_kv_heads == 0
    return (c.num_heads % p == 0 and c.intermediate_size % p == 0 and kv_ok
            and (-(-c.vocab_size // 64) * 64) % p == 0)


def engine_accepts(c, p):
    try:
        check_tensor_parallel_size(c, p)
        return True
    except ValueError:
        return False


for name in ("smollm2-135m", "llama-70b-gqa"):
    c = PRESETS[name]
    print(f"{name} ({c.num_heads} query heads, {c.num_kv_heads} KV heads): "
          f"this engine takes {[p for p in range(1, 65) if engine_accepts(c, p)]}, "
          f"vLLM {[p for p in range(1, 65) if vllm_accepts(c, p)]}")

# %% [markdown]
# <details><summary>Answer</summary>
#
# It is refused before any process starts: 2 does not divide the 9 query heads. A rank must own whole heads
# (attention mixes the 64 values of a head; cutting a head would need an exchange inside attention), so vLLM
# refuses it too. Both ask p to divide the MLP width. The other rules differ: this engine also asks p to divide the
# KV heads and the vocabulary, so a rank's query heads share its own KV heads. vLLM copies a KV head to several ranks when p
# exceeds the KV heads, and pads the vocabulary, so it accepts the larger sizes the cell prints for Llama-3-70B,
# at the price of storing each copied KV head's cache on every rank that holds it. For SmolLM2 the two agree.
# </details>
#
# **4. Pipeline instead.** With 30 layers on 3 ranks split by layers, how many messages does one decode step
# send, and what is one request's step time, compared with tensor parallelism?

# %%
hop = latency + cfg.hidden_size * 4 / bandwidth  # one request's activations, fp32, at this machine's fit
print(f"pipeline: {RANKS - 1} messages, step ≈ {(steps[1]['one'] + (RANKS - 1) * hop) * 1e3:.1f} ms; "
      f"tensor parallel: {2 * cfg.num_layers + 1} all-reduces + a gather, step ≈ {steps[1]['predicted'] * 1e3:.1f} ms "
      f"(one process: {steps[1]['one'] * 1e3:.1f} ms)")

# %% [markdown]
# <details><summary>Answer</summary>
#
# Two (rank 0 to 1, rank 1 to 2), instead of 61 all-reduces. But the ranks run one after another: one request's
# step still takes the whole model's compute plus two hops, no faster than one process. Pipelining pays only with
# several batches in flight, one in each stage.
# </details>
#
# **5. A small bubble.** How many micro-batches keep the bubble of 3 stages under 10%? Of 8 stages? Predict from
# the formula, then compute it.

# %%
for stages in (RANKS, 8):
    m = next(m for m in range(1, 1000) if formulas.pipeline_bubble(stages, m) < 0.1)
    print(f"{stages} stages: m = {m} micro-batches give {formulas.pipeline_bubble(stages, m):.1%} idle "
          f"(m = {m - 1}: {formulas.pipeline_bubble(stages, m - 1):.1%}); 9 × (p − 1) = {9 * (stages - 1)}")

# %% [markdown]
# <details><summary>Answer</summary>
#
# (p − 1)/(m + p − 1) < 1/10 means 10(p − 1) < m + p − 1, so m > 9(p − 1): the cell prints the smallest m for
# each.
# The micro-batches needed grow with the stages, so deep pipelines need large batches to stay busy, and each
# micro-batch must still be large enough to use a stage well. That is one reason serving engines keep pipelines
# short (a stage per node) and do the rest of the splitting inside each stage with tensor parallelism.
# </details>
#
# **6. The memory win on a large model.** Llama-3-70B (`llama-70b-gqa`: 80 layers, 8 KV heads of 128) in 16 bits
# on GPUs of 80 GB, 90% of which the engine may use (vLLM's default `gpu_memory_utilization`). How many tokens of
# KV cache fit at 2, 4 and 8 GPUs with tensor parallelism? Does the capacity grow by p, by less, or by more?

# %%
c70 = PRESETS["llama-70b-gqa"]
usable = 0.9 * 80e9
weights70 = formulas.weight_bytes("llama-70b-gqa")
kv70 = formulas.kv_bytes_per_token(c70.num_layers, c70.num_kv_heads, c70.head_dim, 2)
print(f"weights {human_bytes(weights70)}, KV {human_bytes(kv70)} a token; one GPU: {human_bytes(usable)} usable")
capacity = {}
for p in (1, 2, 4, 8):
    free = usable - weights70 / p
    capacity[p] = max(0, int(free // (kv70 / p)))
    print(f"  {p} GPU(s): weights {human_bytes(weights70 / p)} a GPU, {human_bytes(max(free, 0))} left for KV, "
          f"{capacity[p]:,} tokens ({capacity[p] // 4096:,} requests of 4,096 positions)")
print(f"from 2 to 4 GPUs: {capacity[4] / capacity[2]:.1f}x the tokens; from 4 to 8: {capacity[8] / capacity[4]:.1f}x")

# %% [markdown]
# <details><summary>Answer</summary>
#
# One GPU cannot even hold the weights. From then on the capacity grows by more than p: doubling the GPUs halves
# each token's share of the KV cache on a rank (twice the tokens in the same bytes) and also halves each rank's
# weights, which leaves more bytes for the cache. The cell prints how much more than double each doubling gives; at
# 2 GPUs the weights leave little room, so the first doubling gives the most. That extra batch, not a faster single
# token, is what tensor parallelism buys a serving engine first.
# </details>
#
# **Lab.** [Lab 11](../labs/lab11_notebook.ipynb) has you write the two cuts of a weight, the attention sub-layer split
# by heads (which query and KV heads a rank holds, and where its one all-reduce goes), the vocabulary-parallel
# embedding and LM head (its gather), and optionally an all-reduce made of a reduce-scatter and an all-gather; it
# grades them on shards in one process, then in three real ranks, and serves requests with your layers.
