"""FlashAttention forward pass in Triton.

One program owns a BLOCK_M tile of queries for one head. It keeps that tile on chip and streams the
keys and values past it in BLOCK_N tiles; an online softmax (running max `m`, running sum `l`, running
output `acc`) folds each tile into the answer, so the N x N score matrix is never written to memory.
The extra memory is O(N) (the output) instead of O(N^2) (the scores), and the work is the same FLOPs.

Laid out like Triton's tutorials, top to bottom:
  1. the kernel (`_attn_fwd_inner` is the loop over K/V tiles, `_attn_fwd` the program around it),
  2. the torch references that materialise the scores (`attention_reference`, `attention_reference_varlen`),
  3. the wrappers that validate, pick block sizes and launch (`flash_attention`, `flash_attention_varlen`),
  4. a test hook (`max_error_vs_reference`) and a benchmark hook (`benchmark_tflops`),
  5. `aot_specs`: what the wrappers launch on a given GPU, for compiling it without one (aot.py).

Conventions shared by every entry point:
  - GQA: query head h reads KV head h // (Hq // Hkv); K and V are never repeated in memory.
  - Causal masking is bottom-right aligned: with q_len queries and k_len keys, query i sees keys
    j <= i + (k_len - q_len). When k_len > q_len the queries are the *last* q_len positions (a prefill
    chunk continuing a cached context). A query that sees no key at all (possible only when
    k_len < q_len) gets an all-zero output row, as in flash-attn.
  - Inputs are fp32, fp16 or bf16; scores, softmax statistics and the accumulator are fp32.
  - CPU tensors run in Triton's interpreter, which needs TRITON_INTERPRET=1 in the environment before
    this module is imported (the env var is read when `@triton.jit` decorates the kernels).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .aot import TRITON_DTYPES, KernelSpec
from .checks import (check_device, check_float_tensor, check_gqa_heads, check_head_dim, check_launchable,
                     check_out, check_same_dtype, check_same_shape, check_tensor)
from .gpus import GPUSpec, launch_arguments

# Scores are scaled by sm_scale * log2(e) so the kernel can use exp2, which maps to one hardware
# instruction, while computing exactly exp(sm_scale * q.k).
_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------------
# 1. The kernel
# --------------------------------------------------------------------------------------------------
@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # Triton's interpreter stores bf16 as raw uint16 and its tl.dot multiplies those bit patterns
    # (triton-lang/triton#11584, not supported upstream), so under the interpreter bf16 operands are
    # widened to fp32 first. That is exact (a bf16 product fits in fp32, which is also what tensor
    # cores accumulate in); compiled kernels get UPCAST=False and never see this branch.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                    offs_m, offs_d, lo, hi, k_len, diag, qk_scale,
                    CAUSAL: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Fold the key/value tiles [lo, hi) into the running (acc, l_i, m_i) of one query tile.

    The caller splits the key range in two: tiles every query row may see in full (MASKED=False, no
    per-element test at all) and the tiles crossing the causal diagonal or the end of the keys
    (MASKED=True). Most tiles take the cheap path, which is where the speed comes from.
    """
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        # K is read as a [HEAD_DIM, BLOCK_N] tile (already transposed) so q @ k needs no transpose.
        k_ptrs = k_base + cols[None, :] * stride_kn + offs_d[:, None]
        v_ptrs = v_base + cols[:, None] * stride_vn + offs_d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=cols[None, :] < k_len, other=0.0)
        else:
            k = tl.load(k_ptrs)
        qk = _dot(q, k, PRECISION, UPCAST) * qk_scale
        if MASKED:
            visible = cols[None, :] < k_len
            if CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None] + diag)
            qk = tl.where(visible, qk, float("-inf"))

        # Online softmax: raise the running max if this tile holds a larger score, shrink what was
        # accumulated under the old max by exp(m_old - m_new), then add this tile's contribution.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        if MASKED:
            v = tl.load(v_ptrs, mask=cols[:, None] < k_len, other=0.0)
        else:
            v = tl.load(v_ptrs)
        # P goes back to the input dtype so the second product also runs on fp16/bf16 tensor cores;
        # the accumulator itself stays fp32.
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new
    return acc, l_i, m_i


# Triton compiles a variant per "shape class" of its integer arguments (== 1, divisible by 16). Lengths
# and the GQA group vary from call to call, so they are not specialised: one compile per dtype, head_dim
# and mask mode, instead of one per length class (the strides stay specialised; they are multiples of
# head_dim, so of 16, and the hint lets loads vectorise).
@triton.jit(do_not_specialize=["seq_len_q", "seq_len_k", "group_size"])
def _attn_fwd(Q, K, V, Out, cu_seqlens_q, cu_seqlens_k,
              stride_qb, stride_qh, stride_qm,
              stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn,
              stride_ob, stride_oh, stride_om,
              seq_len_q, seq_len_k, group_size, qk_scale,
              VARLEN: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
              UPCAST: tl.constexpr):
    """Grid: (query tiles, query heads, batch entries or packed sequences).

    Dense and packed (varlen) layouts share this kernel: a dense batch is the special case where
    every sequence starts at token 0 of its own batch slice (stride_*b) and has the same length;
    a packed batch has batch strides of 0 and takes each sequence's start and length from cu_seqlens.
    """
    start_m = tl.program_id(0) * BLOCK_M
    off_h = tl.program_id(1)
    off_b = tl.program_id(2).to(tl.int64)
    off_kv_h = off_h // group_size  # GQA: a group of query heads shares one KV head

    if VARLEN:
        q_start = tl.load(cu_seqlens_q + off_b).to(tl.int64)
        q_len = tl.load(cu_seqlens_q + off_b + 1) - q_start
        k_start = tl.load(cu_seqlens_k + off_b).to(tl.int64)
        k_len = tl.load(cu_seqlens_k + off_b + 1) - k_start
    else:
        q_start = 0
        q_len = seq_len_q
        k_start = 0
        k_len = seq_len_k

    # The grid is sized for the longest sequence; tiles past a shorter one have nothing to do.
    if start_m < q_len:
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        q_ptrs = (Q + off_b * stride_qb + off_h * stride_qh
                  + (q_start + offs_m)[:, None] * stride_qm + offs_d[None, :])
        k_base = K + off_b * stride_kb + off_kv_h * stride_kh + k_start * stride_kn
        v_base = V + off_b * stride_vb + off_kv_h * stride_vh + k_start * stride_vn
        # The Q tile is loaded once and reused against every K/V tile: that reuse is the point.
        q = tl.load(q_ptrs, mask=offs_m[:, None] < q_len, other=0.0)

        # The running max starts at a large finite negative number, not -inf: a row whose keys are
        # all masked so far would otherwise compute exp2(-inf - (-inf)) = NaN.
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

        # Bottom-right causal alignment: query row i sees keys j <= i + diag.
        diag = k_len - q_len
        if CAUSAL:
            # The first row of this tile sees keys < start_m + diag + 1, and so does every later row:
            # those whole tiles need no mask. Keys past the last row's diagonal are never loaded.
            full_end = tl.maximum(tl.minimum(start_m + diag + 1, k_len), 0)
            hi = tl.maximum(tl.minimum(start_m + BLOCK_M + diag, k_len), 0)
        else:
            full_end = k_len
            hi = k_len
        n_full = (full_end // BLOCK_N) * BLOCK_N

        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                                        offs_m, offs_d, 0, n_full, k_len, diag, qk_scale,
                                        CAUSAL, False, BLOCK_N, PRECISION, UPCAST)
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                                        offs_m, offs_d, n_full, hi, k_len, diag, qk_scale,
                                        CAUSAL, True, BLOCK_N, PRECISION, UPCAST)

        # A row that saw no key has l_i == 0 and acc == 0: divide by 1 so it comes out as zeros.
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]
        o_ptrs = (Out + off_b * stride_ob + off_h * stride_oh
                  + (q_start + offs_m)[:, None] * stride_om + offs_d[None, :])
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_m[:, None] < q_len)


# True when the kernels run in Triton's interpreter (TRITON_INTERPRET=1 was set before this import).
INTERPRETED = not isinstance(_attn_fwd, triton.runtime.JITFunction)


# --------------------------------------------------------------------------------------------------
# 2. References (plain torch, materialising the scores)
# --------------------------------------------------------------------------------------------------
def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                        sm_scale: float | None = None, upcast: bool = True) -> torch.Tensor:
    """softmax(q k^T * sm_scale) v with the full [Nq, Nk] score matrix, same conventions as the kernel.

    q [B, Hq, Nq, D], k/v [B, Hkv, Nk, D]. With upcast=True (the default, used to check the kernel)
    the math is fp32; upcast=False keeps the input dtype, which is what "naive attention" costs on a
    GPU and what the benchmark times. Returns q's dtype.
    """
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    compute_dtype = torch.float32 if upcast else q.dtype
    qc, kc, vc = (t.to(compute_dtype) for t in (q, k, v))
    kc = kc.repeat_interleave(group, dim=1)
    vc = vc.repeat_interleave(group, dim=1)
    scores = (qc @ kc.transpose(-1, -2)) * scale
    if not causal:
        return (torch.softmax(scores, dim=-1) @ vc).to(q.dtype)
    n_q, n_k = q.shape[2], k.shape[2]
    visible = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(diagonal=n_k - n_q)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    # Rows with no visible key are all -inf before the softmax (NaN after); the kernel defines them as 0.
    probs = probs.masked_fill(~visible.any(dim=-1, keepdim=True), 0.0)
    return (probs @ vc).to(q.dtype)


def attention_reference_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                               causal: bool = True, sm_scale: float | None = None) -> torch.Tensor:
    """The packed-sequence reference: attention_reference on each sequence in turn. q [Tq, Hq, D]."""
    out = torch.empty_like(q)
    bounds_q = cu_seqlens_q.tolist()
    bounds_k = cu_seqlens_k.tolist()
    for (q0, q1), (k0, k1) in zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:])):
        # [L, H, D] -> [1, H, L, D] and back
        seq_out = attention_reference(q[q0:q1].transpose(0, 1)[None], k[k0:k1].transpose(0, 1)[None],
                                      v[k0:k1].transpose(0, 1)[None], causal, sm_scale)
        out[q0:q1] = seq_out[0].transpose(0, 1)
    return out


# --------------------------------------------------------------------------------------------------
# 3. Wrappers
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def launch_config(head_dim: int, dtype: torch.dtype, gpu: GPUSpec | None) -> LaunchConfig:
    """Pick tile sizes for a GPU described by `gpu`, or for Triton's interpreter when it is None.

    Interpreter (CPU tensors): every tl operation is a NumPy call made once per program and per loop
    step, so the cost is mostly Python overhead per tile. 16 x 16 tiles keep the tests' short
    sequences (17, 100, 257 tokens) spread over several tiles, which is what exercises the online
    softmax and the edge masks, at a cost of seconds.

    GPU: the largest tile wins, since each K/V tile loaded is reused by BLOCK_M queries, but it must
    fit in two places.
      - Registers: the fp32 accumulator [BLOCK_M, head_dim] and scores [BLOCK_M, BLOCK_N] stay in
        registers for the whole loop, spread over 32 * num_warps threads. Past a budget of values per
        thread the compiler spills to (slow) local memory, so we take 4 warps, or 8 when 4 would exceed
        it. Tensor-core products (fp16/bf16 from sm_80) keep their operands compactly: 80 values. FMA
        products (fp32 "ieee" inputs, which tensor cores cannot compute exactly, and everything on a
        T4, where Triton has no tensor-core path) hold far more operand registers: 24 values, so small
        tiles. Both budgets were measured with aot.py, and tests/kernels/test_aot.py checks the choice
        for every variant the course launches (in the models' dtype) for spills with the real compiler.
      - Shared memory: Triton pipelines the K/V loads `num_stages` deep, each stage a K and a V tile;
        we take the deepest pipeline whose estimate fits this GPU's shared memory per block.
    The choice depends only on the GPU's description, so it can be made, and compiled (aot.py), for a
    GPU that is not here.
    """
    if gpu is None:
        return LaunchConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)
    elt = torch.finfo(dtype).bits // 8
    if gpu.tensor_core_dot and dtype != torch.float32:
        tiles, budget, depths = ((128, 64), (128, 32), (64, 64), (64, 32), (32, 16)), 80, (3, 2)
    else:
        tiles, budget, depths = ((64, 32), (32, 16), (16, 16)), 24, (2, 1)
    config = None
    for block_m, block_n in tiles:
        for num_warps in (4, 8):
            if block_m * (head_dim + block_n) <= budget * 32 * num_warps:
                break
        else:
            continue  # too many registers even at 8 warps: a smaller tile
        for num_stages in depths:
            # Q tile + pipelined K and V tiles + the P tile re-laid out for the second dot, 10% slack.
            need = (block_m * head_dim + num_stages * 2 * block_n * head_dim + block_m * block_n) * elt
            config = LaunchConfig(block_m, block_n, num_warps, num_stages)
            if need * 1.1 <= gpu.shared_memory_per_block:
                return config
    return config  # nothing fits: the smallest, and Triton's launch will say why


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ndim: int, layout: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float_tensor(name, t, ndim, layout)
        check_device(name, t, "q", q)
        check_same_dtype(name, t, "q", q)
    check_same_shape("k", k, "v", v)
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k has head_dim {k.shape[-1]} but q has {q.shape[-1]}")
    check_head_dim("q", q.shape[-1])
    check_gqa_heads(q.shape[1], k.shape[1], "k/v")  # heads sit in dim 1 of both [B, H, N, D] and [tokens, H, D]


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    # The kernel walks head_dim with stride 1 (so loads vectorise); every other stride is passed in.
    return t if t.stride(-1) == 1 else t.contiguous()


def _compile_time_args(head_dim: int, dtype: torch.dtype, causal: bool, varlen: bool,
                       gpu: GPUSpec | None) -> dict:
    """The kernel's constexprs and launch options for one call. The launch and `aot_specs` both take
    them from here, so what CI compiles for each GPU the course names is what the wrapper launches there."""
    cfg = launch_config(head_dim, dtype, gpu)
    return dict(VARLEN=varlen, CAUSAL=causal, HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                # fp32 inputs get true fp32 products; the default (TF32) would cost ~1e-3 of accuracy.
                PRECISION="ieee" if dtype == torch.float32 else None,
                UPCAST=gpu is None and dtype == torch.bfloat16,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _launch(q, k, v, out, cu_q, cu_k, strides, grid, seq_len_q, seq_len_k, causal, sm_scale, varlen):
    head_dim = q.shape[-1]
    args = launch_arguments(_compile_time_args, None if INTERPRETED else q.device, head_dim, q.dtype, causal, varlen)
    scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
    _attn_fwd[grid(args["BLOCK_M"])](
        q, k, v, out, cu_q, cu_k, *strides,
        seq_len_q, seq_len_k, q.shape[1] // k.shape[1], scale * _LOG2E, **args)
    return out


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    sm_scale: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Fused attention over a padded batch: q [B, Hq, Nq, D], k/v [B, Hkv, Nk, D] -> [B, Hq, Nq, D].

    Hq must be a multiple of Hkv (GQA/MQA). Nk may differ from Nq; with causal=True the queries are
    the last Nq of the Nk positions (bottom-right alignment). sm_scale defaults to 1/sqrt(D).
    `out`, if given, receives the result (tests pass a NaN-filled one to catch unwritten rows).
    """
    _check_qkv(q, k, v, 4, "[B, H, N, D]")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k has batch {k.shape[0]} but q has batch {q.shape[0]}")
    out = check_out(out, q)
    check_launchable("q", q, _attn_fwd)
    q, k, v = (_unit_stride(t) for t in (q, k, v))
    batch, heads, n_q, _ = q.shape
    n_k = k.shape[2]
    if out.numel() == 0:
        return out
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3])
    return _launch(q, k, v, out, None, None, strides,
                   lambda block_m: (triton.cdiv(n_q, block_m), heads, batch),
                   n_q, n_k, causal, sm_scale, varlen=False)


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, causal: bool = True,
                           sm_scale: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Fused attention over packed sequences (no padding): the engine's prefill entry point.

    q [Tq, Hq, D] holds the query tokens of S sequences back to back, k/v [Tk, Hkv, D] their keys and
    values (for a prefill that continues a cached context, the whole context, so Tk >= Tq).
    cu_seqlens_q / cu_seqlens_k are int32 tensors [S + 1] on q's device with cu[0] = 0 and
    cu[s + 1] - cu[s] the length of sequence s. max_seqlen_q / max_seqlen_k are Python ints, the
    longest lengths (they size the launch grid without reading the device). With causal=True,
    query i of a sequence with q_len Lq and k_len Lk sees keys j <= i + Lk - Lq (bottom-right).
    Returns [Tq, Hq, D] in q's dtype.
    """
    _check_qkv(q, k, v, 3, "[tokens, H, D]")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(name, cu, torch.int32, (None,), "[num_seqs + 1]")
        if cu.numel() < 2:
            raise ValueError(f"{name} must hold num_seqs + 1 >= 2 offsets, got {cu.numel()}")
        check_device(name, cu, "q", q)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k describe {cu_seqlens_q.numel() - 1} and "
                         f"{cu_seqlens_k.numel() - 1} sequences")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if q.device.type == "cpu":
        # Cheap to verify on the host; on a GPU it would cost a device sync on every prefill.
        for name, cu, tokens, longest in (("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
                                          ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)):
            lengths = cu.diff()
            if cu[0] != 0 or cu[-1] != tokens or (lengths < 0).any() or lengths.max() > longest:
                raise ValueError(f"{name} must rise from 0 to {tokens} with no length above its max_seqlen, "
                                 f"got {cu.tolist()}")
    out = check_out(out, q)
    check_launchable("q", q, _attn_fwd)
    q, k, v = (_unit_stride(t) for t in (q, k, v))
    num_seqs = cu_seqlens_q.numel() - 1
    if out.numel() == 0 or max_seqlen_q == 0:
        return out
    # Packed layout: no batch stride (0); a token's offset is its packed index times the token stride.
    strides = (0, q.stride(1), q.stride(0), 0, k.stride(1), k.stride(0),
               0, v.stride(1), v.stride(0), 0, out.stride(1), out.stride(0))
    return _launch(q, k, v, out, cu_seqlens_q, cu_seqlens_k, strides,
                   lambda block_m: (triton.cdiv(max_seqlen_q, block_m), q.shape[1], num_seqs),
                   max_seqlen_q, max_seqlen_k, causal, sm_scale, varlen=True)


# --------------------------------------------------------------------------------------------------
# 4. Test hook and benchmark hook
# --------------------------------------------------------------------------------------------------
def max_error_vs_reference(batch: int, heads_q: int, heads_kv: int, n_q: int, n_k: int, head_dim: int,
                           causal: bool, dtype: torch.dtype, device: str, seed: int = 0) -> float:
    """Test hook: random inputs through the kernel and the fp32 reference; the max absolute difference."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, heads_q, n_q, head_dim, generator=gen, device=device).to(dtype)
    k = torch.randn(batch, heads_kv, n_k, head_dim, generator=gen, device=device).to(dtype)
    v = torch.randn(batch, heads_kv, n_k, head_dim, generator=gen, device=device).to(dtype)
    ours = flash_attention(q, k, v, causal=causal).float()
    return (ours - attention_reference(q, k, v, causal).float()).abs().max().item()


def attention_flops(batch: int, heads: int, n_q: int, n_k: int, head_dim: int, causal: bool) -> float:
    """q k^T and p v are each 2 * Nq * Nk * D flops per head; a causal mask skips about half of them."""
    flops = 4.0 * batch * heads * n_q * n_k * head_dim
    return flops / 2 if causal else flops


def benchmark_tflops(provider: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     causal: bool) -> float | None:
    """Benchmark hook (CUDA tensors): TFLOP/s of 'triton' (this kernel), 'sdpa' (torch's fused kernel: its flash
    backend where the GPU has one, see `devices.sdpa_backend`) or 'naive' (attention_reference in the input
    dtype). None when the naive N x N scores do not fit.
    """
    from torch.nn.attention import sdpa_kernel

    from mini_engine.course.devices import sdpa_backend

    if provider == "triton":
        fn = lambda: flash_attention(q, k, v, causal=causal)  # noqa: E731
    elif provider == "sdpa":
        def fn():
            with sdpa_kernel(sdpa_backend(q.device, q.dtype)):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    elif provider == "naive":
        # The scores, their softmax and the mask are each about N x N per head: ask for that with room.
        score_bytes = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.element_size()
        if 4 * score_bytes > torch.cuda.mem_get_info(q.device)[0]:
            return None
        fn = lambda: attention_reference(q, k, v, causal, upcast=False)  # noqa: E731
    else:
        raise ValueError(f"provider must be 'triton', 'sdpa' or 'naive', got {provider!r}")
    try:
        ms = triton.testing.do_bench(fn)
    except torch.OutOfMemoryError:
        return None
    finally:
        torch.cuda.empty_cache()
    batch, heads, n_q, head_dim = q.shape
    return attention_flops(batch, heads, n_q, k.shape[2], head_dim, causal) / (ms * 1e-3) / 1e12


# --------------------------------------------------------------------------------------------------
# 5. What the wrappers launch on a GPU, for ahead-of-time compilation (aot.py, tests/kernels/test_aot.py)
# --------------------------------------------------------------------------------------------------
def aot_specs(gpu: GPUSpec, dtype: torch.dtype) -> list[KernelSpec]:
    """The launches of `_attn_fwd` on `gpu` for `dtype` that the course makes. Packed causal attention
    (flash_attention_varlen, the engine's prefill) at the course models' head sizes: 64 (SmolLM2) and 128
    (Llama-style checkpoints). Dense attention (flash_attention: chapter 05 and benchmarks/bench_attention.py),
    causal and not, at those sizes and at the 32 of chapter 05's checks. Lengths, batch and the GQA group are
    runtime values, so these cover every model with these head sizes. In another dtype than the model's: fp16
    SmolLM2 (gpu_check.sh's fp16 pass on a bf16 GPU: prefill, and its dense check) and fp32 SmolLM2 prefill
    (chapter 06's fp32 target).
    """
    ptr = f"*{TRITON_DTYPES[dtype]}:16"  # torch allocations are 16-byte aligned
    variants = [(False, True, 64), (False, True, 128), (True, True, 64), (True, True, 128),
                (False, False, 64), (False, False, 128), (False, True, 32), (False, False, 32)]
    if dtype != gpu.model_dtype:
        variants = {torch.float16: [(False, True, 64), (True, True, 64)], torch.float32: [(True, True, 64)]}.get(
            dtype, [])
    specs = []
    for varlen, causal, head_dim in variants:
        args = _compile_time_args(head_dim, dtype, causal, varlen, gpu)
        options = {name: args.pop(name) for name in ("num_warps", "num_stages")}
        # Strides are multiples of head_dim, so of 16 (a packed batch's are 0); lengths and the GQA
        # group are not specialised (do_not_specialize). A dense call passes cu_seqlens as None.
        signature = {name: "i32:16" for name in _attn_fwd.arg_names if name.startswith("stride_")}
        signature |= dict(Q=ptr, K=ptr, V=ptr, Out=ptr, seq_len_q="i32", seq_len_k="i32",
                          group_size="i32", qk_scale="fp32")
        if varlen:
            signature |= dict(cu_seqlens_q="*i32:16", cu_seqlens_k="*i32:16")
        else:
            args |= dict(cu_seqlens_q=None, cu_seqlens_k=None)
        label = f"{'varlen' if varlen else 'dense'} {'causal' if causal else 'non-causal'}, head_dim {head_dim}"
        specs.append(KernelSpec(_attn_fwd, signature, args, options, label))
    return specs


__all__ = ["flash_attention", "flash_attention_varlen", "attention_reference", "attention_reference_varlen",
           "launch_config", "max_error_vs_reference", "benchmark_tflops", "attention_flops", "LaunchConfig",
           "aot_specs"]
