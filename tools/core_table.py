"""Regenerate the table of core files in mini_engine/README.md (between its core-table markers).

    python tools/core_table.py           # rewrite the table from the files
    python tools/core_table.py --check   # exit 1 if the README's table is stale

The core is every top-level mini_engine/*.py but __main__.py. Each row: the file, its line count (as `wc -l`
counts: newlines), the chapter numbers its module docstring names (`chapter 03`, `chapters 02-07`), sorted, and
the docstring's first sentence. Files come in reading order (READING_ORDER), then any other top-level file by
name. Reads the files as text: nothing is imported, so it runs without torch.
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mini_engine"
README = PACKAGE / "README.md"
START, END = "<!-- core-table:start -->", "<!-- core-table:end -->"
READING_ORDER = ["config", "model", "attention", "kv_cache", "paging", "scheduler", "engine", "sampling",
                 "speculative", "generate", "engine_config", "runner", "outputs", "metrics", "devices",
                 "compiled_decode", "__init__"]
# "chapter 03", "chapters 02-07", and the lists "chapters 03 and 09", "chapters 01, 03 and 06".
CHAPTER = re.compile(r"chapters? (\d\d(?:-\d\d)?(?:(?:, | and )\d\d(?:-\d\d)?)*)", re.IGNORECASE)
# A sentence ends at . ! or ? followed by space and a capital, a backtick or a quote ("Kwon et al. 2023" does not).
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`\"'])")


def core_files() -> list[Path]:
    files = {p.stem: p for p in PACKAGE.glob("*.py") if p.name != "__main__.py"}
    known = [files.pop(name) for name in READING_ORDER if name in files]
    return known + [files[name] for name in sorted(files)]


def line_count(path: Path) -> int:
    return path.read_bytes().count(b"\n")


def docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def chapters(doc: str) -> str:
    """The chapters `doc` names, sorted; a chapter inside a range also named ("02" and "02-07") is left out."""
    found = {c for names in CHAPTER.findall(doc) for c in re.split(r", | and ", names)}
    ranges = [tuple(map(int, c.split("-"))) for c in found if "-" in c]
    found = {c for c in found if "-" in c or not any(lo <= int(c) <= hi for lo, hi in ranges)}
    return ", ".join(sorted(found)) or "–"


def first_sentence(doc: str) -> str:
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    return SENTENCE_END.split(paragraph, maxsplit=1)[0].replace("|", "\\|")


def table() -> str:
    rows = ["| file | lines | chapters (the first adds it) | what it holds (its docstring's first sentence) |",
            "| --- | ---: | --- | --- |"]
    total = 0
    files = core_files()
    for path in files:
        doc, lines = docstring(path), line_count(path)
        total += lines
        rows.append(f"| `{path.name}` | {lines} | {chapters(doc)} | {first_sentence(doc)} |")
    rows.append(f"| **the core: {len(files)} files** | **{total}** | | |")
    return "\n".join(rows)


def rewritten(text: str) -> str:
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise SystemExit(f"{README}: needs one {START} line followed by one {END} line")
    head, rest = text.split(START)
    _, tail = rest.split(END)
    return f"{head}{START}\n{table()}\n{END}{tail}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the README's table is stale; write nothing")
    args = parser.parse_args(argv)
    text = README.read_text()
    new = rewritten(text)
    if args.check:
        if new != text:
            print(f"{README.relative_to(ROOT)}: the core table is stale; run python tools/core_table.py",
                  file=sys.stderr)
            return 1
        return 0
    if new != text:
        README.write_text(new)
        print(f"rewrote the core table in {README.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
