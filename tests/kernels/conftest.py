"""Kernel tests run natively on a GPU and in Triton's interpreter on CPU tensors everywhere else.

Triton decides between compiling and interpreting when `@triton.jit` decorates a kernel, reading
TRITON_INTERPRET from the environment, so the variable must be set before any kernel module is
imported. A conftest is imported before the test modules it governs, which makes it the place.
"""
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    if "mini_engine.kernels" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("mini_engine.kernels was imported before tests/kernels/conftest.py could set "
                           "TRITON_INTERPRET=1; run with TRITON_INTERPRET=1 in the environment")
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
