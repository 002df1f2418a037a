"""Invariants of the batching and KV-memory simulators, and the textbook's utilisation and waste figures."""
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
def test_textbook_figures_a_quarter_full_reservation(mix):
    # Requests average a quarter of a 2048-token reservation: 60–80% waste, about 4× the concurrency.
    for seed in range(3):
        run = S.simulate_kv_budget(64 * 2048, 2048, 16, mix=mix, mean_len=512, seed=seed)
        assert run.contiguous_fit == 64
        assert 0.6 < run.waste_fraction_contiguous < 0.8
        assert 3.3 < run.concurrency_multiple < 5.2
        assert run.waste_paged_tokens.max() <= 15 and 6 < run.waste_paged_tokens.mean() < 9  # about half a block


def test_textbook_figures_less_waste_means_less_gain():
    run = S.simulate_kv_budget(64 * 2048, 2048, 16, mix="uniform", mean_len=768)
    assert 0.6 < run.waste_fraction_contiguous < 0.65
    assert 2.2 < run.concurrency_multiple < 2.8


def test_textbook_figures_up_to_8x_for_chat_against_a_long_reservation():
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


# ---------------------------------------------------------------- the same budget over time (chapter 07)

def test_kv_layouts_by_hand():
    # A budget of 8 slots; requests A-D of 2, 5, 1 and 3 tokens reserve 4, 4, 2 and 6 slots.
    lengths = np.array([2, 5, 1, 3])
    contiguous = S._serve("contiguous", lengths, np.array([4, 4, 2, 6]), 8)
    # A at 0-3 and B at 4-7; C waits for A to leave at step 2 and takes 0-1; D (6) waits: at step 3, when C
    # leaves, 4 slots are free, really too few; at step 5 B leaves and D takes 0-5.
    np.testing.assert_array_equal(contiguous.start, [0, 0, 2, 5])
    np.testing.assert_array_equal(contiguous.offset, [0, 4, 0, 0])
    assert contiguous.events.tolist() == [[0, 2, 0, 0, 2], [2, 2, 2, 2, 6], [3, 1, 4, 4, 6], [5, 1, 2, 2, 0],
                                          [8, 0, 8, 8, 0]]
    assert contiguous.stranded.max() == 0 and contiguous.filling_until == 5
    assert contiguous.internal_waste_fraction == pytest.approx(1 - 11 / 16)
    # Paged in blocks of 2: A holds 2 slots, B 6, C 2, D 4.
    paged = S._serve("paged", lengths, -(-lengths // 2) * 2, 8)
    np.testing.assert_array_equal(paged.start, [0, 0, 2, 5])
    assert paged.internal_waste_fraction == pytest.approx(1 - 11 / 14)
    assert paged.mean_running == pytest.approx((2 * 2 + 2 * 1 + 1 * 2) / 5)  # steps 0-1, 2, 3-4


def test_kv_layouts_strand_memory_only_with_reservations_of_different_sizes():
    # Three 4-slot reservations, A and C leave first: 8 slots free, in two holes of 4; D needs 6.
    lengths, held = np.array([1, 9, 1, 3]), np.array([4, 4, 4, 6])
    run = S._serve("contiguous", lengths, held, 12)
    first = run.events[0]
    assert tuple(first[1:]) == (3, 0, 0, 6)  # three running, nothing free, the next needs 6
    after = run.events[1]
    assert tuple(after[1:]) == (1, 8, 4, 6) and run.stranded[1] == 8  # 8 free, but no hole of 6
    assert run.start[3] == 9  # it waits for B
    equal, _ = S.simulate_kv_layouts(reserve="max_model_len")
    assert equal.stranded.max() == 0


@pytest.mark.parametrize("reserve", S.RESERVATIONS)
def test_kv_layouts_conserve_memory_and_never_exceed_the_budget(reserve):
    contiguous, paged = S.simulate_kv_layouts(16 * 1024, 1024, 16, "lognormal", 256, reserve, seed=3)
    for run in (contiguous, paged):
        assert np.all(run.start >= 0) and np.all(np.diff(run.start) >= 0)  # first come, first served
        for step in run.events[:, 0]:
            ids, written = run.snapshot(step)
            assert run.held[ids].sum() <= run.budget_tokens
            assert np.all((written >= 0) & (written < run.lengths[ids]))
        assert np.all(run.events[:, 2] == run.budget_tokens - np.array(
            [run.held[run.snapshot(t)[0]].sum() for t in run.events[:, 0]]))
    ids, _ = contiguous.snapshot(int(contiguous.events[len(contiguous.events) // 2, 0]))
    spans = sorted(zip(contiguous.offset[ids], contiguous.offset[ids] + contiguous.held[ids]))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # reservations never overlap
    assert paged.mean_running >= contiguous.mean_running


def test_kv_layouts_textbook_waste_and_concurrency():
    contiguous, paged = S.simulate_kv_layouts()  # a chat mix averaging 512 against 2048-token reservations
    assert 0.6 < contiguous.internal_waste_fraction < 0.8  # the textbook's "waste from 60–80%"
    assert paged.internal_waste_fraction < 0.02 and np.all(paged.held - paged.lengths <= 15)  # "≤15 tokens"
    assert contiguous.mean_running == 64 and 2 < paged.mean_running / contiguous.mean_running < 4
    uneven, _ = S.simulate_kv_layouts(reserve="per request")
    assert uneven.stranded_time_fraction > 0.5  # uneven reservations leave holes most of the time

