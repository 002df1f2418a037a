"""LLM(compile=True): the engine's decode-only steps run through compiled graphs, one per batch-size bucket, and
give the eager engine's tokens on the real model, for both caches, while the batch grows and shrinks.

Compiling is the slow part (tens of seconds per graph on a 2-core CPU with a cold Inductor cache): each cache
gets one module-scoped engine with max_num_seqs=4, so three graphs (buckets 1, 2 and 4; three running requests
are padded to 4), shared by every test of that cache."""
import pytest
import torch

from mini_engine.compiled_decode import decode_buckets
from mini_engine.engine import LLM, EngineConfig
from mini_engine.sampling import SamplingParams

MAX_TOKENS = (6, 11, 3, 8)  # requests finish at different steps: the batch shrinks 4 -> 3 -> 2 -> 1
LATE_TOKENS = 5             # and one request arrives mid-run


@pytest.fixture(scope="module", params=["contiguous", "paged"])
def engines(request, real):
    model, tok = real
    kwargs = dict(kv_cache=request.param, max_num_seqs=4, max_model_len=128, block_size=16)
    compiled = LLM.from_model(model, tok, compile=True, **kwargs)
    assert compiled.warmup() > 0 and compiled.engine.runner.compiled.compiled_buckets == {1, 2, 4}
    return LLM.from_model(model, tok, **kwargs), compiled


def _graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _run(llm, prompts, params, late_prompt, late_params, late_step=4):
    """Every prompt queued at once, one more added after `late_step` steps; outputs by request, and the batch
    size of every step."""
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    outs, sizes, step = {}, [], 0
    while engine.has_unfinished():
        if step == late_step:
            ids.append(engine.add_request(late_prompt, late_params))
        before = len(engine.scheduler.running)
        for out in engine.step():
            outs[out.request_id] = out.token_ids
        sizes.append(before)
        step += 1
    return [outs[i] for i in ids], sizes


def _workload(chat_prompts, seed=None):
    prompts = chat_prompts + [chat_prompts[0][:7]]  # four prompts of different lengths
    temperature = 0.0 if seed is None else 0.8

    def params(n, i):
        return SamplingParams(temperature=temperature, top_p=0.95, max_tokens=n, ignore_eos=True,
                              seed=None if seed is None else seed + i)
    return (prompts, [params(n, i) for i, n in enumerate(MAX_TOKENS)], chat_prompts[1][:20],
            params(LATE_TOKENS, len(MAX_TOKENS)))


def test_compile_is_a_validated_config_field_shown_in_repr(real):
    with pytest.raises(ValueError, match="compile"):
        EngineConfig(compile="yes")
    llm = LLM.from_model(*real, kv_cache="contiguous", max_num_seqs=5, max_model_len=64, compile=True)
    assert "compiled decode steps (batch buckets 1, 2, 4, 5)" in repr(llm)
    assert llm.engine.compile_seconds == 0.0  # nothing compiled before the first decode step
    assert "compiled" not in repr(LLM.from_model(*real, kv_cache="contiguous", max_num_seqs=5, max_model_len=64))
    assert decode_buckets(1) == [1] and decode_buckets(16) == [1, 2, 4, 8, 16] and decode_buckets(6) == [1, 2, 4, 6]


def test_greedy_tokens_equal_the_eager_engine_across_bucket_changes(engines, chat_prompts, assert_greedy_match):
    eager, compiled = engines
    prompts, params, late, late_params = _workload(chat_prompts)
    want, want_sizes = _run(eager, prompts, params, late, late_params)
    graphs, seconds = _graphs_compiled(), compiled.engine.compile_seconds
    got, sizes = _run(compiled, prompts, params, late, late_params)
    assert _graphs_compiled() == graphs, "a graph was compiled after warm-up (a recompile: TORCH_LOGS=recompiles)"
    assert compiled.engine.compile_seconds == seconds > 0
    assert sizes == want_sizes
    assert {4, 3, 2, 1} <= set(sizes), f"the batch should pass through every bucket (and a padded 3): {sizes}"
    for prompt, ours, ref in zip(prompts + [late], got, want):
        assert len(ours) == len(ref)
        assert_greedy_match(compiled.engine.model, prompt, ours, ref)
    runner = compiled.engine.runner
    assert runner.compiled.num_steps > len(runner.compiled.buckets)  # steps ran through the graphs, not only warm-up
    if runner.blocks is not None:
        assert compiled.engine.num_free_blocks == compiled.engine.num_kv_blocks  # the scratch block is apart


def test_seeded_sampling_equals_the_eager_engine(engines, chat_prompts):
    eager, compiled = engines
    prompts, params, late, late_params = _workload(chat_prompts, seed=7)
    want, _ = _run(eager, prompts, params, late, late_params)
    graphs = _graphs_compiled()
    got, _ = _run(compiled, prompts, params, late, late_params)
    assert _graphs_compiled() == graphs
    assert got == want
