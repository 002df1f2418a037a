"""Latency metrics (chapters 01-02): TTFT (prefill), TPOT (decode), end-to-end, throughput; device-synchronised timers."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .devices import synchronize


@dataclass
class TokenTimer:
    """Records when each token of one stream arrived. Pass `.on_token` to a generate function."""
    device: str = "cpu"
    start: float = 0.0
    stamps: list[float] = field(default_factory=list)

    def begin(self) -> "TokenTimer":
        synchronize(self.device)
        self.start, self.stamps = time.perf_counter(), []
        return self

    def on_token(self, _token=None) -> None:
        self.stamps.append(time.perf_counter())

    @property
    def ttft_s(self) -> float:
        return self.stamps[0] - self.start

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (the decode phase)."""
        if len(self.stamps) < 2:
            return float("nan")
        return (self.stamps[-1] - self.stamps[0]) / (len(self.stamps) - 1)

    @property
    def e2e_s(self) -> float:
        return self.stamps[-1] - self.start


def percentile(values, q: float) -> float:
    values = [v for v in values if v == v]  # drop NaN (a one-token request has no TPOT)
    return float(np.percentile(values, q)) if values else float("nan")
