"""The optional CPU backend: the project's C kernels and the measured choice among equal forms of a product or an
attention, for CPUs. It plugs into a loaded model (`install`) the way quantization swaps layers; the core never
imports it, and MINI_ENGINE_CPU_BACKEND=0 turns all of it off (README.md beside this file says what it does and
what the CPU work measured)."""
from __future__ import annotations

import os

import torch
from torch import nn


def enabled() -> bool:
    """Whether the backend plugs into models loaded on a CPU (MINI_ENGINE_CPU_BACKEND=0 turns it off)."""
    return os.environ.get("MINI_ENGINE_CPU_BACKEND", "1") != "0"


def install(model):
    """Plug the backend into `model`, a model on the CPU, in place (returns it): each bias-free nn.Linear takes the
    product form measured fastest here (`products.Linear`), RMSNorm, RoPE and SwiGLU their fused operators
    (`layers`), each quantized layer of `mini_engine.quant` its tuned forms (`quant_forms`), the "torch"
    attention backend the forms that read the caches in place (`attention`), and its compiled decode steps the
    same place in CPython's frame stack from any caller (`fresh_chunk`). Nothing happens where the backend is
    off or the model is not on a CPU."""
    if not enabled() or model.device.type != "cpu":
        return model
    from .attention import CpuAttention, register_decode_op
    from .fresh_chunk import FreshChunkDecodeGraphs
    from .layers import FUSED
    from .products import Linear
    from .quant_forms import adopt_all
    for module in model.modules():
        if type(module) is nn.Linear and module.bias is None:
            Linear.adopt(module)
        elif type(module) in FUSED:
            module.__class__ = FUSED[type(module)]
    adopt_all(model)
    register_decode_op()
    model.attention_backends["torch"] = CpuAttention()
    if not isinstance(model.__dict__.get("decode_graphs"), FreshChunkDecodeGraphs):
        model.decode_graphs = FreshChunkDecodeGraphs()
    return model

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


def warm_up(model, rows=(1,), progress: bool = True) -> None:
    """Decide the product form of every weight of `model` for each row count in `rows` now, so that the
    timing runs stay out of later measurements (as a benchmark's warm-up does). Quantized layers not yet adopted
    (a model quantized after it loaded) are adopted first; nothing happens where the backend is off.
    A case the process already knows, or trusts from the machine's store, costs a look-up; the cases that must
    still be timed or checked are done first, one per shape and row bucket, under a progress bar (`progress`)
    that names each."""
    if not enabled():
        return
    from tqdm.auto import tqdm

    from . import products, quant_forms
    from .autotune import TUNER
    from .products import Linear
    from .quant_forms import TunedQuantLinear, adopt_all
    adopt_all(model)
    work = []  # (case, what it is, decide): every layer at every row count
    for layer in model.modules():
        for n in rows:
            if isinstance(layer, Linear) and layer.weight.device.type == "cpu":
                case = ("product", products.product_key(layer.weight, n))
                work.append((case, f"{tuple(layer.weight.shape)} at {n} rows", layer.tuner,
                             lambda layer=layer, n=n: layer.form_for(n)))
            elif isinstance(layer, TunedQuantLinear) and layer.qweight.device.type == "cpu":
                case = (f"{layer.meta.kind}_product", quant_forms.product_key(layer, n, model.dtype))
                work.append((case, f"{layer.meta.kind} {layer.out_features}x{layer.in_features} at {n} rows",
                             layer.tuner or TUNER, lambda layer=layer, n=n: layer.form_for(n, model.dtype)))
    pending = {}
    for case, what, tuner, decide in work:
        if case not in pending and not tuner.settled(*case):
            verb = "checking" if (case[0], *case[1]) in tuner.choices else "timing"  # kept, or never met here
            pending[case] = (f"{verb} {what}", decide)
    with torch.inference_mode():
        with tqdm(total=len(pending), desc="CPU backend: product forms", unit="case",
                  disable=not (progress and pending)) as bar:
            for what, decide in pending.values():
                bar.set_postfix_str(what, refresh=False)
                decide()
                bar.update()
        for _, _, _, decide in work:
            decide()


def state_line() -> str:
    """One line for a benchmark's or a chapter's header: whether the backend is on, and what its tuner took from
    the machine's store, checked, replaced and timed in this process."""
    if not enabled():
        return "CPU backend: off (MINI_ENGINE_CPU_BACKEND=0)"
    from .autotune import TUNER
    return f"CPU backend: on; {TUNER.state()}"
