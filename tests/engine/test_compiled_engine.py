"""LLM(compile=True): the engine's decode-only steps run through compiled graphs, one per batch-size bucket, and
give the eager engine's tokens while requests arrive and finish, so that the step's bucket changes.

Compiling is the slow part: a graph of the real model (30 layers) takes about a minute on a 2-core CPU with a
cold Inductor cache, one of the 2-layer tiny model a few seconds. So the paged cache's bucket logic (padded rows
on a scratch block, rows sorted by length and logits put back in order) is exercised on the tiny model, and the
real model gets one module-scoped engine on the contiguous cache (chapter 04's) with two buckets, 1 and 2, shared
by its tests: two graphs, compiled once. compile="max-autotune" (Inductor's own weight products, about twice as
long to compile) gets one bucket of the real model: the bucket logic is the same code. (The ladder's smoke test,
tests/test_bench_ladder.py, runs the real model on the paged cache with compile=True, one bucket, against the
other rungs.) On a GPU, the tiny model also runs on the paged cache with the Triton backend, its graphs replayed
as CUDA graphs: none of them may be skipped."""
import copy

import pytest
import torch

import mini_engine as me
from mini_engine.compiled_decode import decode_buckets
from mini_engine.engine import LLM, EngineConfig
from mini_engine.sampling import SamplingParams

pytestmark = pytest.mark.slow  # minutes of compiling with a cold Inductor cache: started first (tests/conftest.py)


def _graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _run(llm, prompts, params, late_prompt, late_params, late_step):
    """Every prompt queued at once, one more added after `late_step` steps; outputs by request, and the number
    of running requests at every step."""
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    outs, sizes, step = {}, [], 0
    while engine.has_unfinished():
        if step == late_step:
            ids.append(engine.add_request(late_prompt, late_params))
        sizes.append(len(engine.scheduler.running))
        for out in engine.step():
            outs[out.request_id] = out.token_ids
        step += 1
    return [outs[i] for i in ids], sizes


def _bucket_changes(sizes):
    """The batch sizes the decode steps passed through, repeats and idle steps left out: [2, 1, 2, 1], ..."""
    return [n for i, n in enumerate(sizes) if n and (i == 0 or sizes[i - 1] != n)]


def _params(max_tokens, seed=None):
    """Greedy, or seeded sampling (one seed per request)."""
    return [SamplingParams(temperature=0.0 if seed is None else 0.8, top_p=0.95, max_tokens=n, ignore_eos=True,
                           seed=None if seed is None else seed + i) for i, n in enumerate(max_tokens)]


def _compare(eager, compiled, prompts, params, late_step):
    """Run the workload (its last prompt and params arrive late) on both engines: the compiled one's tokens and
    step sizes, the eager one's, and no graph compiled after warm-up."""
    want, want_sizes = _run(eager, prompts[:-1], params[:-1], prompts[-1], params[-1], late_step)
    graphs, seconds = _graphs_compiled(), compiled.engine.compile_seconds
    got, sizes = _run(compiled, prompts[:-1], params[:-1], prompts[-1], params[-1], late_step)
    assert _graphs_compiled() == graphs, "a graph was compiled after warm-up (a recompile: TORCH_LOGS=recompiles)"
    assert compiled.engine.compile_seconds == seconds > 0
    assert sizes == want_sizes
    return got, want, sizes


def test_compile_is_a_validated_config_field_shown_in_repr(tiny_model):
    for bad in ("yes", "cpp", 1):
        with pytest.raises(ValueError, match="compile"):
            EngineConfig(compile=bad)
    llm = LLM.from_model(tiny_model(1), kv_cache="contiguous", max_num_seqs=5, max_model_len=64, compile=True)
    assert "compiled decode steps (batch buckets 1, 2, 4, 5)" in repr(llm)
    llm = LLM.from_model(tiny_model(1), kv_cache="contiguous", max_num_seqs=2, max_model_len=64,
                         compile="max-autotune")
    assert "compiled decode steps (max-autotune) (batch buckets 1, 2)" in repr(llm)
    assert llm.engine.compile_seconds == 0.0  # nothing compiled before the first decode step
    assert "compiled" not in repr(LLM.from_model(tiny_model(1), kv_cache="contiguous", max_num_seqs=5,
                                                 max_model_len=64))
    assert decode_buckets(1) == [1] and decode_buckets(16) == [1, 2, 4, 8, 16] and decode_buckets(6) == [1, 2, 4, 6]


# ---------------------------------------------------------------- the tiny model, paged: padding and sorting

TINY_TOKENS = (6, 11, 3, 8, 5)  # finishing at different steps: 4 -> 3 (padded to 4) -> 2 -> 1; the fifth arrives late


@pytest.fixture(scope="module")
def tiny_engines(tiny_model):
    kwargs = dict(kv_cache="paged", max_num_seqs=4, max_model_len=64, block_size=4)
    compiled = LLM.from_model(tiny_model(2), compile=True, **kwargs)
    assert compiled.warmup() > 0 and compiled.engine.runner.compiled.compiled_buckets == {1, 2, 4}
    return LLM.from_model(tiny_model(2), **kwargs), compiled


@pytest.mark.usefixtures("one_thread")  # the tiny model's ops are too small to split between threads
@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])
def test_tiny_model_tokens_equal_the_eager_engine_through_every_bucket(tiny_engines, seed):
    eager, compiled = tiny_engines
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [23, 24, 25], [1, 2]]
    got, want, sizes = _compare(eager, compiled, prompts, _params(TINY_TOKENS, seed), late_step=5)
    assert {4, 3, 2, 1} <= set(sizes), f"the batch should pass through every bucket (and a padded 3): {sizes}"
    assert got == want  # the tiny model's sharp logits leave no near-ties
    runner = compiled.engine.runner
    assert runner.compiled.num_steps > len(runner.compiled.buckets)  # steps ran through the graphs, not only warm-up
    assert compiled.engine.num_free_blocks == compiled.engine.num_kv_blocks  # the scratch block is apart


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="CUDA graphs: reduce-overhead mode replays the compiled steps as CUDA graphs only on a GPU")
@pytest.mark.parametrize("dtype", ["float32", "course"], ids=["float32", "course-dtype"])
def test_on_a_gpu_the_paged_triton_engine_replays_cuda_graphs(tiny_model, dtype):
    """LLM(compile=True) on CUDA, paged cache, Triton kernels: every bucket's graph is a CUDA graph (Inductor
    counts each graph it declines to capture, with the reason in its log: "skipping cudagraphs due to ..."),
    and the tokens are the eager engine's."""
    dtype = me.default_dtype("cuda") if dtype == "course" else dtype
    model = copy.deepcopy(tiny_model(2)).to("cuda", getattr(torch, dtype))
    kwargs = dict(kv_cache="paged", attention_backend="triton", max_num_seqs=4, max_model_len=64, block_size=16)
    eager = LLM.from_model(model, **kwargs)
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    compiled = LLM.from_model(model, compile=True, **kwargs)
    assert compiled.warmup() > 0 and compiled.engine.runner.compiled.compiled_buckets == {1, 2, 4}
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [23, 24, 25], [1, 2]]
    got, want, sizes = _compare(eager, compiled, prompts, _params(TINY_TOKENS), late_step=5)
    skipped = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] - skips
    assert skipped == 0, f"{skipped} graph(s) ran without CUDA graphs (the reasons: TORCH_LOGS=cudagraphs)"
    assert {4, 3, 2, 1} <= set(sizes), f"the batch should pass through every bucket (and a padded 3): {sizes}"
    assert got == want  # the tiny model's sharp logits leave no near-ties, in bf16 and fp16 too
    assert compiled.engine.runner.compiled.num_steps > len(compiled.engine.runner.compiled.buckets)


# ---------------------------------------------------------------- the real model, contiguous: two buckets

REAL_TOKENS = (8, 4, 6)  # two requests at once: 2 -> 1 when the second finishes, 1 -> 2 when the third arrives


@pytest.fixture(scope="module")
def real_engines(real):
    model, tok = real
    kwargs = dict(kv_cache="contiguous", max_num_seqs=2, max_model_len=96)
    compiled = LLM.from_model(model, tok, compile=True, **kwargs)
    assert compiled.warmup() > 0 and compiled.engine.runner.compiled.compiled_buckets == {1, 2}
    return LLM.from_model(model, tok, **kwargs), compiled


@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])
def test_real_model_tokens_equal_the_eager_engine_across_bucket_changes(real_engines, chat_prompts, seed,
                                                                       assert_greedy_match):
    eager, compiled = real_engines
    prompts = [chat_prompts[0], chat_prompts[1][:9], chat_prompts[2][:14]]  # contexts of different lengths
    got, want, sizes = _compare(eager, compiled, prompts, _params(REAL_TOKENS, seed), late_step=6)
    assert _bucket_changes(sizes) == [2, 1, 2, 1], f"the batch should go 2 -> 1 -> 2 -> 1: {sizes}"
    if seed is not None:
        assert got == want
    for prompt, ours, ref in zip(prompts, got, want):  # greedy: equal, or parted only at a near-tie
        assert len(ours) == len(ref)
        assert_greedy_match(compiled.engine.model, prompt, ours, ref)


def test_real_model_max_autotune_tokens_equal_the_eager_engine(real, chat_prompts, assert_greedy_match):
    """compile="max-autotune": the weights frozen into the graph and multiplied by the GEMMs Inductor timed
    fastest (on a CPU, its generated C++ GEMM where that wins) give the eager engine's greedy tokens."""
    model, tok = real
    kwargs = dict(kv_cache="contiguous", max_num_seqs=1, max_model_len=96)
    compiled = LLM.from_model(model, tok, compile="max-autotune", **kwargs)
    assert compiled.warmup() > 0 and compiled.engine.runner.compiled.compiled_buckets == {1}
    prompts = [chat_prompts[0], chat_prompts[2][:14]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in LLM.from_model(model, tok, **kwargs).generate(prompts, params, use_tqdm=False)]
    graphs = _graphs_compiled()
    got = [o.token_ids for o in compiled.generate(prompts, params, use_tqdm=False)]
    assert _graphs_compiled() == graphs, "a graph was compiled after warm-up (a recompile: TORCH_LOGS=recompiles)"
    assert compiled.engine.runner.compiled.num_steps > 1  # the decode steps ran through the graph
    for prompt, ours, ref in zip(prompts, got, want):
        assert len(ours) == len(ref) == 12
        assert_greedy_match(model, prompt, ours, ref)
