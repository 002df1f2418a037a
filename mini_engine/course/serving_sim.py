"""A continuous-batching server in simulation (chapter 09's slider): requests arrive at random (a Poisson
process), wait for one of `max_batch` places, and decode one token per step; a step of n requests takes the
time measured for n on the real engine. Sweeping the arrival rate traces the throughput-latency curve that
the load test measures over HTTP, in milliseconds instead of minutes.

What it leaves out, on purpose: the prompt's prefill is one fixed cost added to the step a request joins
(`prompt_s`), and every request asks for the same number of tokens.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

import numpy as np


def step_seconds(step_s: dict[int, float], n: int) -> float:
    """The time of a decode step of `n` requests, interpolated linearly between the measured batch sizes
    (`step_s`: batch -> seconds); past the largest one, extended along the last two points' line."""
    if not step_s:
        raise ValueError("step_s: give the step time of at least one batch size")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    b = sorted(step_s)
    if b[0] < 1 or any(step_s[k] <= 0 for k in b):
        raise ValueError(f"step_s: batch sizes must be >= 1 and times > 0, got {step_s}")
    if len(b) == 1 or n <= b[0]:
        return step_s[b[0]]
    if n >= b[-1]:
        slope = (step_s[b[-1]] - step_s[b[-2]]) / (b[-1] - b[-2])
        return step_s[b[-1]] + max(slope, 0.0) * (n - b[-1])
    return float(np.interp(n, b, [step_s[k] for k in b]))


@dataclass(frozen=True)
class LoadRun:
    """One simulated load test. Times in seconds; throughput counts output tokens over the whole run, from the
    first arrival to the last answer, as `serving.loadtest` does."""
    rate: float
    max_batch: int
    tok_s: float
    requests_s: float
    ttft_p50: float
    ttft_p99: float
    e2e_p50: float
    e2e_p99: float
    tpot_p50: float
    mean_batch: float         # requests decoding in an average step


def capacity(step_s: dict[int, float], max_batch: int, tokens: int, prompt_s: float = 0.0) -> float:
    """Requests/s a server of `max_batch` places sustains at best: a full batch, `tokens` steps per request,
    plus each request's prefill."""
    per_request = tokens * step_seconds(step_s, max_batch) / max_batch + prompt_s
    return 1.0 / per_request


def simulate_load(step_s: dict[int, float], rate: float, max_batch: int, tokens: int = 32, prompt_s: float = 0.0,
                  requests: int = 200, seed: int = 0) -> LoadRun:
    """`requests` requests of `tokens` output tokens each arrive at `rate` per second (exponential gaps;
    float('inf'): all at once) at a continuous-batching server with `max_batch` places. Each step every running
    request gains a token; the step a request joins also pays its prefill, `prompt_s`."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate!r}")
    for name, value in (("max_batch", max_batch), ("tokens", tokens), ("requests", requests)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value!r}")
    if prompt_s < 0:
        raise ValueError(f"prompt_s must be >= 0, got {prompt_s!r}")
    cost = [0.0] + [step_seconds(step_s, n) for n in range(1, max_batch + 1)]
    gaps = np.random.default_rng(seed).exponential(1 / rate if math.isfinite(rate) else 0.0, requests)
    arrival = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    first, finish = np.zeros(requests), np.zeros(requests)
    waiting: deque[int] = deque()
    running: list[tuple[int, int]] = []  # (the step count at which it has all its tokens, request)
    now, step, arrived, done, busy = 0.0, 0, 0, 0, 0

    def retire():
        nonlocal done
        while running and running[0][0] == step:
            finish[heapq.heappop(running)[1]] = now
            done += 1

    while done < requests:
        while arrived < requests and arrival[arrived] <= now:
            waiting.append(arrived)
            arrived += 1
        if not running and not waiting:
            now = arrival[arrived]  # idle until the next request
            continue
        joined = []
        while waiting and len(running) < max_batch:
            joined.append(waiting.popleft())
            heapq.heappush(running, (step + tokens, joined[-1]))
        now += cost[len(running)] + prompt_s * len(joined)  # the step that gives the newcomers their first token
        step += 1
        busy += len(running)
        first[joined] = now
        retire()
        if not running:
            continue
        # Nothing changes until a request finishes or one that has arrived can take a free place: skip there.
        dt = cost[len(running)]
        skip = running[0][0] - step
        if len(running) < max_batch and (waiting or arrived < requests):
            skip = 0 if waiting else min(skip, math.ceil((arrival[arrived] - now) / dt))
        if skip > 0:
            now += skip * dt
            step += skip
            busy += skip * len(running)
            retire()
    ttft, e2e = first - arrival, finish - arrival
    tpot = (finish - first) / (tokens - 1) if tokens > 1 else np.zeros(requests)
    q = lambda x, p: float(np.percentile(x, p))
    return LoadRun(rate, max_batch, float(requests * tokens / now), float(requests / now), q(ttft, 50), q(ttft, 99), q(e2e, 50),
                   q(e2e, 99), q(tpot, 50), busy / step)
