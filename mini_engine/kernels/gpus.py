"""GPUs described as data, so a kernel's launch configuration can be chosen, and its compilation checked,
for a GPU that is not in this machine (a T4 on Colab, an A100, an H100) as well as for the one that is.

The figures are NVIDIA's published limits for each architecture (CUDA C Programming Guide, "Technical
Specifications per Compute Capability"): shared memory a block may opt in to, registers per thread.
"""
from __future__ import annotations

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
    def tensor_core_dot(self) -> bool:
        """Whether Triton runs tl.dot on tensor cores here (mma on sm_80, wgmma on sm_90): from sm_80 on.
        Triton 3.x dropped its pre-Ampere MMA path (triton-lang/triton#5066), so on a T4 every product
        is a plain fused multiply-add (FMA) on the CUDA cores, even in fp16."""
        return self.capability >= (8, 0)

    def dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtypes a kernel's wrapper can be asked to run on this GPU."""
        return (torch.float16, torch.bfloat16, torch.float32) if self.supports_bf16 else (torch.float16, torch.float32)

    @classmethod
    def from_device(cls, device: torch.device | str | int | None = None) -> "GPUSpec":
        """The spec of a visible CUDA device, read from the driver."""
        props = torch.cuda.get_device_properties(device)
        smem = getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block)
        return cls(props.name, (props.major, props.minor), smem, props.multi_processor_count)


# The three targets every kernel must compile for (tests/kernels/test_aot.py).
T4 = GPUSpec("Tesla T4", (7, 5), 64 * 1024, 40)
A100 = GPUSpec("A100", (8, 0), 163 * 1024, 108)
H100 = GPUSpec("H100", (9, 0), 227 * 1024, 132)
TARGETS = (T4, A100, H100)
