"""The quantized layers on a GPU: each product through a Triton kernel (W4A16 for int4, W8A16 for int8), what the
kernel reads made once, when the layer lands on the GPU, and never again until it moves.

Everything but the device runs on a CPU too: `QuantLinear.device_product(x, "cuda")` takes the GPU's path on
CPU tensors, whose kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where there
is no GPU). A machine runs the kernels one way only, so the tests of that path build their layers and inputs on
`device`: the GPU where there is one (the layer's operands then made as it lands there), else the CPU. The
tests marked for a GPU run a quantized model there, eager and compiled."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import mini_engine as me
from mini_engine import quant
from mini_engine.kernels import int8_matmul, quant_matmul

KINDS = ["int4", "int4_compact", "int8"]
# The output's rounding, relative to its largest value (the int4 kernel also rounds each weight to x's dtype).
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def device() -> str:
    """Where the GPU path's kernels run natively: the GPU, or the CPU in Triton's interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def make(kind: str, device: str | None = "cpu", seed: int = 0, n: int = 48, k: int = 96) -> quant.QuantLinear:
    """A layer quantized on the CPU, then moved to `device` (None: left unmoved)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    if kind == "int8":
        layer = quant.Int8Linear.from_float(w)
    else:
        layer = quant.Int4Linear.from_float(w, 32, compact=kind == "int4_compact")
    return layer if device is None else layer.to(device)


def rows(device: str = "cpu", m: int = 5, k: int = 96, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(7)).to(device, dtype)


def count_launches(monkeypatch) -> list[str]:
    """Record each launch of the two kernels' wrappers (and still launch them)."""
    launched = []
    for module, name in ((quant_matmul, "w4a16_matmul"), (int8_matmul, "w8a16_matmul")):
        def recorded(*args, _real=getattr(module, name), _name=name):
            launched.append(_name)
            return _real(*args)
        monkeypatch.setattr(module, name, recorded)
    return launched


def count_expansions(monkeypatch) -> list[int]:
    """Record each expansion of compact scales (8-bit d and m to floats)."""
    expanded = []
    real = quant.expand_compact_scales

    def recorded(*args, **kwargs):
        expanded.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(quant, "expand_compact_scales", recorded)
    return expanded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_the_gpu_path_computes_the_layers_product(kind, dtype, device):
    layer, x = make(kind, device), rows(device, dtype=dtype)
    got = layer.device_product(x, "cuda")
    expected = F.linear(x.float(), layer.dequantize()).to(dtype)
    assert got.shape == (5, 48) and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), rtol=0,
                               atol=REL_TOL[dtype] * expected.float().abs().max().item())


@pytest.mark.parametrize("kind", KINDS)
def test_a_gpu_launches_the_layers_kernel_on_its_prepared_operands(kind, monkeypatch, device):
    launched = count_launches(monkeypatch)
    layer, x = make(kind, device), rows(device)
    layer.device_product(x, "cuda")
    assert launched == ["w8a16_matmul" if kind == "int8" else "w4a16_matmul"]
    qweight, scales = layer.kernel_operands()
    if kind == "int8":  # the stored codes and scales as they are
        assert qweight is layer.qweight and torch.equal(scales, layer.scales)
    else:  # the portable layout (a CPU layer stores torch's packed one; a GPU layer, this), scales and zeros [G, N, 2]
        assert torch.equal(qweight, quant.pack_int4(layer.codes())) and scales.shape == (3, 48, 2)
    # Another accelerator dequantizes and calls F.linear: no kernel.
    torch.testing.assert_close(layer.device_product(x, "mps"), F.linear(x, layer.dequantize()))
    assert len(launched) == 1


def test_compact_scales_are_expanded_once_until_the_layer_moves(monkeypatch, device):
    layer, x = make("int4_compact", None), rows(device)
    expanded = count_expansions(monkeypatch)
    layer.to(device)  # on a GPU the scales are expanded here, as the layer lands; on a CPU at the first product
    first = layer.device_product(x, "cuda")
    for _ in range(3):
        torch.testing.assert_close(layer.device_product(x, "cuda"), first, rtol=0, atol=0)
    assert len(expanded) == 1
    layer.to(torch.float32)  # any move or cast (nn.Module._apply) may change the stored tensors: made again
    layer.device_product(x, "cuda")
    assert len(expanded) == 2


def test_new_tensors_loaded_into_a_layer_reach_its_kernel(device):
    layer, other, x = make("int4_compact", device, seed=0), make("int4_compact", device, seed=1), rows(device)
    layer.device_product(x, "cuda")
    layer.load_state_dict(other.state_dict())
    torch.testing.assert_close(layer.device_product(x, "cuda"), other.device_product(x, "cuda"), rtol=0, atol=0)


def test_a_flop_counter_sees_the_product_on_the_gpu_path(monkeypatch, device):
    launched = count_launches(monkeypatch)
    layer, x = make("int4", device), rows(device)
    with FlopCounterMode(display=False) as counter:
        layer.device_product(x, "cuda")
    assert counter.get_total_flops() == 2 * 5 * 48 * 96 and not launched  # a Triton launch would count nothing


def test_a_graph_that_finds_no_operands_makes_its_own_and_stores_nothing(monkeypatch):
    # A CPU layer on every machine: one on a GPU made its operands as it landed. Nothing here is launched.
    layer = make("int4_compact")
    expanded = count_expansions(monkeypatch)
    compiled = torch.compile(lambda: layer.kernel_operands()[1] * 1, fullgraph=True, backend="eager")
    scales_and_zeros = compiled()
    assert layer._kernel is None and len(expanded) == 1  # traced once, nothing kept on the layer
    torch.testing.assert_close(scales_and_zeros, layer.kernel_operands()[1], rtol=0, atol=0)


# ---------------------------------------------------------------- on a GPU


def quantized_pair(tiny_model, quantization):
    """A tiny quantized model on the CPU and a copy of it on the GPU in the course's dtype there."""
    cpu = quant.quantize_model(copy.deepcopy(tiny_model(0)), quantization)
    return cpu, copy.deepcopy(cpu).to("cuda", getattr(torch, me.default_dtype("cuda")))


@GPU
@pytest.mark.parametrize("quantization", KINDS)
def test_a_quantized_model_on_a_gpu_runs_its_products_through_the_kernels(quantization, tiny_model, monkeypatch):
    _, model = quantized_pair(tiny_model, quantization)
    layers = [m for m in model.modules() if isinstance(m, quant.QuantLinear)]
    assert all(m._kernel is not None and m._kernel[1].is_cuda for m in layers)  # made at load
    launched, expanded = count_launches(monkeypatch), count_expansions(monkeypatch)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0)).cuda()
    got = model(ids).float()
    assert len(launched) == len(layers) and not expanded  # every product a kernel, nothing rebuilt
    # The same model with every product dequantized and multiplied by F.linear, in the same dtype.
    monkeypatch.setattr(quant.QuantLinear, "kernel_forward",
                        lambda self, x: F.linear(x, self.dequantize(x.dtype)))
    expected = model(ids).float()
    torch.testing.assert_close(got, expected, rtol=0, atol=3e-2 * expected.abs().max().item())


@GPU
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_the_compiled_decode_step_of_a_quantized_model_on_a_gpu(quantization, tiny_model):
    _, model = quantized_pair(tiny_model, quantization)
    prompt = [3, 17, 42, 5, 99]
    eager = me.generate_cached(model, prompt, max_new_tokens=12)
    assert me.generate_cached(model, prompt, max_new_tokens=12, compile=True) == eager
