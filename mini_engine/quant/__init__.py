"""Weight-only quantization: int8 per output channel, int4 per group, and the GGUF's own Q4_1 weights repacked.

Decode on a CPU is memory-bound: every step reads every weight once, so reading 4 bits per weight instead of 32
is the largest single speedup left. Only the weights are quantized; activations stay in the model's dtype
(weight-only, "W4A16" / "W8A16"), and every product is y = x W^T with W rebuilt from small integers:

- int8, per output channel (symmetric): w[n, k] = q[n, k] * scale[n], q in [-127, 127].
- int4, per group of `group_size` (32 by default) weights along a row (asymmetric), in the rule torch's CPU
  kernel uses: w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g], q in [0, 15], g = k // group_size.
  Round-to-nearest (RTN) from float weights: scale = (max - min) / 15, zero = min + 8 * scale per group.
- Q4_1 (the embedded GGUF's linear layers): blocks of 32 weights with an fp16 scale d and an fp16 minimum m,
  w = d * q + m. That is the int4 rule with scale = d and zero = m + 8 d, so the checkpoint's own 4-bit codes
  are repacked as they are: no re-quantization. The only loss is the scales' dtype: torch's int4 CPU kernel
  takes its scales and zeros in bf16 (8 significant bits against fp16's 11), which moves a weight by at most
  |q - 8| |d - bf16(d)| + |zero - bf16(zero)|, about 1/64 of one quantization step (measured below).

Layouts. `pack_int4` keeps two codes per byte along a row (low nibble: even column), the portable layout the
Triton kernel reads (`kernels/quant_matmul.py`). On a CPU an `Int4Linear` holds its codes in the layout torch's
packed kernel wants instead (`torch.ops.aten._convert_weight_to_int4pack_for_cpu`: blocks of 64 rows with
AVX-512, 32 with AVX2), and nothing else, so the model keeps one copy of its codes; `CPUInt4Layout` reads that
layout back. Which layout this torch build writes is found by packing a probe once (`cpu_int4_layout`), not
assumed. int8 weights are a plain row-major int8 matrix, which is what `torch.ops.aten._weight_int8pack_mm`
reads, so their pack and unpack are the identity.

Products, chosen by measurement. Each quantized layer has several equal forms of its product (the same sums
to rounding), timed on this machine per weight shape, row bucket and dtype by the autotuner (`autotune.TUNER`,
ops "int4_product" and "int8_product": MINI_ENGINE_FORMS="int4_product=int4pack" pins one), as
`products.Linear` does for float weights:
- `dequant`: dequantize the weight in the activations' dtype, then F.linear (the plain form);
- `int4pack`: torch's packed int4 kernel, `_weight_int4pack_mm_for_cpu`, on bf16 activations (an fp32 model's
  activations are cast to bf16 and the result back to fp32; the kernel's fp32-activation variant is a scalar
  reference loop, 40x slower here, so it is not a candidate). What the casts cost, measured: 4.3 ms against
  3.95 ms for the 120 chained products at one row (bf16 activations in and out), and in quality nothing
  visible: the int4 decoder with the fp32 head agreed with the fp32 model on 98.0% of greedy positions at
  perplexity 53.73 against 53.84 (the table below);
- `int8pack` / `int8pack_bf16`: torch's `_weight_int8pack_mm` on the activations as they are / cast to bf16
  (its fp32 path was 10x slower than its bf16 one here);
- `dequant_bf16`: dequantize to bf16 and F.linear in bf16 (for many rows, where a bf16 GEMM beats the int4
  kernel);
- `c_int4`: this project's C kernel (`cpu_kernels.int4_gemm`, csrc/int4_gemm.c) on the same packed codes, with
  fp32 activations (exact products of the int4 weights, where `int4pack` rounds x to bf16; bf16 activations are
  widened to fp32 for it), on x86 CPUs with AVX2 (16 lanes wide where the CPU has AVX-512). Per group of 32
  columns it sums q x over the codes converted to floats, then applies the scale and zero once:
  y += s * sum(q x) + (z - 8 s) * sum(x). A graph reaches it through the C++ operator
  `mini_engine_cpp::int4_gemm` (csrc/torch_ops.cpp), or `mini_engine::int4_gemm` where that cannot be built.
- `c_int8`: the same for int8 weights (`cpu_kernels.int8_gemm`, csrc/int8_gemm.c), fp32 activations, each row's
  scale applied once to its sum; a graph reaches it as `c_int4` does (`int8_gemm`). For the int4 model's head
  at one row, on an AVX2-only AMD EPYC (Zen 3): 2.3-2.7 ms against 3.1-3.5 ms for `int8pack_bf16`.
- `amx_int4` / `amx_int8`: the same products on Intel AMX (`cpu_kernels.int4_gemm(..., amx=True)`,
  csrc/int4_gemm_amx.c and int8_gemm_amx.c), on CPUs that have it (Xeon, Sapphire Rapids and later). x is
  rounded to bf16 as in `int4pack`; the tiles hold the codes themselves (small integers, exact in bf16), so each
  weight becomes bf16 once per call and then serves 16 rows of x per tile instruction, and the scales are applied
  in fp32 (int4: per group, as `c_int4` does; int8: per row, once). That is what the forms above lack past a few
  rows: they dequantize again for every row or every 4 rows.
On a GPU the products go through Triton kernels that dequantize inside the product, never a whole weight per
call: int4 layers through the W4A16 kernel (`kernels.quant_matmul`) on the portable layout, int8 layers through
the W8A16 one (`kernels.int8_matmul`: the codes enter the product exactly, the row's scale is applied once to its
sum). What a kernel reads (`QuantLinear.kernel_operands`) is made once, when the layer lands on the GPU, and kept
until it moves again. For int4 and int8 it is the stored codes and scales themselves; for `int4_compact` it is
the 8-bit d and m expanded once to fp32 scales and zeros (w = (q - 8) * d + (m + 8 d), exact), 8 bytes a group
beside the 2 stored: 6.5 bits a weight held on the GPU where `weight_bytes` counts the 4.5 stored.

Measured on a 2-core Intel Xeon with AMX-BF16 (2026-12-02, torch 2.13, 2 threads), the 120 int4 products of the
layers chained, best of 5 (ms):
    rows   int4pack   c_int4   dequant_bf16   amx_int4
      1       4.7       12.9       164            8.8
     16      23.5       44.8       166           12.3
    128     161        311         181           42.4
    512     645       1228         233          143
and the int8 head (49,152 x 576) at 1 / 16 / 128 rows: `int8pack_bf16` 0.88 / 6.3 / 50.3 ms, `amx_int8` 1.5 / 1.7 /
7.8 ms. With both, the serving workload (batch 16) ran int4 at 1.72x fp32 on that Xeon (1.12x with torch's
kernels alone; `benchmarks/RESULTS.md`). The `c_int4` column above is its 8-lane kernel: its AVX-512 path,
added later, ran the 120 products at one row in 3.6-3.8 ms warm (5.6-5.9 ms with the caches flushed, against
6.4-7.2 for `int4pack`), and the tuner now picks it at one row for most shapes there. The AMX forms are not
picked at one row: a call's fixed cost (the conversion of every code, the tile set-up) is not repaid by one row.

Measured on the 2-core AMD EPYC (AVX-512, AVX-512 BF16) of this project's CI, torch 2.13, one thread (the
machine was shared, so these are best-of-5; ratios are what matters), the model's 120 weight products of
the layers chained (no LM head):
    rows   fp32 F.linear   bf16 F.linear   int4pack (fp32 x cast to bf16)   int8pack_bf16   int8pack (fp32 x)
      1       25.4 ms         15.2 ms                4.3 ms                      7.0 ms           69.8 ms
      4       34.6 ms         15.2 ms                6.5 ms                     11.3 ms          437 ms
     16       88.3 ms         29.0 ms               21.6 ms                     24.7 ms         1155 ms
     64      150 ms           40.4 ms               81.9 ms                     88.7 ms         4603 ms
so at one row int4 runs the products 6x faster than fp32 (at about the memory bandwidth of one core: 66 MB
of codes and scales in 4 ms), and past a few dozen rows a bf16 GEMM on weights dequantized on the fly can
win: the tuner decides per row bucket. Past a few rows torch's int4 kernel is compute-bound: it dequantizes
each weight tile again for every 4 rows of x. The decoder's products for 16 / 64 / 256 rows took 21.0 / 79.8 /
319 ms in int4 against 16.4 / 54.9 / 215 ms in fp32 with oneDNN's packed GEMM (one thread, one layer's
weights timed 30 times), so a batch-16 serving step gains nothing from int4 on this CPU (the serving bench
measured 0.99x fp32); the Triton kernel dequantizes a tile once for 16 to 64 rows.

The tied embedding / LM head (SmolLM2 ties them; the GGUF stores the table as Q8_0: blocks of 32 int8 with an
fp16 scale, verified with gguf.GGUFReader: every decoder product is Q4_1, the embedding Q8_0, the norms F32).
It is a fifth of the model's weights, read whole at every step by the LM head. Measured against the fp32
(dequantized GGUF) model, the decoder int4 (Q4_1 repacked) in every row, perplexity on quality.PERPLEXITY_TEXT
(342 tokens; fp32 53.84) and teacher-forced greedy agreement over quality.QUALITY_PROMPTS x 32 tokens:
    head (and embedding)           perplexity        agreement   head bytes   model's weights (bf16 model: 269 MB)
    float (the fp32 table)         53.73 (-0.2%)     98.0%       113 MB       180 MB
    int8 per row (Q8_0 requant.)   54.19 (+0.6%)     97.7%       28.5 MB      94.9 MB (35.3%)
    int4 groups of 32 (RTN)        58.97 (+9.5%)     83.2%       17.7 MB      84.2 MB (31.3%)
int4 costs too much quality (the embedding's rows spread wider than the decoder's), fp32 too many bytes (the
head alone would read more than the whole int4 decoder), so the head is int8 per row (`default_head`), one
copy serving the LM head (`_weight_int8pack_mm`, bf16 activations) and the embedding lookup
(`QuantEmbedding`). Memory: Q4_1's group of 32 costs 5 bits a weight (4-bit codes plus a 16-bit scale and
zero per 32), so the decoder's products take 5/16 = 31.25% of their bf16 bytes with nothing else counted;
with the int8 head the int4 model's weights are 35.3% of the bf16 model's (the GGUF file itself: 36.5%).
Under 30% would take larger groups (re-quantizing the checkpoint) or a 4-bit head (the row above).

"int4_compact" gets under 30% without touching a code. (1) `compact_scales`: each row keeps two fp32 factors,
and each group an 8-bit code of Q4_1's d (unsigned) and of m (signed), 16 bits a group instead of 32 (QLoRA's
"double quantization", applied to Q4_1's scale and minimum): 4.5 bits a weight plus 8 bytes a row. The kernels
(`c_int4`, `amx_int4`) apply d and m once per group, y += d * sum(q x) + m * sum(x); torch's int4pack takes bf16
scales only and is not a candidate. (2) `SplitHead`: the head's rows for token ids below `SPLIT_HEAD_ROWS`
(a BPE vocabulary is numbered roughly by frequency) in int8, the rest in int4 with compact scales. Measured
(2026-12-02, 2-core Xeon, fp32 activations, tuned forms; 16 chat prompts x 32 tokens, teacher-forced):
    model           weights (% of bf16)   perplexity        agreement   largest logit difference
    int4            94.9 MB (35.3%)       53.87 (+0.05%)    99.2%       0.94
    int4_compact    80.4 MB (29.9%)       54.34 (+0.92%)    93.8%       5.87
An fp32-weight simulation of the parts apart (int8 heads): the 8-bit scales alone gave perplexity -0.27% and
96.9% agreement (Q4_1's own scales: -0.09%, 98.8%); the head is most of the cost. A whole-int5 head
(symmetric, groups of 32) instead of the split one gave +1.73% and 91.8%, an int6 head per row +3.45% and
92.6%: the split by frequency did best at the bytes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..backends import cpu as cpu_backend
from ..backends.cpu import cpu_kernels
from ..backends.cpu.autotune import TUNER, Autotuner, Walk, counting_mode_active, row_bucket
from ..engine_config import QUANTIZATIONS  # ("int4", "int4_compact", "int8")

GROUP_SIZE = 32
# The group sizes torch's CPU int4 kernel takes; its packing also wants out_features divisible by 16.
KERNEL_GROUP_SIZES = (32, 64, 128, 256)
SCALE_DTYPE = torch.bfloat16  # the dtype torch's packed kernels take their scales in (with bf16 activations)
_TINY = 1e-12                 # a group whose weights are all equal gets this scale (and zero = the value)


def check_quantization(quantization) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}")


# ---------------------------------------------------------------- int8, per output channel


def quantize_int8(weight: torch.Tensor, scale_dtype: torch.dtype = SCALE_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (q int8 [N, K] in [-127, 127], scale [N] in `scale_dtype`), w ~ q * scale.
    The codes are rounded against the stored (rounded) scale, so they are the best ones for it."""
    _check_matrix(weight, "weight")
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(_TINY).to(scale_dtype)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 codes as `_weight_int8pack_mm` reads them: a row-major int8 [N, K] matrix (nothing to pack)."""
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"q must be a 2-D int8 tensor, got {q.dtype} of shape {tuple(q.shape)}")
    return q.contiguous()


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int8` (the identity)."""
    return packed


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()[:, None]).to(dtype)


def int8_matmul_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ dequantize_int8(q, scale)^T in fp32, returned in x's dtype: what every int8 form computes."""
    return F.linear(x.float(), dequantize_int8(q, scale)).to(x.dtype)


# ---------------------------------------------------------------- int4, per group


def _check_matrix(weight, name):
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [out_features, in_features]")


def check_group_size(in_features: int, group_size: int) -> None:
    if not isinstance(group_size, int) or group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be an even int >= 2, got {group_size!r}")
    if in_features % group_size:
        raise ValueError(f"in_features ({in_features}) must be a multiple of group_size ({group_size}): every "
                         f"group of a row needs its {group_size} weights")


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE, scale_dtype: torch.dtype = SCALE_DTYPE
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric int4 per group of `group_size` weights along each row: (q uint8 [N, K] in
    [0, 15], scales [N, K / group_size], zeros [N, K / group_size]) with w ~ (q - 8) * scale + zero.
    scale = (max - min) / 15 and zero = min + 8 * scale, rounded to `scale_dtype` first; the codes are then
    rounded against the stored scale and zero."""
    _check_matrix(weight, "weight")
    n, k = weight.shape
    check_group_size(k, group_size)
    groups = weight.float().view(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp_min(_TINY).to(scale_dtype)
    zero = (lo + 8 * scale.float()).to(scale_dtype)
    q = torch.round((groups - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp(0, 15)
    return q.to(torch.uint8).view(n, k), scale, zero


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] in [0, 15] -> [N, K / 2] uint8, two per byte: column 2j in the low nibble, 2j + 1 in the high."""
    if q.dim() != 2 or q.shape[1] % 2:
        raise ValueError(f"q must be 2-D with an even number of columns, got shape {tuple(q.shape)}")
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K / 2] uint8 -> codes [N, K] uint8 in [0, 15] (the inverse of `pack_int4`)."""
    n = packed.shape[0]
    return torch.stack([packed & 15, packed >> 4], dim=-1).view(n, -1)


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int = GROUP_SIZE,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w = (q - 8) * scale + zero, computed in fp32 and returned in `dtype`."""
    n, k = q.shape
    groups = q.view(n, k // group_size, group_size).float() - 8
    return (groups * scales.float()[..., None] + zeros.float()[..., None]).view(n, k).to(dtype)


def int4_matmul_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          group_size: int = GROUP_SIZE) -> torch.Tensor:
    """x [M, K] @ dequantize_int4(...)^T in fp32, returned in x's dtype: what every int4 form computes."""
    return F.linear(x.float(), dequantize_int4(q, scales, zeros, group_size)).to(x.dtype)


def to_scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """[N, G] scales and zeros -> the [G, N, 2] tensor torch's int4 kernels (and the Triton one) read."""
    return torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()


def from_scales_and_zeros(scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `to_scales_and_zeros`: ([N, G] scales, [N, G] zeros)."""
    sz = scales_and_zeros.transpose(0, 1)
    return sz[..., 0], sz[..., 1]


# ---------------------------------------------------------------- compact scales ("int4_compact")


def compact_scales(d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Q4_1's d [N, G] (>= 0) and m [N, G] (w = d * q + m) in 16 bits a group instead of 32: each row gets two
    fp32 factors, fd = max(d) / 255 and fm = max|m| / 127, and each group an unsigned 8-bit code of d and a
    signed one of m (d ~ dc * fd, m ~ mc * fm). Returned as one int16 tensor [G * N + 4 * N], the layout the C
    kernels read: the codes [G, N] (low byte dc, high byte mc), then the factors [2, N] as fp32 bits."""
    if bool((d < 0).any()):
        raise ValueError("d must be >= 0 for compact scales (Q4_1's d = (max - min) / 15 always is)")
    d, m = d.float(), m.float()
    fd = (d.amax(dim=1) / 255).clamp_min(_TINY)
    fm = (m.abs().amax(dim=1) / 127).clamp_min(_TINY)
    dc = torch.round(d / fd[:, None]).clamp(0, 255).to(torch.int32)
    mc = torch.round(m / fm[:, None]).clamp(-127, 127).to(torch.int32)
    codes = (dc + 256 * mc).to(torch.int16).t().reshape(-1)
    return torch.cat([codes, torch.stack([fd, fm]).contiguous().view(torch.int16).reshape(-1)])


def expand_compact_scales(scales: torch.Tensor, n: int, groups: int, dtype: torch.dtype = torch.float32,
                          ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `compact_scales`, to its rounding: (d [N, G], m [N, G]) in `dtype`; of rows `ids` only
    when given."""
    codes = scales[:groups * n].view(groups, n).t()
    factors = scales[groups * n:].contiguous().view(torch.float32).view(2, n).t()
    if ids is not None:
        codes, factors = codes[ids], factors[ids]
    codes = codes.to(torch.int32)
    dc = codes & 255
    mc = (codes - dc) // 256
    return (dc.float() * factors[:, :1]).to(dtype), (mc.float() * factors[:, 1:]).to(dtype)


def quantize_int4_compact(weight: torch.Tensor, group_size: int = GROUP_SIZE
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest int4 per group with compact scales: (codes uint8 [N, K], `compact_scales`), the codes
    rounded against the stored (8-bit) d and m, w ~ d * q + m."""
    _check_matrix(weight, "weight")
    n, k = weight.shape
    check_group_size(k, group_size)
    groups = weight.float().view(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = compact_scales((hi - lo) / 15, lo)
    d, m = expand_compact_scales(scales, n, k // group_size)
    q = torch.round((groups - m[..., None]) / d.clamp_min(_TINY)[..., None]).clamp(0, 15)
    return q.to(torch.uint8).view(n, k), scales


# ---------------------------------------------------------------- GGUF blocks

Q4_1_BLOCK_BYTES, Q8_0_BLOCK_BYTES, GGUF_BLOCK = 20, 34, 32


def split_q4_1(raw, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_1 tensor's bytes ([N, K / 32 * 20] uint8, as `gguf.GGUFReader` gives them) -> (codes uint8 [N, K],
    d fp16 [N, K / 32], m fp16 [N, K / 32]) with w = d * q + m. A block is d (fp16), m (fp16) and 16 bytes
    whose low nibbles are weights 0-15 and high nibbles weights 16-31."""
    n, k = shape
    blocks = torch.as_tensor(raw).reshape(n, k // GGUF_BLOCK, Q4_1_BLOCK_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
    m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]
    qs = blocks[..., 4:]
    codes = torch.empty(n, k // GGUF_BLOCK, GGUF_BLOCK, dtype=torch.uint8)
    torch.bitwise_and(qs, 15, out=codes[..., :GGUF_BLOCK // 2])
    torch.bitwise_right_shift(qs, 4, out=codes[..., GGUF_BLOCK // 2:])
    return codes.view(n, k), d, m


def repack_q4_1(raw, shape: tuple[int, int], scale_dtype: torch.dtype = SCALE_DTYPE
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 blocks as int4 with group size 32, with no re-quantization: (codes, scales = d, zeros = m + 8 d).
    With scale_dtype=torch.float32 the result is exact (d, m fp16, m + 8d computed in fp32); with bf16 (what
    the CPU kernel takes) the scales and zeros are rounded once."""
    codes, d, m = split_q4_1(raw, shape)
    return codes, d.float().to(scale_dtype), (m.float() + 8 * d.float()).to(scale_dtype)


def split_q8_0(raw, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor's bytes -> (q int8 [N, K], d fp16 [N, K / 32]) with w = d * q."""
    n, k = shape
    blocks = torch.as_tensor(raw).reshape(n, k // GGUF_BLOCK, Q8_0_BLOCK_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
    q = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k)
    return q, d


# ---------------------------------------------------------------- torch's CPU int4 layout


@dataclass(frozen=True)
class CPUInt4Layout:
    """How `_convert_weight_to_int4pack_for_cpu` lays out codes: rows in blocks of `block_n`, each block stored
    as [K, block_n / 2] bytes. In a full block, byte j holds rows j and j + block_n / 2 (`halves`) or rows 2j
    and 2j + 1 (not `halves`), low nibble first; a last, partial block always holds pairs."""
    block_n: int
    halves: bool

    def unpack(self, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """The packed bytes -> codes uint8 [n, k]."""
        flat, bn = packed.reshape(-1), self.block_n
        full = n // bn * bn
        parts = []
        if full:
            b = flat[:full * k // 2].view(full // bn, k, bn // 2)
            pair = (b & 15, b >> 4)
            codes = torch.cat(pair, dim=-1) if self.halves else torch.stack(pair, dim=-1).flatten(-2)
            parts.append(codes.transpose(1, 2).reshape(full, k))
        if n > full:
            t = flat[full * k // 2:].view(k, (n - full) // 2)
            parts.append(torch.stack([t & 15, t >> 4], dim=-1).view(k, n - full).t())
        return torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()

    def _rows_in_blocks(self, flat: torch.Tensor, full: int, k: int, ids: torch.Tensor) -> torch.Tensor:
        bn = self.block_n
        j = ids % bn
        byte = j % (bn // 2) if self.halves else j // 2
        shift = (j // (bn // 2) if self.halves else j % 2) * 4
        blocks = flat[:full * k // 2].view(full // bn, k, bn // 2)[ids // bn]   # [T, k, bn / 2]
        b = blocks.gather(2, byte.view(-1, 1, 1).expand(-1, k, 1)).squeeze(2)
        return (b >> shift.to(torch.uint8)[:, None]) & 15

    def rows(self, packed: torch.Tensor, n: int, k: int, ids: torch.Tensor) -> torch.Tensor:
        """Codes of rows `ids` only, uint8 [len(ids), k] (an embedding lookup reads a few rows of the table)."""
        flat, bn = packed.reshape(-1), self.block_n
        full = n // bn * bn
        ids = ids.long()
        if full == n:  # whole blocks only: no data-dependent branch, so a compiled graph takes it as it is
            return self._rows_in_blocks(flat, n, k, ids)
        out = torch.empty(ids.shape[0], k, dtype=torch.uint8, device=packed.device)
        in_full = ids < full
        if full and bool(in_full.any()):
            out[in_full] = self._rows_in_blocks(flat, full, k, ids[in_full])
        if n > full and not bool(in_full.all()):
            j = ids[~in_full] - full
            t = flat[full * k // 2:].view(k, (n - full) // 2)
            out[~in_full] = (t[:, j // 2].t() >> ((j % 2) * 4).to(torch.uint8)[:, None]) & 15
        return out


def int4_kernels_available() -> bool:
    """Whether this torch build has the packed CPU int4 kernel (torch >= 2.5)."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and \
        hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


def int8_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


@functools.cache
def cpu_int4_layout() -> CPUInt4Layout | None:
    """The layout this build's CPU packing writes, found by packing random codes (full blocks and a partial
    one for either block size) and reading them back with each candidate; None when none fits or there is no
    kernel (then int4 layers keep the portable layout and the packed kernel is not used)."""
    if not int4_kernels_available():
        return None
    n, k = 2 * 64 + 16, 64
    codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    except RuntimeError:
        return None
    for layout in (CPUInt4Layout(64, True), CPUInt4Layout(32, True), CPUInt4Layout(32, False),
                   CPUInt4Layout(64, False), CPUInt4Layout(16, False)):
        try:
            if torch.equal(layout.unpack(packed, n, k), codes.to(torch.uint8)):
                return layout
        except RuntimeError:
            continue
    return None


def cpu_pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] -> torch's packed CPU layout (N divisible by 16)."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)


# ---------------------------------------------------------------- the product forms


@dataclass(frozen=True)
class QuantMeta:
    """What a form needs besides the tensors: the product's shape and how its weight is stored."""
    kind: str                            # "int4" or "int8"
    out_features: int
    in_features: int
    group_size: int = 0                  # int4
    layout: CPUInt4Layout | None = None  # int4: torch's CPU layout; None: the portable `pack_int4` layout
    compact: bool = False                # int4: `compact_scales` (8-bit d and m), not bf16 scales and zeros


def dequantize_state(qweight: torch.Tensor, scales: torch.Tensor, meta: QuantMeta,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A quantized layer's weight [N, K] in `dtype` from its stored tensors (`scales`: the [N] int8 scales, the
    [G, N, 2] int4 scales and zeros, or the int4 `compact_scales`)."""
    if meta.kind == "int8":
        return (qweight.to(dtype) * scales.to(dtype)[:, None]) if dtype != torch.float32 \
            else dequantize_int8(qweight, scales)
    n, k = meta.out_features, meta.in_features
    codes = meta.layout.unpack(qweight, n, k) if meta.layout is not None else unpack_int4(qweight)
    groups = codes.view(n, k // meta.group_size, meta.group_size).to(dtype)
    if meta.compact:
        d, m = (t.contiguous()[..., None] for t in expand_compact_scales(scales, n, k // meta.group_size, dtype))
        return torch.addcmul(m, groups, d).view(n, k)
    s, z = (t.to(dtype).contiguous()[..., None] for t in from_scales_and_zeros(scales))
    return torch.addcmul(z, groups - 8, s).view(n, k)


def _dequant(x, qweight, scales, meta):
    return F.linear(x, dequantize_state(qweight, scales, meta, x.dtype))


def _dequant_bf16(x, qweight, scales, meta):
    return F.linear(x.to(torch.bfloat16), dequantize_state(qweight, scales, meta, torch.bfloat16)).to(x.dtype)


def _int4pack(x, qweight, scales, meta):
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), qweight, meta.group_size,
                                                     scales).to(x.dtype)


def _int8pack(x, qweight, scales, meta):
    return torch.ops.aten._weight_int8pack_mm(x, qweight, scales.to(x.dtype))


def _int8pack_bf16(x, qweight, scales, meta):
    return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), qweight, scales).to(x.dtype)


@torch._dynamo.assume_constant_result
def _cpp_ops() -> bool:
    """Run (not traced) while a graph is compiled: whether the C++ operators are loaded (built on first use)."""
    return cpu_kernels.load_torch_ops()


def _c_int4(x, qweight, scales, meta):
    x32 = x.float()  # bf16 activations go in as fp32 (exact) and come out rounded back
    if torch.compiler.is_compiling():  # a graph calls the kernel through an operator it cannot look into
        ops = torch.ops.mini_engine_cpp if _cpp_ops() else torch.ops.mini_engine
        y = ops.int4_gemm(x32, qweight, scales, meta.out_features, meta.group_size, meta.layout.block_n)
    else:
        y = cpu_kernels.int4_gemm(x32, qweight, scales, meta.out_features, meta.group_size, meta.layout.block_n)
    return y.to(x.dtype)


def _amx_int4(x, qweight, scales, meta):
    # bf16 activations go in as fp32 (exact) and come out rounded back: the kernel rounds x to bf16 itself
    x32 = x.float()
    if torch.compiler.is_compiling():
        ops = torch.ops.mini_engine_cpp if _cpp_ops() else torch.ops.mini_engine
        y = ops.int4_gemm_amx(x32, qweight, scales, meta.out_features, meta.group_size, meta.layout.block_n)
    else:
        y = cpu_kernels.int4_gemm(x32, qweight, scales, meta.out_features, meta.group_size, meta.layout.block_n,
                                  amx=True)
    return y.to(x.dtype)


def _c_int8(x, qweight, scales, meta):
    if torch.compiler.is_compiling():
        return (torch.ops.mini_engine_cpp if _cpp_ops() else torch.ops.mini_engine).int8_gemm(x, qweight, scales)
    return cpu_kernels.int8_gemm(x, qweight, scales)


def _amx_int8(x, qweight, scales, meta):
    x32 = x.float()  # as in _amx_int4
    if torch.compiler.is_compiling():
        y = (torch.ops.mini_engine_cpp if _cpp_ops() else torch.ops.mini_engine).int8_gemm_amx(x32, qweight, scales)
    else:
        y = cpu_kernels.int8_gemm(x32, qweight, scales, amx=True)
    return y.to(x.dtype)


def _register_op(schema: str, impl, fake):
    """`torch.ops.mini_engine.<name>` from its schema: a C kernel inside a torch.compile graph, opaque to the
    compiler, which only needs `fake` (the output's shape)."""
    try:
        lib = torch.library.Library("mini_engine", "FRAGMENT")
        lib.define(schema)
        name = schema.split("(")[0]
        lib.impl(name, impl, "CPU")
        torch.library.register_fake(f"mini_engine::{name}", lib=lib)(fake)
    except (RuntimeError, AttributeError):  # an older torch, or defined twice (a reloaded module)
        return None
    return lib


_INT4_OP = _register_op("int4_gemm(Tensor x, Tensor packed, Tensor scales, int n, int group_size, int block_n) "
                        "-> Tensor", cpu_kernels.int4_gemm,
                        lambda x, packed, scales, n, group_size, block_n: x.new_empty(x.shape[0], n))
_INT4_AMX_OP = _register_op(
    "int4_gemm_amx(Tensor x, Tensor packed, Tensor scales, int n, int group_size, int block_n) -> Tensor",
    functools.partial(cpu_kernels.int4_gemm, amx=True),
    lambda x, packed, scales, n, group_size, block_n: x.new_empty(x.shape[0], n))
_INT8_OP = _register_op("int8_gemm(Tensor x, Tensor q, Tensor scales) -> Tensor", cpu_kernels.int8_gemm,
                        lambda x, q, scales: x.new_empty(x.shape[0], q.shape[0]))

_INT8_AMX_OP = _register_op("int8_gemm_amx(Tensor x, Tensor q, Tensor scales) -> Tensor",
                            functools.partial(cpu_kernels.int8_gemm, amx=True),
                            lambda x, q, scales: x.new_empty(x.shape[0], q.shape[0]))

FORMS = {"dequant": _dequant, "dequant_bf16": _dequant_bf16, "int4pack": _int4pack, "int8pack": _int8pack,
         "int8pack_bf16": _int8pack_bf16, "c_int4": _c_int4, "amx_int4": _amx_int4,
         "c_int8": _c_int8, "amx_int8": _amx_int8}


def candidate_forms(meta: QuantMeta, dtype: torch.dtype) -> list[str]:
    """The forms that apply to a layer stored as `meta` with activations of `dtype`, the plain one first."""
    names = ["dequant"]
    if dtype != torch.bfloat16:
        names.append("dequant_bf16")
    if meta.kind == "int4" and meta.layout is not None:
        if not meta.compact:  # torch's kernel takes bf16 scales and zeros only
            names.append("int4pack")
        if (dtype in (torch.float32, torch.bfloat16) and _INT4_OP is not None and cpu_kernels.int4_gemm_supported(
                meta.out_features, meta.in_features, meta.group_size, meta.layout.block_n, meta.layout.halves)):
            names.append("c_int4")
        if (dtype in (torch.float32, torch.bfloat16) and _INT4_AMX_OP is not None and cpu_kernels.int4_gemm_supported(
                meta.out_features, meta.in_features, meta.group_size, meta.layout.block_n, meta.layout.halves,
                amx=True)):
            names.append("amx_int4")
    if meta.kind == "int8" and int8_kernel_available():
        names += ["int8pack"] + (["int8pack_bf16"] if dtype != torch.bfloat16 else [])
    if (meta.kind == "int8" and dtype == torch.float32 and _INT8_OP is not None
            and cpu_kernels.int8_gemm_supported(meta.out_features, meta.in_features)):
        names.append("c_int8")
    if (meta.kind == "int8" and dtype in (torch.float32, torch.bfloat16) and _INT8_AMX_OP is not None
            and cpu_kernels.int8_gemm_supported(meta.out_features, meta.in_features, amx=True)):
        names.append("amx_int8")
    return names


def _timing_states(layer: "QuantLinear", rows: int, dtype: torch.dtype):
    """x of `rows` rows and `products.timing_copies` copies of the layer's tensors (a decode step streams each
    weight from memory once)."""
    from ..backends.cpu.products import timing_copies
    copies = timing_copies(layer.qweight.nbytes + layer.scales.nbytes, rows,
                           layer.in_features * layer.out_features)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, layer.in_features, generator=gen).to(dtype)
    return x, [(layer.qweight.clone(), layer.scales.clone()) for _ in range(copies)]


def choose_form(layer: "QuantLinear", rows: int, dtype: torch.dtype, tuner: Autotuner | None = None) -> str:
    """The tuned form for `rows` rows of `dtype` against this layer's shape and storage (timed on first use);
    the plain form where the CPU backend is off (MINI_ENGINE_CPU_BACKEND=0)."""
    if not cpu_backend.enabled():
        return "dequant"
    bucket, meta = row_bucket(rows), layer.meta
    key = (meta.out_features, meta.in_features, meta.group_size, bucket, str(dtype), "cpu") + \
        (("compact",) if meta.compact else ())  # compact scales have forms of their own (no int4pack)

    def candidates():
        x, states = _timing_states(layer, bucket, dtype)
        forms = {}
        for name in candidate_forms(meta, dtype):
            try:
                FORMS[name](x, *states[0], meta)  # a build that cannot run it says so now
            except RuntimeError:
                continue
            forms[name] = Walk(functools.partial(_call, FORMS[name], x, meta), states)
        return forms
    return (tuner or layer.tuner).choose(f"{meta.kind}_product", key, candidates)


def _call(form, x, meta, state):
    form(x, *state, meta)


@torch._dynamo.assume_constant_result
def _traced_form(layer: "QuantLinear", rows: int, dtype: torch.dtype) -> str:
    """Run (not traced) when torch.compile meets a quantized layer: the form is tuned, or looked up, eagerly."""
    return choose_form(layer, rows, dtype)


# ---------------------------------------------------------------- layers


class QuantLinear(nn.Module):
    """A bias-free linear layer with quantized weights: `qweight` (the codes) and `scales` (int8: [N]; int4:
    the [G, N, 2] scales and zeros), both buffers. The scales are stored as the bits of bf16 numbers in an
    int16 buffer, so `model.to(dtype)` moves them with the model but never rounds them again."""
    kind = ""

    def __init__(self, in_features: int, out_features: int, tuner: Autotuner = TUNER):
        super().__init__()
        self.in_features, self.out_features, self.tuner = in_features, out_features, tuner
        self._forms: dict[tuple[int, torch.dtype], callable] = {}
        self._kernel: tuple[torch.Tensor, torch.Tensor] | None = None  # see kernel_operands

    @property
    def scales(self) -> torch.Tensor:
        return self.scale_bits.view(SCALE_DTYPE)

    @property
    def meta(self) -> QuantMeta:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"

    @property
    def nbytes(self) -> int:
        """Bytes of weight storage: codes plus scales (and zeros)."""
        return self.qweight.nbytes + self.scale_bits.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out_features, in_features] the products compute with."""
        return dequantize_state(self.qweight, self.scales, self.meta, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The common case first, in as few Python operations as possible (a decode step makes 121 products).
        if x.dim() == 2 and not torch.compiler.is_compiling():
            form = self._forms.get((x.shape[0], x.dtype))
            if form is not None and not counting_mode_active():
                return form(x)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.device.type != "cpu":
            y = self.device_product(x2, x2.device.type)
        elif torch.compiler.is_compiling():  # the choice is a fact about the machine: a constant in the graph
            y = FORMS[_traced_form(self, x2.shape[0], x2.dtype)](x2, self.qweight, self.scales, self.meta)
        elif counting_mode_active():  # a FLOP counter sees the product the model means
            y = _dequant(x2, self.qweight, self.scales, self.meta)
        else:
            y = self.form_for(x2.shape[0], x2.dtype)(x2)
        return y.reshape(*shape[:-1], self.out_features)

    def device_product(self, x: torch.Tensor, device_type: str) -> torch.Tensor:
        """The product x [M, K] -> [M, N] off the CPU, on a device of type `device_type`: on a GPU ("cuda") this
        layer's Triton kernel (`kernel_forward`), elsewhere the weight dequantized and F.linear. The device type
        is an argument so that a test can take the GPU's path on CPU tensors, in Triton's interpreter."""
        # A FLOP counter sees the product the model means: a Triton launch is invisible to it.
        if device_type == "cuda" and (torch.compiler.is_compiling() or not counting_mode_active()):
            return self.kernel_forward(x)
        return _dequant(x, self.qweight, self.scales, self.meta)

    def kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ W^T through this layer's Triton kernel, on x's device (natively on a GPU; CPU tensors run
        in Triton's interpreter)."""
        raise NotImplementedError

    def kernel_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, scales) as this layer's Triton kernel reads them. Made once and kept until the layer moves or
        loads new tensors, so no product rebuilds them: when the layer lands on a GPU, else on first use. A graph
        being compiled that finds none makes them in the graph and stores nothing."""
        if self._kernel is not None:
            return self._kernel
        operands = self._make_kernel_operands()
        if not torch.compiler.is_compiling():
            if operands[0].device.type == "cuda":  # CUDA graphs replay fixed addresses: these never move
                for t in operands:
                    torch._dynamo.mark_static_address(t)
            self._kernel = operands
        return operands

    def _make_kernel_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _reset_kernel(self) -> None:
        """Drop the kernel's operands; made again at once on a GPU (at load, not in the first product)."""
        self._kernel = None
        if self.qweight.device.type == "cuda":
            self.kernel_operands()

    def form_for(self, rows: int, dtype: torch.dtype = torch.float32):
        """The product function x -> y tuned for `rows` rows of `dtype` (timed on first use)."""
        form = self._forms.get((rows, dtype))
        if form is None:
            name = choose_form(self, rows, dtype)
            fn, qweight, scales, meta = FORMS[name], self.qweight, self.scales, self.meta
            form = self._forms[(rows, dtype)] = lambda x: fn(x, qweight, scales, meta)
        return form

    def __getstate__(self):
        return {**self.__dict__, "_forms": {}}  # a copy binds its own tensors

    def _apply(self, fn, *args, **kwargs):
        self._forms.clear()
        super()._apply(fn, *args, **kwargs)
        self._reset_kernel()
        return self

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._reset_kernel()  # new codes or scales (compact ones are expanded from them)


class Int8Linear(QuantLinear):
    """int8 weights, one scale per output channel."""
    kind = "int8"

    def __init__(self, in_features: int, out_features: int, tuner: Autotuner = TUNER):
        super().__init__(in_features, out_features, tuner)
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale_bits", torch.zeros(out_features, dtype=torch.int16))

    @classmethod
    def from_codes(cls, q: torch.Tensor, scale: torch.Tensor, tuner: Autotuner = TUNER) -> "Int8Linear":
        layer = cls(q.shape[1], q.shape[0], tuner)
        layer.qweight = pack_int8(q).to(layer.qweight.device)
        layer.scale_bits = scale.to(SCALE_DTYPE).contiguous().view(torch.int16)
        return layer

    @classmethod
    def from_float(cls, weight: torch.Tensor, tuner: Autotuner = TUNER) -> "Int8Linear":
        return cls.from_codes(*quantize_int8(weight), tuner=tuner)

    @property
    def meta(self) -> QuantMeta:
        return QuantMeta("int8", self.out_features, self.in_features)

    def dequantize_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.qweight[ids].to(dtype) * self.scales[ids].to(dtype)[:, None]

    def _make_kernel_operands(self):
        return self.qweight, self.scales  # the row-major codes and bf16 scales as stored

    def kernel_forward(self, x):
        from ..kernels.int8_matmul import w8a16_matmul  # imported here: only this path needs triton
        return w8a16_matmul(x, *self.kernel_operands())


class Int4Linear(QuantLinear):
    """int4 weights in groups of `group_size` along each row, with a bf16 scale and zero per group. On a CPU
    the codes are kept in torch's packed kernel layout (`cpu_int4_layout`), elsewhere in `pack_int4`'s."""
    kind = "int4"

    def __init__(self, in_features: int, out_features: int, group_size: int = GROUP_SIZE,
                 tuner: Autotuner = TUNER, compact: bool = False):
        super().__init__(in_features, out_features, tuner)
        check_group_size(in_features, group_size)
        if group_size not in KERNEL_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {KERNEL_GROUP_SIZES} (the packed kernels' sizes), "
                             f"got {group_size}")
        if out_features % 16:
            raise ValueError(f"out_features ({out_features}) must be a multiple of 16 for the packed int4 layout")
        self.group_size, self.compact = group_size, compact
        self.layout: CPUInt4Layout | None = None  # None: the portable layout
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        groups = in_features // group_size
        self.register_buffer("scale_bits", torch.zeros(groups * out_features + 4 * out_features, dtype=torch.int16)
                             if compact else torch.zeros(groups, out_features, 2, dtype=torch.int16))

    @property
    def scales(self) -> torch.Tensor:
        return self.scale_bits if self.compact else self.scale_bits.view(SCALE_DTYPE)

    @classmethod
    def from_codes(cls, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int = GROUP_SIZE,
                   tuner: Autotuner = TUNER) -> "Int4Linear":
        """From codes [N, K] in [0, 15] and [N, K / group_size] scales and zeros (rounded to bf16 here)."""
        layer = cls(q.shape[1], q.shape[0], group_size, tuner)
        sz = to_scales_and_zeros(scales.to(SCALE_DTYPE), zeros.to(SCALE_DTYPE))
        return layer._set_codes(q, sz.view(torch.int16))

    @classmethod
    def from_compact(cls, q: torch.Tensor, scales: torch.Tensor, group_size: int = GROUP_SIZE,
                     tuner: Autotuner = TUNER) -> "Int4Linear":
        """From codes [N, K] in [0, 15] and `compact_scales` (w = d * q + m, 8-bit d and m)."""
        layer = cls(q.shape[1], q.shape[0], group_size, tuner, compact=True)
        if scales.shape != layer.scale_bits.shape or scales.dtype != torch.int16:
            raise ValueError(f"scales must be compact_scales' int16 {tuple(layer.scale_bits.shape)}, got "
                             f"{scales.dtype} {tuple(scales.shape)}")
        return layer._set_codes(q, scales)

    def _set_codes(self, q: torch.Tensor, scale_bits: torch.Tensor) -> "Int4Linear":
        self.scale_bits = scale_bits.contiguous().to(q.device)
        self.qweight = pack_int4(q)
        if q.device.type == "cpu":
            self._to_cpu_layout()
        return self

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int = GROUP_SIZE, tuner: Autotuner = TUNER,
                   compact: bool = False) -> "Int4Linear":
        if compact:
            return cls.from_compact(*quantize_int4_compact(weight, group_size), group_size=group_size, tuner=tuner)
        return cls.from_codes(*quantize_int4(weight, group_size), group_size=group_size, tuner=tuner)

    @property
    def meta(self) -> QuantMeta:
        return QuantMeta("int4", self.out_features, self.in_features, self.group_size, self.layout, self.compact)

    def extra_repr(self) -> str:
        where = "torch CPU packed layout" if self.layout else "portable layout"
        scales = "8-bit d and m" if self.compact else "bf16 scales and zeros"
        return super().extra_repr() + f", group_size={self.group_size}, {scales}, {where}"

    def kernel_scales(self) -> torch.Tensor:
        """The [G, N, 2] scales and zeros the Triton kernel reads (`kernel_operands`): the stored bf16 ones, or,
        for compact scales, fp32 ones made once from d and m (the 8-bit codes times their factors, then
        zero = m + 8 d)."""
        return self.kernel_operands()[1]

    def _make_kernel_operands(self):
        # The kernel reads the portable layout: on a GPU that is the stored one; a CPU layer (the interpreter, in
        # tests) repacks a copy.
        qweight = self.qweight if self.layout is None else pack_int4(self.codes())
        if not self.compact:
            return qweight, self.scales
        d, m = self.d_and_m()
        return qweight, to_scales_and_zeros(d, m + 8 * d)

    def kernel_forward(self, x):
        from ..kernels.quant_matmul import w4a16_matmul  # imported here: only this path needs triton
        return w4a16_matmul(x, *self.kernel_operands(), self.group_size)

    def d_and_m(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each group's Q4_1 scale d and minimum m [N, K / group_size] in fp32 (w = d * q + m), whatever the
        scales' form."""
        if self.compact:
            return expand_compact_scales(self.scales, self.out_features, self.in_features // self.group_size)
        s, z = (t.float() for t in from_scales_and_zeros(self.scales))
        return s, z - 8 * s

    def codes(self) -> torch.Tensor:
        """The codes [N, K] uint8 in [0, 15], whatever the layout."""
        if self.layout is None:
            return unpack_int4(self.qweight)
        return self.layout.unpack(self.qweight, self.out_features, self.in_features)

    def dequantize_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.layout is None:
            codes = unpack_int4(self.qweight[ids])
        else:
            codes = self.layout.rows(self.qweight, self.out_features, self.in_features, ids)
        groups = codes.view(len(ids), -1, self.group_size).to(dtype)
        if self.compact:
            d, m = (t.contiguous()[..., None] for t in expand_compact_scales(
                self.scales, self.out_features, self.in_features // self.group_size, dtype, ids))
            return torch.addcmul(m, groups, d).view(len(ids), -1)
        s, z = (t[ids].to(dtype).contiguous()[..., None] for t in from_scales_and_zeros(self.scales))
        return torch.addcmul(z, groups - 8, s).view(len(ids), -1)

    def _to_cpu_layout(self) -> None:
        layout = cpu_int4_layout()
        if self.layout is None and layout is not None and self.qweight.device.type == "cpu":
            self.qweight = cpu_pack_int4(unpack_int4(self.qweight))
            self.layout = layout

    def _apply(self, fn, *args, **kwargs):
        if self.layout is not None:  # moves in the portable layout, then repacks if it lands on a CPU
            self.qweight = pack_int4(self.codes())
            self.layout = None
        super()._apply(fn, *args, **kwargs)
        self._to_cpu_layout()
        return self


class SplitHead(nn.Module):
    """An LM head stored in two precisions by token id: rows [0, split) in int8 per row, the rest in int4 with
    compact scales (`Int4Linear(compact=True)`). A BPE vocabulary is numbered in merge order, roughly by
    frequency: in this model 90% of the tokens of `quality.PERPLEXITY_TEXT` and of the chapter prompts'
    greedy continuations have ids below 12,288 (a quarter of the vocabulary), so the tokens a model says most
    keep 8-bit logits and the rare three quarters cost 4.6 bits a weight. `forward` runs both products (each
    tuned as any quantized layer is) and joins their logits; `dequantize_rows` serves the tied embedding."""

    def __init__(self, weight: torch.Tensor, split: int, group_size: int = GROUP_SIZE, tuner: Autotuner = TUNER):
        super().__init__()
        n = weight.shape[0]
        if not (0 < split < n) or (n - split) % 16:
            raise ValueError(f"split must be in (0, {n}) with {n} - split a multiple of 16, got {split}")
        self.split, self.in_features, self.out_features = split, weight.shape[1], n
        self.frequent = Int8Linear.from_float(weight[:split], tuner)
        self.rare = Int4Linear.from_float(weight[split:], group_size, tuner, compact=True)
        self.kind = "int8+int4"

    def extra_repr(self) -> str:
        return f"rows [0, {self.split}) int8, [{self.split}, {self.out_features}) int4 with 8-bit scales"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.frequent(x), self.rare(x)], dim=-1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([self.frequent.dequantize(dtype), self.rare.dequantize(dtype)])

    def dequantize_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # Both tables read for every id (clamped into range), then one picked: a lookup reads a few rows, and
        # without data-dependent branches a compiled graph takes it whole.
        ids = ids.long()
        frequent = self.frequent.dequantize_rows(ids.clamp(max=self.split - 1), dtype)
        rare = self.rare.dequantize_rows((ids - self.split).clamp(min=0), dtype)
        return torch.where((ids < self.split)[:, None], frequent, rare)


class QuantEmbedding(nn.Module):
    """An embedding table read out of a quantized [vocab, hidden] layer: the tied LM head (`tied=True`, one copy
    of the weights serves both), or a table of its own. Rows come out dequantized in the model's dtype."""

    def __init__(self, table: QuantLinear, tied: bool):
        super().__init__()
        if tied:
            self.__dict__["table"] = table  # not a submodule: the model owns it once, as its lm_head
        else:
            self.table = table
        self.tied = tied
        self.register_buffer("_dtype_of", torch.zeros(()), persistent=False)  # follows model.to(dtype)

    @property
    def num_embeddings(self) -> int:
        return self.table.out_features

    @property
    def embedding_dim(self) -> int:
        return self.table.in_features

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.table.kind}" + (", tied to lm_head" if self.tied
                                                                                      else "")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        return self.table.dequantize_rows(flat, self._dtype_of.dtype).view(*ids.shape, self.embedding_dim)


# ---------------------------------------------------------------- whole models

HEAD_CHOICES = ("int8", "int4", "split", "float")
SPLIT_HEAD_ROWS = 12288  # the split head's int8 rows (ids below it): see SplitHead


def quantize_model(model, quantization: str, group_size: int = GROUP_SIZE, head: str | None = None,
                   q4_1: dict | None = None, tuner: Autotuner = TUNER):
    """Replace `model`'s weight products by quantized ones, in place; returns the model.

    quantization: "int4" (group-wise, `group_size`, bf16 scales and zeros), "int4_compact" (the same codes with
      8-bit scales, `compact_scales`) or "int8" (per channel) for the decoder layers' products.
    q4_1: {fused layer name ("layers.3.self_attn.qkv_proj") -> (codes, d, m)} from the GGUF (see
      `loader`): those int4 layers are repacked from the checkpoint's own blocks (needs group_size 32);
      every other layer is quantized from its float weight (round to nearest).
    head: how the LM head (and the tied embedding) is stored: "int8", "int4", "split" (`SplitHead`: frequent
      tokens' rows int8, the rest int4) or "float" (left as is); None: the measured default for the
      quantization (`default_head`)."""
    check_quantization(quantization)
    if quantization is None:
        return model
    head = default_head(quantization) if head is None else head
    if head not in HEAD_CHOICES:
        raise ValueError(f"head must be one of {HEAD_CHOICES} or None, got {head!r}")
    int4, compact = quantization.startswith("int4"), quantization == "int4_compact"
    if q4_1 and int4 and group_size != GGUF_BLOCK:
        raise ValueError(f"group_size must be {GGUF_BLOCK} to repack the GGUF's Q4_1 blocks, got {group_size}")
    q4_1 = q4_1 or {}

    def make(name, weight, kind):
        if kind == "int8":
            return Int8Linear.from_float(weight, tuner)
        if kind == "split":
            return SplitHead(weight, split_rows(weight.shape[0]), group_size, tuner)
        if name in q4_1 and int4:
            codes, d, m = q4_1[name]
            if compact:  # the codes as they are; only d and m are rounded (to 8 bits)
                return Int4Linear.from_compact(codes, compact_scales(d.float(), m.float()), GGUF_BLOCK, tuner)
            return Int4Linear.from_codes(codes, d.float(), m.float() + 8 * d.float(), GGUF_BLOCK, tuner)
        return Int4Linear.from_float(weight, group_size, tuner, compact=compact)

    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            for parent, attr in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                                 (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
                name = f"layers.{i}.{'self_attn' if parent is layer.self_attn else 'mlp'}.{attr}"
                setattr(parent, attr, make(name, getattr(parent, attr).weight.detach().float(),
                                           "int4" if int4 else quantization))
        if head != "float":
            table = make("lm_head", model.lm_head.weight.detach().float(), head)
            tied = model.config.tie_word_embeddings
            if not tied:  # the embedding keeps a table of its own, in int8 (a lookup reads a few rows)
                model.embed_tokens = QuantEmbedding(Int8Linear.from_float(model.embed_tokens.weight.float(), tuner),
                                                    tied=False)
            model.lm_head = table
            if tied:
                model.embed_tokens = QuantEmbedding(table, tied=True)
    model.quantization = quantization
    return model


def default_head(quantization: str) -> str:
    """The LM head's storage measured best for each quantization (see the module docstring); "int4_compact"
    aims at the fewest bytes that keep the issue's quality bar, so its head is split."""
    return {"int4": "int8", "int4_compact": "split", "int8": "int8"}[quantization]


def split_rows(vocab: int) -> int:
    """The split head's int8 rows for a vocabulary of `vocab`: SPLIT_HEAD_ROWS, or a quarter of a smaller one,
    so that the int4 rows are a multiple of 16 (the packed layout's unit)."""
    split = SPLIT_HEAD_ROWS if vocab - SPLIT_HEAD_ROWS >= 16 else vocab // 4
    split = vocab - (vocab - split) // 16 * 16
    if not 0 < split < vocab:
        raise ValueError(f"a vocabulary of {vocab} is too small to split (the int4 rows need 16 or more)")
    return split


def weight_bytes(model) -> int:
    """Bytes the model's weights take (parameters, and the quantized layers' codes and scales), each counted once."""
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, QuantLinear) and id(module) not in seen:
            seen.add(id(module))
            total += module.nbytes
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total
