"""The "int4_compact" quantization (quant.py): the GGUF's own Q4_1 codes with their scale d and minimum m stored
in 8 bits each (`compact_scales`), and an LM head split by token id (`SplitHead`: frequent tokens int8, the rest
int4). It exists for chapter 10's memory target: the model's weights at 30% of bf16's or less. The scales round
trip, the split head computes its rows (the CPU kernels on compact scales: test_cpu_quant_forms.py); the whole model keeps the quality bar of issue 15 (greedy
agreement >= 90%, perplexity within 2% of the fp32 model) and runs in the engine."""
from __future__ import annotations

import copy

import pytest
import torch

import mini_engine as me
from mini_engine import quant
from mini_engine.backends.cpu import cpu_kernels
from mini_engine.backends.cpu.autotune import Autotuner
from mini_engine.sampling import SamplingParams

from test_cpu_quant_forms import AMX, needs_int4_kernel
from test_quant import check_quality, pin_forms, quality_prompts, reference  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


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
    exact = (cpu_kernels.int4_gemm_supported(64, 64, 32, 32, True)
             and cpu_kernels.int8_gemm_supported(64, 64))
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
