"""The optional CPU backend changes speed, never tokens: with it on (the default on a CPU) and off
(MINI_ENGINE_CPU_BACKEND=0, the core's plain PyTorch), the real model gives the same greedy tokens in fp32 on the
plain loop, the paged engine with prefix caching, n-gram speculation and int4 weights."""
import pytest
import torch

import mini_engine as me
from mini_engine.attention import TorchAttention
from mini_engine.backends.cpu.attention import CpuAttention
from mini_engine.backends.cpu.fresh_chunk import FreshChunkDecodeGraphs
from mini_engine.backends.cpu.layers import FusedMLP
from mini_engine.backends.cpu.products import Linear as TunedLinear


def load(monkeypatch, on: bool, **kwargs):
    monkeypatch.setenv("MINI_ENGINE_CPU_BACKEND", "1" if on else "0")
    return me.load_model("smollm2-135m", device="cpu", dtype="float32", **kwargs)


def test_the_backend_plugs_in_after_loading_and_stays_out_when_off(monkeypatch):
    on, _ = load(monkeypatch, True)
    off, _ = load(monkeypatch, False)
    assert isinstance(on.layers[0].mlp, FusedMLP) and isinstance(on.lm_head, TunedLinear)
    assert isinstance(on.attention_backends["torch"], CpuAttention)
    assert type(off.layers[0].mlp).__module__ == "mini_engine.model" and type(off.lm_head) is torch.nn.Linear
    assert type(off.attention_backends["torch"]) is TorchAttention
    assert isinstance(on.decode_graphs, FreshChunkDecodeGraphs) and "decode_graphs" not in vars(off)
    assert on.lm_head.weight is on.embed_tokens.weight, "the tied head still shares the embedding"


def test_quantized_layers_take_the_backends_forms_only_when_on(monkeypatch):
    """On, a quantized model's layers are adopted (`quant_forms`: torch's packed int4 layout where this torch
    writes one, tuned forms); off, they stay the plain layers of `mini_engine.quant`."""
    from mini_engine import quant
    from mini_engine.backends.cpu.quant_forms import CpuInt4Linear, CpuInt8Linear, cpu_int4_layout
    on, _ = load(monkeypatch, True, quantization="int4")
    off, _ = load(monkeypatch, False, quantization="int4")
    assert isinstance(on.layers[0].mlp.down_proj, CpuInt4Linear) and isinstance(on.lm_head, CpuInt8Linear)
    assert on.layers[0].mlp.down_proj.layout == cpu_int4_layout() and on.embed_tokens.table is on.lm_head
    assert type(off.layers[0].mlp.down_proj) is quant.Int4Linear and type(off.lm_head) is quant.Int8Linear
    assert off.layers[0].mlp.down_proj.layout is None


def test_a_copied_layer_is_numbered_anew_for_the_compiled_graphs_lookup(monkeypatch):
    """A compiled graph names a tuned layer by number (`autotune.number_layer`): torch 2.11's Dynamo takes
    no module where the graph asks for the layer's form. A deep copy gets a number of its own."""
    import copy

    from mini_engine.backends.cpu.autotune import numbered_layer
    for quantization in (None, "int4"):
        model, _ = load(monkeypatch, True, quantization=quantization)
        twin = copy.deepcopy(model)
        for layer, copied in ((model.lm_head, twin.lm_head), (model.layers[0].mlp.down_proj,
                                                               twin.layers[0].mlp.down_proj)):
            assert copied.number != layer.number
            assert numbered_layer(layer.number) is layer and numbered_layer(copied.number) is copied


@pytest.fixture(scope="module")
def prompts(real):
    _, tok = real
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    system = "You are a helpful assistant who answers in one short paragraph. "
    return [tok.encode(t) for t in texts] + [tok.encode(system + t) for t in texts]


def engine_tokens(model, tok, prompts, rounds: int = 1, **kwargs):
    """Greedy tokens of the prompts on the paged engine; a second round finds the first's blocks cached."""
    llm = me.LLM.from_model(model, tok, max_num_seqs=4, max_model_len=256, **kwargs)
    for _ in range(rounds):
        outs = llm.generate(prompts, me.SamplingParams(max_tokens=16), use_tqdm=False)
    long = [o for o, p in zip(outs, prompts) if len(p) > 16]  # a prompt with a full block to share
    assert rounds == 1 or (long and all(o.num_cached_tokens > 0 for o in long)), "round two should hit the cache"
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("path", ["plain loop", "paged engine, prefix caching", "n-gram speculation", "int4"])
def test_same_greedy_tokens_with_the_backend_on_and_off(monkeypatch, real, prompts, assert_greedy_match, path):
    quantization = "int4" if path == "int4" else None
    outs, models = {}, {}
    for on in (True, False):
        model, tok = load(monkeypatch, on, quantization=quantization)
        models[on] = model
        if path == "plain loop":
            outs[on] = [me.generate_cached(model, p, max_new_tokens=16) for p in prompts[:2]]
        elif path == "paged engine, prefix caching":
            outs[on] = engine_tokens(model, tok, prompts, rounds=2, enable_prefix_caching=True,
                                     chunked_prefill_tokens=8)
        elif path == "n-gram speculation":
            outs[on] = engine_tokens(model, tok, prompts, speculative={"method": "ngram", "k": 3})
        else:
            outs[on] = engine_tokens(model, tok, prompts[:3])
    for p, a, b in zip(prompts, outs[True], outs[False]):
        assert_greedy_match(models[False], p, a, b)
