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
from mini_engine.course.devices import default_device, fitting, pick, timed
from mini_engine.generate import decode_step, prefill
from mini_engine.course.hardware import measure_ceilings
from mini_engine.kv_cache import ContiguousKVCache
from mini_engine.course.metrics import TokenTimer
from mini_engine.course.widgets import roofline_widget

device = default_device()
dtype = me.default_dtype(device)
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
# At these prompt lengths prefill time grows about linearly with the prompt: every token costs its
# `2 · params` FLOPs in the weight matmuls, and those FLOPs are most of the work. Attention adds
# `4 · L · H · D · n²`, which grows with the square of the prompt, so it takes over past a crossover,
# `params / (2 · L · H · D)` tokens (`formulas.attention_crossover_tokens`). Below it TTFT is close to
# linear in the prompt; well above it, close to quadratic. That is the regime the textbook the course
# accompanies (chapter 00) has in mind when it writes that "long prompts move TTFT up roughly quadratically
# because of the attention term".
# The FLOP count of the whole range, priced at this machine's matmul rate, with the measured points on top:

# %%
ttft_crossover = formulas.attention_crossover_tokens(cfg)
print(f"attention = weight-matmul FLOPs at {ttft_crossover:,.0f} prompt tokens "
      f"({2 * ttft_crossover:,.0f} for a causal kernel that skips the masked half); "
      f"Llama-7B: {formulas.attention_crossover_tokens('llama-7b'):,.0f}")
n_range = np.logspace(0, np.log10(16 * ttft_crossover), 200)
matmul_part, attention_part = formulas.matmul_flops(cfg, n_range), formulas.attention_flops(cfg, n_range, n_range)
for n in (prompt_lens[-1], ttft_crossover, 8 * ttft_crossover):
    m, a = formulas.matmul_flops(cfg, n), formulas.attention_flops(cfg, n, n)
    # d log(FLOPs) / d log(n): 1 for a linear cost, 2 for a quadratic one
    print(f"  {n:9,.0f} tokens: attention {100 * a / (m + a):4.1f}% of the FLOPs, TTFT grows as n^{(m + 2 * a) / (m + a):.2f}")

fig, ax = plt.subplots(figsize=(6.5, 3.6))
ax.plot(n_range, (matmul_part + attention_part) / ceil.peak_flops, "k", label="all FLOPs / peak")
ax.plot(n_range, matmul_part / ceil.peak_flops, ":", color="C2", label="weight matmuls (∝ n)")
ax.plot(n_range, attention_part / ceil.peak_flops, ":", color="C3", label="attention (∝ n²)")
ax.plot(prompt_lens, ttft, "o", color="C0", label="measured TTFT")
ax.axvline(ttft_crossover, color="grey", ls="--", label=f"crossover {ttft_crossover:,.0f} tokens")
ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="seconds",
       title="TTFT: linear below the crossover, quadratic above", ylim=(1e-4, None))
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# The measured points sit above the line by the overheads of a real pass (the line assumes every FLOP
# runs at the peak of a large square matmul), but they roughly follow its slope. This small model
# reaches the crossover at a few thousand tokens; a wider model reaches it much later (the Llama-7B
# figure above), so for prompts of ordinary length the linear term dominates.
#
# A decode step costs nearly the same at any context length: it is dominated by reading all the weights
# once; the K/V reads grow with the context, but for this small GQA model they stay small next to the
# weights until the context reaches thousands of tokens.
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
batch_context = pick(cpu=128, gpu=512, device=device)
# On a GPU the largest batches' caches take gigabytes: a batch this GPU's free memory cannot hold is left out.
batches = fitting(pick(cpu=[1, 2, 4, 8, 16, 32], gpu=[1, 4, 16, 64, 128, 256], device=device),
                  lambda b: formulas.kv_cache_bytes_for(cfg, batch_context, b, nbytes), device, "batch")
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
# The intensity table above, each row placed on the roof: the most this machine allows at that intensity.
table_int = np.array([f / b for _, f, b in rows])
table_roof = formulas.attainable_flops(table_int, ceil.peak_flops, ceil.peak_bw) / 1e9
ax.plot(table_int, table_roof, "D", mfc="none", color="C4",
        label="intensity table on the roof: prefill n=…, decode b=…")
for (name, _, _), i, r in zip(rows, table_int, table_roof):
    is_prefill = name.startswith("prefill")
    short = name.split(", ")[1].replace(" = ", "=") if is_prefill else "b=" + name.split(", ")[1].split()[1]
    ax.annotate(short, (i, r), textcoords="offset points", xytext=(-4, 7) if is_prefill else (5, -11),
                fontsize=7, color="C4")
ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)", ylabel="achieved GFLOP/s",
       title=f"SmolLM2-135M on this {device} ({dtype})")
ax.set_ylim(top=3 * ceil.peak_flops / 1e9)  # room for the labels above the flat roof
ax.legend(fontsize=8, loc="lower right")
plt.tight_layout()
plt.show()


from mini_engine.course.rooflines import GPU_ROOFS


def prefill_ridge_tokens(ridge, dtype_bytes, longest=1 << 16):
    """The shortest prefill of SmolLM2 whose intensity reaches `ridge` FLOP/byte (its intensity grows with n)."""
    n = np.arange(1, longest + 1)
    past = formulas.prefill_intensity(cfg, n, dtype_bytes) >= ridge
    return int(n[past.argmax()]) if past.any() else None


print(f"a prefill passes this {device}'s ridge ({ceil.ridge_point:.1f} FLOP/byte) from "
      f"{prefill_ridge_tokens(ceil.ridge_point, nbytes)} tokens; in 16 bits on a GPU: " + ", ".join(
          f"{name} {prefill_ridge_tokens(roof.ridge_point, 2)} (ridge {roof.ridge_point:.0f})"
          for name, roof in GPU_ROOFS.items() if name != "H200"))

# %% [markdown]
# The hollow diamonds are the rows of the intensity table, each at the height the roof allows it.
# Decode at batch 1 sits at the far left, pinned under the slanted memory roof; every doubling of the
# batch moves it right and up, towards the ridge. Prefill lies further right, and past the ridge, under the
# flat compute roof, from the length the last line prints: a few dozen tokens on a CPU, whose ridge is low,
# but a few hundred in 16 bits on a GPU, whose ridges are in the hundreds of FLOP/byte. The gaps between the points and the roof are
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
controls["dtype"].value = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]  # the ceilings' dtype
controls["context"].value = batch_context
display(roofline)

# %%
ridge_batch = formulas.decode_ridge_batch(cfg, batch_context, nbytes, ceil.peak_flops, ceil.peak_bw)
print(f"on this {device}, a decode step at context {batch_context} reaches the ridge at batch "
      + (f"{int(np.ceil(ridge_batch))}" if np.isfinite(ridge_batch) else "none: the K/V reads keep it below"))
for b in (1, 4, 16, 64, 256):
    i = formulas.decode_intensity(cfg, b, batch_context, nbytes)
    bound = formulas.roofline_bound(formulas.decode_flops(cfg, batch_context, b),
                                    formulas.decode_bytes(cfg, b, batch_context, nbytes), ceil.peak_flops, ceil.peak_bw)
    print(f"  batch {b:4d}: {i:6.2f} FLOP/byte -> {bound}-bound")

# %% [markdown]
# ## The batch-size sweet spot, derived
#
# The textbook reports a rule from practice: "the empirically observed sweet spot for a 7B model on an A100
# sits somewhere around batch size 16 to 64". The roofline predicts it. A decode step moves the weights once, shared by
# the whole batch, plus every sequence's own keys and values. While the weights dominate, one more
# sequence rides almost free: throughput grows with the batch and the step time hardly moves. Once the
# K/V reads equal the weight read, at batch `weight_bytes / (kv_bytes_per_token · context)`
# (`formulas.decode_knee_batch`), the step takes twice as long as at batch 1 and the throughput is half
# of its ceiling, `bandwidth / (kv_bytes_per_token · context)`. Beyond that knee every extra sequence
# brings its own reads: throughput creeps towards the ceiling while each user's tokens slow down in
# proportion. The compute roof never enters: with a K/V head for every query head, Llama-7B's cache
# reads keep the step below the A100's ridge at any batch (`formulas.decode_ridge_batch` is infinite).

# %%
a100 = dict(peak_flops=312e12, peak_bw=2.039e12)  # A100 SXM: dense bf16 tensor-core peak, HBM bandwidth
m7, fp16 = "llama-7b", 2
w7, kv7 = formulas.weight_bytes(m7, fp16), formulas.kv_bytes_per_token_for(m7, fp16)
sweep = np.arange(1, 257)
print(f"{'context':>8}{'knee batch':>12}{'ridge batch':>13}{'fit in 80 GiB':>15}{'tok/s at 1 / 16 / 64 / ceiling':>34}")
fig, (tput_ax, lat_ax) = plt.subplots(1, 2, figsize=(10, 3.4))
for c in (512, 1024, 2048):
    knee = formulas.decode_knee_batch(m7, c, fp16)
    fits = formulas.max_concurrent_requests(80 * 2**30, w7, formulas.kv_cache_bytes_for(m7, c, 1, fp16))
    tok_s = formulas.predicted_decode_tok_s(m7, sweep, c, fp16, **a100)
    print(f"{c:8d}{knee:12.1f}{formulas.decode_ridge_batch(m7, c, fp16, **a100):13.0f}{fits:15d}"
          f"{tok_s[0]:11.0f} / {tok_s[15]:5.0f} / {tok_s[63]:5.0f} / {a100['peak_bw'] / (kv7 * c):6.0f}")
    line = tput_ax.plot(sweep, tok_s, label=f"context {c}")[0]
    lat_ax.plot(sweep, sweep / tok_s * 1e3, color=line.get_color(), label=f"context {c}")
    tput_ax.plot(knee, np.interp(knee, sweep, tok_s), "o", color=line.get_color())
lo_ctx, hi_ctx = (w7 / (kv7 * b) for b in (64, 16))
print(f"the knee sits at batch 64 for {lo_ctx:,.0f}-token contexts and at batch 16 for {hi_ctx:,.0f}-token contexts")
for ax_ in (tput_ax, lat_ax):
    ax_.axvspan(16, 64, color="grey", alpha=0.15, label="the textbook's 16–64")
    ax_.set(xscale="log", xlabel="decode batch size")
tput_ax.set(ylabel="tokens/s (roofline)", title="Llama-7B fp16 on an A100: throughput (dots: knee)")
lat_ax.set(ylabel="ms per token, each sequence", title="…and every user's per-token latency")
tput_ax.legend(fontsize=8)
plt.tight_layout()
plt.show()
print(f"SmolLM2 on this {device} at context {batch_context}: knee at batch "
      f"{formulas.decode_knee_batch(cfg, batch_context, nbytes):.0f}, ridge at batch "
      + (f"{np.ceil(ridge_batch):.0f}" if np.isfinite(ridge_batch) else "never"))

# %% [markdown]
# For contexts the length of ordinary chat requests, several hundred to under two thousand tokens (the
# cell prints the exact range), the knee falls inside the textbook's 16 to 64. Below it a server leaves
# throughput unused for little gain in latency; above it, it buys little throughput at a steep price in
# latency, and at the long end of that range the fit column shows an 80 GB card running out of memory
# not far beyond 64 anyway. The textbook's empirical range is the roofline's knee.
#
# The last line applies the same arithmetic to SmolLM2 on this machine. On a CPU the low ridge point
# comes first: the step turns compute-bound after a few sequences, long before the knee, and that is the
# flattening of the measured throughput curve earlier in this chapter. On a GPU the ridge is far away
# and the knee decides, as for the 7B model.
#
# ## Which optimisation helps which phase
#
# The textbook's advice: "when you read about a new technique, the first question to ask is 'does this
# help prefill or decode?'". Prefill is compute-bound, so what helps it makes the arithmetic more efficient
# or skips it; decode is memory-bound, so what helps it moves fewer bytes per token or puts the idle
# arithmetic to work.
#
# | optimisation | helps | what it attacks | chapter |
# | --- | --- | --- | --- |
# | bigger matmuls, kernel fusion | prefill | compute: keeps the arithmetic units fed, fewer round trips through memory | 05, 09 |
# | FlashAttention | prefill (long prompts) | the n × n scores never reach memory | 05 |
# | prefix caching | prefill | skips the FLOPs of a prompt prefix already computed | 08 |
# | KV cache | decode | recomputation: a step processes one new token | 03 |
# | batching, continuous batching | decode | bandwidth: one weight read serves the whole batch | 02, 04 |
# | grouped-query attention | decode | bytes of K/V read per step: fewer K/V heads to cache | 03 |
# | paged KV cache | decode | memory reserved and never filled: more sequences fit in a batch | 07 |
# | Flash Decoding | decode (long contexts) | idle cores: the context is split so the whole chip reads K/V at once | 05 |
# | speculative decoding | decode | idle arithmetic verifies several drafted tokens per weight read | 06 |
# | weight quantization | decode | bytes per weight | 10 |
# | chunked prefill | decode of the other requests | a long prefill no longer stalls the steps of streaming users | 04 |
#
# One row needs a tool this chapter does not have yet. At a small batch and a long context, a decode step's
# attention is a few long reads, too few to keep a GPU's many processors busy; Flash Decoding splits each
# read into pieces that run side by side and then merges their results. The merge is exact thanks to the
# *online softmax*, which chapter 05 derives for FlashAttention, so chapter 05 takes up Flash Decoding right
# after it.

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
    ("TTFT linear below / quadratic above", f"{ttft_crossover:,.0f} prompt tokens"),
]
for name, value in summary:
    print(f"{name:<36} {value}")

# %% [markdown]
# ## Exercises: predict, then run
#
# Write your prediction down before you run each cell; the answer under it says what you should see and
# why. Each cell takes a few seconds.
#
# **1. Batching at a long context.** Earlier, a batch of decode steps at a short context multiplied the
# throughput. Now give every sequence a much longer context and time batch 1 against a larger batch
# again. Is the throughput gain of the batch larger, the same, or smaller than at the short context?

# %%
long_context = pick(cpu=2048, gpu=4096, device=device)
# One of `batches`, so the short-context gain is measured above; on a GPU the largest whose cache fits.
long_batch = fitting([b for b in pick(cpu=[8], gpu=[64, 16, 4], device=device) if b in batches],
                     lambda b: formulas.kv_cache_bytes_for(cfg, long_context, b, nbytes), device, "batch")[0]
long_cache = ContiguousKVCache(cfg, long_batch, long_context, device, model.dtype)
long_cache.data.normal_()
long_s = {b: best_time(lambda: decode_step(model, long_cache, [42] * b, [long_context] * b, list(range(b))))
          for b in (1, long_batch)}
gain = {batch_context: throughput[batches.index(long_batch)] / throughput[0],
        long_context: long_batch * long_s[1] / long_s[long_batch]}
for c, g in gain.items():
    predicted = (formulas.predicted_decode_tok_s(cfg, long_batch, c, nbytes, ceil.peak_flops, ceil.peak_bw)
                 / formulas.predicted_decode_tok_s(cfg, 1, c, nbytes, ceil.peak_flops, ceil.peak_bw))
    print(f"context {c:5d}: batch {long_batch} gives {g:4.1f}x the tokens/s of batch 1 (roofline {predicted:4.1f}x); "
          f"knee at batch {formulas.decode_knee_batch(cfg, c, nbytes):.0f}")
del long_cache

# %% [markdown]
# <details><summary>Answer</summary>
#
# Smaller. At a short context a decode step is almost all weight read, which the whole batch shares. At
# a long context every sequence also reads its own keys and values, and those reads grow with the batch:
# the shared part of the step shrinks and so does the gain. The knee the cell prints is where the K/V
# reads of the batch equal the weight read. This is why long-context serving gains less from batching,
# and why everything that shrinks the cache (grouped-query attention, a narrower cache dtype) pays off
# twice: more sequences fit, and each costs fewer bytes per step.
# </details>
#
# **2. A prefill in decode steps.** How many decode steps take as long as the prefill of the longest
# prompt measured above? Think of the roofline before you look: each decode step reads the weights once,
# and the prefill reads them once too.

# %%
n_long = prompt_lens[-1]
measured_steps = ttft[-1] / tpot[0]
roofline_steps = ttft_pred[-1] / tpot_pred[0]
print(f"prefill of {n_long} tokens: {ttft[-1] * 1e3:.0f} ms = {measured_steps:.1f} decode steps of "
      f"{tpot[0] * 1e3:.1f} ms (roofline: {roofline_steps:.1f})")
print(f"a decode step does {formulas.decode_intensity(cfg, 1, contexts[0], nbytes):.2f} FLOP/byte, the ridge "
      f"is {ceil.ridge_point:.1f}: a prefill computes about {ceil.ridge_point / formulas.decode_intensity(cfg, 1, contexts[0], nbytes):.0f} "
      f"tokens in the time of one decode step")

# %% [markdown]
# <details><summary>Answer</summary>
#
# Far fewer steps than the prompt has tokens. Both read the weights once; the prefill's extra cost is
# only its arithmetic, and a step that reads each weight for just two FLOPs leaves the arithmetic units
# mostly idle. Roughly, a prefill fits *ridge point ÷ decode intensity* tokens into the time of one
# decode step: a handful on a CPU, whose ridge is low, and hundreds on a GPU. The same fact powers
# speculative decoding (chapter 06): checking several drafted tokens in one pass costs about as much as
# decoding one.
# </details>
#
# **3. Chunked prefill.** The serving engine can cut a long prompt into chunks of
# `chunked_prefill_tokens` so that a prefill never holds up the decode steps of other requests for long
# (chapter 04). Each chunk is a forward pass that reads all the weights again. Predict the TTFT of a
# long prompt in chunks of 32 tokens against the whole prompt in one pass. The cell below borrows `me.LLM`, the
# serving engine that chapter 04 builds, only to time one request's first token both ways; how it schedules is
# chapter 04's story.

# %%
chunk_prompt = torch.randint(100, 40000, (pick(cpu=256, gpu=2048, device=device),)).tolist()
chunk = 32
one_token = me.SamplingParams(max_tokens=1, ignore_eos=True)
chunk_ttft = {}
for label, tokens_per_step in (("whole prompt", None), (f"chunks of {chunk}", chunk)):
    chunk_llm = me.LLM.from_model(model, tok, max_num_seqs=1, max_model_len=len(chunk_prompt) + 8,
                                  chunked_prefill_tokens=tokens_per_step, enable_prefix_caching=False)
    chunk_llm.generate([chunk_prompt[:chunk]], one_token, use_tqdm=False)  # warm-up
    chunk_ttft[label] = chunk_llm.generate([chunk_prompt], one_token, use_tqdm=False)[0].metrics.ttft_s
n = len(chunk_prompt)
pred_whole = formulas.prefill_time(cfg, n, 0, nbytes, ceil.peak_flops, ceil.peak_bw)
pred_chunks = sum(formulas.prefill_time(cfg, chunk, past, nbytes, ceil.peak_flops, ceil.peak_bw)
                  for past in range(0, n, chunk))
for (label, measured_ttft), predicted in zip(chunk_ttft.items(), (pred_whole, pred_chunks)):
    print(f"{n} tokens, {label:>14}: TTFT {measured_ttft * 1e3:7.1f} ms   roofline {predicted * 1e3:7.1f} ms")
print(f"chunked / whole: measured {chunk_ttft[f'chunks of {chunk}'] / chunk_ttft['whole prompt']:.2f}x, "
      f"roofline {pred_chunks / pred_whole:.2f}x; a {chunk}-token chunk is "
      f"{formulas.roofline_bound(formulas.prefill_flops(cfg, chunk), formulas.prefill_bytes(cfg, chunk, nbytes), ceil.peak_flops, ceil.peak_bw)}-bound here")

# %% [markdown]
# <details><summary>Answer</summary>
#
# It depends on which roof a chunk sits under, and the last line of the output says which. If a chunk
# of 32 tokens is compute-bound (as on a CPU, whose ridge point is a few FLOP/byte), the roofline says
# chunking is nearly free: the FLOPs are the same and the extra weight reads hide under the arithmetic.
# Whatever the measurement adds beyond that is the cost of an engine step, paid once per chunk:
# scheduling, launching a forward pass, attention to the chunks already cached. For a small model on a
# CPU that cost is far from negligible. If a chunk is memory-bound (as on a GPU in bf16, whose ridge is
# in the hundreds), every chunk also pays a full weight read, and the TTFT grows towards one decode step
# per chunk. That is why engines use chunks of hundreds of tokens or more: large enough to stay
# compute-bound and amortise the step, small enough that the decode steps scheduled between chunks are
# not held up for long.
# </details>
#
# **Lab.** [Lab 02](../labs/lab02_notebook.ipynb) has you count a forward pass's FLOPs and bytes, its
# arithmetic intensity, the roofline, and the smallest batch that turns a decode step compute-bound,
# graded by `tests/labs/test_lab02.py`.
