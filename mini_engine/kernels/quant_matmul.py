"""W4A16: a product with int4 weights, dequantized inside the kernel, in Triton (chapter 10).

y = x W^T with x [M, K] in fp16, bf16 or fp32 and W [N, K] stored as 4-bit codes q in [0, 15], two per byte
along K (`quant.pack_int4`: column 2j in the low nibble of byte j, 2j + 1 in the high one), rebuilt group by
group of `group_size` columns as w = (q - 8) * scale + zero, the rule torch's packed CPU kernel uses and the
one Q4_1 repacks into (scale = d, zero = m + 8 d). Scales and zeros come as one [K / group_size, N, 2] tensor,
the layout torch's int4 kernels take, in bf16 (or any float dtype).

One program computes a BLOCK_M x BLOCK_N tile of y and walks K in BLOCK_K steps. Each step loads a
[BLOCK_N, BLOCK_K / 2] tile of bytes (half the bytes of an fp8 weight, a quarter of fp16), splits it into
the codes of the even and of the odd columns, dequantizes both in registers with the scale and zero of each
column's group, and makes two products: the even columns of x against the low nibbles and the odd columns
against the high nibbles. The weight is read once per BLOCK_M rows of x, so decode (M = 1) reads 4.5 bits
per weight instead of 16, which is where a memory-bound step gets its speedup. The products accumulate in
fp32; the dequantized weights enter the product in x's dtype (bf16 or fp16: tensor cores).

Laid out like the other kernels: the kernel, its torch reference, the launch configuration and wrapper,
then `aot_specs` for compiling it ahead of time (aot.py). CPU tensors run in Triton's interpreter
(TRITON_INTERPRET=1, set before this import), which is how tests/kernels/test_quant_matmul.py checks it.
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
def _w4a16_matmul(X, W, SZ, Out, M, N, K,
                  stride_xm, stride_wn, stride_sg, stride_om,
                  GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)). W: [N, K / 2] bytes; SZ: [K / GROUP_SIZE, N, 2]."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, BLOCK_K // 2)          # byte j of the step holds columns 2j and 2j + 1
    in_m, in_n = offs_m < M, offs_n < N
    x_rows = X + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + 2 * offs_j                   # the even columns of this step
        in_k = cols < K
        x_even = tl.load(x_rows + cols[None, :], mask=in_m[:, None] & in_k[None, :], other=0.0)
        x_odd = tl.load(x_rows + (cols + 1)[None, :], mask=in_m[:, None] & in_k[None, :], other=0.0)
        byte = tl.load(w_rows + (k0 // 2 + offs_j)[None, :], mask=in_n[:, None] & in_k[None, :], other=0)
        # Columns 2j and 2j + 1 share a group (the group size is even): one scale and zero for both.
        sz = SZ + (cols // GROUP_SIZE)[None, :] * stride_sg + offs_n[:, None] * 2
        scale = tl.load(sz, mask=in_n[:, None] & in_k[None, :], other=0.0).to(tl.float32)
        zero = tl.load(sz + 1, mask=in_n[:, None] & in_k[None, :], other=0.0).to(tl.float32)
        w_even = (((byte & 15).to(tl.float32) - 8.0) * scale + zero).to(x_even.dtype)   # [BLOCK_N, BLOCK_K / 2]
        w_odd = (((byte >> 4).to(tl.float32) - 8.0) * scale + zero).to(x_even.dtype)
        acc += _dot(x_even, tl.trans(w_even), PRECISION, UPCAST)
        acc += _dot(x_odd, tl.trans(w_odd), PRECISION, UPCAST)
    out = Out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


# --------------------------------------------------------------------------------------------------
# 2. Reference (plain torch)
# --------------------------------------------------------------------------------------------------
def w4a16_matmul_reference(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor,
                           group_size: int) -> torch.Tensor:
    """The same product in torch: unpack the codes, dequantize in fp32, F.linear in fp32, back to x's dtype."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    codes = torch.stack([qweight & 15, qweight >> 4], dim=-1).view(n, k).float() - 8
    sz = scales_and_zeros.float().transpose(0, 1)  # [N, G, 2]
    w = (codes.view(n, k // group_size, group_size) * sz[..., :1] + sz[..., 1:]).view(n, k)
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
    """Tiles for `m` rows of x on `gpu` (None: the interpreter), whatever the dtype of the scales and zeros.

    Interpreter: 16 x 32 output tiles and 32 columns a step, so the tests' small shapes cross several tiles and
    steps (the masks and the group walk) in seconds.
    GPU: decode-sized calls (m <= 16) take the smallest row tile tl.dot allows (16) and wide column tiles, so
    many programs stream the weight at once; larger m takes 64-row tiles, which reuse each dequantized weight
    tile 64 times. A step of 64 columns (32 bytes a row) keeps the dequantized operands at 2 x 64 x 32 values.
    Tensor-core GPUs (sm_80 on) pipeline 3 steps deep; a T4, where Triton's products are FMAs, 2 steps with
    smaller tiles. fp32 inputs on sm_80 and later (exact "ieee" FMA products, with the asynchronous copies of
    the pipeline holding registers too) spilled at 4 warps with every tile of 32 x 64 and more (checked with
    aot.py): they take 16 x 64 tiles with 8 warps, whatever m. A prefill tile on a tensor-core GPU takes 8 warps
    too: at 4 it needed all 255 registers a thread, and spilled with fp32 scales and zeros (`int4_compact`'s) under
    every triton and with bf16 ones on an L4 under triton 3.7 (the one PyPI's torch 2.13 pins), not 3.9."""
    if gpu is None:
        return LaunchConfig(16, 32, 32, 1, 1)
    if dtype == torch.float32 and gpu.tensor_core_dot:
        return LaunchConfig(16, 64, 64, 8, 2)
    fma = not gpu.tensor_core_dot or dtype == torch.float32
    if m <= 16:
        return LaunchConfig(16, 64 if fma else 128, 64, 4, 2 if fma else 3)
    return LaunchConfig(32 if fma else 64, 64 if fma else 128, 64, 4 if fma else 8, 2 if fma else 3)


def _compile_time_args(m: int, group_size: int, dtype: torch.dtype, gpu: GPUSpec | None) -> dict:
    """Constexprs and launch options for one call, shared by the launch and `aot_specs`."""
    cfg = launch_config(m, dtype, gpu)
    return dict(GROUP_SIZE=group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                PRECISION="ieee" if dtype == torch.float32 else None,
                UPCAST=gpu is None and dtype == torch.bfloat16,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _check_inputs(x, qweight, scales_and_zeros, group_size) -> None:
    check_float_tensor("x", x, 2, "[M, K]")
    check_tensor("qweight", qweight, torch.uint8, (None, None), "[N, K / 2] (two 4-bit codes per byte)")
    n, k = qweight.shape[0], qweight.shape[1] * 2
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns but qweight holds {k} per row")
    if not isinstance(group_size, int) or group_size < 2 or group_size % 2 or k % group_size:
        raise ValueError(f"group_size must be an even int dividing K = {k}, got {group_size!r}")
    expected = (k // group_size, n, 2)
    # Any float dtype: the kernel widens scales and zeros to fp32 as it reads them.
    if not isinstance(scales_and_zeros, torch.Tensor) or tuple(scales_and_zeros.shape) != expected \
            or not scales_and_zeros.is_floating_point():
        raise ValueError(f"scales_and_zeros must be a float tensor of shape [K / group_size, N, 2] = {list(expected)}")
    for name, t in (("qweight", qweight), ("scales_and_zeros", scales_and_zeros)):
        check_device(name, t, "x", x)


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor,
                 group_size: int = 32) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype, W dequantized from qweight [N, K / 2] uint8 (`quant.pack_int4`)
    and scales_and_zeros [K / group_size, N, 2] (w = (q - 8) * scale + zero)."""
    _check_inputs(x, qweight, scales_and_zeros, group_size)
    check_launchable("x", x, _w4a16_matmul)
    # Unit stride along K for x (the kernel walks it with stride 1); W and the scales are read row-major.
    x, qweight, scales_and_zeros = x.contiguous(), qweight.contiguous(), scales_and_zeros.contiguous()
    m, n = x.shape[0], qweight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    args = launch_arguments(_compile_time_args, None if INTERPRETED else x.device, m, group_size, x.dtype)
    grid = (triton.cdiv(m, args["BLOCK_M"]), triton.cdiv(n, args["BLOCK_N"]))
    _w4a16_matmul[grid](x, qweight, scales_and_zeros, out, m, n, x.shape[1],
                        x.stride(0), qweight.stride(0), scales_and_zeros.stride(0), out.stride(0),
                        **args)
    return out


# --------------------------------------------------------------------------------------------------
# 4. What the wrapper launches on a GPU, for ahead-of-time compilation (aot.py, tests/kernels/test_aot.py)
# --------------------------------------------------------------------------------------------------
def aot_specs(gpu: GPUSpec, dtype: torch.dtype) -> list[KernelSpec]:
    """The launches of `_w4a16_matmul` on `gpu` for `dtype` that the course makes: decode-sized calls (16 rows
    or fewer) and prefill-sized ones (more), at the int4 group sizes of chapter 10 (32, Q4_1's and the default,
    and 64), scales and zeros in bf16 as the layers store them, and in fp32 as `int4_compact` layers make them
    once from their 8-bit codes (group 32), contiguous operands (strides are multiples of 16: K is a multiple of
    the group size, N of 16). Quantized models run in the GPU's model dtype only."""
    if dtype != gpu.model_dtype:
        return []
    ptr = f"*{TRITON_DTYPES[dtype]}:16"
    variants = [(group_size, torch.bfloat16, "") for group_size in (32, 64)]
    variants += [(32, torch.float32, ", fp32 compact scales")]
    specs = []
    for group_size, scales_dtype, what in variants:
        signature = dict(X=ptr, W="*u8:16", SZ=f"*{TRITON_DTYPES[scales_dtype]}:16", Out=ptr, M="i32", N="i32",
                         K="i32", stride_xm="i32:16", stride_wn="i32:16", stride_sg="i32:16", stride_om="i32:16")
        for m, label in ((1, "decode, 1 row"), (256, "prefill, 256 rows")):
            args = _compile_time_args(m, group_size, dtype, gpu)
            options = {name: args.pop(name) for name in ("num_warps", "num_stages")}
            specs.append(KernelSpec(_w4a16_matmul, signature, args, options, f"{label}, group {group_size}{what}"))
    return specs


__all__ = ["w4a16_matmul", "w4a16_matmul_reference", "launch_config", "LaunchConfig", "aot_specs"]
