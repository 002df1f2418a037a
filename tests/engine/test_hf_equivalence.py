"""mini_engine's forward pass against HF transformers on the same weights."""
import pytest
import torch

import mini_engine as me

transformers = pytest.importorskip("transformers")

TINY = [  # (num_heads, num_kv_heads, tie_word_embeddings, rope_theta)
    (4, 4, False, 10000.0),    # MHA, untied
    (4, 2, True, 10000.0),     # GQA, tied
    (6, 2, False, 500000.0),   # GQA, other theta
    (4, 1, True, 500000.0),    # MQA
]


def write_tiny_checkpoint(path, heads, kv_heads, tied, theta, legacy_rope_key):
    torch.manual_seed(heads * 100 + kv_heads)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=heads * 16, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=tied,
                                   rope_parameters={"rope_type": "default", "rope_theta": theta})
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    if legacy_rope_key:  # checkpoints written before transformers 5 carry a bare rope_theta
        import json
        cfg_path = path / "config.json"
        d = json.loads(cfg_path.read_text())
        d.pop("rope_parameters", None)
        d["rope_theta"] = theta
        cfg_path.write_text(json.dumps(d))
    _write_byte_tokenizer(path)
    return model


def _write_byte_tokenizer(path):
    """A tiny byte-level BPE with no merges, enough for an HF folder to be complete."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))


@pytest.mark.parametrize("heads,kv_heads,tied,theta", TINY)
@pytest.mark.parametrize("legacy_rope_key", [False, True])
def test_tiny_logits_match_hf(tmp_path, heads, kv_heads, tied, theta, legacy_rope_key):
    ref = write_tiny_checkpoint(tmp_path, heads, kv_heads, tied, theta, legacy_rope_key)
    model, tok = me.load_model(str(tmp_path))
    assert model.config.rope_theta == theta and model.config.tie_word_embeddings == tied
    ids = torch.randint(0, 300, (3, 37))
    with torch.no_grad():
        expected = ref(ids).logits
    for backend in ("torch", "naive"):
        got = model(ids, backend=backend)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0, msg=f"backend {backend}")
    assert tok.decode(tok.encode("hello, world")) == "hello, world"


def test_real_model_logits_match_hf_gguf(real, hf_real, chat_prompts):
    model, _ = real
    ref, _ = hf_real
    ids = torch.tensor([chat_prompts[0]])
    with torch.no_grad():
        expected = ref(ids).logits
    # The products' form is chosen per machine and per run (`products`): oneDNN's packed GEMM and the two-row
    # GEMM sum in other orders than HF's F.linear, and after 30 fp32 layers logits of size ~10 differed by up
    # to 1.2e-4 (measured on an AMD EPYC). 3e-4 is still far below any difference a wrong weight, RoPE or
    # mask makes (those move logits by 1e-1 or more); the greedy tests check the tokens themselves.
    torch.testing.assert_close(model(ids), expected, atol=3e-4, rtol=1e-5)


def test_naive_greedy_matches_hf_generate(real, hf_real, chat_prompts, assert_greedy_match):
    model, _ = real
    ref, _ = hf_real
    for prompt in chat_prompts:
        with torch.no_grad():
            hf_out = ref.generate(torch.tensor([prompt]), do_sample=False, use_cache=False, max_new_tokens=12,
                                  eos_token_id=model.config.eos_token_id, pad_token_id=model.config.eos_token_id)
        hf_tokens = hf_out[0, len(prompt):].tolist()
        ours = me.generate_naive(model, prompt, max_new_tokens=12)
        assert_greedy_match(model, prompt, ours, hf_tokens)


def test_tokenizer_and_chat_template_match_hf(real, hf_real):
    _, tok = real
    _, hf_tok = hf_real
    conversation = [{"role": "user", "content": "Hi there! 2+2=?"}]
    assert tok.apply_chat_template(conversation) == hf_tok.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True)
    texts = ["Hello world", "Numbers 1234567 and 3.14", "  spaces\n\ttabs, émoji 🚀 and code: def f(x): return x",
             tok.apply_chat_template(conversation)]
    for text in texts:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids)


def test_the_benches_hf_model_holds_the_weights_transformers_loads(real, hf_real, chat_prompts):
    """bench.load_hf(..., model) builds HF's model from ours instead of running transformers' GGUF loader (a
    second against 15-25 s): it must hold exactly the tensors that loader gives, and compute the same logits."""
    from mini_engine.bench.runs import load_hf
    model, _ = real
    ref, _ = hf_real
    built = load_hf("cpu", torch.float32, model)
    want, got = ref.state_dict(), built.state_dict()
    assert sorted(got) == sorted(want), "the built model's parameters are not named as transformers names them"
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), f"{name} differs from what transformers' GGUF loader gives"
    assert built.config.rope_parameters["rope_theta"] == ref.config.rope_parameters["rope_theta"]
    ids = torch.tensor([chat_prompts[0]])
    with torch.no_grad():
        assert torch.equal(built(ids).logits, ref(ids).logits)
