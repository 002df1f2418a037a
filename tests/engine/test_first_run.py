"""A process's first batch pays for the CPU backend's choices only what it must (issue 60): with an empty store it
times each case it meets once, building each candidate form once; with a store filled on a quiet machine it trusts
what was checked within a day and builds nothing; where a kept choice is checked, only the two forms it compares
are built. Counted on the issue's serving workload, scaled down, with the tuner's clock faked (every timed call
takes one tick, no thread waits): the counts, not the times, are what is asserted."""
import dataclasses
import itertools
import random

import pytest
import torch

import mini_engine as me
from mini_engine.backends.cpu import autotune, products
from mini_engine.backends.cpu.autotune import Autotuner

pytestmark = pytest.mark.skipif(not me.backends.cpu.enabled(), reason="the CPU backend is off")

WORDS = "the a model token cache batch prefill decode memory weight layer attention engine request".split()
PRODUCT_FORMS = 4   # at most: linear, transposed or two_row, onednn, c_f32 (an fp32 product)
ATTENTION_FORMS = 6  # at most: the paged copy with all sequences, 8, 4, 2 or 1 at a time, and the C kernel


def serve(store, monkeypatch, trust_s: float = 24 * 3600):
    """A fresh process's tuner (the process's TUNER, reset; `store` its file, checked as a new process would),
    then the scaled-down workload: 8 mixed requests (8-24 prompt words, 4-12 tokens each, greedy), 4 at a time."""
    fresh = Autotuner(store=store, clock=itertools.count().__next__, waited=lambda: 0.0, trust_s=trust_s,
                      spot_share=0.0, repeats=1, check_rounds=1)  # one round: the counts of forms are the same
    for f in dataclasses.fields(Autotuner):
        monkeypatch.setattr(autotune.TUNER, f.name, getattr(fresh, f.name))
    if store.exists():
        autotune.TUNER.kept_loaded = autotune.TUNER.load(store, check=True)
    monkeypatch.setattr(products, "TIMING_BYTES", 1)  # one copy of each weight a timing: the counts are the same
    model, tok = me.load_model("smollm2-135m", device="cpu", dtype="float32")
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24))) for _ in range(8)]
    params = [me.SamplingParams(max_tokens=rng.randint(4, 12), ignore_eos=True) for _ in range(8)]
    with torch.inference_mode():
        outs = me.LLM.from_model(model, tok, max_num_seqs=4).generate(prompts, params, use_tqdm=False)
    return autotune.TUNER, [o.token_ids for o in outs]


def test_first_use_builds_each_form_once_empty_none_when_trusted_and_two_a_check(tmp_path, monkeypatch):
    store = tmp_path / "tuned.json"
    empty, tokens = serve(store, monkeypatch)
    cases = empty.timings_run
    products_timed = sum(op == "product" for op, *_ in empty.choices)
    bound = PRODUCT_FORMS * products_timed + ATTENTION_FORMS * (cases - products_timed)
    assert 0 < cases == len(empty.choices) and empty.checked == 0
    assert empty.built <= bound, (f"an empty store: at most {PRODUCT_FORMS} forms built per product case and "
                                  f"{ATTENTION_FORMS} per attention case, once each ({cases} cases: {bound}); "
                                  f"built {empty.built}")
    assert store.exists() and empty.not_kept == 0

    trusted, again = serve(store, monkeypatch)
    assert again == tokens
    assert (trusted.built, trusted.calls, trusted.checked, trusted.timings_run) == (0, 0, 0, 0), (
        f"a store filled and checked within a day: nothing built or timed at first use, got {trusted.state()}")
    assert trusted.trusted == cases

    checked, again = serve(store, monkeypatch, trust_s=0)  # every kept case checked, as issue 50 had it
    assert again == tokens and checked.timings_run == 0 and checked.replaced == 0
    assert checked.built <= 2 * cases, (f"a check builds the two forms it compares: at most 2 x {cases} cases = "
                                        f"{2 * cases} forms, got {checked.built}")
    assert checked.built == 2 * checked.checked
