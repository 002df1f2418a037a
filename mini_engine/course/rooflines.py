"""The rooflines of the GPUs the course names, and what fewer bits per weight do to a decode step on each
(chapter 10's slider).

The figures are the vendors' published peaks: dense fp16 / bf16 tensor-core FLOP/s (the sparse figures on
the data sheets are twice these) and memory bandwidth. A quantized weight-only model (W4A16, W8A16) still
multiplies in 16 bits, so its compute roof is the same; only the bytes a step moves shrink.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import formulas as F


@dataclass(frozen=True)
class Roof:
    """A machine's two ceilings: peak FLOP/s and memory bytes/s."""
    name: str
    peak_flops: float
    peak_bw: float

    @property
    def ridge_point(self) -> float:
        return F.ridge_point(self.peak_flops, self.peak_bw)


# Colab offers the T4, L4 and A100; the H100 and H200 are what serving clusters run (DESIGN's devices).
GPU_ROOFS = {
    "T4": Roof("T4", 65e12, 320e9),                     # Turing: fp16 tensor cores only
    "L4": Roof("L4", 121e12, 300e9),
    "A100": Roof("A100-80GB SXM", 312e12, 2.039e12),    # the figures chapters 02, 04 and 09 use
    "H100": Roof("H100 SXM", 989e12, 3.35e12),
    "H200": Roof("H200 SXM", 989e12, 4.8e12),           # an H100's compute with faster, larger memory
}


@dataclass(frozen=True)
class QuantCeiling:
    """One machine's decode ceiling for weights of `weight_bits` bits (see `quantized_decode_ceilings`)."""
    machine: str
    weight_bits: float
    bytes_per_token: float    # bytes a decode step moves per token it produces
    tok_s: float              # the roofline's ceiling on decode tokens/s (the whole batch)
    speedup: float            # that ceiling over the same machine's with 16-bit weights
    bound: str                # "memory" or "compute"
    bits_at_ridge: float      # below this many bits per weight the step is compute-bound; 0: never


def quantized_decode_ceilings(model, weight_bits: float, batch: int = 1, context: int = 1024, kv_bytes: float = 2,
                              roofs: dict[str, Roof] | None = None) -> list[QuantCeiling]:
    """For each machine in `roofs` (default `GPU_ROOFS`): the bytes per token and the roofline ceiling of a decode
    step of `model` at `batch` sequences of `context` tokens, its weights stored at `weight_bits` bits each (with
    the scales: `formulas.bits_per_weight`) and its K/V cache and activations at `kv_bytes` bytes a value.

    Fewer bits pay while the step is memory-bound. Below `bits_at_ridge` the weights are no longer what limits
    the step, the arithmetic is, and the ceiling stops rising."""
    F._check_at_least("weight_bits", weight_bits, 1)
    F._check_at_least("batch", batch, 1)
    F._check_at_least("context", context, 1)
    if not kv_bytes > 0:
        raise ValueError(f"kv_bytes must be > 0, got {kv_bytes!r}")
    roofs = GPU_ROOFS if roofs is None else roofs
    if not roofs:
        raise ValueError("roofs: give at least one machine")
    flops = F.decode_flops(model, context, batch)
    moved = F.decode_bytes(model, batch, context, kv_bytes, weight_bits)
    rest = moved - F.weight_bytes(model, weight_bits / 8)  # the K/V and activations: no weight bits change them
    params = F.ModelShape.of(model).n_params
    rows = []
    for name, roof in roofs.items():
        tok_s = F.predicted_decode_tok_s(model, batch, context, kv_bytes, roof.peak_flops, roof.peak_bw, weight_bits)
        base = F.predicted_decode_tok_s(model, batch, context, kv_bytes, roof.peak_flops, roof.peak_bw, 16)
        # Compute-bound once the bytes take less time than the FLOPs: weight bytes < flops / ridge - the rest.
        at_ridge = max(0.0, 8 * (flops / roof.ridge_point - rest) / params)
        rows.append(QuantCeiling(name, float(weight_bits), moved / batch, tok_s, tok_s / base,
                                 F.roofline_bound(flops, moved, roof.peak_flops, roof.peak_bw), at_ridge))
    return rows
