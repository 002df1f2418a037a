"""Compiling the decode step on a CPU: a cold compile's time and the C++ kernels Inductor generates, with each
layer's index into the KV cache a tensor (the engine's way, `kv_cache._store`) or a Python int (the way it
replaced: each layer's cache-store kernel then differs from the others by one constant, and all 30 are compiled
apart), and the compiled step against the eager one. Same run, same model, fp32, batch 1.

Each way runs in a process of its own with an empty Inductor cache, so that both compiles are cold. Forms are
tuned by an eager run first (the machine's tuning store keeps them), so no timing of product forms lands in a
compile time. On a GPU Inductor emits Triton, not C++: this bench is for the CPU.

    python benchmarks/bench_compile.py [--tokens 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WAYS = {"tensor": "a tensor (now)", "int": "an int (before)"}


def measure(way: str, tokens: int, rounds: int) -> dict:
    """In this process (its Inductor cache empty): compile the step, count the C++ files, time the steps."""
    import torch

    import mini_engine as me
    from mini_engine import kv_cache

    if way == "int":  # every cache this process makes indexes its layers by Python ints, the way this replaced
        init = kv_cache.KVCache.__init__

        def int_layers(self, config, *args):
            init(self, config, *args)
            self._layer_ids = list(range(config.num_layers))
        kv_cache.KVCache.__init__ = int_layers
    model, tok = me.load_model("smollm2-135m")
    prompt = tok.encode("The printing press changed how knowledge spread, because")
    me.generate_cached(model, prompt, 4)  # tunes the product forms off the clock
    t0 = time.perf_counter()
    me.generate_cached(model, prompt, 2, compile=True)
    compile_s = time.perf_counter() - t0
    cpp_files = len(list(Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).rglob("*.cpp")))

    def step_s(compile: bool) -> tuple[list[int], float]:
        stamps = []
        out = me.generate_cached(model, prompt, tokens, compile=compile,
                                 on_token=lambda _t: stamps.append(time.perf_counter()))
        return out, statistics.median(b - a for a, b in zip(stamps, stamps[1:]))

    eager, compiled, same = [], [], True
    for _ in range(rounds):  # alternated, so that a slow spell of the machine hits both
        e_out, e_s = step_s(False)
        c_out, c_s = step_s(True)
        eager.append(e_s)
        compiled.append(c_s)
        same &= e_out == c_out
    return {"compile_s": compile_s, "cpp_files": cpp_files, "eager_ms": 1e3 * min(eager),
            "compiled_ms": 1e3 * min(compiled), "same_tokens": same, "threads": torch.get_num_threads()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens per timed run")
    parser.add_argument("--rounds", type=int, default=3, help="eager/compiled runs per way (best kept)")
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.way:
        print(json.dumps(measure(args.way, args.tokens, args.rounds)))
        return 0

    from tqdm import tqdm

    from mini_engine.course.hardware import describe_machine

    results = {}
    for way in tqdm(WAYS, desc="cold compiles (a minute or two each on a 2-core CPU)"):
        with tempfile.TemporaryDirectory(prefix="bench-compile-") as cache:
            done = subprocess.run([sys.executable, __file__, "--way", way, "--tokens", str(args.tokens),
                                   "--rounds", str(args.rounds)], capture_output=True, text=True,
                                  env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        results[way] = json.loads(done.stdout.strip().splitlines()[-1])
    print(describe_machine("cpu"))
    print(f"{'layer index':<18}{'cold compile':>13}{'C++ files':>11}{'eager step':>12}{'compiled step':>15}"
          f"{'eager/compiled':>16}{'same tokens':>13}")
    for way, r in results.items():
        print(f"{WAYS[way]:<18}{r['compile_s']:>12.1f}s{r['cpp_files']:>11}{r['eager_ms']:>10.1f}ms"
              f"{r['compiled_ms']:>13.1f}ms{r['eager_ms'] / r['compiled_ms']:>15.2f}x{str(r['same_tokens']):>13}")
    now, before = results["tensor"], results["int"]
    print(f"cold compile, int / tensor: {before['compile_s'] / now['compile_s']:.2f}x; compiled step, "
          f"int / tensor: {before['compiled_ms'] / now['compiled_ms']:.2f}x (best of {args.rounds} runs of "
          f"{args.tokens} tokens each)")
    return 0 if all(r["same_tokens"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
