"""Is a process's first batch as fast as its second? The CPU backend times (or checks) its choices the first time a
process meets a case, and that cost lands on the first work a student times (issue 60).

Each measurement is a fresh process that loads smollm2-135m and runs one workload three times, printing seconds and
tok/s per run and what the tuner did in each: cases timed, kept choices checked (and replaced), candidate forms
built and calls made to time them, and the seconds spent. The counters, not the wall times, say where a busy
machine's first run went.

Workloads:
- `llm`: `LLM("smollm2-135m", max_num_seqs=16)` serving 32 mixed requests (8-96 prompt words, 8-96 tokens each,
  greedy, seeded), the issue's workload;
- `cached`: chapter 03's cached loop (`generate_cached`, one prompt, 64 tokens).
Stores (each in a temporary folder of its own, MINI_ENGINE_TUNE_DIR; the machine's own store is never touched):
- `empty`: nothing kept, every case is timed in the first run;
- `filled`: a process runs the workload first (and keeps what it timed on a quiet machine; `--fill-busy`: on any
  machine), then the measured process starts from that store, as every process after a chapter does.

    python benchmarks/bench_first_run.py [--store empty|filled|both] [--workload llm|cached|both] [--profile]
        [--requests 32] [--fill-busy]
MINI_ENGINE_TUNE_TRUST=0 in the environment checks every kept choice at first use (issue 50's rule) for a before.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COUNTERS = ("timings_run", "checked", "replaced", "not_kept", "built", "calls", "timing_s", "check_s")
WORDS = ("the a model token cache batch prefill decode memory weight layer attention engine request student "
         "kernel product row column matrix vector speed latency throughput queue block page prefix tree").split()


def mixed_requests(n: int = 32, seed: int = 0):
    """`n` prompts of 8-96 words and their greedy sampling parameters (8-96 tokens each, EOS ignored)."""
    import mini_engine as me
    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 96))) for _ in range(n)]
    params = [me.SamplingParams(max_tokens=rng.randint(8, 96), ignore_eos=True) for _ in range(n)]
    return prompts, params


def child(workload: str, runs: int, profile: bool, requests: int, keep_busy: bool) -> None:
    """One process: the workload `runs` times; one JSON line a run on stdout."""
    import mini_engine as me
    from mini_engine.backends.cpu import autotune, state_line
    tuner = autotune.TUNER
    if keep_busy:  # fill a store on a busy machine anyway: its counters, not its choices, are what is measured
        tuner.busy_share = float("inf")
    if workload == "llm":
        llm = me.LLM("smollm2-135m", max_num_seqs=16)
        prompts, params = mixed_requests(requests)

        def work():
            outs = llm.generate(prompts, params, use_tqdm=False)
            return sum(len(o.token_ids) for o in outs)
    else:
        model, tok = me.load_model("smollm2-135m", device="cpu", dtype="float32")
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me a fun fact about octopuses."}]))

        def work():
            return len(me.generate_cached(model, ids, 64, me.SamplingParams(max_tokens=64, ignore_eos=True)))
    for run in range(runs):
        before = {name: getattr(tuner, name) for name in COUNTERS}
        if profile and run == 0:
            import cProfile
            import pstats
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            tokens = prof.runcall(work)
            seconds = time.perf_counter() - t0
            pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
        else:
            t0 = time.perf_counter()
            tokens = work()
            seconds = time.perf_counter() - t0
        did = {name: getattr(tuner, name) - before[name] for name in COUNTERS}
        print(json.dumps({"run": run + 1, "seconds": seconds, "tokens": tokens, **did, "state": state_line()}),
              flush=True)


def measure(workload: str, store: str, runs: int, profile: bool, requests: int, fill_busy: bool) -> list[dict]:
    folder = tempfile.mkdtemp(prefix="first-run-")
    env = {**os.environ, "MINI_ENGINE_TUNE_DIR": folder, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for name in ("MINI_ENGINE_TUNE_CACHE", "MINI_ENGINE_TUNED", "MINI_ENGINE_FORMS"):
        env.pop(name, None)
    cmd = [sys.executable, __file__, "--child", workload, "--requests", str(requests)]
    if store == "filled":  # fill the store as an earlier process would have, with every run: a second run of the
        # same prompts meets the prefix cache, whose shorter prefill chunks are cases of their own
        subprocess.run([*cmd, "--runs", str(runs)] + (["--fill-busy"] if fill_busy else []), env=env, cwd=ROOT,
                       check=True, capture_output=True)
    out = subprocess.run([*cmd, "--runs", str(runs)] + (["--profile"] if profile else []), env=env, cwd=ROOT,
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    if profile:
        print(out.stderr[-6000:])
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    print(f"\n{workload}, {store} store ({rows[0]['state'].split(';')[1].strip() if rows else ''}...)")
    print(f"{'run':>4} {'seconds':>8} {'tok/s':>7} {'timed':>6} {'checked':>8} {'replaced':>8} {'built':>6} "
          f"{'calls':>6} {'timing s':>9} {'check s':>8}")
    for r in rows:
        print(f"{r['run']:>4} {r['seconds']:>8.2f} {r['tokens'] / r['seconds']:>7.1f} {r['timings_run']:>6} "
              f"{r['checked']:>8} {r['replaced']:>8} {r['built']:>6} {r['calls']:>6} {r['timing_s']:>9.2f} "
              f"{r['check_s']:>8.2f}")
    if len(rows) > 1:
        print(f"first / second: {rows[0]['seconds'] / rows[1]['seconds']:.2f}x; {rows[-1]['state']}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", choices=["empty", "filled", "both"], default="both")
    parser.add_argument("--workload", choices=["llm", "cached", "both"], default="llm")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="cProfile the first run (printed, top 25)")
    parser.add_argument("--requests", type=int, default=32, help="requests of the llm workload (32: the issue's)")
    parser.add_argument("--fill-busy", action="store_true", help="keep what the filling process times even on a "
                        "busy machine (to count a filled store's first use where no quiet store can be made)")
    parser.add_argument("--child", choices=["llm", "cached"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.runs < 1 or args.requests < 1:
        raise SystemExit("--runs and --requests must be >= 1")
    if args.child:
        child(args.child, args.runs, args.profile, args.requests, args.fill_busy)
        return
    from mini_engine.course.hardware import cpu_info
    print(f"CPU: {cpu_info()}; load average {os.getloadavg()[0]:.1f} at start")
    for workload in (("llm", "cached") if args.workload == "both" else (args.workload,)):
        for store in (("empty", "filled") if args.store == "both" else (args.store,)):
            measure(workload, store, args.runs, args.profile, args.requests, args.fill_busy)


if __name__ == "__main__":
    main()
