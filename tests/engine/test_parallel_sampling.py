"""Parallel sampling (`SamplingParams(n=...)`, chapter 08): n completions of one prompt. On the paged cache the
prompt is prefilled once and the samples fork from it, sharing its blocks, the partly filled last one copied
on a sample's first write (copy-on-write); the contiguous cache computes the prompt once per sample. Greedy
samples are copies of the n=1 answer, seeded ones differ and reproduce, the copy happens and only its owner
writes it, preemption changes nothing and leaks nothing, and a bad n is refused."""
import random

import pytest
import torch

import mini_engine as me
from mini_engine.engine import LLM, LLMEngine

pytestmark = pytest.mark.usefixtures("one_thread")


def run(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def completions(out):
    return [o.token_ids for o in out.outputs]


# ---------------------------------------------------------------- the real model

def test_greedy_n3_gives_three_copies_of_the_n1_answer(real, chat_prompts, guard_writes):
    model, tok = real
    llm = guard_writes(LLM.from_model(model, tok, block_size=16, max_num_seqs=4, max_model_len=128))
    one = run(llm, chat_prompts[:1], me.SamplingParams(max_tokens=6))[0]
    three = run(llm, chat_prompts[:1], me.SamplingParams(max_tokens=6, n=3))[0]
    assert len(one.outputs) == 1 and one.outputs[0].token_ids == one.token_ids and one.outputs[0].index == 0
    assert completions(three) == [one.token_ids] * 3 and [o.index for o in three.outputs] == [0, 1, 2]
    assert [o.text for o in three.outputs] == [one.text] * 3 and three.text == one.text
    assert three.token_ids == one.token_ids and three.finish_reason == three.outputs[0].finish_reason
    assert three.metrics.num_output_tokens == sum(len(t) for t in completions(three))
    assert llm.engine.num_free_blocks == llm.engine.num_kv_blocks


def test_seeded_n3_is_reproducible_its_samples_differ_and_sample_0_is_the_n1_answer(real, chat_prompts):
    model, tok = real
    params = me.SamplingParams(temperature=1.0, top_p=0.95, max_tokens=8, seed=0, n=3, ignore_eos=True)
    llm = LLM.from_model(model, tok, block_size=16, max_num_seqs=4, max_model_len=128)
    first, again = (run(llm, chat_prompts[1:2], params)[0] for _ in range(2))
    assert completions(first) == completions(again), "the same seed gives the same three answers"
    assert len({tuple(t) for t in completions(first)}) == 3, f"three streams, three answers: {completions(first)}"
    single = run(llm, chat_prompts[1:2], me.SamplingParams(temperature=1.0, top_p=0.95, max_tokens=8, seed=0,
                                                            ignore_eos=True))[0]
    assert single.token_ids == first.outputs[0].token_ids, "sample 0 draws what n=1 draws: seeded outputs unchanged"


# ---------------------------------------------------------------- the tiny model

def test_the_prompt_is_prefilled_once_and_the_contiguous_cache_gives_the_same_samples(tiny_model):
    model = tiny_model(1)
    prompt = list(range(3, 23))  # 20 tokens: one full block of 16, the last block partly filled
    params = me.SamplingParams(temperature=1.0, max_tokens=5, seed=3, n=4, ignore_eos=True)
    paged = LLM.from_model(model, block_size=16, max_num_seqs=4, num_kv_blocks=16, record_trace=True)
    contiguous = LLM.from_model(model, kv_cache="contiguous", max_num_seqs=4, max_model_len=64, record_trace=True)
    a, b = run(paged, [prompt], params)[0], run(contiguous, [prompt], params)[0]
    assert completions(a) == completions(b), "fork + copy-on-write gives what four separate prefills give"
    assert len({tuple(t) for t in completions(a)}) == 4
    computed = {name: sum(n for step in llm.engine.trace for _, _, n, _ in step.chunks)
                for name, llm in (("paged", paged), ("contiguous", contiguous))}
    assert computed == {"paged": 20 + 4 * 4, "contiguous": 4 * (20 + 4)}, "paged prefills the prompt once"


def test_the_shared_partial_block_is_copied_and_written_only_by_its_owner(tiny_model, guard_writes):
    model = tiny_model(1)
    engine = guard_writes(LLMEngine.from_model(model, block_size=8, max_num_seqs=4, num_kv_blocks=16))
    prompt = list(range(5, 25))  # 20 tokens: two full blocks of 8 and one holding 4
    ids = engine.add_request(prompt, me.SamplingParams(temperature=1.0, max_tokens=3, seed=1, n=4, ignore_eos=True))
    engine.step()                                   # the one prefill; the other three fork from it
    snap = engine.block_pool()
    samples = sorted(snap.block_tables)
    assert samples[0] == ids and len(samples) == 4 and len({snap.block_tables[s] for s in samples}) == 1
    table = snap.block_tables[ids]
    assert [snap.ref_counts[b] for b in table] == [4, 4, 4], "after the fork every block is shared by all four"
    k_cache = engine.runner.kv_cache.layer(0)[0]
    prompt_kv = k_cache[table[2], :4].clone()       # the prompt's last 4 positions, in the partial block
    engine.step()                                   # the first decode: each sample writes position 20
    snap = engine.block_pool()
    assert sorted(b for b, _ in engine.scheduler.block_copies) == [table[2]] * 3, "three copies of the partial block"
    for s in samples:
        own = snap.block_tables[s]
        assert own[:2] == table[:2], "full prompt blocks stay shared"
        assert snap.ref_counts[own[2]] == 1, "each sample now owns its last block"
        assert torch.equal(k_cache[own[2], :4], prompt_kv), "the copy carries the prompt's keys"
    assert [snap.ref_counts[b] for b in table[:2]] == [4, 4]
    assert len({snap.block_tables[s][2] for s in samples}) == 4, "four distinct last blocks"
    assert table[2] in {snap.block_tables[s][2] for s in samples}, "the last holder wrote in place"
    rows = [k_cache[snap.block_tables[s][2], 4] for s in samples]
    assert len({tuple(r.flatten().tolist()) for r in rows}) > 1, "different tokens, different keys at position 20"
    while engine.has_unfinished():
        engine.step()
    assert engine.num_free_blocks == engine.num_kv_blocks


@pytest.mark.parametrize("n", [0, -1, 1.5, "2", True, None])
def test_a_bad_n_is_refused_by_name(n):
    with pytest.raises(ValueError, match=r"^n must be an int >= 1"):
        me.SamplingParams(n=n)


def test_n_the_engine_cannot_hold_is_refused_and_the_engine_keeps_serving(tiny_model):
    model = tiny_model(1)
    llm = LLM.from_model(model, block_size=4, max_num_seqs=4, num_kv_blocks=7)
    prompt = list(range(1, 18))                     # 17 tokens: 4 full blocks shared, one block per sample
    with pytest.raises(ValueError, match=r"n=5 samples run side by side but max_num_seqs=4"):
        run(llm, [prompt], me.SamplingParams(n=5))
    with pytest.raises(ValueError, match=r"n=4 samples of a 17-token prompt need 4 shared blocks \+ 4"):
        run(llm, [prompt], me.SamplingParams(n=4))
    params = me.SamplingParams(max_tokens=2, ignore_eos=True)
    params.n = 0                                    # changed after it was made: the engine checks again
    with pytest.raises(ValueError, match=r"^n must be"):
        llm.engine.add_request(prompt, params)
    assert not llm.engine.has_unfinished(), "nothing was queued"
    out = run(llm, [prompt], me.SamplingParams(n=3, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs) == 3 and all(len(t) == 4 for t in completions(out))
    contiguous = LLM.from_model(model, kv_cache="contiguous", max_num_seqs=2, max_model_len=32)
    with pytest.raises(ValueError, match=r"n=3 samples run side by side but max_num_seqs=2"):
        run(contiguous, [prompt], me.SamplingParams(n=3))
    assert llm.engine.num_free_blocks == llm.engine.num_kv_blocks


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_parallel_samples_under_preemption_change_no_output_and_leak_no_block(tiny_model, guard_writes, caching):
    model = tiny_model(1)
    rng = random.Random(4)
    prompts = [[rng.randrange(128) for _ in range(rng.randint(1, 30))] for _ in range(16)]
    params = [me.SamplingParams(max_tokens=rng.randint(1, 16), ignore_eos=True, n=rng.choice([1, 2, 3, 4]),
                                temperature=rng.choice([0.0, 1.0, 1.0]), seed=i) for i in range(len(prompts))]
    roomy = run(LLM.from_model(model, max_num_seqs=16, num_kv_blocks=400, block_size=4), prompts, params)
    llm = guard_writes(LLM.from_model(model, max_num_seqs=8, num_kv_blocks=16, block_size=4,
                                      chunked_prefill_tokens=16, enable_prefix_caching=caching))
    tight = run(llm, prompts, params)
    assert sum(o.metrics.num_preemptions for o in tight) > 0, "a pool this small should preempt samples"
    for i, (a, b) in enumerate(zip(tight, roomy)):
        assert completions(a) == completions(b), f"request {i} (n={params[i].n}) changed under preemption"
        assert len(a.outputs) == params[i].n
    blocks = llm.engine.scheduler.blocks
    assert not blocks.block_tables and not any(blocks.ref_counts), "a block leaked"
    assert llm.engine.num_free_blocks == llm.engine.num_kv_blocks
    assert not llm.engine.scheduler.running and len(llm.engine.scheduler.free_slots) == 8, "a slot leaked"
