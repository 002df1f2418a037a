"""Weight-only quantization (quant/): the pieces against their rules, the GGUF's Q4_1 blocks repacked exactly, the
int4 and int8 models' quality against the fp32 model, and the engine (paging, prefix caching, n-gram speculation,
the compiled step) running a quantized model. The CPU backend's forms of the products, each against its
dequantized reference, are tested in test_cpu_quant_forms.py.

The quality figures are printed (`pytest -s`): greedy agreement is teacher-forced (quality.py): the fp32
model decodes each prompt greedily, the quantized model reads the same tokens, and we count the positions
where its argmax is the fp32 model's token."""
from __future__ import annotations

import copy
import subprocess
import sys

import numpy as np
import pytest
import torch

import mini_engine as me
from mini_engine.course import quality
from mini_engine import quant
from mini_engine.backends.cpu import quant_forms as qf
from mini_engine.backends.cpu.autotune import Autotuner
from mini_engine.loading.loader import embedded_gguf_path
from mini_engine.sampling import SamplingParams

from test_cpu_quant_forms import AMX, C_INT4, needs_int4_kernel  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

# The forms a CPU decode takes (tests that compare two runs token for token pin them, so that a row count
# met by one run and not the other cannot switch a layer to a form that rounds differently).
KERNEL_FORMS = Autotuner(forced={"int4_product": "int4pack", "int8_product": "int8pack_bf16"})


def pin_forms(model, tuner=KERNEL_FORMS):
    """The model's quantized layers adopted by the CPU backend (one quantized after it loaded is not yet) and
    pinned to `tuner`'s forms."""
    for m in list(model.modules()):
        if isinstance(m, quant.QuantLinear):
            qf.adopt(m, tuner)
            m._forms.clear()
    return model


# ---------------------------------------------------------------- the pieces


@pytest.mark.parametrize("shape, group_size", [((48, 64), 32), ((16, 96), 32), ((32, 256), 128)])
def test_int4_quantize_pack_unpack_dequantize(shape, group_size):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    q, s, z = quant.quantize_int4(w, group_size)
    assert q.dtype == torch.uint8 and q.max() <= 15 and s.shape == (shape[0], shape[1] // group_size)
    packed = quant.pack_int4(q)
    assert packed.shape == (shape[0], shape[1] // 2) and packed.dtype == torch.uint8
    assert torch.equal(quant.unpack_int4(packed), q)
    err = (quant.dequantize_int4(q, s, z, group_size) - w).abs().view(shape[0], -1, group_size)
    # Round to nearest: half a step, plus the bf16 rounding of the group's zero (and of the scale, times 8).
    bound = s.float()[..., None] * (0.5 + 8 * 2**-8) + z.float().abs()[..., None] * 2**-8
    assert (err <= bound).all()


def test_int8_quantize_per_channel():
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    q, scale = quant.quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (40,)
    assert torch.equal(quant.unpack_int8(quant.pack_int8(q)), q)
    err = (quant.dequantize_int8(q, scale) - w).abs()
    assert (err <= scale.float()[:, None] * 0.5 + w.abs().amax(1, keepdim=True) * 2**-8).all()


@pytest.mark.parametrize("in_features, out_features, group_size, message", [
    (48, 32, 32, r"in_features \(48\) must be a multiple of group_size \(32\)"),
    (64, 40, 32, r"out_features \(40\) must be a multiple of 16"),
    (64, 32, 16, r"group_size must be one of \(32, 64, 128, 256\)"),
    (64, 32, 7, "group_size must be an even int"),
])
def test_unsupported_shapes_are_rejected_naming_the_argument(in_features, out_features, group_size, message):
    with pytest.raises(ValueError, match=message):
        quant.Int4Linear(in_features, out_features, group_size)
    if "in_features" in message:
        with pytest.raises(ValueError, match=message):
            quant.quantize_int4(torch.randn(out_features, in_features), group_size)


def test_a_plain_layer_computes_its_dequantized_weight_in_the_portable_layout():
    """Not adopted by the CPU backend, a quantized layer keeps `pack_int4`'s layout and computes F.linear on its
    dequantized weight, exactly, in any dtype and shape of x."""
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(2)) * 0.1
    for layer in (quant.Int4Linear.from_float(w, 32), quant.Int4Linear.from_float(w, 32, compact=True),
                  quant.Int8Linear.from_float(w)):
        assert type(layer) in (quant.Int4Linear, quant.Int8Linear) and getattr(layer, "layout", None) is None
        x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(3))
        for dtype in (torch.float32, torch.bfloat16):
            expected = torch.nn.functional.linear(x.to(dtype), layer.dequantize(dtype))
            assert torch.equal(layer(x.to(dtype)), expected)
        moved = copy.deepcopy(layer).to(torch.bfloat16)
        assert torch.equal(moved.dequantize(), layer.dequantize())


def test_importing_quant_imports_no_backend_and_registers_no_operator():
    code = ("import sys, torch, mini_engine.quant as q; "
            "assert not any(m.startswith('mini_engine.backends') for m in sys.modules), sorted(sys.modules); "
            "assert not hasattr(torch.ops.mini_engine, 'int4_gemm'); "
            "q.quantize_model; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---------------------------------------------------------------- the GGUF's Q4_1 blocks


@pytest.fixture(scope="module")
def gguf_reader():
    gguf = pytest.importorskip("gguf")
    return gguf, gguf.GGUFReader(embedded_gguf_path())


def test_gguf_tensor_types(gguf_reader):
    """What the embedded file really holds: every linear layer Q4_1, the tied embedding Q8_0, norms F32."""
    gguf, reader = gguf_reader
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert {v for k, v in types.items() if k.startswith("blk.") and "norm" not in k} == {"Q4_1"}
    assert types["token_embd.weight"] == "Q8_0" and "output.weight" not in types
    assert {v for k, v in types.items() if "norm" in k} == {"F32"}


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.7.ffn_down.weight", "blk.29.ffn_up.weight"])
def test_q4_1_repacking_is_exact(gguf_reader, name):
    """Dequantizing the repacked blocks gives the gguf package's dequantization: bit for bit with fp32 scales
    and zeros; with the bf16 ones the kernels take, within the rounding of the scale and the zero."""
    gguf, reader = gguf_reader
    t = next(t for t in reader.tensors if t.name == name)
    shape = tuple(int(s) for s in reversed(t.shape))
    expected = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
    expected = expected.reshape(shape)
    codes, s, z = quant.repack_q4_1(np.array(t.data), shape, scale_dtype=torch.float32)
    assert torch.equal(quant.dequantize_int4(codes, s, z, 32), expected)
    codes, s16, z16 = quant.repack_q4_1(np.array(t.data), shape)  # bf16 scales and zeros
    got = quant.dequantize_int4(codes, s16, z16, 32)
    bound = ((codes.view(shape[0], -1, 32).float() - 8).abs() * (s - s16.float()).abs()[..., None]
             + (z - z16.float()).abs()[..., None]).view(shape)
    assert ((got - expected).abs() <= bound * (1 + 1e-6) + 1e-12).all()
    step = s.abs().mean().item()
    print(f"\n{name}: bf16 scales move a weight by at most {(got - expected).abs().max():.2e} "
          f"({(got - expected).abs().max() / step:.3f} of a mean quantization step)")


# ---------------------------------------------------------------- whole models


@pytest.fixture(scope="module")
def int4(real):
    model, _ = me.load_model("smollm2-135m", quantization="int4")
    return pin_forms(model)


QUALITY_TOKENS = 16


@pytest.fixture(scope="module")
def quality_prompts(real):
    """The chapters' questions (quality.QUALITY_PROMPTS) as chat prompts."""
    return quality.chat_prompt_ids(real[1])


@pytest.fixture(scope="module")
def reference(real, quality_prompts):
    """The fp32 model's greedy continuations of the quality prompts, computed once."""
    return quality.reference_greedy(real[0], quality_prompts, QUALITY_TOKENS)


def test_loaded_int4_layers_are_the_gguf_blocks(real, int4):
    """The loaded int4 qkv (q and k rows un-permuted for RoPE, then q, k, v stacked) dequantizes to the fp32
    model's weights (the gguf package's dequantization) within the bf16 rounding of the scales and zeros."""
    model, _ = real
    for i in (0, 29):
        ours = int4.layers[i].self_attn.qkv_proj
        theirs = model.layers[i].self_attn.qkv_proj.weight
        s, _ = quant.from_scales_and_zeros(ours.scales)
        err = (ours.dequantize() - theirs).abs().view(theirs.shape[0], -1, 32)
        assert (err <= 8 * s.float().abs()[..., None] * 2**-8 + theirs.abs().amax() * 2**-8).all()
        assert isinstance(int4.layers[i].mlp.down_proj, quant.Int4Linear)
    assert isinstance(int4.lm_head, quant.Int8Linear) and int4.embed_tokens.table is int4.lm_head


def check_quality(model, real, tok, prompts, reference, name):
    fp32, _ = real
    agreement = quality.greedy_agreement(model, fp32, prompts, QUALITY_TOKENS, reference_tokens=reference)
    ppl, ppl_ref = quality.perplexity(model, tok), quality.perplexity(fp32, tok)
    print(f"\n{name}: {agreement}; perplexity {ppl:.3f} vs fp32 {ppl_ref:.3f} ({100 * (ppl / ppl_ref - 1):+.2f}%)")
    assert agreement.rate >= 0.90, f"{name}: {agreement}"
    assert abs(ppl / ppl_ref - 1) <= 0.02, f"{name}: perplexity {ppl:.3f} vs {ppl_ref:.3f}"


def test_int4_model_quality(int4, real, quality_prompts, reference):
    needs_int4_kernel()
    check_quality(int4, real, real[1], quality_prompts, reference, "int4 (Q4_1 repacked, int8 head)")


@C_INT4
def test_int4_model_quality_with_the_c_kernel(int4, real, quality_prompts, reference):
    """The same model with its int4 products in the C kernel (fp32 activations, where torch's take bf16)."""
    needs_int4_kernel()
    model = pin_forms(copy.deepcopy(int4), Autotuner(forced={"int4_product": "c_int4", "int8_product": "int8pack_bf16"}))
    check_quality(model, real, real[1], quality_prompts, reference, "int4 through the C kernel (int8 head)")



@AMX
def test_int4_model_quality_with_the_amx_kernels(int4, real, quality_prompts, reference):
    """The same model with every int4 product and the int8 head on the AMX kernels (bf16 activations, as torch's
    packed kernels take them)."""
    needs_int4_kernel()
    model = pin_forms(copy.deepcopy(int4), Autotuner(forced={"int4_product": "amx_int4", "int8_product": "amx_int8"}))
    check_quality(model, real, real[1], quality_prompts, reference, "int4 through the AMX kernels (int8 head)")


def test_int8_model_quality(real, quality_prompts, reference):
    model = pin_forms(quant.quantize_model(copy.deepcopy(real[0]), "int8"))
    check_quality(model, real, real[1], quality_prompts, reference, "int8 (per channel, int8 head)")


def test_weight_memory(real, int4):
    """Q4_1 at group 32 costs 5 bits a weight (4-bit codes, a 16-bit scale and zero per 32): the decoder's
    products take 5/16 of their bf16 bytes; the int8 head adds a byte a weight for a fifth of the model."""
    fp32 = real[0]
    bf16_bytes = quant.weight_bytes(fp32) // 2
    layers = [m for m in int4.modules() if isinstance(m, quant.Int4Linear)]
    bits = 8 * sum(m.nbytes for m in layers) / sum(m.in_features * m.out_features for m in layers)
    ratio = quant.weight_bytes(int4) / bf16_bytes
    print(f"\nint4 model: {quant.weight_bytes(int4) / 1e6:.1f} MB of weights = {100 * ratio:.1f}% of bf16's "
          f"{bf16_bytes / 1e6:.1f} MB; its int4 layers {bits:.2f} bits per weight")
    assert bits == 5.0
    assert ratio < 0.36


def test_engine_with_paging_prefix_caching_and_ngram_equals_generate_cached(int4, real, chat_prompts,
                                                                           assert_greedy_match):
    needs_int4_kernel()
    tok = real[1]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = [me.generate_cached(int4, p, 16, params) for p in chat_prompts]
    llm = me.LLM.from_model(int4, tok, kv_cache="paged", enable_prefix_caching=True, block_size=4,
                            speculative={"method": "ngram", "k": 3}, max_model_len=128)
    assert llm.config.quantization == "int4" and "int4 weights" in repr(llm)
    for _ in range(2):  # the second round hits the prefix cache
        outs = llm.generate(chat_prompts, params, use_tqdm=False)
        for prompt, out, ref in zip(chat_prompts, outs, expected):
            # bf16 logits (the int8 head's): a divergence is allowed only where the top two are within a step
            assert_greedy_match(int4, prompt, out.token_ids, ref, tol=0.26)
    assert outs[0].num_cached_tokens > 0
    assert llm.engine.num_free_blocks == llm.engine.num_kv_blocks


def test_engine_refuses_a_model_of_other_weights(real):
    with pytest.raises(ValueError, match="quantization='int4' but the model's weights are float"):
        me.LLM.from_model(real[0], real[1], quantization="int4")
    with pytest.raises(ValueError, match="quantization must be one of"):
        me.load_model("smollm2-135m", quantization="int3")


def test_tiny_model_quantized_at_load_runs_cached_compiled_and_in_the_engine(tiny_model, assert_greedy_match):
    """Round to nearest from float weights (an HF checkpoint's path), on a random tiny Llama: the cached loop,
    the compiled decode step and the engine agree."""
    model = quant.quantize_model(copy.deepcopy(tiny_model(0)), "int4", head="int8")
    pin_forms(model)
    assert model.quantization == "int4" and isinstance(model.embed_tokens, quant.QuantEmbedding)
    prompt = [3, 17, 5, 99, 42]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    eager = me.generate_cached(model, prompt, 12, params)
    compiled = me.generate_cached(model, prompt, 12, params, compile=True)
    assert_greedy_match(model, prompt, compiled, eager, tol=0.26)
    out = me.LLM.from_model(model, None, max_model_len=64).generate([prompt], params, use_tqdm=False)[0]
    assert_greedy_match(model, prompt, out.token_ids, eager, tol=0.26)


def test_bf16_activations(tiny_model):
    """load_model(dtype="bfloat16", quantization="int4"): the activations (and the KV cache) in bf16, the same
    quantized weights; the logits stay close to the fp32-activation model's."""
    model = quant.quantize_model(copy.deepcopy(tiny_model(1)), "int4", head="int8")
    ids = torch.tensor([[3, 17, 5, 99, 42, 7]])
    fp32_logits = model(ids)
    scales = model.lm_head.scales.clone()
    model.to(torch.bfloat16)
    assert model.dtype == torch.bfloat16 and torch.equal(model.lm_head.scales, scales), "scales are not re-rounded"
    logits = model(ids)
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), fp32_logits, rtol=0, atol=0.05 * fp32_logits.abs().max().item())
    out = me.generate_cached(model, [3, 17, 5], 6, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert len(out) == 6


@pytest.mark.parametrize("tied", [True, False])
def test_hf_folder_is_quantized_at_load(tmp_path, tied):
    """An HF checkpoint (no Q4_1 blocks) is quantized when it loads, round to nearest; the quantized model then
    computes exactly the float model whose weights are its dequantized ones (embedding included, tied or not)."""
    pytest.importorskip("transformers")
    from test_hf_equivalence import write_tiny_checkpoint  # tests/engine is on sys.path
    write_tiny_checkpoint(tmp_path, 4, 2, tied, 10000.0, False)
    qmodel, _ = me.load_model(str(tmp_path), quantization="int4")
    model, _ = me.load_model(str(tmp_path))
    pin_forms(qmodel, Autotuner(forced={"int4_product": "dequant", "int8_product": "dequant"}))
    with torch.no_grad():
        for name, module in qmodel.named_modules():
            if isinstance(module, quant.QuantLinear) and name != "embed_tokens.table":
                model.get_submodule(name).weight.copy_(module.dequantize())
        if not tied:
            model.embed_tokens.weight.copy_(qmodel.embed_tokens.table.dequantize())
    assert isinstance(qmodel.layers[1].mlp.down_proj, quant.Int4Linear) and qmodel.embed_tokens.tied == tied
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(qmodel(ids), model(ids), rtol=1e-5, atol=1e-5)


def test_compile_mode_is_checked(tiny_model):
    with pytest.raises(ValueError, match=r"compile must be False or one of \(True, 'cpp'"):
        me.generate_cached(tiny_model(0), [1, 2], 2, compile="fast")


@pytest.mark.slow
def test_compiled_with_the_cpp_wrapper_per_model(tiny_model, assert_greedy_match):
    """compile="cpp" (C++ wrapper, no guards on the model's modules): each model gets a graph of its own, so two
    models with the same shapes, one quantized, never share one. The first C++-wrapper compile on a machine
    builds Inductor's headers: a minute or two."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [3, 17, 5, 99]
    plain = tiny_model(0)
    quantized = pin_forms(quant.quantize_model(copy.deepcopy(plain), "int4", head="int8"))
    for model in (plain, quantized, plain):
        eager = me.generate_cached(model, prompt, 8, params)
        assert_greedy_match(model, prompt, me.generate_cached(model, prompt, 8, params, compile="cpp"), eager, tol=0.26)


def test_a_quantized_draft_is_named_in_the_speculative_config():
    from mini_engine.engine_config import SpeculativeConfig
    spec = SpeculativeConfig.parse({"method": "draft", "model": "smollm2-135m", "quantization": "int4", "k": 3})
    assert spec.quantization == "int4" and spec.as_dict()["quantization"] == "int4"
    with pytest.raises(ValueError, match=r"speculative\['quantization'\] must be one of"):
        SpeculativeConfig.parse({"method": "draft", "model": "smollm2-135m", "quantization": "int2"})
    with pytest.raises(ValueError, match="applies when speculative\\['model'\\] is a name or path"):
        SpeculativeConfig.parse({"method": "draft", "model": object(), "quantization": "int4"})

