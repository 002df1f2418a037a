"""Load the server like real users do (chapter 09): `python -m mini_engine loadtest --url ... --rate R --requests N`.

Requests arrive as a Poisson process (exponential gaps, seeded) at `rate` per second, whatever the server's pace,
so a rate above what it sustains makes requests queue; each one streams through the official `openai` client, so
TTFT is the time to the first text a user would see. `run_loadtest` measures one rate and returns a dict,
`sweep` several (the throughput-latency curve), `start_server` runs `python -m mini_engine serve` in a
subprocess for tests and notebooks. `run_hostile_loadtest` (`loadtest --hostile N`) times honest streams alone
and then while hostile clients send oversized, malformed and abandoned requests, and checks what the server
holds after it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from ..course.metrics import percentile

# Chat questions of mixed length; request i asks PROMPTS[i % len(PROMPTS)].
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Give three tips for learning a new programming language.",
    "What is the difference between a list and a tuple in Python?",
    "Summarise the plot of Romeo and Juliet in a few lines.",
    "Name five fruits that are red.",
    "How does a bicycle stay upright when it moves? Answer briefly, for a curious child.",
]


@dataclass
class _Result:
    start: float
    first: float | None = None   # first text received
    end: float | None = None
    num_tokens: int = 0
    error: str | None = None


async def _one(client, model: str, prompt: str, max_tokens: int, ignore_eos: bool) -> _Result:
    result = _Result(time.perf_counter())
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": ignore_eos})
        async for chunk in stream:
            if chunk.usage is not None:
                result.num_tokens = chunk.usage.completion_tokens
            if result.first is None and chunk.choices and chunk.choices[0].delta.content:
                result.first = time.perf_counter()
        result.end = time.perf_counter()
    except Exception as e:  # counted, not raised: a load test reports how many requests failed and why
        result.error = f"{type(e).__name__}: {e}"
    return result


async def loadtest(url: str, rate: float, num_requests: int, prompts: list[str] | None = None,
                   max_tokens: int = 64, api_key: str | None = None, model: str | None = None,
                   ignore_eos: bool = True, seed: int = 0, progress: bool = True) -> dict:
    """The async form of `run_loadtest` (for code already inside an event loop)."""
    from openai import APIError, AsyncOpenAI
    from tqdm.auto import tqdm

    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s (inf: all at once), got {rate!r}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests!r}")
    prompts = prompts or PROMPTS
    # max_retries=0: a refused request is an error to count, not one to hide behind retries.
    client = AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key or "none", max_retries=0, timeout=600)
    async with client:
        try:
            model = model or (await client.models.list()).data[0].id
        except APIError as e:  # nothing listening, or a wrong key: say so once, not once per request
            raise ValueError(f"url: the server at {url} did not list its models: {e}") from None
        rng = random.Random(seed)
        bar = tqdm(total=num_requests, desc=f"rate {rate:g}/s", disable=not progress)
        tasks, t0 = [], time.perf_counter()
        for i in range(num_requests):
            task = asyncio.ensure_future(_one(client, model, prompts[i % len(prompts)], max_tokens, ignore_eos))
            task.add_done_callback(lambda _: bar.update(1))
            tasks.append(task)
            if i + 1 < num_requests and rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals: exponential gaps
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
    return _summary(results, rate, duration)


def _summary(results: list[_Result], rate: float, duration: float) -> dict:
    ok = [r for r in results if r.error is None]
    ttft = [r.first - r.start for r in ok if r.first is not None]
    tpot = [(r.end - r.first) / (r.num_tokens - 1) for r in ok if r.first is not None and r.num_tokens > 1]
    e2e = [r.end - r.start for r in ok]
    tokens = sum(r.num_tokens for r in ok)
    summary = {"rate": rate, "requests": len(results), "completed": len(ok), "errors": len(results) - len(ok),
               "duration_s": duration, "output_tokens": tokens, "output_tok_s": tokens / duration,
               "requests_s": len(ok) / duration}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        summary[f"{name}_p50_s"], summary[f"{name}_p99_s"] = percentile(values, 50), percentile(values, 99)
    summary["error_messages"] = sorted({r.error for r in results if r.error})
    return summary


def run_to_end(work):
    """Run the coroutine `work` to its end from plain code, in a notebook too (its event loop is left alone)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(work)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # inside a running loop (Jupyter): run beside it
        return pool.submit(asyncio.run, work).result()


def run_loadtest(url: str, rate: float, num_requests: int, prompts: list[str] | None = None, **kwargs) -> dict:
    """Send `num_requests` streamed chat requests at Poisson arrivals of `rate` per second (float('inf'): all at
    once) to the server at `url`; wait for all of them. Returns rate, requests, completed, errors (and
    error_messages), duration_s, output_tokens, output_tok_s, requests_s, and ttft/tpot/e2e p50 and p99 in
    seconds. Keyword arguments: max_tokens (64), api_key, model (the server's first), ignore_eos (True, so every
    request generates max_tokens), seed, progress. Works from a notebook too (its event loop is left alone)."""
    return run_to_end(loadtest(url, rate, num_requests, prompts, **kwargs))


def sweep(url: str, rates: list[float], num_requests: int, **kwargs) -> list[dict]:
    """`run_loadtest` at each rate in turn: the points of the throughput-latency curve."""
    return [run_loadtest(url, rate, num_requests, **kwargs) for rate in rates]


def format_table(results: list[dict]) -> str:
    head = (f"{'rate/s':>7} {'done':>5} {'errors':>6} {'tok/s':>7} {'req/s':>6} {'TTFT p50':>9} {'p99':>7} "
            f"{'TPOT p50':>9} {'p99':>7} {'E2E p50':>8} {'p99':>7}")
    rows = [head, "-" * len(head)]
    for r in results:
        ms = [1000 * r[f"{m}_{q}_s"] for m in ("ttft", "tpot", "e2e") for q in ("p50", "p99")]
        rows.append(f"{r['rate']:>7g} {r['completed']:>5} {r['errors']:>6} {r['output_tok_s']:>7.1f} "
                    f"{r['requests_s']:>6.2f} " + " ".join(f"{v:>{w}.0f}" for v, w in zip(ms, (9, 7, 9, 7, 8, 7))))
    return "\n".join(rows) + "\n(latencies in ms)"


def plot_sweep(results: list[dict], path: str | None = None):
    """The throughput-latency curve: output tok/s against the offered rate, and latency against throughput.
    Saved to `path` when given; returns the figure."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    rates, tok_s = [r["rate"] for r in results], [r["output_tok_s"] for r in results]
    left.plot(rates, tok_s, "o-")
    left.set(xlabel="offered load (requests/s)", ylabel="output tokens/s", title="throughput")
    for key, label in (("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "TTFT p99"), ("e2e_p50_s", "end-to-end p50")):
        right.plot(tok_s, [r[key] for r in results], "o-", label=label)
    right.set(xlabel="output tokens/s", ylabel="seconds", title="latency vs throughput")
    right.legend()
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig


# ---------------------------------------------------------------- a hostile load

# Requests the server must refuse, each with the statuses that count as refusing it. An oversized body is 413, or
# 400 when the server's body limit is above it (then its prompt is too long to tokenize); a prompt too long to
# tokenize is 400, or 413 when the server's body limit is below it.
_MALFORMED = [b'{"prompt": "hi", "max_tokens": 4', b'{"prompt": "hi", "max_tokens": 4, "frobnicate": true}',
              b'{"prompt": "hi", "seed": 1208925819614629174706176}', b'{"prompt": "hi", "logprobs": 99}',
              b'{"prompt": [1.5, 2.5]}', b'{"prompt": "hi", "max_tokens": -3}', b'{"prompt": "hi", "suffix": "!"}',
              b'{"prompt": "hi", "temperature": "hot"}', b'["not", "an", "object"]']
_EXPECTED = {"oversized": (413, 400), "long_prompt": (400, 413), "malformed": (400,)}
_ATTACKS = ["oversized", "malformed", "abandoned_stream", "long_prompt", "abandoned_whole", "half_body",
            "malformed", "slow_reader"]


async def _attack(http, url: str, kind: str, i: int, bodies: dict) -> tuple[str, int | None]:
    """One hostile request; returns (kind, the status it got, or None for a client that left without one)."""
    import httpx

    completions = url + "/v1/completions"
    headers = {"content-type": "application/json"}
    if kind in ("oversized", "long_prompt", "malformed"):
        body = bodies[kind] if kind != "malformed" else _MALFORMED[i % len(_MALFORMED)]
        r = await http.post(completions, content=body, headers=headers, timeout=60)
        return kind, r.status_code
    # max_tokens None: the rest of the context, so that the request is still running when its client leaves.
    stream_body = {"prompt": "Once upon a time", "max_tokens": None, "ignore_eos": True, "stream": True}
    if kind in ("abandoned_stream", "slow_reader"):  # leaves after two events, or reads one event a second
        async with http.stream("POST", completions, json=stream_body, timeout=60) as r:
            events = 0
            async for line in r.aiter_lines():
                events += bool(line)
                if kind == "slow_reader":
                    await asyncio.sleep(1.0)
                if events == 2:
                    break
        return kind, None
    if kind == "abandoned_whole":  # gives up waiting for a whole answer
        with contextlib.suppress(httpx.TimeoutException):
            await http.post(completions, json={**stream_body, "stream": False}, timeout=0.5)
        return kind, None
    # half_body: promises a body, sends part of it and goes away
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: 100000\r\n\r\n{\"prompt\": \"aaaa")
    await writer.drain()
    await asyncio.sleep(0.3)
    writer.close()
    return kind, None


async def _metrics(http, url: str) -> dict[str, float]:
    text = (await http.get(url + "/metrics", timeout=10)).text
    return {name.removeprefix("mini_engine_"): float(value) for name, value in
            (line.split(" ") for line in text.splitlines() if line and not line.startswith("#"))}


async def hostile_loadtest(url: str, honest: int = 4, hostile: int = 3, max_tokens: int = 64,
                           api_key: str | None = None, model: str | None = None,
                           oversized_bytes: int = 20 * 2**20, idle_timeout: float = 60) -> dict:
    """The async form of `run_hostile_loadtest`."""
    import httpx
    from openai import AsyncOpenAI

    if honest < 1 or hostile < 1:
        raise ValueError(f"honest and hostile must be >= 1 clients, got {honest} and {hostile}")
    url = url.rstrip("/")
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    client = AsyncOpenAI(base_url=url + "/v1", api_key=api_key or "none", max_retries=0, timeout=600)
    bodies = {"oversized": json.dumps({"prompt": "a" * oversized_bytes}).encode(),  # built once: not timed
              "long_prompt": json.dumps({"prompt": "lorem ipsum " * 80_000}).encode()}

    async def honest_run() -> dict:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(client, model, PROMPTS[i % len(PROMPTS)], max_tokens, True)
                                         for i in range(honest)))
        return _summary(results, float("inf"), time.perf_counter() - t0)

    async with client, httpx.AsyncClient(headers=headers) as http:
        try:
            model = model or (await client.models.list()).data[0].id
        except Exception as e:  # nothing listening, or a wrong key: say so once
            raise ValueError(f"url: the server at {url} did not list its models: {e}") from None
        await honest_run()  # warm-up: the first requests of a fresh server are slower
        before = await _metrics(http, url)
        quiet = await honest_run()
        stop, outcomes, health = asyncio.Event(), [], []

        async def attacker(worker: int) -> None:
            i = worker  # worker w sends attacks w, w + hostile, ...: together they send every kind
            while not stop.is_set() or i < len(_ATTACKS):
                kind = _ATTACKS[i % len(_ATTACKS)]
                try:
                    outcomes.append(await _attack(http, url, kind, i, bodies))
                except Exception as e:  # the attacker's own failure is recorded, not raised
                    outcomes.append((kind, f"{type(e).__name__}: {e}"))
                i += hostile

        async def prober() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                r = await http.get(url + "/health", timeout=60)
                health.append((time.perf_counter() - t0, r.status_code))
                await asyncio.sleep(0.2)

        tasks = [asyncio.ensure_future(attacker(w)) for w in range(hostile)] + [asyncio.ensure_future(prober())]
        await asyncio.sleep(1.0)  # the attack is under way before the honest clients start
        attacked = await honest_run()
        stop.set()
        await asyncio.gather(*tasks)
        deadline = time.monotonic() + idle_timeout
        while True:  # every request ends: finished, or aborted because its client left
            after = await _metrics(http, url)
            held = after.get("kv_blocks_used", after["kv_slots_used"])
            if (after["requests_running"] == after["requests_waiting"] == held == 0
                    or time.monotonic() > deadline):
                break
            await asyncio.sleep(0.1)
    refused = {kind: [status for k, status in outcomes if k == kind] for kind in _EXPECTED}
    return {"quiet": quiet, "attacked": attacked,
            "hostile_requests": len(outcomes), "outcomes": outcomes, "refused": refused,
            "all_refused": all(status in _EXPECTED[kind] for kind, codes in refused.items() for status in codes),
            "abandoned": sum(k not in _EXPECTED for k, _ in outcomes),
            "health_max_s": max(t for t, _ in health), "health_ok": all(code == 200 for _, code in health),
            "kv_blocks_held": held, "requests_left": after["requests_running"] + after["requests_waiting"],
            "aborted": after["requests_aborted_total"] - before["requests_aborted_total"]}


def run_hostile_loadtest(url: str, honest: int = 4, hostile: int = 3, max_tokens: int = 64, **kwargs) -> dict:
    """Honest streaming clients, quiet and then under attack: `honest` chat streams of `max_tokens` tokens (EOS
    ignored) run once alone and once while `hostile` clients send, in turn, oversized bodies, prompts too long to
    tokenize, malformed and out-of-range requests, streams and whole requests they abandon, bodies they never
    finish and streams they read one event a second. Returns the two runs' summaries ("quiet", "attacked", as
    `run_loadtest`'s), every hostile request's (kind, status) in "outcomes" (None: the client left), "all_refused"
    (each refused request got its 4xx), "health_max_s" (the slowest /health during the attack), and, once the
    server is idle again, "kv_blocks_held" (0: every block came back) and "aborted". Keyword arguments: api_key,
    model, oversized_bytes (20 MiB), idle_timeout (60 s)."""
    return run_to_end(hostile_loadtest(url, honest, hostile, max_tokens, **kwargs))


def format_hostile(result: dict, max_ratio: float = 1.5) -> str:
    """The quiet run beside the run under attack, and what the attack got."""
    quiet, attacked = result["quiet"], result["attacked"]
    rows = [f"{'honest streams':<22} {'quiet':>9} {'attacked':>9} {'ratio':>7}"]
    for key, label in (("tpot_p50_s", "TPOT p50 (ms)"), ("tpot_p99_s", "TPOT p99 (ms)"),
                       ("ttft_p50_s", "TTFT p50 (ms)"), ("e2e_p99_s", "E2E p99 (ms)")):
        rows.append(f"{label:<22} {1000 * quiet[key]:>9.1f} {1000 * attacked[key]:>9.1f} "
                    f"{attacked[key] / quiet[key]:>6.2f}x")
    rows.append(f"{'completed':<22} {quiet['completed']:>9} {attacked['completed']:>9}")
    kinds = {}
    for kind, status in result["outcomes"]:
        kinds.setdefault(kind, {}).setdefault("left" if status is None else str(status), 0)
        kinds[kind]["left" if status is None else str(status)] += 1
    rows.append(f"hostile requests: {result['hostile_requests']} (" + "; ".join(
        f"{kind} " + ", ".join(f"{status}: {count}" for status, count in sorted(codes.items()))
        for kind, codes in sorted(kinds.items())) + ")")
    ratio = attacked["tpot_p50_s"] / quiet["tpot_p50_s"]
    rows += [f"every refused request got its 4xx: {'yes' if result['all_refused'] else 'NO'}; slowest /health: "
             f"{result['health_max_s']:.2f} s; requests aborted: {result['aborted']:g}",
             f"after the attack: {result['kv_blocks_held']:g} KV blocks held, {result['requests_left']:g} requests "
             "left",
             f"honest TPOT under attack within {max_ratio:g}x of quiet: {'yes' if ratio <= max_ratio else 'NO'} "
             f"({ratio:.2f}x)"]
    return "\n".join(rows)


# ---------------------------------------------------------------- the server in a subprocess

def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m mini_engine serve ...` running in a subprocess: `.url`, `.stop()`; a context manager. Its output
    goes to a log file (`.log_path`), shown in the error if it fails to start."""

    def __init__(self, args: list[str], host: str, port: int, timeout: float):
        import httpx

        self.url = f"http://{host}:{port}"
        log = tempfile.NamedTemporaryFile("w+", prefix="mini_engine-serve-", suffix=".log", delete=False)
        self.log_path = log.name
        command = [sys.executable, "-m", "mini_engine", "serve", "--host", host, "--port", str(port), *args]
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not answer /health within {timeout} s:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self, timeout: float = 15) -> None:
        """Interrupt the server (as Ctrl-C does) and wait; kill it if it does not go."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(*args: str, model: str = "smollm2-135m", host: str = "127.0.0.1", port: int | None = None,
                 timeout: float = 180) -> ServerProcess:
    """Start `python -m mini_engine serve --model MODEL ARGS...` (e.g. "--max-model-len", "512") on a free port
    and return once /health answers: `server.url`, `server.stop()`."""
    return ServerProcess(["--model", model, *args], host, port or free_port(host), timeout)
