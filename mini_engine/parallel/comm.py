"""One rank's end of the group (chapter 11): the all-reduce and the gather the parallel layers call, over
torch.distributed: gloo between CPU processes, NCCL between GPUs.

Each engine makes a group of its own, not torch.distributed's one default group per process, so that two engines
can run side by side in one notebook. The ranks meet through a file store in a fresh temporary folder: two runs on
one machine cannot collide there, as they can on a fixed port. gloo talks over 127.0.0.1 (`localhost` may resolve
to IPv6), and every collective gives up after `timeout_s`: a rank that died or stopped answering is an error, not
a hang.
"""
from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist


class Communicator:
    def __init__(self, store_path: str, rank: int, size: int, device: torch.device, timeout_s: float):
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.FileStore(store_path, size)
        store.set_timeout(timeout)  # the meeting itself: a rank that never comes is an error too
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            self.group = dist.ProcessGroupGloo(store, rank, size, options)
        self.rank, self.size, self.timeout, self.device = rank, size, timeout, device
        self.log: list[float] | None = None  # when a list: each collective's seconds, in order (`measure.py`)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; every rank gets the sum."""
        start = self._now()
        self.group.allreduce([t]).wait(self.timeout)
        self._record(start)
        return t

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's `t` joined along the last dimension, in rank order; other ranks: `t` itself."""
        t, start = t.contiguous(), self._now()
        options = dist.GatherOptions()
        options.rootRank = 0
        if self.rank != 0:
            self.group.gather([], [t], options).wait(self.timeout)
        else:
            parts = [torch.empty_like(t) for _ in range(self.size)]
            self.group.gather([parts], [t], options).wait(self.timeout)
            t = torch.cat(parts, dim=-1)
        self._record(start)
        return t

    def _now(self) -> float:
        """The clock, read only while collectives are logged. NCCL's wait() only orders the GPU's stream: while
        timing, wait for the GPU itself, so that a collective's time is its own and not the work queued before it."""
        if self.log is None:
            return 0.0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _record(self, start: float) -> None:
        if self.log is not None:
            self.log.append(self._now() - start)

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.device))
