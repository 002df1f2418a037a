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
# # 09 · The full stack: from a naive loop to a serving engine, on one workload
#
# Eight chapters each added one idea to the same engine and measured it on its own workload. The textbook
# (chapter 00 introduces it) closes on a stronger claim: "These stack, they aren't alternatives — production
# engines like vLLM run PagedAttention, continuous batching, FlashAttention kernels, and automatic prefix
# caching together, with speculative decoding on top, and the gains multiply". A naive loop that recomputes
# everything turns out a few tokens per second; the same model on the same hardware under a serving stack
# turns out hundreds, and vLLM, TGI, SGLang and TensorRT-LLM are recombinations of the same few primitives.
# Whether the gains really multiply is a question to measure, not to assume.
#
# This chapter:
#
# 1. builds one workload on which every optimisation has something to gain: a long shared system prompt,
#    requests that ask for a given text back, open questions, mixed lengths;
# 2. runs it up the **ladder**, one rung per idea, from HF transformers and the naive loop through static and
#    continuous batching to the full engine (`python -m mini_engine bench --ladder` prints the same table at full
#    size);
# 3. sets each rung's gain beside the textbook's claim, measured alone and on top of the rungs below: where the
#    gains multiply and where they do not;
# 4. connects the textbook's "5 to 10 tokens per second" naive and "200 to 500" optimised, for a 7B model on an
#    A100, with the roofline
#    arithmetic, and the same arithmetic with the ladder measured here;
# 5. serves the engine over HTTP as users meet it: an OpenAI-compatible server in the background, a streamed
#    answer through the official `openai` client, and the throughput-latency curve, measured and then under
#    sliders (a simulation built on the engine's measured step costs);
# 6. maps the primitives onto vLLM, TGI, SGLang and TensorRT-LLM, and lists what this engine still lacks.

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
import time

import matplotlib.pyplot as plt
import numpy as np
from tqdm.auto import tqdm

import mini_engine as me
from mini_engine import formulas
from mini_engine.bench.ladder import (LABELS, RUNGS, TEXTBOOK_CLAIMS, SHORT_SYSTEM_PROMPT, SYSTEM_PROMPT, LadderWorkload,
                                      agreement, bench_ladder)
from mini_engine.course.devices import default_device, fitting, pick, warm_up
from mini_engine.engine import LLM
from mini_engine.course.hardware import describe_machine, matmul_floor_tok_s, measure_ceilings
from mini_engine.course.metrics import percentile
from mini_engine.speculative import NgramProposer

device = default_device()
dtype = me.default_dtype(device)
model, tok = me.load_model("smollm2-135m", device=device, dtype=dtype)
warm_up(model, 256)  # one-time choices for steps of up to 256 tokens, made now, off the clock
print(describe_machine(device))
print(f"device: {device}, dtype: {dtype}")

# %% [markdown]
# ## 1. One workload for every rung
#
# Each optimisation pays on a different kind of traffic, so the workload mixes them:
#
# - every request opens with the same **system prompt** of about 230 tokens (the assistant's rules; on a CPU its
#   first 100, below): prefix caching computes it once;
# - half the requests are **input-grounded**, "repeat this text exactly" or "fix the spelling and return it in
#   full": the answer copies the prompt, so n-gram speculation finds its drafts there (chapter 06);
# - the other half are **open questions** with different length limits, so requests finish at different
#   times: a static batch waits for its longest request, continuous batching refills the places the others
#   free, and paging lets more of them in at once.
#
# Greedy decoding, and EOS ends a request: every rung must produce the same tokens, which the ladder checks. On
# a CPU the workload is smaller: 16 requests instead of 64, every length limit a quarter of the GPU's (so the mix of
# short and long answers, which is what batching policies differ on, stays the same), and the system prompt's first
# five sentences, because every rung but one computes each request's system prompt again, and on two cores sixteen
# long prompts would take longer than their answers.

# %%
size = pick(cpu={"requests": 16, "batch": 4, "sample": 1, "length_scale": 0.25, "system_prompt": SHORT_SYSTEM_PROMPT},
            gpu={"requests": 64, "batch": 16, "sample": 2, "length_scale": 1.0, "system_prompt": SYSTEM_PROMPT},
            device=device)
work = LadderWorkload.build(tok, size["requests"], length_scale=size["length_scale"],
                            system_prompt=size["system_prompt"])
print(work.describe())
for i in range(2):
    print(f"\nrequest {i} ({work.kinds[i]}, max_tokens {work.max_tokens[i]}), the part after the system prompt:")
    print(repr(tok.decode(work.prompts[i][work.shared_prefix_len:])[:240]))

# %% [markdown]
# ## 2. The ladder
#
# One row per rung, each adding one thing to the rung above it. The first row is HF transformers' batched
# `generate` on the same requests (static batches, left-padded), the reference every engine is measured against.
# The serving engine enters with **static batching**: it takes `batch` requests, runs them until the last one has
# finished, then takes the next `batch`. The rung below it, **continuous batching**, changes only that: a place
# freed by a finished request is refilled at the next step. Same places, same requests, same engine, so their
# ratio is the textbook's comparison ("lifting utilization ~50% → ~90% (≈1.8× more tokens/sec)"), measured like
# for like.
# The starred rungs run one request at a time, on a sample of the requests: their tokens/s is what **one user**
# gets; the other rows serve every request together, and their tokens/s is what **all users together** get.
# That difference is the point of a serving engine, and the footnotes under the table say it again.
#
# Two rungs compile graphs with `torch.compile` (the decode step alone, and the engine's decode steps per
# batch-size bucket). On a CPU that costs minutes before the first token, too long for this notebook, so here
# they run on a GPU only; `python -m mini_engine bench --ladder` measures them on any machine, and
# `benchmarks/RESULTS.md` holds a CPU run. Set `RUN_COMPILED = True` to include them anyway.

# %%
RUN_COMPILED = pick(cpu=False, gpu=True, device=device)
rungs = [r for r in RUNGS if RUN_COMPILED or r not in ("compiled", "compiled_engine")]
ladder = bench_ladder(model=model, tok=tok, requests=size["requests"], batch=size["batch"], sample=size["sample"],
                      length_scale=size["length_scale"], system_prompt=size["system_prompt"], rungs=rungs,
                      tune=False,  # warmed up above
                      print_fn=lambda _report: None)  # the bench's full report; the table and its footnotes below
print(ladder.table())
print(ladder.footnotes())
for x in ladder.rows:
    if x.rung in ("compiled", "compiled_engine"):  # a graph compiled inside the timing would be counted in it
        print(f"{x.label}: {x.notes}")
print()
print(ladder.batching_beside_textbook())

# %%
ladder.plot()
plt.show()

# %% [markdown]
# Read the chart on its log scale: every gridline is a factor of ten. The orange bars (one user at a time) and
# the blue ones (everyone at once) answer different questions; the gap between the last orange bar and the
# first blue one is what batching buys a machine, not what it buys a user, whose tokens arrive no faster.
#
# ## 3. Each rung's gain beside the textbook's claim, and whether they multiply
#
# Down the ladder the gains multiply by construction: each rung's ratio to the one above it, multiplied down
# the column, is the top rung's ratio to the bottom one. The real question is whether each idea keeps, on top of
# the others, the gain it has **alone**. Three of them can be measured alone cheaply, on the sample request and
# on one stream: speculation (n-gram, on `generate_speculative`), prefix caching (the time to first token of one
# request whose system prompt is cached, against one whose is not), and the KV cache itself. Batching is measured
# alone by its first rung (static batches against one user at a time), and continuous batching by its ratio to
# static batching on the same places: the textbook's own comparison.

# %%
GREEDY = me.SamplingParams(temperature=0.0)


def one_stream(fn, prompt, n):
    t0 = time.perf_counter()
    out = fn(prompt, n)
    return out, time.perf_counter() - t0


sample_prompt, sample_n = work.prompts[0], work.max_tokens[0]  # an input-grounded request
plain, plain_s = one_stream(lambda p, n: me.generate_cached(model, p, n, GREEDY, eos_token_id=tok.eos_token_id),
                            sample_prompt, sample_n)
(spec, spec_stats), spec_s = one_stream(
    lambda p, n: me.generate_speculative(model, p, NgramProposer(1, 4), k=4, max_new_tokens=n, params=GREEDY,
                                         eos_token_id=tok.eos_token_id), sample_prompt, sample_n)
print(f"speculation alone (one stream, request 0): {plain_s / spec_s:.2f}x, alpha {spec_stats.alpha:.2f}, "
      f"{spec_stats.tokens_per_step:.2f} tokens per pass, identical tokens: {spec == plain}")


def ttft_alone(caching: bool) -> float:
    """TTFT of request 1 on an engine that has just served request 0 (which shares its system prompt)."""
    llm = LLM.from_model(model, tok, enable_prefix_caching=caching, max_num_seqs=2,
                         max_model_len=max(len(p) for p in work.prompts[:2]) + 8)
    llm.generate([work.prompts[0]], me.SamplingParams(max_tokens=1), use_tqdm=False)
    return llm.generate([work.prompts[1]], me.SamplingParams(max_tokens=1), use_tqdm=False)[0].metrics.ttft_s


ttft_off, ttft_on = ttft_alone(False), ttft_alone(True)
print(f"prefix caching alone (TTFT of one request behind a cached system prompt): {ttft_off * 1e3:.0f} -> "
      f"{ttft_on * 1e3:.0f} ms, {ttft_off / ttft_on:.1f}x")

# %%
r = ladder.row


def gain(a, b):
    return r(a).tok_s / r(b).tok_s if r(a) and r(b) else float("nan")


ladder_order = [x.rung for x in ladder.rows if x.rung != "hf"]
below = {x: ladder_order[i - 1] for i, x in enumerate(ladder_order) if i}
alone = {"cached": gain("cached", "naive"), "compiled": gain("compiled", "cached"),
         "static": gain("static", "cached"), "continuous": gain("continuous", "static"),
         "paged": gain("paged", "continuous"), "prefix": ttft_off / ttft_on, "speculative": plain_s / spec_s,
         "compiled_engine": float("nan")}
alone_what = {"cached": "tok/s, one stream", "compiled": "tok/s, one stream", "static": "tok/s, all vs one user",
              "continuous": "tok/s, same places", "paged": "tok/s, equal KV memory", "prefix": "TTFT, one request",
              "speculative": "tok/s, one stream", "compiled_engine": "-"}
print(f"{'rung':<34}{'alone':>8}  {'(measured as)':<24}{'on the rungs below':>19}  the textbook's claim")
for rung in ladder_order[1:]:
    print(f"{LABELS[rung]:<34}{alone[rung]:>7.2f}x  {alone_what[rung]:<24}{gain(rung, below[rung]):>18.2f}x  "
          f"{TEXTBOOK_CLAIMS[rung]}")
paged, prefix, spec_row = r("paged"), r("prefix"), r("speculative")
print(f"\n{ladder.batching_beside_textbook()}")
print(f"paging: {r('continuous').peak_running} -> {paged.peak_running} requests at once on the same KV memory")
print(f"prefix caching in the batch: hit rate {prefix.stats['cached_tokens'] / prefix.stats['prompt_tokens']:.0%} "
      f"of prompt tokens; TTFT p50 {percentile(paged.ttft, 50) * 1e3:.0f} -> {percentile(prefix.ttft, 50) * 1e3:.0f} ms")
print(f"speculation in the batch: {spec_row.stats['accepted']} of {spec_row.stats['drafts']} drafts accepted")
isolated = np.prod([v for k, v in alone.items() if k in ladder_order[1:] and v == v and k != "prefix"])
print(f"\nproduct of the tok/s gains measured alone: {isolated:.0f}x; measured top rung / naive: "
      f"{ladder.top.tok_s / r('naive').tok_s:.0f}x")

# %% [markdown]
# How to read it (your numbers are in the table above; the reasons do not depend on them):
#
# - **The KV cache** is the largest single step, and it grows with the prompt: the naive loop runs the whole
#   sequence (the prompt and the answer so far, over a hundred tokens) through the model for every new token, the
#   cached loop one token. The textbook's "~700×" counts attention work over 1,024 tokens; on tokens/s the weight
#   products, which the naive loop also repeats, set the ratio (chapter 01).
# - **Batching** (static batches, one user → a batch of users) buys what the machine had spare. On a GPU a
#   decode step is memory-bound and 16 sequences cost about what one does; on a CPU the products turn
#   compute-bound after a few rows (chapter 02), so the gain is real but well below the batch size.
# - **Continuous batching** against static batching, on the same places, is the textbook's comparison. A static batch
#   keeps its places until its longest request ends, so the places of the requests that finished early sit idle
#   (the "places busy" line); continuous batching gives them to waiting requests at the next step. How idle a
#   static batch is depends on how much the lengths differ within it, which is why the workload mixes them. The
#   textbook's 50% → 90% turns into 1.8× tokens/s only if a fuller step costs no more than an emptier one: true of
#   a memory-bound GPU step, not of a CPU step, where more requests per step make the step slower. So on a CPU the
#   tokens/s gain falls short of the rise in busy places; on a GPU the two come close.
# - **Paging** lets more requests in at once on the same memory (the concurrency line), which the textbook
#   prices at "2 to 4× more sequences". On this CPU more requests per step no longer buy much, so its tokens/s
#   gain is small; its wins here are concurrency and time to first token (chapter 07).
# - **Prefix caching** cuts time to first token by roughly the prompt's share that is shared (alone, one
#   request), but it only removes prefill work. In a batch that is mostly decoding, prefill is a small part of
#   the total time, so its tokens/s gain is small: Amdahl's law, not a failure.
# - **Speculation** wins alone on input-grounded text (α near 0.9), and much less on top of a batch: a verify
#   pass is cheap only while a step is memory-bound, and the batch has already spent the spare compute that the
#   drafts' extra rows need (chapter 06 measured this at batch 1 and 16). Batching and speculation draw on the
#   same resource, so their gains do not multiply.
# - **The compiled engine step** removes the Python and per-kernel cost of decode-only steps. Steps that carry
#   drafts or prompt chunks stay eager, so on top of speculation it finds fewer steps to speed up. On a small
#   CPU that cost is a few milliseconds of a batch-16 step that the weight products and attention fill: on the
#   2-core CPU of `benchmarks/RESULTS.md` the compiled engine served the chapter-04 workload at 0.88-1.06x the
#   eager engine, depending on the run (the same tokens for all 64 requests). On a GPU, where a step is hundreds
#   of tiny kernel launches, the same graphs replayed as CUDA graphs are what vLLM relies on.
#
# So the gains multiply where they attack different costs (recompute, idle lanes, reserved memory, repeated
# prefill), and they do not where two of them spend the same spare capacity, or where one removes time that
# others have already made small.
#
# ## 4. The textbook's A100 figures, and the arithmetic that connects them
#
# The textbook: "A 7B model on a single A100 with a naive stack delivers around 5 to 10 tokens per second; the
# same hardware running a fully optimized stack delivers 200 to 500". The roofline of chapter 02 says where
# such numbers come from. A decode step must move every weight from memory once (13.5 GB for Llama-7B in
# fp16), and a naive step must also do the arithmetic for the whole sequence again.
# `formulas.generation_tok_s` puts both on the roofline of an A100-80GB (312 TFLOP/s, 2.04 TB/s):

# %%
A100 = dict(peak_flops=312e12, peak_bw=2.039e12)
P, T = 512, 512
rows = [("naive, one stream (compute-bound, the sequence recomputed every step)",
         formulas.generation_tok_s("llama-7b", P, T, 2, **A100, cache=False), formulas.prefill_bytes("llama-7b", P + T // 2)),
        *((f"KV cache, batch {b}", formulas.generation_tok_s("llama-7b", P, T, 2, **A100, batch=b),
           formulas.decode_bytes_per_token("llama-7b", b, P + T // 2)) for b in (1, 4, 16, 64))]
print(f"Llama-7B, fp16, {P}-token prompts, {T} new tokens each, on an A100-80GB's roofline")
print(f"{'':72}{'ceiling tok/s':>14}{'bytes / token':>15}")
for name, tok_s, bytes_per_token in rows:
    print(f"{name:<72}{tok_s:>14.0f}{bytes_per_token / 1e9:>12.2f} GB")
print("the textbook: naive 5-10 tok/s, optimised stack 200-500 tok/s")
naive_roof, one_stream, batch16 = rows[0][1], A100["peak_bw"] / formulas.weight_bytes("llama-7b", 2), rows[3][1]
print(f"naive: 5-10 tok/s is {5 / naive_roof:.0%}-{10 / naive_roof:.0%} of its ceiling here; at 1,024 + 1,024 "
      f"tokens the ceiling is {formulas.generation_tok_s('llama-7b', 1024, 1024, 2, **A100, cache=False):.0f} tok/s")
print(f"one cached stream: at most {A100['peak_bw'] / 1e12:.2f} TB/s / "
      f"{formulas.weight_bytes('llama-7b', 2) / 1e9:.1f} GB = {one_stream:.0f} tok/s; batch 16 lifts the roof "
      f"{batch16 / rows[1][1]:.1f}x, and 200-500 tok/s is {200 / batch16:.0%}-{500 / batch16:.0%} of it")

# %% [markdown]
# The naive ceiling (about 29 tok/s at these lengths, 14 at 1,024 + 1,024) is set by FLOPs, and the textbook's
# 5-10 is a sixth to a third of it (the cell's last lines print these): what eager code attains. One cached
# stream cannot pass bandwidth / model bytes, 2.04 TB/s / 13.5 GB ≈ 150 tok/s, *below* the textbook's
# optimised 200-500. So the optimised figure is a batched one: with 16 streams each token carries a sixteenth
# of the weight read (plus its own keys and values), and the roof rises tenfold. 200-500 tok/s is 13-33% of
# that roof; vLLM on such a GPU
# serves thousands of tokens per second in aggregate. The textbook's "5 to 50×" is therefore mostly batching,
# and a roofline says how much is left.
#
# The same arithmetic on this machine, with its own measured ceilings, beside the ladder:

# %%
ceil = measure_ceilings(device, model.dtype, quick=True)
c = model.config
shape = formulas.ModelShape.of(c)
nbytes = model.dtype.itemsize
# The compute roof: the faster of a plain square matmul and the model's own products at 256 rows (on a CPU the
# model's products can run faster than one large square matmul).
products_flops = formulas.matmul_flops(shape, 1) * matmul_floor_tok_s(model, 256)
peak_flops = max(ceil.peak_flops, products_flops)
p_mean = int(np.mean([len(p) for p in work.prompts]))
t_mean = max(1, int(np.mean([len(o) for o in r("continuous").outputs.values()])))
roof = dict(peak_flops=peak_flops, peak_bw=ceil.peak_bw)
top = ladder.top
cases = [("naive (one stream)", r("naive"), formulas.generation_tok_s(shape, p_mean, t_mean, nbytes, **roof, cache=False)),
         ("KV cache (one stream)", r("cached"), formulas.generation_tok_s(shape, p_mean, t_mean, nbytes, **roof)),
         (f"top rung, batch up to {top.peak_running}", top,
          formulas.generation_tok_s(shape, p_mean, t_mean, nbytes, **roof, batch=top.peak_running))]
print(f"{describe_machine(device)}\nmeasured ceilings: {peak_flops / 1e9:.0f} GFLOP/s (plain matmul "
      f"{ceil.peak_flops / 1e9:.0f}, the model's products at 256 rows {products_flops / 1e9:.0f}), "
      f"{ceil.peak_bw / 1e9:.1f} GB/s; "
      f"SmolLM2-135M, {dtype}, {p_mean}-token prompts, {t_mean} new tokens (the workload's means)")
print(f"{'':40}{'measured tok/s':>15}{'roofline tok/s':>16}{'share':>8}")
for name, row, ceiling in cases:
    print(f"{name:<40}{row.tok_s:>15.1f}{ceiling:>16.1f}{row.tok_s / ceiling:>8.0%}")
print(f"weights: {formulas.weight_bytes(shape, nbytes) / 1e6:.0f} MB per decode step; ridge point "
      f"{peak_flops / ceil.peak_bw:.0f} FLOP/byte (an A100's: {312e12 / 2.039e12:.0f})")

# %% [markdown]
# On a CPU the ridge point is low (a few to a few tens of FLOP per byte, against the A100's 150), so even a single stream of this
# small model is close to compute-bound, and batching raises the roof far less than on a GPU: the same formulas,
# another machine, a different ladder. (The top rung may even pass its "roofline" when speculation gives it more
# than one token per sequence per step, which the formula does not count.)
#
# ## 5. Serving it: an OpenAI-compatible server under load
#
# Offline `LLM.generate` knows every request in advance. A server does not: requests arrive whenever users send
# them, each streams its answer back, and a new one joins the running batch at the next step. `start_server`
# runs `python -m mini_engine serve` in the background (a subprocess on 127.0.0.1), and a few bursts of requests
# warm it up. (`tuned_env()` hands the server the one-time choices this notebook made before timing anything,
# so that its first requests are not slowed by making them again.)

# %%
from openai import OpenAI

from mini_engine.bench.server import tuned_env, warm_server
from mini_engine.serving.loadtest import PROMPTS, format_table, plot_sweep, start_server, sweep

SERVER_SEQS = pick(cpu=4, gpu=16, device=device)  # the most requests the server decodes at once
with tuned_env():
    server = start_server("--device", device, "--dtype", dtype, "--max-model-len", "512", "--max-num-seqs",
                          str(SERVER_SEQS))
print(f"server at {server.url} (log: {server.log_path})")
print(f"warm-up bursts: {warm_server(server.url, PROMPTS, up_to=8):.1f} s")

# %% [markdown]
# Any OpenAI client talks to it. A streamed chat answer, printed as it arrives, with its time to first token:

# %%
client = OpenAI(base_url=server.url + "/v1", api_key="none")
t0, first, pieces = time.perf_counter(), None, []
stream = client.chat.completions.create(
    model="smollm2-135m", messages=[{"role": "user", "content": "Give two tips for a first bicycle ride."}],
    max_tokens=48, temperature=0.0, stream=True)
for chunk in stream:
    text = chunk.choices[0].delta.content if chunk.choices else None
    if text:
        first = first or time.perf_counter()
        pieces.append(text)
        print(text, end="", flush=True)
stream_s = time.perf_counter() - t0
print(f"\n\n[{len(pieces)} chunks, TTFT {(first - t0) * 1e3:.0f} ms, {stream_s:.2f} s in all]")

# %% [markdown]
# Now the load: requests arrive as a Poisson process at a given rate (`loadtest.sweep`), each streaming its
# answer. Below the engine's capacity, throughput follows the offered rate and latency stays flat; past it,
# requests queue (time to first token grows) while throughput levels off at what the engine sustains. Where
# the curve bends is the server's capacity on this machine. The server above admits at most 4 requests at once
# (`--max-num-seqs 4`), so that a handful of requests is enough to fill its batch and make the next ones wait.

# %%
rates = pick(cpu=[1.5, 6, 24], gpu=[4, 16, 64, 256], device=device)
SWEEP_REQUESTS, SWEEP_TOKENS = pick(cpu=8, gpu=64, device=device), 32
curve = sweep(server.url, rates, SWEEP_REQUESTS, max_tokens=SWEEP_TOKENS)
print(format_table(curve))
plot_sweep(curve)
plt.show()
server.stop()

# %% [markdown]
# ### The same curve under sliders
#
# A load test takes tens of seconds a point; a simulation takes milliseconds. What a continuous-batching server
# does under load follows mostly from two costs the engine can measure: the time of one decode step with n
# requests in it, and the prefill a new request adds to the step it joins. Below, both are measured on the
# engine, on the server's prompts: n requests start together and ask for the same number of tokens, so each of
# them waits one step per token, and its time per output token is the step's time at batch n. Then
# `serving_sim.simulate_load` replays the load test with those costs: Poisson arrivals, at most a batch limit of
# requests at once, the others waiting in the queue. First the simulation beside the curve just measured:

# %%
from IPython.display import display

from mini_engine.course.serving_sim import capacity, simulate_load
from mini_engine.course.widgets import load_widget

# The largest batch's engine holds a KV pool for every place at max_model_len: `fitting` drops a batch whose pool
# would not fit this GPU's free memory, and says so.
step_batches = fitting(pick(cpu=(1, 2, 4, 8, 16), gpu=(1, 4, 16, 64), device=device),
                       lambda b: formulas.kv_cache_bytes_for(model, 512, b, model.dtype.itemsize), device, "batch")
server_prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
steps_llm = LLM.from_model(model, tok, max_num_seqs=max(step_batches), max_model_len=512)
fixed = me.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
steps_llm.generate(server_prompts[:2], me.SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
step_s = {}
for b in step_batches:
    outs = steps_llm.generate((server_prompts * b)[:b], fixed, use_tqdm=False)
    step_s[b] = float(np.median([o.metrics.tpot_s for o in outs]))
    if b == 1:  # one request alone: its time to first token is its prefill and one step
        prompt_s = max(outs[0].metrics.ttft_s - step_s[1], 0.0)
del steps_llm
print("decode step: " + ", ".join(f"batch {b} {t * 1e3:.1f} ms" for b, t in step_s.items())
      + f"; a prompt's prefill {prompt_s * 1e3:.0f} ms")
print(f"capacity with {SERVER_SEQS} places: {capacity(step_s, SERVER_SEQS, SWEEP_TOKENS, prompt_s):.2f} requests/s")
print(f"{'rate/s':>7}{'tok/s measured':>16}{'simulated':>11}{'TTFT p50 measured':>19}{'simulated':>11}")
for c_ in curve:  # the simulation averaged over 20 draws of the same number of arrivals as the load test
    sims = [simulate_load(step_s, c_["rate"], SERVER_SEQS, SWEEP_TOKENS, prompt_s, SWEEP_REQUESTS, seed)
            for seed in range(20)]
    c_["sim_tok_s"] = np.mean([x.tok_s for x in sims])
    print(f"{c_['rate']:>7g}{c_['output_tok_s']:>16.1f}{c_['sim_tok_s']:>11.1f}{c_['ttft_p50_s'] * 1e3:>17.0f}ms"
          f"{np.mean([x.ttft_p50 for x in sims]) * 1e3:>9.0f}ms")

# %% [markdown]
# The simulation should land near the measured points, and above them where the server is busy: it has no HTTP,
# no streaming, no tokenizer, and no load generator sharing the cores with the engine, all of which the
# measured curve pays for. Now move the sliders. The arrival rate walks the curve: throughput follows the
# offered load until the server's capacity, then levels off while the latency takes off (requests wait for a
# place). The batch limit moves the capacity: each extra place adds a request per step but makes the step slower
# by the measured amount, so the capacity grows while a step of more requests costs little more (a memory-bound
# step: a GPU) and stops growing once the step's cost grows with its rows (a compute-bound step: a CPU after a
# few requests). Longer answers hold a place longer: the same rate is then a heavier load.

# %%
display(load_widget(step_s, prompt_s, max_batch=SERVER_SEQS, tokens=SWEEP_TOKENS))

# %% [markdown]
# `python -m mini_engine bench --workload server` measures the same at full size: the server's throughput
# against offline `LLM.generate` on the same requests, and whether every request is answered at twice the rate
# the engine sustains (results in `benchmarks/RESULTS.md`). On a two-core CPU the load generator's streaming
# clients share the cores with the server, which is part of what the curve measures. The gap between the
# server and the offline engine on the same requests is the cost of serving itself: HTTP, streaming every
# token, clients on the same machine. Measuring one against the other is how such costs are found, and not all
# of them are where one would look: one found this way cost the server a quarter of its speed and had nothing
# to do with HTTP (appendix [A1](A1_fast_on_a_cpu.ipynb), section 7).
#
# ## 6. The same primitives in production engines
#
# The textbook says that with these primitives in hand "the modern serving stacks (vLLM, TGI, SGLang,
# TensorRT-LLM) start to read as recombinations of a small number of primitives". Here is where each of ours
# lives in them (as of their 2025 releases; every one of them moves fast, so check the project's documentation):
#
# | primitive (chapter) | mini_engine | vLLM | TGI | SGLang | TensorRT-LLM |
# | --- | --- | --- | --- | --- | --- |
# | KV cache (03) | contiguous or paged | paged | paged | paged (token-granular pool) | paged |
# | continuous batching (04) | `scheduling="continuous"` | yes (its core loop) | yes (router + batcher) | yes | "in-flight batching" |
# | chunked prefill (04) | `chunked_prefill_tokens` | yes | yes | yes | "chunked context" |
# | fused attention (05) | Triton flash / paged decode kernels; SDPA on CPU | FlashAttention, FlashInfer | FlashAttention, FlashInfer | FlashInfer, Triton | its own fused kernels |
# | speculative decoding (06) | n-gram, draft model | n-gram, draft, EAGLE, Medusa | Medusa, n-gram | EAGLE, draft | draft, Medusa, EAGLE, lookahead |
# | paged KV cache (07) | `kv_cache="paged"` | PagedAttention (it started there) | yes | yes | yes |
# | prefix caching (08) | hashed full blocks | automatic prefix caching (hashed blocks) | prefix caching | RadixAttention (a radix tree of prefixes) | KV cache reuse |
# | compiled / graph-captured steps (03, 09) | `torch.compile`, CUDA graphs per batch bucket | CUDA graphs, `torch.compile` | CUDA graphs | CUDA graphs | ahead-of-time compiled engines |
# | quantization (10) | int8 / int4 weights | many (FP8, INT4 AWQ/GPTQ, ...) | many | many | FP8, INT4, FP4 |
# | OpenAI-compatible server (09) | `python -m mini_engine serve` | `vllm serve` | Messages API | yes | `trtllm-serve` |
#
# What this engine still lacks compared with them:
#
# - **Every way to use many devices**: the engine splits a model over ranks by tensor or pipeline parallelism
#   (`tensor_parallel_size`, `pipeline_parallel_size`; chapter 11), but has no expert parallelism, and does not
#   split prefill and decode onto different machines (disaggregated serving), as some production engines do.
# - **Overlap**: the engine schedules, runs and samples in sequence; vLLM and SGLang prepare the next step on the
#   CPU while the GPU runs this one, and run the detokenizer and API server in processes of their own.
# - **Graphs for every step**: only decode-only steps are compiled here; steps carrying drafts or prompt chunks
#   run eagerly. Production engines capture far more of the step (and TensorRT-LLM compiles the whole model).
# - **Memory beyond recomputation**: a preempted request recomputes; others can also swap KV blocks to CPU
#   memory, quantize the KV cache (FP8), and share prefixes across machines.
# - **Better drafts**: EAGLE and Medusa heads trained on the target, and tree-shaped verification.
# - **Product features**: structured output (grammars, JSON schemas), LoRA adapters served side by side,
#   priorities and fairness between users, multimodal inputs, rate limiting, authentication beyond one key.
#
# ## What you measured

# %%
naive, cached, hf = r("naive"), r("cached"), r("hf")
summary = [
    ("workload", work.describe()),
    *((f"{x.label}{' (one user, sample)' if x.single_stream else ''}: tok/s",
       f"{x.tok_s:.1f} ({x.tok_s / naive.tok_s:.1f}x naive)") for x in ladder.rows),
    ("top rung / naive", f"{top.tok_s / naive.tok_s:.1f}x"),
    ("top rung / HF batched generate", f"{top.tok_s / hf.tok_s:.2f}x"),
    ("outputs equal to the cached rung's (on the sample)",
     ", ".join(f"{x.rung} {same[0]}/{same[1]}" for x in ladder.rows if (same := agreement(x, cached)))),
    ("speculation alone: speedup, alpha", f"{plain_s / spec_s:.2f}x, {spec_stats.alpha:.2f}"),
    ("prefix caching alone: TTFT off -> on", f"{ttft_off * 1e3:.0f} -> {ttft_on * 1e3:.0f} ms ({ttft_off / ttft_on:.1f}x)"),
    ("continuous / static batching: tok/s, places busy",
     f"{gain('continuous', 'static'):.2f}x, {r('static').stats['lanes_busy']:.0%} -> "
     f"{r('continuous').stats['lanes_busy']:.0%} (the textbook: about 1.8x, 50% -> 90%)"),
    ("paging: requests at once, contiguous -> paged", f"{r('continuous').peak_running} -> {paged.peak_running}"),
    ("roofline here: naive, cached, top (share reached)",
     ", ".join(f"{row.tok_s / ceiling:.0%}" for _, row, ceiling in cases)),
    ("A100 roofline, Llama-7B: naive, batch 1, batch 16 (tok/s)", ", ".join(f"{x[1]:.0f}" for x in rows[:2] + rows[3:4])),
    ("server: streamed answer TTFT", f"{(first - t0) * 1e3:.0f} ms"),
    *((f"server at {c_['rate']:g} req/s: tok/s (simulated), TTFT p50, errors",
       f"{c_['output_tok_s']:.1f} ({c_['sim_tok_s']:.1f}), {c_['ttft_p50_s'] * 1e3:.0f} ms, {c_['errors']}")
      for c_ in curve),
    ("decode step at batch 1 / largest measured", f"{step_s[min(step_s)] * 1e3:.1f} / {step_s[max(step_s)] * 1e3:.1f} ms "
                                                  f"(batch {max(step_s)})"),
]
width = max(len(k) for k, _ in summary)
for k, v in summary:
    print(f"{k:<{width}}  {v}")

# %% [markdown]
# ## Exercises: predict, then run
#
# Write your prediction down before you run each cell; the answer under it says what you should see and why.
#
# **1. Batch of one.** Run the paged + prefix caching engine with `max_num_seqs=1` on the first three requests,
# so it serves one request at a time like the cached rung. Predict its tokens/s against the cached rung's and
# against the batched row.

# %%
from mini_engine.bench.ladder import engine_kwargs_for, run_engine_rung

first3 = LadderWorkload(work.prompts[:3], work.max_tokens[:3], work.kinds[:3], work.shared_prefix_len)
solo = run_engine_rung(model, tok, first3, "prefix", progress=False,
                       **engine_kwargs_for("prefix", first3, device, size["batch"], 16, None, 1, 4))
print(f"engine, one request at a time: {solo.tok_s:.1f} tok/s; cached rung (one stream): {cached.tok_s:.1f}; "
      f"batched: {prefix.tok_s:.1f}; same tokens as batched: "
      f"{all(solo.outputs[i] == prefix.outputs[i] for i in range(3))}")

# %% [markdown]
# <details><summary>Answer</summary>
#
# Close to the cached rung: one request at a time, the engine is a cached loop with some bookkeeping per step
# (scheduling, block tables), and prefix caching saves it a little prefill. Far below the batched row: what
# the serving engine adds is mostly the batch. The tokens are the same, because greedy decoding does not
# depend on what else shares the step.
# </details>
#
# **2. Nothing to share.** Build the workload with a one-sentence system prompt. Which rung's gain shrinks the
# most, and which one does not move?

# %%
short = LadderWorkload.build(tok, size["requests"], 16, system_prompt="Be brief.")
short_runs = {rung: run_engine_rung(model, tok, short, rung, progress=False,
                                    **engine_kwargs_for(rung, short, device, size["batch"], 16, None, None, 4))
              for rung in tqdm(["paged", "prefix"], desc="short system prompt")}
for rung, x in short_runs.items():
    print(f"{LABELS[rung]:<20} {x.tok_s:7.1f} tok/s, prompt tokens from the cache "
          f"{x.stats['cached_tokens']} of {x.stats['prompt_tokens']}")
print(f"prefix / paged: {short_runs['prefix'].tok_s / short_runs['paged'].tok_s:.2f}x here, "
      f"{gain('prefix', 'paged'):.2f}x with the long system prompt")
# What is left to share: each prompt's longest common start with an earlier one, and the whole blocks of 16 in it.
common = [max((next((k for k, (a, b) in enumerate(zip(p, q)) if a != b), min(len(p), len(q)))
               for q in short.prompts[:i]), default=0) for i, p in enumerate(short.prompts)]
print(f"every prompt shares its first {short.shared_prefix_len} tokens ({short.shared_prefix_len // 16} whole blocks "
      f"of 16); with an earlier prompt, up to {max(common)} tokens: at most {sum(c // 16 * 16 for c in common)} of "
      f"{sum(map(len, short.prompts))} prompt tokens in whole blocks")

# %% [markdown]
# <details><summary>Answer</summary>
#
# Prefix caching's: the system prompt all requests share is now shorter than a block of 16, and a hit is
# counted in whole blocks (chapter 08), so its hit rate falls to almost nothing. Not quite zero: the
# input-grounded requests also open their user turn with the same instruction ("Repeat this text
# exactly: ..."), which carries their common start past one block, and the cell's last line counts those
# blocks. Speculation and batching do not depend on the system prompt. Prefix caching also costs nothing
# measurable when it finds nothing: with no hit the two engines run the same steps, so any gap between the
# two rows above is the machine's noise.
# </details>
#
# **3. The A100 arithmetic for a bigger model.** Predict the batch-1 decode ceiling of Llama-2-13B in fp16 on
# an A100-80GB, and with int4 weights (half a byte per weight; the KV cache stays fp16).

# %%
for name, wbytes in (("fp16", 2), ("int4 weights", 0.5)):
    weights, kv = formulas.weight_bytes("llama-2-13b", wbytes), formulas.kv_cache_bytes_for("llama-2-13b", 1024)
    print(f"Llama-2-13B, {name}: {weights / 1e9:.1f} GB of weights + {kv / 1e9:.1f} GB of KV per decode step at 1K "
          f"context -> {2.039e12 / (weights + kv):.0f} tok/s ceiling at batch 1")

# %% [markdown]
# <details><summary>Answer</summary>
#
# fp16: 26 GB of weights plus 0.8 GB of KV at 1K tokens, so about 76 tok/s: a bigger model is slower per stream
# in direct proportion to its bytes. int4 divides the weight bytes by four (chapter 10): about 280 tok/s, but not
# 4× the fp16 figure, because the KV cache is not smaller. This is the textbook's "quantization stacks
# multiplicatively with the inference-stack optimizations here, often giving another 2 to 4× throughput
# improvement on top": it attacks the bytes per token that every rung above still pays.
# </details>
#
# **4. Where is the knee?** From the throughput-latency curve above, estimate the highest request rate this
# server sustains without the time to first token taking off. Then predict it from its throughput at the
# highest rate: a request asks for 32 tokens.

# %%
best = max(c_["output_tok_s"] for c_ in curve)
print(f"highest throughput measured: {best:.1f} tok/s -> about {best / 32:.1f} requests/s of 32 tokens each")
base_ttft = curve[0]["ttft_p50_s"]
for c_ in curve:
    print(f"rate {c_['rate']:g}/s: offered {c_['rate'] * 32:.0f} tok/s, served {c_['output_tok_s']:.1f} tok/s, "
          f"TTFT p50 {c_['ttft_p50_s'] * 1e3:.0f} ms ({c_['ttft_p50_s'] / base_ttft:.1f}x the lowest rate's)")

# %% [markdown]
# <details><summary>Answer</summary>
#
# Below the knee the time to first token stays near its value at the lowest rate and the batch is rarely full;
# past it, requests wait for one of the 4 places in the batch and the time to first token multiplies, while
# throughput stops following the offered rate. The knee sits near the best throughput divided by 32 tokens per
# request. With only 8 requests per rate the measured tokens/s stays below the offered rate even where the
# server keeps up: the run also lasts while the last request decodes, and that tail is a large part of so short
# a run (the server bench in `benchmarks/RESULTS.md` discusses the same effect at 32 requests).
# </details>
