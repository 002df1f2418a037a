"""Choose between equal forms of a computation by timing them on the machine that runs them.

Which form of `x @ W.T` is fastest on a CPU depends on the CPU: on an AMD EPYC with AVX2 only, MKL's
two-row GEMM streamed the weights faster than its GEMV and bf16 products ran faster in fp32; on an Intel
Xeon with AVX-512 BF16 the same tricks made the products 2.6x slower than plain `F.linear`. So no constant
decides: the first time the engine meets a new case (a weight shape, a bucket of row counts, a dtype, a
device), it times every candidate once and keeps the fastest for the rest of the process, as Triton's
`autotune` does for a kernel's launch configurations.

The first candidate is the library's plain form; another form wins only when its best time beats the plain
form's by more than `margin` and it was the faster of the two in most rounds, so that timing noise (a busy
machine) keeps the plain form rather than crowning a slower one.
Set MINI_ENGINE_FORMS="product=linear,attention=native" (or pass `forced`) to pin a choice: benchmarks use
it to time one form against another, tests to reach every form.

A process can hand its choices to another one on the same machine: `TUNER.save(path)` writes them as JSON, and a
process started with MINI_ENGINE_TUNED=path begins with them (a server started from a notebook that has already
tuned, say), so it does not time the same cases again. Cases the file lacks are timed as usual.

The process's tuner also keeps what it timed in a file per machine (`machine_store`, beside the built C kernels in
$MINI_ENGINE_CACHE or ~/.cache/mini_engine), so the next chapter, test or server on this machine starts with
those choices instead of timing the same cases again (each chapter spent 20-30 s doing so). The file's name
is a digest of what a choice depends on: the CPU's model and flags, torch's version, the thread count, the C
kernel settings and this package's source; change any of them and the forms are timed anew. Set
MINI_ENGINE_TUNE_CACHE=0 to time every case in every process, or delete the file to time them once more.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode


@dataclass(frozen=True)
class Choice:
    form: str
    times_ms: dict[str, float]   # best time of each candidate; empty when the form was forced

    @property
    def speedup(self) -> float:
        """The winner against the plain (first) form; 1.0 when the plain form won or nothing was timed."""
        if not self.times_ms:
            return 1.0
        return next(iter(self.times_ms.values())) / self.times_ms[self.form]


def forced_from_env(value: str | None = None) -> dict[str, str]:
    """Parse MINI_ENGINE_FORMS ("op=form,op=form")."""
    value = os.environ.get("MINI_ENGINE_FORMS", "") if value is None else value
    forced = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        op, sep, form = item.partition("=")
        if not sep or not op.strip() or not form.strip():
            raise ValueError(f"MINI_ENGINE_FORMS entries must look like op=form, got {item!r}")
        forced[op.strip()] = form.strip()
    return forced


class Walk:
    """A timing candidate for a weight product: `call` run on every copy of the weight in turn (`copies`, enough
    of them that each call meets its weight cold, as a model's step does), which is what the tuner times; and
    `first()`, one call on the first copy, which the tuner uses as the warm-up (it pays for allocation and
    kernel selection, and tells a hopeless form). Warming up on one copy instead of all of them halved the time
    spent tuning the int4_compact head's 36,864 x 576 product at one row, where dequantizing took 5 s a walk."""

    def __init__(self, call: Callable[[object], object], copies):
        self.call, self.copies = call, copies

    def __call__(self) -> None:
        for copy in self.copies:
            self.call(copy)

    def first(self) -> None:
        self.call(self.copies[0])


@dataclass
class Autotuner:
    forced: dict[str, str] = field(default_factory=dict)   # op -> form, skipping the timing
    margin: float = 0.03     # an alternative must beat the plain form by 3%: a noisy tie keeps the plain form
    repeats: int = 5
    drop: float = 4.0        # a form this many times slower than the fastest in its first two runs is not timed again
    choices: dict[tuple, Choice] = field(default_factory=dict)
    timings_run: int = 0     # how many cases were timed: a cached case is never timed again
    clock: Callable[[], float] = time.perf_counter
    store: Path | None = None  # where timed choices are kept for later processes (`machine_store`); None: nowhere

    def choose(self, op: str, key: tuple, make_candidates: Callable[[], dict[str, Callable[[], object]]]) -> str:
        """The form to use for (`op`, `key`). On the first call for a key, `make_candidates()` builds a dict
        from each form (the plain one first) to a zero-argument call running it on representative inputs,
        and they are timed; later calls only look the choice up."""
        choice = self.choices.get((op, *key))
        # A forced op takes its forced form even where a form was decided before it was forced (a test pins forms
        # after earlier tests tuned, or the machine's store held the case).
        if choice is None or (op in self.forced and choice.form != self.forced[op]):
            choice = self.choices[(op, *key)] = self._decide(op, make_candidates())
            if self.store is not None and choice.times_ms:  # a forced form is not a fact about the machine
                self._keep()
        return choice.form

    def __deepcopy__(self, memo):
        # A tuner holds facts about the machine, not about a model: a copied model (copy.deepcopy(model), then
        # .to(torch.bfloat16)) keeps deciding in the same tuner, where `backends.cpu.tuned_forms` and later models
        # see its choices, rather than tuning into a private copy.
        return self

    def _keep(self) -> None:
        """Merge this tuner's timed choices into `store` (another process may have added its own meanwhile)."""
        try:
            self.store.parent.mkdir(parents=True, exist_ok=True)
            rows = {json.dumps(r["case"]): r for r in _read_rows(self.store)} if self.store.exists() else {}
            rows.update({json.dumps(r["case"]): r for r in self._rows() if r["times_ms"]})
            tmp = self.store.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(list(rows.values())))
            os.replace(tmp, self.store)  # atomic: a reader never sees half a file
        except (OSError, ValueError, TypeError, KeyError) as e:  # keeping is a convenience: never fail a product
            warnings.warn(f"could not keep tuned choices in {self.store} ({e}); they are timed again next time")
            self.store = None

    def _decide(self, op: str, candidates: dict[str, Callable[[], object]]) -> Choice:
        if op in self.forced:
            form = self.forced[op]
            if form not in candidates:
                raise ValueError(f"forced form {form!r} for {op!r} is not one of {list(candidates)} here")
            return Choice(form, {})
        self.timings_run += 1
        # The warm-up call pays for allocation and kernel selection; its time only serves to drop hopeless forms.
        # A `Walk` warms up on one copy of the weight.
        warm_up = {name: self._time(getattr(fn, "first", fn)) for name, fn in candidates.items()}
        times = {name: [] for name in candidates}
        live = dict(candidates)
        for round_ in range(self.repeats):
            for name, fn in live.items():  # interleaved, so a burst of noise hits every form alike
                times[name].append(self._time(fn))
            if round_ == 0:
                live = {name: fn for name, fn in live.items() if not self._hopeless(name, warm_up, times)}
        plain = next(iter(candidates))
        best = {name: min(ts) for name, ts in times.items()}

        def wins(name):
            # Faster by the margin at its best, and faster in most rounds: on a busy machine one lucky
            # round (or one unlucky round of the plain form) must not crown a form for the whole process.
            rounds = list(zip(times[name], times[plain]))  # one round only where the plain form was dropped
            won = sum(t < p for t, p in rounds)
            return best[name] * (1 + self.margin) < best[plain] and won >= 0.8 * len(rounds)
        winners = [name for name in live if name != plain and wins(name)]
        form = min(winners, key=best.get) if winners else plain
        return Choice(form, {name: t * 1e3 for name, t in best.items()})

    def _time(self, fn: Callable[[], object]) -> float:
        t0 = self.clock()
        fn()
        return self.clock() - t0

    def _hopeless(self, name: str, warm_up: dict[str, float], times: dict[str, list[float]]) -> bool:
        """Over `drop` times slower than the fastest form in the warm-up and in the first round: not timed again.
        On a CPU without bf16 instructions (a Zen 3 EPYC) a bf16 product's native forms ran 4-7x slower than its fp32
        forms at 64 and 256 rows, and the fp32 forms up to 16x slower than the native ones at one row: timing them
        four more times could not change the choice. Tuning a bf16 model for a perplexity pass and a short decode
        took 27-28 s with every form timed in full, 15-18 s with hopeless forms dropped (same perplexity, same tokens)."""
        return (warm_up[name] > self.drop * min(warm_up.values())
                and times[name][0] > self.drop * min(ts[0] for ts in times.values()))

    def report(self) -> list[tuple[tuple, Choice]]:
        """Every decided case, in the order met."""
        return list(self.choices.items())

    def save(self, path) -> None:
        """Write every decided case to `path` (JSON): MINI_ENGINE_TUNED=path starts another process with them."""
        Path(path).write_text(json.dumps(self._rows()))

    def _rows(self) -> list[dict]:
        return [{"case": list(case), "form": c.form, "times_ms": c.times_ms} for case, c in self.choices.items()]

    def load(self, path) -> int:
        """Take the cases `save` wrote to `path` that this tuner has not decided and whose op is not forced;
        returns how many. The file must come from this machine: a choice is a fact about the CPU that timed it."""
        taken = 0
        for row in _read_rows(path):
            case = _as_tuple(row["case"])
            if case[0] not in self.forced and case not in self.choices:
                self.choices[case] = Choice(row["form"], dict(row["times_ms"]))
                taken += 1
        return taken


def row_bucket(rows: int, cap: int = 256) -> int:
    """Counts share a decision within powers of two (1, 2, 4, ..., cap; cap stands for every count above)."""
    return min(1 << (rows - 1).bit_length(), cap)


# Layers by number, for the functions torch.compile runs instead of tracing them (`assume_constant_result`): their
# arguments must be constants, and torch 2.11's Dynamo refuses a module there (2.13's takes one).
_LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_NUMBERS = itertools.count()


def number_layer(layer) -> None:
    """Give `layer` a number of its own, `layer.number`, that `numbered_layer` turns back into it. A copy of a
    layer must be numbered anew (its `__setstate__` does it), or its number would name the original."""
    layer.number = next(_NUMBERS)
    _LAYERS[layer.number] = layer


def numbered_layer(number: int):
    return _LAYERS[number]


def counting_mode_active() -> bool:
    """True under a dispatch mode such as FlopCounterMode: it must see the product the model means (one row
    is one row), and no timing runs would be counted as the model's work."""
    return _get_current_dispatch_mode() is not None


def _read_rows(path) -> list[dict]:
    rows = json.loads(Path(path).read_text())
    if not isinstance(rows, list):
        raise ValueError(f"{path} does not hold a list of tuned cases")
    return rows


def machine_store() -> Path | None:
    """The file where the process's tuner keeps its timed choices on this machine, named by a digest of what
    they depend on; None when MINI_ENGINE_TUNE_CACHE=0."""
    if os.environ.get("MINI_ENGINE_TUNE_CACHE", "1") == "0":
        return None
    from .cpu_kernels import _cpu_signature, cache_dir
    package = Path(__file__).parent
    digest = hashlib.sha256(_cpu_signature())
    for part in (torch.__version__, str(torch.get_num_threads()), os.environ.get("MINI_ENGINE_C_KERNELS", "1"),
                 os.environ.get("CC", "")):
        digest.update(b"\0" + part.encode())
    sources = [*package.glob("*.py"), *package.glob("csrc/*")]  # the backend's own: edits elsewhere keep choices
    for source in sorted(sources):
        digest.update(b"\0" + source.read_bytes())
    return cache_dir() / f"tuned-{digest.hexdigest()[:16]}.json"


def _as_tuple(value):
    """JSON lists back into the tuples a case is made of (shapes inside it included)."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value


def tuner_from_env() -> Autotuner:
    """The process's tuner: MINI_ENGINE_FORMS pins forms, MINI_ENGINE_TUNED names a file of choices to start from,
    and the machine's store (`machine_store`) adds what earlier processes timed here and keeps what this one times."""
    tuner = Autotuner(forced_from_env(), store=machine_store())
    for path, name in ((os.environ.get("MINI_ENGINE_TUNED"), "MINI_ENGINE_TUNED"), (tuner.store, "the tuning store")):
        if path and (name == "MINI_ENGINE_TUNED" or Path(path).exists()):
            try:
                tuner.load(path)
            except (OSError, ValueError, KeyError, TypeError) as e:  # tuning anew is slower, never wrong
                warnings.warn(f"{name}={str(path)!r} could not be read ({e}); forms will be timed as met")
    return tuner


# The process's tuner: choices are facts about this machine, shared by every model loaded in the process.
TUNER = tuner_from_env()
