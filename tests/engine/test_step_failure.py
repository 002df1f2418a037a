"""A step is all or nothing (issue 59): an exception anywhere in a step (scheduling, before or after the block copies,
inside the model after a layer has written keys and values, in the sampler, in the proposer) aborts the requests the
step scheduled, leaves the pool consistent, puts nothing half-written in either prefix cache, and the engine serves
the next request with the tokens an uncached engine produces. The faults land in the step that has copy-on-write
pending (a forked sample's first write into the shared last block, or a radix match that ends inside a block), where
a lost copy used to poison the cache."""
import pytest

import mini_engine as me
from mini_engine.engine import LLM, LLMEngine

pytestmark = pytest.mark.usefixtures("one_thread")

PREFIX = list(range(3, 17))                       # 14 tokens: three blocks of 4 and two tokens of a fourth
PROMPT = PREFIX + [90, 91, 92, 93, 94]            # extends it, ending inside its fifth block
SAMPLED = me.SamplingParams(max_tokens=6, ignore_eos=True, n=2)  # greedy: the follow-ups can extend its answer
GREEDY = me.SamplingParams(max_tokens=6, ignore_eos=True)
FOLLOW_UPS = [PROMPT, PREFIX + [40, 41, 42], PROMPT[:17], PROMPT + [60]]  # + PROMPT and its answer's first tokens
CACHES = {"hashed": {}, "radix": {"prefix_cache": "radix"}}
ENGINE = dict(block_size=4, num_kv_blocks=64, max_num_seqs=4, enable_prefix_caching=True)


class Injected(Exception):
    pass


def arm(engine: LLMEngine, point: str, monkeypatch) -> dict:
    """Make the first step that has block copies to plan or run raise at `point`; returns {"fired": bool}."""
    state = {"fired": False}
    runner, scheduler = engine.runner, engine.scheduler

    def fire():
        if not state["fired"]:
            state["fired"] = True
            raise Injected(point)

    if point == "schedule":  # inside schedule(), once a copy is planned and the table points at the new block
        cow = scheduler.blocks.copy_on_write
        monkeypatch.setattr(scheduler.blocks, "copy_on_write",
                            lambda *a: (copies := cow(*a)) and fire() or copies)
    elif point == "before_copies":
        execute = runner.execute
        monkeypatch.setattr(runner, "execute",
                            lambda chunks, copies=(): (copies and fire()) or execute(chunks, copies))
    elif point == "after_copies":
        copy = runner.kv_cache.copy_blocks
        monkeypatch.setattr(runner.kv_cache, "copy_blocks", lambda pairs: (copy(pairs), fire()))
    elif point == "model":  # after layer 0 has written this step's keys and values
        state["hook"] = runner.model.layers[1].register_forward_pre_hook(  # removed by the test (a shared model)
            lambda *_: fire() if scheduler.block_copies else None)  # a pre-hook must return None
    elif point == "sampler":
        sample = engine._sample
        monkeypatch.setattr(engine, "_sample", lambda chunks, logits: (scheduler.block_copies and fire())
                            or sample(chunks, logits))
    else:
        raise ValueError(point)
    return state


def assert_pool_consistent(engine: LLMEngine) -> None:
    """An idle engine's pool: no tables, every block free or cached-and-unheld, counts and hashes exact."""
    bm = engine.scheduler.blocks
    n = bm.num_blocks
    assert not bm.block_tables and not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.num_free_blocks == n, "a block leaked"
    assert sorted(engine.scheduler.free_slots) == list(range(engine.scheduler.num_slots))
    assert not engine._samples and not engine._request_of and not engine._generators
    free, evictable = list(bm.free_blocks), list(bm.evictable)
    assert len(set(free)) == len(free) and not set(free) & set(evictable)
    assert set(free) | set(evictable) == set(range(n)), "a block is neither free nor cached"
    cached = set(bm.cached_blocks.values())
    assert {b for b, h in enumerate(bm.block_hash) if h is not None} == cached == set(evictable)
    tree = set(getattr(bm, "node_of", ()))
    assert [bm.ref_counts[b] for b in range(n)] == [int(b in tree) for b in range(n)], "reference counts are off"
    if tree:
        assert tree == cached


def follow_ups(model) -> tuple[list[list[int]], list[list[int]]]:
    """The follow-up prompts (the last: PROMPT and the first tokens of its greedy answer, which a drained engine
    would have cached) and their greedy tokens on an uncached engine."""
    llm = LLM.from_model(model, **{**ENGINE, "enable_prefix_caching": False})
    answer = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].token_ids
    prompts = FOLLOW_UPS + [PROMPT + answer[:4]]
    return prompts, [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("cache", sorted(CACHES))
@pytest.mark.parametrize("point", ["schedule", "before_copies", "after_copies", "model", "sampler"])
def test_a_failed_step_aborts_what_it_scheduled_and_caches_nothing_it_did_not_compute(
        tiny_model, guard_writes, monkeypatch, cache, point):
    model = tiny_model(1)
    engine = guard_writes(LLMEngine.from_model(model, **ENGINE, **CACHES[cache]))
    llm = LLM.__new__(LLM)
    llm.engine = engine
    llm.generate([PREFIX], me.SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)  # PREFIX cached
    state = arm(engine, point, monkeypatch)
    request_id = engine.add_request(PROMPT, SAMPLED)
    samples = engine.request_samples(request_id)
    try:
        with pytest.raises(Injected) as raised:
            while engine.has_unfinished():
                engine.step()
    finally:
        if "hook" in state:
            state["hook"].remove()
    assert state["fired"], f"no step planned a block copy: the fault at {point} never fired"
    assert [s.finish_reason for s in samples] == ["abort", "abort"], "the step's requests are aborted"
    assert any(f"requests [{request_id}]" in note for note in raised.value.__notes__), "the note names them"
    assert not engine.has_unfinished()
    while engine.has_unfinished():  # (nothing left: a drained engine is what used to poison the cache)
        engine.step()
    assert_pool_consistent(engine)
    # Every cached block a follow-up hits must hold the keys and values of its tokens: the uncached engine's tokens.
    prompts, expected = follow_ups(model)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in outs) > 0, "the follow-ups should hit the cache"
    assert [o.token_ids for o in outs] == expected
    assert_pool_consistent(engine)


@pytest.mark.parametrize("cache", sorted(CACHES))
def test_a_failed_proposer_leaves_the_pool_alone_and_the_engine_serves_on(tiny_model, monkeypatch, cache):
    """The proposer runs before anything is scheduled: its failure aborts nothing and changes no block."""
    model = tiny_model(1)
    llm = LLM.from_model(model, **ENGINE, **CACHES[cache], speculative={"method": "ngram", "k": 3})
    engine = llm.engine
    request_id = engine.add_request(PREFIX * 2, GREEDY)
    engine.step()  # the prefill; decodes propose from here on
    blocks = engine.scheduler.blocks
    before = (list(blocks.ref_counts), {k: list(v) for k, v in blocks.block_tables.items()})
    propose = engine.proposer.propose

    def failing(*args):
        raise Injected("proposer")
    monkeypatch.setattr(engine.proposer, "propose", failing)
    with pytest.raises(Injected):
        engine.step()
    assert (list(blocks.ref_counts), {k: list(v) for k, v in blocks.block_tables.items()}) == before, "nothing was scheduled, so no block changed"
    monkeypatch.setattr(engine.proposer, "propose", propose)
    out = {}
    while engine.has_unfinished():
        out.update({o.request_id: o.token_ids for o in engine.step()})
    plain = LLM.from_model(model, **{**ENGINE, "enable_prefix_caching": False})
    assert out[request_id] == plain.generate([PREFIX * 2], GREEDY, use_tqdm=False)[0].token_ids
    assert_pool_consistent(engine)


@pytest.mark.parametrize("cache", sorted(CACHES))
def test_generate_aborts_all_its_requests_when_a_step_fails_and_serves_the_next_call(tiny_model, monkeypatch, cache):
    """LLM.generate raises, as the server fails every stream: its requests still queued (max_num_seqs=1 keeps two
    waiting) are aborted too, so nothing of that call runs on in the engine."""
    model = tiny_model(1)
    llm = LLM.from_model(model, **{**ENGINE, "max_num_seqs": 2}, **CACHES[cache])
    llm.generate([PREFIX], me.SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    arm(llm.engine, "before_copies", monkeypatch)
    with pytest.raises(Injected):
        llm.generate([PROMPT, PREFIX + [50], PREFIX + [51]], SAMPLED, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert_pool_consistent(llm.engine)
    prompts, expected = follow_ups(model)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
