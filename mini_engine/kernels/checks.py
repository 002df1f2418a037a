"""The input checks every kernel wrapper shares. Each raises a ValueError that names the argument.

A kernel trusts its pointers and sizes: given a tensor of the wrong rank, dtype or device it reads memory it
does not own, and on a GPU that shows up later as wrong numbers or an illegal-address error, far from the
call that caused it. So each wrapper checks its arguments with these functions before it launches, and calls
`check_launchable` last, once every check of the values themselves has had its say.
"""
from __future__ import annotations

import torch
import triton

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dtype_names(dtypes) -> str:
    """"int32", or "float32, float16 or bfloat16" for a tuple."""
    names = [str(d).removeprefix("torch.") for d in (dtypes if isinstance(dtypes, tuple) else (dtypes,))]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _described(t) -> str:
    """What a wrong argument was, for the message: its dtype and shape, or its type when not a tensor."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{_dtype_names(t.dtype)} {list(t.shape)}"


def check_float_tensor(name: str, t, ndim: int, layout: str) -> None:
    """`t` is a tensor of `ndim` dimensions, laid out as `layout` says (e.g. "[B, H, N, D]"), in fp32, fp16
    or bf16: the dtypes the kernels compute in."""
    if not isinstance(t, torch.Tensor) or t.dim() != ndim:
        raise ValueError(f"{name} must be a {ndim}-D tensor {layout}, got {_described(t)}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be {_dtype_names(FLOAT_DTYPES)}, got {t.dtype}")


def check_tensor(name: str, t, dtypes: torch.dtype | tuple[torch.dtype, ...], shape: tuple, layout: str) -> None:
    """`t` is a tensor of exactly this dtype (or one of these), such as int32 for indices and lengths or uint8
    for packed codes, and of this shape, where None stands for any size: (num_seqs, None) is "num_seqs rows
    of any width"."""
    fits = (isinstance(t, torch.Tensor) and t.dtype in (dtypes if isinstance(dtypes, tuple) else (dtypes,))
            and t.dim() == len(shape) and all(want is None or have == want for have, want in zip(t.shape, shape)))
    if not fits:
        raise ValueError(f"{name} must be a {len(shape)}-D {_dtype_names(dtypes)} tensor {layout}, "
                         f"got {_described(t)}")


def check_device(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """`t` lives where `ref` does: a kernel reads all its pointers on one device."""
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def check_same_dtype(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """`t` has `ref`'s dtype: the kernel is compiled for one element type per pointer."""
    if t.dtype != ref.dtype:
        raise ValueError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}")


def check_same_shape(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{name_a} and {name_b} must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")


def check_head_dim(name: str, head_dim: int, smallest: int = 16, largest: int | None = 256) -> None:
    """tl.arange spans a power of two, so the head dimension must be one. The attention kernels also need at
    least 16 (tl.dot's inner dimension) and at most 256, the largest head their launch configurations are
    sized for; a plain copy passes smallest=1, largest=None."""
    if head_dim < smallest or (largest is not None and head_dim > largest) or head_dim & (head_dim - 1):
        bounds = f" in [{smallest}, {largest}]" if largest is not None else ""
        raise ValueError(f"{name} head_dim must be a power of two{bounds}, got {head_dim}")


def check_gqa_heads(heads_q: int, heads_kv: int, kv_names: str) -> None:
    """Grouped-query attention: every KV head serves the same number of query heads."""
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"the number of q heads ({heads_q}) must be a multiple of {kv_names} heads ({heads_kv})")


def check_unit_stride(name: str, t: torch.Tensor, why: str = "") -> None:
    """The kernel walks `t`'s last dimension with stride 1; a wrapper copies a read-only input that is not, but
    a tensor written in place (an output, a cache) has to be so already."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension{why}")


def check_out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The output buffer: a new one shaped like q, or the caller's, which must match q and be unit-stride."""
    if out is None:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must match q ({tuple(q.shape)}, {q.dtype}, {q.device}), got "
                         f"({tuple(out.shape)}, {out.dtype}, {out.device})")
    check_unit_stride("out", out)
    return out


def check_launchable(name: str, t: torch.Tensor, kernel) -> None:
    """A CPU tensor can run only in Triton's interpreter. Whether the kernels are interpreted was fixed when
    their module was imported (TRITON_INTERPRET=1 then), so `kernel`, a @triton.jit function, tells."""
    if t.device.type == "cpu" and isinstance(kernel, triton.runtime.JITFunction):
        raise ValueError(f"{name} is a CPU tensor but Triton is compiling for a GPU: set TRITON_INTERPRET=1 "
                         "before importing mini_engine.kernels to run the kernel in the interpreter")
