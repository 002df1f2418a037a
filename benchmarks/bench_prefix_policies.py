"""Admission orders for a prefix cache, side by side on chapter 08's three workloads (issue 59): arrival order,
longest prefix first (`scheduling="cache_aware"`, SGLang's "lpm"), and longest prefix with each of its two options,
in-batch prefix holding (`prefix_holding=True`) and aging (`aging_s=`), from mini_engine/prefix/policies.py.

The workloads are `python -m mini_engine bench --workload radix`'s (mini_engine/bench/radix.py): a conversation,
few-shot questions and branching continuations, each request of a round sent at once; by default at the sizes
chapter 08 measures them, `--scale N` at the bench's own sizes (N times its users, questions and branches; far
longer). Every policy serves the same workload on a fresh engine with the same cache (`--cache`, the radix tree by
default), the policies alternated within each workload after one unmeasured warm-up. Reported per workload and
policy: prompt tokens served from the cache (and as a share of the ideal, every token some earlier request
computed), TTFT p50 and p99 (with a few requests a round, p99 is about the slowest), output tokens per second of the
whole workload, and whether every policy produced the same greedy tokens (they must: a policy only reorders or
delays admissions).

    python benchmarks/bench_prefix_policies.py             # SmolLM2-135M, a few minutes on 2 cores
    python benchmarks/bench_prefix_policies.py --scale 1   # the bench's sizes: much longer
    python benchmarks/bench_prefix_policies.py --quick     # a tiny random model: a smoke test

Numbers measured on a busy machine are noise: benchmarks/RESULTS.md takes them from a quiet one.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from mini_engine.bench.radix import StructuredWorkload, run_structured, workloads  # noqa: E402
from mini_engine.course.metrics import percentile  # noqa: E402


def policies(aging_s: float) -> list[tuple[str, str, dict]]:
    """(label, scheduling, options) of each admission order compared."""
    return [("arrival order", "continuous", {}),
            ("longest prefix", "cache_aware", {}),
            ("longest prefix + holding", "cache_aware", {"prefix_holding": True}),
            (f"longest prefix + aging {aging_s:g}s", "cache_aware", {"aging_s": aging_s})]


def chapter_workloads(vocab: int) -> list[StructuredWorkload]:
    """The three workloads at the sizes chapter 08 measures (its `small`), from the bench's builders."""
    return [StructuredWorkload.conversation(users=2, turns=3, output_len=8, vocab=vocab),
            StructuredWorkload.few_shot(tasks=2, questions=3, examples_len=(60, 110), output_len=4, vocab=vocab),
            StructuredWorkload.branching(contexts=1, branches=3, context_len=(80, 140), output_len=4, vocab=vocab)]


def cpu_name() -> str:
    """lscpu's model name (the CPU the numbers belong to), or /proc/cpuinfo's where lscpu is missing."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")]
        if names:
            return names[0]
    except (OSError, subprocess.CalledProcessError):
        pass
    from mini_engine.course.hardware import cpu_info
    return cpu_info().model


def tiny_model():
    """A random 2-layer model (no weights to load): `--quick` and the smoke test."""
    from mini_engine.config import ModelConfig
    from mini_engine.model import LlamaModel

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=2048, eos_token_id=None)
    return LlamaModel(cfg).eval(), None


def bench(model, tok, cache: str = "radix", aging_s: float = 0.5, batch: int = 4, block_size: int = 16,
          scale: int | None = None, print_fn=print, progress: bool = False) -> list[tuple[str, object]]:
    """Every workload (chapter 08's sizes, or the bench's times `scale`) under every policy; prints the table and
    returns (label, StructuredRun) pairs."""
    common = {"block_size": block_size, "max_num_seqs": batch}
    vocab = model.config.vocab_size
    warm = StructuredWorkload.few_shot(tasks=1, questions=2, examples_len=(60, 110), output_len=4, vocab=vocab)
    run_structured(model, tok, warm, cache, **common)  # the first steps at new shapes pay one-time costs
    runs = []
    for work in chapter_workloads(vocab) if scale is None else workloads(vocab, scale):
        for label, scheduling, options in policies(aging_s):
            runs.append((label, run_structured(model, tok, work, cache, scheduling, **common, **options)))
            if progress:
                print(f"  {work.name}, {label}: {runs[-1][1].seconds:.1f} s", file=sys.stderr, flush=True)
    print_fn(f"CPU (lscpu model name): {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print_fn(f"workloads at {'chapter 08' if scale is None else f'the radix bench x{scale}'}'s sizes; cache={cache} "
             f"block_size={block_size} max_num_seqs={batch} chunked_prefill_tokens=512; greedy, random token ids")
    header = (f"{'workload':<13}{'policy':<31}{'requests':>9}{'reused':>8}{'of ideal':>9}{'TTFT p50':>10}"
              f"{'TTFT p99':>10}{'out tok/s':>10}")
    lines = [header, "-" * len(header)]
    for label, r in runs:
        lines.append(f"{r.workload:<13}{label:<31}{len(r.prompts):>9}{r.reused:>8}{r.share_of_ideal:>9.1%}"
                     f"{percentile(r.ttft, 50) * 1e3:>8.0f}ms{percentile(r.ttft, 99) * 1e3:>8.0f}ms{r.tok_s:>10.1f}")
    print_fn("\n".join(lines))
    same = all(r.outputs == next(s for _, s in runs if s.workload == r.workload).outputs for _, r in runs)
    print_fn(f"greedy outputs identical under every policy of each workload: {same}")
    return runs


def main(argv: list[str] | None = None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny random model: a smoke test in seconds")
    parser.add_argument("--cache", choices=("radix", "hashed"), default="radix")
    parser.add_argument("--aging-s", type=float, default=0.5, help="aging_s of the aging row (seconds)")
    parser.add_argument("--batch", type=int, default=4, help="max_num_seqs: small, so the bursts queue")
    parser.add_argument("--scale", type=int, default=None,
                        help="the radix bench's sizes times this (default: chapter 08's sizes)")
    args = parser.parse_args(argv)
    if args.quick:
        model, tok = tiny_model()
    else:
        import mini_engine as me
        from mini_engine.backends.cpu import warm_up

        model, tok = me.load_model("smollm2-135m", device="cpu", dtype="float32")
        warm_up(model, [1 << i for i in range(10)])
    return bench(model, tok, args.cache, args.aging_s, args.batch, scale=args.scale, progress=True)


if __name__ == "__main__":
    main()
