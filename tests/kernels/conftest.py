"""Kernel tests run natively on a GPU and in Triton's interpreter on CPU tensors everywhere else.

TRITON_INTERPRET must be set before any kernel module is imported (Triton reads it when `@triton.jit`
decorates a kernel); tests/conftest.py sets it when no GPU is visible, before any test module loads.
"""
import pytest
import torch


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
