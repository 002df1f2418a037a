"""The compiled decode step is the eager one, fused: same logits (to rounding), same cache contents, same
greedy tokens on the real model, in fp32 and bf16, for cache lengths that share a graph. (Compiling takes seconds for a
tiny model and about a minute for SmolLM2: these tests are the slowest in the suite.)"""
import functools

import pytest
import torch

import mini_engine as me
from mini_engine.compiled_decode import CompiledDecode, cache_length, decode_graph, graphs_compiled
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


PROMPTS, SLOTS = [[5, 6, 7, 8, 9], [10, 11]], [2, 0]  # unequal contexts, slots out of order, slot 1 unused


def twin_steps(model, steps: int):
    """PROMPTS prefilled into twin caches, and `steps` decode steps after them: the eager steps run now, on the
    first cache; each (logits, run) pair holds an eager step's logits and a function that runs the same step
    compiled (`CompiledDecode`) on the second cache. Call the runs in order: each step reads what the one before
    wrote. Returns (eager cache, compiled cache, pairs)."""
    eager_cache, compiled_cache = _two_caches(model, PROMPTS, SLOTS, max_len=12)
    graphs = CompiledDecode(model, compiled_cache, "torch", max_num_seqs=2)
    pairs = []
    for step in range(steps):
        tokens, lens = [20 + step, 30 + step], [len(p) + 1 + step for p in PROMPTS]
        pairs.append((decode_step(model, eager_cache, tokens, lens, SLOTS),
                      functools.partial(graphs, tokens, [n - 1 for n in lens], SLOTS)))
    return eager_cache, compiled_cache, pairs


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Inductor emits Triton there)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_compiled_step_matches_eager_step_on_a_tiny_model(kv_heads, device):
    model = tiny_model(4, kv_heads).to(device)
    eager_cache, compiled_cache, pairs = twin_steps(model, 3)  # three steps: each reads what the one before wrote
    for step, (want, run) in enumerate(pairs):
        torch.testing.assert_close(run(), want, rtol=1e-4, atol=1e-4,
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
    with pytest.raises(ValueError, match="compile must be"):
        CompiledDecode(model, cache, "torch", 1, mode="fast")
    graphs = CompiledDecode(model, cache, "torch", 1)
    with pytest.raises(ValueError, match="max_len"):
        graphs([1], [4], [0])
    with pytest.raises(ValueError, match="one entry per sequence"):
        graphs([1, 2], [3], [0])
    with pytest.raises(ValueError, match="compile must be"):
        generate_cached(model, [1, 2], 2, compile="fast")


def test_plain_loop_cache_lengths_are_bucketed():
    """A compiled plain loop sizes its cache by `cache_length`, so that runs of nearby lengths share a graph."""
    assert [cache_length(n, 2048) for n in (1, 100, 256, 257, 600, 5000)] == [256, 256, 256, 512, 1024, 2048]


def test_graphs_belong_to_their_model_and_a_copy_starts_without_them():
    """The graphs live on the model; a deep copy (a quantized copy, say) compiles its own. Two runs of nearby
    lengths compile once."""
    import copy
    model = tiny_model(4, 2)
    before = graphs_compiled()
    generate_cached(model, [1, 2, 3], 4, compile=True)
    generate_cached(model, [1, 2, 3, 4, 5], 7, compile=True)
    assert graphs_compiled() - before == 1, "the second run's cache length recompiled the step"
    assert len(model.decode_graphs) == 1
    twin = copy.deepcopy(model)
    assert len(twin.decode_graphs) == 0
    generate_cached(twin, [1, 2, 3], 4, compile=True)
    assert twin.decode_graphs[True, "cpu", torch.float32] is not model.decode_graphs[True, "cpu", torch.float32]


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
