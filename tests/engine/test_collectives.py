"""The collectives inside an all-reduce (mini_engine/parallel/collectives.py, chapter 11), on three real ranks: the
all-reduce built from a reduce-scatter then an all-gather equals torch.distributed's, and each collective equals its
definition computed from every rank's input; the timing functions return a mean for every collective and payload,
and the overlap's serial and overlapped steps. No timing is asserted (the machine is shared)."""
from __future__ import annotations

import os

import pytest

from mini_engine.parallel.collectives import (COLLECTIVES, check_collectives, collective_seconds, overlap_seconds)

SIZE = 3


@pytest.fixture(scope="module", autouse=True)
def patient_ranks():
    """A busy machine may start the three ranks slowly: collectives wait up to 300 s (unless told otherwise)."""
    before = os.environ.get("MINI_ENGINE_TP_TIMEOUT")
    os.environ.setdefault("MINI_ENGINE_TP_TIMEOUT", "300")
    yield
    if before is None:
        del os.environ["MINI_ENGINE_TP_TIMEOUT"]


@pytest.fixture(scope="module")
def errors():
    """One run of the checks on three fresh ranks (7 rows: the composed all-reduce pads to 9)."""
    return check_collectives(SIZE, shape=(7, 5))


def test_reduce_scatter_then_all_gather_is_the_all_reduce(errors):
    """fp32 sums taken in another order may differ in the last bits (values about 1): 1e-6, not 0."""
    assert set(errors) == set(COLLECTIVES)
    assert errors["all_reduce_from_halves"] < 1e-6, errors


def test_each_collective_equals_its_definition(errors):
    """all_reduce: the sum of the ranks' inputs; reduce_scatter: rank r's slice r of that sum; all_gather: the
    inputs joined in rank order, exactly (a copy)."""
    assert errors["all_reduce"] < 1e-6 and errors["reduce_scatter"] < 1e-6, errors
    assert errors["all_gather"] == 0, errors


def test_collective_seconds_times_every_collective_at_every_payload():
    seconds = collective_seconds([64, 9216], SIZE, repeats=2)
    assert set(seconds) == set(COLLECTIVES)
    assert all(len(s) == 2 and all(t > 0 for t in s) for s in seconds.values()), seconds


def test_overlap_times_the_serial_and_the_overlapped_step():
    o = overlap_seconds(SIZE, tokens=64, repeats=2)
    assert min(o.compute_s, o.all_reduce_s, o.serial_s, o.overlapped_s) > 0
    assert o.gain == pytest.approx(o.serial_s / o.overlapped_s)


def test_a_payload_that_does_not_divide_is_refused_by_name():
    """reduce_scatter needs rows that divide by the group's size; the error says so before any collective."""
    import torch

    from mini_engine.parallel.comm import Communicator
    comm = Communicator.__new__(Communicator)  # no group needed: the check comes first
    comm.size = SIZE
    with pytest.raises(ValueError, match=r"first dimension \(7\) must divide by the group's size \(3\)"):
        comm.reduce_scatter(torch.zeros(7, 2))
