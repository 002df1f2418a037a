"""Lab 04: a continuous-batching scheduler.

You write the loop at the heart of a serving engine. At every step it
  1. admits waiting requests into free cache slots (first come, first served),
  2. runs ONE model step for the whole batch (`step_fn`), which returns one new token per running request,
  3. evicts the requests that just finished, so their slots are free for the next step.
That is Orca's iteration-level scheduling: nobody waits for the longest request of a batch.

Fill in every function marked TODO in labs/lab04_continuous_batching.py, then grade your work with

    pytest tests/labs/test_lab04.py --impl=labs

Pure Python: the model hides behind `step_fn`. `make_model_step` (given) builds one from a real model
and a contiguous KV cache, so the same scheduler also drives real generation; `EnginePolicy` (given) plugs your
admission rule into the serving engine, `mini_engine.LLM`, in place of its own continuous batching.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from mini_engine.attention import AttentionMetadata


@dataclass
class Request:
    """One generation request. Given: nothing to fill in here.

    `output` grows by one token per step while the request runs. The scheduler sets `slot` (the cache row it
    owns while running), `admitted_step` and `finished_step` (the step in which it got its last token)."""
    request_id: int
    prompt: list[int]
    max_tokens: int
    arrival_step: int = 0
    stop_token_id: int | None = None
    output: list[int] = field(default_factory=list)
    slot: int | None = None
    admitted_step: int | None = None
    finished_step: int | None = None


def is_finished(request: Request) -> bool:
    """True once the request has `max_tokens` output tokens, or its last output token is its
    `stop_token_id` (when that is not None)."""
    # TODO: two ways a request ends (see the docstring).
    raise NotImplementedError("lab04 is_finished: a request ends at its length limit or at its stop token; which of "
                              "its tokens can be the stop?")


class ContinuousBatcher:
    """Runs requests through `step_fn` with at most `num_slots` of them in the batch at once.

    `step_fn(batch)` takes the list of running requests and returns one new token per request, in the same
    order (for a request with no output yet it runs the prompt: prefill; otherwise it decodes its last token).

    State (given): `waiting` (requests not admitted yet, in the order they were added), `running` (the batch),
    `free_slots` (slot numbers nobody holds), `step_count` (steps done so far) and `timeline` (one row per
    step: for each slot, the id of the request that ran in it, or None)."""

    def __init__(self, step_fn: Callable[[list[Request]], list[int]], num_slots: int):
        self.step_fn, self.num_slots = step_fn, num_slots
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.free_slots: list[int] = list(range(num_slots))
        self.step_count = 0
        self.timeline: list[list[int | None]] = []

    def add_request(self, request: Request) -> None:
        """Queue a request; it may be admitted from step `request.arrival_step` on."""
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        """Whether any request is still waiting or running."""
        return bool(self.waiting or self.running)

    def admit(self) -> list[Request]:
        """Move waiting requests that have arrived (arrival_step <= step_count) into the batch, in the order they
        were added, while free slots remain. Give each one a slot from `free_slots` and set its admitted_step.
        Requests that have not arrived yet stay in `waiting`, in order. Returns the admitted requests."""
        # TODO: first come, first served, among the requests that have arrived.
        raise NotImplementedError("lab04 admit: which waiting requests may start at this step, and what does each "
                                  "take and record when it does?")

    def evict(self) -> list[Request]:
        """Remove every finished request (see `is_finished`) from the batch, give its slot back to
        `free_slots`, set its slot to None and its finished_step to the current step. Returns them."""
        # TODO: is_finished says who is done; what must a finished request give back?
        raise NotImplementedError("lab04 evict: a finished request leaves the batch and returns what it held; which "
                                  "of its fields record that?")

    def step(self) -> list[Request]:
        """One iteration: admit, run `step_fn` once on the whole batch (not at all if the batch is empty) and
        append each returned token to its request's output, record the timeline row (which request held which
        slot during this step), evict, and advance step_count. Returns the requests that finished."""
        # TODO: one iteration, in the docstring's order; the timeline row shows the slots as the batch held them.
        raise NotImplementedError("lab04 step: one iteration in the docstring's order; what happens when nobody is "
                                  "running?")

    def run(self) -> list[Request]:
        """Step until no request is waiting or running; return every request in the order they finished."""
        # TODO: step until nothing is left.
        raise NotImplementedError("lab04 run: what tells you the work is done, and what does each step hand back?")


def make_model_step(model, kv_cache) -> Callable[[list[Request]], list[int]]:
    """Given: a greedy `step_fn` over a real mini_engine model and a ContiguousKVCache with at least
    `num_slots` slots. Each request's keys and values live in its slot's cache row, so a request must keep
    its slot while it runs, and two running requests must never share one."""
    def step(batch: list[Request]) -> list[int]:
        ids, query_lens, context_lens, slots = [], [], [], []
        for r in batch:
            new = r.prompt if not r.output else r.output[-1:]  # prefill the prompt, or decode the last token
            ids += new
            query_lens.append(len(new))
            context_lens.append(len(r.prompt) + len(r.output))
            slots.append(r.slot)
        meta = AttentionMetadata.build(query_lens, context_lens, slots, device=model.device, last_only=True)
        logits = model(torch.tensor(ids, device=model.device), meta, kv_cache)
        return logits.argmax(dim=-1).tolist()
    return step


class EnginePolicy:
    """Given: your `ContinuousBatcher.admit` as the serving engine's scheduling policy, `LLM(...,
    scheduling=EnginePolicy())` (the engine takes any object with these two methods; see `EngineConfig`).

    The engine keeps its own requests, slots and steps, and at every step asks its policy which waiting requests
    to start. This adapter puts the question to your batcher: the engine's waiting requests become your
    `Request`s (all of them have arrived), its free slots your `free_slots`, and the requests your `admit` takes
    start in the order it took them, while the step's token budget lasts (your batcher knows nothing of tokens)."""
    name = "lab04"

    def admit(self, waiting, running, free_slots: int, budget: float, now: float) -> list:
        batcher = ContinuousBatcher(step_fn=None, num_slots=free_slots)
        for i, r in enumerate(waiting):
            batcher.add_request(Request(i, list(r.prompt_ids), r.params.max_tokens))
        started = []
        for mine in batcher.admit():
            if budget <= 0:
                break
            r = waiting[mine.request_id]
            started.append(r)
            budget -= r.num_uncomputed - r.num_cached_hint  # a prefix-cache hit costs the step nothing
        if waiting and free_slots and budget > 0 and not running and not started:
            raise RuntimeError(f"admit() started none of {len(waiting)} waiting requests with {free_slots} slots "
                               "free and nothing running: the engine would wait forever")
        return started

    def seconds_until_admission(self, waiting, running, now: float) -> float:
        return 0.0  # every request in the engine's queue has arrived: admission never waits for a clock
