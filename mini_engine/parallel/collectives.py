"""The collectives inside an all-reduce, and overlapping one with compute (chapter 11), on real ranks.

An all-reduce is two collectives in a row. A reduce-scatter sums the ranks' tensors and leaves each rank one
size-th of the sum; an all-gather then hands every rank every other rank's size-th. The ring algorithm does exactly
that: p - 1 steps of each, every rank sending and receiving 1/p of the payload a step, so that each moves
2(p - 1)/p of it, whatever p. `all_reduce_from_halves` builds one this way on the ranks' `Communicator` and
`check_collectives` checks it (and each half against its definition) equal to torch.distributed's all-reduce;
`collective_seconds` times the four over payload sizes. Sequence parallelism (`sequence.py`) keeps the two
halves apart, with per-token work between them.

Overlap. A collective waits on other ranks; compute that does not need its result can run meanwhile.
`all_reduce(t, async_op=True)` starts one and returns at once; `wait()` blocks (gloo) or orders the stream
(NCCL) when its result is needed. On a GPU, kernels are queued onto streams: the kernels of one stream run in order,
those of two streams may run at once. NCCL runs its collectives on a stream of its own and copies over NVLink or
PCIe with a few of the GPU's SMs, while the default stream's matmul uses the rest; `wait()` only makes the current
stream wait for NCCL's stream (an event), so the host never blocks and queues the next kernels at once. The overlap
is real only when the compute is independent of the collective and the two do not fight for the same SMs and
memory bandwidth. On a CPU, gloo's collective runs on gloo's own thread while this process's thread multiplies;
on a machine with fewer cores than threads they take turns. `overlap_seconds` measures the gain either way.

The ranks run functions of this package (`_check_all`, `_time_collectives`, `_time_overlap`): a function defined in a
notebook cell cannot be started with `spawn` (the new process cannot import it).
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from .comm import Communicator
from .ranks import _main_left_out, threads_per_rank, timeout_s

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_reduce_from_halves")


def all_reduce_from_halves(comm: Communicator, t: torch.Tensor) -> torch.Tensor:
    """The sum of `t` over the ranks, on every rank (a new tensor): `t` flattened and padded with zeros to a
    multiple of the group's size, reduce-scattered (each rank holds the sum of its size-th), then all-gathered
    (every rank the whole sum), the padding dropped."""
    flat = t.reshape(-1)
    extra = -flat.numel() % comm.size
    if extra:
        flat = torch.cat([flat, flat.new_zeros(extra)])
    total = comm.all_gather(comm.reduce_scatter(flat))
    return total[:t.numel()].view(t.shape)


def _ranks(fn, ranks: int, *args):
    """Run fn(rank, ranks, store, *args, out) on `ranks` fresh processes meeting through a file store in a temporary
    folder; return what rank 0 put in `out`."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="mini_engine_tp_") as folder, _main_left_out():
        mp.start_processes(fn, nprocs=ranks, start_method="spawn", join=True,
                           args=(ranks, os.path.join(folder, "store"), *args, out))
        return out.get()


def _join(rank: int, size: int, store: str, threads: int, device: str) -> Communicator:
    torch.set_num_threads(threads)
    device = torch.device(f"cuda:{rank}" if device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return Communicator(store, rank, size, device, timeout_s())  # MINI_ENGINE_TP_TIMEOUT, as the engine's ranks


def _inputs(rank: int, shape, device) -> torch.Tensor:
    """Rank `rank`'s input: random, and the same on every rank that asks for it (each rank can then compute
    every collective's definition from all the ranks' inputs)."""
    generator = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(shape, generator=generator).to(device)


def check_collectives(ranks: int = 3, shape: tuple = (7, 5), device: str = "cpu") -> dict[str, float]:
    """The largest absolute difference, over every rank, between: torch's all-reduce and the sum of the ranks'
    inputs; `all_reduce_from_halves` and torch's all-reduce (`shape` need not divide by `ranks`: it pads); each
    rank's reduce-scatter and its slice of the sum; the all-gather and the ranks' inputs joined in rank order.
    Random fp32 inputs [shape] on `ranks` fresh processes (gloo; device="cuda": NCCL, a GPU each). Sums taken in
    another order differ in the last bits: expect about 1e-7, not 0, except for the all-gather (a copy)."""
    per_rank = _ranks(_check_all, ranks, tuple(shape), device)
    return {name: max(errors[name] for errors in per_rank) for name in per_rank[0]}


def _check_all(rank: int, size: int, store: str, shape: tuple, device: str, out) -> None:
    """`_check` on every rank, each rank's errors gathered to rank 0 (a rank's reduce-scatter is its own)."""
    comm = _join(rank, size, store, threads_per_rank(size), device)
    everyone = [_inputs(r, shape, comm.device) for r in range(size)]
    mine, total = everyone[rank], torch.stack(everyone).sum(0)
    rows = shape[0] - shape[0] % size  # reduce-scatter needs rows that divide by size
    errors = {
        "all_reduce": (comm.all_reduce(mine.clone()) - total).abs().max(),
        "all_reduce_from_halves": (all_reduce_from_halves(comm, mine) - comm.all_reduce(mine.clone())).abs().max(),
        "reduce_scatter": (comm.reduce_scatter(mine[:rows]) - total[:rows].chunk(size)[rank]).abs().max(),
        "all_gather": (comm.all_gather(mine) - torch.cat(everyone)).abs().max(),
    }
    gathered = comm.gather(torch.stack(list(errors.values())).reshape(len(errors), 1).float())
    if rank == 0:
        out.put([dict(zip(errors, row.tolist())) for row in gathered.cpu().T])  # one row a rank
    comm.barrier()


def _time_collectives(rank: int, size: int, store: str, sizes: list[int], repeats: int, threads: int,
                      device: str, out) -> None:
    comm = _join(rank, size, store, threads, device)
    calls = {"all_reduce": comm.all_reduce, "reduce_scatter": comm.reduce_scatter,
             "all_gather": comm.all_gather, "all_reduce_from_halves": lambda t: all_reduce_from_halves(comm, t)}
    times = {name: [] for name in COLLECTIVES}
    for n in sizes:
        elements = -(-max(1, n // 4) // size) * size  # fp32, rounded up to a multiple of size
        for name, call in calls.items():
            # The all-gather's payload is its output, as the others' is their input: each rank brings n/size.
            t = torch.ones(elements // size if name == "all_gather" else elements, device=comm.device)
            for _ in range(3):
                call(t)
            comm.barrier()
            _sync(comm.device)
            start = time.perf_counter()
            for _ in range(repeats):
                call(t)
            _sync(comm.device)  # NCCL's wait() returns before the GPU has done the work
            times[name].append((time.perf_counter() - start) / repeats)
    if rank == 0:
        out.put(times)
    comm.barrier()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def collective_seconds(payload_bytes: list[int], ranks: int = 3, repeats: int = 50,
                       device: str = "cpu") -> dict[str, list[float]]:
    """Mean seconds of one call of each of COLLECTIVES, for each payload (bytes of fp32: the all-reduce's and the
    reduce-scatter's input, the all-gather's output, each rank bringing a size-th), among `ranks` fresh processes:
    over gloo, each with its share of the cores; with device="cuda", over NCCL, a GPU each. The mean, as
    `measure.all_reduce_seconds` takes it (a step pays every call, the slow ones too)."""
    return _ranks(_time_collectives, ranks, list(payload_bytes), repeats, threads_per_rank(ranks), device)


@dataclass
class Overlap:
    """One step's seconds (the means over the repeats) on rank 0: an independent matmul and an all-reduce alone,
    one after the other (serial), and the all-reduce started asynchronously before the matmul and waited for
    after it (overlapped)."""
    compute_s: float
    all_reduce_s: float
    serial_s: float
    overlapped_s: float

    @property
    def gain(self) -> float:
        """serial / overlapped: how many times faster the step is with the all-reduce hidden behind the compute
        (at best serial / max(compute, all-reduce))."""
        return self.serial_s / self.overlapped_s


def _time_overlap(rank: int, size: int, store: str, tokens: int, hidden: int, inner: int, repeats: int,
                  threads: int, device: str, out) -> None:
    comm = _join(rank, size, store, threads, device)
    x = torch.randn(tokens, hidden, device=comm.device)
    w = torch.randn(inner, hidden, device=comm.device) / hidden ** 0.5
    t = torch.ones(tokens, hidden, device=comm.device)  # a block's output: what its all-reduce carries

    def compute():
        return x @ w.T

    def serial():
        compute()
        comm.all_reduce(t)

    def overlapped():
        pending = comm.all_reduce(t, async_op=True)
        compute()
        pending.wait()

    steps = {"compute": compute, "all_reduce": lambda: comm.all_reduce(t), "serial": serial,
             "overlapped": overlapped}
    seconds = {name: 0.0 for name in steps}
    for round_ in range(4):  # the kinds interleaved, so that a busy spell of the machine falls on all of them
        for name, step in steps.items():
            for _ in range(2):
                step()
            comm.barrier()
            _sync(comm.device)
            start = time.perf_counter()
            for _ in range(repeats):
                step()
            _sync(comm.device)
            seconds[name] += (time.perf_counter() - start) / repeats / 4
    if rank == 0:
        out.put(seconds)
    comm.barrier()


def overlap_seconds(ranks: int = 3, tokens: int = 256, hidden: int = 576, inner: int = 1536, repeats: int = 20,
                    device: str = "cpu") -> Overlap:
    """Time on `ranks` fresh processes a step made of an fp32 matmul [tokens, hidden] x [hidden, inner] (SmolLM2's
    MLP width) and an all-reduce of [tokens, hidden] that does not depend on it: serial against overlapped
    (`Overlap`). gloo on the CPU, each rank with its share of the cores; device="cuda": NCCL, a GPU each."""
    s = _ranks(_time_overlap, ranks, tokens, hidden, inner, repeats, threads_per_rank(ranks), device)
    return Overlap(s["compute"], s["all_reduce"], s["serial"], s["overlapped"])
