"""The compiled decode step is the eager one, fused: same logits (to rounding), same cache contents, same
greedy tokens on the real model, in fp32 and bf16, for any cache length. (Compiling takes seconds for a
tiny model and about a minute for SmolLM2: these tests are the slowest in the suite.)"""
import pytest
import torch

import mini_engine as me
from mini_engine.compiled_decode import compiled_decode_step, decode_graph
from mini_engine.generate import decode_step, generate_cached, prefill
from mini_engine.kv_cache import ContiguousKVCache
from mini_engine.sampling import SamplingParams

from test_cached_equivalence import tiny_model  # tests/engine is on sys.path (pytest rootdir-less import)


def _two_caches(model, prompts, slots, max_len):
    """Two identical caches holding the prompts' prefills (prompt i in slot slots[i])."""
    caches = []
    for _ in range(2):
        cache = ContiguousKVCache(model.config, 3, max_len, model.device, model.dtype)
        prefill(model, cache, prompts, slots)
        caches.append(cache)
    return caches


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Inductor emits Triton there)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_compiled_step_matches_eager_step_on_a_tiny_model(kv_heads, device):
    model = tiny_model(4, kv_heads).to(device)
    prompts, slots = [[5, 6, 7, 8, 9], [10, 11]], [2, 0]  # unequal contexts, slots out of order, slot 1 unused
    eager_cache, compiled_cache = _two_caches(model, prompts, slots, max_len=12)
    for step in range(3):  # three steps: each reads what the previous one wrote
        tokens, lens = [20 + step, 30 + step], [len(p) + 1 + step for p in prompts]
        want = decode_step(model, eager_cache, tokens, lens, slots)
        got = compiled_decode_step(model, compiled_cache, tokens, lens, slots)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"step {step}: compiled logits differ from eager: {m}")
    torch.testing.assert_close(compiled_cache.data, eager_cache.data, rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"the compiled step left different keys/values in the cache: {m}")


def test_uncompiled_function_is_the_same_step():
    """decode_graph run eagerly, from the tensor-only metadata: the graph's source is the model's own step."""
    model = tiny_model(4, 2)
    eager_cache, pure_cache = _two_caches(model, [[1, 2, 3], [5, 6]], [1, 2], max_len=6)
    want = decode_step(model, eager_cache, [4, 7], [4, 3], [1, 2])
    slots, lens = torch.tensor([1, 2]), torch.tensor([4, 3])
    with torch.inference_mode():  # every row reads the cache's 6 positions, masked past its own context
        got = decode_graph(model, pure_cache, "torch", torch.tensor([4, 7]), lens - 1, slots, lens, slots=slots,
                           logits_order=torch.tensor([1, 0]))
    torch.testing.assert_close(got, want[[1, 0]], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pure_cache.data, eager_cache.data)


def test_compiled_step_rejects_bad_input_clearly():
    model = tiny_model(4, 2)
    cache = ContiguousKVCache(model.config, 1, 4, "cpu", model.dtype)
    with pytest.raises(ValueError, match="max_len"):
        compiled_decode_step(model, cache, [1], [5], [0])
    with pytest.raises(ValueError, match="one entry per sequence"):
        compiled_decode_step(model, cache, [1, 2], [3], [0])
    with pytest.raises(ValueError, match="context_lens must be >= 1"):
        compiled_decode_step(model, cache, [1], [0], [0])


def test_real_model_compiled_greedy_tokens_equal_eager_fp32(real, chat_prompts, assert_greedy_match):
    model = real[0]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    for prompt, n in zip(chat_prompts[:2], (20, 12)):  # two cache lengths: one graph serves both
        want = generate_cached(model, prompt, n, params)
        got = generate_cached(model, prompt, n, params, compile=True)
        assert_greedy_match(model, prompt, got, want)


def test_real_model_compiled_bf16_differs_from_eager_bf16_only_at_near_ties(real, chat_prompts,
                                                                            assert_greedy_match):
    """bf16 rounds every intermediate: eager rounds after each op, the fused kernels once per kernel, so
    their logits differ by about as much as either differs from fp32 (measured: up to ~0.8). Greedy tokens
    must agree wherever fp32 has a clear winner; where they part, fp32's logits for the two choices must be
    within bf16's error of each other (0.5), so both are legitimate argmaxes."""
    model = me.load_model("smollm2-135m", device="cpu", dtype="bfloat16")[0]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for prompt in chat_prompts[:2]:
        want = generate_cached(model, prompt, 24, params)
        got = generate_cached(model, prompt, 24, params, compile=True)
        assert_greedy_match(real[0], prompt, got, want, tol=0.5)
