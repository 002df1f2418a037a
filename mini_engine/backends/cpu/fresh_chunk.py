"""Compiled decode steps started at the beginning of a frame-stack chunk, so that a step costs the same wherever it
is called from.

CPython from 3.11 on keeps a thread's Python frames in chunks of 16 KiB. A call whose frame does not fit in the
current chunk maps a new chunk, and until the fix of python/cpython#142183 (in later 3.13 and 3.14 releases) the
chunk is unmapped again when that frame returns. A compiled decode step makes some 120 Python calls from one frame of
Inductor's wrapper (each weight product reaches its packed copy through `packed_product`, a Python operator). When
that frame sits near a chunk's end, every one of those calls maps and unmaps a chunk and takes a page fault, and
the step runs about a quarter slower. Where the frame sits depends on every caller above it (the CLI, a notebook,
pytest, a benchmark's helper), so one commit's step measured 0.7x or 1.05x another's, depending only on its
callers.

`on_fresh_chunk` calls through a frame larger than a whole chunk: it never fits in the current one, so CPython
maps a chunk for it (32 KiB), and everything the step calls lies in that chunk at the same place on every call,
from any caller. That costs one map and unmap a step instead of a lottery. (A thread of its own would also start
the step at a chunk's beginning, but OpenMP regions run from a second thread slowed every step of the process on
2 cores: see benchmarks/RESULTS.md.)

Not every interpreter has the problem: CPython 3.10 has no chunks (its frames are objects on the heap), and a
release with the fix keeps a spare chunk. `chunk_ends_cost_a_map` measures it once, and where it finds nothing to
avoid, `FreshChunkDecodeGraphs` calls each step plainly.
"""
from __future__ import annotations

import functools
import sys
import types

try:
    import resource
except ImportError:  # Windows: no page-fault count to measure with
    resource = None

from ...compiled_decode import DecodeGraphs

_CHUNK_BYTES = 16 * 1024  # CPython's frame-stack chunk (Python/pystate.c, DATA_STACK_CHUNK_SIZE)


def _call(fn, args, kwargs):
    return fn(*args, **kwargs)


def _with_spare_slots(n: int):
    """`_call` with its value stack reserved n slots (8n bytes) larger than it needs: what it calls lies 8n bytes
    further along the frame stack. The unused slots cost only address space."""
    code = _call.__code__
    return types.FunctionType(code.replace(co_stacksize=code.co_stacksize + n), globals(), "_call")


# `_call` with a frame more than a chunk long.
_call_from_a_chunk_of_its_own = _with_spare_slots(_CHUNK_BYTES // 8)


def on_fresh_chunk(fn, *args, **kwargs):
    """fn(*args, **kwargs), its frames laid at the same place of a frame-stack chunk of their own, whatever the
    caller's depth."""
    return _call_from_a_chunk_of_its_own(fn, args, kwargs)


def _from_depth(depth, fn):
    return fn() if depth == 0 else _from_depth(depth - 1, fn)


def at_every_stack_position(fn):
    """Yields fn() called from every 8-byte position of a frame-stack chunk: from under `depth` small frames (each
    between 64 and 256 bytes: 256 of them span more than a chunk), then from a frame 0 to 255 bytes longer."""
    calls = [_with_spare_slots(n) for n in range(32)]
    for depth in range(256):
        yield from _from_depth(depth, lambda: [call(fn, (), {}) for call in calls])


def _page_faults() -> int:
    # This thread's alone where the system can say (Linux), so that other threads' work does not count.
    return resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_minflt


def _leaf():
    return None


def faults_of_calls(calls: int) -> int:
    """Minor page faults while one frame makes `calls` small calls: about `calls` where each callee's frame lands
    past the chunk's end (a chunk mapped and unmapped per call), about none elsewhere."""
    before = _page_faults()
    for _ in range(calls):
        _leaf()
    return _page_faults() - before


@functools.cache
def chunk_ends_cost_a_map() -> bool:
    """Whether, on this interpreter, a call whose frame lands past a chunk's end maps a chunk each time: measured
    once (tens of milliseconds) by making calls from every position of a chunk and counting page faults. Where
    faults cannot be counted, assumed from CPython 3.11 on."""
    if resource is None:
        return sys.version_info >= (3, 11)
    calls = 16
    return any(faults >= calls // 2 for faults in at_every_stack_position(lambda: faults_of_calls(calls)))


class FreshChunkDecodeGraphs(DecodeGraphs):
    """A model's compiled decode steps (`DecodeGraphs`), each run through `on_fresh_chunk` where this interpreter
    has the chunk problem."""

    def run(self, model, mode, *args, **kwargs):
        if not chunk_ends_cost_a_map():
            return super().run(model, mode, *args, **kwargs)
        return on_fresh_chunk(super().run, model, mode, *args, **kwargs)
