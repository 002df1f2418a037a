"""Chapter 12's tiered prefix cache on this machine: a prefix evicted from the pool, recomputed or copied back.

    python benchmarks/bench_kv_offload.py [--lengths 64 256 512] [--repeats 3] [--dtype float32]

1. pack and unpack (mini_engine/transfer/pack.py) of 16 blocks of 16 tokens: GB/s, against the bytes per token of
   the course's formula (2 x layers x kv_heads x head_dim x dtype bytes).
2. For each prefix length: a request of the prefix and 8 new tokens, after a first request computed the prefix and
   a filler request of as many other tokens pushed it out of a pool that holds one of them. TTFT (median of the
   repeats, after one unmeasured round) when the prefix is recomputed (kv_offload=None), copied back from host memory (kv_offload="host"), and
   from files (kv_offload="disk" with a host tier of one block; the files may still be in the OS page cache, so this
   is the copy and the checks, not the drive). The table says how many tokens each tier served.

SmolLM2-135M on the CPU, one request at a time. Prints; writes nothing.
"""
from __future__ import annotations

import argparse
import platform
import random
import statistics
import tempfile
import time

import mini_engine as me
from mini_engine.transfer import bytes_per_token, pack, unpack


def transfer_rates(llm, blocks: int = 16, repeats: int = 5) -> tuple[float, float, int]:
    """(pack GB/s, unpack GB/s, bytes per token) over `blocks` blocks of the engine's pool."""
    cache = llm.engine.runner.kv_cache
    ids = list(range(blocks))
    times_pack, times_unpack = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        buffer = pack(cache, ids)
        times_pack.append(time.perf_counter() - start)
        start = time.perf_counter()
        unpack(cache, buffer, ids)
        times_unpack.append(time.perf_counter() - start)
    size = buffer.numel()
    return size / min(times_pack) / 1e9, size / min(times_unpack) / 1e9, bytes_per_token(cache)


def ttft(model, tok, length: int, repeats: int, **offload) -> tuple[float, int, int, int]:
    """(median TTFT s, cached tokens, from host, from disk) of prefix + 8 tokens after the prefix was evicted."""
    blocks = -(-(length + 8 + 2) // 16) + 1  # one request's blocks: the filler evicts the prefix
    llm = me.LLM.from_model(model, tok, block_size=16, num_kv_blocks=blocks, max_num_seqs=1,
                            max_model_len=blocks * 16, **offload)
    rng = random.Random(length)
    params = me.SamplingParams(max_tokens=1, ignore_eos=True)
    times, out = [], None
    for i in range(repeats + 1):  # the first round warms this engine's shapes up, unmeasured
        prefix = [rng.randrange(200, 9000) for _ in range(length)]
        llm.generate([prefix + [rng.randrange(200, 9000)]], params, use_tqdm=False)
        llm.generate([[rng.randrange(200, 9000) for _ in range(length + 1)]], params, use_tqdm=False)  # the filler
        out = llm.generate([prefix + [rng.randrange(200, 9000) for _ in range(8)]], params, use_tqdm=False)[0]
        times += [out.metrics.ttft_s] if i else []
    m = out.metrics
    return statistics.median(times), out.num_cached_tokens, m.num_host_cached_tokens, m.num_disk_cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    model, tok = me.load_model("smollm2-135m", device="cpu", dtype=args.dtype)
    print(f"SmolLM2-135M {args.dtype} on {platform.processor() or platform.machine()}")
    llm = me.LLM.from_model(model, tok, block_size=16, num_kv_blocks=64)
    llm.generate([list(range(300, 300 + max(args.lengths)))], me.SamplingParams(max_tokens=2), use_tqdm=False)  # warm
    pack_rate, unpack_rate, per_token = transfer_rates(llm)
    print(f"bytes per token {per_token:,}; pack {pack_rate:.2f} GB/s, unpack {unpack_rate:.2f} GB/s (16 blocks)")
    print(f"{'prefix':>7} {'recompute ms':>13} {'host ms':>8} {'disk ms':>8}  cached (host, disk) tokens")
    with tempfile.TemporaryDirectory() as directory:
        for length in args.lengths:
            recompute = ttft(model, tok, length, args.repeats)
            host = ttft(model, tok, length, args.repeats, kv_offload="host")
            disk = ttft(model, tok, length, args.repeats, kv_offload="disk", kv_offload_dir=directory,
                        kv_offload_host_blocks=1)
            print(f"{length:>7} {recompute[0] * 1e3:>13.1f} {host[0] * 1e3:>8.1f} {disk[0] * 1e3:>8.1f}  "
                  f"recompute {recompute[1]}, host {host[1]} {host[2:]}, disk {disk[1]} {disk[2:]}")


if __name__ == "__main__":
    main()
