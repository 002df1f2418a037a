"""Grades lab 04 (a continuous-batching scheduler) in either tree via the `impl` fixture.

    pytest tests/labs/test_lab04.py --impl=labs        # your work
    pytest tests/labs/test_lab04.py --impl=solutions   # the reference answers

Most tests drive your scheduler with a fake model whose n-th token for a request is 100 * request_id + n,
so every output is known in advance; the last ones drive it with a real (tiny) model and KV cache.
"""
import importlib
import math
import random
import types

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


# ---------------------------------------------------------------- your admission rule in the serving engine


def serve(model, tok, scheduling, prompts, params, slots=3):
    """The workload through `LLM` with this policy: each request's tokens, and what each engine step ran
    (request id and token count per chunk)."""
    llm = me.LLM.from_model(model, tok, kv_cache="contiguous", scheduling=scheduling, max_num_seqs=slots,
                            max_model_len=max(len(p) + sp.max_tokens for p, sp in zip(prompts, params)),
                            chunked_prefill_tokens=512, record_trace=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.token_ids for o in outs], [[(rid, n) for rid, _, n, _ in step.chunks] for step in llm.engine.trace]


def mixed_workload(n=6, seed=0):
    """Chapter 04's kind of workload, smaller: prompts and output lengths spread over a range, ignore_eos."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 20000) for _ in range(rng.randint(8, 32))] for _ in range(n)]
    return prompts, [me.SamplingParams(max_tokens=rng.randint(2, 8), ignore_eos=True) for _ in range(n)]


def test_your_admit_serves_the_engine(impl, real_model):
    """Plugged into `LLM` through `EnginePolicy`, your admission rule must schedule exactly as the engine's own
    continuous batching does, and so give every request the same tokens."""
    model, tok = real_model
    prompts, params = mixed_workload()
    got, steps = serve(model, tok, impl.EnginePolicy(), prompts, params)
    expected, engine_steps = serve(model, tok, "continuous", prompts, params)
    assert got == expected, (
        "with your admit as the engine's policy some requests got other tokens than under the engine's continuous "
        f"batching: {[i for i, (a, b) in enumerate(zip(got, expected)) if a != b]}")
    first = next((i for i, (a, b) in enumerate(zip(steps, engine_steps)) if a != b),
                 min(len(steps), len(engine_steps)))
    assert steps == engine_steps, (
        f"engine step {first}: your policy ran {steps[first] if first < len(steps) else 'nothing'} (request id, "
        f"tokens), continuous batching runs {engine_steps[first] if first < len(engine_steps) else 'nothing'}: "
        "does admit fill every free slot with the waiting requests, first come, first served?")


# ---------------------------------------------------------------- the guards (see conftest.py)

solution = importlib.import_module(f"solutions.{LAB}")  # what a hand-off may build on besides the engine


def is_finished_by_the_engine(request):
    stops = frozenset() if request.stop_token_id is None else frozenset({request.stop_token_id})
    twin = scheduler.Request(request.request_id, request.prompt, me.SamplingParams(max_tokens=request.max_tokens),
                             stops, 0.0, output_ids=list(request.output))
    last = request.output[-1] if request.output else None
    engine_side = types.SimpleNamespace(max_model_len=math.inf)
    return scheduler.Scheduler._finish_reason(engine_side, twin, last) is not None


def admit_by_the_engine(batcher):
    """The engine's continuous policy picks which arrived requests start; the batcher gives them slots."""
    arrived = [types.SimpleNamespace(request=r, num_uncomputed=len(r.prompt), num_cached_hint=0)
               for r in batcher.waiting if r.arrival_step <= batcher.step_count]
    chosen = scheduler.ContinuousPolicy().admit(arrived, batcher.running, len(batcher.free_slots), math.inf, 0.0)
    for r in (view.request for view in chosen):
        batcher.waiting.remove(r)
        r.slot, r.admitted_step = batcher.free_slots.pop(0), batcher.step_count
        batcher.running.append(r)
    return [view.request for view in chosen]


class AdmitByTheEngine(solution.ContinuousBatcher):
    def admit(self):
        return admit_by_the_engine(self)


class EvictByTheEngine(solution.ContinuousBatcher):
    def evict(self):
        finished = [r for r in self.running if solution.is_finished(r)]
        engine_side = types.SimpleNamespace(running=self.running, free_slots=self.free_slots, blocks=None)
        for r in finished:
            r.forks = []  # the engine's requests carry the samples they will fork
            scheduler.Scheduler._release(engine_side, r)
            r.finished_step = self.step_count
        return finished


class StepAdmittingByTheEngine(solution.ContinuousBatcher):
    def step(self):
        admit_by_the_engine(self)
        row = [None] * self.num_slots
        if self.running:
            for r, token in zip(self.running, self.step_fn(list(self.running))):
                r.output.append(token)
                row[r.slot] = r.request_id
        self.timeline.append(row)
        finished = self.evict()
        self.step_count += 1
        return finished


class RunPlannedByTheSimulator(solution.ContinuousBatcher):
    """run() takes the schedule from the course's batching simulator and only runs the model along it."""

    def run(self):
        requests, self.waiting = list(self.waiting), []
        plan = simulate.simulate_continuous([r.max_tokens for r in requests], self.num_slots)
        for step in range(plan.steps):
            for i, r in enumerate(requests):
                if plan.start_step[i] == step:
                    r.slot, r.admitted_step = int(plan.lane[i]), step
                    self.running.append(r)
            for r, token in zip(self.running, self.step_fn(list(self.running))):
                r.output.append(token)
            self.timeline.append([None if i < 0 else requests[i].request_id for i in plan.timeline[step]])
            for r in [r for r in self.running if solution.is_finished(r)]:
                self.running.remove(r)
                r.slot, r.finished_step = None, step
            self.step_count += 1
        return sorted(requests, key=lambda r: r.finished_step)


# Each part of the lab handed to something that already does it, and a grading test that must fail it.
HAND_OFFS = [
    ("is_finished", is_finished_by_the_engine, test_is_finished, {}),
    ("ContinuousBatcher.admit", AdmitByTheEngine, test_admit_skips_requests_that_have_not_arrived, {}),
    ("ContinuousBatcher.evict", EvictByTheEngine, test_evict_frees_slots, {}),
    ("ContinuousBatcher.step", StepAdmittingByTheEngine, test_step_runs_the_model_once_for_the_whole_batch, {}),
    ("ContinuousBatcher.run", RunPlannedByTheSimulator, test_requests_finishing_at_different_steps, {"num_slots": 3}),
]


def test_every_part_of_the_lab_has_a_hand_off_check(asked_for):
    missing = set(asked_for(LAB)) - {part for part, *_ in HAND_OFFS}
    assert not missing, f"parts of the lab with no hand-off check above: {sorted(missing)}"


@pytest.mark.parametrize("part,replacement,test,args", HAND_OFFS,
                         ids=[f"{part}-{i}" for i, (part, *_) in enumerate(HAND_OFFS)])
def test_the_grader_fails_a_part_handed_off(hand_off, part, replacement, test, args):
    hand_off(part, replacement, test, **args)


# Source text, so that the given EnginePolicy, which looks ContinuousBatcher up when it runs, uses it.
ADMIT_ONE_A_STEP = """
class ContinuousBatcher(ContinuousBatcher):
    def admit(self):
        return super().admit()[:1]
"""


def test_the_engine_check_catches_a_policy_that_starts_one_request_a_step(mutant, real_model):
    with pytest.raises(AssertionError, match="engine step 0: your policy ran"):
        test_your_admit_serves_the_engine(mutant(ContinuousBatcher=ADMIT_ONE_A_STEP), real_model)
