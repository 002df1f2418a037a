#!/usr/bin/env bash
# The one command to run on a GPU machine with this repository: at most 8 minutes, offline (it installs nothing).
# It needs a Python with torch (CUDA), triton, pytest and transformers; no gguf, no ipywidgets, no model weights
# (the engine runs SmolLM2-135M's shapes with random weights). benchmarks/gpu_check.py does the work: it prints
# the environment (GPU, compute capability, torch, triton), then fails on any wrong answer:
#   - the kernel tests (tests/kernels, and the engine's tests of its kernels) natively on the GPU, real sizes
#     included (run last, with what is left of the budget);
#   - the Triton attention backend against the torch one through the engine (contiguous and paged caches;
#     prefill, decode, verify; fp16 and, from compute capability 8.0, bf16); host syncs per step;
#     LLM(compile=True) against eager, its decode steps replayed as CUDA graphs (none skipped, Inductor counts);
#   a part that raises is a failed check, with its traceback, and the next part still runs;
# then prints one table: FlashAttention against SDPA at N = 1k-16k, paged decode bandwidth against the GPU's
# peak, the serving workload eager against compiled (and vLLM, where it is installed).
# Record that table in benchmarks/RESULTS.md with the GPU's name.
#
#   bash benchmarks/gpu_check.sh           # PYTHON=/path/to/python picks the interpreter
#   bash benchmarks/gpu_check.sh --dry     # the same steps on the CPU at tiny sizes, kernels in Triton's
#                                          # interpreter: what CI runs (tests/test_gpu_check.py); times mean nothing
#   bash benchmarks/gpu_check.sh --parts serving kernel-tests   # only these parts: a second run finishes what the
#                                          # budget cut from the first (parts: backends syncs attention bandwidth
#                                          # serving kernel-tests)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
BUDGET=480  # seconds, for all of it
start=$SECONDS

dry=()
if [[ "${1:-}" == --dry ]]; then
  dry=(--dry); shift; export CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1
else
  unset TRITON_INTERPRET  # Triton compiles for the GPU
fi
if [[ $# -gt 0 && "$1" != --parts ]]; then
  echo "usage: bash benchmarks/gpu_check.sh [--dry] [--parts PART ...]" >&2; exit 2
fi

PY=""
for candidate in "${PYTHON:-}" .venv/bin/python "$(command -v python3 || true)"; do
  if [[ -n "$candidate" && -x "$candidate" ]] && "$candidate" -c 'import torch, triton' 2>/dev/null; then
    PY=$candidate; break
  fi
done
if [[ -z "$PY" ]]; then echo "no Python with torch and triton found: set PYTHON=..." >&2; exit 2; fi
missing=$("$PY" -c 'import importlib.util as u
print(" ".join(m for m in ("torch", "triton", "pytest", "transformers") if u.find_spec(m) is None))')
if [[ -n "$missing" ]]; then echo "$PY lacks: $missing (this script installs nothing)" >&2; exit 2; fi
echo "== $PY"

# Past its budget the Python part is sent SIGTERM: it stops, prints the table so far and fails.
left=$(( BUDGET - (SECONDS - start) - 10 ))
timeout -k 15 "$left" "$PY" benchmarks/gpu_check.py --budget $(( left - 20 )) "${dry[@]}" "$@"
rc=$?
echo "== $((SECONDS - start)) s in all"
exit $rc
