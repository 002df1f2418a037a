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
# # Lab 04 · A continuous-batching scheduler
#
# Open `labs/lab04_continuous_batching.py` and fill in the five functions marked `TODO`: `is_finished`, and
# `admit`, `evict`, `step` and `run` of `ContinuousBatcher`. This notebook runs your scheduler on the real
# model, draws which request held which slot at every step, serves chapter 04's workload with the engine,
# `LLM`, using your admission rule, and then runs the grader, the same tests CI runs against the reference
# solution:
#
#     pytest tests/labs/test_lab04.py --impl=labs
#
# Re-run the notebook after each edit (the first cell reloads your module).

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
import labs.lab04_continuous_batching as lab

importlib.reload(lab)  # pick up your latest edits

import matplotlib.pyplot as plt
import numpy as np

import mini_engine as me
from mini_engine.kv_cache import ContiguousKVCache

model, tok = me.load_model("smollm2-135m")

# %% [markdown]
# ## 1. Serve six questions through three slots
# Each request has its own length limit, and one arrives late. `make_model_step` (given) runs one packed
# forward pass over the batch your scheduler hands it; every request keeps its keys and values in its slot.

# %%
questions = ["What is the capital of France?", "Name a primary color.", "What is 3 times 4?",
             "Say hello in Spanish.", "What is the largest planet?", "Name a fruit that is yellow."]
limits, arrivals = [12, 4, 8, 6, 10, 5], [0, 0, 0, 0, 3, 9]
requests = [lab.Request(i, tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])), n, arrival_step=a,
                        stop_token_id=tok.eos_token_id)
            for i, (q, n, a) in enumerate(zip(questions, limits, arrivals))]
cache = ContiguousKVCache(model.config, num_slots=3, max_len=128)
batcher = lab.ContinuousBatcher(lab.make_model_step(model, cache), num_slots=3)
for r in requests:
    batcher.add_request(r)
try:
    batcher.run()
    done = True
except NotImplementedError as err:
    print(f"not implemented yet: {err}")
    done = False

if done:
    for q, r in zip(questions, requests):
        print(f"{q!r} -> {tok.decode(r.output)!r}  (admitted at step {r.admitted_step}, finished at step {r.finished_step})")

# %% [markdown]
# ## 2. Who held which slot
# Every column is one step; a slot that frees up should be taken by a waiting request at the very next step.

# %%
if done:
    grid = np.array([[-1 if rid is None else rid for rid in row] for row in batcher.timeline]).T
    fig, ax = plt.subplots(figsize=(8, 2.2))
    ax.imshow(np.ma.masked_less(grid, 0), aspect="auto", cmap="tab10", vmin=0, vmax=9, interpolation="nearest")
    for (slot, step), rid in np.ndenumerate(grid):
        if rid >= 0:
            ax.text(step, slot, rid, ha="center", va="center", fontsize=7)
    ax.set(xlabel="step", ylabel="slot", yticks=range(3), title="request id in each slot")
    plt.tight_layout()
    plt.show()
    same = all(r.output == me.generate_cached(model, r.prompt, r.max_tokens, eos_token_id=tok.eos_token_id)
               for r in requests)
    print("every answer equals generating it alone:", same)

# %% [markdown]
# ## 3. Your admission rule inside the serving engine
# The engine of chapter 04, `mini_engine.LLM`, keeps its own requests, slots and KV cache, and at every step asks
# its scheduling policy which waiting requests to start. `EnginePolicy` (given) hands that question to your
# `ContinuousBatcher.admit`. Below, the chapter's mixed workload runs twice on the real model: once under the
# engine's own continuous batching, once under yours. The two must start the same requests at the same steps,
# and so give every request the same tokens.

# %%
from mini_engine import LLM

rng = np.random.default_rng(0)  # the workload of chapter 04, section 3 (its CPU size)
prompt_lens, output_lens = rng.integers(8, 49, size=16), rng.integers(4, 41, size=16)
prompts = [rng.integers(1000, 20000, size=n).tolist() for n in prompt_lens]
work_params = [me.SamplingParams(max_tokens=int(n), ignore_eos=True) for n in output_lens]


def serve(policy):
    """The workload through LLM under one policy: each request's tokens, and what every step ran."""
    llm = LLM.from_model(model, tok, kv_cache="contiguous", scheduling=policy, max_num_seqs=4,
                         max_model_len=int((prompt_lens + output_lens).max()), chunked_prefill_tokens=512,
                         record_trace=True)
    outs = llm.generate(prompts, work_params, use_tqdm=False)
    return [o.token_ids for o in outs], [[(rid, n) for rid, _, n, _ in step.chunks] for step in llm.engine.trace]


try:
    your_tokens, your_steps = serve(lab.EnginePolicy())
except NotImplementedError as err:
    print(f"not implemented yet: {err}")
else:
    engine_tokens, engine_steps = serve("continuous")
    print(f"{len(prompts)} requests, {sum(map(len, your_tokens))} tokens in {len(your_steps)} engine steps")
    print("same tokens as the engine's own continuous batching:", your_tokens == engine_tokens)
    print("same requests started at the same steps:            ", your_steps == engine_steps)

# %% [markdown]
# ## 4. Grade
# The grader prints one line per test; a failing test says what to fix.

# %%
import pytest

code = pytest.main([str(ROOT / "tests/labs/test_lab04.py"), "--impl=labs", "-q", "--no-header",
                    "-p", "no:cacheprovider", "--rootdir", str(ROOT)])
print("all tests pass: well done!" if code == 0 else "some tests still fail: read the messages above")
