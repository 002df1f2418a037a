"""The one check of mini_engine/kernels/checks.py that the wrappers' own tests cannot reach on a machine
without a GPU: CPU tensors run in Triton's interpreter when it is on, and when the kernels are compiled for
a GPU they are refused, before anything is launched, with a message that names the argument and says how to
run them. The test of each wrapper holds on both kinds of machine."""
import pytest
import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from mini_engine.kernels import (flash_attention, flash_attention_varlen, paged_decode_attention, rejection_sampler,
                                 store_kv_cache, w4a16_matmul, w8a16_matmul)
from mini_engine.kernels.checks import check_launchable
from mini_engine.kernels.flash_attention import INTERPRETED

REFUSED = "is a CPU tensor but Triton is compiling for a GPU: set TRITON_INTERPRET=1"


def _add(x, y):
    return x + y


def test_a_compiled_kernel_refuses_cpu_tensors_and_an_interpreted_one_takes_them():
    compiled, interpreted = triton.runtime.JITFunction(_add), InterpretedFunction(_add)
    with pytest.raises(ValueError, match=f"^x {REFUSED}"):
        check_launchable("x", torch.zeros(4), compiled)
    check_launchable("x", torch.zeros(4), interpreted)


def small_valid_calls():
    """One small, valid call of each wrapper, on CPU tensors: (the argument named when they are refused, call)."""
    q, kv = torch.randn(1, 2, 16, 16), torch.randn(1, 1, 16, 16)
    cu = torch.tensor([0, 16], dtype=torch.int32)
    cache = torch.randn(2, 16, 1, 16)
    tables, lens = torch.tensor([[1]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    probs = torch.softmax(torch.randn(1, 2, 8), -1)
    return {
        "flash_attention": ("q", lambda: flash_attention(q, kv, kv)),
        "flash_attention_varlen": ("q", lambda: flash_attention_varlen(q[0].transpose(0, 1), kv[0].transpose(0, 1),
                                                                       kv[0].transpose(0, 1), cu, cu, 16, 16)),
        "paged_decode_attention": ("q", lambda: paged_decode_attention(q[0, :, 0][None], cache, cache, tables, lens)),
        "store_kv_cache": ("k", lambda: store_kv_cache(kv[0, :, :2].transpose(0, 1), kv[0, :, :2].transpose(0, 1),
                                                       cache.clone(), cache.clone(),
                                                       torch.tensor([3, -1], dtype=torch.int32))),
        "w4a16_matmul": ("x", lambda: w4a16_matmul(torch.randn(2, 64), torch.zeros(16, 32, dtype=torch.uint8),
                                                   torch.ones(2, 16, 2), 32)),
        "w8a16_matmul": ("x", lambda: w8a16_matmul(torch.randn(2, 64), torch.zeros(16, 64, dtype=torch.int8),
                                                   torch.ones(16))),
        "rejection_sampler": ("draft_token_ids", lambda: rejection_sampler(
            probs, torch.tensor([[3]]), torch.tensor([1], dtype=torch.int32), None, torch.rand(1, 1),
            1 / torch.rand(1, 8))),
    }


@pytest.mark.parametrize("wrapper", list(small_valid_calls()))
def test_cpu_tensors_run_in_the_interpreter_or_are_refused(wrapper):
    name, call = small_valid_calls()[wrapper]
    if INTERPRETED:
        call()
    else:
        with pytest.raises(ValueError, match=f"^{name} {REFUSED}"):
            call()
