"""The CPU backend starts each compiled decode step at the beginning of a frame-stack chunk of its own
(`fresh_chunk`), so that the step's Python calls never straddle a chunk's end because of where it was called
from: no chunk mapped per call at any caller depth, the eager step's logits, the caller's errors."""
import copy
import resource
import sys

import pytest
import torch

from mini_engine.backends.cpu import install
from mini_engine.backends.cpu.fresh_chunk import FreshChunkDecodeGraphs, on_fresh_chunk
from mini_engine.compiled_decode import DecodeGraphs

from test_cached_equivalence import tiny_model
from test_compiled_decode import twin_steps

CALLS = 2000


def nest(depth: int, fn):
    return fn() if depth == 0 else nest(depth - 1, fn)


def leaf():
    return None


def faults_of_many_calls() -> int:
    """Minor page faults while one frame calls a small function CALLS times: about CALLS where each call's frame
    lands past the chunk's end (a chunk mapped and unmapped per call), about none elsewhere."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(CALLS):
        leaf()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_calls_on_a_fresh_chunk_cross_no_chunk_end_at_any_caller_depth():
    depths = range(200)  # more than a 16 KiB chunk's worth of these frames
    plain = [nest(d, faults_of_many_calls) for d in depths]
    fresh = [nest(d, lambda: on_fresh_chunk(faults_of_many_calls)) for d in depths]
    crossed = [d for d in depths if fresh[d] >= CALLS // 4]
    assert not crossed, f"depths that crossed a chunk's end through on_fresh_chunk: {crossed}"
    if sys.version_info < (3, 13):  # the lottery this removes: some depth of the plain calls crosses at every call
        assert max(plain) >= CALLS // 2, "no plain depth crossed: the measurement above would show nothing"


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
    assert [c.co_name for c in callers] == ["_call", "_call"], "each step called from the one-chunk frame"
    assert callers[0].co_stacksize * 8 > 16 * 1024
