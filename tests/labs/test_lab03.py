"""Grades lab 03 (the KV cache: its size, one cached attention step, the cached loop) via `impl`.

    pytest tests/labs/test_lab03.py --impl=labs        # your work
    pytest tests/labs/test_lab03.py --impl=solutions   # the reference answers

The ground truth is the engine itself: the bytes a ContiguousKVCache really allocates, the engine's
attention over its cache, its generation loops, and the FLOPs PyTorch counts while they run.
"""
import importlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import mini_engine as me
from mini_engine import attention, compiled_decode, engine, formulas, generate, kv_cache, runner, simulate
from mini_engine.attention import AttentionMetadata, attention_with_cache
from mini_engine.config import PRESETS, ModelConfig
from mini_engine.kv_cache import ContiguousKVCache
from mini_engine.model import LlamaModel

LAB = "lab03_kv_cache"
# The package re-exports functions under these modules' names.
attention_kernels = [importlib.import_module(f"mini_engine.kernels.{name}") for name in ("flash_attention",
                                                                                          "paged_attention")]
# The engine's finished versions of what this lab builds: calling them fails the test (see conftest.py).
# cached_generate is meant to use prefill and decode_step (the lab imports them), not a whole loop.
SHORTCUTS = {
    "kv_cache_bytes": [formulas, kv_cache, engine],
    "max_concurrent_requests": [formulas, kv_cache, engine, simulate],
    "decode_attention": [attention, kv_cache, *attention_kernels, F.scaled_dot_product_attention],
    "cached_generate": [generate.generate_naive, generate.generate_cached, generate.generate_batch,
                        generate.generate_speculative, engine, runner, compiled_decode],
}
GiB = 2**30


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, hidden_size=96, intermediate_size=128, num_layers=2, num_heads=6,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=256)
    model = LlamaModel(cfg, attention_backend="naive")  # naive attention: PyTorch can count its FLOPs
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)  # sharp logits, so greedy choices are never near-ties
    return model.eval()


def measured_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


# ---------------------------------------------------------------- the size of the cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["smollm2-135m", "llama-7b", "llama-70b-gqa"])
def test_kv_cache_bytes_equal_an_allocated_cache(impl, name, dtype):
    cfg = PRESETS[name]
    for batch, seq_len in ((1, 1), (3, 5), (2, 64)):
        cache = ContiguousKVCache(cfg, batch, seq_len, dtype=dtype)
        got = impl.kv_cache_bytes(cfg, seq_len, batch, dtype.itemsize)
        assert got == cache.nbytes, (
            f"{name}, batch {batch}, {seq_len} tokens, {dtype}: a real cache of shape {tuple(cache.data.shape)} "
            f"[layers, K/V, batch, kv_heads, positions, head_dim] holds {cache.nbytes} bytes, you computed {got}")


def test_kv_cache_bytes_reproduce_the_textbook(impl):
    got = {name: impl.kv_cache_bytes(PRESETS[name], n, 1, 2) for name, n in
           (("llama-7b", 4096), ("llama-70b-gqa", 131072), ("llama-70b-mha", 131072))}
    assert got == {"llama-7b": 2 * GiB, "llama-70b-gqa": 40 * GiB, "llama-70b-mha": 320 * GiB}, (
        "fp16, one sequence: Llama-7B at 4K tokens needs exactly 2 GiB and Llama-70B at 128K tokens 40 GiB with "
        f"its 8 KV heads (320 GiB if all 64 heads kept K/V); you got {[f'{v / GiB:g} GiB' for v in got.values()]}")


def test_max_concurrent_requests_on_an_80gb_gpu(impl):
    cfg = PRESETS["llama-2-13b"]
    got = impl.max_concurrent_requests(cfg, 80 * GiB, 2048, 2)
    assert got == 35, ("Llama-2-13B in fp16 on an 80 GiB GPU, 2048-token requests: (80 GiB - 26 GB of weights) // "
                       f"1.5625 GiB per request = 35 (the textbook: \"~35 on an 80 GB A100\"); you got {got}")


@pytest.mark.parametrize("gpu_gib,seq_len", [(16, 4096), (24, 1024), (80, 32768), (10, 128)])
def test_max_concurrent_requests_match_the_formula(impl, gpu_gib, seq_len):
    cfg = PRESETS["llama-7b"]
    expected = formulas.max_concurrent_requests(gpu_gib * GiB, formulas.weight_bytes(cfg, 2),
                                                formulas.kv_cache_bytes_for(cfg, seq_len, 1, 2))
    got = impl.max_concurrent_requests(cfg, gpu_gib * GiB, seq_len, 2)
    assert got == expected, (f"Llama-7B fp16 on {gpu_gib} GiB with {seq_len}-token requests: {expected} fit "
                             f"(0 when the weights alone do not), you returned {got}")
    assert isinstance(got, int), f"return a whole number of requests (an int), not {type(got).__name__}"


# ---------------------------------------------------------------- one cached attention step


def engine_decode(q, k_cache, v_cache, context):
    """The engine's attention for one token of one sequence, on a cache that already holds its K/V."""
    meta = AttentionMetadata.build([1], [context], slots=[0])
    return attention_with_cache(q[None], k_cache[None], v_cache[None], meta, "torch")[0]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("position", [0, 5, 37])
def test_decode_attention_matches_the_engine(impl, heads, kv_heads, position):
    torch.manual_seed(position)
    d, max_len = 32, 48
    k_cache, v_cache = torch.randn(kv_heads, max_len, d), torch.randn(kv_heads, max_len, d)
    k_cache[:, position:] = v_cache[:, position:] = float("nan")  # unused positions: must never be read
    q, k_new, v_new = torch.randn(heads, d), torch.randn(kv_heads, d), torch.randn(kv_heads, d)
    got = impl.decode_attention(q, k_new, v_new, k_cache, v_cache, position)

    assert torch.equal(k_cache[:, position], k_new) and torch.equal(v_cache[:, position], v_new), (
        f"write k_new and v_new into the caches at position {position}, in place (k_cache[:, position] = k_new)")
    assert got.shape == (heads, d), f"return one output vector per query head: shape {(heads, d)}, got {tuple(got.shape)}"
    assert not got.isnan().any(), (f"your output has NaNs: you read cache positions after {position}, "
                                   "which hold nothing yet (attend to positions 0..position only)")
    expected = engine_decode(q, k_cache, v_cache, position + 1)
    shared = F.scaled_dot_product_attention(q[:, None], k_cache[:1, :position + 1], v_cache[:1, :position + 1])[:, 0]
    if 1 < kv_heads < heads and torch.allclose(got, shared, atol=1e-5):
        pytest.fail("every query head used KV head 0: with grouped-query attention query head h reads "
                    f"KV head h // {heads // kv_heads}", pytrace=False)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=lambda m: (
        f"output differs from the engine's attention ({heads} query heads, {kv_heads} KV heads, position "
        f"{position}): scale scores by 1/sqrt(head_dim), softmax over positions 0..{position}, and give "
        f"query head h KV head h // {heads // kv_heads} (repeat_interleave, not repeat)\n{m}"))


def test_decode_attention_steps_build_up_causal_attention(impl):
    """Feeding a sequence one token at a time through your step gives exactly causal attention over it."""
    torch.manual_seed(1)
    heads, kv_heads, n, d = 6, 2, 12, 16
    q, k, v = torch.randn(n, heads, d), torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
    k_cache, v_cache = torch.zeros(kv_heads, n, d), torch.zeros(kv_heads, n, d)
    steps = torch.stack([impl.decode_attention(q[i], k[i], v[i], k_cache, v_cache, i) for i in range(n)])
    expected = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              is_causal=True, enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(steps, expected, atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"token-by-token decode should equal causal attention over the sequence\n{m}")


def test_decode_attention_rejects_a_full_cache(impl):
    k_cache, v_cache = torch.zeros(2, 8, 16), torch.zeros(2, 8, 16)
    q, k_new, v_new = torch.randn(2, 16), torch.randn(2, 16), torch.randn(2, 16)
    last = impl.decode_attention(q, k_new, v_new, k_cache, v_cache, 7)  # the last position still fits
    assert last.shape == (2, 16), "position 7 of an 8-position cache is valid: expected an output of shape (2, 16)"
    before = (k_cache.clone(), v_cache.clone())
    for position in (8, 11):
        try:
            impl.decode_attention(q, k_new, v_new, k_cache, v_cache, position)
        except ValueError as err:
            message = str(err)
        except Exception as err:
            pytest.fail(f"position {position} of an 8-position cache raised {type(err).__name__}: {err}; check "
                        "`position` against k_cache.shape[1] first and raise ValueError", pytrace=False)
        else:
            pytest.fail(f"position {position} is past the end of an 8-position cache: raise ValueError naming it "
                        "before writing anything", pytrace=False)
        assert str(position) in message, (
            f"your ValueError says {message!r}: name the position ({position}) that does not fit the "
            f"cache's {k_cache.shape[1]} positions, so the caller sees what went wrong")
        assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]), (
            "a rejected step must leave the caches as they were: check the position before writing")


# ---------------------------------------------------------------- the cached loop


@pytest.mark.parametrize("prompt", [[3], [1, 2, 3, 4, 5], list(range(40, 80))], ids=["1", "5", "40"])
def test_cached_generate_matches_full_recompute(impl, tiny, prompt):
    expected = me.generate_naive(tiny, prompt, max_new_tokens=15)
    got = impl.cached_generate(tiny, prompt, 15)
    first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    assert got == expected, (
        f"cached greedy tokens must equal full recompute: expected {expected}, got {got}"
        + (f" (first difference at new token {first}: check the context length you pass to decode_step)"
           if first is not None else " (return only the new tokens, max_new_tokens of them)"))


def test_cached_generate_stops_after_eos(impl, tiny):
    free = me.generate_naive(tiny, [9, 8, 7], max_new_tokens=12)
    eos = free[4]
    expected = free[:free.index(eos) + 1]
    got = impl.cached_generate(tiny, [9, 8, 7], 12, eos_token_id=eos)
    assert got == expected, f"stop right after emitting eos_token_id={eos} and include it: expected {expected}, got {got}"


def test_cached_generate_does_no_recomputation(impl, tiny):
    prompt, new = list(range(10, 30)), 12
    engine = measured_flops(lambda: me.generate_cached(tiny, prompt, new))
    naive = measured_flops(lambda: me.generate_naive(tiny, prompt, new))
    got = measured_flops(lambda: impl.cached_generate(tiny, prompt, new))
    assert got == engine, (
        f"your loop did {got:,} FLOPs; one prefill plus {new - 1} single-token decode steps do {engine:,} "
        f"(full recompute: {naive:,}). Feed the model only the newest token after the prefill, and run the "
        "prefill once")


def test_cached_generate_on_the_real_model(impl, real_model):
    model, tok = real_model
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    got = impl.cached_generate(model, prompt, 12, eos_token_id=tok.eos_token_id)
    assert got == me.generate_cached(model, prompt, 12, eos_token_id=tok.eos_token_id), (
        f"on SmolLM2 your loop produced {tok.decode(got)!r}, the engine's cached loop something else")
    assert "Paris" in tok.decode(got), f"SmolLM2 should answer Paris; your loop produced {tok.decode(got)!r}"



# ---------------------------------------------------------------- the guards (see conftest.py)


def decode_attention_by_sdpa(q, k_new, v_new, k_cache, v_cache, position):
    k_cache[:, position], v_cache[:, position] = k_new, v_new
    keys, values = k_cache[None, :, :position + 1], v_cache[None, :, :position + 1]
    return F.scaled_dot_product_attention(q[None, :, None], keys, values, enable_gqa=True)[0, :, 0]


def decode_attention_by_the_engine(q, k_new, v_new, k_cache, v_cache, position):
    k_cache[:, position], v_cache[:, position] = k_new, v_new
    meta = AttentionMetadata.build([1], [position + 1], slots=[0])
    return attention_with_cache(q[None], k_cache[None], v_cache[None], meta, "torch")[0]


# Each part of the lab handed to something that already does it, and a grading test that must fail it.
HAND_OFFS = [
    ("kv_cache_bytes", lambda config, seq_len, batch=1, dtype_bytes=2: ContiguousKVCache(
        config, batch, seq_len, device="meta", dtype={2: torch.bfloat16, 4: torch.float32}[dtype_bytes]).nbytes,
     test_kv_cache_bytes_equal_an_allocated_cache, {"name": "llama-7b", "dtype": torch.bfloat16}),
    ("kv_cache_bytes", lambda config, seq_len, batch=1, dtype_bytes=2: int(formulas.kv_cache_bytes_for(
        config, seq_len, batch, dtype_bytes)), test_kv_cache_bytes_reproduce_the_textbook, {}),
    ("max_concurrent_requests", lambda config, gpu_bytes, seq_len, dtype_bytes=2: int(formulas.max_concurrent_requests(
        gpu_bytes, formulas.weight_bytes(config, dtype_bytes), formulas.kv_cache_bytes_for(config, seq_len, 1, dtype_bytes))),
     test_max_concurrent_requests_on_an_80gb_gpu, {}),
    ("decode_attention", decode_attention_by_sdpa, test_decode_attention_matches_the_engine,
     {"heads": 9, "kv_heads": 3, "position": 5}),
    ("decode_attention", decode_attention_by_the_engine, test_decode_attention_matches_the_engine,
     {"heads": 9, "kv_heads": 3, "position": 5}),
    ("cached_generate", lambda model, prompt_ids, max_new_tokens, eos_token_id=None: me.generate_cached(
        model, prompt_ids, max_new_tokens, eos_token_id=eos_token_id),
     test_cached_generate_matches_full_recompute, {"prompt": [1, 2, 3, 4, 5]}),
]


def test_every_part_of_the_lab_has_a_hand_off_check(asked_for):
    missing = set(asked_for(LAB)) - {part for part, *_ in HAND_OFFS}
    assert not missing, f"parts of the lab with no hand-off check above: {sorted(missing)}"


@pytest.mark.parametrize("part,replacement,test,args", HAND_OFFS,
                         ids=[f"{part}-{i}" for i, (part, *_) in enumerate(HAND_OFFS)])
def test_the_grader_fails_a_part_handed_off(hand_off, part, replacement, test, args):
    hand_off(part, replacement, test, **args)
