"""The compiled single stream at a range of Python call depths: how far its speed depends on where it is called.

CPython keeps each thread's frames in a stack of 16 KiB chunks. Up to 3.12 (and before the backports of
python/cpython#142183 to 3.13 and 3.14), a call whose frame does not fit in the current chunk maps a new chunk,
and the chunk is unmapped again when that frame returns. A loop whose calls land on a chunk's end therefore pays an
mmap, a munmap and a page fault on every call. A compiled decode step on a CPU makes over a hundred Python calls a
step (Inductor's wrapper calls each operator through a Python method, and the product operator of the CPU
backend is Python), all from one frame. Whether they cross a chunk's end depends only on how deep that frame
sits, which depends on every caller above it. Two commits whose call paths differ by a frame can then measure
very differently for no reason in the step itself.

This runs the same timed stream (greedy, EOS ignored) under 0, 1, ... `--depths - 1` extra frames, and prints
per depth the time per output token and the minor page faults per token. The page faults show which rows crossed a
chunk's end. It also runs on an older checkout that keeps the engine's modules at the top level.

    python benchmarks/bench_call_depth.py [--depths 160] [--tokens 24]
"""
from __future__ import annotations

import argparse
import platform
import resource
import statistics
import sys
import time

import torch


def _engine_parts():
    """load_model and describe_machine: an older checkout keeps them at the top level (tried first, since the
    editable install also finds the new paths)."""
    try:
        from mini_engine.hardware import describe_machine
        from mini_engine.loader import load_model
    except ImportError:
        from mini_engine.course.hardware import describe_machine
        from mini_engine.loading.loader import load_model
    return load_model, describe_machine


def nest(depth: int, fn):
    """fn() called `depth` frames deeper than this call."""
    return fn() if depth == 0 else nest(depth - 1, fn)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, default=160, help="extra frames (about one 16 KiB chunk's worth): 0 to depths - 1")
    parser.add_argument("--tokens", type=int, default=24, help="new tokens per timed stream")
    args = parser.parse_args(argv)

    import mini_engine as me
    from tqdm.auto import tqdm
    load_model, describe_machine = _engine_parts()
    model, tok = load_model("smollm2-135m", device="cpu", dtype="float32")
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Explain, step by step, how a bicycle stays upright while moving."}]))
    params = me.SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    me.generate_cached(model, prompt, 4, params)                 # eager warm-up (and the CPU backend's tuning)
    me.generate_cached(model, prompt, 2, params, compile=True)  # compiles the decode step: not timed

    def stream():
        stamps = []
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        me.generate_cached(model, prompt, args.tokens, params, compile=True,
                           on_token=lambda _: stamps.append(time.perf_counter()))
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        return statistics.median(gaps) * 1e3, faults / len(stamps)

    rows = [(d, *nest(d, stream)) for d in tqdm(range(args.depths), desc="call depths")]
    print(describe_machine("cpu"))
    print(f"Python {platform.python_version()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.tokens} tokens a stream")
    print(f"{'depth':>5} {'TPOT p50':>9} {'faults/token':>13}")
    for depth, tpot, faults in rows:
        print(f"{depth:>5} {tpot:>7.1f}ms {faults:>13.1f}")
    bands = (("no crossing (<= 5 faults/token)", lambda f: f <= 5),
             ("some calls crossing (5-100)", lambda f: 5 < f < 100),
             ("crossing at every product (>= 100)", lambda f: f >= 100))
    for name, inside in bands:
        part = [r for r in rows if inside(r[2])]
        if part:
            tpots = sorted(r[1] for r in part)
            print(f"{name}: {len(part)} of {len(rows)} depths, TPOT median {statistics.median(tpots):.1f} ms "
                  f"(min {tpots[0]:.1f}, max {tpots[-1]:.1f})")


if __name__ == "__main__":
    sys.exit(main())
