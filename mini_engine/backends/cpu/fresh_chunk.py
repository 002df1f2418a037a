"""Compiled decode steps started at the beginning of a frame-stack chunk, so that a step costs the same wherever it
is called from.

CPython up to 3.12 (and 3.13 and 3.14 before the fix of python/cpython#142183 was backported to them) keeps a
thread's Python frames in chunks of 16 KiB. A call whose frame does not fit in the current chunk maps a new chunk,
and the chunk is unmapped again when that frame returns. A compiled decode step makes some 120 Python calls from
one frame of Inductor's wrapper (each weight product reaches its packed copy through `packed_product`, a Python
operator). When that frame sits near a chunk's end, every one of those calls maps and unmaps a chunk and takes a
page fault, and the step runs about a quarter slower. Where the frame sits depends on every caller above it (the
CLI, a notebook, pytest, a benchmark's helper), so one commit's step measured 0.7x or 1.05x another's, depending
only on its callers.

`on_fresh_chunk` calls through a frame larger than a whole chunk: it never fits in the current one, so CPython
maps a chunk for it (32 KiB), and everything the step calls lies in that chunk at the same place on every call,
from any caller. That costs one map and unmap a step instead of a lottery. (A thread of its own would also start
the step at a chunk's beginning, but OpenMP regions run from a second thread slowed every step of the process on
2 cores: see benchmarks/RESULTS.md.)
"""
from __future__ import annotations

import types

from ...compiled_decode import DecodeGraphs

_CHUNK_BYTES = 16 * 1024  # CPython's frame-stack chunk (Python/pystate.c, DATA_STACK_CHUNK_SIZE)


def _call(fn, args, kwargs):
    return fn(*args, **kwargs)


# `_call` with a frame more than a chunk long: its value stack reserved larger than it needs (the unused slots cost
# only address space).
_call_from_a_chunk_of_its_own = types.FunctionType(
    _call.__code__.replace(co_stacksize=_call.__code__.co_stacksize + _CHUNK_BYTES // 8), globals(), "_call")


def on_fresh_chunk(fn, *args, **kwargs):
    """fn(*args, **kwargs), its frames laid at the same place of a frame-stack chunk of their own, whatever the
    caller's depth."""
    return _call_from_a_chunk_of_its_own(fn, args, kwargs)


class FreshChunkDecodeGraphs(DecodeGraphs):
    """A model's compiled decode steps (`DecodeGraphs`), each run through `on_fresh_chunk`."""

    def run(self, model, mode, *args, **kwargs):
        return on_fresh_chunk(super().run, model, mode, *args, **kwargs)
