"""The NumPy online softmax and its stepper widget."""
import numpy as np
import pytest

from mini_engine.course import online_softmax
from mini_engine.course.online_softmax import (
    online_softmax_attention, online_softmax_states, plot_online_softmax, softmax_attention)


def problem(n=50, rows=3, head_dim=5, seed=0):
    rng = np.random.default_rng(seed)
    # Large, spread-out scores: a naive exp() would overflow, so this also checks the max trick.
    return rng.normal(scale=30.0, size=(rows, n)), rng.normal(size=(n, head_dim))


@pytest.mark.parametrize("tile", [1, 7, 16, 50, 64])
def test_final_state_is_exact_softmax_attention(tile):
    scores, values = problem()
    np.testing.assert_allclose(online_softmax_attention(scores, values, tile),
                               softmax_attention(scores, values), rtol=1e-12, atol=1e-12)


def test_each_state_is_the_exact_answer_over_the_prefix_seen():
    scores, values = problem(n=37)
    states = list(online_softmax_states(scores, values, tile=8))
    assert [s.seen for s in states] == [8, 16, 24, 32, 37]
    assert [s.tiles for s in states] == [1, 2, 3, 4, 5]
    for state in states:
        prefix_scores, prefix_values = scores[:, :state.seen], values[:state.seen]
        np.testing.assert_allclose(state.m, prefix_scores.max(axis=-1))
        np.testing.assert_allclose(state.l, np.exp(prefix_scores - state.m[:, None]).sum(axis=-1))
        np.testing.assert_allclose(state.output, softmax_attention(prefix_scores, prefix_values),
                                   rtol=1e-12, atol=1e-12)


def test_single_query_row_and_bad_arguments():
    scores, values = problem(rows=1)
    np.testing.assert_allclose(online_softmax_attention(scores[0], values, 9),
                               softmax_attention(scores[0], values), rtol=1e-12)
    with pytest.raises(ValueError, match="tile"):
        next(online_softmax_states(scores, values, 0))
    with pytest.raises(ValueError, match="values"):
        next(online_softmax_states(scores, values[:-1], 4))


def test_plot_shows_the_running_output_and_converges_at_the_last_tile():
    rng = np.random.default_rng(1)
    scores, values = rng.normal(size=20), rng.normal(size=(20, 3))
    states = list(online_softmax_states(scores, values, tile=6))
    for tiles_seen in (1, len(states)):
        bars = plot_online_softmax(scores, values, 6, tiles_seen).axes[2].patches
        np.testing.assert_allclose([b.get_height() for b in bars], states[tiles_seen - 1].output)
    np.testing.assert_allclose(states[-1].output, softmax_attention(scores, values), rtol=1e-12)


def test_stepper_widget_redraws_when_the_slider_moves(monkeypatch):
    drawn = []

    def recording_plot(scores, values, tile, tiles_seen):
        drawn.append(tiles_seen)
        return plot_online_softmax(scores, values, tile, tiles_seen)

    monkeypatch.setattr(online_softmax, "plot_online_softmax", recording_plot)
    slider, picture, errors = online_softmax.online_softmax_stepper(n=20, tile=6).children
    assert (slider.min, slider.max) == (1, 4)
    pictures = [picture.value]
    for value in (2, 4, 1):
        slider.value = value
        pictures.append(picture.value)
    assert drawn == [1, 2, 4, 1], "each slider move must redraw the figure for that many tiles"
    assert errors.outputs == (), f"drawing failed: {errors.outputs}"
    assert pictures[0] == pictures[3] and len(set(pictures)) == 3, "the picture must change with the slider"
