"""The radix prefix cache under memory pressure: admission and eviction cost per request as the pool grows (issue 59).

No model runs: the real `Scheduler` plans every step over a `RadixBlockManager` and a sampler stand-in draws the
tokens, so what is timed is the bookkeeping alone. For each pool size the pool is first filled with distinct
sequences (every block cached, none free), then requests arrive: one of `--prefixes` distinct prefixes (64-512
tokens), a tail of their own (16-64 tokens) and `--max-tokens` outputs. Admission is the time in the block
manager's lookups the scheduler makes to admit a request (`num_cached_tokens`, `lookup`, `allocate_cached`);
eviction is the time in `_evict_one`. Both are per request; flat as the pool grows means O(1) or O(log n) per
block, rising with it means a scan.

Before and after: run it on this checkout, then on an older one (the engine is imported from `--engine`):

    python benchmarks/bench_radix_eviction.py
    git worktree add /tmp/old <commit> && python benchmarks/bench_radix_eviction.py --engine /tmp/old
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path


def timed(fn, total: list[float]):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - t
    return wrapper


def run(me, num_blocks: int, args) -> dict:
    from mini_engine.prefix.radix_cache import RadixBlockManager
    from mini_engine.scheduler import ContinuousPolicy, Request, Scheduler

    rng, size = random.Random(args.seed), args.block_size
    bm = RadixBlockManager(num_blocks, size)
    seq = 0
    while bm.free_blocks:  # fill: distinct sequences until every block is cached and none is free
        toks = [rng.randrange(50_000, 60_000) for _ in range(16 * size)]
        bm.allocate_cached(f"fill{seq}", toks)
        bm.append_slots(f"fill{seq}", len(toks))
        bm.cache_blocks(f"fill{seq}", toks, len(toks))
        bm.free(f"fill{seq}")
        seq += 1
    evictions_before = bm.num_evictions
    admission, eviction = [0.0], [0.0]
    for name in ("num_cached_tokens", "lookup", "allocate_cached"):
        setattr(bm, name, timed(getattr(bm, name), admission))
    bm._evict_one = timed(bm._evict_one, eviction)
    scheduler = Scheduler(ContinuousPolicy(), args.max_num_seqs, 1 << 20, None, bm)
    prefixes = [[rng.randrange(1000, 40_000) for _ in range(rng.randrange(64, 513))] for _ in range(args.prefixes)]
    params = me.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for i in range(args.requests):
        prompt = rng.choice(prefixes) + [rng.randrange(40_000, 50_000) for _ in range(rng.randrange(16, 65))]
        scheduler.add(Request(i, prompt, params, frozenset(), 0.0))
    steps, start = 0, time.perf_counter()
    while scheduler.has_unfinished():
        chunks = scheduler.schedule(0.0)
        scheduler.update(chunks, [rng.randrange(1000) for _ in scheduler.samplers(chunks)], 0.0)
        steps += 1
    wall = time.perf_counter() - start
    n = args.requests
    return {"blocks": num_blocks, "requests": n, "steps": steps,
            "evictions/req": (bm.num_evictions - evictions_before) / n,
            "admission us/req": admission[0] / n * 1e6, "eviction us/req": eviction[0] / n * 1e6,
            "schedule+update us/req": wall / n * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", type=Path, default=Path(__file__).resolve().parents[1],
                        help="checkout whose mini_engine to import (default: this one)")
    parser.add_argument("--pools", type=int, nargs="+", default=[1024, 4096, 16384], help="pool sizes in blocks")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefixes", type=int, default=300, help="distinct shared prefixes")
    parser.add_argument("--requests", type=int, default=600, help="requests timed per pool size")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sys.path.insert(0, str(args.engine.resolve()))
    import mini_engine as me
    from mini_engine.prefix.radix_cache import RadixBlockManager

    how = "a heap of leaves" if hasattr(RadixBlockManager, "_refresh") else "a scan"
    print(f"mini_engine from {Path(me.__file__).resolve().parent.parent}: eviction by {how}")
    rows = [run(me, n, args) for n in args.pools]
    cols = list(rows[0])
    print(" | ".join(f"{c:>22}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]:>22.1f}" if isinstance(r[c], float) else f"{r[c]:>22}" for c in cols))


if __name__ == "__main__":
    main()
