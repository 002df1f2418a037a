"""The weight products y = x W^T: the equal forms that compete on a CPU, and the `Linear` layer that picks
among them by timing them on the machine it runs on (`autotune`).

The candidates, all computing the same sums in another order (results agree with F.linear to rounding):
- `linear`: F.linear(x, W), the library's plain form and the one HF transformers uses;
- `transposed`: (W x^T)^T, a GEMM with the weight as the left operand (2+ rows);
- `two_row`: a single row computed as two copies of itself, a GEMM instead of a GEMV (1 row);
- `*_fp32`: the same in fp32, for bf16/fp16 weights (CPUs without bf16 instructions convert anyway);
- `onednn`: oneDNN's own GEMM on a copy of the weight packed once into its blocked layout (the weight
  prepacking Inductor does for CPU inference). It costs a second copy of the weight, so it is used only where
  it wins. On a 2-core AMD EPYC (Zen 5) fp32 products ran 2.2-4x faster this way at every row count from 1 to
  1,056: PyTorch's fp32 F.linear goes to MKL there, and the packed oneDNN kernel used the CPU's AVX-512 better.
- `c_f32`: the project's C kernel (csrc/f32_gemm.c) on a copy of the weight packed into panels once, for fp32
  weights whose rows are a multiple of its panel: it streams the weights while it computes, which decides the
  speed of the 4 to 64 rows of a batch's decode step (a second copy too, used only where it wins).
Which wins depends on the CPU, the BLAS, the shape and the number of rows: measured, never assumed.

Under torch.compile the forms are traced into the graph, and tuned apart (the key "traced"): the compiler
cannot trace an opaque packed tensor, so a graph reaches a packed form through the custom operator
`mini_engine::packed_product`, which takes the plain weight and runs the packed copy its `Linear` keeps (the
same copy the eager steps use: no third copy of the weights).
"""
from __future__ import annotations

import functools
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels
from .autotune import (TUNER, Autotuner, Walk, counting_mode_active, number_layer, numbered_layer,
                       row_bucket)


def _transposed(x, w):
    return (w @ x.t()).t().contiguous()  # the next layer wants row-major activations


def _two_row(x, w):
    return (w @ x.repeat(2, 1).t())[:, :1].t().contiguous()


def _in_fp32(form):
    return lambda x, w: form(x.float(), w.float()).to(x.dtype)


# oneDNN lays a packed weight out for the row count it is told to expect, and a layer keeps one packed copy for
# every row count. Told 1 row, oneDNN chose a layout that was slower at every row count: on a 2-core AMD EPYC
# (Zen 5), the 120 fp32 decoder products took 11.9 ms at 1 row and 18.5 ms at 4 (packed for 1) against 7.6 and
# 11.1 ms packed for any count from 2 to 512, which were within 3% of one another (bf16: no difference). Before,
# the first call's row count decided the layout, and a layer first called with one row kept the slow one.
PACK_ROWS = 64


def _onednn_pack(w):
    return torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)  # an opaque oneDNN tensor: run only by _onednn


def _onednn(x, packed):
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


FORMS = {"linear": F.linear, "transposed": _transposed, "two_row": _two_row,
         "linear_fp32": _in_fp32(F.linear), "transposed_fp32": _in_fp32(_transposed),
         "two_row_fp32": _in_fp32(_two_row), "onednn": _onednn, "c_f32": cpu_kernels.f32_gemm}
# Forms that run on a prepared copy of the weight, not the weight itself: form -> prepare(weight).
PACKERS = {"onednn": _onednn_pack, "c_f32": cpu_kernels.f32_pack}


def prepare_weight(form: str, w: torch.Tensor) -> torch.Tensor:
    """The second argument `FORMS[form]` takes: the weight, or its packed copy for a packed form."""
    return PACKERS[form](w) if form in PACKERS else w


@functools.cache
def onednn_available() -> bool:
    """Whether this PyTorch build has oneDNN and its linear-weight packing (every x86 and Arm CPU build does)."""
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs weights of `dtype` on this CPU. Its bf16 packing needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT: on an AVX2-only AMD EPYC (Zen 3) it raised "bf16 path needs the cpu support ...", so the
    packed form is offered for bf16 only where a probe packs."""
    if dtype not in (torch.float32, torch.bfloat16) or not onednn_available():
        return False
    try:
        _onednn_pack(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError:
        return False
    return True


def candidate_forms(shape: tuple[int, int], rows: int, dtype: torch.dtype, packed: bool = True) -> list[str]:
    """The forms that apply to `rows` rows of `dtype` against a weight of `shape` on this machine, the plain one
    first; `packed=False`: the forms a torch.compile graph can call, which leaves out the packed forms unless
    `packed_product` reaches them."""
    names = ["linear", "two_row" if rows == 1 else "transposed"]
    if dtype != torch.float32:
        names += [n + "_fp32" for n in names]
    if packed or _PACKED_OP is not None:
        if onednn_packs(dtype):
            names.append("onednn")
        if dtype == torch.float32 and cpu_kernels.f32_gemm_supported(shape[0]):
            names.append("c_f32")
    return names


@functools.cache
def last_level_cache_bytes() -> int:
    """The largest CPU cache (Linux sysfs); 64 MiB where it cannot be read."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=64 * 2**20)


# Timing a product on one weight in a loop would keep it in cache, where a decode or a short prefill chunk streams
# every weight from memory once: a form that wins in cache can lose on the model (see `timing_copies`).
TIMING_FLOPS = 8e9
# ... and of at most 512 MiB of copies: a VM may report its host's whole L3 (480 MiB on a 2-core Xeon), and filling
# fresh memory took up to 2 s a GiB there, which made the timing of the 113 MB head cost seconds per case.
TIMING_BYTES = 512 * 2**20


def timing_copies(nbytes: int, rows: int, macs: int) -> int:
    """How many copies of a weight of `nbytes` bytes (`macs` multiply-adds per row of x) to time a form on, so
    that one timed pass streams them from memory as the model does: together about twice the last-level cache
    (at most TIMING_BYTES), at most 64, and at most TIMING_FLOPS of work per pass, which only large row counts
    reach (they are compute-bound, where caching matters little). Caps that kept the copies in cache chose forms
    that lost on the model twice: 0.2 GFLOP a pass crowned a bf16 form that made the chained products 5-12%
    slower, and on a 2-core Xeon with AMX 1 GFLOP left 8-17 copies of the 7 MB gate/up weight at 16 and 32 rows,
    where MKL's plain GEMM (which repacks the weight on every call, cheap in cache) kept its place; over the
    model's 120 products, streamed, oneDNN's prepacked form was 1.5x faster for that shape (12.4 against 18.5 ms
    at 16 rows)."""
    copies = -(-min(2 * last_level_cache_bytes(), TIMING_BYTES) // nbytes)
    return max(1, min(copies, 64, int(TIMING_FLOPS // (2 * rows * macs))))


def _timing_inputs(weight: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x of `rows` rows, and `timing_copies` copies of the weight."""
    copies = timing_copies(weight.nbytes, rows, weight.numel())
    gen = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(rows, weight.shape[1], generator=gen, device=weight.device).to(weight.dtype)
    return x, weight.detach().expand(copies, *weight.shape).clone()


def product_key(weight: torch.Tensor, rows: int, packed: bool = True) -> tuple:
    """The case a product of `rows` rows against `weight` is tuned as (the tuner's op "product")."""
    # With the packed forms reachable from a graph (`packed_product`), a graph chooses among the same forms as
    # the eager steps, and shares their decision; without it, among fewer, decided apart ("traced").
    apart = not packed and _PACKED_OP is None
    return (tuple(weight.shape), row_bucket(rows), str(weight.dtype), weight.device.type) + \
        (("traced",) if apart else ())


def choose_form(weight: torch.Tensor, rows: int, tuner: Autotuner = TUNER, packed: bool = True) -> str:
    """The tuned form for `rows` rows against `weight` (timed on first use of its shape, row bucket, dtype
    and device; `packed=False`: among the forms torch.compile can trace)."""
    bucket, key = row_bucket(rows), product_key(weight, rows, packed)

    def candidates(names=None):  # `names`: build only these (a check compares two forms)
        x, ws = _timing_inputs(weight, bucket)
        forms = {}
        for name in candidate_forms(tuple(weight.shape), bucket, weight.dtype, packed):
            if names is not None and name not in names:
                continue
            try:
                prepared = _prepared_copies(name, ws)
                if name in PACKERS:  # a build or CPU that cannot run it says so now, not in the middle of a step
                    FORMS[name](x, prepared[0])
            except RuntimeError:
                continue
            forms[name] = Walk(functools.partial(FORMS[name], x), prepared)
        return forms
    return tuner.choose("product", key, candidates)


def _prepared_copies(name: str, ws: torch.Tensor):
    """The timing copies `ws` [copies, N, K] as form `name` takes them. A packed copy that is a plain tensor is
    packed once and copied in one allocation, as the weights were: packing each copy apart took seconds for the
    head's 9 copies of 113 MB on a 2-core Xeon, where one allocation of them all took 0.2 s."""
    if name not in PACKERS:
        return ws
    first = PACKERS[name](ws[0])
    if first.layout == torch.strided:
        return first.expand(len(ws), *first.shape).clone()
    return [first, *(PACKERS[name](w) for w in ws[1:])]  # oneDNN's opaque tensors are packed one by one


class Linear(nn.Linear):
    """A bias-free nn.Linear whose product, on a CPU, takes the form measured fastest on this machine for its
    weight shape, row count and dtype (see `products`). On a GPU, under torch.compile with nothing tuned,
    and under FLOP counters (which must see the product the model means), it is F.linear."""

    def __init__(self, in_features: int, out_features: int, tuner: Autotuner = TUNER):
        super().__init__(in_features, out_features, bias=False)
        self._init_forms(tuner)

    @classmethod
    def adopt(cls, layer: nn.Linear, tuner: Autotuner = TUNER) -> "Linear":
        """Turn a bias-free nn.Linear into this class in place, keeping its weight (`install` does this)."""
        layer.__class__ = cls
        layer._init_forms(tuner)
        return layer

    def _init_forms(self, tuner: Autotuner) -> None:
        self.tuner = tuner
        number_layer(self)  # how a compiled graph's `_traced_form` names it
        # (rows, dtype) -> form: the tuner's answer, kept here because a decode step makes 121 products and
        # each lookup through the tuner costs microseconds.
        self._forms: dict[tuple[int, torch.dtype], callable] = {}
        self._packed: dict[str, tuple] = {}  # packed form -> (weight version, dtype, packed copy)

    def forward(self, x):
        w = self.weight
        # The common case first, in as few Python operations as possible: a decode step makes 121 products,
        # and every microsecond here is a microsecond on each of them (`_forms` only holds CPU cases).
        if x.dim() == 2 and not torch.compiler.is_compiling():
            form = self._forms.get((x.shape[0], w.dtype))
            if form is not None and not counting_mode_active():
                return form(x, w)
        if x.device.type != "cpu" or x.dim() != 2:
            return F.linear(x, w)
        if torch.compiler.is_compiling():  # the choice is a fact about the machine: a constant in the graph
            if _inductor_writes_products():
                return F.linear(x, w)
            name = _traced_form(self.number, x.shape[0])
            if name in PACKERS:
                return torch.ops.mini_engine.packed_product(x, w, name)
            return FORMS[name](x, w)
        if counting_mode_active():
            return F.linear(x, w)
        return self.form_for(x.shape[0])(x, w)

    def __getstate__(self):
        # A copy (copy.deepcopy, pickle) decides its forms anew: the cached forms of a packed weight are bound
        # to this layer, and a oneDNN packed tensor cannot be copied.
        return {**self.__dict__, "_forms": {}, "_packed": {}}

    def __setstate__(self, state):
        super().__setstate__(state)
        number_layer(self)

    def _apply(self, fn, *args, **kwargs):
        self._forms.clear()  # moved to another device or dtype: the forms are decided anew
        self._packed.clear()
        return super()._apply(fn, *args, **kwargs)

    def packed_product(self, x, name: str):
        """x times this layer's weight in the packed form `name`, on the layer's packed copy (what the custom
        operator `packed_product` runs inside a compiled graph)."""
        form = self._forms.get(("packed", name))
        if form is None:
            form = self._forms[("packed", name)] = self._packed_form(name)
        return form(x, self.weight)

    def form_for(self, rows: int):
        """The product function (x, weight) tuned for `rows` rows of this weight (timed on first use)."""
        form = self._forms.get((rows, self.weight.dtype))
        if form is None:
            name = choose_form(self.weight, rows, self.tuner)
            form = self._forms[(rows, self.weight.dtype)] = self._packed_form(name) if name in PACKERS \
                else FORMS[name]
        return form

    def _packed_form(self, name: str):
        """FORMS[name] on this layer's packed copy of the weight for that form, packed once and again only if the
        weight is changed in place (its version counter moves) or its dtype changes. A layer whose row counts
        chose two packed forms keeps a copy for each."""
        run, pack = FORMS[name], PACKERS[name]

        def form(x, w):
            kept = self._packed.get(name)
            if kept is None or kept[:2] != (w._version, w.dtype):
                kept = self._packed[name] = (w._version, w.dtype, pack(w.detach()))
            return run(x, kept[2])
        return form


@torch._dynamo.assume_constant_result
def _inductor_writes_products() -> bool:
    """Run (not traced) when torch.compile meets a Linear: whether Inductor tunes the graph's products itself
    (max_autotune, as compile="max-autotune" sets it): then the graph gets the plain product, the one form
    Inductor can replace with its own GEMM, and Inductor's timings choose."""
    from torch._inductor import config
    return bool(config.max_autotune)


@torch._dynamo.assume_constant_result
def _traced_form(number: int, rows: int) -> str:
    """Run (not traced) when torch.compile meets a Linear (`number`: its `number_layer`): the form is tuned, or
    looked up, eagerly, among the forms the compiler can trace. A packed form registers the layer, for
    `packed_product` to find."""
    layer = numbered_layer(number)
    name = choose_form(layer.weight, rows, layer.tuner, packed=False)
    if name in PACKERS:
        _OWNERS[layer.weight.data_ptr()] = weakref.ref(layer)
    return name


# weight's data_ptr -> its Linear: how the operator finds the layer, and so the packed copy, of a weight.
_OWNERS: dict[int, weakref.ref] = {}


def _packed_product(x: torch.Tensor, weight: torch.Tensor, name: str) -> torch.Tensor:
    """x W^T in the packed form `name`, on the packed copy kept by the Linear that owns `weight`. A weight no
    Linear has registered (or moved since) gets the plain product: the same sums, never a wrong weight."""
    ref = _OWNERS.get(weight.data_ptr())
    layer = ref() if ref is not None else None
    if layer is None or layer.weight.data_ptr() != weight.data_ptr() or layer.weight.shape != weight.shape:
        return F.linear(x, weight)
    return layer.packed_product(x, name)


def _register_packed_op():
    """`torch.ops.mini_engine.packed_product(x, weight, name)`: opaque to the compiler, which only needs its
    output's shape. Declared through torch.library.Library, whose calls cost no more than the kernel's own
    (a `torch.library.custom_op` added about 9 us to each product)."""
    try:
        lib = torch.library.Library("mini_engine", "DEF")
        lib.define("packed_product(Tensor x, Tensor weight, str name) -> Tensor")
        lib.impl("packed_product", _packed_product, "CPU")
        torch.library.register_fake("mini_engine::packed_product", lib=lib)(
            lambda x, weight, name: x.new_empty(x.shape[0], weight.shape[0]))
    except (RuntimeError, AttributeError):  # an older torch, or defined twice (a reloaded module)
        return None
    return lib


_PACKED_OP = _register_packed_op()
