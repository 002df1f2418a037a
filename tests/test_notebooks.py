"""Committed notebooks match their jupytext sources, carry no outputs, and open on Colab.

The checks over this checkout pass when it has no notebooks yet; the tests on a scratch tree below
show that each check catches what it is for.
"""
import json
import re
from pathlib import Path

import jupytext
import pytest

from tools import course_setup
from tools.sync_notebooks import (
    ROOT,
    committed_notebooks,
    is_notebook_source,
    main,
    notebook_sources,
    orphans,
    out_of_sync,
    sync,
    with_outputs,
)

HEADER = """\
# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---
"""
CHAPTER = HEADER + """
# %% [markdown]
# # A chapter

# %%
import sys
if "google.colab" in sys.modules:
    print("installing")

# %% tags=["raises-exception"]
raise NotImplementedError
"""


def _first_code_cell(path: Path) -> str:
    return next((c.source for c in jupytext.read(path).cells if c.cell_type == "code"), "")


# --- this checkout ---------------------------------------------------------------------------

def test_every_notebook_source_has_its_ipynb_in_sync():
    problems = out_of_sync()
    assert not problems, "\n".join(problems)


def test_committed_notebooks_hold_no_outputs():
    problems = with_outputs()
    assert not problems, "\n".join(problems)


def test_every_notebook_has_a_source():
    problems = orphans()
    assert not problems, "\n".join(problems)


def test_every_chapter_script_is_a_notebook_source():
    # chapters/NN_topic.py only exists as a notebook source; without the header it would be ignored.
    plain = [p.name for p in (ROOT / "chapters").glob("[0-9A][0-9]_*.py") if not is_notebook_source(p)]
    assert not plain, f"chapter sources without the jupytext header (formats: ipynb,py:percent): {plain}"


def test_every_lab_has_a_notebook():
    modules = [p for p in (ROOT / "labs").glob("lab[0-9][0-9]_*.py") if not is_notebook_source(p)]
    missing = sorted(p.name for p in modules if not (ROOT / "labs" / f"{p.name[:5]}_notebook.ipynb").exists())
    assert not missing, f"lab modules without a notebook labs/labNN_notebook.py (+ .ipynb via `make sync`): {missing}"


def test_every_notebook_opens_with_the_colab_setup_cell():
    # The cell installs the course on Colab from COURSE_URL (tests/test_colab_setup.py runs it).
    wrong = [p.relative_to(ROOT).as_posix() for p in committed_notebooks()
             if _first_code_cell(p) != course_setup.setup_cell(lab=p.parent.name == "labs")]
    assert not wrong, (f"first code cell is not the Colab setup cell of tools/course_setup.py: {wrong} "
                       "(run `make sync`, which writes it into every notebook source)")


def test_readme_links_point_to_the_course_repository():
    repo = course_setup.COURSE_URL.removeprefix("https://github.com/")
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"https://(?:colab\.research\.google\.com/github|mybinder\.org/v2/gh)/([^/]+/[^/]+)/", readme)
    assert links, "README.md has no Colab or Binder links"
    assert set(links) == {repo}, f"README's Colab/Binder links name {sorted(set(links))}, not {repo} (COURSE_URL)"


# --- the checks themselves, on a scratch tree ------------------------------------------------

@pytest.fixture
def tree(tmp_path):
    (tmp_path / "chapters").mkdir()
    (tmp_path / "labs").mkdir()
    (tmp_path / "chapters" / "00_intro.py").write_text(CHAPTER)
    (tmp_path / "labs" / "lab01_loop.py").write_text('"""A lab module, not a notebook."""\n\ndef f():\n    return 1\n')
    return tmp_path


def test_only_files_with_the_jupytext_header_are_sources(tree):
    assert [p.relative_to(tree).as_posix() for p in notebook_sources(tree)] == ["chapters/00_intro.py"]


def test_a_missing_ipynb_is_reported_then_synced(tree):
    assert out_of_sync(tree) == ["chapters/00_intro.py: no 00_intro.ipynb (run `make sync`)"]
    assert sync(tree) == [tree / "chapters" / "00_intro.ipynb"]
    assert out_of_sync(tree) == with_outputs(tree) == orphans(tree) == []
    assert sync(tree) == [], "a second sync rewrote an up-to-date notebook"
    assert main(["--check", "--root", str(tree)]) == 0


def test_synced_notebook_is_stripped_with_python3_kernel_and_tags(tree):
    sync(tree)
    nb = json.loads((tree / "chapters" / "00_intro.ipynb").read_text())
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    assert [c["cell_type"] for c in nb["cells"]] == ["markdown", "code", "code"]
    assert nb["cells"][2]["metadata"]["tags"] == ["raises-exception"]
    assert all(c["outputs"] == [] and c["execution_count"] is None for c in nb["cells"][1:])


def test_an_edited_source_is_out_of_sync(tree):
    sync(tree)
    source = tree / "chapters" / "00_intro.py"
    source.write_text(source.read_text().replace("installing", "installing the package"))
    assert out_of_sync(tree) == [
        "chapters/00_intro.py: 00_intro.ipynb differs from its source from cell 1 on "
        "(3 cells in the source, 3 in the notebook; run `make sync`)"
    ]
    assert main(["--check", "--root", str(tree)]) == 1


def test_outputs_and_orphans_are_reported(tree):
    sync(tree)
    ipynb = tree / "chapters" / "00_intro.ipynb"
    nb = json.loads(ipynb.read_text())
    nb["cells"][1]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["installing\n"]}]
    nb["cells"][1]["execution_count"] = 1
    ipynb.write_text(json.dumps(nb))
    (tree / "labs" / "scratch.ipynb").write_text(json.dumps(nb))
    assert out_of_sync(tree) == []  # same cells: outputs are a separate problem
    assert with_outputs(tree) == [
        "chapters/00_intro.ipynb: cells [1] hold outputs (run `make sync`)",
        "labs/scratch.ipynb: cells [1] hold outputs (run `make sync`)",
    ]
    assert orphans(tree) == ["labs/scratch.ipynb: no paired .py source with a jupytext header"]
    assert committed_notebooks(tree) == [ipynb, tree / "labs" / "scratch.ipynb"]
