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
# # 04 · Batching: static, dynamic, continuous
#
# Chapter 02 showed that a decode step is limited by reading the weights, not by arithmetic: one step for
# sixteen sequences costs little more than one step for one, because the weights are read once for all of
# them. So a server should decode many requests together. The question this chapter answers is *which*
# requests, and *when* they may join and leave the batch.
#
# - **Static batching** pads a batch to its longest request and runs it to the end: a request that finishes
#   early leaves its lane idle until the longest one is done, and new requests wait for the whole batch.
# - **Dynamic batching** collects the requests that arrive within a short time window (or until a batch is
#   full) and runs them as one static batch, at the price of waiting for the window to close. The engine's
#   version also sorts them into buckets of similar prompt length, a separate idea (length bucketing) that
#   cuts the padding a static batch carries.
# - **Continuous batching** (Orca, Yu et al. 2022) decides the batch at every step: a finished request leaves
#   at once, and a waiting one takes its place at the next step.
#
# We first simulate the three on paper, then run them on the real engine, `mini_engine.LLM`, and measure
# throughput, time to first token (TTFT) and time per output token (TPOT).

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
import inspect
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import display

import mini_engine as me
from mini_engine import formulas, simulate
from mini_engine.course.devices import default_device, fitting, pick
from mini_engine.course.hardware import describe_machine
from mini_engine.engine import LLM, LLMEngine
from mini_engine.course.metrics import percentile
from mini_engine.course.widgets import batching_widget

device = default_device()
dtype = me.default_dtype(device)
model, tok = me.load_model("smollm2-135m", device=device, dtype=dtype)
print(f"device: {device}, dtype: {dtype}, {torch.get_num_threads()} CPU threads")

# %% [markdown]
# ## 1. On paper: how busy are the lanes?
#
# The simulator strips a batch down to its lanes: each step, every busy lane produces one token of one
# request. Requests need different numbers of tokens. Under static batching a lane whose request is done
# sits idle until the batch's longest request finishes; under continuous batching it takes the next
# request at once. With output lengths uniform between 1 and 200 and 32 lanes:

# %%
lengths = simulate.sample_lengths(1000, mean=100, spread=1.0)
static_run, continuous_run = simulate.simulate_static(lengths, 32), simulate.simulate_continuous(lengths, 32)
for run in (static_run, continuous_run):
    print(f"{run.policy:>10}: {100 * run.utilisation:3.0f}% of lane-steps busy, {run.steps} steps, "
          f"{run.tokens_per_step:.1f} tokens per step")
sim_rows = {r.policy: r.utilisation for r in (static_run, continuous_run)}

# %% [markdown]
# ### Our numbers against the textbook's 50% → 90%
#
# The textbook (chapter 00 introduces it) says of continuous batching: "iteration-level scheduling evicts
# finished requests and admits waiting ones every token step, lifting utilization ~50% → ~90% (≈1.8× more
# tokens/sec)". The simulator's numbers above are close but not the same; each comes from a few
# assumptions we can check.
#
# **Static.** A batch lasts as long as its longest request. With lengths uniform in [1, L], a request
# needs about L/2 steps on average and the longest of B needs about L·B/(B + 1), so the share of busy
# lane-steps is about (B + 1) / (2B): a little over one half for 32 lanes, and exactly one half only in
# the limit of a very large batch. The textbook's 50% is that limit.
#
# **Continuous.** A lane idles only at the very end, while the last requests drain and no one waits to
# take a free lane. That drain costs about the same number of idle lane-steps however long the queue
# was, so the share it wastes shrinks as more requests are queued per lane. Our 1000 requests give 32
# lanes a long queue; the textbook's 90% is what a shorter queue gives:

# %%
batch_lanes = static_run.batch_size
print(f"static, {batch_lanes} lanes: simulated {100 * static_run.utilisation:.1f}%, "
      f"(B + 1) / 2B = {100 * (batch_lanes + 1) / (2 * batch_lanes):.1f}%, limit for a large batch 50%")
queue_sizes = [64, 128, 256, 384, 512, 1000, 4000]
queue_util = {n: simulate.simulate_continuous(simulate.sample_lengths(n, mean=100, spread=1.0), batch_lanes).utilisation
              for n in queue_sizes}
for n, u in queue_util.items():
    print(f"continuous, {n:5d} requests queued ({n / batch_lanes:5.1f} per lane): {100 * u:5.1f}% busy")
ninety = next(n for n, u in queue_util.items() if u >= 0.9)
below = max(n for n, u in queue_util.items() if n < ninety)
print(f"continuous crosses 90% between {below} and {ninety} queued requests ({below / batch_lanes:.0f} to "
      f"{ninety / batch_lanes:.0f} per lane): the textbook's figure fits a queue of that size")
print(f"the textbook's gain: 90% / 50% = {0.9 / 0.5:.1f}x; the simulator's: {100 * continuous_run.utilisation:.0f}% / "
      f"{100 * static_run.utilisation:.0f}% = {continuous_run.utilisation / static_run.utilisation:.2f}x "
      f"(tokens per step: {continuous_run.tokens_per_step / static_run.tokens_per_step:.2f}x)")

# %% [markdown]
# "More tokens per second" follows from "more tokens per step" only if a step costs the same whether 16
# or 32 of its lanes are busy. For decode that is nearly so, since a step's cost is dominated by reading
# the weights (chapter 02); the engine measurements below check it on real steps, where prefill work
# and the CPU's arithmetic make it only roughly true.
#
# Drag the sliders: with no length spread (every request equally long) the two policies coincide; the more
# the lengths differ, and the larger the batch, the more static batching wastes (the longest of more
# requests is longer).

# %%
display(batching_widget(batch=32, spread=1.0, requests=256))

# %%
spreads = np.linspace(0, 1, 11)
fig, ax = plt.subplots(figsize=(6, 3.2))
for batch, style in ((8, "--"), (32, "-")):
    for sim, color in ((simulate.simulate_static, "C3"), (simulate.simulate_continuous, "C2")):
        busy = [sim(simulate.sample_lengths(1000, 100, s), batch).utilisation for s in spreads]
        ax.plot(spreads, busy, style, color=color, label=f"{sim.__name__.split('_')[1]}, batch {batch}")
ax.set(xlabel="length spread (0: all equal, 1: uniform in [1, 200])", ylabel="busy lane-steps",
       title="Static batching wastes what the length spread leaves idle", ylim=(0, 1.05))
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 2. The engine
#
# `mini_engine.LLM` is a small serving engine in the style of vLLM. Requests queue up; at each step the
# **scheduler** (pure Python, `mini_engine/scheduler.py`) decides which requests run and how many of their
# tokens; the **model runner** packs those tokens end to end, with no padding, into one forward pass over a
# KV cache with one slot per running request (`kv_cache="contiguous"`: each slot reserves `max_model_len`
# positions; chapter 07 replaces it with the paged cache, the engine's default); the **sampler** draws each
# request's next token with its own parameters and random stream. The three policies differ only in when a
# waiting request is admitted:

# %%
from mini_engine.scheduler import ContinuousPolicy, Scheduler, StaticPolicy

print(inspect.getsource(StaticPolicy.admit))
print(inspect.getsource(ContinuousPolicy.admit))
print(inspect.getsource(Scheduler.schedule))

# %% [markdown]
# The same engine answers real prompts. Each request may carry its own sampling parameters:

# %%
llm = LLM.from_model(model, tok, kv_cache="contiguous", max_num_seqs=4, max_model_len=256)
print(llm)
questions = ["What is the capital of France?", "Name three primary colors.", "What is 2 + 2?"]
chats = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
params = [me.SamplingParams(max_tokens=24), me.SamplingParams(max_tokens=24, temperature=0.7, seed=0),
          me.SamplingParams(max_tokens=12)]
for q, out in zip(questions, llm.generate(chats, params, use_tqdm=False)):
    print(f"{q!r} -> {out.text!r}  ({len(out.token_ids)} tokens, TTFT {out.metrics.ttft_s * 1e3:.0f} ms)")

# %% [markdown]
# ## 3. One workload, three policies
#
# Now a mixed workload: requests with prompt and output lengths spread over a range (random token ids, and
# `ignore_eos` so each request produces exactly its length), all queued at once. Each policy serves the same
# requests with the same number of slots. Our static batching does not pad (the engine packs tokens), so
# what it loses is only the wait for each batch's longest request; `python -m mini_engine bench --workload
# serving` adds HF transformers' padded static `generate` to measure the padding cost as well.

# %%
n_requests, slots = pick(cpu=16, gpu=256, device=device), pick(cpu=4, gpu=32, device=device)
rng = np.random.default_rng(0)
prompt_lens = rng.integers(*pick(cpu=(8, 49), gpu=(16, 513), device=device), size=n_requests)
output_lens = rng.integers(*pick(cpu=(4, 41), gpu=(16, 513), device=device), size=n_requests)
prompts = [rng.integers(1000, 20000, size=n).tolist() for n in prompt_lens]
work_params = [me.SamplingParams(max_tokens=int(n), ignore_eos=True) for n in output_lens]
max_len = int((prompt_lens + output_lens).max())
print(f"{n_requests} requests, prompts {prompt_lens.min()}-{prompt_lens.max()} tokens, "
      f"outputs {output_lens.min()}-{output_lens.max()} tokens, {slots} slots")


def serve(policy, batch=slots, chunk=512, reqs=None):
    """Run the workload (or `reqs` = (prompts, params)) under one policy; return outputs, engine, seconds."""
    engine_llm = LLM.from_model(model, tok, kv_cache="contiguous", scheduling=policy, max_num_seqs=batch,
                                max_model_len=max_len, chunked_prefill_tokens=chunk, record_trace=True,
                                dynamic_bucket_width=pick(cpu=16, gpu=128, device=device))
    ps, sps = reqs or (prompts, work_params)
    t0 = time.perf_counter()
    outs = engine_llm.generate(ps, sps, use_tqdm=False)
    return outs, engine_llm.engine, time.perf_counter() - t0


serve("continuous", reqs=(prompts[:2], [me.SamplingParams(max_tokens=2)] * 2))  # warm-up, not measured
runs = {policy: serve(policy) for policy in ("static", "dynamic", "continuous")}


def summarise(outs, engine, seconds):
    trace = engine.trace
    busy = sum(len(r.chunks) for r in trace) / (engine.config.max_num_seqs * len(trace))
    ttft, tpot = [o.metrics.ttft_s for o in outs], [o.metrics.tpot_s for o in outs]
    return {"tok/s": sum(len(o.token_ids) for o in outs) / seconds, "seconds": seconds, "steps": len(trace),
            "slots busy": busy, "TTFT p50": percentile(ttft, 50), "TTFT p99": percentile(ttft, 99),
            "TPOT p50": percentile(tpot, 50), "TPOT p99": percentile(tpot, 99)}


results = {policy: summarise(*run) for policy, run in runs.items()}
print(f"{'policy':>10} {'tok/s':>7} {'seconds':>8} {'steps':>6} {'busy':>6} {'TTFT p50':>9} {'TTFT p99':>9} "
      f"{'TPOT p50':>9} {'TPOT p99':>9}")
for policy, r in results.items():
    print(f"{policy:>10} {r['tok/s']:7.1f} {r['seconds']:8.1f} {r['steps']:6d} {100 * r['slots busy']:5.0f}% "
          f"{r['TTFT p50']:8.2f}s {r['TTFT p99']:8.2f}s {r['TPOT p50'] * 1e3:7.0f}ms {r['TPOT p99'] * 1e3:7.0f}ms")
print(describe_machine(device))  # what the table ran on

# %% [markdown]
# Did the three policies compute the same thing? Greedy decoding depends only on a request's own tokens,
# not on which other requests share its steps, so each request should get identical tokens under every
# policy (outputs come back in prompt order):

# %%
tokens_by_policy = {policy: [o.token_ids for o in outs] for policy, (outs, _, _) in runs.items()}
for policy, ids in tokens_by_policy.items():
    same = [a == b for a, b in zip(ids, tokens_by_policy["static"])]
    print(f"{policy:>10}: {sum(same)}/{len(same)} requests with the same tokens as static, "
          f"{sum(map(len, ids))} tokens in all")
policies_agree = all(ids == tokens_by_policy["static"] for ids in tokens_by_policy.values())
print(f"every policy produced the same tokens: {policies_agree}")

# %% [markdown]
# What differs is the number of steps needed to produce them. A picture of the slots over time shows why. Each
# bar is one request in one slot during one step; hatched bars are prompt (prefill) work.

# %%
def draw_timeline(ax, engine, title, t_end):
    t0 = engine.trace[0].start
    for record in engine.trace:
        for rid, slot, n_tokens, sampled in record.chunks:
            prefill = n_tokens > 1 or not sampled
            ax.barh(slot, record.end - record.start, left=record.start - t0, height=0.8,
                    color=plt.cm.tab20(rid % 20), hatch="///" if prefill else None, edgecolor="white", lw=0.3)
    ax.set(xlim=(0, t_end), ylabel="slot", title=title, yticks=range(engine.config.max_num_seqs))
    ax.invert_yaxis()


t_end = max(seconds for _, _, seconds in runs.values())
fig, axes = plt.subplots(3, 1, figsize=(10, 6), sharex=True)
for ax, (policy, (outs, engine, seconds)) in zip(axes, runs.items()):
    draw_timeline(ax, engine, f"{policy}: {seconds:.1f} s, {100 * results[policy]['slots busy']:.0f}% of slot-steps busy",
                  t_end)
axes[-1].set_xlabel("seconds")
plt.tight_layout()
plt.show()

# %% [markdown]
# Static batching leaves slots empty while a batch's longest request finishes. Dynamic batching here also
# buckets requests by prompt length, so its batches are smaller (a bucket rarely fills every slot) and a
# request may wait for its bucket's window to close: with an engine that does not pad, it pays the bucketing's
# costs without collecting its benefit (less padding). Continuous batching refills a slot at the next step;
# its TPOT is a little higher, because its steps also carry the prompts of requests that join mid-batch.
#
# Latency, request by request: TTFT includes the time spent queued, which is where the policies differ most;
# TPOT is how fast a running request advances.

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
for policy, (outs, _, _) in runs.items():
    for ax, values in ((left, [o.metrics.ttft_s for o in outs]), (right, [o.metrics.tpot_s * 1e3 for o in outs])):
        values = np.sort([v for v in values if v == v])
        ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=policy)
left.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="time to first token")
right.set(xlabel="TPOT (ms)", title="time per output token")
left.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# A padded implementation (HF `generate` with a static batch) would also compute the padding. From the
# workload alone: every batch pads its prompts to the longest one and decodes until its longest output.

# %%
useful = int(prompt_lens.sum() + output_lens.sum())
padded = sum(len(prompt_lens[i:i + slots]) * (prompt_lens[i:i + slots].max() + output_lens[i:i + slots].max())
             for i in range(0, n_requests, slots))
print(f"useful tokens {useful}, computed by a padded static batch {padded}: {100 * (1 - useful / padded):.0f}% "
      "of its token positions are padding or idle lanes")

# %% [markdown]
# ## 4. Batch size: throughput against latency
#
# A bigger batch shares each read of the weights among more requests, so throughput rises; but every step
# carries more work, so each request's tokens come more slowly. Continuous batching on the same workload
# with different numbers of slots traces the curve a serving engineer tunes along.

# %%
# Each slot reserves max_len positions of cache: a batch whose reservation this GPU cannot hold is left out.
sweep_batches = fitting(pick(cpu=[1, 2, 4, 8], gpu=[1, 4, 16, 64, 128], device=device),
                        lambda b: formulas.kv_cache_bytes_for(model.config, max_len, b, model.dtype.itemsize),
                        device, "batch")
sweep_n = pick(cpu=8, gpu=128, device=device)
sweep_reqs = (prompts[:sweep_n], [me.SamplingParams(max_tokens=int(min(n, 24)), ignore_eos=True)
                                  for n in output_lens[:sweep_n]])
sweep = {b: summarise(*serve("continuous", batch=b, reqs=sweep_reqs)) for b in sweep_batches}
for b, r in sweep.items():
    print(f"batch {b:4d}: {r['tok/s']:7.1f} tok/s, TPOT p50 {r['TPOT p50'] * 1e3:6.0f} ms")

fig, ax = plt.subplots(figsize=(5.5, 3.4))
ax.plot([r["TPOT p50"] * 1e3 for r in sweep.values()], [r["tok/s"] for r in sweep.values()], "o-")
for b, r in sweep.items():
    ax.annotate(f"batch {b}", (r["TPOT p50"] * 1e3, r["tok/s"]), textcoords="offset points", xytext=(5, -10),
                fontsize=8)
ax.set(xlabel="TPOT p50 (ms): latency per token", ylabel="tokens/s: throughput",
       title="Throughput against latency (continuous)")
plt.tight_layout()
plt.show()

# %% [markdown]
# ### A note on the textbook's "5 to 50×"
#
# The textbook puts naive code for a 7B model on an A100 at "somewhere around 5 to 10 tokens per second"
# and "the same model, same hardware, with a fully optimized inference stack" at "200 to 500 tokens per
# second", and calls the difference "a 5 to 50× throughput gap"; later it calls the combined effect
# "roughly 5× to 10×". Its own endpoints give neither (chapter 01 did the division). And 200 to 500 tok/s is more than *one* stream of a 7B
# model can decode on an A100 at all: each token must read the fp16 weights once, so the roofline of
# chapter 02 caps a single stream, and only a batch, which shares each read, gets past it.

# %%
A100 = dict(peak_flops=312e12, peak_bw=2.039e12)  # dense bf16 FLOP/s and HBM bytes/s, A100-80GB SXM
print(f"the textbook's endpoints: 200 / 10 = {200 / 10:.0f}x to 500 / 5 = {500 / 5:.0f}x")
for b in (1, 4, 16, 64):
    ceiling = formulas.predicted_decode_tok_s("llama-7b", b, 1024, 2, **A100)
    print(f"llama-7b fp16 on an A100, batch {b:3d}, 1K context: roofline ceiling {ceiling:7.0f} tok/s in all")
print(f"on this machine, the sweep above: batch {sweep_batches[-1]} gives "
      f"{sweep[sweep_batches[-1]]['tok/s'] / sweep[sweep_batches[0]]['tok/s']:.1f}x the tok/s of batch {sweep_batches[0]}")

# %% [markdown]
# So the textbook's 200 to 500 tok/s is the throughput of a batched server, summed over its streams, set
# against the 5 to 10 tok/s of one naive stream; the ratio of its endpoints is 20× to 100×, and most of
# it is batching, the subject of this chapter. Batching raises what all users get together, not what one
# user sees: the tokens per second of one stream stay under the batch-1 ceiling whatever the batch, and
# even fall a little as the batch grows. Two later chapters do lift one stream, by changing what a weight
# read buys. Speculative decoding (Leviathan et al. 2023; chapter 06) gets several of one stream's tokens
# out of a single read of the weights, so one stream can pass bandwidth / model bytes; quantization
# (weight-only int4, as in GPTQ, Frantar et al. 2023; chapter 10) makes the read itself smaller, which
# raises the ceiling.

# %% [markdown]
# ## 5. Chunked prefill: a long prompt arrives mid-stream
#
# A running request advances one token per step, so anything that makes a step long stalls it. A long
# prompt is such a thing: run whole, its prefill turns one step into a long one, and every running request
# waits for it. Chunked prefill (Sarathi, Agrawal et al. 2023) caps the tokens of a step
# (`chunked_prefill_tokens`): the prompt is split into chunks, each run alongside the decodes of the running
# requests, so their stall is spread into many small delays. We add the long prompt with `LLMEngine.add_request` while other requests are decoding.

# %%
long_len = pick(cpu=384, gpu=4096, device=device)
chunk = pick(cpu=64, gpu=512, device=device)
long_prompt = rng.integers(1000, 20000, size=long_len).tolist()


def mid_stream(chunk_tokens):
    engine = LLMEngine.from_model(model, tok, kv_cache="contiguous", max_num_seqs=4, max_model_len=long_len + 32,
                                  chunked_prefill_tokens=chunk_tokens, record_trace=True)
    for p in prompts[:3]:
        engine.add_request(p[:16], me.SamplingParams(max_tokens=30, ignore_eos=True))
    outs = {}
    for step in range(200):
        if step == 6:  # the running requests are decoding by now
            arrival = time.perf_counter()
            long_id = engine.add_request(long_prompt, me.SamplingParams(max_tokens=4, ignore_eos=True))
        outs.update((o.request_id, o) for o in engine.step())
        if not engine.has_unfinished():
            break
    running = [o for rid, o in outs.items() if rid != long_id]
    gaps = [(t - arrival, (t - prev) * 1e3) for o in running
            for prev, t in zip(o.metrics.token_times, o.metrics.token_times[1:])]
    return {"gaps": gaps, "max stall ms": max(g for _, g in gaps),
            "TPOT p50 ms": percentile([o.metrics.tpot_s * 1e3 for o in running], 50),
            "long TTFT s": outs[long_id].metrics.ttft_s}


chunked = {"whole prompt": mid_stream(None), f"chunks of {chunk}": mid_stream(chunk)}
fig, ax = plt.subplots(figsize=(7, 3.2))
for name, r in chunked.items():
    t, g = zip(*sorted(r["gaps"]))
    ax.plot(t, g, ".", label=name, alpha=0.7)
    print(f"{name:>14}: longest stall of a running request {r['max stall ms']:5.0f} ms, their TPOT p50 "
          f"{r['TPOT p50 ms']:4.0f} ms; the long prompt's TTFT {r['long TTFT s']:.2f} s")
ax.axvline(0, color="k", lw=0.8)
ax.set(xlabel=f"seconds since the {long_len}-token prompt arrived", ylabel="gap between tokens (ms)",
       title="Running requests' inter-token gaps", yscale="log")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# Without chunking, one step holds the whole prompt and the running requests see a single long stall. With
# chunks, the same work is spread over several steps: each stall is shorter, the running requests keep
# streaming, and the long prompt's own first token comes a little later (its prefill now shares steps).
#
# What the CPU changes here: chapter 02 found that on a CPU a decode step turns compute-bound after a few
# sequences (its ridge point is low), so each sequence added to a batch costs real arithmetic, and the
# throughput this chapter gains by batching is smaller than a GPU's, whose steps stay memory-bound, with each
# extra sequence nearly free, up to far larger batches. The ideas are the same on both: keep every lane of the
# batch busy, and let no long prompt stall the others. (How the engine multiplies a batch's rows by the weights
# on a CPU is the subject of the optional appendix [A1](A1_fast_on_a_cpu.ipynb).)

# %% [markdown]
# ## What you measured

# %%
best = max(sweep, key=lambda b: sweep[b]["tok/s"])
summary = [
    ("simulator, 32 lanes: busy lane-steps, static", f"{100 * sim_rows['static']:.0f}%"),
    ("simulator, 32 lanes: busy lane-steps, continuous", f"{100 * sim_rows['continuous']:.0f}%"),
    ("simulator: continuous crosses 90% between", f"{below} and {ninety} queued requests"),
] + [(f"engine, {n_requests} requests / {slots} slots: {p}", f"{r['tok/s']:.1f} tok/s, TTFT p50 {r['TTFT p50']:.2f} s, "
      f"{100 * r['slots busy']:.0f}% slots busy") for p, r in results.items()] + [
    ("continuous vs static throughput", f"{results['continuous']['tok/s'] / results['static']['tok/s']:.2f}x"),
    ("every policy produced the same tokens", f"{policies_agree}"),
    (f"batch sweep {sweep_batches}: best throughput", f"batch {best}: {sweep[best]['tok/s']:.1f} tok/s "
     f"({sweep[best]['tok/s'] / sweep[sweep_batches[0]]['tok/s']:.1f}x batch {sweep_batches[0]})"),
] + [(f"long prompt mid-stream, {name}: longest stall", f"{r['max stall ms']:.0f} ms") for name, r in chunked.items()]
width = max(len(k) for k, _ in summary)
for k, v in summary:
    print(f"{k:<{width}}  {v}")


# %% [markdown]
# ## Exercises: predict, then run
#
# Write your prediction down before you run each cell; the answer under it says what you should see
# and why. Each cell takes a few seconds.
#
# **1. A smaller static batch.** With the same length mix (uniform in [1, 200]), does static batching
# waste more or less of its lane-steps with 8 lanes than with 32? Predict the busy share with the
# estimate from section 1.

# %%
for lanes in (8, 32):
    run8 = simulate.simulate_static(lengths, lanes)
    print(f"static, {lanes:2d} lanes: {100 * run8.utilisation:.1f}% busy; (B + 1) / 2B = "
          f"{100 * (lanes + 1) / (2 * lanes):.1f}%")

# %% [markdown]
# <details><summary>Answer</summary>
#
# Less waste with fewer lanes. A batch waits for its longest member, and the longest of 8 random lengths
# is on average shorter than the longest of 32, so the share (B + 1) / 2B is a little higher for small
# batches; it falls towards one half as the batch grows. Static batching punishes exactly the large
# batches that decode needs to read its weights efficiently.
# </details>
#
# **2. `max_num_seqs`: how many steps?** Eight requests, each with a 10-token prompt and exactly 4 output
# tokens, run under continuous batching with `max_num_seqs` 1, 4 and 8. Predict how many engine steps
# each takes (the prompt and the first token take one step). Which is fastest in seconds, and by as much
# as in steps?

# %%
eight = ([rng.integers(1000, 20000, size=10).tolist() for _ in range(8)],
         [me.SamplingParams(max_tokens=4, ignore_eos=True)] * 8)
for seqs in (1, 4, 8):
    outs, engine, seconds = serve("continuous", batch=seqs, reqs=eight)
    print(f"max_num_seqs={seqs}: {len(engine.trace):3d} steps, {seconds:5.2f} s, "
          f"{sum(len(o.token_ids) for o in outs) / seconds:6.1f} tok/s")

# %% [markdown]
# <details><summary>Answer</summary>
#
# Each request needs 4 steps (one prefill step that samples its first token, then 3 decode steps), so
# one slot needs 8 × 4 steps, four slots a quarter of that and eight slots an eighth. The seconds fall
# by less than the steps: a step that carries eight requests does more work than a step that carries
# one. How much more depends on the machine: where a step is dominated by reading the weights (a GPU) the
# extra rows are almost free; where arithmetic dominates (a CPU after a few sequences, section 5's note and
# chapter 02) they are not.
# </details>
#
# **3. `chunked_prefill_tokens`: when does a long prompt get its first token?** One request with a
# 300-token prompt, `chunked_prefill_tokens=64`: how many steps run before its first output token? And
# with chunking off (`None`)?

# %%
long_one = ([rng.integers(1000, 20000, size=300).tolist()], [me.SamplingParams(max_tokens=2, ignore_eos=True)])
for chunk_tokens in (64, None):
    one_llm = LLM.from_model(model, tok, kv_cache="contiguous", max_num_seqs=1, max_model_len=320,
                             chunked_prefill_tokens=chunk_tokens, record_trace=True)
    outs, engine = one_llm.generate(*long_one, use_tqdm=False), one_llm.engine
    first = next(r.step for r in engine.trace if any(sampled for *_, sampled in r.chunks))
    print(f"chunked_prefill_tokens={chunk_tokens}: first token in step {first} (0-based), "
          f"prompt tokens per step {[n for r in engine.trace[:first + 1] for _, _, n, _ in r.chunks]}, "
          f"TTFT {outs[0].metrics.ttft_s * 1e3:.0f} ms")

# %% [markdown]
# <details><summary>Answer</summary>
#
# With chunks of 64 the prompt needs ⌈300 / 64⌉ steps, and the last of them samples the first token;
# without chunking one step takes the whole prompt. Alone on the engine, chunking only delays the first
# token a little (more steps, each with its fixed cost). Its benefit appears when other requests are
# decoding at the same time, as section 5 measured: their stall is spread over many short steps.
# </details>
#
# **4. Static against continuous when every request is alike.** The eight requests of exercise 2 (prompts
# of equal length, exactly 4 output tokens each) on 4 slots: how many steps does static batching take, and how
# many does continuous batching take?

# %%
for policy in ("static", "continuous"):
    outs, engine, seconds = serve(policy, batch=4, reqs=eight)
    busy = sum(len(r.chunks) for r in engine.trace) / (4 * len(engine.trace))
    print(f"{policy:>10}: {len(engine.trace)} steps, {100 * busy:.0f}% of slot-steps busy")

# %% [markdown]
# <details><summary>Answer</summary>
#
# The same number. When every request in a batch finishes at the same step, no lane waits for a longer
# neighbour, so static batching loses nothing and the two policies make identical batches (the
# simulator's spread-0 case in section 1). Continuous batching pays off only when lengths differ, which
# in real traffic they always do.
# </details>
#
# **Lab.** [Lab 04](../labs/lab04_notebook.ipynb) has you write the continuous-batching scheduler itself:
# admit into free slots, one model step for the whole batch, evict the finished, and drive the real
# model with it.
