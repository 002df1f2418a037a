"""The compiled single stream at a range of Python call depths: how far its speed depends on where it is called.

CPython keeps each thread's frames in a stack of 16 KiB chunks. Up to 3.12 (and before the backports of
python/cpython#142183 to 3.13 and 3.14), a call whose frame does not fit in the current chunk maps a new chunk,
and the chunk is unmapped again when that frame returns. A loop whose calls land on a chunk's end therefore pays an
mmap, a munmap and a page fault on every call. A compiled decode step on a CPU makes over a hundred Python calls a
step (Inductor's wrapper calls each operator through a Python method, and the product operator of the CPU
backend is Python), all from one frame. Whether they cross a chunk's end depends only on how deep that frame
sits, which depends on every caller above it. Two commits whose call paths differ by a frame can then measure
very differently for no reason in the step itself.

The CPU backend starts each compiled step on a chunk of its own (`backends/cpu/fresh_chunk.py`). This runs the
same timed stream (greedy, EOS ignored) under 0, 1, ... `--depths - 1` extra frames, at each depth once that way
and once with the step called from where its caller is (the graphs are shared), and prints per depth the time per
output token and the minor page faults per token. The page faults show which rows crossed a chunk's end. On an
older checkout, without `fresh_chunk`, it runs the second way only.

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

    ways = _ways(model)
    rows = {way: [] for way in ways}
    for depth in tqdm(range(args.depths), desc="call depths"):
        for way, graphs in ways.items():  # alternated at each depth: the machine's drift falls on both alike
            if graphs is not None:
                model.decode_graphs = graphs
            rows[way].append((depth, *nest(depth, stream)))
    print(describe_machine("cpu"))
    print(f"Python {platform.python_version()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.tokens} tokens a stream")
    print(f"{'depth':>5} " + " ".join(f"{way + ': TPOT p50, faults/token':>36}" for way in rows))
    for depth in range(args.depths):
        print(f"{depth:>5} " + " ".join(f"{r[depth][1]:>24.1f}ms {r[depth][2]:>9.1f}" for r in rows.values()))
    bands = (("no crossing (<= 5 faults/token)", lambda f: f <= 5),
             ("some calls crossing (5-100)", lambda f: 5 < f < 100),
             ("crossing at every product (>= 100)", lambda f: f >= 100))
    for way, way_rows in rows.items():
        for name, inside in bands:
            part = [r for r in way_rows if inside(r[2])]
            if part:
                tpots = sorted(r[1] for r in part)
                print(f"{way}, {name}: {len(part)} of {len(way_rows)} depths, TPOT median "
                      f"{statistics.median(tpots):.1f} ms (min {tpots[0]:.1f}, max {tpots[-1]:.1f})")


def _ways(model) -> dict:
    """The model's compiled steps two ways: the CPU backend's (`FreshChunkDecodeGraphs`), and a plain
    `DecodeGraphs` holding the same graphs, whose steps run where their caller's frames leave them. An older
    checkout or a model without the backend has only the second ({"as called": None}: left as it is)."""
    graphs = model.__dict__.get("decode_graphs")
    try:
        from mini_engine.compiled_decode import DecodeGraphs
    except ImportError:
        return {"as called": None}
    if graphs is None or type(graphs) is DecodeGraphs:
        return {"as called": None}
    plain = DecodeGraphs()
    plain.update(graphs)
    plain.caches = graphs.caches
    return {"fresh chunk": graphs, "as called": plain}


if __name__ == "__main__":
    sys.exit(main())
