"""What test_tensor_parallel.py and test_pipeline_parallel.py share: the engines' knobs, the prompts, and whether a
rank's process is still alive."""
from __future__ import annotations

import os
from pathlib import Path

# Both modules' engines and their one-process references run the same knobs: a small paged pool, prompts chunked
# 24 tokens at a time (so that prefills are cut and mixed with decodes), prefix caching on.
KNOBS = dict(max_num_seqs=8, num_kv_blocks=96, block_size=8, chunked_prefill_tokens=24, enable_prefix_caching=True)
SYSTEM = ("You are a careful assistant who answers in short, plain sentences and names the units of every "
          "number you give. ")
PROMPTS = ["The capital of France is", SYSTEM + "How far is the Moon?", SYSTEM + "Name three prime numbers.",
           "def fibonacci(n):"]


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a rank its parent has not reaped yet counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
