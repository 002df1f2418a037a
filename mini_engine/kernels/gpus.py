"""GPUs described as data, so a kernel's launch configuration can be chosen, and its compilation checked,
for a GPU that is not in this machine (a T4 or an L4 on Colab, an A100, an H100) as well as for the one that is.

The figures are NVIDIA's published limits for each architecture (CUDA C Programming Guide, "Technical
Specifications per Compute Capability"): shared memory a block may opt in to, registers per thread.
"""
from __future__ import annotations

import functools
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


@torch._dynamo.assume_constant_result
def gpu_of(device: torch.device) -> GPUSpec:
    """The GPU a kernel launched on `device` runs on, read from the driver once per device.

    The wrappers call it for every launch, and some launch inside a compiled graph (the paged decode kernel and
    the quantized products in the compiled decode step). There torch.compile runs this function, it does not
    trace it: the driver is asked (or the cache read) while the graph is built, and the spec enters the graph
    as a constant, so no query of the device is ever part of traced code. The device is fixed for a graph
    (its tensors' devices are guarded), so the constant cannot go stale."""
    return _read_gpu(torch.device(device))


# The GPUs the course names, which every kernel must compile for (tests/kernels/test_aot.py): Colab's T4 and
# L4, an A100 and an H100.
T4 = GPUSpec("Tesla T4", (7, 5), 64 * 1024, 40)
L4 = GPUSpec("L4", (8, 9), 99 * 1024, 58)
A100 = GPUSpec("A100", (8, 0), 163 * 1024, 108)
H100 = GPUSpec("H100", (9, 0), 227 * 1024, 132)
TARGETS = (T4, L4, A100, H100)
