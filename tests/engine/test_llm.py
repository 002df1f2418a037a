"""The serving engine end to end: LLM.generate and LLMEngine against the one-request reference loop."""
import copy
import dataclasses
import random

import pytest

import mini_engine as me
from mini_engine.engine import LLM, LLMEngine

POLICIES = ["continuous", "static", "dynamic"]
KV_CACHES = ["paged", "contiguous"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model(0)


@pytest.fixture(scope="module")
def workload():
    """Twelve prompts of 1-40 tokens, each with its own output length (1-24)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(128) for _ in range(rng.randint(1, 40))] for _ in range(12)]
    return prompts, [rng.randint(1, 24) for _ in prompts]


@pytest.fixture(scope="module")
def reference(tiny, workload):
    prompts, lengths = workload
    return [me.generate_cached(tiny, p, n) for p, n in zip(prompts, lengths)]


def serve(model, prompts, params, tokenizer=None, **kwargs):
    kwargs = {"max_num_seqs": 3, "dynamic_timeout_s": 0.0, **kwargs}
    return LLM.from_model(model, tokenizer, **kwargs).generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("kv_cache", KV_CACHES)
@pytest.mark.parametrize("chunk", [None, 5, 512], ids=["no-chunking", "chunk-5", "chunk-512"])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_matches_one_request_at_a_time(tiny, workload, reference, assert_greedy_match, policy, chunk,
                                              kv_cache):
    prompts, lengths = workload
    outs = serve(tiny, prompts, [me.SamplingParams(max_tokens=n) for n in lengths], scheduling=policy,
                 chunked_prefill_tokens=chunk, kv_cache=kv_cache, block_size=4)
    for prompt, out, ref in zip(prompts, outs, reference):
        assert_greedy_match(tiny, prompt, out.token_ids, ref)
        assert out.finish_reason == "length" and out.prompt_token_ids == prompt


def test_naive_attention_backend_gives_the_same_tokens(tiny, workload, reference, assert_greedy_match):
    prompts, lengths = workload
    llm = LLM.from_model(tiny, max_num_seqs=4, attention_backend="naive")
    outs = llm.generate(prompts, [me.SamplingParams(max_tokens=n) for n in lengths], use_tqdm=False)
    assert llm.config.attention_backend == "naive"
    for prompt, out, ref in zip(prompts, outs, reference):
        assert_greedy_match(tiny, prompt, out.token_ids, ref)


def test_auto_backend_is_torch_on_cpu(tiny):
    llm = LLM.from_model(tiny)
    assert llm.config.attention_backend == "torch" and "attention=torch" in repr(llm)


def test_cpu_defaults_and_the_pool_at_equal_memory(tiny):
    paged, contiguous = LLM.from_model(tiny), LLM.from_model(tiny, kv_cache="contiguous")
    assert paged.config.kv_cache == "paged" and "paged KV cache" in repr(paged), "paged is the default"
    assert (paged.config.max_num_seqs, paged.config.max_model_len) == (64, 256), "CPU defaults, capped by the model"
    assert (contiguous.config.max_num_seqs, contiguous.config.max_model_len) == (16, 256)
    assert paged.engine.num_kv_blocks == 16 * 256 // 16 == paged.engine.num_free_blocks
    assert paged.engine.kv_cache_bytes == contiguous.engine.kv_cache_bytes, "the pool holds what 16 slots reserve"
    assert contiguous.engine.num_kv_blocks is None and contiguous.engine.num_free_blocks is None
    sized = LLM.from_model(tiny, max_num_seqs=4, max_model_len=100, block_size=8)
    assert (sized.config.max_num_seqs, sized.engine.num_kv_blocks) == (4, 50), "4 x 100 positions in blocks of 8"


def test_mixed_sampling_parameters_in_one_batch(tiny, workload):
    prompts, _ = workload
    params = [me.SamplingParams(max_tokens=12),
              me.SamplingParams(temperature=0.8, seed=1, max_tokens=12),
              me.SamplingParams(temperature=1.2, top_k=5, seed=2, max_tokens=7),
              me.SamplingParams(temperature=1.0, top_p=0.5, seed=3, max_tokens=12),
              me.SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=4, max_tokens=3)]
    outs = serve(tiny, prompts[:5], params, chunked_prefill_tokens=6)
    for prompt, p, out in zip(prompts, params, outs):
        # the reference loop draws from a generator seeded the same way: same logits, same tokens
        assert out.token_ids == me.generate_cached(tiny, prompt, p.max_tokens, p), f"params {p}"


def test_seeded_sampling_does_not_depend_on_the_batch(tiny, workload):
    prompts, lengths = workload
    seeded = me.SamplingParams(temperature=1.0, top_p=0.95, seed=123, max_tokens=15)
    alone = serve(tiny, [prompts[0]], seeded)[0].token_ids
    others = [me.SamplingParams(temperature=1.0, max_tokens=n) for n in lengths[1:]]  # unseeded neighbours
    for policy in POLICIES:
        crowd = serve(tiny, prompts[1:6] + [prompts[0]] + prompts[6:], others[:5] + [seeded] + others[5:],
                      scheduling=policy, chunked_prefill_tokens=4)
        assert crowd[5].token_ids == alone, f"{policy}: a seeded request must not see its neighbours' draws"
    other_seed = serve(tiny, [prompts[0]], dataclasses.replace(seeded, seed=124))[0].token_ids
    assert other_seed != alone


def test_stop_tokens_and_ignore_eos(tiny, workload, reference):
    prompts, _ = workload
    free = me.generate_cached(tiny, prompts[0], 20)
    stop = free[5]
    cut = free[:free.index(stop) + 1]
    out = serve(tiny, [prompts[0]], me.SamplingParams(max_tokens=20, stop_token_ids=[stop]))[0]
    assert (out.token_ids, out.finish_reason) == (cut, "stop")

    with_eos = copy.deepcopy(tiny)
    with_eos.config = dataclasses.replace(tiny.config, eos_token_id=stop)
    out = serve(with_eos, [prompts[0]], me.SamplingParams(max_tokens=20))[0]
    assert (out.token_ids, out.finish_reason) == (cut, "stop"), "the model's EOS token ends a request"
    out = serve(with_eos, [prompts[0]], me.SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert (out.token_ids, out.finish_reason) == (free, "length"), "ignore_eos runs to max_tokens"


def test_output_stops_at_max_model_len(tiny):
    out = serve(tiny, [[1, 2, 3, 4, 5]], me.SamplingParams(max_tokens=50), max_model_len=12)[0]
    assert (len(out.token_ids), out.finish_reason) == (7, "length"), "prompt 5 + output 7 = max_model_len 12"
    assert out.token_ids == me.generate_cached(tiny, [1, 2, 3, 4, 5], 7)


def _bad(what):
    p = me.SamplingParams()
    for name, value in what.items():
        setattr(p, name, value)  # SamplingParams checks itself when made; the engine checks again
    return p


@pytest.mark.parametrize("prompt,params,match", [
    ([1, 2], _bad({"temperature": -1.0}), "temperature"),
    ([1, 2], _bad({"top_p": 1.5}), "top_p"),
    ([1, 2], _bad({"top_p": 0.0}), "top_p"),
    ([], None, "prompt is empty"),
    ([1] * 40, None, "max_model_len"),
    ([1, 500], None, "vocabulary"),
    ("a string", None, "tokenizer"),
    ([1, 2], "greedy", "sampling_params"),
])
def test_generate_rejects_a_bad_request_before_running_any(tiny, prompt, params, match):
    llm = LLM.from_model(tiny, max_num_seqs=2, max_model_len=32)
    good = me.SamplingParams(max_tokens=3)
    with pytest.raises(ValueError, match=rf"request 1: .*{match}"):
        llm.generate([[1, 2, 3], prompt, [4, 5]], [good, params, good], use_tqdm=False)
    assert not llm.engine.has_unfinished(), "nothing may be queued when one request of the call is bad"
    assert llm.generate([[1, 2, 3]], good, use_tqdm=False)[0].token_ids == me.generate_cached(tiny, [1, 2, 3], 3)


def test_sampling_params_list_must_match_prompts(tiny):
    with pytest.raises(ValueError, match="sampling_params has 1 entries for 2 prompts"):
        serve(tiny, [[1], [2]], [me.SamplingParams()])


def test_add_request_rejects_one_request_and_the_running_ones_finish(tiny, workload, reference, assert_greedy_match):
    prompts, lengths = workload
    engine = LLMEngine.from_model(tiny, max_num_seqs=3, max_model_len=64, chunked_prefill_tokens=8)
    ids = [engine.add_request(p, me.SamplingParams(max_tokens=n)) for p, n in zip(prompts[:4], lengths[:4])]
    outputs = {}
    for _ in range(3):
        outputs.update((o.request_id, o) for o in engine.step())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([1] * 64, me.SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request([1, 2], _bad({"top_p": -0.5}))
    while engine.has_unfinished():
        outputs.update((o.request_id, o) for o in engine.step())
    assert sorted(outputs) == ids
    for i, rid in enumerate(ids):
        assert_greedy_match(tiny, prompts[i], outputs[rid].token_ids, reference[i])


def test_requests_arriving_mid_run_join_the_batch(tiny, workload, reference, assert_greedy_match):
    prompts, lengths = workload
    engine = LLMEngine.from_model(tiny, max_num_seqs=4, chunked_prefill_tokens=10, record_trace=True)
    arrivals = {0: [0, 1], 2: [2, 3, 4], 5: [5], 9: [6, 7, 8, 9, 10, 11]}
    ids, outputs, step = {}, {}, 0
    while engine.has_unfinished() or step <= max(arrivals):
        for i in arrivals.get(step, []):
            ids[engine.add_request(prompts[i], me.SamplingParams(max_tokens=lengths[i]))] = i
        outputs.update((o.request_id, o) for o in engine.step())
        step += 1
    assert sorted(outputs) == sorted(ids)
    for rid, i in ids.items():
        assert_greedy_match(tiny, prompts[i], outputs[rid].token_ids, reference[i])
    arrived = {rid: step for step, batch in arrivals.items() for rid, i in ids.items() if i in batch}
    first_step = {}
    for record in engine.trace:
        for c in record.chunks:
            first_step.setdefault(c[0], record.step)
    assert all(first_step[rid] >= arrived[rid] for rid in ids), "a request ran before it arrived"


def test_static_admits_a_batch_only_when_the_last_one_is_done(tiny, workload):
    prompts, lengths = workload
    llm = LLM.from_model(tiny, max_num_seqs=4, scheduling="static", record_trace=True)
    llm.generate(prompts, [me.SamplingParams(max_tokens=n) for n in lengths], use_tqdm=False)
    batches = [set(), ]
    for record in llm.engine.trace:
        ids = {c[0] for c in record.chunks}
        if not ids & batches[-1]:
            batches.append(ids)
        batches[-1] |= ids
    assert [sorted(b) for b in batches[1:]] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_the_trace_names_each_chunks_slot_even_in_the_step_its_request_finishes(tiny, workload):
    """Chapter 04 draws the trace by slot: the step that finishes a request frees its slot, so the record is taken
    before the step's update (a None slot broke the drawing once)."""
    prompts, lengths = workload
    llm = LLM.from_model(tiny, max_num_seqs=4, kv_cache="contiguous", record_trace=True)
    llm.generate(prompts, [me.SamplingParams(max_tokens=n) for n in lengths], use_tqdm=False)
    slots = [slot for record in llm.engine.trace for _, slot, _, _ in record.chunks]
    assert slots and all(isinstance(s, int) and 0 <= s < 4 for s in slots)


def test_metrics_are_consistent(tiny, workload):
    prompts, lengths = workload
    outs = serve(tiny, prompts, [me.SamplingParams(max_tokens=n) for n in lengths])
    for out, n in zip(outs, lengths):
        m = out.metrics
        assert 0 <= m.queue_s <= m.ttft_s <= m.e2e_s
        assert m.num_output_tokens == n == len(m.token_times) and m.num_preemptions == 0
        assert list(m.token_times) == sorted(m.token_times)
        if n == 1:
            assert m.tpot_s != m.tpot_s, "one token: no time per output token (NaN)"
        else:
            assert m.tpot_s == pytest.approx((m.e2e_s - m.ttft_s) / (n - 1))


@pytest.mark.parametrize("kwargs,match", [
    ({"kv_cache": "pages"}, "kv_cache must be one of"),
    ({"block_size": 0}, "block_size must be an int >= 1"),
    ({"num_kv_blocks": 0}, "num_kv_blocks must be an int >= 1"),
    ({"kv_cache": "contiguous", "num_kv_blocks": 100}, "num_kv_blocks sizes the paged KV pool"),
    ({"kv_cache": "contiguous", "enable_prefix_caching": True}, "enable_prefix_caching=True shares blocks"),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching must be"),
    ({"speculative": {"method": "ngram", "k": 0}}, r"speculative\[.k.\] must be an int >= 1"),
    ({"scheduling": "fifo"}, "scheduling"),
    ({"attention_backend": "cuda"}, "attention_backend"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"chunked_prefill_tokens": 0}, "chunked_prefill_tokens"),
    ({"max_model_len": 1000}, "max_model_len 1000 exceeds the model's 256 positions"),
    ({"dtype": "bfloat16"}, "dtype"),
])
def test_bad_engine_arguments(tiny, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM.from_model(tiny, **kwargs)


def test_llm_constructor_checks_arguments_before_loading():
    with pytest.raises(ValueError, match="kv_cache"):
        LLM("no-such-model", kv_cache="pages")


def test_stress_hundreds_of_requests_through_few_slots(tiny):
    rng = random.Random(1)
    n = 300
    prompts = [[rng.randrange(128) for _ in range(rng.randint(1, 12))] for _ in range(n)]
    params = [me.SamplingParams(max_tokens=rng.randint(1, 8), temperature=rng.choice([0.0, 1.0]),
                                seed=rng.choice([None, i]), stop_token_ids=[rng.randrange(128)]) for i in range(n)]
    llm = LLM.from_model(tiny, max_num_seqs=3, max_model_len=24, chunked_prefill_tokens=7)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts and len({o.request_id for o in outs}) == n
    for o, p in zip(outs, params):
        assert 1 <= len(o.token_ids) <= p.max_tokens
        stopped = o.token_ids[-1] in p.stop_token_ids
        assert o.finish_reason == ("stop" if stopped else "length")
        assert not set(o.token_ids[:-1]) & set(p.stop_token_ids), "generation must end at the first stop token"
        if not stopped:
            assert len(o.token_ids) == p.max_tokens
    assert not llm.engine.has_unfinished() and len(llm.engine.scheduler.free_slots) == 3
    for i in range(0, n, 30):  # a sample of them, against the reference loop
        if params[i].greedy or params[i].seed is not None:
            assert outs[i].token_ids == me.generate_cached(tiny, prompts[i], params[i].max_tokens, params[i])


def test_real_model_answers_chat_prompts(real, chat_prompts, assert_greedy_match):
    model, tok = real
    llm = LLM.from_model(model, tok, max_num_seqs=4, max_model_len=128, chunked_prefill_tokens=16)
    question = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    outs = llm.generate([question] + chat_prompts[1:], me.SamplingParams(max_tokens=16), use_tqdm=False)
    assert "Paris" in outs[0].text
    assert outs[0].prompt_token_ids == chat_prompts[0]
    for prompt, out in zip(chat_prompts, outs):
        ref = me.generate_cached(model, prompt, 16, eos_token_id=tok.eos_token_id)
        assert_greedy_match(model, prompt, out.token_ids, ref)
        assert out.text == tok.decode(out.token_ids)
        assert out.finish_reason == ("stop" if out.token_ids[-1] == tok.eos_token_id else "length")
