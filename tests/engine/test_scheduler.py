"""The scheduler on its own: no model, no tensors. A fake step emits token 1000 + (tokens so far), so every
request's output is known in advance and the tests check the plan each policy makes, step by step."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_engine.paging import BlockManager
from mini_engine.sampling import SamplingParams
from mini_engine.scheduler import (ContinuousPolicy, DynamicPolicy, Request, RequestStatus, Scheduler, StaticPolicy,
                                   make_policy)


def request(i, prompt_len, max_tokens, arrival=0.0, stop=()):
    return Request(i, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), frozenset(stop), arrival)


def fake_token(r: Request) -> int:
    return 1000 + r.num_tokens


def run_step(s: Scheduler, now: float = 0.0):
    """One step: plan, check the plan's invariants, 'sample' and apply. Returns (chunks, finished)."""
    chunks = s.schedule(now)
    slots = [r.slot for r in s.running]
    assert len(slots) == len(set(slots)) and None not in slots, f"running requests share a slot: {slots}"
    assert len(s.running) + len(s.free_slots) == s.num_slots
    tokens = [fake_token(c.request) for c in chunks if c.samples]
    return chunks, s.update(chunks, tokens, now)


def drain(s: Scheduler, max_steps=10_000):
    steps = []
    while s.has_unfinished():
        steps.append(run_step(s, now=len(steps)))
        assert len(steps) < max_steps, "scheduler made no progress"
    return steps


def make(policy, slots=2, max_len=1000, budget=None, blocks=None):
    """blocks: (num_blocks, block_size) for a paged cache; None for the contiguous one."""
    return Scheduler(policy, slots, max_len, budget, blocks and BlockManager(*blocks))


def check_blocks(s: Scheduler, chunks=()):
    """Each running request holds exactly the blocks its computed tokens fill, plus those of its chunk in a
    step planned but not yet applied (`chunks`); waiting requests hold nothing."""
    bm = s.blocks
    step = {c.request.request_id: c.num_tokens for c in chunks}
    for r in s.running:
        n = r.num_computed + step.get(r.request_id, 0)
        assert len(bm.block_table(r.request_id)) == bm.blocks_for(n), f"request {r.request_id} holds the wrong blocks"
    for r in s.waiting:
        assert r.request_id not in bm.block_tables, f"waiting request {r.request_id} still holds blocks"
    held = sum(len(t) for t in bm.block_tables.values())
    assert held + bm.num_free_blocks == bm.num_blocks


def test_continuous_refills_a_freed_slot_at_the_next_step():
    s = make(ContinuousPolicy(), slots=2)
    reqs = [request(0, 3, 1), request(1, 3, 4), request(2, 3, 2)]
    for r in reqs:
        s.add(r)
    chunks, finished = run_step(s)
    assert [(c.request.request_id, c.num_tokens) for c in chunks] == [(0, 3), (1, 3)], "prefills of the first two"
    assert finished == [reqs[0]] and reqs[0].finish_reason == "length"
    chunks, _ = run_step(s)
    assert [(c.request.request_id, c.num_tokens) for c in chunks] == [(1, 1), (2, 3)], \
        "request 2 takes request 0's slot while request 1 decodes"
    assert reqs[2].slot == 0 and reqs[2].first_scheduled_time == 0.0


def test_static_waits_for_the_whole_batch():
    s = make(StaticPolicy(), slots=2)
    reqs = [request(0, 3, 1), request(1, 3, 4), request(2, 3, 2)]
    for r in reqs:
        s.add(r)
    steps = drain(s)
    scheduled = [{c.request.request_id for c in chunks} for chunks, _ in steps]
    assert scheduled == [{0, 1}, {1}, {1}, {1}, {2}, {2}], "request 2 must wait until request 1, the longest, is done"


def test_dynamic_releases_a_full_bucket_at_once_and_a_partial_one_after_its_timeout():
    policy = DynamicPolicy(batch_size=2, bucket_width=10, timeout_s=1.0)
    s = make(policy, slots=2)
    short, long_a, long_b = request(0, 4, 2, arrival=0.0), request(1, 15, 2, arrival=0.1), request(2, 18, 2, arrival=0.2)
    for r in (short, long_a, long_b):
        s.add(r)
    chunks, _ = run_step(s, now=0.3)
    assert {c.request.request_id for c in chunks} == {1, 2}, "the full bucket (prompts 11-20 tokens) runs first"
    while s.running:
        run_step(s, now=0.4)
    assert s.schedule(now=0.5) == [] and s.seconds_until_admission(0.5) == pytest.approx(0.5), \
        "the short request waits for its bucket to fill, until 1 s after its arrival"
    chunks, _ = run_step(s, now=1.0)
    assert [c.request.request_id for c in chunks] == [0]


def test_chunked_prefill_spends_the_budget_on_decodes_first():
    s = make(ContinuousPolicy(), slots=3, budget=4)
    decoding = request(0, 2, 10)
    s.add(decoding)
    run_step(s)
    s.add(request(1, 10, 1))
    plans = []
    while s.running and len(plans) < 5:
        chunks, _ = run_step(s)
        plans.append([(c.request.request_id, c.num_tokens, c.samples) for c in chunks])
    assert plans[:4] == [
        [(0, 1, True), (1, 3, False)],   # the decode first, then 3 of the 10 prompt tokens: no sample yet
        [(0, 1, True), (1, 3, False)],
        [(0, 1, True), (1, 3, False)],
        [(0, 1, True), (1, 1, True)],    # the last chunk finishes the prompt: its first token is sampled
    ]


def test_chunks_restart_where_the_cache_stops():
    s = make(ContinuousPolicy(), slots=1, budget=3)
    r = request(0, 7, 2)
    s.add(r)
    starts = []
    while s.has_unfinished():
        starts.append(r.num_computed)
        run_step(s)
    assert starts == [0, 3, 6, 7], "chunks of 3, 3, 1 prompt tokens, then one decode"
    assert r.output_ids == [1007, 1008]


def test_finish_reasons():
    s = make(ContinuousPolicy(), slots=3, max_len=8)
    stop = request(0, 2, 10, stop={1004})          # tokens 1002, 1003, then 1004: a stop token
    length = request(1, 2, 3)
    capped = request(2, 5, 10)                     # 5 prompt + 3 output = max_len 8
    for r in (stop, length, capped):
        s.add(r)
    drain(s)
    assert (stop.output_ids, stop.finish_reason) == ([1002, 1003, 1004], "stop")
    assert (len(length.output_ids), length.finish_reason) == (3, "length")
    assert (capped.num_tokens, capped.finish_reason) == (8, "length")
    assert all(r.status is RequestStatus.FINISHED and r.slot is None for r in (stop, length, capped))


def test_preempted_request_recomputes_and_resumes():
    s = make(ContinuousPolicy(), slots=1)
    r, other = request(0, 4, 3), request(1, 2, 1)
    s.add(r)
    run_step(s)
    run_step(s)
    s.add(other)
    s.preempt(r)
    assert (r.status, r.slot, r.num_computed, r.num_preemptions) == (RequestStatus.PREEMPTED, None, 0, 1)
    assert s.waiting == [r, other], "a preempted request goes back to the front of the queue"
    chunks, _ = run_step(s)
    assert [(c.request.request_id, c.num_tokens, c.samples) for c in chunks] == [(0, 6, True)], \
        "prompt (4) and both generated tokens recomputed, and the next token sampled"
    drain(s)
    assert r.output_ids == [1004, 1005, 1006] and other.output_ids == [1002]
    with pytest.raises(ValueError, match="not running"):
        s.preempt(r)


def test_paged_blocks_are_taken_as_tokens_are_computed_and_returned_at_the_end():
    s = make(ContinuousPolicy(), slots=2, budget=3, blocks=(8, 4))
    r = request(0, 6, 5)
    s.add(r)
    tables = []
    while s.has_unfinished():
        run_step(s)
        check_blocks(s)
        tables.append(list(s.blocks.block_table(0)))
    assert tables == [[0], [0, 1], [0, 1], [0, 1], [0, 1, 2], []], \
        "prompt chunks of 3 and 3, decodes at positions 6 to 9 (8 needs a third block); all returned at the end"
    assert s.blocks.num_free_blocks == 8


def test_a_decode_without_a_free_block_preempts_the_most_recently_admitted_request():
    s = make(ContinuousPolicy(), slots=3, blocks=(3, 2))
    old, young = request(0, 2, 4), request(1, 2, 4)  # 2 + 4 tokens: the whole pool (3 blocks of 2) each
    s.add(old)
    s.add(young)
    run_step(s)                       # both prompts: a block each; one block left
    chunks, _ = run_step(s)           # old's decode takes the last block; young's decode needs one: none left
    assert [c.request.request_id for c in chunks] == [0], "young preempted itself: nobody younger holds blocks"
    assert (young.status, young.num_preemptions, young.num_computed) == (RequestStatus.PREEMPTED, 1, 0)
    assert s.waiting == [young] and young.output_ids == [1002], "its output so far is kept, to be recomputed"
    steps = drain(s)
    assert old.output_ids == [1002 + k for k in range(4)] and young.output_ids == old.output_ids
    assert s.num_preemptions == young.num_preemptions and s.blocks.num_free_blocks == 3
    recompute = [c for chunks, _ in steps for c in chunks if c.request is young][0]
    assert (recompute.start, recompute.num_tokens, recompute.samples) == (0, 3, True), \
        "readmitted: prompt (2) and output (1) in one prefill, which samples the next token"


def test_admission_waits_until_the_whole_prompt_fits():
    s = make(ContinuousPolicy(), slots=3, blocks=(4, 4))
    first, second = request(0, 9, 3), request(1, 8, 1)   # 3 blocks, then 2: not both at once
    s.add(first)
    s.add(second)
    chunks, _ = run_step(s)
    assert [c.request for c in chunks] == [first] and s.waiting == [second]
    while first.status is not RequestStatus.FINISHED:
        run_step(s)
    chunks, _ = run_step(s)
    assert [c.request for c in chunks] == [second]


def test_a_request_longer_than_the_pool_stops_at_the_pool():
    s = make(ContinuousPolicy(), slots=1, max_len=100, blocks=(3, 4))
    r = request(0, 5, 50)
    s.add(r)
    drain(s)
    assert (r.num_tokens, r.finish_reason, r.num_preemptions) == (12, "length", 0), \
        "capped at 3 blocks x 4 positions, like max_model_len"


def test_update_rejects_a_wrong_number_of_tokens():
    s = make(ContinuousPolicy())
    s.add(request(0, 3, 2))
    chunks = s.schedule(0.0)
    with pytest.raises(ValueError, match="sampled"):
        s.update(chunks, [], 0.0)


@pytest.mark.parametrize("kwargs,match", [({"num_slots": 0}, "num_slots"), ({"token_budget": 0}, "token_budget")])
def test_bad_scheduler_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Scheduler(ContinuousPolicy(), **{"num_slots": 2, "max_model_len": 10, **kwargs})
    with pytest.raises(ValueError, match="scheduling"):
        make_policy("fifo", 2)


work = st.lists(st.tuples(st.integers(1, 12), st.integers(1, 6), st.integers(0, 8)), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(work=work, policy=st.sampled_from(["static", "dynamic", "continuous"]), slots=st.integers(1, 4),
       budget=st.one_of(st.none(), st.integers(1, 10)))
def test_every_request_finishes_under_every_policy(work, policy, slots, budget):
    """Requests (prompt length, max_tokens, arrival step) arrive over time; whatever the policy, slots and
    budget, each one gets exactly its tokens and the step-level rules of its policy hold."""
    s = Scheduler(make_policy(policy, slots, bucket_width=4, timeout_s=2), slots, 1000, budget)
    reqs = [request(i, p, m, arrival=a) for i, (p, m, a) in enumerate(work)]
    last_arrival = max(a for _, _, a in work)
    step = 0
    while s.has_unfinished() or step <= last_arrival:
        assert step < 10_000, "scheduler made no progress"
        for r in reqs:
            if r.arrival_time == step:
                s.add(r)
        was_running = list(s.running)
        chunks = s.schedule(now=step)
        tokens = sum(c.num_tokens for c in chunks)
        if budget is not None:  # decodes (one token each) are never skipped, prompt chunks share what is left
            assert tokens <= max(budget, len(chunks)), f"step {step}: {tokens} tokens for a budget of {budget}"
        admitted = [r.request_id for r in s.running if r not in was_running]
        if policy != "continuous" and was_running:
            assert not admitted, f"step {step}: {policy} admitted {admitted} while a batch was running"
        if policy == "continuous" and budget is None:
            assert not (s.waiting and s.free_slots), f"step {step}: a slot idles while requests wait"
        s.update(chunks, [fake_token(c.request) for c in chunks if c.samples], now=step)
        step += 1
    for r in reqs:
        assert r.status is RequestStatus.FINISHED, f"request {r.request_id} never finished"
        assert r.output_ids == [1000 + len(r.prompt_ids) + k for k in range(r.params.max_tokens)]


@settings(max_examples=80, deadline=None)
@given(work=work, policy=st.sampled_from(["static", "dynamic", "continuous"]), slots=st.integers(1, 4),
       budget=st.one_of(st.none(), st.integers(1, 10)), num_blocks=st.integers(4, 14), block_size=st.integers(1, 4))
def test_paged_every_request_finishes_with_its_tokens_and_no_block_leaks(work, policy, slots, budget, num_blocks,
                                                                         block_size):
    """The same random workloads on a small block pool: requests get preempted and recomputed, yet each one
    gets exactly the tokens it would get alone, block tables always match what has been computed, and the
    pool is whole at the end."""
    pool = num_blocks * block_size
    s = Scheduler(make_policy(policy, slots, bucket_width=4, timeout_s=2), slots, 1000, budget,
                  BlockManager(num_blocks, block_size))
    reqs = [request(i, min(p, pool - 1), m, arrival=a) for i, (p, m, a) in enumerate(work)]
    last_arrival = max(a for _, _, a in work)
    step = 0
    while s.has_unfinished() or step <= last_arrival:
        assert step < 10_000, "scheduler made no progress"
        for r in reqs:
            if r.arrival_time == step:
                s.add(r)
        chunks = s.schedule(now=step)
        check_blocks(s, chunks)
        assert all(c.request.status is RequestStatus.RUNNING for c in chunks), "a preempted request was scheduled"
        s.update(chunks, [fake_token(c.request) for c in chunks if c.samples], now=step)
        step += 1
    for r in reqs:
        assert r.status is RequestStatus.FINISHED, f"request {r.request_id} never finished"
        n = min(r.params.max_tokens, pool - len(r.prompt_ids))
        assert r.output_ids == [1000 + len(r.prompt_ids) + k for k in range(n)]
    assert s.blocks.num_free_blocks == num_blocks and not s.blocks.block_tables
    assert s.num_preemptions == sum(r.num_preemptions for r in reqs)
