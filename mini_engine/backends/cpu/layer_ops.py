"""The small operations around a layer's weight products: RMSNorm, the rotary embedding of q and k, SwiGLU's
silu(gate) * up, and the paged cache's write. Each is PyTorch's ops, or, in an eager step on fp32 CPU tensors,
one fused C operator (csrc/layer_ops.c through csrc/torch_ops.cpp), as vLLM calls its own `rms_norm`,
`rotary_embedding`, `silu_and_mul` and `reshape_and_cache` kernels.

Why both: at the few rows of a decode step or a short prefill chunk, these operations are all dispatch and no
arithmetic, and the weight products between them evict the dispatcher's code and data from the caches, so
each PyTorch operator pays that again (on a 2-core Xeon with AMX, an RMSNorm of 32 rows: 59 us inside a step,
25 us when called twice in a row). One operator per operation instead of two to six takes most of that
away. A compiled graph keeps PyTorch's ops (`torch.compiler.is_compiling()`): Inductor fuses them itself, and
better, together with their neighbours. Where the C++ operators cannot be built (no compiler, no AVX2, or
MINI_ENGINE_C_KERNELS=0), PyTorch's ops run everywhere. Results agree with PyTorch's to float rounding: the
sums run in another order (tests/engine/test_layer_ops.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...model import apply_rope
from . import cpu_kernels


def fused(x: torch.Tensor) -> bool:
    """Whether x's operation runs as a fused C operator: an eager step (not being traced), fp32, on a CPU, with
    the operators built."""
    return (not torch.compiler.is_compiling() and x.dtype == torch.float32 and x.device.type == "cpu"
            and cpu_kernels.load_torch_ops())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension, normalised in fp32 (as the reference does,
    so that bf16/fp16 runs keep the statistic exact)."""
    if fused(x) and x.dim() == 2 and weight.dtype == torch.float32:
        return torch.ops.mini_engine_cpp.rms_norm(x, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """`apply_rope` on x [T, heads x D] (rows may be a view into a wider product's output): [T, heads, D]."""
    if fused(x) and cos.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous():
        return torch.ops.mini_engine_cpp.rope(x, cos, sin, heads)
    return apply_rope(x.view(x.shape[0], heads, -1), cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up, for gate_up [T, 2I] holding gate then up: [T, I]."""
    if fused(gate_up):
        return torch.ops.mini_engine_cpp.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def store_fused(k: torch.Tensor, v: torch.Tensor, k_rows: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether `store_rows` runs as the fused C operator: an eager fp32 CPU step, int32 rows (the engine's
    slot_mapping), each token's keys and values contiguous."""
    return (fused(k) and k_rows.dtype == torch.float32 and rows.dtype == torch.int32 and rows.is_contiguous()
            and k.stride(1) == k.shape[2] and v.stride(1) == v.shape[2])


def store_rows(k: torch.Tensor, v: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
               rows: torch.Tensor) -> None:
    """k_rows[rows] = k and v_rows[rows] = v: new keys and values k/v [T, Hkv, D] into the cache's rows [R, Hkv, D]."""
    if store_fused(k, v, k_rows, rows):
        torch.ops.mini_engine_cpp.store_rows(k, v, k_rows, v_rows, rows)
        return
    k_rows[rows] = k
    v_rows[rows] = v
