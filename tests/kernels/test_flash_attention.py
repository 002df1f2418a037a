"""FlashAttention kernel vs the materialised-scores reference.

On CPU these run in Triton's interpreter (see conftest.py), so shapes stay small; lengths are chosen
to not be multiples of the tile sizes, and every output buffer starts as NaN so a row the kernel
forgets to write cannot pass.
"""
import pytest
import torch

from mini_engine.kernels import attention_reference, flash_attention, flash_attention_varlen
from mini_engine.kernels.flash_attention import INTERPRETED, attention_reference_varlen

FP32_TOL = dict(atol=1e-4, rtol=1e-4)
HALF_TOL = dict(atol=2e-2, rtol=2e-2)


def rand(*shape, device, dtype=torch.float32, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=gen, device=device).to(dtype)


def qkv(batch, heads_q, heads_kv, n_q, n_k, head_dim, device, dtype=torch.float32):
    return (rand(batch, heads_q, n_q, head_dim, device=device, dtype=dtype, seed=1),
            rand(batch, heads_kv, n_k, head_dim, device=device, dtype=dtype, seed=2),
            rand(batch, heads_kv, n_k, head_dim, device=device, dtype=dtype, seed=3))


def run_poisoned(q, k, v, **kwargs):
    out = torch.full_like(q, float("nan"))
    result = flash_attention(q, k, v, out=out, **kwargs)
    assert result.data_ptr() == out.data_ptr(), "the kernel must write into the out= buffer it was given"
    return result


def test_interpreter_is_used_exactly_when_there_is_no_gpu():
    assert INTERPRETED == (not torch.cuda.is_available())


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n, head_dim", [(1, 16), (17, 32), (100, 16), (257, 64)])
def test_lengths_that_are_not_tile_multiples(n, head_dim, causal, device):
    q, k, v = qkv(1, 3, 1, n, n, head_dim, device)
    torch.testing.assert_close(run_poisoned(q, k, v, causal=causal),
                               attention_reference(q, k, v, causal), **FP32_TOL)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads_q, heads_kv", [(2, 2), (3, 1), (8, 1), (6, 2)])
def test_grouped_query_attention(heads_q, heads_kv, causal, device):
    q, k, v = qkv(2, heads_q, heads_kv, 33, 33, 16, device)
    torch.testing.assert_close(run_poisoned(q, k, v, causal=causal),
                               attention_reference(q, k, v, causal), **FP32_TOL)


def test_gqa_reads_kv_head_h_div_group(device):
    # Query heads 0-2 must read KV head 0 and heads 3-5 KV head 1: make the two KV heads' values
    # constant and different, so each output row equals its KV head's constant whatever the weights.
    q, k, _ = qkv(1, 6, 2, 9, 9, 16, device)
    v = torch.stack([torch.full((9, 16), 1.0), torch.full((9, 16), -1.0)])[None].to(device)
    out = run_poisoned(q, k, v, causal=True)
    torch.testing.assert_close(out[0, :3], torch.full_like(out[0, :3], 1.0))
    torch.testing.assert_close(out[0, 3:], torch.full_like(out[0, 3:], -1.0))


@pytest.mark.parametrize("n_q, n_k", [(1, 100), (17, 100), (40, 257)])
def test_causal_with_more_keys_than_queries_is_bottom_right_aligned(n_q, n_k, device):
    q, k, v = qkv(1, 2, 1, n_q, n_k, 32, device)
    out = run_poisoned(q, k, v, causal=True)
    torch.testing.assert_close(out, attention_reference(q, k, v, True), **FP32_TOL)
    # The last query is the last position: it sees every key, exactly as without a mask.
    torch.testing.assert_close(out[:, :, -1], attention_reference(q, k, v, False)[:, :, -1], **FP32_TOL)


@pytest.mark.parametrize("n_q, n_k", [(40, 17), (17, 40)])
def test_non_causal_with_different_lengths(n_q, n_k, device):
    q, k, v = qkv(1, 2, 2, n_q, n_k, 16, device)
    torch.testing.assert_close(run_poisoned(q, k, v, causal=False),
                               attention_reference(q, k, v, False), **FP32_TOL)


def test_causal_rows_that_see_no_key_are_zero(device):
    # 30 queries over 20 keys, bottom-right aligned: the first 10 queries come before every key.
    q, k, v = qkv(1, 2, 1, 30, 20, 16, device)
    out = run_poisoned(q, k, v, causal=True)
    assert torch.equal(out[:, :, :10], torch.zeros_like(out[:, :, :10]))
    torch.testing.assert_close(out, attention_reference(q, k, v, True), **FP32_TOL)


def test_custom_scale_and_strided_inputs(device):
    # The model produces [B, N, H, D] and transposes it: the kernel must honour those strides.
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in qkv(2, 4, 2, 21, 21, 16, device))
    assert not q.is_contiguous()
    torch.testing.assert_close(run_poisoned(q, k, v, causal=True, sm_scale=0.3),
                               attention_reference(q, k, v, True, sm_scale=0.3), **FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype, device):
    q, k, v = qkv(1, 4, 2, 70, 70, 32, device, dtype=dtype)
    out = run_poisoned(q, k, v, causal=True)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), attention_reference(q, k, v, True).float(), **HALF_TOL)


def packed(lengths, heads, head_dim, device, seed, dtype=torch.float32):
    return rand(sum(lengths), heads, head_dim, device=device, dtype=dtype, seed=seed)


def cu_seqlens(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def run_varlen(q_lens, k_lens, heads_q, heads_kv, head_dim, causal, device, dtype=torch.float32):
    q = packed(q_lens, heads_q, head_dim, device, seed=1, dtype=dtype)
    k = packed(k_lens, heads_kv, head_dim, device, seed=2, dtype=dtype)
    v = packed(k_lens, heads_kv, head_dim, device, seed=3, dtype=dtype)
    cu_q, cu_k = cu_seqlens(q_lens, device), cu_seqlens(k_lens, device)
    out = torch.full_like(q, float("nan"))
    flash_attention_varlen(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), causal=causal, out=out)
    return out, attention_reference_varlen(q, k, v, cu_q, cu_k, causal)


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_uneven_prompts(causal, device):
    lengths = [17, 1, 40, 5]
    out, ref = run_varlen(lengths, lengths, 3, 1, 32, causal, device)
    torch.testing.assert_close(out, ref, **FP32_TOL)


def test_varlen_prefill_chunks_continuing_cached_contexts(device):
    # Each sequence brings q_len new tokens on top of k_len - q_len cached ones (chunked prefill).
    out, ref = run_varlen([5, 1, 30], [20, 1, 64], 4, 2, 16, True, device)
    torch.testing.assert_close(out, ref, **FP32_TOL)


def test_every_diagonal_offset_against_the_tile_grid(device):
    # The kernel skips the causal mask on tiles it proves fully visible; an off-by-one there only shows
    # when the diagonal lands at one particular offset inside a tile. Sweep k_len - q_len over more
    # than a whole CPU tile (16) in one packed call.
    q_lens = [20] * 18
    out, ref = run_varlen(q_lens, [20 + extra for extra in range(18)], 1, 1, 16, True, device)
    torch.testing.assert_close(out, ref, **FP32_TOL)


def test_varlen_matches_dense_for_each_sequence(device):
    q_lens, k_lens = [3, 18], [19, 18]
    q = packed(q_lens, 2, 16, device, seed=1)
    k, v = packed(k_lens, 2, 16, device, seed=2), packed(k_lens, 2, 16, device, seed=3)
    out = flash_attention_varlen(q, k, v, cu_seqlens(q_lens, device), cu_seqlens(k_lens, device), 18, 19,
                                 out=torch.full_like(q, float("nan")))
    first = run_poisoned(q[:3].transpose(0, 1)[None], k[:19].transpose(0, 1)[None], v[:19].transpose(0, 1)[None])
    torch.testing.assert_close(out[:3], first[0].transpose(0, 1), **FP32_TOL)


def test_varlen_on_views_of_a_fused_qkv_projection(device):
    # The engine splits one [T, (Hq + 2 Hkv) * D] projection into views: token strides are not H * D.
    lengths, heads_q, heads_kv, head_dim = [9, 23], 4, 2, 16
    qkv_proj = packed(lengths, heads_q + 2 * heads_kv, head_dim, device, seed=4)
    q, k, v = qkv_proj.split([heads_q, heads_kv, heads_kv], dim=1)
    assert not q.is_contiguous()
    cu = cu_seqlens(lengths, device)
    out = flash_attention_varlen(q, k, v, cu, cu, 23, 23, out=torch.full_like(q, float("nan")))
    torch.testing.assert_close(out, attention_reference_varlen(q, k, v, cu, cu), **FP32_TOL)


def test_varlen_bf16(device):
    out, ref = run_varlen([33, 2], [33, 40], 2, 1, 64, True, device, dtype=torch.bfloat16)
    torch.testing.assert_close(out.float(), ref.float(), **HALF_TOL)


def bad_call(**overrides):
    args = dict(q=torch.zeros(1, 4, 8, 16), k=torch.zeros(1, 2, 8, 16), v=torch.zeros(1, 2, 8, 16))
    args.update(overrides)
    flash_attention(**args)


@pytest.mark.parametrize("overrides, message", [
    (dict(q=torch.zeros(4, 8, 16)), "^q must be a 4-D tensor"),
    (dict(k=torch.zeros(1, 2, 8, 16, dtype=torch.float16)), "^k has dtype"),
    (dict(v=torch.zeros(1, 2, 9, 16)), "^k and v must have the same shape"),
    (dict(q=torch.zeros(1, 4, 8, 48), k=torch.zeros(1, 2, 8, 48), v=torch.zeros(1, 2, 8, 48)), "^q head_dim"),
    (dict(k=torch.zeros(1, 3, 8, 16), v=torch.zeros(1, 3, 8, 16)), "number of q heads"),
    (dict(q=torch.zeros(1, 4, 8, 16, dtype=torch.int32)), "^q must be float32"),
    (dict(k=torch.zeros(2, 2, 8, 16), v=torch.zeros(2, 2, 8, 16)), "^k has batch"),
    (dict(out=torch.zeros(1, 4, 9, 16)), "^out must match q"),
])
def test_bad_inputs_name_the_argument(overrides, message):
    with pytest.raises(ValueError, match=message):
        bad_call(**overrides)


@pytest.mark.parametrize("cu_q, max_q, message", [
    (torch.tensor([0, 3, 8], dtype=torch.int64), 5, "^cu_seqlens_q must be a 1-D int32"),
    (torch.tensor([0, 3, 7], dtype=torch.int32), 5, "^cu_seqlens_q must rise from 0 to 8"),
    (torch.tensor([0, 3, 8], dtype=torch.int32), 4, "^cu_seqlens_q must rise"),
    (torch.tensor([0, 8], dtype=torch.int32), 8, "^cu_seqlens_q and cu_seqlens_k describe"),
    (torch.tensor([0, 3, 8], dtype=torch.int32), 5.0, "^max_seqlen_q must be"),
])
def test_bad_varlen_inputs_name_the_argument(cu_q, max_q, message):
    q, k = torch.zeros(8, 2, 16), torch.zeros(8, 1, 16)
    with pytest.raises(ValueError, match=message):
        flash_attention_varlen(q, k, k, cu_q, torch.tensor([0, 3, 8], dtype=torch.int32), max_q, 5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real sizes need a GPU (the interpreter would take hours)")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_real_sizes_on_gpu(head_dim, causal, gpu_dtype):
    q, k, v = qkv(2, 16, 4, 4096, 4096, head_dim, "cuda", dtype=gpu_dtype)
    out = run_poisoned(q, k, v, causal=causal)
    torch.testing.assert_close(out.float(), attention_reference(q, k, v, causal).float(), **HALF_TOL)
    lengths = [4096, 1, 1000, 3000]
    out, ref = run_varlen(lengths, lengths, 16, 4, head_dim, causal, "cuda", dtype=gpu_dtype)
    torch.testing.assert_close(out.float(), ref.float(), **HALF_TOL)
