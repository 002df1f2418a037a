"""This machine: what CPU it is, its measured ceilings (matmul FLOP/s and memory bandwidth, the two roofs
of the roofline), and which forms of the weight products the engine measured fastest on it."""
from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .devices import synchronize


# The instruction sets that decide which product forms win (flag names as Linux's /proc/cpuinfo spells them).
ISA_FLAGS = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX-512 BF16", "avx512_fp16": "AVX-512 FP16",
             "amx_bf16": "AMX-BF16", "asimd": "NEON", "sve": "SVE"}


@dataclass(frozen=True)
class CPUInfo:
    model: str
    cores: int           # logical CPUs this process may use
    isa: tuple[str, ...]  # the extensions of ISA_FLAGS this CPU has

    def __str__(self) -> str:
        return f"{self.model}, {self.cores} cores, {', '.join(self.isa) or 'no AVX2/AVX-512/NEON'}"


def cpu_info(cpuinfo: str | None = None) -> CPUInfo:
    """Read /proc/cpuinfo (Linux, x86 or Arm); elsewhere the platform's processor name, and no flags."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep:
            fields.setdefault(name.strip(), value.strip())
    model = fields.get("model name") or fields.get("Model") or platform.processor() or platform.machine()
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return CPUInfo(model, cores, tuple(label for flag, label in ISA_FLAGS.items() if flag in flags))


def describe_machine(device: str = "cpu") -> str:
    """One line naming the hardware a measurement ran on: the CPU, and the GPU when there is one. On a CPU, a second
    line says what the optional CPU backend did: its forms were timed on this machine, now or in an earlier run, and
    a reader comparing two runs must know which."""
    line = f"CPU: {cpu_info()}; torch {torch.__version__}, {torch.get_num_threads()} threads"
    if str(device).startswith("cuda") and torch.cuda.is_available():
        line += f"; GPU: {torch.cuda.get_device_name(device)}"
    elif str(device) == "cpu":
        from ..backends.cpu import state_line
        line += "\n" + state_line()
    return line


@dataclass(frozen=True)
class Ceilings:
    device: str
    dtype: str
    peak_flops: float   # FLOP/s of a large square matmul
    peak_bw: float      # bytes/s of a large tensor copy (bytes read + bytes written)

    @property
    def ridge_point(self) -> float:
        """FLOPs per byte above which a kernel is compute-bound on this machine."""
        return self.peak_flops / self.peak_bw


def _best_time(fn, device, repeats: int) -> float:
    fn()  # warm-up: first call pays for allocation and kernel selection
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_matmul_flops(device: str = "cpu", dtype=torch.float32, n: int = 1024, repeats: int = 5) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _best_time(lambda: a @ b, device, repeats)


def measure_memory_bandwidth(device: str = "cpu", mib: int = 256, repeats: int = 5) -> float:
    """A copy much larger than the caches: every byte goes to and from main memory."""
    src = torch.empty(mib * 2**20 // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best_time(lambda: dst.copy_(src), device, repeats)


def measure_ceilings(device: str = "cpu", dtype=torch.float32, quick: bool = False) -> Ceilings:
    n, mib = (512, 64) if quick else ((4096, 1024) if device.startswith("cuda") else (2048, 256))
    return Ceilings(device, str(dtype).removeprefix("torch."), measure_matmul_flops(device, dtype, n),
                    measure_memory_bandwidth(device, mib))


def matmul_floor_tok_s(model, batch: int = 1, repeats: int = 3, plain: bool = False) -> float:
    """The decode floor: tokens/s of the model's weight matrix products alone, chained for `batch` rows, with
    no attention, norms, sampling or Python bookkeeping. No engine computing its products this way can decode
    `batch` streams faster. By default the products are the model's own layers (with the CPU backend, each
    takes the form measured fastest here, `backends.cpu.products.Linear`); `plain=True` times F.linear, as HF transformers computes them."""
    import torch.nn.functional as F

    c = model.config
    layers = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
              for layer in model.layers]
    x = torch.randn(batch, c.hidden_size, device=model.device, dtype=model.dtype)
    attn_width, mlp_width = c.num_heads * c.head_dim, c.intermediate_size

    # A quantized layer (mini_engine/quant) has no float weight: F.linear then runs on its weight dequantized once, here.
    plain_weights = {id(lin): lin.weight if hasattr(lin, "weight") else lin.dequantize(model.dtype)
                     for lin in [model.lm_head, *(p for group in layers for p in group)]} if plain else {}

    def product(linear, h):
        return F.linear(h, plain_weights[id(linear)]) if plain else linear(h)

    def chain():
        h = x
        for qkv, o, gate_up, down in layers:  # slice each output to the next product's input width
            h = product(o, product(qkv, h)[:, :attn_width].contiguous())
            h = product(down, product(gate_up, h)[:, :mlp_width].contiguous())
        return product(model.lm_head, h)

    with torch.inference_mode():
        return batch / _best_time(chain, str(model.device), repeats)
