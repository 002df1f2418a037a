"""Lab 01: the naive decode loop and a FLOPs counter.

Fill in every function marked TODO in labs/lab01_naive.py, then grade your work with

    pytest tests/labs/test_lab01.py --impl=labs

The model you get is a `mini_engine` LlamaModel: `model(torch.tensor([ids]))` returns logits of shape
[1, len(ids), vocab]; `model.config` has num_layers, num_heads, head_dim, ...
"""
from __future__ import annotations

import torch
from torch import nn


def naive_generate(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """Greedy generation by full recompute: at every step, run the WHOLE sequence so far through the model,
    take the argmax of the last position's logits, and append it.

    Returns only the new tokens. Stop after `max_new_tokens` tokens, or right after emitting `eos_token_id`
    (that token is included in the output).
    """
    # TODO: chapter 01's loop, with greedy choice in place of sampling.
    raise NotImplementedError("lab01 naive_generate: what does the model see at each step, and which position's "
                              "logits choose the next token?")


def linear_flops(model: nn.Module, n_tokens: int) -> int:
    """FLOPs of every nn.Linear in `model` applied to `n_tokens` tokens.

    A Linear with in_features i and out_features o does i*o multiply-adds per token, and one multiply-add
    counts as 2 FLOPs. Walk the modules (model.modules()) and add them up.
    """
    # TODO: the docstring gives one layer's cost; which modules hold the weight matmuls?
    raise NotImplementedError("lab01 linear_flops: find every nn.Linear among the model's modules; its shape gives "
                              "its cost per token")


def attention_flops(config, n_tokens: int) -> int:
    """FLOPs of the two attention products (Q·Kᵀ and P·V) of a full causal forward pass over `n_tokens`
    tokens, computed the naive way (the whole n×n score matrix, masked afterwards).

    Per layer and query head each product is an (n × d) by (d × n) or (n × n) by (n × d) matmul:
    n·n·d multiply-adds each. Use config.num_layers, config.num_heads and config.head_dim.
    """
    # TODO: count one product's multiply-adds from its shapes, then how many products one pass runs.
    raise NotImplementedError("lab01 attention_flops: how many of these products does one pass run: per layer, per "
                              "query head or per KV head?")


def forward_flops(model: nn.Module, n_tokens: int) -> int:
    """FLOPs of one full forward pass over `n_tokens` tokens: the linear layers plus attention."""
    # TODO: what does one full pass consist of?
    raise NotImplementedError("lab01 forward_flops: you have counted both parts of a pass already")


def naive_generation_flops(model: nn.Module, prompt_len: int, new_tokens: int) -> int:
    """Total FLOPs of `naive_generate` producing `new_tokens` tokens after a prompt of `prompt_len` tokens
    (no early stop). Step s runs a forward pass over prompt_len + s tokens, for s = 0 .. new_tokens - 1."""
    # TODO: how long is the sequence at step s?
    raise NotImplementedError("lab01 naive_generation_flops: each step is one full pass; how many tokens does step "
                              "s see?")
