"""Shared fixtures for engine tests: the real embedded model, its HF reference, random tiny checkpoints, and a
guard that checks every write of the paged engine."""
from __future__ import annotations

import functools

import pytest
import torch

import mini_engine as me
from mini_engine.config import ModelConfig
from mini_engine.loading.loader import embedded_gguf_path
from mini_engine.model import LlamaModel

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Name a color."}],
]


@pytest.fixture(scope="session")
def real():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, fp32 on the CPU."""
    return me.load_model("smollm2-135m", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def hf_real():
    """(model, tokenizer) from transformers' own GGUF loader: the independent reference."""
    transformers = pytest.importorskip("transformers")
    path = embedded_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tok


@pytest.fixture(scope="session")
def chat_prompts(real):
    _, tok = real
    return [tok.encode(tok.apply_chat_template(m)) for m in PROMPTS]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@pytest.fixture(scope="session")
def assert_greedy_match():
    """Greedy sequences must be equal, or differ first where the top two logits tie (within 1e-5):
    then both choices are correct argmaxes and later tokens may legitimately differ."""
    def check(model, prompt: list[int], ours: list[int], ref: list[int], tol: float = 1e-5):
        i = first_divergence(ours, ref)
        if i is None:
            return
        assert i < min(len(ours), len(ref)), f"one sequence stopped early at {i}: {ours} vs {ref}"
        logits = model(torch.tensor([prompt + ref[:i]]))[0, -1].float()
        gap = float(logits[ref[i]] - logits[ours[i]]).__abs__()
        assert gap < tol, f"tokens differ at step {i} ({ours[i]} vs {ref[i]}) with logit gap {gap:.3g} >= {tol}"
    return check


@pytest.fixture(scope="module")
def one_thread():
    """The tiny model's ops are too small to split: on a busy 2-core machine, a second thread waiting at every
    op's barrier makes these tests many times slower. Use with `pytestmark = pytest.mark.usefixtures(...)`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def _tiny_model(seed: int) -> LlamaModel:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=None)
    model = LlamaModel(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)  # sharp distributions: greedy ties are practically impossible
    return model.eval()


@pytest.fixture(scope="session")
def tiny_model():
    """tiny_model(seed): a random 2-layer Llama (vocab 128, 4 query / 2 KV heads), the same object per seed."""
    return _tiny_model


@pytest.fixture(scope="session")
def guard_writes():
    """guard_writes(llm): wrap the model runner of an LLM or LLMEngine so that every step checks that no chunk
    writes into a block another table holds or the prefix cache has registered (copy-on-write has run by
    then). Returns llm."""
    def guard(llm):
        engine = getattr(llm, "engine", llm)
        runner, blocks = engine.runner, engine.scheduler.blocks
        execute = runner.execute

        def checked(chunks, block_copies=()):
            for c in chunks:
                table = blocks.block_table(c.request.request_id)
                for p in range(c.start, c.start + c.num_tokens):
                    block = table[p // blocks.block_size]
                    assert blocks.ref_counts[block] == 1 and blocks.block_hash[block] is None, \
                        f"request {c.request.request_id} writes position {p} into shared/cached block {block}"
            for src, dst in block_copies:
                assert blocks.ref_counts[dst] == 1 and blocks.ref_counts[src] >= 1, f"copy {src} -> {dst}"
            return execute(chunks, block_copies)
        runner.execute = checked
        return llm
    return guard
