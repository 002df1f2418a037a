"""Grades lab 04 (a continuous-batching scheduler) in either tree via the `impl` fixture.

    pytest tests/labs/test_lab04.py --impl=labs        # your work
    pytest tests/labs/test_lab04.py --impl=solutions   # the reference answers

Most tests drive your scheduler with a fake model whose n-th token for a request is 100 * request_id + n,
so every output is known in advance; the last ones drive it with a real (tiny) model and KV cache.
"""
import random

import pytest
import torch

import mini_engine as me
from mini_engine import engine, generate, scheduler, simulate
from mini_engine.config import ModelConfig
from mini_engine.kv_cache import ContiguousKVCache
from mini_engine.model import LlamaModel
from mini_engine.course.simulate import simulate_continuous

LAB = "lab04_continuous_batching"
# The engine's scheduler, its batching simulator (which the tests below compare against), its serving engine
# and its generation loops already do this lab's job: a lab function or a ContinuousBatcher method that calls
# any of them fails (see conftest.py).
SHORTCUTS = {
    "is_finished": [scheduler],
    "ContinuousBatcher": [scheduler, simulate, engine, generate.generate_naive, generate.generate_cached,
                          generate.generate_batch],
}


class FakeModel:
    """A step_fn that records every batch it is given and answers 100 * request_id + len(output)."""

    def __init__(self):
        self.batches: list[list[int]] = []

    def __call__(self, batch):
        self.batches.append([r.request_id for r in batch])
        return [100 * r.request_id + len(r.output) for r in batch]


def batcher(impl, num_slots, specs, model=None):
    """specs: (max_tokens, arrival_step) per request, ids 0, 1, ..."""
    b = impl.ContinuousBatcher(model or FakeModel(), num_slots)
    reqs = [impl.Request(i, [1, 2, 3], n, arrival_step=a) for i, (n, a) in enumerate(specs)]
    for r in reqs:
        b.add_request(r)
    return b, reqs


def test_is_finished(impl):
    r = impl.Request(0, [1], max_tokens=3, stop_token_id=7)
    assert not impl.is_finished(r), "a request with no output yet is not finished"
    r.output = [5, 6]
    assert not impl.is_finished(r), "2 of max_tokens=3 tokens: not finished"
    r.output = [5, 6, 8]
    assert impl.is_finished(r), "a request with max_tokens output tokens is finished"
    r.output = [7]
    assert impl.is_finished(r), "a request whose last token is its stop_token_id is finished"
    r.output = [7, 5]
    assert not impl.is_finished(r), "only the LAST token counts as a stop (a stop earlier would have ended it)"
    assert not impl.is_finished(impl.Request(1, [1], max_tokens=3, stop_token_id=None, output=[0])), \
        "stop_token_id=None means: no stop token"


def test_admit_fills_free_slots_in_order(impl):
    b, reqs = batcher(impl, 2, [(3, 0), (3, 0), (3, 0)])
    admitted = b.admit()
    assert [r.request_id for r in admitted] == [0, 1], "admit the first requests added, as many as there are slots"
    assert [r.request_id for r in b.running] == [0, 1] and [r.request_id for r in b.waiting] == [2], \
        "admitted requests move from self.waiting to self.running; the rest stay waiting"
    assert sorted(r.slot for r in admitted) == [0, 1] and b.free_slots == [], \
        "each admitted request takes one slot out of self.free_slots"
    assert all(r.admitted_step == 0 for r in admitted), "set admitted_step to the current step_count"
    assert b.admit() == [], "no free slot, nothing admitted"


def test_admit_skips_requests_that_have_not_arrived(impl):
    b, reqs = batcher(impl, 3, [(3, 2), (3, 0), (3, 5), (3, 1)])
    assert [r.request_id for r in b.admit()] == [1], "only request 1 has arrived at step 0 (arrival_step <= step_count)"
    assert [r.request_id for r in b.waiting] == [0, 2, 3], "requests that have not arrived stay waiting, in order"
    b.step_count = 2
    assert [r.request_id for r in b.admit()] == [0, 3], "at step 2, requests 0 and 3 have arrived"


def test_evict_frees_slots(impl):
    b, reqs = batcher(impl, 2, [(1, 0), (3, 0)])
    b.admit()
    reqs[0].output, reqs[1].output = [9], [9]
    b.step_count = 4
    finished = b.evict()
    assert finished == [reqs[0]], "evict returns exactly the finished requests"
    assert b.running == [reqs[1]], "finished requests leave self.running; the others stay"
    assert reqs[0].slot is None and reqs[0].finished_step == 4, "set the slot to None and finished_step to step_count"
    assert len(b.free_slots) == 1 and b.free_slots[0] not in (reqs[1].slot, None), \
        "the finished request's slot goes back to self.free_slots"


def test_step_runs_the_model_once_for_the_whole_batch(impl):
    model = FakeModel()
    b, reqs = batcher(impl, 2, [(2, 0), (3, 0), (1, 0)], model)
    finished = b.step()
    assert model.batches == [[0, 1]], "step 0: admit requests 0 and 1, then ONE call of step_fn with both"
    assert reqs[0].output == [0] and reqs[1].output == [100], "append each returned token to its request's output"
    assert finished == [] and b.step_count == 1, "nobody finished yet; step_count advanced to 1"
    assert b.timeline == [[0, 1]] or b.timeline == [[1, 0]], \
        "timeline row: for each slot, the id of the request that ran in it"
    b.step()
    assert reqs[0].finished_step == 1 and model.batches[-1] == [0, 1]
    b.step()
    assert model.batches[-1] == [1, 2], "the slot request 0 freed is taken by request 2 at the very next step"


def test_an_empty_step_does_not_call_the_model(impl):
    model = FakeModel()
    b, reqs = batcher(impl, 2, [(1, 2)], model)
    assert b.step() == [] and model.batches == [], "no request has arrived: do not call step_fn with an empty batch"
    assert b.timeline == [[None, None]] and b.step_count == 1, "still record the (empty) row and count the step"


@pytest.mark.parametrize("num_slots", [1, 3, 4])
def test_requests_finishing_at_different_steps(impl, num_slots):
    """All waiting at step 0: the admission and finish steps must match the course's batching simulator."""
    lengths = [5, 1, 3, 8, 2, 2, 7, 1, 4, 6]
    b, reqs = batcher(impl, num_slots, [(n, 0) for n in lengths])
    done = b.run()
    assert sorted(r.request_id for r in done) == list(range(len(lengths))), "run() returns every request once"
    assert [r.finished_step for r in done] == sorted(r.finished_step for r in done), \
        "run() returns requests in the order they finished"
    sim = simulate_continuous(lengths, num_slots)
    for r in reqs:
        assert r.output == [100 * r.request_id + k for k in range(r.max_tokens)], f"request {r.request_id} tokens"
        assert (r.admitted_step, r.finished_step) == (sim.start_step[r.request_id], sim.finish_step[r.request_id] - 1), (
            f"request {r.request_id} (max_tokens {r.max_tokens}) should run from step {sim.start_step[r.request_id]} "
            f"to step {sim.finish_step[r.request_id] - 1}: is a freed slot refilled at the very next step?")
    assert len(b.timeline) == sim.steps, f"{sim.steps} steps in all, one timeline row each"


def test_arrivals_mid_run(impl):
    model = FakeModel()
    b, reqs = batcher(impl, 2, [(4, 0), (2, 0), (3, 1), (1, 6), (2, 6), (2, 6)], model)
    b.run()
    assert model.batches == [[0, 1], [0, 1], [0, 2], [0, 2], [2], [3, 4], [4, 5], [5]], (
        "step 2: request 2 (arrived at step 1) takes request 1's slot; step 5: nobody to run; "
        "step 6: requests 3 and 4 arrive and start at once; request 5 takes the first slot that frees")
    assert [r.admitted_step for r in reqs] == [0, 0, 2, 6, 6, 7]


def test_no_slot_idles_while_a_request_waits(impl):
    rng = random.Random(0)
    specs = [(rng.randint(1, 6), rng.randint(0, 30)) for _ in range(40)]
    b, reqs = batcher(impl, 3, specs)
    while b.has_unfinished():
        b.step()
        arrived = [r for r in b.waiting if r.arrival_step <= b.step_count - 1]
        assert not (arrived and None in b.timeline[-1]), (
            f"step {b.step_count - 1}: a slot stayed empty while requests {[r.request_id for r in arrived]} "
            "had arrived and were waiting")
        assert b.step_count < 1000, "run does not finish: are finished requests evicted?"
    assert all(impl.is_finished(r) for r in reqs)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=128, eos_token_id=None)
    model = LlamaModel(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)  # sharp logits, so greedy choices are never near-ties
    return model.eval()


def test_drives_a_real_model(impl, tiny):
    """Your scheduler runs a real model over a real KV cache: every request must get exactly the tokens it
    gets when generated alone. Slots are reused, so a slot handed to two requests at once corrupts both."""
    rng = random.Random(1)
    cache = ContiguousKVCache(tiny.config, num_slots=3, max_len=64)
    b = impl.ContinuousBatcher(impl.make_model_step(tiny, cache), 3)
    reqs = [impl.Request(i, [rng.randrange(128) for _ in range(rng.randint(1, 20))], rng.randint(1, 12),
                         arrival_step=rng.randint(0, 15)) for i in range(10)]
    for r in reqs:
        b.add_request(r)
    b.run()
    for r in reqs:
        expected = me.generate_cached(tiny, r.prompt, r.max_tokens)
        assert r.output == expected, (f"request {r.request_id}: got {r.output}, generating it alone gives {expected}; "
                                      "does every running request keep its own slot until it finishes?")


def test_stop_token_ends_a_request_early(impl, tiny):
    cache = ContiguousKVCache(tiny.config, num_slots=2, max_len=64)
    free = me.generate_cached(tiny, [1, 2, 3], 10)
    b = impl.ContinuousBatcher(impl.make_model_step(tiny, cache), 2)
    r = impl.Request(0, [1, 2, 3], 10, stop_token_id=free[3])
    b.add_request(r)
    b.run()
    assert r.output == free[:free.index(free[3]) + 1], "stop right after the stop token (and keep it)"
