"""The CPU backend's kept choices hold for later runs: a case timed on a busy machine is used but not kept, a kept
case is checked at its first use in a process and replaced when it now loses, and the tests keep their choices in a
folder of their own run. Timing is faked (`Machine`): what each form costs, and how long the process's threads
waited for a CPU meanwhile, are set by the test."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mini_engine.backends.cpu import autotune
from mini_engine.backends.cpu.autotune import Autotuner

ROOT = Path(__file__).resolve().parents[2]


class Machine:
    """A wall clock and a run-queue clock that the forms advance: `form(seconds, waited)` takes `seconds` of wall
    time, of which its threads spent `waited` waiting for a CPU."""

    def __init__(self):
        self.now = 0.0
        self.waited = 0.0
        self.calls = []

    def form(self, name, seconds, waited=0.0):
        def run():
            self.calls.append(name)
            self.now += seconds
            self.waited += waited
        return run

    def tuner(self, store=None, **kwargs):
        return Autotuner(repeats=3, clock=lambda: self.now, waited=lambda: self.waited, store=store,
                         **{"wall": lambda: 1e9, **kwargs})

    def builder(self, costs: dict, waited: float = 0.0):
        """A candidates builder that takes the names to build (as the products' builders do), counting what it
        builds in `self.built`."""
        self.built = []

        def build(names=None):
            made = {n: self.form(n, c, waited * c) for n, c in costs.items() if names is None or n in names}
            self.built += list(made)
            return made
        return build


def kept(store: Path) -> dict:
    return {tuple(row["case"]): row["form"] for row in json.loads(store.read_text())}


def test_a_quiet_timing_is_kept_for_the_next_process(tmp_path):
    m = Machine()
    store = tmp_path / "tuned.json"
    tuner = m.tuner(store)
    assert tuner.choose("op", ("case",), lambda: {"plain": m.form("plain", 1.0), "alt": m.form("alt", 0.5)}) == "alt"
    assert kept(store) == {("op", "case"): "alt"}
    assert tuner.not_kept == 0


def test_a_timing_on_a_busy_machine_is_used_but_not_kept(tmp_path):
    """The threads waited for a CPU for most of the timing (wall time far above the time they ran): the choice
    serves this process, and the store does not learn it."""
    m = Machine()
    store = tmp_path / "tuned.json"
    tuner = m.tuner(store)
    got = tuner.choose("op", ("case",), lambda: {"plain": m.form("plain", 8.0, waited=6.0),
                                                  "alt": m.form("alt", 1.0, waited=0.7)})
    assert got == "alt", "the process still uses what it measured"
    assert not store.exists(), "a choice timed on a busy machine must not be kept"
    assert tuner.not_kept == 1 and "1 on a busy machine, not kept" in tuner.state()
    # The next quiet timing of another case is kept, and the busy one is still left out.
    tuner.choose("op", ("quiet",), lambda: {"plain": m.form("plain", 1.0), "alt": m.form("alt", 2.0)})
    assert kept(store) == {("op", "quiet"): "plain"}


def write_store(path: Path, form: str, times_ms: dict) -> Path:
    path.write_text(json.dumps([{"case": ["op", "case"], "form": form, "times_ms": times_ms}]))
    return path


@pytest.mark.parametrize("stored,times_ms,now,winner", [
    # A kept alternative that now loses to the plain form.
    ("alt", {"plain": 1.0, "alt": 0.5}, {"plain": 1.0, "alt": 2.0}, "plain"),
    # The case: the plain form kept because the C form was timed 50x too slow on a busy machine.
    ("plain", {"plain": 10.0, "c": 488.0}, {"plain": 1.0, "c": 0.5}, "c"),
])
def test_a_kept_choice_that_loses_at_first_use_is_timed_again_and_replaced(tmp_path, stored, times_ms, now, winner):
    m = Machine()
    store = write_store(tmp_path / "tuned.json", stored, times_ms)
    tuner = m.tuner(store)
    assert tuner.load(store, check=True) == 1
    candidates = lambda: {name: m.form(name, cost) for name, cost in now.items()}  # noqa: E731
    with pytest.warns(UserWarning, match=f"kept choice '{stored}'.*replaced in {store}"):
        assert tuner.choose("op", ("case",), candidates) == winner
    assert kept(store) == {("op", "case"): winner}, "the file must hold the new choice"
    assert (tuner.checked, tuner.replaced, tuner.timings_run) == (1, 1, 1)
    m.calls.clear()
    assert tuner.choose("op", ("case",), candidates) == winner and not m.calls, "checked once a process"


def test_a_kept_choice_that_still_wins_costs_only_its_check(tmp_path, recwarn):
    m = Machine()
    store = write_store(tmp_path / "tuned.json", "alt", {"plain": 1.0, "alt": 0.5, "other": 0.9})
    tuner = m.tuner(store)
    tuner.load(store, check=True)
    now = {"plain": 1.0, "alt": 0.5, "other": 3.0}
    assert tuner.choose("op", ("case",), lambda: {n: m.form(n, c) for n, c in now.items()}) == "alt"
    assert sorted(set(m.calls)) == ["alt", "plain"], "the check times the kept form against the plain one only"
    assert len(m.calls) == 2 * (1 + tuner.check_rounds)
    assert (tuner.checked, tuner.replaced, tuner.timings_run) == (1, 0, 0) and not recwarn.list


def test_a_check_on_a_busy_machine_changes_nothing(tmp_path):
    m = Machine()
    store = write_store(tmp_path / "tuned.json", "plain", {"plain": 10.0, "c": 488.0})
    before = store.read_text()
    tuner = m.tuner(store)
    tuner.load(store, check=True)
    got = tuner.choose("op", ("case",), lambda: {"plain": m.form("plain", 4.0, waited=3.0),
                                                  "c": m.form("c", 1.0, waited=0.75)})
    assert got == "plain" and store.read_text() == before and tuner.replaced == 0


def test_a_forced_op_and_a_handed_over_file_are_not_checked(tmp_path):
    m = Machine()
    store = write_store(tmp_path / "tuned.json", "alt", {"plain": 1.0, "alt": 0.5})
    handed = m.tuner()
    handed.load(store)  # MINI_ENGINE_TUNED: what a process beside this one has just timed
    forced = m.tuner(forced={"op": "alt"})
    forced.load(write_store(tmp_path / "other.json", "alt", {}), check=True)
    for tuner in (handed, forced):
        assert tuner.choose("op", ("case",), lambda: {"plain": m.form("plain", 1.0), "alt": m.form("alt", 2.0)}) \
            == "alt"
    assert not m.calls


def test_run_queue_wait_counts_seconds_that_only_grow():
    first = autotune.run_queue_wait()
    sum(range(100_000))
    assert 0 <= first <= autotune.run_queue_wait()


def test_the_process_tuner_starts_from_the_store_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("MINI_ENGINE_TUNE_DIR", str(tmp_path))
    monkeypatch.delenv("MINI_ENGINE_TUNED", raising=False)
    monkeypatch.delenv("MINI_ENGINE_FORMS", raising=False)
    monkeypatch.delenv("MINI_ENGINE_TUNE_CACHE", raising=False)
    store = autotune.machine_store()
    assert store.parent == tmp_path, "MINI_ENGINE_TUNE_DIR names the store's folder"
    write_store(store, "alt", {"plain": 1.0, "alt": 0.5})
    tuner = autotune.tuner_from_env()
    assert tuner.unchecked == {("op", "case")} and tuner.kept_loaded == 1
    assert tuner.state().startswith(f"1 choices kept in {store}, 0 checked (0.0 s), 0 replaced, 0 trusted "
                                    f"(checked within 24 h); 0 timed now (0.0 s); 0 forms built, 0 timed calls")


def test_make_test_keeps_its_choices_in_a_folder_of_its_run():
    """`make test` must never write the machine's store, which the chapters read afterwards: both of its commands
    (notebooks, then tests) run with MINI_ENGINE_TUNE_DIR in the clone's build/ folder, emptied first."""
    out = subprocess.run(["make", "-n", "test", "PY=python"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "MAKEFLAGS": ""}, check=True).stdout
    runs = [line for line in out.splitlines() if "pytest" in line]
    folder = ROOT / "build" / "test-tuning"
    assert f"rm -rf {folder}" in out, "the run's folder must start empty"
    assert runs and all(f"MINI_ENGINE_TUNE_DIR={folder}" in line for line in runs), runs


def test_the_tuning_verb_shows_resets_and_names_the_store(tmp_path):
    env = {**os.environ, "MINI_ENGINE_TUNE_DIR": str(tmp_path), "MINI_ENGINE_TUNE_CACHE": "1"}
    env.pop("MINI_ENGINE_TUNED", None)

    def tuning(*args):
        return subprocess.run([sys.executable, "-m", "mini_engine", "tuning", "--threads", "1", *args], cwd=ROOT,
                              env=env, capture_output=True, text=True, check=True).stdout
    out = tuning()
    assert "kept choices for 1 threads" in out and "none yet" in out
    store = Path(out.splitlines()[0].rsplit(": ", 1)[1])
    assert store.parent == tmp_path
    store.write_text(json.dumps([{"case": ["product", [576, 576], 1, "torch.float32", "cpu"], "form": "c_f32",
                                  "times_ms": {"linear": 0.05, "c_f32": 0.03}}]))
    out = tuning()
    assert "1 cases" in out and "c_f32" in out and "linear 0.05, c_f32 0.03" in out
    (tmp_path / "tuned-0000000000000000.json").write_text("[]")
    assert "1 other file(s)" in tuning()
    out = tuning("--reset")
    assert "deleted 2 file(s)" in out and "none yet" in out and not list(tmp_path.glob("tuned-*.json"))
    bad = subprocess.run([sys.executable, "-m", "mini_engine", "tuning", "--threads", "0"], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--threads" in bad.stderr


def test_the_tuning_verb_says_when_choices_were_checked_and_what_a_first_use_costs(tmp_path):
    env = {**os.environ, "MINI_ENGINE_TUNE_DIR": str(tmp_path), "MINI_ENGINE_TUNE_CACHE": "1", "HF_HUB_OFFLINE": "1",
           "MINI_ENGINE_FORMS": "product=linear"}  # forced: the verb's --check runs without timing anything
    env.pop("MINI_ENGINE_TUNED", None)

    def tuning(*args):
        return subprocess.run([sys.executable, "-m", "mini_engine", "tuning", "--threads", "1", *args], cwd=ROOT,
                              env=env, capture_output=True, text=True, check=True).stdout
    store = Path(tuning().splitlines()[0].rsplit(": ", 1)[1])
    now = __import__("time").time()
    store.write_text(json.dumps([{"case": ["product", [576, 576], 1, "torch.float32", "cpu"], "form": "c_f32",
                                  "times_ms": {"linear": 0.05, "c_f32": 0.03}, "checked_at": now - 2 * 3600},
                                 {"case": ["product", [576, 576], 2, "torch.float32", "cpu"], "form": "linear",
                                  "times_ms": {"linear": 0.05, "c_f32": 0.06}}]))
    out = tuning()
    assert "checked: 1 within the last 24 h" in out and "1 longer ago or never" in out and "last 2.0 h ago" in out
    out = tuning("--check", "--rows", "1")
    assert "first use of smollm2-135m's products at rows (1,)" in out and "0 timed now" in out, out


def test_a_check_builds_and_times_only_the_two_forms_it_compares(tmp_path):
    """Issue 60: building every candidate (a product's weight copies and packed weights) for a check that times two
    of them was most of a check's cost. Counted, not timed."""
    m = Machine()
    store = write_store(tmp_path / "tuned.json", "plain", {"plain": 1.0, "c": 1.1, "onednn": 1.5, "slow": 9.0})
    tuner = m.tuner(store, trust_s=0)
    tuner.load(store, check=True)
    build = m.builder({"plain": 1.0, "c": 1.2, "onednn": 1.5, "slow": 9.0})
    assert tuner.choose("op", ("case",), build) == "plain"
    assert m.built == ["plain", "c"], "a kept plain form is checked against the form timed closest to it, alone"
    assert sorted(set(m.calls)) == ["c", "plain"] and len(m.calls) == 2 * (1 + tuner.check_rounds)
    assert (tuner.built, tuner.calls, tuner.checked, tuner.timings_run) == (2, 2 * (1 + tuner.check_rounds), 1, 0)


def test_a_check_that_finds_a_loser_builds_every_form_to_time_the_case_again(tmp_path):
    m = Machine()
    store = write_store(tmp_path / "tuned.json", "alt", {"plain": 1.0, "alt": 0.5, "other": 0.9})
    tuner = m.tuner(store, trust_s=0)
    tuner.load(store, check=True)
    with pytest.warns(UserWarning, match="kept choice 'alt'"):
        assert tuner.choose("op", ("case",), m.builder({"plain": 1.0, "alt": 2.0, "other": 0.5})) == "other"
    assert m.built == ["plain", "alt", "plain", "alt", "other"], "the check's two forms, then all three"
    assert kept(store) == {("op", "case"): "other"}


def stamped(path: Path, form: str, times_ms: dict, checked_at: float) -> Path:
    path.write_text(json.dumps([{"case": ["op", "case"], "form": form, "times_ms": times_ms,
                                 "checked_at": checked_at}]))
    return path


def test_a_choice_timed_on_a_quiet_machine_is_stamped_and_trusted_by_the_next_process_for_a_while(tmp_path):
    m = Machine()
    store = tmp_path / "tuned.json"
    first = m.tuner(store, wall=lambda: 1000.0)
    first.choose("op", ("case",), lambda: {"plain": m.form("plain", 1.0), "alt": m.form("alt", 0.5)})
    assert json.loads(store.read_text())[0]["checked_at"] == 1000.0
    m.calls.clear()
    soon = m.tuner(store, wall=lambda: 1000.0 + 3600, spot_share=0.0)
    soon.load(store, check=True)
    assert soon.choose("op", ("case",), m.builder({"plain": 1.0, "alt": 0.5})) == "alt"
    assert not m.calls and not m.built and (soon.trusted, soon.checked) == (1, 0), "checked an hour ago: trusted"
    late = m.tuner(store, wall=lambda: 1000.0 + soon.trust_s + 1, spot_share=0.0)
    late.load(store, check=True)
    assert late.choose("op", ("case",), m.builder({"plain": 1.0, "alt": 0.5})) == "alt"
    assert (late.trusted, late.checked) == (0, 1), "a day later the choice is checked again at its first use"
    assert json.loads(store.read_text())[0]["checked_at"] == 1000.0 + soon.trust_s + 1, "a quiet check renews it"


def test_a_spot_check_still_finds_a_trusted_choice_that_went_wrong(tmp_path):
    """A recent stamp spares the check, but a share of trusted cases are checked anyway (`spot_share`): a choice
    that is wrong for this machine now is found by the processes that use it, and replaced."""
    m = Machine()
    store = stamped(tmp_path / "tuned.json", "plain", {"plain": 10.0, "c": 488.0}, checked_at=1e9 - 60)
    tuner = m.tuner(store, spot_share=1.0)
    tuner.load(store, check=True)
    with pytest.warns(UserWarning, match="kept choice 'plain'"):
        assert tuner.choose("op", ("case",), m.builder({"plain": 1.0, "c": 0.5})) == "c"
    assert kept(store) == {("op", "case"): "c"} and tuner.replaced == 1


def test_a_busy_check_and_a_busy_timing_stamp_nothing(tmp_path):
    m = Machine()
    store = stamped(tmp_path / "tuned.json", "plain", {"plain": 10.0, "c": 488.0}, checked_at=5.0)
    before = store.read_text()
    tuner = m.tuner(store)
    tuner.load(store, check=True)  # stamped long ago: checked
    assert tuner.choose("op", ("case",), m.builder({"plain": 4.0, "c": 1.0}, waited=0.75)) == "plain"
    assert tuner.checked == 1 and store.read_text() == before, "a busy check renews no trust"
    tuner.choose("op", ("other",), m.builder({"plain": 4.0, "c": 1.0}, waited=0.75))
    assert tuner.choices[("op", "other")].checked_at is None and store.read_text() == before


def test_the_trust_window_is_set_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MINI_ENGINE_TUNE_DIR", str(tmp_path))
    monkeypatch.setenv("MINI_ENGINE_TUNE_TRUST", "0")
    assert autotune.tuner_from_env().trust_s == 0, "0: every kept case is checked at its first use, as before"
    monkeypatch.setenv("MINI_ENGINE_TUNE_TRUST", "a day")
    with pytest.raises(ValueError, match="MINI_ENGINE_TUNE_TRUST"):
        autotune.tuner_from_env()
