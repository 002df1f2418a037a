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
# # 06 · Speculative decoding: draft, verify, accept
#
# A decode step reads every weight of the model to produce a single token. Chapter 02 measured what that
# means: at batch 1 the step is bound by memory traffic, and the arithmetic units sit mostly idle. Feeding
# the same step five tokens instead of one reads the same weights once and does five times the arithmetic,
# which the idle units absorb almost for free.
#
# Speculative decoding (Leviathan et al. 2023; Chen et al. 2023) turns that slack into tokens. Something cheap
# guesses the next *k* tokens; the target model then runs **once** over its last token and the *k* guesses,
# which gives its own next-token distribution at all *k + 1* positions; a rejection sampler keeps the guesses
# the target agrees with and adds one token of the target's own. A round therefore commits between 1 and
# *k + 1* tokens for one target pass. The sampler is built so that the output follows the target's
# distribution **exactly**: greedy output is the same token for token, sampled output has the same law. (That
# holds in exact arithmetic; section 3 shows the one way floating point bends it: a near-tie can flip.)
#
# This chapter:
#
# 1. puts the closed form under sliders and reproduces the textbook's k × α table from code (chapter 00
#    introduces the textbook);
# 2. walks through one round by hand;
# 3. measures, on the real model, α, tokens per target pass and tokens/s with and without speculation, on
#    a task that repeats its input and on open chat, beside the formula's prediction;
# 4. colours the accepted and rejected drafts over a generated text;
# 5. uses a 16-bit copy of the model as a draft for the fp32 target: the lesson about what a draft costs;
# 6. checks with a histogram that the rejection sampler leaves the distribution unchanged;
# 7. measures the serving engine at batch 1 and 16: why the gain shrinks in a busy server; exercises close it.

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
import html
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import HTML, display

import mini_engine as me
from mini_engine import formulas
from mini_engine.course.devices import default_device, pick, warm_up
from mini_engine.course.hardware import describe_machine, matmul_floor_tok_s
from mini_engine.speculative import DraftModelProposer, NgramProposer, rejection_sample
from mini_engine.course.widgets import speculative_widget

device = default_device()
dtype = me.default_dtype(device)
model, tok = me.load_model("smollm2-135m", device=device, dtype=dtype)
warm_up(model, 256)  # one-time choices for steps of up to 256 tokens, made now, off the clock
NEW = pick(40, 160, device)  # tokens per generation: short on a CPU so the chapter runs in about two minutes
GREEDY = me.SamplingParams(temperature=0.0, ignore_eos=True)
print(describe_machine(device))
print(f"device: {device}, dtype: {dtype}, {NEW} new tokens per run")

# %% [markdown]
# ## 1. The formula
#
# Say each draft is accepted with probability α, independently, until the first rejection. A round with
# *k* drafts then commits 1 + α + α² + … + α^k tokens on average: the target's own token always, the first
# draft with probability α, the first two with α², and so on. Summed,
#
# $$E[\text{tokens per target pass}] = \frac{1-\alpha^{k+1}}{1-\alpha}.$$
#
# A round costs one target pass, *k* draft passes at `draft_cost` each (in units of a target pass) and some
# bookkeeping (`overhead`), so the speedup over plain decoding is that expectation divided by
# 1 + k · draft_cost + overhead. The textbook's example: "at α=0.8, k=4 that yields ~3.36 tokens per target
# step"; and "with k = 5, acceptance rate α = 0.7, and a draft model 50× cheaper than the big one, the
# formula gives roughly 2.5× speedup":

# %%
print(f"α = 0.8, k = 4: {formulas.expected_tokens_per_step(4, 0.8):.2f} tokens per target pass")
print(f"α = 0.7, k = 5, draft 50x cheaper, 5% overhead: {formulas.speculative_speedup(5, 0.7, 0.02, 0.05):.2f}x")

# %% [markdown]
# The textbook prints a table of this speedup, rows k and columns α, for a draft 50 times cheaper than the
# target and 5% overhead per round. `formulas.speculative_speedup_table` computes it; its cells match the
# textbook's to the two decimals it prints (1.21× at k = 1, α = 0.3, up to 5.49× at k = 10, α = 0.9):

# %%
table = formulas.speculative_speedup_table()
print("  k | " + "  ".join(f"α={a:.1f}" for a in formulas.TEXTBOOK_ALPHAS))
for k, row in zip(formulas.TEXTBOOK_KS, table):
    print(f"{k:3d} | " + "  ".join(f"{s:5.2f}" for s in row))

# %% [markdown]
# Move the sliders: the left plot is the speedup against k for several α (the bold curve is the slider's
# α), the right one the expected tokens per pass against α. Two things to find: a larger k helps only
# while α is high, and an expensive draft (drag `draft cost` to 0.3) makes every k a loss.

# %%
display(speculative_widget())

# %% [markdown]
# ### The textbook contradicts itself about α < 0.5
#
# The textbook's prose says: "Acceptance rates of 0.6 to 0.8 are typical for a well-chosen draft model;
# below 0.5 the technique struggles to break even because the draft cost and the rejection probability
# conspire against you." Its own table says otherwise: with the table's assumptions every cell is a gain, even at α = 0.3. Speculation loses only
# when a round costs more target passes than it yields tokens, that is when
# draft_cost > (E − 1 − overhead) / k. The break-even draft cost, from the same formula:

# %%
print("break-even draft cost (relative to one target pass), overhead 0.05")
print("  k | " + "  ".join(f"α={a:.1f}" for a in formulas.TEXTBOOK_ALPHAS))
for k in formulas.TEXTBOOK_KS:
    cells = [(formulas.expected_tokens_per_step(k, a) - 1 - 0.05) / k for a in formulas.TEXTBOOK_ALPHAS]
    print(f"{k:3d} | " + "  ".join(f"{c:5.3f}" for c in cells))
print(f"α = 0.3, k = 1: (1 + 0.3) / (1 + 0.02 + 0.05) = {1.3 / 1.07:.2f}x, a gain with the textbook's own numbers")

# %% [markdown]
# At α = 0.3 and k = 1 the round yields 1.3 tokens for 1.07 target passes: a 1.21× gain, and the draft
# could cost up to a quarter of the target before the gain vanished. What *is* true at low α is that the
# gain is small, the best k is 1 or 2, and any hidden cost (a draft that is not 50× cheaper, a verify pass
# that is not free because the server is busy, section 7) eats it. The statement holds for expensive
# drafts, not for the table it sits beside.
#
# ## 2. One round by hand
#
# `generate_speculative` (in `mini_engine/generate.py`, beside `generate_cached`) is the plain loop. One
# round of it, unrolled: the n-gram proposer looks for the sequence's last tokens earlier in the sequence
# and proposes what followed them there (Saxena's prompt lookup decoding, 2023; vLLM's "ngram" method). The
# prompt below asks to copy a sentence, so after the model has started copying, the lookup finds the source
# sentence in the prompt.

# %%
copy_prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content":
    "Repeat this sentence exactly: The river flows past the old mill and under the stone bridge."}]))
first = me.generate_cached(model, copy_prompt, 6, GREEDY)  # the answer so far: 6 tokens
seq = copy_prompt + first
drafts = NgramProposer(ngram_min=1, ngram_max=4).propose(seq, 4)
print("so far:", repr(tok.decode(first)), "  drafts:", [tok.decode([t]) for t in drafts])

# %% [markdown]
# The target runs once over the last token and the four drafts, against its KV cache, and returns five rows
# of logits: row j is its prediction after j drafts. Greedy acceptance is "keep drafts while each equals the
# target's argmax at its position, then add the argmax where they first differ (or after the last one)":

# %%
logits = model(torch.tensor([seq + drafts], device=device))[0, len(seq) - 1:]  # 5 rows: p_0 .. p_4
wanted = logits.argmax(-1).tolist()
print("target's argmax per position:", [tok.decode([t]) for t in wanted])
probs = torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)  # greedy: one-hot rows
kept = rejection_sample(probs[None].float(), torch.tensor([drafts], dtype=torch.long).view(1, -1))[0]
print(f"rejection_sample keeps {len(kept) - 1} of {len(drafts)} drafts and adds one token:",
      [tok.decode([t]) for t in kept])

# %% [markdown]
# (This cell recomputes the whole sequence for clarity; the loop sends only the five new tokens and reads
# the rest from its cache.) If a draft is rejected, the keys and values the pass wrote for it and for the
# drafts after it are simply not counted: the loop's cache length stops after the accepted tokens, attention
# never reads past that length, and the next round overwrites those rows. That is the whole rollback.
#
# ## 3. Measured on the real model
#
# Two workloads, each run with plain cached decoding and with n-gram speculation (k = 4), greedy:
#
# - **input-grounded**: give the model a paragraph and ask for it back, the extreme of the tasks prompt lookup
#   was made for (editing a document or code, extracting fields, quoting a source: the answer copies runs of
#   the input). A 135M model is a poor editor: asked to fix the spelling of a paragraph instead, it rewrote
#   words and casing freely, and lookup's α fell to about 0.4 in a trial run;
# - **open chat**: a question whose answer has to be written from scratch; lookup finds little.
#
# Each run records a timestamp per token; decode speed counts the tokens after the first (the prefill is
# the same either way).

# %%
SOURCE = ("The committee met on Tuesday to discuss the new park. Members agreed that the playground needs new "
          "swings, that the benches along the river should be repaired, and that the lights on the main path "
          "must stay on until midnight.")
WORKLOADS = {
    "input-grounded": [{"role": "user", "content": "Repeat the following text word for word:\n\n" + SOURCE}],
    "open chat": [{"role": "user", "content": "Give me three ideas for a rainy weekend with children."}],
}
prompts = {name: tok.encode(tok.apply_chat_template(m)) for name, m in WORKLOADS.items()}


def stamped(fn):
    """Run fn(on_token); return (its result, seconds per token after the first)."""
    stamps = []
    result = fn(lambda _t: stamps.append(time.perf_counter()))
    return result, (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def run_plain(prompt, n=NEW, target=model):
    return stamped(lambda cb: me.generate_cached(target, prompt, n, GREEDY, on_token=cb))


def run_spec(prompt, proposer, k=4, n=NEW, target=model, params=GREEDY):
    (out, stats), per_token = stamped(lambda cb: me.generate_speculative(target, prompt, proposer, k=k,
                                                                         max_new_tokens=n, params=params,
                                                                         on_token=cb))
    return out, stats, per_token


def predict(stats, step_s):
    """The formula's tokens per target pass and speedup from the run's measured α and measured costs: each
    round's expected tokens with its own number of drafts, over each round's cost in plain decode steps (a
    verify pass, `verify` steps on average, plus `draft` steps per draft)."""
    verify = stats.target_s / stats.target_steps / step_s
    draft = stats.draft_s / max(stats.num_draft_tokens, 1) / step_s
    n = np.array([len(d) for d, _ in stats.rounds])
    tokens = formulas.expected_tokens_per_step(n, stats.alpha)
    return float(tokens.mean()), float(tokens.sum() / (verify + draft * n).sum()), verify, draft


results = {}
for name, prompt in prompts.items():
    plain_out, plain_s = run_plain(prompt)
    spec_out, stats, spec_s = run_spec(prompt, NgramProposer(ngram_min=1, ngram_max=4))
    results[name] = dict(plain=plain_out, spec=spec_out, stats=stats, plain_s=plain_s, spec_s=spec_s,
                         prediction=predict(stats, plain_s))

print(f"{'workload':<16}{'α':>6}{'drafted':>9}{'tok/pass':>10}{'(formula)':>10}{'plain tok/s':>13}"
      f"{'spec tok/s':>12}{'speedup':>9}{'(formula)':>10}")
for name, r in results.items():
    st, (tokens_f, speed_f, verify, draft) = r["stats"], r["prediction"]
    print(f"{name:<16}{st.alpha:6.2f}{st.num_draft_tokens:9d}{st.tokens_per_step:10.2f}{tokens_f:10.2f}"
          f"{1 / r['plain_s']:13.1f}{1 / r['spec_s']:12.1f}{r['plain_s'] / r['spec_s']:8.2f}x{speed_f:9.2f}x")
for name, r in results.items():
    _, _, verify, draft = r["prediction"]
    print(f"{name}: a verify pass costs {verify:.2f} plain decode steps, a draft {draft:.4f}")

# %% [markdown]
# Greedy speculative output should be the plain output, token for token, and in exact arithmetic it is. In
# floating point there is one catch. The verify pass computes the target's logits for five positions in one
# product, where plain decoding computes one position at a time: the same sums, taken in another order, and so
# rounded differently. In fp32 the logits then differ by about a millionth and the argmax almost never moves.
# In bf16 or fp16 (this chapter's dtype on a GPU) they differ by a hundredth or more, enough to flip the argmax
# where the two best tokens are that close: a **near-tie**. From that token on, the two outputs continue
# differently, and both are the model's greedy output up to rounding. (The course's tests accept exactly that:
# outputs equal, or equal up to a position where the two best logits are within rounding of each other.) Where
# the outputs differ, the cell says where, and how close the two best logits were there:

# %%
def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def top_two_gap(target, prompt, out, i):
    """How far apart the target's two best logits are before output token i (one plain forward pass)."""
    with torch.inference_mode():
        logits = target(torch.tensor([prompt + out[:i]], device=device))[0, -1].float()
    best = logits.topk(2).values
    return float(best[0] - best[1])


for name, r in results.items():
    i = first_difference(r["spec"], r["plain"])
    if i is None:
        print(f"{name}: identical, all {len(r['plain'])} tokens")
    else:
        print(f"{name}: the same up to token {i}, then {tok.decode([r['plain'][i]])!r} (plain) against "
              f"{tok.decode([r['spec'][i]])!r} (speculative): a near-tie, the target's two best logits there are "
              f"{top_two_gap(model, prompts[name], r['plain'], i):.3f} apart")
print(repr(tok.decode(results["input-grounded"]["spec"])))

# %% [markdown]
# How to read the table:
#
# - **α** is estimated as accepted / tested drafts (a draft is tested only if every draft before it in its
#   round passed); **drafted** counts the proposals. On open chat the lookup rarely finds a match, so it
#   rarely proposes anything, and when it does the guess is usually wrong.
# - **tok/pass (formula)** applies (1 − α^(n+1)) / (1 − α) to each round with its own number of drafts n.
#   The measured value can beat it on copying work: acceptances are not independent there. Once the copy is
#   under way, whole runs of drafts are right; one early rejection is followed by a fresh match.
# - **speedup (formula)** divides those tokens by each round's measured cost in plain decode steps. A verify
#   pass over five tokens costs somewhat more than a one-token step (more rows through every product, a
#   longer attention row, the sampler), and that, not the n-gram proposer, is the price of a round here.
# - When lookup finds nothing, a round is a plain decode step with a few extra list operations: the chat
#   speedup should sit close to 1. (Timings on a shared machine wobble by a few percent from run to run.)
#
# ## 4. Which drafts were accepted
#
# The input-grounded answer again, coloured by where each token came from: green for an accepted draft, plain
# for the target's own token, and in red (struck through, between the tokens) the drafts it rejected.

# %%
def colour_rounds(first_token, stats, limit=None):
    """HTML: the first token, then per round the accepted drafts (green), the rejected drafts (red, struck
    through) and the target's token."""
    spans = [html.escape(tok.decode([first_token]))]
    out = results["input-grounded"]["spec"]
    pos = 1
    for drafts, accepted in stats.rounds[:limit]:
        for t in drafts[:accepted]:
            spans.append(f"<span style='background:#b6e3b6'>{html.escape(tok.decode([t]))}</span>")
        if accepted < len(drafts):
            wrong = html.escape(tok.decode(drafts[accepted:]))
            spans.append(f"<span style='color:#c0392b;text-decoration:line-through'>{wrong}</span>")
        pos += accepted
        if pos < len(out):
            spans.append(f"<span style='border-bottom:2px solid #555'>{html.escape(tok.decode([out[pos]]))}</span>")
        pos += 1
    return "<div style='font-family:monospace;line-height:1.8;white-space:pre-wrap'>" + "".join(spans) + "</div>"


st = results["input-grounded"]["stats"]
display(HTML(colour_rounds(results["input-grounded"]["spec"][0], st)))
print(f"{st.target_steps} target passes for {len(results['input-grounded']['spec'])} tokens; "
      f"underlined: the target's own token of each round")

# %% [markdown]
# ## 5. A draft model: the target's weights in 16 bits
#
# A classic draft is a smaller model of the same family. This chapter's model is already the smallest of its
# family, so take the next best candidate: the same weights in 16 bits, drafting for the same model in fp32.
# On a CPU the fp32 model is the chapter's `model`, and the draft is its bf16 copy. On a GPU the chapter's
# model already runs in 16 bits (bf16, or fp16 on a T4), so a 16-bit copy of it would be the target itself:
# there this section loads the fp32 model as the target, and the chapter's model is the draft. Either way the
# draft agrees with the target almost everywhere, so α is high. But it is not much cheaper: 16 bits halve the
# bytes a decode step reads, and a 135M-parameter decode step is not purely a weight read (on a CPU, chapter
# 03's "everything else"; on a GPU, launching a few hundred small kernels costs as much as reading the weights).
# `DraftModelProposer` keeps its own KV cache, catches up on the tokens it has not seen, and drafts k tokens
# with k one-token passes.

# %%
prompt = prompts["input-grounded"]
if model.dtype == torch.float32:  # a CPU: the chapter's model is the fp32 target, its plain run is section 3's
    target32, draft_model = model, copy.deepcopy(model).to(torch.bfloat16)
    plain32_out, plain_s = results["input-grounded"]["plain"], results["input-grounded"]["plain_s"]
else:  # a GPU: the chapter's 16-bit model drafts for the model loaded in fp32
    target32, draft_model = me.load_model("smollm2-135m", device=device, dtype="float32")[0], model
    run_plain(prompt, 4, target=target32)  # warm-up (kernels compile on first use)
    plain32_out, plain_s = run_plain(prompt, target=target32)
half = str(draft_model.dtype).removeprefix("torch.")
run_spec(prompt, DraftModelProposer(draft_model, model.config.vocab_size, max_len=len(prompt) + 16), n=4,
         target=target32)  # warm-up
half_out, half_stats, half_s = run_spec(prompt, DraftModelProposer(draft_model, model.config.vocab_size,
                                                                   max_len=len(prompt) + NEW + 8), target=target32)
tokens_f, speed_f, verify, draft = predict(half_stats, plain_s)
print(f"{half} draft for the fp32 target, k = 4: α = {half_stats.alpha:.2f}, "
      f"{half_stats.tokens_per_step:.2f} tokens per target pass (formula {tokens_f:.2f})")
print(f"a draft token costs {draft:.2f} target steps, a verify pass {verify:.2f}: a round costs "
      f"{verify + 4 * draft:.2f} target steps")
print(f"measured speedup {plain_s / half_s:.2f}x, formula {speed_f:.2f}x; identical output: {half_out == plain32_out}")

# %% [markdown]
# Near-perfect agreement and still no gain: k draft passes at a sizeable fraction of a target pass each (on
# some CPUs a bf16 step is not cheaper than an fp32 one at all: the cost printed above is measured, not
# assumed) cost as much as the tokens they save, or more. The formula says it plainly: with draft_cost c, the
# round costs 1 + k·c, and no α can push (1 − α^(k+1)) / (1 − α) past k + 1. Real deployments pick drafts 10
# to 100 times smaller than the target (the textbook says "typically 30× to 100× smaller", and its table
# assumes a draft 50× cheaper), or drafts that cost almost nothing: prompt lookup, extra decoding heads on the
# target itself (Medusa), or a one-layer head that reuses the target's hidden states (EAGLE). The GPU cell in
# section 8 tries a 135M draft for a 360M target; even that is only 2.7× smaller.
#
# ## 6. Lossless: the distribution does not change
#
# The rejection sampler accepts draft x with probability min(1, p(x)/q(x)) and, at a rejection, draws from
# the residual max(0, p − q), renormalised. Token y then comes out with probability min(p(y), q(y)) from the
# accept branch plus max(0, p(y) − q(y)) from the residual branch: exactly p(y). Below, a target p and a draft
# q over eight tokens that disagree a lot (α = Σ min(p, q) is printed), 100,000 verification steps with one
# draft each, and the histogram of the first token emitted. For contrast, a sampler with a classic bug: at a
# rejection it draws from p itself instead of the residual.

# %%
gen = torch.Generator().manual_seed(0)
V, S = 8, 100_000
p = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.06, 0.04, 0.03])
q = torch.tensor([0.02, 0.05, 0.08, 0.10, 0.15, 0.20, 0.20, 0.20])
drafted = torch.multinomial(q, S, replacement=True, generator=gen)[:, None]  # one draft per step, from q
rows = rejection_sample(torch.stack([p, p])[None].expand(S, 2, V), drafted, q[None, None].expand(S, 1, V), gen)
emitted = torch.tensor([r[0] for r in rows])
accept = torch.rand(S, generator=gen) * q[drafted[:, 0]] < p[drafted[:, 0]]
buggy = torch.where(accept, drafted[:, 0], torch.multinomial(p, S, replacement=True, generator=gen))
freq = lambda t: torch.bincount(t, minlength=V).double() / S
print(f"α = Σ min(p, q) = {formulas.acceptance_rate(p, q):.2f}; accepted in the run: "
      f"{sum(len(r) == 2 for r in rows) / S:.2f}")
print(f"largest |frequency − p|: rejection_sample {(freq(emitted) - p).abs().max():.4f}, "
      f"buggy sampler {(freq(buggy) - p).abs().max():.4f} (5 standard deviations ≈ {5 * (0.25 / S) ** 0.5:.4f})")
x = np.arange(V)
fig, ax = plt.subplots(figsize=(8, 3))
ax.bar(x - 0.3, p, 0.2, label="target p", color="k")
ax.bar(x - 0.1, q, 0.2, label="draft q", color="tab:gray")
ax.bar(x + 0.1, freq(emitted), 0.2, label="rejection_sample", color="tab:green")
ax.bar(x + 0.3, freq(buggy), 0.2, label="buggy: p after a rejection", color="tab:red")
ax.set(xlabel="token", ylabel="frequency", title=f"{S:,} verification steps: the emitted token follows p, not q")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# The buggy sampler over-produces the tokens q favours: its accept branch already gives them their share,
# and drawing from p again at a rejection adds more. The residual is what removes that double count. (The
# test suite checks the same thing at 200,000 samples per position; lab 06 has you write the sampler.)
#
# ## 7. Batch 1 against batch 16: why the gain shrinks in a busy server
#
# Everything above ran one sequence through the plain loop. The serving engine speculates too:
# `LLM(speculative={"method": "ngram", "k": 4})` packs each decoding request's last token and its drafts into
# the same forward pass as the other requests' prefills and decodes, and rolls the rejected positions back.
#
# The formula assumes that verifying k + 1 tokens costs about as much as producing one. That holds while a
# step is memory-bound: the weight read dominates, and extra rows ride along. At batch B a verify step pushes
# up to B·(k + 1) rows through the same weights. Once that passes the roofline's ridge point (chapter 02) the
# step becomes compute-bound, and its cost grows with the rows: the formula's denominator grows with it.
# Batching and speculation spend the same slack; a server that already batches 16 requests has less left.
#
# First the cost side alone: the weight products timed on this machine for B and B·(k + 1) rows (k = 4).

# %%
costs = {}
for b in (1, 16):
    plain_step = b / matmul_floor_tok_s(model, b, plain=True)
    verify_step = 5 * b / matmul_floor_tok_s(model, 5 * b, plain=True)
    costs[b] = verify_step / plain_step
alpha_edit = results["input-grounded"]["stats"].alpha
for b, c in costs.items():
    print(f"batch {b:2d}: a verify step of {5 * b} rows costs {c:.2f}x a plain step of {b}; "
          f"with α = {alpha_edit:.2f}, k = 4 the formula predicts "
          f"{formulas.speculative_speedup(4, alpha_edit, 0.0, max(c - 1, 0.0)):.2f}x")

# %% [markdown]
# Now the serving engine itself, with and without n-gram speculation, on the same requests at batch 1 (two
# requests one after the other) and batch 16. The workloads are the bench's (`python -m mini_engine bench
# --workload speculative`): "repeat / proofread this text" requests, and open chat questions. By default
# the engine adapts the draft length: a request drafts one token more than it had accepted in its last round
# (at most k), so requests whose drafts keep failing draft one at a time.

# %%
from mini_engine.bench import speculative as spec_bench

NGRAM = {"method": "ngram", "k": 4}
engine_runs = {}
for workload in ("grounded", "chat"):
    for batch in (1, 16):
        requests = spec_bench.prompts_for(tok, workload, 2 if batch == 1 else 16)
        for spec in (None, NGRAM):
            spec_bench.run_spec(model, tok, requests, batch, spec, 4)  # warm-up
        engine_runs[workload, batch] = [spec_bench.run_spec(model, tok, requests, batch, spec, 32, workload)
                                        for spec in (None, NGRAM)]
print(f"{'workload':9} {'batch':>5} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} {'α':>5} "
      f"{'tok/round':>9} {'same':>5}")
for (workload, batch), (plain, spec) in engine_runs.items():
    print(f"{workload:9} {batch:5d} {plain.tok_s:11.1f} {spec.tok_s:10.1f} {spec.tok_s / plain.tok_s:6.2f}x "
          f"{spec.alpha:5.2f} {spec.tokens_per_round:9.2f} {str(spec.outputs == plain.outputs):>5}")

fig, ax = plt.subplots(figsize=(6, 3))
labels = [f"{w}\nbatch {b}" for w, b in engine_runs]
ax.bar(labels, [s.tok_s / p.tok_s for p, s in engine_runs.values()], color=["tab:green", "tab:olive", "tab:blue",
                                                                            "tab:gray"])
ax.axhline(1.0, color="black", lw=0.8)
ax.set_ylabel("speculative / plain tok/s")
ax.set_title("n-gram speculation in the serving engine")
plt.tight_layout()
plt.show()

# %% [markdown]
# Read the table row by row. At batch 1 the grounded requests gain roughly what the plain loop gained: the
# step is memory-bound and the drafted rows ride along. At batch 16 the same α buys less, because a step of
# 16 requests with drafts carries up to 80 rows and is no longer free to widen. Open chat finds few drafts:
# at batch 1 they cost next to nothing, at batch 16 each failed draft is a row every layer pays for, and
# speculation can turn into a slowdown even with the adaptive draft length (the bench's `fixed k` column
# shows the same without it). The products above are only part of a step (attention, norms and Python
# bookkeeping add a cost per row), so they bound the gain from above. On a GPU the ridge sits much further
# out (about 150 rows for an A100 in bf16) and batch 16 still has slack for k = 4; at batch 64 or 128 it
# does not. That is why serving engines turn speculation down or off as load rises.
#
# ## 8. On a GPU: SmolLM2-360M as the target, the embedded 135M as the draft (optional)
#
# On Colab with a GPU and network access this cell downloads SmolLM2-360M-Instruct (same tokenizer, same
# vocabulary) and runs it with the 135M model as the draft. It is skipped everywhere else, including CI.

# %%
def network_ok(host="huggingface.co"):
    import socket
    try:
        socket.create_connection((host, 443), timeout=3).close()
        return True
    except OSError:
        return False


if not (torch.cuda.is_available() and network_ok()):
    print("skipped: needs a CUDA GPU and network access (run it on Colab with a GPU runtime)")
else:
    from huggingface_hub import snapshot_download

    folder = snapshot_download("HuggingFaceTB/SmolLM2-360M-Instruct",
                               allow_patterns=["*.json", "*.safetensors", "*.txt"])
    target, target_tok = me.load_model(folder, device="cuda", dtype=me.default_dtype("cuda"))
    small, _ = me.load_model("smollm2-135m", device="cuda", dtype=me.default_dtype("cuda"))
    for name, msgs in WORKLOADS.items():
        gp = target_tok.encode(target_tok.apply_chat_template(msgs))
        me.generate_cached(target, gp, 8, GREEDY)  # warm-up (kernels compile on first use)
        t0 = time.perf_counter(); ref = me.generate_cached(target, gp, 128, GREEDY); torch.cuda.synchronize()
        plain_gpu = time.perf_counter() - t0
        for label, prop in (("135M draft", DraftModelProposer(small, target.config.vocab_size, max_len=2048)),
                            ("n-gram", NgramProposer(1, 4))):
            t0 = time.perf_counter()
            out, st_gpu = me.generate_speculative(target, gp, prop, k=4, max_new_tokens=128, params=GREEDY)
            torch.cuda.synchronize()
            print(f"{name:<15} {label:<11} α = {st_gpu.alpha:.2f}, {st_gpu.tokens_per_step:.2f} tok/pass, "
                  f"{plain_gpu / (time.perf_counter() - t0):.2f}x vs plain, identical: {out == ref}")

# %% [markdown]
# ## What you measured

# %%
edit, chat = results["input-grounded"], results["open chat"]
summary = [
    ("formula: α = 0.8, k = 4", f"{formulas.expected_tokens_per_step(4, 0.8):.2f} tokens per target pass"),
    ("textbook's table: k = 5, α = 0.7 (draft 50x cheaper)", f"{formulas.speculative_speedup(5, 0.7, 0.02, 0.05):.2f}x"),
]
for name, r in (("input-grounded", edit), ("open chat", chat)):
    st, (tokens_f, speed_f, _, _) = r["stats"], r["prediction"]
    summary += [
        (f"{name}, n-gram k = 4: α, tokens per pass (formula)",
         f"{st.alpha:.2f}, {st.tokens_per_step:.2f} ({tokens_f:.2f})"),
        (f"{name}: decode tok/s plain -> speculative, speedup (formula)",
         f"{1 / r['plain_s']:.1f} -> {1 / r['spec_s']:.1f}, {r['plain_s'] / r['spec_s']:.2f}x ({speed_f:.2f}x)"),
        (f"{name}: greedy output identical", f"{r['spec'] == r['plain']}"),
    ]
summary += [
    (f"{half} draft for the fp32 target: α, tokens per pass", f"{half_stats.alpha:.2f}, {half_stats.tokens_per_step:.2f}"),
    (f"{half} draft: cost per draft token, speedup (formula)",
     f"{predict(half_stats, plain_s)[3]:.2f} target steps, {plain_s / half_s:.2f}x ({predict(half_stats, plain_s)[1]:.2f}x)"),
    ("rejection sampler, 100k draws: largest |freq − p|", f"{(freq(emitted) - p).abs().max():.4f}"),
    ("verify (5 rows) / plain step, products only: batch 1, batch 16", f"{costs[1]:.2f}x, {costs[16]:.2f}x"),
    *((f"engine, {w}, batch {b}: tok/s plain -> speculative, speedup, same tokens",
       f"{p.tok_s:.1f} -> {sp.tok_s:.1f}, {sp.tok_s / p.tok_s:.2f}x, {sp.outputs == p.outputs}")
      for (w, b), (p, sp) in engine_runs.items()),
]
width = max(len(k) for k, _ in summary)
for k, v in summary:
    print(f"{k:<{width}}  {v}")

# %% [markdown]
# ## Exercises: predict, then run
#
# Write your prediction down before you run each cell; the answer under it says what you should see and why.
#
# **1. More drafts, fewer drafts.** On the input-grounded workload, n-gram speculation ran with k = 4. What
# happens to tokens per target pass and to the speedup with k = 1 and with k = 8?

# %%
for k in (1, 4, 8):
    out, st_k, s_k = run_spec(prompts["input-grounded"], NgramProposer(1, 4), k=k)
    print(f"k = {k}: α = {st_k.alpha:.2f}, {st_k.tokens_per_step:.2f} tokens per pass, "
          f"{results['input-grounded']['plain_s'] / s_k:.2f}x vs plain, identical: {out == edit['plain']}")

# %% [markdown]
# <details><summary>Answer</summary>
#
# k = 1 caps a round at 2 tokens, so tokens per pass fall below 2 and the speedup shrinks. k = 8 lets a long
# copied run go through in one pass: tokens per pass rise, though by less than the ratio of k, because the
# copied runs are interrupted (where the output departs from the source, at its opening and its end or where
# the small model slips a word, the lookup's drafts go wrong) and a pass can only accept drafts up to the
# first miss. Its verify passes are also wider (9 rows).
# Lookup costs nothing, so with a high α the best k is larger than for a draft model; the formula's
# `draft_cost` is practically 0 here, and only the verify pass's growth with k limits it.
# </details>
#
# **2. The n-gram sizes.** On open chat, the proposer matched 1 to 4 tokens. Require a match of at least 3
# tokens (`ngram_min=3`). Predict: more or fewer drafts? Higher or lower α?

# %%
for lo in (1, 3):
    out, st_n, s_n = run_spec(prompts["open chat"], NgramProposer(ngram_min=lo, ngram_max=4))
    print(f"ngram_min = {lo}: {st_n.num_draft_tokens} drafts in {st_n.target_steps} passes, α = {st_n.alpha:.2f}, "
          f"{st_n.tokens_per_step:.2f} tokens per pass, identical: {out == chat['plain']}")

# %% [markdown]
# <details><summary>Answer</summary>
#
# Fewer drafts, and those it makes are more often right. A single-token match (a frequent word, a space, a
# newline) fires everywhere and is usually followed by something else this time; a three-token match is rare
# but specific. In free text neither finds much, so tokens per pass stay near 1: this is the case where
# speculation must at least not cost anything, and proposing nothing costs nothing.
# </details>
#
# **3. Sampling instead of greedy.** Run the input-grounded workload with temperature 0.7 (seeded). Will α
# go up, stay, or go down compared with greedy?

# %%
sampled = me.SamplingParams(temperature=0.7, seed=0, ignore_eos=True)
out, st_t, _ = run_spec(prompts["input-grounded"], NgramProposer(1, 4), params=sampled)
print(f"temperature 0.7: α = {st_t.alpha:.2f} (greedy: {edit['stats'].alpha:.2f}), "
      f"{st_t.tokens_per_step:.2f} tokens per pass")
print(repr(tok.decode(out)))

# %% [markdown]
# <details><summary>Answer</summary>
#
# Down. The n-gram proposer is deterministic (q is one-hot at its guess), so a draft x is accepted with
# probability p(x). Under greedy decoding p is one-hot at the argmax and a right guess always passes; under
# sampling even the most likely token has p(x) < 1, so right guesses are sometimes rejected, and the
# sampled text wanders from the source, which makes the next guesses worse. The output is still exactly
# as random as sampling the target directly; only the speed changes.
# </details>
#
# **4. The target as its own draft.** Use the chapter's model itself as the draft. Predict α, tokens per pass and
# the speedup.

# %%
out, st_s, s_s = run_spec(prompts["open chat"], DraftModelProposer(model, max_len=1024), n=24)
plain_24, s_24 = run_plain(prompts["open chat"], 24)
print(f"self-draft: α = {st_s.alpha:.2f}, {st_s.tokens_per_step:.2f} tokens per pass, "
      f"{s_24 / s_s:.2f}x vs plain, identical: {out == plain_24}")

# %% [markdown]
# <details><summary>Answer</summary>
#
# α = 1 (up to rounding ties) and 5 tokens per pass, the maximum for k = 4, yet no gain: each round runs
# four draft passes that cost a full target pass each, plus the verify pass. The formula with
# draft_cost = 1: 5 / (1 + 4) = 1 at best, and the verify pass's extra cost makes it a loss. A perfect draft
# is worthless if it is as expensive as the target; α and draft cost must be judged together.
# </details>
#
# **Lab.** [Lab 06](../labs/lab06_notebook.ipynb) has you write the n-gram proposer, the residual
# distribution and the batched rejection sampler, graded by a statistical test like section 6's.
