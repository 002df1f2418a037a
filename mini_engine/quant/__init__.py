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
Triton kernel reads (`kernels/quant_matmul.py`). int8 weights are a plain row-major int8 matrix.

Products. A quantized layer here computes in plain PyTorch: on a CPU it dequantizes its weight in the
activations' dtype and calls F.linear (`dequantize_state`). The optional CPU backend (`backends/cpu/quant_forms.py`)
adopts these layers after loading, as it does float ones: there an int4 layer keeps its codes in torch's packed CPU
layout, and each layer takes, per row bucket and dtype, the fastest of several equal forms of its product (torch's
packed kernels, the project's C and AMX kernels), measured on the machine; its docstring gives the forms and
what they measured. `MINI_ENGINE_CPU_BACKEND=0` leaves the plain form.

On a GPU the products go through Triton kernels that dequantize inside the product, never a whole weight per
call: int4 layers through the W4A16 kernel (`kernels.quant_matmul`) on the portable layout, int8 layers through
the W8A16 one (`kernels.int8_matmul`: the codes enter the product exactly, the row's scale is applied once to its
sum). What a kernel reads (`QuantLinear.kernel_operands`) is made once, when the layer lands on the GPU, and kept
until it moves again. For int4 and int8 it is the stored codes and scales themselves; for `int4_compact` it is
the 8-bit d and m expanded once to fp32 scales and zeros (w = (q - 8) * d + (m + 8 d), exact), 8 bytes a group
beside the 2 stored: 6.5 bits a weight held on the GPU where `weight_bytes` counts the 4.5 stored.

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
"double quantization", applied to Q4_1's scale and minimum): 4.5 bits a weight plus 8 bytes a row. The CPU kernels
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

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

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


# ---------------------------------------------------------------- the plain product


@dataclass(frozen=True)
class QuantMeta:
    """What a form needs besides the tensors: the product's shape and how its weight is stored."""
    kind: str                            # "int4" or "int8"
    out_features: int
    in_features: int
    group_size: int = 0                  # int4
    layout: object | None = None         # int4: a packed CPU layout (the CPU backend's, with unpack and rows);
                                         # None: the portable `pack_int4` layout
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


# ---------------------------------------------------------------- layers


class QuantLinear(nn.Module):
    """A bias-free linear layer with quantized weights: `qweight` (the codes) and `scales` (int8: [N]; int4:
    the [G, N, 2] scales and zeros), both buffers. The scales are stored as the bits of bf16 numbers in an
    int16 buffer, so `model.to(dtype)` moves them with the model but never rounds them again."""
    kind = ""

    def __init__(self, in_features: int, out_features: int, tuner=None):
        super().__init__()
        # tuner: the CPU backend's autotuner its tuned forms ask, once it adopts the layer (None: the process's)
        self.in_features, self.out_features, self.tuner = in_features, out_features, tuner
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
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        return self.device_product(x2, x2.device.type).reshape(*shape[:-1], self.out_features)

    def device_product(self, x: torch.Tensor, device_type: str) -> torch.Tensor:
        """The product x [M, K] -> [M, N] on a device of type `device_type`: on a GPU ("cuda") this layer's
        Triton kernel (`kernel_forward`), elsewhere (a CPU too) the weight dequantized and F.linear. The device type
        is an argument so that a test can take the GPU's path on CPU tensors, in Triton's interpreter."""
        # A FLOP counter sees the product the model means: a Triton launch is invisible to it.
        if device_type == "cuda" and (torch.compiler.is_compiling() or _get_current_dispatch_mode() is None):
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

    def _apply(self, fn, *args, **kwargs):
        super()._apply(fn, *args, **kwargs)
        self._reset_kernel()
        return self

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._reset_kernel()  # new codes or scales (compact ones are expanded from them)


class Int8Linear(QuantLinear):
    """int8 weights, one scale per output channel."""
    kind = "int8"

    def __init__(self, in_features: int, out_features: int, tuner=None):
        super().__init__(in_features, out_features, tuner)
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale_bits", torch.zeros(out_features, dtype=torch.int16))

    @classmethod
    def from_codes(cls, q: torch.Tensor, scale: torch.Tensor, tuner=None) -> "Int8Linear":
        layer = cls(q.shape[1], q.shape[0], tuner)
        layer.qweight = pack_int8(q).to(layer.qweight.device)
        layer.scale_bits = scale.to(SCALE_DTYPE).contiguous().view(torch.int16)
        return layer

    @classmethod
    def from_float(cls, weight: torch.Tensor, tuner=None) -> "Int8Linear":
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
    """int4 weights in groups of `group_size` along each row, with a bf16 scale and zero per group, the codes in
    `pack_int4`'s layout (the CPU backend's adopted layer keeps them in torch's packed CPU layout instead)."""
    kind = "int4"

    def __init__(self, in_features: int, out_features: int, group_size: int = GROUP_SIZE,
                 tuner=None, compact: bool = False):
        super().__init__(in_features, out_features, tuner)
        check_group_size(in_features, group_size)
        if group_size not in KERNEL_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {KERNEL_GROUP_SIZES} (the packed kernels' sizes), "
                             f"got {group_size}")
        if out_features % 16:
            raise ValueError(f"out_features ({out_features}) must be a multiple of 16 for the packed int4 layout")
        self.group_size, self.compact = group_size, compact
        self.layout = None  # None: the portable layout (the CPU backend sets its packed one)
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        groups = in_features // group_size
        self.register_buffer("scale_bits", torch.zeros(groups * out_features + 4 * out_features, dtype=torch.int16)
                             if compact else torch.zeros(groups, out_features, 2, dtype=torch.int16))

    @property
    def scales(self) -> torch.Tensor:
        return self.scale_bits if self.compact else self.scale_bits.view(SCALE_DTYPE)

    @classmethod
    def from_codes(cls, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int = GROUP_SIZE,
                   tuner=None) -> "Int4Linear":
        """From codes [N, K] in [0, 15] and [N, K / group_size] scales and zeros (rounded to bf16 here)."""
        layer = cls(q.shape[1], q.shape[0], group_size, tuner)
        sz = to_scales_and_zeros(scales.to(SCALE_DTYPE), zeros.to(SCALE_DTYPE))
        return layer._set_codes(q, sz.view(torch.int16))

    @classmethod
    def from_compact(cls, q: torch.Tensor, scales: torch.Tensor, group_size: int = GROUP_SIZE,
                     tuner=None) -> "Int4Linear":
        """From codes [N, K] in [0, 15] and `compact_scales` (w = d * q + m, 8-bit d and m)."""
        layer = cls(q.shape[1], q.shape[0], group_size, tuner, compact=True)
        if scales.shape != layer.scale_bits.shape or scales.dtype != torch.int16:
            raise ValueError(f"scales must be compact_scales' int16 {tuple(layer.scale_bits.shape)}, got "
                             f"{scales.dtype} {tuple(scales.shape)}")
        return layer._set_codes(q, scales)

    def _set_codes(self, q: torch.Tensor, scale_bits: torch.Tensor) -> "Int4Linear":
        self.scale_bits = scale_bits.contiguous().to(q.device)
        self.qweight = pack_int4(q)
        return self

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int = GROUP_SIZE, tuner=None,
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


class SplitHead(nn.Module):
    """An LM head stored in two precisions by token id: rows [0, split) in int8 per row, the rest in int4 with
    compact scales (`Int4Linear(compact=True)`). A BPE vocabulary is numbered in merge order, roughly by
    frequency: in this model 90% of the tokens of `quality.PERPLEXITY_TEXT` and of the chapter prompts'
    greedy continuations have ids below 12,288 (a quarter of the vocabulary), so the tokens a model says most
    keep 8-bit logits and the rare three quarters cost 4.6 bits a weight. `forward` runs both products (each
    tuned as any quantized layer is) and joins their logits; `dequantize_rows` serves the tied embedding."""

    def __init__(self, weight: torch.Tensor, split: int, group_size: int = GROUP_SIZE, tuner=None):
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
                   q4_1: dict | None = None, tuner=None):
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