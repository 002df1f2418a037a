"""Tensor parallelism (mini_engine/parallel, chapter 11): three ranks serve what one process serves, each parallel
layer's shards add or join up to the full layer, a size that does not divide the model is refused before any
process starts, and a rank that dies or stops answering is an error within the timeout with no rank left behind.

One three-rank engine serves the module (`tp`), beside a one-process reference on the same plain modules (`ref`);
the fault tests that end an engine come last. Peak memory of this module on a 2-core CPU: see benchmarks/RESULTS.md.
"""
from __future__ import annotations

import copy
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import mini_engine as me
from mini_engine.config import ModelConfig
from mini_engine.model import LlamaModel
from mini_engine.parallel import (ColumnParallelLinear, ParallelLMHead, ParallelModel, RowParallelLinear,
                                  VocabParallelEmbedding, check_tensor_parallel_size, shard_model)
from mini_engine.parallel.layers import split_columns, split_gate_up, split_qkv, split_rows

from tests.engine.rank_checks import KNOBS, PROMPTS, SYSTEM, alive

SIZE = 3


@pytest.fixture(scope="module")
def tp():
    """The module's one three-rank engine (collectives give up after 30 s)."""
    os.environ["MINI_ENGINE_TP_TIMEOUT"] = "30"
    try:
        llm = me.LLM("smollm2-135m", tensor_parallel_size=SIZE, **KNOBS)
    finally:
        del os.environ["MINI_ENGINE_TP_TIMEOUT"]
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def ref():
    """One process on the same plain modules (no CPU backend): the reference."""
    model, tok = me.load_model("smollm2-135m", cpu_backend=False)
    return me.LLM.from_model(model, tok, **KNOBS)


def test_three_ranks_give_one_process_greedy_tokens(tp, ref):
    params = me.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got, want = tp.generate(PROMPTS, params, use_tqdm=False), ref.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert tp.engine.num_free_blocks == tp.engine.num_kv_blocks


def test_logits_match_within_tolerance(tp, ref):
    """fp32: the all-reduces add the ranks' partial sums in another order than one product does; the logits
    (magnitude about 20) agree to 1e-3."""
    ids = torch.tensor([tp.engine.tokenizer.encode(SYSTEM + "What is a prime number?")])
    got, want = tp.engine.model(ids), ref.engine.model(ids)
    assert got.shape == want.shape == (1, ids.shape[1], 49152)
    assert (got - want).abs().max().item() < 1e-3


def test_seeded_samples_logprobs_and_n_equal_one_process(tp, ref):
    params = me.SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, seed=11, n=3, logprobs=2, ignore_eos=True)
    got, want = tp.generate(PROMPTS[1:3], params, use_tqdm=False), ref.generate(PROMPTS[1:3], params, use_tqdm=False)
    for g, w in zip(got, want):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        assert len({tuple(c.token_ids) for c in g.outputs}) > 1  # the n samples differ, reproducibly
        for cg, cw in zip(g.outputs, w.outputs):
            for a, b in zip(cg.logprobs, cw.logprobs):
                assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-3 for t in a)
    assert tp.engine.num_free_blocks == tp.engine.num_kv_blocks


def test_prefix_cache_hits_under_three_ranks(tp, ref):
    """A prompt whose system prompt the pool holds reads its blocks from every rank's share of the cache."""
    params = me.SamplingParams(temperature=0.0, max_tokens=12)
    prompt = SYSTEM + "Why is the sky blue?"
    tp.generate([prompt], params, use_tqdm=False)
    got = tp.generate([prompt], params, use_tqdm=False)[0]
    want = ref.generate([prompt], params, use_tqdm=False)[0]
    assert got.num_cached_tokens > 0
    assert got.token_ids == want.token_ids


def test_two_engines_on_one_set_of_ranks_keep_their_own_caches(tp, ref):
    """A second engine served by the module's ranks (chapter 11 does this to measure a smaller pool): each engine's
    KV cache has its own share on every rank, so after the second has run, the first's cached prefix still holds
    the right keys and values."""
    params = me.SamplingParams(temperature=0.0, max_tokens=12)
    prompt = SYSTEM + "What is a light-year?"
    tp.generate([prompt], params, use_tqdm=False)
    other = me.LLM.from_model(tp.engine.model, tp.engine.tokenizer, **{**KNOBS, "num_kv_blocks": 48})
    want = ref.generate([PROMPTS[3], prompt], params, use_tqdm=False)
    assert [o.token_ids for o in other.generate([PROMPTS[3]], params, use_tqdm=False)] == [want[0].token_ids]
    again = tp.generate([prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == want[1].token_ids


def test_each_layers_shards_add_or_join_to_the_full_layer():
    """Every rank's shard run in one process (comm=None: no exchange): column-parallel outputs join, row-parallel
    and vocabulary-parallel partials add, LM-head ranges join."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=6,
                         num_kv_heads=3, head_dim=8, tie_word_embeddings=True)
    model = LlamaModel(config).eval()
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    x, ids = torch.randn(5, 32), torch.tensor([0, 31, 32, 64, 95])
    with torch.no_grad():
        q, k, v = attn.qkv_proj(x).split([48, 24, 24], dim=-1)
        parts = [ColumnParallelLinear(split_qkv(attn.qkv_proj.weight, config, r, SIZE))(x) for r in range(SIZE)]
        assert torch.allclose(torch.cat([p[:, :16] for p in parts], -1), q, atol=1e-6)
        assert torch.allclose(torch.cat([p[:, 16:24] for p in parts], -1), k, atol=1e-6)
        assert torch.allclose(torch.cat([p[:, 24:] for p in parts], -1), v, atol=1e-6)
        gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
        parts = [ColumnParallelLinear(split_gate_up(mlp.gate_up_proj.weight, r, SIZE))(x) for r in range(SIZE)]
        assert torch.allclose(torch.cat([p.chunk(2, -1)[0] for p in parts], -1), gate, atol=1e-6)
        assert torch.allclose(torch.cat([p.chunk(2, -1)[1] for p in parts], -1), up, atol=1e-6)
        h = torch.randn(5, 48)
        partial = [RowParallelLinear(split_columns(mlp.down_proj.weight, r, SIZE))(h.chunk(SIZE, -1)[r])
                   for r in range(SIZE)]
        assert torch.allclose(sum(partial), mlp.down_proj(h), atol=1e-5)
        rows = [VocabParallelEmbedding(split_rows(model.embed_tokens.weight, r, SIZE), 32 * r)(ids)
                for r in range(SIZE)]
        assert torch.allclose(sum(rows), model.embed_tokens(ids))
        assert all((r == 0).all(dim=-1).sum() == 5 - (ids // 32 == i).sum() for i, r in enumerate(rows))
        heads = [ParallelLMHead(split_rows(model.embed_tokens.weight, r, SIZE))(x) for r in range(SIZE)]
        assert torch.allclose(torch.cat(heads, -1), model.lm_head(x), atol=1e-5)
        # The whole model cut in place: each attention told its share of the heads, every weight a third.
        shard = shard_model(copy.deepcopy(model), 1, SIZE)
        assert (shard.layers[0].self_attn.num_heads, shard.layers[0].self_attn.num_kv_heads) == (2, 1)
        assert shard.config.intermediate_size == 16 and shard.config.vocab_size == 96
        assert sum(p.numel() for p in shard.parameters()) < sum(p.numel() for p in model.parameters()) / 2.5


def test_the_communication_formula():
    """A ring all-reduce: 2(p - 1) hops of latency, each rank moving 2(p - 1)/p of the payload; none for one rank."""
    from mini_engine.course import formulas
    assert formulas.all_reduce_seconds(3000, 1, 1e-5, 1e9) == 0
    assert formulas.all_reduce_seconds(3000, 3, 1e-5, 1e9) == pytest.approx(4e-5 + 4 / 3 * 3e-6)
    compute, comm = formulas.tensor_parallel_step(30, 576, 1, 3, 0.03, 1e-5, 1e9)
    assert compute == pytest.approx(0.01) and comm == pytest.approx(60 * (4e-5 + 4 / 3 * 1152 / 1e9))


def test_a_decode_step_splits_into_computing_communicating_and_waiting(tp, ref):
    """Chapter 11's measurement: every rank logs each collective's seconds; a decode step holds the embedding's
    all-reduce, two a layer and the logits' gather, on every rank alike; the three parts add up to the step, and
    the communication (the least over the ranks, collective by collective) is no more than rank 0's time in them."""
    from mini_engine.parallel.measure import decode_step_times
    steps = decode_step_times(tp, batch=2, tokens=4)
    assert steps.collectives == 2 * tp.engine.model.config.num_layers + 2
    assert steps.compute_s > 0 and steps.communication_s > 0 and steps.waiting_s >= 0
    assert steps.compute_s + steps.communication_s + steps.waiting_s == pytest.approx(steps.mean_s)
    assert 0 < steps.communication_share < 1
    assert tp.engine.model.comm.log is None  # logging is off again, on rank 0 and (they answered) on the others
    one = decode_step_times(ref, batch=2, tokens=4)
    assert one.collectives == 0 and one.compute_s == one.mean_s and one.communication_s == 0
    assert tp.engine.num_free_blocks == tp.engine.num_kv_blocks


def test_the_memory_win_a_rank_holds_a_share_of_the_kv_heads(ref):
    """At one budget of bytes a rank, three ranks hold three times the blocks (a KV head each, not three); and the
    largest batch an engine runs is capped by its pool: 12 blocks of 8 hold at most 4 requests of 20 + 4 tokens (3
    blocks each; the scheduler may keep room for growth), 36 hold all 8."""
    from mini_engine.parallel import rank_config
    from mini_engine.parallel.measure import kv_blocks_within, largest_batch
    config = ref.engine.model.config
    per_block = 2 * 30 * 3 * 64 * 16 * 4
    assert kv_blocks_within(100 * per_block, config, 16) == 100
    assert kv_blocks_within(100 * per_block, rank_config(config, SIZE), 16) == 300
    model, tok = ref.engine.model, ref.engine.tokenizer
    small, large = (me.LLM.from_model(model, tok, num_kv_blocks=n, block_size=8, max_num_seqs=16,
                                      enable_prefix_caching=False) for n in (12, 36))
    assert 2 <= largest_batch(small, requests=8, prompt_tokens=20, new_tokens=4) <= 4
    assert largest_batch(large, requests=8, prompt_tokens=20, new_tokens=4) == 8


@pytest.mark.parametrize("size, number", [(2, "num_heads (9)"), (4, "num_heads (9)"), (9, "num_kv_heads (3)")])
def test_a_size_that_does_not_divide_the_model_is_refused(size, number):
    smollm = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64)
    with pytest.raises(ValueError, match=re.escape(f"tensor_parallel_size={size} does not divide the model's {number}")):
        check_tensor_parallel_size(smollm, size)


def test_llm_refuses_before_any_process_starts():
    import multiprocessing
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=r"does not divide the model's num_heads \(9\).*\[1, 3\]"):
        me.LLM("smollm2-135m", tensor_parallel_size=2)
    assert set(multiprocessing.active_children()) == before
    with pytest.raises(ValueError, match="compile"):
        me.LLM("smollm2-135m", tensor_parallel_size=3, compile=True)


def test_two_engines_at_once_then_a_rank_that_stops_answering(tp, ref):
    """A second three-rank engine beside the module's: both serve at once, from two threads, with rendezvous
    folders of their own. Then one of its ranks is stopped (SIGSTOP): the next step is an error within the timeout,
    and every rank of that engine ends, the stopped one too."""
    os.environ["MINI_ENGINE_TP_TIMEOUT"] = "8"
    try:
        other = me.LLM("smollm2-135m", tensor_parallel_size=SIZE, **KNOBS)
    finally:
        del os.environ["MINI_ENGINE_TP_TIMEOUT"]
    params = me.SamplingParams(temperature=0.0, max_tokens=12)
    results = {}
    threads = [threading.Thread(target=lambda name, llm: results.__setitem__(name, llm.generate(
        PROMPTS, params, use_tqdm=False)), args=(name, llm)) for name, llm in (("tp", tp), ("other", other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = [o.token_ids for o in ref.generate(PROMPTS, params, use_tqdm=False)]
    assert [o.token_ids for o in results["tp"]] == [o.token_ids for o in results["other"]] == want
    pids = other.engine.model.pids
    os.kill(pids[1], signal.SIGSTOP)
    start = time.perf_counter()
    # Rank 0's own collective may time out first, or the rank still running may time out first and exit, which
    # rank 0 then sees: on a busy machine either comes first, and both are a clear error within the timeout.
    with pytest.raises(RuntimeError, match="did not answer within 8 s|exited with code"):
        other.generate(PROMPTS[:1], params, use_tqdm=False)
    assert time.perf_counter() - start < 8 + 10
    assert not any(alive(p) for p in pids)
    with pytest.raises(RuntimeError, match="shut down"):
        other.generate(PROMPTS[:1], params, use_tqdm=False)


def test_an_interrupted_step_ends_every_rank():
    """KeyboardInterrupt in the middle of a step (a notebook's interrupted cell) reaches the caller, and the ranks,
    which can no longer agree on the cache, end. A tiny model: the ranks start in seconds."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=6,
                         num_kv_heads=3, head_dim=8, tie_word_embeddings=True)
    model = ParallelModel(LlamaModel(config).eval(), SIZE, timeout=10)
    pids = model.pids
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 96)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    model.shard = interrupted
    with pytest.raises(KeyboardInterrupt):
        model(torch.tensor([[1, 2, 3]]))
    assert model.closed and not any(alive(p) for p in pids)


def test_the_step_message_is_compact():
    """What rank 0 sends the other ranks each step: the token ids and the lists the metadata is built from, pickled
    once. A batch of 16 decoding at 1,000 positions (16-token blocks): a few kilobytes, where the metadata's own
    tensors (the decode mask alone is batch x longest context) pickle to far more; each rank rebuilds the same
    metadata from it."""
    import pickle

    from mini_engine.attention import AttentionMetadata
    from mini_engine.parallel.ranks import moved, step_inputs, step_message
    tables = [list(range(63 * i, 63 * i + 63)) for i in range(16)]
    meta = AttentionMetadata.build([1] * 16, [1000] * 16, block_tables=tables, block_size=16)
    meta.logits_indices = torch.arange(16)
    ids = torch.arange(16)
    message = step_message(ids, meta, "torch", False, 0)
    tensors = pickle.dumps(("forward", ids, moved(meta, torch.device("cpu")), "torch", False, 0))
    assert len(message) < 8_000 and len(message) * 4 < len(tensors), \
        f"the step message is {len(message):,} bytes, against {len(tensors):,} for the metadata's tensors"
    kind, inputs, *_ = pickle.loads(message)
    got_ids, got = step_inputs(inputs, torch.device("cpu"))
    assert kind == "forward" and torch.equal(got_ids, ids)
    for name in ("positions", "slot_mapping", "block_tables", "logits_indices"):
        assert torch.equal(getattr(got, name), getattr(meta, name)), name
    assert torch.equal(got.decode.context_lens, meta.decode.context_lens)


FAULTY = '''
from mini_engine.parallel import layers


class RowParallelLinear(layers.RowParallelLinear):
    def forward(self, x):
        if self.comm is not None and self.comm.rank == 2 and x.shape[0] == 13:
            raise ValueError("rank 2 refuses a step of 13 tokens (this test's layer)")
        return super().forward(x)
'''


def test_a_rank_that_raises_is_quoted_on_rank_0(tmp_path, monkeypatch):
    """A rank's own exception travels up its pipe: rank 0's error quotes it, traceback and all, and every rank ends.
    The ranks build from a module of this test's (the `layers=` hook) whose row-parallel layer raises on rank 2."""
    (tmp_path / "tp_faulty_layers.py").write_text(FAULTY)
    monkeypatch.syspath_prepend(str(tmp_path))  # a spawned rank starts with this sys.path
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=6,
                         num_kv_heads=3, head_dim=8, tie_word_embeddings=True)
    model = ParallelModel(LlamaModel(config).eval(), SIZE, timeout=20, layers="tp_faulty_layers")
    pids = model.pids
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 96)
    with pytest.raises(RuntimeError, match=r"step failed: rank 2 \(pid \d+\) raised ValueError: rank 2 refuses a "
                                           r"step of 13 tokens") as failed:
        model(torch.tensor([list(range(13))]))
    assert re.search(r"(?s)rank 2's traceback:\nTraceback .*tp_faulty_layers.py.* in forward", str(failed.value))
    assert model.closed and not any(alive(p) for p in pids)
    with pytest.raises(RuntimeError, match=r"shut down \(rank 2 \(pid \d+\) raised ValueError"):
        model(torch.tensor([[1, 2, 3]]))


def test_sequence_and_pipeline_options_are_checked_before_any_process_starts():
    import multiprocessing
    before = set(multiprocessing.active_children())
    for kwargs, match in ((dict(sequence_parallel=True), "sequence_parallel=True .* needs tensor_parallel_size > 1"),
                          (dict(sequence_parallel="yes", tensor_parallel_size=3), "sequence_parallel must be"),
                          (dict(tensor_parallel_size=3, pipeline_parallel_size=2), "one way at a time"),
                          (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be an int >= 1"),
                          (dict(pipeline_micro_batches=0), "pipeline_micro_batches must be an int >= 1"),
                          (dict(pipeline_parallel_size=2, compile=True), "compile")):
        with pytest.raises(ValueError, match=match):
            me.LLM("smollm2-135m", **kwargs)
    assert set(multiprocessing.active_children()) == before


def test_interpreter_exit_ends_every_rank(tmp_path):
    """A script (no `if __name__ == "__main__":` guard) that makes an engine and exits without shutdown."""
    script = tmp_path / "serve_and_exit.py"
    script.write_text(textwrap.dedent("""
        import mini_engine as me
        llm = me.LLM("smollm2-135m", tensor_parallel_size=3, num_kv_blocks=32)
        print(*llm.engine.model.pids, flush=True)
        print(llm.generate(["Hello"], me.SamplingParams(max_tokens=4), use_tqdm=False)[0].token_ids, flush=True)
    """))
    before = set(Path(os.environ.get("TMPDIR", "/tmp")).glob("mini_engine_tp_*"))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    pids = [int(p) for p in run.stdout.splitlines()[0].split()]
    deadline = time.time() + 10
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids)
    assert set(Path(os.environ.get("TMPDIR", "/tmp")).glob("mini_engine_tp_*")) <= before


def test_a_killed_rank_is_an_error_and_shutdown_leaves_nothing(tp):
    """Last: it ends the module's engine. A rank killed between steps: the next step says which rank died, and
    every other rank has ended; nothing is left in the temporary folder."""
    model = tp.engine.model
    pids, folder = model.pids, model.folder
    os.kill(pids[0], signal.SIGKILL)
    time.sleep(0.5)
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        tp.generate(PROMPTS[:1], me.SamplingParams(max_tokens=4), use_tqdm=False)
    assert not any(alive(p) for p in pids)
    assert not Path(folder).exists()
    tp.shutdown()  # a second shutdown does nothing


def test_a_server_whose_ranks_failed_says_so(tp):
    """After the test above ended the module's engine: the server's /health answers 503, and a request gets a clear
    503 at once (no hang) naming what failed."""
    from fastapi.testclient import TestClient

    from mini_engine.serving.server import build_app
    assert tp.engine.model.closed
    with TestClient(build_app(tp)) as client:
        health = client.get("/health", timeout=10)
        assert health.status_code == 503 and "rank 1" in health.json()["error"]["message"]
        start = time.perf_counter()
        answer = client.post("/v1/completions", json={"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 4},
                             timeout=30)
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "engine_failed"
        assert "rank 1" in answer.json()["error"]["message"] and time.perf_counter() - start < 10
