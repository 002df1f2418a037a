"""Lab 11: tensor parallelism, one model's layers cut across ranks (Megatron-LM; chapter 11).

A linear layer y = x W^T keeps its weight as W [out, in]. Split it over `size` ranks and each rank holds and
multiplies only its share. You write the four cuts a transformer needs:
  1. the column-parallel linear: which dimension of W is cut, and why the rank then needs nothing from the others
     (`column_shard`, `column_parallel_linear`);
  2. the row-parallel linear: the other dimension; each rank gets a partial y, and one all-reduce (a sum over the
     ranks) makes the whole y (`row_shard`, `row_parallel_linear`);
  3. the attention's split by heads: the fused [q; k; v] projection's rows of the rank's query heads AND of its KV
     heads (SmolLM2-135M has 9 query heads and 3 KV heads: at 3 ranks each holds 3 and 1), so attention runs on
     each rank alone (`qkv_shard`);
  4. the vocabulary-parallel embedding: each rank looks up only the ids of its vocabulary range, gives zeros for
     the others, and an all-reduce adds the one rank that held each id (`vocab_parallel_embedding`).
Column then row: attention (q/k/v column-parallel, o_proj row-parallel) and the MLP (gate/up column-parallel,
down_proj row-parallel) each cost one all-reduce.

`comm` is one rank's end of the group: `comm.all_reduce(t)` sums `t` over every rank, in place, and returns it
(the engine's `mini_engine.parallel.comm.Communicator`, or the grader's over torch.distributed). With comm=None a
layer returns its partial result: the grader runs every rank's shard in one process and adds or joins them itself.

Fill in every function marked TODO in labs/lab11_tensor_parallel.py, then grade your work with

    pytest tests/labs/test_lab11.py --impl=labs

The grader first runs each rank's shard in one process and compares the joined (or summed) outputs with the full
layer's; then, last, three real ranks (processes joined by torch.distributed's gloo) run your layers together.
Below your functions, the given part (`split_rows`, `split_columns`, `split_qkv` and the three layer classes)
wraps them in the names and signatures of `mini_engine.parallel.layers`, so the engine can build every rank from
them: `ParallelModel(full, 3, layers="labs.lab11_tensor_parallel")` (its hook, `resolve_layers`). The lab notebook
serves real requests that way, at three ranks, and compares the tokens with one process's.
"""
from __future__ import annotations

import torch
from torch import nn


# ---------------------------------------------------------------- 1. column-parallel

def column_shard(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s share of a column-parallel layer's weight W [out, in]: the OUTPUT features out/size * rank
    ... out/size * (rank + 1), i.e. W's rows of them, shape [out/size, in]. `size` divides `out`."""
    # TODO: W is [out, in] and this layer's outputs are what the ranks share. Which dimension of W is that?
    # (torch.Tensor.chunk, or a slice; chapter 11, section 1, draws the cut.)
    raise NotImplementedError("lab11 column_shard: not written yet (see its docstring)")


def column_parallel_linear(x: torch.Tensor, weight_shard: torch.Tensor) -> torch.Tensor:
    """y_rank = x W_rank^T, the rank's slice of the outputs ([..., out/size]) from the WHOLE input x ([..., in]).
    No communication: joining every rank's y_rank along the last dimension, in rank order, gives the full y."""
    # TODO: a plain linear layer over the rank's rows of W (x @ W^T, or torch.nn.functional.linear). Ask
    # yourself what this rank needs from the others here.
    raise NotImplementedError("lab11 column_parallel_linear: not written yet (see its docstring)")


# ---------------------------------------------------------------- 2. row-parallel

def row_shard(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s share of a row-parallel layer's weight W [out, in]: the INPUT features in/size * rank ...
    in/size * (rank + 1), i.e. W's columns of them, shape [out, in/size]. `size` divides `in`."""
    # TODO: here the ranks share W's INPUTS. Which dimension of W [out, in] indexes them?
    raise NotImplementedError("lab11 row_shard: not written yet (see its docstring)")


def row_parallel_linear(x_shard: torch.Tensor, weight_shard: torch.Tensor, comm=None) -> torch.Tensor:
    """The whole y ([..., out]) from the rank's slice of the input, x_shard ([..., in/size]: what the
    column-parallel layer before it gave this rank). The rank's product is only a partial y; summed over the ranks
    it is the full one. With `comm`, return that sum (`comm.all_reduce(t)` sums t over the ranks, in place, and
    returns it); with comm=None, the partial y."""
    # TODO: each rank's product is one term of a sum over the ranks. Where does the one exchange go, and
    # what do you return when there is no comm? (mini_engine/parallel/comm.py shows what all_reduce does.)
    raise NotImplementedError("lab11 row_parallel_linear: not written yet (see its docstring)")


# ---------------------------------------------------------------- 3. attention, split by heads

def qkv_shard(weight: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, rank: int,
              size: int) -> torch.Tensor:
    """Rank `rank`'s rows of the fused [q; k; v] projection's weight ([(num_heads + 2 * num_kv_heads) * head_dim,
    hidden]: q's rows first, then k's, then v's, each head's head_dim rows together). The rank owns whole heads:
    query heads num_heads/size * rank ..., and the KV heads num_kv_heads/size * rank ... that those query heads
    read (grouped-query attention). Return the rank's q rows, then its k rows, then its v rows, in that order:
    [(num_heads + 2 * num_kv_heads) / size * head_dim, hidden]. `size` divides both head counts."""
    # TODO: cut the fused weight back into its q, k and v parts first (how many rows has each?), then give
    # each part the same cut as a column-parallel layer, and join the rank's parts in q, k, v order.
    raise NotImplementedError("lab11 qkv_shard: not written yet (see its docstring)")


# ---------------------------------------------------------------- 4. vocabulary-parallel embedding

def vocab_parallel_embedding(ids: torch.Tensor, weight_shard: torch.Tensor, start: int, comm=None) -> torch.Tensor:
    """The embedding of `ids` (any shape, int64) from the rank's rows of the table, weight_shard
    ([V/size, hidden]: the vocabulary's ids start ... start + V/size - 1). An id in that range gives its row; an id
    outside it gives a row of zeros (another rank holds it). With `comm`, return the sum over the ranks (every id's
    row, from the one rank that held it); with comm=None, this rank's part. Shape [*ids.shape, hidden], in
    weight_shard's dtype."""
    # TODO: shift the ids into the shard's own numbering, find which of them this shard holds, look those up
    # (an index outside the shard must not be used as is) and zero the others' rows; then the one exchange.
    raise NotImplementedError("lab11 vocab_parallel_embedding: not written yet (see its docstring)")

# ---------------------------------------------------------------- given: your pieces in the engine's shapes
# mini_engine/parallel/layers.py builds every rank from these names when asked to (`resolve_layers`):
# `ParallelModel(full, 3, layers="labs.lab11_tensor_parallel")` cuts the real model's weights with your shards and
# runs its forward passes through your layers, in every rank. Nothing to write here.

def split_rows(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The engine's name for a column-parallel share (gate/up, a vocabulary range): your `column_shard`."""
    return column_shard(weight, rank, size)


def split_columns(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The engine's name for a row-parallel share (o_proj, down_proj): your `row_shard`."""
    return row_shard(weight, rank, size)


def split_qkv(weight: torch.Tensor, config, rank: int, size: int) -> torch.Tensor:
    """The engine's name for the attention's share by heads: your `qkv_shard`, with the model's head counts."""
    return qkv_shard(weight, config.num_heads, config.num_kv_heads, config.head_dim, rank, size)


class ColumnParallelLinear(nn.Module):
    """A rank's column-parallel layer (q/k/v, gate/up) holding its shard: forward is your `column_parallel_linear`."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        return column_parallel_linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """A rank's row-parallel layer (o_proj, down_proj): forward is your `row_parallel_linear` with the rank's comm."""

    def __init__(self, weight: torch.Tensor, comm=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.comm = comm

    def forward(self, x):
        return row_parallel_linear(x, self.weight, self.comm)


class VocabParallelEmbedding(nn.Module):
    """A rank's share of the embedding table, ids start ... start + V/size - 1: forward is your
    `vocab_parallel_embedding` with the rank's comm."""

    def __init__(self, weight: torch.Tensor, start: int, comm=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.comm = start, comm

    def forward(self, ids):
        return vocab_parallel_embedding(ids, self.weight, self.start, self.comm)
