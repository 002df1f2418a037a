"""The ranks of a tensor-parallel engine (chapter 11), vLLM's driver-worker shape: the engine's own process is rank 0
and runs the scheduler and the sampler; ranks 1 ... size-1 are processes of their own (started with `spawn`) that
each hold their share of the weights and of the KV cache and wait for work. Every step, rank 0 sends them one compact
message down a pipe, pickled once: the token ids and the plain lists the step's attention metadata is built from
(query and context lengths, block tables or slots; `AttentionMetadata.built_from`). Each rank builds its own
metadata from them (nano-vllm's workers do the same from the sequences), then all run the same forward pass, meeting
at the parallel layers' collectives; rank 0 gets the gathered logits. The block tables are rank 0's, so every rank
reads and writes the same blocks: of its own KV heads.

What a serving engineer expects of processes holds here: every rank joins the group before any weight is sent (so
start-up cannot outlast the group's timeout however large the model); a rank that raises sends its traceback up its
pipe, and rank 0's error quotes it; a rank that dies or stops answering turns the next step into a RuntimeError
within the timeout (MINI_ENGINE_TP_TIMEOUT seconds, default 60), never a hang; every rank is ended by `shutdown()`,
by leaving `with LLM(...)`, by an interrupted step, by garbage collection and at the interpreter's exit. A rank whose
parent goes away finds its pipe closed and exits. No shared memory is used, and the rendezvous folder is removed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
import weakref

import torch
import torch.multiprocessing as mp

from ..attention import AttentionMetadata
from ..kv_cache import ContiguousKVCache, PagedKVCache
from ..model import LlamaModel, rope_tables
from ..runner import ModelRunner
from .comm import Communicator
from .layers import shard_model, split

DEFAULT_TIMEOUT_S = 60.0
STARTUP_S = 300.0  # a new process importing torch on a loaded machine; one that dies is seen at once


def timeout_s() -> float:
    """Seconds a collective may wait for another rank (MINI_ENGINE_TP_TIMEOUT, default 60)."""
    return float(os.environ.get("MINI_ENGINE_TP_TIMEOUT", DEFAULT_TIMEOUT_S))


def threads_per_rank(size: int) -> int:
    """Each rank's share of the cores this process may use (at least one): ranks that each ran a thread per core
    would oversubscribe the CPU, and OpenMP teams would wait on descheduled threads."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // size)


def build_shard(config, rank: int, size: int, comm, attention_backend: str, device, dtype, weights: dict,
                layers: str | None = None, sequence_parallel: bool = False):
    """Rank `rank`'s model: the layers built at their shard's shapes on the meta device (no memory), then given
    storage and the rank's weights. The rank never holds the whole model. `layers`: see `layers.resolve_layers`;
    `sequence_parallel`: see `sequence.py`."""
    with torch.device("meta"):
        model = LlamaModel(config, attention_backend)
    shard_model(model, rank, size, comm, layers)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    model.rope_cos, model.rope_sin = rope_tables(config, device)  # not weights: computed again, as LlamaModel.empty
    model.load_state_dict(weights)
    if sequence_parallel:
        from .sequence import apply_sequence_parallel
        apply_sequence_parallel(model, rank, size, comm)
    return model.eval()


def cache_spec(kv_cache) -> tuple:
    """What another rank needs to build its share of rank 0's cache: the same blocks (or slots), its own KV heads."""
    if isinstance(kv_cache, PagedKVCache):
        return ("paged", kv_cache.num_blocks, kv_cache.block_size)
    return ("contiguous", kv_cache.num_slots, kv_cache.max_len)


def make_cache(spec: tuple, config, device, dtype):
    kind, a, b = spec
    return PagedKVCache(config, a, b, device, dtype) if kind == "paged" else ContiguousKVCache(config, a, b, device, dtype)


def moved(obj, device: torch.device):
    """`obj` (a tensor, or a dataclass, dict, list or tuple holding tensors) with its tensors on `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        moved_fields = {f.name: moved(getattr(obj, f.name), device) for f in dataclasses.fields(obj)}
        new = object.__new__(type(obj))
        new.__dict__.update(moved_fields)
        return new
    if isinstance(obj, dict):
        return {k: moved(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(moved(v, device) for v in obj)
    return obj


def _send(conn, message) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn):
    return pickle.loads(conn.recv_bytes())


def step_message(input_ids: torch.Tensor, meta, backend, last_only: bool, cache_id: int | None) -> bytes:
    """One forward step as the other ranks receive it, pickled once for all of them: the token ids and the plain
    lists `meta` was built from, not its tensors (a decode step's mask alone is batch x longest context)."""
    if meta is not None and meta.built_from is not None:
        rows = None if meta.logits_indices is None else meta.logits_indices.tolist()
        inputs = ("lists", input_ids.tolist(), meta.built_from, rows)
    else:  # no cache and no metadata (input_ids [B, N]), or metadata made by hand: its tensors, on the CPU
        cpu = torch.device("cpu")
        inputs = ("tensors", input_ids.to(cpu), moved(meta, cpu))
    return pickle.dumps(("forward", inputs, backend, last_only, cache_id), protocol=pickle.HIGHEST_PROTOCOL)


def step_inputs(inputs: tuple, device: torch.device):
    """(input_ids, meta) on `device`, from `step_message`'s inputs."""
    if inputs[0] == "tensors":
        return inputs[1].to(device), moved(inputs[2], device)
    _, ids, built_from, rows = inputs
    meta = AttentionMetadata.build(**built_from, device=device)
    if rows is not None:
        meta.logits_indices = torch.tensor(rows, dtype=torch.long, device=device)
    return torch.tensor(ids, dtype=torch.long, device=device), meta


def rank_main(rank: int, size: int, store_path: str, conn, threads: int, device: str, timeout: float,
              layers: str | None = None, sequence_parallel: bool = False) -> None:
    """A rank other than 0: join the group, receive its weights, then run what rank 0 sends until "stop" (or until
    rank 0's end of the pipe closes). An error sends its traceback to rank 0 and ends the process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 decides
    torch.set_num_threads(threads)
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        _send(conn, ("ready", None))  # torch is imported: what remains of start-up is quick
        comm = Communicator(store_path, rank, size, device, timeout)  # first: rank 0 sends weights once all are in
        _, config, backend, dtype, count = _recv(conn)
        weights = dict(_recv(conn) for _ in range(count))
        model = build_shard(config, rank, size, comm, backend, device, dtype, weights, layers, sequence_parallel)
        del weights
        caches = {}  # rank 0's cache id -> this rank's share of it
        while True:
            kind, *args = _recv(conn)
            if kind == "stop":
                break
            if kind == "cache":
                caches[args[0]] = make_cache(args[1], model.config, device, model.dtype)
            elif kind == "drop":
                del caches[args[0]]
            elif kind == "copy":
                caches[args[0]].copy_blocks(args[1])
            elif kind == "log":  # start logging each collective's time, or stop and send the log to rank 0
                if args[0]:
                    comm.log = []
                else:
                    _send(conn, ("log", comm.log or []))
                    comm.log = None
            elif kind == "forward":
                inputs, backend, last_only, cache_id = args
                ids, meta = step_inputs(inputs, device)
                model(ids, meta, None if cache_id is None else caches[cache_id], backend, last_only)
    except EOFError:
        pass  # rank 0 has gone: nothing is left to serve
    except BaseException:
        with contextlib.suppress(OSError, ValueError):
            _send(conn, ("error", traceback.format_exc()))
        raise


@contextlib.contextmanager
def _main_left_out():
    """A rank runs package code only: it need not import the script that made the engine, as `spawn` does by
    default (a script without an `if __name__ == "__main__":` guard would then make an engine in every rank)."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__.pop(k) for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)


def _end_ranks(ranks: list, folder: str) -> None:
    """Stop every rank (politely, then by force), close the pipes, remove the rendezvous folder. Runs once."""
    for _, conn in ranks:
        with contextlib.suppress(OSError, ValueError):
            _send(conn, ("stop",))
    for process, conn in ranks:
        process.join(2.0)
        if process.is_alive():  # busy in a collective that will never complete, or stopped (SIGSTOP)
            process.kill()
            process.join(5.0)
        conn.close()
    shutil.rmtree(folder, ignore_errors=True)


class Ranks:
    """Processes 1 ... size-1 behind the engine's own (rank 0), for a model split over them (`ParallelModel`, and
    `pipeline.PipelineModel`, whose ranks are stages): started with `spawn`, each with a pipe to this process and its
    share of the cores; ended by `shutdown()`, garbage collection or the interpreter's exit (a finalizer), after
    which the rendezvous folder is gone. A step that fails ends them all and raises, quoting what they said."""

    noun = "rank"
    step_failed = "step failed"  # what a failed step's error opens with

    def __init__(self, size: int, timeout: float | None, prefix: str):
        self.size, self.timeout = size, timeout_s() if timeout is None else timeout
        self.threads = threads_per_rank(size)
        self.folder = tempfile.mkdtemp(prefix=prefix)  # the rendezvous: file stores in it
        self._ranks: list = []  # (process, pipe) of ranks 1 ... size-1
        self._finalizer = weakref.finalize(self, _end_ranks, self._ranks, self.folder)  # at exit, or when collected
        self.failure: str | None = None
        self._caches: dict[int, weakref.ref] = {}  # id -> a KV cache of rank 0's that the others mirror (their share)
        self._cache_ids = itertools.count()

    def _spawn(self, target, args_of) -> None:
        """Start ranks 1 ... size-1 running `target(*args_of(rank, pipe))`, then wait until each says it is ready
        (imports done: seconds on a quiet machine, a minute on a loaded one), so that the group's own timeout only
        counts from then. A rank that dies on the way is an error at once."""
        ctx = mp.get_context("spawn")
        for rank in range(1, self.size):
            parent, child = ctx.Pipe()
            process = ctx.Process(target=target, args=args_of(rank, child), daemon=True,
                                  name=f"mini_engine-{self.noun}{rank}")
            with _main_left_out():
                process.start()
            child.close()
            self._ranks.append((process, parent))
        for rank, (process, conn) in enumerate(self._ranks, start=1):
            deadline = time.monotonic() + STARTUP_S
            while not conn.poll(1.0):
                if not process.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"{self.noun} {rank} did not start within {STARTUP_S:g} s"
                                       if process.is_alive() else f"{self.noun} {rank} died while starting")
            kind, _ = _recv(conn)
            if kind != "ready":
                raise RuntimeError(f"{self.noun} {rank} sent {kind!r} while starting")

    @property
    def pids(self) -> list[int]:
        """The process ids of ranks 1 ... size-1 (rank 0 is this process)."""
        return [process.pid for process, _ in self._ranks]

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def shutdown(self) -> None:
        """End every other rank and remove the rendezvous folder; safe to call more than once."""
        self._finalizer()

    def _cache_id(self, kv_cache) -> int | None:
        """The id under which the other ranks hold their share of `kv_cache` (made on first use): two engines may
        share one set of ranks, each with a cache of its own. The ranks let go of a cache rank 0 no longer holds."""
        found = None
        for cache_id, ref in list(self._caches.items()):
            if ref() is None:
                self._broadcast(("drop", cache_id))
                del self._caches[cache_id]
            elif ref() is kv_cache:
                found = cache_id
        if found is None and kv_cache is not None:
            found = next(self._cache_ids)
            self._broadcast(("cache", found, cache_spec(kv_cache)))
            self._caches[found] = weakref.ref(kv_cache)
        return found

    def _broadcast(self, message) -> None:
        """`message` to every other rank, pickled once (bytes are sent as they are)."""
        data = message if isinstance(message, bytes) else pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for _, conn in self._ranks:
            conn.send_bytes(data)

    def _replies(self, kind: str) -> list:
        """Each other rank's answer of `kind`, in rank order, each within the timeout."""
        out = []
        for rank, (_, conn) in enumerate(self._ranks, start=1):
            if not conn.poll(self.timeout):
                raise TimeoutError(f"{self.noun} {rank} did not send its {kind}: timed out")
            got, payload = _recv(conn)
            if got != kind:
                raise RuntimeError(f"{self.noun} {rank} sent {got!r} in place of its {kind}")
            out.append(payload)
        return out

    @contextlib.contextmanager
    def _threads(self):
        """This process computes as rank 0 with its share of the cores, and with all of them again afterwards."""
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _reports(self) -> tuple[list[str], list[str]]:
        """What the other ranks say about their end: (causes, tracebacks). A rank that raised on its own is a cause, as
        is one that exited without a word; one that raised only because a peer went (a closed connection, a
        collective timed out) is not, but its traceback is kept. Waits a moment for a rank still on its way out."""
        causes, tracebacks = [], []
        for rank, (process, conn) in enumerate(self._ranks, start=1):
            process.join(0.5)
            said = None
            with contextlib.suppress(OSError, EOFError, ValueError):
                while said is None and conn.poll(0.1 if process.exitcode is not None else 0):
                    kind, payload = _recv(conn)
                    said = payload.rstrip() if kind == "error" else None
            name = f"{self.noun} {rank} (pid {process.pid})"
            if said is not None:
                last = said.splitlines()[-1]
                if not any(s in last.lower() for s in ("connection closed", "timed out", "connection reset")):
                    causes.append(f"{name} raised {last}")
                tracebacks.append(f"{self.noun} {rank}'s traceback:\n{said}")
            elif process.exitcode is not None:
                causes.append(f"{name} exited with code {process.exitcode}")
        return causes, tracebacks

    def _check(self) -> None:
        if self.closed:
            raise RuntimeError(f"this engine's {self.noun}s have been shut down"
                               f"{' (' + self.failure.splitlines()[0] + ')' if self.failure else ''}; "
                               "make a new LLM to go on")
        if any(not process.is_alive() for process, _ in self._ranks):
            self._fail(None)

    def _fail(self, error: BaseException | None, what: str | None = None):
        """A step could not complete: end every rank (they can no longer agree on the cache), then raise, naming the
        cause first and quoting the ranks' own tracebacks."""
        causes, tracebacks = self._reports()
        self.shutdown()
        if isinstance(error, KeyboardInterrupt):
            self.failure = "interrupted"
            raise error
        timed_out = error is not None and "timed out" in str(error).lower() or any("imed out" in t for t in tracebacks)
        if not causes:
            causes = [f"a {self.noun} did not answer within {self.timeout:g} s" if timed_out else
                      f"{type(error).__name__}: {error}"]
        self.failure = "\n".join(causes + tracebacks)
        raise RuntimeError(f"{what or self.step_failed}: {self.failure}\nEvery {self.noun} has been shut down; make a new LLM to go on") \
            from error


class ParallelRunner(ModelRunner):
    """Rank 0's runner: the core's, which also hands each step's copy-on-write block copies to the other ranks."""

    def execute(self, chunks, block_copies=()):
        if block_copies:
            self.model.copy_blocks(block_copies, self.kv_cache)
        return super().execute(chunks, block_copies)


class ParallelModel(Ranks):
    """What the engine holds in place of a LlamaModel when the model is split over `size` ranks: rank 0's shard,
    and the other ranks behind it. Calling it runs one forward pass on every rank and returns the whole logits.
    `config` is one rank's share (its heads and KV heads, which size the engine's KV cache; the whole vocabulary).
    Built from `full`, a model in the core's plain modules on the CPU, which the caller then lets go.

    `layers` (the hook lab 11 serves through): the dotted name of a module whose weight splits and layer classes
    every rank builds its shard from in place of the engine's (`layers.resolve_layers` names what it may bring);
    hand the result to `LLMEngine(model, tokenizer, config)` to serve with them."""

    runner_class = ParallelRunner  # LLMEngine builds this runner for a model that brings one
    step_failed = "tensor-parallel step failed"

    def __init__(self, full: LlamaModel, size: int, device="cpu", timeout: float | None = None,
                 layers: str | None = None, sequence_parallel: bool = False):
        super().__init__(size, timeout, "mini_engine_tp_")
        device = torch.device(device)
        self.quantization = None
        self.sequence_parallel = sequence_parallel
        store = os.path.join(self.folder, "store")
        first = (device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else 0  # rank r runs on cuda:first+r, counted from rank 0's own GPU
        try:
            self._spawn(rank_main, lambda rank, conn: (
                rank, size, store, conn, self.threads, f"cuda:{first + rank}" if device.type == "cuda" else "cpu",
                self.timeout, layers, sequence_parallel))
            with self._threads():
                self.comm = Communicator(store, 0, size, device, self.timeout)  # waits for every rank to join
            state = full.state_dict()
            for rank, (_, conn) in enumerate(self._ranks, start=1):  # one weight at a time: no second whole copy
                _send(conn, ("load", full.config, full.attention_backend, full.dtype, len(state)))
                for name, w in state.items():
                    _send(conn, (name, split(name, w, full.config, rank, size, layers)))
            with self._threads():
                mine = {name: split(name, w, full.config, 0, size, layers) for name, w in state.items()}
                self.shard = build_shard(full.config, 0, size, self.comm, full.attention_backend, device, full.dtype,
                                         mine, layers, sequence_parallel)
        except BaseException as e:
            if isinstance(e, (OSError, EOFError, RuntimeError)):
                self._fail(e, "a tensor-parallel rank failed to start")
            self.shutdown()
            raise
        self.config = self.shard.config

    # What LLMEngine reads of a model.
    @property
    def device(self) -> torch.device:
        return self.shard.device

    @property
    def dtype(self) -> torch.dtype:
        return self.shard.dtype

    @property
    def attention_backend(self) -> str:
        return self.shard.attention_backend

    def __repr__(self) -> str:
        state = "shut down" if self.closed else f"ranks 1-{self.size - 1}: pids {self.pids}"
        return f"ParallelModel({self.size} ranks, {self.threads} thread(s) each, {self.device}, {state})"

    def __call__(self, input_ids, meta=None, kv_cache=None, backend=None, last_only=False):
        self._check()
        try:
            self._broadcast(step_message(input_ids, meta, backend, last_only, self._cache_id(kv_cache)))
            with self._threads():
                return self.shard(input_ids, meta, kv_cache, backend, last_only)
        except BaseException as e:
            self._fail(e)

    def copy_blocks(self, pairs, kv_cache) -> None:
        """The other ranks' share of a step's copy-on-write in `kv_cache` (rank 0's own is copied by the runner)."""
        self._check()
        try:
            self._broadcast(("copy", self._cache_id(kv_cache), list(pairs)))
        except BaseException as e:
            self._fail(e)

    def collective_log(self, on: bool) -> list[list[float]] | None:
        """Start logging every rank's seconds in each collective (on=True); or stop, and return the logs, one list a
        rank in rank order, each collective in the same place in every list (all ranks run the same ones)."""
        self._check()
        try:
            self._broadcast(("log", on))
            if on:
                self.comm.log = []
                return None
            logs = [self.comm.log or []] + self._replies("log")
            self.comm.log = None
            return logs
        except BaseException as e:
            self._fail(e)
