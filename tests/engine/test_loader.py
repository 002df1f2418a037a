import pytest

import mini_engine as me


def test_unknown_name_says_what_is_known():
    with pytest.raises(FileNotFoundError, match="smollm2-135m"):
        me.load_model("no-such-model")


def test_folder_without_checkpoint_says_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        me.load_model(str(tmp_path))


def test_bad_dtype_is_named():
    with pytest.raises((ValueError, AttributeError), match="dtype|float"):
        me.load_model("smollm2-135m", dtype="float7")


def test_real_model_shape(real):
    model, tok = real
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (30, 576, 9, 3, 64, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0
    assert sum(p.numel() for p in model.parameters()) == c.num_params == 134_515_008
    assert tok.eos_token_id == 2 and tok.decode([tok.eos_token_id], skip_special_tokens=False) == "<|im_end|>"


def test_attention_backend_auto_and_bad_name(real):
    model, _ = real
    assert model.attention_backend == "torch"  # "auto" on a CPU
    with pytest.raises(ValueError, match="attention_backend"):
        me.load_model("smollm2-135m", attention_backend="flash9")


def test_our_gguf_reader_reads_what_the_gguf_package_reads():
    """mini_engine.loading.gguf_file against gguf.GGUFReader on the embedded file: every metadata field (value and type),
    every tensor's name, shape, type and bytes; and the loader's torch dequantization gives gguf's floats."""
    import numpy as np
    import torch

    gguf = pytest.importorskip("gguf")
    from mini_engine.loading.gguf_file import read_gguf
    from mini_engine.loading.loader import _dequantize, embedded_gguf_path

    path = embedded_gguf_path()
    ours, ref = read_gguf(path), gguf.GGUFReader(path)
    fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}  # the header, as pseudo-fields
    assert list(ours.metadata) == list(fields), "metadata keys differ (or their order)"
    for key, field in fields.items():
        expected = field.contents()
        assert ours.metadata[key] == expected and type(ours.metadata[key]) is type(expected), f"field {key}"
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    kinds = set()
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.shape == tuple(int(s) for s in b.shape) and a.tensor_type == int(b.tensor_type), a.name
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), f"{a.name}: bytes differ"
        if a.tensor_type not in kinds:  # one tensor of each type (F32, Q4_1, Q8_0): the floats gguf gives
            kinds.add(a.tensor_type)
            expected = torch.from_numpy(np.array(gguf.quants.dequantize(b.data, b.tensor_type), dtype=np.float32))
            assert torch.equal(_dequantize(a), expected.reshape(-1, a.shape[0])), f"{a.name}: dequantized floats"
    assert kinds == {0, 3, 8}, f"the embedded file holds F32, Q4_1 and Q8_0 tensors, got types {kinds}"


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    from mini_engine.loading.gguf_file import read_gguf
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(bad)
