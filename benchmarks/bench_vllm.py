"""The ladder's workload (chapter 09) on vLLM beside mini_engine's top rungs, on one GPU, in one run.

    python benchmarks/bench_vllm.py [--requests 256] [--dtype bfloat16]

Needs a GPU and `pip install vllm` (a Colab GPU runtime will do). vLLM reads an HF checkpoint folder, so the
embedded GGUF is converted once with transformers (dequantized weights and config, saved under build/); no
network is needed. vLLM gets the prompts as token ids (`skip_tokenizer_init`), so both engines see exactly the
same tokens, with the same per-request max_tokens, greedy, EOS ending a request.

Each vLLM configuration runs in a subprocess of its own (a vLLM engine does not hand its GPU memory back inside
one process): its defaults (continuous batching, paged KV cache, prefix caching, CUDA graphs), then with n-gram
speculation when this vLLM version takes `speculative_config`. Printed: tokens/s of each, vLLM / mini_engine,
and how many requests produced identical tokens (bf16 on both sides: a near-tie can flip).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VLLM_CONFIGS = {
    "default": {"enable_prefix_caching": True},
    "ngram": {"enable_prefix_caching": True,
              "speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                     "prompt_lookup_min": 1}},
}


def workload(requests: int):
    """The ladder's workload, built with mini_engine's tokenizer; and the EOS token id."""
    from mini_engine.bench.ladder import LadderWorkload
    from mini_engine.loading.loader import load_model
    _, tok = load_model("smollm2-135m", device="cpu")
    return LadderWorkload.build(tok, requests), tok.eos_token_id


def export_hf_folder(dest: Path) -> Path:
    """The embedded GGUF as an HF checkpoint folder (config.json + safetensors), made once with transformers."""
    if (dest / "config.json").exists():
        return dest
    import torch
    import transformers

    from mini_engine.loading.loader import embedded_gguf_path
    path = embedded_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    # A model loaded from a GGUF file refuses save_pretrained; a plain copy of it, with the same weights, does not.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(dest)
    model.generation_config.save_pretrained(dest)
    return dest


def run_vllm(config: str, requests: int, dtype: str, out: Path) -> None:
    """One vLLM configuration on the workload; writes {"seconds", "outputs"} (or {"error"}) to `out`."""
    from vllm import LLM, SamplingParams

    work, eos = workload(requests)
    folder = export_hf_folder(ROOT / "build" / "smollm2-135m-hf")
    try:
        llm = LLM(model=str(folder), dtype=dtype, skip_tokenizer_init=True, gpu_memory_utilization=0.5, seed=0,
                  max_model_len=max(2048, work.longest), **VLLM_CONFIGS[config])
    except (TypeError, ValueError) as e:  # an older vLLM without this option
        out.write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return
    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=n, stop_token_ids=[eos], detokenize=False)
              for n in work.max_tokens]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up, as for our engine
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    out.write_text(json.dumps({"seconds": seconds, "outputs": [list(o.outputs[0].token_ids) for o in outs]}))


def ours(requests: int, dtype: str) -> dict:
    """mini_engine's paged + prefix caching rung (vLLM's default features) and its top rung, on the GPU."""
    import mini_engine as me
    from mini_engine.bench.ladder import compile_engine_available, engine_kwargs_for, run_engine_rung

    model, tok = me.load_model("smollm2-135m", device="cuda", dtype=dtype)
    work, _ = workload(requests)
    rungs = ["prefix", "speculative"] + (["compiled_engine"] if compile_engine_available() else [])
    rows = {}
    for rung in rungs:
        kwargs = engine_kwargs_for(rung, work, "cuda", 64, 16, None, None, 4)
        rows[rung] = run_engine_rung(model, tok, work, rung, progress=False, **kwargs)
    return rows


def same(a: list[int], b: list[int], eos: int) -> bool:
    strip = lambda t: t[:-1] if t and t[-1] == eos else t  # noqa: E731 (vLLM may leave the stop token out)
    return strip(list(a)) == strip(list(b))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                        help="default: the GPU's (mini_engine.default_dtype: bf16 from compute capability 8.0)")
    parser.add_argument("--run-vllm", choices=sorted(VLLM_CONFIGS), help=argparse.SUPPRESS)  # the subprocess
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_vllm:
        run_vllm(args.run_vllm, args.requests, args.dtype, args.out)
        return 0
    import torch
    if not torch.cuda.is_available():
        print("bench_vllm: no GPU visible; vLLM runs on a GPU only")
        return 1
    from mini_engine.course.devices import default_dtype
    args.dtype = args.dtype or default_dtype("cuda")
    work, eos = workload(args.requests)
    export_hf_folder(ROOT / "build" / "smollm2-135m-hf")  # once, before any timing
    rows = ours(args.requests, args.dtype)
    torch.cuda.empty_cache()
    tokens = {rung: row.tokens for rung, row in rows.items()}
    print(f"GPU: {torch.cuda.get_device_name()}; {work.describe()}; {args.dtype}")
    print(f"{'system':<44} {'tok/s':>9} {'vs vLLM default':>15} {'identical to ours':>18}")
    results = {}
    for config in VLLM_CONFIGS:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "vllm.json"
            cmd = [sys.executable, __file__, "--run-vllm", config, "--requests", str(args.requests), "--dtype",
                   args.dtype, "--out", str(out)]
            proc = subprocess.run(cmd)
            results[config] = json.loads(out.read_text()) if out.exists() else {"error": f"exit {proc.returncode}"}
    base = results["default"]
    if "error" in base:
        print(f"vLLM default: failed ({base['error']})")
        return 1
    base_tok_s = sum(len(o) for o in base["outputs"]) / base["seconds"]
    top = rows[list(rows)[-1]]
    for config, res in results.items():
        if "error" in res:
            print(f"{'vLLM ' + config:<44} skipped: {res['error']}")
            continue
        tok_s = sum(len(o) for o in res["outputs"]) / res["seconds"]
        agree = sum(same(a, top.outputs[i], eos) for i, a in enumerate(res["outputs"]))
        print(f"{'vLLM ' + config:<44} {tok_s:>9.1f} {tok_s / base_tok_s:>14.2f}x {agree:>12}/{len(work)}")
    for rung, row in rows.items():
        print(f"{'mini_engine ' + rung:<44} {row.tok_s:>9.1f} {row.tok_s / base_tok_s:>14.2f}x "
              f"{'(ours)':>18}  [{tokens[rung]} tokens]")
    print(f"mini_engine top rung ({list(rows)[-1]}) / vLLM default: {top.tok_s / base_tok_s:.2f}x tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
