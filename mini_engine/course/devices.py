"""Device choice and workload sizing (chapter 00), so one notebook is meaningful on a GPU and finishes on a CPU."""
from __future__ import annotations

import time
from typing import TypeVar

import torch

T = TypeVar("T")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> torch.dtype:
    """fp32 on a CPU (exact, and what the reference numbers use); bf16 on a GPU that has it, else fp16 (T4)."""
    if device == "cpu":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


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
