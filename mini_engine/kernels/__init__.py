"""Triton kernels, each next to its torch reference and wrapper.

Importing this package imports triton but never sets TRITON_INTERPRET: to run the kernels on CPU
tensors, set TRITON_INTERPRET=1 in the environment before importing it.
"""
from .flash_attention import attention_reference, flash_attention, flash_attention_varlen
from .int8_matmul import w8a16_matmul, w8a16_matmul_reference
from .kv_store import store_kv_cache, store_kv_cache_reference
from .paged_attention import paged_decode_attention, paged_decode_attention_reference
from .quant_matmul import w4a16_matmul, w4a16_matmul_reference
from .rejection_sampler import rejection_sampler

__all__ = ["flash_attention", "flash_attention_varlen", "attention_reference",
           "paged_decode_attention", "paged_decode_attention_reference", "store_kv_cache", "store_kv_cache_reference",
           "rejection_sampler", "w4a16_matmul", "w4a16_matmul_reference", "w8a16_matmul", "w8a16_matmul_reference"]
