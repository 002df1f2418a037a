"""Shared fixtures for engine tests: the real embedded model, its HF reference, and random tiny checkpoints."""
from __future__ import annotations

import pytest
import torch

import mini_engine as me
from mini_engine.loader import embedded_gguf_path

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
