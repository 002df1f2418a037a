"""Tensor and pipeline parallelism (chapter 11): one model split across ranks that are processes of their own,
served by the same engine.

`LLM("smollm2-135m", tensor_parallel_size=3)` (vLLM's name) loads the model once, checks that the size divides its
heads, KV heads, MLP width and vocabulary, cuts every weight into its ranks' shares, Megatron-LM style (`layers.py`),
starts ranks 1 ... size-1 as processes joined by torch.distributed (`comm.py`: gloo on a CPU, NCCL between GPUs)
and keeps rank 0's share in this process (`ranks.ParallelModel`), which the engine then runs as it runs a
LlamaModel: scheduling, paging, prefix caching and sampling stay on rank 0, unchanged. `sequence_parallel=True`
also splits the norms and the residual stream over tokens (`sequence.py`). `pipeline_parallel_size=p` instead
cuts the stack of layers into p stages (`pipeline.py`). The core reads the same without this package: `LLM`
imports it only when the model runs in more than one process.
"""
from __future__ import annotations

import torch

from .collectives import (COLLECTIVES, Overlap, all_reduce_from_halves, check_collectives, collective_seconds,
                          overlap_seconds)
from .layers import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding,
                     check_tensor_parallel_size, rank_config, shard_model, shard_weights)
from .ranks import ParallelModel, threads_per_rank, timeout_s
from .sequence import apply_sequence_parallel, residual_bytes

__all__ = ["COLLECTIVES", "ColumnParallelLinear", "Overlap", "ParallelLMHead", "ParallelModel", "RowParallelLinear",
           "VocabParallelEmbedding", "all_reduce_from_halves", "apply_sequence_parallel", "check_collectives",
           "check_tensor_parallel_size", "collective_seconds", "load_parallel", "overlap_seconds", "rank_config",
           "residual_bytes", "shard_model", "shard_weights", "threads_per_rank", "timeout_s"]


def load_parallel(config):
    """(model, tokenizer) for an `EngineConfig` whose model runs in several processes: a `ParallelModel` at
    tensor_parallel_size ranks, or a `pipeline.PipelineModel` at pipeline_parallel_size stages. A size that does not
    fit the model, or weights not built for several ranks, is a ValueError before any process starts."""
    from ..attention import resolve_backend
    from ..loading.loader import load_model

    size = config.num_ranks
    if config.quantization is not None:
        raise ValueError(f"quantization={config.quantization!r} is not built for a model split over {size} processes; "
                         "use quantization=None or one process")
    device = torch.device(config.device)
    first = (device.index or 0) if device.type == "cuda" else 0
    if device.type == "cuda" and torch.cuda.device_count() < first + size:
        raise ValueError(f"{size} ranks from {device} need a GPU each (NCCL), but {torch.cuda.device_count()} are "
                         "visible; run the ranks on device='cpu' instead")
    backend = resolve_backend(config.attention_backend, device)
    full, tokenizer = load_model(config.model, device="cpu", dtype=config.dtype, attention_backend=backend,
                                 cpu_backend=False)
    if config.pipeline_parallel_size > 1:
        from .pipeline import PipelineModel
        return PipelineModel(full, config.pipeline_parallel_size, device,
                             micro_batches=config.pipeline_micro_batches), tokenizer
    check_tensor_parallel_size(full.config, size)
    return ParallelModel(full, size, device, sequence_parallel=config.sequence_parallel), tokenizer
