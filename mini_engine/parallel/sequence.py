"""Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models";
Megatron-LM's `--sequence-parallel`), on top of tensor parallelism (chapter 11).

Plain tensor parallelism splits the projections but not what lies between them: every rank holds the whole
residual stream [tokens, hidden] and runs the same RMSNorms on it, the same work and the same memory `size` times
over. Sequence parallelism splits that part along the tokens: rank r holds rows r*T/size ... of the residual and
normalises only those (a norm, like the residual add, treats each token alone). The communication changes shape,
not volume: a row-parallel layer's all-reduce becomes a reduce-scatter (each rank keeps the sum of its own tokens'
rows), and a column-parallel layer, which needs every token, first all-gathers its input. An all-reduce is itself a
reduce-scatter then an all-gather (`collectives.py`), so the bytes moved are the same; what a rank holds between
the projections is a size-th.

Along the step (T packed tokens, padded to T' = a multiple of size; the padding rows are dropped where whole tokens
are needed, so attention never sees them):

    embedding (vocabulary-parallel)  -> reduce-scatter              residual [T'/size, hidden] on each rank
    per layer: RMSNorm (own rows)    -> all-gather, qkv, attention, o_proj -> reduce-scatter, residual add
               RMSNorm (own rows)    -> all-gather, gate_up, down_proj     -> reduce-scatter, residual add
    final RMSNorm (own rows)         -> all-gather, drop padding, pick the logits rows, LM head (vocabulary ranges)

`apply_sequence_parallel` turns a rank's tensor-parallel model (after `layers.shard_model`) into this, in place,
without touching the core: the embedding, the norms and the row-parallel projections are replaced by the modules
below (same weight names, so a model still on the meta device loads its shard afterwards, as `ranks.build_shard`
does), and the instance gets its own `run` (the core's `LlamaModel.run`, the final norm before the logits rows are
picked). Training is where
the paper's win is largest (the activations kept for the backward pass shrink by size); at inference a rank holds
a size-th of the residual stream and of the norms' work, while the gathered input of each column-parallel layer is
whole under both schemes and lives only for that product. `residual_bytes` measures the first on an engine.
"""
from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..model import DecoderLayer, RMSNorm
from .layers import VocabParallelEmbedding


@dataclass
class TokenSplit:
    """The step's packed token count, set by the rank model's `run` at the start of each step, and shared by its
    sequence-parallel modules: how far to pad before a reduce-scatter, where the padding starts after a gather."""
    size: int
    tokens: int = 0

    @property
    def padded(self) -> int:
        """The token count rounded up to a multiple of size: each rank holds padded / size rows."""
        return -(-self.tokens // self.size) * self.size

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, ...] with zero rows appended up to `padded`."""
        extra = self.padded - x.shape[0]
        return torch.cat([x, x.new_zeros((extra, *x.shape[1:]))]) if extra else x


def _parameter(weight) -> nn.Parameter:
    """The module's weight: the same Parameter object when it is one (so that a tied LM head stays tied)."""
    return weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)


class SequenceParallelEmbedding(VocabParallelEmbedding):
    """The vocabulary-parallel embedding whose all-reduce became a reduce-scatter: rank r ends with the embeddings
    of its own slice of the step's tokens. The padding ids are -1, in no rank's range: zero rows."""

    def __init__(self, weight, start: int, comm, split: TokenSplit):
        super().__init__(weight, start)  # comm=None: the parent returns the partial sum, this layer exchanges it
        self.weight, self.sequence_comm, self.split = _parameter(weight), comm, split

    def forward(self, ids):
        padded = torch.cat([ids, ids.new_full((self.split.padded - ids.shape[0],), -1)])
        return self.sequence_comm.reduce_scatter(super().forward(padded))


class SequenceParallelNorm(RMSNorm):
    """An RMSNorm over this rank's rows of the residual stream, then the all-gather that hands the column-parallel
    layer after it every token (the padding dropped). Megatron-LM gathers at the column-parallel layer's input:
    the same point of the step; here the projections stay the tensor-parallel ones, and attention, which reads
    its token count off its input, gets whole tokens."""

    def __init__(self, norm: RMSNorm, comm, split: TokenSplit):
        super().__init__(norm.weight.shape[0], norm.eps)
        self.weight, self.comm, self.split = _parameter(norm.weight), comm, split

    def forward(self, x):
        return self.comm.all_gather(super().forward(x))[:self.split.tokens]


class SequenceParallelRowLinear(nn.Module):
    """A row-parallel linear layer whose all-reduce became a reduce-scatter: the partial product of every token,
    padded, summed over the ranks, and each rank keeps its own tokens' rows (the residual stream's slice)."""

    def __init__(self, weight, comm, split: TokenSplit):
        super().__init__()
        self.weight, self.comm, self.split = _parameter(weight), comm, split

    def forward(self, x):
        return self.comm.reduce_scatter(self.split.pad(F.linear(x, self.weight)))


def _run(self, input_ids: torch.Tensor, meta, kv_cache, backend: str) -> torch.Tensor:
    """`LlamaModel.run` under sequence parallelism (bound to a rank's model by `apply_sequence_parallel`): the
    residual stream and the norms on this rank's slice of the tokens, whole tokens again before the LM head."""
    split = self.token_split
    split.tokens = input_ids.shape[0]
    cos = self.rope_cos[meta.positions, None].to(self.dtype)  # every token's angles: attention sees all of them
    sin = self.rope_sin[meta.positions, None].to(self.dtype)
    x = self.embed_tokens(input_ids)  # [padded / size, hidden]: this rank's tokens
    attention = self.attention_backends[backend]
    for i, layer in enumerate(self.layers):
        x = layer(x, cos, sin, meta, i, kv_cache, attention)
    x = self.norm(x)  # this rank's rows normalised, then every token's, the padding dropped
    if meta.logits_indices is not None:
        x = x[meta.logits_indices]
    return self.lm_head(x)


def apply_sequence_parallel(model, rank: int, size: int, comm):
    """Make rank `rank` of `size`'s tensor-parallel model (`layers.shard_model` has cut it) sequence-parallel, in
    place, and return it. Every rank of the group must do the same: the collectives change on all of them. The
    weights are the same Parameters under the same names: a model on the meta device stays there (then loads its
    shard), a model with weights keeps them."""
    if comm is None:
        raise ValueError("apply_sequence_parallel needs the rank's Communicator (comm): sequence parallelism "
                         "exchanges slices of the tokens between ranks")
    if getattr(model, "token_split", None) is not None:
        raise ValueError("this model is sequence-parallel already")
    if not 0 <= rank < size or comm.size != size:
        raise ValueError(f"rank={rank}, size={size} do not match the communicator's group of {comm.size}")
    split = TokenSplit(size)
    rows = model.embed_tokens.weight.shape[0]
    model.embed_tokens = SequenceParallelEmbedding(model.embed_tokens.weight, rank * rows, comm, split)
    for layer in model.layers:
        layer.input_layernorm = SequenceParallelNorm(layer.input_layernorm, comm, split)
        layer.self_attn.o_proj = SequenceParallelRowLinear(layer.self_attn.o_proj.weight, comm, split)
        layer.post_attention_layernorm = SequenceParallelNorm(layer.post_attention_layernorm, comm, split)
        layer.mlp.down_proj = SequenceParallelRowLinear(layer.mlp.down_proj.weight, comm, split)
    model.norm = SequenceParallelNorm(model.norm, comm, split)
    model.token_split = split
    model.run = types.MethodType(_run, model)
    return model


def residual_bytes(llm, prompts, max_tokens: int = 1) -> int:
    """The largest residual-stream activation one rank holds during `llm.generate(prompts)` (greedy, `max_tokens`
    each), in bytes: the largest input or output of a decoder layer, or input of an RMSNorm, recorded on rank 0
    (every rank holds the same shapes: under sequence parallelism each its padded slice); the largest step is the
    one that prefills the most tokens. One process, tensor-parallel or sequence-parallel alike; the all-gathered
    input of a column-parallel layer, whole under both, is not counted (see the module's docstring)."""
    import mini_engine as me

    model = getattr(llm.engine.model, "shard", llm.engine.model)  # rank 0's model, or the one process's
    largest = [0]

    def record_input(module, args):
        largest[0] = max(largest[0], args[0].nbytes)

    def record_output(module, args, output):
        largest[0] = max(largest[0], output.nbytes)

    watched = [m for m in model.modules() if isinstance(m, (DecoderLayer, RMSNorm))]
    hooks = [m.register_forward_pre_hook(record_input) for m in watched]
    hooks += [m.register_forward_hook(record_output) for m in watched if isinstance(m, DecoderLayer)]
    try:
        llm.generate(prompts, me.SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    finally:
        for h in hooks:
            h.remove()
    return largest[0]
