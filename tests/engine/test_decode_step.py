"""One builder of a decode step (`AttentionMetadata.build`) serves the plain loop, the engine and the compiled step:
the compiled step's inputs are the eager step's positions and cache rows (`paging.slot_mapping` for a paged cache),
with sizes fixed for its graph, and they give the eager step's logits. A compiled plain loop keeps one cache per
shape on the model, so a CUDA graph recorded on its address is replayed, not recorded anew, by the next call."""
import torch

from mini_engine.attention import AttentionMetadata
from mini_engine.compiled_decode import decode_graph, plain_cache
from mini_engine.generate import decode_step, generate_batch, prefill
from mini_engine.kv_cache import ContiguousKVCache, PagedKVCache
from mini_engine.paging import slot_mapping

from test_cached_equivalence import tiny_model  # tests/engine is on sys.path (pytest rootdir-less import)


def test_eager_decode_reads_up_to_the_longest_context_and_the_compiled_form_its_fixed_length():
    lens, slots = [4, 9, 2], [2, 0, 1]
    eager = AttentionMetadata.build([1] * 3, lens, slots)
    fixed = AttentionMetadata.build([1] * 3, lens, slots, static_len=32)
    for meta in (eager, fixed):
        assert meta.positions.tolist() == [3, 8, 1] and meta.slot_mapping.tolist() == slots
    assert eager.decode.max_context == 9, "an eager decode reads no key position past the longest context"
    assert fixed.decode.max_context == 32 and fixed.decode.mask.shape == (3, 1, 1, 32)
    assert fixed.decode.context_lens.tolist() == lens and fixed.decode.slots is fixed.slot_mapping


def test_paged_compiled_form_maps_slots_as_the_block_manager_does():
    tables, lens = [[5, 2], [7], [3]], [6, 3, 1]
    meta = AttentionMetadata.build([1] * 3, lens, block_tables=tables, block_size=4, static_len=16, fill=3)
    assert meta.slot_mapping.tolist() == [slot_mapping(t, n - 1, n, 4)[0] for t, n in zip(tables, lens)]
    assert meta.slot_mapping.dtype == torch.int32
    assert meta.block_tables.tolist() == [[5, 2, 3, 3], [7, 3, 3, 3], [3, 3, 3, 3]], "padded with block `fill`"
    assert meta.decode.block_tables is meta.block_tables and meta.decode.slots is None


def test_compiled_step_inputs_give_the_eager_step_uncompiled():
    """The graph's inputs, taken from the one builder and run through `decode_graph` without compiling: the eager
    decode step's logits and cache contents, for the contiguous and the paged cache."""
    model = tiny_model(4, 2)
    prompts, tokens = [[1, 2, 3], [5, 6, 7, 8, 9]], [4, 10]
    lens = [len(p) + 1 for p in prompts]
    contiguous = [ContiguousKVCache(model.config, 2, 16) for _ in range(2)]
    for cache in contiguous:
        prefill(model, cache, prompts, [1, 0])
    want = decode_step(model, contiguous[0], tokens, lens, [1, 0])
    meta = AttentionMetadata.build([1, 1], lens, [1, 0], static_len=16)
    with torch.inference_mode():
        got = decode_graph(model, contiguous[1], "torch", torch.tensor(tokens), meta.positions, meta.slot_mapping,
                           meta.decode.context_lens, meta.decode.slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(contiguous[1].data, contiguous[0].data)

    paged, tables = PagedKVCache(model.config, 8, 4), [[2, 5], [1, 7]]
    prompt_step = AttentionMetadata.build([len(p) for p in prompts], block_tables=tables, block_size=4)
    model(torch.tensor([t for p in prompts for t in p]), prompt_step, paged)
    meta = AttentionMetadata.build([1, 1], lens, block_tables=tables, block_size=4, static_len=16, fill=0)
    with torch.inference_mode():
        got = decode_graph(model, paged, "torch", torch.tensor(tokens), meta.positions, meta.slot_mapping,
                           meta.decode.context_lens, block_tables=meta.block_tables)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compiled_plain_loop_keeps_its_cache_across_calls():
    model = tiny_model(4, 2)
    prompts = [[1, 2, 3], [4, 5]]
    want = generate_batch(model, prompts, 6)
    first = generate_batch(model, prompts, 6, compile=True)
    (cache,) = model.decode_graphs.caches.values()
    address = cache.data.data_ptr()
    second = generate_batch(model, prompts, 5, compile=True)  # nearby length: the same cache, zeroed anew
    assert list(model.decode_graphs.caches.values()) == [cache] and cache.data.data_ptr() == address
    assert first == want and second == [out[:5] for out in want]
    assert plain_cache(model, 2, 9) is cache and not cache.data.any(), "each run starts from an empty cache"
