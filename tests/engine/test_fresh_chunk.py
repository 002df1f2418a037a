"""The CPU backend starts each compiled decode step at the beginning of a frame-stack chunk of its own
(`fresh_chunk`) where the interpreter maps a chunk for every call past a chunk's end, so that the step's Python
calls never straddle a chunk's end because of where it was called from: no chunk mapped per call from any position
in the stack, the eager step's logits, the caller's errors. Elsewhere (CPython 3.10, a release with the fix of
python/cpython#142183) the backend calls each step plainly."""
import copy
import platform
import sys

import pytest
import torch

from mini_engine.backends.cpu import install
from mini_engine.backends.cpu.fresh_chunk import (FreshChunkDecodeGraphs, at_every_stack_position,
                                                  chunk_ends_cost_a_map, faults_of_calls, on_fresh_chunk)
from mini_engine.compiled_decode import DecodeGraphs

from test_cached_equivalence import tiny_model
from test_compiled_decode import twin_steps

CALLS = 64
HAS_THE_PROBLEM = chunk_ends_cost_a_map()


@pytest.mark.skipif(not HAS_THE_PROBLEM, reason=f"{platform.python_implementation()} {platform.python_version()} "
                    f"maps no chunk for a call past a frame-stack chunk's end (measured): the backend calls each "
                    f"compiled step plainly, and there is nothing for on_fresh_chunk to remove")
def test_calls_on_a_fresh_chunk_cross_no_chunk_end_from_any_stack_position():
    plain = list(at_every_stack_position(lambda: faults_of_calls(CALLS)))
    fresh = list(at_every_stack_position(lambda: on_fresh_chunk(faults_of_calls, CALLS)))
    # The lottery this removes: from some positions, every plain call maps a chunk.
    assert max(plain) >= CALLS // 2, "no plain position crossed a chunk's end: the measurement would show nothing"
    crossed = sum(faults >= CALLS // 4 for faults in fresh)
    assert not crossed, f"{crossed} of {len(fresh)} positions crossed a chunk's end through on_fresh_chunk"


def test_on_fresh_chunk_returns_and_raises_as_the_call_does():
    assert on_fresh_chunk(divmod, 7, 2) == (3, 1)
    assert on_fresh_chunk(sorted, [3, 1, 2], reverse=True) == [3, 2, 1]
    with pytest.raises(ZeroDivisionError):
        on_fresh_chunk(divmod, 1, 0)


def test_an_installed_models_compiled_step_runs_on_a_fresh_chunk_with_the_eager_logits(monkeypatch):
    model = install(tiny_model(4, 2))
    assert isinstance(model.decode_graphs, FreshChunkDecodeGraphs)
    assert type(copy.deepcopy(model).decode_graphs) is FreshChunkDecodeGraphs
    callers, plain_run = [], DecodeGraphs.run
    monkeypatch.setattr(DecodeGraphs, "run",
                        lambda *a, **k: callers.append(sys._getframe(1).f_code) or plain_run(*a, **k))
    for want, run in twin_steps(model, 2)[2]:
        torch.testing.assert_close(run(), want, rtol=1e-4, atol=1e-4)
    if HAS_THE_PROBLEM:
        assert [c.co_name for c in callers] == ["_call", "_call"], "each step called from the one-chunk frame"
        assert callers[0].co_stacksize * 8 > 16 * 1024
    else:
        assert [c.co_name for c in callers] == ["run", "run"], "each step called plainly: nothing to avoid here"
