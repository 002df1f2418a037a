"""benchmarks/bench_prefix_policies.py on a tiny random model (its --quick mode): every workload runs under every
admission order, the greedy tokens agree, holding reuses at least what longest prefix first reuses, and the table
names the CPU. (The numbers on the real model belong in benchmarks/RESULTS.md.)"""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_prefix_policies as bench  # noqa: E402


@pytest.fixture(scope="module")
def result():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    lines = []
    try:
        runs = bench.bench(*bench.tiny_model(), print_fn=lines.append)
    finally:
        torch.set_num_threads(threads)
    return runs, "\n".join(lines)


def test_every_workload_runs_under_every_policy_with_the_same_tokens(result):
    runs, text = result
    labels = [label for label, _, _ in bench.policies(0.5)]
    assert [label for label, _ in runs] == labels * 3
    assert [r.workload for _, r in runs[::4]] == ["conversation", "few-shot", "branching"]
    assert "greedy outputs identical under every policy of each workload: True" in text
    for label, r in runs:
        assert 0 < r.reused <= r.ideal and len(r.ttft) == len(r.prompts) and r.seconds > 0


def test_holding_reuses_at_least_what_longest_prefix_first_reuses(result):
    runs, _ = result
    by = {(r.workload, label): r.reused for label, r in runs}
    gains = [by[w, "longest prefix + holding"] - by[w, "longest prefix"] for w in ("conversation", "few-shot",
                                                                                  "branching")]
    assert min(gains) >= 0 and max(gains) > 0, f"reuse with holding minus without, per workload: {gains}"


def test_the_table_names_the_cpu_and_its_columns(result):
    _, text = result
    for phrase in ("CPU (lscpu model name):", "cache=radix", "TTFT p50", "TTFT p99", "out tok/s", "of ideal",
                   "longest prefix + aging 0.5s", "arrival order"):
        assert phrase in text, f"bench output lacks {phrase!r}:\n{text}"
