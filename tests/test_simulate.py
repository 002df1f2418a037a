"""Invariants of the batching and fragmentation simulators, and the seed's utilisation figures."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_engine import simulate as S

POLICIES = [S.simulate_static, S.simulate_continuous]
lengths_st = st.lists(st.integers(1, 30), min_size=1, max_size=40)


def _check_timeline(run: S.BatchRun):
    """Every request runs for exactly its length, uninterrupted, in one lane, and lanes never overlap."""
    assert run.tokens == run.lengths.sum()
    assert (run.timeline >= 0).sum() == run.tokens
    np.testing.assert_array_equal(run.finish_step, run.start_step + run.lengths)
    assert run.steps == run.finish_step.max()
    for i, (start, finish, lane) in enumerate(zip(run.start_step, run.finish_step, run.lane)):
        assert np.all(run.timeline[start:finish, lane] == i)
        assert (run.timeline == i).sum() == run.lengths[i]
    assert run.utilisation == pytest.approx(run.tokens / (run.steps * run.batch_size))


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, batch_size=st.integers(1, 6))
def test_every_policy_finishes_every_request(lengths, batch_size):
    for simulate in POLICIES:
        _check_timeline(simulate(lengths, batch_size))


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, batch_size=st.integers(1, 6))
def test_continuous_never_loses_to_static(lengths, batch_size):
    static = S.simulate_static(lengths, batch_size)
    continuous = S.simulate_continuous(lengths, batch_size)
    assert continuous.steps <= static.steps
    assert continuous.utilisation >= static.utilisation


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, batch_size=st.integers(1, 6))
def test_continuous_keeps_every_lane_busy_while_requests_wait(lengths, batch_size):
    run = S.simulate_continuous(lengths, batch_size)
    assert np.all(np.diff(run.start_step) >= 0)  # admitted in arrival order
    last_admission = run.start_step.max()
    assert np.all(run.timeline[:last_admission] >= 0)


def test_static_batches_wait_for_their_longest_request():
    run = S.simulate_static([3, 1, 2, 5, 1], batch_size=2)
    np.testing.assert_array_equal(run.start_step, [0, 0, 3, 3, 8])
    assert run.steps == 3 + 5 + 1
    assert run.timeline[2, 1] == -1  # request 1 finished after one step; its lane idles until the batch ends


def test_continuous_refills_a_lane_the_step_after_it_frees():
    run = S.simulate_continuous([3, 1, 2, 5, 1], batch_size=2)
    np.testing.assert_array_equal(run.start_step, [0, 0, 1, 3, 3])
    np.testing.assert_array_equal(run.lane, [0, 1, 1, 0, 1])  # ties go to the lowest lane
    assert run.steps == 8


def test_utilisation_goes_from_about_half_to_above_90_percent():
    # The documented mix: lengths uniform in [1, 200], 32 lanes, 1000 requests waiting.
    for seed in range(3):
        lengths = S.sample_lengths(1000, mean=100, spread=1.0, seed=seed)
        static = S.simulate_static(lengths, 32).utilisation
        continuous = S.simulate_continuous(lengths, 32).utilisation
        assert 0.45 < static < 0.58
        assert continuous > 0.9


def test_equal_lengths_need_no_continuous_batching():
    lengths = S.sample_lengths(64, mean=50, spread=0.0)
    assert np.all(lengths == 50)
    assert S.simulate_static(lengths, 8).utilisation == 1.0
    assert S.simulate_continuous(lengths, 8).steps == S.simulate_static(lengths, 8).steps


def test_sample_lengths_range_and_determinism():
    lengths = S.sample_lengths(5000, mean=100, spread=1.0, seed=3)
    assert lengths.min() == 1 and lengths.max() == 200
    assert abs(lengths.mean() - 100) < 3
    np.testing.assert_array_equal(lengths, S.sample_lengths(5000, mean=100, spread=1.0, seed=3))
    narrow = S.sample_lengths(1000, mean=100, spread=0.2, seed=3)
    assert narrow.min() >= 80 and narrow.max() <= 120
    with pytest.raises(ValueError, match="spread"):
        S.sample_lengths(10, 100, 1.5)


def test_bad_batches_are_rejected():
    with pytest.raises(ValueError, match="batch_size"):
        S.simulate_continuous([1, 2], 0)
    with pytest.raises(ValueError, match="lengths"):
        S.simulate_static([3, 0], 2)
    with pytest.raises(ValueError, match="lengths"):
        S.simulate_continuous([], 2)


def test_fragmentation_by_hand():
    # max_len 64, blocks of 16: reservations 64 each vs blocks [1, 1, 2, 3].
    frag = S.simulate_fragmentation([5, 16, 17, 40], max_len=64, block_size=16)
    assert frag.used == 78
    assert frag.reserved_contiguous == 256 and frag.wasted_contiguous == 178
    assert frag.reserved_paged == 7 * 16 and frag.wasted_paged == 11 + 0 + 15 + 8
    assert frag.pool_tokens == 256
    assert frag.max_concurrent_contiguous == 4
    assert frag.max_concurrent_paged == 9  # 16 blocks / 1.75 blocks per request
    assert frag.waste_fraction_contiguous == pytest.approx(178 / 256)


def test_fragmentation_at_the_seed_scale():
    # Requests use a quarter of a 2048-token reservation on average.
    lengths = S.sample_lengths(500, mean=512, spread=1.0, seed=0)
    frag = S.simulate_fragmentation(lengths, max_len=2048, block_size=16)
    assert 0.6 < frag.waste_fraction_contiguous < 0.8
    assert frag.wasted_paged < 16 * len(lengths)
    assert 2 <= frag.max_concurrent_paged / frag.max_concurrent_contiguous <= 8


def test_fragmentation_rejects_requests_longer_than_the_reservation():
    with pytest.raises(ValueError, match="max_len"):
        S.simulate_fragmentation([10, 100], max_len=64, block_size=16)


# ---------------------------------------------------------------- a fixed KV budget (chapter 07)

@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 200), min_size=1, max_size=60), block_size=st.sampled_from([1, 4, 16, 32]),
       budget_blocks=st.integers(13, 400))
def test_kv_budget_admits_the_longest_prefix_that_fits(lengths, block_size, budget_blocks):
    budget = budget_blocks * block_size
    run = S.KVBudgetRun(np.array(lengths), budget, max_model_len=200, block_size=block_size)
    blocks = [-(-n // block_size) for n in lengths]
    fit = run.paged_fit
    assert sum(blocks[:fit]) <= budget_blocks
    assert fit == len(lengths) or sum(blocks[:fit + 1]) > budget_blocks
    assert run.contiguous_fit == min(len(lengths), budget // 200)
    assert np.all((run.waste_paged_tokens >= 0) & (run.waste_paged_tokens <= block_size - 1))
    assert fit >= run.contiguous_fit  # a block never holds more than the reservation would


def test_kv_budget_by_hand():
    run = S.KVBudgetRun(np.array([5, 16, 17, 40, 64, 3]), budget_tokens=128, max_model_len=64, block_size=16)
    assert run.contiguous_fit == 2
    assert run.paged_fit == 4  # blocks 1 + 1 + 2 + 3 = 7 of 8; the fifth request needs 4 more
    assert run.concurrency_multiple == 2.0
    np.testing.assert_allclose(run.waste_contiguous, [59 / 64, 48 / 64, 47 / 64, 24 / 64, 0, 61 / 64])
    np.testing.assert_array_equal(run.waste_paged_tokens, [11, 0, 15, 8, 0, 13])
    assert run.waste_fraction_paged == pytest.approx(47 / (12 * 16))


@pytest.mark.parametrize("mix", S.LENGTH_MIXES)
def test_seed_figures_a_quarter_full_reservation(mix):
    # Requests average a quarter of a 2048-token reservation: 60–80% waste, about 4× the concurrency.
    for seed in range(3):
        run = S.simulate_kv_budget(64 * 2048, 2048, 16, mix=mix, mean_len=512, seed=seed)
        assert run.contiguous_fit == 64
        assert 0.6 < run.waste_fraction_contiguous < 0.8
        assert 3.3 < run.concurrency_multiple < 5.2
        assert run.waste_paged_tokens.max() <= 15 and 6 < run.waste_paged_tokens.mean() < 9  # about half a block


def test_seed_figures_less_waste_means_less_gain():
    run = S.simulate_kv_budget(64 * 2048, 2048, 16, mix="uniform", mean_len=768)
    assert 0.6 < run.waste_fraction_contiguous < 0.65
    assert 2.2 < run.concurrency_multiple < 2.8


def test_seed_figures_up_to_8x_for_chat_against_a_long_reservation():
    run = S.simulate_kv_budget(64 * 4096, 4096, 16, mix="lognormal", mean_len=512)
    assert 7 < run.concurrency_multiple < 9.5
    assert run.waste_fraction_paged < 0.02


def test_lognormal_mix_is_long_tailed_with_the_requested_mean():
    lengths = S.sample_context_lengths(100_000, "lognormal", 512, max_model_len=10**9, seed=1)
    assert abs(lengths.mean() / 512 - 1) < 0.03
    assert np.median(lengths) < 0.7 * lengths.mean()  # most requests are short...
    assert (lengths > 4 * 512).mean() > 0.01          # ...and a few are very long
    capped = S.sample_context_lengths(1000, "lognormal", 512, max_model_len=600, seed=1)
    assert capped.min() >= 1 and capped.max() == 600


def test_kv_budget_rejects_bad_parameters():
    with pytest.raises(ValueError, match="mix"):
        S.simulate_kv_budget(mix="zipf")
    with pytest.raises(ValueError, match="budget_tokens"):
        S.simulate_kv_budget(budget_tokens=1000, max_model_len=2048)
    with pytest.raises(ValueError, match="block_size"):
        S.simulate_kv_budget(block_size=0)
    with pytest.raises(ValueError, match="sigma"):
        S.simulate_kv_budget(sigma=0)
