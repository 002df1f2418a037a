"""Each kernel's launch arguments, and the GPU they are chosen for, are worked out outside traced code.

The paged decode kernel and the quantized products launch inside the compiled decode step, so their wrappers run
while torch.compile traces it. Each takes its tiles from `gpus.launch_arguments`, which reads the GPU's
description (`gpus.gpu_of`); torch.compile must run that function, not trace it (no query of the driver, no
choice of tiles is part of a graph), and its answer must be the one an eager call gets. On a CPU the driver is
replaced by a stand-in that fails any full graph that traces it."""
import ast
import importlib
import pathlib

import pytest
import torch

from mini_engine.kernels import aot, gpus

# The kernel modules (the package's names flash_attention and rejection_sampler are the wrapper functions).
MODULES = {name: importlib.import_module(name) for name in aot.KERNEL_MODULES}
# For each, the arguments of a launch the course makes (what its wrapper passes to launch_arguments).
LAUNCHES = {"flash_attention": (64, torch.bfloat16, True, True), "paged_attention": (64, 16, 3, torch.bfloat16),
            "kv_store": (64, 16, 3, torch.bfloat16), "rejection_sampler": (4, 49152, True),
            "quant_matmul": (1, 32, torch.bfloat16), "int8_matmul": (1, torch.bfloat16)}


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


def tiles(x: torch.Tensor) -> list[int]:
    """Every kernel's tile sizes, warps and stages for a launch on x's device, as its wrapper asks for them."""
    found = []
    for module, args in LAUNCHES.items():
        chosen = gpus.launch_arguments(MODULES[f"mini_engine.kernels.{module}"]._compile_time_args, x.device, *args)
        found += [chosen[name] for name in sorted(chosen) if name.startswith(("BLOCK", "num_"))]
    return found


def test_launch_arguments_are_worked_out_outside_a_full_graph(stand_in_gpu):
    def step(x):
        return x * sum(tiles(x))

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    x = torch.ones(4)
    expected = sum(tiles(x))  # eager: the A100's tiles, one read per kernel
    assert len(stand_in_gpu) == len(LAUNCHES)
    assert torch.equal(compiled(x), x * expected)  # traced: the same tiles, read while the graph was built
    assert len(stand_in_gpu) == 2 * len(LAUNCHES)
    assert torch.equal(compiled(x), x * expected)  # replayed: nothing read again
    assert len(stand_in_gpu) == 2 * len(LAUNCHES)


def test_the_interpreter_gets_its_own_tiles_and_no_gpu_is_read(stand_in_gpu):
    chosen = gpus.launch_arguments(MODULES["mini_engine.kernels.paged_attention"]._compile_time_args, None,
                                   *LAUNCHES["paged_attention"])
    assert chosen["BLOCK_N"] == 16 and chosen["num_warps"] == 1 and not stand_in_gpu


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


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_wrapper_takes_its_launch_arguments_from_launch_arguments(module):
    """A wrapper that called _compile_time_args or read the GPU itself would trace both inside a compiled step;
    only aot_specs (which names its GPU) calls _compile_time_args directly."""
    tree = ast.parse(pathlib.Path(MODULES[module].__file__).read_text())
    for function in (node for node in tree.body if isinstance(node, ast.FunctionDef)):
        called = {node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
                  for node in ast.walk(function) if isinstance(node, ast.Call)}
        if function.name != "aot_specs":
            assert "_compile_time_args" not in called, f"{module}.{function.name} calls _compile_time_args"
        assert not called & {"gpu_of", "from_device", "get_device_properties"}, \
            f"{module}.{function.name} reads the GPU itself: go through gpus.launch_arguments"
    assert "launch_arguments" in pathlib.Path(MODULES[module].__file__).read_text()


class StandInKernel:
    """Takes a kernel's place: `kernel[grid](*args, **launch_arguments)` records the grid and launch arguments."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, kwargs))
        return launch


def meta_calls():
    """The wrappers that launch inside the compiled decode step, each with inputs on the meta device (shapes and
    dtypes, no data: what a GPU's tensors look like to the code before the launch), and the launch arguments
    each must choose for an A100."""
    paged = MODULES["mini_engine.kernels.paged_attention"]
    w4a16, w8a16 = MODULES["mini_engine.kernels.quant_matmul"], MODULES["mini_engine.kernels.int8_matmul"]
    meta = dict(device="meta")
    x = torch.empty(2, 576, dtype=torch.bfloat16, **meta)
    return {
        "paged_decode_attention": (paged, "_paged_decode_fwd", lambda: paged.paged_decode_attention(
            torch.empty(2, 9, 64, dtype=torch.bfloat16, **meta), torch.empty(8, 16, 3, 64, dtype=torch.bfloat16, **meta),
            torch.empty(8, 16, 3, 64, dtype=torch.bfloat16, **meta), torch.empty(2, 4, dtype=torch.int32, **meta),
            torch.empty(2, dtype=torch.int32, **meta)), paged._compile_time_args(64, 16, 3, torch.bfloat16, gpus.A100)),
        "w4a16_matmul": (w4a16, "_w4a16_matmul", lambda: w4a16.w4a16_matmul(
            x, torch.empty(960, 288, dtype=torch.uint8, **meta), torch.empty(18, 960, 2, dtype=torch.bfloat16, **meta),
            32), w4a16._compile_time_args(2, 32, torch.bfloat16, gpus.A100)),
        "w8a16_matmul": (w8a16, "_w8a16_matmul", lambda: w8a16.w8a16_matmul(
            x, torch.empty(960, 576, dtype=torch.int8, **meta), torch.empty(960, dtype=torch.bfloat16, **meta)),
            w8a16._compile_time_args(2, torch.bfloat16, gpus.A100)),
    }


@pytest.mark.parametrize("wrapper", list(meta_calls()))
def test_a_wrapper_traces_as_one_graph_up_to_its_launch(wrapper, stand_in_gpu, monkeypatch):
    """Everything a wrapper does before its launch (checks, layouts, the launch arguments) compiles into one graph,
    as it must inside the compiled decode step; the launch itself is a stand-in here (a Triton launch in a graph
    runs where there is a GPU: tests/engine/test_quant_gpu.py, tests/engine/test_compiled_decode.py)."""
    module, kernel, call, expected = meta_calls()[wrapper]
    monkeypatch.setattr(module, "INTERPRETED", False)  # launch as on a GPU (the stand-in driver's A100)
    monkeypatch.setattr(module, kernel, StandInKernel())
    torch.compile(call, fullgraph=True, backend="eager")()
    (_, chosen), = getattr(module, kernel).launches
    assert chosen == expected and len(stand_in_gpu) == 1
