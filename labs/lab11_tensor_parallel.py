"""Lab 11: tensor parallelism, one model's layers cut across ranks (Megatron-LM; chapter 11).

A linear layer y = x W^T keeps its weight as W [out, in]. Split over `size` ranks, each rank holds and multiplies
only its share. The MLP is given at the bottom of this file, as an example to read: gate/up are column-parallel
(each rank computes its slice of the outputs from the whole x, nothing exchanged), down is row-parallel (each rank's
product is a partial sum of the whole y, and one all-reduce adds them). You write the rest of a rank:
  1. the two cuts of a weight, `column_shard` and `row_shard`;
  2. the split attention block, `qkv_shard` (which rows of the fused [q; k; v] weight are the rank's query heads
     AND the KV heads they read) and `ParallelAttention` (a rank's attention over its own heads alone, and where
     its one all-reduce goes);
  3. the vocabulary-parallel embedding, `vocab_parallel_embedding` (each rank looks up only its ids);
  4. the vocabulary-parallel LM head, `ParallelLMHead.forward` (each rank's logits of its vocabulary range, and
     the collective that puts them together on rank 0, which samples);
  5. optional: an all-reduce of your own, `ring_all_reduce`, made of a `reduce_scatter` and an `all_gather` that
     you build from one point-to-point step, `comm.sendrecv` (what NCCL's ring does with each chunk).

`comm` is one rank's end of the group (the engine's `mini_engine.parallel.comm.Communicator`, or the grader's over
torch.distributed): `comm.all_reduce(t)` sums `t` over every rank, in place, and returns it; `comm.gather(t)`
returns on rank 0 every rank's `t` joined along the last dimension in rank order, and `t` itself on the others.
With comm=None a layer returns its partial result: the grader runs every rank's shard in one process and adds or
joins them itself. The optional part's comm (the grader's) has `comm.rank`, `comm.size` and one point-to-point step,
`comm.sendrecv(send, to, recv, source)`: it sends the tensor `send` to rank `to` and, at the same time, receives
into `recv` (a tensor of the same shape) from rank `source`, and returns when both are done (torch.distributed's
isend and irecv, both posted, then waited on). Both at once, not a send and then a receive: in a ring where every
rank first sends, each send may wait for a receive that its neighbour has not reached yet, and on a transport
that does not buffer the message no rank ever gets there. NCCL's ring posts both sides of a step together too.

Fill in every function or method marked TODO in labs/lab11_tensor_parallel.py, then grade your work with

    pytest tests/labs/test_lab11.py --impl=labs

The grader first runs each rank's shard in one process; then, last, three real ranks (processes joined by
torch.distributed's gloo) run your layers together. The given part at the bottom wraps your pieces in the names
and signatures of `mini_engine.parallel.layers`, so the engine can build every rank from them:
`ParallelModel(full, 3, layers="labs.lab11_tensor_parallel")` (its hook, `resolve_layers`). The lab notebook
serves real requests that way, at three ranks, and compares the tokens with one process's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mini_engine.model import apply_rope


# ---------------------------------------------------------------- 1. the two cuts

def column_shard(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s share of a column-parallel layer's weight W [out, in]: the OUTPUT features out/size * rank
    ... out/size * (rank + 1) - 1, shape [out/size, in]. `size` divides `out`. May return a view of `weight`: a
    layer that keeps a share clones it (a view would keep the whole weight alive in every rank)."""
    # TODO: the ranks share this layer's OUTPUTS. In W [out, in], which dimension counts them? (Chapter 11
    # gives Megatron's names for the two cuts.)
    raise NotImplementedError("lab11 column_shard: not written yet (see its docstring)")


def row_shard(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s share of a row-parallel layer's weight W [out, in]: the INPUT features in/size * rank ...
    in/size * (rank + 1) - 1, shape [out, in/size]. `size` divides `in`. May return a view, as `column_shard`."""
    # TODO: here the ranks share the layer's INPUTS: the other dimension of W.
    raise NotImplementedError("lab11 row_shard: not written yet (see its docstring)")


# ---------------------------------------------------------------- 2. attention, split by heads

def qkv_shard(weight: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, rank: int,
              size: int) -> torch.Tensor:
    """Rank `rank`'s rows of the fused [q; k; v] projection's weight ([(num_heads + 2 * num_kv_heads) * head_dim,
    hidden]: q's rows first, then k's, then v's, each head's head_dim rows together). The rank owns whole heads:
    its query heads, and the KV heads that those query heads read (grouped-query attention). Returns the rank's q
    rows, then its k rows, then its v rows: [(num_heads + 2 * num_kv_heads) / size * head_dim, hidden], a new
    tensor (the parts are joined). `size` divides both head counts."""
    # TODO: the fused weight is three projections stacked: Attention.__init__ in mini_engine/model.py says how
    # many rows each has. Which of k's and v's heads do this rank's query heads read (grouped-query attention,
    # chapter 11)? Cut each of the three, not the stack.
    raise NotImplementedError("lab11 qkv_shard: not written yet (see its docstring)")


class ParallelAttention(nn.Module):
    """Rank `rank` of `size`'s attention block, built from the full model's `mini_engine.model.Attention`
    (`attn`: attn.qkv_proj.weight [(Hq + 2 Hkv) * D, hidden], attn.o_proj.weight [hidden, Hq * D], and
    attn.num_heads, attn.num_kv_heads, attn.head_dim). The rank runs attention over its own heads alone and returns
    the block's whole output [T, hidden] (with comm=None, its partial one).

    The engine loads each rank's weights by name, so the block keeps its shares, COPIES (a view would keep the
    whole weight alive in every rank), as `self.qkv_proj` and `self.o_proj`, modules with a `.weight`; and its own
    head counts as `self.num_heads` and `self.num_kv_heads` (the engine sizes the rank's KV cache from them)."""

    def __init__(self, attn, rank: int, size: int, comm=None):
        super().__init__()
        # TODO: what does a rank keep of each of attn's projections, and how many heads is that? Your cuts above
        # and the given layer classes at the bottom of this file hold shares; the class docstring says how.
        raise NotImplementedError("lab11 ParallelAttention.__init__: not written yet (see the class docstring)")


    def forward(self, x, cos, sin, meta, layer_idx: int, kv_cache, attention):
        """x [T, hidden] -> [T, hidden]; cos, sin [T, 1, D]: RoPE's angles (`mini_engine.model.apply_rope`);
        `attention(q, k, v, meta, kv_cache, layer_idx)` runs attention over q [T, Hq, D], k and v [T, Hkv, D] and
        returns [T, Hq, D]."""
        # TODO: Attention.project and Attention.forward in mini_engine/model.py, with this rank's heads. Then: of
        # the products in this block, whose output on one rank is only one term of a sum over the ranks? That is
        # where the block's one exchange goes (and not anywhere else).
        raise NotImplementedError("lab11 ParallelAttention.forward: not written yet (see its docstring)")


# ---------------------------------------------------------------- 3. vocabulary-parallel embedding

def vocab_parallel_embedding(ids: torch.Tensor, weight_shard: torch.Tensor, start: int, comm=None) -> torch.Tensor:
    """The embedding of `ids` (any shape, int64) from the rank's rows of the table, weight_shard
    ([V/size, hidden]: the vocabulary's ids start ... start + V/size - 1). An id in that range gives its row; an id
    outside it gives a row of zeros (another rank holds it). With `comm`, return the sum over the ranks (every id's
    row, from the one rank that held it); with comm=None, this rank's part. Shape [*ids.shape, hidden], in
    weight_shard's dtype."""
    # TODO: the shard numbers its rows from 0, the vocabulary from `start`. An id another rank holds has no row
    # here: it must not index the shard as it is (past the end it raises; below 0, PyTorch counts from the end),
    # and its row must come out zeros, in the table's dtype. Then the one exchange.
    raise NotImplementedError("lab11 vocab_parallel_embedding: not written yet (see its docstring)")


# ---------------------------------------------------------------- 4. vocabulary-parallel LM head

class ParallelLMHead(nn.Module):
    """The LM head of rank `rank`: `weight` is its rows of the output table, the vocabulary range start ... start
    + V/size - 1, in order (for a model whose head is tied to the embedding, the very rows the rank's embedding
    holds: the engine ties them after building the rank, so keep `weight` as given, no copy)."""

    def __init__(self, weight: torch.Tensor, comm=None):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> on rank 0 the whole logits [T, V], every id's column in vocabulary order (rank 0
        samples); on the other ranks their own [T, V/size]. With comm=None, the rank's own [T, V/size]."""
        # TODO: each rank's logits are some COLUMNS of the whole [T, V] (which ones?), not one term of a sum.
        # Which of comm's two collectives joins instead of adding (mini_engine/parallel/comm.py), and in what order?
        raise NotImplementedError("lab11 ParallelLMHead.forward: not written yet (see its docstring)")


# ---------------------------------------------------------------- 5. optional: an all-reduce of your own

def reduce_scatter(t: torch.Tensor, comm) -> torch.Tensor:
    """The ring's first half: `t` ([n, ...], every rank's the same shape; comm.size divides n) cut along dim 0 into
    comm.size chunks; returns chunk comm.rank of the SUM over the ranks, [n/size, ...], a new tensor (t untouched).
    Built from `comm.sendrecv` alone, in comm.size - 1 steps, each rank sending one chunk a step."""
    # TODO: the ranks in a ring, each sending to rank + 1 and receiving from rank - 1. Draw 3 ranks and 3 chunks
    # on paper: at each step, which chunk does a rank pass on, and which one does the incoming chunk add to, so
    # that chunk c ends, summed over every rank, at rank c? Check your drawing for 2 ranks and for 4.
    raise NotImplementedError("lab11 reduce_scatter: not written yet (see its docstring)")


def all_gather(chunk: torch.Tensor, comm) -> torch.Tensor:
    """The ring's second half: every rank's `chunk` ([m, ...]) joined along dim 0 in rank order, [size * m, ...],
    on every rank. Built from `comm.sendrecv` alone, in comm.size - 1 steps."""
    # TODO: the same ring, with nothing to add: a complete chunk passed on. Which chunk does each rank start with,
    # and which does it forward at each step?
    raise NotImplementedError("lab11 all_gather: not written yet (see its docstring)")


def ring_all_reduce(t: torch.Tensor, comm) -> torch.Tensor:
    """Sum `t` (any shape, any number of elements) over the ranks, in place, and return it: `reduce_scatter` then
    `all_gather`, as the engine's comm.all_reduce does with NCCL's ring."""
    # TODO: your two halves, in order, over the elements of t; if comm.size does not divide their number, what can
    # you add to a sum without changing it? Then put the result in t.
    raise NotImplementedError("lab11 ring_all_reduce: not written yet (see its docstring)")


# ---------------------------------------------------------------- given: the linear layers, and your pieces in the
# engine's shapes. mini_engine/parallel/layers.py builds every rank from these names when asked to (`resolve_layers`):
# `ParallelModel(full, 3, layers="labs.lab11_tensor_parallel")` cuts the real model's weights with your shards and
# runs its forward passes through these layers and yours, in every rank. Nothing to write here.

class ColumnParallelLinear(nn.Module):
    """A rank's column-parallel layer (gate/up, and the q/k/v of your attention): y_rank = x W_rank^T, the rank's
    slice of the outputs from the WHOLE x. Nothing exchanged: what follows works on those outputs alone."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """A rank's row-parallel layer (down_proj): x_rank W_rank^T is one term of a sum over the ranks; with a comm,
    the all-reduce makes it the whole y on every rank."""

    def __init__(self, weight: torch.Tensor, comm=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.comm = comm

    def forward(self, x):
        partial = F.linear(x, self.weight)
        return partial if self.comm is None else self.comm.all_reduce(partial)


class VocabParallelEmbedding(nn.Module):
    """A rank's share of the embedding table, ids start ... start + V/size - 1: your `vocab_parallel_embedding`."""

    def __init__(self, weight: torch.Tensor, start: int, comm=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.comm = start, comm

    def forward(self, ids):
        return vocab_parallel_embedding(ids, self.weight, self.start, self.comm)


def split_rows(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The engine's name for a column-parallel share (gate/up, a vocabulary range): your `column_shard`."""
    return column_shard(weight, rank, size)


def split_columns(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The engine's name for a row-parallel share (o_proj, down_proj): your `row_shard`."""
    return row_shard(weight, rank, size)


def split_qkv(weight: torch.Tensor, config, rank: int, size: int) -> torch.Tensor:
    """The engine's name for the attention's share by heads: your `qkv_shard`, with the model's head counts."""
    return qkv_shard(weight, config.num_heads, config.num_kv_heads, config.head_dim, rank, size)
