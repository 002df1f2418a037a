"""A whole decode step as one compiled graph: how the cached decode step gets close to its weight products.

Chapter 03 measures an eager decode step on a CPU: the weight products are about two thirds of it, and
the rest is some 40 small kernels per layer (RMSNorm, RoPE, the cache write, residual adds, SiLU times
up), each paying dispatch and Python costs larger than its arithmetic. `torch.compile(fullgraph=True)`
traces the step once; Inductor fuses those small ops into a few C++ loops per layer and calls the products
as before. This is gpt-fast's `decode_one_token`, and the CPU counterpart of vLLM's CUDA graphs.

One graph serves every step only if the step's shapes do not change as the context grows, so:
- attention reads each slot's whole `max_len` and masks the positions past its context (as gpt-fast
  does): a little more attention arithmetic, no new shapes. The cache's length dimension is marked
  dynamic, so caches of any `max_len` share one graph.
- the new keys and values are written with one indexed store into the cache's base tensor. Written
  through per-layer views (`ContiguousKVCache.write`), the compiler copies the whole cache at each layer
  to keep the views consistent (measured: 0.27 ms a layer for a 116-position cache).
The first call compiles (about a minute for SmolLM2 on a 2-core CPU); later calls, even with other cache
lengths, reuse the graph. A new batch size, dtype or model compiles a new graph.

`compile="cpp"` (generate_cached(compile="cpp")) compiles the same step with Inductor's C++ wrapper: the
graph's few hundred kernel calls per step are made from generated C++ instead of generated Python, and
Dynamo skips its guards on the model's modules (each model, dtype and device gets a graph of its own, so none
is ever offered to another). Compiling takes about twice as long. It pays where the products are cheap:
for the int4 model (quant.py), whose 121 products take about 7 ms per token on one core of the CI machine,
the Python wrapper and the guards cost about 2 ms more per step: `bench --quantization int4` measured the
C++ wrapper at 116.4 tok/s against 97.9 with the Python one (one thread, load average 2, same run).
"""
from __future__ import annotations

import functools
import types
import weakref

import torch
import torch.nn.functional as F

from .attention import attention_in_fp32, run_attention


def _attend(q, k, v, see):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=see, enable_gqa=q.shape[1] != k.shape[1])


def decode_one_token(model, tokens, positions, slots, kv_data, attn_fp32: bool = False):
    """One new token per sequence, tensors only. tokens, positions, slots: [B] (slot = the sequence's row
    in the cache); kv_data: the cache's [layers, 2, slots, kv_heads, max_len, head_dim] tensor, updated in
    place; attn_fp32: run bf16/fp16 attention in fp32 (`attention.attention_in_fp32` decides, outside the
    graph). Returns logits [B, vocab]. Same arithmetic as `LlamaModel.forward` on a decode step."""
    b, max_len = tokens.shape[0], kv_data.shape[4]
    cos = model.rope_cos[positions, None].to(model.dtype)
    sin = model.rope_sin[positions, None].to(model.dtype)
    see = (torch.arange(max_len, device=tokens.device) <= positions[:, None])[:, None, None, :]  # [B,1,1,L]
    kv = torch.arange(2, device=tokens.device)[:, None].expand(2, b)  # index K then V, for each sequence
    x = model.embed_tokens(tokens)
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        q, k, v = attn.project(layer.input_layernorm(x), cos, sin)
        kv_data[torch.full_like(kv, i), kv, slots.expand(2, b), :, positions.expand(2, b)] = torch.stack([k, v])
        o = run_attention(attn_fp32, functools.partial(_attend, see=see), q.unsqueeze(2), kv_data[i, 0, slots],
                          kv_data[i, 1, slots])
        x = x + attn.o_proj(o.reshape(b, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.norm(x))


@functools.cache
def _compiled():
    # Built on first use: importing and configuring torch.compile costs seconds that eager runs need not pay.
    return torch.compile(decode_one_token, fullgraph=True, dynamic=False)


_CPP_GRAPHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(dtype, device): compiled step}


def _compiled_cpp(model):
    """The step for this model, dtype and device, compiled with the C++ wrapper and without guards on the
    model's modules. Dynamo keeps compiled graphs per code object, so each one compiles a fresh copy of
    `decode_one_token`'s code: with those guards skipped, a graph must never be offered to another model."""
    graphs = _CPP_GRAPHS.setdefault(model, {})
    key = (model.dtype, model.device)
    if key not in graphs:
        fn = types.FunctionType(decode_one_token.__code__.replace(), decode_one_token.__globals__,
                                decode_one_token.__name__, decode_one_token.__defaults__)
        graphs[key] = torch.compile(fn, fullgraph=True, dynamic=False, options={
            "cpp_wrapper": True, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
    return graphs[key]


COMPILE_MODES = (True, "cpp")


@torch.inference_mode()
def compiled_decode_step(model, kv_cache, tokens: list[int], context_lens: list[int], slots: list[int],
                         mode: bool | str = True) -> torch.Tensor:
    """`generate.decode_step` through the compiled graph: same arguments, same logits [B, vocab] (to
    rounding: fused kernels sum in another order). mode="cpp": the C++-wrapper graph (see the docstring)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be False, True or 'cpp', got {mode!r}")
    if not len(tokens) == len(context_lens) == len(slots):
        raise ValueError("tokens, context_lens and slots need one entry per sequence")
    model.check_last_position(max(context_lens) - 1, kv_cache)
    if min(context_lens) < 1:
        raise ValueError(f"context_lens must be >= 1 (they count the new token), got {min(context_lens)}")
    if kv_cache.max_len > 1:  # size-1 dimensions are always specialised; mark_dynamic would refuse them
        torch._dynamo.mark_dynamic(kv_cache.data, 4)
    device = model.device
    slots = torch.tensor(slots, device=device)
    # Timed eagerly at the graph's own attention shape (the whole max_len, masked): a Python bool in the graph.
    k = kv_cache.data[0, 0, slots]
    q = torch.zeros(len(tokens), model.config.num_heads, 1, k.shape[-1], dtype=k.dtype, device=device)
    see = torch.ones(1, 1, 1, k.shape[2], dtype=torch.bool, device=device)
    attn_fp32 = attention_in_fp32("decode", functools.partial(_attend, see=see), q, k, k)
    step = _compiled_cpp(model) if mode == "cpp" else _compiled()
    return step(model, torch.tensor(tokens, device=device), torch.tensor(context_lens, device=device) - 1,
                slots, kv_cache.data, attn_fp32)
