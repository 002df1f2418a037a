"""Ahead-of-time compilation: what each Triton kernel becomes on a GPU that is not in this machine.

Triton compiles for a *named* GPU without one present: the Python source goes to Triton IR, then to
PTX for that architecture, then through NVIDIA's `ptxas` (bundled with Triton) to a cubin. No CUDA
driver is involved, so a CPU-only CI machine can prove that every kernel builds for each GPU the course
names (gpus.TARGETS: a T4, an L4, an A100 and an H100) with the launch configuration its wrapper would
pick there, and read off what the GPU would need to run it: shared memory per block, registers per
thread, and register spills.

A kernel module joins by exposing `aot_specs(gpu, dtype) -> list[KernelSpec]` (what its wrapper
launches on that GPU for that dtype, in the variants the course uses) and being listed once in
`KERNEL_MODULES`.

Compilation needs `@triton.jit` to have produced real JIT functions, which it does not under
TRITON_INTERPRET=1 (the tests and the CPU notebooks set it). `compile_all` therefore always compiles
in fresh Python processes with TRITON_INTERPRET unset, one per core (at most 8: each imports torch),
so it works from any process; `compile_kernel` is the in-process step those workers run. Compiled
kernels land in Triton's own cache (~/.triton/cache), so a second run of the same kernels takes seconds.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import triton

from .gpus import TARGETS, GPUSpec

# Every module with a Triton kernel, each exposing aot_specs(gpu, dtype); tests/kernels/test_aot.py
# fails on a kernel module missing from this list.
KERNEL_MODULES = ("mini_engine.kernels.flash_attention", "mini_engine.kernels.paged_attention",
                  "mini_engine.kernels.kv_store", "mini_engine.kernels.rejection_sampler",
                  "mini_engine.kernels.quant_matmul", "mini_engine.kernels.int8_matmul")

# Triton's names for the element types, as they appear in a signature ("*bf16" is a bf16 pointer).
TRITON_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass(frozen=True)
class KernelSpec:
    """One compilation of one kernel: exactly what its wrapper launches for some GPU and dtype.

    signature: every runtime argument's Triton type, in triton.tools.compile's notation: "*fp16:16" is
      a pointer and "i32:16" an integer that the launch sees divisible by 16 (Triton specialises on
      that, so the hint changes the code: loads vectorise); "i32" is an integer it does not specialise.
    constexprs: every compile-time argument (tl.constexpr parameters, and pointers passed as None).
    options: launch options (num_warps, num_stages); any left out take Triton's defaults, as a launch
      that omits them does.
    label: how a caller gets here, e.g. "dense causal, head_dim 64".
    """
    kernel: object  # the @triton.jit function (a JITFunction, or an InterpretedFunction under the interpreter)
    signature: dict[str, str]
    constexprs: dict[str, object]
    options: dict[str, int] = field(default_factory=dict)
    label: str = ""

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    @property
    def tile(self) -> str:
        """The tile sizes (constexprs named BLOCK_*), e.g. '128x64'."""
        return "x".join(str(v) for k, v in self.constexprs.items() if k.startswith("BLOCK")) or "-"


@dataclass(frozen=True)
class Build:
    """A kernel compiled for one GPU, or why it did not compile (`error`)."""
    kernel: str
    gpu: str
    arch: int          # 75 for sm_75
    dtype: str         # "fp16", "bf16" or "fp32"
    label: str
    tile: str
    num_warps: int = 0
    num_stages: int = 0
    shared_memory: int = 0   # bytes per block, the figure Triton checks against the GPU's limit at load
    registers: int = 0       # per thread
    spill_bytes: int = 0     # local memory per thread: ptxas's stack frame, which for Triton code is spills
    cubin_bytes: int = 0
    ptx: str = ""
    error: str | None = None

    @property
    def where(self) -> str:
        """Which kernel, GPU, dtype and configuration: the first words of every failure message."""
        return f"{self.kernel} on {self.gpu} (sm_{self.arch}), {self.dtype}, {self.label}, tile {self.tile}"


def jobs(gpus=TARGETS, spec_fns=None) -> list[tuple[KernelSpec, GPUSpec, str]]:
    """Every (spec, gpu, dtype) that the course launches on these GPUs: each module's aot_specs answers for
    every dtype, with all its variants in the dtype a model runs in there (`GPUSpec.model_dtype`: fp16 on a
    T4, bf16 from sm_80) and those few that run in another (gpu_check.sh's fp16 pass on a bf16 GPU, chapter
    06's fp32 target, fp32 probabilities), or none.
    spec_fns: aot_specs-like functions; by default those of every module in KERNEL_MODULES."""
    if spec_fns is None:
        spec_fns = [importlib.import_module(module).aot_specs for module in KERNEL_MODULES]
    return [(spec, gpu, name) for specs_of in spec_fns for gpu in gpus for dtype, name in TRITON_DTYPES.items()
            for spec in specs_of(gpu, dtype)]


def compile_kernel(spec: KernelSpec, gpu: GPUSpec, dtype: str) -> Build:
    """Compile in this process for `gpu`; the kernel must be a real JITFunction (no TRITON_INTERPRET)."""
    if not isinstance(spec.kernel, triton.runtime.JITFunction):
        raise RuntimeError(f"{spec.name} was defined under TRITON_INTERPRET=1: use compile_all, "
                           "which compiles in processes without it")
    names = spec.kernel.arg_names
    missing = set(names) - set(spec.signature) - set(spec.constexprs)
    if missing:
        raise ValueError(f"{spec.name}: aot spec gives neither a type nor a value for {sorted(missing)}")
    signature = {n: spec.signature.get(n, "constexpr").split(":")[0] for n in names}
    # tt.divisibility is the attribute a launch attaches to arguments it saw divisible by 16.
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in spec.signature.items() if t.endswith(":16")}
    source = triton.compiler.ASTSource(spec.kernel, signature, spec.constexprs, attrs)
    target = triton.backends.compiler.GPUTarget("cuda", gpu.arch, 32)
    compiled = triton.compile(source, target=target, options=spec.options)
    registers, spill_bytes = _resource_usage(compiled.asm["cubin"])
    return Build(spec.name, gpu.name, gpu.arch, dtype, spec.label, spec.tile,
                 compiled.metadata.num_warps, compiled.metadata.num_stages, compiled.metadata.shared,
                 registers, spill_bytes, len(compiled.asm["cubin"]), compiled.asm["ptx"])


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """Registers per thread and stack bytes per thread, read from the cubin by cuobjdump (bundled with
    Triton). On a GPU, Triton reports the same two figures as kernel.n_regs and kernel.n_spills (the
    stack bytes / 4), but only after loading the kernel through the driver."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-res-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return int(found[1]), int(found[2])


def compile_all(jobs: list[tuple[KernelSpec, GPUSpec, str]], workers: int | None = None) -> list[Build]:
    """Compile every job, in parallel worker processes without TRITON_INTERPRET; Builds in job order.

    Jobs that compile to the same code (the same kernel, types, constexprs and options for the same
    architecture: paged decode for SmolLM2-135M's group of 3 query heads and for 1.7B's group of 1, which
    both pad to 16 rows, say) are compiled once, and each gets that Build under its own label. A kernel that fails to compile comes back as a
    Build with `error` set, so one bad configuration does not hide the others.
    """
    payloads, first_of = [], {}  # the distinct compilations; where each one's Build will be among them
    for spec, gpu, dtype in jobs:
        if _code_key(spec, gpu) not in first_of:
            first_of[_code_key(spec, gpu)] = len(payloads)
            payloads.append({"kernel": _kernel_path(spec), "gpu": dataclasses.asdict(gpu), "dtype": dtype,
                             "spec": {"signature": spec.signature, "constexprs": spec.constexprs,
                                      "options": spec.options, "label": spec.label}})
    workers = max(1, min(workers or os.cpu_count() or 1, 8, len(payloads)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # The workers import the kernel modules as this process did (a lab solution, say, from the repo root).
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)

    def run(shard: list[dict]) -> list[dict]:
        done = subprocess.run([sys.executable, "-m", "mini_engine.kernels.aot"], input=json.dumps(shard),
                              capture_output=True, text=True, env=env)
        if done.returncode:
            raise RuntimeError(f"aot worker failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        return json.loads(done.stdout)

    # Shard i takes compilations i, i + workers, ...: each worker gets a mix of cheap and expensive kernels.
    with ThreadPoolExecutor(workers) as pool:
        shards = list(pool.map(run, [payloads[i::workers] for i in range(workers)]))
    compiled = [None] * len(payloads)
    for i, shard in enumerate(shards):
        compiled[i::workers] = [Build(**b) for b in shard]
    return [dataclasses.replace(compiled[first_of[_code_key(spec, gpu)]], gpu=gpu.name, dtype=dtype,
                                label=spec.label, tile=spec.tile)
            for spec, gpu, dtype in jobs]


def _kernel_path(spec: KernelSpec) -> str:
    """"module:name", how a worker process finds the kernel."""
    return f"{spec.kernel.fn.__module__}:{spec.name}"


def _code_key(spec: KernelSpec, gpu: GPUSpec) -> str:
    """Everything the compiled code depends on: two jobs with the same key compile to the same cubin."""
    return json.dumps([_kernel_path(spec), gpu.arch, spec.signature, spec.constexprs, spec.options], sort_keys=True)


def _worker() -> None:
    """Compile the jobs read as JSON on stdin; write their Builds as JSON on stdout."""
    # Triton prints a failing kernel's whole PTX to stdout, and tools it runs inherit stdout: point
    # file descriptor 1 at stderr and keep a private copy of the real stdout for the answer alone.
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    builds = []
    for job in json.load(sys.stdin):
        module, name = job["kernel"].split(":")
        spec = KernelSpec(getattr(importlib.import_module(module), name), **job["spec"])
        gpu = GPUSpec(**job["gpu"] | {"capability": tuple(job["gpu"]["capability"])})
        try:
            build = compile_kernel(spec, gpu, job["dtype"])
        except Exception as e:  # noqa: BLE001 (any compiler error becomes the Build's message)
            build = Build(spec.name, gpu.name, gpu.arch, job["dtype"], spec.label, spec.tile,
                          error=f"{type(e).__name__}: {e}"[:3000])
        builds.append(dataclasses.asdict(build))
    json.dump(builds, answer)
    answer.close()


if __name__ == "__main__":
    _worker()
