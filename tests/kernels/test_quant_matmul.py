"""The W4A16 kernel (int4 weights dequantized in the kernel) against its torch reference, at small shapes in
Triton's interpreter on a CPU (natively on a GPU): row counts below and above a tile, columns crossing several
tiles, every group size, and the reference itself against quant.py's dequantize-then-multiply."""
import pytest
import torch

from mini_engine import quant
from mini_engine.kernels import w4a16_matmul, w4a16_matmul_reference

# Output tolerance relative to the output's largest value: bf16 keeps 8 significant bits (the dequantized
# weights enter the product in bf16, and the output is rounded to bf16), fp16 11, fp32 computes exactly.
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def quantized(n, k, group_size, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    q, s, z = quant.quantize_int4(w, group_size)
    return q, s, z, quant.pack_int4(q).to(device), quant.to_scales_and_zeros(s, z).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m, n, k, group_size", [(1, 48, 64, 32), (5, 80, 96, 32), (17, 64, 128, 64),
                                                 (3, 32, 256, 256)])
def test_kernel_matches_reference(m, n, k, group_size, dtype, device):
    q, s, z, qweight, sz = quantized(n, k, group_size, seed=m, device=device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    got = w4a16_matmul(x, qweight, sz, group_size)
    expected = w4a16_matmul_reference(x, qweight, sz, group_size)
    assert got.shape == (m, n) and got.dtype == dtype
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=REL_TOL[dtype] * scale)
    # The reference is quant.py's: dequantize (w = (q - 8) * scale + zero) in fp32, then multiply.
    torch.testing.assert_close(expected.cpu(), quant.int4_matmul_reference(x.cpu(), q, s, z, group_size))


def test_gguf_q4_1_blocks_through_the_kernel(device):
    """Q4_1's w = d * q + m as the kernel's w = (q - 8) * scale + zero with scale = d, zero = m + 8 d."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (32, 64), generator=gen, dtype=torch.uint8)
    d = (torch.rand(32, 2, generator=gen) * 0.01).half()
    m = (-torch.rand(32, 2, generator=gen) * 0.08).half()
    w = codes.view(32, 2, 32).float() * d.float()[..., None] + m.float()[..., None]
    sz = quant.to_scales_and_zeros(d.float(), m.float() + 8 * d.float())  # fp32: exact
    x = torch.randn(3, 64, generator=gen)
    got = w4a16_matmul(x.to(device), quant.pack_int4(codes).to(device), sz.to(device), 32)
    torch.testing.assert_close(got.cpu(), x @ w.view(32, 64).t(), rtol=1e-5, atol=1e-5)


def test_a_compact_layer_through_the_kernel(device):
    """An `int4_compact` layer (8-bit d and m, `quant.compact_scales`) on a GPU: its `kernel_operands()` (the codes
    in the portable layout, fp32 d and m + 8 d as scales and zeros) give the layer's dequantized weight's product."""
    layer = quant.Int4Linear.from_float(torch.randn(48, 96, generator=torch.Generator().manual_seed(4)), 32,
                                        compact=True)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(5))
    qweight, scales_and_zeros = layer.kernel_operands()
    assert torch.equal(qweight, quant.pack_int4(layer.codes())) and scales_and_zeros.dtype == torch.float32
    got = w4a16_matmul(x.to(device), qweight.to(device), scales_and_zeros.to(device), 32)
    torch.testing.assert_close(got.cpu(), x @ layer.dequantize().t(), rtol=1e-5, atol=1e-5)


def test_x_as_a_view(device):
    q, s, z, qweight, sz = quantized(32, 64, 32, device=device)
    x = torch.randn(4, 128, device=device)[:, ::2]  # every other column: not unit stride
    torch.testing.assert_close(w4a16_matmul(x, qweight, sz, 32), w4a16_matmul_reference(x, qweight, sz, 32),
                               rtol=1e-5, atol=1e-4)


def bad_call(**overrides):
    _, _, _, qweight, sz = quantized(32, 64, 32)
    args = dict(x=torch.randn(2, 64), qweight=qweight, scales_and_zeros=sz, group_size=32)
    args.update(overrides)
    w4a16_matmul(**args)


@pytest.mark.parametrize("overrides, message", [
    (dict(x=torch.randn(64)), "^x must be a 2-D tensor"),
    (dict(x=torch.randn(2, 64, dtype=torch.float64)), "^x must be float32"),
    (dict(x=torch.randn(2, 48)), "^x has 48 columns but qweight holds 64"),
    (dict(qweight=torch.zeros(32, 32, dtype=torch.int8)), "^qweight must be a 2-D uint8"),
    (dict(group_size=24), "^group_size must be an even int dividing K = 64"),
    (dict(scales_and_zeros=torch.zeros(2, 32)), r"^scales_and_zeros must be .* \[2, 32, 2\]"),
])
def test_bad_inputs_name_the_argument(overrides, message):
    with pytest.raises(ValueError, match=message):
        bad_call(**overrides)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="model-sized products are for the GPU")
@pytest.mark.parametrize("m", [1, 16, 300])
def test_model_sized_products_on_gpu(m, gpu_dtype):
    # Activations in the model's dtype on this GPU; scales and zeros in bf16, as the layers store them.
    q, s, z, qweight, sz = quantized(3072, 576, 32, device="cuda")
    x = torch.randn(m, 576, device="cuda", dtype=gpu_dtype)
    got = w4a16_matmul(x, qweight, sz.to(torch.bfloat16), 32)
    expected = w4a16_matmul_reference(x, qweight, sz.to(torch.bfloat16), 32)
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=REL_TOL[gpu_dtype] * scale)
