"""Lab 05: FlashAttention, one tile at a time.

You build the two pieces that make attention run in O(N) memory:

  Part 1, `online_softmax` (NumPy): attention outputs from key tiles that arrive one at a time, keeping
  only a running max, a running sum and a running output per query, never the whole score row.
  Part 2, `attention_tile_step` (Triton): the same update inside a GPU kernel, where it is the body
  of the loop over K/V tiles. The kernel around it (`attention_kernel`), a harness that runs your
  step on its own (`run_tile_step`) and the torch wrapper (`flash_attention`) are given.

CPU tensors run in Triton's interpreter: set TRITON_INTERPRET=1 before importing this file when you
have no GPU (the lab's tests do it for you). Grade with
    pytest tests/labs/test_lab05.py --impl=labs
"""
from __future__ import annotations

from typing import Iterable

import numpy as np
import torch
import triton
import triton.language as tl


# --------------------------------------------------------------------------------------------------
# Part 1: online softmax in NumPy
# --------------------------------------------------------------------------------------------------
def online_softmax(score_tiles: Iterable[np.ndarray], value_tiles: Iterable[np.ndarray]) -> np.ndarray:
    """Attention output softmax(S) @ V, reading S and V one tile of keys at a time, in a single pass.

    score_tiles yields arrays [Q, t_i]: the scores of all Q query rows against the t_i keys of tile i.
    value_tiles yields the matching value rows [t_i, D]. Both may be generators, so each tile can be
    read once and there is no going back. Keep, per query row: the running max m, the running sum
    l of exp(s - m), and the running output acc = sum of exp(s - m) * v. Return acc / l, shape [Q, D].
    Must not overflow for scores in the hundreds.
    """
    # TODO: chapter 05's "Online softmax, step by step" follows one row through the tiles.
    raise NotImplementedError("lab05 online_softmax: what must m, l and acc start as, and when a tile raises a row's "
                              "max, what happens to what l and acc already hold?")


# --------------------------------------------------------------------------------------------------
# Part 2: the inner step of the FlashAttention kernel
# --------------------------------------------------------------------------------------------------
@triton.jit
def attention_tile_step(acc, l_i, m_i, qk, v):
    """Fold one K/V tile into the running state of a BLOCK_M tile of queries; return (acc, l_i, m_i).

    acc [BLOCK_M, D] fp32: running sum of p * v;  l_i [BLOCK_M] fp32: running sum of p;
    m_i [BLOCK_M] fp32: running max score (starts at -1e30, not -inf, so exp2 of a difference is never
    NaN). qk [BLOCK_M, BLOCK_N] fp32: this tile's scores, already multiplied by sm_scale * log2(e) and
    set to -inf where masked, so the softmax weights are exp2(qk - max), not exp. v [BLOCK_N, D] fp32.
    """
    # TODO: Part 1's update for BLOCK_M query rows at once, written with triton.language.
    raise NotImplementedError("lab05 attention_tile_step: triton.language has per-row reductions, an exp2 and a "
                              "matrix product; which units are the scores in, and what must the old state be "
                              "multiplied by?")


# ---- given: a harness that runs your step once, the kernel around it, and the wrapper -------------
@triton.jit
def _tile_step_kernel(Acc, L, M, QK, V, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    rows, cols, dims = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, HEAD_DIM)
    acc = tl.load(Acc + rows[:, None] * HEAD_DIM + dims[None, :])
    l_i, m_i = tl.load(L + rows), tl.load(M + rows)
    qk = tl.load(QK + rows[:, None] * BLOCK_N + cols[None, :])
    v = tl.load(V + cols[:, None] * HEAD_DIM + dims[None, :])
    acc, l_i, m_i = attention_tile_step(acc, l_i, m_i, qk, v)
    tl.store(Acc + rows[:, None] * HEAD_DIM + dims[None, :], acc)
    tl.store(L + rows, l_i)
    tl.store(M + rows, m_i)


def run_tile_step(acc: torch.Tensor, l_i: torch.Tensor, m_i: torch.Tensor, qk: torch.Tensor,
                  v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run attention_tile_step once on fp32 tensors (sizes powers of two >= 16); return new copies."""
    acc, l_i, m_i = (t.float().contiguous().clone() for t in (acc, l_i, m_i))
    _tile_step_kernel[(1,)](acc, l_i, m_i, qk.float().contiguous(), v.float().contiguous(),
                            BLOCK_M=qk.shape[0], BLOCK_N=qk.shape[1], HEAD_DIM=v.shape[1])
    return acc, l_i, m_i


@triton.jit
def attention_kernel(Q, K, V, Out, seq_len, qk_scale, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (query tile, batch x head); q/k/v/out are contiguous [B * H, N, HEAD_DIM] fp32."""
    start_m = tl.program_id(0) * BLOCK_M
    base = tl.program_id(1).to(tl.int64) * seq_len * HEAD_DIM
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=offs_m[:, None] < seq_len, other=0.0)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:  # keys past this tile's last query are never needed, so the loop stops there
        hi = tl.minimum(start_m + BLOCK_M, seq_len)
    else:
        hi = seq_len
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        k = tl.load(K + base + cols[None, :] * HEAD_DIM + offs_d[:, None], mask=cols[None, :] < seq_len, other=0.0)
        v = tl.load(V + base + cols[:, None] * HEAD_DIM + offs_d[None, :], mask=cols[:, None] < seq_len, other=0.0)
        qk = tl.dot(q, k) * qk_scale
        visible = cols[None, :] < seq_len
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        acc, l_i, m_i = attention_tile_step(acc, l_i, m_i, qk, v)
    tl.store(Out + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], acc / l_i[:, None],
             mask=offs_m[:, None] < seq_len)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    block: int = 16) -> torch.Tensor:
    """Attention with your step inside the kernel: q/k/v [B, H, N, D], D a power of two >= 16; fp32."""
    batch, heads, seq_len, head_dim = q.shape
    q3, k3, v3 = (t.float().reshape(batch * heads, seq_len, head_dim).contiguous() for t in (q, k, v))
    out = torch.empty_like(q3)
    grid = (triton.cdiv(seq_len, block), batch * heads)
    attention_kernel[grid](q3, k3, v3, out, seq_len, head_dim ** -0.5 * 1.4426950408889634,
                           CAUSAL=causal, HEAD_DIM=head_dim, BLOCK_M=block, BLOCK_N=block)
    return out.reshape(batch, heads, seq_len, head_dim)
