"""The W8A16 kernel (int8 weights, one scale per row, applied to each finished sum) against its torch reference, at
small shapes in Triton's interpreter on a CPU (natively on a GPU): row counts below and above a tile, columns
crossing several tiles, K not a multiple of a step, and the reference itself against quant.py's."""
import pytest
import torch

from mini_engine import quant
from mini_engine.kernels import w8a16_matmul, w8a16_matmul_reference

# Output tolerance relative to the output's largest value. The codes enter the product exactly and the sums are
# fp32, so what is left is the output's own rounding (one unit in the last place of bf16 or fp16) and fp32's.
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def quantized(n, k, seed=0, device="cpu"):
    q, scale = quant.quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    return q.to(device), scale.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m, n, k", [(1, 48, 64), (5, 80, 96), (17, 64, 100), (3, 16, 32)])
def test_kernel_matches_reference(m, n, k, dtype, device):
    q, scale = quantized(n, k, seed=m, device=device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    got = w8a16_matmul(x, q, scale)
    expected = w8a16_matmul_reference(x, q, scale)
    assert got.shape == (m, n) and got.dtype == dtype
    tol = REL_TOL[dtype] * expected.float().abs().max().item()
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=tol)
    # The reference is quant.py's: dequantize (w = q * scale) in fp32, then multiply.
    torch.testing.assert_close(expected.cpu(), quant.int8_matmul_reference(x.cpu(), q.cpu(), scale.cpu()))


def test_a_layer_through_the_kernel(device):
    """An `Int8Linear` (bf16 scales, as stored) through the kernel gives its dequantized weight's product."""
    layer = quant.Int8Linear.from_float(torch.randn(48, 96, generator=torch.Generator().manual_seed(4)))
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(5))
    got = w8a16_matmul(x.to(device), layer.qweight.to(device), layer.scales.to(device))
    torch.testing.assert_close(got.cpu(), x @ layer.dequantize().t(), rtol=1e-5, atol=1e-5)


def test_x_as_a_view_and_no_rows(device):
    q, scale = quantized(32, 64, device=device)
    x = torch.randn(4, 128, device=device)[:, ::2]  # every other column: not unit stride
    torch.testing.assert_close(w8a16_matmul(x, q, scale), w8a16_matmul_reference(x, q, scale), rtol=1e-5, atol=1e-4)
    assert w8a16_matmul(x[:0], q, scale).shape == (0, 32)


def bad_call(**overrides):
    q, scale = quantized(32, 64)
    args = dict(x=torch.randn(2, 64), qweight=q, scales=scale)
    args.update(overrides)
    w8a16_matmul(**args)


@pytest.mark.parametrize("overrides, message", [
    (dict(x=torch.randn(64)), "^x must be a 2-D tensor"),
    (dict(x=torch.randn(2, 64, dtype=torch.float64)), "^x must be float32"),
    (dict(x=torch.randn(2, 48)), "^x has 48 columns but qweight holds 64"),
    (dict(qweight=torch.zeros(32, 64, dtype=torch.uint8)), "^qweight must be a 2-D int8"),
    (dict(scales=torch.ones(16)), r"^scales must be .* \[N\] = \[32\]"),
    (dict(scales=torch.ones(32, dtype=torch.int32)), r"^scales must be a float tensor"),
])
def test_bad_inputs_name_the_argument(overrides, message):
    with pytest.raises(ValueError, match=message):
        bad_call(**overrides)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="model-sized products are for the GPU")
@pytest.mark.parametrize("n, k", [(49152, 576), (3072, 576), (576, 1536)], ids=["head", "gate_up", "down"])
@pytest.mark.parametrize("m", [1, 16, 300])
def test_model_sized_products_on_gpu(m, n, k, gpu_dtype):
    # SmolLM2's int8 products, activations in the model's dtype on this GPU, scales in bf16 as the layers store them.
    q, scale = quantized(n, k, device="cuda")
    x = torch.randn(m, k, device="cuda", dtype=gpu_dtype)
    got = w8a16_matmul(x, q, scale)
    expected = w8a16_matmul_reference(x, q, scale)
    scale_of_output = expected.float().abs().max().item()
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=REL_TOL[gpu_dtype] * scale_of_output)
