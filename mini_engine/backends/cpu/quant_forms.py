"""The CPU backend's quantized products: torch's packed CPU layout for int4 codes, the forms that read it or the
int8 codes (torch's packed kernels, this project's C and AMX kernels), and the measured choice among them. The
layers of `mini_engine.quant` compute in plain PyTorch (dequantize, then F.linear; the Triton kernels on a GPU);
`adopt` turns one into its subclass here (`CpuInt4Linear`, `CpuInt8Linear`), which keeps its int4 codes in torch's
CPU layout and takes, per row bucket and dtype, the form measured fastest on this machine, the way
`products.Linear.adopt` does for float layers. `install` (and `warm_up`) adopt every quantized layer of a model on
a CPU; with MINI_ENGINE_CPU_BACKEND=0 nothing is adopted and the plain form runs. The operators a compiled graph
calls (`mini_engine::int4_gemm` and the others) are registered on first use (`register_ops`), not at import.

Layouts. `quant.pack_int4` keeps two codes per byte along a row (low nibble: even column), the portable layout
the Triton kernel reads (`kernels/quant_matmul.py`). An adopted int4 layer on a CPU holds its codes in the layout
torch's packed kernel wants instead (`torch.ops.aten._convert_weight_to_int4pack_for_cpu`: blocks of 64 rows
with AVX-512, 32 with AVX2), and nothing else, so the model keeps one copy of its codes; `CPUInt4Layout` reads
that layout back. Which layout this torch build writes is found by packing a probe once (`cpu_int4_layout`), not
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
  perplexity 53.73 against 53.84 (the head table in `quant`'s docstring);
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
On a GPU none of this applies: the layers use the Triton kernels (`mini_engine.quant`'s docstring).

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
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...quant import Int4Linear, Int8Linear, QuantLinear, QuantMeta, _dequant, dequantize_state, pack_int4, unpack_int4
from . import cpu_kernels
from .autotune import (TUNER, Autotuner, Walk, counting_mode_active, number_layer, numbered_layer,
                       row_bucket)

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


@functools.cache
def register_ops() -> dict:
    """Register the operators a compiled graph calls for the C and AMX forms (where the C++ ones of
    csrc/torch_ops.cpp cannot be built), once, on first use: {name: library, or None where it failed}."""
    int4 = lambda x, packed, scales, n, group_size, block_n: x.new_empty(x.shape[0], n)  # noqa: E731
    int8 = lambda x, q, scales: x.new_empty(x.shape[0], q.shape[0])  # noqa: E731
    int4_args = "(Tensor x, Tensor packed, Tensor scales, int n, int group_size, int block_n) -> Tensor"
    int8_args = "(Tensor x, Tensor q, Tensor scales) -> Tensor"
    return {"int4_gemm": _register_op("int4_gemm" + int4_args, cpu_kernels.int4_gemm, int4),
            "int4_gemm_amx": _register_op("int4_gemm_amx" + int4_args,
                                          functools.partial(cpu_kernels.int4_gemm, amx=True), int4),
            "int8_gemm": _register_op("int8_gemm" + int8_args, cpu_kernels.int8_gemm, int8),
            "int8_gemm_amx": _register_op("int8_gemm_amx" + int8_args,
                                          functools.partial(cpu_kernels.int8_gemm, amx=True), int8)}


FORMS = {"dequant": _dequant, "dequant_bf16": _dequant_bf16, "int4pack": _int4pack, "int8pack": _int8pack,
         "int8pack_bf16": _int8pack_bf16, "c_int4": _c_int4, "amx_int4": _amx_int4,
         "c_int8": _c_int8, "amx_int8": _amx_int8}


def candidate_forms(meta: QuantMeta, dtype: torch.dtype) -> list[str]:
    """The forms that apply to a layer stored as `meta` with activations of `dtype`, the plain one first."""
    ops = register_ops()
    names = ["dequant"]
    if dtype != torch.bfloat16:
        names.append("dequant_bf16")
    if meta.kind == "int4" and meta.layout is not None:
        if not meta.compact:  # torch's kernel takes bf16 scales and zeros only
            names.append("int4pack")
        shape = (meta.out_features, meta.in_features, meta.group_size, meta.layout.block_n, meta.layout.halves)
        if (dtype in (torch.float32, torch.bfloat16) and ops["int4_gemm"] is not None
                and cpu_kernels.int4_gemm_supported(*shape)):
            names.append("c_int4")
        if (dtype in (torch.float32, torch.bfloat16) and ops["int4_gemm_amx"] is not None
                and cpu_kernels.int4_gemm_supported(*shape, amx=True)):
            names.append("amx_int4")
    if meta.kind == "int8" and int8_kernel_available():
        names += ["int8pack"] + (["int8pack_bf16"] if dtype != torch.bfloat16 else [])
    if (meta.kind == "int8" and dtype == torch.float32 and ops["int8_gemm"] is not None
            and cpu_kernels.int8_gemm_supported(meta.out_features, meta.in_features)):
        names.append("c_int8")
    if (meta.kind == "int8" and dtype in (torch.float32, torch.bfloat16) and ops["int8_gemm_amx"] is not None
            and cpu_kernels.int8_gemm_supported(meta.out_features, meta.in_features, amx=True)):
        names.append("amx_int8")
    return names


def _timing_states(layer: QuantLinear, rows: int, dtype: torch.dtype):
    """x of `rows` rows and `products.timing_copies` copies of the layer's tensors (a decode step streams each
    weight from memory once)."""
    from .products import timing_copies
    copies = timing_copies(layer.qweight.nbytes + layer.scales.nbytes, rows,
                           layer.in_features * layer.out_features)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, layer.in_features, generator=gen).to(dtype)
    return x, [(layer.qweight.clone(), layer.scales.clone()) for _ in range(copies)]


def product_key(layer: QuantLinear, rows: int, dtype: torch.dtype) -> tuple:
    """The case a product of `rows` rows of `dtype` against this layer is tuned as (op f"{kind}_product")."""
    meta = layer.meta
    return (meta.out_features, meta.in_features, meta.group_size, row_bucket(rows), str(dtype), "cpu") + \
        (("compact",) if meta.compact else ())  # compact scales have forms of their own (no int4pack)


def choose_form(layer: QuantLinear, rows: int, dtype: torch.dtype, tuner: Autotuner | None = None) -> str:
    """The tuned form for `rows` rows of `dtype` against this layer's shape and storage (timed on first use);
    the plain form where the CPU backend is off (MINI_ENGINE_CPU_BACKEND=0)."""
    from . import enabled
    if not enabled():
        return "dequant"
    bucket, meta = row_bucket(rows), layer.meta
    key = product_key(layer, rows, dtype)

    def candidates(names=None):  # `names`: build only these (a check compares two forms)
        x, states = _timing_states(layer, bucket, dtype)
        forms = {}
        for name in candidate_forms(meta, dtype):
            if names is not None and name not in names:
                continue
            try:
                FORMS[name](x, *states[0], meta)  # a build that cannot run it says so now
            except RuntimeError:
                continue
            forms[name] = Walk(functools.partial(_call, FORMS[name], x, meta), states)
        return forms
    return (tuner or layer.tuner or TUNER).choose(f"{meta.kind}_product", key, candidates)


def _call(form, x, meta, state):
    form(x, *state, meta)


@torch._dynamo.assume_constant_result
def _traced_form(number: int, rows: int, dtype: torch.dtype) -> str:
    """Run (not traced) when torch.compile meets a quantized layer (`number`: its `number_layer`): the form is
    tuned, or looked up, eagerly."""
    return choose_form(numbered_layer(number), rows, dtype)


# ---------------------------------------------------------------- the adopted layers


class TunedQuantLinear:
    """What an adopted quantized layer adds to its class in `mini_engine.quant`: on a CPU, the product form
    measured fastest here for its row count and dtype, kept per (rows, dtype); elsewhere, under a FLOP counter
    (which must see the product the model means) and where nothing applies, the layer's own product."""

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
            y = FORMS[_traced_form(self.number, x2.shape[0], x2.dtype)](x2, self.qweight, self.scales, self.meta)
        elif counting_mode_active():  # a FLOP counter sees the product the model means
            y = _dequant(x2, self.qweight, self.scales, self.meta)
        else:
            y = self.form_for(x2.shape[0], x2.dtype)(x2)
        return y.reshape(*shape[:-1], self.out_features)

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

    def __setstate__(self, state):
        super().__setstate__(state)
        number_layer(self)

    def _apply(self, fn, *args, **kwargs):
        self._forms.clear()  # moved to another device or dtype: the forms are decided anew
        return super()._apply(fn, *args, **kwargs)

    def _load_from_state_dict(self, *args, **kwargs):
        self._forms.clear()  # new tensors: the forms bound the old ones
        super()._load_from_state_dict(*args, **kwargs)


class CpuInt8Linear(TunedQuantLinear, Int8Linear):
    """An adopted `Int8Linear`: its row-major codes are what torch's and this project's int8 kernels read."""


class CpuInt4Linear(TunedQuantLinear, Int4Linear):
    """An adopted `Int4Linear`: on a CPU its codes are kept in torch's packed layout (`cpu_int4_layout`), and
    nothing else, so the model keeps one copy of them; elsewhere in the portable one (`pack_int4`)."""

    def _to_cpu_layout(self) -> None:
        layout = cpu_int4_layout()
        if self.layout is None and layout is not None and self.qweight.device.type == "cpu":
            self.qweight = cpu_pack_int4(unpack_int4(self.qweight))
            self.layout = layout
            self._forms.clear()
            self._kernel = None  # the Triton kernel's operands are made again from the codes

    def _apply(self, fn, *args, **kwargs):
        if self.layout is not None:  # moves in the portable layout, then repacks if it lands on a CPU
            self.qweight = pack_int4(self.codes())
            self.layout = None
        super()._apply(fn, *args, **kwargs)
        self._to_cpu_layout()
        return self


ADOPTED = {Int8Linear: CpuInt8Linear, Int4Linear: CpuInt4Linear}


def adopt(layer: QuantLinear, tuner: Autotuner | None = None) -> QuantLinear:
    """Turn a quantized layer of `mini_engine.quant` into its tuned CPU class in place (`install` does this for
    every one of a model's); `tuner`: the tuner it asks (default: the layer's own, else the process's). A layer
    already adopted only takes the tuner."""
    if type(layer) in ADOPTED:
        layer.__class__ = ADOPTED[type(layer)]
        layer._forms = {}
        number_layer(layer)
        register_ops()
    if tuner is not None:
        layer.tuner = tuner
    if isinstance(layer, CpuInt4Linear):
        layer._to_cpu_layout()
    return layer


def adopt_all(model) -> None:
    """`adopt` every quantized layer of `model` on a CPU (a tied embedding's table is the LM head, adopted once)."""
    for module in model.modules():
        if type(module) in ADOPTED and module.qweight.device.type == "cpu":
            adopt(module)

