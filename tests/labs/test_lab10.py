"""Grades lab 10 (group-wise int4 quantization, packing, and the GGUF's Q4_1 blocks repacked) in either tree.

    pytest tests/labs/test_lab10.py --impl=labs        # your work
    pytest tests/labs/test_lab10.py --impl=solutions   # the reference answers

Small hand-made cases first (a group you can check on paper), then random matrices, then the real model: the
embedded GGUF's Q4_1 tensors repacked by your code must dequantize to exactly what the `gguf` package gives, and
with your 8-bit scales to within half a code of them.
"""
import importlib

import numpy as np
import pytest
import torch

from mini_engine import quant
from mini_engine.loading import loader

LAB = "lab10_quantization"
quant_kernels = importlib.import_module("mini_engine.kernels.quant_matmul")
# The engine's quantization (quant/), its int4 kernel with the kernel's torch reference, and its GGUF loader
# already do each of these jobs: calling them fails the test (see conftest.py).
SHORTCUTS = {name: [quant, quant_kernels, loader] for name in (
    "quantize_int4", "dequantize_int4", "pack_int4", "unpack_int4", "int4_matmul", "repack_q4_1", "compact_scales")}


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- quantize / dequantize

def test_one_group_by_hand(impl):
    w = torch.tensor([[0.0, 1.45, 3.0, 0.2]])
    q, scales, zeros = impl.quantize_int4(w, group_size=4)
    assert q.dtype == torch.uint8, f"codes must be uint8, got {q.dtype}"
    assert torch.allclose(scales, torch.tensor([[0.2]])), f"scale = (max - min) / 15 = 3.0 / 15 = 0.2, got {scales}"
    assert torch.allclose(zeros, torch.tensor([[1.6]])), f"zero = min + 8 * scale = 0 + 1.6, got {zeros}"
    assert q.tolist() == [[0, 7, 15, 1]], (f"q = round((w - zero) / scale + 8): 0.0 -> 0, 1.45 -> round(7.25) = 7, "
                                          f"3.0 -> 15, 0.2 -> 1; got {q.tolist()}")


def test_codes_cover_the_range_and_errors_stay_within_half_a_step(impl):
    w = rand(6, 96)
    q, scales, zeros = impl.quantize_int4(w, group_size=32)
    assert q.shape == (6, 96) and scales.shape == (6, 3) and zeros.shape == (6, 3)
    assert int(q.min()) == 0 and int(q.max()) == 15, "each group's min must get code 0 and its max code 15"
    back = impl.dequantize_int4(q, scales, zeros, group_size=32)
    assert back.dtype == torch.float32 and back.shape == w.shape
    err = (back - w).abs().view(6, 3, 32)
    worst = (err / scales[..., None]).max().item()
    assert worst <= 0.5 + 1e-4, f"round to nearest: no weight may move more than half a step, worst {worst:.3f} steps"


def test_dequantize_is_the_rule(impl):
    q = torch.tensor([[0, 8, 15, 3, 8, 8, 1, 14]], dtype=torch.uint8)
    scales, zeros = torch.tensor([[0.5, 2.0]]), torch.tensor([[1.0, -1.0]])
    got = impl.dequantize_int4(q, scales, zeros, group_size=4)
    expected = torch.tensor([[-3.0, 1.0, 4.5, -1.5, -1.0, -1.0, -15.0, 11.0]])
    assert torch.allclose(got, expected), f"w = (q - 8) * scale + zero per group of 4: expected {expected}, got {got}"


def test_a_constant_group_comes_back_exactly(impl):
    w = torch.full((2, 32), 0.3125)
    q, scales, zeros = impl.quantize_int4(w, group_size=32)
    assert torch.isfinite(scales).all() and torch.isfinite(zeros).all(), "all-equal groups must not divide by zero"
    assert torch.equal(impl.dequantize_int4(q, scales, zeros, group_size=32), w)


def test_group_size_must_divide_the_row(impl):
    with pytest.raises(ValueError, match="group_size"):
        impl.quantize_int4(rand(4, 48), group_size=32)


# ---------------------------------------------------------------- packing and the product

def test_pack_puts_even_columns_in_the_low_nibble(impl):
    q = torch.tensor([[1, 2, 15, 0], [7, 8, 0, 15]], dtype=torch.uint8)
    packed = impl.pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 2)
    assert packed.tolist() == [[0x21, 0x0F], [0x87, 0xF0]], \
        f"byte j = column 2j | column 2j + 1 << 4: expected [[0x21, 0x0F], [0x87, 0xF0]], got {packed.tolist()}"
    assert torch.equal(impl.unpack_int4(packed), q)


def test_pack_unpack_round_trip(impl):
    q = torch.randint(0, 16, (5, 64), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    assert torch.equal(impl.unpack_int4(impl.pack_int4(q)), q)
    assert impl.pack_int4(q).numel() * 2 == q.numel(), "two codes per byte: half the bytes of the codes"


def test_int4_matmul_is_x_times_the_dequantized_weight(impl):
    w, x = rand(16, 64, seed=3), rand(3, 64, seed=4)
    q, scales, zeros = impl.quantize_int4(w, group_size=32)
    got = impl.int4_matmul(x, impl.pack_int4(q), scales, zeros, group_size=32)
    expected = x @ impl.dequantize_int4(q, scales, zeros, group_size=32).t()
    assert got.shape == (3, 16)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # ... and close to the float product: int4 costs a little accuracy, not the answer.
    rel = ((got - x @ w.t()).norm() / (x @ w.t()).norm()).item()
    assert rel < 0.15, f"relative error of the int4 product {rel:.3f}: too large for round to nearest"


# ---------------------------------------------------------------- Q4_1 repacking

def q4_1_block(d: float, m: float, codes: list[int]) -> list[int]:
    """One 20-byte Q4_1 block, built by hand: d and m as fp16, then weight i | weight i + 16 << 4."""
    head = np.array([d, m], dtype=np.float16).view(np.uint8).tolist()
    return head + [codes[i] | codes[i + 16] << 4 for i in range(16)]


def test_repack_one_hand_made_block(impl):
    codes = list(range(16)) + list(range(15, -1, -1))
    raw = torch.tensor([q4_1_block(0.25, -2.0, codes)], dtype=torch.uint8)
    q, scales, zeros = impl.repack_q4_1(raw, 1, 32)
    assert q.tolist() == [codes], f"low nibbles are weights 0-15, high nibbles 16-31: got {q.tolist()}"
    assert scales.tolist() == [[0.25]] and zeros.tolist() == [[0.0]], \
        f"scale = d = 0.25 and zero = m + 8 d = -2 + 2 = 0, got {scales.tolist()}, {zeros.tolist()}"
    w = impl.dequantize_int4(q, scales, zeros, group_size=32)
    assert torch.equal(w, 0.25 * torch.tensor([codes], dtype=torch.float32) - 2.0), "w must be d * q + m"


def test_repacked_gguf_tensor_dequantizes_exactly(impl):
    """A real Q4_1 tensor of the embedded model: your repacking, dequantized, equals gguf's dequantization."""
    gguf = pytest.importorskip("gguf")
    from mini_engine.loading.loader import embedded_gguf_path
    reader = gguf.GGUFReader(embedded_gguf_path())
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    n, k = (int(s) for s in reversed(t.shape))
    expected = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
    q, scales, zeros = impl.repack_q4_1(torch.from_numpy(np.array(t.data)), n, k)
    got = impl.dequantize_int4(q, scales, zeros, group_size=32)
    assert got.shape == (n, k) == expected.reshape(n, k).shape
    assert torch.equal(got, expected.reshape(n, k)), \
        f"no re-quantization, so no error: largest difference {(got - expected.reshape(n, k)).abs().max():.3g}"


# ---------------------------------------------------------------- the scales in 8 bits


def test_compact_scales_by_hand(impl):
    d = torch.tensor([[0.0, 0.5, 1.02]])
    m = torch.tensor([[-1.27, 0.6, 0.0]])
    d_codes, m_codes, fd, fm = impl.compact_scales(d, m)
    assert d_codes.dtype == torch.uint8 and m_codes.dtype == torch.int8, \
        f"d's codes are uint8 (d >= 0) and m's int8 (m has either sign), got {d_codes.dtype}, {m_codes.dtype}"
    assert torch.allclose(fd, torch.tensor([0.004])) and torch.allclose(fm, torch.tensor([0.01])), \
        f"f_d = max(d) / 255 = 1.02 / 255 = 0.004 and f_m = max|m| / 127 = 0.01, got {fd.tolist()}, {fm.tolist()}"
    assert d_codes.tolist() == [[0, 125, 255]], f"round(d / f_d): 0, 0.5 / 0.004 = 125, 255; got {d_codes.tolist()}"
    assert m_codes.tolist() == [[-127, 60, 0]], f"round(m / f_m): -127, 60, 0; got {m_codes.tolist()}"


def test_compact_scales_round_trip_within_half_a_code(impl):
    d, m = rand(8, 18, seed=3).abs() * 0.02, rand(8, 18, seed=4) * 0.1
    d_codes, m_codes, fd, fm = impl.compact_scales(d, m)
    assert d_codes.shape == m_codes.shape == (8, 18) and fd.shape == fm.shape == (8,), "codes [n, g], factors [n]"
    d_back, m_back = d_codes.float() * fd[:, None], m_codes.float() * fm[:, None]
    assert ((d_back - d).abs() <= fd[:, None] / 2 + 1e-7).all(), "d_codes * f_d must be within half a code of d"
    assert ((m_back - m).abs() <= fm[:, None] / 2 + 1e-7).all(), "m_codes * f_m must be within half a code of m"
    zero_row = impl.compact_scales(torch.zeros(1, 4), torch.zeros(1, 4))
    assert all(torch.isfinite(t.float()).all() for t in zero_row), "an all-zero row must not divide by zero"


def test_gguf_tensor_with_compact_scales_stays_within_half_a_code(impl):
    """The real Q4_1 tensor, repacked, with d and m in 8 bits: every weight moves by at most 15 half-codes of d
    plus half a code of m, and the relative error stays small."""
    gguf = pytest.importorskip("gguf")
    from mini_engine.loading.loader import embedded_gguf_path
    reader = gguf.GGUFReader(embedded_gguf_path())
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    n, k = (int(s) for s in reversed(t.shape))
    q, scales, zeros = impl.repack_q4_1(torch.from_numpy(np.array(t.data)), n, k)
    d, m = scales, zeros - 8 * scales
    d_codes, m_codes, fd, fm = impl.compact_scales(d, m)
    d8, m8 = d_codes.float() * fd[:, None], m_codes.float() * fm[:, None]
    exact = impl.dequantize_int4(q, d, m + 8 * d, group_size=32)
    small = impl.dequantize_int4(q, d8, m8 + 8 * d8, group_size=32)
    bound = (15 * fd / 2 + fm / 2)[:, None] * (1 + 1e-4)
    assert ((small - exact).abs() <= bound).all(), "with d and m within half a code, no weight moves more"
    rel = ((small - exact).pow(2).mean() / exact.pow(2).mean()).sqrt().item()
    assert rel < 0.05, f"8-bit scales should move the weights by a few percent at most, got {rel:.3f} (relative RMS)"


# ---------------------------------------------------------------- the guards (see conftest.py)


def int4_matmul_by_the_kernels_reference(x, packed, scales, zeros, group_size=32):
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1)  # [G, N, 2], as the kernel reads them
    return quant_kernels.w4a16_matmul_reference(x.float(), packed, scales_and_zeros, group_size)


def compact_scales_by_the_engine(d, m):
    n, groups = d.shape
    packed = quant.compact_scales(d, m)
    codes = packed[:groups * n].view(groups, n).t().to(torch.int32)
    factors = packed[groups * n:].clone().view(torch.float32).view(2, n)
    return (codes & 255).to(torch.uint8), ((codes - (codes & 255)) // 256).to(torch.int8), factors[0], factors[1]


# Each part of the lab handed to something that already does it, and a grading test that must fail it.
HAND_OFFS = [
    ("quantize_int4", lambda w, group_size=32: quant.quantize_int4(w, group_size, scale_dtype=torch.float32),
     test_one_group_by_hand, {}),
    ("dequantize_int4", quant.dequantize_int4, test_dequantize_is_the_rule, {}),
    ("pack_int4", quant.pack_int4, test_pack_puts_even_columns_in_the_low_nibble, {}),
    ("unpack_int4", quant.unpack_int4, test_pack_unpack_round_trip, {}),
    ("int4_matmul", int4_matmul_by_the_kernels_reference, test_int4_matmul_is_x_times_the_dequantized_weight, {}),
    ("int4_matmul", lambda x, packed, scales, zeros, group_size=32: quant.int4_matmul_reference(
        x, quant.unpack_int4(packed), scales, zeros, group_size), test_int4_matmul_is_x_times_the_dequantized_weight, {}),
    ("repack_q4_1", lambda raw, n, k: quant.repack_q4_1(raw, (n, k), scale_dtype=torch.float32),
     test_repack_one_hand_made_block, {}),
    ("compact_scales", compact_scales_by_the_engine, test_compact_scales_by_hand, {}),
]


def test_every_part_of_the_lab_has_a_hand_off_check(asked_for):
    missing = set(asked_for(LAB)) - {part for part, *_ in HAND_OFFS}
    assert not missing, f"parts of the lab with no hand-off check above: {sorted(missing)}"


@pytest.mark.parametrize("part,replacement,test,args", HAND_OFFS,
                         ids=[f"{part}-{i}" for i, (part, *_) in enumerate(HAND_OFFS)])
def test_the_grader_fails_a_part_handed_off(hand_off, part, replacement, test, args):
    hand_off(part, replacement, test, **args)
