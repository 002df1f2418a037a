"""PagedAttention decode (this repo's Triton kernel): achieved memory bandwidth beside a plain copy.

A decode step reads every cached key and value once and does little arithmetic with them, so the
figure of merit is bandwidth: bytes of K/V read / time. On a GPU, for 64 sequences decoding one token
each over contexts up to 4096 tokens, GQA 9/3 at head_dim 64 (SmolLM2's heads) and 32/8 at 128
(Llama-3-8B's), in bf16 (fp16 below compute capability 8.0: a T4), this checks the kernel against the gather
reference, times it with triton.testing.do_bench, and times a torch copy of the same number of bytes
in the same run. The copy reads and writes them, so its bandwidth counts both: what this GPU
sustains, the ceiling the kernel is measured against. Block tables are shuffled, as a pool that has
served for a while leaves them. Exits 1 if any correctness check failed.

On a CPU the kernel can only run in Triton's interpreter, which times Python, not the kernel, so this
prints a small correctness table instead.

    python benchmarks/bench_paged_attention.py [--quick]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernel import below

import triton  # noqa: E402

from mini_engine.course.devices import default_dtype, fitting  # noqa: E402
from mini_engine.kernels.paged_attention import (  # noqa: E402
    kv_bytes_read, paged_decode_attention, paged_decode_attention_reference, random_paged_inputs)

NUM_SEQS = 64
BLOCK_SIZE = 16
HEADS = [(9, 3, 64), (32, 8, 128)]  # (query heads, KV heads, head_dim)
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float32: 1e-4}


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def max_error(inputs) -> float:
    out = paged_decode_attention(*inputs)
    return (out.float() - paged_decode_attention_reference(*inputs).float()).abs().max().item()


def copy_bandwidth(num_bytes: int) -> float:
    """GB/s of `dst.copy_(src)` over num_bytes: read + write, so 2 * num_bytes move per copy."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def gpu_table(workloads: dict[str, list[int]], dtype: torch.dtype) -> bool:
    rows, all_ok = [], True
    for heads_q, heads_kv, head_dim in HEADS:
        def pool_and_copy_bytes(name: str) -> int:  # the K/V pool, then a copy's source and destination as large
            blocks = sum(-(-n // BLOCK_SIZE) for n in workloads[name])
            return 3 * 2 * blocks * BLOCK_SIZE * heads_kv * head_dim * dtype.itemsize

        for name in fitting(workloads, pool_and_copy_bytes, "cuda", f"contexts ({heads_q}/{heads_kv} heads)"):
            lengths = workloads[name]
            inputs = random_paged_inputs(lengths, heads_q, heads_kv, head_dim, BLOCK_SIZE, dtype, "cuda")
            error = max_error(inputs)
            ok = error <= TOLERANCE[dtype]
            all_ok &= ok
            ms = triton.testing.do_bench(lambda: paged_decode_attention(*inputs), return_mode="median")
            num_bytes = kv_bytes_read(inputs[4], inputs[1])
            ours, copy = num_bytes / (ms * 1e-3) / 1e9, copy_bandwidth(num_bytes)
            rows.append([f"{heads_q}/{heads_kv}", f"{head_dim}", name, f"{num_bytes / 2**20:.0f}",
                         f"{error:.1e}" + ("" if ok else " FAIL"), f"{ms * 1e3:.0f}", f"{ours:.0f}", f"{copy:.0f}",
                         f"{ours / copy:.0%}"])
            del inputs
            torch.cuda.empty_cache()
    print(f"\npaged decode attention, {NUM_SEQS} sequences, block_size {BLOCK_SIZE}, {dtype_name(dtype)}, "
          f"on {torch.cuda.get_device_name()} (torch {torch.__version__}, triton {triton.__version__})")
    print_table(["Hq/Hkv", "D", "contexts", "K/V MiB", "max|err|", "us", "GB/s", "copy GB/s", "of copy"], rows)
    return all_ok


def cpu_table() -> bool:
    rows, all_ok = [], True
    for lengths, (heads_q, heads_kv, head_dim), dtype in [([1, 15, 16, 17, 100], HEADS[0], torch.float32),
                                                          ([33, 70], HEADS[1], torch.float32),
                                                          ([1, 17, 64], HEADS[0], torch.bfloat16)]:
        inputs = random_paged_inputs(lengths, heads_q, heads_kv, head_dim, BLOCK_SIZE, dtype, "cpu")
        error = max_error(inputs)
        ok = error <= TOLERANCE[dtype]
        all_ok &= ok
        rows.append([f"{heads_q}/{heads_kv}", f"{head_dim}", ",".join(map(str, lengths)), dtype_name(dtype),
                     f"{error:.1e}", "ok" if ok else "FAIL"])
    print("No CUDA GPU: no timing is possible (Triton's interpreter times Python, not the kernel).")
    print("Correctness of the paged decode kernel in the interpreter vs the fp32 gather reference "
          "(shuffled block tables, NaN in every slot outside the contexts):")
    print_table(["Hq/Hkv", "D", "contexts", "dtype", "max abs err", "check"], rows)
    return all_ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="contexts of 1024 and 4096 tokens only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        return 0 if cpu_table() else 1
    contexts = [1024, 4096] if args.quick else [256, 1024, 2048, 4096]
    workloads = {f"{n} each": [n] * NUM_SEQS for n in contexts}
    # A serving mix: every length from 1 to 4096, so tiles end mid-block and sequences end unevenly.
    gen = torch.Generator().manual_seed(0)
    workloads["1..4096"] = torch.randint(1, 4097, (NUM_SEQS,), generator=gen).tolist()
    dtype = getattr(torch, default_dtype("cuda"))  # bf16 from compute capability 8.0, fp16 below (T4)
    return 0 if gpu_table(workloads, dtype) else 1


if __name__ == "__main__":
    sys.exit(main())
