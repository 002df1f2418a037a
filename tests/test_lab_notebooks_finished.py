"""Every lab notebook, run top to bottom as a student who finished the lab runs it: the reference solution in place
of the stub.

`make test` already runs the lab notebooks under nbval with the stubs, where each part says "not implemented yet";
that never reaches the code after a part, which only a finished lab runs. Here the kernel, before the notebook's
first cell, puts `solutions.labNN_topic` in `sys.modules` under the stub's name, `labs.labNN_topic`: the notebook's
own `import labs.labNN_topic as lab` (and its reload) then gets the solution, with no text of the notebook changed.
The module keeps its own name, so the ranks a notebook starts (lab 11) import the solution too.

A notebook fails this test when a cell raises, when a part still prints its `attempt` message ("not implemented
yet"), or when its grader cell (pytest on the lab's tests with --impl=labs, which then grades the solution under
the labs' name) does not say that every test passes. The failure names the cell: its index in the notebook (every
cell counted, markdown too, from 0) and its first line of code.

In the grader, this module is a plugin (PYTEST_ADDOPTS names it) that leaves out the lab's slow engine checks:
`make test` runs them on the solutions already (tests/labs), and run a second time they would make a notebook take
minutes; the quick tests still show that the grader passes a finished lab under the labs' name.

One notebook runs at a time, in a kernel of its own that is shut down before the next starts.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parent.parent
LABS = ROOT / "labs"
NOTEBOOKS = sorted(LABS.glob("lab[0-9][0-9]_notebook.ipynb"))
CELL_TIMEOUT = 1200  # seconds, as `make test` gives a notebook cell under nbval: the machine may be busy

# What a notebook prints when a part it tries is still a stub (every lab's `attempt`, lab 04's try blocks), and
# what its grader cell prints when every test passes.
NOT_WRITTEN = "not implemented yet"
GRADER_PASSED = "all tests pass"

pytestmark = pytest.mark.slow


def solution_in_place(notebook: Path) -> str:
    """The code the kernel runs before the notebook: the lab's solution module under the stub's name."""
    lab = notebook.name.removesuffix("_notebook.ipynb")
    (module,) = [p.stem for p in LABS.glob(f"{lab}_*.py") if not p.name.endswith("_notebook.py")]
    return (f"import importlib, os, sys\n"
            f"sys.path[:0] = [{str(ROOT)!r}, {str(Path(__file__).parent)!r}]\n"
            f"sys.modules['labs.{module}'] = importlib.import_module('solutions.{module}')\n"
            f"os.environ['PYTEST_ADDOPTS'] = '-p {Path(__file__).stem}'\n")


def pytest_collection_modifyitems(config, items):
    """In the grader a notebook runs (as the plugin solution_in_place names): its engine checks left out."""
    slow = [item for item in items if item.get_closest_marker("engine") is not None
            or "real_model" in getattr(item, "fixturenames", ())]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item not in slow]


def first_line(cell) -> str:
    """The cell's first line of code (its opening comments skipped), by which a reader finds it."""
    lines = [line.strip() for line in cell.source.splitlines() if line.strip()]
    code = [line for line in lines if not line.startswith("#")]
    return (code or lines or [""])[0]


def printed(cell) -> str:
    return "".join(out.get("text", "") for out in cell.get("outputs", ()) if out.get("output_type") == "stream")


def without_colours(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def run_finished(notebook: Path, before: str, folder: Path):
    """Runs `notebook` in a fresh kernel started in `folder`, after the code `before`; fails naming the first cell
    that raises, prints NOT_WRITTEN, or is a grader that does not print GRADER_PASSED. Returns the notebook with its
    outputs and each code cell's (seconds, index)."""
    nb = nbformat.read(notebook, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(folder)}})
    where = notebook.relative_to(ROOT) if ROOT in notebook.parents else notebook.name
    times = []

    def run_aside(source: str):
        """Runs code that is not the notebook's (nbclient stores a cell it runs at its index: here, past the end)."""
        nb.cells.append(nbformat.v4.new_code_cell(source))
        try:
            return printed(client.execute_cell(nb.cells[-1], len(nb.cells) - 1, store_history=False))
        finally:
            nb.cells.pop()

    with client.setup_kernel():
        run_aside(before)
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            began = time.perf_counter()
            name = f"{where}, cell {index} (`{first_line(cell)}`)"
            try:
                client.execute_cell(cell, index)
            except CellExecutionError as err:
                pytest.fail(f"{name} raised {err.ename}: {err.evalue}\n{without_colours(str(err))}", pytrace=False)
            times.append((time.perf_counter() - began, index))
            shown = printed(cell)
            stub = next((line for line in shown.splitlines() if NOT_WRITTEN in line), None)
            if stub is not None:
                pytest.fail(f"{name} prints {stub.strip()!r} with the solution in place:\n{shown}", pytrace=False)
            if "pytest.main(" in cell.source and GRADER_PASSED not in shown:
                pytest.fail(f"{name}, the grader, does not print {GRADER_PASSED!r} with the solution in place:\n"
                            f"{shown}", pytrace=False)
        # The kernel's CPU seconds, its ranks' and workers' included: on a busy machine a truer measure than the
        # clock of what the notebook costs.
        nb.metadata["cpu_seconds"] = float(run_aside(
            "import resource\nprint(sum(getattr(resource.getrusage(who), field) for field in ('ru_utime', 'ru_stime')"
            " for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))"))
    return nb, times


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_the_finished_lab_notebook_runs_top_to_bottom(notebook):
    start = time.perf_counter()
    nb, times = run_finished(notebook, solution_in_place(notebook), LABS)  # a notebook runs from its own folder
    slowest = ", ".join(f"cell {i} {s:.0f} s" for s, i in sorted(times, reverse=True)[:3])
    graded = [line for cell in nb.cells if "pytest.main(" in cell.source
              for line in without_colours(printed(cell)).splitlines() if re.search(r"\d+ passed", line)]
    print(f"{notebook.relative_to(ROOT)}: {time.perf_counter() - start:.0f} s with the solution in place, "
          f"{nb.metadata.cpu_seconds:.0f} CPU seconds (slowest cells: {slowest}); grader: {' '.join(graded) or 'none'}")


# ---------------------------------------------------------------- the check itself, on small notebooks

def small_notebook(tmp_path: Path, *sources: str) -> Path:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# A lab")] +
                                  [nbformat.v4.new_code_cell(source) for source in sources])
    path = tmp_path / "lab99_notebook.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.mark.parametrize("sources, says", [
    (("x = 1", "# the second part\ny = {}['missing']"),
     r"cell 2 \(`y = \{\}\['missing'\]`\) raised KeyError: 'missing'"),
    (("print('part 1: not implemented yet: fill in the TODO')",),
     r"cell 1 \(`print\(.*\)`\) prints 'part 1: not implemented yet: fill in the TODO'"),
    (("code = pytest.main([])  # the grader\nprint('some tests still fail')",),
     r"cell 1 \(`code = pytest.main\(\[\]\)  # the grader`\), the grader, does not print 'all tests pass'"),
], ids=["raises", "not-written", "grader-fails"])
def test_a_failure_names_the_cell(tmp_path, sources, says):
    notebook = small_notebook(tmp_path, *sources)
    with pytest.raises(pytest.fail.Exception, match=says):
        run_finished(notebook, "pytest = type('pytest', (), {'main': staticmethod(lambda args: 1)})", tmp_path)


def test_the_solution_stands_in_for_the_stub(tmp_path):
    notebook = small_notebook(tmp_path, "import labs.lab01_naive as lab\nimportlib.reload(lab)\n"
                                        "print(lab.__name__, lab.naive_generate.__module__)")
    nb, _ = run_finished(notebook, solution_in_place(LABS / "lab01_notebook.ipynb"), tmp_path)
    assert printed(nb.cells[1]).split() == ["solutions.lab01_naive"] * 2
