"""An OpenAI-compatible HTTP server over `LLMEngine` (chapter 09): `python -m mini_engine serve`.

    POST /v1/completions, /v1/chat/completions   (stream or not; n, stop, seed, top_k, logprobs, echo, a batch of
                                                  prompts, vLLM's ignore_eos: see protocol.py for every field)
    POST /tokenize, /detokenize; GET /tokenizer_info   (vLLM's, which lm-evaluation-harness's remote tokenizer uses)
    GET  /v1/models, /health, /metrics           (metrics in the Prometheus text format)

One thread, the engine loop (`EngineLoop`), owns the engine and calls `step()` while anything is unfinished.
`serve()` runs it on the main thread, the one that loaded the model, and uvicorn on a second thread: torch's
OpenMP runtime keeps one team of worker threads per thread that runs parallel work, and once two teams exist on
a machine with as many cores as one team needs, libgomp stops spinning between parallel regions and every region
waits on a futex wake-up (a step of 32 decodes took 64 ms instead of 48 on the 2-core CPU of chapter 09).
HTTP handlers run on uvicorn's asyncio loop: they read and check a request, hand it to the engine thread through
a thread-safe queue and read its tokens back from an asyncio queue that the engine thread fills after every step
(`loop.call_soon_threadsafe`). A request that arrives mid-generation is added between two steps and joins the
running batch at the next one: continuous batching, online.

No request can stall the others. The event loop only moves bytes: a body over `max_body_bytes` is refused (413)
before it is read; parsing, chat templates and tokenizing run on a small pool of "prepare" threads, and
detokenizing and formatting answers on an "output" pool, so a costly request waits behind costly requests only.
A prompt string longer than any prompt of `max_model_len` tokens can be is refused without being tokenized
(`protocol.max_prompt_chars`). What reaches the engine has been checked (`LLMEngine.validate`, and prompt +
max_tokens within the context), so a bad request gets an OpenAI-shaped 400 and never touches the others; a full
queue (`max_waiting`) answers 503; a client that goes away, mid-stream or while waiting for a whole answer, has
its request aborted (`LLMEngine.abort_request`), so its KV blocks come back at once. A slow reader slows only its
own stream: the engine never waits for a client. Text is detokenised incrementally (`IncrementalDetokenizer`) so
that a character split across byte tokens is sent whole, and stop strings are cut from it as OpenAI does.

Log-probabilities (`logprobs`, and `echo` for the prompt's) are the model's raw ones, log_softmax of its logits in
fp32 before temperature, top-k or top-p (vLLM's default), computed in the step that samples: responses.py.

The load generator, its hostile variant and a helper that starts this server in a subprocess are in `loadtest.py`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
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

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from .detokenizer import TokenText
from .protocol import (APIError, ChatBody, CompletionBody, DetokenizeBody, TokenizeBody, max_prompt_chars,
                       parse)
from .responses import Prompt, Responder
from ..sampling import SamplingParams

log = logging.getLogger("mini_engine.serving.server")


@dataclass(frozen=True)
class ServerConfig:
    model_name: str                 # what /v1/models lists and requests must name
    api_key: str | None = None      # when set, every /v1 route wants `Authorization: Bearer <api_key>`
    max_waiting: int = 256          # requests queued (not yet admitted) beyond which new ones get 503
    max_body_bytes: int = 4 * 2**20  # a request body over this is refused with 413, unread

    def __post_init__(self):
        if not isinstance(self.max_waiting, int) or self.max_waiting < 0:
            raise ValueError(f"max_waiting must be an int >= 0, got {self.max_waiting!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (None turns authentication off)")
        if not isinstance(self.max_body_bytes, int) or isinstance(self.max_body_bytes, bool) \
                or self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be an int >= 1024, got {self.max_body_bytes!r}")


# ---------------------------------------------------------------- the engine loop

@dataclass(eq=False)
class Stream:
    """One prompt's way into the engine thread and back. The engine thread sets `request_id` and `samples`, and
    pushes events to `events` (shared by the prompts of one HTTP request): ("tokens", prompt_index, [(sample,
    new_ids, finish_reason | None, their logprobs | None), ...], the prompt's logprobs | None) after a step, the
    prompt's logprobs once, when all are computed; or ("error", message)."""
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    prompt_index: int = 0
    request_id: int | None = None
    samples: list = field(default_factory=list)
    num_seen: list[int] = field(default_factory=list)  # per sample: output tokens already pushed
    prompt_logprobs_sent: bool = False

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
        # Requests handed in and taken by the engine thread: each count has one writer, so reading both is safe.
        self._num_handed_in = self._num_taken = 0
        self._counts = dict(prompt_tokens=0, generation_tokens=0, finished=0, aborted=0)
        self._snapshot()  # /metrics has every row before the first request (the pool's size among them)
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
    def failure(self) -> str | None:
        """Why this engine can serve no more, or None: a model split over processes whose ranks have failed
        (chapter 11) is shut down for good, and every later step would only raise."""
        model = self.engine.model
        return (getattr(model, "failure", None) or "its ranks were shut down") if getattr(model, "closed", False) \
            else None

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
        except Exception as e:  # validated on arrival, so not expected; answered, and the loop runs on
            log.exception("add_request failed")
            stream.push(("error", f"the engine refused the request: {e}"))
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
            deltas, want = [], stream.params.logprobs is not None
            for i, sample in enumerate(stream.samples):
                seen = stream.num_seen[i]
                new = sample.output_ids[seen:]
                if new:
                    logprobs = sample.logprobs[seen:seen + len(new)] if want else None
                    deltas.append((i, list(new), sample.finish_reason, logprobs))
                    stream.num_seen[i] += len(new)
                    self._counts["generation_tokens"] += len(new)
            prompt_logprobs = self._prompt_logprobs(stream)
            if deltas or prompt_logprobs is not None:
                pushes.append((stream, ("tokens", stream.prompt_index, deltas, prompt_logprobs)))
            if all(s.finish_reason is not None for s in stream.samples):
                del self.streams[request_id]
                self._counts["finished"] += 1
        self._snapshot()  # first: a client that has its tokens finds /metrics up to date
        for stream, event in pushes:
            stream.push(event)

    @staticmethod
    def _prompt_logprobs(stream: Stream) -> list | None:
        """The prompt's logprobs (first None), once, as soon as the engine has scored every prompt token."""
        if stream.params.prompt_logprobs is None or stream.prompt_logprobs_sent:
            return None
        scored, need = stream.samples[0].prompt_logprobs, len(stream.prompt_ids) - 1
        if len(scored) < need:
            return None
        stream.prompt_logprobs_sent = True
        return [None, *scored[:need]]

    def _snapshot(self) -> None:
        s, engine = self.engine.scheduler, self.engine
        blocks = {} if engine.num_kv_blocks is None else dict(
            kv_blocks_used=engine.num_kv_blocks - engine.num_free_blocks, kv_blocks_total=engine.num_kv_blocks)
        self.stats = EngineStats(running=len(s.running), waiting=len(s.waiting), preemptions=s.num_preemptions,
                                 kv_slots_used=s.num_slots - len(s.free_slots), kv_slots_total=s.num_slots,
                                 **self._counts, **blocks)


# ---------------------------------------------------------------- the app

SMALL_BODY = 64 * 2**10  # bodies up to this size are prepared on their own pool, never behind a large one


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
    prompt_chars = max_prompt_chars(tokenizer, max_len)
    token_text = TokenText(tokenizer)
    loop = EngineLoop(engine)
    # Threads for the work that grows with a request (see the module's docstring). Small bodies and large ones
    # are prepared on pools of their own, so a queue of large prompts cannot delay a small one.
    pools = {"small": concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="mini_engine-prepare"),
             "large": concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mini_engine-prepare-large"),
             "output": concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="mini_engine-output")}

    async def off_loop(pool: str, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pools[pool], fn, *args)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if engine_thread:
            loop.start()
        try:
            yield
        finally:
            loop.stop()
            for pool in pools.values():
                pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="mini_engine", lifespan=lifespan)
    app.state.engine_loop = loop

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return e.response()

    async def check_key(request: Request) -> None:
        if config.api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), config.api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                           code="invalid_api_key")

    v1 = [Depends(check_key)]

    async def read(request: Request, model):
        """The body, at most `max_body_bytes` of it (413 beyond, unread when Content-Length says so), parsed as
        `model` off the event loop; the pool that prepares it is returned with it."""
        limit = config.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request body has {int(declared)} bytes, more than this server takes "
                                f"(max_body_bytes={limit})", code="request_too_large")
        raw = bytearray()
        try:
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > limit:
                    raise APIError(413, f"the request body is longer than this server takes (max_body_bytes="
                                        f"{limit})", code="request_too_large")
        except ClientDisconnect:
            raise APIError(400, "the client went away before sending the whole body") from None
        pool = "small" if len(raw) <= SMALL_BODY else "large"
        body = await off_loop(pool, parse, model, bytes(raw))
        if getattr(body, "model", None) is not None and body.model != config.model_name:
            raise APIError(404, f"The model {body.model!r} does not exist; this server serves "
                                f"{config.model_name!r}", "model", "model_not_found")
        return body, pool

    # ------------------------------------------------------------ checks and tokenizing (on the prepare pools)

    def encode(text: str, param: str) -> list[int]:
        if prompt_chars is not None and len(text) > prompt_chars:
            raise ValueError(f"{param} has {len(text)} characters, more than a prompt of fewer than max_model_len="
                             f"{max_len} tokens can have ({prompt_chars}); it was not tokenized")
        return tokenizer.encode(text)  # releases the GIL while it works (loading/tokenizer.py)

    def prepare(prompts: list, sampling: dict, max_tokens: int | None, param: str,
                echo: bool = False) -> list[tuple[Prompt, SamplingParams]]:
        """Each prompt tokenized and checked, with its SamplingParams; all are checked before any is submitted."""
        out = []
        for i, prompt in enumerate(prompts):
            try:
                ids = encode(prompt, param) if isinstance(prompt, str) else prompt
                if len(ids) >= max_len:  # said before the engine's checks, which look at every token
                    raise ValueError(f"prompt has {len(ids)} tokens; this model's maximum context length is "
                                     f"{max_len} tokens, which leaves room for at most {max_len - 1}")
                ids, _ = engine.validate(ids)
                room = max_len - len(ids)
                if max_tokens is not None and max_tokens > room:
                    raise ValueError(f"max_tokens={max_tokens}: this model's maximum context length is {max_len} "
                                     f"tokens and the prompt has {len(ids)}, which leaves {room}")
                params = SamplingParams(**sampling, max_tokens=room if max_tokens is None else max_tokens)
                ids, params = engine.validate(ids, params)
            except ValueError as e:  # the engine's messages start with the argument's name
                name = re.match(r"\w+", str(e)).group()
                where = f"prompt {i}: " if len(prompts) > 1 else ""
                raise APIError(400, where + str(e), param if name in ("prompt", param) else name) from None
            text = (prompt if isinstance(prompt, str) else tokenizer.decode(ids)) if echo else None
            out.append((Prompt(ids, text), params))
        return out

    def render(body: ChatBody) -> str:
        messages = [{"role": m.role, "content": m.text} for m in body.messages]
        size = sum(len(m["content"]) for m in messages)
        if prompt_chars is not None and size > prompt_chars:
            raise APIError(400, f"messages have {size} characters, more than a prompt of fewer than max_model_len="
                                f"{max_len} tokens can have ({prompt_chars})", "messages")
        try:
            return tokenizer.apply_chat_template(messages)
        except Exception as e:  # a conversation the model's template refuses (jinja raises its own errors)
            raise APIError(400, f"messages: the chat template failed: {e}", "messages") from None

    # ------------------------------------------------------------ routes

    @app.get("/health")
    async def health():
        if not loop.running:
            raise APIError(503, "the engine loop is not running", type="server_error")
        if loop.failure:
            raise APIError(503, f"the engine has failed: {loop.failure.splitlines()[0]}", type="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(loop.stats, loop.num_waiting),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=v1)
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "mini_engine", "max_model_len": max_len}]}

    def check_room(prompts: int) -> None:
        """A request of `prompts` prompts refused before any work when the queue cannot take it: 400 when it
        never could (more prompts than max_waiting), 503 when it could later or the engine has failed."""
        if loop.failure:
            raise APIError(503, f"the engine has failed and serves no more requests: {loop.failure.splitlines()[0]}",
                           code="engine_failed", type="server_error")
        if prompts > config.max_waiting:
            raise APIError(400, f"prompt: a batch of {prompts} prompts, more than this server queues at once "
                                f"(max_waiting={config.max_waiting})", "prompt")
        if loop.num_waiting + prompts > config.max_waiting:
            raise APIError(503, f"the server is busy: {loop.num_waiting} requests are waiting and this one brings "
                                f"{prompts} more (max_waiting={config.max_waiting}); retry later", code="overloaded",
                           type="server_error")

    @app.post("/v1/completions", dependencies=v1)
    async def completions(request: Request):
        body, pool = await read(request, CompletionBody)
        check_room(len(body.prompts))  # before tokenizing: a batch the queue cannot take costs nothing
        k, echo = body.logprobs, body.echo
        drop = echo and body.max_tokens == 0  # score the prompt only: one token is generated and dropped
        sampling = {**_sampling(body), "logprobs": None if drop else k, "prompt_logprobs": k if echo else None}
        prepared = await off_loop(pool, prepare, body.prompts, sampling, 1 if drop else body.max_tokens, "prompt",
                                  echo)
        return await respond(request, body, prepared, chat=False, top=k, echo=echo, drop_output=drop)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(request: Request):
        body, pool = await read(request, ChatBody)
        k = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        prompt = await off_loop(pool, render, body)
        prepared = await off_loop(pool, prepare, [prompt], {**_sampling(body), "logprobs": k}, max_tokens,
                                  "messages")
        return await respond(request, body, prepared, chat=True, top=k)

    async def respond(request: Request, body, prepared: list, chat: bool, top: int | None, echo: bool = False,
                      drop_output: bool = False):
        """Hand the prompts to the engine thread; answer whole, or stream."""
        check_room(len(prepared))  # again: others may have queued while these were tokenized
        events: asyncio.Queue = asyncio.Queue()
        streams = [Stream(prompt.ids, params, asyncio.get_running_loop(), events, i)
                   for i, (prompt, params) in enumerate(prepared)]
        for stream in streams:
            loop.submit(stream)
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": config.model_name}
        usage = body.stream and body.stream_options is not None and body.stream_options.include_usage
        responder = Responder(head, [p for p, _ in prepared], body.n, tokenizer, token_text, body.stops, chat,
                              top, echo, drop_output, usage)
        events_of = _events(loop, streams, events, responder)
        output = pools["output"]
        if body.stream:
            return StreamingResponse(_sse(events_of, responder, output), media_type="text/event-stream")
        return await _until_disconnected(request, _whole(events_of, responder, output))

    # ------------------------------------------------------------ vLLM's tokenizer routes

    @app.post("/tokenize", dependencies=v1)
    async def tokenize(request: Request):
        body, pool = await read(request, TokenizeBody)
        try:
            ids = await off_loop(pool, encode, body.prompt, "prompt")
        except ValueError as e:
            raise APIError(400, str(e), "prompt") from None
        return {"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": None}

    @app.post("/detokenize", dependencies=v1)
    async def detokenize(request: Request):
        body, pool = await read(request, DetokenizeBody)
        vocab = engine.model.config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens holds ids outside the vocabulary [0, {vocab}): {bad[:5]}", "tokens")
        return {"prompt": await off_loop(pool, tokenizer.decode, body.tokens)}

    @app.get("/tokenizer_info", dependencies=v1)
    async def tokenizer_info():
        def token(token_id):
            return None if token_id is None else token_text.text(token_id)
        return {"tokenizer_class": type(tokenizer).__name__, "eos_token": token(tokenizer.eos_token_id),
                "bos_token": token(getattr(tokenizer, "bos_token_id", None)), "pad_token": None,
                "chat_template": getattr(tokenizer, "chat_template", None), "model_max_length": max_len}

    return app


def _sampling(body) -> dict:
    return dict(temperature=body.temperature, top_p=body.top_p, top_k=0 if body.top_k == -1 else body.top_k,
                seed=body.seed, n=body.n, ignore_eos=body.ignore_eos)


async def _events(loop: EngineLoop, streams: list[Stream], events: asyncio.Queue, responder: Responder):
    """One answer's engine events, until every choice has ended. If this generator is left before every sample
    has finished in the engine (a client went away, or stop strings ended the choices), those requests are
    aborted: their KV blocks go back at once."""
    try:
        while not responder.done:
            event = await events.get()
            if event[0] == "error":
                raise APIError(500, event[1], type="server_error")
            yield event
    finally:
        for p in responder.unfinished_prompts():
            loop.abort(streams[p])


async def _whole(events_of, responder: Responder, pool) -> Response:
    run = asyncio.get_running_loop().run_in_executor
    async with contextlib.aclosing(events_of):
        async for event in events_of:
            await run(pool, responder.feed, event)
    return Response(await run(pool, responder.whole), media_type="application/json")


async def _until_disconnected(request: Request, work):
    """Run `work` (a non-streamed answer) unless the client goes away first: then it is cancelled, which aborts
    the request (see `_events`). After the body has been read, the next ASGI message is the disconnect."""
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


async def _sse(events_of, responder: Responder, pool):
    """Server-sent events in OpenAI's chunk shape (responses.py); an error after the status line has gone out
    travels as an event."""
    run = asyncio.get_running_loop().run_in_executor
    try:
        if start := responder.sse_start():
            yield start
        async with contextlib.aclosing(events_of):
            async for event in events_of:
                if text := await run(pool, responder.sse, event):
                    yield text
    except APIError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
    yield await run(pool, responder.sse_end)


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
