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
# - **Dynamic batching** groups requests of similar length (less padding), at the price of waiting for a
#   group to fill.
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
from mini_engine import simulate
from mini_engine.devices import default_device, pick
from mini_engine.engine import LLM, LLMEngine
from mini_engine.metrics import percentile
from mini_engine.widgets import batching_widget

device = default_device()
dtype = "float32" if device == "cpu" else "bfloat16"
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
# About half the static batch's compute is spent on lanes that wait: the seed's "roughly 50% → 90%".
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

# %% [markdown]
# Every policy produced the same tokens (greedy decoding is deterministic, and the tests check it); what
# differs is the number of steps needed to produce them. A picture of the slots over time shows why. Each
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
# Static batching leaves slots empty while a batch's longest request finishes. Dynamic batching here buckets
# requests by prompt length, so its batches are smaller (a bucket rarely fills every slot) and a request may
# wait for its bucket: with an engine that does not pad, it pays dynamic batching's costs without collecting
# its benefit (less padding). Continuous batching refills a slot at the next step; its TPOT is a little
# higher, because its steps also carry the prompts of requests that join mid-batch.
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
sweep_batches = pick(cpu=[1, 2, 4, 8], gpu=[1, 4, 16, 64, 128], device=device)
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
# ### The same products, in another order: measure, don't assume
#
# A step of 16 decodes multiplies a skinny 16-row activation matrix by every weight matrix. `x @ W.T` and
# `(W @ x.T).T` are the same numbers, but BLAS libraries run them through different kernels, and which is
# faster depends on the CPU, its instruction set and the library version: a form that won by 1.4x on one
# course machine lost by 2.6x on another. So the engine's `Linear` (in `products.py`) times the candidate
# forms on *your* machine the first time it meets a weight shape with a new number of rows, and keeps the
# fastest (`autotune.py`; F.linear unless another form wins by 3%). Below: the candidates as timed here for
# 1, 4 and 16 rows, then the model's weight products alone, chained (`hardware.matmul_floor_tok_s`), with
# the chosen forms and with plain F.linear. That is the ceiling on decode throughput at each batch size.
# Only the order of the sums changes, so results agree to float rounding (`tests/engine/test_linear.py`).

# %%
from mini_engine.hardware import format_tuned_forms, matmul_floor_tok_s, tune_products

tune_products(model, (1, 4, 16))
for b in (1, 4, 16):
    print(f"{b} row(s):\n{format_tuned_forms(rows=b)}\n")
floor_rows = {b: (matmul_floor_tok_s(model, b), matmul_floor_tok_s(model, b, plain=True)) for b in (1, 4, 16)}
for b, (ours, plain) in floor_rows.items():
    print(f"batch {b:2d}: weight products alone {ours:7.1f} tok/s in the tuned forms, {plain:7.1f} with "
          f"F.linear ({ours / plain:.2f}x)")

# %% [markdown]
# ## 5. Chunked prefill: a long prompt arrives mid-stream
#
# A running request advances one token per step, so anything that makes a step long stalls it. A long
# prompt is such a thing: run whole, its prefill turns one step into a long one, and every running request
# waits for it. Chunked prefill caps the tokens of a step (`chunked_prefill_tokens`): the prompt is split
# into chunks, each run alongside the decodes of the running requests, so their stall is spread into many
# small delays. We add the long prompt with `LLMEngine.add_request` while other requests are decoding.

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
# ## What you measured

# %%
best = max(sweep, key=lambda b: sweep[b]["tok/s"])
summary = [
    ("simulator, 32 lanes: busy lane-steps, static", f"{100 * sim_rows['static']:.0f}%"),
    ("simulator, 32 lanes: busy lane-steps, continuous", f"{100 * sim_rows['continuous']:.0f}%"),
] + [(f"engine, {n_requests} requests / {slots} slots: {p}", f"{r['tok/s']:.1f} tok/s, TTFT p50 {r['TTFT p50']:.2f} s, "
      f"{100 * r['slots busy']:.0f}% slots busy") for p, r in results.items()] + [
    ("continuous vs static throughput", f"{results['continuous']['tok/s'] / results['static']['tok/s']:.2f}x"),
    ("weight products at batch 16: tuned forms / F.linear", f"{floor_rows[16][0] / floor_rows[16][1]:.2f}x"),
    (f"batch sweep {sweep_batches}: best throughput", f"batch {best}: {sweep[best]['tok/s']:.1f} tok/s "
     f"({sweep[best]['tok/s'] / sweep[sweep_batches[0]]['tok/s']:.1f}x batch {sweep_batches[0]})"),
] + [(f"long prompt mid-stream, {name}: longest stall", f"{r['max stall ms']:.0f} ms") for name, r in chunked.items()]
width = max(len(k) for k, _ in summary)
for k, v in summary:
    print(f"{k:<{width}}  {v}")
