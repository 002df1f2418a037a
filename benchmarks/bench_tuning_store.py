"""Do the CPU backend's kept choices hold after a busy run? Tune while other processes load every core, stop them,
then time chapter 03's cached loop with the kept choices and with choices timed afresh, alternated.

Two scenarios, each with a fresh store of its own (MINI_ENGINE_TUNE_DIR in a temporary folder):
- `busy tuning, as now`: the tuner as it ships. A case timed while the process waited for a CPU is not kept, so the
  quiet runs that follow time it themselves (the first) or use what the first quiet run kept.
- `busy tuning kept (the old rule)`: the busy run keeps everything (its `busy_share` set out of reach), as the tuner
  did before it watched the run queue. The first quiet run's check at first use must find the choices that lost
  and replace them.
Each quiet run prints its start-up (the warm-up: tuning, or checking what was kept) and its decode speed; `fresh`
runs set MINI_ENGINE_TUNE_CACHE=0 and time every case themselves.

    python benchmarks/bench_tuning_store.py [--busy 6] [--rounds 3] [--tokens 64]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# One process: load the model, warm up (the start-up that tuning or checking costs), then the cached loop.
CHILD = r"""
import json, sys, time
import torch
import mini_engine as me
from mini_engine.backends.cpu import autotune, state_line, warm_up
keep_busy = sys.argv[1] == "1"
tokens = int(sys.argv[2])
if keep_busy:
    autotune.TUNER.busy_share = float("inf")
model, tok = me.load_model("smollm2-135m", device="cpu", dtype="float32")
ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me a fun fact about octopuses."}]))
params = me.SamplingParams(max_tokens=tokens, ignore_eos=True)
t0 = time.perf_counter()
warm_up(model, [1])
me.generate_cached(model, ids, 4, me.SamplingParams(max_tokens=4, ignore_eos=True))  # attention's cases too
startup = time.perf_counter() - t0
best = 0.0
for _ in range(2):
    t0 = time.perf_counter()
    me.generate_cached(model, ids, tokens, params)
    best = max(best, tokens / (time.perf_counter() - t0))
t = autotune.TUNER
print(json.dumps({"tok_s": best, "startup_s": startup, "state": state_line(), "checked": t.checked,
                  "check_s": t.check_s, "replaced": t.replaced, "timed": t.timings_run, "not_kept": t.not_kept}))
"""


def run_child(env: dict, tokens: int, keep_busy: bool = False) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, "1" if keep_busy else "0", str(tokens)], env=env,
                         capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    for line in out.stderr.splitlines():
        if "kept choice" in line:  # the check's one line, when it replaces a choice
            print("   ", line.strip()[:160])
    return json.loads(out.stdout.strip().splitlines()[-1])


def scenario(name: str, keep_busy: bool, busy: int, rounds: int, tokens: int, threads: int) -> dict:
    folder = tempfile.mkdtemp(prefix="tuning-bench-")
    base = {**os.environ, "OMP_NUM_THREADS": str(threads), "MINI_ENGINE_TUNE_DIR": folder}
    base.pop("MINI_ENGINE_TUNE_CACHE", None)
    base.pop("MINI_ENGINE_TUNED", None)
    print(f"\n{name}: tuning with {busy} busy processes on the cores")
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        loaded = run_child(base, tokens, keep_busy)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    print(f"  busy run: {loaded['tok_s']:.1f} tok/s; {loaded['state']}")
    results = {"kept": [], "fresh": []}
    for r in range(rounds):
        for kind in ("kept", "fresh"):  # alternated, so drift on the machine hits both alike
            env = base if kind == "kept" else {**base, "MINI_ENGINE_TUNE_CACHE": "0"}
            row = run_child(env, tokens)
            results[kind].append(row)
            print(f"  round {r + 1} {kind:<5}: {row['tok_s']:5.1f} tok/s, start-up {row['startup_s']:5.1f} s; "
                  f"{row['state']}")
    kept = statistics.median(r["tok_s"] for r in results["kept"])
    fresh = statistics.median(r["tok_s"] for r in results["fresh"])
    checks = [r["check_s"] * 1e3 for r in results["kept"] if r["checked"] and not r["replaced"]]
    print(f"  {name}: kept {kept:.1f} tok/s / fresh {fresh:.1f} tok/s = {kept / fresh:.2f}x (medians of {rounds})"
          + (f"; checking the kept choices at start-up: {statistics.median(checks):.0f} ms (median of {len(checks)} "
             f"runs, {results['kept'][-1]['checked']} cases)" if checks else ""))
    return {"kept": kept, "fresh": fresh, "checks_ms": checks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--busy", type=int, default=6, help="busy processes while the store is first tuned")
    parser.add_argument("--rounds", type=int, default=3, help="alternated quiet runs of each kind")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    if min(args.busy, args.rounds, args.tokens) < 1:
        raise SystemExit("--busy, --rounds and --tokens must be >= 1")
    from mini_engine.course.hardware import cpu_info
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"CPU: {cpu_info()}; {threads} threads a process; {args.tokens} tokens, chapter 03's cached loop")
    for name, keep_busy in (("busy tuning, as now", False), ("busy tuning kept (the old rule)", True)):
        scenario(name, keep_busy, args.busy, args.rounds, args.tokens, threads)


if __name__ == "__main__":
    main()
