"""The fused C operators for a layer's small operations (`layer_ops`: RMSNorm, RoPE, silu(gate) * up, the paged
cache's write) against PyTorch's ops, side by side in one process, on the two steps they were made for:

- the TTFT of a request whose 1,024-token prefix is cached (a 32-token chunk: issue 11's request);
- a decode step of 16 sequences of about 200 positions (the serving workload's steady state).

The two ways alternate, request by request and step by step, so that a machine that slows down mid-run
slows both. fp32, the machine's thread count, product forms tuned before the clock starts.

    python benchmarks/bench_layer_ops.py [--rounds 6]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="alternations of the two ways (default 6)")
    args = parser.parse_args()

    from tqdm import tqdm

    from mini_engine.backends.cpu import layer_ops
    from mini_engine.bench.prefix import SharedPrefixWorkload
    from mini_engine.engine import LLM
    from mini_engine.course.hardware import describe_machine
    from mini_engine.backends.cpu import warm_up
    from mini_engine.loading.loader import load_model
    from mini_engine.sampling import SamplingParams

    model, tok = load_model("smollm2-135m")
    warm_up(model, [1 << i for i in range(10)])
    fused = layer_ops.fused
    ways = {"fused C operators": fused, "PyTorch ops": lambda x: False}
    per_round = 4
    work = SharedPrefixWorkload.random(len(ways) * per_round * args.rounds, 1024, 32,
                                       vocab=model.config.vocab_size)
    llm = LLM.from_model(model, tok, block_size=16, max_num_seqs=16, max_model_len=1100)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    llm.generate([work.prefix + work.warm_question], one, use_tqdm=False)
    ttft = {name: [] for name in ways}
    prompts = iter(work.prompts)
    for _ in tqdm(range(args.rounds), desc="cached requests"):
        for name, way in ways.items():
            layer_ops.fused = way
            for _ in range(per_round):
                out = llm.generate([next(prompts)], one, use_tqdm=False)[0]
                assert out.num_cached_tokens == 1024, out.num_cached_tokens
                ttft[name].append(out.metrics.ttft_s)

    layer_ops.fused = fused
    g = torch.Generator().manual_seed(0)
    decode = LLM.from_model(model, tok, block_size=16, max_num_seqs=16, max_model_len=512)
    engine = decode.engine
    for _ in range(16):
        engine.add_request(torch.randint(0, model.config.vocab_size, (200,), generator=g).tolist(),
                           SamplingParams(max_tokens=400, ignore_eos=True))
    while engine.scheduler.waiting or any(r.num_computed < len(r.prompt_ids) for r in engine.scheduler.running):
        engine.step()
    steps = {name: [] for name in ways}
    for _ in tqdm(range(args.rounds * 4), desc="decode steps"):
        for name, way in ways.items():
            layer_ops.fused = way
            for _ in range(3):
                t0 = time.perf_counter()
                engine.step()
                steps[name].append(time.perf_counter() - t0)
    layer_ops.fused = fused

    print(describe_machine("cpu"))
    print(f"fp32, {torch.get_num_threads()} threads; medians, the two ways alternated")
    base = "PyTorch ops"
    for title, runs in (("TTFT, 1,024 cached + 32 new tokens", ttft), ("decode step, 16 sequences", steps)):
        print(f"{title}:")
        for name, times in runs.items():
            med = statistics.median(times)
            print(f"  {name:18s} {med * 1e3:7.2f} ms  ({statistics.median(runs[base]) / med:.3f}x PyTorch's ops)")


if __name__ == "__main__":
    main()
