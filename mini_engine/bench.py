"""`python -m mini_engine bench`: each rung of the ladder and HF transformers on one workload, in one run.

Every row is measured in the same process on the same prompt, so the ratio column compares like with like.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .generate import generate_cached, generate_naive
from .metrics import TokenTimer, percentile
from .sampling import SamplingParams

BENCH_PROMPT = [{"role": "user", "content": "Explain, step by step, how a bicycle stays upright while moving."}]


@dataclass
class Row:
    system: str
    workload: str
    tokens: int
    seconds: float
    ttft: list[float]
    tpot: list[float]
    kv_bytes: int | None = None

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def _single_stream(name, workload, fn, device) -> Row:
    timer = TokenTimer(device).begin()
    out = fn(timer.on_token)
    return Row(name, workload, len(out), timer.e2e_s, [timer.ttft_s], [timer.tpot_s])


def run_mini(model, rung: str, prompt: list[int], new_tokens: int) -> Row:
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    loop = {"naive": generate_naive, "cached": generate_cached}[rung]
    row = _single_stream(f"mini_engine {rung}", f"1 x {len(prompt)}+{new_tokens}",
                         lambda cb: loop(model, prompt, new_tokens, params, on_token=cb), str(model.device))
    if rung == "cached":
        from .formulas import kv_cache_bytes
        c = model.config
        row.kv_bytes = kv_cache_bytes(c.num_layers, c.num_kv_heads, c.head_dim, len(prompt) + new_tokens, 1,
                                      model.dtype.itemsize)
    return row


def load_hf(device: str, dtype: torch.dtype):
    """transformers' own GGUF loader on the same file: the reference every rung is compared with."""
    import transformers

    from .loader import embedded_gguf_path
    path = embedded_gguf_path()
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return hf.to(device).eval()


def run_hf(hf, prompt: list[int], new_tokens: int, use_cache: bool) -> Row:
    """HF `generate`, greedy, no early stop; a streamer-like hook times each token."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    device = str(hf.device)
    timer = TokenTimer(device)

    class Stamp(StoppingCriteria):  # called once per generated token: a cheap way to time each one
        def __call__(self, input_ids, scores, **kwargs):
            timer.on_token()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    ids = torch.tensor([prompt], device=hf.device)
    timer.begin()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, use_cache=use_cache,
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                          stopping_criteria=StoppingCriteriaList([Stamp()]))
    tag = "cached" if use_cache else "no cache"
    return Row(f"HF transformers ({tag})", f"1 x {len(prompt)}+{new_tokens}", out.shape[1] - len(prompt),
               timer.e2e_s, [timer.ttft_s], [timer.tpot_s])


def format_table(rows: list[Row], baseline: Row | None) -> str:
    head = (f"{'system':<28} {'workload':<14} {'tokens':>6} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'TPOT p50':>9} {'TPOT p99':>9} {'peak KV':>9} {'ratio':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        kv = f"{r.kv_bytes / 2**20:.1f}MiB" if r.kv_bytes else "-"
        ratio = f"{r.tok_s / baseline.tok_s:.2f}x" if baseline else "-"
        lines.append(f"{r.system:<28} {r.workload:<14} {r.tokens:>6} {r.tok_s:>8.2f} "
                     f"{percentile(r.ttft, 50) * 1e3:>7.1f}ms {percentile(r.ttft, 99) * 1e3:>7.1f}ms "
                     f"{percentile(r.tpot, 50) * 1e3:>7.1f}ms {percentile(r.tpot, 99) * 1e3:>7.1f}ms "
                     f"{kv:>9} {ratio:>7}")
    return "\n".join(lines)


def bench(rungs: list[str], new_tokens: int, device: str, dtype: str, with_hf: bool = True, warmup: bool = True,
          print_fn=print) -> list[Row]:
    from .loader import load_model

    model, tok = load_model("smollm2-135m", device=device, dtype=dtype)
    prompt = tok.encode(tok.apply_chat_template(BENCH_PROMPT))
    if warmup:  # first calls pay for allocator growth and lazy init; keep them out of the numbers
        generate_cached(model, prompt, 4, SamplingParams(max_tokens=4, ignore_eos=True))
    rows = []
    if with_hf:
        try:
            hf = load_hf(device, model.dtype)
        except ImportError:
            print_fn("transformers is not installed: HF rows skipped (pip install -e '.[dev]')")
        else:
            for use_cache in ([False] if rungs == ["naive"] else [False, True]):
                if not use_cache and "naive" not in rungs:
                    continue
                rows.append(run_hf(hf, prompt, new_tokens, use_cache))
            del hf
    for rung in rungs:
        rows.append(run_mini(model, rung, prompt, new_tokens))
    baseline = rows[0] if rows else None
    print_fn(f"device={device} dtype={dtype} threads={torch.get_num_threads()} "
             f"prompt={len(prompt)} tokens, new={new_tokens} tokens (greedy, ignore_eos); ratio vs first row")
    print_fn(format_table(rows, baseline))
    return rows
