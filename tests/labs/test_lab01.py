"""Grades lab 01 (the naive decode loop and a FLOPs counter) in either tree via the `impl` fixture.

    pytest tests/labs/test_lab01.py --impl=labs        # your work
    pytest tests/labs/test_lab01.py --impl=solutions   # the reference answers
"""
import importlib

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import mini_engine as me
from mini_engine import compiled_decode, engine, formulas, generate, runner
from mini_engine.config import ModelConfig
from mini_engine.model import LlamaModel

LAB = "lab01_naive"
attention_kernels = importlib.import_module("mini_engine.kernels.flash_attention")  # the package re-exports a function by that name
# What already does this lab's jobs: calling it fails the test (see conftest.py). The FLOPs are to be counted
# from the model's shapes, not measured by PyTorch's counter (the ground truth the tests compare with).
SHORTCUTS = {
    "naive_generate": [generate, engine, runner, compiled_decode],
    **dict.fromkeys(["linear_flops", "attention_flops", "forward_flops", "naive_generation_flops"],
                    [formulas, attention_kernels.attention_flops, FlopCounterMode]),
}


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=256)
    model = LlamaModel(cfg, attention_backend="naive")  # naive attention: PyTorch can count its FLOPs
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)  # sharp logits, so greedy choices are never near-ties
    return model.eval()


def measured_flops(fn) -> int:
    """FLOPs PyTorch itself counts while `fn` runs: the ground truth for your formulas."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_naive_generate_matches_reference_loop(impl, tiny):
    for prompt in ([1, 2, 3], [7] * 20):
        expected = me.generate_naive(tiny, prompt, max_new_tokens=10)
        got = impl.naive_generate(tiny, prompt, 10)
        assert got == expected, ("naive_generate should return only the NEW tokens, chosen greedily "
                                 f"(argmax of the last position): expected {expected}, got {got}")


def test_naive_generate_stops_after_eos(impl, tiny):
    free = me.generate_naive(tiny, [1, 2, 3], max_new_tokens=10)
    eos = free[3]
    got = impl.naive_generate(tiny, [1, 2, 3], 10, eos_token_id=eos)
    expected = free[:free.index(eos) + 1]
    assert got == expected, f"stop right after emitting eos_token_id={eos} and include it: expected {expected}, got {got}"


def test_naive_generate_recomputes_everything(impl, tiny):
    prompt, steps = [5, 6, 7, 8], 6
    flops = measured_flops(lambda: impl.naive_generate(tiny, prompt, steps))
    expected = sum(measured_flops(lambda n=n: tiny(torch.randint(0, 128, (1, n)))) for n in range(4, 4 + steps))
    assert flops == expected, ("each step must run one forward pass over the whole sequence so far "
                               f"(and nothing more): PyTorch counted {flops} FLOPs, expected {expected}")


def test_naive_generate_on_the_real_model(impl, real_model):
    model, tok = real_model
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    got = impl.naive_generate(model, prompt, 12, eos_token_id=tok.eos_token_id)
    assert "Paris" in tok.decode(got), f"SmolLM2 should answer Paris; your loop produced {tok.decode(got)!r}"


@pytest.mark.parametrize("n", [1, 7, 64])
def test_linear_flops_match_pytorch_count(impl, tiny, n):
    expected = measured_flops(lambda: tiny(torch.randint(0, 128, (1, n)), backend="torch"))  # matmuls only
    got = impl.linear_flops(tiny, n)
    assert got == expected, (f"linear_flops(model, {n}) = {got}, but PyTorch counts {expected} FLOPs in the "
                             "linear layers: 2 FLOPs per multiply-add, in*out multiply-adds per token per Linear")


@pytest.mark.parametrize("n", [1, 7, 64])
def test_forward_flops_match_pytorch_count(impl, tiny, n):
    expected = measured_flops(lambda: tiny(torch.randint(0, 128, (1, n))))
    linear = measured_flops(lambda: tiny(torch.randint(0, 128, (1, n)), backend="torch"))
    assert impl.attention_flops(tiny.config, n) == expected - linear, (
        f"attention_flops(config, {n}) should be {expected - linear}: two n×n×head_dim products per layer and head")
    assert impl.forward_flops(tiny, n) == expected, f"forward_flops(model, {n}) should be {expected}"


def test_naive_generation_flops_is_the_sum_of_steps(impl, tiny):
    measured = measured_flops(lambda: impl.naive_generate(tiny, [1, 2, 3, 4, 5], 8))
    got = impl.naive_generation_flops(tiny, 5, 8)
    assert got == measured, f"naive_generation_flops(model, 5, 8) = {got}; the loop really did {measured} FLOPs"


def test_attention_flops_grow_quadratically(impl):
    cfg = me.PRESETS["smollm2-135m"]  # the formula needs shapes only: no weights are allocated
    a = impl.attention_flops(cfg, 1000)
    b = impl.attention_flops(cfg, 2000)
    per_token_pair = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim  # Q·Kᵀ and P·V, 2 FLOPs per multiply-add
    assert a > 0, (f"attention_flops(SmolLM2, 1000) = {a}: over 1000 tokens the two attention products do "
                   f"1000·1000·{cfg.head_dim} multiply-adds each, per layer and query head")
    assert b == 4 * a, (f"attention_flops(SmolLM2, 1000) = {a} and (…, 2000) = {b}, a ratio of {b / a:.3g}: attention "
                        "work of one pass is quadratic in length, so doubling n must multiply it by exactly 4")
    assert a == per_token_pair * 1000**2, (
        f"attention_flops(SmolLM2, 1000) = {a:,}, expected {per_token_pair * 1000**2:,}: 2 products × 2 FLOPs × "
        f"{cfg.num_layers} layers × {cfg.num_heads} query heads × head_dim {cfg.head_dim} × n²")


# ---------------------------------------------------------------- the guards (see conftest.py)


def counted_by_pytorch(model, n_tokens, **kwargs):
    with FlopCounterMode(display=False) as counter:
        model(torch.zeros(1, n_tokens, dtype=torch.long), **kwargs)
    return counter.get_total_flops()


# Each part of the lab handed to something that already does it, and a grading test that must fail it.
HAND_OFFS = [
    ("naive_generate", lambda model, prompt_ids, max_new_tokens, eos_token_id=None:
        me.generate_naive(model, prompt_ids, max_new_tokens, eos_token_id=eos_token_id),
     test_naive_generate_matches_reference_loop, {}),
    ("naive_generate", lambda model, prompt_ids, max_new_tokens, eos_token_id=None:
        me.LLM.from_model(model, None, max_num_seqs=1).generate(
            [prompt_ids], me.SamplingParams(temperature=0.0, max_tokens=max_new_tokens), use_tqdm=False)[0].token_ids,
     test_naive_generate_matches_reference_loop, {}),
    ("linear_flops", lambda model, n_tokens: counted_by_pytorch(model, n_tokens, backend="torch"),
     test_linear_flops_match_pytorch_count, {"n": 7}),
    ("attention_flops", lambda config, n_tokens: int(formulas.attention_flops(config, n_tokens, n_tokens)),
     test_attention_flops_grow_quadratically, {}),
    ("attention_flops", lambda config, n_tokens: config.num_layers * int(attention_kernels.attention_flops(
        1, config.num_heads, n_tokens, n_tokens, config.head_dim, causal=False)),
     test_attention_flops_grow_quadratically, {}),
    ("forward_flops", counted_by_pytorch, test_forward_flops_match_pytorch_count, {"n": 7}),
    ("naive_generation_flops", lambda model, prompt_len, new_tokens: sum(
        counted_by_pytorch(model, prompt_len + s) for s in range(new_tokens)),
     test_naive_generation_flops_is_the_sum_of_steps, {}),
]


def test_every_part_of_the_lab_has_a_hand_off_check(asked_for):
    missing = set(asked_for(LAB)) - {part for part, *_ in HAND_OFFS}
    assert not missing, f"parts of the lab with no hand-off check above: {sorted(missing)}"


@pytest.mark.parametrize("part,replacement,test,args", HAND_OFFS,
                         ids=[f"{part}-{i}" for i, (part, *_) in enumerate(HAND_OFFS)])
def test_the_grader_fails_a_part_handed_off(hand_off, part, replacement, test, args):
    hand_off(part, replacement, test, **args)
