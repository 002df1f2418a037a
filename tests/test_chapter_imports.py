"""The numbered chapters (chapters/00_... to 10_...) teach ideas that hold on any machine: none of them imports the
optional CPU backend (`mini_engine.backends`). What they need of it (its choices made before anything is timed)
they get through the course's helpers (`mini_engine.course.devices.warm_up`); how it works is the optional
appendix A1's subject, and appendices may import it."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUMBERED = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.py"))
BACKENDS = "mini_engine.backends"


def backend_imports(source: str) -> list[str]:
    """Each place in `source` that imports the backend: `import`, `from ... import` (the package named whole or
    through `from mini_engine import backends`) or a module name handed to importlib, with its line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = [module] + [f"{module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        else:
            continue
        if any(n == BACKENDS or n.startswith(BACKENDS + ".") for n in names):
            found.append(f"line {node.lineno}: {ast.get_source_segment(source, node)}")
    return found


def test_the_check_finds_every_way_of_importing_the_backend():
    for line in ("from mini_engine.backends.cpu import warm_up", "import mini_engine.backends.cpu as cpu",
                 "from mini_engine import backends", "from mini_engine.backends import cpu",
                 "importlib.import_module('mini_engine.backends.cpu')"):
        assert backend_imports(line), line
    assert not backend_imports("from mini_engine.course.devices import warm_up\n# mini_engine.backends in a comment")


def test_no_numbered_chapter_imports_the_backend():
    assert len(NUMBERED) >= 11, [p.name for p in NUMBERED]
    offenders = {p.name: found for p in NUMBERED if (found := backend_imports(p.read_text()))}
    assert not offenders, ("numbered chapters import the CPU backend (use mini_engine.course.devices.warm_up; the "
                           f"backend's own story is appendix A1's): {offenders}")
