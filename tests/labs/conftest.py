"""Lab grading: one test file per lab runs against the student's labs/ or the reference solutions/.

A test module names its lab once, `LAB = "lab01_naive"`, and takes the `impl` fixture: the module
`labs.lab01_naive` under `--impl=labs`, `solutions.lab01_naive` under `--impl=solutions` (the default).
This folder has no __init__.py on purpose: it would make it a package named `labs`, shadowing the stubs.

A test module may also name, per lab function, the engine's finished functions that already do that
function's job (functions, or whole modules and classes): `SHORTCUTS = {"naive_generate":
[me.generate_naive], "forward_flops": [formulas]}`. Through `impl`, each call of that lab function then
fails, in one line, if it reached any of them: the lab asks for the piece itself, not a call to the engine.
A lab class may be named too (`{"ContinuousBatcher": [scheduler]}`): then every method of its instances is
watched, so a `run()` that hands the work to the engine's scheduler fails the same way. What a list names
may also be a Triton kernel (a call from the lab's own kernels is found in their source too, since on a GPU a
compiled kernel runs out of Python's sight) or a C function such as `F.scaled_dot_product_attention`.
A given function that runs a piece the student writes (lab 05's `flash_attention` runs their tile step) can
be watched as well; `GIVEN = {"flash_attention": "attention_tile_step"}` makes its message name that piece.

Tests of the guards themselves take the `mutant` fixture (the solution with parts replaced by ones that hand
their job to the engine), `hand_off` (a grading test must fail such a mutant, naming the part) or `asked_for`
(what the stub leaves to write). They grade the solutions' mutants, not the student's work, so under
`--impl=labs` they are left out.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import re
import sys
import types
from pathlib import Path

import pytest

import mini_engine as me


def _is_triton(obj) -> bool:
    """A @triton.jit function, compiled or run by Triton's interpreter; `obj.fn` is its Python source function."""
    return type(obj).__module__.startswith("triton.") and inspect.isfunction(getattr(obj, "fn", None))


def _defined_in(obj, module_name: str) -> bool:
    return getattr(obj.fn if _is_triton(obj) else obj, "__module__", None) == module_name


def functions_of(*owners) -> list:
    """Every function, method (constructors and property getters too) and Triton kernel defined in these
    modules or classes (imports excluded); anything else passed, a function or a C function, is kept as is."""
    found = []
    for owner in owners:
        if not (inspect.ismodule(owner) or inspect.isclass(owner)):
            found.append(owner)
            continue
        name = owner.__name__ if inspect.ismodule(owner) else owner.__module__
        for attr, obj in vars(owner).items():
            if attr.startswith("__") and inspect.ismodule(owner):
                continue
            obj = getattr(obj, "__func__", obj)  # static and class methods
            obj = obj.fget if isinstance(obj, property) else obj
            if inspect.isclass(obj) and obj.__module__ == name:
                found += functions_of(obj)
            elif (inspect.isfunction(obj) or _is_triton(obj)) and _defined_in(obj, name):
                found.append(obj)
    return found


def _code(fn):
    fn = inspect.unwrap(fn.fn if _is_triton(fn) else fn)
    return getattr(fn, "__code__", None)


def _watch_keys(fn) -> list:
    """How a call of `fn` shows to the profiler: by its code object; a Triton kernel's also by file and name
    (the interpreter runs a rewritten copy of its code); a C function by its identity."""
    code = _code(fn)
    if code is None:
        return [id(fn)] if callable(fn) else []
    return [code, (code.co_filename, code.co_name)] if _is_triton(fn) else [code]


def _global_names(code) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _global_names(const)
    return names


def _kernels_reached(fn, kernel_modules: set[str], seen: set) -> list:
    """The Triton kernels `fn`'s source can reach: global names its code uses (attributes too, on a module that
    holds forbidden kernels), followed through its own module's functions and kernels. On a GPU a compiled
    kernel runs out of the profiler's sight, so its calls are read from the source instead."""
    fn = fn.fn if _is_triton(fn) else inspect.unwrap(fn)
    if not inspect.isfunction(fn) or fn in seen:
        return []
    seen.add(fn)
    names, found = _global_names(fn.__code__), []
    for name in names:
        obj = fn.__globals__.get(name)
        near = [getattr(obj, n, None) for n in names] if inspect.ismodule(obj) and obj.__name__ in kernel_modules \
            else [obj]
        for candidate in near:
            if _is_triton(candidate):
                found.append(candidate)
            if _is_triton(candidate) or (inspect.isfunction(candidate) and candidate.__module__ == fn.__module__):
                found += _kernels_reached(candidate, kernel_modules, seen)
    return found


def _raises_not_implemented(fn) -> bool:
    code = _code(fn)
    return code is not None and "NotImplementedError" in _global_names(code)


def _describe(hit) -> str:
    fn = hit.fn if _is_triton(hit) else hit
    where = getattr(fn, "__module__", None) or type(fn).__module__
    what = f"{where}.{getattr(fn, '__qualname__', fn)}()"
    return f"the engine's finished {what}" if where.startswith("mini_engine") else what


def _watched(name: str, fn, forbidden: dict, fix: str | None = None):
    """`fn`, failing in one line if a call of it reaches one of the `forbidden` functions (keyed as `_watch_keys`
    makes them). `fix` names the piece to write when `fn` is given code that runs it."""
    kernels = {k for k in forbidden.values() if _is_triton(k)}
    kernel_modules = {k.fn.__module__ for k in kernels}
    kernel_names = {key for key in forbidden if isinstance(key, tuple)}

    def fail(hit):
        given = f" (the given {name} runs it: leave that as it is)" if fix else ""
        pytest.fail(f"{name}() calls {_describe(hit)}, which already does this lab's job: write {fix or name} "
                    f"yourself from the pieces its docstring names{given}", pytrace=False)

    def guarded(*args, **kwargs):
        reached = [k for k in _kernels_reached(fn, kernel_modules, set()) if k in kernels] if kernels else []
        if reached:
            fail(reached[0])
        hits = []

        def watch(frame, event, arg):
            if hits:
                return
            if event == "call":
                code = frame.f_code
                hit = forbidden.get(code)
                if hit is None and kernel_names:
                    hit = forbidden.get((code.co_filename, code.co_name))
            elif event == "c_call":
                hit = forbidden.get(id(arg))
            else:
                return
            if hit is not None:
                hits.append(hit)

        previous = sys.getprofile()
        sys.setprofile(watch)
        try:
            result = fn(*args, **kwargs)
        finally:
            sys.setprofile(previous)
            if hits:
                fail(hits[0])
        return result

    return functools.wraps(fn)(guarded)


class _Guarded:
    """The lab module, with some of its functions run under a watch for engine shortcuts."""

    def __init__(self, module, shortcuts: dict[str, list], given: dict[str, str] | None = None):
        self._module, self._given = module, given or {}
        self._shortcuts = {}
        for name, owners in shortcuts.items():
            self._shortcuts[name] = {key: f for f in functions_of(*owners) for key in _watch_keys(f)}

    def __getattr__(self, name):
        obj = getattr(self._module, name)
        if name not in self._shortcuts or not callable(obj):
            return obj
        forbidden, fix = self._shortcuts[name], self._given.get(name)
        if inspect.isclass(obj):
            # A subclass whose methods (its bases' too, but for the engine's own) are watched: instances still
            # pass isinstance(obj) and keep state.
            own = {attr: fn for cls in reversed(obj.__mro__[:-1]) for attr, fn in vars(cls).items()}
            methods = {attr: _watched(f"{name}.{attr}", fn, forbidden, fix) for attr, fn in own.items()
                       if inspect.isfunction(fn) and (attr == "__init__" or not attr.startswith("__"))
                       and _code(fn) not in forbidden}
            return type(name, (obj,), {**methods, "__module__": obj.__module__, "__doc__": obj.__doc__})
        return _watched(name, obj, forbidden, fix)

    def __repr__(self):
        return f"<{self._module.__name__}, guarded against engine shortcuts>"


@pytest.fixture(scope="module")
def impl(request):
    lab = getattr(request.module, "LAB", None)
    if lab is None:
        pytest.fail(f"{request.module.__name__} uses `impl` but does not name its lab (LAB = 'labNN_topic')")
    module = importlib.import_module(f"{request.config.getoption('--impl')}.{lab}")
    shortcuts = getattr(request.module, "SHORTCUTS", None)
    return _Guarded(module, shortcuts, getattr(request.module, "GIVEN", None)) if shortcuts else module


@pytest.fixture
def mutant(request):
    """mutant(name=replacement, ...): the reference solution with some functions or classes replaced, guarded as
    `impl` is by the module's SHORTCUTS. A test builds a mutant that hands a lab function's job to the engine
    and checks that a grading test fails on it: proof that the guard works. A replacement given as source text
    is added to the end of the solution's source, run as a module file of its own: then the solution's code that
    looks the name up when it runs (a given kernel calling the student's Triton function) uses the mutant."""
    module = importlib.import_module(f"solutions.{request.module.LAB}")

    def build(**replacements):
        fake = types.ModuleType(module.__name__)
        sources = [text for text in replacements.values() if isinstance(text, str)]
        if sources:  # Triton reads a kernel's source from its file, so the mutant gets one
            path = request.getfixturevalue("tmp_path") / f"{module.__name__.rpartition('.')[2]}_mutant.py"
            path.write_text("\n\n".join([inspect.getsource(module), *sources]))
            spec = importlib.util.spec_from_file_location(f"{module.__name__}_mutant", path)
            fake = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = fake  # a dataclass looks its module up while its class is made
            try:
                spec.loader.exec_module(fake)
            finally:
                del sys.modules[spec.name]
        else:
            fake.__dict__.update(vars(module))
        fake.__dict__.update({name: part for name, part in replacements.items() if not isinstance(part, str)})
        return _Guarded(fake, request.module.SHORTCUTS, getattr(request.module, "GIVEN", None))
    return build


@pytest.fixture
def hand_off(request, mutant):
    """hand_off(part, replacement, test, **args) checks that the grading function `test` fails the solution whose
    `part` (a function, or a "Class.method" whose class `replacement` is) hands its job to the engine, with the
    guard's message naming the part. The test's other fixtures are looked up by name; `args` gives the rest."""

    def check(part: str, replacement, test, **args):
        wanted = [name for name in inspect.signature(test).parameters if name != "impl" and name not in args]
        fixtures = {name: request.getfixturevalue(name) for name in wanted}
        with pytest.raises(pytest.fail.Exception, match=rf"calls .*already does this lab's job: write "
                                                        rf"{re.escape(part)} yourself"):
            test(mutant(**{part.partition(".")[0]: replacement}), **fixtures, **args)
    return check


@pytest.fixture
def asked_for():
    """asked_for(lab): what the stub, labs/<lab>.py, leaves to write: its functions, methods ("Class.method") and
    Triton kernels whose body raises NotImplementedError."""

    def parts(lab: str) -> list[str]:
        stub, found = importlib.import_module(f"labs.{lab}"), []
        for name, obj in vars(stub).items():
            if inspect.isclass(obj) and obj.__module__ == stub.__name__:
                found += [f"{name}.{attr}" for attr, fn in vars(obj).items()
                          if inspect.isfunction(fn) and _raises_not_implemented(fn)]
            elif (inspect.isfunction(obj) or _is_triton(obj)) and _defined_in(obj, stub.__name__) \
                    and _raises_not_implemented(obj):
                found.append(name)
        return found
    return parts


def pytest_collection_modifyitems(config, items):
    # Tests of the guards (they take `mutant`, `hand_off` or `asked_for`) grade the solutions' mutants: under
    # --impl=labs they say nothing about the student's work, so they are left out.
    if config.getoption("--impl") != "labs":
        return
    here = Path(__file__).parent
    left_out = [item for item in items if here in item.path.parents
                and {"mutant", "asked_for"} & set(getattr(item, "fixturenames", ()))]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in left_out]


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
