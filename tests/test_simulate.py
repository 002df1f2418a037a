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
