"""The C paged-decode kernel (cpu_kernels.paged_decode) against a plain reference, its input checks, the build's
effect on the rest of the process, and the engine's tokens with the kernel against the PyTorch copy form."""
import pytest
import torch

import mini_engine as me
from mini_engine.backends.cpu import cpu_kernels
from mini_engine.backends.cpu.attention import IN_PLACE, CpuAttention, register_decode_op
from mini_engine.backends.cpu.autotune import TUNER
from mini_engine.engine import LLM

pytestmark = pytest.mark.skipif(cpu_kernels.compiler() is None, reason="no C compiler on this machine")


def reference(q, k_pool, v_pool, tables, lens):
    """Each sequence's blocks gathered in order, attention in float64: [S, Hq, D]."""
    s, hq, d = q.shape
    g = hq // k_pool.shape[2]
    out = []
    for i in range(s):
        n = int(lens[i])
        k = k_pool[tables[i].long()].flatten(0, 1)[:n].double().repeat_interleave(g, dim=1)  # [n, Hq, D]
        v = v_pool[tables[i].long()].flatten(0, 1)[:n].double().repeat_interleave(g, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), k) * d ** -0.5, dim=-1)
        out.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(out).float()


def random_case(seed, lens, hq=9, hkv=3, d=64, block_size=16, spare=5):
    """A pool with room for every context plus `spare` blocks, shuffled tables padded with block 0."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + spare
    k_pool, v_pool = torch.randn(2, num_blocks, block_size, hkv, d, generator=g).unbind(0)
    ids = torch.randperm(num_blocks, generator=g).tolist()
    width = max(need)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n] + [0] * (width - n))
        at += n
    q = torch.randn(len(lens), hq, d, generator=g)
    return q, k_pool, v_pool, torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 32), (8, 2, 16)], ids=["gqa 9/3", "mha", "gqa 8/2"])
@pytest.mark.parametrize("block_size", [16, 4])
def test_the_kernel_matches_the_reference(heads, block_size):
    """Contexts of 1 position, of block multiples and not, of different lengths in one call; block tables
    shuffled through the pool and padded past each context (padding is never read)."""
    hq, hkv, d = heads
    lens = [1, block_size, block_size + 1, 3 * block_size - 1, 70, 200]
    q, k_pool, v_pool, tables, lens_t = random_case(block_size + hq, lens, hq, hkv, d, block_size)
    got = cpu_kernels.paged_decode(q, k_pool, v_pool, tables, lens_t)
    torch.testing.assert_close(got, reference(q, k_pool, v_pool, tables, lens_t), rtol=1e-5, atol=1e-5)


def chunk_reference(q, k_pool, v_pool, tables, visible):
    """Query j of sequence s over the first visible[s, j] positions, in float64: [S, Q, Hq, D]."""
    s, n_q = visible.shape
    return torch.stack([torch.stack([reference(q[i, j:j + 1], k_pool, v_pool, tables[i:i + 1], visible[i, j:j + 1])[0]
                                     for j in range(n_q)]) for i in range(s)])


@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 16)], ids=["gqa 9/3", "gqa 8/2"])
def test_the_chunk_kernel_matches_the_reference(heads):
    """Verify chunks of Q = 5 rows: each row sees one more position than the one before, the last rows of a
    shorter chunk repeat its last position (as VerifyGroup pads them), contexts from 5 to 200 positions."""
    hq, hkv, d = heads
    lens = [5, 16, 17, 70, 200]
    q, k_pool, v_pool, tables, lens_t = random_case(40 + hq, lens, hq, hkv, d)
    n_q = 5
    visible = torch.tensor([[n - n_q + 1 + j for j in range(n_q)] for n in lens], dtype=torch.int32)
    visible[2, 3:] = visible[2, 2]  # a chunk of 3 real rows, padded to 5
    visible[2] += lens[2] - int(visible[2, -1])
    qc = torch.randn(len(lens), n_q, hq, d, generator=torch.Generator().manual_seed(1))
    got = cpu_kernels.paged_chunk(qc, k_pool, v_pool, tables, visible)
    torch.testing.assert_close(got, chunk_reference(qc, k_pool, v_pool, tables, visible), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="visible"):
        cpu_kernels.paged_chunk(qc, k_pool, v_pool, tables, visible.flip(1))  # decreasing rows


@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 32), (8, 2, 16)], ids=["gqa 9/3", "mha", "gqa 8/2"])
@pytest.mark.parametrize("block_size", [16, 4])
def test_a_prefill_chunk_through_the_kernel_matches_the_reference(heads, block_size):
    """Long chunks after a cached prefix, as chunked prefill and prefix caching make them: query rows in tiles of
    16 with a partial last tile (37 tokens x the group's heads), each token seeing its own prefix, and a chunk
    that is its sequence's whole context (no cached prefix)."""
    hq, hkv, d = heads
    lens = [100, 37]
    q, k_pool, v_pool, tables, _ = random_case(60 + hq + block_size, lens, hq, hkv, d, block_size)
    n_q = 37
    visible = torch.tensor([[n - n_q + 1 + j for j in range(n_q)] for n in lens], dtype=torch.int32)
    qc = torch.randn(len(lens), n_q, hq, d, generator=torch.Generator().manual_seed(2))
    got = cpu_kernels.paged_chunk(qc, k_pool, v_pool, tables, visible)
    torch.testing.assert_close(got, chunk_reference(qc, k_pool, v_pool, tables, visible), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", [{"LANES": 16, "RT": 1, "KB": 16, "PC": 8, "WRT": 3, "WKB": 8, "WPC": 8},
                                    {"LANES": 16, "RT": 1, "KB": 16, "PC": 8}, {"LANES": 8, "RT": 2, "KB": 4, "PC": 4}],
                         ids=["AVX-512 layout", "AVX-512 without wide tiles", "AVX2 layout"])
def test_each_vector_layout_of_the_chunk_kernel_matches_the_reference(layout, monkeypatch):
    """The chunk kernel picks its tiles by the CPU's registers (one 16-row vector with AVX-512, two 8-row vectors
    with AVX2, and with AVX-512 three-vector tiles for chunks whose rows fill them); a machine runs only its own.
    Each is built here, whatever the CPU (GCC lowers a vector wider than the registers into several), and checked
    on chunks with partial tiles and a partial last block: 37 tokens (111 rows a KV head: wide tiles where the
    layout has them) and 5 tokens (15 rows: the narrow tiles)."""
    build_for = cpu_kernels._paged_lib
    monkeypatch.setattr(cpu_kernels, "_paged_lib", lambda hq, hkv, d: build_for(hq, hkv, d, tuple(layout.items())))
    for block_size in (16, 4):
        q, k_pool, v_pool, tables, _ = random_case(80 + block_size, [100, 37], block_size=block_size)
        for n_q in (37, 5):
            visible = torch.tensor([[n - n_q + 1 + j for j in range(n_q)] for n in (100, 37)], dtype=torch.int32)
            qc = torch.randn(2, n_q, 9, 64, generator=torch.Generator().manual_seed(3))
            got = cpu_kernels.paged_chunk(qc, k_pool, v_pool, tables, visible)
            torch.testing.assert_close(got, chunk_reference(qc, k_pool, v_pool, tables, visible), rtol=1e-5,
                                       atol=1e-5, msg=lambda m: f"layout {layout}, block_size {block_size}, "
                                                                f"{n_q} tokens: {m}")


@pytest.mark.parametrize("defines", [(("SCORES16", 0),), ()], ids=["one position at a time", "this CPU's build"])
def test_the_decode_kernel_with_and_without_16_scores_at_once(defines, monkeypatch):
    """With AVX-512 the decode kernel sums 16 positions' scores together; a CPU without it takes them one at a
    time. Both are checked here (the second is this CPU's build), on whole and partial blocks of 16 and on
    blocks of 4, which the 16-wide path never takes."""
    build_for = cpu_kernels._paged_lib
    monkeypatch.setattr(cpu_kernels, "_paged_lib", lambda hq, hkv, d: build_for(hq, hkv, d, defines))
    for block_size in (16, 4):
        q, k_pool, v_pool, tables, lens = random_case(90 + block_size, [100, 37, 16, 1], block_size=block_size)
        torch.testing.assert_close(cpu_kernels.paged_decode(q, k_pool, v_pool, tables, lens),
                                   reference(q, k_pool, v_pool, tables, lens), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"defines {defines}, block_size {block_size}: {m}")


def test_the_engines_prefill_chunks_take_either_form_alike(force_forms):
    """One step of two decodes and two prefill chunks (one after 40 cached positions, one fresh) through
    the CPU backend's attention: the chunks read in place by the kernel give the copy + SDPA's result."""
    from mini_engine.attention import AttentionMetadata

    query_lens, context_lens = [1, 30, 1, 19], [9, 70, 33, 19]
    q, k_pool, v_pool, tables, _ = random_case(7, context_lens)
    qs = torch.randn(sum(query_lens), 9, 64, generator=torch.Generator().manual_seed(3))
    outs = {}
    for form in (IN_PLACE, "copy"):
        force_forms(paged_prefill=form)
        # a step of its own for each form: a step decides its chunks' form once, at its first layer
        meta = AttentionMetadata.build(query_lens, context_lens, block_tables=[t[:-(-c // 16)] for t, c in
                                                                              zip(tables.tolist(), context_lens)],
                                       block_size=16)
        outs[form] = CpuAttention().with_cache(qs, k_pool, v_pool, meta)
        assert {v for (key, _), v in meta.extras.items() if key[0] == "prefill"} == {form}
    torch.testing.assert_close(outs[IN_PLACE], outs["copy"], rtol=1e-5, atol=1e-5)


def test_no_sequences_and_one_sequence():
    q, k_pool, v_pool, tables, lens = random_case(0, [37])
    assert cpu_kernels.paged_decode(q[:0], k_pool, v_pool, tables[:0], lens[:0]).shape == (0, 9, 64)
    torch.testing.assert_close(cpu_kernels.paged_decode(q, k_pool, v_pool, tables, lens),
                               reference(q, k_pool, v_pool, tables, lens), rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_refused_by_name_before_the_kernel_reads_memory():
    q, k_pool, v_pool, tables, lens = random_case(1, [20, 33])
    with pytest.raises(ValueError, match="context_lens"):
        cpu_kernels.paged_decode(q, k_pool, v_pool, tables, torch.tensor([20, 33 + 16], dtype=torch.int32))
    with pytest.raises(ValueError, match="context_lens"):
        cpu_kernels.paged_decode(q, k_pool, v_pool, tables, torch.tensor([0, 33], dtype=torch.int32))
    bad = tables.clone()
    bad[1, 2] = k_pool.shape[0]  # a block id past the pool, inside the context
    with pytest.raises(ValueError, match="block_tables"):
        cpu_kernels.paged_decode(q, k_pool, v_pool, bad, lens)
    padded = tables.clone()
    padded[0, 2] = 10**6  # past sequence 0's context (20 positions = 2 blocks): never read, so allowed
    cpu_kernels.paged_decode(q, k_pool, v_pool, padded, lens)
    with pytest.raises(ValueError, match="one row per sequence"):
        cpu_kernels.paged_decode(q, k_pool, v_pool, tables[:1], lens)
    assert not cpu_kernels.paged_decode_supported(q.bfloat16(), k_pool.bfloat16(), v_pool.bfloat16())
    with pytest.raises(ValueError, match="fp32"):
        cpu_kernels.paged_decode(q.bfloat16(), k_pool.bfloat16(), v_pool.bfloat16(), tables, lens)


def test_a_changed_table_is_checked_again():
    """The checks are skipped for the pair of tensors checked last (a step's 30 layers share them), but a
    table written in place since must be checked anew."""
    q, k_pool, v_pool, tables, lens = random_case(2, [20, 33])
    cpu_kernels.paged_decode(q, k_pool, v_pool, tables, lens)
    tables[1, 1] = -1
    with pytest.raises(ValueError, match="block_tables"):
        cpu_kernels.paged_decode(q, k_pool, v_pool, tables, lens)


def test_loading_the_kernel_keeps_denormals_in_every_other_op():
    """Linked with -ffast-math, a shared library turns on flush-to-zero for the whole process when it loads;
    the build compiles with it but links without it, so PyTorch's arithmetic is unchanged."""
    q, k_pool, v_pool, tables, lens = random_case(3, [5])
    cpu_kernels.paged_decode(q, k_pool, v_pool, tables, lens)  # built and loaded
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    assert (tiny * 2).item() > 0, "denormals are flushed to zero: the kernel was linked with -ffast-math"


def test_a_build_is_reused_and_named_for_this_source_flags_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("MINI_ENGINE_CACHE", str(tmp_path))
    first = cpu_kernels.build("paged_decode", {"HQ": 4, "HKV": 2, "HEAD_DIM": 8})
    assert first.parent == tmp_path and first.exists()
    mtime = first.stat().st_mtime_ns
    assert cpu_kernels.build("paged_decode", {"HQ": 4, "HKV": 2, "HEAD_DIM": 8}) == first
    assert first.stat().st_mtime_ns == mtime, "built again"
    assert cpu_kernels.build("paged_decode", {"HQ": 4, "HKV": 2, "HEAD_DIM": 16}) != first
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".so", ".so"], "a temporary file was left behind"


def test_without_a_compiler_the_pytorch_path_is_the_only_form(monkeypatch):
    monkeypatch.setenv("MINI_ENGINE_C_KERNELS", "0")
    cpu_kernels._paged_lib.cache_clear()
    try:
        q, k_pool, v_pool, _, _ = random_case(4, [5])
        assert not cpu_kernels.paged_decode_supported(q, k_pool, v_pool)
    finally:
        monkeypatch.delenv("MINI_ENGINE_C_KERNELS")
        cpu_kernels._paged_lib.cache_clear()


@pytest.fixture
def force_forms(monkeypatch):
    """force(**forms): from now on the tuner's ops take the given forms (op=form); its choices are put back
    after."""
    before = dict(TUNER.choices)

    def force(**forms):
        TUNER.choices.clear()
        TUNER.choices.update(before)
        monkeypatch.setattr(TUNER, "forced", {**TUNER.forced, **forms})
    yield force
    TUNER.choices.clear()
    TUNER.choices.update(before)


KERNELS = {"paged_decode": IN_PLACE, "paged_verify": IN_PLACE, "paged_prefill": IN_PLACE}
COPIES = {"paged_decode": "1 at a time", "paged_verify": "copy", "paged_prefill": "copy"}


def test_a_compiled_graph_reaches_the_kernel_through_the_decode_operator(force_forms):
    """A compiled decode step attends through `mini_engine::decode_attention` (every row padded to one table
    width, masked past its context): with the kernel forced, the reference's result."""
    from mini_engine.attention import DecodeGroup

    q, k_pool, v_pool, tables, lens = random_case(5, [3, 40, 17, 64])
    group = DecodeGroup.from_tensors(lens, tables.shape[1] * 16, block_tables=tables)
    force_forms(**KERNELS)
    register_decode_op()
    got = torch.ops.mini_engine.decode_attention(q, k_pool, v_pool, group.mask, lens, None, tables)
    torch.testing.assert_close(got, reference(q, k_pool, v_pool, tables, lens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "k": 4}], ids=["plain", "n-gram speculation"])
def test_real_model_same_tokens_with_the_kernels_as_with_the_copy(real, chat_prompts, force_forms, speculative):
    """The engine on the paged cache, every paged decode, prefill chunk and verify chunk forced through the
    kernels, then through the copy and SDPA: the same greedy tokens, and the same seeded samples."""
    model, tok = real
    params = [me.SamplingParams(max_tokens=24), me.SamplingParams(max_tokens=24, temperature=0.8, seed=7),
              me.SamplingParams(max_tokens=24)]
    if speculative:
        params = [me.SamplingParams(max_tokens=24)] * 3  # greedy: speculation changes no token
    outs = {}
    for name, forms in (("kernels", KERNELS), ("copies", COPIES)):
        force_forms(**forms)
        llm = LLM.from_model(model, tok, block_size=16, max_num_seqs=3, max_model_len=128, speculative=speculative)
        outs[name] = [o.token_ids for o in llm.generate(chat_prompts, params, use_tqdm=False)]
    assert outs["kernels"] == outs["copies"]


def test_real_model_chunked_prefill_over_a_cached_prefix_same_tokens_either_way(real, chat_prompts, force_forms,
                                                                                 monkeypatch):
    """Prompts cut into 20-token prefill chunks, each attending to the chunks before it, and a second round of the
    same prompts behind a shared cached prefix (prefix caching): the kernels give the copy's greedy tokens."""
    import mini_engine.backends.cpu.attention as attention

    model, tok = real
    chunk_queries = []  # query tokens per sequence of each paged_chunk call: the kernel did run
    monkeypatch.setattr(attention, "paged_chunk", lambda q, *a: chunk_queries.append(q.shape[1]) or
                        cpu_kernels.paged_chunk(q, *a))
    prompts = chat_prompts + [chat_prompts[0] + chat_prompts[1][:7]]  # shares prompt 0's blocks
    outs = {}
    for name, forms in (("kernels", KERNELS), ("copies", COPIES)):
        force_forms(**forms)
        llm = LLM.from_model(model, tok, block_size=16, max_num_seqs=4, max_model_len=256, chunked_prefill_tokens=20)
        first = llm.generate(prompts[:1], me.SamplingParams(max_tokens=8), use_tqdm=False)
        rest = llm.generate(prompts, me.SamplingParams(max_tokens=16), use_tqdm=False)
        assert rest[-1].num_cached_tokens > 0, "the last prompt should have found prompt 0's blocks cached"
        outs[name] = [o.token_ids for o in first + rest]
        if name == "kernels":
            assert max(chunk_queries) == 20, "20-token prefill chunks should have gone through the kernel"
    assert outs["kernels"] == outs["copies"]


def contiguous_case(seed, lens, slots, num_slots=6, max_len=80, hq=9, hkv=3, d=64):
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = torch.randn(2, num_slots, hkv, max_len, d, generator=g).unbind(0)
    q = torch.randn(len(lens), hq, d, generator=g)
    return q, k_cache, v_cache, torch.tensor(slots, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


def contiguous_reference(q, k_cache, v_cache, slots, lens):
    """The contiguous cache seen as a pool of one block per slot: [slots, max_len, Hkv, D]."""
    tables = slots.view(-1, 1)
    return reference(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), tables, lens)


@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 32), (8, 2, 16)], ids=["gqa 9/3", "mha", "gqa 8/2"])
def test_the_contiguous_cache_kernel_matches_the_reference(heads):
    """Sequences in slots out of order, contexts of 1 position, of the whole slot and between."""
    hq, hkv, d = heads
    q, k_cache, v_cache, slots, lens = contiguous_case(hq, [1, 80, 37, 5], [4, 0, 5, 2], hq=hq, hkv=hkv, d=d)
    got = cpu_kernels.contiguous_decode(q, k_cache, v_cache, slots, lens)
    torch.testing.assert_close(got, contiguous_reference(q, k_cache, v_cache, slots, lens), rtol=1e-5, atol=1e-5)
    assert cpu_kernels.contiguous_decode(q[:0], k_cache, v_cache, slots[:0], lens[:0]).shape == (0, hq, d)


def test_the_contiguous_cache_kernel_refuses_a_slot_or_length_outside_the_cache():
    q, k_cache, v_cache, slots, lens = contiguous_case(7, [10, 20], [0, 1])
    for bad_slots, bad_lens in (([0, 6], [10, 20]), ([-1, 1], [10, 20]), ([0, 1], [0, 20]), ([0, 1], [10, 81])):
        with pytest.raises(ValueError, match="slots must lie in .* and context_lens in"):
            cpu_kernels.contiguous_decode(q, k_cache, v_cache, torch.tensor(bad_slots, dtype=torch.int32),
                                          torch.tensor(bad_lens, dtype=torch.int32))
    with pytest.raises(ValueError, match="one row per sequence"):
        cpu_kernels.contiguous_decode(q, k_cache, v_cache, slots[:1], lens)
    assert not cpu_kernels.contiguous_decode_supported(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16())


def test_a_compiled_graph_reaches_the_contiguous_cache_kernel_through_the_decode_operator(force_forms):
    """A compiled step on the contiguous cache passes its slots and context lengths to
    `mini_engine::decode_attention` (its mask spans the whole slot): with the kernel forced, the reference's result."""
    from mini_engine.attention import DecodeGroup

    q, k_cache, v_cache, slots, lens = contiguous_case(8, [3, 80, 17], [2, 5, 0])
    group = DecodeGroup.from_tensors(lens, k_cache.shape[2], slots=slots)
    force_forms(contiguous_decode=IN_PLACE)
    register_decode_op()
    got = torch.ops.mini_engine.decode_attention(q, k_cache, v_cache, group.mask, lens, slots, None)
    torch.testing.assert_close(got, contiguous_reference(q, k_cache, v_cache, slots, lens), rtol=1e-5, atol=1e-5)


def test_real_model_same_tokens_on_the_contiguous_cache_with_the_kernel_as_with_sdpa(real, chat_prompts, force_forms):
    """generate_batch (the contiguous cache, sequences that stop at different steps) with every decode through
    the kernel, then through SDPA: the same greedy tokens."""
    from mini_engine.generate import generate_batch

    model, _ = real
    outs = {}
    for form in (IN_PLACE, "sdpa"):
        force_forms(contiguous_decode=form)
        outs[form] = generate_batch(model, chat_prompts[:3], 16)
    assert outs[IN_PLACE] == outs["sdpa"]


def test_the_cpp_operator_reads_the_contiguous_cache_as_the_ctypes_kernel_does():
    """`mini_engine_cpp::contiguous_decode` (what compiled steps call; slots and lengths of any integer dtype)
    gives the ctypes wrapper's result bit for bit, and refuses a slot outside the cache before reading it."""
    if not cpu_kernels.load_torch_ops():
        pytest.skip("the C++ operators could not be built here (no C++ compiler or PyTorch headers)")
    q, k_cache, v_cache, slots, lens = contiguous_case(9, [1, 80, 37], [4, 0, 5])
    got = torch.ops.mini_engine_cpp.contiguous_decode(q, k_cache, v_cache, slots.long(), lens.long())
    assert torch.equal(got, cpu_kernels.contiguous_decode(q, k_cache, v_cache, slots, lens))
    with pytest.raises(RuntimeError, match="slots must lie in"):
        torch.ops.mini_engine_cpp.contiguous_decode(q, k_cache, v_cache, slots + 6, lens)


@pytest.mark.parametrize("form", [IN_PLACE, "operator", None], ids=["in place", "operator", "timed"])
def test_a_compiled_contiguous_step_gives_the_eager_logits_through_either_graph_operator(force_forms, form):
    """Compiling a decode step on the contiguous cache times the two operators its graph could call (the C++
    kernel's, or `mini_engine::decode_attention`), while Dynamo traces; forced to either, or timed afresh, the
    graph gives the eager step's logits."""
    if not cpu_kernels.load_torch_ops():
        pytest.skip("the C++ operators could not be built here (no C++ compiler or PyTorch headers)")
    from test_compiled_decode import twin_steps

    from mini_engine.backends.cpu import install
    from mini_engine.backends.cpu.attention import _graph_reads_in_place
    from test_cached_equivalence import tiny_model

    if form is None:  # nothing decided: the graph's trace times both operators
        force_forms()
        for case in [c for c in TUNER.choices if c[0] == "graph_contiguous_decode"]:
            del TUNER.choices[case]
    else:
        force_forms(graph_contiguous_decode=form)
        assert _graph_reads_in_place(2, 4, 2, 16, str(torch.float32)) == (form == IN_PLACE)
    model = install(tiny_model(4, 2))
    for want, run in twin_steps(model, 2)[2]:
        with torch.profiler.profile() as prof:
            got = run()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        called = {e.key for e in prof.key_averages()}
        ops = {IN_PLACE: "mini_engine_cpp::contiguous_decode", "operator": "mini_engine::decode_attention"}
        form = form or TUNER.choices[("graph_contiguous_decode", str(torch.float32), 2, 4, (2, 128, 16))].form
        assert ops[form] in called


def test_a_step_hands_its_kernels_tensors_whose_checks_are_remembered(real, chat_prompts, force_forms, monkeypatch):
    """The kernels' input checks remember a checked tensor by identity and version, once per step. A tensor
    made in inference mode keeps no version, so it would be checked again at every layer: every table, length
    and visibility tensor a step hands the paged kernels (decodes, verify chunks, prefill chunks) has one."""
    import mini_engine.backends.cpu.attention as attention

    model, tok = real
    seen = []
    for name in ("paged_chunk", "paged_decode"):
        kernel = getattr(cpu_kernels, name)
        monkeypatch.setattr(attention, name, lambda q, k, v, tables, lens, kernel=kernel, name=name: seen.append(
            (name, tables.is_inference(), lens.is_inference())) or kernel(q, k, v, tables, lens))
    force_forms(**KERNELS)
    llm = LLM.from_model(model, tok, block_size=16, max_num_seqs=3, max_model_len=256, chunked_prefill_tokens=20,
                         speculative={"method": "ngram", "k": 4})
    llm.generate(chat_prompts, me.SamplingParams(max_tokens=16), use_tqdm=False)
    assert {name for name, *_ in seen} == {"paged_chunk", "paged_decode"}
    assert not [s for s in seen if s[1] or s[2]], "a kernel was handed an inference-mode tensor"
