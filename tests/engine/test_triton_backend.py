"""The engine with attention_backend="triton" (the FlashAttention kernel, and on the paged cache the KV-store
and paged decode kernels) gives the same logits and greedy tokens as the torch backend.

The model and every tensor live on the GPU where there is one, where the kernels are compiled; elsewhere on
the CPU, where they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 when no GPU is
visible, and the kernels cannot run on CPU tensors once compiled)."""
import pytest
import torch

import mini_engine as me
from mini_engine.attention import AttentionMetadata
from mini_engine.config import ModelConfig
from mini_engine.engine import LLM
from mini_engine.kv_cache import ContiguousKVCache, PagedKVCache
from mini_engine.model import LlamaModel


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module", params=[(4, 2), (4, 4)], ids=["gqa", "mha"])
def tiny(request, device):
    heads, kv_heads = request.param
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=heads,
                      num_kv_heads=kv_heads, head_dim=16, max_position_embeddings=128)
    model = LlamaModel(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return model.to(device).eval()


def test_no_cache_forward_matches_torch(tiny, device):
    ids = torch.randint(0, 128, (2, 19), device=device)
    torch.testing.assert_close(tiny(ids, backend="triton"), tiny(ids, backend="torch"), atol=1e-4, rtol=1e-4)


def test_chunked_prefill_through_the_cache_matches_torch(tiny, device):
    """Two sequences prefilled in chunks: the second chunk's queries attend to keys already in the cache."""
    ids = [torch.randint(0, 128, (n,), device=device) for n in (21, 9)]
    logits = {}
    for backend in ("torch", "triton"):
        cache = ContiguousKVCache(tiny.config, 2, 32, device=device)
        first = AttentionMetadata.build([12, 5], [12, 5], slots=[0, 1], device=device)
        tiny(torch.cat([ids[0][:12], ids[1][:5]]), first, cache, backend=backend)
        second = AttentionMetadata.build([9, 4], [21, 9], slots=[0, 1], device=device)
        logits[backend] = tiny(torch.cat([ids[0][12:], ids[1][5:]]), second, cache, backend=backend)
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)


def test_greedy_tokens_match_torch(tiny):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
    expected = me.generate_batch(tiny, prompts, 8)
    tiny.attention_backend = "triton"
    try:
        assert me.generate_batch(tiny, prompts, 8) == expected
        assert me.generate_naive(tiny, prompts[1], 6) == expected[1][:6]
    finally:
        tiny.attention_backend = "torch"


def test_paged_steps_match_torch(tiny, device):
    """Through shuffled block tables of 4 positions: prompt chunks (the second one attending to blocks the
    first wrote), then a step mixing two decodes with a new prompt that has no cached context."""
    ids = [torch.randint(0, 128, (n,), device=device) for n in (13, 7, 6)]
    tables = [[9, 2, 14, 5], [0, 11], [7, 3]]
    steps = [([8, 5], [8, 5], [0, 1], [ids[0][:8], ids[1][:5]]),
             ([5, 2], [13, 7], [0, 1], [ids[0][8:], ids[1][5:]]),
             ([1, 1, 6], [14, 8, 6], [0, 1, 2], [ids[1][:1], ids[0][:1], ids[2]])]
    logits = {}
    for backend in ("torch", "triton"):
        cache = PagedKVCache(tiny.config, 16, 4, device=device)
        for query_lens, context_lens, seqs, tokens in steps:
            meta = AttentionMetadata.build(query_lens, context_lens, block_tables=[tables[i] for i in seqs],
                                           block_size=4, device=device)
            logits[backend] = tiny(torch.cat(tokens), meta, cache, backend=backend)
        logits[backend, "cache"] = cache.data.clone()
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits["triton", "cache"], logits["torch", "cache"], atol=1e-5, rtol=1e-5)


def test_paged_engine_greedy_tokens_match_torch(tiny):
    prompts, params = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12]], me.SamplingParams(max_tokens=6)
    outs = {backend: LLM.from_model(tiny, attention_backend=backend, block_size=4, chunked_prefill_tokens=5)
            .generate(prompts, params, use_tqdm=False) for backend in ("torch", "triton")}
    assert [o.token_ids for o in outs["triton"]] == [o.token_ids for o in outs["torch"]]
