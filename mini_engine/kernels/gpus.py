"""GPUs described as data, so a kernel's launch configuration can be chosen, and its compilation checked,
for a GPU that is not in this machine (a T4 or an L4 on Colab, an A100, an H100) as well as for the one that is.

The figures are NVIDIA's published limits for each architecture (CUDA C Programming Guide, "Technical
Specifications per Compute Capability"): shared memory a block may opt in to, registers per thread.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GPUSpec:
    name: str
    capability: tuple[int, int]   # compute capability (major, minor): sm_75 = (7, 5)
    shared_memory_per_block: int  # bytes a block may use when it opts in (more than the 48 KiB default)
    num_sms: int
    max_registers_per_thread: int = 255

    @property
    def arch(self) -> int:
        """Triton's target number: 75 for sm_75."""
        return self.capability[0] * 10 + self.capability[1]

    @property
    def supports_bf16(self) -> bool:
        """bf16 tensor-core products arrived with Ampere (sm_80); a T4 runs fp16 only."""
        return self.capability >= (8, 0)

    @property
    def model_dtype(self) -> torch.dtype:
        """The dtype the course runs a model in here, by `mini_engine.default_dtype`'s rule: bf16 from sm_80,
        fp16 below."""
        return torch.bfloat16 if self.supports_bf16 else torch.float16

    @property
    def tensor_core_dot(self) -> bool:
        """Whether Triton runs tl.dot on tensor cores here (mma on sm_80, wgmma on sm_90): from sm_80 on.
        Triton 3.x dropped its pre-Ampere MMA path (triton-lang/triton#5066), so on a T4 every product
        is a plain fused multiply-add (FMA) on the CUDA cores, even in fp16."""
        return self.capability >= (8, 0)

    @classmethod
    def from_device(cls, device: torch.device | str | int | None = None) -> "GPUSpec":
        """The spec of a visible CUDA device, read from the driver."""
        props = torch.cuda.get_device_properties(device)
        smem = getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block)
        return cls(props.name, (props.major, props.minor), smem, props.multi_processor_count)


@functools.cache
def _read_gpu(device: torch.device) -> GPUSpec:
    return GPUSpec.from_device(device)


def gpu_of(device: torch.device | str) -> GPUSpec:
    """The GPU a kernel launched on `device` runs on, read from the driver once per device."""
    return _read_gpu(torch.device(device))


def launch_arguments(compile_time_args: Callable[..., dict], device: torch.device | None, *args) -> dict:
    """A kernel's constexprs and launch options for one launch on `device`: `compile_time_args(*args, gpu)`, where
    gpu is `gpu_of(device)`, or None (the interpreter's tiles) when device is None.

    Every wrapper gets its launch arguments here, and some launch inside a compiled graph (the paged decode kernel
    and the quantized products inside the compiled decode step). There torch.compile runs this function, it does
    not trace it: the GPU is read (or found in the cache) while the graph is built, and the arguments enter the
    graph as constants, so neither a query of the driver nor the choice of tiles is traced code. The arguments
    must then be constants themselves, which they are in a graph compiled with dynamic=False (the compiled decode
    step's): sizes, dtypes and devices, each guarded, so a graph that sees others is compiled again."""
    return dict(_chosen_outside_the_trace(compile_time_args, device, *args))


@torch._dynamo.assume_constant_result
def _chosen_outside_the_trace(compile_time_args, device, *args) -> tuple[tuple[str, object], ...]:
    # As (name, value) pairs: a constant dict would make torch.compile guard on its keys, which it cannot do for
    # a constant; a tuple of constants it takes as it is, and the dict is rebuilt in the graph.
    return tuple(compile_time_args(*args, None if device is None else gpu_of(device)).items())


# The GPUs the course names, which every kernel must compile for (tests/kernels/test_aot.py): Colab's T4 and
# L4, an A100 and an H100.
T4 = GPUSpec("Tesla T4", (7, 5), 64 * 1024, 40)
L4 = GPUSpec("L4", (8, 9), 99 * 1024, 58)
A100 = GPUSpec("A100", (8, 0), 163 * 1024, 108)
H100 = GPUSpec("H100", (9, 0), 227 * 1024, 132)
TARGETS = (T4, L4, A100, H100)
