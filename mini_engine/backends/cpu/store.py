"""The machine's store of kept choices, for people: `python -m mini_engine tuning` shows what the tuner keeps for a
process like the one asking (its thread count, torch and backend source), and can delete it or time it afresh."""
from __future__ import annotations

import torch

from . import autotune


def describe() -> str:
    """The kept choices of a process like this one (its thread count, torch, backend source), as a table of case,
    form and each candidate's best time; and how many files other settings keep beside them."""
    path = autotune.machine_store()
    if path is None:
        return "the store is off (MINI_ENGINE_TUNE_CACHE=0): every process times its cases afresh"
    from . import format_tuned_forms
    others = sorted(p for p in path.parent.glob("tuned-*.json") if p != path)
    lines = [f"kept choices for {torch.get_num_threads()} threads and torch {torch.__version__}: {path}"]
    if path.exists():
        tuner = autotune.Autotuner()
        lines += [f"{tuner.load(path)} cases", format_tuned_forms(tuner), _checked(tuner)]
    else:
        lines.append("none yet: the next process to meet a case times it and keeps it here")
    if others:
        lines.append(f"{len(others)} other file(s) in {path.parent}, for other thread counts, torch versions or "
                     f"backend sources: {', '.join(p.name for p in others)}")
    return "\n".join(lines)


def _checked(tuner: autotune.Autotuner) -> str:
    """When the kept choices were last timed or checked on a quiet machine, and so which a process trusts."""
    stamps = [c.checked_at for c in tuner.choices.values() if c.checked_at is not None]
    now = tuner.wall()
    recent = sum(0 <= now - t < tuner.trust_s for t in stamps)
    line = (f"checked: {recent} within the last {tuner.trust_s / 3600:g} h (trusted at first use but for spot checks "
            f"of {tuner.spot_share:.0%}), {len(tuner.choices) - recent} longer ago or never (checked at first use)")
    if stamps:
        line += f"; last {(now - max(stamps)) / 3600:.1f} h ago, oldest {(now - min(stamps)) / 3600:.1f} h ago"
    return line


def check(model_name: str, dtype: str, rows: tuple[int, ...]) -> str:
    """What a new process's first use of `model_name`'s products at `rows` costs now: this process's tuner decides
    them as a first batch would (trusting, checking or timing each case), and says what it did."""
    import time

    from ...loading.loader import load_model
    from . import warm_up
    model, _ = load_model(model_name, device="cpu", dtype=dtype)
    t0 = time.perf_counter()
    warm_up(model, rows)
    return f"first use of {model_name}'s products at rows {rows}: {time.perf_counter() - t0:.1f} s; " \
           f"{autotune.TUNER.state()}"


def reset() -> list:
    """Delete every file of kept choices in the store's folder; returns their paths."""
    path = autotune.machine_store()
    if path is None:
        return []
    gone = sorted(path.parent.glob("tuned-*.json"))
    for p in gone:
        p.unlink(missing_ok=True)
    return gone


def retime(model_name: str, dtype: str, rows: tuple[int, ...]) -> str:
    """Delete the kept choices, then time every product of `model_name` at each row count in `rows` afresh (a
    tuner made now, which keeps what it times on a quiet machine); returns what it did, in a line."""
    from ...loading.loader import load_model
    from . import warm_up
    reset()
    model, _ = load_model(model_name, device="cpu", dtype=dtype)
    autotune.TUNER.choices.clear()  # what this process took from the store before the reset must not stand
    autotune.TUNER.unchecked.clear()
    warm_up(model, rows)
    return f"timed afresh: {autotune.TUNER.state()}"

