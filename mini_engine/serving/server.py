"""An OpenAI-compatible HTTP server over `LLMEngine` (chapter 09): `python -m mini_engine serve`.

    POST /v1/completions, /v1/chat/completions   (stream or not; n, stop, seed, top_k, vLLM's ignore_eos, ...)
    GET  /v1/models, /health, /metrics           (metrics in the Prometheus text format)

One thread, the engine loop (`EngineLoop`), owns the engine and calls `step()` while anything is unfinished.
`serve()` runs it on the main thread, the one that loaded the model, and uvicorn on a second thread: torch's
OpenMP runtime keeps one team of worker threads per thread that runs parallel work, and once two teams exist on
a machine with as many cores as one team needs, libgomp stops spinning between parallel regions and every region
waits on a futex wake-up (a step of 32 decodes took 64 ms instead of 48 on the 2-core CPU of chapter 09).
HTTP handlers run on uvicorn's asyncio loop: they validate a request, hand it to the engine thread through a
thread-safe queue and read its tokens back from an asyncio queue that the engine thread fills after every step
(`loop.call_soon_threadsafe`). A request that arrives mid-generation is added between two steps and joins the
running batch at the next one: continuous batching, online.

What reaches the engine has been checked (`LLMEngine.validate`, and prompt + max_tokens within the context), so a
bad request gets an OpenAI-shaped 400 and never touches the others; a full queue (`max_waiting`) answers 503;
a client that goes away has its request aborted (`LLMEngine.abort_request`), so its KV blocks come back at
once. Text is detokenised incrementally (`IncrementalDetokenizer`) so that a character split across byte
tokens is sent whole, and stop strings are cut from it as OpenAI does (detokenizer.py).

The load generator and a helper that starts this server in a subprocess are in `loadtest.py`.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import queue
import re
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from .detokenizer import IncrementalDetokenizer
from ..sampling import SamplingParams

log = logging.getLogger("mini_engine.serving.server")
MAX_STOPS, MAX_STOP_CHARS = 16, 256  # OpenAI takes up to 4 stop strings; vLLM sets no bound


@dataclass(frozen=True)
class ServerConfig:
    model_name: str                 # what /v1/models lists and requests must name
    api_key: str | None = None      # when set, every /v1 route wants `Authorization: Bearer <api_key>`
    max_waiting: int = 256          # requests queued (not yet admitted) beyond which new ones get 503

    def __post_init__(self):
        if not isinstance(self.max_waiting, int) or self.max_waiting < 0:
            raise ValueError(f"max_waiting must be an int >= 0, got {self.max_waiting!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (None turns authentication off)")


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status)


# ---------------------------------------------------------------- the engine loop

@dataclass(eq=False)
class Stream:
    """One HTTP request's way into the engine thread and back. The engine thread sets `request_id` and
    `samples`, and pushes events: ("tokens", [(index, new_ids, finish_reason | None), ...]) after a step, or
    ("error", message)."""
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    request_id: int | None = None
    samples: list = field(default_factory=list)
    num_seen: list[int] = field(default_factory=list)  # per sample: output tokens already pushed

    def push(self, event) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop has closed: the server is shutting down
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


@dataclass(frozen=True)
class EngineStats:
    """What /metrics reports; a fresh snapshot is published by the engine thread (readers never touch the
    engine)."""
    running: int = 0
    waiting: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    preemptions: int = 0
    kv_blocks_used: int | None = None    # paged cache
    kv_blocks_total: int | None = None
    kv_slots_used: int = 0               # sequence slots (a contiguous cache's rows)
    kv_slots_total: int = 0


class EngineLoop:
    """The one thread that owns the engine: adds and aborts requests between steps, steps while anything is
    unfinished, and after each step pushes every request's new tokens to its Stream."""

    def __init__(self, engine):
        self.engine = engine
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("add" | "abort", Stream), or None to stop
        self.streams: dict[int, Stream] = {}  # engine request id -> its stream
        self.stats = EngineStats()
        # Requests handed in and taken by the engine thread: each count has one writer, so reading both is safe.
        self._num_handed_in = self._num_taken = 0
        self._counts = dict(prompt_tokens=0, generation_tokens=0, finished=0, aborted=0)
        self.running = False  # True while run() steps, on whichever thread
        self.thread = threading.Thread(target=self.run, name="mini_engine-loop", daemon=True)

    def start(self) -> None:
        """Run the loop on its own thread (`run()` runs it on the caller's)."""
        self.thread.start()

    def stop(self) -> None:
        self.inbox.put(None)
        if self.thread.is_alive():
            self.thread.join()

    @property
    def num_waiting(self) -> int:
        """Requests not admitted yet: queued in the engine, or handed in and not yet taken."""
        return self.stats.waiting + self._num_handed_in - self._num_taken

    def submit(self, stream: Stream) -> None:
        self._num_handed_in += 1  # only the asyncio thread submits
        self.inbox.put(("add", stream))

    def abort(self, stream: Stream) -> None:
        self.inbox.put(("abort", stream))

    def run(self) -> None:
        """Step until `stop()`."""
        self.running = True
        try:
            self._loop()
        finally:
            self.running = False

    def _loop(self) -> None:
        while self._take_inbox(block=not self.engine.has_unfinished()):
            if not self.engine.has_unfinished():
                continue
            try:
                self.engine.step()
            except Exception as e:  # an engine bug, not a bad request (those were refused before): fail them all
                log.exception("engine step failed")
                streams, self.streams = list(self.streams.values()), {}
                for stream in streams:
                    stream.push(("error", f"engine step failed: {e}"))
                for stream in streams:
                    with contextlib.suppress(Exception):  # the engine may be in no state to abort: try all
                        self.engine.abort_request(stream.request_id)
            self._publish()

    def _take_inbox(self, block: bool) -> bool:
        """Add and abort what was handed in (waiting for something when idle); False when told to stop."""
        try:
            item = self.inbox.get(block=block)
            while True:
                if item is None:
                    return False
                kind, stream = item
                self._add(stream) if kind == "add" else self._abort(stream)
                item = self.inbox.get_nowait()
        except queue.Empty:
            return True
        finally:
            self._snapshot()

    def _add(self, stream: Stream) -> None:
        try:
            stream.request_id = self.engine.add_request(stream.prompt_ids, stream.params)
        except ValueError as e:  # validated on arrival, so not expected; answered all the same
            stream.push(("error", str(e)))
            return
        finally:  # queued in the engine before it stops counting as handed in: num_waiting never undercounts
            self._snapshot()
            self._num_taken += 1
        stream.samples = self.engine.request_samples(stream.request_id)
        stream.num_seen = [0] * len(stream.samples)
        self.streams[stream.request_id] = stream
        self._counts["prompt_tokens"] += len(stream.prompt_ids)

    def _abort(self, stream: Stream) -> None:
        if self.streams.pop(stream.request_id, None) is not None and self.engine.abort_request(stream.request_id):
            self._counts["aborted"] += 1

    def _publish(self) -> None:
        pushes = []
        for request_id, stream in list(self.streams.items()):
            deltas = []
            for i, sample in enumerate(stream.samples):
                new = sample.output_ids[stream.num_seen[i]:]
                if new:
                    deltas.append((i, list(new), sample.finish_reason))
                    stream.num_seen[i] += len(new)
                    self._counts["generation_tokens"] += len(new)
            if deltas:
                pushes.append((stream, ("tokens", deltas)))
            if all(s.finish_reason is not None for s in stream.samples):
                del self.streams[request_id]
                self._counts["finished"] += 1
        self._snapshot()  # first: a client that has its tokens finds /metrics up to date
        for stream, event in pushes:
            stream.push(event)

    def _snapshot(self) -> None:
        s, engine = self.engine.scheduler, self.engine
        blocks = {} if engine.num_kv_blocks is None else dict(
            kv_blocks_used=engine.num_kv_blocks - engine.num_free_blocks, kv_blocks_total=engine.num_kv_blocks)
        self.stats = EngineStats(running=len(s.running), waiting=len(s.waiting), preemptions=s.num_preemptions,
                                 kv_slots_used=s.num_slots - len(s.free_slots), kv_slots_total=s.num_slots,
                                 **self._counts, **blocks)


# ---------------------------------------------------------------- the OpenAI request bodies

class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # fields of OpenAI's API we do not implement are ignored
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0   # OpenAI's default: sampling
    top_p: float = 1.0
    top_k: int = 0             # vLLM's extension; -1 (vLLM's "off") is taken as 0
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    ignore_eos: bool = False   # vLLM's extension: generate max_tokens whatever the model says

    @property
    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", "stop")
        # Each is searched for after every token: a bound keeps one request from slowing every other one.
        if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise APIError(400, f"stop: at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters", "stop")
        return stops


class CompletionBody(_Body):
    prompt: str | list[int]
    max_tokens: int | None = 16  # OpenAI's default for completions


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class _Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[_TextPart]


class ChatBody(_Body):
    messages: list[_Message]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens


# ---------------------------------------------------------------- the app

def build_app(engine, config: ServerConfig | None = None, engine_thread: bool = True) -> FastAPI:
    """The FastAPI app serving `engine` (an LLMEngine, or an LLM whose engine it takes over). The engine loop
    (`app.state.engine_loop`) starts on a thread of its own with the app (uvicorn runs its lifespan) and stops with
    it; with `engine_thread=False` the caller runs `app.state.engine_loop.run()` on a thread of its choice."""
    engine = getattr(engine, "engine", engine)
    if engine.tokenizer is None:
        raise ValueError("engine: the server needs an engine with a tokenizer (prompts and answers are text)")
    config = config or ServerConfig(model_name=engine.config.model)
    tokenizer = engine.tokenizer
    max_len = engine.scheduler.max_model_len  # prompt + output, capped by the paged pool too
    loop = EngineLoop(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if engine_thread:
            loop.start()
        yield
        loop.stop()

    app = FastAPI(title="mini_engine", lifespan=lifespan)
    app.state.engine_loop = loop

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def bad_body(request, e: RequestValidationError):
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        return APIError(400, f"{param or 'body'}: {first['msg']}", param).response()

    async def check_key(request: Request) -> None:
        if config.api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), config.api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                           code="invalid_api_key")

    v1 = [Depends(check_key)]

    @app.get("/health")
    async def health():
        if not loop.running:
            raise APIError(503, "the engine loop is not running", type="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(loop.stats, loop.num_waiting),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=v1)
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "mini_engine", "max_model_len": max_len}]}

    def start(body: _Body, prompt, max_tokens: int | None, prompt_param: str) -> tuple[Stream, list[str]]:
        """Check a request, then hand it to the engine thread."""
        if body.model is not None and body.model != config.model_name:
            raise APIError(404, f"The model {body.model!r} does not exist; this server serves "
                                f"{config.model_name!r}", "model", "model_not_found")
        stops = body.stops
        try:
            prompt_ids, _ = engine.validate(prompt)  # tokenized and checked against max_model_len and the pool
            room = max_len - len(prompt_ids)
            if max_tokens is not None and max_tokens > room:
                raise ValueError(f"max_tokens={max_tokens}: this model's maximum context length is {max_len} "
                                 f"tokens and the prompt has {len(prompt_ids)}, which leaves {room}")
            params = SamplingParams(
                temperature=body.temperature, top_p=body.top_p, top_k=0 if body.top_k == -1 else body.top_k,
                max_tokens=room if max_tokens is None else max_tokens, seed=body.seed, n=body.n,
                ignore_eos=body.ignore_eos)
            prompt_ids, params = engine.validate(prompt_ids, params)
        except ValueError as e:  # the engine's messages start with the argument's name
            name = re.match(r"\w+", str(e)).group()
            raise APIError(400, str(e), prompt_param if name == "prompt" else name) from None
        if loop.num_waiting >= config.max_waiting:
            raise APIError(503, f"the server is busy: {loop.num_waiting} requests are waiting "
                                f"(max_waiting={config.max_waiting}); retry later", code="overloaded",
                           type="server_error")
        stream = Stream(prompt_ids, params, asyncio.get_running_loop())
        loop.submit(stream)
        return stream, stops

    async def respond(request: Request, body: _Body, stream: Stream, stops: list[str], chat: bool):
        pieces = _choices(loop, stream, tokenizer, stops)
        kind = "chat.completion" if chat else "text_completion"
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "object": kind,
                "created": int(time.time()), "model": config.model_name}
        if body.stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(_sse(pieces, head, stream, chat, usage), media_type="text/event-stream")
        return await _until_disconnected(request, _collect(pieces, head, stream, chat))

    @app.post("/v1/completions", dependencies=v1)
    async def completions(request: Request, body: CompletionBody):
        stream, stops = start(body, body.prompt, body.max_tokens, "prompt")
        return await respond(request, body, stream, stops, chat=False)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(request: Request, body: ChatBody):
        messages = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                     else "".join(p.text for p in m.content)} for m in body.messages]
        if not messages:
            raise APIError(400, "messages must not be empty", "messages")
        try:
            prompt = tokenizer.apply_chat_template(messages)
        except Exception as e:  # a conversation the model's template refuses (jinja raises its own errors)
            raise APIError(400, f"messages: the chat template failed: {e}", "messages") from None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        stream, stops = start(body, prompt, max_tokens, "messages")
        return await respond(request, body, stream, stops, chat=True)

    return app


async def _choices(loop: EngineLoop, stream: Stream, tokenizer, stops: list[str]):
    """The request's text as it is generated: yields lists of (index, text, finish_reason | None, num_tokens).
    A choice ends at the engine's finish or at a stop string. If this generator is left before every choice has
    finished in the engine (a client went away, or stop strings ended the choices), the request is aborted:
    its KV blocks go back at once."""
    n = stream.params.n
    text = [IncrementalDetokenizer(tokenizer, stops) for _ in range(n)]
    ended, engine_done = [False] * n, [False] * n
    try:
        while not all(ended):
            event = await stream.events.get()
            if event[0] == "error":
                raise APIError(500, event[1], type="server_error")
            out = []
            for i, ids, reason in event[1]:
                engine_done[i] = engine_done[i] or reason is not None
                if ended[i]:
                    continue  # already cut at a stop string: the engine's later tokens are not sent
                delta = text[i].add(ids)
                if reason is not None and not text[i].stopped:
                    delta += text[i].finish()
                if text[i].stopped:
                    reason = "stop"
                ended[i] = reason is not None
                out.append((i, delta, reason, len(ids)))
            yield out
    finally:
        if not all(engine_done):
            loop.abort(stream)


def _usage(stream: Stream, num_tokens: int) -> dict:
    prompt = len(stream.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": num_tokens, "total_tokens": prompt + num_tokens}


async def _collect(pieces, head: dict, stream: Stream, chat: bool) -> dict:
    n = stream.params.n
    texts, reasons, num_tokens = [""] * n, [None] * n, 0
    async for out in pieces:
        for i, delta, reason, count in out:
            texts[i] += delta
            reasons[i] = reason or reasons[i]
            num_tokens += count
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]}, "logprobs": None,
                    "finish_reason": reasons[i]} for i in range(n)]
    else:
        choices = [{"index": i, "text": texts[i], "logprobs": None, "finish_reason": reasons[i]} for i in range(n)]
    return {**head, "choices": choices, "usage": _usage(stream, num_tokens)}


async def _until_disconnected(request: Request, work):
    """Run `work` (a non-streamed answer) unless the client goes away first: then it is cancelled, which aborts
    the request (see `_choices`). After the body has been read, the next ASGI message is the disconnect."""
    task = asyncio.ensure_future(work)

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass
    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled (the server shutting down)
        watch.cancel()
        if not task.done():
            task.cancel()  # its generator's cleanup aborts the request
    return task.result() if task.done() and not task.cancelled() else JSONResponse({}, status_code=499)


async def _sse(pieces, head: dict, stream: Stream, chat: bool, include_usage: bool):
    """Server-sent events in OpenAI's chunk shape: chat chunks open each choice with the assistant role and end
    it with an empty delta carrying finish_reason; the usage chunk (choices []) comes before `data: [DONE]`."""
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    extra = {"usage": None} if include_usage else {}

    def event(choices, **more) -> str:
        return f"data: {json.dumps({**head, 'choices': choices, **extra, **more}, ensure_ascii=False)}\n\n"

    def choice(i, text, reason, role=False):
        if not chat:
            return {"index": i, "text": text, "logprobs": None, "finish_reason": reason}
        delta = {"role": "assistant", "content": text} if role else {} if text is None else {"content": text}
        return {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}

    num_tokens = 0
    try:
        if chat:
            yield event([choice(i, "", None, role=True) for i in range(stream.params.n)])
        async for out in pieces:
            num_tokens += sum(count for *_, count in out)
            texts = [choice(i, delta, None) for i, delta, _, _ in out if delta]
            ends = [choice(i, None if chat else "", reason) for i, _, reason, _ in out if reason]
            if texts:
                yield event(texts)
            if ends:
                yield event(ends)
    except APIError as e:  # the status line has gone out: the error travels as an event
        yield f"data: {json.dumps({'error': json.loads(e.response().body)['error']})}\n\n"
    if include_usage:
        yield event([], usage=_usage(stream, num_tokens))
    yield "data: [DONE]\n\n"


def prometheus_text(stats: EngineStats, num_waiting: int) -> str:
    """The engine's state in the Prometheus text exposition format (version 0.0.4)."""
    rows = [("requests_running", "gauge", "Sequences in the running batch", stats.running),
            ("requests_waiting", "gauge", "Requests queued, not admitted yet", num_waiting),
            ("prompt_tokens_total", "counter", "Prompt tokens of the requests added", stats.prompt_tokens),
            ("generation_tokens_total", "counter", "Tokens generated", stats.generation_tokens),
            ("requests_finished_total", "counter", "Requests the engine finished", stats.finished),
            ("requests_aborted_total", "counter", "Requests aborted (client gone, stop string)", stats.aborted),
            ("preemptions_total", "counter", "Requests preempted for lack of KV blocks", stats.preemptions),
            ("kv_slots_used", "gauge", "Sequence slots in use", stats.kv_slots_used),
            ("kv_slots_total", "gauge", "Sequence slots", stats.kv_slots_total)]
    if stats.kv_blocks_total is not None:
        rows += [("kv_blocks_used", "gauge", "KV cache blocks held by requests", stats.kv_blocks_used),
                 ("kv_blocks_total", "gauge", "KV cache blocks in the paged pool", stats.kv_blocks_total)]
    return "".join(f"# HELP mini_engine_{name} {help}\n# TYPE mini_engine_{name} {kind}\nmini_engine_{name} {value}\n"
                   for name, kind, help, value in rows)


def serve(llm, host: str = "127.0.0.1", port: int = 8000, config: ServerConfig | None = None) -> None:
    """Serve `llm` until interrupted; prints the URL once the socket listens. The engine loop runs on this thread
    (see the module's docstring for why), uvicorn on another."""
    import uvicorn

    config = config or ServerConfig(model_name=llm.config.model)
    app = build_app(llm, config, engine_thread=False)
    loop = app.state.engine_loop
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=5))

    def http() -> None:
        try:
            server.run()
        finally:  # however uvicorn ends (a port in use, a shutdown), the engine loop ends with it
            loop.stop()

    def announce() -> None:
        while not server.started and http_thread.is_alive():
            time.sleep(0.05)
        if server.started:
            print(f"mini_engine serving {config.model_name} at http://{host}:{port}/v1 (OpenAI-compatible; Ctrl-C "
                  "stops)", flush=True)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():  # uvicorn, off the main thread, installs no handlers
        signal.signal(signal.SIGTERM, interrupt)  # `kill`, a container's stop: shut down as Ctrl-C does
    http_thread = threading.Thread(target=http, name="uvicorn", daemon=True)
    http_thread.start()
    threading.Thread(target=announce, daemon=True).start()
    try:
        loop.run()
    except KeyboardInterrupt:
        pass
    server.should_exit = True  # uvicorn closes its connections, runs the lifespan's shutdown and returns
    http_thread.join()
    if not server.started:
        raise SystemExit(f"mini_engine could not serve on {host}:{port} (see uvicorn's message above)")
    print("mini_engine server stopped", flush=True)
