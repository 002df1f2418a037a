"""A picture of tensor parallelism's cut (chapter 11, section 1): which share of each weight every rank holds, what
every rank holds whole, and where each collective sits in a step. Drawn from a model config's own sizes."""
from __future__ import annotations

from dataclasses import dataclass

from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

from ..config import ModelConfig

SPLIT, WHOLE, COLLECTIVE, LOCAL = "#9ecae1", "#d9d9d9", "#fdae6b", "#c7e9c0"


@dataclass(frozen=True)
class Stage:
    """One row of the picture: per-rank boxes (`kind` SPLIT, WHOLE or LOCAL) or one COLLECTIVE band across them."""
    name: str
    kind: str
    label: str  # may hold {lo}, {hi} (the rank's first and last query head) and {v0}, {v1} (its vocabulary ids)


def split_stages(config: ModelConfig, ranks: int) -> list[Stage]:
    """The rows of the picture, top to bottom, for `config` cut over `ranks` (heads, KV heads, the MLP width and
    the vocabulary must divide evenly: this engine's rule). Shapes are [out, in], as nn.Linear stores a weight."""
    for name, n in (("num_heads", config.num_heads), ("num_kv_heads", config.num_kv_heads),
                    ("intermediate_size", config.intermediate_size), ("vocab_size", config.vocab_size)):
        if n % ranks:
            raise ValueError(f"ranks: {ranks} does not divide {name} = {n}")
    h, d = config.hidden_size, config.head_dim
    q, kv, mlp, vocab = (config.num_heads // ranks, config.num_kv_heads // ranks, config.intermediate_size // ranks,
                         config.vocab_size // ranks)
    return [
        Stage("embed_tokens", SPLIT, f"[{vocab:,}, {h}]: ids {{v0:,}}…{{v1:,}}\n(other ids give zeros)"),
        Stage("all-reduce", COLLECTIVE, f"all-reduce: sum the ranks' [b, {h}], every rank gets it"),
        Stage("input_layernorm", WHOLE, f"RMSNorm [{h}]\nwhole on every rank"),
        Stage("qkv_proj", SPLIT, f"column-parallel [{(q + 2 * kv) * d}, {h}]\nq heads {{lo}}…{{hi}}, "
                                 f"{kv} KV head(s)"),
        Stage("attention", LOCAL, f"attention over its {q} heads;\nKV cache of its {kv} KV head(s)"),
        Stage("o_proj", SPLIT, f"row-parallel [{h}, {q * d}]\n→ a partial sum [b, {h}]"),
        Stage("all-reduce", COLLECTIVE, f"all-reduce: the partial sums added, [b, {h}] on every rank"),
        Stage("post_attention_layernorm", WHOLE, f"RMSNorm [{h}]\nwhole on every rank"),
        Stage("gate_up_proj", SPLIT, f"column-parallel [2 × {mlp}, {h}]\nthen SwiGLU on its {mlp} columns"),
        Stage("down_proj", SPLIT, f"row-parallel [{h}, {mlp}]\n→ a partial sum [b, {h}]"),
        Stage("all-reduce", COLLECTIVE, f"all-reduce: the partial sums added (× {config.num_layers} layers: "
                                        f"{2 * config.num_layers} all-reduces)"),
        Stage("norm", WHOLE, f"RMSNorm [{h}]\nwhole on every rank"),
        Stage("lm_head", SPLIT, f"vocabulary-parallel [{vocab:,}, {h}]\n(the embedding's rows) → its logits"),
        Stage("gather", COLLECTIVE, f"gather: rank 0 joins the [b, {vocab:,}] slices and samples"),
    ]


def draw_tensor_parallel_split(config: ModelConfig, ranks: int = 3, width: float = 11.0) -> Figure:
    """The cut of one decoder layer (and the embedding and LM head around it) over `ranks`: a column per rank, blue
    for a rank's share of a split weight, grey for what every rank holds whole, green for work a rank does on its
    own share, orange bands for the collectives that join the ranks."""
    if ranks < 2:
        raise ValueError(f"ranks must be >= 2 to draw a split, got {ranks}")
    stages = split_stages(config, ranks)
    q, vocab = config.num_heads // ranks, config.vocab_size // ranks
    height = 0.62 * len(stages) + 0.7
    fig = Figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(-1.25, ranks)
    ax.set_ylim(-len(stages) - 0.2, 0.9)
    ax.axis("off")
    for r in range(ranks):
        ax.text(r + 0.5, 0.45, f"rank {r}", ha="center", va="center", fontsize=10, weight="bold")
    for i, stage in enumerate(stages):
        y = -i - 0.5
        ax.text(-1.2, y, stage.name, ha="left", va="center", fontsize=8.5, family="monospace")
        if stage.kind == COLLECTIVE:
            ax.add_patch(FancyBboxPatch((0.03, y - 0.3), ranks - 0.06, 0.6, boxstyle="round,pad=0.01",
                                        facecolor=COLLECTIVE, edgecolor="k", lw=0.6))
            ax.text(ranks / 2, y, stage.label, ha="center", va="center", fontsize=8)
            continue
        for r in range(ranks):
            ax.add_patch(FancyBboxPatch((r + 0.04, y - 0.4), 0.92, 0.8, boxstyle="round,pad=0.01",
                                        facecolor=stage.kind, edgecolor="k", lw=0.4))
            ax.text(r + 0.5, y, stage.label.format(lo=r * q, hi=(r + 1) * q - 1, v0=r * vocab, v1=(r + 1) * vocab - 1),
                    ha="center", va="center", fontsize=7)
    return fig


def tensor_parallel_split_image(config: ModelConfig, ranks: int = 3, width: float = 9.0):
    """The drawing as an IPython image, which every notebook front end shows (a standalone Figure needs the inline
    backend to show itself)."""
    import io

    from IPython.display import Image

    buf = io.BytesIO()
    draw_tensor_parallel_split(config, ranks, width).savefig(buf, format="png", dpi=80)
    return Image(buf.getvalue())
