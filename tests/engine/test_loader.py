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
