"""Command line: `python -m mini_engine demo | generate "prompt" | bench | serve | loadtest | tuning`."""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

from .course.devices import default_device, default_dtype


def _stream_printer(tok):
    """Print tokens as they arrive; decode the whole answer each time so multi-byte characters come out whole."""
    ids, shown = [], [""]

    def on_token(token):
        ids.append(token)
        text = tok.decode(ids)
        sys.stdout.write(text[len(shown[0]):])
        sys.stdout.flush()
        shown[0] = text
    return on_token


def cmd_generate(args) -> None:
    import mini_engine as me
    model, tok = me.load_model(args.model, device=args.device, dtype=args.dtype, quantization=args.quantization)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": args.prompt}]))
    params = me.SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                               max_tokens=args.max_tokens, seed=args.seed)
    if args.naive and args.compile:
        raise ValueError("--naive and --compile: the compiled step is the KV-cached decode step; pick one")
    loop = me.generate_naive if args.naive else functools.partial(me.generate_cached, compile=args.compile)
    if args.compile:  # a one-time cost: done before the clock starts, and reported
        t0 = time.perf_counter()
        loop(model, prompt, 2)
        print(f"[compiled the decode step in {time.perf_counter() - t0:.1f} s]")
    t0 = time.perf_counter()
    out = loop(model, prompt, args.max_tokens, params, eos_token_id=tok.eos_token_id, on_token=_stream_printer(tok))
    dt = time.perf_counter() - t0
    kind = "naive (no cache)" if args.naive else "KV cache, compiled step" if args.compile else "KV cache"
    print(f"\n[{len(out)} tokens in {dt:.2f} s = {len(out) / dt:.1f} tok/s, {kind}, {args.device} {args.dtype}]")


def cmd_demo(args) -> None:
    import mini_engine as me
    t0 = time.perf_counter()
    model, tok = me.load_model(args.model, device=args.device, dtype=args.dtype, quantization=args.quantization)
    print(f"loaded {args.model}: {model.config.num_params / 1e6:.1f}M parameters, "
          f"{model.config.num_layers} layers, on {args.device} ({args.dtype}) in {time.perf_counter() - t0:.1f} s")
    question = "What is the capital of France? Answer in one sentence."
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]))
    print(f"\nuser: {question}\nprompt: {len(prompt)} tokens")
    for name, loop in [("naive (full recompute)", me.generate_naive), ("KV cache", me.generate_cached)]:
        print(f"\n{name}: ", end="")
        t0 = time.perf_counter()
        out = loop(model, prompt, 48, eos_token_id=tok.eos_token_id, on_token=_stream_printer(tok))
        dt = time.perf_counter() - t0
        print(f"\n  -> {len(out)} tokens, {len(out) / dt:.1f} tok/s")


def cmd_bench(args) -> None:
    from .bench.runs import DEFAULT_SERVING_RUNGS, SERVING_RUNGS, SINGLE_STREAM_RUNGS, bench, bench_serving
    rungs = args.rung or []
    serving = [r for r in rungs if r in SERVING_RUNGS]
    single = [r for r in rungs if r in SINGLE_STREAM_RUNGS]
    if args.quantization and (args.ladder or args.workload in ("paging", "prefix", "radix", "speculative", "server")):
        raise ValueError(f"--quantization adds rows to the single and serving workloads, not "
                         f"{'--ladder' if args.ladder else '--workload ' + args.workload}")
    if args.ladder or args.workload == "server":
        for name in ("requests", "batch", "sample", "tokens"):
            value = getattr(args, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name} must be >= 1")
    if args.ladder:
        from .bench.ladder import RUNGS as LADDER_RUNGS
        from .bench.ladder import bench_ladder
        if rungs or args.workload != "single":
            raise ValueError("--ladder runs its own workload up every rung; it takes no --rung or --workload")
        bench_ladder(args.device, args.dtype, requests=args.requests, batch=args.batch, sample=args.sample, k=args.k,
                     rungs=[r for r in LADDER_RUNGS if not (args.no_hf and r == "hf")],
                     plot=args.plot or "build/ladder.png")
        return
    if args.workload == "server":
        from .bench.server import bench_server
        if rungs:
            raise ValueError("--workload server measures the HTTP server against offline LLM.generate; no --rung")
        bench_server(32 if args.requests is None else args.requests, 64 if args.tokens is None else args.tokens,
                     args.device, args.dtype, rate=args.rate)
        return
    if args.workload == "radix":
        from .bench.radix import bench_radix
        if rungs:
            raise ValueError("--workload radix compares the two prefix caches and two admission orders; no --rung")
        if args.scale < 1 or (args.batch is not None and args.batch < 1):
            raise ValueError("--scale and --batch must be >= 1")
        if args.num_kv_blocks is not None and args.num_kv_blocks < 1:
            raise ValueError(f"--num-kv-blocks must be >= 1, got {args.num_kv_blocks}")
        bench_radix(args.device, args.dtype, scale=args.scale, batch=args.batch or 4,
                    num_kv_blocks=args.num_kv_blocks)
        return
    # Paging, by default at two KV memories: the contiguous default's 16 slots, and 4 slots, where memory (not the
    # number of requests) bounds the batch.
    slot_counts = (16, 4) if args.batch is None else (args.batch,)
    for name, default in (("requests", 64), ("batch", 16), ("tokens", 128)):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.workload == "paging":
        from .bench.paging import bench_paging
        if rungs:
            raise ValueError("--workload paging compares the two KV caches; it takes no --rung")
        if args.requests < 1 or args.batch < 1 or args.max_model_len < 2:
            raise ValueError("--requests and --batch must be >= 1, --max-model-len >= 2")
        for slots in slot_counts:
            bench_paging(args.requests, slots, args.device, args.dtype, max_model_len=args.max_model_len)
    elif args.workload == "prefix":
        from .bench.prefix import bench_prefix
        if rungs:
            raise ValueError("--workload prefix compares prefix caching on and off; it takes no --rung")
        if args.requests < 1 or args.batch < 1 or args.prefix_len < 1 or args.question_len < 1:
            raise ValueError("--requests, --batch, --prefix-len and --question-len must be >= 1")
        bench_prefix(args.requests, args.device, args.dtype, prefix_len=args.prefix_len,
                     question_len=args.question_len, batch=args.batch)
    elif args.workload == "speculative":
        from .bench.speculative import bench_speculative
        if rungs:
            raise ValueError("--workload speculative compares n-gram speculation on and off; it takes no --rung")
        if args.batch < 1 or args.tokens < 1 or args.k < 1:
            raise ValueError("--batch, --tokens and --k must be >= 1")
        bench_speculative(args.device, args.dtype, batches=(1, args.batch), max_tokens=args.tokens, k=args.k)
    elif serving or args.workload == "serving":
        if single:
            raise ValueError(f"--rung {single}: one-stream rungs; the serving workload takes {list(SERVING_RUNGS)}")
        if args.requests < 1 or args.batch < 1:
            raise ValueError("--requests and --batch must be >= 1")
        bench_serving(serving or list(DEFAULT_SERVING_RUNGS), args.requests, args.batch, args.device, args.dtype,
                      with_hf=not args.no_hf, kv_cache=args.kv_cache, quantization=args.quantization)
    else:
        bench(single or list(SINGLE_STREAM_RUNGS), args.tokens, args.device, args.dtype, with_hf=not args.no_hf,
              hf_dtype=args.hf_dtype, quantization=args.quantization)


def cmd_serve(args) -> None:
    import mini_engine as me
    from .serving.server import ServerConfig, serve
    config = ServerConfig(model_name=args.served_model_name or args.model, api_key=args.api_key,
                          max_waiting=args.max_waiting, max_body_bytes=args.max_body_bytes)  # checked before loading
    llm = me.LLM(args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
                 kv_cache=args.kv_cache,
                 max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks,
                 enable_prefix_caching=args.enable_prefix_caching, prefix_cache=args.prefix_cache,
                 tensor_parallel_size=args.tensor_parallel_size)
    print(llm, flush=True)
    with llm:  # a tensor-parallel engine's ranks end with the server
        serve(llm, args.host, args.port, config)


def cmd_loadtest(args) -> None:
    from .serving.loadtest import format_hostile, format_table, plot_sweep, run_hostile_loadtest, run_loadtest
    if args.hostile:
        print(format_hostile(run_hostile_loadtest(args.url, honest=args.honest, hostile=args.hostile,
                                                  max_tokens=args.max_tokens, api_key=args.api_key)))
        return
    rates = [float(r) for r in args.sweep.split(",")] if args.sweep else [args.rate]
    results = [run_loadtest(args.url, rate, args.requests, max_tokens=args.max_tokens, api_key=args.api_key,
                            seed=args.seed) for rate in rates]
    print(format_table(results))
    for r in results:
        for message in r["error_messages"]:
            print(f"rate {r['rate']:g}: error: {message}")
    if args.plot:
        plot_sweep(results, args.plot)
        print(f"saved {args.plot}")


def with_default_dtype(args: argparse.Namespace) -> argparse.Namespace:
    """Fill in --dtype, when none was given, with the device's: `mini_engine.default_dtype`."""
    if getattr(args, "device", None) is not None and args.dtype is None:
        try:
            args.dtype = default_dtype(args.device)
        except (AssertionError, RuntimeError) as e:  # torch without CUDA, or no GPU: its message says which
            raise ValueError(f"--device {args.device}: {e}") from e
    return args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mini_engine", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default="smollm2-135m", help="embedded name, .gguf file or HF folder")
    common.add_argument("--device", default=default_device())
    common.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="default: float32 on a CPU; on a GPU bfloat16 from compute capability 8.0, float16 "
                             "below (T4, V100)")
    common.add_argument("--quantization", default=None, choices=["int4", "int4_compact", "int8"],
                        help="weight-only quantized products (int4: the GGUF's Q4_1 blocks repacked; chapter 10); "
                             "bench: the quantized rows beside the float ones")
    sub.add_parser("demo", parents=[common], help="load the embedded model and chat, naive vs cached")
    g = sub.add_parser("generate", parents=[common], help="stream a chat answer")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--naive", action="store_true", help="full recompute instead of the KV cache")
    g.add_argument("--compile", action="store_true",
                   help="run each decode step as one compiled graph (compiles first: about a minute on a CPU)")
    b = sub.add_parser("bench", parents=[common], help="benchmark table: mini_engine rungs vs HF transformers")
    b.add_argument("--rung", action="append",
                   choices=["naive", "cached", "compiled", "static", "dynamic", "continuous", "compiled-engine",
                            "compiled-engine-max-autotune"],
                   help="repeatable; default: naive, cached and compiled (one stream), or the three policies "
                        "(serving); compiled-engine: continuous with compiled decode steps, and "
                        "compiled-engine-max-autotune with Inductor's own weight products too (serving, by name)")
    b.add_argument("--ladder", action="store_true",
                   help="one workload (a shared system prompt, input-grounded and open requests, mixed lengths) up "
                        "every rung: HF batched generate, naive, cached, compiled, continuous batching, paged, + prefix "
                        "caching, + n-gram speculation, + compiled engine step; one table and a bar chart (--plot)")
    b.add_argument("--workload", choices=["single", "serving", "paging", "prefix", "radix", "speculative", "server"],
                   default="single",
                   help="single: one chat prompt, one stream; serving: many requests (implied by a policy rung); "
                        "paging: the serving workload on the contiguous vs the paged KV cache at equal memory, "
                        "and one decode step from each; prefix: a shared system prompt with prefix caching on "
                        "vs off (TTFT, throughput) and the serving workload on vs off; radix: a conversation, few-shot and "
                        "branching, on hashed blocks vs the radix tree and in arrival vs cache-aware order (reuse, "
                        "TTFT, throughput); speculative: n-gram "
                        "speculation on vs off at batch 1 and --batch, input-grounded and open chat; server: the "
                        "OpenAI server (a subprocess) against offline LLM.generate on the same requests, all at "
                        "once, at the rate the engine sustains and at twice it")
    b.add_argument("--tokens", type=int, default=None, help="single: new tokens of the one request (default 128); "
                   "speculative: output tokens per request (default 128; 48 is enough); server: per request "
                   "(default 64)")
    b.add_argument("--k", type=int, default=4, help="speculative: drafts per round")
    b.add_argument("--requests", type=int, default=None, help="serving: number of requests (lengths 16-256; "
                   "default 64); ladder: default 32 on a CPU, 256 on a GPU; server: default 32")
    b.add_argument("--batch", type=int, default=None,
                   help="serving: max_num_seqs, and HF's batch size (default 16); paging: the contiguous slots, whose "
                        "memory the paged pool gets, and the decode step's batch (default: 16, then 4); ladder: the "
                        "contiguous slots and HF's batch (default 16 on a CPU, 64 on a GPU)")
    b.add_argument("--sample", type=int, default=None,
                   help="ladder: requests the one-at-a-time rungs (naive, cached, compiled) run (default 2 on a CPU)")
    b.add_argument("--plot", default=None, help="ladder: save the bar chart here (default build/ladder.png)")
    b.add_argument("--rate", type=float, default=None,
                   help="server: the sustained rate R in requests/s (default: what offline LLM.generate sustains)")
    b.add_argument("--max-model-len", type=int, default=2048, help="paging: max_model_len of both engines")
    b.add_argument("--prefix-len", type=int, default=1024, help="prefix: tokens of the shared prefix")
    b.add_argument("--question-len", type=int, default=32, help="prefix: each request's own tokens")
    b.add_argument("--scale", type=int, default=1, help="radix: multiplies the users, questions and branches "
                   "(default 1: 32 requests in all)")
    b.add_argument("--num-kv-blocks", type=int, default=None, help="radix: the pool's blocks (default: max_num_seqs "
                   "requests of the longest; a smaller pool makes the caches evict)")
    b.add_argument("--kv-cache", choices=["paged", "contiguous"], default="paged",
                   help="serving: our engine's KV cache (chapter 04 measured the contiguous one)")
    b.add_argument("--no-hf", action="store_true", help="skip the HF transformers rows")
    b.add_argument("--hf-dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="single: HF's dtype when it should differ from --dtype (e.g. our bf16 vs HF fp32)")
    s = sub.add_parser("serve", parents=[common], help="OpenAI-compatible HTTP server (/v1/completions, "
                       "/v1/chat/completions, /v1/models, /health, /metrics)")
    s.add_argument("--host", default="127.0.0.1", help="127.0.0.1: this machine only; 0.0.0.0 opens it to the network")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--kv-cache", choices=["paged", "contiguous"], default="paged")
    s.add_argument("--max-num-seqs", type=int, default=None, help="sequences in the running batch")
    s.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens of one request")
    s.add_argument("--num-kv-blocks", type=int, default=None, help="paged: blocks in the pool")
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="paged: share cached prompt blocks (default: on with the paged cache)")
    s.add_argument("--prefix-cache", choices=["hashed", "radix"], default="hashed",
                   help="hashed: vLLM's hashed full blocks; radix: SGLang's radix tree, matches end at any token")
    s.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks the model is split over, each a process (chapter 11); must divide its heads")
    s.add_argument("--max-waiting", type=int, default=256, help="queued requests beyond which new ones get 503")
    s.add_argument("--max-body-bytes", type=int, default=4 * 2**20,
                   help="request bodies over this size are refused with 413, unread (default 4 MiB)")
    s.add_argument("--api-key", default=os.environ.get("MINI_ENGINE_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1 routes (default: $MINI_ENGINE_API_KEY)")
    s.add_argument("--served-model-name", default=None, help="the model's name in the API (default: --model)")
    lt = sub.add_parser("loadtest", help="Poisson load on a running server: TTFT / TPOT / end-to-end p50, p99")
    lt.add_argument("--url", default="http://127.0.0.1:8000")
    lt.add_argument("--rate", type=float, default=4.0, help="requests per second (inf: all at once)")
    lt.add_argument("--requests", type=int, default=64)
    lt.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (EOS ignored)")
    lt.add_argument("--sweep", default=None, help="comma-separated rates, e.g. 1,2,4,8: one row each")
    lt.add_argument("--plot", default=None, help="save the throughput-latency curve to this PNG")
    lt.add_argument("--seed", type=int, default=0, help="seeds the arrival times")
    lt.add_argument("--api-key", default=os.environ.get("MINI_ENGINE_API_KEY"))
    lt.add_argument("--hostile", type=int, default=0, metavar="N",
                    help="N hostile clients (oversized, malformed and abandoned requests) against --honest "
                         "streaming clients: their time per output token quiet and under attack, and the KV "
                         "blocks held after it (--max-tokens per honest stream)")
    lt.add_argument("--honest", type=int, default=4, help="with --hostile: honest streaming clients (default 4)")
    t = sub.add_parser("tuning", help="the CPU backend's kept choices (case, form, times): show, reset or retime")
    t.add_argument("--threads", type=int, default=None, help="for processes with this many threads (default: "
                   "torch's default here; each thread count keeps choices of its own)")
    t.add_argument("--reset", action="store_true", help="delete every kept choice: the next run times them afresh")
    t.add_argument("--retime", action="store_true", help="delete them, then time the model's products afresh now")
    t.add_argument("--model", default="smollm2-135m")
    t.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    t.add_argument("--check", action="store_true", help="what a new process's first use of the model's products "
                   "costs now: trusted, checked or timed, and the seconds and forms it took")
    t.add_argument("--rows", default="1,16", help="with --retime or --check: the row counts (comma-separated)")
    return parser


def cmd_tuning(args) -> None:
    import torch
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    from .backends.cpu import store
    if args.retime or args.check:
        try:
            rows = tuple(int(r) for r in args.rows.split(","))
        except ValueError:
            rows = ()
        if not rows or min(rows) < 1:
            raise ValueError(f"--rows must be positive integers separated by commas, got {args.rows!r}")
        print((store.retime if args.retime else store.check)(args.model, args.dtype, rows))
    elif args.reset:
        gone = store.reset()
        print(f"deleted {len(gone)} file(s) of kept choices" + "".join(f"\n  {p}" for p in gone))
    print(store.describe())


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        {"demo": cmd_demo, "generate": cmd_generate, "bench": cmd_bench, "serve": cmd_serve,
         "loadtest": cmd_loadtest, "tuning": cmd_tuning}[args.cmd](with_default_dtype(args))
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"error: {e}\n")


if __name__ == "__main__":
    main()
