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
# # Lab 06 · Speculative decoding: the proposer, the rejection sampler and the loop
#
# Open `labs/lab06_speculative.py` and fill in the four functions marked `TODO`:
#
# * `ngram_propose`: prompt lookup, the cheapest guesser there is;
# * `residual_distribution`: max(0, p − q), normalised, where a rejected position draws from;
# * `rejection_sample`: the batched accept / reject step that makes speculation lossless;
# * `generate_speculative`: the loop around them: draft, verify in one forward pass, accept, roll the cache back.
#
# This notebook tries each piece on small cases, checks your sampler's output against the target
# distribution with 100,000 draws, runs your loop on the real model, then serves requests with the real
# engine drafting with your proposer, and finally runs the grader, the same tests CI runs against the
# reference solution:
#
#     pytest tests/labs/test_lab06.py --impl=labs
#
# Re-run the notebook after each edit (the first cell reloads your module). Chapter 06 explains the ideas.

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
from pathlib import Path

ROOT = Path.cwd().parent if Path.cwd().name == "labs" else Path.cwd()
sys.path.insert(0, str(ROOT))
import labs.lab06_speculative as lab

importlib.reload(lab)  # pick up your latest edits

import matplotlib.pyplot as plt
import numpy as np
import torch

import mini_engine as me
from mini_engine import formulas
from mini_engine.speculative import NgramProposer


def attempt(part, fn):
    """Run one part of the lab; say which TODO is still open instead of stopping the notebook."""
    try:
        return fn()
    except NotImplementedError as err:
        print(f"{part}: not implemented yet: {err}")
        return None


# %% [markdown]
# ## 1. Prompt lookup
# The sequence's last tokens, searched for earlier in the sequence; what followed them there is the guess.
# Longer matches are tried first. Compare your answers with the engine's `NgramProposer` on a few cases.

# %%
cases = [
    ([5, 6, 7, 8, 9, 1, 5, 6, 7], 2),         # [5, 6, 7] seen before, followed by 8, 9
    ([1, 2, 10, 1, 2, 20, 30, 1, 2], 2),      # [1, 2] twice before: the latest one wins
    ([1, 2, 3, 4], 3),                        # nothing repeats: no guess
    ([4, 4, 4, 4], 3),                        # a match may run into the suffix itself
]
for tokens, k in cases:
    mine = attempt("ngram_propose", lambda: lab.ngram_propose(tokens, k, ngram_min=1, ngram_max=3))
    if mine is None:
        break
    engine = NgramProposer(ngram_min=1, ngram_max=3).propose(tokens, k)
    print(f"{tokens} k={k}: yours {mine}, engine {engine} {'ok' if mine == engine else '<- differs'}")

# %% [markdown]
# On real text: a sentence copied twice. Once the copy has started, lookup finds the original and proposes
# the rest of it.

# %%
model, tok = me.load_model("smollm2-135m", device="cpu", dtype="float32")
sentence = "The river flows past the old mill and under the stone bridge."
ids = tok.encode(sentence + " Again: " + " ".join(sentence.split()[:4]))
guess = attempt("ngram_propose on real tokens", lambda: lab.ngram_propose(ids, 6, ngram_min=1, ngram_max=3))
if guess is not None:
    print(repr(tok.decode(ids)), "->", repr(tok.decode(guess)))

# %% [markdown]
# ## 2. The residual
# After a rejection, the target's token must come from what p wants *beyond* what q already offered:
# max(0, p − q), renormalised. A picture for a small vocabulary:

# %%
P = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])  # the target
Q = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])  # a draft that disagrees: α = Σ min(P, Q) = 0.5
res = attempt("residual_distribution", lambda: lab.residual_distribution(P, Q))
if res is not None:
    print("residual:", res.numpy().round(3), " sums to", round(float(res.sum()), 6))
    print("p = q (nothing left): falls back to p:", lab.residual_distribution(P, P).numpy().round(3))
    x = np.arange(6)
    fig, ax = plt.subplots(figsize=(7, 2.6))
    ax.bar(x - 0.25, P, 0.25, label="target p", color="k")
    ax.bar(x, Q, 0.25, label="draft q", color="tab:gray")
    ax.bar(x + 0.25, res, 0.25, label="residual", color="tab:orange")
    ax.set(xlabel="token", ylabel="probability", title="the residual holds only what q under-offers")
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()

# %% [markdown]
# ## 3. The rejection sampler
# First the greedy case: with one-hot target rows, the sampler must keep drafts while each equals the
# target's argmax, then emit the argmax. Four sequences, k = 3, agreeing with the target for 0 to 3 drafts:

# %%
argmax = torch.tensor([[1, 2, 3, 4]] * 4)
target = torch.nn.functional.one_hot(argmax, 6).float()
drafts = torch.tensor([[0, 2, 3], [1, 0, 3], [1, 2, 0], [1, 2, 3]])
out = attempt("rejection_sample (greedy)", lambda: lab.rejection_sample(target, drafts, None, torch.Generator()))
if out is not None:
    print("yours:   ", out)
    print("expected:", [[1], [1, 2], [1, 2, 3], [1, 2, 3, 4]])

# %% [markdown]
# Now the statistical check: 100,000 sequences, k = 2, drafts drawn from Q, a target P at every position.
# The first token each sequence emits must follow P, whatever Q proposed; and the mean number of tokens per
# step must match the formula (1 − α^(k+1)) / (1 − α) with α = Σ min(P, Q).

# %%
N, k = 100_000, 2
gen = torch.Generator().manual_seed(0)
drafts = torch.multinomial(Q, N * k, replacement=True, generator=gen).view(N, k)
rows = attempt("rejection_sample (sampled)", lambda: lab.rejection_sample(
    P.expand(N, k + 1, 6), drafts, Q.expand(N, k, 6), gen))
if rows is not None:
    first = torch.bincount(torch.tensor([r[0] for r in rows]), minlength=6).double() / N
    worst = ((first - P).abs() / (5 * (P * (1 - P) / N).sqrt())).max()
    mean = sum(map(len, rows)) / N
    alpha = formulas.acceptance_rate(P.numpy(), Q.numpy())
    print(f"first token's frequencies {first.numpy().round(3)} vs p {P.numpy()}: worst token at "
          f"{float(worst):.2f}x five standard deviations ({'ok' if worst < 1 else 'too far: check the residual'})")
    print(f"mean tokens per step {mean:.3f}, formula {formulas.expected_tokens_per_step(k, alpha):.3f} (α = {alpha:.2f})")
    fig, ax = plt.subplots(figsize=(7, 2.6))
    ax.bar(np.arange(6) - 0.2, P, 0.4, label="target p", color="k")
    ax.bar(np.arange(6) + 0.2, first, 0.4, label="your sampler's first token", color="tab:green")
    ax.set(xlabel="token", ylabel="frequency", title=f"{N:,} verification steps")
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()

# %% [markdown]
# ## 4. Your loop on the real model
# `Target` (given) holds the model and the KV cache of one sequence: `forward(tokens)` runs tokens after what
# the cache holds, in one pass, and returns the logits at each; `rollback(n)` keeps the first n positions. Your
# `generate_speculative` drafts with your `ngram_propose` while the model repeats a sentence. Greedy, its
# tokens should be the plain greedy decoding's: a verify pass computes the same logits as one-token steps up to
# rounding, which could flip only a near-tie between the two top tokens. Most rounds should accept several
# drafts, so the model runs far fewer passes than there are tokens.

# %%
def my_proposer(token_ids, k):
    return lab.ngram_propose(token_ids, k, ngram_min=1, ngram_max=3)


prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Repeat exactly: " + sentence}]))
greedy = me.SamplingParams(temperature=0.0, ignore_eos=True)
target = lab.Target(model, len(prompt) + 20)
result = attempt("your speculative loop", lambda: lab.generate_speculative(target, prompt, my_proposer, 4, 20))
if result is not None:
    out, rounds = result
    plain = me.generate_cached(model, prompt, 20, greedy)
    accepted, drafted = sum(a for _, a in rounds), sum(d for d, _ in rounds)
    print(repr(tok.decode(out)))
    print(f"identical to plain decoding: {out == plain}; {target.num_passes} forward passes for {len(out)} tokens; "
          f"{accepted} of {drafted} drafts accepted")
    print("rounds (drafts, accepted):", rounds)

# %% [markdown]
# ## 5. Your proposer serves requests
# The serving engine speculates too, and takes any object with a `propose(token_ids, k)` method as its
# proposer: `LLM(speculative={"method": proposer, "k": 4})`. Chapter 06's two workloads, a text to repeat and
# an open question, run twice on the same engine: drafting with the engine's own n-gram lookup, then with
# yours. Both must give the same tokens, and the same drafts and accepted drafts, request by request.

# %%
from mini_engine.engine import LLM

SOURCE = ("The committee met on Tuesday to discuss the new park. Members agreed that the playground needs new "
          "swings, that the benches along the river should be repaired, and that the lights on the main path "
          "must stay on until midnight.")
WORKLOADS = {
    "input-grounded": [{"role": "user", "content": "Repeat the following text word for word:\n\n" + SOURCE}],
    "open chat": [{"role": "user", "content": "Give me three ideas for a rainy weekend with children."}],
}
requests = [tok.encode(tok.apply_chat_template(m)) for m in WORKLOADS.values()]
params = me.SamplingParams(temperature=0.0, max_tokens=48)


class LabProposer:
    """Your ngram_propose, for the engine's proposer hook."""

    def propose(self, token_ids, k):
        return lab.ngram_propose(token_ids, k, ngram_min=1, ngram_max=3)


def serve(method):
    llm = LLM.from_model(model, tok, max_num_seqs=2,
                         speculative={"method": method, "k": 4, **({"ngram_max": 3} if method == "ngram" else {})})
    return llm.generate(requests, params, use_tqdm=False)


yours = attempt("the engine with your proposer", lambda: serve(LabProposer()))
if yours is not None:
    engine_own = serve("ngram")
    print(f"{'workload':<16}{'tokens':>7}{'drafted':>9}{'accepted':>10}  same tokens and drafts as the engine's")
    for name, a, b in zip(WORKLOADS, engine_own, yours):
        same = a.token_ids == b.token_ids and (a.metrics.num_draft_tokens, a.metrics.num_accepted_tokens) == \
            (b.metrics.num_draft_tokens, b.metrics.num_accepted_tokens)
        print(f"{name:<16}{len(b.token_ids):7d}{b.metrics.num_draft_tokens:9d}{b.metrics.num_accepted_tokens:10d}  {same}")
    print("the engine serves your proposer's drafts exactly as its own:",
          all(a.token_ids == b.token_ids for a, b in zip(engine_own, yours)))

# %% [markdown]
# ## 6. Grade
# The grader prints one line per failing test, saying what to fix.

# %%
import pytest

code = pytest.main([str(ROOT / "tests/labs/test_lab06.py"), "--impl=labs", "-q", "--no-header",
                    "-p", "no:cacheprovider", "--rootdir", str(ROOT)])
print("all tests pass: well done!" if code == 0 else "some tests still fail: read the messages above")
