"""What tensor parallelism costs on this machine (chapter 11): the all-reduce's time over payload sizes, measured
between real ranks and fitted as latency + bytes / bandwidth, and the decode step of a served engine timed with
the share its rank 0 spent inside collectives.

The ranks run `_time_all_reduce`, a function of this package: a function defined in a notebook cell cannot be
started with `spawn` (the new process cannot import it).
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time

import numpy as np
import torch
import torch.multiprocessing as mp

from .comm import Communicator
from .ranks import _main_left_out, threads_per_rank


def _time_all_reduce(rank: int, size: int, store: str, sizes: list[int], repeats: int, threads: int, out) -> None:
    torch.set_num_threads(threads)
    comm = Communicator(store, rank, size, torch.device("cpu"), 60.0)
    times = []
    for n in sizes:
        t = torch.ones(max(1, n // 4))  # fp32: n bytes
        for _ in range(3):
            comm.all_reduce(t)
        comm.barrier()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            comm.all_reduce(t)
            samples.append(time.perf_counter() - start)
        times.append(statistics.median(samples))
    if rank == 0:
        out.put(times)
    comm.barrier()


def all_reduce_seconds(payload_bytes: list[int], ranks: int = 3, repeats: int = 20) -> list[float]:
    """Median seconds of one fp32 all-reduce of each payload (bytes) among `ranks` fresh gloo processes on this
    machine, each with its share of the cores."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="mini_engine_tp_") as folder, _main_left_out():
        mp.start_processes(_time_all_reduce, nprocs=ranks, start_method="spawn", join=True,
                           args=(ranks, os.path.join(folder, "store"), list(payload_bytes), repeats,
                                 threads_per_rank(ranks), out))
        return out.get()


def fit_latency_bandwidth(payload_bytes, seconds) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of the line t = latency + bytes / bandwidth through the measurements
    (least squares, each point weighted by 1/t so that the small payloads count as much as the large)."""
    x, t = np.asarray(payload_bytes, float), np.asarray(seconds, float)
    w = 1 / t
    slope, latency = np.polyfit(x, t, 1, w=w)
    return float(max(latency, 0.0)), float(1 / max(slope, 1e-30))


def decode_step_times(llm, batch: int, tokens: int, prompt: str = "Tell me a story about a lighthouse."):
    """Median seconds of the engine's decode-only steps for `batch` requests of `tokens` new tokens each, and for a
    tensor-parallel engine the share of those steps rank 0 spent in collectives (None for one process)."""
    import mini_engine as me

    engine = llm.engine
    engine.config.record_trace = True
    comm = getattr(engine.model, "comm", None)
    params = me.SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{prompt} ({i})", params)
    steps, in_comm = [], []
    while engine.has_unfinished():
        before = comm.seconds if comm else 0.0
        start = time.perf_counter()
        engine.step()
        took = time.perf_counter() - start
        record = engine.trace[-1] if engine.trace else None
        if record is not None and all(n == 1 for _, _, n, _ in record.chunks) and len(record.chunks) == batch:
            steps.append(took)
            in_comm.append((comm.seconds - before) if comm else 0.0)
    engine.trace.clear()
    engine.config.record_trace = False
    share = sum(in_comm) / sum(steps) if comm else None
    return statistics.median(steps), share
