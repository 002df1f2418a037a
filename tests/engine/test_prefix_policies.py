"""The cache-aware policy's two options (mini_engine/prefix/policies.py): aging bounds how long a request with no
prefix-cache hit waits behind a stream of hits, and in-batch prefix holding makes a burst that shares an uncached
prefix compute it once. Steps are counted, never timed: the policy reads `now`, so the engine runs on a clock the
test moves by one second a step."""
import random
from types import SimpleNamespace

import pytest

import mini_engine as me
from mini_engine import LLM
from mini_engine.engine_config import EngineConfig
from mini_engine.paging import BlockManager
from mini_engine.prefix.policies import HOLD_TOKENS, HoldAndAgePolicy
from mini_engine.scheduler import CacheAwarePolicy, Request, Scheduler, make_policy

pytestmark = pytest.mark.usefixtures("one_thread")
ONE = me.SamplingParams(max_tokens=1, ignore_eos=True)
SMALL = 128  # max_model_len: a KV pool of 16 x 128 positions, not the CPU default's 16 x 1024


def request(i: int, prompt: list[int], arrival: float = 0.0, hint: int = 0, max_tokens: int = 1) -> Request:
    r = Request(i, prompt, me.SamplingParams(max_tokens=max_tokens, ignore_eos=True), frozenset(), arrival)
    r.num_cached_hint = hint
    return r


# ---------------------------------------------------------------- aging

def steps_until_served(policy, steps: int = 60) -> int | None:
    """One free slot a step; each step a new request arrives whose 40 prompt tokens are all cached, beside one
    waiting since t = 0 with nothing cached. The step (= the clock, in seconds) that admits the latter, or None."""
    starving = request(0, [9] * 20)
    waiting = [starving]
    for step in range(steps):
        waiting.append(request(step + 1, [1] * 40 + [step], arrival=float(step), hint=40))
        admitted = policy.admit(waiting, [], 1, 512, float(step))
        assert len(admitted) == 1
        if admitted[0] is starving:
            return step
        waiting.remove(admitted[0])
    return None


def test_without_aging_a_request_with_no_hit_starves_behind_a_stream_of_hits():
    assert steps_until_served(CacheAwarePolicy()) is None
    assert steps_until_served(HoldAndAgePolicy(prefix_holding=True)) is None


@pytest.mark.parametrize("aging_s", [0, 3, 5.5, 20])
def test_with_aging_it_is_served_once_it_has_waited_aging_s(aging_s):
    assert steps_until_served(HoldAndAgePolicy(aging_s=aging_s)) == int(-(-aging_s // 1))  # the first step >= aging_s


def test_aged_requests_go_oldest_first_after_preempted_ones_and_are_never_held():
    policy = HoldAndAgePolicy(prefix_holding=True, aging_s=2.0)
    shared = list(range(100, 160))
    old, older, hit = request(1, shared + [1], arrival=7.0), request(2, shared + [2], arrival=5.0), \
        request(3, [5] * 30, arrival=9.0, hint=29)
    preempted = request(4, [6] * 10, arrival=8.5)
    preempted.status = me.scheduler.RequestStatus.PREEMPTED
    order = policy.admit([old, older, hit, preempted], [], 4, 10_000, now=10.0)
    # older and old share 60 uncached tokens: without aging the second would be held a step
    assert [r.request_id for r in order] == [4, 2, 1, 3]


class Clock:
    """Stands in for the engine's `time` module: perf_counter reads `t`, which the test advances."""
    def __init__(self):
        self.t = 0.0

    def perf_counter(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


def stream_prompts() -> tuple[list[int], list[int]]:
    rng = random.Random(0)
    return [rng.randrange(1000, 40_000) for _ in range(48)], [rng.randrange(1000, 40_000) for _ in range(24)]


def serve_stream(real, monkeypatch, steps: int, **policy) -> tuple[int | None, list[int]]:
    """The engine, one request at a time (max_num_seqs=1), a cached 48-token prefix and a stream of requests that
    hit it, one arriving each step, beside one request that shares nothing. Returns the step that finished the
    latter (None: not within `steps`) and its tokens (the stream stopped, drained)."""
    model, tok = real
    clock = Clock()
    monkeypatch.setattr(me.engine, "time", clock)
    prefix, lonely = stream_prompts()
    engine = LLM.from_model(model, tok, scheduling="cache_aware", max_num_seqs=1, max_model_len=SMALL,
                            **policy).engine
    engine.add_request(prefix + [7], ONE)
    while engine.has_unfinished():
        engine.step()
    rid = engine.add_request(lonely, me.SamplingParams(max_tokens=4, ignore_eos=True))
    served, outs = None, []
    for step in range(steps):
        clock.t = step + 1.0
        engine.add_request(prefix + [11 + step], ONE)
        outs += engine.step()
        if served is None and any(o.request_id == rid for o in outs):
            served = step
    while engine.has_unfinished():
        outs += engine.step()
    lone = next(o for o in outs if o.request_id == rid)
    assert all(o.num_cached_tokens == 48 for o in outs if o.request_id != rid), "the stream hits the prefix"
    return served, lone.token_ids


def test_through_the_engine_aging_bounds_the_wait_and_changes_no_token(real, monkeypatch):
    alone = LLM.from_model(*real, enable_prefix_caching=False, max_model_len=SMALL)
    lonely = stream_prompts()[1]
    expected = alone.generate([lonely], me.SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0].token_ids
    starved, tokens = serve_stream(real, monkeypatch, 25)
    assert starved is None, "longest prefix first serves the stream of hits, never the request with none"
    assert tokens == expected
    served, tokens = serve_stream(real, monkeypatch, 25, aging_s=3.0)
    # it arrives at t = 0 and ages at t = 3 (step 2); its 4 tokens take 4 steps, one slot
    assert served is not None and served <= 2 + 4, f"served at step {served}"
    assert tokens == expected


# ---------------------------------------------------------------- in-batch prefix holding

def burst(num_prefixes: int = 2, per_prefix: int = 3, prefix_len: int = 64, seed: int = 1) -> list[list[int]]:
    """Requests sharing `num_prefixes` new prefixes, interleaved (as different users' requests arrive)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, 40_000) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [prefixes[p] + [rng.randrange(1000, 40_000) for _ in range(4)]
            for _ in range(per_prefix) for p in range(num_prefixes)]


@pytest.mark.parametrize("cache", ["hashed", "radix"])
def test_holding_computes_a_shared_new_prefix_once_and_changes_no_token(real, assert_greedy_match, cache):
    prompts = burst()
    params = me.SamplingParams(max_tokens=3, ignore_eos=True)
    plain = LLM.from_model(*real, enable_prefix_caching=False, max_model_len=SMALL).generate(prompts, params,
                                                                                          use_tqdm=False)
    runs = {}
    for holding in (False, True):
        llm = LLM.from_model(*real, scheduling="cache_aware", prefix_cache=cache, prefix_holding=holding,
                             max_model_len=SMALL)
        runs[holding] = llm.generate(prompts, params, use_tqdm=False)
    reused = {h: sum(o.num_cached_tokens for o in outs) for h, outs in runs.items()}
    assert reused[False] == 0, "all six fit the first step: each computes its prefix"
    assert reused[True] == 4 * 64, f"the four held requests take their 64-token prefix from the cache: {reused}"
    for prompt, a, b in zip(prompts, runs[True], plain):
        assert_greedy_match(real[0], prompt, a.token_ids, b.token_ids)


def plan(policy, prompts: list[list[int]], block_size: int = 16) -> list[list[int]]:
    """The scheduler with a hashed prefix cache and no model: per step, the ids it admitted."""
    s = Scheduler(policy, 8, 1024, 512, BlockManager(128, block_size, enable_prefix_caching=True))
    for i, p in enumerate(prompts):
        s.add(request(i, p, max_tokens=2))
    admitted, seen = [], set()
    while s.has_unfinished():
        chunks = s.schedule(0.0)
        admitted.append([r.request_id for r in s.running if r.request_id not in seen])
        seen |= set(admitted[-1])
        s.update(chunks, [1 for _ in s.samplers(chunks)], 0.0)
        assert len(admitted) < 100
    return admitted


def test_a_held_request_waits_for_the_cache_only_once_when_the_shared_part_is_cached():
    """Five requests share 40 new tokens, blocks of 16: one runs, four are held; a step later the cache serves them 32
    tokens and the 8 left are fewer than HOLD_TOKENS, so all four start together. (A rule of "at most 32 tokens
    cached, at least 32 shared" would hold all but one of them again, and again.)"""
    prompts = [list(range(100, 140)) + [200 + 10 * i + j for j in range(8)] for i in range(5)]
    assert plan(HoldAndAgePolicy(prefix_holding=True), prompts)[:2] == [[0], [1, 2, 3, 4]]
    assert plan(CacheAwarePolicy(), prompts)[0] == [0, 1, 2, 3, 4]


def test_a_request_is_held_while_a_prompt_it_shares_is_still_being_computed_in_chunks():
    shared = list(range(100, 200))
    prompts = [shared + [1] * 8, shared + [2] * 8]
    results = {}
    for name, policy in (("plain", CacheAwarePolicy()), ("holding", HoldAndAgePolicy(prefix_holding=True))):
        s = Scheduler(policy, 8, 1024, 64, BlockManager(128, 16, enable_prefix_caching=True))
        reqs = [request(i, p, max_tokens=2) for i, p in enumerate(prompts)]
        for r in reqs:
            s.add(r)
        while s.has_unfinished():
            chunks = s.schedule(0.0)
            s.update(chunks, [1 for _ in s.samplers(chunks)], 0.0)
        results[name] = reqs[1].num_cached_tokens
    # plain: the second starts in step 2 with the 64 tokens step 1 cached and recomputes 36 the first is computing
    assert results == {"plain": 64, "holding": 96}


def test_holding_and_aging_apply_only_to_a_queue_the_policy_ranks():
    shared = list(range(100, 200))
    waiting = [request(i, shared + [i], arrival=float(i)) for i in range(3)]
    assert len(HoldAndAgePolicy(prefix_holding=True).admit(waiting, [], 3, 10_000, 0.0)) == 1
    over = HoldAndAgePolicy(prefix_holding=True, aging_s=0.0, max_ranked=2)
    assert over.admit(waiting[::-1], [], 3, 10_000, 0.0) == waiting[::-1], "past max_ranked: queue order, no hold"


def test_a_request_gaining_too_little_or_only_its_last_token_is_not_held():
    p = HoldAndAgePolicy(prefix_holding=True)
    shared = list(range(HOLD_TOKENS))
    assert p.gains_by_waiting(shared + [1, 2], 0, [shared + [3]])
    assert not p.gains_by_waiting(shared + [1, 2], 1, [shared + [3]]), "31 more tokens: not worth a step"
    assert not p.gains_by_waiting(shared, 0, [shared + [3]]), "its last token is never served from the cache"
    assert not p.gains_by_waiting([], 0, [shared]), "a request wanting prompt logprobs looks nothing up"


# ---------------------------------------------------------------- configuration

def test_the_options_are_off_by_default_and_the_default_policy_is_unchanged():
    c = EngineConfig(scheduling="cache_aware")
    assert (c.prefix_holding, c.aging_s) == (False, None)
    assert type(make_policy("cache_aware", 4, **c.policy_options)) is CacheAwarePolicy
    p = make_policy("cache_aware", 4, **EngineConfig(scheduling="cache_aware", prefix_holding=True,
                                                     aging_s=2).policy_options)
    assert isinstance(p, HoldAndAgePolicy) and (p.prefix_holding, p.aging_s, p.max_ranked) == (True, 2, 128)
    assert EngineConfig(scheduling="cache_aware", aging_s=0).resolved("cpu", 2048).aging_s == 0


@pytest.mark.parametrize("kwargs, name", [
    ({"prefix_holding": True}, "prefix_holding"),
    ({"aging_s": 1.0}, "aging_s"),
    ({"aging_s": 0}, "aging_s"),
    ({"scheduling": "continuous", "prefix_holding": True}, "prefix_holding"),
    ({"scheduling": SimpleNamespace(admit=len, seconds_until_admission=len), "aging_s": 1.0}, "aging_s"),
    ({"scheduling": "cache_aware", "aging_s": -1.0}, "aging_s"),
    ({"scheduling": "cache_aware", "aging_s": float("nan")}, "aging_s"),
    ({"scheduling": "cache_aware", "aging_s": "5"}, "aging_s"),
    ({"scheduling": "cache_aware", "aging_s": True}, "aging_s"),
    ({"scheduling": "cache_aware", "prefix_holding": 1}, "prefix_holding"),
    ({"scheduling": "cache_aware", "prefix_holding": None}, "prefix_holding"),
])
def test_bad_options_raise_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        EngineConfig(**kwargs)


def test_the_policy_checks_its_own_arguments():
    for kwargs, name in (({"aging_s": -2}, "aging_s"), ({"prefix_holding": "yes"}, "prefix_holding"),
                         ({"hold_tokens": 0}, "hold_tokens")):
        with pytest.raises(ValueError, match=name):
            HoldAndAgePolicy(**kwargs)
