"""Keep every notebook's .ipynb in step with its jupytext source.

A notebook source is a .py file in chapters/ or labs/ whose jupytext header pairs it with an
.ipynb in the percent format:

    # ---
    # jupyter:
    #   jupytext:
    #     formats: ipynb,py:percent
    # ...

The header is what tells a notebook source from a plain module: labs/ also holds the lab modules
(labs/labNN_topic.py) that tests import, and those carry no header. The .py is the source of truth;
the .ipynb is generated from it, outputs stripped and kernelspec python3, so it opens as-is in
Colab and JupyterLab.

    python tools/sync_notebooks.py           # rewrite every .ipynb whose source changed
    python tools/sync_notebooks.py --check   # exit 1 and list every pair that is out of step
"""
from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import jupytext

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIRS = ("chapters", "labs")
KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}


def is_notebook_source(path: Path) -> bool:
    formats = jupytext.read(path, fmt="py:percent").metadata.get("jupytext", {}).get("formats", "")
    return {"ipynb", "py:percent"} <= set(formats.split(","))


def notebook_sources(root: Path = ROOT) -> list[Path]:
    return sorted(p for d in NOTEBOOK_DIRS for p in (root / d).glob("*.py") if is_notebook_source(p))


def committed_notebooks(root: Path = ROOT) -> list[Path]:
    return sorted(p for d in NOTEBOOK_DIRS for p in (root / d).glob("*.ipynb"))


def _stable_ids(cells) -> None:
    # jupytext draws random cell ids; ids derived from the content keep regenerated files diff-free.
    seen: dict[str, int] = {}
    for cell in cells:
        digest = hashlib.sha1(f"{cell.cell_type}\0{cell.source}".encode()).hexdigest()[:8]
        seen[digest] = seen.get(digest, 0) + 1
        cell.id = digest if seen[digest] == 1 else f"{digest}-{seen[digest]}"


def render(source: Path) -> str:
    """The .ipynb text that `source` should have on disk."""
    nb = jupytext.read(source)
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    _stable_ids(nb.cells)
    return jupytext.writes(nb, fmt="ipynb")


def _cells(nb) -> list[tuple[str, str, list[str]]]:
    # nbval reads tags (e.g. raises-exception), so they count as content alongside type and source.
    return [(c.cell_type, c.source, list(c.metadata.get("tags", []))) for c in nb.cells]


def out_of_sync(root: Path = ROOT) -> list[str]:
    """Sources whose .ipynb is missing or whose cells differ from the source's."""
    problems = []
    for source in notebook_sources(root):
        ipynb = source.with_suffix(".ipynb")
        name = source.relative_to(root)
        if not ipynb.exists():
            problems.append(f"{name}: no {ipynb.name} (run `make sync`)")
            continue
        expected, actual = _cells(jupytext.read(source)), _cells(jupytext.read(ipynb))
        if expected != actual:
            at = next((i for i, (e, a) in enumerate(zip(expected, actual)) if e != a), min(len(expected), len(actual)))
            problems.append(
                f"{name}: {ipynb.name} differs from its source from cell {at} on "
                f"({len(expected)} cells in the source, {len(actual)} in the notebook; run `make sync`)"
            )
    return problems


def with_outputs(root: Path = ROOT) -> list[str]:
    """Committed notebooks that still carry outputs or execution counts."""
    problems = []
    for ipynb in committed_notebooks(root):
        cells = jupytext.read(ipynb).cells
        dirty = [i for i, c in enumerate(cells) if c.get("outputs") or c.get("execution_count") is not None]
        if dirty:
            problems.append(f"{ipynb.relative_to(root)}: cells {dirty} hold outputs (run `make sync`)")
    return problems


def orphans(root: Path = ROOT) -> list[str]:
    """Notebooks with no source to regenerate them from."""
    sources = set(notebook_sources(root))
    return [
        f"{ipynb.relative_to(root)}: no paired .py source with a jupytext header"
        for ipynb in committed_notebooks(root)
        if ipynb.with_suffix(".py") not in sources
    ]


def sync(root: Path = ROOT) -> list[Path]:
    """Regenerate every .ipynb whose text differs from its source's rendering; return those written."""
    written = []
    for source in notebook_sources(root):
        ipynb, text = source.with_suffix(".ipynb"), render(source)
        if not ipynb.exists() or ipynb.read_text(encoding="utf-8") != text:
            ipynb.write_text(text, encoding="utf-8")
            written.append(ipynb)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="report out-of-step pairs instead of fixing them")
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    args = parser.parse_args(argv)
    if args.check:
        problems = out_of_sync(args.root) + with_outputs(args.root) + orphans(args.root)
        print("\n".join(problems) or f"{len(notebook_sources(args.root))} notebooks in sync")
        return 1 if problems else 0
    for ipynb in sync(args.root):
        print(f"wrote {ipynb.relative_to(args.root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
