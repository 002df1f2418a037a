"""course/prefix_designs.py: the three designs' counts by hand, and the replay against the engine's own caches
(the block managers driven directly, then whole engines on a tiny random model, served one at a time)."""
import random

import pytest
import torch

from mini_engine.bench.radix import StructuredWorkload, run_structured
from mini_engine.config import ModelConfig
from mini_engine.course.prefix_designs import DESIGNS, expected_loss, replay, served
from mini_engine.model import LlamaModel
from mini_engine.paging import BlockManager
from mini_engine.prefix.radix_cache import RadixBlockManager


def test_rounding_designs_serve_whole_pages_and_the_partial_block_every_token():
    # chapter 08's exercise 4, blocks of 16: B shares 70 tokens of A; C is A again (100 tokens: 99 matchable)
    assert [served(70, 16, d) for d in DESIGNS] == [64, 64, 70]
    assert [served(99, 16, d) for d in DESIGNS] == [96, 96, 99]
    assert [served(99, 128, d) for d in DESIGNS] == [0, 0, 99]
    assert {served(37, 1, d) for d in DESIGNS} == {37}  # page size 1: every design matches at any token


def test_replay_counts_per_request_and_the_partial_design_pays_one_copy_per_unaligned_hit():
    prompts = [list(range(10)), list(range(7)) + [99, 98], list(range(10)) + [50, 51, 52]]
    outputs = [[10, 11, 12], [5], [1]]
    # request 1 shares 7 tokens with request 0; request 2 shares request 0's whole prompt, 10 tokens, then parts
    # from request 0's output (50 against 10)
    hashed, partial = replay(prompts, outputs, 4, "hashed"), replay(prompts, outputs, 4, "partial")
    assert partial.ideal == [0, 7, 10] and partial.cached == [0, 7, 10]
    assert hashed.cached == [0, 4, 8] and hashed.lost == 5 and hashed.hits == 2
    assert partial.copies == 2 and hashed.copies == 0
    assert replay(prompts, outputs, 4, "rounded").cached == hashed.cached
    assert expected_loss(2, 4) == 3.0


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="design"):
        served(3, 4, "tree")
    with pytest.raises(ValueError, match="page_size"):
        served(3, 0, "hashed")
    with pytest.raises(ValueError, match="outputs"):
        replay([[1, 2]], [], 4, "hashed")


def structured_requests(rng: random.Random, page: int):
    """Conversations and branches over a few shared prefixes, prompts and outputs of random lengths."""
    draw = lambda lo, hi: [rng.randrange(1000) for _ in range(rng.randint(lo, hi))]  # noqa: E731
    stems = [draw(1, 5 * page) for _ in range(3)]
    prompts, outputs = [], []
    for _ in range(12):
        if prompts and rng.random() < 0.5:  # a next turn of an earlier request: its prompt, its answer, more
            k = rng.randrange(len(prompts))
            prompt = prompts[k] + outputs[k] + draw(1, page)
        else:
            prompt = rng.choice(stems)[:] + draw(0, 2 * page)
        if len(prompt) < 2:
            prompt += draw(2, 3)
        prompts.append(prompt)
        outputs.append(draw(1, page))
    return prompts, outputs


def serve_one_at_a_time(manager, prompts, outputs) -> list[int]:
    """Each request as the scheduler drives it, alone: take the matched blocks, copy a partly matched one, compute
    the prompt and the outputs but the last, then finish."""
    cached = []
    for k, (prompt, out) in enumerate(zip(prompts, outputs)):
        hit = manager.allocate_cached(k, prompt)
        computed = prompt + out[:-1]
        manager.copy_on_write(k, hit, len(computed))
        manager.append_slots(k, len(computed))
        manager.cache_blocks(k, computed, len(computed))
        manager.free(k)
        cached.append(hit)
    assert manager.num_evictions == 0
    return cached


@pytest.mark.parametrize("page", [1, 4, 16])
@pytest.mark.parametrize("seed", range(5))
def test_replay_matches_the_engines_block_managers(page, seed):
    prompts, outputs = structured_requests(random.Random(seed), page)
    blocks = 4 * sum(len(p) + len(o) for p, o in zip(prompts, outputs)) // page + 8  # nothing is evicted
    hashed = serve_one_at_a_time(BlockManager(blocks, page, enable_prefix_caching=True), prompts, outputs)
    tree = serve_one_at_a_time(RadixBlockManager(blocks, page), prompts, outputs)
    assert hashed == replay(prompts, outputs, page, "hashed").cached
    assert tree == replay(prompts, outputs, page, "partial").cached


def test_replay_matches_the_engines_num_cached_tokens_served_one_at_a_time():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=2048, eos_token_id=None)
    model = LlamaModel(cfg).eval()
    works = [StructuredWorkload.conversation(users=2, turns=3, output_len=6, vocab=1000),
             StructuredWorkload.few_shot(tasks=2, questions=2, output_len=3, vocab=1000),
             StructuredWorkload.branching(contexts=1, branches=3, output_len=3, vocab=1000)]
    for work in works:
        for cache, design in (("hashed", "hashed"), ("radix", "partial")):
            run = run_structured(model, None, work, cache, block_size=16, max_num_seqs=1, num_kv_blocks=256)
            assert run.num_evictions == 0
            assert run.cached == replay(run.prompts, run.outputs, 16, design).cached, (work.name, cache)
