"""FlashAttention (this repo's Triton kernel) vs torch SDPA vs naive attention.

On a GPU: for N in 1k..16k, head_dim 64 and 128, in fp16 and (from compute capability 8.0) bf16, checks our
output and SDPA's against the project's fp32 reference (on the first and last queries, whose scores it can
hold), then measures TFLOP/s of the three with triton.testing.do_bench and prints one table. SDPA runs the
fused kernel this GPU has (`devices.sdpa_backend`: FlashAttention from sm_80, the memory-efficient kernel on a
T4); naive reads "skipped" where its N x N scores would not fit in free memory. B x H shrinks as N grows so
every row has the same number of query tokens in flight (enough to fill the GPU). Exits 1 if any check failed.

On a CPU: the kernel can only run in Triton's interpreter, which measures Python, not the kernel,
so this prints a small correctness table against the fp32 reference and no timings.

    python benchmarks/bench_attention.py [--quick] [--no-causal]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernel import below
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402

from mini_engine.course.devices import default_dtype, fitting, sdpa_backend  # noqa: E402
from mini_engine.kernels.flash_attention import (  # noqa: E402
    attention_flops, attention_reference, flash_attention, max_error_vs_reference)

HEADS = 16
TOKENS_IN_FLIGHT = 1 << 18  # B * H * N: 16 x 16 heads at 1k, 1 x 16 heads at 16k
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float32: 1e-4}
CHECKED_ROWS = 256  # queries at each end of the sequence checked against the reference


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def fmt(tflops: float | None) -> str:
    return "skipped" if tflops is None else f"{tflops:.1f}"


def gpu_dtypes() -> list[torch.dtype]:
    """fp16 everywhere; bf16 too where the GPU multiplies it natively (default_dtype says bf16 from sm_80)."""
    return [torch.float16] + ([torch.bfloat16] if default_dtype("cuda") == "bfloat16" else [])


def time_ms(fn, device: str) -> float:
    """Milliseconds per call: triton's do_bench on a GPU; on a CPU the best of three calls (the interpreter)."""
    if device.startswith("cuda"):
        return triton.testing.do_bench(fn)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def sdpa(q, k, v, causal: bool):
    """torch's scaled_dot_product_attention on the fused kernel this device has (SDPA's own choice on a CPU)."""
    from torch.nn.attention import sdpa_kernel

    backend = sdpa_backend(q.device, q.dtype)
    with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def reference_error(out: torch.Tensor, q, k, v, causal: bool, rows: int = CHECKED_ROWS) -> float:
    """Max |out - reference| over the first and last `rows` queries of a self-attention (Nq = Nk). The fp32
    reference materialises the scores of those rows only: queries [a, b) see keys [0, b) under the causal
    mask, which is the reference's bottom-right alignment."""
    n = q.shape[2]
    error = 0.0
    for a in sorted({0, max(0, n - rows)}):
        b = min(n, a + rows)
        end = b if causal else n
        expected = attention_reference(q[:, :, a:b], k[:, :, :end], v[:, :, :end], causal)
        error = max(error, (out[:, :, a:b].float() - expected.float()).abs().max().item())
    return error


def compare(n: int, head_dim: int, dtype: torch.dtype, causal: bool, device: str, heads: int = HEADS,
            tokens_in_flight: int = TOKENS_IN_FLIGHT, naive: bool = True) -> dict:
    """One row: our kernel and SDPA at sequence length n, checked against the reference, then timed (naive
    attention too when `naive` and its scores fit). TFLOP/s are None for what was not timed."""
    batch = max(1, tokens_in_flight // (heads * n))
    gen = torch.Generator(device=device).manual_seed(n)
    q, k, v = (torch.randn(batch, heads, n, head_dim, generator=gen, device=device, dtype=dtype) for _ in range(3))
    ours_out, sdpa_out = flash_attention(q, k, v, causal=causal), sdpa(q, k, v, causal)
    row = {"n": n, "head_dim": head_dim, "dtype": dtype, "batch": batch, "heads": heads,
           "sdpa_kernel": getattr(sdpa_backend(device, dtype), "name", "default"),
           "ours_error": reference_error(ours_out, q, k, v, causal),
           "sdpa_error": reference_error(sdpa_out, q, k, v, causal)}
    row["ok"] = row["ours_error"] <= TOLERANCE[dtype]
    del ours_out, sdpa_out
    flops = attention_flops(batch, heads, n, n, head_dim, causal)
    tflops = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
    row["ours"] = tflops(time_ms(lambda: flash_attention(q, k, v, causal=causal), device))
    row["sdpa"] = tflops(time_ms(lambda: sdpa(q, k, v, causal), device))
    # Naive keeps up to three B x H x N x N tensors at once (scores, masked scores, softmax) and two N x N masks.
    fits = naive and fitting([n], lambda m: 3 * batch * heads * m * m * q.element_size() + 2 * m * m, device,
                             "naive attention, N")
    row["naive"] = tflops(time_ms(lambda: attention_reference(q, k, v, causal, upcast=False), device)) if fits else None
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def gpu_table(seq_lens: list[int], head_dims: list[int], dtypes: list[torch.dtype], causal: bool) -> bool:
    rows, all_ok = [], True
    for dtype in dtypes:
        for head_dim in head_dims:
            for n in seq_lens:
                r = compare(n, head_dim, dtype, causal, "cuda")
                all_ok &= r["ok"]
                rows.append([f"{n}", f"{head_dim}", str(dtype).removeprefix("torch."), f"{r['batch']}x{HEADS}",
                             f"{r['ours_error']:.1e}" + ("" if r["ok"] else " FAIL"), f"{r['sdpa_error']:.1e}",
                             fmt(r["ours"]), fmt(r["sdpa"]), fmt(r["naive"]), f"{r['ours'] / r['sdpa']:.2f}"])
    kernel = sdpa_backend("cuda", dtypes[0]).name
    print(f"\nattention forward, {'causal' if causal else 'non-causal'}, TFLOP/s on {torch.cuda.get_device_name()}"
          f" (torch {torch.__version__}; SDPA's {kernel} kernel; errors against the fp32 reference)")
    print_table(["N", "D", "dtype", "BxH", "max|ours-ref|", "max|SDPA-ref|", "ours", "SDPA", "naive", "ours/SDPA"],
                rows)
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
    ok = gpu_table(seq_lens, [64, 128], gpu_dtypes(), args.causal)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
