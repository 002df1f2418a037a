"""The device helpers every chapter, lab, benchmark and the CLI size their work with: the dtype a GPU runs the
model in, the SDPA kernel a GPU has, and workloads fitted to the GPU's free memory. GPUs are mocked (their
compute capability and free memory), so these run on any machine."""
import re
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend

import mini_engine as me
from mini_engine.course import devices

ROOT = Path(__file__).resolve().parents[1]
GPUS = {"T4": (7, 5), "A100": (8, 0), "L4": (8, 9), "H100": (9, 0)}


@pytest.fixture
def gpu(monkeypatch):
    """A mocked CUDA GPU of a chosen compute capability, whose is_bf16_supported() says True as a T4's does
    (it counts emulation)."""
    def install(capability):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    return install


@pytest.mark.parametrize("name,expected", [("T4", "float16"), ("A100", "bfloat16"), ("L4", "bfloat16"),
                                           ("H100", "bfloat16")], ids=["sm75-T4", "sm80-A100", "sm89-L4", "sm90-H100"])
def test_default_dtype_follows_the_compute_capability(gpu, name, expected):
    capability = GPUS[name]
    gpu(capability)
    for device in ("cuda", "cuda:0", torch.device("cuda", 0)):
        assert me.default_dtype(device) == expected, f"{name} (sm_{capability[0]}{capability[1]}) on {device!r}"


def test_default_dtype_is_float32_on_a_cpu_and_names_a_dtype_the_engine_takes(gpu):
    gpu(GPUS["T4"])
    assert me.default_dtype("cpu") == me.default_dtype(torch.device("cpu")) == "float32"
    for capability in GPUS.values():
        gpu(capability)
        assert isinstance(getattr(torch, me.default_dtype("cuda")), torch.dtype)
    with pytest.raises(ValueError, match="device"):
        me.default_dtype("meta")


@pytest.mark.parametrize("name,dtype,expected", [
    ("T4", torch.float16, SDPBackend.EFFICIENT_ATTENTION), ("A100", torch.bfloat16, SDPBackend.FLASH_ATTENTION),
    ("A100", torch.float32, SDPBackend.EFFICIENT_ATTENTION), ("H100", torch.float16, SDPBackend.FLASH_ATTENTION)],
    ids=["T4-fp16", "A100-bf16", "A100-fp32", "H100-fp16"])
def test_sdpa_backend_is_flash_only_where_the_gpu_has_it(gpu, name, dtype, expected):
    gpu(GPUS[name])
    assert devices.sdpa_backend("cuda", dtype) == expected
    assert devices.sdpa_backend("cpu", dtype) is None  # SDPA picks its own kernel on a CPU


@pytest.fixture
def gpu_memory(monkeypatch):
    """A mocked GPU with `free` bytes free by the driver's count and `spare` more held, unused, by PyTorch."""
    def install(free, spare=0):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 16 * 2**30))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * 2**30 + spare)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2 * 2**30)
    return install


def test_fitting_skips_what_the_gpu_cannot_hold_and_says_why(gpu_memory, capsys):
    gpu_memory(free=14 * 2**30, spare=2 * 2**30)  # 16 GiB available to new tensors
    naive = lambda n: 9 * n * n * 2 * 3  # noqa: E731  (three bf16 score tensors of 9 heads)
    kept = devices.fitting([4096, 8192, 16384, 32768], naive, "cuda", what="N")
    assert kept == [4096, 8192, 16384]  # 13.5 GiB at N = 16384 fits; 54 GiB at N = 32768 does not
    printed = capsys.readouterr().out
    assert "N = 32768: skipped" in printed and "54.0 GiB" in printed and "16.0 GiB free" in printed, printed
    assert "16384" not in printed


def test_fitting_shrinks_a_workload_to_the_largest_that_fits(gpu_memory, capsys):
    gpu_memory(free=3 * 2**30)
    kv_bytes = lambda batch: batch * 4096 * 23 * 1024  # noqa: E731  (SmolLM2's bf16 KV cache per token)
    assert devices.fitting([64, 32, 16, 8], kv_bytes, "cuda", what="batch")[0] == 16
    assert capsys.readouterr().out.count("skipped") == 2


def test_fitting_keeps_every_size_on_a_cpu(monkeypatch):
    def no_gpu(*args, **kwargs):
        raise AssertionError("a CPU run must not ask CUDA for its memory")
    monkeypatch.setattr(torch.cuda, "mem_get_info", no_gpu)
    assert devices.fitting([1, 10**6], lambda n: float(n) ** 4, "cpu") == [1, 10**6]
    assert devices.free_memory("cpu") is None


# Ways of choosing bf16 for any GPU: by device alone ("float32" if device == "cpu" else "bfloat16"), hard-coded
# for CUDA, or from is_bf16_supported(), which is True on a T4. default_dtype(device) decides instead.
BF16_FOR_EVERY_GPU = [
    re.compile(r"""["']cpu["']\s+else\s+(["']bfloat16["']|torch\.bfloat16)"""),
    re.compile(r"""(["']bfloat16["']|torch\.bfloat16)\s+if\s+[^\n]*(cuda|device)"""),
    re.compile(r"""device\s*=\s*["']cuda["'][^\n]*dtype\s*=\s*(["']bfloat16["']|torch\.bfloat16)"""),
    re.compile(r"""is_bf16_supported\("""),
]
SOURCES = ["chapters/*.py", "labs/*.py", "solutions/*.py", "benchmarks/*.py", "benchmarks/*.sh",
           "mini_engine/__main__.py", "mini_engine/bench/*.py", "mini_engine/serving/*.py"]


def test_no_chapter_lab_or_benchmark_chooses_bf16_for_every_gpu():
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for pattern in SOURCES for path in sorted(ROOT.glob(pattern))
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if any(p.search(line) for p in BF16_FOR_EVERY_GPU)]
    assert not found, ("these choose bf16 on every GPU (a T4 has none; use mini_engine.default_dtype(device)):\n"
                       + "\n".join(found))


def test_the_check_above_catches_each_way():
    for line in ('dtype = "float32" if device == "cpu" else "bfloat16"',
                 'dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32',
                 'model = me.load_model(folder, device="cuda", dtype="bfloat16")',
                 'dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"'):
        assert any(p.search(line) for p in BF16_FOR_EVERY_GPU), line
    for line in ('dtype = me.default_dtype(device)', 'other = "bfloat16" if dtype == "float32" else "float32"'):
        assert not any(p.search(line) for p in BF16_FOR_EVERY_GPU), line


def test_warm_up_hands_the_backend_every_row_count_the_runs_will_bring(monkeypatch):
    """The chapters warm a model through the course's helper, never the backend itself: a number means every power
    of two up to it (the tuner decides per power of two), a list means those counts."""
    from mini_engine.backends import cpu as cpu_backend

    asked = []
    monkeypatch.setattr(cpu_backend, "warm_up", lambda model, rows: asked.append(rows))
    for rows in (1, 16, 100, 256, (1, 16, 64)):
        devices.warm_up("model", rows)
    assert asked == [(1,), (1, 2, 4, 8, 16), (1, 2, 4, 8, 16, 32, 64, 128), (1, 2, 4, 8, 16, 32, 64, 128, 256),
                     (1, 16, 64)]
