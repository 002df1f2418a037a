"""Paged decode attention vs its gather-through-the-block-table reference.

On CPU these run in Triton's interpreter, so shapes stay small. Every input comes from
`random_paged_inputs`: block tables are shuffled (a sequence's blocks are scattered through the pool),
and every slot a sequence must not read (spare blocks, the tail of its last block) is NaN and every
table entry past its context points outside the pool, so a kernel reading past a context cannot pass.
Output buffers start as NaN, so a row the kernel forgets to write cannot pass either.
"""
import pytest
import torch

from mini_engine.kernels import attention_reference, paged_decode_attention, paged_decode_attention_reference
from mini_engine.kernels.paged_attention import gather_context, random_paged_inputs

FP32_TOL = dict(atol=1e-4, rtol=1e-4)
HALF_TOL = dict(atol=2e-2, rtol=2e-2)


def run_poisoned(q, k_cache, v_cache, block_tables, context_lens, **kwargs):
    out = torch.full_like(q, float("nan"))
    result = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, out=out, **kwargs)
    assert result.data_ptr() == out.data_ptr(), "the kernel must write into the out= buffer it was given"
    return result


def check(context_lens, heads_q, heads_kv, head_dim, block_size, device, dtype=torch.float32, seed=0):
    inputs = random_paged_inputs(context_lens, heads_q, heads_kv, head_dim, block_size, dtype, device, seed)
    out = run_poisoned(*inputs)
    assert out.dtype == dtype
    tol = FP32_TOL if dtype == torch.float32 else HALF_TOL
    torch.testing.assert_close(out.float(), paged_decode_attention_reference(*inputs).float(), **tol)


@pytest.mark.parametrize("heads_q, heads_kv", [(9, 3), (4, 4)])
def test_context_lengths_around_block_boundaries(heads_q, heads_kv, device):
    # One position, a block less one, exactly one block, one past it, and several blocks with a ragged end.
    check([1, 15, 16, 17, 100, 130], heads_q, heads_kv, 32, 16, device)


@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_block_sizes_smaller_and_larger_than_a_tile(block_size, device):
    # The kernel's tile is 16 positions in the interpreter: with blocks of 1 or 4 a tile spans many
    # blocks, with blocks of 32 a block spans two tiles.
    check([1, 33, 70], 6, 2, 16, block_size, device)


def test_random_inputs_really_are_shuffled_and_poisoned(device):
    q, k_cache, _, block_tables, _ = random_paged_inputs([40, 40], 2, 1, 16, 16, torch.float32, device, seed=1)
    used = block_tables[:, :3].flatten().tolist()
    assert sorted(used) != used, "blocks should be scattered through the pool, not laid out in order"
    assert k_cache.isnan().any(), "slots outside every context hold NaN"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype, device):
    check([1, 17, 64], 9, 3, 64, 16, device, dtype=dtype)


def test_reference_agrees_with_dense_attention(device):
    # The decode query is the last position: paged attention over a gathered context is plain
    # (non-causal) attention of one query over that context.
    inputs = random_paged_inputs([23, 50], 4, 2, 16, 8, torch.float32, device, seed=2)
    q, k_cache, v_cache, block_tables, context_lens = inputs
    out = run_poisoned(*inputs)
    for s, n in enumerate(context_lens.tolist()):
        k = gather_context(k_cache, block_tables[s], n).transpose(0, 1)[None]  # [1, Hkv, n, D]
        v = gather_context(v_cache, block_tables[s], n).transpose(0, 1)[None]
        dense = attention_reference(q[s][None, :, None], k, v, causal=False)[0, :, 0]
        torch.testing.assert_close(out[s], dense, **FP32_TOL)


def test_gqa_reads_kv_head_h_div_group(device):
    # Query heads 0-2 must read KV head 0 and heads 3-5 KV head 1: make the two KV heads' values
    # constant and different, so each output row equals its KV head's constant whatever the scores.
    q, k_cache, v_cache, block_tables, context_lens = random_paged_inputs([20, 7], 6, 2, 16, 4, torch.float32,
                                                                          device, seed=3)
    v_cache[:, :, 0], v_cache[:, :, 1] = 1.0, -1.0
    out = run_poisoned(q, k_cache, v_cache, block_tables, context_lens)
    torch.testing.assert_close(out[:, :3], torch.full_like(out[:, :3], 1.0))
    torch.testing.assert_close(out[:, 3:], torch.full_like(out[:, 3:], -1.0))


def test_custom_scale_and_a_query_view_of_a_fused_projection(device):
    # The engine slices q out of one [S, (Hq + 2 Hkv) * D] projection: its sequence stride is not Hq * D.
    q, k_cache, v_cache, block_tables, context_lens = random_paged_inputs([5, 31], 4, 2, 16, 16, torch.float32,
                                                                          device, seed=4)
    fused = torch.cat([q, torch.zeros(2, 4, 16, device=device)], dim=1)
    q_view = fused[:, :4]
    assert not q_view.is_contiguous()
    torch.testing.assert_close(run_poisoned(q_view, k_cache, v_cache, block_tables, context_lens, scale=0.3),
                               paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens,
                                                                scale=0.3), **FP32_TOL)


def test_strided_block_tables_and_context_lens(device):
    # Views the engine might pass: a block table cut out of a wider one, context lengths taken every other.
    q, k_cache, v_cache, block_tables, context_lens = random_paged_inputs([9, 40], 2, 1, 16, 8, torch.float32,
                                                                          device, seed=5)
    wide = torch.zeros(2, 2 * block_tables.shape[1], dtype=torch.int32, device=device)
    wide[:, ::2] = block_tables
    every_other = torch.stack([context_lens, torch.zeros_like(context_lens)], dim=1).flatten()[::2]
    torch.testing.assert_close(run_poisoned(q, k_cache, v_cache, wide[:, ::2], every_other),
                               paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens),
                               **FP32_TOL)


def test_empty_context_gives_zeros_and_no_sequences_gives_an_empty_result(device):
    q, k_cache, v_cache, block_tables, _ = random_paged_inputs([16, 3], 2, 1, 16, 16, torch.float32, device)
    out = run_poisoned(q, k_cache, v_cache, block_tables, torch.tensor([0, 3], dtype=torch.int32, device=device))
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    empty = paged_decode_attention(q[:0], k_cache, v_cache, block_tables[:0], torch.zeros(0, dtype=torch.int32,
                                                                                         device=device))
    assert empty.shape == (0, 2, 16)


def bad_call(**overrides):
    args = dict(q=torch.zeros(2, 4, 16), k_cache=torch.zeros(5, 16, 2, 16), v_cache=torch.zeros(5, 16, 2, 16),
                block_tables=torch.zeros(2, 3, dtype=torch.int32), context_lens=torch.ones(2, dtype=torch.int32))
    args.update(overrides)
    paged_decode_attention(**args)


@pytest.mark.parametrize("overrides, message", [
    (dict(q=torch.zeros(2, 4, 1, 16)), "^q must be a 3-D tensor"),
    (dict(k_cache=torch.zeros(5, 16, 32)), "^k_cache must be a 4-D tensor"),
    (dict(v_cache=torch.zeros(5, 16, 2, 16, dtype=torch.float16)), "^v_cache has dtype"),
    (dict(q=torch.zeros(2, 4, 16, dtype=torch.int32)), "^q must be float32"),
    (dict(v_cache=torch.zeros(6, 16, 2, 16)), "^k_cache and v_cache must have the same shape"),
    (dict(k_cache=torch.zeros(5, 16, 2, 32), v_cache=torch.zeros(5, 16, 2, 32)), "^k_cache has head_dim"),
    (dict(q=torch.zeros(2, 4, 24), k_cache=torch.zeros(5, 16, 2, 24), v_cache=torch.zeros(5, 16, 2, 24)),
     "^q head_dim"),
    (dict(k_cache=torch.zeros(5, 16, 3, 16), v_cache=torch.zeros(5, 16, 3, 16)), "number of q heads"),
    (dict(block_tables=torch.zeros(2, 3, dtype=torch.int64)), "^block_tables must be a 2-D int32"),
    (dict(context_lens=torch.ones(2, 1, dtype=torch.int32)), "^context_lens must be a 1-D int32"),
    (dict(context_lens=torch.ones(3, dtype=torch.int32)), "one row per sequence"),
    (dict(context_lens=torch.tensor([1, 49], dtype=torch.int32)), r"^context_lens must lie in \[0, .* 48\]"),
    (dict(context_lens=torch.tensor([1, -1], dtype=torch.int32)), "^context_lens must lie"),
    (dict(block_tables=torch.tensor([[0, 0, 0], [5, 0, 0]], dtype=torch.int32)), "^block_tables row 1 points"),
    (dict(out=torch.zeros(2, 4, 32)), "^out must match q"),
])
def test_bad_inputs_name_the_argument(overrides, message):
    with pytest.raises(ValueError, match=message):
        bad_call(**overrides)


def test_table_entries_past_the_context_are_neither_checked_nor_read(device):
    # Padding past a context may hold anything (the engine pads with 0, tests with ids outside the pool): on a
    # CPU the wrapper's check of the table must pass it, and on a GPU the kernel must not read it. Every value
    # in the pool is 1, so every output is 1 when only the pool is read.
    args = dict(q=torch.randn(2, 4, 16), k_cache=torch.randn(5, 16, 2, 16), v_cache=torch.ones(5, 16, 2, 16),
                block_tables=torch.tensor([[0, 99, -1], [4, -7, 123]], dtype=torch.int32),
                context_lens=torch.tensor([16, 9], dtype=torch.int32))
    out = paged_decode_attention(**{name: t.to(device) for name, t in args.items()})
    torch.testing.assert_close(out, torch.ones_like(out))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real sizes need a GPU (the interpreter would take hours)")
@pytest.mark.parametrize("heads_q, heads_kv, head_dim", [(9, 3, 64), (32, 8, 128)])
def test_real_sizes_on_gpu(heads_q, heads_kv, head_dim, gpu_dtype):
    # 64 decoding sequences with contexts from 1 to 4096 tokens, the longest one included.
    gen = torch.Generator().manual_seed(0)
    lengths = [4096, 1, 16, 17] + torch.randint(1, 4097, (60,), generator=gen).tolist()
    check(lengths, heads_q, heads_kv, head_dim, 16, "cuda", dtype=gpu_dtype)
