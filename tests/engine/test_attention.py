"""The cached attention paths against a plain reference: repeat the KV heads, attend one sequence at a time.

The engine prepares a step's decodes once (`DecodeGroup`) and attends all of them in one grouped product;
these tests pin that down for consecutive and scattered slots, unequal contexts and steps that mix decodes
with prefill chunks, and check the sign-folded RoPE against the textbook rotate-half form. "cpu" is the optional
CPU backend's attention (`backends/cpu/attention.py`), whose forms must give the same results."""
import pytest
import torch

from mini_engine.attention import AttentionMetadata, DecodeGroup, attention_with_cache
from mini_engine.backends.cpu.attention import CpuAttention, register_decode_op
from mini_engine.config import ModelConfig
from mini_engine.model import apply_rope, rope_tables
from mini_engine.paging import BlockManager

D, MAX_LEN = 16, 40


def attend(q, k_cache, v_cache, meta, backend):
    if backend == "cpu":
        return CpuAttention().with_cache(q, k_cache, v_cache, meta)
    return attention_with_cache(q, k_cache, v_cache, meta, backend)


def reference(q, k_cache, v_cache, meta):
    """Each sequence alone: its new queries see cached positions up to their own (causal), KV heads repeated."""
    out, start = [], 0
    for n, ctx, slot in zip(meta.query_lens, meta.context_lens, meta.slots):
        qs = q[start:start + n].transpose(0, 1)                      # [Hq,n,D]
        rep = qs.shape[0] // k_cache.shape[1]
        k = k_cache[slot, :, :ctx].repeat_interleave(rep, dim=0)    # [Hq,ctx,D]
        v = v_cache[slot, :, :ctx].repeat_interleave(rep, dim=0)
        scores = qs @ k.transpose(-1, -2) / D ** 0.5
        visible = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
        out.append((scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v).transpose(0, 1))
        start += n
    return torch.cat(out)


STEPS = {
    "one decode": ([1], [9], [2]),
    "consecutive decodes, equal contexts": ([1, 1, 1], [7, 7, 7], [1, 2, 3]),
    "consecutive decodes, unequal contexts": ([1, 1, 1, 1], [3, 17, 40, 1], [0, 1, 2, 3]),
    "decodes with a gap in their slots": ([1, 1, 1], [12, 5, 30], [4, 2, 3]),
    "scattered decodes": ([1, 1, 1], [12, 5, 30], [4, 0, 9]),
    "decodes and prefill chunks": ([1, 6, 1, 9], [20, 6, 4, 25], [3, 0, 1, 4]),
    "prefill chunks only": ([5, 3], [5, 11], [1, 0]),
    "speculative chunks only": ([5, 5, 3], [12, 30, 8], [2, 0, 1]),
    "speculative chunks, decodes and a long prefill": ([1, 5, 20, 2, 1], [9, 17, 20, 30, 4], [0, 3, 1, 4, 2]),
}


@pytest.mark.parametrize("backend", ["torch", "naive", "cpu"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("step", list(STEPS))
def test_cached_attention_equals_per_sequence_reference(step, heads, kv_heads, backend):
    query_lens, context_lens, slots = STEPS[step]
    torch.manual_seed(len(step))
    k_cache, v_cache = torch.randn(2, 10, kv_heads, MAX_LEN, D).unbind(0)
    q = torch.randn(sum(query_lens), heads, D)
    meta = AttentionMetadata.build(query_lens, context_lens, slots)
    got = attend(q, k_cache, v_cache, meta, backend)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, meta), rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"{step}: {m}")


def test_short_chunks_are_attended_together_and_long_ones_alone():
    """In the CPU backend, chunks of 2 to MAX_VERIFY_TOKENS tokens (a speculative step's last token plus drafts)
    form one `VerifyGroup`, padded to the longest; decodes keep their own group and longer prefill chunks go alone."""
    from mini_engine.backends.cpu.attention import MAX_VERIFY_TOKENS, VerifyGroup
    meta = AttentionMetadata.build([1, 5, MAX_VERIFY_TOKENS + 1, 2], [9, 17, 30, 30], [0, 3, 1, 4])
    group = VerifyGroup.build(meta, "cpu")
    assert group.seqs == [1, 3] and group.query_len == 5 and group.max_context == 30
    assert group.packed.tolist() == [1, 2, 3, 4, 5, 23, 24]
    assert group.tokens.tolist() == [1, 2, 3, 4, 5, 23, 24, 24, 24, 24], "padding repeats a chunk's last row"
    # Query j of the second chunk (context 30, 2 new tokens) sees positions < 29 + min(j, 1).
    assert group.mask[1, 0, :, 0].sum(-1).tolist() == [29, 30, 30, 30, 30]
    assert VerifyGroup.build(AttentionMetadata.build([1, 1], [4, 6], [0, 1]), "cpu") is None


def paged_copy(k_cache, v_cache, meta, block_size, generator):
    """The same contexts in a paged pool: each sequence's blocks drawn in a shuffled order from a pool twice
    the size needed, every position nobody owns (and each last block's tail) filled with large garbage."""
    per_seq = [-(-c // block_size) for c in meta.context_lens]
    num_blocks = 2 * sum(per_seq)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = [order[sum(per_seq[:i]):sum(per_seq[:i + 1])] for i in range(len(per_seq))]
    pools = []
    for cache in (k_cache, v_cache):
        pool = torch.full((num_blocks, block_size, *cache.shape[1:2], cache.shape[-1]), 1e4)
        for table, ctx, slot in zip(tables, meta.context_lens, meta.slots):
            for p in range(ctx):
                pool[table[p // block_size], p % block_size] = cache[slot, :, p]
        pools.append(pool)
    return pools, tables


@pytest.mark.parametrize("backend", ["torch", "naive", "cpu"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("step", list(STEPS))
def test_paged_attention_equals_the_contiguous_reference(step, block_size, backend):
    """Same contexts, read through shuffled block tables (lengths rarely a multiple of the block); steps mix
    decodes, prompt chunks with cached context and prompts with none, and every sequence has its table."""
    query_lens, context_lens, slots = STEPS[step]
    g = torch.Generator().manual_seed(len(step) + block_size)
    k_cache, v_cache = torch.randn(2, 10, 2, MAX_LEN, D, generator=g).unbind(0)
    q = torch.randn(sum(query_lens), 6, D, generator=g)
    meta = AttentionMetadata.build(query_lens, context_lens, slots)
    (k_pool, v_pool), tables = paged_copy(k_cache, v_cache, meta, block_size, g)
    paged = AttentionMetadata.build(query_lens, context_lens, block_tables=tables, block_size=block_size)
    got = attend(q, k_pool, v_pool, paged, backend)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, meta), rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"{step}, block {block_size}: {m}")


@pytest.mark.parametrize("chunk", [1, 2, 3, 4])
def test_paged_decode_gives_the_same_result_however_many_sequences_are_copied_at_once(chunk):
    """On a CPU the paged decode copies the blocks of `chunk` sequences at a time (the autotuner picks how
    many): every choice, including one that leaves a shorter last group, gives the reference's result."""
    query_lens, context_lens, slots = STEPS["consecutive decodes, unequal contexts"]
    g = torch.Generator().manual_seed(chunk)
    k_cache, v_cache = torch.randn(2, 10, 2, MAX_LEN, D, generator=g).unbind(0)
    q = torch.randn(sum(query_lens), 6, D, generator=g)
    meta = AttentionMetadata.build(query_lens, context_lens, slots)
    (k_pool, v_pool), tables = paged_copy(k_cache, v_cache, meta, 4, g)
    paged = AttentionMetadata.build(query_lens, context_lens, block_tables=tables, block_size=4)
    got = CpuAttention().paged_decode(q, k_pool, v_pool, paged.decode, f"{chunk} at a time")
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, meta), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 2, 3, 4])
def test_paged_decode_reading_each_groups_own_longest_context_gives_the_same_result(chunk):
    """A compiled step's group (`DecodeGroup.from_tensors`, every row's table padded to the same width, and
    `lens`): each copy of `chunk` sequences reads only its own longest context. Sorted or not, through the
    operator a compiled graph calls or directly, the reference's result."""
    query_lens, context_lens, slots = STEPS["consecutive decodes, unequal contexts"]
    g = torch.Generator().manual_seed(10 + chunk)
    k_cache, v_cache = torch.randn(2, 10, 2, MAX_LEN, D, generator=g).unbind(0)
    q = torch.randn(sum(query_lens), 6, D, generator=g)
    meta = AttentionMetadata.build(query_lens, context_lens, slots)
    (k_pool, v_pool), tables = paged_copy(k_cache, v_cache, meta, 4, g)
    width = -(-MAX_LEN // 4)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    group = DecodeGroup.from_tensors(lens, width * 4, block_tables=block_tables)
    want = reference(q, k_cache, v_cache, meta)
    for order in (list(range(len(lens))), sorted(range(len(lens)), key=lambda i: -context_lens[i])):
        rows = torch.tensor(order)
        sub = DecodeGroup(slice(None), None, max(context_lens), group.mask[rows], block_tables[rows],
                          lens[rows])
        got = CpuAttention().paged_decode(q[rows], k_pool, v_pool, sub, f"{chunk} at a time",
                                          [context_lens[i] for i in order])
        torch.testing.assert_close(got, want[rows], rtol=1e-5, atol=1e-5)
    register_decode_op()
    got = torch.ops.mini_engine.decode_attention(q, k_pool, v_pool, group.mask, lens, None, block_tables)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_paged_metadata_maps_each_new_token_to_its_slot():
    bm = BlockManager(num_blocks=10, block_size=4)
    bm.allocate("a", 6)   # blocks 0, 1: positions 0-5 (a decodes its sixth token)
    bm.allocate("b", 3)   # block 2: a 3-token prompt
    bm.append_slots("a", 6)
    meta = AttentionMetadata.build([1, 3], [6, 3], block_tables=[bm.block_table("a"), bm.block_table("b")],
                                   block_size=4)
    assert meta.slot_mapping.tolist() == [5, 8, 9, 10], "a's position 5 is block 1, offset 1; b starts block 2"
    assert meta.block_tables.tolist() == [[0, 1], [2, 0]] and meta.block_tables.dtype == torch.int32
    assert meta.decode.block_tables.tolist() == [[0, 1]] and meta.decode.context_lens.tolist() == [6]
    with pytest.raises(ValueError, match="not both"):
        AttentionMetadata.build([1], [6], slots=[0], block_tables=[[0, 1]], block_size=4)


def test_decode_group_reads_consecutive_slots_as_a_view():
    meta = AttentionMetadata.build([1, 1, 1], [4, 9, 2], [2, 3, 4])
    assert meta.decode.slots == slice(2, 5), "consecutive slots should be a slice of the cache, not a gather"
    assert meta.decode.is_whole_step and meta.decode.max_context == 9
    assert meta.decode.mask[:, 0, 0].tolist() == [[True] * 4 + [False] * 5, [True] * 9, [True] * 2 + [False] * 7]
    assert AttentionMetadata.build([1, 1], [5, 5], [0, 1]).decode.mask is None, "equal contexts need no mask"
    assert AttentionMetadata.build([1, 1], [4, 6], [3, 1]).decode.slots.tolist() == [3, 1], \
        "slots out of order are gathered"
    mixed = AttentionMetadata.build([3, 1], [3, 8], [0, 1])
    assert not mixed.decode.is_whole_step and mixed.decode.tokens.tolist() == [3]
    assert AttentionMetadata.build([3, 2], [3, 8], [0, 1]).decode is None


def test_sign_folded_rope_equals_rotate_half():
    cfg = ModelConfig(vocab_size=8, hidden_size=32, intermediate_size=8, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=D, max_position_embeddings=64)
    cos, sin = rope_tables(cfg)
    positions = torch.tensor([0, 1, 7, 63])
    x = torch.randn(4, 3, D)
    c, s = cos[positions, None], sin[positions, None]
    plain_sin = torch.cat([-s[..., :D // 2], s[..., D // 2:]], dim=-1)  # undo the sign fold: [sin, sin]
    x1, x2 = x.chunk(2, dim=-1)
    expected = torch.addcmul(x * c, torch.cat([-x2, x1], dim=-1), plain_sin)  # x*cos + rotate_half(x)*sin
    torch.testing.assert_close(apply_rope(x, c, s), expected, rtol=0, atol=0)  # the fold is exact


def test_a_step_decides_its_attention_form_once_and_apart_for_flop_counting(monkeypatch):
    """The CPU backend decides a decode's attention form at a step's first layer and keeps it for the others; a
    FLOP counter (which must see PyTorch's ops, never the C kernel) gets a decision of its own."""
    from torch.utils.flop_counter import FlopCounterMode

    decided = []
    form_for = CpuAttention.paged_decode_form
    monkeypatch.setattr(CpuAttention, "paged_decode_form", lambda *a, **k: decided.append(1) or form_for(*a, **k))
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(2, 6, 16, 3, 64, generator=g)
    meta = AttentionMetadata.build([1, 1], [20, 37], block_tables=[[0, 1], [2, 3, 4]], block_size=16)
    q = torch.randn(2, 9, 64, generator=g)
    attention = CpuAttention()
    first = attention.decode(q, *pool, meta.decode, meta)
    for _ in range(3):  # the step's other layers
        torch.testing.assert_close(attention.decode(q, *pool, meta.decode, meta), first)
    assert len(decided) == 1, "the form is decided once per step"
    with FlopCounterMode(display=False):
        counted = attention.decode(q, *pool, meta.decode, meta)
    assert len(decided) == 2 and meta.extras[("paged decode", True)] == "2 at a time", \
        "under a FLOP counter the step decides again, and never for the C kernel"
    torch.testing.assert_close(counted, first, rtol=1e-5, atol=1e-5)
