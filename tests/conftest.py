"""Settings every test shares: which lab tree is graded, and no network, display or GPU assumed."""
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Without a GPU the Triton kernels are tested in Triton's interpreter, which reads this variable
# when triton is first imported: it must be set here, before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The CPU backend's tuner keeps what tests time in the clone's build/ folder (`make test` empties it first), never in
# the machine's store that chapters and benchmarks read: tests share the cores, and their timings are not a quiet run's.
os.environ.setdefault("MINI_ENGINE_TUNE_DIR", str(Path(__file__).resolve().parent.parent / "build" / "test-tuning"))
# Under pytest-xdist (`make test` runs two workers), the cores are split between the workers: two processes
# each running as many threads as there are cores would make every OpenMP barrier wait on a descheduled thread.
# OMP_NUM_THREADS carries the share to what a test starts (a server, a Jupyter kernel, the CLI). Set before
# mini_engine is imported, since the tuner's store is named by the thread count it times with.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    share = max(1, cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(share)
    torch.set_num_threads(share)


def pytest_addoption(parser):
    # Registered here, in the top conftest, since pytest takes options only from initial conftests.
    parser.addoption(
        "--impl",
        choices=("labs", "solutions"),
        default="solutions",
        help="which tree tests/labs grades: your work in labs/ or the reference in solutions/",
    )


@pytest.fixture
def plain_forms(monkeypatch):
    """Product forms pinned, untimed (float: F.linear; int4, int8: torch's packed kernels), here and in a server
    subprocess, for tests of the benches, whose tuning would cost a minute; the tuner's choices are put back
    after."""
    from mini_engine.backends.cpu.autotune import TUNER

    before = dict(TUNER.choices)
    pins = {"product": "linear", "int4_product": "int4pack", "int8_product": "int8pack"}
    monkeypatch.setattr(TUNER, "forced", {**TUNER.forced, **pins})
    monkeypatch.setenv("MINI_ENGINE_FORMS", ",".join(f"{op}={form}" for op, form in pins.items()))
    yield
    TUNER.choices.clear()
    TUNER.choices.update(before)


def pytest_collection_modifyitems(items):
    # The slow files first: pytest-xdist hands out files in this order (`make test` turns off its own order, most
    # tests first), and a minutes-long file started last would leave the other worker idle at the end.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True, scope="module")
def release_memory_after_each_file():
    """What a test file compiled or loaded is let go when it ends: Dynamo's caches keep every compiled graph, and
    through its guards the models it was traced with, for the life of the process, and glibc keeps freed pages.
    A worker runs half the suite, so without this it grew past 13 GB and was killed for memory."""
    yield
    import ctypes
    import gc

    torch._dynamo.reset()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        pass
