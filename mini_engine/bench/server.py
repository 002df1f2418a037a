"""`python -m mini_engine bench --workload server`: the OpenAI-compatible server under load against offline
`LLM.generate` on the same requests, in one run (chapter 09).

1. This process loads the model and tunes its product forms for every row bucket (1-256). The server starts in a
   subprocess (`loadtest.start_server`) with those choices (MINI_ENGINE_TUNED, see `autotune`), so both run the
   same forms and the server times none of them on the clock; bursts of 1, 2, 4, ... requests then warm it up.
2. Offline: the same chat requests through `LLM.generate` in this process, on an engine configured as the
   server's, every request queued at once, after a warm-up. Its requests per second is R, the rate this engine
   sustains on this workload.
3. The server through the official `openai` client (`loadtest.run_loadtest`, streamed): every request at once
   (the offline run's conditions, so the two throughputs compare HTTP, streaming and detokenising against none),
   Poisson arrivals at R, and at 2R, where requests must queue and none may be lost.

Every request asks for `max_tokens` tokens with ignore_eos, greedy, so all runs produce the same number of tokens.
The load generator runs in this process and shares the machine's cores with the server: on a small CPU its
streaming clients' work is part of what the server's throughput pays for.
"""
from __future__ import annotations

import contextlib
import os
import resource
import tempfile
import time
from pathlib import Path

import torch

from ..course.metrics import percentile
from ..sampling import SamplingParams

# Engine options the server's command line takes, by the LLM keyword they set.
SERVE_FLAGS = {"kv_cache": "--kv-cache", "max_num_seqs": "--max-num-seqs", "max_model_len": "--max-model-len",
               "num_kv_blocks": "--num-kv-blocks", "enable_prefix_caching": "--enable-prefix-caching",
               "prefix_cache": "--prefix-cache"}


def serve_args(device: str, dtype: str, engine_kwargs: dict) -> list[str]:
    """The `python -m mini_engine serve` arguments that configure its engine as `LLM(**engine_kwargs)`."""
    args = ["--device", device, "--dtype", dtype]
    for key, value in engine_kwargs.items():
        if key not in SERVE_FLAGS:
            raise ValueError(f"engine_kwargs: {key!r} is not a server option (it takes {sorted(SERVE_FLAGS)})")
        if key == "enable_prefix_caching":
            args.append("--enable-prefix-caching" if value else "--no-enable-prefix-caching")
        else:
            args += [SERVE_FLAGS[key], str(value)]
    return args


@contextlib.contextmanager
def tuned_env():
    """MINI_ENGINE_TUNED set, while inside, to a file of this process's tuned choices: a server started inside
    begins with them (`start_server` passes the environment on)."""
    from ..backends.cpu.autotune import TUNER
    before = os.environ.get("MINI_ENGINE_TUNED")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tuned.json"
        TUNER.save(path)
        os.environ["MINI_ENGINE_TUNED"] = str(path)
        try:
            yield path
        finally:
            if before is None:
                os.environ.pop("MINI_ENGINE_TUNED", None)
            else:
                os.environ["MINI_ENGINE_TUNED"] = before


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time (user + system, all threads) of this process, or of process `pid` (Linux /proc; NaN elsewhere)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime in clock ticks
    except (OSError, ValueError, IndexError):
        return float("nan")


def _with_cpu(fn, server_pid: int) -> dict:
    """fn()'s summary, with the CPU seconds this process (the offline engine, or the load generator's clients) and
    the server spent during it: on a small CPU they compete for the same cores."""
    own, served = cpu_seconds(), cpu_seconds(server_pid)
    result = fn()
    result["bench_cpu_s"], result["server_cpu_s"] = cpu_seconds() - own, cpu_seconds(server_pid) - served
    return result


def warm_server(url: str, prompts: list[str], up_to: int, max_tokens: int = 8) -> float:
    """Bursts of 1, 2, 4, ... `up_to` requests at once (short answers): every batch size and prompt chunk the
    measured runs bring is met once, so the server tunes its product forms now. Returns the seconds it took."""
    from ..serving.loadtest import run_loadtest

    t0, n = time.perf_counter(), 1
    while True:
        result = run_loadtest(url, float("inf"), n, prompts, max_tokens=max_tokens, progress=False)
        if result["errors"]:
            raise RuntimeError(f"warm-up requests failed: {result['error_messages']}")
        if n >= up_to:
            return time.perf_counter() - t0
        n = min(2 * n, up_to)


def run_offline(model, tok, prompts: list[str], max_tokens: int, engine_kwargs: dict, progress: bool) -> dict:
    """`LLM.generate` on the chat-templated prompts, all queued at once; the same summary keys as run_loadtest."""
    from ..engine import LLM

    llm = LLM.from_model(model, tok, **engine_kwargs)
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in prompts]
    llm.generate(ids[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # allocation and lazy init, untimed
    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    t0 = time.perf_counter()
    outs = llm.generate(ids, params, use_tqdm=progress)
    duration = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    summary = {"rate": float("nan"), "requests": len(outs), "completed": len(outs), "errors": 0,
               "duration_s": duration, "output_tokens": tokens, "output_tok_s": tokens / duration,
               "requests_s": len(outs) / duration, "error_messages": []}
    for name, values in (("ttft", [o.metrics.ttft_s for o in outs]), ("tpot", [o.metrics.tpot_s for o in outs]),
                         ("e2e", [o.metrics.e2e_s for o in outs])):
        summary[f"{name}_p50_s"], summary[f"{name}_p99_s"] = percentile(values, 50), percentile(values, 99)
    summary["engine"] = repr(llm)
    return summary


def format_server_table(rows: list[tuple[str, dict]], offline: dict, max_tokens: int) -> str:
    head = (f"{'run':<28} {'rate/s':>7} {'done':>5} {'errors':>6} {'tok/s':>7} {'offered':>8} {'vs offline':>10} "
            f"{'TTFT p50':>9} {'p99':>7} {'TPOT p50':>9} {'p99':>7} {'E2E p50':>8} {'p99':>7} {'CPU s: bench':>12} "
            f"{'server':>6}")
    lines = [head, "-" * len(head)]
    for name, r in rows:
        rate = r["rate"]
        offered = "-" if rate != rate or rate == float("inf") else f"{rate * max_tokens:.1f}"
        ms = [1000 * r[f"{m}_{q}_s"] for m in ("ttft", "tpot", "e2e") for q in ("p50", "p99")]
        lines.append(f"{name:<28} {'-' if rate != rate else f'{rate:.2f}':>7} {r['completed']:>5} {r['errors']:>6} "
                     f"{r['output_tok_s']:>7.1f} {offered:>8} {r['output_tok_s'] / offline['output_tok_s']:>9.2f}x "
                     + " ".join(f"{v:>{w}.0f}" for v, w in zip(ms, (9, 7, 9, 7, 8, 7)))
                     + f" {r.get('bench_cpu_s', float('nan')):>12.1f} {r.get('server_cpu_s', float('nan')):>6.1f}")
    return "\n".join(lines) + ("\n(latencies in ms; offered: the arrival rate times the tokens each request asks for; "
                              "CPU s: seconds of CPU this process (the offline engine, or the load generator's "
                              "streaming clients) and the server used during the run)")


def bench_server(requests: int = 32, max_tokens: int = 64, device: str = "cpu", dtype: str = "float32",
                 rate: float | None = None, engine_kwargs: dict | None = None, tune: bool = True,
                 progress: bool = True, print_fn=print) -> dict:
    """The whole measurement; prints one table and returns {"offline", "all_at_once", "rate", "double_rate"
    (run_loadtest dicts), "R", "warmup_s", "tune_s"}."""
    from ..course.hardware import describe_machine
    from ..backends.cpu import warm_up
    from ..loading.loader import load_model
    from ..serving.loadtest import PROMPTS, run_loadtest, start_server

    if requests < 1 or max_tokens < 1:
        raise ValueError("requests and max_tokens must be >= 1")
    if rate is not None and not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate!r}")
    engine_kwargs = dict(engine_kwargs or {})
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    common = {"max_tokens": max_tokens, "ignore_eos": True, "progress": progress}
    model, tok = load_model("smollm2-135m", device=device, dtype=dtype)
    t0 = time.perf_counter()
    if tune:
        warm_up(model, [1 << i for i in range(9)])
    tune_s = time.perf_counter() - t0
    with tuned_env():
        server = start_server(*serve_args(device, dtype, engine_kwargs))
    with server:
        warmup_s = warm_server(server.url, prompts, requests)
        pid = server.process.pid
        offline = _with_cpu(lambda: run_offline(model, tok, prompts, max_tokens, engine_kwargs, progress), pid)
        del model  # the server idled meanwhile
        r = rate or offline["requests_s"]
        at_once = _with_cpu(lambda: run_loadtest(server.url, float("inf"), requests, prompts, **common), pid)
        at_rate = _with_cpu(lambda: run_loadtest(server.url, r, requests, prompts, seed=0, **common), pid)
        at_double = _with_cpu(lambda: run_loadtest(server.url, 2 * r, requests, prompts, seed=1, **common), pid)
    rows = [("offline LLM.generate", offline), ("server, all at once", at_once), ("server at R", at_rate),
            ("server at 2R", at_double)]
    print_fn(describe_machine(device))
    print_fn(f"device={device} dtype={dtype} threads={torch.get_num_threads()}; {requests} chat requests "
             f"(loadtest.PROMPTS), {max_tokens} output tokens each (ignore_eos, greedy); engine: {offline['engine']}")
    print_fn(f"product forms tuned in {tune_s:.1f} s (the server started with the same choices); server warm-up "
             f"(bursts of 1, 2, 4, ... {requests} requests): {warmup_s:.1f} s; neither is in any row")
    print_fn(format_server_table(rows, offline, max_tokens))
    print_fn(f"R = {r:.2f} requests/s ({'given' if rate else 'what offline LLM.generate sustained on these requests'})")
    print_fn(f"server, all at once / offline: {at_once['output_tok_s'] / offline['output_tok_s']:.2f}x tokens/s "
             "(target: within 10%)")
    print_fn(f"server at R: {at_rate['output_tok_s'] / offline['output_tok_s']:.2f}x offline tokens/s, "
             f"{at_rate['completed']}/{requests} answered, {at_rate['errors']} errors; at 2R: "
             f"{at_double['output_tok_s'] / offline['output_tok_s']:.2f}x, {at_double['completed']}/{requests} answered, "
             f"{at_double['errors']} errors (target: every request answered, 0 errors)")
    client = at_once["bench_cpu_s"] / at_once["duration_s"]
    print_fn(f"while all requests streamed at once, the load generator's clients kept {client:.1f} of the machine's "
             f"{os.cpu_count()} cores busy and the server {at_once['server_cpu_s'] / at_once['duration_s']:.1f}; "
             f"offline, the engine alone used {offline['bench_cpu_s'] / offline['duration_s']:.1f}")
    for name, res in rows[1:]:
        for message in res["error_messages"]:
            print_fn(f"{name}: error: {message}")
    return {"offline": offline, "all_at_once": at_once, "rate": at_rate, "double_rate": at_double, "R": r,
            "warmup_s": warmup_s, "tune_s": tune_s}
