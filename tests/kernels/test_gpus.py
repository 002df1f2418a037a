"""Which GPU a launch targets (`gpus.gpu_of`) is read outside traced code.

The paged decode kernel and the quantized products launch inside the compiled decode step, so their wrappers run
while torch.compile traces it. Each asks `gpu_of` for the GPU's description to choose its tiles; torch.compile
must run that function, not trace it (no query of the driver is part of a graph), and the answer must be the one
an eager call gets. On a CPU the driver is replaced by a stand-in that breaks any graph that traces it, and each
wrapper's choice of launch arguments is compiled whole, as it runs before a launch on a GPU."""
import importlib
import pathlib
import re

import pytest
import torch

from mini_engine.kernels import gpus

# The kernel modules (the package's names flash_attention and rejection_sampler are the wrapper functions).
flash_attention, paged_attention, kv_store, quant_matmul, int8_matmul, rejection_sampler = (
    importlib.import_module(f"mini_engine.kernels.{name}") for name in
    ("flash_attention", "paged_attention", "kv_store", "quant_matmul", "int8_matmul", "rejection_sampler"))


@pytest.fixture
def stand_in_gpu(monkeypatch):
    """`gpu_of` reads an A100 from a stand-in driver; returns the devices it was asked about, one per read."""
    asked = []

    def read(device):
        torch._dynamo.graph_break()  # inside a full graph this fails the compile: it must run, not be traced
        asked.append(device)
        return gpus.A100
    monkeypatch.setattr(gpus, "_read_gpu", read)
    return asked


def launch_arguments(x: torch.Tensor) -> list[dict]:
    """What each wrapper works out before it launches on x's device, as it does it."""
    gpu = gpus.gpu_of(x.device)
    return [flash_attention._compile_time_args(64, torch.bfloat16, True, True, gpu),
            paged_attention._compile_time_args(64, 16, 3, torch.bfloat16, gpu),
            kv_store._compile_time_args(64, 16, 3, torch.bfloat16, gpu),
            quant_matmul._compile_time_args(x.shape[0], 32, torch.bfloat16, gpu),
            int8_matmul._compile_time_args(x.shape[0], torch.bfloat16, gpu),
            rejection_sampler._compile_time_args(4, 49152, True, gpu)]


def tiles(arguments: list[dict]) -> list[int]:
    return [v for args in arguments for name, v in sorted(args.items()) if name.startswith(("BLOCK", "num_"))]


def test_the_gpu_is_read_outside_a_full_graph_and_enters_it_as_a_constant(stand_in_gpu):
    def step(x):
        return x * sum(tiles(launch_arguments(x)))

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    x = torch.ones(1, 4)
    expected = sum(tiles(launch_arguments(x)))  # eager: the A100's tiles
    assert len(stand_in_gpu) == 1
    assert torch.equal(compiled(x), x * expected)  # traced: read once, while the graph was built
    assert len(stand_in_gpu) == 2
    assert torch.equal(compiled(x), x * expected)  # replayed: not read again
    assert len(stand_in_gpu) == 2


def test_the_driver_is_read_once_per_device(monkeypatch):
    reads = []

    def from_device(device):
        reads.append(device)
        return gpus.H100
    monkeypatch.setattr(gpus.GPUSpec, "from_device", staticmethod(from_device))
    gpus._read_gpu.cache_clear()
    try:
        assert gpus.gpu_of("cuda:3") is gpus.gpu_of(torch.device("cuda", 3)) is gpus.H100
        assert gpus.gpu_of("cuda:2") is gpus.H100
        assert reads == [torch.device("cuda", 3), torch.device("cuda", 2)]
    finally:
        gpus._read_gpu.cache_clear()  # no stand-in answer outlives the test


def test_no_wrapper_asks_the_driver_itself():
    """Every kernel module goes through gpu_of: a direct query would be traced inside a compiled step."""
    folder = pathlib.Path(gpus.__file__).parent
    direct = [path.name for path in sorted(folder.glob("*.py")) if path.name != "gpus.py"
              and re.search(r"get_device_properties|from_device\(", path.read_text())]
    assert not direct, f"{direct} read the GPU's properties directly: call gpus.gpu_of(device) instead"
