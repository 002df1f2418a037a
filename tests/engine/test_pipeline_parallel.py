"""Pipeline parallelism (mini_engine/parallel/pipeline.py, chapter 11): SmolLM2's 30 layers cut into three stages,
each a process of its own, serve what one process serves, with the step's sequences whole and in one or two
micro-batches; the logits come back in the step's row order; a size that does not fit is refused before any process
starts; a stage that dies, raises or stops answering is an error on stage 0 within the timeout with no stage left.

One three-stage engine serves the module (`pp`), beside a one-process reference on the same plain modules (`ref`);
its micro-batches are set per test (`PipelineModel.micro_batches` may change between steps). The fault test that
ends it comes last; the others start small random models of their own (their stages start in seconds).
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

import mini_engine as me
from mini_engine.attention import AttentionMetadata
from mini_engine.config import ModelConfig
from mini_engine.model import LlamaModel
from mini_engine.parallel.ranks import _send
from mini_engine.parallel.pipeline import (PipelineModel, bubble_of, format_bubbles, measure_bubble,
                                           split_sequences, stage_layers)

from tests.engine.rank_checks import KNOBS, PROMPTS, SYSTEM, alive

SIZE = 3


@pytest.fixture(scope="module")
def plain():
    """SmolLM2 in the core's plain modules (no CPU backend), and its tokenizer."""
    return me.load_model("smollm2-135m", cpu_backend=False)


@pytest.fixture(scope="module")
def pp(plain):
    """The module's one three-stage engine (a stage gives up after MINI_ENGINE_TP_TIMEOUT seconds, default 60)."""
    model, tok = plain
    llm = me.LLM.from_model(PipelineModel(model, SIZE, micro_batches=2), tok, **KNOBS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def ref(plain):
    model, tok = plain
    return me.LLM.from_model(model, tok, **KNOBS)


def tiny(num_layers: int = 3) -> LlamaModel:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=num_layers, num_heads=6,
                         num_kv_heads=3, head_dim=8, tie_word_embeddings=True)
    return LlamaModel(config).eval()


GREEDY = me.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def want(ref):
    """The one process's greedy tokens for PROMPTS."""
    return [o.token_ids for o in ref.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_three_stages_give_one_process_greedy_tokens(pp, want, micro_batches):
    """Prompts cut into chunks of 24 tokens and decodes mixed in the same steps, one micro-batch or two."""
    pp.engine.model.micro_batches = micro_batches
    assert [o.token_ids for o in pp.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
    assert pp.engine.num_free_blocks == pp.engine.num_kv_blocks


def test_each_stage_holds_its_layers_and_their_cache(pp):
    """Stage 0 holds layers 0-9 and the embedding; the engine's KV cache, sized from its config, has 10 layers."""
    model = pp.engine.model
    assert [(r.start, r.stop) for r in model.cuts] == [(0, 10), (10, 20), (20, 30)]
    assert stage_layers(30, 4, 1) == range(7, 15) and stage_layers(30, 4, 3) == range(22, 30)
    assert len(model.stage.layers) == 10 and pp.engine.runner.kv_cache.data.shape[0] == 10
    assert isinstance(model.stage.lm_head, torch.nn.Identity) and model.config.vocab_size == 49152
    with pytest.raises(ValueError, match="micro_batches"):
        model.micro_batches = 0


def test_prefix_cache_hits_and_prompt_logprobs_under_two_micro_batches(pp, ref):
    """A prompt whose system prompt the pool holds reads its blocks from every stage's share of the cache; beside it
    in the same steps, a prompt's scored rows (after the sampled rows in a step's logits) come back in their places."""
    pp.engine.model.micro_batches = 2
    plain, scored = me.SamplingParams(temperature=0.0, max_tokens=12), \
        me.SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=1)
    prompts = [SYSTEM + "Why is the sky blue?", SYSTEM + "What is rain?"]
    pp.generate(prompts[:1], plain, use_tqdm=False)
    got = pp.generate(prompts, [plain, scored], use_tqdm=False)
    want = ref.generate(prompts, [plain, scored], use_tqdm=False)
    assert got[0].num_cached_tokens > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert len(got[1].prompt_logprobs) == len(got[1].prompt_token_ids)
    for a, b in zip(got[1].prompt_logprobs[1:], want[1].prompt_logprobs[1:]):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-3 for t in a)


def test_logits_come_back_in_the_steps_row_order(pp, ref):
    """A packed step of three sequences in three micro-batches, its logits rows asked for out of order: each row is
    the one process's row (fp32; a micro-batch's products may add in another order: 1e-3 on logits about 20)."""
    model = pp.engine.model
    model.micro_batches = 3
    ids = torch.tensor(pp.engine.tokenizer.encode(SYSTEM + "What is a prime number? Two, three, five."))[:24]
    meta = AttentionMetadata.build([5, 12, 7])
    meta.logits_indices = torch.tensor([23, 4, 16, 0, 9, 17])
    got = model(ids, meta)
    want = ref.engine.model(ids, meta)
    assert got.shape == want.shape == (6, 49152)
    assert (got - want).abs().max().item() < 1e-3
    batched, one = model(ids[None, :], last_only=True), ref.engine.model(ids[None, :], last_only=True)
    assert batched.shape == one.shape == (1, 1, 49152) and (batched - one).abs().max().item() < 1e-3


def test_sequences_are_cut_whole_into_about_equal_micro_batches():
    assert split_sequences([1] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert split_sequences([1, 1, 1], 8) == [(0, 1), (1, 2), (2, 3)]  # never an empty micro-batch
    assert split_sequences([30, 2, 2, 2, 30], 2) == [(0, 3), (3, 5)]
    assert split_sequences([100, 1, 1, 1], 3) == [(0, 1), (1, 2), (2, 4)]


def test_the_bubble_is_measured_beside_the_formula(pp):
    """measure_bubble's numbers are consistent (never timed: the machine is shared): every stage busy within the
    step, the formula's (p-1)/(m+p-1), and the engine's cache left to the engine."""
    model = pp.engine.model
    before = model.micro_batches
    rows = [measure_bubble(model, m, batch=4, prompt_len=16, repeats=1) for m in (1, 2)]
    assert model.micro_batches == before and not model.timing
    for r, m in zip(rows, (1, 2)):
        assert r.stages == SIZE and r.micro_batches == m and r.formula == pytest.approx(2 / (m + 2))
        assert len(r.busy_s) == SIZE and all(0 < b <= r.step_s for b in r.busy_s)
        assert 0 <= r.measured < 1 and 0 <= r.replayed < 1 and r.from_cpu < 1
    assert "(p-1)/(m+p-1)" in format_bubbles(rows)
    decode = measure_bubble(model, 2, batch=4, prompt_len=16, repeats=1, kind="decode")
    assert decode.micro_batches == 2
    # A replayed schedule of equal stage times gives the formula exactly.
    times = [[(k, 0.0, 1.0, 1.0) for k in range(4)] for _ in range(3)]
    assert bubble_of(times, (0.0, 6.0)).replayed == pytest.approx(2 / 6)


@pytest.mark.parametrize("kwargs, name", [(dict(size=0), "pipeline_parallel_size"),
                                          (dict(size=4), "pipeline_parallel_size"),
                                          (dict(size=True), "pipeline_parallel_size"),
                                          (dict(size=2, micro_batches=0), "micro_batches")])
def test_bad_sizes_are_refused_before_any_process_starts(kwargs, name):
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=name):
        PipelineModel(tiny(3), **kwargs)
    assert set(multiprocessing.active_children()) == before


def test_a_stage_that_raises_is_quoted_and_one_that_stops_answering_times_out():
    """Two small engines. In the first, stage 2 is asked to copy blocks of a cache it was never given: it sends its
    error and exits, and stage 0's next step quotes it. In the second, stage 1 is stopped (SIGSTOP): the next step is
    an error within the timeout, and every stage ends, the stopped one too."""
    model = PipelineModel(tiny(3), SIZE, micro_batches=2, timeout=5)
    pids = model.pids
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 96)
    _send(model._ranks[1][1], ("copy", 7, [(0, 1)]))  # to stage 2 alone
    time.sleep(0.5)
    with pytest.raises(RuntimeError, match=r"(?s)stage 2 \(pid \d+\) raised KeyError: 7.*stage 2's traceback"):
        model(torch.tensor([[1, 2, 3]]))
    assert model.closed and not any(alive(p) for p in pids)

    model = PipelineModel(tiny(3), SIZE, micro_batches=2, timeout=5)
    pids, folder = model.pids, model.folder
    os.kill(pids[0], signal.SIGSTOP)
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="did not answer within 5 s"):
        model(torch.tensor([[1, 2, 3]]))
    assert time.perf_counter() - start < 5 + 10
    assert not any(alive(p) for p in pids) and not Path(folder).exists()
    with pytest.raises(RuntimeError, match="shut down"):
        model(torch.tensor([[1, 2, 3]]))


def test_a_stage_killed_mid_step_is_an_error_and_shutdown_leaves_nothing(pp):
    """Last: it ends the module's engine. Mid-generation, the last stage is stopped, a step starts (stage 0 then
    waits for its logits) and the stage is killed: the step fails naming the stage, and every stage has ended."""
    model = pp.engine.model
    pids, folder = model.pids, model.folder
    params = me.SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for prompt in PROMPTS:
        pp.engine.add_request(prompt, params)
    for _ in range(3):
        pp.engine.step()
    os.kill(pids[-1], signal.SIGSTOP)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        step = pool.submit(pp.engine.step)
        time.sleep(1.0)
        assert not step.done()  # stage 0 is waiting on the stopped stage
        os.kill(pids[-1], signal.SIGKILL)
        with pytest.raises(RuntimeError, match=rf"stage 2 \(pid {pids[-1]}\) exited with code -9"):
            step.result(timeout=30)
    assert not any(alive(p) for p in pids)
    assert not Path(folder).exists()
    pp.shutdown()  # a second shutdown does nothing


def test_interpreter_exit_ends_every_stage(tmp_path):
    """A script (no `if __name__ == "__main__":` guard) that starts stages and exits without shutdown."""
    script = tmp_path / "stages_and_exit.py"
    script.write_text(textwrap.dedent("""
        import torch
        from mini_engine.config import ModelConfig
        from mini_engine.model import LlamaModel
        from mini_engine.parallel.pipeline import PipelineModel
        config = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=6,
                             num_kv_heads=3, head_dim=8)
        model = PipelineModel(LlamaModel(config).eval(), 3, micro_batches=2)
        print(*model.pids, flush=True)
        print(tuple(model(torch.tensor([[1, 2, 3]])).shape), flush=True)
    """))
    before = set(Path(tempfile.gettempdir()).glob("mini_engine_pp_*"))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    pids = [int(p) for p in run.stdout.splitlines()[0].split()]
    assert run.stdout.splitlines()[1] == "(1, 3, 96)"
    deadline = time.time() + 10
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids)
    assert set(Path(tempfile.gettempdir()).glob("mini_engine_pp_*")) <= before
