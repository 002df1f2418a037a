"""Speculative decoding's verify step in Triton: accept drafts, then draw the one token the target adds.

One program per sequence. It reads the target's probability of each draft, runs the accept test
u_j · q_j(x_j) < p_j(x_j) on all drafts at once and finds the first rejection, then streams the vocabulary
of that position in BLOCK_V tiles to draw the last token by an exponential race, argmax(w · (1/E)), over
w = max(0, p − q) (after a rejection) and w = p (the bonus token, or the fallback when rounding left the
residual empty). All random numbers come in from outside (`speculative.draw_randoms`), so a launch is a
pure function of its inputs: the kernel and its torch reference choose the same tokens, bit for bit, which
is what the tests check. The whole step is a few loads per draft plus one pass over V floats per sequence,
tiny next to the target's forward pass; as one launch it avoids a dozen small torch ops per step on a GPU.

Laid out like the other kernels, but for its torch reference: that is the engine's own CPU path,
`speculative.rejection_sample_from_randoms` (one formulation to read; the tests compare the two). Then the
launch configuration and wrapper, and `aot_specs` for compiling it ahead of time (aot.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .aot import KernelSpec
from .checks import check_device, check_launchable, check_tensor
from .gpus import GPUSpec, launch_arguments

_INT_ARGS = ["num_slots", "vocab_size", "stride_ts", "stride_tk", "stride_ds", "stride_qs", "stride_qk",
             "stride_us", "stride_es", "stride_os"]


# Sizes are not specialised (every int is passed as a plain i32): one compilation per k serves every
# vocabulary and batch, and what aot_specs compiles is exactly what a launch runs.
@triton.jit(do_not_specialize=_INT_ARGS)
def _rejection_sample(TargetProbs, DraftIds, NumDrafts, DraftProbs, Uniforms, InvExp, Out,
                      num_slots, vocab_size,
                      stride_ts, stride_tk, stride_ds, stride_qs, stride_qk, stride_us, stride_es, stride_os,
                      HAS_DRAFT_PROBS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """Grid: (sequences,). num_slots = k, the drafts a row has room for; row s holds NumDrafts[s] of them."""
    s = tl.program_id(0).to(tl.int64)
    n = tl.load(NumDrafts + s)
    offs_k = tl.arange(0, BLOCK_K)
    drafted = offs_k < n

    # The accept test on every draft at once; an id outside the vocabulary reads p = 0 and is rejected.
    x = tl.load(DraftIds + s * stride_ds + offs_k, mask=drafted, other=-1).to(tl.int64)
    in_vocab = drafted & (x >= 0) & (x < vocab_size)
    p_x = tl.load(TargetProbs + s * stride_ts + offs_k * stride_tk + x, mask=in_vocab, other=0.0)
    if HAS_DRAFT_PROBS:
        q_x = tl.load(DraftProbs + s * stride_qs + offs_k * stride_qk + x, mask=in_vocab, other=1.0)
    else:
        q_x = tl.full([BLOCK_K], 1.0, tl.float32)  # a deterministic proposer: q is one-hot at its guess
    u = tl.load(Uniforms + s * stride_us + offs_k, mask=drafted, other=1.0)
    rejected = drafted & ~(u * q_x < p_x)
    num_accepted = tl.min(tl.where(rejected, offs_k, n), axis=0)  # the first rejection, or n
    was_rejected = num_accepted < n
    x_at = tl.sum(tl.where(offs_k == num_accepted, x, 0), axis=0)  # the rejected draft (when there is one)
    x_at_in_vocab = was_rejected & (x_at >= 0) & (x_at < vocab_size)

    # One pass over the vocabulary at position num_accepted: a running argmax for each candidate w.
    p_row = TargetProbs + s * stride_ts + num_accepted * stride_tk
    q_row = DraftProbs + s * stride_qs + num_accepted * stride_qk
    best_res, arg_res = -1.0, 0
    best_p, arg_p = -1.0, 0
    res_max = 0.0
    for start in range(0, vocab_size, BLOCK_V):
        offs_v = start + tl.arange(0, BLOCK_V)
        in_row = offs_v < vocab_size
        p = tl.load(p_row + offs_v, mask=in_row, other=0.0)
        if HAS_DRAFT_PROBS:
            # Read only after a rejection (row num_accepted = k does not exist when all were accepted).
            q = tl.load(q_row + offs_v, mask=offs_v < tl.where(was_rejected, vocab_size, 0), other=0.0)
        else:
            q = tl.where((offs_v == x_at) & x_at_in_vocab, 1.0, 0.0)
        residual = tl.maximum(p - q, 0.0)
        inv_e = tl.load(InvExp + s * stride_es + offs_v, mask=in_row, other=0.0)
        # Lanes past the vocabulary score -1, below any real lane (scores are >= 0).
        tile_res, tile_arg_res = tl.max(tl.where(in_row, residual * inv_e, -1.0), axis=0, return_indices=True)
        tile_p, tile_arg_p = tl.max(tl.where(in_row, p * inv_e, -1.0), axis=0, return_indices=True)
        # Strictly greater: on a tie the earlier tile keeps it, the lowest index, as torch.argmax does.
        arg_res = tl.where(tile_res > best_res, start + tile_arg_res, arg_res)
        best_res = tl.maximum(best_res, tile_res)
        arg_p = tl.where(tile_p > best_p, start + tile_arg_p, arg_p)
        best_p = tl.maximum(best_p, tile_p)
        res_max = tl.maximum(res_max, tl.max(residual, axis=0))
    last = tl.where(was_rejected & (res_max > 0), arg_res, arg_p).to(tl.int64)

    # The whole row: accepted drafts, the drawn token, then -1 padding.
    out = tl.where(offs_k < num_accepted, x, tl.where(offs_k == num_accepted, last, -1))
    tl.store(Out + s * stride_os + offs_k, out, mask=offs_k < num_slots + 1)


INTERPRETED = not isinstance(_rejection_sample, triton.runtime.JITFunction)


@dataclass(frozen=True)
class LaunchConfig:
    block_v: int
    num_warps: int


def launch_config(vocab_size: int, gpu: GPUSpec | None) -> LaunchConfig:
    """Vocabulary tiles of 1024 fp32 (4 KiB per operand) with 4 warps: 8 values per thread per operand, no
    spills, the same on every GPU since the step is a single streaming pass. The interpreter takes the
    vocabulary in one tile when it is small (the tests' V <= 1024), in 1024s otherwise."""
    block_v = min(triton.next_power_of_2(vocab_size), 1024)
    return LaunchConfig(block_v=block_v if gpu is None else 1024, num_warps=4)


def _compile_time_args(num_slots: int, vocab_size: int, has_draft_probs: bool, gpu: GPUSpec | None) -> dict:
    """Constexprs and launch options for one call, shared by the launch and `aot_specs`."""
    cfg = launch_config(vocab_size, gpu)
    return dict(HAS_DRAFT_PROBS=has_draft_probs, BLOCK_K=triton.next_power_of_2(num_slots + 1),
                BLOCK_V=cfg.block_v, num_warps=cfg.num_warps)


def _check_inputs(target_probs, draft_token_ids, num_drafts, draft_probs, uniforms, inv_exponentials) -> None:
    check_tensor("draft_token_ids", draft_token_ids, (torch.int32, torch.int64), (None, None), "[S, k]")
    s, k = draft_token_ids.shape
    check_tensor("target_probs", target_probs, torch.float32, (s, k + 1, None),
                 f"[S, k + 1, V] = [{s}, {k + 1}, V]")
    check_device("target_probs", target_probs, "draft_token_ids", draft_token_ids)
    vocab = target_probs.shape[-1]
    expected = {"num_drafts": (num_drafts, torch.int32, (s,), "[S]"),
                "uniforms": (uniforms, torch.float32, (s, k), "[S, k]"),
                "inv_exponentials": (inv_exponentials, torch.float32, (s, vocab), "[S, V]")}
    if draft_probs is not None:
        expected["draft_probs"] = (draft_probs, torch.float32, (s, k, vocab), "[S, k, V]")
    for name, (t, dtype, shape, layout) in expected.items():
        check_tensor(name, t, dtype, shape, f"{layout} = {list(shape)}")
        check_device(name, t, "draft_token_ids", draft_token_ids)


def rejection_sampler(target_probs: torch.Tensor, draft_token_ids: torch.Tensor, num_drafts: torch.Tensor,
                      draft_probs: torch.Tensor | None, uniforms: torch.Tensor,
                      inv_exponentials: torch.Tensor) -> torch.Tensor:
    """The kernel's launch, with `speculative.rejection_sample_from_randoms`'s arguments and result: [S, k + 1] int64 rows of
    accepted drafts, the drawn token, -1 padding. target_probs [S, k+1, V], draft_probs [S, k, V] or None,
    uniforms [S, k] and inv_exponentials [S, V] are fp32; num_drafts [S] int32 (drafts in each row)."""
    _check_inputs(target_probs, draft_token_ids, num_drafts, draft_probs, uniforms, inv_exponentials)
    check_launchable("draft_token_ids", draft_token_ids, _rejection_sample)
    target_probs, draft_token_ids, num_drafts, uniforms, inv_exponentials = (
        t.contiguous() for t in (target_probs, draft_token_ids, num_drafts, uniforms, inv_exponentials))
    s, k = draft_token_ids.shape
    vocab = target_probs.shape[-1]
    out = torch.empty(s, k + 1, dtype=torch.int64, device=target_probs.device)
    if s == 0:
        return out
    # Without draft probabilities the pointer is never read; the target's stands in so the signature is fixed.
    q = draft_probs.contiguous() if draft_probs is not None else target_probs
    q_strides = q.stride()[:2] if draft_probs is not None else (0, 0)
    _rejection_sample[(s,)](
        target_probs, draft_token_ids, num_drafts, q, uniforms, inv_exponentials, out,
        k, vocab, *target_probs.stride()[:2], draft_token_ids.stride(0), *q_strides,
        uniforms.stride(0), inv_exponentials.stride(0), out.stride(0),
        **launch_arguments(_compile_time_args, None if INTERPRETED else target_probs.device, k, vocab,
                           draft_probs is not None))
    return out


def aot_specs(gpu: GPUSpec, dtype: torch.dtype) -> list[KernelSpec]:
    """The launches on `gpu` over SmolLM2's 49,152-token vocabulary, with draft probabilities (a sampled draft
    model) and without (n-gram or greedy drafts), for every number of drafts a row can hold up to chapter 06's
    largest k, 8: the engine verifies each request on its own, with as many drafts as it proposed (adaptive
    speculation drafts fewer than k), so every k from 0 to 8 is launched; k compiles to BLOCK_K = the power of
    two above it, so these are five kernels of each kind. Probabilities are always fp32
    (speculative.rejection_sample casts them), so only the fp32 pass has launches to compile."""
    if dtype != torch.float32:
        return []
    signature = {name: "i32" for name in _INT_ARGS}
    signature |= dict(TargetProbs="*fp32:16", DraftIds="*i64:16", NumDrafts="*i32:16", DraftProbs="*fp32:16",
                      Uniforms="*fp32:16", InvExp="*fp32:16", Out="*i64:16")
    specs = []
    for has_draft_probs in (True, False):
        for k in range(9):
            args = _compile_time_args(k, 49152, has_draft_probs, gpu)
            options = {"num_warps": args.pop("num_warps")}
            label = f"k={k}, {'draft probabilities' if has_draft_probs else 'deterministic drafts'}, V 49152"
            specs.append(KernelSpec(_rejection_sample, signature, args, options, label))
    return specs


__all__ = ["rejection_sampler", "launch_config", "LaunchConfig", "aot_specs"]
