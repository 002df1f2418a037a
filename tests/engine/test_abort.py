"""`LLMEngine.abort_request`: what the server calls when a client goes away. An aborted request leaves the queue or
the batch between two steps, gives its slot and KV blocks back at once (forked samples too, and slots reserved for
samples not forked yet), never produces an output, and changes nothing for the requests that run on."""
import pytest

import mini_engine as me
from mini_engine.engine import LLM, LLMEngine

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [list(range(3, 23)), list(range(40, 71)), list(range(80, 89))]  # 20, 31 and 9 tokens
GREEDY = me.SamplingParams(max_tokens=12, ignore_eos=True)
CACHES = [dict(kv_cache="paged", block_size=4, num_kv_blocks=64, max_num_seqs=4),
          dict(kv_cache="contiguous", max_num_seqs=4, max_model_len=64)]


def run_to_end(engine: LLMEngine) -> dict[int, list[int]]:
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o.token_ids for o in engine.step()})
    return outputs


def assert_idle_and_empty(engine: LLMEngine):
    s = engine.scheduler
    assert not s.waiting and not s.running and sorted(s.free_slots) == list(range(s.num_slots))
    if engine.num_kv_blocks is not None:
        assert engine.num_free_blocks == engine.num_kv_blocks, "every block is back in the pool"
        assert not s.blocks.block_tables
    assert not engine._samples and not engine._request_of and not engine._generators


def alone(model, cache, prompts):
    """Greedy outputs of `prompts`, without the request that the test aborts."""
    return [o.token_ids for o in LLM.from_model(model, **cache).generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("cache", CACHES, ids=["paged", "contiguous"])
def test_abort_running_mid_decode_frees_everything_and_leaves_the_others_unchanged(tiny_model, cache):
    model = tiny_model(1)
    engine = LLMEngine.from_model(model, **cache)
    a, b, c = (engine.add_request(p, GREEDY) for p in PROMPTS)
    for _ in range(4):  # prefills, then a few decodes: b is mid-decode
        assert not engine.step()
    samples = engine.request_samples(b)
    assert len(samples[0].output_ids) >= 2 and samples[0].status.value == "running"
    assert engine.abort_request(b)
    assert samples[0].finish_reason == "abort" and samples[0].slot is None
    assert not engine.abort_request(b), "a second abort finds nothing to do"
    outputs = run_to_end(engine)
    assert set(outputs) == {a, c}, "an aborted request never produces an output"
    assert [outputs[a], outputs[c]] == alone(model, cache, [PROMPTS[0], PROMPTS[2]])
    assert_idle_and_empty(engine)


@pytest.mark.parametrize("cache", CACHES, ids=["paged", "contiguous"])
def test_abort_waiting_request(tiny_model, cache):
    model = tiny_model(1)
    engine = LLMEngine.from_model(model, **{**cache, "max_num_seqs": 1})
    a, b = (engine.add_request(p, GREEDY) for p in PROMPTS[:2])
    engine.step()
    assert [r.request_id for r in engine.scheduler.waiting] == [b]
    assert engine.abort_request(b) and not engine.scheduler.waiting
    assert run_to_end(engine) == {a: alone(model, cache, PROMPTS[:1])[0]}
    assert_idle_and_empty(engine)


def test_abort_finished_or_unknown_request_is_a_no_op(tiny_model):
    engine = LLMEngine.from_model(tiny_model(1), **CACHES[0])
    a = engine.add_request(PROMPTS[0], me.SamplingParams(max_tokens=2, ignore_eos=True))
    assert set(run_to_end(engine)) == {a}
    assert not engine.abort_request(a) and not engine.abort_request(12345)
    assert_idle_and_empty(engine)


def test_abort_preempted_request(tiny_model):
    """A preempted request waits at the front of the queue holding nothing; abort takes it out of there."""
    engine = LLMEngine.from_model(tiny_model(1), kv_cache="paged", block_size=4, num_kv_blocks=64, max_num_seqs=4)
    a, b = (engine.add_request(p, GREEDY) for p in PROMPTS[:2])
    engine.step()
    victim = engine.request_samples(b)[0]
    engine.scheduler.preempt(victim)
    assert engine.scheduler.waiting == [victim] and victim.status.value == "preempted"
    assert engine.abort_request(b) and victim.finish_reason == "abort"
    assert set(run_to_end(engine)) == {a}
    assert_idle_and_empty(engine)


@pytest.mark.parametrize("cache", CACHES, ids=["paged", "contiguous"])
@pytest.mark.parametrize("when", ["before_fork", "after_fork"])
def test_abort_parallel_sampling_request(tiny_model, cache, when):
    """n=3: before the fork (prompt half prefilled) the unforked samples' reserved slots come back; after it,
    every forked sample's blocks and slot do (shared blocks lose all their holders)."""
    model = tiny_model(1)
    engine = LLMEngine.from_model(model, **cache, chunked_prefill_tokens=16)
    a = engine.add_request(PROMPTS[2], GREEDY)
    b = engine.add_request(PROMPTS[1], me.SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=12,
                                                         ignore_eos=True))
    outputs = {o.request_id: o.token_ids for o in engine.step()}  # a's prompt (9 tokens) and 7 of b's 31
    samples = engine.request_samples(b)
    if when == "after_fork":
        while not all(s.output_ids for s in samples):  # the contiguous cache prefills each sample on its own
            outputs.update({o.request_id: o.token_ids for o in engine.step()})
        assert all(len(s.output_ids) >= 1 and s.slot is not None for s in samples)
    else:
        assert samples[0].is_prefill and samples[0].num_computed > 0
    assert engine.abort_request(b)
    assert [s.finish_reason for s in samples] == ["abort"] * 3 and all(s.slot is None for s in samples)
    outputs.update(run_to_end(engine))
    assert outputs == {a: alone(model, cache, PROMPTS[2:])[0]}
    assert_idle_and_empty(engine)


def test_abort_on_the_real_model_with_prefix_caching(real, chat_prompts):
    """The real model: abort one request mid-decode, the other's text is the one it has alone, and the pool is
    all free afterwards (cached blocks count as free)."""
    model, tok = real
    kwargs = dict(block_size=16, max_num_seqs=4, max_model_len=128, enable_prefix_caching=True)
    engine = LLMEngine.from_model(model, tok, **kwargs)
    params = me.SamplingParams(max_tokens=8)
    a, b = (engine.add_request(p, params) for p in chat_prompts[:2])
    engine.step()
    engine.step()
    assert engine.abort_request(b)
    outputs = run_to_end(engine)
    expected = LLM.from_model(model, tok, **kwargs).generate(chat_prompts[:1], params, use_tqdm=False)[0]
    assert outputs == {a: expected.token_ids}
    assert_idle_and_empty(engine)
