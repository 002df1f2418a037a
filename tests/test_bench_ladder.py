"""The ladder (`python -m mini_engine bench --ladder`) and the server bench (`--workload server`) end to end on tiny
workloads: every rung is in the table, outputs are compared, the chart is saved, the server answers every request.
No timing is asserted (the numbers belong in benchmarks/RESULTS.md). The server bench pins the product forms to
the plain ones (MINI_ENGINE_FORMS) so that its server pays for no tuning. The ladder keeps the tuned forms: in
`make test` the chapters have timed them already (the machine's tuning store), and its compiled rung is then the
graph chapter 03 compiled, which Inductor's cache holds (a cold compile is about a minute on a 2-core CPU)."""
import ast
import subprocess
from pathlib import Path

import pytest

from mini_engine.bench.ladder import LABELS, RUNGS, LadderWorkload, bench_ladder

ROOT = Path(__file__).resolve().parents[1]


def test_workload_shares_the_system_prompt_mixes_kinds_and_never_repeats_a_prompt():
    import mini_engine as me
    _, tok = me.load_model("smollm2-135m")
    work = LadderWorkload.build(tok, 40)
    assert work.kinds[:4] == ["grounded", "chat", "grounded", "chat"]
    assert work.shared_prefix_len > 200, "every prompt opens with the long system prompt"
    assert all(p[:work.shared_prefix_len] == work.prompts[0][:work.shared_prefix_len] for p in work.prompts)
    assert len({tuple(p) for p in work.prompts}) == 40, "past the distinct tasks, readers make each prompt unique"
    assert len(set(work.max_tokens)) > 2


def test_length_scale_keeps_the_mix_of_lengths():
    import mini_engine as me
    _, tok = me.load_model("smollm2-135m")
    full, half = LadderWorkload.build(tok, 8), LadderWorkload.build(tok, 8, length_scale=0.5)
    assert half.max_tokens == [round(n / 2) for n in full.max_tokens] and len(set(half.max_tokens)) > 2
    assert half.prompts == full.prompts
    with pytest.raises(ValueError, match="length_scale"):
        LadderWorkload.build(tok, 8, length_scale=0)


def test_ladder_prints_a_static_rung_and_its_ratio_beside_the_textbooks():
    # Continuous against static batching on the same places and the same requests: the textbook's comparison (lanes
    # about 50% -> 90% busy, about 1.8x tokens/s), like for like. Mixed lengths, so a static batch has idle places.
    lines = []
    res = bench_ladder(requests=6, batch=2, sample=1, rungs=["static", "continuous"], length_scale=0.1, tune=False,
                       progress=False, system_prompt="Be brief.", print_fn=lines.append)
    text = "\n".join(lines)
    static, continuous = res.row("static"), res.row("continuous")
    assert [r.rung for r in res.rows] == ["static", "continuous"]
    assert LABELS["static"] in text and LABELS["continuous"] in text, f"the table lacks a batching rung:\n{text}"
    assert "static" in static.engine and "continuous" in continuous.engine, "each rung runs its own policy"
    assert static.peak_running <= 2 and continuous.peak_running <= 2, "both get the same places"
    assert continuous.outputs == static.outputs, "the policy decides when a request runs, not what it says"
    for row in (static, continuous):
        assert 0 < row.stats["lanes_busy"] <= 1
    line = res.batching_beside_textbook()
    assert line in text, f"the report lacks the textbook's comparison:\n{text}"
    assert f"{continuous.tok_s / static.tok_s:.2f}x tokens/s" in line
    assert f"{static.stats['lanes_busy']:.0%} -> {continuous.stats['lanes_busy']:.0%}" in line
    assert '(the textbook: utilization "~50% → ~90%", "≈1.8×")' in line
    # Chapter 09 runs the static rung (it leaves out only the compiled ones on a CPU) and prints this line.
    chapter = (ROOT / "chapters" / "09_full_stack.py").read_text()
    assert "ladder.batching_beside_textbook()" in chapter and '"static"' not in chapter.split("rungs = [")[1].split("]")[0]


@pytest.mark.slow
def test_ladder_runs_every_rung_and_compares_outputs(tmp_path):
    # The paged engines run one request at a time (paged_max_num_seqs=1), so a compiled engine step compiles one
    # batch-size bucket, not several.
    lines = []
    plot = tmp_path / "ladder.png"
    res = bench_ladder(requests=3, batch=2, sample=1, tune=False, progress=False, paged_max_num_seqs=1,
                       max_tokens_cap=5, system_prompt="You are a helpful assistant. Be brief.", plot=str(plot),
                       print_fn=lines.append)
    text = "\n".join(lines)
    assert [r.rung for r in res.rows] == list(RUNGS), "HF first, then every rung in ladder order"
    for rung in RUNGS:
        assert LABELS[rung] in text, f"the table lacks the {rung} rung:\n{text}"
    cached, continuous = res.row("cached"), res.row("continuous")
    assert sorted(cached.outputs) == [0] and sorted(continuous.outputs) == [0, 1, 2]
    for r in res.rows:
        if r.rung != "hf":  # HF's fp32 may flip a near-tie; ours must agree (greedy)
            assert r.outputs[0] == cached.outputs[0], f"{r.rung} differs from the cached rung on request 0"
    for rung in ("paged", "prefix", "speculative"):
        assert res.row(rung).outputs == continuous.outputs, f"{rung} differs from continuous batching"
    assert res.row("compiled_engine").compile_s > 0, "the compiled engine's one-time compile is reported apart"
    for phrase in ("CPU:", "=cached", "one request at a time", "compiling (one-time, in no row)",
                   "prefix-cache hit rate", "drafts accepted", "continuous / static batching", "places busy",
                   "top rung", "target >= 25x", "target >= 4x"):
        assert phrase in text, f"the report lacks {phrase!r}:\n{text}"
    assert plot.stat().st_size > 10_000


def test_server_bench_answers_every_request(plain_forms):
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from mini_engine.bench.server import bench_server
    lines = []
    res = bench_server(requests=3, max_tokens=4, tune=False, progress=False,
                       engine_kwargs={"max_model_len": 128, "max_num_seqs": 4}, print_fn=lines.append)
    for key in ("all_at_once", "rate", "double_rate"):
        assert res[key]["completed"] == 3 and res[key]["errors"] == 0, res[key]
        assert res[key]["output_tokens"] == 12
    assert res["offline"]["output_tokens"] == 12 and res["R"] > 0
    text = "\n".join(lines)
    for phrase in ("offline LLM.generate", "server at 2R", "within 10%", "0 errors"):
        assert phrase in text, f"the report lacks {phrase!r}:\n{text}"


def test_gpu_check_and_the_vllm_script_parse():
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_check.sh")], check=True)
    ast.parse((ROOT / "benchmarks" / "bench_vllm.py").read_text())
