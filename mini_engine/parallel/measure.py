"""What tensor parallelism costs on this machine (chapter 11): the all-reduce's time over payload sizes, measured
between real ranks and fitted as latency + bytes / bandwidth, and the decode step of a served engine split into
computing, communicating and waiting for a slower rank.

The ranks run `_time_all_reduce`, a function of this package: a function defined in a notebook cell cannot be
started with `spawn` (the new process cannot import it).
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.multiprocessing as mp

from .comm import Communicator
from .ranks import _main_left_out, threads_per_rank


def _time_all_reduce(rank: int, size: int, store: str, sizes: list[int], repeats: int, threads: int, device: str,
                     out) -> None:
    torch.set_num_threads(threads)
    device = torch.device(f"cuda:{rank}" if device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    comm = Communicator(store, rank, size, device, 60.0)
    times = []
    for n in sizes:
        t = torch.ones(max(1, n // 4), device=device)  # fp32: n bytes
        for _ in range(3):
            comm.all_reduce(t)
        comm.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            comm.all_reduce(t)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # NCCL's wait() returns before the GPU has done the work
        times.append((time.perf_counter() - start) / repeats)
    if rank == 0:
        out.put(times)
    comm.barrier()


def all_reduce_seconds(payload_bytes: list[int], ranks: int = 3, repeats: int = 100,
                       device: str = "cpu") -> list[float]:
    """Mean seconds of one fp32 all-reduce of each payload (bytes) among `ranks` fresh processes on this machine:
    over gloo, each with its share of the cores; with device="cuda", over NCCL, a GPU each (as the engine's ranks).
    The mean, not the median: a step pays the sum of its collectives, slow ones included, and on a CPU shared by
    more threads than cores a few calls wait milliseconds for a rank to be scheduled (the median of such calls
    jumps between a fast and a slow mode; the mean is steady)."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="mini_engine_tp_") as folder, _main_left_out():
        mp.start_processes(_time_all_reduce, nprocs=ranks, start_method="spawn", join=True,
                           args=(ranks, os.path.join(folder, "store"), list(payload_bytes), repeats,
                                 threads_per_rank(ranks), device, out))
        return out.get()


def fit_latency_bandwidth(payload_bytes, seconds) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of the line t = latency + bytes / bandwidth through the measurements
    (least squares, each point weighted by 1/t so that the small payloads count as much as the large)."""
    x, t = np.asarray(payload_bytes, float), np.asarray(seconds, float)
    w = 1 / t
    slope, latency = np.polyfit(x, t, 1, w=w)
    return float(max(latency, 0.0)), float(1 / max(slope, 1e-30))


@dataclass
class DecodeSteps:
    """The decode-only steps of one run. For a tensor-parallel engine, each step's time splits three ways on rank 0:
    computing (outside any collective), communicating (each collective's time on the rank that reached it last,
    the least over the ranks: the others were only waiting for that rank) and waiting for a slower rank (rank 0's
    time in collectives beyond that). One process: all compute."""
    step_s: float        # median seconds a step
    mean_s: float        # mean seconds a step (the three parts below add up to it)
    compute_s: float
    communication_s: float
    waiting_s: float
    collectives: int     # collectives a step

    @property
    def communication_share(self) -> float:
        return self.communication_s / self.mean_s


def decode_step_times(llm, batch: int, tokens: int,
                      prompt: str = "Tell me a story about a lighthouse.") -> DecodeSteps:
    """Time the engine's decode-only steps for `batch` requests of `tokens` new tokens each (see DecodeSteps)."""
    import mini_engine as me

    engine = llm.engine
    engine.config.record_trace = True
    model = engine.model
    parallel = hasattr(model, "collective_log")
    params = me.SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{prompt} ({i})", params)
    steps, spans = [], []  # each decode step's seconds, and its collectives' place in the logs
    if parallel:
        model.collective_log(True)
    while engine.has_unfinished():
        first = len(model.comm.log) if parallel else 0
        start = time.perf_counter()
        engine.step()
        took = time.perf_counter() - start
        record = engine.trace[-1] if engine.trace else None
        if record is not None and all(n == 1 for _, _, n, _ in record.chunks) and len(record.chunks) == batch:
            steps.append(took)
            spans.append((first, len(model.comm.log) if parallel else 0))
    logs = model.collective_log(False) if parallel else None
    engine.trace.clear()
    engine.config.record_trace = False
    mean = statistics.fmean(steps)
    if not parallel:
        return DecodeSteps(statistics.median(steps), mean, mean, 0.0, 0.0, 0)
    per_call = list(zip(*logs))  # one tuple a collective: its seconds on each rank
    rank0 = statistics.fmean(sum(logs[0][a:b]) for a, b in spans)
    communication = statistics.fmean(sum(min(t) for t in per_call[a:b]) for a, b in spans)
    a, b = spans[0]
    return DecodeSteps(statistics.median(steps), mean, mean - rank0, communication, rank0 - communication, b - a)


def kv_blocks_within(budget_bytes: int, config, block_size: int, dtype: torch.dtype = torch.float32) -> int:
    """Blocks of `block_size` tokens whose keys and values, every layer's, fit `budget_bytes` of one rank's memory.
    `config` is what the rank holds (`layers.rank_config`: its share of the KV heads), so at p ranks the same bytes
    hold p times the blocks, as long as p divides the KV heads (beyond that, vLLM copies KV heads to every rank)."""
    per_block = 2 * config.num_layers * config.num_kv_heads * config.head_dim * block_size * dtype.itemsize
    return budget_bytes // per_block


def largest_batch(llm, requests: int, prompt_tokens: int, new_tokens: int) -> int:
    """The most requests `llm` ran in one step when `requests` of `prompt_tokens` prompt and `new_tokens` new tokens
    arrive at once: its KV pool, not max_num_seqs, is what caps it when the pool is small (the scheduler admits
    what the free blocks hold, and preempts when growing sequences outrun them)."""
    import mini_engine as me

    engine = llm.engine
    engine.config.record_trace = True
    params = me.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(requests):
        engine.add_request([1 + (i * 7 + j) % 1000 for j in range(prompt_tokens)], params)  # no shared prefix
    while engine.has_unfinished():
        engine.step()
    most = max(len(record.chunks) for record in engine.trace)
    engine.trace.clear()
    engine.config.record_trace = False
    return most
