"""Tensor parallelism on this machine (chapter 11, issue 53): gloo's all-reduce among the ranks over payload sizes,
fitted as latency + bytes / bandwidth; then one process against `--ranks` ranks decoding the same greedy requests,
at batch 1 and 16, each tensor-parallel step split into computing, communicating and waiting for a slower rank; and
the step and its communication as chapter 11's formula predicts them from the fitted constants and the one-process
step, against what was measured. The ranks share this one CPU, so their compute is predicted as the one-process
step's, not a p-th of it (see the chapter).

    python benchmarks/bench_tensor_parallel.py [--ranks 3] [--tokens 16] [--repeats 3]

fp32, the plain modules (no CPU backend) in both engines, the paged cache; one process uses every core, each rank
its share (`threads_per_rank`).
"""
from __future__ import annotations

import argparse
import statistics

import mini_engine as me
from mini_engine.course.hardware import cpu_info
from mini_engine.parallel import threads_per_rank
from mini_engine.parallel.measure import all_reduce_seconds, decode_step_times, fit_latency_bandwidth

PAYLOADS = [64, 1024, 2304, 9216, 36864, 147456, 589824, 2359296]


def predicted_communication(cfg, batch: int, ranks: int, latency: float, bandwidth: float) -> float:
    """One decode step's collectives at the fitted constants: the embedding's all-reduce and two a layer, of
    batch x hidden fp32 values, as the fit measured them (the fit's latency is a whole all-reduce's, not a hop's);
    and the gather of the logits on rank 0 (each other rank sends its batch x vocab / ranks values)."""
    all_reduces = (2 * cfg.num_layers + 1) * (latency + batch * cfg.hidden_size * 4 / bandwidth)
    gather = latency + batch * cfg.vocab_size * 4 * (ranks - 1) / ranks / bandwidth
    return all_reduces + gather


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16, help="new tokens a request")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each engine at each batch, alternated")
    args = parser.parse_args()
    if min(args.ranks, args.tokens, args.repeats) < 1:
        raise SystemExit("--ranks, --tokens and --repeats must be >= 1")
    print(f"CPU: {cpu_info()}; {args.ranks} ranks of {threads_per_rank(args.ranks)} thread(s) against one process")

    ar_s = all_reduce_seconds(PAYLOADS, args.ranks, repeats=200)
    latency, bandwidth = fit_latency_bandwidth(PAYLOADS, ar_s)
    print(f"\ngloo all-reduce among {args.ranks} processes (mean of 200): latency {latency * 1e6:.0f} us, "
          f"bandwidth {bandwidth / 1e9:.2f} GB/s")
    print("| payload (bytes) | measured (us) | fit (us) |\n| --- | --- | --- |")
    for n, s in zip(PAYLOADS, ar_s):
        print(f"| {n:,} | {s * 1e6:.0f} | {(latency + n / bandwidth) * 1e6:.0f} |")

    model, tokenizer = me.load_model("smollm2-135m", device="cpu", dtype="float32", cpu_backend=False)
    cfg = model.config
    one = me.LLM.from_model(model, tokenizer, num_kv_blocks=256)
    tp = me.LLM("smollm2-135m", device="cpu", tensor_parallel_size=args.ranks, num_kv_blocks=256)
    try:
        print("\n| batch | one process (ms) | ranks (ms) | one / ranks | rank 0: compute / communicating / waiting "
              "(ms) | step predicted (ms) | communication predicted / measured (ms) | share communicating, "
              "predicted / measured |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
        for batch in (1, 16):
            ones, tps = [], []
            for _ in range(args.repeats):  # alternated, so drift on the machine hits both alike
                ones.append(decode_step_times(one, batch, args.tokens))
                tps.append(decode_step_times(tp, batch, args.tokens))
            one_s = statistics.median(r.step_s for r in ones)
            best = min(tps, key=lambda r: r.step_s)
            tp_s = statistics.median(r.step_s for r in tps)
            comm = statistics.median(r.communication_s for r in tps)
            share = statistics.median(r.communication_share for r in tps)
            predicted = predicted_communication(cfg, batch, args.ranks, latency, bandwidth)
            step = one_s + predicted  # the ranks share the cores one process had: compute is not divided
            print(f"| {batch} | {one_s * 1e3:.1f} | {tp_s * 1e3:.1f} | {one_s / tp_s:.2f}x | "
                  f"{best.compute_s * 1e3:.1f} / {best.communication_s * 1e3:.1f} / {best.waiting_s * 1e3:.1f} | "
                  f"{step * 1e3:.1f} | {predicted * 1e3:.1f} / {comm * 1e3:.1f} | {predicted / step:.0%} / "
                  f"{share:.0%} (ratio {predicted / step / share:.2f}) |")
        print(f"\n({best.collectives} collectives a step; medians of {args.repeats} runs of {args.tokens} tokens; "
              "the compute / communicating / waiting split is the run with the fastest median step)")
    finally:
        tp.shutdown()


if __name__ == "__main__":
    main()
