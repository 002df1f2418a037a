"""Writing a step's new keys and values into the paged KV cache, in Triton.

Every token of a step (a prefill chunk's many, a decode's one) has a slot in the paged cache, chosen by
the block manager: slot = block_id * block_size + offset, the token's place in its sequence's block.
`slot_mapping[t]` is token t's slot; -1 means "do not store" (vLLM's convention for padding tokens,
such as the rows a CUDA graph pads a batch with). One program copies one token's K and V, every KV head
at once, so a decode step of S sequences is S tiny programs: the copy is pure memory traffic.

The cache is [num_blocks, block_size, Hkv, D], so a slot's Hkv x D values are contiguous: the write is
one vectorised row per token, which is why this layout puts the heads inside the slot.
Laid out like the other kernels: kernel, torch reference, launch configuration and wrapper, then
`aot_specs` for compiling it ahead of time (aot.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .aot import TRITON_DTYPES, KernelSpec
from .checks import (check_device, check_float_tensor, check_head_dim, check_launchable, check_same_dtype,
                     check_same_shape, check_tensor, check_unit_stride)
from .flash_attention import INTERPRETED, _unit_stride
from .gpus import GPUSpec, launch_arguments


# The head count is masked against BLOCK_H, so it is not specialised: one compile per head size and
# block size serves every model with the same rounded-up head count.
@triton.jit(do_not_specialize=["num_kv_heads"])
def _store_kv(K, V, K_cache, V_cache, slot_mapping,
              stride_kt, stride_kh, stride_vt, stride_vh,
              stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
              num_kv_heads,
              KV_BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr):
    """Grid: (tokens,). Copies token t's [Hkv, D] keys and values to its slot."""
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t).to(tl.int64)  # int64: block * stride can pass 2**31 in a large pool
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    # BLOCK_H is Hkv rounded up to a power of two (tl.arange's rule); a skipped token writes no head.
    mask = offs_h[:, None] < tl.where(slot >= 0, num_kv_heads, 0)
    block = slot // KV_BLOCK_SIZE
    offset = slot % KV_BLOCK_SIZE
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(K_cache + block * stride_kcb + offset * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :],
             k, mask=mask)
    tl.store(V_cache + block * stride_vcb + offset * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :],
             v, mask=mask)


def store_kv_cache_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             slot_mapping: torch.Tensor) -> None:
    """The same write in torch: view each cache as [num_slots, Hkv, D] and index it by slot."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


@dataclass(frozen=True)
class LaunchConfig:
    num_warps: int


def head_rows(num_kv_heads: int) -> int:
    """BLOCK_H: the KV heads rounded up to a power of two."""
    return triton.next_power_of_2(num_kv_heads)


def launch_config(head_dim: int, num_kv_heads: int, dtype: torch.dtype, gpu: GPUSpec | None) -> LaunchConfig:
    """Warps for one token's copy: enough that each thread moves one 16-byte vector (the widest load a
    GPU thread issues), at most 8. SmolLM2's 3 x 64 bf16 row takes 1 warp; 8 x 128 takes 4. The copy is
    the same on every GPU; gpu=None (the interpreter) takes 1 warp."""
    if gpu is None:
        return LaunchConfig(num_warps=1)
    row_bytes = head_rows(num_kv_heads) * head_dim * (torch.finfo(dtype).bits // 8)
    return LaunchConfig(num_warps=min(8, max(1, row_bytes // (32 * 16))))


def _compile_time_args(head_dim: int, block_size: int, num_kv_heads: int, dtype: torch.dtype,
                       gpu: GPUSpec | None) -> dict:
    """The kernel's constexprs and launch options for one call, shared by the launch and `aot_specs`."""
    cfg = launch_config(head_dim, num_kv_heads, dtype, gpu)
    return dict(KV_BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_H=head_rows(num_kv_heads),
                num_warps=cfg.num_warps)


def _check_inputs(k, v, k_cache, v_cache, slot_mapping) -> None:
    for name, t, ndim, layout in (("k", k, 3, "[tokens, Hkv, D]"), ("v", v, 3, "[tokens, Hkv, D]"),
                                  ("k_cache", k_cache, 4, "[num_blocks, block_size, Hkv, D]"),
                                  ("v_cache", v_cache, 4, "[num_blocks, block_size, Hkv, D]")):
        check_float_tensor(name, t, ndim, layout)
        check_device(name, t, "k", k)
        check_same_dtype(name, t, "k", k)
    check_same_shape("k", k, "v", v)
    check_same_shape("k_cache", k_cache, "v_cache", v_cache)
    if k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"k holds [Hkv, D] = {list(k.shape[1:])} per token but k_cache holds "
                         f"{list(k_cache.shape[2:])} per slot")
    check_head_dim("k", k.shape[-1], smallest=1, largest=None)  # a copy: no tl.dot, so no lower bound of 16
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        # The kernel walks a slot's heads with the strides it is given, but head_dim with stride 1.
        check_unit_stride(name, cache, ": it is written in place")
    check_tensor("slot_mapping", slot_mapping, torch.int32, (k.shape[0],), f"[tokens = {k.shape[0]}]")
    check_device("slot_mapping", slot_mapping, "k", k)
    if k.device.type == "cpu":
        # Cheap on the host; on a GPU it would cost a device sync on every step.
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        if ((slot_mapping < -1) | (slot_mapping >= num_slots)).any():
            raise ValueError(f"slot_mapping entries must be -1 (skip) or a slot in [0, {num_slots}), "
                             f"got {slot_mapping.tolist()}")


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Write k/v [T, Hkv, D] into k_cache/v_cache [num_blocks, block_size, Hkv, D] (one layer's) in place:
    token t goes to slot slot_mapping[t] = block_id * block_size + offset, or nowhere when it is -1.
    k and v may be views (of a fused QKV projection, say) with any token and head strides."""
    _check_inputs(k, v, k_cache, v_cache, slot_mapping)
    check_launchable("k", k, _store_kv)
    k, v = _unit_stride(k), _unit_stride(v)
    slot_mapping = slot_mapping.contiguous()  # read at slot_mapping + t
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    args = launch_arguments(_compile_time_args, None if INTERPRETED else k.device, head_dim, k_cache.shape[1],
                            num_kv_heads, k.dtype)
    _store_kv[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        num_kv_heads, **args)


def aot_specs(gpu: GPUSpec, dtype: torch.dtype) -> list[KernelSpec]:
    """The launches of `_store_kv` on `gpu` for `dtype` that the course makes: SmolLM2's 3 KV heads of 64 at
    every block size the engine runs with in the chapters (16 by default, 8 in chapter 07's pool picture, and
    chapter 07's sweep of 1 to 256), and Llama-style 8 heads of 128 at block size 16. In fp16 on a bf16 GPU
    (gpu_check.sh's fp16 pass), SmolLM2 at block size 16 only; nothing in fp32."""
    # torch allocations, and views of a fused QKV projection cut at whole heads, are 16-byte aligned
    ptr = f"*{TRITON_DTYPES[dtype]}:16"
    signature = {name: "i32:16" for name in _store_kv.arg_names if name.startswith("stride_")}
    signature |= dict(K=ptr, V=ptr, K_cache=ptr, V_cache=ptr, slot_mapping="*i32:16", num_kv_heads="i32")
    variants = [(3, 64, block_size) for block_size in (1, 4, 8, 16, 64, 256)] + [(8, 128, 16)]
    if dtype != gpu.model_dtype:
        variants = [(3, 64, 16)] if dtype == torch.float16 else []
    specs = []
    for num_kv_heads, head_dim, block_size in variants:
        args = _compile_time_args(head_dim, block_size, num_kv_heads, dtype, gpu)
        options = {"num_warps": args.pop("num_warps")}
        specs.append(KernelSpec(_store_kv, signature, args, options,
                                f"{num_kv_heads} KV heads x head_dim {head_dim}, block_size {block_size}"))
    return specs


__all__ = ["store_kv_cache", "store_kv_cache_reference", "launch_config", "LaunchConfig", "head_rows", "aot_specs"]
