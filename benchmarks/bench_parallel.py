"""Chapter 11's second half on this machine: what each step's message to the ranks costs, the pipeline's bubble, an
all-reduce overlapped with compute, and the largest batch one rank and three hold at one KV budget a rank.

    python benchmarks/bench_parallel.py [--before REV] [--repeats 3]

1. A decode step at three ranks (batch 1 and 16, 16 tokens each), in this tree and, with --before, in a checkout of
   REV (`git worktree`, removed afterwards) run in a process of its own, alternated: the step message (the token ids
   and the lists the metadata is built from, pickled once) against REV's (the metadata's tensors pickled per rank);
   then the message alone at batch 16 and 1,000 positions: its bytes, and the microseconds to make and read it.
2. Three pipeline stages, a prefill of 16 sequences of 64 tokens in m = 1, 2, 4, 8 micro-batches: the bubble
   measured against (p-1)/(m+p-1) (`pipeline.measure_bubble`).
3. An all-reduce of [256, 576] fp32 hidden behind an independent matmul on three ranks (`collectives.overlap_seconds`).
4. At one KV budget a rank, the largest batch of 100 + 28-token requests that one rank and three ranks run at once.

fp32, the plain modules (no CPU backend), the paged cache; each rank with its share of the cores.
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
STEP = """
import json, mini_engine as me
from mini_engine.parallel.measure import decode_step_times
with me.LLM("smollm2-135m", tensor_parallel_size=3, num_kv_blocks=256) as tp:
    decode_step_times(tp, 1, 4)  # warm
    print(json.dumps({b: decode_step_times(tp, b, 16).step_s for b in (1, 16)}))
"""


def step_seconds(tree: Path) -> dict:
    """Median decode-step seconds at batch 1 and 16 of a three-rank engine built from `tree`'s mini_engine."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    run = subprocess.run([sys.executable, "-c", STEP], env=env, capture_output=True, text=True, timeout=900,
                         cwd=tempfile.gettempdir())
    if run.returncode:
        raise SystemExit(f"the step measurement failed in {tree}:\n{run.stderr[-3000:]}")
    return {int(k): v for k, v in json.loads(run.stdout.strip().splitlines()[-1]).items()}


def compare_steps(before: str, repeats: int) -> None:
    old = Path(tempfile.mkdtemp(prefix="mini_engine_before_"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), before], check=True,
                   capture_output=True)
    try:
        runs = {"before": [], "after": []}
        for _ in range(repeats):  # alternated, so drift on the machine hits both alike
            runs["before"].append(step_seconds(old))
            runs["after"].append(step_seconds(ROOT))
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], capture_output=True)
    print(f"\n1. A decode step at three ranks (median step of 16 tokens; medians of {repeats} runs, alternated)")
    print(f"| batch | before ({before}, ms) | after (ms) | before / after |\n| --- | --- | --- | --- |")
    for b in (1, 16):
        was, now = (statistics.median(r[b] for r in runs[k]) for k in ("before", "after"))
        print(f"| {b} | {was * 1e3:.1f} | {now * 1e3:.1f} | {was / now:.2f}x |")


def message_costs(repeats: int = 200) -> None:
    """The step message itself, a batch of 16 decoding at 1,000 positions (16-token blocks): its bytes, rank 0's
    seconds to make it and a rank's to read it, against the metadata's tensors pickled as before (once per rank)."""
    import pickle
    import timeit

    import torch

    from mini_engine.attention import AttentionMetadata
    from mini_engine.parallel.ranks import moved, step_inputs, step_message

    tables = [list(range(63 * i, 63 * i + 63)) for i in range(16)]
    meta = AttentionMetadata.build([1] * 16, [1000] * 16, block_tables=tables, block_size=16)
    meta.logits_indices, ids, cpu = torch.arange(16), torch.arange(16), torch.device("cpu")
    new = step_message(ids, meta, "torch", False, 0)
    old = pickle.dumps(("forward", ids, moved(meta, cpu), "torch", False, True), protocol=pickle.HIGHEST_PROTOCOL)
    inputs = pickle.loads(new)[1]

    def us(fn) -> float:
        return timeit.timeit(fn, number=repeats) / repeats * 1e6

    print("\n1b. The step message, batch 16 at 1,000 positions\n| message | bytes | rank 0 makes it (us) | a rank reads "
          "it (us) |\n| --- | --- | --- | --- |")
    print(f"| the metadata's tensors, pickled once a rank (before) | {len(old):,} | "
          f"{us(lambda: pickle.dumps(('forward', ids, moved(meta, cpu)), protocol=pickle.HIGHEST_PROTOCOL)):.0f} a rank | "
          f"{us(lambda: pickle.loads(old)):.0f} |")
    print(f"| ids and build()'s lists, pickled once (after) | {len(new):,} | "
          f"{us(lambda: step_message(ids, meta, 'torch', False, 0)):.0f} | "
          f"{us(lambda: step_inputs(inputs, cpu)):.0f} (builds the metadata) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="a git revision to time the three-rank decode step against")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")

    import torch

    import mini_engine as me
    from mini_engine.course.hardware import cpu_info
    from mini_engine.parallel import rank_config
    from mini_engine.parallel.collectives import overlap_seconds
    from mini_engine.parallel.measure import kv_blocks_within, largest_batch
    from mini_engine.parallel.pipeline import PipelineModel, bubble_table, format_bubbles

    print(f"CPU: {cpu_info()}; torch {torch.__version__}")
    if args.before:
        compare_steps(args.before, args.repeats)
    message_costs()

    model, tokenizer = me.load_model("smollm2-135m", cpu_backend=False)
    print("\n2. Pipeline bubble: 3 stages, a prefill of 16 sequences x 64 tokens")
    stages = PipelineModel(model, 3)
    try:
        print(format_bubbles(bubble_table(stages, (1, 2, 4, 8), repeats=args.repeats)))
    finally:
        stages.shutdown()

    o = overlap_seconds(ranks=3)
    print(f"\n3. Overlap on 3 ranks: matmul {o.compute_s * 1e3:.2f} ms, all-reduce {o.all_reduce_s * 1e3:.2f} ms; "
          f"serial {o.serial_s * 1e3:.2f} ms, overlapped {o.overlapped_s * 1e3:.2f} ms: {o.gain:.2f}x")

    budget = 32 * 1024 * 1024  # bytes of KV cache a rank
    print(f"\n4. The largest batch at {budget / 2**20:.0f} MiB of KV cache a rank (24 requests of 100 + 28 tokens)")
    print("| ranks | KV heads a rank | blocks of 16 | largest batch run |\n| --- | --- | --- | --- |")
    for ranks in (1, 3):
        config = rank_config(model.config, ranks)
        blocks = kv_blocks_within(budget, config, 16)
        knobs = dict(num_kv_blocks=blocks, block_size=16, max_num_seqs=64, enable_prefix_caching=False)
        llm = me.LLM.from_model(model, tokenizer, **knobs) if ranks == 1 else \
            me.LLM("smollm2-135m", tensor_parallel_size=ranks, **knobs)
        with llm:
            batch = largest_batch(llm, requests=24, prompt_tokens=100, new_tokens=28)
        print(f"| {ranks} | {config.num_kv_heads} | {blocks} | {batch} |")


if __name__ == "__main__":
    main()
