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
# # Lab 01 · The naive decode loop and a FLOPs counter
#
# Open `labs/lab01_naive.py` and fill in the five functions marked `TODO`. This notebook tries each one on
# the real model and then runs the grader, the same tests CI runs against the reference solution:
#
#     pytest tests/labs/test_lab01.py --impl=labs
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
import os
from pathlib import Path

ROOT = Path.cwd().parent if Path.cwd().name == "labs" else Path.cwd()
sys.path.insert(0, str(ROOT))
import labs.lab01_naive as lab

importlib.reload(lab)  # pick up your latest edits

import mini_engine as me

model, tok = me.load_model("smollm2-135m")


def attempt(what, fn):
    """Run one of your functions; a TODO that is still open is reported, not raised."""
    try:
        result = fn()
    except NotImplementedError as err:
        print(f"{what}: not implemented yet ({err})")
        return None
    print(f"{what}: {result}")
    return result


# %% [markdown]
# ## 1. The loop
# Your `naive_generate` should answer like the engine's own `generate_naive`.

# %%
prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
mine = attempt("your tokens", lambda: lab.naive_generate(model, prompt, 12, eos_token_id=tok.eos_token_id))
reference = me.generate_naive(model, prompt, 12)
print("reference  :", reference, repr(tok.decode(reference)))
if mine is not None:
    print("yours      :", repr(tok.decode(mine)), "— same as reference" if mine == reference else "— DIFFERENT")

# %% [markdown]
# ## 2. Counting FLOPs
# Compare your counter with the closed form in `mini_engine.course.formulas` (which counts every parameter,
# embedding included, so it is a little higher than the linear layers alone).

# %%
from mini_engine import formulas

for n in (16, 256, 2048):
    theirs = formulas.naive_step_flops(model.config, n)
    attempt(f"forward_flops(n={n}) vs formulas {theirs / 1e9:.2f} GFLOP",
            lambda n=n: f"{lab.forward_flops(model, n) / 1e9:.2f} GFLOP")
attempt("naive_generation_flops(prompt 32, 256 new)",
        lambda: f"{lab.naive_generation_flops(model, 32, 256) / 1e12:.2f} TFLOP")

# %% [markdown]
# ## 3. Grade
# The grader prints one line per test; a failing test says what to fix.

# %%
import pytest

code = pytest.main([str(ROOT / "tests/labs/test_lab01.py"), "--impl=labs", "-q", "--no-header",
                    "-p", "no:cacheprovider", "--rootdir", str(ROOT)])
print("all tests pass: well done!" if code == 0 else "some tests still fail: read the messages above")
