"""`python -m mini_engine bench --workload radix` on a tiny random model: every workload runs on every engine, the
reuse each cache reports is the one its design allows, and the table and ratios are printed. (The numbers on the real
model belong in benchmarks/RESULTS.md.)"""
import pytest
import torch

from mini_engine.bench.radix import ENGINES, StructuredWorkload, bench_radix, ideal_reuse
from mini_engine.config import ModelConfig
from mini_engine.model import LlamaModel

B = 16


@pytest.fixture(scope="module")
def runs():
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=2048, eos_token_id=None)
    lines = []
    try:
        result = bench_radix("cpu", "float32", block_size=B, progress=False, print_fn=lines.append,
                             model_and_tokenizer=(LlamaModel(cfg).eval(), None))
    finally:
        torch.set_num_threads(threads)
    return result, "\n".join(lines)


def test_ideal_reuse_counts_what_earlier_requests_computed():
    prompts = [[1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 3, 4, 5, 6], [7]]
    computed = [[1, 2, 3, 4, 5], [1, 2, 3, 9], [1, 2, 3, 4, 5, 6], [7]]
    # the second shares 3 tokens with the first; the third 5 of the first's computed tokens (its own last token
    # is never served); the fourth nothing, and a one-token prompt computes its token anyway
    assert ideal_reuse(prompts, computed) == [0, 3, 5, 0]


def test_every_workload_runs_on_every_engine(runs):
    result, _ = runs
    assert [(r.cache, r.scheduling) for r in result] == list(ENGINES) * 3
    assert [r.workload for r in result[::4]] == ["conversation", "few-shot", "branching"]
    for r in result:
        assert 0 < r.reused <= r.ideal <= r.prompt_tokens and r.seconds > 0 and len(r.ttft) == len(r.prompts)
        same = next(s for s in result if s.workload == r.workload)
        assert r.outputs == same.outputs, "greedy outputs must not depend on the cache or the order"


def test_hashed_reuses_whole_blocks_and_radix_at_least_as_much(runs):
    result, _ = runs
    for r in result:
        if r.cache == "hashed":
            assert all(c % B == 0 for c in r.cached), "the hashed cache serves whole blocks"
            radix = next(s for s in result if (s.workload, s.scheduling, s.cache) == (r.workload, r.scheduling, "radix"))
            assert radix.reused >= r.reused


def test_a_conversations_next_turn_reuses_the_whole_previous_turn_on_the_radix_tree(runs):
    result, _ = runs
    for r in result:
        if r.workload == "conversation" and r.cache == "radix":
            users = len(StructuredWorkload.conversation(vocab=1000).first)
            for k in range(users, len(r.prompts)):
                before = len(r.prompts[k - users]) + len(r.outputs[k - users]) - 1  # its last token never computed
                assert r.cached[k] == before, f"turn {k // users + 1}: {r.cached[k]} of {before} reused"
            assert r.share_of_ideal > 0.9


def test_the_table_names_the_cpu_and_prints_the_ratios(runs):
    _, text = runs
    for phrase in ("CPU:", "block_size=16", "of ideal", "TTFT p50", "out tok/s", "radix / hashed, arrival order",
                   "cache-aware / arrival, radix", "outputs identical across the engines of each workload: True"):
        assert phrase in text, f"bench output lacks {phrase!r}:\n{text}"
