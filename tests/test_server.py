"""The OpenAI-compatible server (`mini_engine.serving.server`) through the official `openai` client and raw HTTP: greedy
answers equal the offline `LLM.generate` text, streamed or not; 32 concurrent streams finish and share steps; a
character split across byte tokens arrives whole; bad requests get OpenAI-shaped 400s while others stream on; a
client that goes away leaves nothing held; /metrics parses; --api-key, --max-waiting (503), ignore_eos, n and stop
work; the load generator runs end to end. Servers run in this process (a uvicorn thread over one loaded model),
except one started with `python -m mini_engine serve` in a subprocess; every test's server is stopped."""
from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time

import httpx
import pytest
import torch

import mini_engine as me
from mini_engine.__main__ import main
from mini_engine.serving.detokenizer import IncrementalDetokenizer
from mini_engine.engine import LLM
from mini_engine.serving.loadtest import free_port, run_loadtest, start_server

openai = pytest.importorskip("openai")  # the [serve] extra
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
from mini_engine.serving.server import ServerConfig, build_app  # noqa: E402 (needs fastapi)

ENGINE = dict(max_model_len=256, max_num_seqs=32, block_size=16)
MODEL = "smollm2-135m"
PIZZA = "Pizza: 🍕🍕🍕🍕🍕🍕"  # greedy continues with more pizzas: each one three byte tokens
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One model thread: the engine thread's tiny steps gain nothing from a second core shared with the test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def real():
    return me.load_model(MODEL, device="cpu", dtype="float32")


@contextlib.contextmanager
def serving(real, config: ServerConfig | None = None, **engine_kwargs):
    """A server in a uvicorn thread over a fresh engine on the loaded weights; yields (url, llm); always stopped."""
    model, tok = real
    llm = LLM.from_model(model, tok, **{**ENGINE, **engine_kwargs})
    app = build_app(llm, config or ServerConfig(MODEL))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "the server thread died while starting"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{server.config.port}", llm
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module")
def server(real):
    with serving(real, record_trace=True) as (url, llm):
        yield url, llm


@pytest.fixture(scope="module")
def offline(real):
    """Greedy text from the offline engine with the server's settings, one prompt at a time."""
    model, tok = real
    llm = LLM.from_model(model, tok, **ENGINE)

    def run(prompt, **params):
        if isinstance(prompt, list):
            prompt = tok.apply_chat_template(prompt)
        return llm.generate([prompt], me.SamplingParams(**params), use_tqdm=False)[0]
    return run


def client(url, **kwargs):
    return openai.OpenAI(base_url=url + "/v1", api_key=kwargs.pop("api_key", "none"), max_retries=0, **kwargs)


def metrics(url) -> dict[str, float]:
    """/metrics parsed strictly: every sample line `name value`, each announced by # HELP and # TYPE."""
    text = httpx.get(url + "/metrics").text
    values, typed = {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            assert kind in ("gauge", "counter")
            typed.add(name)
        elif not line.startswith("# HELP "):
            name, value = line.split(" ")
            assert name in typed, f"{name} has no # TYPE line"
            values[name.removeprefix("mini_engine_")] = float(value)
    return values


def wait_idle(url, timeout=20) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if m["requests_running"] == m["requests_waiting"] == m["kv_blocks_used"] == m["kv_slots_used"] == 0:
            return m
        assert time.monotonic() < deadline, f"the server still holds requests or blocks: {m}"
        time.sleep(0.05)


def answer(out, stream: bool, chat: bool) -> tuple[str, str | None]:
    """(text, finish_reason) of choice 0, from a response or a stream of chunks."""
    if stream:
        deltas, reason = stream_text(out, chat)
        return "".join(deltas), reason
    choice = out.choices[0]
    return choice.message.content if chat else choice.text, choice.finish_reason


def stream_text(chunks, chat: bool) -> tuple[list[str], str | None]:
    deltas, reason = [], None
    for chunk in chunks:
        for c in chunk.choices:
            text = c.delta.content if chat else c.text
            if text:
                deltas.append(text)
            reason = c.finish_reason or reason
    return deltas, reason


# ---------------------------------------------------------------- answers equal the offline engine's

@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_and_chat_equal_offline_greedy_text(server, offline, stream):
    url, _ = server
    c = client(url)
    for prompt in ("The three primary colours are", "def fibonacci(n):"):
        expected = offline(prompt, max_tokens=12)
        out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=stream)
        assert answer(out, stream, chat=False) == (expected.text, expected.finish_reason)
    expected = offline(FRANCE, max_tokens=16)
    out = c.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=16, temperature=0, stream=stream)
    text, reason = answer(out, stream, chat=True)
    if not stream:
        assert out.usage.completion_tokens == len(expected.token_ids)
        assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert (text, reason) == (expected.text, expected.finish_reason) and "Paris" in text


def test_stream_shape_usage_chunk_before_done(server):
    url, _ = server
    body = {"model": MODEL, "messages": FRANCE, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------- many clients, continuous batching online

def test_32_concurrent_streaming_clients_all_complete_in_shared_steps(server):
    url, llm = server
    questions = ["Name a colour.", "Count to five.", "Say hello in French.", "What is 3 + 4?"]

    async def main():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        async with c:
            async def one(i):
                chunks = await c.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": questions[i % 4]}], max_tokens=4 + i % 3,
                    temperature=0.7, seed=i, stream=True, stream_options={"include_usage": True})
                return [chunk async for chunk in chunks]
            return await asyncio.gather(*(one(i) for i in range(32)))

    step = len(llm.engine.trace)
    results = asyncio.run(main())
    for i, chunks in enumerate(results):
        _, reason = stream_text(chunks, chat=True)
        assert reason in ("stop", "length") and chunks[-1].usage.completion_tokens <= 4 + i % 3
    widest = max(len({rid for rid, *_ in s.chunks}) for s in llm.engine.trace[step:])
    assert widest >= 8, f"requests arriving together should share steps; at most {widest} did"
    wait_idle(url)


# ---------------------------------------------------------------- multi-byte characters

def test_incremental_detokenizer_holds_back_a_split_character(real):
    _, tok = real
    pizza = tok.encode("🍕")
    assert len(pizza) == 3 and "\ufffd" in tok.decode(pizza[:1]), "the emoji is three byte tokens"
    ids = tok.encode("a 🍕b🍕") + pizza[:2]  # ends inside a third pizza
    d = IncrementalDetokenizer(tok)
    deltas = [d.add([t]) for t in ids]
    assert all("\ufffd" not in x for x in deltas) and "".join(deltas) == "a 🍕b🍕"
    assert d.finish() == tok.decode(ids)[len("a 🍕b🍕"):], "what is left at the end is what decode gives"


def test_stop_strings_are_cut_across_tokens_and_never_sent_in_part(real):
    _, tok = real
    ids = tok.encode("The capital of France is Paris. It is")
    d = IncrementalDetokenizer(tok, stop=["France is P", "zzz"])
    deltas = [d.add([t]) for t in ids]
    assert "".join(deltas) + d.finish() == "The capital of " and d.stopped
    d = IncrementalDetokenizer(tok, stop=["France!"])  # a prefix held back, then released when it cannot match
    assert "".join(d.add([t]) for t in ids) + d.finish() == "The capital of France is Paris. It is"


def test_a_streamed_emoji_arrives_whole(server, offline):
    url, _ = server
    expected = offline(PIZZA, max_tokens=6)
    assert expected.text == "🍕🍕"
    out = client(url).completions.create(model=MODEL, prompt=PIZZA, max_tokens=6, temperature=0, stream=True)
    deltas, _ = stream_text(out, chat=False)
    assert deltas == ["🍕", "🍕"]


# ---------------------------------------------------------------- bad requests, disconnects, metrics

BAD = [
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10_000}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi " * 400}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 17}, "stop"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
]


def test_bad_requests_get_openai_shaped_400_while_another_streams_on(server, offline):
    url, _ = server
    expected = offline(FRANCE, max_tokens=16)
    out = client(url).chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=16, temperature=0,
                                              stream=True)
    chunks = [next(out), next(out)]  # the stream has started
    for path, body, param in BAD:
        r = httpx.post(url + path, json={"model": MODEL, **body}, timeout=30)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert error["param"] == param and error["message"], (body, error)
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"model": "gpt-4", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    deltas, reason = stream_text(chunks + list(out), chat=True)
    assert ("".join(deltas), reason) == (expected.text, expected.finish_reason)
    wait_idle(url)


def test_a_client_that_disconnects_leaves_nothing_held(server):
    url, _ = server
    aborted = metrics(url)["requests_aborted_total"]
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert [next(lines) for _ in range(4)]  # two events, mid-stream
        assert metrics(url)["kv_blocks_used"] > 0
    with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up
        httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=1.0)
    m = wait_idle(url)
    assert m["requests_aborted_total"] == aborted + 2


def test_metrics_parse_and_count(server):
    url, _ = server
    before = metrics(url)
    client(url).completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                                   extra_body={"ignore_eos": True})
    after = metrics(url)
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == 3
    assert after["requests_finished_total"] - before["requests_finished_total"] == 1
    assert after["kv_blocks_total"] > 0 and after["kv_slots_total"] == 32
    parser = pytest.importorskip("prometheus_client.parser")
    families = {f.name for f in parser.text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    assert {"mini_engine_requests_running", "mini_engine_requests_waiting", "mini_engine_kv_blocks_used",
            "mini_engine_generation_tokens"} <= families


def test_health_and_models(server):
    url, _ = server
    assert httpx.get(url + "/health").status_code == 200
    assert [m.id for m in client(url).models.list().data] == [MODEL]


# ---------------------------------------------------------------- sampling options

def test_ignore_eos(server, offline):
    url, _ = server
    question = [{"role": "user", "content": "What is 2+2?"}]  # the greedy answer ends with EOS after 12 tokens
    c = client(url)
    short = c.chat.completions.create(model=MODEL, messages=question, max_tokens=20, temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 20
    full = c.chat.completions.create(model=MODEL, messages=question, max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 20
    assert full.choices[0].message.content == offline(question, max_tokens=20, ignore_eos=True).text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n2_seeded_equals_the_offline_samples(server, offline, stream):
    url, _ = server
    expected = offline(FRANCE, max_tokens=8, n=2, temperature=0.9, seed=7)
    out = client(url).chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=8, n=2, temperature=0.9,
                                              seed=7, stream=stream)
    texts = ["", ""]
    for chunk in out if stream else [out]:
        for c in chunk.choices:
            texts[c.index] += (c.delta.content or "") if stream else c.message.content
    assert texts == [o.text for o in expected.outputs] and texts[0] != texts[1]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stop_string_is_cut_and_frees_the_request(server, offline, stream):
    url, _ = server
    full = offline(FRANCE, max_tokens=16).text
    assert "Paris" in full
    out = client(url).chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=16, temperature=0,
                                              stop=["Paris", "never"], stream=stream)
    assert answer(out, stream, chat=True) == (full[:full.index("Paris")], "stop")
    wait_idle(url)


# ---------------------------------------------------------------- a full queue, the CLI with --api-key, loadtest

def test_full_queue_answers_503(real):
    with serving(real, ServerConfig(MODEL, max_waiting=1), max_num_seqs=1) as (url, _):
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as running:
            lines = running.iter_lines()  # kept: a dropped iterator closes the response, and the server aborts it
            assert next(lines)  # admitted and generating
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as queued:
                assert queued.status_code == 200
                assert metrics(url)["requests_waiting"] == 1
                r = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=30)
                assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
                assert r.json()["error"]["type"] == "server_error"
        wait_idle(url)


def test_cli_server_with_api_key_and_the_loadtest(tmp_path, capsys):
    with start_server("--max-model-len", "256", "--max-num-seqs", "8", "--api-key", "sesame",
                      "--max-body-bytes", "4096") as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a" * 4096, "max_tokens": 2},
                       headers={"authorization": "Bearer sesame"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        with pytest.raises(openai.AuthenticationError):
            client(srv.url, api_key="wrong").models.list()
        assert httpx.get(srv.url + "/health").status_code == 200, "/health needs no key"
        out = client(srv.url, api_key="sesame").completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert out.usage.completion_tokens == 2
        result = run_loadtest(srv.url, rate=20.0, num_requests=4, max_tokens=4, api_key="sesame", progress=False)
        assert (result["completed"], result["errors"], result["output_tokens"]) == (4, 0, 16), result
        assert result["ttft_p50_s"] > 0 and result["e2e_p99_s"] >= result["ttft_p99_s"]
        plot = tmp_path / "curve.png"
        main(["loadtest", "--url", srv.url, "--sweep", "50,inf", "--requests", "2", "--max-tokens", "2",
              "--api-key", "sesame", "--plot", str(plot)])
        table = capsys.readouterr().out
        assert "TTFT p50" in table and len([line for line in table.splitlines() if " 2      0 " in line]) == 2, table
        assert plot.stat().st_size > 0
        main(["loadtest", "--url", srv.url, "--hostile", "2", "--honest", "1", "--max-tokens", "4",
              "--api-key", "sesame"])
        report = capsys.readouterr().out
        assert "every refused request got its 4xx: yes" in report, report
        assert "after the attack: 0 KV blocks held, 0 requests left" in report, report
        srv.process.send_signal(signal.SIGTERM)  # as `kill` or a container's stop: a clean shutdown, not a crash
        srv.process.wait(30)
    assert srv.process.returncode == 0, f"SIGTERM should stop the server cleanly:\n{srv.log()}"
    assert "mini_engine server stopped" in srv.log()


def test_a_failed_step_answers_500_and_the_engine_serves_on_with_a_clean_cache(real, offline):
    """A step that raises (here with a copy-on-write pending: a radix match ending inside a block, n=2) fails the
    streams it served with 500; the engine aborted what it scheduled, so nothing uncopied entered the tree and
    the same prompt then gets the offline engine's text (issue 59)."""
    prefix = "The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz"
    prompt = prefix + " built a machine that changed how books were made"
    with serving(real, prefix_cache="radix") as (url, llm):
        c = client(url, timeout=60)
        c.completions.create(model=MODEL, prompt=prefix, max_tokens=1, temperature=0)  # the prefix is cached
        runner, fired = llm.engine.runner, []
        execute = runner.execute

        def failing(chunks, copies=()):
            if copies and not fired:
                fired.append(copies)
                raise RuntimeError("injected")
            return execute(chunks, copies)
        runner.execute = failing
        with pytest.raises(openai.InternalServerError, match="engine step failed: injected"):
            c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, n=2, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert fired, "the step with the pending copy should have failed"
        wait_idle(url)
        again = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
        assert again.choices[0].text == offline(prompt, max_tokens=8, ignore_eos=True).outputs[0].text
        wait_idle(url)
