"""Lab 02: FLOPs and bytes of a forward pass, arithmetic intensity and the roofline.

Fill in every function marked TODO in labs/lab02_flops_bytes.py, then grade your work with

    pytest tests/labs/test_lab02.py --impl=labs

The model you get is a `mini_engine` LlamaModel: its `nn.Linear` layers hold every matmul weight, and
`model.config` has num_layers, num_heads, num_kv_heads, head_dim, hidden_size. All counts are for ONE
forward pass; a decode step is a forward pass of one new token per sequence against the KV cache.
"""
from __future__ import annotations

from torch import nn


def forward_flops(model: nn.Module, n_tokens: int, context_len: int | None = None) -> int:
    """FLOPs of one forward pass of one sequence: `n_tokens` new tokens go through every nn.Linear
    (logits included, one row per new token), and in attention each new token scores all `context_len`
    keys (default: n_tokens, a full pass with no cache; with a cache, context_len = cached + new).

    Count attention as naive attention computes it: per layer and query head, Q·Kᵀ and P·V each do
    n_tokens · context_len · head_dim multiply-adds, masked or not. One multiply-add is 2 FLOPs.
    """
    # TODO: lab 01 counted a full pass; what changes when only n_tokens are new and they attend to context_len keys?
    raise NotImplementedError("lab02 forward_flops: which part of the work grows with the new tokens alone, and "
                              "which with new tokens times keys?")


def forward_bytes(model: nn.Module, n_tokens: int, context_len: int | None = None, dtype_bytes: int = 4) -> int:
    """Bytes one forward pass of one sequence must move between memory and the processor, at best:

    * every weight once (each parameter tensor once: a tied embedding is one tensor);
    * K and V of all `context_len` positions (default n_tokens) in every layer, each KV head a vector of
      head_dim numbers: the cached ones are read, the new ones written;
    * the hidden state (hidden_size numbers per new token) read and written once by every layer.

    Everything is `dtype_bytes` bytes per number (4 for fp32, 2 for fp16/bf16).
    """
    # TODO: the docstring lists three kinds of traffic: count the numbers of each, then their bytes.
    raise NotImplementedError("lab02 forward_bytes: model.parameters() and model.config give every count (a tied "
                              "weight is one tensor: count it once)")


def arithmetic_intensity(model: nn.Module, n_tokens: int, context_len: int | None = None,
                         dtype_bytes: int = 4) -> float:
    """FLOPs per byte moved of that forward pass. A prefill of n tokens reuses every weight n times;
    a decode step (n_tokens = 1) uses each weight once."""
    # TODO: intensity is work over traffic.
    raise NotImplementedError("lab02 arithmetic_intensity: you have both halves of the ratio above")


def decode_intensity(model: nn.Module, batch: int, context_len: int, dtype_bytes: int = 4) -> float:
    """Arithmetic intensity of ONE decode step that advances `batch` sequences by one token each, every
    sequence attending to `context_len` keys. The batch shares one read of the weights; each sequence
    brings its own FLOPs, its own K/V and its own hidden state."""
    # TODO: which traffic does the batch share, and which does each sequence bring?
    raise NotImplementedError("lab02 decode_intensity: split a pass's bytes into the part the batch shares and the "
                              "part each sequence adds")


def attainable_flops(intensity: float, peak_flops: float, peak_bw: float) -> float:
    """The roofline: the FLOP/s a kernel of this intensity can reach, limited either by the bytes the
    memory delivers per second (intensity · bandwidth) or by the arithmetic units (peak FLOP/s)."""
    # TODO: chapter 02's roofline: two ceilings, and a kernel meets the lower one.
    raise NotImplementedError("lab02 attainable_flops: what limits a kernel whose bytes arrive slower than its "
                              "FLOPs could use them, and what otherwise?")


def min_batch_for_compute_bound(model: nn.Module, context_len: int, peak_flops: float, peak_bw: float,
                                dtype_bytes: int = 4, max_batch: int = 4096) -> int | None:
    """The smallest batch (1 .. max_batch) whose decode step reaches the ridge point (intensity ≥
    peak_flops / peak_bw), i.e. is no longer memory-bound. None if no batch up to max_batch does: the
    per-sequence K/V reads grow with the batch too, so for long contexts the ridge may be out of reach."""
    # TODO: where is the ridge point, and how does decode_intensity move with the batch?
    raise NotImplementedError("lab02 min_batch_for_compute_bound: try the batches in order with decode_intensity; "
                              "when is there no answer?")
