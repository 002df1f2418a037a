"""The ring all-reduce step by step (chapter 11, section 7): which ranks' contributions each rank holds of each
slice after every hop, worked out by running the algorithm on sets of rank numbers instead of tensors."""
from __future__ import annotations

from dataclasses import dataclass

from matplotlib.figure import Figure


@dataclass(frozen=True)
class RingStep:
    """The ranks' state after one step: `held[r][c]`, the ranks whose values of slice c rank r has summed;
    `sent[r]`, the slice rank r sent to rank r + 1 in this step (None before the first)."""
    title: str
    held: tuple[tuple[frozenset, ...], ...]
    sent: tuple[int | None, ...]


def ring_all_reduce_steps(ranks: int) -> list[RingStep]:
    """The state after each of the ring's 2(p - 1) steps, and before the first. Reduce-scatter: in step s rank r
    sends its partial sum of slice (r - s - 1) mod p to rank r + 1, which adds its own; after p - 1 steps rank r
    holds slice r summed over every rank. All-gather: in step s rank r passes on the whole slice (r - s) mod p,
    which the next rank copies."""
    if ranks < 2:
        raise ValueError(f"ranks must be >= 2, got {ranks}")
    held = [[frozenset({r}) for _ in range(ranks)] for r in range(ranks)]
    steps = [RingStep("each rank's own values", tuple(map(tuple, held)), (None,) * ranks)]
    for phase, combine in (("reduce-scatter", frozenset.union), ("all-gather", lambda mine, got: got)):
        for s in range(ranks - 1):
            sent = tuple((r - s - (phase == "reduce-scatter")) % ranks for r in range(ranks))
            before = [row[:] for row in held]  # every rank sends what it held before this step
            for r, c in enumerate(sent):
                held[(r + 1) % ranks][c] = combine(before[(r + 1) % ranks][c], before[r][c])
            steps.append(RingStep(f"{phase} step {s + 1}", tuple(map(tuple, held)), sent))
    return steps


def draw_ring_all_reduce(ranks: int = 3, width: float = 11.0) -> Figure:
    """One panel per step: a row per rank, a column per slice, each cell naming the ranks summed in it (dark when
    it holds every rank's); the cell a rank just received is outlined."""
    steps = ring_all_reduce_steps(ranks)
    fig = Figure(figsize=(width, 0.55 * ranks + 1.0))
    axes = fig.subplots(1, len(steps))
    for ax, step in zip(axes, steps):
        for r, row in enumerate(step.held):
            for c, got in enumerate(row):
                whole = len(got) == ranks
                received = step.sent[(r - 1) % ranks] == c
                ax.add_patch(_cell(c, r, "#3182bd" if whole else "#c6dbef", received))
                ax.text(c + 0.5, r + 0.5, "+".join(map(str, sorted(got))), ha="center", va="center", fontsize=7,
                        color="white" if whole else "black")
        ax.set(xlim=(0, ranks), ylim=(ranks, 0), title=step.title)
        ax.title.set_fontsize(8)
        ax.set_xticks([c + 0.5 for c in range(ranks)], [f"slice {c}" for c in range(ranks)], fontsize=6)
        ax.set_yticks([r + 0.5 for r in range(ranks)], [f"rank {r}" for r in range(ranks)], fontsize=7)
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
    fig.tight_layout()
    return fig


def _cell(c: int, r: int, colour: str, received: bool):
    from matplotlib.patches import Rectangle

    return Rectangle((c + 0.04, r + 0.06), 0.92, 0.88, facecolor=colour,
                     edgecolor="#e6550d" if received else "white", linewidth=2 if received else 0.5)


def ring_all_reduce_image(ranks: int = 3, width: float = 11.0):
    """The drawing as an IPython image, which every notebook front end shows."""
    import io

    from IPython.display import Image

    buf = io.BytesIO()
    draw_ring_all_reduce(ranks, width).savefig(buf, format="png", dpi=80)
    return Image(buf.getvalue())
