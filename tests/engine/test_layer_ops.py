"""The fused C operators for a layer's small operations (csrc/layer_ops.c via torch_ops.cpp, `layer_ops`) against
PyTorch's own ops: RMSNorm, the rotary embedding and silu(gate) * up, on the shapes the model gives them (views
into a fused product's output included), at the row counts that take one thread and several; the real model's
logits and greedy tokens with them against without them; their refusals of bad input."""
import pytest
import torch
import torch.nn.functional as F

from mini_engine.backends.cpu import cpu_kernels

from mini_engine.backends.cpu import layer_ops
from mini_engine.generate import generate_cached
from mini_engine.model import apply_rope

pytestmark = pytest.mark.skipif(not cpu_kernels.load_torch_ops(),
                                reason="the fused operators need C and C++ compilers and an x86 CPU with AVX2")
ops = torch.ops.mini_engine_cpp
ROWS = [1, 5, 32, 64, 200]  # 64 and up: rows shared among threads (silu_mul: from 16,384 values, so 32 too)


@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_equals_pytorchs(rows):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 576, generator=g) * 3, torch.randn(576, generator=g)
    expected = w * F.rms_norm(x, (576,), eps=1e-5)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), expected, rtol=1e-5, atol=1e-5)
    wide = torch.randn(rows, 700, generator=g)  # rows further apart than their width: a view
    torch.testing.assert_close(ops.rms_norm(wide[:, :576], w, 1e-5), w * F.rms_norm(wide[:, :576], (576,), eps=1e-5),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", ROWS)
def test_rope_equals_apply_rope_on_the_qkv_products_view(rows):
    """q and k are the first 12 heads of the fused qkv output [T, 960]: the operator reads them in place."""
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, 960, generator=g)
    angles = torch.rand(rows, 1, 32, generator=g) * 6.3
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([-angles.sin(), angles.sin()], -1)
    qk = qkv[:, :768]
    got = ops.rope(qk, cos, sin, 12)
    assert got.shape == (rows, 12, 64) and got.is_contiguous()
    torch.testing.assert_close(got, apply_rope(qk.reshape(rows, 12, 64), cos, sin), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_equals_pytorchs(rows):
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 3072, generator=g) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_the_model_gives_the_same_logits_and_tokens_with_and_without_them(real, chat_prompts, monkeypatch):
    model, _ = real
    ids = torch.tensor([chat_prompts[0]])
    assert layer_ops.fused(torch.empty(1)), "an fp32 CPU tensor in an eager step takes the fused operators"
    fused_logits = model(ids)
    fused_tokens = generate_cached(model, chat_prompts[1], max_new_tokens=12)
    monkeypatch.setattr(layer_ops, "fused", lambda x: False)
    torch.testing.assert_close(fused_logits, model(ids), rtol=1e-4, atol=1e-3)  # logits of about 20: rounding
    assert fused_tokens == generate_cached(model, chat_prompts[1], max_new_tokens=12)


def test_only_eager_fp32_cpu_steps_take_them():
    assert not layer_ops.fused(torch.empty(1, dtype=torch.bfloat16)), "bf16 keeps PyTorch's ops (fp32 statistic)"
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(layer_ops.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-5),
                               F.rms_norm(x.float(), (8,), eps=1e-5).bfloat16())
    traced = torch.compile(lambda t: layer_ops.fused(t), fullgraph=True)
    assert not traced(torch.empty(2)), "a compiled graph keeps PyTorch's ops, for Inductor to fuse"


def test_bad_inputs_are_refused_by_name():
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="rms_norm: weight"):
        ops.rms_norm(x, torch.ones(32), 1e-5)
    with pytest.raises(RuntimeError, match="rms_norm needs fp32"):
        ops.rms_norm(x.double(), torch.ones(64), 1e-5)
    with pytest.raises(RuntimeError, match="rms_norm needs fp32"):
        ops.rms_norm(x.t(), torch.ones(4), 1e-5)  # columns, not rows
    with pytest.raises(RuntimeError, match="silu_mul: gate_up"):
        ops.silu_mul(torch.randn(4, 63))
    with pytest.raises(RuntimeError, match="rope: cos and sin"):
        ops.rope(x, torch.randn(4, 1, 16), torch.randn(4, 1, 16), 2)
    with pytest.raises(RuntimeError, match="rope: the rows' width"):
        ops.rope(x, torch.randn(4, 1, 32), torch.randn(4, 1, 32), 3)


def test_store_rows_equals_the_indexed_store_and_refuses_rows_outside_the_cache():
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(7, 12, 64, generator=g)
    k, v = qkv[:, 6:9], qkv[:, 9:12]  # views, as the model's k and v are
    k_rows, v_rows = torch.zeros(40, 3, 64), torch.zeros(40, 3, 64)
    rows = torch.tensor([3, 17, 18, 0, 39, 5, 6], dtype=torch.int32)
    ops.store_rows(k, v, k_rows, v_rows, rows)
    expected_k, expected_v = torch.zeros(40, 3, 64), torch.zeros(40, 3, 64)
    expected_k[rows], expected_v[rows] = k, v
    assert torch.equal(k_rows, expected_k) and torch.equal(v_rows, expected_v)
    before = k_rows.clone()
    with pytest.raises(RuntimeError, match=r"rows must lie in \[0, 40\), got 40"):
        ops.store_rows(k, v, k_rows, v_rows, torch.tensor([1, 2, 3, 4, 5, 6, 40], dtype=torch.int32))
    assert torch.equal(k_rows, before), "a bad row is found before anything is written"
    with pytest.raises(RuntimeError, match="store_rows: rows must be int32"):
        ops.store_rows(k, v, k_rows, v_rows, rows.long())


def test_the_engines_paged_cache_write_takes_the_fused_store(real, chat_prompts, monkeypatch):
    """The engine's slot_mapping (int32) must be what the fused store takes: a type mismatch would quietly send
    every write back to PyTorch's two indexed stores a layer (it once did)."""
    from mini_engine.engine import LLM
    from mini_engine.sampling import SamplingParams

    model, tok = real
    taken = []
    store_fused = layer_ops.store_fused
    monkeypatch.setattr(layer_ops, "store_fused", lambda *a: taken.append(store_fused(*a)) or taken[-1])
    out = LLM.from_model(model, tok, kv_cache="paged").generate(
        chat_prompts[:2], SamplingParams(max_tokens=3), use_tqdm=False)
    assert all(len(o.token_ids) == 3 for o in out)
    assert taken and all(taken), f"{taken.count(False)} of {len(taken)} cache writes fell back to PyTorch's store"
