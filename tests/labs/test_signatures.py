"""The student's stubs and the reference solutions expose the same API, so one test file grades both; and every
part a stub asks for is watched by its grader for a hand-off to the engine."""
import importlib
import inspect
from pathlib import Path

from tools.sync_notebooks import is_notebook_source

ROOT = Path(__file__).resolve().parents[2]


def _lab_modules(tree: str) -> set[str]:
    # Lab notebooks' jupytext sources live beside the stubs in labs/; they are not lab modules.
    return {p.stem for p in (ROOT / tree).glob("lab[0-9][0-9]_*.py") if not is_notebook_source(p)}


def _public_api(module) -> dict[str, object]:
    """Functions and classes the module defines itself (imports excluded), by name."""
    return {
        name: obj
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(obj) or inspect.isclass(obj))
        and obj.__module__ == module.__name__
    }


def _signature(obj, module) -> str:
    try:
        signature = str(inspect.signature(obj))
    except ValueError:  # classes built on C types (exceptions, say) have none to compare
        return "(no signature)"
    # Rendered without the module's own prefix, so a class defined in both trees reads the same.
    return signature.replace(f"{module.__name__}.", "")


def _has_docstring(obj) -> bool:
    doc = (obj.__doc__ or "").strip()
    # A dataclass without a docstring gets an invented one, "Name(field: type, ...)": not documentation.
    return bool(doc) and not (inspect.isclass(obj) and doc.startswith(f"{obj.__name__}("))


def _methods(cls) -> dict[str, object]:
    """Public methods, static and class methods unwrapped to their functions; properties excluded."""
    methods = {name: getattr(attr, "__func__", attr) for name, attr in vars(cls).items() if not name.startswith("_")}
    return {name: fn for name, fn in methods.items() if inspect.isfunction(fn)}


def _api_differences(lab: str) -> list[str]:
    stub, solution = (importlib.import_module(f"{tree}.{lab}") for tree in ("labs", "solutions"))
    stub_api, solution_api = _public_api(stub), _public_api(solution)
    problems = [f"{lab}: `{name}` is in solutions/ but not in labs/" for name in solution_api.keys() - stub_api.keys()]
    problems += [f"{lab}: `{name}` is in labs/ but not in solutions/" for name in stub_api.keys() - solution_api.keys()]
    for name in sorted(stub_api.keys() & solution_api.keys()):
        pairs = [(name, stub_api[name], solution_api[name])]
        if inspect.isclass(stub_api[name]) and inspect.isclass(solution_api[name]):
            stub_methods, solution_methods = _methods(stub_api[name]), _methods(solution_api[name])
            problems += [
                f"{lab}: method `{name}.{m}` exists in only one of labs/ and solutions/"
                for m in sorted(stub_methods.keys() ^ solution_methods.keys())
            ]
            pairs += [
                (f"{name}.{m}", stub_methods[m], solution_methods[m])
                for m in sorted(stub_methods.keys() & solution_methods.keys())
            ]
        for qualname, a, b in pairs:
            sig_a, sig_b = _signature(a, stub), _signature(b, solution)
            if sig_a != sig_b:
                problems.append(f"{lab}: `{qualname}` signatures differ: labs{sig_a} vs solutions{sig_b}")
        for tree, obj in (("labs", stub_api[name]), ("solutions", solution_api[name])):
            if not _has_docstring(obj):
                problems.append(f"{lab}: `{name}` in {tree}/ has no docstring")
    return problems


def test_every_lab_has_a_stub_and_a_solution():
    stubs, solutions = _lab_modules("labs"), _lab_modules("solutions")
    assert stubs == solutions, (
        f"labs without a solution: {sorted(stubs - solutions)}; solutions without a stub: {sorted(solutions - stubs)}"
    )


def test_stubs_and_solutions_share_signatures_and_docstrings():
    labs = sorted(_lab_modules("labs") & _lab_modules("solutions"))
    problems = [p for lab in labs for p in _api_differences(lab)]
    assert not problems, "\n".join(problems)


def test_every_part_a_lab_asks_for_is_guarded(asked_for):
    """Each function a stub leaves to write is watched by its grader (SHORTCUTS in tests/labs/test_labNN.py, see
    conftest.py): under its own name, through its class, or through the given code that runs it (GIVEN)."""
    problems = []
    for lab in sorted(_lab_modules("labs")):
        grader = importlib.import_module(f"test_{lab[:5]}")  # this folder is on sys.path, as pytest imports it
        shortcuts, given = getattr(grader, "SHORTCUTS", {}), getattr(grader, "GIVEN", {})
        watched = set(shortcuts) | {part for name, part in given.items() if name in shortcuts}
        problems += [f"{lab}: `{part}` is not watched: name it (or its class) in SHORTCUTS of {grader.__name__}.py"
                     for part in asked_for(lab) if part not in watched and part.partition(".")[0] not in watched]
    assert not problems, "\n".join(problems)
