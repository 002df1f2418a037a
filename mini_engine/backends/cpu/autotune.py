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
MINI_ENGINE_TUNE_CACHE=0 to time every case in every process, MINI_ENGINE_TUNE_DIR=dir to keep the file
elsewhere (the tests keep theirs in a folder of their run), or run `python -m mini_engine tuning` to see it
and `--reset` to time everything once more.

A kept choice must hold for every later run, so two guards stand between a busy machine and the file:
- a case timed while the process's threads waited for a CPU (`run_queue_wait`) for more than `busy_share` of
  the timing is used in this process but not kept: on an oversubscribed machine an OpenMP team waits for its
  descheduled threads, and a multithreaded form can look 50x slower than it is;
- the first time a process uses a kept case, it times the kept form against its strongest rival (the plain
  form, or where the plain form was kept, the form that came closest) for a few rounds; a kept form that now
  loses beyond the margin is timed again and replaced in the file, with one line that says so.

That check costs every new process's first work (issue 60: 8.5 s of a 14 s first batch, with the store filled),
so it is paid only where it can find something:
- it builds only the two forms it compares (`make_candidates(names)`): building every candidate's inputs, copies
  and packed weights for a check that times two of them was most of its cost;
- a case timed or checked on a quiet machine carries the time it was (`checked_at`), and a later process trusts it
  for `trust_s` (a day; MINI_ENGINE_TUNE_TRUST=seconds, 0 checks every kept case as before) without checking it,
  except for a random `spot_share` of them (one case in 20), so that a choice that went wrong is still found by
  the processes that use it within a few runs, and every choice is checked again once its day is out.
A busy check stamps nothing: only a quiet timing or check renews a choice's trust.
"""
from __future__ import annotations

import hashlib
import itertools
import inspect
import json
import os
import random
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
    busy: bool = False           # timed while the machine was busy: used in this process, never kept
    checked_at: float | None = None  # when it was last timed or checked on a quiet machine (time.time()); None: never

    @property
    def speedup(self) -> float:
        """The winner against the plain (first) form; 1.0 when the plain form won or nothing was timed."""
        if not self.times_ms:
            return 1.0
        return next(iter(self.times_ms.values())) / self.times_ms[self.form]


def run_queue_wait() -> float:
    """Seconds this process's threads have spent ready to run but waiting for a CPU (Linux's schedstat,
    summed over the live threads). Where that is not available, wall time minus the process's CPU time, which
    tells a busy machine only for single-threaded work and never reports one falsely for multithreaded work."""
    total = 0.0
    try:
        for task in os.scandir("/proc/self/task"):
            with open(f"{task.path}/schedstat") as f:
                total += int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return time.perf_counter() - time.process_time()
    return total


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
    waited: Callable[[], float] = run_queue_wait  # seconds the process's threads have waited for a CPU so far
    busy_share: float = 0.25  # a timing whose threads waited longer than this share of its wall time is not kept
    check_rounds: int = 3     # rounds of the check a kept choice gets at its first use in a process
    store: Path | None = None  # where timed choices are kept for later processes (`machine_store`); None: nowhere
    unchecked: set = field(default_factory=set)  # cases taken from the store and not yet checked in this process
    kept_loaded: int = 0      # cases taken from the store
    checked: int = 0          # kept cases checked at their first use (`_check`)
    check_s: float = 0.0      # ... and the seconds they took (building their inputs, and any timing again, included)
    replaced: int = 0         # ... and timed again because the kept form lost
    trust_s: float = 24 * 3600  # a kept case timed or checked quietly this recently is not checked at first use...
    spot_share: float = 0.05  # ... except for this share of them, drawn at random (`load`)
    trusted: int = 0          # cases taken from the store that were trusted without a check
    wall: Callable[[], float] = time.time  # the clock of `checked_at`
    rng: random.Random = field(default_factory=random.Random)
    not_kept: int = 0         # cases timed on a busy machine, so not kept
    built: int = 0            # candidate forms built for timing or checking (inputs, copies, packed weights)
    calls: int = 0            # calls of a candidate form made to time it (warm-ups included)
    timing_s: float = 0.0     # seconds spent timing cases (`_decide`), building their candidates included

    def choose(self, op: str, key: tuple, make_candidates: Callable[[], dict[str, Callable[[], object]]]) -> str:
        """The form to use for (`op`, `key`). On the first call for a key, `make_candidates()` builds a dict
        from each form (the plain one first) to a zero-argument call running it on representative inputs,
        and they are timed; later calls only look the choice up."""
        case = (op, *key)
        choice = self.choices.get(case)
        # A forced op takes its forced form even where a form was decided before it was forced (a test pins forms
        # after earlier tests tuned, or the machine's store held the case).
        if choice is None or (op in self.forced and choice.form != self.forced[op]):
            t0 = time.perf_counter()
            choice = self.choices[case] = self._decide(op, self._build(make_candidates))
            self.timing_s += time.perf_counter() - t0
            self._keep_if_quiet(choice)
        elif case in self.unchecked and op not in self.forced:
            self.unchecked.discard(case)
            choice = self.choices[case] = self._check(case, choice, make_candidates)
        return choice.form

    def _keep_if_quiet(self, choice: Choice) -> None:
        if choice.busy:
            self.not_kept += 1
        elif self.store is not None and choice.times_ms:  # a forced form is not a fact about the machine
            self._keep()

    def _check(self, case: tuple, kept: Choice, make_candidates: Callable[..., dict]) -> Choice:
        """The first use in this process of a choice from the store: the kept form against its strongest rival,
        `check_rounds` interleaved rounds, with only those two forms built. It stands unless the rival beats it as
        a new form must beat the plain one (`_beats`) on a quiet machine; then the case is timed again and the
        file updated. A quiet check that the kept form passes renews its `checked_at` in the file."""
        t0 = time.perf_counter()
        try:
            return self._check_against_rival(case, kept, make_candidates)
        finally:
            self.check_s += time.perf_counter() - t0

    def _check_against_rival(self, case: tuple, kept: Choice, make_candidates: Callable[..., dict]) -> Choice:
        rival = self._rival(kept)
        pair = self._build(make_candidates, [kept.form] + ([rival] if rival else []))
        if kept.form not in pair:  # no longer offered here (a kernel that failed to build): time anew
            return self._retime(case, kept, self._build(make_candidates), why=f"{kept.form} is not available")
        if rival not in pair:  # nothing was timed against it, or its rival cannot run here now
            return kept
        self.checked += 1
        pair = {kept.form: pair[kept.form], rival: pair[rival]}
        for fn in pair.values():
            self.calls += 1
            getattr(fn, "first", fn)()
        times, busy = self._rounds(pair, self.check_rounds)
        if busy:
            return kept
        if not self._beats(times[rival], times[kept.form]):
            renewed = self.choices[case] = Choice(kept.form, kept.times_ms, checked_at=self.wall())
            if self.store is not None:
                self._keep()
            return renewed
        return self._retime(case, kept, self._build(make_candidates),
                            why=f"it took {min(times[kept.form]) * 1e3:.2f} ms against {rival}'s "
                                f"{min(times[rival]) * 1e3:.2f}")

    @staticmethod
    def _rival(kept: Choice) -> str | None:
        """The plain form (the first one timed) against a kept alternative; against a kept plain form, the form
        timed closest to it."""
        plain = next(iter(kept.times_ms), None)
        if kept.form != plain:
            return plain
        others = [name for name in kept.times_ms if name != plain]
        return min(others, key=kept.times_ms.get, default=None)

    def _retime(self, case: tuple, kept: Choice, candidates: dict, why: str) -> Choice:
        t0 = time.perf_counter()
        choice = self.choices[case] = self._decide(case[0], candidates)
        self.timing_s += time.perf_counter() - t0
        self.replaced += 1
        self._keep_if_quiet(choice)
        warnings.warn(f"the CPU backend's kept choice {kept.form!r} for {' '.join(map(str, case))} lost on this run "
                      f"({why}): timed again, {choice.form!r} now"
                      + (f", replaced in {self.store}" if self.store is not None and not choice.busy else ""),
                      stacklevel=2)
        return choice

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
        waited, t0 = self.waited(), self.clock()
        warm_up = {name: self._time(getattr(fn, "first", fn)) for name, fn in candidates.items()}
        times = {name: [] for name in candidates}
        live = dict(candidates)
        for round_ in range(self.repeats):
            for name, fn in live.items():  # interleaved, so a burst of noise hits every form alike
                times[name].append(self._time(fn))
            if round_ == 0:
                live = {name: fn for name, fn in live.items() if not self._hopeless(name, warm_up, times)}
        busy = self._was_busy(waited, t0)
        plain = next(iter(candidates))
        best = {name: min(ts) for name, ts in times.items()}
        winners = [name for name in live if name != plain and self._beats(times[name], times[plain])]
        form = min(winners, key=best.get) if winners else plain
        return Choice(form, {name: t * 1e3 for name, t in best.items()}, busy, None if busy else self.wall())

    def _beats(self, times: list[float], others: list[float]) -> bool:
        """Faster by the margin at its best, and faster in most rounds: on a busy machine one lucky round (or one
        unlucky round of the other form) must not crown a form for the whole process."""
        rounds = list(zip(times, others))  # one round only where the other form was dropped as hopeless
        won = sum(t < o for t, o in rounds)
        return min(times) * (1 + self.margin) < min(others) and won >= 0.8 * len(rounds)

    def _rounds(self, forms: dict[str, Callable[[], object]], rounds: int) -> tuple[dict[str, list[float]], bool]:
        """Each form timed `rounds` times, interleaved; and whether the machine was busy meanwhile."""
        waited, t0 = self.waited(), self.clock()
        times = {name: [] for name in forms}
        for _ in range(rounds):
            for name, fn in forms.items():
                times[name].append(self._time(fn))
        return times, self._was_busy(waited, t0)

    def _was_busy(self, waited_before: float, t0: float) -> bool:
        """Whether the process's threads waited for a CPU for more than `busy_share` of the wall time since t0."""
        return self.waited() - waited_before > self.busy_share * (self.clock() - t0)

    def _build(self, make_candidates: Callable[..., dict], names: list[str] | None = None) -> dict:
        """The candidates `make_candidates` builds: only the forms in `names` where it takes them (a builder of
        costly inputs, such as a product's weight copies and packed weights, takes the names it is to build)."""
        takes_names = names is not None and bool(inspect.signature(make_candidates).parameters)
        candidates = make_candidates(names) if takes_names else make_candidates()
        if names is not None:
            candidates = {name: fn for name, fn in candidates.items() if name in names}
        self.built += len(candidates)
        return candidates

    def _time(self, fn: Callable[[], object]) -> float:
        self.calls += 1
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
        return [{"case": list(case), "form": c.form, "times_ms": c.times_ms}
                | ({"checked_at": c.checked_at} if c.checked_at is not None else {})
                for case, c in self.choices.items() if not c.busy]

    def load(self, path, check: bool = False) -> int:
        """Take the cases `save` wrote to `path` that this tuner has not decided and whose op is not forced;
        returns how many. The file must come from this machine: a choice is a fact about the CPU that timed it.
        `check`: each taken case is checked at its first use (`_check`), as the machine's store is, unless it was
        timed or checked on a quiet machine within `trust_s` and is not drawn for a spot check (`spot_share`)."""
        taken, now = 0, self.wall()
        for row in _read_rows(path):
            case = _as_tuple(row["case"])
            if case[0] not in self.forced and case not in self.choices:
                checked_at = row.get("checked_at")
                self.choices[case] = Choice(row["form"], dict(row["times_ms"]), checked_at=checked_at)
                if check:
                    recent = checked_at is not None and 0 <= now - checked_at < self.trust_s
                    if recent and self.rng.random() >= self.spot_share:
                        self.trusted += 1
                    else:
                        self.unchecked.add(case)
                taken += 1
        return taken

    def settled(self, op: str, key: tuple) -> bool:
        """Whether (`op`, `key`) is decided for this process, so that its next use times nothing."""
        case = (op, *key)
        return case in self.choices and case not in self.unchecked and not (
            op in self.forced and self.choices[case].form != self.forced[op])

    def state(self) -> str:
        """One line: what this process took from the store, checked, replaced, and timed itself."""
        if self.store is None:
            kept = "no store of kept choices (MINI_ENGINE_TUNE_CACHE=0)"
        else:
            kept = (f"{self.kept_loaded} choices kept in {_home_relative(self.store)}, {self.checked} checked "
                    f"({self.check_s:.1f} s), {self.replaced} replaced, {self.trusted} trusted (checked within "
                    f"{self.trust_s / 3600:g} h)")
        busy = f", {self.not_kept} on a busy machine, not kept" if self.not_kept else ""
        return (f"{kept}; {self.timings_run} timed now ({self.timing_s:.1f} s{busy}); "
                f"{self.built} forms built, {self.calls} timed calls")


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
    folder = Path(os.environ["MINI_ENGINE_TUNE_DIR"]) if os.environ.get("MINI_ENGINE_TUNE_DIR") else cache_dir()
    package = Path(__file__).parent
    digest = hashlib.sha256(_cpu_signature())
    for part in (torch.__version__, str(torch.get_num_threads()), os.environ.get("MINI_ENGINE_C_KERNELS", "1"),
                 os.environ.get("CC", "")):
        digest.update(b"\0" + part.encode())
    sources = [*package.glob("*.py"), *package.glob("csrc/*")]  # the backend's own: edits elsewhere keep choices
    for source in sorted(sources):
        digest.update(b"\0" + source.read_bytes())
    return folder / f"tuned-{digest.hexdigest()[:16]}.json"


def _home_relative(path: Path) -> str:
    try:
        return "~/" + str(path.relative_to(Path.home()))
    except ValueError:
        return str(path)


def _as_tuple(value):
    """JSON lists back into the tuples a case is made of (shapes inside it included)."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value


def tuner_from_env() -> Autotuner:
    """The process's tuner: MINI_ENGINE_FORMS pins forms, MINI_ENGINE_TUNED names a file of choices to start from,
    and the machine's store (`machine_store`) adds what earlier processes timed here and keeps what this one times."""
    trust = os.environ.get("MINI_ENGINE_TUNE_TRUST", "")
    try:
        trust_s = float(trust) if trust else Autotuner.trust_s
    except ValueError:
        raise ValueError(f"MINI_ENGINE_TUNE_TRUST must be a number of seconds, got {trust!r}") from None
    tuner = Autotuner(forced_from_env(), store=machine_store(), trust_s=trust_s)
    for path, name in ((os.environ.get("MINI_ENGINE_TUNED"), "MINI_ENGINE_TUNED"), (tuner.store, "the tuning store")):
        if path and (name == "MINI_ENGINE_TUNED" or Path(path).exists()):
            try:
                # Only the store's choices are checked: MINI_ENGINE_TUNED hands over what a process running
                # beside this one has just timed.
                taken = tuner.load(path, check=name != "MINI_ENGINE_TUNED")
            except (OSError, ValueError, KeyError, TypeError) as e:  # tuning anew is slower, never wrong
                warnings.warn(f"{name}={str(path)!r} could not be read ({e}); forms will be timed as met")
            else:
                if name != "MINI_ENGINE_TUNED":
                    tuner.kept_loaded = taken
    return tuner


# The process's tuner: choices are facts about this machine, shared by every model loaded in the process.
TUNER = tuner_from_env()
