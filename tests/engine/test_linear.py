"""`model.Linear` computes x W^T in whichever equal form is faster on a CPU; the result must be F.linear's."""
import pytest
import torch
import torch.nn.functional as F

from mini_engine.model import Linear


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 2, 16, 100, 200])
def test_linear_equals_f_linear(rows, dtype, tol):
    torch.manual_seed(rows)
    layer = Linear(576, 480).to(dtype)  # 1.05 MiB in fp32: big enough for every fast path
    x = torch.randn(rows, 576, dtype=dtype)
    got = layer(x)
    expected = F.linear(x.float(), layer.weight.float())
    assert got.dtype == dtype and got.shape == (rows, 480)
    assert got.is_contiguous(), "the next layer expects row-major activations (a transposed view is slow)"
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol * 10)


def test_linear_keeps_nn_linear_state_dict_names():
    assert set(Linear(4, 3).state_dict()) == {"weight"}, "no bias, same key as nn.Linear(bias=False)"
