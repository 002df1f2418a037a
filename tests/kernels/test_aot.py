"""Every Triton kernel compiles for each GPU the course names: a T4 (sm_75), an L4 (sm_89), an A100 (sm_80)
and an H100 (sm_90), with no GPU here.

For each registered kernel (aot.KERNEL_MODULES, plus lab 05's solution), every variant the course launches
on each GPU (`aot.jobs`: the model's dtype there, fp16 on a T4 and bf16 from sm_80, and the few launches in
another: gpu_check.sh's fp16 pass, chapter 06's fp32 target, fp32 probabilities and compact scales; SmolLM2's
shapes; the chapters' sweeps of block sizes, head sizes, causal and not, group sizes, draft counts), in the launch
configuration the wrapper picks for that GPU, is compiled ahead of time to PTX and a cubin
(mini_engine/kernels/aot.py) and checked against that GPU: the shared memory it needs per block, and no
registers spilled to local memory. Each variant is a test named by kernel, GPU, dtype and variant; variants
that compile to the same code are compiled once. About two CPU-minutes, about a minute on an idle 2-core CPU;
Triton's cache (~/.triton/cache, or TRITON_CACHE_DIR), which the worker processes share, makes a rerun take
seconds.
"""
import importlib
import pathlib
import re

import pytest
import torch

from mini_engine.kernels import aot
from mini_engine.kernels.aot import KernelSpec

lab05 = importlib.import_module("solutions.lab05_flash_attention")


def lab05_specs(gpu, dtype):
    """Lab 05's kernels as its wrappers launch them: fp32 only (its flash_attention casts to fp32),
    Triton's default warps and stages (the wrappers pass none), the lab's 16 x 16 tiles."""
    if dtype != torch.float32:
        return []
    ptr = "*fp32:16"
    return [KernelSpec(lab05.attention_kernel, dict(Q=ptr, K=ptr, V=ptr, Out=ptr, seq_len="i32", qk_scale="fp32"),
                       dict(CAUSAL=True, HEAD_DIM=64, BLOCK_M=16, BLOCK_N=16), label="causal, head_dim 64"),
            KernelSpec(lab05._tile_step_kernel, dict(Acc=ptr, L=ptr, M=ptr, QK=ptr, V=ptr),
                       dict(BLOCK_M=16, BLOCK_N=16, HEAD_DIM=16), label="one 16 x 16 tile, head_dim 16")]


JOBS = aot.jobs() + aot.jobs(spec_fns=[lab05_specs])


def job_id(job):
    spec, gpu, dtype = job
    return f"{spec.name}-sm_{gpu.arch}-{dtype}-{spec.label}"


@pytest.fixture(scope="module")
def builds():
    # One parallel compilation of everything; each test below then checks one build.
    return dict(zip(map(job_id, JOBS), aot.compile_all(JOBS)))


@pytest.mark.parametrize("job", JOBS, ids=job_id)
def test_kernel_compiles_within_the_gpus_limits(job, builds):
    _, gpu, _ = job
    build = builds[job_id(job)]
    assert build.error is None, f"{build.where} does not compile:\n{build.error}"
    assert build.shared_memory <= gpu.shared_memory_per_block, (
        f"{build.where} needs {build.shared_memory} B of shared memory per block, {gpu.name} has "
        f"{gpu.shared_memory_per_block} B: the launch would fail with OutOfResources. Pick a smaller tile "
        f"or fewer stages for this GPU in the wrapper's launch config.")
    assert build.spill_bytes == 0, (
        f"{build.where} spills registers: {build.spill_bytes} B of local memory per thread at "
        f"{build.registers} registers, {build.num_warps} warps. Every spilled value is a round trip to "
        f"device memory inside the loop: give the tile more warps or make it smaller in the wrapper's "
        f"launch config.")


def test_every_kernel_module_is_registered():
    folder = pathlib.Path(aot.__file__).parent
    with_kernels = {f"mini_engine.kernels.{path.stem}" for path in folder.glob("*.py")
                    if re.search(r"^@triton\.jit", path.read_text(), re.MULTILINE)}
    missing = sorted(with_kernels - set(aot.KERNEL_MODULES))
    assert not missing, (f"{missing} define Triton kernels but are not in aot.KERNEL_MODULES: give each an "
                         f"aot_specs(gpu, dtype) listing what its wrapper launches, and add it there")
