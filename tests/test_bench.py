"""`python -m mini_engine bench` end to end at toy sizes: every row is produced and the ratios are printed.
(The numbers themselves belong in benchmarks/RESULTS.md, never in a pass/fail test.)"""
import pytest

from mini_engine.backends.cpu import cpu_kernels
from mini_engine.bench.runs import bench, bench_serving
from mini_engine.bench.paging import bench_paging

pytest.importorskip("transformers")


def test_single_stream_bench_prints_each_rung_hf_and_the_ratios():
    lines = []
    rows = bench(["naive", "cached", "compiled"], 3, "cpu", "float32", print_fn=lines.append)
    assert [r.system for r in rows] == ["HF transformers (no cache)", "HF transformers (cached)",
                                        "mini_engine naive", "mini_engine cached", "mini_engine compiled"]
    assert all(r.tokens == 3 for r in rows)
    text = "\n".join(lines)
    for phrase in ("mini_engine cached (float32) / HF cached (float32)", "mini_engine compiled / mini_engine cached",
                   "compiled the decode step in", "matmul floor at batch 1"):
        assert phrase in text, f"bench output lacks {phrase!r}:\n{text}"


def test_single_stream_bench_with_int4_adds_the_quantized_rows_and_llama_cpp(plain_forms):
    from mini_engine.bench.runs import llama_cpp_available
    lines = []
    rows = bench(["cached"], 3, "cpu", "float32", with_hf=False, print_fn=lines.append, quantization="int4")
    expected = ["mini_engine cached", "mini_engine int4 cached"]
    assert [r.system for r in rows][:2] == expected
    llama_rows = [r.system.startswith("llama.cpp") for r in rows[2:]]
    if not llama_cpp_available():
        assert llama_rows == []
    else:  # a row, or a build that crashes on this machine said so and cost only its row
        assert llama_rows == [True] or any(line.startswith("llama.cpp: no row") for line in lines), lines
    assert all(r.tokens == 3 for r in rows)
    text = "\n".join(lines)
    for phrase in ("mini_engine int4 cached: ", "x mini_engine float32 cached", "% of the bf16 model's",
                   "matmul floor at batch 1 (the weight products alone, chained)", "float32, int4 weights"):
        assert phrase in text, f"bench output lacks {phrase!r}:\n{text}"


def test_serving_bench_with_int4_serves_the_same_requests(plain_forms):
    lines = []
    rows = bench_serving(["continuous"], requests=3, batch=2, device="cpu", dtype="float32", with_hf=False,
                         low=4, high=8, print_fn=lines.append, progress=False, quantization="int4")
    assert [r.system for r in rows] == ["mini_engine continuous", "mini_engine int4 continuous"]
    assert rows[0].tokens == rows[1].tokens
    assert "mini_engine int4 continuous / mini_engine continuous (float32): " in "\n".join(lines)


def test_serving_bench_runs_hf_static_and_each_policy(plain_forms):
    lines = []
    rows = bench_serving(["continuous", "static", "dynamic"], requests=3, batch=2, device="cpu", dtype="float32",
                         low=4, high=8, print_fn=lines.append)
    assert [r.system for r in rows] == ["HF transformers static batch", "mini_engine continuous",
                                        "mini_engine static", "mini_engine dynamic"]
    assert len({r.tokens for r in rows}) == 1, "every system must serve the same requests"
    text = "\n".join(lines)
    assert "matmul floor at batch 2" in text
    for policy in ("static", "dynamic"):  # the count itself is the reader's to judge: batch shapes may flip a tie
        assert f"mini_engine {policy}: " in text and "requests with the same greedy tokens as continuous" in text, text
    assert all(sum(map(len, r.token_ids)) == r.tokens for r in rows[1:]), "each engine row keeps what it generated"


def test_paging_bench_compares_the_two_caches_at_equal_memory():
    lines = []
    rows, steps = bench_paging(requests=6, batch=3, device="cpu", dtype="float32", max_model_len=64, low=4, high=8,
                               contexts=(8, 20), progress=False, print_fn=lines.append)
    contiguous, paged = rows
    assert (contiguous.system, paged.system) == ("mini_engine contiguous", "mini_engine paged")
    assert contiguous.kv_bytes == paged.kv_bytes, "both caches get the same memory"
    assert contiguous.tokens == paged.tokens
    assert (contiguous.peak_running, paged.peak_running) == (3, 6), \
        "3 slots of 64 positions; as 12 blocks of 16 the same memory holds all six short requests (a block each, " \
        "and one free block per running request) at once"
    assert sorted(steps) == [8, 20] and all(t > 0 for pair in steps.values() for t in pair)
    text = "\n".join(lines)
    phrases = ["CPU:", "peak concurrent requests", "context     8", "paged / contiguous"]
    if cpu_kernels.compiler() is not None:  # the kernel beside the copy it replaces
        phrases += ["the C kernel reading the pool in place against the copy + SDPA", "x the kernel"]
    for phrase in phrases:
        assert phrase in text, f"bench output lacks {phrase!r}:\n{text}"


def test_speculative_bench_compares_ngram_on_and_off_on_both_workloads():
    from mini_engine.bench.speculative import bench_speculative
    lines = []
    runs = bench_speculative(batches=(1, 2), max_tokens=3, requests_at_batch_1=1, print_fn=lines.append)
    assert [(p.workload, p.batch, p.speculative, s.speculative, f.speculative) for p, s, f in runs] == \
        [(w, b, False, True, True) for w in ("grounded", "chat") for b in (1, 2)]
    assert all(p.outputs == s.outputs == f.outputs for p, s, f in runs), \
        "greedy: speculation, adaptive or not, must not change the tokens"
    text = "\n".join(lines)
    for phrase in ("alpha", "tok/round", "pred. speedup", "fixed k", "grounded", "chat"):
        assert phrase in text, f"bench output lacks {phrase!r}:\n{text}"


def test_llama_cpp_row_prefills_the_whole_prompt_every_run(monkeypatch):
    """llama-cpp-python reuses the previous prompt's KV cache when the same prompt comes again; a timed run that
    did so would leave the prefill out of llama.cpp's TTFT while our rows pay theirs. A stand-in Llama records
    how many prompt tokens each run found already cached."""
    import sys
    import types

    from mini_engine.bench.runs import run_llama_cpp

    cached_at_start = []

    class Llama:
        def __init__(self, **kwargs):
            self.n_tokens = 0

        def reset(self):
            self.n_tokens = 0

        def generate(self, tokens, **kwargs):
            cached_at_start.append(self.n_tokens)
            self.n_tokens = len(tokens)
            while True:
                self.n_tokens += 1
                yield 7

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=Llama))
    row = run_llama_cpp([1, 2, 3, 4], 5, threads=1, repeats=2)
    assert row.tokens == 5
    assert cached_at_start == [0, 0, 0], f"runs started with {cached_at_start} tokens already in llama.cpp's cache"


def test_a_crash_in_a_child_process_is_an_error_here_and_costs_only_its_row():
    """llama.cpp runs in a child process (`run_llama_cpp_isolated`): a build that segfaults on the machine must
    cost its row, not the bench. The child's result comes back; its crash (here a read of address 0) is a
    RuntimeError in this process, which goes on."""
    import ctypes

    from mini_engine.bench.runs import in_child_process
    assert in_child_process(max, 3, 7) == 7
    with pytest.raises(RuntimeError, match="crashed its process"):
        in_child_process(ctypes.string_at, 0)
