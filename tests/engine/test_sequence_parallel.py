"""Sequence parallelism (mini_engine/parallel/sequence.py, chapter 11): three tensor-parallel ranks whose residual
stream and norms are split over the step's tokens serve what one process serves, with the paged cache, prefix
caching off and on, token counts that do not divide by three (padded, the padding dropped); every collective is
the reduce-scatter or all-gather that replaced an all-reduce; and a rank holds a third of the residual stream that
plain tensor parallelism holds whole.

The sequence-parallel engine is a module fixture, parametrised over prefix caching (one engine at a time); the plain
tensor-parallel engine, for the activation bytes, is started once, by the last test.
"""
from __future__ import annotations

import os

import pytest
import torch

import mini_engine as me
from mini_engine.parallel.sequence import TokenSplit, apply_sequence_parallel, residual_bytes

SIZE = 3
KNOBS = dict(max_num_seqs=8, num_kv_blocks=96, block_size=8, chunked_prefill_tokens=24)
SYSTEM = ("You are a careful assistant who answers in short, plain sentences and names the units of every "
          "number you give. ")
# 1, 5, 6 and 31 tokens: one alone is padded to three, 31 is cut by the 24-token chunks into 24 + 7.
PROMPTS = ["Hi", "The capital of France is", "def fibonacci(n):", SYSTEM + "How far is the Moon?"]


def start(**knobs) -> me.LLM:
    os.environ["MINI_ENGINE_TP_TIMEOUT"] = "300"  # a busy machine starts ranks slowly; not a test of the timeout
    try:
        return me.LLM("smollm2-135m", tensor_parallel_size=SIZE, **KNOBS, **knobs)
    finally:
        del os.environ["MINI_ENGINE_TP_TIMEOUT"]


@pytest.fixture(scope="module", params=[False, True], ids=["prefix-caching-off", "prefix-caching-on"])
def sp(request):
    llm = start(sequence_parallel=True, enable_prefix_caching=request.param)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def ref():
    """One process on the same plain modules (no CPU backend): the reference, without prefix caching (its steps
    prefill every prompt token, every time)."""
    model, tok = me.load_model("smollm2-135m", cpu_backend=False)
    return me.LLM.from_model(model, tok, **KNOBS, enable_prefix_caching=False)


def test_prompts_leave_token_counts_that_do_not_divide(ref):
    lengths = [len(ref.engine.tokenizer.encode(p)) for p in PROMPTS]
    assert any(n % SIZE for n in lengths) and min(lengths) < SIZE, lengths


def test_sequence_parallel_ranks_give_one_process_greedy_tokens(sp, ref):
    params = me.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got, want = sp.generate(PROMPTS, params, use_tqdm=False), ref.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # One request alone: every decode step is one token, which ranks 1 and 2 hold only as padding.
    alone = sp.generate(PROMPTS[1:2], params, use_tqdm=False)[0]
    assert alone.token_ids == want[1].token_ids
    assert sp.engine.num_free_blocks == sp.engine.num_kv_blocks


def test_prefix_cache_hits_under_sequence_parallelism(sp, ref):
    if not sp.engine.config.enable_prefix_caching:
        pytest.skip("prefix caching is off in this engine")
    params = me.SamplingParams(temperature=0.0, max_tokens=12)
    prompt = SYSTEM + "Why is the sky blue?"
    sp.generate([prompt], params, use_tqdm=False)
    got = sp.generate([prompt], params, use_tqdm=False)[0]
    assert got.num_cached_tokens > 0
    assert got.token_ids == ref.generate([prompt], params, use_tqdm=False)[0].token_ids


def test_logits_match_within_tolerance(sp, ref):
    """fp32: the reduce-scatters add the ranks' partial sums in another order than one product does; the logits
    (magnitude about 20) agree to 1e-3. 31 tokens: the last rank's slice holds 10 and one padding row."""
    ids = torch.tensor([sp.engine.tokenizer.encode(PROMPTS[3])])
    got, want = sp.engine.model(ids), ref.engine.model(ids)
    assert got.shape == want.shape == (1, ids.shape[1], 49152)
    assert (got - want).abs().max().item() < 1e-3


def test_every_all_reduce_became_a_reduce_scatter_and_an_all_gather(sp):
    """A decode step: the embedding's reduce-scatter, per layer two (all-gather, reduce-scatter) pairs, the final
    norm's all-gather and the logits' gather: 4L + 3 collectives where plain tensor parallelism has 2L + 2."""
    from mini_engine.parallel.measure import decode_step_times
    steps = decode_step_times(sp, batch=2, tokens=3)
    assert steps.collectives == 4 * sp.engine.model.config.num_layers + 3
    assert sp.engine.num_free_blocks == sp.engine.num_kv_blocks


def test_bad_arguments_are_refused_by_name():
    from mini_engine.config import ModelConfig
    from mini_engine.model import LlamaModel
    model = LlamaModel(ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=6,
                                   num_kv_heads=3, head_dim=8))
    with pytest.raises(ValueError, match="needs the rank's Communicator"):
        apply_sequence_parallel(model, 0, SIZE, None)
    with pytest.raises(ValueError, match="sequence_parallel=True .* needs tensor_parallel_size > 1"):
        me.LLM("smollm2-135m", sequence_parallel=True)
    split = TokenSplit(SIZE, tokens=7)
    assert split.padded == 9 and split.pad(torch.ones(7, 2)).shape == (9, 2)


def test_a_rank_holds_a_third_of_the_residual_stream(sp, ref):
    """The largest residual-stream activation of a step, measured on rank 0: whole tokens under plain tensor
    parallelism (as in one process), ceil(T / 3) of them under sequence parallelism."""
    if sp.engine.config.enable_prefix_caching:
        pytest.skip("measured once, on the engine without prefix caching (the same schedule as the plain one)")
    tp = start(enable_prefix_caching=False)
    try:
        plain, sequence = residual_bytes(tp, PROMPTS), residual_bytes(sp, PROMPTS)
    finally:
        tp.shutdown()
    row = ref.engine.model.config.hidden_size * 4  # fp32
    tokens = plain // row
    assert plain == residual_bytes(ref, PROMPTS)
    assert sequence == -(-tokens // SIZE) * row < plain, (plain, sequence)
