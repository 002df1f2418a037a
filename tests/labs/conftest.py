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

import contextlib
import functools
import importlib
import importlib.util
import inspect
import os
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
    if where.startswith("mini_engine.course"):
        return f"the course's finished {what}"
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
def wrong_answer(request, mutant):
    """wrong_answer(test, replacements, line) checks that the grading function `test`, run on the solution with
    `replacements` (as `mutant` takes them: a wrong answer), fails and prints one line that matches the regular
    expression `line`: what the student reads. The test's other fixtures are looked up by name."""

    def check(test, replacements: dict, line: str):
        fixtures = {name: request.getfixturevalue(name) for name in inspect.signature(test).parameters
                    if name != "impl"}
        try:
            test(mutant(**replacements), **fixtures)
        except (Exception, pytest.fail.Exception) as err:  # noqa: BLE001 - whatever the wrong answer raised
            shown = one_line(pytest.ExceptionInfo.from_exception(err), request.config.rootpath,
                             Path(inspect.getfile(test)))
        else:
            pytest.fail(f"{test.__name__} passes a wrong answer ({', '.join(replacements)} replaced)")
        assert "\n" not in shown and re.fullmatch(line, shown), f"{test.__name__} prints {shown!r}, not {line!r}"
    return check


@pytest.fixture
def reference(request):
    """The reference solution of the module's lab, for tests of the course's own material (a lab notebook run on
    it) rather than of the student's work: left out under --impl=labs."""
    return importlib.import_module(f"solutions.{request.module.LAB}")


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


def pytest_configure(config):
    config.addinivalue_line("markers", "engine(what): a slow check on the real model or engine; the grader runs it "
                                       "after the quick ones and says `what` it does before it starts")
    config.addinivalue_line("markers", "optional(*parts): grades optional parts of the lab (functions); while one is "
                                       "not written, the test is skipped")


def is_engine_check(item) -> bool:
    """A slow check: it loads the real model (the `real_model` fixture) or is marked `engine`."""
    return item.get_closest_marker("engine") is not None or "real_model" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    # Tests of the guards (they take `mutant`, `hand_off`, `wrong_answer` or `asked_for`) grade the solutions'
    # mutants, and tests of a lab notebook (`reference`) run it on the solution: under --impl=labs they say nothing
    # about the student's work, so they are left out.
    if config.getoption("--impl") == "labs":
        left_out = [item for item in items if here in item.path.parents
                    and {"mutant", "asked_for", "reference"} & set(getattr(item, "fixturenames", ()))]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if item not in left_out]
    # Every lab's slow engine checks run after all the quick ones, so a wrong answer shows in seconds. (A stable
    # sort: tests/conftest.py then puts any `slow` file first for pytest-xdist, which keeps this order inside.)
    items.sort(key=lambda item: here in item.path.parents and is_engine_check(item))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # A slow check says what it is doing before it starts (loading the model included), so a quiet minute
    # does not look like a hang.
    if not is_engine_check(item):
        return
    marker = item.get_closest_marker("engine")
    what = marker.args[0] if marker and marker.args else \
        (inspect.getdoc(getattr(item, "function", None)) or item.name.removeprefix("test_").replace("_", " "))
    what = " ".join(what.split(". ")[0].split())
    reporter = item.config.pluginmanager.get_plugin("terminalreporter")
    capture = item.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:  # no reporter in a pytest-xdist worker
        with capture.global_and_fixture_disabled():
            if reporter._tw.width_of_current_line:
                reporter.write("\n")  # after the progress dots
            reporter.write_line(f"slow check, {item.path.stem}: {what} (up to a minute or two on a laptop CPU) ...")


# ---------------------------------------------------------------- one line per failure

FULL_TRACEBACK = "MINI_ENGINE_LAB_TRACEBACK"


def wants_full_traceback(config) -> bool:
    """`--tb=long` (or native) or MINI_ENGINE_LAB_TRACEBACK=1 show pytest's whole report instead of one line."""
    return config.getoption("tbstyle") in ("long", "native") or os.environ.get(FULL_TRACEBACK, "") not in ("", "0")


def _where(entry, root: Path) -> str:
    path = Path(entry.path)
    try:
        path = path.relative_to(root)
    except ValueError:
        pass
    return f"{path.as_posix()}:{entry.lineno + 1}"


def todo_hint(path, lineno: int) -> str:
    """The `# TODO:` comment just above a stub's `raise NotImplementedError` (line `lineno`, from 0), as one line."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return ""
    comment, i = [], lineno - 1
    while i >= 0 and lines[i].lstrip().startswith("#"):
        comment.insert(0, lines[i].strip().lstrip("#").strip())
        if comment[0].startswith("TODO"):
            return " ".join(comment).removeprefix("TODO:").strip()
        i -= 1
    return ""


def not_implemented_line(excinfo, root: Path) -> str:
    """`not implemented yet: labs/lab07_paging.py:57 in allocate(): <the TODO's hint>`."""
    frame = excinfo.traceback[-1]
    message = str(excinfo.value)
    hint = re.sub(r"^lab\d\d [\w.]+: ", "", message)  # the stub's "lab07 allocate: " prefix
    if not message or "not written yet" in message or "see its docstring" in message and len(hint) < 40:
        hint = todo_hint(frame.path, frame.lineno) or hint
    return f"not implemented yet: {_where(frame, root)} in {frame.name}(): {hint or 'fill in the TODO'}"


def assertion_message(error: BaseException) -> str:
    """The message of a failed `assert test, message` without pytest's explanation of the expression ("" for a
    bare assert)."""
    text = str(error)
    message, _, explanation = text.partition("\nassert ")
    return "" if text.startswith("assert ") else " ".join(message.split())


def one_line(excinfo, root: Path, test_file: Path) -> str:
    """What a failing lab test (in `test_file`) prints: one line that says what to fix."""
    error = excinfo.value
    in_test = [e for e in excinfo.traceback if Path(e.path) == test_file]
    if excinfo.errisinstance(NotImplementedError):
        return not_implemented_line(excinfo, root)
    if excinfo.errisinstance(AssertionError):
        where = _where((in_test or excinfo.traceback)[-1], root)
        return assertion_message(error) or f"{where}: {' '.join(str(error).split())}"
    if isinstance(error, pytest.fail.Exception):
        message = " ".join(str(error.msg).split())
        if message.startswith("DID NOT RAISE"):
            entry = in_test[-1] if in_test else None
            if entry is not None:
                lines = Path(entry.path).read_text().splitlines()
                code = lines[entry.lineno + 1].strip() if entry.lineno + 1 < len(lines) else ""
                kind = message.removeprefix("DID NOT RAISE").strip(" <>").removeprefix("class ").strip("'")
                return f"{_where(entry, root)}: `{code}` must raise {kind}, and nothing was raised"
        return message
    # Anything else your code raised: where, in your lab file, and what.
    trees = [root / "labs", root / "solutions"]
    yours = [e for e in excinfo.traceback if any(tree in Path(e.path).parents for tree in trees)]
    entry = yours[-1] if yours else excinfo.traceback[-1]
    return (f"{type(error).__name__}: {' '.join(str(error).split())} (raised at {_where(entry, root)} in "
            f"{entry.name}())")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    # A stub that is still a TODO is the expected state of a fresh lab, not a crash, and a wrong answer is
    # a thing to fix, not a traceback to read: each says so in one line (the full report on request).
    report = yield
    excinfo = call.excinfo
    if excinfo is None or report.passed or wants_full_traceback(item.config) or \
            excinfo.errisinstance((KeyboardInterrupt, pytest.skip.Exception)):
        return report
    line = one_line(excinfo, item.config.rootpath, Path(item.path))
    optional = item.get_closest_marker("optional")
    if optional and excinfo.errisinstance(NotImplementedError) and excinfo.traceback[-1].name in optional.args:
        report.outcome = "skipped"  # an optional part left for later is not a failure
        report.longrepr = (str(item.path), item.location[1] or 0, f"optional, {line}")
        return report
    report.longrepr = line
    return report


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    here = Path(__file__).parent
    failed = [r for r in terminalreporter.stats.get("failed", ()) if here in Path(str(r.fspath)).parents]
    if failed and not wants_full_traceback(config):
        terminalreporter.write_line(f"(one line per failure: --tb=long or {FULL_TRACEBACK}=1 shows the full traceback)")


@pytest.fixture
def must_raise():
    """with must_raise(ValueError, "a double free must raise ValueError"): ... fails in one line with that message
    when the block raises nothing, or another error (its type and text said); a TODO still not written passes."""

    @contextlib.contextmanager
    def check(kind, what: str):
        try:
            yield
        except kind:
            return
        except NotImplementedError:
            raise
        except Exception as err:  # noqa: BLE001 - a student's code may raise anything
            pytest.fail(f"{what}; yours raised {type(err).__name__}: {err}", pytrace=False)
        pytest.fail(f"{what}; yours raised nothing", pytrace=False)
    return check


@pytest.fixture(scope="session")
def real_model():
    """The embedded SmolLM2-135M-Instruct (fp32, CPU), loaded once for all lab tests."""
    return me.load_model("smollm2-135m", device="cpu", dtype="float32")
