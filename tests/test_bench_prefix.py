"""`python -m mini_engine bench --workload prefix` at toy sizes: every measurement is made and printed, and the
cache is hit exactly where the block arithmetic says. (The numbers belong in benchmarks/RESULTS.md.)"""
from mini_engine.backends.cpu import cpu_kernels
from mini_engine.bench.prefix import bench_prefix
from mini_engine.course.formulas import cached_prefix_tokens


def test_prefix_bench_measures_ttft_throughput_and_the_serving_workload():
    lines = []
    res = bench_prefix(requests=3, device="cpu", dtype="float32", prefix_len=40, question_len=5, output_len=3,
                       serving_requests=3, batch=2, block_size=16, low=4, high=8, tune_rows=(1, 2, 4, 8, 16, 64), progress=False, print_fn=lines.append)
    off, on = res["ttft"]
    assert off.cached_tokens == 0 and off.computed_tokens == off.prompt_tokens == 3 * 45
    assert on.cached_tokens == 3 * cached_prefix_tokens(45, 40, 16) == 3 * 32
    # each measured request's steps compute exactly its uncached prompt tokens (and its one output token
    # comes from the last of them, which samples)
    assert [sum(n for n, _ in steps) for steps in off.steps] == [45] * 3
    assert [sum(n for n, _ in steps) for steps in on.steps] == [45 - 32] * 3
    assert all(sec > 0 for r in (off, on) for steps in r.steps for _, sec in steps)
    t_off, t_on = res["throughput"]
    assert t_off.output_tokens == t_on.output_tokens == 9 and t_on.cached_tokens > 0
    s_off, s_on = res["serving"]
    assert s_off.tokens == s_on.tokens and s_on.system.endswith("on")
    text = "\n".join(lines)
    phrases = ["CPU:", "TTFT p50 off / on", "predicted by the FLOP ratio", "caching off: 45 tokens in",
               "caching on : 13 tokens in", "output tok/s", "on / off"]
    if cpu_kernels.compiler() is not None:  # the prefill chunk's two attention forms, side by side
        phrases += ["5 tokens over    45 positions: in place", "45 tokens over    45 positions: in place"]
    for phrase in phrases:
        assert phrase in text, f"bench output lacks {phrase!r}:\n{text}"
