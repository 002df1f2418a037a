"""The engine on the paged KV cache: the same tokens as the contiguous cache and the one-request loop, blocks
that all come back, preemption under a small pool that changes no output, and requests that cannot fit."""
import random

import pytest

import mini_engine as me
from mini_engine.engine import LLM, LLMEngine


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model(1)


def run(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def test_real_model_paged_equals_contiguous_and_generate_cached(real, chat_prompts, assert_greedy_match):
    model, tok = real
    params = me.SamplingParams(max_tokens=20)  # the prompts (26-40 tokens) and outputs cross block boundaries
    kwargs = {"max_num_seqs": 3, "max_model_len": 128, "chunked_prefill_tokens": 24}
    paged = run(LLM.from_model(model, tok, block_size=16, **kwargs), chat_prompts, params)
    contiguous = run(LLM.from_model(model, tok, kv_cache="contiguous", **kwargs), chat_prompts, params)
    for prompt, p, c in zip(chat_prompts, paged, contiguous):
        assert p.token_ids == c.token_ids, "same packed steps, same arithmetic: the tokens must be identical"
        assert_greedy_match(model, prompt, p.token_ids, me.generate_cached(model, prompt, 20,
                                                                            eos_token_id=tok.eos_token_id))


def random_workload(n: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(128) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    params = [me.SamplingParams(max_tokens=rng.randint(1, 64), ignore_eos=True,
                                temperature=rng.choice([0.0, 0.0, 1.0]), seed=i) for i in range(n)]
    return prompts, params


def test_stress_a_small_pool_preempts_and_changes_no_output(tiny):
    """200 requests (greedy and seeded sampling) through 24 blocks of 16 positions: running requests outgrow
    the pool, the newest are preempted and recompute, and yet every output equals the unconstrained run's."""
    prompts, params = random_workload(200, seed=0)
    free = run(LLM.from_model(tiny, max_num_seqs=12, num_kv_blocks=400), prompts, params)
    llm = LLM.from_model(tiny, max_num_seqs=12, num_kv_blocks=24, block_size=16, chunked_prefill_tokens=48)
    tight = run(llm, prompts, params)
    preempted = [o for o in tight if o.metrics.num_preemptions]
    assert preempted, "a pool this small should force preemptions"
    assert any(p.temperature > 0 for o in preempted for p in [params[o.request_id - tight[0].request_id]]), \
        "a sampling request should be among the preempted, to prove its random stream survives"
    for i, (a, b) in enumerate(zip(tight, free)):
        assert a.token_ids == b.token_ids, f"request {i} ({params[i]}) changed under preemption"
    assert sum(o.metrics.num_preemptions for o in tight) == llm.engine.scheduler.num_preemptions
    assert llm.engine.num_free_blocks == llm.engine.num_kv_blocks == 24, "every block is back in the pool"
    assert not llm.engine.has_unfinished()


def test_a_request_larger_than_the_pool_is_rejected_and_the_engine_keeps_serving(tiny):
    llm = LLM.from_model(tiny, max_num_seqs=2, num_kv_blocks=4, block_size=8, max_model_len=200)
    good = me.SamplingParams(max_tokens=5)
    with pytest.raises(ValueError, match=r"request 1: .*num_kv_blocks=4"):
        run(llm, [[1, 2, 3], [7] * 32, [4, 5]], good)       # 32 + 1 positions need 5 blocks of 8
    assert not llm.engine.has_unfinished() and llm.engine.num_free_blocks == 4, "nothing queued, nothing held"
    engine = llm.engine
    rid = engine.add_request([1, 2, 3], good)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        engine.add_request([7] * 40, good)
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    assert list(outs) == [rid] and outs[rid].token_ids == me.generate_cached(tiny, [1, 2, 3], 5)
    fits = run(llm, [[7] * 31], me.SamplingParams(max_tokens=10))[0]   # 31 + 1 fit; the output stops at the pool
    assert (len(fits.token_ids), fits.finish_reason) == (1, "length")
    assert engine.num_free_blocks == 4


def test_block_pool_snapshots_follow_requests_as_they_arrive_grow_and_finish(tiny):
    engine = LLMEngine.from_model(tiny, max_num_seqs=4, num_kv_blocks=12, block_size=4)
    first = engine.add_request(list(range(1, 10)), me.SamplingParams(max_tokens=6))   # 9 tokens: 3 blocks
    assert engine.block_pool().owners == (None,) * 12
    engine.step()
    snap = engine.block_pool()
    assert snap.owners[:3] == (first,) * 3 and snap.num_free_blocks == 9 and snap.num_computed == {first: 9}
    second = engine.add_request([5, 6], me.SamplingParams(max_tokens=2))
    engine.step()
    snap = engine.block_pool()
    assert snap.owners.count(first) == 3 and snap.owners.count(second) == 1, "position 9 still fits block 3"
    for _ in range(3):
        engine.step()
    snap = engine.block_pool()
    assert snap.owners.count(first) == 4 and second not in snap.owners, "first grew a block; second finished"
    while engine.has_unfinished():
        engine.step()
    assert engine.block_pool().num_free_blocks == 12 and engine.block_pool().step == engine._num_steps
    with pytest.raises(ValueError, match="kv_cache='paged'"):
        LLMEngine.from_model(tiny, kv_cache="contiguous").block_pool()


@pytest.mark.parametrize("policy", ["static", "dynamic"])
def test_other_policies_on_a_small_pool(tiny, policy):
    prompts, params = random_workload(40, seed=1)
    free = run(LLM.from_model(tiny, max_num_seqs=6, num_kv_blocks=200, scheduling=policy, dynamic_timeout_s=0.0),
               prompts, params)
    llm = LLM.from_model(tiny, max_num_seqs=6, num_kv_blocks=14, block_size=8, chunked_prefill_tokens=16,
                         scheduling=policy, dynamic_timeout_s=0.0)  # 112 positions: the longest request fits
    assert [o.token_ids for o in run(llm, prompts, params)] == [o.token_ids for o in free]
    assert llm.engine.num_free_blocks == 14
