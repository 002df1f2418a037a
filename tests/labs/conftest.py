"""Lab grading: one test file per lab runs against the student's labs/ or the reference solutions/.

A test module names its lab once, `LAB = "lab01_naive"`, and takes the `impl` fixture: the module
`labs.lab01_naive` under `--impl=labs`, `solutions.lab01_naive` under `--impl=solutions` (the default).
This folder has no __init__.py on purpose: it would make it a package named `labs`, shadowing the stubs.

A test module may also name, per lab function, the engine's finished functions that already do that
function's job (functions, or whole modules and classes): `SHORTCUTS = {"naive_generate":
[me.generate_naive], "forward_flops": [formulas]}`. Through `impl`, each call of that lab function then
fails, in one line, if it reached any of them: the lab asks for the piece itself, not a call to the engine.
A lab class may be named too (`{"ContinuousBatcher": [scheduler]}`): then every method of its instances is
watched, so a `run()` that hands the work to the engine's scheduler fails the same way.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import sys

import pytest

import mini_engine as me


def functions_of(*owners) -> list:
    """Every function and method defined in these modules or classes (imports excluded)."""
    found = []
    for owner in owners:
        name = owner.__name__ if inspect.ismodule(owner) else owner.__module__
        for attr, obj in vars(owner).items():
            if attr.startswith("__"):
                continue
            obj = getattr(obj, "__func__", obj)  # static and class methods
            if inspect.isclass(obj) and obj.__module__ == name:
                found += functions_of(obj)
            elif inspect.isfunction(obj) and obj.__module__ == name:
                found.append(obj)
    return found


def _code(fn):
    fn = inspect.unwrap(fn)
    return getattr(fn, "__code__", None)


def _watched(name: str, fn, forbidden: dict):
    """`fn`, failing in one line if a call of it reaches one of the `forbidden` functions (by code object)."""

    def guarded(*args, **kwargs):
        hits = []

        def watch(frame, event, _arg):
            if event == "call" and frame.f_code in forbidden and not hits:
                hits.append(forbidden[frame.f_code])

        previous = sys.getprofile()
        sys.setprofile(watch)
        try:
            result = fn(*args, **kwargs)
        finally:
            sys.setprofile(previous)
            if hits:
                hit = hits[0]
                pytest.fail(f"{name}() calls the engine's finished {hit.__module__}.{hit.__qualname__}(), which "
                            f"already does this lab's job: write {name} yourself from the pieces its "
                            "docstring names", pytrace=False)
        return result

    return functools.wraps(fn)(guarded)


class _Guarded:
    """The lab module, with some of its functions run under a watch for engine shortcuts."""

    def __init__(self, module, shortcuts: dict[str, list]):
        self._module = module
        self._shortcuts = {}
        for name, owners in shortcuts.items():
            fns = [f for o in owners for f in (functions_of(o) if inspect.ismodule(o) or inspect.isclass(o) else [o])]
            self._shortcuts[name] = {_code(f): f for f in fns if _code(f) is not None}

    def __getattr__(self, name):
        obj = getattr(self._module, name)
        if name not in self._shortcuts or not callable(obj):
            return obj
        forbidden = self._shortcuts[name]
        if inspect.isclass(obj):
            # A subclass whose own methods are watched: instances still pass isinstance(obj) and keep state.
            methods = {attr: _watched(f"{name}.{attr}", fn, forbidden) for attr, fn in vars(obj).items()
                       if inspect.isfunction(fn) and (attr == "__init__" or not attr.startswith("__"))}
            return type(name, (obj,), {**methods, "__module__": obj.__module__, "__doc__": obj.__doc__})
        return _watched(name, obj, forbidden)

    def __repr__(self):
        return f"<{self._module.__name__}, guarded against engine shortcuts>"


@pytest.fixture(scope="module")
def impl(request):
    lab = getattr(request.module, "LAB", None)
    if lab is None:
        pytest.fail(f"{request.module.__name__} uses `impl` but does not name its lab (LAB = 'labNN_topic')")
    module = importlib.import_module(f"{request.config.getoption('--impl')}.{lab}")
    shortcuts = getattr(request.module, "SHORTCUTS", None)
    return _Guarded(module, shortcuts) if shortcuts else module


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    # A stub that is still a TODO is the expected state of a fresh lab, not a crash: say so in
    # one line instead of a traceback through the test's internals.
    report = yield
    if call.excinfo is not None and call.excinfo.errisinstance(NotImplementedError):
        frame = call.excinfo.traceback[-1]
        report.longrepr = (
            f"not implemented yet: {frame.path.name}:{frame.lineno + 1} in {frame.name}(): "
            f"{call.excinfo.value or 'fill in the TODO'}"
        )
    return report


@pytest.fixture(scope="session")
def real_model():
    """The embedded SmolLM2-135M-Instruct (fp32, CPU), loaded once for all lab tests."""
    return me.load_model("smollm2-135m", device="cpu", dtype="float32")
