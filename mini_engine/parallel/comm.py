"""One rank's end of the group (chapter 11): the all-reduce and the gather the parallel layers call, and the two
halves an all-reduce is made of (reduce-scatter, all-gather: `collectives.py`, sequence parallelism in
`sequence.py`), over torch.distributed: gloo between CPU processes, NCCL between GPUs.

Each engine makes a group of its own, not torch.distributed's one default group per process, so that two engines
can run side by side in one notebook. The ranks meet through a file store in a fresh temporary folder: two runs on
one machine cannot collide there, as they can on a fixed port. gloo talks over 127.0.0.1 (`localhost` may resolve
to IPv6), and every collective gives up after `timeout_s` (gloo's wait on the host; NCCL's own watchdog, see
`_wait`): a rank that died or stopped answering is an error, not a hang.
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

    def all_reduce(self, t: torch.Tensor, async_op: bool = False):
        """Sum `t` over the ranks, in place; every rank gets the sum. With async_op=True, return at once a `Pending`
        whose wait() returns `t` once summed: the caller computes something independent meanwhile (overlap,
        `collectives.overlap_seconds`). Its logged seconds run from the start to the end of wait()."""
        start = self._now()
        work = self.group.allreduce([t])
        if async_op:
            return Pending(self, work, start, t)
        self._wait(work)
        self._record(start)
        return t

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of `t` over the ranks, of which rank r keeps the r-th of `size` equal slices along dim 0: `t`'s
        first dimension must divide by size. The first half of an all-reduce: each rank ends with 1/size of the sum.
        (gloo in torch 2.13 has its own reduce-scatter, as NCCL does: `_reduce_scatter_base`, bound on every
        torch.distributed backend, is what torch.distributed.reduce_scatter_single calls a group's backend with.)"""
        if t.shape[0] % self.size:
            raise ValueError(f"reduce_scatter: t's first dimension ({t.shape[0]}) must divide by the group's size "
                             f"({self.size}); pad it")
        t, start = t.contiguous(), self._now()
        out = t.new_empty((t.shape[0] // self.size, *t.shape[1:]))
        self._wait(self.group._reduce_scatter_base(out, t, dist.ReduceScatterOptions()))  # the options sum
        self._record(start)
        return out

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` joined along dim 0, in rank order, on every rank (the second half of an all-reduce;
        `_allgather_base` backs torch.distributed.all_gather_single)."""
        t, start = t.contiguous(), self._now()
        out = t.new_empty((t.shape[0] * self.size, *t.shape[1:]))
        self._wait(self.group._allgather_base(out, t))
        self._record(start)
        return out

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's `t` joined along the last dimension, in rank order; other ranks: `t` itself."""
        t, start = t.contiguous(), self._now()
        options = dist.GatherOptions()
        options.rootRank = 0
        if self.rank != 0:
            self._wait(self.group.gather([], [t], options))
        else:
            parts = [torch.empty_like(t) for _ in range(self.size)]
            self._wait(self.group.gather([parts], [t], options))
            t = torch.cat(parts, dim=-1)
        self._record(start)
        return t

    def _wait(self, work) -> None:
        """Wait for a collective. gloo: on this host, at most `timeout` (the collective runs on the CPU). NCCL: no
        host-side timeout, as a host-side wait(timeout) makes the host poll and sleep until the GPU has finished,
        at every collective; wait() only orders the current stream after NCCL's, so the host runs ahead and
        queues the next kernels. A rank that hangs is caught by the process group's own timeout (`options._timeout`
        above): NCCL's watchdog thread finds the collective past it and, by PyTorch's default
        (TORCH_NCCL_ASYNC_ERROR_HANDLING=3), ends the process, rank 0's included, where gloo raises."""
        if self.device.type == "cuda":
            work.wait()
        else:
            work.wait(self.timeout)

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


class Pending:
    """An all-reduce under way (`Communicator.all_reduce(t, async_op=True)`): wait() returns the summed tensor."""

    def __init__(self, comm: Communicator, work, start: float, t: torch.Tensor):
        self.comm, self.work, self.start, self.tensor = comm, work, start, t

    def wait(self) -> torch.Tensor:
        self.comm._wait(self.work)
        self.comm._record(self.start)
        return self.tensor
