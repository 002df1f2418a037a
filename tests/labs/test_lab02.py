"""Grades lab 02 (FLOPs, bytes and arithmetic intensity of a forward pass) in either tree via `impl`.

    pytest tests/labs/test_lab02.py --impl=labs        # your work
    pytest tests/labs/test_lab02.py --impl=solutions   # the reference answers

The ground truth is measured on a real forward pass: PyTorch's FlopCounterMode counts the FLOPs, and
the bytes are the sizes of the tensors the pass touches (weights, the K/V it reads or writes in the
cache, every layer's hidden state in and out).
"""
import importlib
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mini_engine import formulas, quant
from mini_engine.attention import AttentionMetadata
from mini_engine.config import ModelConfig
from mini_engine.generate import decode_step
from mini_engine.kv_cache import ContiguousKVCache
from mini_engine.model import LlamaModel

LAB = "lab02_flops_bytes"
attention_kernels = importlib.import_module("mini_engine.kernels.flash_attention")  # the package re-exports a function by that name
# The course's own formulas already compute all of this, and PyTorch's FLOP counter measures it (the tests'
# ground truth): calling them fails the test (see conftest.py).
SHORTCUTS = dict.fromkeys(["forward_flops", "forward_bytes", "arithmetic_intensity", "decode_intensity",
                           "attainable_flops", "min_batch_for_compute_bound"],
                          [formulas, attention_kernels.attention_flops, quant.weight_bytes, FlopCounterMode])
A100 = dict(peak_flops=312e12, peak_bw=2.039e12)  # dense bf16 FLOP/s and HBM bytes/s of an A100-80GB


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=256)
    # Naive attention materialises Q·Kᵀ and P·V as matmuls, so FlopCounterMode sees them.
    return LlamaModel(cfg, attention_backend="naive").eval()


def measured_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def measured_bytes(model, fn, kv: torch.Tensor) -> int:
    """Bytes of the weights (each tensor once), of `kv` (the K/V slice the pass reads or writes) and of
    every decoder layer's hidden state going in and coming out while `fn` runs."""
    moved = sum(p.nbytes for p in model.parameters()) + kv.nbytes

    def count(_module, args, output):
        nonlocal moved
        moved += args[0].nbytes + output.nbytes

    hooks = [layer.register_forward_hook(count) for layer in model.layers]
    try:
        fn()
    finally:
        for hook in hooks:
            hook.remove()
    return moved


def run_chunk(model, n_tokens: int, past: int, batch: int = 1):
    """One forward pass of `n_tokens` new tokens for each of `batch` sequences that already hold `past`
    tokens in a fresh cache, logits for every new token. Returns (run, the cache slice it touches)."""
    context = past + n_tokens
    cache = ContiguousKVCache(model.config, batch, context + 1)
    meta = AttentionMetadata.build([n_tokens] * batch, [context] * batch, slots=list(range(batch)))
    ids = torch.randint(0, model.config.vocab_size, (n_tokens * batch,))
    return (lambda: model(ids, meta, cache)), cache.data[:, :, :batch, :, :context]


# ---------------------------------------------------------------- FLOPs


@pytest.mark.parametrize("n", [1, 9, 64])
def test_forward_flops_of_a_full_pass(impl, tiny, n):
    expected = measured_flops(lambda: tiny(torch.randint(0, 128, (1, n))))
    got = impl.forward_flops(tiny, n)
    assert got == expected, (
        f"forward_flops(model, {n}) = {got}, but PyTorch counted {expected} FLOPs in a full pass over {n} tokens: "
        "2 FLOPs per multiply-add, in*out per nn.Linear per token, and n*n*head_dim per attention product, "
        "layer and query head (context_len defaults to n_tokens)")


@pytest.mark.parametrize("n,past", [(1, 31), (1, 100), (12, 20)])
def test_forward_flops_against_a_cache(impl, tiny, n, past):
    run, _ = run_chunk(tiny, n, past)
    expected = measured_flops(run)
    got = impl.forward_flops(tiny, n, past + n)
    assert got == expected, (
        f"forward_flops(model, {n}, context_len={past + n}) = {got}; PyTorch counted {expected}. Only the "
        f"{n} new tokens go through the linear layers, but each of them scores all {past + n} keys")


def test_forward_flops_on_the_real_model(impl, real_model):
    model, _ = real_model
    expected = measured_flops(lambda: model(torch.randint(0, 49152, (1, 6)), backend="naive"))
    got = impl.forward_flops(model, 6)
    assert got == expected, f"SmolLM2, 6 tokens: you count {got} FLOPs, PyTorch counted {expected}"


# ---------------------------------------------------------------- bytes


@pytest.mark.parametrize("n,past", [(1, 0), (1, 40), (16, 0), (5, 11)])
def test_forward_bytes_match_the_tensors_a_pass_touches(impl, tiny, n, past):
    run, kv = run_chunk(tiny, n, past)
    expected = measured_bytes(tiny, run, kv)
    got = impl.forward_bytes(tiny, n, past + n, dtype_bytes=4)
    weights = sum(p.nbytes for p in tiny.parameters())
    assert got == expected, (
        f"forward_bytes(model, {n}, context_len={past + n}) = {got}, but the pass touches {expected} bytes: "
        f"{weights} of weights (count a tied or shared tensor once), {kv.nbytes} of K/V for {past + n} positions, "
        f"{expected - weights - kv.nbytes} of hidden states (in and out of each of {tiny.config.num_layers} layers)")


def test_forward_bytes_scale_with_the_dtype(impl, tiny):
    half = LlamaModel(tiny.config, attention_backend="naive").to(torch.bfloat16).eval()
    cache = ContiguousKVCache(half.config, 1, 25, dtype=torch.bfloat16)
    meta = AttentionMetadata.build([24], slots=[0])
    expected = measured_bytes(half, lambda: half(torch.randint(0, 128, (24,)), meta, cache),
                              cache.data[:, :, :1, :, :24])
    got = impl.forward_bytes(half, 24, dtype_bytes=2)
    assert got == expected, f"in bf16 (dtype_bytes=2) the pass touches {expected} bytes, you count {got}"


# ---------------------------------------------------------------- intensity and the roofline


@pytest.mark.parametrize("n,past", [(1, 0), (1, 200), (32, 0)])
def test_arithmetic_intensity_is_measured_flops_per_measured_byte(impl, tiny, n, past):
    run, kv = run_chunk(tiny, n, past)
    expected = measured_flops(run) / measured_bytes(tiny, run, kv)
    got = impl.arithmetic_intensity(tiny, n, past + n)
    assert got == pytest.approx(expected, rel=1e-12), (
        f"arithmetic_intensity(model, {n}, {past + n}) = {got}, measured {expected:.4f} FLOPs per byte")


@pytest.mark.parametrize("batch", [1, 2, 8])
def test_decode_intensity_of_a_batched_step(impl, tiny, batch):
    context = 24
    cache = ContiguousKVCache(tiny.config, batch, context)
    tokens, slots = [3] * batch, list(range(batch))
    run = lambda: decode_step(tiny, cache, tokens, [context] * batch, slots)
    expected = measured_flops(run) / measured_bytes(tiny, run, cache.data[:, :, :batch, :, :context])
    got = impl.decode_intensity(tiny, batch, context)
    assert got == pytest.approx(expected, rel=1e-12), (
        f"decode_intensity(model, batch={batch}, context_len={context}) = {got}, measured {expected:.4f}: the "
        "weights are read once for the whole batch; FLOPs, K/V and hidden states come once per sequence")


def test_decode_is_memory_bound_and_long_prefill_compute_bound_on_the_real_model(impl, real_model):
    model, _ = real_model
    cfg = model.config
    ridge = A100["peak_flops"] / A100["peak_bw"]
    decode = impl.decode_intensity(model, 1, 1024, dtype_bytes=2)
    prefill = impl.arithmetic_intensity(model, 2048, dtype_bytes=2)
    assert decode == pytest.approx(formulas.decode_intensity(cfg, 1, 1024, 2), rel=0.02), (
        "your decode intensity should agree with the course formula within 2% on SmolLM2")
    assert prefill == pytest.approx(formulas.prefill_intensity(cfg, 2048, 2), rel=0.02), (
        "your prefill intensity should agree with the course formula within 2% on SmolLM2")
    assert decode < 2 < ridge < prefill, (f"fp16 decode should be about 1 FLOP/byte and a 2048-token prefill far above "
                                          f"the A100 ridge ({ridge:.0f}); got {decode:.2f} and {prefill:.0f}")


@pytest.mark.parametrize("intensity", [0.5, 10, 153.0, 1e4])
def test_attainable_flops_is_the_roofline(impl, intensity):
    got = impl.attainable_flops(intensity, **A100)
    expected = formulas.attainable_flops(intensity, **A100)
    assert got == pytest.approx(expected), (
        f"at {intensity} FLOP/byte an A100 reaches {expected:.3g} FLOP/s (min of peak and intensity·bandwidth), "
        f"not {got:.3g}")


def test_min_batch_for_compute_bound(impl, tiny):
    context, peak_bw = 32, 1e9
    peak_flops = 4 * peak_bw  # ridge at 4 FLOPs/byte: the tiny model's decode gets there at a batch near 11
    got = impl.min_batch_for_compute_bound(tiny, context, peak_flops, peak_bw)

    def measured(batch):
        cache = ContiguousKVCache(tiny.config, batch, context)
        run = lambda: decode_step(tiny, cache, [1] * batch, [context] * batch, list(range(batch)))
        return measured_flops(run) / measured_bytes(tiny, run, cache.data[:, :, :batch, :, :context])

    expected = next(b for b in range(1, 64) if measured(b) >= 4)
    assert got == expected, (f"a measured decode step first reaches 4 FLOPs/byte at batch {expected} "
                             f"(batch {expected - 1}: {measured(expected - 1):.3f}); you returned {got}")


def test_min_batch_is_none_only_when_no_allowed_batch_gets_there(impl, tiny):
    reachable = impl.min_batch_for_compute_bound(tiny, 32, 4e9, 1e9, max_batch=512)
    assert reachable is not None, ("with a 32-token context a large enough batch does reach 4 FLOPs/byte: "
                                   "return the smallest such batch, not None")
    capped = impl.min_batch_for_compute_bound(tiny, 32, 4e9, 1e9, max_batch=reachable - 1)
    assert capped is None, (f"batch {reachable} is the first to reach the ridge, so with max_batch={reachable - 1} "
                            f"no allowed batch does: return None (you returned {capped})")


def test_min_batch_is_none_when_kv_reads_keep_decode_memory_bound(impl, tiny):
    # Each sequence does about 2 FLOPs per byte of its own K/V at this context: no batch reaches 20.
    assert impl.min_batch_for_compute_bound(tiny, 32, 4e9, 1e9, max_batch=512) is not None, (
        "with a 32-token context a large enough batch does reach 4 FLOPs/byte: return that batch, not None")
    got = impl.min_batch_for_compute_bound(tiny, 4000, 20e9, 1e9, max_batch=512)
    assert got is None, ("with a 4000-token context the per-sequence K/V reads grow as fast as the FLOPs: "
                         f"no batch reaches 20 FLOPs/byte, so return None (you returned {got})")


# ---------------------------------------------------------------- the guards (see conftest.py)


def counted_by_pytorch(model, n_tokens, context_len=None):
    with FlopCounterMode(display=False) as counter:
        model(torch.zeros(1, n_tokens, dtype=torch.long))
    return counter.get_total_flops()


def bytes_with_the_engines_weight_count(model, n_tokens, context_len=None, dtype_bytes=4):
    cfg, context_len = model.config, n_tokens if context_len is None else context_len
    weights = quant.weight_bytes(model) // next(model.parameters()).element_size() * dtype_bytes
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * context_len * dtype_bytes
    return weights + kv + 2 * cfg.num_layers * cfg.hidden_size * n_tokens * dtype_bytes


def ridge_batch_of_the_formulas(model, context_len, peak_flops, peak_bw, dtype_bytes=4, max_batch=4096):
    batch = formulas.decode_ridge_batch(model.config, context_len, dtype_bytes, peak_flops, peak_bw)
    return math.ceil(batch) if batch <= max_batch else None


solution = importlib.import_module(f"solutions.{LAB}")  # what a hand-off may build on besides the engine
# Each part of the lab handed to something that already does it, and a grading test that must fail it.
HAND_OFFS = [
    ("forward_flops", counted_by_pytorch, test_forward_flops_of_a_full_pass, {"n": 9}),
    ("forward_flops", lambda model, n_tokens, context_len=None: int(formulas.prefill_flops(
        model.config, n_tokens, (context_len or n_tokens) - n_tokens)), test_forward_flops_against_a_cache,
     {"n": 12, "past": 20}),
    ("forward_bytes", bytes_with_the_engines_weight_count, test_forward_bytes_match_the_tensors_a_pass_touches,
     {"n": 5, "past": 11}),
    ("forward_bytes", lambda model, n_tokens, context_len=None, dtype_bytes=4: int(formulas.prefill_bytes(
        model.config, n_tokens, dtype_bytes, past=(context_len or n_tokens) - n_tokens)),
     test_forward_bytes_scale_with_the_dtype, {}),
    ("arithmetic_intensity", lambda model, n_tokens, context_len=None, dtype_bytes=4: formulas.arithmetic_intensity(
        solution.forward_flops(model, n_tokens, context_len),
        solution.forward_bytes(model, n_tokens, context_len, dtype_bytes)),
     test_arithmetic_intensity_is_measured_flops_per_measured_byte, {"n": 1, "past": 200}),
    ("decode_intensity", lambda model, batch, context_len, dtype_bytes=4: float(formulas.decode_intensity(
        model.config, batch, context_len, dtype_bytes)), test_decode_intensity_of_a_batched_step, {"batch": 2}),
    ("attainable_flops", formulas.attainable_flops, test_attainable_flops_is_the_roofline, {"intensity": 10}),
    ("min_batch_for_compute_bound", ridge_batch_of_the_formulas, test_min_batch_for_compute_bound, {}),
]


def test_every_part_of_the_lab_has_a_hand_off_check(asked_for):
    missing = set(asked_for(LAB)) - {part for part, *_ in HAND_OFFS}
    assert not missing, f"parts of the lab with no hand-off check above: {sorted(missing)}"


@pytest.mark.parametrize("part,replacement,test,args", HAND_OFFS,
                         ids=[f"{part}-{i}" for i, (part, *_) in enumerate(HAND_OFFS)])
def test_the_grader_fails_a_part_handed_off(hand_off, part, replacement, test, args):
    hand_off(part, replacement, test, **args)
