"""FlashAttention (this repo's Triton kernel) vs torch SDPA (flash backend) vs naive attention.

On a GPU: for N in 1k..16k, head_dim 64 and 128, fp16 and bf16, first checks our output against SDPA,
then measures TFLOP/s of the three with triton.testing.do_bench and prints one table (naive reads
"OOM" where its N x N scores do not fit). B x H shrinks as N grows so every row has the same number
of query tokens in flight (enough to fill the GPU). Exits 1 if any correctness check failed.

On a CPU: the kernel can only run in Triton's interpreter, which measures Python, not the kernel,
so this prints a small correctness table against the fp32 reference and no timings.

    python benchmarks/bench_attention.py [--quick] [--no-causal]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernel import below

from mini_engine.kernels.flash_attention import (  # noqa: E402
    benchmark_tflops, flash_attention, max_error_vs_reference)

HEADS = 16
TOKENS_IN_FLIGHT = 1 << 18  # B * H * N: 16 x 16 heads at 1k, 1 x 16 heads at 16k
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float32: 1e-4}


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def fmt(tflops: float | None) -> str:
    return "OOM" if tflops is None else f"{tflops:.1f}"


def gpu_table(seq_lens: list[int], head_dims: list[int], dtypes: list[torch.dtype], causal: bool) -> bool:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows, all_ok = [], True
    for dtype in dtypes:
        for head_dim in head_dims:
            for n in seq_lens:
                batch = max(1, TOKENS_IN_FLIGHT // (HEADS * n))
                q, k, v = (torch.randn(batch, HEADS, n, head_dim, device="cuda", dtype=dtype) for _ in range(3))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                ours_out = flash_attention(q, k, v, causal=causal)
                error = (ours_out.float() - expected.float()).abs().max().item()
                # Both sides round their output to 8 (bf16) or 11 (fp16) bits: compare relative to size.
                ok = torch.allclose(ours_out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
                all_ok &= ok
                ours, sdpa, naive = (benchmark_tflops(p, q, k, v, causal) for p in ("triton", "sdpa", "naive"))
                rows.append([f"{n}", f"{head_dim}", str(dtype).removeprefix("torch."), f"{batch}x{HEADS}",
                             f"{error:.1e}" + ("" if ok else " FAIL"), fmt(ours), fmt(sdpa), fmt(naive),
                             "-" if ours is None or sdpa is None else f"{ours / sdpa:.2f}"])
                del q, k, v, expected, ours_out
                torch.cuda.empty_cache()
    print(f"\nattention forward, {'causal' if causal else 'non-causal'}, TFLOP/s on {torch.cuda.get_device_name()}"
          f" (torch {torch.__version__})")
    print_table(["N", "D", "dtype", "BxH", "max|ours-SDPA|", "ours", "SDPA-flash", "naive", "ours/SDPA"], rows)
    return all_ok


def cpu_table(causal: bool) -> bool:
    rows, all_ok = [], True
    for n_q, n_k, heads_q, heads_kv, head_dim, dtype in [(64, 64, 4, 1, 32, torch.float32),
                                                         (33, 100, 2, 2, 64, torch.float32),
                                                         (64, 64, 4, 2, 32, torch.bfloat16)]:
        error = max_error_vs_reference(1, heads_q, heads_kv, n_q, n_k, head_dim, causal, dtype, "cpu")
        ok = error <= TOLERANCE[dtype]
        all_ok &= ok
        rows.append([f"{n_q}x{n_k}", f"{heads_q}/{heads_kv}", f"{head_dim}", str(dtype).removeprefix("torch."),
                     f"{error:.1e}", "ok" if ok else "FAIL"])
    print("No CUDA GPU: no timing is possible (Triton's interpreter times Python, not the kernel).")
    mask = "causal" if causal else "non-causal"
    print(f"Correctness of the kernel in the interpreter vs the fp32 reference ({mask}):")
    print_table(["Nq x Nk", "Hq/Hkv", "D", "dtype", "max abs err", "check"], rows)
    return all_ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N in 1k and 4k only")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        return 0 if cpu_table(args.causal) else 1
    seq_lens = [1024, 4096] if args.quick else [1024, 2048, 4096, 8192, 16384]
    ok = gpu_table(seq_lens, [64, 128], [torch.float16, torch.bfloat16], args.causal)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
