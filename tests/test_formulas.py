"""The closed forms reproduce the textbook's numbers and agree with brute-force sums."""
import numpy as np
import pytest

from mini_engine import formulas as F
from mini_engine.config import PRESETS

A100 = dict(peak_flops=312e12, peak_bw=2.039e12)
TINY = F.ModelShape(n_params=1000, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_size=32)
ATTENTION_ONLY = F.ModelShape(n_params=0, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_size=32)
MATMUL_ONLY = F.ModelShape(n_params=1000, n_layers=2, n_heads=0, n_kv_heads=2, head_dim=8, hidden_size=32)


# ---------------------------------------------------------------- KV memory

def test_kv_cache_textbook_numbers():
    assert F.kv_cache_bytes(32, 32, 128, seq_len=4096, dtype_bytes=2) == 2 * F.GiB  # Llama-7B at 4K
    assert F.kv_bytes_per_token(40, 40, 128, 2) / F.MiB == pytest.approx(0.78, abs=0.005)  # Llama-2-13B
    assert F.kv_cache_bytes(80, 8, 128, 131072) / F.GiB == pytest.approx(40)  # Llama-70B, GQA
    assert F.kv_cache_bytes(80, 64, 128, 131072) / F.GiB == pytest.approx(320)  # Llama-70B, 64 KV heads


def test_kv_cache_textbook_table():
    # The textbook's exercise table (GiB, fp16, batch 1), rows Llama-7B / 13B / 70B with 64 heads.
    expected = {"llama-7b": [0.50, 2.00, 16.00, 64.00],
                "llama-2-13b": [0.78, 3.12, 25.00, 100.00],
                "llama-70b-mha": [2.50, 10.00, 80.00, 320.00]}
    contexts = np.array([1024, 4096, 32768, 131072])
    for name, row in expected.items():
        got = F.kv_cache_bytes_for(name, contexts) / F.GiB
        np.testing.assert_allclose(got, row, atol=0.005)


def test_kv_cache_scales_linearly_and_override_heads():
    one = F.kv_cache_bytes_for("llama-7b", 100)
    assert F.kv_cache_bytes_for("llama-7b", 100, batch=3) == 3 * one
    assert F.kv_cache_bytes_for("llama-7b", 300) == 3 * one
    assert F.kv_cache_bytes_for("llama-7b", 100, dtype_bytes=1) * 2 == one
    assert F.kv_cache_bytes_for("llama-7b", 100, n_kv_heads=1) * 32 == one  # MQA
    assert F.kv_cache_bytes_for("llama-70b-mha", 10) == 8 * F.kv_cache_bytes_for("llama-70b-gqa", 10)


def test_max_concurrent_requests_reproduces_35_on_an_80gb_a100():
    # Assumptions (documented in the docstring): 80 GiB card, fp16 weights, 2048 fp16 KV tokens per request.
    kv = F.kv_cache_bytes_for("llama-2-13b", 2048)
    fits = F.max_concurrent_requests(80 * F.GiB, F.weight_bytes("llama-2-13b", 2), kv)
    assert fits == 35
    free = 80 * F.GiB - F.weight_bytes("llama-2-13b", 2)
    assert fits * kv <= free < (fits + 1) * kv


def test_max_concurrent_requests_is_zero_when_weights_do_not_fit():
    assert F.max_concurrent_requests(16 * F.GiB, F.weight_bytes("llama-70b-gqa"), 1) == 0
    np.testing.assert_array_equal(F.max_concurrent_requests(np.array([10, 20, 35]), 5, 10), [0, 1, 3])


# ---------------------------------------------------------------- FLOPs

def _attention_flops_by_loops(shape, n_queries, n_keys):
    """Count the multiply-adds of QKᵀ and PV one query, key, head and layer at a time."""
    macs = 0
    for _layer in range(shape.n_layers):
        for _head in range(shape.n_heads):
            for _q in range(n_queries):
                for _k in range(n_keys):
                    macs += shape.head_dim  # one score q·k
                    macs += shape.head_dim  # its share of p·v
    return 2 * macs


def test_flops_per_token_counts_matmuls_and_attention():
    assert F.attention_flops(TINY, 3, 5) == _attention_flops_by_loops(TINY, 3, 5)
    assert F.flops_per_token(TINY, 7) == 2 * TINY.n_params + _attention_flops_by_loops(TINY, 1, 7)
    assert F.prefill_flops(TINY, 6) == 6 * 2 * TINY.n_params + _attention_flops_by_loops(TINY, 6, 6)
    assert F.prefill_flops(TINY, 4, past=3) == 4 * 2 * TINY.n_params + _attention_flops_by_loops(TINY, 4, 7)
    assert F.decode_flops(TINY, 9, batch=5) == 5 * F.flops_per_token(TINY, 9)


def test_model_can_be_a_config_a_preset_name_or_a_shape():
    cfg = PRESETS["llama-7b"]
    shape = F.ModelShape.of(cfg)
    assert shape.n_params == cfg.num_params and shape.n_kv_heads == 32
    assert F.flops_per_token("llama-7b", 100) == F.flops_per_token(cfg, 100) == F.flops_per_token(shape, 100)
    with pytest.raises(ValueError, match="model"):
        F.flops_per_token("no-such-model", 1)


@pytest.mark.parametrize("prompt_len,new_tokens", [(1, 1), (1, 9), (5, 1), (7, 13)])
def test_generation_closed_forms_equal_step_sums(prompt_len, new_tokens):
    naive = sum(F.naive_step_flops(TINY, prompt_len + s) for s in range(new_tokens))
    cached = F.prefill_flops(TINY, prompt_len) + sum(
        F.decode_flops(TINY, prompt_len + s) for s in range(1, new_tokens))
    assert F.naive_generation_flops(TINY, prompt_len, new_tokens) == pytest.approx(naive, rel=1e-12)
    assert F.cached_generation_flops(TINY, prompt_len, new_tokens) == pytest.approx(cached, rel=1e-12)


def test_generation_flops_accept_arrays():
    lengths = np.array([1, 2, 50, 1024])
    got = F.naive_generation_flops("llama-7b", 3, lengths)
    np.testing.assert_allclose(got, [F.naive_generation_flops("llama-7b", 3, int(n)) for n in lengths], rtol=1e-12)


def test_growth_orders_of_naive_and_cached_generation():
    # Doubling N: attention costs 8× (O(N³)) without a cache and 4× (O(N²)) with one; matmuls 4× and 2×.
    n = 4096
    ratio = lambda fn, shape: fn(shape, 1, 2 * n) / fn(shape, 1, n)
    assert ratio(F.naive_generation_flops, ATTENTION_ONLY) == pytest.approx(8, rel=1e-3)
    assert ratio(F.cached_generation_flops, ATTENTION_ONLY) == pytest.approx(4, rel=1e-3)
    assert ratio(F.naive_generation_flops, MATMUL_ONLY) == pytest.approx(4, rel=1e-3)
    assert ratio(F.cached_generation_flops, MATMUL_ONLY) == pytest.approx(2, rel=1e-3)


def test_attention_work_ratio_is_about_700_at_1024():
    n = 1024
    brute = sum(i * i for i in range(1, n + 1)) / sum(range(1, n + 1))
    assert F.attention_work_ratio(n) == pytest.approx(brute)
    assert round(F.attention_work_ratio(n)) == 683  # the textbook rounds it to "roughly a 700× reduction"
    # The same ratio falls out of the cost model once the matmuls are taken away.
    assert F.naive_generation_flops(ATTENTION_ONLY, 1, n) / F.cached_generation_flops(ATTENTION_ONLY, 1, n) \
        == pytest.approx(brute)


def test_bad_lengths_are_rejected_by_name():
    with pytest.raises(ValueError, match="prompt_len"):
        F.naive_generation_flops(TINY, 0, 5)
    with pytest.raises(ValueError, match="new_tokens"):
        F.cached_generation_flops(TINY, 3, 0)
    with pytest.raises(ValueError, match="seq_len"):
        F.kv_cache_bytes(1, 1, 1, -1)


# ---------------------------------------------------------------- bytes, intensity, roofline

def test_decode_at_batch_1_moves_about_one_byte_per_flop():
    # fp16: two FLOPs and two bytes per weight, the KV read adds a little.
    assert F.decode_intensity("llama-7b", 1, 1024, 2) == pytest.approx(1.0, abs=0.05)
    assert F.decode_intensity("llama-7b", 1, 1024, 4) == pytest.approx(0.5, abs=0.03)


def test_decode_intensity_grows_with_batch_then_saturates_on_kv_reads():
    batches = np.array([1, 2, 8, 64, 512, 4096])
    intensity = F.decode_intensity("llama-7b", batches, 4096, 2)
    assert np.all(np.diff(intensity) > 0)
    # Per sequence a step does flops_per_token(context) and moves `context` KV entries: the ceiling.
    ceiling = F.flops_per_token("llama-7b", 4096) / (F.kv_bytes_per_token_for("llama-7b", 2) * 4096)
    assert intensity[-1] < ceiling < F.ridge_point(**A100)


def test_prefill_intensity_grows_with_prompt_length():
    assert F.prefill_intensity("llama-7b", 1, 2) == pytest.approx(F.decode_intensity("llama-7b", 1, 1, 2))
    assert F.prefill_bytes("llama-7b", 1, 2, past=99) == F.decode_bytes("llama-7b", 1, 100, 2)
    assert F.prefill_intensity("llama-7b", 2048, 2) > F.ridge_point(**A100)


def test_roofline_pieces():
    ridge = F.ridge_point(**A100)
    assert ridge == pytest.approx(312e12 / 2.039e12)
    assert F.attainable_flops(ridge / 2, **A100) == pytest.approx(A100["peak_flops"] / 2)
    assert F.attainable_flops(ridge * 2, **A100) == A100["peak_flops"]
    assert F.roofline_time(1e12, 1e9, 1e12, 1e9) == 1.0
    assert F.roofline_time(2e12, 1e9, 1e12, 1e9) == 2.0
    assert F.roofline_bound(1.0, 1.0, **A100) == "memory"
    assert F.roofline_bound(1e6, 1.0, **A100) == "compute"


def test_predicted_decode_rate_on_an_a100():
    # Batch 1 is bound by reading the fp16 weights once per token: about 2.04 TB/s / 13.5 GB ≈ 150 tok/s.
    one = F.predicted_decode_tok_s("llama-7b", 1, 1024, 2, **A100)
    assert one == pytest.approx(A100["peak_bw"] / F.decode_bytes("llama-7b", 1, 1024, 2))
    assert 100 < one < 200
    assert F.predicted_decode_tok_s("llama-7b", 32, 1024, 2, **A100) > 10 * one


# ---------------------------------------------------------------- speculative decoding

def _expected_tokens_by_cases(k, alpha):
    """Sum over how many drafts are accepted: j < k with probability αʲ(1−α), all k with αᵏ; +1 target token."""
    return sum((j + 1) * alpha**j * (1 - alpha) for j in range(k)) + (k + 1) * alpha**k


def test_expected_tokens_per_step():
    assert F.expected_tokens_per_step(4, 0.8) == pytest.approx(3.36, abs=0.005)
    for k in (0, 1, 3, 7):
        for alpha in (0.0, 0.3, 0.9):
            assert F.expected_tokens_per_step(k, alpha) == pytest.approx(_expected_tokens_by_cases(k, alpha))
    assert F.expected_tokens_per_step(5, 1.0) == 6


def test_speculative_speedup_reproduces_the_textbook_table():
    ks, alphas = [1, 3, 5, 7, 10], [0.3, 0.5, 0.7, 0.9]
    book = [[1.21, 1.40, 1.59, 1.78],
            [1.28, 1.69, 2.28, 3.10],
            [1.24, 1.71, 2.56, 4.07],
            [1.20, 1.67, 2.64, 4.79],
            [1.14, 1.60, 2.61, 5.49]]
    table = F.speculative_speedup_table(ks, alphas, draft_cost=0.02, overhead=0.05)
    assert table.shape == (5, 4)
    np.testing.assert_allclose(table, book, atol=0.006)
    assert table[2, 2] == F.speculative_speedup(k=5, alpha=0.7, draft_cost=0.02, overhead=0.05)
    # The defaults are the textbook's grid and costs.
    np.testing.assert_array_equal(F.speculative_speedup_table(), table)
    assert (F.TEXTBOOK_KS, F.TEXTBOOK_ALPHAS) == (tuple(ks), tuple(alphas))


def test_acceptance_rate_is_the_overlap_of_p_and_q():
    assert F.acceptance_rate([0.2, 0.3, 0.5], [0.2, 0.3, 0.5]) == pytest.approx(1.0)
    assert F.acceptance_rate([0.5, 0.5, 0.0], [0.0, 0.0, 1.0]) == 0.0
    assert F.acceptance_rate([0.6, 0.3, 0.1], [0.0, 1.0, 0.0]) == pytest.approx(0.3)  # one-hot q: p(guess)
    np.testing.assert_allclose(F.acceptance_rate([[0.5, 0.5], [1.0, 0.0]], [[1.0, 0.0], [0.5, 0.5]]), [0.5, 0.5])
    with pytest.raises(ValueError, match="draft_probs"):
        F.acceptance_rate([0.5, 0.5], [1.0, 0.0, 0.0])


def test_expected_accepted_drafts_leaves_out_the_targets_token():
    assert F.expected_accepted_drafts(4, 0.8) == pytest.approx(0.8 + 0.64 + 0.512 + 0.4096)
    assert F.expected_accepted_drafts(3, 1.0) == 3
    assert F.expected_accepted_drafts(3, 0.0) == 0


def test_speculative_speedup_is_tokens_over_round_cost():
    assert F.speculative_speedup(4, 0.8, draft_cost=0.1) == pytest.approx(3.3616 / 1.4)
    assert F.speculative_speedup(0, 0.5, draft_cost=0.1) == 1.0  # no drafts: plain decoding
    with pytest.raises(ValueError, match="alpha"):
        F.speculative_speedup(4, 1.5, 0.02)
    with pytest.raises(ValueError, match="draft_cost"):
        F.speculative_speedup(4, 0.5, -0.1)


# ---------------------------------------------------------------- paging and prefix caching

def test_paged_waste_is_the_tail_of_the_last_block():
    assert F.paged_waste_tokens(17, 16) == 15
    assert F.paged_waste_tokens(32, 16) == 0
    assert F.blocks_needed(33, 16) == 3
    lengths = np.arange(1, 200)
    waste = F.paged_waste_tokens(lengths, 16)
    assert np.all((waste >= 0) & (waste < 16))
    np.testing.assert_array_equal((lengths + waste) % 16, 0)


def test_contiguous_waste_fraction():
    assert F.contiguous_waste_fraction([512, 1024], 2048) == pytest.approx(1 - 1536 / 4096)
    with pytest.raises(ValueError, match="actual_lens"):
        F.contiguous_waste_fraction([3000], 2048)


def test_prefix_cache_savings_match_the_textbook():
    # Llama-2-13B, a 2000-token shared prompt, 50-token questions, 1000 requests.
    s = F.prefix_cache_savings(2000, 50, 1000, "llama-2-13b")
    assert s.ttft_ratio == pytest.approx(40, rel=0.05)
    matmul_skipped = 2 * PRESETS["llama-2-13b"].num_params * 2000 * 999
    assert matmul_skipped / 1e15 == pytest.approx(52, rel=0.01)
    assert matmul_skipped < s.flops_skipped < 1.1 * matmul_skipped  # attention adds a few percent
    assert s.flops_with + s.flops_skipped == pytest.approx(s.flops_without)


def test_prefix_cache_savings_by_brute_force():
    p, sfx, n = 6, 3, 4
    s = F.prefix_cache_savings(p, sfx, n, TINY)
    without = sum(F.prefill_flops(TINY, p + sfx) for _ in range(n))
    with_cache = F.prefill_flops(TINY, p) + sum(F.prefill_flops(TINY, sfx, past=p) for _ in range(n))
    assert s.flops_without == without and s.flops_with == with_cache
    assert F.prefix_cache_savings(0, sfx, n, TINY).ttft_ratio == 1.0


def test_human_bytes():
    assert F.human_bytes(2 * F.GiB) == "2.00 GiB"
    assert F.human_bytes(819200) == "800.00 KiB"
    assert F.human_bytes(12) == "12 B"


def test_cached_prefix_tokens_of_a_hand_computed_prompt():
    # A 64-token prompt in blocks of 16 whose first 48 tokens are cached: three full blocks hit.
    assert F.cached_prefix_tokens(64, 48, 16) == 48
    assert F.cached_prefix_tokens(64, 50, 16) == 48, "2 tokens of a fourth block are not a full block"
    assert F.cached_prefix_tokens(64, 64, 16) == 48, "a full hit recomputes the last block, for its logits"
    assert F.cached_prefix_tokens(65, 64, 16) == 64
    assert F.cached_prefix_tokens(64, 64, 1) == 63, "token-granular: everything but the last token"
    assert F.cached_prefix_tokens(1, 1, 1) == 0
    np.testing.assert_array_equal(F.cached_prefix_tokens(np.array([17, 33, 40]), 32, 16), [16, 32, 32])


def test_cached_prefix_tokens_by_brute_force():
    for block in (1, 3, 16):
        for n in range(1, 40):
            for shared in range(n + 1):
                best = max(c for c in range(0, n, block) if c <= shared)
                assert F.cached_prefix_tokens(n, shared, block) == best, (n, shared, block)


def test_cached_prefix_tokens_rejects_bad_arguments_by_name():
    for kwargs, name in (({"block_size": 0}, "block_size"), ({"prompt_len": 0}, "prompt_len"),
                         ({"shared_len": -1}, "shared_len")):
        with pytest.raises(ValueError, match=name):
            F.cached_prefix_tokens(**{"prompt_len": 8, "shared_len": 4, "block_size": 4, **kwargs})


def test_prefix_hit_rate_of_a_shared_system_prompt():
    # Four requests: a 32-token system prompt and 16 own tokens each; the first fills the cache.
    assert F.prefix_hit_rate([48] * 4, [0, 32, 32, 32], 16) == 3 * 32 / (4 * 48)
    assert F.prefix_hit_rate([50, 50], [0, 40], 16) == 32 / 100, "a 40-token prefix fills 2 blocks of 16"
    assert F.prefix_hit_rate([50, 50], [0, 0], 16) == 0


def test_block_boundary_loss_of_a_300_token_system_prompt():
    assert F.block_boundary_loss(330, 300, 16) == 12, "288 of 300 in blocks of 16, all 300 token by token"
    assert F.block_boundary_loss(330, 300, 128) == 44
    assert F.block_boundary_loss(330, 300, 1) == 0
    assert F.block_boundary_loss(330, 320, 16) == 0, "a prefix that ends on a boundary loses nothing"
    assert F.block_boundary_loss(300, 300, 16) == 299 - 288, "a whole prompt: radix keeps all but the last token"
    np.testing.assert_array_equal(F.block_boundary_loss(100, np.array([15, 16, 17]), 16), [15, 0, 1])
    with pytest.raises(ValueError, match="block_size"):
        F.block_boundary_loss(10, 5, 0)


def test_the_expected_block_boundary_loss_is_the_mean_over_every_end_in_a_block():
    for block in (1, 2, 16, 128):
        ends = np.arange(10 * block, 11 * block)  # one prefix ending at each position of a block
        mean = np.mean(F.block_boundary_loss(20 * block, ends, block))
        assert F.expected_block_boundary_loss(block) == pytest.approx(mean) == (block - 1) / 2
    np.testing.assert_allclose(F.expected_block_boundary_loss(np.array([16, 32])), [7.5, 15.5])


def test_prefix_cache_savings_count_whole_blocks():
    s = F.prefix_cache_savings(40, 10, 3, TINY, block_size=16)
    assert s.cached_tokens == 32
    assert s.flops_with == F.prefill_flops(TINY, 32) + 3 * F.prefill_flops(TINY, 18, past=32)
    assert s.flops_without == 3 * F.prefill_flops(TINY, 50)
    assert s.ttft_ratio == pytest.approx(50 / 18)
    assert s.hit_rate == pytest.approx(F.prefix_hit_rate([50] * 3, [0, 40, 40], 16))
    aligned = F.prefix_cache_savings(2000, 50, 1000, "llama-2-13b", block_size=16)
    assert aligned == F.prefix_cache_savings(2000, 50, 1000, "llama-2-13b"), "2000 is 125 blocks of 16"
    assert aligned.hit_rate == pytest.approx(999 / 1000 * 2000 / 2050)


def test_ttft_flop_ratio_is_the_prompt_over_its_uncached_tail():
    # Matmuls and attention of a prefill against the same P + S keys both scale with the new tokens.
    for model in (TINY, "smollm2-135m", "llama-2-13b"):
        for p, s in ((2000, 50), (100, 7), (6240, 160)):
            assert F.prefix_cache_savings(p, s, 1, model).ttft_ratio == pytest.approx((p + s) / s)


def test_prefill_time_is_the_roofline_of_a_prefill():
    flops, moved = F.prefill_flops(TINY, 5, 3), F.prefill_bytes(TINY, 5, 2, 3)
    assert F.prefill_time(TINY, 5, 3, 2, 1e3, 1e2) == max(flops / 1e3, moved / 1e2)


def test_prefix_cache_ttft_explains_the_textbooks_40x():
    m = "llama-2-13b"
    without, with_hit = F.prefix_cache_ttft(m, 2000, 50, 2, **A100)
    assert without == pytest.approx(0.182, rel=0.01)
    # A 50-token suffix on an A100 is memory-bound: its TTFT is the time to read the weights and the KV.
    assert F.roofline_bound(F.prefill_flops(m, 50, 2000), F.prefill_bytes(m, 50, 2, 2000), **A100) == "memory"
    assert with_hit == pytest.approx(F.prefill_bytes(m, 50, 2, 2000) / A100["peak_bw"])
    assert without / with_hit == pytest.approx(13.4, rel=0.01)
    without, with_hit = F.prefix_cache_ttft(m, 6240, 160, 2, **A100)  # a compute-bound suffix
    assert without / with_hit == pytest.approx(40, rel=0.01)
    without, with_hit = F.prefix_cache_ttft(m, 2000, 50, 4, peak_flops=60e9, peak_bw=17e9)  # a 2-core CPU
    assert without / with_hit == pytest.approx(41, rel=0.01)
    prefixes = np.array([0, 100, 2000, 30000])
    without, with_hit = F.prefix_cache_ttft(m, prefixes, 50, 2, **A100, block_size=16)
    flop_ratio = [F.prefix_cache_savings(p, 50, 1, m, block_size=16).ttft_ratio for p in prefixes]
    assert np.all(without / with_hit <= np.array(flop_ratio) + 1e-9), "a roofline never beats the FLOP ratio"


# ---------------------------------------------------------------- attention's HBM traffic

def test_attention_hbm_bytes_counts_every_pass():
    n, d = 1000, 64
    # naive: Q, K, V, O once each (N·d), S written, read, P written, read (N² each)
    assert F.attention_hbm_bytes(n, d, 2) == 2 * (4 * n * d + 4 * n * n)
    # tiled: Q and O once, K and V once per query tile (⌈1000/128⌉ = 8 tiles)
    assert F.attention_hbm_bytes(n, d, 2, block_m=128) == 2 * (2 * n * d + 2 * n * d * 8)
    # one tile holding every query reads K and V once: the minimum, 4·N·d
    assert F.attention_hbm_bytes(n, d, 4, block_m=n) == 4 * 4 * n * d
    # doubling the tile halves the K/V passes; the tiled traffic has no N² term when N ≤ block_m
    big, small = F.attention_hbm_bytes(8192, 128, 2, 128), F.attention_hbm_bytes(8192, 128, 2, 64)
    assert small - big == 2 * 2 * 8192 * 128 * (128 - 64)
    assert np.allclose(F.attention_hbm_bytes(np.array([256, 512]), d, 2), [F.attention_hbm_bytes(256, d, 2),
                                                                          F.attention_hbm_bytes(512, d, 2)])
    with pytest.raises(ValueError, match="block_m"):
        F.attention_hbm_bytes(n, d, 2, block_m=0)


# ---------------------------------------------------------------- where the regimes change

def test_attention_crossover_is_where_attention_equals_the_matmuls():
    for name in ("smollm2-135m", "llama-7b"):
        n = F.attention_crossover_tokens(name)
        assert F.attention_flops(name, n, n) == pytest.approx(F.matmul_flops(name, n))
    assert F.attention_crossover_tokens("smollm2-135m") == pytest.approx(3.9e3, rel=0.01)
    assert F.attention_crossover_tokens("llama-7b") == pytest.approx(25.7e3, rel=0.01)


def test_decode_knee_batch_doubles_the_step_and_halves_the_ceiling():
    m, c = "llama-7b", 1024
    b = F.decode_knee_batch(m, c, 2)
    kv = F.kv_bytes_per_token_for(m, 2)
    assert b * kv * c == pytest.approx(F.weight_bytes(m, 2))
    # a memory-bound step there moves twice the weights (batch 1 already adds one sequence's K/V, hence
    # 2b / (b + 1) of its bytes); the throughput is half of bandwidth / (kv · c)
    one, knee = F.decode_bytes(m, 1, c, 2), F.decode_bytes(m, b, c, 2)
    assert knee == pytest.approx(2 * F.weight_bytes(m, 2), rel=1e-3)
    assert knee / one == pytest.approx(2 * b / (b + 1), rel=1e-3)
    assert (b / knee) / (1 / (kv * c)) == pytest.approx(0.5, rel=0.01)
    np.testing.assert_allclose(F.decode_knee_batch(m, np.array([512, 2048]), 2), [2 * b, b / 2])
    with pytest.raises(ValueError, match="context"):
        F.decode_knee_batch(m, 0)


def test_decode_ridge_batch_reaches_the_ridge_or_never():
    m, c, dtype_bytes = "smollm2-135m", 128, 4
    cpu = dict(peak_flops=60e9, peak_bw=17e9)
    b = F.decode_ridge_batch(m, c, dtype_bytes, **cpu)
    ridge = F.ridge_point(**cpu)
    assert F.decode_intensity(m, b, c, dtype_bytes) == pytest.approx(ridge)
    assert F.decode_intensity(m, np.floor(b), c, dtype_bytes) < ridge <= F.decode_intensity(m, np.ceil(b), c, dtype_bytes)
    # Llama-7B (32 KV heads) on an A100: K/V reads cap the intensity below the ridge at 2k tokens of context
    assert F.decode_ridge_batch("llama-7b", 2048, 2, **A100) == np.inf
    assert np.isfinite(F.decode_ridge_batch("llama-7b", 16, 2, **A100))
    got = F.decode_ridge_batch("llama-7b", np.array([16, 2048]), 2, **A100)
    assert np.isfinite(got[0]) and got[1] == np.inf


# ---------------------------------------------------------------- the ladder on a roofline (chapter 09)

def test_naive_generation_time_sums_one_full_prefill_per_step():
    steps = [F.prefill_time(TINY, n, 0, 2, **A100) for n in range(5, 5 + 7)]
    assert F.naive_generation_time(TINY, 5, 7, 2, **A100) == pytest.approx(sum(steps))


def test_cached_generation_time_is_one_prefill_then_decode_steps():
    want = F.roofline_time(3 * F.prefill_flops(TINY, 5), F.prefill_bytes(TINY, 15, 2), **A100)
    want += sum(F.roofline_time(F.decode_flops(TINY, c, 3), F.decode_bytes(TINY, 3, c, 2), **A100) for c in (6, 7, 8))
    assert F.cached_generation_time(TINY, 5, 4, 2, **A100, batch=3) == pytest.approx(want)
    assert F.cached_generation_time(TINY, 5, 1, 2, **A100) == pytest.approx(F.prefill_time(TINY, 5, 0, 2, **A100))


def test_the_textbooks_naive_and_optimised_7b_figures_on_an_a100():
    # Naive: compute-bound steps that grow with the sequence. The textbook's 5-10 tok/s is a fraction of this roof.
    assert F.generation_tok_s("llama-7b", 128, 512, 2, **A100, cache=False) == pytest.approx(59.2, abs=0.5)
    assert F.generation_tok_s("llama-7b", 512, 1024, 2, **A100, cache=False) == pytest.approx(21.7, abs=0.5)
    # One cached stream reads all 13.5 GB of weights per token: at most about 146 tok/s, below the textbook's 200-500,
    one = F.generation_tok_s("llama-7b", 512, 512, 2, **A100)
    assert one == pytest.approx(146, abs=2)
    assert F.weight_bytes("llama-7b", 2) / 2.039e12 == pytest.approx(1 / 151, rel=0.01)
    # which batching reaches: 16 sequences share each weight read.
    assert F.generation_tok_s("llama-7b", 512, 512, 2, **A100, batch=16) == pytest.approx(1530, rel=0.01)
    assert F.decode_bytes_per_token("llama-7b", 16, 1024) / 1e9 == pytest.approx(1.38, abs=0.01)
    assert F.decode_bytes_per_token("llama-7b", 1, 1024) == F.decode_bytes("llama-7b", 1, 1024)


def test_generation_tok_s_checks_its_arguments():
    with pytest.raises(ValueError, match="batch"):
        F.generation_tok_s(TINY, 5, 5, 2, **A100, batch=2, cache=False)
    with pytest.raises(ValueError, match="new_tokens"):
        F.cached_generation_time(TINY, 5, 0, 2, **A100)


def test_bits_per_weight_of_the_formats_chapter_10_names():
    assert F.bits_per_weight(4, 32, 16, 16) == 5.0           # Q4_1: the embedded GGUF's decoder
    assert F.bits_per_weight(8, 32) == 8.5                   # Q8_0: its embedding
    assert F.bits_per_weight(4, 64, 32) == 4.5               # NF4 (QLoRA), fp32 absmax per 64
    assert F.bits_per_weight(4, 128, 16, 4) == pytest.approx(4.16, abs=0.01)  # AWQ / GPTQ int4, g128
    assert F.bits_per_weight(16) == 16.0
    with pytest.raises(ValueError, match="group_size"):
        F.bits_per_weight(4, 0)


def test_quantized_weights_shrink_only_the_weight_term_of_a_decode_step():
    full = F.decode_bytes("llama-7b", 1, 1024, 2)
    assert F.decode_bytes("llama-7b", 1, 1024, 2, weight_bits=16) == pytest.approx(full)
    int4 = F.decode_bytes("llama-7b", 16, 1024, 2, weight_bits=4)
    kv_and_act = F.decode_bytes("llama-7b", 16, 1024, 2) - F.weight_bytes("llama-7b", 2)
    assert int4 == pytest.approx(F.weight_bytes("llama-7b", 0.5) + kv_and_act)
    # batch 1 on an A100: almost the whole step is weights, so int4 is nearly 4x; at batch 16 the K/V dilutes it
    one = [F.predicted_decode_tok_s("llama-7b", 1, 1024, 2, **A100, weight_bits=w) for w in (16, 4)]
    sixteen = [F.predicted_decode_tok_s("llama-7b", 16, 1024, 2, **A100, weight_bits=w) for w in (16, 4)]
    assert 3.5 < one[1] / one[0] < 4
    assert 1.5 < sixteen[1] / sixteen[0] < one[1] / one[0]
    assert F.decode_bytes_per_token("llama-7b", 16, 1024, weight_bits=4) == pytest.approx(int4 / 16)


# ---------------------------------------------------------------- tensor parallelism (chapter 11)

def test_ring_all_reduce_is_reduce_scatter_then_all_gather():
    """2(p - 1) hops and 2(p - 1)/p of the bytes; each half is a reduce-scatter or an all-gather; one rank: free."""
    n, hop, bw, base = 3000, 1e-5, 1e9, 7e-6
    assert F.ring_all_reduce_seconds(n, 1, hop, bw, base) == 0
    assert F.ring_all_reduce_seconds(n, 3, hop, bw, base) == pytest.approx(base + 4 * hop + 4 / 3 * n / bw)
    assert F.all_reduce_seconds(n, 3, hop, bw) == pytest.approx(4 * hop + 4 / 3 * n / bw)
    for p in (2, 3, 8):
        rs = F.reduce_scatter_seconds(n, p, hop, bw)
        assert rs == pytest.approx((p - 1) * hop + (p - 1) / p * n / bw)
        assert F.all_gather_seconds(n, p, hop, bw) == rs
        assert rs + F.all_gather_seconds(n, p, hop, bw) == pytest.approx(F.all_reduce_seconds(n, p, hop, bw))
    # The bus-bandwidth factor tends to 2: a large ring all-reduce moves about twice the payload through each link.
    assert F.ring_all_reduce_seconds(1e9, 1000, 0, 1e9) == pytest.approx(2 * 999 / 1000)
    assert list(F.ring_all_reduce_seconds(n, np.array([1, 2, 4]), hop, bw)) == pytest.approx(
        [0, 2 * hop + n / bw, 6 * hop + 1.5 * n / bw])
    with pytest.raises(ValueError, match="ranks"):
        F.ring_all_reduce_seconds(n, 0, hop, bw)


def test_one_shot_all_reduce_is_flat_in_ranks_but_reads_every_payload():
    lat, bw = 9e-6, 450e9
    assert F.one_shot_all_reduce_seconds(4096, 1, lat, bw) == 0
    small = [F.one_shot_all_reduce_seconds(4096, p, lat, bw) for p in (2, 4, 8)]
    assert max(small) - min(small) < 0.1e-6, "a few KB: one latency whatever p"
    assert F.one_shot_all_reduce_seconds(64 << 20, 8, lat, bw) > 3 * F.ring_all_reduce_seconds(
        64 << 20, 8, 1e-6, bw), "64 MiB: (p - 1) whole payloads into each rank lose to the ring's 2(p - 1)/p"


def test_pipeline_bubble():
    assert F.pipeline_bubble(1, 1) == 0
    assert F.pipeline_bubble(4, 1) == pytest.approx(3 / 4)
    assert F.pipeline_bubble(3, 8) == pytest.approx(2 / 10)
    assert list(F.pipeline_bubble(4, np.array([1, 2, 4, 8]))) == pytest.approx([3 / 4, 3 / 5, 3 / 7, 3 / 11])
    for kwargs in ({"stages": 0}, {"micro_batches": 0}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            F.pipeline_bubble(**{"stages": 2, "micro_batches": 2, **kwargs})


def test_all_reduce_picks_the_algorithm_by_payload():
    """Decode's few KB: a low-latency algorithm at about 10-20 µs, nearly flat in p; 64 MiB: a bandwidth one."""
    from mini_engine.course import interconnects as I
    h100, a100, t4 = (I.SYSTEMS[k] for k in ("H100 × NVLink 4 (NVSwitch)", "A100 × NVLink 3 (NVSwitch)",
                                              "T4 × PCIe 3 (one host)"))
    small = {p: I.all_reduce(h100, 16 * 1024, p) for p in (2, 4, 8)}
    assert all(5e-6 < c.seconds < 20e-6 for c in small.values()), small
    assert small[8].seconds < 2 * small[2].seconds, "nearly flat in p"
    assert small[8].algorithm == "vLLM one-shot"
    # vLLM's measured latency at 4 KB, as quoted; a one-shot read adds (p - 1) payloads over the link.
    assert I.all_reduce_options(h100, 4096, 8)["vLLM one-shot"] == pytest.approx(9.3e-6 + 7 * 4096 / 450e9)
    # NCCL's own model: LL ring on NVLink at p = 8, base 6.6 µs and 14 hops of 0.6 µs, half the bandwidth.
    assert I.all_reduce_options(a100, 4096, 8)["NCCL ring, LL"] == pytest.approx(
        (6.6 + 14 * 0.6) * 1e-6 + 14 / 8 * 4096 / 150e9)
    big = I.all_reduce(h100, 64 << 20, 8)
    assert big.algorithm == "NCCL NVLS" and big.seconds > 100e-6
    assert I.all_reduce(a100, 64 << 20, 4).algorithm in ("NCCL ring, Simple", "NCCL ring, LL128")
    assert "vLLM one-shot" not in I.all_reduce_options(a100, 4096, 3), "vLLM's kernel takes 2, 4, 6 or 8 GPUs"
    assert "vLLM one-shot" not in I.all_reduce_options(t4, 4096, 2), "no NVLink on a T4"
    assert I.all_reduce(t4, 4096, 1) == I.AllReduceCost(0.0, "")
    # Two nodes: the ring crosses the network, slower than one node's NVLink.
    ib = I.SYSTEMS["H100 × 2 nodes, InfiniBand NDR"]
    assert I.all_reduce(ib, 4096, 8).seconds > I.all_reduce(h100, 4096, 8).seconds
    assert "vLLM one-shot" not in I.all_reduce_options(ib, 4096, 8), "vLLM's kernel needs one node"


def test_tensor_parallel_decode_uses_each_gpus_own_roofline():
    from mini_engine.course import interconnects as I
    a100 = I.tensor_parallel_decode(I.SYSTEMS["A100 × NVLink 3 (NVSwitch)"], "llama-70b-gqa", 8, 4)
    h100 = I.tensor_parallel_decode(I.SYSTEMS["H100 × NVLink 4 (NVSwitch)"], "llama-70b-gqa", 8, 4)
    roof = I.SYSTEMS["H100 × NVLink 4 (NVSwitch)"].roof
    assert h100.one_rank_s == F.roofline_time(F.decode_flops("llama-70b-gqa", 512, 8),
                                                     F.decode_bytes("llama-70b-gqa", 8, 512),
                                                     roof.peak_flops, roof.peak_bw)
    assert h100.one_rank_s < a100.one_rank_s and h100.compute_s == pytest.approx(h100.one_rank_s / 4)
    assert h100.collectives == 160 and h100.payload_bytes == 8 * 8192 * 2
    assert h100.step_s == pytest.approx(h100.compute_s + 160 * h100.all_reduce.seconds)
    assert 3 < h100.speedup < 4 and h100.communication_share < 0.2, "a 70B model at batch 8 gains most of p"
    small = I.tensor_parallel_decode(I.SYSTEMS["H100 × NVLink 4 (NVSwitch)"], "smollm2-135m", 1, 2)
    assert small.speedup < 0.5, "SmolLM2 at batch 1: slower on two GPUs than one, even on NVLink"
