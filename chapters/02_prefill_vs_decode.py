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
# # 02 · Prefill vs decode
#
# A request to a language model runs in two phases that share the same weights and almost nothing else.
#
# * **Prefill** pushes the whole prompt through the model in one forward pass, fills the KV cache
#   (chapter 03 builds it) and yields the first new token. Its latency is the **time to first token**
#   (TTFT).
# * **Decode** then produces the rest one token per forward pass: a single new token per sequence,
#   attending to everything in the cache. Its pace is the **time per output token** (TPOT).
#
# Prefill multiplies every weight by hundreds of token vectors at once; decode multiplies every weight by
# one. This chapter measures both phases on SmolLM2, counts the FLOPs each does per byte it moves (the
# *arithmetic intensity*), places them on this machine's roofline, and shows the lever decode has left:
# batching many sequences into each step.

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

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import display

import mini_engine as me
from mini_engine import formulas
from mini_engine.devices import default_device, pick, timed
from mini_engine.generate import decode_step, prefill
from mini_engine.hardware import measure_ceilings
from mini_engine.kv_cache import ContiguousKVCache
from mini_engine.metrics import TokenTimer
from mini_engine.widgets import roofline_widget

device = default_device()
dtype = "float32" if device == "cpu" else "bfloat16"
model, tok = me.load_model("smollm2-135m", device=device, dtype=dtype)
cfg = model.config
nbytes = model.dtype.itemsize  # bytes per weight and per cached number
print(f"device: {device}, dtype: {dtype}, attention backend: {model.attention_backend}")


def best_time(fn, repeats: int = 3) -> float:
    """Fastest of a few runs after a warm-up: the machine's capability, not its noise."""
    fn()
    return min(timed(fn, device)[1] for _ in range(repeats))


# %% [markdown]
# ## Two phases in one request
#
# `generate_cached` is the two phases written out: one `prefill` call, then a loop of `decode_step`.
# A `TokenTimer` stamps the arrival of every token, so the first stamp is the TTFT and the gaps after
# it are the TPOT.

# %%
print(inspect.getsource(prefill))
print(inspect.getsource(decode_step))

# %%
prompt_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Why is the sky blue?"}]))
new_tokens = pick(cpu=24, gpu=128, device=device)
params = me.SamplingParams(max_tokens=new_tokens, ignore_eos=True)  # fixed length, so runs compare
me.generate_cached(model, prompt_ids, 2)  # warm-up
timer = TokenTimer(device).begin()
out = me.generate_cached(model, prompt_ids, new_tokens, params, on_token=timer.on_token)
print(tok.decode(out))
print(f"\nprompt {len(prompt_ids)} tokens -> TTFT {timer.ttft_s * 1e3:.0f} ms; "
      f"then {len(out) - 1} tokens at TPOT {timer.tpot_s * 1e3:.1f} ms ({1 / timer.tpot_s:.1f} tok/s)")

# %%
arrivals_ms = (np.array(timer.stamps) - timer.start) * 1e3
fig, ax = plt.subplots(figsize=(6, 2.8))
ax.step(arrivals_ms, np.arange(1, len(out) + 1), where="post")
ax.axvline(arrivals_ms[0], color="C1", ls="--", label=f"first token: TTFT {arrivals_ms[0]:.0f} ms")
ax.set(xlabel="ms since the request started", ylabel="tokens received", title="One request: prefill, then decode")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## This machine's ceilings
#
# As in chapter 00: the matmul rate (FLOP/s) and the memory bandwidth (bytes/s) of this device, in the
# model's dtype. Every prediction below is made from these two numbers.

# %%
ceil = measure_ceilings(device, model.dtype)
print(f"matmul {ceil.peak_flops / 1e9:.1f} GFLOP/s, memory {ceil.peak_bw / 1e9:.1f} GB/s, "
      f"ridge point {ceil.ridge_point:.1f} FLOP/byte")

# %% [markdown]
# ## Time to first token against prompt length
#
# TTFT is the time of one prefill. We time `prefill` on prompts of random token ids: the cost of a pass
# depends on how many tokens there are, not which. The roofline prediction is
# `max(FLOPs / peak FLOP/s, bytes / bandwidth)` with the FLOPs and bytes of `formulas.prefill_flops` and
# `formulas.prefill_bytes`.

# %%
prompt_lens = pick(cpu=[8, 32, 64, 128, 256], gpu=[64, 256, 1024, 2048, 4096], device=device)
prefill_cache = ContiguousKVCache(cfg, 1, max(prompt_lens), device, model.dtype)


def prefill_flops(n):
    # prefill() computes logits for the last token only; the formula prices the output matmul for all n.
    return formulas.prefill_flops(cfg, n) - 2 * cfg.vocab_size * cfg.hidden_size * (n - 1)


ttft = []
for n in prompt_lens:
    ids = torch.randint(100, 40000, (n,)).tolist()
    ttft.append(best_time(lambda: prefill(model, prefill_cache, [ids], [0]), repeats=2))
ttft = np.array(ttft)
ttft_pred = np.array([formulas.roofline_time(prefill_flops(n), formulas.prefill_bytes(cfg, n, nbytes),
                                             ceil.peak_flops, ceil.peak_bw) for n in prompt_lens])
prefill_achieved = np.array([prefill_flops(n) for n in prompt_lens]) / ttft
for n, t, p, a in zip(prompt_lens, ttft, ttft_pred, prefill_achieved):
    print(f"prompt {n:5d}: TTFT {t * 1e3:7.1f} ms   roofline {p * 1e3:7.1f} ms   {a / 1e9:6.1f} GFLOP/s achieved")

# %% [markdown]
# ## Time per output token against context length
#
# A decode step feeds one token and reads the keys and values of every earlier position from the cache.
# For timing, what the cache holds does not matter, only how much of it is read, so we fill a cache with
# random numbers instead of paying for a long prefill, then time one `decode_step` at several context
# lengths.

# %%
contexts = pick(cpu=[16, 256, 1024, 2048, 4096], gpu=[256, 1024, 4096, 8192], device=device)
decode_cache = ContiguousKVCache(cfg, 1, max(contexts), device, model.dtype)
decode_cache.data.normal_()
tpot = np.array([best_time(lambda: decode_step(model, decode_cache, [42], [c], [0]), repeats=5) for c in contexts])
tpot_pred = np.array([formulas.roofline_time(formulas.decode_flops(cfg, c), formulas.decode_bytes(cfg, 1, c, nbytes),
                                             ceil.peak_flops, ceil.peak_bw) for c in contexts])
for c, t, p in zip(contexts, tpot, tpot_pred):
    kv = formulas.kv_cache_bytes_for(cfg, c, 1, nbytes)
    print(f"context {c:5d}: TPOT {t * 1e3:6.1f} ms   roofline {p * 1e3:5.1f} ms   "
          f"(reads {formulas.weight_bytes(cfg, nbytes) / 2**20:.0f} MiB of weights + {kv / 2**20:5.1f} MiB of K/V)")

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
left.plot(prompt_lens, ttft * 1e3, "o-", label="measured")
left.plot(prompt_lens, ttft_pred * 1e3, "--", label="roofline bound")
left.set(xlabel="prompt tokens", ylabel="ms", title="TTFT grows with the prompt")
right.plot(contexts, tpot * 1e3, "o-", label="measured")
right.plot(contexts, tpot_pred * 1e3, "--", label="roofline bound")
right.set(xlabel="context tokens (cache + new)", ylabel="ms", title="TPOT: the weights dominate, K/V adds a little",
          ylim=(0, None))
for ax in (left, right):
    ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# Prefill time grows about linearly with the prompt: every token costs its `2 · params` FLOPs, and the
# arithmetic units are the bottleneck. A decode step costs nearly the same at any context length: it
# is dominated by reading all the weights once; the K/V reads grow with the context, but for this small
# GQA model they stay small next to the weights until the context reaches thousands of tokens.
#
# ## Arithmetic intensity
#
# Both phases multiply the same weight matrices, but by different amounts of data. A prefill of *n*
# tokens reads each weight once and uses it for *n* multiply-adds; a decode step uses it once per
# sequence in the batch. Counting FLOPs and bytes (`formulas.prefill_intensity`,
# `formulas.decode_intensity`) at this dtype:

# %%
print(f"{'work':<28}{'FLOPs':>12}{'bytes':>12}{'FLOP/byte':>11}  bound here (ridge {ceil.ridge_point:.1f})")
rows = [(f"prefill, n = {n}", formulas.prefill_flops(cfg, n), formulas.prefill_bytes(cfg, n, nbytes))
        for n in (1, 16, 128, 1024)]
rows += [(f"decode, batch {b}, context 256", formulas.decode_flops(cfg, 256, b), formulas.decode_bytes(cfg, b, 256, nbytes))
         for b in (1, 8, 64)]
for name, f, b in rows:
    bound = formulas.roofline_bound(f, b, ceil.peak_flops, ceil.peak_bw)
    print(f"{name:<28}{f / 1e9:10.2f} G{b / 2**20:9.0f} Mi{f / b:11.2f}  {bound}")

# %% [markdown]
# In fp32 every weight is 4 bytes and meets 2 FLOPs per token, so a single decode step sits near
# 0.5 FLOP/byte (in bf16 near 1). A prefill's intensity grows about like its length. Any kernel whose
# intensity is below the **ridge point** (peak FLOP/s ÷ bandwidth) waits on memory; above it, on the
# arithmetic units. Decode at batch 1 is far below the ridge on every machine; long prefills are far
# above it.
#
# ## Batching decode: throughput against latency
#
# Decode has idle arithmetic units, so it can take more work for free: advance *B* sequences in one
# step and the weights, read once, serve *B* tokens. `decode_step` takes a list of sequences, one cache
# slot each; `generate_batch` runs whole requests this way. We time a step at growing batch sizes.

# %%
batches = pick(cpu=[1, 2, 4, 8, 16, 32], gpu=[1, 4, 16, 64, 128, 256], device=device)
batch_context = pick(cpu=128, gpu=512, device=device)
batch_cache = ContiguousKVCache(cfg, max(batches), batch_context, device, model.dtype)
batch_cache.data.normal_()


def step(b):
    return lambda: decode_step(model, batch_cache, torch.randint(100, 40000, (b,)).tolist(),
                               [batch_context] * b, list(range(b)))


step_s = np.array([best_time(step(b)) for b in batches])
throughput = np.array(batches) / step_s
predicted_tok_s = formulas.predicted_decode_tok_s(cfg, np.array(batches), batch_context, nbytes,
                                                  ceil.peak_flops, ceil.peak_bw)
decode_achieved = formulas.decode_flops(cfg, batch_context, np.array(batches)) / step_s
for b, s, t, p in zip(batches, step_s, throughput, predicted_tok_s):
    print(f"batch {b:4d}: step {s * 1e3:7.1f} ms = per-token latency   throughput {t:8.1f} tok/s   "
          f"(roofline at most {p:8.1f})")

# %%
fig, ax = plt.subplots(figsize=(6.5, 3.6))
ax.plot(batches, throughput, "o-", color="C0", label="throughput (measured)")
ax.plot(batches, predicted_tok_s, ":", color="C0", label="throughput (roofline)")
ax.set(xscale="log", xlabel="decode batch size", ylabel="tokens/s, all sequences")
ax.set_xticks(batches, [str(b) for b in batches])
ax2 = ax.twinx()
ax2.plot(batches, step_s * 1e3, "s--", color="C3", label="per-token latency (step time)")
ax2.set_ylabel("ms per token, each sequence", color="C3")
ax.set_title("Bigger batches: more tokens/s, slower tokens")
lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
ax.legend(lines, [l.get_label() for l in lines], fontsize=8, loc="upper left")
plt.tight_layout()
plt.show()

# %% [markdown]
# Throughput climbs steeply while the step is memory-bound (the extra sequences ride on the same weight
# read) and flattens once the batch pushes the step past the ridge point; every sequence's tokens
# arrive more slowly all the while. A server picks the batch on purpose: large for cheap tokens, small
# for snappy ones.
#
# The same thing end to end: a few different prompts answered one at a time, then all together with
# `generate_batch` (one prefill for all of them, then batched decode steps).

# %%
questions = ["Name a fruit.", "What is 2 + 2?", "Give me a synonym for happy.", "Who wrote Hamlet?",
             "What colour is grass?", "Say hello in French.", "Name a planet.", "What is the opposite of hot?"]
requests = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
            for q in questions[:pick(cpu=4, gpu=8, device=device)]]
answer_len = pick(cpu=12, gpu=64, device=device)
answer_params = me.SamplingParams(max_tokens=answer_len, ignore_eos=True)
one_by_one, one_s = timed(lambda: [me.generate_cached(model, r, answer_len, answer_params) for r in requests], device)
together, batch_s = timed(lambda: me.generate_batch(model, requests, answer_len, answer_params), device)
for q, a in zip(questions, together):
    print(f"{q:<30} -> {tok.decode(a)!r}")
e2e_gain = one_s / batch_s
print(f"\nsame tokens as one at a time: {together == one_by_one}")  # batching changes the speed, not the answers
print(f"{len(requests)} requests x {answer_len} tokens: one at a time {one_s:.2f} s "
      f"({len(requests) * answer_len / one_s:.1f} tok/s), batched {batch_s:.2f} s "
      f"({len(requests) * answer_len / batch_s:.1f} tok/s): {e2e_gain:.1f}x")

# %% [markdown]
# ## The roofline, with what we measured
#
# The roofline draws both ceilings in one picture: at intensity *I* a kernel can reach at most
# `min(peak FLOP/s, I · bandwidth)`. Each point is a measurement from above: the FLOPs the formulas count
# divided by the time the step took, placed at its arithmetic intensity.

# %%
prefill_int = formulas.prefill_intensity(cfg, np.array(prompt_lens), nbytes)
decode_int = formulas.decode_intensity(cfg, np.array(batches), batch_context, nbytes)
x = np.logspace(-1.5, 3.5, 200)
fig, ax = plt.subplots(figsize=(7, 4.2))
ax.plot(x, formulas.attainable_flops(x, ceil.peak_flops, ceil.peak_bw) / 1e9, "k", label="roofline (this machine)")
ax.axvline(ceil.ridge_point, color="grey", ls=":", label=f"ridge {ceil.ridge_point:.1f} FLOP/byte")
ax.plot(prefill_int, prefill_achieved / 1e9, "s-", color="C1", label="prefill, prompt " + "/".join(map(str, prompt_lens)))
ax.plot(decode_int, decode_achieved / 1e9, "o-", color="C0", label="decode, batch " + "/".join(map(str, batches)))
for b, i, a in zip(batches, decode_int, decode_achieved):
    ax.annotate(str(b), (i, a / 1e9), textcoords="offset points", xytext=(3, -10), fontsize=7, color="C0")
ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)", ylabel="achieved GFLOP/s",
       title=f"SmolLM2-135M on this {device} ({dtype})")
ax.legend(fontsize=8, loc="lower right")
plt.tight_layout()
plt.show()

# %% [markdown]
# Decode at batch 1 sits at the far left, pinned under the slanted memory roof; every doubling of the
# batch moves it right and up, towards the ridge. Prefill lies further right: from a few dozen tokens
# on it is past the ridge, under the flat compute roof. The gaps between the points and the roof are
# overheads: Python between the kernels, small matmuls that run below the peak of a large square one,
# attention on a plain PyTorch path. Later chapters close some of them.
#
# ## Slider: batch size, intensity and the bound
#
# The widget prices a decode step with the formulas and **this machine's measured ceilings**: pick a
# batch and a context and read off the intensity, which roof binds, and the throughput that roof
# allows. Try the larger presets too, and see how far batch 1 sits from the ridge.

# %%
roofline = roofline_widget(peak_flops=ceil.peak_flops, peak_bw=ceil.peak_bw, model="smollm2-135m")
controls = {w.description: w for w in roofline.children[0].children}
controls["dtype"].value = {"float32": "fp32", "bfloat16": "bf16"}[dtype]  # the dtype the ceilings were measured in
controls["context"].value = batch_context
display(roofline)

# %%
crossover = next((b for b in range(1, 4097)
                  if formulas.decode_intensity(cfg, b, batch_context, nbytes) >= ceil.ridge_point), None)
print(f"on this {device}, a decode step at context {batch_context} reaches the ridge at batch {crossover}")
for b in (1, 4, 16, 64, 256):
    i = formulas.decode_intensity(cfg, b, batch_context, nbytes)
    bound = formulas.roofline_bound(formulas.decode_flops(cfg, batch_context, b),
                                    formulas.decode_bytes(cfg, b, batch_context, nbytes), ceil.peak_flops, ceil.peak_bw)
    print(f"  batch {b:4d}: {i:6.2f} FLOP/byte -> {bound}-bound")

# %% [markdown]
# ## What you measured

# %%
best = int(np.argmax(throughput))
summary = [
    (f"TTFT, {prompt_lens[0]} / {prompt_lens[-1]}-token prompt", f"{ttft[0] * 1e3:.0f} ms / {ttft[-1] * 1e3:.0f} ms"),
    (f"TPOT, context {contexts[0]} / {contexts[-1]}", f"{tpot[0] * 1e3:.1f} ms / {tpot[-1] * 1e3:.1f} ms"),
    ("prefill achieved (longest)", f"{prefill_achieved[-1] / 1e9:.1f} GFLOP/s of {ceil.peak_flops / 1e9:.1f} peak"),
    ("decode batch 1 achieved", f"{decode_achieved[0] / 1e9:.1f} GFLOP/s"),
    (f"intensity: decode b=1 / prefill {prompt_lens[-1]}", f"{decode_int[0]:.2f} / {prefill_int[-1]:.0f} FLOP/byte"),
    ("ridge point", f"{ceil.ridge_point:.1f} FLOP/byte"),
    (f"decode throughput, batch 1 / {batches[best]}", f"{throughput[0]:.1f} / {throughput[best]:.1f} tok/s"),
    (f"per-token latency, batch 1 / {batches[best]}", f"{step_s[0] * 1e3:.1f} / {step_s[best] * 1e3:.1f} ms"),
    (f"{len(requests)} requests batched vs one by one", f"{e2e_gain:.1f}x faster"),
]
for k, v in summary:
    print(f"{k:<36} {v}")
