"""The KV cache changes the cost of generation, never its result: cached, naive, batched and HF's own
cached `generate` agree under greedy decoding, and the cache holds exactly the bytes the formula says."""
import pytest
import torch

import mini_engine as me
from mini_engine import formulas
from mini_engine.config import PRESETS, ModelConfig
from mini_engine.generate import decode_step, prefill
from mini_engine.kv_cache import ContiguousKVCache
from mini_engine.model import LlamaModel

NEW_TOKENS = 14


def tiny_model(num_heads: int, num_kv_heads: int, backend: str = "torch") -> LlamaModel:
    torch.manual_seed(num_heads * 10 + num_kv_heads)
    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=num_heads,
                      num_kv_heads=num_kv_heads, head_dim=16, max_position_embeddings=256, eos_token_id=None)
    model = LlamaModel(cfg, attention_backend=backend)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)  # sharp distributions: greedy ties are practically impossible
    return model.eval()


TINY = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


@pytest.fixture(scope="module", params=list(TINY), ids=list(TINY))
def tiny(request):
    return tiny_model(*TINY[request.param])


# ---------------------------------------------------------------- the real model


def test_real_cached_matches_naive_and_hf_generate(real, hf_real, chat_prompts, assert_greedy_match):
    model, _ = real
    ref, _ = hf_real
    eos = model.config.eos_token_id
    for prompt in chat_prompts[:2]:
        cached = me.generate_cached(model, prompt, NEW_TOKENS)
        naive = me.generate_naive(model, prompt, NEW_TOKENS)
        with torch.no_grad():
            hf_out = ref.generate(torch.tensor([prompt]), do_sample=False, use_cache=True, max_new_tokens=NEW_TOKENS,
                                  eos_token_id=eos, pad_token_id=eos)
        hf = hf_out[0, len(prompt):].tolist()
        assert_greedy_match(model, prompt, cached, naive)
        assert_greedy_match(model, prompt, cached, hf)


def test_real_batched_prompts_of_different_lengths_match_one_at_a_time(real, chat_prompts, assert_greedy_match):
    model, _ = real
    assert len({len(p) for p in chat_prompts}) > 1, "the chat prompts should differ in length"
    batched = me.generate_batch(model, chat_prompts, 12)
    for prompt, got in zip(chat_prompts, batched):
        assert_greedy_match(model, prompt, got, me.generate_cached(model, prompt, 12))


# ---------------------------------------------------------------- random tiny models


@pytest.mark.parametrize("backend", ["torch", "naive"])
@pytest.mark.parametrize("kind", list(TINY))
def test_tiny_cached_equals_naive(kind, backend):
    model = tiny_model(*TINY[kind], backend=backend)
    for prompt in ([3], [1, 2, 3, 4, 5], list(range(10, 47))):
        cached = me.generate_cached(model, prompt, 20)
        naive = me.generate_naive(model, prompt, 20)
        assert cached == naive, f"{kind}/{backend}, prompt of {len(prompt)}: cached {cached} != naive {naive}"


def test_tiny_cached_logits_equal_full_forward(tiny):
    """Each decode step's logits equal the last row of a full forward pass over the sequence so far."""
    seq = torch.randint(0, 128, (30,)).tolist()
    cache = ContiguousKVCache(tiny.config, 1, len(seq))
    logits = [prefill(tiny, cache, [seq[:8]], [0])[0]]
    for n in range(9, len(seq) + 1):
        logits.append(decode_step(tiny, cache, [seq[n - 1]], [n], [0])[0])
    full = tiny(torch.tensor([seq]))[0, 7:]
    torch.testing.assert_close(torch.stack(logits), full, atol=1e-4, rtol=1e-4)


def test_tiny_batch_of_equal_lengths_matches_one_at_a_time(tiny):
    prompts = [torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(4)]
    batched = me.generate_batch(tiny, prompts, 16)
    assert batched == [me.generate_cached(tiny, p, 16) for p in prompts]


def test_tiny_batch_of_different_lengths_matches_one_at_a_time(tiny):
    prompts = [[5], list(range(20, 43)), [7, 7, 7, 7], list(range(60, 71))]
    batched = me.generate_batch(tiny, prompts, 16)
    assert batched == [me.generate_cached(tiny, p, 16) for p in prompts]


def test_tiny_batch_where_one_sequence_stops_early(tiny):
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4]]
    eos = me.generate_cached(tiny, prompts[0], 16)[4]  # the first prompt hits it by its fifth token
    batched = me.generate_batch(tiny, prompts, 16, eos_token_id=eos)
    alone = [me.generate_cached(tiny, p, 16, eos_token_id=eos) for p in prompts]
    assert batched == alone
    assert len(batched[0]) <= 5 and batched[0][-1] == eos


def test_cache_holds_every_position_but_the_last_token(tiny):
    """After prefill and T − 1 decode steps the cache has K/V for prompt + T − 1 tokens, nothing beyond."""
    prompt, new = [4, 5, 6, 7, 8], 9
    cache = ContiguousKVCache(tiny.config, 1, 32)
    me.generate_cached(tiny, prompt, new, me.SamplingParams(max_tokens=new, ignore_eos=True), kv_cache=cache)
    filled = cache.data.abs().sum(dim=(0, 1, 2, 3, 5)) != 0  # per position, over layers, K/V, slots, heads, dims
    assert filled.tolist() == [True] * (len(prompt) + new - 1) + [False] * (32 - len(prompt) - new + 1)


# ---------------------------------------------------------------- cache sizing


def test_a_cache_too_small_is_rejected(tiny):
    prompt = [1, 2, 3, 4, 5, 6]
    short = ContiguousKVCache(tiny.config, 1, len(prompt) + 3)
    with pytest.raises(ValueError, match="kv_cache too small"):
        me.generate_cached(tiny, prompt, 4, kv_cache=short)
    few_slots = ContiguousKVCache(tiny.config, 1, 64)
    with pytest.raises(ValueError, match="kv_cache too small"):
        me.generate_batch(tiny, [prompt, prompt], 4, kv_cache=few_slots)
    exact = ContiguousKVCache(tiny.config, 1, len(prompt) + 4)
    assert len(me.generate_cached(tiny, prompt, 4, kv_cache=exact)) == 4


def test_a_write_past_the_end_is_rejected(tiny):
    cache = ContiguousKVCache(tiny.config, 1, 8)
    prefill(tiny, cache, [[1, 2, 3, 4, 5, 6, 7, 8]], [0])
    with pytest.raises(ValueError, match="max_len"):
        decode_step(tiny, cache, [9], [9], [0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["tiny-gqa", "tiny-mha", "smollm2-135m"])
def test_kv_cache_bytes_formula_equals_the_allocated_tensor(name, dtype):
    cfg = PRESETS[name] if name in PRESETS else tiny_model(*TINY[name.removeprefix("tiny-")]).config
    for slots, max_len in ((1, 1), (3, 17), (2, 128)):
        cache = ContiguousKVCache(cfg, slots, max_len, dtype=dtype)
        expected = formulas.kv_cache_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_len, slots,
                                           dtype.itemsize)
        assert cache.nbytes == cache.data.untyped_storage().nbytes() == expected
        assert formulas.kv_cache_bytes_for(cfg, max_len, slots, dtype.itemsize) == expected
