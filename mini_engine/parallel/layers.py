"""Megatron-LM's tensor-parallel layers (Shoeybi et al. 2019; chapter 11): one model's weights cut across `size`
ranks so that each rank holds and multiplies only its share.

A linear layer y = x W^T (W [out, in]) can be cut two ways:
- column-parallel: W's rows (the outputs) are split. Each rank computes its slice of y from the whole x; nothing
  is exchanged. q/k/v are cut by heads (a rank owns whole heads, so attention runs on each rank alone), gate/up
  by MLP columns.
- row-parallel: W's columns (the inputs) are split. Each rank multiplies its slice of x, which is exactly what a
  column-parallel layer before it produced, and gets a partial y; one all-reduce (a sum over ranks) makes the
  whole y on every rank. o_proj and down_proj.
Column then row: a block (attention, or the MLP) costs one all-reduce, two a layer. The embedding and the tied LM
head are cut by vocabulary: a rank looks up only the ids in its range (the others give zeros; an all-reduce sums),
and computes the logits of its range (gathered on rank 0, which samples). Norms are tiny and replicated.

`comm` is the rank's `comm.Communicator`; with comm=None a layer returns its partial result (the tests run every
rank's shard in one process and add or join the partials themselves).
"""
from __future__ import annotations

import dataclasses
import importlib
import types

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig

DIVIDED = ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size")  # what a rank takes a share of


def check_tensor_parallel_size(config: ModelConfig, size) -> None:
    """A ValueError unless `size` ranks divide the heads, the KV heads, the MLP width and the vocabulary."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {size!r}")
    for name in DIVIDED:
        n = getattr(config, name)
        if n % size:
            fits = [p for p in range(1, config.num_kv_heads + 1) if all(getattr(config, f) % p == 0 for f in DIVIDED)]
            raise ValueError(f"tensor_parallel_size={size} does not divide the model's {name} ({n}): each rank must "
                             f"hold whole heads and equal shares; sizes that divide this model: {fits}")


def rank_config(config: ModelConfig, size: int) -> ModelConfig:
    """The model as one rank runs it: its share of the heads, KV heads and MLP width. The vocabulary stays whole:
    the logits a step returns are gathered over every rank's range."""
    return dataclasses.replace(config, num_heads=config.num_heads // size, num_kv_heads=config.num_kv_heads // size,
                               intermediate_size=config.intermediate_size // size)


def split_rows(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rows rank * out/size ... of W [out, in]: a column-parallel layer's share (and a vocabulary range)."""
    return weight.chunk(size, dim=0)[rank]


def split_columns(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Columns rank * in/size ... of W [out, in]: a row-parallel layer's share."""
    return weight.chunk(size, dim=1)[rank]


def split_qkv(weight: torch.Tensor, config: ModelConfig, rank: int, size: int) -> torch.Tensor:
    """The fused [q; k; v] projection's rows of the rank's heads: query heads rank * Hq/size ..., and the KV heads
    they read (grouped-query attention keeps a rank's query heads with their own KV heads)."""
    d = config.head_dim
    q, k, v = weight.split([config.num_heads * d, config.num_kv_heads * d, config.num_kv_heads * d])
    return torch.cat([split_rows(q, rank, size), split_rows(k, rank, size), split_rows(v, rank, size)])


def split_gate_up(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The fused [gate; up] projection's rows of the rank's MLP columns, gate's then up's."""
    gate, up = weight.chunk(2)
    return torch.cat([split_rows(gate, rank, size), split_rows(up, rank, size)])


class ColumnParallelLinear(nn.Linear):
    """y_rank = x W_rank^T with W_rank the rank's rows: a plain linear layer of out/size outputs; no communication
    (its output feeds the row-parallel layer after it, or attention over the rank's own heads)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.weight = nn.Parameter(weight, requires_grad=False)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_rank W_rank^T, with W_rank the rank's columns: the partial product, then one
    all-reduce (the block's one exchange)."""

    def __init__(self, weight: torch.Tensor, comm=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.comm = comm

    def forward(self, x):
        y = F.linear(x, self.weight)
        return y if self.comm is None else self.comm.all_reduce(y)


class VocabParallelEmbedding(nn.Module):
    """Rows start ... start + V/size of the embedding table. An id outside the range looks up zeros; the all-reduce
    adds the one rank that holds it."""

    def __init__(self, weight: torch.Tensor, start: int, comm=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.comm = start, comm

    def forward(self, ids):
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return x if self.comm is None else self.comm.all_reduce(x)


class ParallelLMHead(nn.Module):
    """The logits of the rank's vocabulary range (its rows of the tied table); rank 0 gathers every range and
    returns the whole [rows, V]; other ranks return their own [rows, V/size]."""

    def __init__(self, weight: torch.Tensor, comm=None):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.comm = comm

    def forward(self, x):
        logits = F.linear(x, self.weight)
        return logits if self.comm is None else self.comm.gather(logits)


CUSTOM = ("split_rows", "split_columns", "split_qkv", "ColumnParallelLinear", "RowParallelLinear",
          "VocabParallelEmbedding", "ParallelLMHead",
          "ParallelAttention")  # what a `layers=` module may bring in place of the engine's (lab 11)


def resolve_layers(layers: str | None = None) -> types.SimpleNamespace:
    """The pieces `split` and `shard_model` build a rank from: the engine's own, or, with `layers` the dotted name of
    a module (lab 11's `labs.lab11_tensor_parallel`), that module's versions of any of CUSTOM, with the engine's
    signatures, the engine's filling in the rest. A name, not the module itself: every rank imports it in its own
    process (a rank started by `spawn` has the parent's sys.path, so the module must be importable there).
    `ParallelAttention(attn, rank, size, comm)`, a whole attention block built from the full one, has no engine
    version (the engine cuts its Attention in place): None unless the module brings one."""
    module = importlib.import_module(layers) if layers else None
    here = globals()
    return types.SimpleNamespace(**{name: getattr(module, name, None) or here.get(name) for name in CUSTOM})


# How each weight is divided among the ranks, by its module's name (the one table: `split` reads it for a state_dict
# and `shard_model` for a model's modules); a weight not named here (the norms) is copied whole to every rank.
SPLITS = {"qkv_proj": "qkv", "gate_up_proj": "gate_up", "o_proj": "columns", "down_proj": "columns",
          "embed_tokens": "rows", "lm_head": "rows"}


def split(name: str, weight: torch.Tensor, config: ModelConfig, rank: int, size: int,
          layers: str | None = None) -> torch.Tensor:
    """The rank's share of the full model's weight `name` (a state_dict key), a copy: norms whole. `layers`: see
    `resolve_layers`."""
    kind = SPLITS.get(name.split(".")[-2]) if "." in name else None
    use = resolve_layers(layers)
    if kind == "qkv":
        part = use.split_qkv(weight, config, rank, size)
    elif kind == "gate_up":
        gate, up = weight.chunk(2)
        part = torch.cat([use.split_rows(gate, rank, size), use.split_rows(up, rank, size)])
    elif kind == "columns":
        part = use.split_columns(weight, rank, size)
    elif kind == "rows":
        part = use.split_rows(weight, rank, size)
    else:
        part = weight
    return part.clone()


def shard_weights(model, rank: int, size: int, layers: str | None = None) -> dict[str, torch.Tensor]:
    """The rank's share of every weight of a full model, keyed as the sharded model's state_dict."""
    return {name: split(name, w, model.config, rank, size, layers) for name, w in model.state_dict().items()}


def shard_model(model, rank: int, size: int, comm=None, layers: str | None = None):
    """Cut a full `LlamaModel` down to rank `rank` of `size`, in place (returns it): every projection, the embedding
    and the LM head replaced by its parallel layer holding the rank's share (a copy: the full weights can go),
    each attention told its share of the heads. Each share is cut by `split`, so SPLITS is the one table of how a
    weight is divided. A model on the meta device stays there (a rank builds its shapes this way, then loads its
    weights). `layers`, the dotted name of a module, builds the rank from that module's splits and layer classes
    instead of the engine's (`resolve_layers`: lab 11 serves with a student's)."""
    config = model.config
    use = resolve_layers(layers)
    check_tensor_parallel_size(config, size)
    local = rank_config(config, size)

    def share(name: str, module) -> torch.Tensor:
        return split(f"{name}.weight", module.weight, config, rank, size, layers)

    for i, layer in enumerate(model.layers):
        attn, mlp, at = layer.self_attn, layer.mlp, f"layers.{i}"
        if use.ParallelAttention is not None:  # a `layers=` module's own block (lab 11): it cuts its heads itself
            layer.self_attn = use.ParallelAttention(attn, rank, size, comm)
        else:
            attn.qkv_proj = use.ColumnParallelLinear(share(f"{at}.self_attn.qkv_proj", attn.qkv_proj))
            attn.o_proj = use.RowParallelLinear(share(f"{at}.self_attn.o_proj", attn.o_proj), comm)
            attn.num_heads, attn.num_kv_heads = local.num_heads, local.num_kv_heads
            attn.qk_size, attn.v_size = (local.num_heads + local.num_kv_heads) * local.head_dim, \
                local.num_kv_heads * local.head_dim
        mlp.gate_up_proj = use.ColumnParallelLinear(share(f"{at}.mlp.gate_up_proj", mlp.gate_up_proj))
        mlp.down_proj = use.RowParallelLinear(share(f"{at}.mlp.down_proj", mlp.down_proj), comm)
    model.embed_tokens = use.VocabParallelEmbedding(share("embed_tokens", model.embed_tokens),
                                                    rank * (config.vocab_size // size), comm)
    head = model.embed_tokens.weight if config.tie_word_embeddings else share("lm_head", model.lm_head)
    model.lm_head = use.ParallelLMHead(head, comm)
    model.config = local
    return model
