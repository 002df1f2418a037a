"""The "int4_compact" quantization (quant.py): the GGUF's own Q4_1 codes with their scale d and minimum m stored
in 8 bits each (`compact_scales`), and an LM head split by token id (`SplitHead`: frequent tokens int8, the rest
int4). It exists for chapter 10's memory target: the model's weights at 30% of bf16's or less. Each kernel reads
the compact scales against its dequantized reference; the whole model keeps the quality bar of issue 15 (greedy
agreement >= 90%, perplexity within 2% of the fp32 model) and runs in the engine."""
from __future__ import annotations

import copy

import pytest
import torch

import mini_engine as me
from mini_engine import quant
from mini_engine.backends.cpu.autotune import Autotuner, Choice
from mini_engine.sampling import SamplingParams

from test_quant import (AMX, C_INT4, check_quality, needs_int4_kernel, pack_halves, pin_forms,  # noqa: F401
                        quality_prompts, reference)

pytestmark = pytest.mark.usefixtures("one_thread")


def random_compact(n: int, k: int, seed: int):
    """Random codes [n, k] and compact scales, and the weight they stand for (fp32 [n, k])."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = quant.compact_scales(torch.rand(n, k // 32, generator=gen) * 0.02,
                                  -torch.rand(n, k // 32, generator=gen) * 0.15)
    weight = quant.dequantize_state(quant.pack_int4(q), scales, quant.QuantMeta("int4", n, k, 32, None, compact=True))
    return q, scales, weight


def test_compact_scales_round_trip_within_half_a_code():
    gen = torch.Generator().manual_seed(0)
    d = torch.rand(40, 6, generator=gen) * 0.03
    m = torch.randn(40, 6, generator=gen) * 0.1
    scales = quant.compact_scales(d, m)
    assert scales.dtype == torch.int16 and scales.shape == (6 * 40 + 4 * 40,)  # 16 bits a group, 2 fp32 a row
    d2, m2 = quant.expand_compact_scales(scales, 40, 6)
    fd, fm = d.amax(dim=1, keepdim=True) / 255, m.abs().amax(dim=1, keepdim=True) / 127
    assert ((d2 - d).abs() <= fd / 2 * (1 + 1e-5)).all(), "d's code must be the nearest of 256 steps of max(d)/255"
    assert ((m2 - m).abs() <= fm / 2 * (1 + 1e-5)).all(), "m's code must be the nearest of 255 steps of max|m|/127"
    ids = torch.tensor([3, 0, 39])
    d3, m3 = quant.expand_compact_scales(scales, 40, 6, ids=ids)
    assert torch.equal(d3, d2[ids]) and torch.equal(m3, m2[ids])
    with pytest.raises(ValueError, match="d must be >= 0"):
        quant.compact_scales(-d, m)


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
    got = quant.cpu_kernels.int4_gemm(x, pack_halves(q, block_n), scales, n, 32, block_n, amx=amx)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"block_n {block_n}, {rows} rows, amx={amx}: {m}")
    with pytest.raises(ValueError, match="compact int16"):
        quant.cpu_kernels.int4_gemm(x, pack_halves(q, block_n), scales[:-2], n, 32, block_n, amx=amx)


@pytest.mark.parametrize("rows", [1, 3, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_form_of_a_compact_layer_equals_its_dequantized_weight(rows, dtype):
    """Every form the tuner may pick for a compact layer (never torch's int4pack: it takes bf16 scales only)."""
    gen = torch.Generator().manual_seed(rows)
    layer = quant.Int4Linear.from_float(torch.randn(48, 64, generator=gen) * 0.1, 32, compact=True)
    assert layer.compact and "8-bit d and m" in repr(layer)
    assert layer.nbytes == 48 * 64 // 2 + 48 * 2 * 2 + 48 * 8  # codes, 2 bytes a group, 8 bytes a row
    forms = quant.candidate_forms(layer.meta, dtype)
    assert "int4pack" not in forms and "dequant" in forms
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    expected = x.double() @ layer.dequantize().double().t()
    for form in forms:
        got = quant.FORMS[form](x, layer.qweight, layer.scales, layer.meta)
        exact = dtype == torch.float32 and form in ("dequant", "c_int4")
        tol = 1e-5 if exact else 1.6e-2 * expected.abs().max().item()
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=tol, msg=lambda m: f"{form}: {m}")
    # quantized at load: the codes are the nearest for the stored (8-bit) d and m
    w = torch.randn(16, 64, generator=gen)
    q, scales = quant.quantize_int4_compact(w)
    d, m = quant.expand_compact_scales(scales, 16, 2)
    err = (quant.dequantize_state(quant.pack_int4(q), scales, quant.QuantMeta("int4", 16, 64, 32, None, True)) - w)
    assert (err.abs().view(16, 2, 32) <= d[..., None] / 2 + 1e-6).all()


def test_split_head_products_and_rows():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(96, 64, generator=gen) * 0.1
    head = quant.SplitHead(w, quant.split_rows(96))
    assert head.split == 96 - 64 and isinstance(head.frequent, quant.Int8Linear) and head.rare.compact
    weight = head.dequantize()
    assert weight.shape == (96, 64)
    torch.testing.assert_close(weight[:32], head.frequent.dequantize())
    x = torch.randn(5, 64, generator=gen)
    torch.testing.assert_close(head(x).double(), x.double() @ weight.double().t(), rtol=0, atol=2e-2)
    ids = torch.tensor([95, 0, 31, 32, 7, 64])
    torch.testing.assert_close(head.dequantize_rows(ids, torch.float32), weight[ids])
    assert quant.split_rows(49152) == quant.SPLIT_HEAD_ROWS == 12288
    with pytest.raises(ValueError, match="too small to split"):
        quant.split_rows(10)
    with pytest.raises(ValueError, match="split must be"):
        quant.SplitHead(w, 40)  # 56 int4 rows: not a multiple of 16


# ---------------------------------------------------------------- the whole model


def exact_forms() -> Autotuner:
    """fp32 products whatever the row count, so that two runs of other row counts give the same logits: the C
    kernels where they build, else dequantize-then-multiply. (Pinned, too, so that the tests do not spend half a
    minute tuning the split head's forms; the AMX test below runs the other kernels.)"""
    exact = (quant.cpu_kernels.int4_gemm_supported(64, 64, 32, 32, True)
             and quant.cpu_kernels.int8_gemm_supported(64, 64))
    return Autotuner(forced={"int4_product": "c_int4", "int8_product": "c_int8"} if exact else
                     {"int4_product": "dequant", "int8_product": "dequant"})


@pytest.fixture(scope="module")
def compact(real):
    model, _ = me.load_model("smollm2-135m", quantization="int4_compact")
    return pin_forms(model, exact_forms())


def test_compact_model_keeps_the_gguf_codes_and_fits_in_30_percent_of_bf16(compact, real):
    """The codes are the checkpoint's own; d and m are within half an 8-bit step of the GGUF's fp16 ones; the
    weights take at most 30% of the bf16 model's bytes."""
    needs_int4_kernel()
    int4, _ = me.load_model("smollm2-135m", quantization="int4")
    for i in (0, 29):
        ours, exact = compact.layers[i].mlp.gate_up_proj, int4.layers[i].mlp.gate_up_proj
        assert torch.equal(ours.codes(), exact.codes())
        d, m = ours.d_and_m()
        d_ref, m_ref = exact.d_and_m()
        step = d_ref.amax(dim=1, keepdim=True) / 255 + d_ref.amax() * 2**-8  # an 8-bit step, plus bf16's rounding
        assert ((d - d_ref).abs() <= step).all()
    assert isinstance(compact.lm_head, quant.SplitHead) and compact.embed_tokens.table is compact.lm_head
    bf16_bytes = quant.weight_bytes(real[0]) // 2
    ratio = quant.weight_bytes(compact) / bf16_bytes
    print(f"\nint4_compact: {quant.weight_bytes(compact) / 1e6:.1f} MB = {100 * ratio:.2f}% of bf16's "
          f"{bf16_bytes / 1e6:.1f} MB")
    assert ratio <= 0.30


def test_compact_model_quality(compact, real, quality_prompts, reference):
    needs_int4_kernel()
    check_quality(compact, real, real[1], quality_prompts, reference,
                  "int4_compact (8-bit scales, split head; C kernels, fp32)")


@AMX
def test_compact_model_quality_with_the_amx_kernels(compact, real, quality_prompts, reference):
    needs_int4_kernel()
    amx = Autotuner(forced={"int4_product": "amx_int4", "int8_product": "amx_int8"})
    model = pin_forms(copy.deepcopy(compact), amx)
    check_quality(model, real, real[1], quality_prompts, reference, "int4_compact through the AMX kernels")


def test_compact_model_in_the_engine_equals_generate_cached(compact, real, chat_prompts, assert_greedy_match):
    """Paging, prefix caching and n-gram speculation on the compact model give generate_cached's tokens."""
    needs_int4_kernel()
    model = compact
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [me.generate_cached(model, p, 12, params) for p in chat_prompts]
    llm = me.LLM.from_model(model, real[1], kv_cache="paged", enable_prefix_caching=True, block_size=4,
                            speculative={"method": "ngram", "k": 3}, max_model_len=128)
    assert llm.config.quantization == "int4_compact"
    for _ in range(2):
        for prompt, out, ref in zip(chat_prompts, llm.generate(chat_prompts, params, use_tqdm=False), expected):
            assert_greedy_match(model, prompt, out.token_ids, ref, tol=1e-3)


def test_a_compact_layer_is_tuned_apart_from_a_bf16_scaled_one_of_its_shape():
    """The tuner's choice for a layer with bf16 scales (torch's int4pack among its candidates) is not reused for
    a compact layer of the same shape, whose scales int4pack cannot read."""
    needs_int4_kernel()
    tuner = Autotuner()
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(5)) * 0.1
    plain = quant.Int4Linear.from_float(w, 32, tuner)
    small = quant.Int4Linear.from_float(w, 32, tuner, compact=True)
    # as if int4pack had won the timing for the bf16-scaled layer's shape
    tuner.choices[("int4_product", 64, 96, 32, 1, str(torch.bfloat16), "cpu")] = Choice("int4pack", {})
    x = torch.randn(1, 96).bfloat16()
    assert quant.choose_form(plain, 1, torch.bfloat16) == "int4pack"
    assert quant.choose_form(small, 1, torch.bfloat16) in quant.candidate_forms(small.meta, torch.bfloat16)
    torch.testing.assert_close(small(x).float(), (x.double() @ small.dequantize().double().t()).float(),
                               rtol=0, atol=2e-2)
