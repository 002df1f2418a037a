"""W8A16: a product with int8 weights and one scale per output channel, in Triton (chapter 10).

y = x W^T with x [M, K] in fp16, bf16 or fp32 and W [N, K] stored as int8 codes q in [-127, 127] with a scale per
row: w[n, k] = q[n, k] * scale[n] (`quant.quantize_int8`; the int8 LM head and the "int8" model's layers). The
codes are a plain row-major int8 matrix, so nothing is repacked for the kernel; the scales come as an [N] float
tensor (the layers store them in bf16).

One program computes a BLOCK_M x BLOCK_N tile of y and walks K in BLOCK_K steps. Each step loads a
[BLOCK_N, BLOCK_K] tile of codes (one byte a weight, half of fp16's), widens it to x's dtype and multiplies: a
code of at most 127 in magnitude is exact in fp16 and bf16, so the product sees the codes themselves and the
accumulator (fp32) holds sum_k x[m, k] q[n, k] with no rounding of the weights at all. The row's scale is applied
once, to the finished sum: y[m, n] = scale[n] * sum_k x[m, k] q[n, k]. Decode (M = 1) reads 8 bits per weight
instead of 16, which is what a memory-bound step can gain from; the weight is read once per BLOCK_M rows of x.

Laid out like quant_matmul.py (the W4A16 kernel): the kernel, its torch reference, the launch configuration and
wrapper, then `aot_specs` for compiling it ahead of time (aot.py). CPU tensors run in Triton's interpreter
(TRITON_INTERPRET=1, set before this import), which is how tests/kernels/test_int8_matmul.py checks it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .aot import TRITON_DTYPES, KernelSpec
from .checks import check_device, check_float_tensor, check_launchable, check_tensor
from .flash_attention import INTERPRETED, _dot
from .gpus import GPUSpec, launch_arguments


# --------------------------------------------------------------------------------------------------
# 1. The kernel
# --------------------------------------------------------------------------------------------------
# Sizes are not specialised: one compilation per tile configuration and dtype serves every layer.
@triton.jit(do_not_specialize=["M", "N", "K"])
def _w8a16_matmul(X, W, S, Out, M, N, K,
                  stride_xm, stride_wn, stride_om,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)). W: [N, K] int8; S: [N]."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    in_m, in_n = offs_m < M, offs_n < N
    x_rows = X + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + offs_k
        in_k = cols < K
        x = tl.load(x_rows + cols[None, :], mask=in_m[:, None] & in_k[None, :], other=0.0)
        q = tl.load(w_rows + cols[None, :], mask=in_n[:, None] & in_k[None, :], other=0)   # [BLOCK_N, BLOCK_K]
        # The codes exactly, in x's dtype (the interpreter's bf16 goes through fp32: see _dot).
        w = q.to(tl.float32) if UPCAST else q.to(x.dtype)
        acc += _dot(x, tl.trans(w), PRECISION, UPCAST)
    scale = tl.load(S + offs_n, mask=in_n, other=0.0).to(tl.float32)
    out = Out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, (acc * scale[None, :]).to(Out.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


# --------------------------------------------------------------------------------------------------
# 2. Reference (plain torch)
# --------------------------------------------------------------------------------------------------
def w8a16_matmul_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The same product in torch: dequantize in fp32 (w = q * scale), F.linear in fp32, back to x's dtype."""
    w = qweight.float() * scales.float()[:, None]
    return torch.nn.functional.linear(x.float(), w).to(x.dtype)


# --------------------------------------------------------------------------------------------------
# 3. Launch configuration and wrapper
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def launch_config(m: int, dtype: torch.dtype, gpu: GPUSpec | None) -> LaunchConfig:
    """Tiles for `m` rows of x on `gpu` (None: the interpreter).

    Interpreter: 16 x 32 output tiles and 32 columns a step, so the tests' small shapes cross several tiles and
    steps (the masks) in seconds.
    GPU: the W4A16 kernel's reasoning (quant_matmul.launch_config). Decode-sized calls (m <= 16) take the
    smallest row tile tl.dot allows (16) and wide column tiles, so many programs stream the weight at once; larger
    m takes 64-row tiles, which reuse each widened weight tile 64 times. Tensor-core GPUs (sm_80 on) walk K 64
    columns a step (64 bytes a row of codes) and pipeline 3 steps deep. Where the products are FMAs (a T4, where
    Triton has no tensor-core path, and fp32 "ieee" inputs) the operands sit in registers: a T4 at 64 columns a
    step spilled (248 and 280 bytes a thread at 4 warps, compiled with aot.py), so FMA products take 32, the
    W4A16 kernel's width per product, and 2 stages; fp32 on sm_80 and later takes 16 x 64 tiles with 8 warps, as
    the W4A16 kernel does. tests/kernels/test_aot.py compiles the course's launches for each GPU it names and
    checks that none spills registers or overflows shared memory."""
    if gpu is None:
        return LaunchConfig(16, 32, 32, 1, 1)
    if dtype == torch.float32 and gpu.tensor_core_dot:
        return LaunchConfig(16, 64, 32, 8, 2)
    fma = not gpu.tensor_core_dot or dtype == torch.float32
    if m <= 16:
        return LaunchConfig(16, 64 if fma else 128, 32 if fma else 64, 4, 2 if fma else 3)
    return LaunchConfig(32 if fma else 64, 64 if fma else 128, 32 if fma else 64, 4, 2 if fma else 3)


def _compile_time_args(m: int, dtype: torch.dtype, gpu: GPUSpec | None) -> dict:
    """Constexprs and launch options for one call, shared by the launch and `aot_specs`."""
    cfg = launch_config(m, dtype, gpu)
    return dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                PRECISION="ieee" if dtype == torch.float32 else None,
                UPCAST=gpu is None and dtype == torch.bfloat16,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _check_inputs(x, qweight, scales) -> None:
    check_float_tensor("x", x, 2, "[M, K]")
    check_tensor("qweight", qweight, torch.int8, (None, None), "[N, K] (one int8 code per weight)")
    n, k = qweight.shape
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns but qweight holds {k} per row")
    # Any float dtype: the kernel widens the scales to fp32 as it reads them.
    if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != (n,) or not scales.is_floating_point():
        raise ValueError(f"scales must be a float tensor of shape [N] = [{n}] (one per row of qweight)")
    for name, t in (("qweight", qweight), ("scales", scales)):
        check_device(name, t, "x", x)


def w8a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype, W = qweight [N, K] int8 times scales [N] row by row
    (w[n, k] = qweight[n, k] * scales[n])."""
    _check_inputs(x, qweight, scales)
    check_launchable("x", x, _w8a16_matmul)
    # Unit stride along K for x and W (the kernel walks both with stride 1); one scale per row, read in order.
    x, qweight, scales = x.contiguous(), qweight.contiguous(), scales.contiguous()
    m, n = x.shape[0], qweight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    args = launch_arguments(_compile_time_args, None if INTERPRETED else x.device, m, x.dtype)
    grid = (triton.cdiv(m, args["BLOCK_M"]), triton.cdiv(n, args["BLOCK_N"]))
    _w8a16_matmul[grid](x, qweight, scales, out, m, n, x.shape[1],
                        x.stride(0), qweight.stride(0), out.stride(0), **args)
    return out


# --------------------------------------------------------------------------------------------------
# 4. What the wrapper launches on a GPU, for ahead-of-time compilation (aot.py, tests/kernels/test_aot.py)
# --------------------------------------------------------------------------------------------------
def aot_specs(gpu: GPUSpec, dtype: torch.dtype) -> list[KernelSpec]:
    """The launches of `_w8a16_matmul` on `gpu` for `dtype` that the course makes: decode-sized calls (16 rows or
    fewer) and prefill-sized ones (more), scales in bf16 as the layers store them, contiguous operands. SmolLM2's
    int8 products (the head, 49,152 x 576, and the "int8" model's layers: 960, 576, 3,072 x 576 and 576 x 1,536)
    have strides that are multiples of 16, which the signature states; their sizes are runtime values. Quantized
    models run in the GPU's model dtype only."""
    if dtype != gpu.model_dtype:
        return []
    ptr = f"*{TRITON_DTYPES[dtype]}:16"
    signature = dict(X=ptr, W="*i8:16", S="*bf16:16", Out=ptr, M="i32", N="i32", K="i32", stride_xm="i32:16",
                     stride_wn="i32:16", stride_om="i32:16")
    specs = []
    for m, label in ((1, "decode, 1 row"), (256, "prefill, 256 rows")):
        args = _compile_time_args(m, dtype, gpu)
        options = {name: args.pop(name) for name in ("num_warps", "num_stages")}
        specs.append(KernelSpec(_w8a16_matmul, signature, args, options, label))
    return specs


__all__ = ["w8a16_matmul", "w8a16_matmul_reference", "launch_config", "LaunchConfig", "aot_specs"]
