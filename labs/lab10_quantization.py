"""Lab 10: int4 weights, group by group, and the checkpoint's own 4-bit blocks repacked.

A decode step reads every weight once, so a model stored in 4 bits instead of 32 is read eight times faster
when memory is the bottleneck. A weight matrix is cut into groups of `group_size` weights along each row;
each group gets a scale and a zero, and each weight a 4-bit code q in [0, 15]:

    w ~ (q - 8) * scale + zero           (the rule torch's packed int4 kernels use)

You write:
  1. `quantize_int4`: round to nearest. In a group with smallest value lo and largest hi, scale = (hi - lo) / 15
     and zero = lo + 8 * scale, so code 0 lands on lo and code 15 on hi; q = round((w - zero) / scale + 8).
  2. `dequantize_int4`: the rule above, group by group.
  3. `pack_int4` and `unpack_int4`: two codes per byte, column 2j in the low nibble, column 2j + 1 in the high.
  4. `int4_matmul`: y = x W^T with W dequantized (what every int4 kernel computes, in fewer bytes).
  5. `repack_q4_1`: the GGUF file's Q4_1 blocks as int4 codes, scales and zeros without re-quantizing. A block
     holds 32 weights in 20 bytes: an fp16 scale d, an fp16 minimum m, then 16 bytes whose low nibbles are
     weights 0-15 and high nibbles weights 16-31, with w = d * q + m. Since d * q + m = (q - 8) * d + (m + 8 d),
     scale = d and zero = m + 8 d give the same weights exactly.
  6. `compact_scales`: the scales of part 5 in 8 bits. Q4_1 spends 32 bits per group of 32 on d and m, a whole
     bit per weight; store each row's d as unsigned 8-bit codes of max(d) / 255 and its m as signed 8-bit codes
     of max|m| / 127, and the group costs 16 bits (`quantization="int4_compact"` in the engine, chapter 10).

Fill in every function marked TODO in labs/lab10_quantization.py, then grade your work with

    pytest tests/labs/test_lab10.py --impl=labs

Plain torch on CPU tensors; nothing from the engine's quant.py.
"""
from __future__ import annotations

import torch


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest int4 in groups of `group_size` consecutive weights of a row.

    w: float [N, K]. Returns (q, scales, zeros): q uint8 [N, K] with values in [0, 15]; scales and zeros fp32
    [N, K // group_size], scale = (max - min) / 15 and zero = min + 8 * scale per group, and
    q = round((w - zero) / scale + 8) clamped to [0, 15]. A group whose weights are all equal (max = min) would
    divide by zero: it gets scale 0, zero = its value and codes 8, which dequantize to the value exactly.
    Raises ValueError naming group_size when K is not a multiple of it."""
    # TODO: part 1 of the module docstring, per group: make the groups a dimension of their own first.
    raise NotImplementedError("lab10 quantize_int4: view each row as its groups, find each group's extremes, then "
                              "scale, zero and codes as defined above; what must a constant group get?")


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """w = (q - 8) * scale + zero, each weight with its group's scale and zero. Returns fp32 [N, K]."""
    # TODO: the rule at the top of the module, each weight with its own group's scale and zero.
    raise NotImplementedError("lab10 dequantize_int4: how do you line each weight up with its group's scale and "
                              "zero? (the grouping of quantize_int4)")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (K even, values 0-15) -> uint8 [N, K // 2]: byte j of a row holds column 2j in its low 4 bits
    and column 2j + 1 in its high 4 bits."""
    # TODO: the byte layout in the docstring: which two columns share a byte, and in which half?
    raise NotImplementedError("lab10 pack_int4: a row's even and odd columns become the two halves of its bytes; "
                              "mind the dtype")


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: uint8 [N, K // 2] -> codes uint8 [N, K]."""
    # TODO: undo pack_int4.
    raise NotImplementedError("lab10 unpack_int4: which four bits of a byte hold which column?")


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int = 32) -> torch.Tensor:
    """y = x W^T for x [M, K] (fp32) and W stored as `pack_int4` codes with their scales and zeros: [M, N]."""
    # TODO: build it from the functions above.
    raise NotImplementedError("lab10 int4_matmul: what matrix do the packed codes stand for? You have written every "
                              "step to it")


def repack_q4_1(raw: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_1 tensor's bytes, uint8 [n, k // 32 * 20] (row by row, 32 weights a block), as int4:
    (q uint8 [n, k], scales fp32 [n, k // 32], zeros fp32 [n, k // 32]) with scale = d and zero = m + 8 d.

    Block layout (20 bytes): bytes 0-1 d (fp16, little-endian), bytes 2-3 m (fp16), bytes 4-19 qs; weight i
    of the block (i < 16) is qs[i] & 15 and weight i + 16 is qs[i] >> 4. Hint: `t.contiguous().view(torch.float16)`
    reinterprets pairs of bytes as fp16 numbers."""
    # TODO: the block layout in the docstring, and part 5 of the module docstring for scale and zero.
    raise NotImplementedError("lab10 repack_q4_1: view the bytes block by block, read d and m as fp16 (the "
                              "docstring's hint), and the codes from the nibbles in the documented order")


def compact_scales(d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1's d [n, g] (>= 0) and m [n, g] in 8 bits a number: (d_codes uint8 [n, g], m_codes int8 [n, g],
    f_d fp32 [n], f_m fp32 [n]) with f_d = max of the row's d / 255, f_m = max of the row's |m| / 127 (at least
    1e-12, so an all-zero row divides by something), d_codes = round(d / f_d) in [0, 255] and
    m_codes = round(m / f_m) in [-127, 127]; so d ~ d_codes * f_d and m ~ m_codes * f_m, within half a code."""
    # TODO: per row, the factors and code ranges the docstring gives.
    raise NotImplementedError("lab10 compact_scales: one factor per row for d and one for m, then each number "
                              "rounded to a code within its range and integer type")
