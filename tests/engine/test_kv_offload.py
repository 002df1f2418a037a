"""The tiered prefix cache (chapter 12, mini_engine/transfer/offload.py): blocks the hashed prefix cache evicts go
to host memory, then to files, and come back on a hit. Outputs equal the uncached engine's; hits from each tier are
counted; a damaged or missing file is a miss; the tiers never outgrow their bounds; bad arguments name themselves."""
import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mini_engine as me
from mini_engine.engine import LLM
from mini_engine.engine_config import EngineConfig
from mini_engine.paging import BlockManager
from mini_engine.transfer import TierStore, pack
from mini_engine.transfer.offload import TieredBlockManager

pytestmark = pytest.mark.usefixtures("one_thread")

PARAMS = me.SamplingParams(max_tokens=4, ignore_eos=True)


def roots(seed, n, length=40, vocab=128):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def serve(llm, prompts, params=PARAMS):
    """One request at a time: each finds what the ones before it left in the pool and the tiers."""
    return [out for p in prompts for out in llm.generate([p], params, use_tqdm=False)]


def tiers(llm) -> TierStore:
    return llm.engine.scheduler.blocks.tiers


def files(store: TierStore) -> list[str]:
    return sorted(f for f in os.listdir(store.directory) if f.endswith(".kv"))


def check_bounds_and_no_leak(llm):
    store, blocks = tiers(llm), llm.engine.scheduler.blocks
    assert len(store.host) <= store.host_blocks and len(store.disk) <= store.disk_blocks
    if store.directory:
        assert len(files(store)) == len(store.disk), "a file for every disk entry, and no other"
    tree = getattr(blocks, "node_of", {})  # the radix tree holds a reference of its own on each of its blocks
    assert not blocks.block_tables and not blocks.loads, "a sequence was left behind"
    assert all(count == (b in tree) for b, count in enumerate(blocks.ref_counts)), "a block leaked"
    assert llm.engine.num_free_blocks == llm.engine.num_kv_blocks


# ---------------------------------------------------------------- arguments

@pytest.mark.parametrize("kwargs, name", [
    ({"kv_offload": "ram"}, "kv_offload must be one of"),
    ({"kv_offload": "disk"}, "kv_offload_dir"),
    ({"kv_offload": "host", "kv_offload_dir": "/tmp"}, "kv_offload_dir is for kv_offload='disk'"),
    ({"kv_offload": "host", "kv_offload_disk_blocks": 4}, "kv_offload_disk_blocks is for kv_offload='disk'"),
    ({"kv_offload_host_blocks": 4}, "kv_offload_host_blocks sizes a tier"),
    ({"kv_offload": "host", "kv_offload_host_blocks": 0}, "kv_offload_host_blocks must be an int >= 1"),
    ({"kv_offload": "host", "kv_offload_host_blocks": True}, "kv_offload_host_blocks must be an int >= 1"),
    ({"kv_offload": "disk", "kv_offload_dir": "/tmp", "kv_offload_disk_blocks": 2.5}, "kv_offload_disk_blocks"),
    ({"kv_offload": "disk", "kv_offload_dir": 3}, "kv_offload_dir must be a path"),
    ({"kv_offload": "host", "enable_prefix_caching": False}, "enable_prefix_caching"),
    ({"kv_offload": "host", "kv_cache": "contiguous", "enable_prefix_caching": None}, "kv_cache='paged'"),
    ({"kv_offload": "host", "block_manager": BlockManager}, "block_manager=... has no tiers"),
    ({"kv_offload": "host", "tensor_parallel_size": 3}, "tensor_parallel_size"),
])
def test_bad_arguments_raise_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        EngineConfig(**kwargs)


def test_a_file_as_the_directory_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="kv_offload_dir must be a directory"):
        EngineConfig(kv_offload="disk", kv_offload_dir=tmp_path / "f")


def test_the_default_path_has_no_tiers(tiny_model):
    assert EngineConfig().block_manager_class() is BlockManager
    llm = LLM.from_model(tiny_model(1), num_kv_blocks=8)
    assert type(llm.engine.scheduler.blocks) is BlockManager
    out = llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False)[0]
    assert (out.metrics.num_host_cached_tokens, out.metrics.num_disk_cached_tokens) == (0, 0)
    made = EngineConfig(kv_offload="host").block_manager_class()(8, 4, True)
    assert isinstance(made, TieredBlockManager) and made.tiers.host_blocks == 8 and not made.tiers.disk_blocks


# ---------------------------------------------------------------- the tiers alone

def packed(value: float):
    from mini_engine.config import ModelConfig
    from mini_engine.kv_cache import PagedKVCache
    cfg = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=4, max_position_embeddings=16)
    cache = PagedKVCache(cfg, 1, 2)
    cache.data.fill_(value)
    return pack(cache, [0])


def test_host_then_disk_least_recently_used_first(tmp_path):
    store = TierStore(host_blocks=2, disk_blocks=3, directory=tmp_path)
    for i in range(4):
        store.put(bytes([i]), packed(i))
    assert list(store.host) == [b"\2", b"\3"] and list(store.disk) == [b"\0", b"\1"]
    assert store.get(b"\0")[1] == "disk" and store.get(b"\3")[1] == "host"
    store.put(b"\4", packed(4))                       # pushes 2 down; 0 was read since 1, so 1 is the oldest on disk
    store.put(b"\5", packed(5))                       # pushes 3 down: the disk tier is over its bound, 1 goes
    assert list(store.disk) == [b"\0", b"\2", b"\3"] and store.stats.drops == 1
    assert len(files(store)) == 3
    store.put(b"\0", packed(0))                       # in use again: back to host memory, its file gone
    assert store.tier(b"\0") == "host" and len(files(store)) == len(store.disk)
    directory = store.directory
    store.clear()
    assert not len(store) and not files(store)
    del store
    assert not os.path.exists(directory), "a store's own directory goes with it"


@pytest.mark.parametrize("damage", ["missing", "truncated", "corrupted", "empty"])
def test_a_damaged_file_is_a_miss_and_forgotten(tmp_path, damage):
    store = TierStore(host_blocks=1, disk_blocks=4, directory=tmp_path)
    store.put(b"a", packed(1.0))
    store.put(b"b", packed(2.0))                      # "a" goes to disk
    path = store.path(b"a")
    if damage == "missing":
        os.remove(path)
    else:
        data = bytearray(open(path, "rb").read())
        data = {"truncated": data[:-3], "empty": b"", "corrupted": data[:-1] + bytes([data[-1] ^ 0x10])}[damage]
        open(path, "wb").write(data)
    assert store.get(b"a") is None and b"a" not in store and store.stats.bad_files == 1
    assert store.get(b"b")[1] == "host"


# ---------------------------------------------------------------- the engine

@pytest.mark.parametrize("prefix_cache", ["hashed", "radix"])
def test_outputs_equal_the_uncached_engine_with_hits_from_host_and_disk(tiny_model, tmp_path, guard_writes,
                                                                        prefix_cache):
    """Six 40-token prefixes (30 blocks of 8) through a pool of 12 blocks: a plain prefix cache has evicted most by
    the time they come back; the tiers hold them all. The second pass runs in reverse: the latest prefixes are still
    in host memory, the oldest only on disk."""
    model, prefixes = tiny_model(1), roots(0, 6)
    prompts = [r + [7, 8] for r in prefixes] + [r + [10, 11] for r in reversed(prefixes)]
    ref = serve(LLM.from_model(model, num_kv_blocks=400, enable_prefix_caching=False), prompts)
    pool = serve(LLM.from_model(model, num_kv_blocks=12, block_size=8), prompts)
    host = guard_writes(LLM.from_model(model, num_kv_blocks=12, block_size=8, kv_offload="host",
                                       kv_offload_host_blocks=40, prefix_cache=prefix_cache))
    disk = guard_writes(LLM.from_model(model, num_kv_blocks=12, block_size=8, kv_offload="disk",
                                       kv_offload_dir=tmp_path, kv_offload_host_blocks=10, kv_offload_disk_blocks=40,
                                       prefix_cache=prefix_cache))
    found = {}
    for name, llm in (("host", host), ("disk", disk)):
        outs = serve(llm, prompts)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref], f"kv_offload={name!r} changed an output"
        assert [o.num_cached_tokens for o in outs[6:]] == [40] * 6, "every prefix comes back, pool or tier"
        assert sum(o.num_cached_tokens for o in outs[:6]) < 8, "distinct prefixes (a token or two in common)"
        for o in outs:
            assert o.metrics.num_host_cached_tokens + o.metrics.num_disk_cached_tokens <= o.num_cached_tokens
        found[name] = [sum(getattr(o.metrics, f"num_{t}_cached_tokens") for o in outs) for t in ("host", "disk")]
        assert llm.engine.scheduler.blocks.num_evictions > 0
        check_bounds_and_no_leak(llm)
    assert sum(o.num_cached_tokens for o in pool) < 6 * 40 / 2, "the hashed pool alone keeps little of it"
    assert found["host"][0] >= 3 * 40 and found["host"][1] == 0, f"most prefixes come back from host memory: {found}"
    assert found["disk"][0] > 0 and found["disk"][1] > 0, f"hits from both tiers: {found['disk']}"
    stats = tiers(disk).stats
    assert (stats.host_hits, stats.disk_hits) == (found["disk"][0] // 8, found["disk"][1] // 8) and stats.demotions


@pytest.mark.parametrize("prefix_cache", ["hashed", "radix"])
def test_damaged_files_are_misses_and_tokens_stay_equal(tiny_model, tmp_path, prefix_cache):
    model, prefixes = tiny_model(2), roots(1, 6)
    prompts = [r + [3] for r in prefixes]
    ref = serve(LLM.from_model(model, num_kv_blocks=400, enable_prefix_caching=False), prompts * 2)
    llm = LLM.from_model(model, num_kv_blocks=12, block_size=8, kv_offload="disk", kv_offload_dir=tmp_path,
                         kv_offload_host_blocks=2, kv_offload_disk_blocks=60, prefix_cache=prefix_cache)
    first = serve(llm, prompts)
    store = tiers(llm)
    names = files(store)
    assert len(names) >= 15, "30 blocks went through a pool of 12 and a host tier of 2"
    for i, name in enumerate(names):  # every file damaged one way or another
        path = os.path.join(store.directory, name)
        if i % 3 == 0:
            os.remove(path)
        else:
            data = bytearray(open(path, "rb").read())
            open(path, "wb").write(data[:len(data) // 2] if i % 3 == 1 else data[:-1] + bytes([data[-1] ^ 1]))
    second = serve(llm, prompts)
    assert [o.token_ids for o in first + second] == [o.token_ids for o in ref]
    # The oldest prefixes were only on disk, every file damaged: misses, recomputed. (Later requests may hit files
    # written during the second pass.)
    assert [o.metrics.num_disk_cached_tokens for o in second[:2]] == [0, 0] and store.stats.bad_files >= 2
    check_bounds_and_no_leak(llm)


@pytest.mark.parametrize("prefix_cache", ["hashed", "radix"])
def test_a_step_that_fails_before_its_copies_caches_nothing_unwritten(tiny_model, monkeypatch, prefix_cache):
    """The copy back fails: the step's requests are aborted, their blocks are not registered, and the same prompts
    then run to the same tokens as an uncached engine."""
    import mini_engine.transfer.offload as offload
    model, prefixes = tiny_model(1), roots(3, 4)
    prompts = [r + [5] for r in prefixes]
    ref = serve(LLM.from_model(model, num_kv_blocks=400, enable_prefix_caching=False), prompts)
    llm = LLM.from_model(model, num_kv_blocks=12, block_size=8, kv_offload="host", prefix_cache=prefix_cache)
    serve(llm, prompts)
    real_unpack = offload.unpack
    monkeypatch.setattr(offload, "unpack", lambda *a: (_ for _ in ()).throw(RuntimeError("link down")))
    with pytest.raises(RuntimeError, match="link down"):
        llm.generate([prompts[0]], PARAMS, use_tqdm=False)
    blocks = llm.engine.scheduler.blocks
    assert not blocks.loads and not blocks.block_tables
    assert blocks.lookup(prompts[0]) == [], "the blocks the failed step never wrote are not cached"
    monkeypatch.setattr(offload, "unpack", real_unpack)
    assert [o.token_ids for o in serve(llm, prompts)] == [o.token_ids for o in ref]
    check_bounds_and_no_leak(llm)


def test_the_real_model_through_both_tiers(real, tmp_path, assert_greedy_match):
    """SmolLM2-135M: three 48-token prefixes (3 blocks of 16 each) through a pool of 6 blocks and a host tier of 2:
    coming back in reverse order, the middle one is partly in host memory, the first on disk."""
    model, tok = real
    prefixes = roots(4, 3, length=48, vocab=9000)
    prompts = [r + [100 + i] for i, r in enumerate(prefixes)] + [r + [200] for r in reversed(prefixes)]
    params = me.SamplingParams(max_tokens=2, ignore_eos=True)
    kwargs = {"max_num_seqs": 2, "max_model_len": 96, "block_size": 16}
    ref = LLM.from_model(model, tok, enable_prefix_caching=False, **kwargs).generate(prompts, params, use_tqdm=False)
    llm = LLM.from_model(model, tok, num_kv_blocks=6, kv_offload="disk", kv_offload_dir=tmp_path,
                         kv_offload_host_blocks=2, kv_offload_disk_blocks=12, **kwargs)
    outs = serve(llm, prompts, params)
    for prompt, a, b in zip(prompts, outs, ref):
        if a.token_ids != b.token_ids:
            assert_greedy_match(model, prompt, a.token_ids, b.token_ids)
    host = sum(o.metrics.num_host_cached_tokens for o in outs)
    disk = sum(o.metrics.num_disk_cached_tokens for o in outs)
    assert host > 0 and disk > 0, (host, disk)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 48, 48, 48], "every prefix comes back, pool or tier"
    check_bounds_and_no_leak(llm)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_tiers_never_exceed_their_bounds(tiny_model, tmp_path_factory, data):
    """Random small pools, tiers and workloads (prefixes of a few roots, several requests at once): after every
    step the tiers hold at most their bounds, and the outputs equal the uncached engine's."""
    model = tiny_model(3)
    draw = data.draw
    block_size, prefix_cache = draw(st.sampled_from([4, 8])), draw(st.sampled_from(["hashed", "radix"]))
    host_blocks, disk_blocks = draw(st.integers(1, 6)), draw(st.integers(0, 8))
    rng = random.Random(draw(st.integers(0, 10**6)))
    bases = roots(rng.random(), 3, length=24)
    prompts = [rng.choice(bases)[:rng.randint(1, 24)] + [rng.randrange(128) for _ in range(rng.randint(0, 4))]
               for _ in range(draw(st.integers(4, 14)))]
    prompts = [p or [1] for p in prompts]
    params = me.SamplingParams(max_tokens=3, ignore_eos=True)
    ref = LLM.from_model(model, num_kv_blocks=200, enable_prefix_caching=False).generate(prompts, params,
                                                                                         use_tqdm=False)
    offload = {"kv_offload": "disk", "kv_offload_dir": tmp_path_factory.mktemp("kv"),
               "kv_offload_disk_blocks": disk_blocks} if disk_blocks else {"kv_offload": "host"}
    llm = LLM.from_model(model, max_num_seqs=3, num_kv_blocks=draw(st.integers(8, 14)), block_size=block_size,
                         chunked_prefill_tokens=16, kv_offload_host_blocks=host_blocks, prefix_cache=prefix_cache,
                         **offload)
    engine, store = llm.engine, tiers(llm)
    ids = [engine.add_request(p, params) for p in prompts[:len(prompts) // 2]]
    outs = {}
    later = prompts[len(prompts) // 2:]
    while engine.has_unfinished() or later:
        if later and rng.random() < 0.4:
            ids.append(engine.add_request(later.pop(0), params))
        for out in engine.step():
            outs[out.request_id] = out
        assert len(store.host) <= host_blocks and len(store.disk) <= disk_blocks
        if store.directory:
            assert len(files(store)) == len(store.disk)
    assert [outs[i].token_ids for i in ids] == [o.token_ids for o in ref]
    check_bounds_and_no_leak(llm)


@pytest.mark.parametrize("prefix_cache", ["hashed", "radix"])
def test_a_tier_the_size_of_the_pool_gives_back_a_whole_prefix(tiny_model, prefix_cache):
    """A 96-token prefix (12 blocks of 8) pushed out of a 14-block pool by a filler, into a host tier of 14 blocks.
    Copying it back takes the filler's blocks, whose saves push the oldest blocks out of the tier: the walk holds
    every buffer it found before it takes a block, so the whole prefix still comes back."""
    model = tiny_model(1)
    prefix, filler = roots(5, 2, length=96)
    ref = serve(LLM.from_model(model, num_kv_blocks=400, enable_prefix_caching=False), [prefix + [1, 2]])
    llm = LLM.from_model(model, num_kv_blocks=14, block_size=8, max_num_seqs=1, kv_offload="host",
                         prefix_cache=prefix_cache)
    serve(llm, [prefix + [3], filler + [4]])
    out = serve(llm, [prefix + [1, 2]])[0]
    assert out.num_cached_tokens == 96 and out.metrics.num_host_cached_tokens >= 80
    assert out.token_ids == ref[0].token_ids
    check_bounds_and_no_leak(llm)
