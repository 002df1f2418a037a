"""PagedAttention for decode, in Triton.

A paged KV cache stores each sequence's keys and values in fixed-size blocks (pages) of `block_size`
token slots, scattered anywhere in one pool; a per-sequence block table lists them in order. Token
position p of sequence s lives in block `block_tables[s, p // block_size]` at offset `p % block_size`.
Decode brings one new query token per sequence, which attends to that sequence's `context_lens[s]`
cached positions (the new token's own key and value included: kv_store.py wrote them first).

One program owns one sequence and one KV head. It walks the context in BLOCK_N-token tiles, looks up
each position's block in the block table (a tile may span several blocks, or part of one), loads the
K and V tiles once and uses them for every query head of its GQA group, folding each tile into an
online softmax as FlashAttention does. Decode reads every cached byte once and does little math with
it, so its speed is memory bandwidth: loading K/V once per group, not once per query head, is what
GQA buys here. tl.dot needs at least 16 rows on a GPU, so the group (3 query heads for SmolLM2) is
padded to BLOCK_G >= 16 rows under a mask: the idle rows cost arithmetic, which decode has to spare,
and no extra memory traffic.

Laid out like flash_attention.py: the kernel, the torch reference (a gather through the block
table), the launch configuration (chosen from a GPU described as data, `gpus.GPUSpec`, so it can be
compiled ahead of time for a GPU that is not here) and the wrapper, then test and benchmark hooks and
`aot_specs`, what the wrapper launches on each GPU (aot.py compiles those without a GPU).
Positions past a sequence's context are never read, so blocks it does not own may hold anything.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .aot import TRITON_DTYPES, KernelSpec
from .checks import (check_device, check_float_tensor, check_gqa_heads, check_head_dim, check_launchable,
                     check_out, check_same_dtype, check_same_shape, check_tensor)
from .flash_attention import _LOG2E, INTERPRETED, _dot, _unit_stride
from .gpus import GPUSpec, launch_arguments


# --------------------------------------------------------------------------------------------------
# 1. The kernel
# --------------------------------------------------------------------------------------------------
# The GQA group size is a runtime argument (masked against BLOCK_G), so models that differ only in
# their group share one compile. The cache and query strides stay specialised (they are multiples of
# head_dim, so of 16, and the hint lets loads vectorise); the block table's row stride is its width,
# which changes with the longest context and is read one entry at a time: not specialised either.
@triton.jit(do_not_specialize=["group_size", "stride_bts"])
def _paged_decode_fwd(Q, K_cache, V_cache, Out, block_tables, context_lens,
                      stride_qs, stride_qh,
                      stride_kb, stride_kt, stride_kh,
                      stride_vb, stride_vt, stride_vh,
                      stride_bts, stride_os, stride_oh,
                      group_size, qk_scale,
                      KV_BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                      BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Grid: (sequences, KV heads). Query heads kv_head * group_size + [0, group_size) share this KV head."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens + seq)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    in_group = offs_g < group_size
    heads = kv_head * group_size + offs_g
    q = tl.load(Q + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=in_group[:, None], other=0.0)

    k_head = K_cache + kv_head * stride_kh
    v_head = V_cache + kv_head * stride_vh
    block_table = block_tables + seq * stride_bts
    # A large finite start for the running max: exp2(m_old - m_new) must never see -inf - (-inf).
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)

    for start in range(0, context_len, BLOCK_N):
        pos = start + offs_n
        valid = pos < context_len
        # Positions past the context read neither the block table nor the cache: the entries there
        # may be stale or padding, and the slots may belong to another sequence (or hold NaN).
        block = tl.load(block_table + pos // KV_BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offset = pos % KV_BLOCK_SIZE
        # K is read as a [HEAD_DIM, BLOCK_N] tile (already transposed) so q @ k needs no transpose.
        k = tl.load(k_head + (block * stride_kb + offset * stride_kt)[None, :] + offs_d[:, None],
                    mask=valid[None, :], other=0.0)
        scores = _dot(q, k, PRECISION, UPCAST) * qk_scale
        scores = tl.where(valid[None, :], scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + (block * stride_vb + offset * stride_vt)[:, None] + offs_d[None, :],
                    mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new

    # An empty context (context_len 0) leaves l_i == 0 and acc == 0: the output row is zeros.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(Out + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=in_group[:, None])


# --------------------------------------------------------------------------------------------------
# 2. Reference (plain torch: gather each sequence's blocks, then ordinary attention)
# --------------------------------------------------------------------------------------------------
def gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """One sequence's first `context_len` positions out of a paged cache [num_blocks, block_size, H, D]:
    its blocks in block-table order, laid end to end -> [context_len, H, D]. Only the blocks the context
    covers are touched."""
    num_blocks = -(-context_len // cache.shape[1])
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:context_len]


def paged_decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                                     scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v for each sequence over its gathered context, in fp32; returns q's dtype.

    Same arguments and conventions as `paged_decode_attention`; a sequence with an empty context gets zeros.
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    out = torch.zeros_like(q)
    for s, n in enumerate(context_lens.tolist()):
        if n == 0:
            continue
        k = gather_context(k_cache, block_tables[s], n).float()  # [n, Hkv, D]
        v = gather_context(v_cache, block_tables[s], n).float()
        qs = q[s].float().view(num_kv_heads, group, head_dim)     # query head h reads KV head h // group
        probs = torch.softmax(torch.einsum("hgd,nhd->hgn", qs, k) * scale, dim=-1)
        out[s] = torch.einsum("hgn,nhd->hgd", probs, v).reshape(q.shape[1], head_dim).to(q.dtype)
    return out


# --------------------------------------------------------------------------------------------------
# 3. Launch configuration and wrapper
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchConfig:
    block_n: int  # context positions per tile (independent of the cache's block_size)
    num_warps: int
    num_stages: int


def group_rows(group_size: int) -> int:
    """BLOCK_G: the GQA group padded to a power of two of at least 16 rows (tl.dot's minimum on a GPU)."""
    return max(16, triton.next_power_of_2(group_size))


def launch_config(head_dim: int, dtype: torch.dtype, gpu: GPUSpec | None) -> LaunchConfig:
    """Tile sizes for a GPU described as data (gpu=None: Triton's interpreter).

    Interpreter: 16-position tiles, so the tests' short contexts (15, 16, 17, 100 tokens) span several
    tiles and block-table entries, which exercises the online softmax and the edge masks.

    GPU: decode is bound by memory bandwidth, so each program should keep many bytes in flight: the
    largest K/V tile that fits. From Ampere (sm_80) on, Triton pipelines the loads through shared memory
    with asynchronous copies, keeping up to num_stages - 1 K and V tiles in flight beside the q and P
    tiles: the largest tile and depth whose count fits the GPU's shared memory with 10% slack (an upper
    bound: tests/kernels/test_aot.py reads the real figure off the compiled kernel). A T4 (sm_75) has no
    asynchronous copies, and Triton 3 gives it no tensor-core products either, so its tiles and products
    sit in registers: a tile of 8 warps x 32 threads x 16 elements at most, or it spills. Warps: enough
    that a K tile is at most 16 elements per thread, between 4 and 8.
    The tile does not depend on the cache's block_size: the table lookup is per position, so a tile may
    cover several blocks or part of one, as long as it is at least 16 positions (tl.dot).
    fp32 inputs (tests, not serving) get exact "ieee" products with no tensor-core path: smaller tiles.
    """
    if gpu is None:
        return LaunchConfig(block_n=16, num_warps=1, num_stages=1)
    elt = torch.finfo(dtype).bits // 8
    if gpu.capability < (8, 0):
        block_n, stages = max(16, min(128, (8 * 32 * 16) // head_dim)), 1
    else:
        candidates = ((32, 3), (32, 2), (16, 2)) if dtype == torch.float32 else ((128, 3), (64, 3), (64, 2), (16, 2))
        rows = group_rows(1)
        for block_n, stages in candidates:
            need = ((stages - 1) * 2 * block_n * head_dim + rows * block_n + rows * head_dim) * elt
            if need * 1.1 <= gpu.shared_memory_per_block:
                break
    num_warps = min(8, max(4, block_n * head_dim // (32 * 16)))
    return LaunchConfig(block_n, num_warps, stages)


def _compile_time_args(head_dim: int, block_size: int, group: int, dtype: torch.dtype,
                       gpu: GPUSpec | None) -> dict:
    """The kernel's constexprs and launch options for one call; the launch and `aot_specs` both take them
    from here, so what CI compiles for a GPU is what the wrapper launches there."""
    cfg = launch_config(head_dim, dtype, gpu)
    return dict(KV_BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_G=group_rows(group), BLOCK_N=cfg.block_n,
                # fp32 inputs get true fp32 products; the default (TF32) would cost ~1e-3 of accuracy.
                PRECISION="ieee" if dtype == torch.float32 else None,
                UPCAST=gpu is None and dtype == torch.bfloat16,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _check_inputs(q, k_cache, v_cache, block_tables, context_lens) -> None:
    check_float_tensor("q", q, 3, "[num_seqs, Hq, D]")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_float_tensor(name, t, 4, "[num_blocks, block_size, Hkv, D]")
        check_device(name, t, "q", q)
        check_same_dtype(name, t, "q", q)
    check_same_shape("k_cache", k_cache, "v_cache", v_cache)
    num_seqs, heads_q, head_dim = q.shape
    num_blocks, block_size, heads_kv, _ = k_cache.shape
    if k_cache.shape[-1] != head_dim:
        raise ValueError(f"k_cache has head_dim {k_cache.shape[-1]} but q has {head_dim}")
    check_head_dim("q", head_dim)
    check_gqa_heads(heads_q, heads_kv, "k_cache/v_cache")
    if block_size < 1:
        raise ValueError("k_cache must have a block_size (dim 1) of at least 1")
    check_tensor("block_tables", block_tables, torch.int32, (None, None), "[num_seqs, max_blocks]")
    check_tensor("context_lens", context_lens, torch.int32, (None,), "[num_seqs]")
    for name, t in (("block_tables", block_tables), ("context_lens", context_lens)):
        check_device(name, t, "q", q)
    if block_tables.shape[0] != num_seqs or context_lens.shape[0] != num_seqs:
        raise ValueError(f"block_tables and context_lens must have one row per sequence of q ({num_seqs}), got "
                         f"{block_tables.shape[0]} and {context_lens.shape[0]}")
    if q.device.type == "cpu":
        # Cheap on the host; on a GPU these checks would cost a device sync on every decode step.
        capacity = block_tables.shape[1] * block_size
        if (context_lens < 0).any() or (context_lens > capacity).any():
            raise ValueError(f"context_lens must lie in [0, max_blocks * block_size = {capacity}], "
                             f"got {context_lens.tolist()}")
        for s, n in enumerate(context_lens.tolist()):
            used = block_tables[s, :-(-n // block_size)]
            if ((used < 0) | (used >= num_blocks)).any():
                raise ValueError(f"block_tables row {s} points outside the cache's {num_blocks} blocks "
                                 f"within its context: {used.tolist()}")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step of attention over a paged KV cache (one layer): q [S, Hq, D] -> [S, Hq, D].

    k_cache / v_cache [num_blocks, block_size, Hkv, D] hold this layer's keys and values; Hq must be a
    multiple of Hkv (query head h reads KV head h // (Hq // Hkv)). block_tables [S, max_blocks] int32
    lists each sequence's blocks in order; context_lens [S] int32 says how many positions it attends to
    (any length, not only block multiples; 0 gives a zero row). Entries past a sequence's context are
    never read. scale defaults to 1/sqrt(D). `out`, if given, receives the result.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens)
    out = check_out(out, q)
    check_launchable("q", q, _paged_decode_fwd)
    q, k_cache, v_cache, block_tables = (_unit_stride(t) for t in (q, k_cache, v_cache, block_tables))
    context_lens = context_lens.contiguous()  # read at context_lens + seq
    num_seqs, heads_q, head_dim = q.shape
    block_size, heads_kv = k_cache.shape[1], k_cache.shape[2]
    if out.numel() == 0:
        return out
    group = heads_q // heads_kv
    args = launch_arguments(_compile_time_args, None if INTERPRETED else q.device, head_dim, block_size, group,
                            q.dtype)
    sm_scale = head_dim ** -0.5 if scale is None else float(scale)
    _paged_decode_fwd[(num_seqs, heads_kv)](
        q, k_cache, v_cache, out, block_tables, context_lens,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1),
        group, sm_scale * _LOG2E, **args)
    return out


# --------------------------------------------------------------------------------------------------
# 4. Test and benchmark hooks
# --------------------------------------------------------------------------------------------------
def random_paged_inputs(context_lens: list[int], heads_q: int, heads_kv: int, head_dim: int, block_size: int,
                        dtype: torch.dtype, device: str, seed: int = 0, spare_blocks: int = 3):
    """Random decode inputs laid out the way a paged cache really is: each sequence owns just the blocks its
    context needs, drawn from a shuffled pool (so neighbours in a table are not neighbours in memory), and
    every slot no sequence may read (spare blocks, the tail of each last block, table padding) is NaN, or
    an out-of-range block id, so a kernel that reads past a context cannot pass.

    Returns (q, k_cache, v_cache, block_tables, context_lens).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(needed) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen, device=device)
    # Padding entries point past the pool: reading one would fault on a GPU and fail the check on a CPU.
    block_tables = torch.full((len(context_lens), max([*needed, 1])), num_blocks + 7, dtype=torch.int32,
                              device=device)
    k_cache = torch.full((num_blocks, block_size, heads_kv, head_dim), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    first = 0
    for s, (n, count) in enumerate(zip(context_lens, needed)):
        blocks = order[first:first + count]
        first += count
        block_tables[s, :count] = blocks.int()
        # Positions 0..n-1 through the table; the tail of the last block stays NaN.
        pos = torch.arange(n, device=device)
        for cache in (k_cache, v_cache):
            cache[blocks[pos // block_size], pos % block_size] = torch.randn(
                n, heads_kv, head_dim, generator=gen, device=device).to(dtype)
    q = torch.randn(len(context_lens), heads_q, head_dim, generator=gen, device=device).to(dtype)
    return q, k_cache, v_cache, block_tables, torch.tensor(context_lens, dtype=torch.int32, device=device)


def kv_bytes_read(context_lens: torch.Tensor, k_cache: torch.Tensor) -> int:
    """Bytes of K and V one call must read: every context position, every KV head, once (the floor
    that makes decode memory-bound; q, the tables and the output are negligible beside it)."""
    _, _, heads_kv, head_dim = k_cache.shape
    return 2 * int(context_lens.sum()) * heads_kv * head_dim * k_cache.element_size()


# --------------------------------------------------------------------------------------------------
# 5. What the wrapper launches on a GPU, for ahead-of-time compilation (aot.py, tests/kernels/test_aot.py)
# --------------------------------------------------------------------------------------------------
def aot_specs(gpu: GPUSpec, dtype: torch.dtype) -> list[KernelSpec]:
    """The launches of `_paged_decode_fwd` on `gpu` for `dtype` that the course makes: SmolLM2's heads (9 query
    heads on 3 KV heads of 64) at every block size the engine runs with in the chapters (16 by default, 8 in
    chapter 07's pool picture, and chapter 07's sweep of 1 to 256), and benchmarks/bench_paged_attention.py's
    Llama-style 32 on 8 heads of 128 at block size 16. The larger SmolLM2 models (15 on 5, 32 on 32) compile to
    the same code as the 135M: a GQA group of up to 16 pads to BLOCK_G = 16. In fp16 on a bf16 GPU (gpu_check.sh's
    fp16 pass), SmolLM2 at block size 16 only; nothing in fp32."""
    ptr = f"*{TRITON_DTYPES[dtype]}:16"  # torch allocations are 16-byte aligned
    signature = {name: "i32:16" for name in _paged_decode_fwd.arg_names if name.startswith("stride_")}
    signature |= dict(Q=ptr, K_cache=ptr, V_cache=ptr, Out=ptr, block_tables="*i32:16", context_lens="*i32:16",
                      stride_bts="i32", group_size="i32", qk_scale="fp32")
    variants = [("SmolLM2-135M", 9, 3, 64, block_size) for block_size in (1, 4, 8, 16, 64, 256)]
    variants += [("SmolLM2-360M", 15, 5, 64, 16), ("SmolLM2-1.7B", 32, 32, 64, 16), ("Llama-3-8B", 32, 8, 128, 16)]
    if dtype != gpu.model_dtype:
        variants = [("SmolLM2-135M", 9, 3, 64, 16)] if dtype == torch.float16 else []
    specs = []
    for model, heads_q, heads_kv, head_dim, block_size in variants:
        args = _compile_time_args(head_dim, block_size, heads_q // heads_kv, dtype, gpu)
        options = {name: args.pop(name) for name in ("num_warps", "num_stages")}
        specs.append(KernelSpec(_paged_decode_fwd, signature, args, options,
                                f"decode, {model} ({heads_q}/{heads_kv} heads of {head_dim}), block_size {block_size}"))
    return specs


__all__ = ["paged_decode_attention", "paged_decode_attention_reference", "gather_context", "launch_config",
           "LaunchConfig", "group_rows", "random_paged_inputs", "kv_bytes_read", "aot_specs"]
