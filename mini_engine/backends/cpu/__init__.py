"""The optional CPU backend: the project's C kernels and the measured choice among equal forms of a product or an
attention, for CPUs. It plugs into a loaded model (`install`) the way quantization swaps layers; the core never
imports it, and MINI_ENGINE_CPU_BACKEND=0 turns all of it off (README.md beside this file says what it does and
what the CPU work measured)."""
from __future__ import annotations

import torch

def tuned_forms(tuner=None) -> list[dict]:
    """The forms the autotuner has chosen so far in this process, one row per case, with each candidate's
    best time (ms) and the winner's speedup over the plain form."""
    from .autotune import TUNER
    rows = []
    for (op, *key), choice in (tuner or TUNER).report():
        rows.append({"op": op, "case": tuple(key), "form": choice.form, "times_ms": choice.times_ms,
                     "speedup": choice.speedup})
    return rows


def format_tuned_forms(tuner=None, rows: int | None = None) -> str:
    """The table of `tuned_forms`; with `rows`, only the weight products of that row bucket."""
    lines = [f"{'op':<10} {'case':<52} {'chosen':<16} {'vs plain':>8}  candidates (best ms)"]
    for r in tuned_forms(tuner):
        if rows is not None and (r["op"] != "product" or r["case"][1] != rows):
            continue
        times = ", ".join(f"{n} {t:.2f}" for n, t in r["times_ms"].items()) or "forced"
        case = " ".join(str(k).removeprefix("torch.") for k in r["case"])
        lines.append(f"{r['op']:<10} {case:<52} {r['form']:<16} {r['speedup']:>7.2f}x  {times}")
    return "\n".join(lines)


def warm_up(model, rows=(1,)) -> None:
    """Decide the product form of every weight of `model` for each row count in `rows` now, so that the
    timing runs stay out of later measurements (as a benchmark's warm-up does)."""
    from .products import Linear
    from ..quant import QuantLinear
    with torch.inference_mode():
        for layer in model.modules():
            if isinstance(layer, Linear) and layer.weight.device.type == "cpu":
                for n in rows:
                    layer.form_for(n)
            elif isinstance(layer, QuantLinear) and layer.qweight.device.type == "cpu":
                for n in rows:
                    layer.form_for(n, model.dtype)
