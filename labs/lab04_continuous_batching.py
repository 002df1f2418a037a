"""Lab 04: a continuous-batching scheduler.

You write the loop at the heart of a serving engine. At every step it
  1. admits waiting requests into free cache slots (first come, first served),
  2. runs ONE model step for the whole batch (`step_fn`), which returns one new token per running request,
  3. evicts the requests that just finished, so their slots are free for the next step.
That is Orca's iteration-level scheduling: nobody waits for the longest request of a batch.

Fill in every function marked TODO in labs/lab04_continuous_batching.py, then grade your work with

    pytest tests/labs/test_lab04.py --impl=labs

Pure Python: the model hides behind `step_fn`. `make_model_step` (given) builds one from a real model
and a contiguous KV cache, so the same scheduler also drives real generation.
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
    # TODO: compare len(request.output) with max_tokens, and the last output token with stop_token_id
    raise NotImplementedError("lab04 is_finished: compare len(request.output) with max_tokens, and the last output token with stop_token_id")


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
        # TODO: walk self.waiting in order; admit requests that have arrived while self.free_slots is not empty
        raise NotImplementedError("lab04 admit: walk self.waiting in order; admit requests that have arrived while self.free_slots is not empty")

    def evict(self) -> list[Request]:
        """Remove every finished request (see `is_finished`) from the batch, give its slot back to
        `free_slots`, set its slot to None and its finished_step to the current step. Returns them."""
        # TODO: find the finished requests in self.running, remove them and put their slots back in self.free_slots
        raise NotImplementedError("lab04 evict: find the finished requests in self.running, remove them and put their slots back in self.free_slots")

    def step(self) -> list[Request]:
        """One iteration: admit, run `step_fn` once on the whole batch (not at all if the batch is empty) and
        append each returned token to its request's output, record the timeline row (which request held which
        slot during this step), evict, and advance step_count. Returns the requests that finished."""
        # TODO: admit; call self.step_fn once with the running batch; append tokens; record the timeline row; evict; count the step
        raise NotImplementedError("lab04 step: admit; call self.step_fn once with the running batch; append tokens; record the timeline row; evict; count the step")

    def run(self) -> list[Request]:
        """Step until no request is waiting or running; return every request in the order they finished."""
        # TODO: call self.step() until self.has_unfinished() is False, collecting what each step returns
        raise NotImplementedError("lab04 run: call self.step() until self.has_unfinished() is False, collecting what each step returns")


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
