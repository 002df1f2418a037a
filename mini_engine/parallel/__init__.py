"""Tensor parallelism (chapter 11): one model split across ranks, Megatron-LM style, served by the same engine.

`LLM("smollm2-135m", tensor_parallel_size=3)` (vLLM's name) loads the model once, checks that the size divides its
heads, KV heads, MLP width and vocabulary, cuts every weight into its ranks' shares (`layers.py`), starts ranks
1 ... size-1 as processes joined by torch.distributed (`comm.py`: gloo on a CPU, NCCL between GPUs) and keeps rank
0's share in this process (`ranks.ParallelModel`), which the engine then runs as it runs a LlamaModel: scheduling,
paging, prefix caching and sampling stay on rank 0, unchanged. The core reads the same without this package;
`load_model` imports it only when tensor_parallel_size > 1.
"""
from __future__ import annotations

import torch

from .layers import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding,
                     check_tensor_parallel_size, rank_config, shard_model, shard_weights)
from .ranks import ParallelModel, threads_per_rank, timeout_s

__all__ = ["ColumnParallelLinear", "ParallelLMHead", "ParallelModel", "RowParallelLinear", "VocabParallelEmbedding",
           "check_tensor_parallel_size", "rank_config", "shard_model", "shard_weights", "load_parallel",
           "threads_per_rank", "timeout_s"]


def load_parallel(name_or_path: str, device, dtype, attention_backend: str, quantization, size: int):
    """(ParallelModel, tokenizer): `load_model(..., tensor_parallel_size=size)`. A size that does not divide the
    model, or weights not built for several ranks, is a ValueError before any process starts."""
    from ..attention import resolve_backend
    from ..loading.loader import load_model

    if quantization is not None:
        raise ValueError(f"quantization={quantization!r} is not built for tensor_parallel_size > 1 (got {size}); "
                         "use quantization=None or one process")
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size={size} needs a GPU per rank (NCCL), but {torch.cuda.device_count()} "
                         "are visible; run the ranks on device='cpu' instead")
    backend = resolve_backend(attention_backend, device)
    full, tokenizer = load_model(name_or_path, device="cpu", dtype=dtype, attention_backend=backend, cpu_backend=False)
    check_tensor_parallel_size(full.config, size)
    return ParallelModel(full, size, device), tokenizer
