"""The CPU backend's quantized forms (backends/cpu/quant_forms.py): torch's packed CPU layout for int4 codes, each
form a tuned layer may take (torch's packed kernels, the C and AMX kernels) against its dequantized reference,
eagerly and in a compiled graph through either set of operators, the kernels' own builds and refusals, and the
compact scales as the kernels read them."""
from __future__ import annotations

import copy

import pytest
import torch

from mini_engine import quant
from mini_engine.backends.cpu import cpu_kernels
from mini_engine.backends.cpu import quant_forms as qf
from mini_engine.backends.cpu.autotune import Autotuner, Choice

pytestmark = pytest.mark.usefixtures("one_thread")

# The packed kernels take bf16 activations and return bf16: 8 significant bits.
BF16_REL = 1.6e-2


def needs_int4_kernel():
    if qf.cpu_int4_layout() is None:
        pytest.skip("this torch build has no packed int4 CPU kernel (or writes a layout we do not know)")


# ---------------------------------------------------------------- torch's CPU layout and the forms


@pytest.mark.parametrize("n", [64, 80, 144])  # whole blocks of 64 rows, and a partial last block
def test_torch_cpu_layout_reads_back(n):
    needs_int4_kernel()
    w = torch.randn(n, 96, generator=torch.Generator().manual_seed(n))
    layer = qf.adopt(quant.Int4Linear.from_float(w, 32))
    assert layer.layout is not None, "on a CPU the codes are kept in the packed kernel's layout"
    q, s, z = quant.quantize_int4(w, 32)
    assert torch.equal(layer.codes(), q)
    ids = torch.tensor([0, 1, 31, 32, 63, n - 1, n - 16, 5])
    assert torch.equal(layer.dequantize_rows(ids, torch.float32), layer.dequantize()[ids])
    moved = copy.deepcopy(layer).to(torch.bfloat16)  # a dtype move repacks; codes and scales survive it
    assert torch.equal(moved.codes(), q) and torch.equal(moved.scales, layer.scales)


def form_cases():
    cases = []
    for kind in ("int4", "int8"):
        for dtype in (torch.float32, torch.bfloat16):
            layer = quant.Int4Linear(64, 48) if kind == "int4" else quant.Int8Linear(64, 48)
            for name in qf.candidate_forms(layer.meta if kind == "int8" else
                                              quant.QuantMeta("int4", 48, 64, 32, qf.cpu_int4_layout()), dtype):
                cases.append((kind, name, dtype))
    return cases


@pytest.mark.parametrize("rows", [1, 3, 33])
@pytest.mark.parametrize("kind, form, dtype", form_cases(), ids=lambda v: str(v).removeprefix("torch."))
def test_each_form_equals_the_dequantized_reference(kind, form, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 64, generator=gen) * 0.1
    layer = qf.adopt(quant.Int4Linear.from_float(w, 32) if kind == "int4" else quant.Int8Linear.from_float(w))
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    if kind == "int4":
        s, z = quant.from_scales_and_zeros(layer.scales)
        expected = quant.int4_matmul_reference(x, layer.codes(), s, z, 32)
    else:
        expected = quant.int8_matmul_reference(x, layer.qweight, layer.scales)
    got = qf.FORMS[form](x, layer.qweight, layer.scales, layer.meta)
    assert got.shape == (rows, 48) and got.dtype == dtype
    exact = dtype == torch.float32 and form in ("dequant", "int8pack")  # fp32 all the way
    tol = 1e-5 if exact else BF16_REL * expected.float().abs().max().item()
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=tol)
    # The layer itself, with this form pinned, computes the same.
    layer.tuner = Autotuner(forced={f"{kind}_product": form})
    torch.testing.assert_close(layer(x).float(), got.float(), rtol=0, atol=tol)


def pack_halves(codes: torch.Tensor, block_n: int) -> torch.Tensor:
    """Codes [N, K] in torch's "halves" CPU layout with rows in blocks of `block_n` (the inverse of
    CPUInt4Layout.unpack): a CPU packs one of the two block sizes, the C kernel reads both."""
    n, k = codes.shape
    blocks = codes.view(n // block_n, block_n, k).transpose(1, 2)           # [blocks, K, block_n]
    half = block_n // 2
    return (blocks[..., :half] | (blocks[..., half:] << 4)).contiguous().view(-1)


C_INT4 = pytest.mark.skipif(not cpu_kernels.int4_gemm_supported(64, 64, 32, 32, True),
                            reason="the C int4 kernel needs a C compiler and an x86 CPU with AVX2")


@C_INT4
@pytest.mark.parametrize("block_n", [32, 64])
@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("shape", [(64, 96), (192, 576)], ids=["64x96", "192x576"])
def test_the_c_int4_kernel_equals_the_dequantized_reference(shape, rows, block_n):
    """fp32 activations against the int4 weight (bf16 scales and zeros), read in torch's packed layout with
    either block size: fp32 arithmetic, so within fp32 rounding of the float64 reference."""
    gen = torch.Generator().manual_seed(rows + block_n)
    n, k = shape
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3
    zeros = torch.randn(n, k // 32, generator=gen) * 0.05
    sz = quant.to_scales_and_zeros(scales.to(quant.SCALE_DTYPE), zeros.to(quant.SCALE_DTYPE))
    s, z = quant.from_scales_and_zeros(sz)
    x = torch.randn(rows, k, generator=gen)
    expected = quant.int4_matmul_reference(x.double(), q, s.double(), z.double(), 32)
    got = cpu_kernels.int4_gemm(x, pack_halves(q, block_n), sz, n, 32, block_n)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"block_n {block_n}, {rows} rows of {shape}: {m}")


@C_INT4
def test_the_c_int4_form_in_a_layer_a_graph_and_on_bad_input():
    """The layer's `c_int4` form (the layout this torch writes), the same through torch.compile (the operator
    `mini_engine::int4_gemm`, one graph), and inputs the kernel cannot take refused by name."""
    needs_int4_kernel()
    layer = qf.adopt(quant.Int4Linear.from_float(torch.randn(64, 96, generator=torch.Generator().manual_seed(0)), 32))
    assert "c_int4" in qf.candidate_forms(layer.meta, torch.float32)
    assert "c_int4" in qf.candidate_forms(layer.meta, torch.bfloat16)  # widened to fp32 for the kernel
    assert "c_int4" not in qf.candidate_forms(layer.meta, torch.float16)
    layer.tuner = Autotuner(forced={"int4_product": "c_int4"})
    x = torch.randn(3, 96)
    expected = qf.FORMS["dequant"](x, layer.qweight, layer.scales, layer.meta)
    # Both fp32, summed in other orders: the rounding scales with the terms (outputs of about 10), not the result.
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)
    compiled = torch.compile(lambda x: layer(x) * 2, fullgraph=True)
    torch.testing.assert_close(compiled(x), 2 * expected, rtol=1e-5, atol=2e-4)
    with pytest.raises(ValueError, match="fp32"):
        cpu_kernels.int4_gemm(x.bfloat16(), layer.qweight, layer.scales, 64, 32, layer.layout.block_n)
    with pytest.raises(ValueError, match="scales"):
        cpu_kernels.int4_gemm(x, layer.qweight, layer.scales[:1], 64, 32, layer.layout.block_n)
    assert not cpu_kernels.int4_gemm_supported(48, 96, 32, 32, True)   # not whole blocks of rows
    assert not cpu_kernels.int4_gemm_supported(64, 96, 32, 32, False)  # the pairs layout


def test_tuned_layer_and_flop_counter():
    """Unpinned, a layer times its forms once per row bucket and dtype; a FLOP counter sees a plain product."""
    from torch.utils.flop_counter import FlopCounterMode
    tuner = Autotuner(repeats=1)
    layer = qf.adopt(quant.Int4Linear.from_float(torch.randn(48, 64), 32, tuner=tuner))
    x = torch.randn(2, 64)
    y = layer(x)
    assert tuner.timings_run == 1 and layer(x).shape == y.shape and tuner.timings_run == 1
    with FlopCounterMode(display=False) as counter:
        layer(x)
    assert counter.get_total_flops() == 2 * 2 * 64 * 48


AMX = pytest.mark.skipif(
    not cpu_kernels.int4_gemm_supported(64, 64, 32, 64, True, amx=True),
    reason="the AMX kernels need a CPU with AMX-BF16 (Intel Xeon, Sapphire Rapids or later) and a C compiler for it")

C_INT8 = pytest.mark.skipif(not cpu_kernels.int8_gemm_supported(64, 64),
                            reason="the C int8 kernel needs a C compiler and an x86 CPU with AVX2")


@C_INT8
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_the_c_int8_form_equals_the_dequantized_reference_in_a_layer_and_a_graph(rows):
    """The `c_int8` form (fp32 activations, the layer's own int8 rows and bf16 scales) within fp32 rounding of
    the float64 product, eagerly and through torch.compile (`mini_engine::int8_gemm`); bad input refused by name."""
    gen = torch.Generator().manual_seed(rows)
    layer = qf.adopt(quant.Int8Linear.from_float(torch.randn(200, 96, generator=gen)))
    assert "c_int8" in qf.candidate_forms(layer.meta, torch.float32)
    assert "c_int8" not in qf.candidate_forms(layer.meta, torch.bfloat16)
    layer.tuner = Autotuner(forced={"int8_product": "c_int8"})
    x = torch.randn(rows, 96, generator=gen)
    expected = torch.nn.functional.linear(x.double(), layer.qweight.double() * layer.scales.double()[:, None]).float()
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    compiled = torch.compile(lambda x: layer(x) * 2, fullgraph=True, dynamic=False)  # a graph per row count
    torch.testing.assert_close(compiled(x), 2 * expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="fp32"):
        cpu_kernels.int8_gemm(x.bfloat16(), layer.qweight, layer.scales)
    with pytest.raises(ValueError, match="scales"):
        cpu_kernels.int8_gemm(x, layer.qweight, layer.scales.float())
    assert not cpu_kernels.int8_gemm_supported(198, 96)  # rows in fours
    assert not cpu_kernels.int8_gemm_supported(200, 92)  # columns in eights


@C_INT4
def test_the_cpp_operators_equal_the_kernels_and_a_graph_takes_either_route(monkeypatch):
    """torch.ops.mini_engine_cpp (csrc/torch_ops.cpp, what graphs call) gives the ctypes wrappers' results bit
    for bit and refuses bad input by name; a graph compiled without it (no C++ compiler) calls the
    Python-registered operators, with the same result."""
    if not cpu_kernels.load_torch_ops():
        pytest.skip("the C++ operators could not be built here (no C++ compiler or PyTorch headers)")
    gen = torch.Generator().manual_seed(3)
    int4 = qf.adopt(quant.Int4Linear.from_float(torch.randn(64, 96, generator=gen), 32))
    int8 = qf.adopt(quant.Int8Linear.from_float(torch.randn(200, 96, generator=gen)))
    x = torch.randn(3, 96, generator=gen)
    ops, kernels = torch.ops.mini_engine_cpp, cpu_kernels
    block_n = int4.layout.block_n
    assert torch.equal(ops.int4_gemm(x, int4.qweight, int4.scales, 64, 32, block_n),
                       kernels.int4_gemm(x, int4.qweight, int4.scales, 64, 32, block_n))
    assert torch.equal(ops.int8_gemm(x, int8.qweight, int8.scales), kernels.int8_gemm(x, int8.qweight, int8.scales))
    with pytest.raises(RuntimeError, match="fp32"):
        ops.int8_gemm(x.bfloat16(), int8.qweight, int8.scales)
    with pytest.raises(RuntimeError, match="scales"):
        ops.int4_gemm(x, int4.qweight, int4.scales[:1], 64, 32, block_n)
    int4.tuner = Autotuner(forced={"int4_product": "c_int4"})
    results = []
    for cpp in (True, False):
        monkeypatch.setattr(qf, "_cpp_ops", lambda cpp=cpp: cpp)
        torch._dynamo.reset()
        results.append(torch.compile(lambda x: int4(x) * 2, fullgraph=True)(x))
    assert torch.equal(results[0], results[1])
    torch._dynamo.reset()


def random_int4(n: int, k: int, group_size: int, seed: int):
    """Random codes [n, k], their bf16 scales and zeros as the kernels take them ([k / group_size, n, 2]), and
    the two read back as floats ([n, groups] each)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // group_size, generator=gen) * 0.02 + 1e-3
    zeros = torch.randn(n, k // group_size, generator=gen) * 0.05
    sz = quant.to_scales_and_zeros(scales.to(quant.SCALE_DTYPE), zeros.to(quant.SCALE_DTYPE))
    return (q, sz, *quant.from_scales_and_zeros(sz))


@AMX
@pytest.mark.parametrize("block_n", [32, 64])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("shape, group_size", [((64, 96), 32), ((192, 576), 64)], ids=["64x96-g32", "192x576-g64"])
def test_the_amx_int4_kernel_equals_the_reference_on_bf16_activations(shape, group_size, rows, block_n):
    """The AMX kernel multiplies the codes themselves (exact in bf16) and applies the scales in fp32, so against
    a float64 reference on x rounded to bf16 it is within fp32 rounding, for a partial tile of x (5, 17, 40 rows),
    a full one (16) and groups of one or two tiles."""
    n, k = shape
    q, sz, s, z = random_int4(n, k, group_size, rows + block_n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    expected = quant.int4_matmul_reference(x.bfloat16().double(), q, s.double(), z.double(), group_size)
    got = cpu_kernels.int4_gemm(x, pack_halves(q, block_n), sz, n, group_size, block_n, amx=True)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"block_n {block_n}, {rows} rows of {shape}, groups of {group_size}: {m}")


@AMX
@pytest.mark.parametrize("rows", [1, 16, 17])
def test_the_amx_int8_kernel_equals_the_reference_on_bf16_activations(rows):
    gen = torch.Generator().manual_seed(rows)
    q, scales = quant.quantize_int8(torch.randn(224, 96, generator=gen))
    x = torch.randn(rows, 96, generator=gen)
    expected = quant.int8_matmul_reference(x.bfloat16().double(), q, scales.double())
    got = cpu_kernels.int8_gemm(x, q, scales, amx=True)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4 * expected.abs().max().item())


@AMX
def test_the_amx_forms_in_a_layer_in_a_graph_through_either_operator_and_on_bad_input(monkeypatch):
    """Both AMX forms as a layer runs them, and the same through torch.compile, whether the graph calls the C++
    operators or the Python-registered ones; shapes the kernels cannot take are not offered to the tuner, and
    bad activations are refused by name."""
    gen = torch.Generator().manual_seed(5)
    int4 = qf.adopt(quant.Int4Linear.from_float(torch.randn(64, 96, generator=gen), 32))
    int8 = qf.adopt(quant.Int8Linear.from_float(torch.randn(224, 96, generator=gen)))
    assert "amx_int4" in qf.candidate_forms(int4.meta, torch.float32)
    assert "amx_int8" in qf.candidate_forms(int8.meta, torch.float32)
    x = torch.randn(3, 96, generator=gen)
    for layer, form in ((int4, "amx_int4"), (int8, "amx_int8")):
        layer.tuner = Autotuner(forced={f"{layer.kind}_product": form})
        expected = qf.FORMS["dequant"](x.bfloat16().float(), layer.qweight, layer.scales, layer.meta)
        eager = layer(x)
        torch.testing.assert_close(eager, expected, rtol=1e-5, atol=1e-5)
        for cpp in (True, False) if cpu_kernels.load_torch_ops() else (False,):
            monkeypatch.setattr(qf, "_cpp_ops", lambda cpp=cpp: cpp)
            torch._dynamo.reset()
            compiled = torch.compile(lambda x: layer(x) * 2, fullgraph=True)(x)
            assert torch.equal(compiled, 2 * eager), f"{form} in a graph, C++ operators {cpp}"
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="fp32"):
        cpu_kernels.int4_gemm(x.bfloat16(), int4.qweight, int4.scales, 64, 32, int4.layout.block_n, amx=True)
    with pytest.raises(ValueError, match="fp32"):
        cpu_kernels.int8_gemm(x.bfloat16(), int8.qweight, int8.scales, amx=True)
    assert not cpu_kernels.int4_gemm_supported(64, 96, 16, 64, True, amx=True)  # groups under one tile
    assert not cpu_kernels.int8_gemm_supported(200, 96, amx=True)               # rows not in 32s
    assert not cpu_kernels.int8_gemm_supported(224, 80, amx=True)               # columns not in 32s


@C_INT4
def test_the_c_int4_kernels_avx2_build_equals_the_dequantized_reference():
    """A CPU without AVX-512 runs the 8-lane kernel; built that way here too (-DAVX2_ONLY=1) and checked against
    the reference, as this CPU's own build is above."""
    import ctypes
    lib = ctypes.CDLL(str(cpu_kernels.build("int4_gemm", {"AVX2_ONLY": 1})))
    lib.int4_gemm_f32.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 6
    gen = torch.Generator().manual_seed(7)
    n, k = 192, 576
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    sz = quant.to_scales_and_zeros((torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).to(quant.SCALE_DTYPE),
                                   (torch.randn(n, k // 32, generator=gen) * 0.05).to(quant.SCALE_DTYPE))
    compact = quant.compact_scales(torch.rand(n, k // 32, generator=gen) * 0.02, torch.randn(n, k // 32) * 0.05)
    meta = quant.QuantMeta("int4", n, k, 32, None, compact=True)
    s, z = quant.from_scales_and_zeros(sz)
    cases = ((sz, quant.dequantize_int4(q, s, z, 32)),
             (compact, quant.dequantize_state(quant.pack_int4(q), compact, meta)))
    for scales, expected_weight in cases:
        for block_n in (32, 64):
            packed = pack_halves(q, block_n)
            for rows in (1, 3):
                x = torch.randn(rows, k, generator=gen)
                y = torch.empty(rows, n)
                assert lib.int4_gemm_f32(x.data_ptr(), packed.data_ptr(), scales.contiguous().data_ptr(), y.data_ptr(),
                                         rows, n, k, 32, block_n, int(scales is compact)) == 0
                expected = x.double() @ expected_weight.double().t()
                torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"block_n {block_n}, {rows} rows, {scales.dtype}: {m}")




# ---------------------------------------------------------------- compact scales


def random_compact(n: int, k: int, seed: int):
    """Random codes [n, k] and compact scales, and the weight they stand for (fp32 [n, k])."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = quant.compact_scales(torch.rand(n, k // 32, generator=gen) * 0.02,
                                  -torch.rand(n, k // 32, generator=gen) * 0.15)
    weight = quant.dequantize_state(quant.pack_int4(q), scales, quant.QuantMeta("int4", n, k, 32, None, compact=True))
    return q, scales, weight


@C_INT4
@pytest.mark.parametrize("amx", [False, pytest.param(True, marks=AMX)], ids=["c_int4", "amx_int4"])
@pytest.mark.parametrize("block_n", [32, 64])
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_the_int4_kernels_read_compact_scales(rows, block_n, amx):
    """The C and AMX kernels on compact scales against float64 products with the weight they stand for (the AMX
    kernel on x rounded to bf16, as it rounds it)."""
    n, k = 192, 576
    q, scales, weight = random_compact(n, k, rows + block_n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    expected = (x.bfloat16() if amx else x).double() @ weight.double().t()
    got = cpu_kernels.int4_gemm(x, pack_halves(q, block_n), scales, n, 32, block_n, amx=amx)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"block_n {block_n}, {rows} rows, amx={amx}: {m}")
    with pytest.raises(ValueError, match="compact int16"):
        cpu_kernels.int4_gemm(x, pack_halves(q, block_n), scales[:-2], n, 32, block_n, amx=amx)


@pytest.mark.parametrize("rows", [1, 3, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_form_of_a_compact_layer_equals_its_dequantized_weight(rows, dtype):
    """Every form the tuner may pick for a compact layer (never torch's int4pack: it takes bf16 scales only)."""
    gen = torch.Generator().manual_seed(rows)
    layer = qf.adopt(quant.Int4Linear.from_float(torch.randn(48, 64, generator=gen) * 0.1, 32, compact=True))
    assert layer.compact and "8-bit d and m" in repr(layer)
    assert layer.nbytes == 48 * 64 // 2 + 48 * 2 * 2 + 48 * 8  # codes, 2 bytes a group, 8 bytes a row
    forms = qf.candidate_forms(layer.meta, dtype)
    assert "int4pack" not in forms and "dequant" in forms
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    expected = x.double() @ layer.dequantize().double().t()
    for form in forms:
        got = qf.FORMS[form](x, layer.qweight, layer.scales, layer.meta)
        exact = dtype == torch.float32 and form in ("dequant", "c_int4")
        tol = 1e-5 if exact else 1.6e-2 * expected.abs().max().item()
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=tol, msg=lambda m: f"{form}: {m}")
    # quantized at load: the codes are the nearest for the stored (8-bit) d and m
    w = torch.randn(16, 64, generator=gen)
    q, scales = quant.quantize_int4_compact(w)
    d, m = quant.expand_compact_scales(scales, 16, 2)
    err = (quant.dequantize_state(quant.pack_int4(q), scales, quant.QuantMeta("int4", 16, 64, 32, None, True)) - w)
    assert (err.abs().view(16, 2, 32) <= d[..., None] / 2 + 1e-6).all()


def test_a_compact_layer_is_tuned_apart_from_a_bf16_scaled_one_of_its_shape():
    """The tuner's choice for a layer with bf16 scales (torch's int4pack among its candidates) is not reused for
    a compact layer of the same shape, whose scales int4pack cannot read."""
    needs_int4_kernel()
    tuner = Autotuner()
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(5)) * 0.1
    plain = qf.adopt(quant.Int4Linear.from_float(w, 32, tuner))
    small = qf.adopt(quant.Int4Linear.from_float(w, 32, tuner, compact=True))
    # as if int4pack had won the timing for the bf16-scaled layer's shape
    tuner.choices[("int4_product", 64, 96, 32, 1, str(torch.bfloat16), "cpu")] = Choice("int4pack", {})
    x = torch.randn(1, 96).bfloat16()
    assert qf.choose_form(plain, 1, torch.bfloat16) == "int4pack"
    assert qf.choose_form(small, 1, torch.bfloat16) in qf.candidate_forms(small.meta, torch.bfloat16)
    torch.testing.assert_close(small(x).float(), (x.double() @ small.dequantize().double().t()).float(),
                               rtol=0, atol=2e-2)
