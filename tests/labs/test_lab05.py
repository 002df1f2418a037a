"""Grades lab 05 (online softmax, the FlashAttention inner step) in either tree via the `impl` fixture.

    pytest tests/labs/test_lab05.py --impl=labs        # your work
    pytest tests/labs/test_lab05.py --impl=solutions   # the reference answers
"""
import importlib
import tracemalloc

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import triton

from mini_engine import attention
from mini_engine.course import online_softmax as engine_online_softmax

# Without a GPU the lab's kernels run in Triton's interpreter: tests/conftest.py sets TRITON_INTERPRET
# before this module, or the lab file that `impl` imports, is loaded.
from mini_engine.kernels.flash_attention import attention_reference

LAB = "lab05_flash_attention"
attention_kernels = importlib.import_module("mini_engine.kernels.flash_attention")  # the package re-exports a function by that name
# Chapter 05's own online softmax, the engine's attention and its FlashAttention kernel, and PyTorch's SDPA
# already do this lab's jobs: calling them fails the test (see conftest.py). The tile step is graded through the
# given harness and kernel that run it, so those are watched too, and their messages name the tile step.
ATTENTION = [engine_online_softmax, attention_kernels, attention, F.scaled_dot_product_attention]
SHORTCUTS = {"online_softmax": ATTENTION, "run_tile_step": ATTENTION, "flash_attention": ATTENTION}
GIVEN = {"run_tile_step": "attention_tile_step", "flash_attention": "attention_tile_step"}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# On a GPU, tl.dot of fp32 tiles uses TF32 unless told otherwise, which costs about 1e-3.
TOL = dict(atol=1e-4, rtol=1e-4) if DEVICE == "cpu" else dict(atol=1e-2, rtol=1e-2)


def call(what, fn, *args, **kwargs):
    """Run the student's code; turn a stub's NotImplementedError into a failure that says what to do."""
    try:
        return fn(*args, **kwargs)
    except (NotImplementedError, triton.errors.TritonError) as err:
        # Inside a kernel the stub's error arrives wrapped (interpreter) or as a compile error (GPU).
        hint = not_implemented_hint(err)
        if hint is None:
            raise
    pytest.fail(f"{what} is not implemented yet ({hint})", pytrace=False)


def not_implemented_hint(err):
    while err is not None:
        if isinstance(err, NotImplementedError):
            return str(err)
        if "NotImplementedError" in str(err) and err.__cause__ is None:
            return str(err)
        err = err.__cause__
    return None


def exact_attention(scores, values):
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True) @ values


def tiles(scores, values, sizes):
    """Split the key axis into consecutive tiles of the given sizes, handed out as one-shot generators."""
    bounds = np.cumsum([0, *sizes])
    assert bounds[-1] == scores.shape[-1]
    return ((scores[:, a:b] for a, b in zip(bounds, bounds[1:])),
            (values[a:b] for a, b in zip(bounds, bounds[1:])))


# ---- Part 1 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("sizes", [[24], [8, 8, 8], [5, 1, 11, 7], [1] * 24])
def test_online_softmax_matches_exact_attention(impl, sizes):
    rng = np.random.default_rng(0)
    scores, values = rng.normal(size=(3, 24)), rng.normal(size=(24, 4))
    got = call("online_softmax", impl.online_softmax, *tiles(scores, values, sizes))
    assert got.shape == (3, 4), f"online_softmax should return [queries, head_dim] = (3, 4), got {got.shape}"
    np.testing.assert_allclose(
        got, exact_attention(scores, values), rtol=1e-10, atol=1e-12,
        err_msg=f"with tiles of sizes {sizes} the result differs from softmax(S) @ V: when a tile raises the "
                "max, are l and acc both multiplied by exp(m_old - m_new) before adding the new tile?")


def test_online_softmax_survives_large_scores(impl):
    # exp(800) overflows float64: only subtracting the running max keeps this finite.
    rng = np.random.default_rng(1)
    scores, values = rng.normal(scale=400.0, size=(2, 30)), rng.normal(size=(30, 3))
    with np.errstate(over="ignore", invalid="ignore"):
        got = call("online_softmax", impl.online_softmax, *tiles(scores, values, [10, 10, 10]))
    assert np.isfinite(got).all(), "online_softmax overflowed: exponentiate s - m (the running max), never s"
    np.testing.assert_allclose(got, exact_attention(scores, values), rtol=1e-10, atol=1e-12,
                               err_msg="large scores: rescale the old sums whenever the running max changes")


def test_online_softmax_when_a_late_tile_holds_the_max(impl):
    scores = np.array([[0.0, 1.0, 2.0, 50.0]])
    values = np.arange(8.0).reshape(4, 2)
    got = call("online_softmax", impl.online_softmax, *tiles(scores, values, [2, 2]))
    np.testing.assert_allclose(got, exact_attention(scores, values), rtol=1e-12,
                               err_msg="the max arrives in the second tile: the first tile's contribution "
                                       "must shrink by exp(m_old - m_new), almost to nothing here")


def test_online_softmax_streams_its_tiles(impl):
    """A long sequence, its tiles made one at a time: gathering them all (a list of tiles, a concatenate, one
    exact softmax at the end) needs memory for every score at once; a streaming pass needs one tile."""
    queries, n_tiles, tile, dim = 4, 100, 1000, 8

    def score_tiles():
        rng = np.random.default_rng(5)
        for _ in range(n_tiles):
            yield rng.normal(size=(queries, tile))

    def value_tiles():
        rng = np.random.default_rng(6)
        for _ in range(n_tiles):
            yield rng.normal(size=(tile, dim))

    expected = exact_attention(np.concatenate(list(score_tiles()), axis=1), np.concatenate(list(value_tiles())))
    all_scores = queries * n_tiles * tile * 8  # bytes of every score as float64
    tracemalloc.start()
    try:
        got = call("online_softmax", impl.online_softmax, score_tiles(), value_tiles())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12,
                               err_msg=f"{n_tiles} tiles of {tile} keys: the result differs from softmax(S) @ V")
    assert peak < all_scores / 4, (
        f"online_softmax held {peak / 1e6:.1f} MB at its peak while all {n_tiles} tiles of scores take "
        f"{all_scores / 1e6:.1f} MB: fold each tile into m, l and acc and let it go before reading the next "
        "(no list of tiles, no concatenate, no softmax over the whole row)")


# ---- Part 2 ---------------------------------------------------------------------------------------
def tile_problem(seed, masked=False):
    gen = torch.Generator().manual_seed(seed)
    qk = torch.randn(16, 16, generator=gen) * 3
    if masked:
        qk[:, 10:] = float("-inf")  # keys past the end of the sequence (or the causal diagonal)
    v = torch.randn(16, 16, generator=gen)
    return qk.to(DEVICE), v.to(DEVICE)


def expected_step(acc, l_i, m_i, qk, v):
    m_new = torch.maximum(m_i, qk.max(dim=1).values)
    alpha = torch.exp2(m_i - m_new)
    p = torch.exp2(qk - m_new[:, None])
    return acc * alpha[:, None] + p @ v, l_i * alpha + p.sum(dim=1), m_new


def check_step(impl, acc, l_i, m_i, qk, v, situation):
    got = call("attention_tile_step", impl.run_tile_step, acc, l_i, m_i, qk, v)
    want = expected_step(acc, l_i, m_i, qk, v)
    for name, g, w, fix in zip(("acc", "l_i", "m_i"), got, want, (
            "the old acc rescaled to the new max, plus this tile's softmax weights (exp2, against the new max) "
            "times v",
            "the old l_i rescaled to the new max, plus the row sums of this tile's weights",
            "the larger of the old max and this tile's row max")):
        assert torch.isfinite(g).all(), f"{situation}: {name} has NaN/inf; expected {fix}"
        torch.testing.assert_close(g, w, **TOL, msg=lambda m: f"{situation}: wrong {name}, expected {fix}.\n{m}")


def test_tile_step_on_the_first_tile(impl):
    qk, v = tile_problem(0)
    fresh = (torch.zeros(16, 16, device=DEVICE), torch.zeros(16, device=DEVICE),
             torch.full((16,), -1e30, device=DEVICE))
    check_step(impl, *fresh, qk, v, "first tile (acc = l = 0, m = -1e30)")


def test_tile_step_rescales_an_earlier_state(impl):
    qk, v = tile_problem(1)
    gen = torch.Generator().manual_seed(2)
    # Half the rows had a larger max before this tile, half get a new max from it.
    m_i = torch.where(torch.arange(16) % 2 == 0, torch.full((16,), 12.0), torch.full((16,), -3.0))
    state = (torch.rand(16, 16, generator=gen).to(DEVICE), (1 + torch.rand(16, generator=gen)).to(DEVICE),
             m_i.to(DEVICE))
    check_step(impl, *state, qk, v, "a later tile")


def test_tile_step_with_masked_scores(impl):
    qk, v = tile_problem(3, masked=True)
    state = (torch.ones(16, 16, device=DEVICE), torch.ones(16, device=DEVICE), torch.zeros(16, device=DEVICE))
    check_step(impl, *state, qk, v, "a tile whose last 6 keys are masked with -inf")


@pytest.mark.parametrize("causal", [False, True])
def test_kernel_with_your_step_matches_attention(impl, causal):
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 50, 16, generator=gen).to(DEVICE) for _ in range(3))
    got = call("attention_tile_step (inside attention_kernel)", impl.flash_attention, q, k, v, causal=causal)
    torch.testing.assert_close(
        got, attention_reference(q, k, v, causal), **TOL,
        msg=lambda m: f"the full kernel ({'causal' if causal else 'non-causal'}, 50 tokens in tiles of 16) "
                      f"disagrees with softmax(QK^T / sqrt(d)) V. If a tile-step test fails too, fix that first; "
                      f"otherwise check that your step returns (acc, l_i, m_new) in that order.\n{m}")


# ---- the guards (see conftest.py) -----------------------------------------------------------------
def online_softmax_by_the_course(score_tiles, value_tiles):
    scores, values = np.concatenate(list(score_tiles), axis=1), np.concatenate(list(value_tiles))
    return engine_online_softmax.online_softmax_attention(scores, values, tile=8)


def online_softmax_by_sdpa(score_tiles, value_tiles):
    # softmax(S) V is SDPA with S as the queries, the identity as the keys and a scale of 1.
    scores = torch.from_numpy(np.concatenate(list(score_tiles), axis=1))
    values = torch.from_numpy(np.concatenate(list(value_tiles)))
    keys = torch.eye(scores.shape[1], dtype=scores.dtype)
    return F.scaled_dot_product_attention(scores[None], keys[None], values[None], scale=1.0)[0].numpy()


# A tile step that multiplies with the engine kernel's own helper: Triton source, so the given kernels run it.
TILE_STEP_WITH_THE_ENGINES_KERNEL = """
import importlib

_engine_kernels = importlib.import_module("mini_engine.kernels.flash_attention")


@triton.jit
def attention_tile_step(acc, l_i, m_i, qk, v):
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk - m_new[:, None])
    return acc * alpha[:, None] + _engine_kernels._dot(p, v, "ieee", False), l_i * alpha + tl.sum(p, 1), m_new
"""

# Each part of the lab handed to something that already does it, and a grading test that must fail it.
HAND_OFFS = [
    ("online_softmax", online_softmax_by_the_course, test_online_softmax_matches_exact_attention,
     {"sizes": [8, 8, 8]}),
    ("online_softmax", online_softmax_by_sdpa, test_online_softmax_when_a_late_tile_holds_the_max, {}),
    ("attention_tile_step", TILE_STEP_WITH_THE_ENGINES_KERNEL, test_tile_step_on_the_first_tile, {}),
]
# The given wrapper edited to hand the whole of attention to the engine's kernel or to SDPA.
WRAPPERS = [lambda q, k, v, causal=False, block=16: attention_kernels.flash_attention(q, k, v, causal=causal),
            lambda q, k, v, causal=False, block=16: F.scaled_dot_product_attention(q, k, v, is_causal=causal)]


def test_every_part_of_the_lab_has_a_hand_off_check(asked_for):
    missing = set(asked_for(LAB)) - {part for part, *_ in HAND_OFFS}
    assert not missing, f"parts of the lab with no hand-off check above: {sorted(missing)}"


@pytest.mark.parametrize("part,replacement,test,args", HAND_OFFS,
                         ids=[f"{part}-{i}" for i, (part, *_) in enumerate(HAND_OFFS)])
def test_the_grader_fails_a_part_handed_off(hand_off, part, replacement, test, args):
    hand_off(part, replacement, test, **args)


@pytest.mark.parametrize("wrapper", WRAPPERS, ids=["engine-kernel", "sdpa"])
def test_the_grader_fails_a_given_wrapper_that_hands_attention_off(mutant, wrapper):
    with pytest.raises(pytest.fail.Exception, match=r"^flash_attention\(\) calls .*write attention_tile_step yourself"):
        test_kernel_with_your_step_matches_attention(mutant(flash_attention=wrapper), causal=True)
