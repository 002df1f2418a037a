"""Device choice and workload sizing (chapter 00), so one notebook is meaningful on a GPU and finishes on a CPU."""
from __future__ import annotations

import time
from typing import Callable, Iterable, TypeVar

import torch

T = TypeVar("T")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str | torch.device) -> str:
    """The dtype the course runs the model in on `device`, by name (what `load_model` and `LLM` take).

    float32 on a CPU (exact, and what the reference numbers use). On a GPU, bfloat16 from compute capability 8.0
    (A100, L4, H100), whose tensor cores multiply it natively, and float16 below (T4, V100). The capability
    decides, not `torch.cuda.is_bf16_supported()`, which says True on a T4 because it counts emulated bf16: there
    every product would run as slow converted fp32, and Triton's bf16 kernels would not compile for it.
    """
    kind = torch.device(device).type
    if kind == "cpu":
        return "float32"
    if kind != "cuda":
        raise ValueError(f"device must be 'cpu' or a CUDA device, got {device!r}")
    major, _ = torch.cuda.get_device_capability(device)
    return "bfloat16" if major >= 8 else "float16"


def sdpa_backend(device: str | torch.device, dtype: torch.dtype):
    """The fused kernel of PyTorch's `scaled_dot_product_attention` to compare with on `device`: FlashAttention
    where the GPU has it (compute capability 8.0 or more, fp16 or bf16 inputs), else the memory-efficient kernel
    (any GPU from sm_50), else the plain math one. None on a CPU, where SDPA picks its own fused kernel.
    Use it as `with torch.nn.attention.sdpa_kernel(backend): ...`; `backend.name` says which one ran."""
    from torch.nn.attention import SDPBackend

    if torch.device(device).type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(device)
    if capability >= (8, 0) and dtype in (torch.float16, torch.bfloat16):
        return SDPBackend.FLASH_ATTENTION
    return SDPBackend.EFFICIENT_ATTENTION if capability >= (5, 0) else SDPBackend.MATH


def free_memory(device: str | torch.device) -> int | None:
    """Bytes a new workload can take on a GPU: what the driver reports free plus what PyTorch's allocator keeps
    reserved but unused (it hands that out first). None on a CPU, where the notebooks' sizes are small anyway."""
    if torch.device(device).type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def fitting(sizes: Iterable[T], nbytes: Callable[[T], float], device: str | torch.device, what: str = "size",
            headroom: float = 0.9) -> list[T]:
    """The sizes whose workload fits the device: `nbytes(size)` at most `headroom` of its free memory (every size
    on a CPU). Each size left out is printed with the reason, so a smaller GPU runs a shorter sweep instead of
    running out of memory. To shrink one workload, list candidates largest first and take the first kept."""
    sizes = list(sizes)
    free = free_memory(device)
    if free is None:
        return sizes
    kept = []
    for size in sizes:
        need = nbytes(size)
        if need <= headroom * free:
            kept.append(size)
        else:
            print(f"{what} = {size}: skipped, it needs {need / 2**30:.1f} GiB and this GPU has "
                  f"{free / 2**30:.1f} GiB free")
    return kept


def pick(cpu: T, gpu: T, device: str | None = None) -> T:
    """The one knob notebooks use to size workloads: the full one on a GPU, a smaller one on a CPU."""
    return gpu if (device or default_device()).startswith("cuda") else cpu


def synchronize(device: str | torch.device) -> None:
    """Wait for queued GPU work so a timer measures the work, not its launch."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str | torch.device = "cpu"):
    """Run `fn()` once; return (result, seconds), synchronising the device on both sides."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - t0


def warm_up(model, rows: int | Iterable[int] = 256) -> None:
    """Make, before anything is timed, the choices the engine would otherwise make inside the first timed run.

    `rows`: the token counts a forward pass will bring in the runs to come (the sequences of a decode step, the
    tokens of a prefill chunk), or one number for every count up to it. On a CPU the optional backend
    (`mini_engine/backends/cpu/`, appendix A1) times its equal forms of each weight product the first time the
    product meets a new count (per power of two), and keeps the fastest; here it does that for every count the
    runs will bring, off the clock. Where an earlier process on this machine kept those choices and checked them
    within a day, that is look-ups and a few spot checks (well under a second); what must still be timed or
    checked shows a progress bar naming each case. Nothing happens on a GPU or with MINI_ENGINE_CPU_BACKEND=0.
    It lives with the course's helpers so that no chapter needs to know the backend exists."""
    if isinstance(rows, int):
        rows = [1 << i for i in range((max(rows, 1) - 1).bit_length() + 1)]  # 1, 2, 4, ... up to rows or past it
    from ..backends import cpu as cpu_backend
    cpu_backend.warm_up(model, tuple(rows))
