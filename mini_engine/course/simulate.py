"""Discrete simulators for the batching and memory chapters: fast enough to run on every slider move.

Batching model (chapter 04): every request is waiting at step 0 and needs `length` decode steps; a lane
of the batch emits one token of one request per step; prefill is folded into a request's first step.
What differs between policies is only when a free lane may take the next waiting request:

- static: a batch of `batch_size` requests runs until its longest member is done, then the next batch starts
  (with every request already waiting, a dynamic batcher that collects requests for a time window forms
  the same batches);
- continuous (Orca's iteration-level scheduling): a lane that frees up takes the next request at once.

With lengths uniform in [1, 200] (`sample_lengths(1000, mean=100, spread=1.0)`) and 32 lanes, static
batching keeps about 51% of lane-steps busy and continuous batching about 97%: the textbook's "lifting
utilization ~50% → ~90%".

Memory model (chapter 07): a KV budget of token slots, filled either by contiguous reservations or by
fixed-size blocks. `simulate_kv_budget` counts how many requests of a length mix each layout admits at once;
`simulate_kv_layouts` runs a queue through the budget over time, requests finishing and new ones taking their
place, which is where a contiguous layout's free memory can end up in holes too small to use.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BatchRun:
    """Outcome of one batching simulation. Steps are 0-based; request i occupies `lane[i]` during steps
    start_step[i] .. finish_step[i] − 1, so `finish_step` is also its latency in steps."""

    policy: str
    batch_size: int
    lengths: np.ndarray
    start_step: np.ndarray
    finish_step: np.ndarray
    lane: np.ndarray
    timeline: np.ndarray  # [steps, lanes]: id of the request a lane serves at that step, -1 when idle

    @property
    def steps(self) -> int:
        return self.timeline.shape[0]

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def utilisation(self) -> float:
        """Busy lane-steps / all lane-steps: the share of the batch's compute that produced tokens."""
        return float((self.timeline >= 0).sum() / self.timeline.size)

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps

    @property
    def mean_latency_steps(self) -> float:
        return float(self.finish_step.mean())


def sample_lengths(n: int, mean: float, spread: float, seed: int = 0) -> np.ndarray:
    """`n` output lengths uniform in [mean · (1 − spread), mean · (1 + spread)], at least 1.

    spread = 0 gives identical requests (static batching wastes nothing); spread = 1 gives lengths uniform
    in [1, 2 · mean], the mix behind the module's 51% → 97% figures.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if mean < 1:
        raise ValueError(f"mean must be >= 1, got {mean}")
    if not 0 <= spread <= 1:
        raise ValueError(f"spread must lie in [0, 1], got {spread}")
    low = max(1, round(mean * (1 - spread)))
    high = max(low, round(mean * (1 + spread)))
    return np.random.default_rng(seed).integers(low, high + 1, size=n)


def _check(lengths, batch_size) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1 or lengths.size == 0:
        raise ValueError("lengths must be a non-empty 1-D sequence of output lengths")
    if np.any(lengths < 1):
        raise ValueError("lengths: every request needs at least one step")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return lengths


def _run(policy, lengths, batch_size, start, lane) -> BatchRun:
    finish = start + lengths
    timeline = np.full((int(finish.max()), batch_size), -1, dtype=np.int64)
    for i, (s, f, ln) in enumerate(zip(start, finish, lane)):
        timeline[s:f, ln] = i
    return BatchRun(policy, batch_size, lengths, start, finish, lane, timeline)


def simulate_static(lengths, batch_size: int) -> BatchRun:
    """Requests in arrival order, `batch_size` at a time; a batch ends when its longest request ends."""
    lengths = _check(lengths, batch_size)
    ids = np.arange(len(lengths))
    start = np.empty_like(lengths)
    step = 0
    for first in range(0, len(lengths), batch_size):
        start[first:first + batch_size] = step
        step += lengths[first:first + batch_size].max()  # the whole batch waits for its longest request
    return _run("static", lengths, batch_size, start, lane=ids % batch_size)


def simulate_continuous(lengths, batch_size: int) -> BatchRun:
    """Each lane takes the next waiting request (in arrival order) the step after its last one finished."""
    lengths = _check(lengths, batch_size)
    start = np.empty_like(lengths)
    lane = np.empty_like(lengths)
    free_at = [(0, ln) for ln in range(batch_size)]  # (step the lane frees, lane): a valid heap already
    for i, length in enumerate(lengths):
        step, ln = heapq.heappop(free_at)
        start[i], lane[i] = step, ln
        heapq.heappush(free_at, (step + int(length), ln))
    return _run("continuous", lengths, batch_size, start, lane)


# ---------------------------------------------------------------- chapter 07: a fixed KV budget

LENGTH_MIXES = ("uniform", "lognormal")


def sample_context_lengths(n: int, mix: str, mean_len: float, max_model_len: int, sigma: float = 1.0,
                           seed: int = 0) -> np.ndarray:
    """Final context lengths (prompt + output) of `n` requests, capped to [1, max_model_len].

    - "uniform": uniform in [1, 2 · mean_len] (`sample_lengths` with spread 1), the textbook mix;
    - "lognormal": chat-like, most requests short and a long tail: log-lengths normal with spread `sigma`,
      centred so that the mean before the cap is `mean_len` (with sigma = 1 the median is 61% of the mean
      and about one request in 13 is over 2.5 times the mean).
    """
    if mix not in LENGTH_MIXES:
        raise ValueError(f"mix must be one of {LENGTH_MIXES}, got {mix!r}")
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    if mix == "uniform":
        lengths = sample_lengths(n, mean_len, 1.0, seed)
    else:
        if mean_len < 1:
            raise ValueError(f"mean_len must be >= 1, got {mean_len}")
        if sigma <= 0:
            raise ValueError(f"sigma must be > 0, got {sigma}")
        mu = np.log(mean_len) - sigma ** 2 / 2  # E[exp(N(mu, sigma^2))] = exp(mu + sigma^2 / 2)
        lengths = np.round(np.random.default_rng(seed).lognormal(mu, sigma, size=n)).astype(np.int64)
    return np.clip(lengths, 1, max_model_len)


@dataclass(frozen=True)
class KVBudgetRun:
    """Contiguous reservation vs paged blocks for one queue of requests on a fixed KV budget (chapter 07).

    Both layouts admit requests in arrival order until the next one does not fit. Contiguous: every
    request reserves `max_model_len` slots, since its final length is unknown when it starts. Paged: a
    request holds ⌈length / block_size⌉ blocks, counted at its final length (prompt + output): the most it
    ever holds, so paging's figures are its worst case. Memory is in token slots (times
    `formulas.kv_bytes_per_token` for bytes).
    """

    lengths: np.ndarray  # the queue's final context lengths, in arrival order
    budget_tokens: int
    max_model_len: int
    block_size: int

    @property
    def blocks(self) -> np.ndarray:
        return -(-self.lengths // self.block_size)

    @property
    def contiguous_fit(self) -> int:
        """Requests admitted at once under contiguous reservation."""
        return min(len(self.lengths), self.budget_tokens // self.max_model_len)

    @property
    def paged_fit(self) -> int:
        """Requests admitted at once under paging: the longest prefix of the queue whose blocks fit."""
        return int(np.searchsorted(np.cumsum(self.blocks), self.budget_tokens // self.block_size, side="right"))

    @property
    def concurrency_multiple(self) -> float:
        return self.paged_fit / self.contiguous_fit

    @property
    def waste_contiguous(self) -> np.ndarray:
        """Per request: the fraction of its reservation it never fills."""
        return 1 - self.lengths / self.max_model_len

    @property
    def waste_paged_tokens(self) -> np.ndarray:
        """Per request: the unused tail of its last block, 0 to block_size − 1 slots."""
        return self.blocks * self.block_size - self.lengths

    @property
    def waste_fraction_contiguous(self) -> float:
        """Share of reserved slots that hold no token, over the queue's requests."""
        return float(self.waste_contiguous.mean())

    @property
    def waste_fraction_paged(self) -> float:
        return float(self.waste_paged_tokens.sum() / (self.blocks.sum() * self.block_size))


def simulate_kv_budget(budget_tokens: int = 64 * 2048, max_model_len: int = 2048, block_size: int = 16,
                       mix: str = "lognormal", mean_len: float = 512, sigma: float = 1.0,
                       seed: int = 0) -> KVBudgetRun:
    """How many requests of a length mix fit in `budget_tokens` KV slots, contiguous vs paged.

    The figures follow from the assumptions, all parameters here: the reservation (`max_model_len`), the
    mix and its mean (the fill, mean_len / max_model_len), and the block size. Contiguous waste is about
    1 − fill and the concurrency multiple about max_model_len / (mean_len + block_size / 2), so:
    - the defaults (a chat-like lognormal mix averaging 512 tokens against a 2048-token reservation, the
      budget of 64 such reservations) waste about 77% and fit 4–5× more requests when paged;
    - fills of 25–37% waste 63–75% and fit 2.5–4× more (the textbook's "waste from 60–80%" and "2 to 4× more
      sequences"): "uniform" with mean_len 768 to 512 against 2048;
    - the same chat mix against max_model_len = 4096 gives about 8× (at 88% waste): the textbook's "~8×
      concurrency";
    - paged waste is under one block per request whatever the mix: at most block_size − 1 slots.
    The queue holds budget_tokens // block_size requests, enough that paging is never short of requests.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if budget_tokens < max(max_model_len, block_size):
        raise ValueError(f"budget_tokens must hold at least one max_model_len reservation ({max_model_len}) "
                         f"and one block, got {budget_tokens}")
    lengths = sample_context_lengths(budget_tokens // block_size, mix, mean_len, max_model_len, sigma, seed)
    return KVBudgetRun(lengths, budget_tokens, max_model_len, block_size)


# ---------------------------------------------------------------- chapter 07: the same budget over time

RESERVATIONS = ("max_model_len", "per request")


@dataclass(frozen=True)
class LayoutRun:
    """One queue served first come, first served from a KV budget under one layout (chapter 07).

    Request i needs `lengths[i]` token slots by its end; it is admitted at step `start[i]`, writes one token
    per step and leaves at step start[i] + lengths[i]. While it runs it holds `held[i]` slots: a contiguous
    reservation (from slot `offset[i]` on), or under paging the blocks of its final length (the most it ever
    holds, so paging's figures are its worst case). A request that does not fit waits, and so does every
    request behind it. `events` holds, at every step where something finished or was admitted, the state after
    admission: (step, requests running, free slots, largest run of adjacent free slots, slots the queue's next
    request needs, 0 once the queue is empty).
    """

    layout: str
    budget_tokens: int
    lengths: np.ndarray
    held: np.ndarray
    start: np.ndarray
    offset: np.ndarray  # first slot of the reservation (contiguous), -1 under paging
    events: np.ndarray  # [n, 5] int64: step, running, free, largest free run, next request's need

    @property
    def filling_until(self) -> int:
        """The step the last request is admitted: until then the queue is never empty."""
        return int(self.start.max())

    def _between_events(self, column: int) -> tuple[np.ndarray, np.ndarray]:
        """A column of `events` and how many steps each value lasted, over steps [0, filling_until)."""
        steps = self.events[:, 0]
        keep = steps < self.filling_until
        durations = np.diff(np.append(steps[keep], self.filling_until))
        return self.events[keep, column], durations

    @property
    def mean_running(self) -> float:
        """Requests running at once, averaged over the steps while requests still wait."""
        running, durations = self._between_events(1)
        return float((running * durations).sum() / max(durations.sum(), 1))

    @property
    def internal_waste_fraction(self) -> float:
        """Share of the slots requests hold that never receive a token (internal fragmentation)."""
        return float(1 - self.lengths.sum() / self.held.sum())

    @property
    def stranded(self) -> np.ndarray:
        """Per event: free slots the next request could not use because none of the holes was large enough
        although together they were (external fragmentation); 0 where it fit or the memory was really full."""
        _, running, free, largest, need = self.events.T
        return np.where((need > largest) & (need <= free), free, 0)

    @property
    def stranded_time_fraction(self) -> float:
        """Share of the steps while requests wait in which the next one waits only because of fragmentation."""
        _, durations = self._between_events(1)
        keep = self.events[:, 0] < self.filling_until
        return float((durations * (self.stranded[keep] > 0)).sum() / max(durations.sum(), 1))

    def snapshot(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids of the requests running at `step`, tokens each has written)."""
        ids = np.flatnonzero((self.start <= step) & (step < self.start + self.lengths))
        return ids, step - self.start[ids]


def _first_fit(spans: list[tuple[int, int]], need: int, budget: int) -> tuple[int, int]:
    """(first slot of the first free run of `need` slots or -1, largest free run) in a budget whose taken spans
    are `spans`, sorted (start, end)."""
    at, largest, found = 0, 0, -1
    for lo, hi in spans + [(budget, budget)]:
        largest = max(largest, lo - at)
        if found < 0 and lo - at >= need:
            found = at
        at = hi
    return found, largest


def _serve(layout: str, lengths: np.ndarray, held: np.ndarray, budget_tokens: int) -> LayoutRun:
    n = len(lengths)
    start, offset = np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64)
    spans: list[tuple[int, int]] = []  # contiguous: taken (start, end) slots, sorted
    finishing: list[tuple[int, int]] = []  # heap of (step it leaves, request)
    free, step, nxt, events = budget_tokens, 0, 0, []
    while nxt < n or finishing:
        while finishing and finishing[0][0] == step:
            _, i = heapq.heappop(finishing)
            free += held[i]
            if offset[i] >= 0:
                spans.remove((offset[i], offset[i] + held[i]))
        largest = free
        while nxt < n:
            if layout == "contiguous":
                at, largest = _first_fit(spans, held[nxt], budget_tokens)
                if at < 0:
                    break
                offset[nxt] = at
                spans.append((at, at + held[nxt]))
                spans.sort()
            elif held[nxt] > free:
                largest = free
                break
            start[nxt], free = step, free - held[nxt]
            heapq.heappush(finishing, (step + int(lengths[nxt]), nxt))
            nxt += 1
        if layout == "contiguous" and nxt < n:
            largest = _first_fit(spans, held[nxt], budget_tokens)[1]
        events.append((step, len(finishing), free, largest if nxt < n else free, held[nxt] if nxt < n else 0))
        if not finishing:
            break
        step = finishing[0][0]
    return LayoutRun(layout, budget_tokens, lengths, held, start, offset, np.array(events, dtype=np.int64))


def simulate_kv_layouts(budget_tokens: int = 64 * 2048, max_model_len: int = 2048, block_size: int = 16,
                        mix: str = "lognormal", mean_len: float = 512, reserve: str = "max_model_len",
                        requests: int | None = None, seed: int = 0) -> tuple[LayoutRun, LayoutRun]:
    """(contiguous, paged): one queue of requests served from the same KV budget under each layout.

    Contiguous: each request reserves adjacent slots when it starts, `max_model_len` of them (`reserve=
    "max_model_len"`, what this engine's contiguous cache does) or what it says it may need (`"per request"`:
    the prompt plus the max_tokens it asked for, drawn here as twice its final length, at most max_model_len),
    placed in the first run of free slots long enough (first fit). Paged: each request holds the blocks of its
    final length, anywhere in the pool. Lengths are `sample_context_lengths(requests, mix, mean_len, ...)`;
    by default enough requests to fill the budget about four times over.

    Equal reservations can never strand free memory: a freed one fits the next request exactly. Reservations of
    different sizes can: requests leave in another order than they came, and the free slots end up in holes
    between reservations, each too small for the next request although together they are not.
    """
    if reserve not in RESERVATIONS:
        raise ValueError(f"reserve must be one of {RESERVATIONS}, got {reserve!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if budget_tokens < max(max_model_len, block_size):
        raise ValueError(f"budget_tokens must hold at least one max_model_len reservation ({max_model_len}) "
                         f"and one block, got {budget_tokens}")
    n = requests if requests is not None else min(4000, max(8, 4 * budget_tokens // max(1, int(mean_len))))
    lengths = sample_context_lengths(n, mix, mean_len, max_model_len, seed=seed)
    reserved = (np.full(n, max_model_len, dtype=np.int64) if reserve == "max_model_len"
                else np.minimum(2 * lengths, max_model_len))
    blocks = -(-lengths // block_size) * block_size
    return (_serve("contiguous", lengths, reserved, budget_tokens),
            _serve("paged", lengths, blocks, budget_tokens // block_size * block_size))

