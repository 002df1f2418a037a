"""Log-probabilities through the server, as real clients read them: echo's prompt log-probabilities equal
log_softmax of the model's logits; generated tokens' equal the offline engine's, greedy and seeded; the official
`openai` client reads them from a completion and a chat completion, whole and streamed; a batch of prompts gets
one choice per prompt and sample; vLLM's tokenizer routes; and lm-evaluation-harness (`local-completions`) runs a
small multiple-choice task shipped in tests/data through the server, with the accuracy the engine's own
log-probabilities give offline."""
from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest
import torch

import mini_engine as me
from mini_engine.engine import LLM
from mini_engine.serving.detokenizer import TokenText
from test_server import ENGINE, MODEL, client, offline, one_thread, real, serving, wait_idle  # noqa: F401 (fixtures)

openai = pytest.importorskip("openai")  # the [serve] extra
TASK = Path(__file__).parent / "data" / "lm_eval"
PROMPT = "The quick brown fox jumps over the lazy dog because it"
TOL = 1e-3  # fp32: the server batches other requests beside these, and a batch's sums round differently


@pytest.fixture(scope="module")
def server(real):
    with serving(real) as (url, llm):
        yield url, llm


def post(url: str, path: str, **body) -> dict:
    r = httpx.post(url + path, json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits over the whole sequence, no cache: row i scores token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)


# ---------------------------------------------------------------- echo: the prompt's log-probabilities

@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_equal_log_softmax_of_the_logits(server, real, max_tokens):
    url, _ = server
    model, tok = real
    ids = tok.encode(PROMPT)
    choice = post(url, "/v1/completions", prompt=PROMPT, max_tokens=max_tokens, echo=True, logprobs=3,
                  temperature=0)["choices"][0]
    lp, ref = choice["logprobs"], reference_logprobs(model, ids)
    names = TokenText(tok).text
    assert len(lp["tokens"]) == len(ids) + max_tokens
    assert lp["tokens"][:len(ids)] == [names(t) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None, "nothing scores the first token"
    for i in range(1, len(ids)):
        assert abs(lp["token_logprobs"][i] - ref[i - 1, ids[i]].item()) < TOL, i
        top = ref[i - 1].topk(3)
        expected = {names(t): v for t, v in zip(top.indices.tolist(), top.values.tolist())}
        expected[names(ids[i])] = ref[i - 1, ids[i]].item()  # the prompt's own token is always there
        got = lp["top_logprobs"][i]
        assert got.keys() == expected.keys() and all(abs(got[k] - expected[k]) < TOL for k in got), i
    assert lp["text_offset"][:len(ids)] == [len(tok.decode(ids[:i])) for i in range(len(ids))]
    if max_tokens == 0:  # the prompt alone: lm-eval's way to score it
        assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    else:  # the greedy token after the prompt, scored by the last row
        greedy = int(ref[-1].argmax())
        assert choice["text"] == PROMPT + tok.decode([greedy]) and lp["tokens"][-1] == names(greedy)
        assert abs(lp["token_logprobs"][-1] - ref[-1, greedy].item()) < TOL
        assert lp["text_offset"][-1] == len(PROMPT)


def test_echo_of_a_token_prompt_and_without_logprobs(server, real):
    url, _ = server
    _, tok = real
    ids = tok.encode(PROMPT)
    choice = post(url, "/v1/completions", prompt=ids, max_tokens=2, echo=True, temperature=0)["choices"][0]
    assert choice["text"].startswith(PROMPT) and choice["logprobs"] is None
    usage = post(url, "/v1/completions", prompt=ids, max_tokens=0, echo=True)["usage"]
    assert usage == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}


# ---------------------------------------------------------------- generated tokens: as the offline engine

SAMPLING = [dict(temperature=0.0), dict(temperature=0.8, top_k=40, seed=11)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("params", SAMPLING, ids=["greedy", "seeded"])
def test_generated_logprobs_equal_the_offline_engines(server, offline, real, params, stream):
    url, _ = server
    names = TokenText(real[1]).text
    expected = offline(PROMPT, max_tokens=8, logprobs=2, ignore_eos=True, **params).outputs[0]
    assert expected.logprobs is not None and len(expected.logprobs) == 8
    out = client(url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, logprobs=2, stream=stream,
                                         extra_body={"ignore_eos": True, "top_k": params.get("top_k", 0)},
                                         **{k: v for k, v in params.items() if k != "top_k"})
    tokens, token_logprobs, tops, offsets, text = [], [], [], [], ""
    for chunk in out if stream else [out]:
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                token_logprobs += c.logprobs.token_logprobs
                tops += c.logprobs.top_logprobs
                offsets += c.logprobs.text_offset
    assert text == expected.text and tokens == [names(t) for t in expected.token_ids]
    for got, top, token, want in zip(token_logprobs, tops, expected.token_ids, expected.logprobs):
        assert abs(got - want[token]) < TOL
        assert top.keys() == {names(t) for t in want} and all(abs(top[names(t)] - v) < TOL for t, v in want.items())
    # Each token's text starts at its offset (a stream sends each token's offset as it comes).
    assert offsets == [len(real[1].decode(expected.token_ids[:i])) for i in range(8)]


# ---------------------------------------------------------------- the official client: chat

@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_client_reads_chat_logprobs(server, offline, real, stream):
    url, _ = server
    question = [{"role": "user", "content": "What is the capital of France?"}]
    expected = offline(question, max_tokens=6, logprobs=3).outputs[0]
    out = client(url).chat.completions.create(model=MODEL, messages=question, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=3, stream=stream)
    content, text = [], ""
    for chunk in out if stream else [out]:
        for c in chunk.choices:
            text += (c.delta.content or "") if stream else c.message.content
            if c.logprobs is not None:
                content += c.logprobs.content
    names = TokenText(real[1])
    assert text == expected.text and len(content) == len(expected.token_ids)
    for entry, token, want in zip(content, expected.token_ids, expected.logprobs):
        assert entry.token == names.text(token) and bytes(entry.bytes) == names.bytes(token)
        assert abs(entry.logprob - want[token]) < TOL
        best = sorted(want.items(), key=lambda item: -item[1])[:3]
        assert [t.token for t in entry.top_logprobs] == [names.text(t) for t, _ in best]
        assert all(abs(t.logprob - v) < TOL for t, (_, v) in zip(entry.top_logprobs, best))


def test_chat_logprobs_without_top_and_a_split_character(server, real):
    url, _ = server
    _, tok = real
    body = {"messages": [{"role": "user", "content": "Pizza: 🍕🍕🍕🍕🍕🍕"}], "max_tokens": 4, "temperature": 0,
            "logprobs": True}
    choice = post(url, "/v1/chat/completions", **body)["choices"][0]
    entries = choice["logprobs"]["content"]
    assert all(e["top_logprobs"] == [] and e["logprob"] <= 0 for e in entries)
    # The bytes of the tokens add up to the text, whole characters or not.
    assert b"".join(bytes(e["bytes"]) for e in entries).decode(errors="replace") == choice["message"]["content"]
    pizza = tok.encode("🍕")
    assert TokenText(tok).text(pizza[0]) == "bytes:\\xf0\\x9f", "a part of a character shows as its bytes"


# ---------------------------------------------------------------- a batch of prompts

@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_batch_of_prompts_gets_a_choice_per_prompt_and_sample(server, offline, real, stream):
    url, _ = server
    _, tok = real
    prompts = ["The three primary colours are", "def fibonacci(n):", "Once upon a time"]
    for batch in (prompts, [tok.encode(p) for p in prompts]):
        out = client(url).completions.create(model=MODEL, prompt=batch, max_tokens=5, n=2, temperature=0.9,
                                             seed=3, stream=stream)
        texts = [""] * 6
        for chunk in out if stream else [out]:
            for c in chunk.choices:
                texts[c.index] += c.text
        expected = [o.text for p in prompts for o in offline(p, max_tokens=5, n=2, temperature=0.9,
                                                             seed=3).outputs]
        assert texts == expected
    wait_idle(url)


def test_a_bad_prompt_in_a_batch_refuses_the_whole_batch(server):
    url, _ = server
    r = httpx.post(url + "/v1/completions", json={"prompt": ["fine", "", "fine too"], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["message"].startswith("prompt 1: ")
    wait_idle(url)


# ---------------------------------------------------------------- vLLM's tokenizer routes

def test_tokenize_detokenize_and_tokenizer_info(server, real):
    url, _ = server
    _, tok = real
    out = post(url, "/tokenize", prompt=PROMPT)
    assert out["tokens"] == tok.encode(PROMPT) and out["count"] == len(out["tokens"])
    assert post(url, "/detokenize", tokens=out["tokens"])["prompt"] == PROMPT
    info = httpx.get(url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["chat_template"] == tok.chat_template
    r = httpx.post(url + "/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


# ---------------------------------------------------------------- lm-evaluation-harness

def offline_loglikelihoods(real, pairs: list[tuple[str, str]]) -> list[float]:
    """What lm-eval asks of a model, from the offline engine: log P(continuation | context), with the tokens split
    as lm-eval splits them (`_encode_pair`: trailing spaces move to the continuation, the whole is tokenized and
    the context's tokens cut off)."""
    model, tok = real
    llm = LLM.from_model(model, tok, **ENGINE)
    inputs = []
    for context, continuation in pairs:
        spaces = len(context) - len(context.rstrip())
        context, continuation = context[:len(context) - spaces], context[len(context) - spaces:] + continuation
        whole, head = tok.encode(context + continuation), tok.encode(context)
        inputs.append((whole, len(head)))
    outs = llm.generate([ids for ids, _ in inputs], me.SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    return [sum(out.prompt_logprobs[i][ids[i]] for i in range(start, len(ids)))
            for out, (ids, start) in zip(outs, inputs)]


def test_lm_eval_multiple_choice_through_the_server_equals_offline(server, real, monkeypatch, tmp_path):
    url, _ = server
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path))  # read when `datasets` is first imported, below
    import lm_eval  # the [dev] extra, lm-eval[api]: imported here, after the environment above is set
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(TASK)  # the task's data file is named relative to it
    # tokenizer_backend="remote": lm-eval tokenizes through the server's /tokenize (no tokenizer download);
    # batch_size 16: its prompts go 16 to a request, as token-id lists.
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=["mini_engine_tiny_qa"],
        model_args={"base_url": url + "/v1/completions", "model": MODEL, "tokenizer_backend": "remote",
                    "max_length": ENGINE["max_model_len"], "max_retries": 1},
        batch_size=16, task_manager=TaskManager(include_path=str(TASK), include_defaults=False),
        log_samples=True, bootstrap_iters=0)
    samples = results["samples"]["mini_engine_tiny_qa"]
    assert len(samples) == len((TASK / "tiny_qa.jsonl").read_text().splitlines()) == 8
    pairs = [tuple(args) for s in samples for args in s["arguments"]]
    expected = offline_loglikelihoods(real, pairs)
    got = [resp[0][0] for s in samples for resp in s["resps"]]
    assert all(abs(a - b) < TOL for a, b in zip(got, expected)), list(zip(got, expected))
    correct, k = [], 0
    for s in samples:
        scores = expected[k:k + len(s["arguments"])]
        k += len(s["arguments"])
        correct.append(max(range(len(scores)), key=scores.__getitem__) == s["target"])
    accuracy = results["results"]["mini_engine_tiny_qa"]["acc,none"]
    print(f"lm-eval accuracy through the server: {accuracy:.3f}; offline: {sum(correct) / len(correct):.3f}")
    assert math.isclose(accuracy, sum(correct) / len(correct))
    assert accuracy >= 0.5, "the model knows most of these: chance would be 0.25"
