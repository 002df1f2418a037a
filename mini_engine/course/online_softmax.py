"""Online softmax in NumPy: the recurrence FlashAttention runs on chip, one key tile at a time.

softmax-weighted attention over N keys, o = sum_j exp(s_j) v_j / sum_j exp(s_j), seems to need every
score before the first output can be formed (the max for stability, the sum for normalising). The
online form keeps three running quantities per query instead and folds in one tile of keys at a time:

    m_new = max(m, max_j s_j)                       running max (for numerical safety)
    l_new = l * exp(m - m_new) + sum_j exp(s_j - m_new)      running denominator
    acc_new = acc * exp(m - m_new) + sum_j exp(s_j - m_new) v_j    running numerator

The factor exp(m - m_new) re-expresses what was accumulated under the old max in terms of the new
one, so after any number of tiles acc / l is exactly the attention output over the keys seen so far.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np


@dataclass(frozen=True)
class OnlineSoftmaxState:
    """What the recurrence holds after `tiles` tiles, i.e. the first `seen` keys."""

    tiles: int
    seen: int
    m: np.ndarray    # running max of the scores, one per query row
    l: np.ndarray    # running sum of exp(score - m)
    acc: np.ndarray  # running sum of exp(score - m) * value, [..., D]

    @property
    def output(self) -> np.ndarray:
        """The attention output over the keys seen so far (normalising is the only extra step)."""
        return self.acc / self.l[..., None]


def softmax_attention(scores: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The exact answer, all scores at once: softmax(scores) @ values. scores [..., N], values [N, D]."""
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)) @ values


def online_softmax_states(scores: np.ndarray, values: np.ndarray, tile: int) -> Iterator[OnlineSoftmaxState]:
    """Yield the running state after each tile of `tile` keys. scores [..., N], values [N, D]."""
    scores = np.asarray(scores, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    if tile < 1:
        raise ValueError(f"tile must be at least 1, got {tile}")
    if scores.shape[-1] != values.shape[0]:
        raise ValueError(f"scores cover {scores.shape[-1]} keys but values has {values.shape[0]} rows")
    m = np.full(scores.shape[:-1], -np.inf)
    l = np.zeros(scores.shape[:-1])
    acc = np.zeros((*scores.shape[:-1], values.shape[1]))
    for tiles, start in enumerate(range(0, scores.shape[-1], tile), start=1):
        s = scores[..., start:start + tile]
        m_new = np.maximum(m, s.max(axis=-1))
        rescale = np.exp(m - m_new)          # 0 on the first tile, where m is -inf
        p = np.exp(s - m_new[..., None])
        l = l * rescale + p.sum(axis=-1)
        acc = acc * rescale[..., None] + p @ values[start:start + tile]
        m = m_new
        yield OnlineSoftmaxState(tiles, start + s.shape[-1], m, l, acc)


def online_softmax_attention(scores: np.ndarray, values: np.ndarray, tile: int) -> np.ndarray:
    """The same answer as softmax_attention, computed tile by tile."""
    *_, last = online_softmax_states(scores, values, tile)
    return last.output


def plot_online_softmax(scores: np.ndarray, values: np.ndarray, tile: int, tiles_seen: int):
    """A standalone matplotlib Figure of the state after `tiles_seen` tiles for one query row.

    scores [N], values [N, D]. Left: the scores, those seen so far in colour, and the running max.
    Middle: m and l after each tile. Right: the running output next to the exact answer.
    """
    from matplotlib.figure import Figure

    states = list(online_softmax_states(scores, values, tile))
    state = states[tiles_seen - 1]
    exact = softmax_attention(scores, values)
    fig = Figure(figsize=(13, 3.4))
    ax_scores, ax_stats, ax_out = fig.subplots(1, 3)

    seen = np.arange(len(scores)) < state.seen
    ax_scores.bar(np.arange(len(scores)), scores, color=np.where(seen, "tab:blue", "lightgray"))
    ax_scores.axhline(float(state.m), color="tab:red", label=f"running max m = {float(state.m):.2f}")
    for boundary in range(tile, len(scores), tile):
        ax_scores.axvline(boundary - 0.5, color="black", lw=0.5, alpha=0.3)
    ax_scores.set(title=f"scores: {state.seen}/{len(scores)} keys seen", xlabel="key position")
    ax_scores.legend(loc="lower right", fontsize=8)

    steps = np.arange(1, len(states) + 1)
    ax_stats.plot(steps[:tiles_seen], [float(s.m) for s in states[:tiles_seen]], "o-", color="tab:red",
                  label="running max m")
    ax_stats.plot(steps[:tiles_seen], [float(s.l) for s in states[:tiles_seen]], "s-", color="tab:green",
                  label="running sum l")
    ax_stats.set(title="softmax statistics per tile", xlabel="tiles seen", xlim=(0.5, len(states) + 0.5))
    ax_stats.legend(fontsize=8)

    dims = np.arange(values.shape[1])
    ax_out.bar(dims, state.output, color="tab:blue", alpha=0.7, label="running output acc / l")
    ax_out.plot(dims, exact, "k_", markersize=22, mew=2, label="exact softmax(s) @ V")
    error = np.abs(state.output - exact).max()
    ax_out.set(title=f"output after tile {tiles_seen}/{len(states)}: max error {error:.1e}",
               xlabel="output dimension")
    ax_out.legend(fontsize=8)
    fig.tight_layout()
    return fig


def online_softmax_stepper(n: int = 48, tile: int = 8, head_dim: int = 6, seed: int = 0):
    """An ipywidgets slider over tiles: watch m, l and the running output converge on the exact answer.

    Returns a VBox (slider, picture, error area). The figure is rendered to PNG in an Image widget,
    like the course's other widgets, so it redraws the same way in Jupyter, Colab and VS Code.
    """
    import io

    import ipywidgets as widgets

    rng = np.random.default_rng(seed)
    scores = rng.normal(scale=2.0, size=n)
    values = rng.normal(size=(n, head_dim))
    slider = widgets.IntSlider(value=1, min=1, max=-(-n // tile), description="tiles seen",
                               continuous_update=False)
    picture, errors = widgets.Image(format="png"), widgets.Output()

    def draw(tiles_seen: int) -> None:
        buf = io.BytesIO()
        plot_online_softmax(scores, values, tile, tiles_seen).savefig(buf, format="png", dpi=80)
        picture.value = buf.getvalue()

    def redraw(change) -> None:
        errors.outputs = ()
        with errors:  # in a notebook a failure shows under the picture instead of in the browser log
            draw(change["new"])

    slider.observe(redraw, names="value")
    draw(slider.value)
    return widgets.VBox([slider, picture, errors])
