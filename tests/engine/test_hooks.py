"""The engine's three hooks for parts of your own (the labs plug theirs in): a scheduling policy object, a
proposer object in `speculative`, a `paging.BlockManager` subclass. Each part is used (its methods are called),
serves the same tokens as the engine's own part, and a bad one is refused when the config is made, by name."""
import random

import pytest

import mini_engine as me
from mini_engine.engine import LLM
from mini_engine.engine_config import EngineConfig
from mini_engine.paging import BlockManager
from mini_engine.scheduler import ContinuousPolicy, StaticPolicy
from mini_engine.speculative import NgramProposer

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = me.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model(1)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    # Repeating prompts, so that n-gram lookup finds drafts to verify.
    return [[rng.randrange(128) for _ in range(n)] * 3 for n in (3, 9, 5, 14, 4, 7)]


def run(llm, prompts):
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.token_ids for o in outs]


# ---------------------------------------------------------------- scheduling=<policy object>

class CountingPolicy(ContinuousPolicy):
    """The engine's continuous policy, counting its calls: proof that the engine asks it."""
    name = "counting"

    def __init__(self):
        self.calls = 0

    def admit(self, waiting, running, free_slots, budget, now):
        self.calls += 1
        return super().admit(waiting, running, free_slots, budget, now)


class ShortestFirst:
    """A policy that is not the engine's: the shortest waiting prompts first, as many as there are free slots."""

    def admit(self, waiting, running, free_slots, budget, now):
        return sorted(waiting, key=lambda r: r.num_tokens)[:free_slots]

    def seconds_until_admission(self, waiting, running, now):
        return 0.0


@pytest.mark.parametrize("kv_cache", ["paged", "contiguous"])
def test_a_policy_object_schedules_the_engine(tiny, prompts, kv_cache):
    plain = run(LLM.from_model(tiny, kv_cache=kv_cache, max_num_seqs=2), prompts)
    policy = CountingPolicy()
    llm = LLM.from_model(tiny, kv_cache=kv_cache, max_num_seqs=2, scheduling=policy, record_trace=True)
    assert run(llm, prompts) == plain
    assert policy.calls > 0, "the engine never asked the policy object"
    assert "scheduling=counting" in repr(llm)
    assert llm.engine.scheduler.policy is policy


def test_a_policy_of_another_order_changes_the_order_not_the_tokens(tiny, prompts):
    plain = run(LLM.from_model(tiny, max_num_seqs=2), prompts)
    llm = LLM.from_model(tiny, max_num_seqs=2, scheduling=ShortestFirst(), record_trace=True)
    assert run(llm, prompts) == plain
    first = [rid for rid, *_ in llm.engine.trace[0].chunks]
    assert sorted(first) == [0, 4], f"the two shortest prompts (requests 0 and 4) start first, got {first}"


@pytest.mark.parametrize("policy", [object(), "fifo", StaticPolicy, type("OnlyAdmit", (), {"admit": lambda *a: []})()])
def test_a_bad_policy_is_refused_by_name(policy):
    with pytest.raises(ValueError, match=r"scheduling must be one of .* or a policy object with admit\(\)"):
        EngineConfig(scheduling=policy)


# ---------------------------------------------------------------- speculative={"method": <proposer>}

class LookupProposer:
    """The engine's n-gram lookup behind an object of our own, counting the drafts it proposed."""

    def __init__(self):
        self.inner, self.proposed = NgramProposer(1, 4), 0

    def propose(self, token_ids, k):
        drafts = self.inner.propose(token_ids, k)
        self.proposed += len(drafts)
        return drafts


@pytest.mark.parametrize("kv_cache", ["paged", "contiguous"])
def test_a_proposer_object_drafts_for_the_engine(tiny, prompts, kv_cache):
    engine_own = LLM.from_model(tiny, kv_cache=kv_cache, max_num_seqs=3,
                                speculative={"method": "ngram", "k": 3, "ngram_min": 1, "ngram_max": 4})
    proposer = LookupProposer()
    ours = LLM.from_model(tiny, kv_cache=kv_cache, max_num_seqs=3, speculative={"method": proposer, "k": 3})
    a, b = (llm.generate(prompts, GREEDY, use_tqdm=False) for llm in (engine_own, ours))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    drafted = [o.metrics.num_draft_tokens for o in b]
    assert drafted == [o.metrics.num_draft_tokens for o in a] and sum(drafted) > 0
    assert proposer.proposed >= sum(drafted), "drafts the engine verified came from the proposer object"
    assert ours.engine.proposer is proposer and "'k': 3" in repr(ours)
    if kv_cache == "paged":
        assert ours.engine.num_free_blocks == ours.engine.num_kv_blocks, "rolled back: every block free when idle"


@pytest.mark.parametrize("spec, match", [
    ({"method": object()}, r"speculative\['method'\] must be one of .* or a proposer object"),
    ({"method": NgramProposer}, r"speculative\['method'\] must be one of .* or a proposer object"),  # the class
    ({"method": LookupProposer(), "ngram_max": 3}, r"speculative\['ngram_max'\]: unknown key"),
    ({"method": LookupProposer(), "k": 0}, r"speculative\['k'\] must be an int >= 1"),
])
def test_a_bad_proposer_is_refused_by_name(spec, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(speculative=spec)


# ---------------------------------------------------------------- block_manager=<BlockManager subclass>

class CountingBlocks(BlockManager):
    """The engine's block manager, counting the blocks it hands out."""
    instances: list = []

    def __init__(self, num_blocks, block_size, enable_prefix_caching=False):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.taken = 0
        CountingBlocks.instances.append(self)

    def _take_block(self):
        self.taken += 1
        return super()._take_block()


@pytest.mark.parametrize("caching", [False, True])
def test_a_block_manager_subclass_runs_the_paged_pool(tiny, prompts, caching):
    kwargs = {"max_num_seqs": 3, "num_kv_blocks": 24, "block_size": 4, "enable_prefix_caching": caching}
    plain = LLM.from_model(tiny, **kwargs)
    ours = LLM.from_model(tiny, block_manager=CountingBlocks, **kwargs)
    blocks = ours.engine.scheduler.blocks
    assert type(blocks) is CountingBlocks and ours.engine.runner.blocks is blocks
    assert (blocks.num_blocks, blocks.block_size, blocks.enable_prefix_caching) == (24, 4, caching)
    assert run(ours, prompts * 2) == run(plain, prompts * 2)
    assert blocks.taken > 0 and ours.engine.num_free_blocks == 24
    # The pool is small: requests are preempted, as often as with the engine's own manager.
    preempted = [[o.metrics.num_preemptions for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
                 for llm in (ours, plain)]
    assert preempted[0] == preempted[1] and sum(preempted[0]) > 0


def not_a_class(num_blocks, block_size, enable_prefix_caching):
    return BlockManager(num_blocks, block_size, enable_prefix_caching)


@pytest.mark.parametrize("bad", [not_a_class, BlockManager(4, 4), dict, "paged"])
def test_a_bad_block_manager_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="block_manager must be a subclass of paging.BlockManager"):
        EngineConfig(block_manager=bad)


def test_a_block_manager_needs_the_paged_cache():
    with pytest.raises(ValueError, match="block_manager runs the paged KV pool; kv_cache='contiguous'"):
        EngineConfig(kv_cache="contiguous", block_manager=CountingBlocks)
