"""Kernel tests run natively on a GPU and in Triton's interpreter on CPU tensors everywhere else.

TRITON_INTERPRET must be set before any kernel module is imported (Triton reads it when `@triton.jit`
decorates a kernel); tests/conftest.py sets it when no GPU is visible, before any test module loads. So a
machine runs the kernels one way only: a test that launches one builds its tensors on `device`. Tests of
the wrappers' input checks build CPU tensors on every machine: the checks all run before the launch, and
the ones that read values (lengths, table entries, slots) run on CPU tensors only, since on a GPU they would
make the host wait for the device on every step.
"""
import pytest
import torch

import mini_engine as me


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def gpu_dtype() -> torch.dtype:
    """The dtype the course runs a model in on this GPU (bf16 from compute capability 8.0, fp16 on a T4): the
    real-size tests use it."""
    return getattr(torch, me.default_dtype("cuda"))
