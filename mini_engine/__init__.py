"""mini_engine: a small, readable, real LLM inference engine for the course (mini_engine/README.md is the guide)."""
import importlib

from .config import PRESETS, ModelConfig
from .engine import LLM, LLMEngine
from .outputs import CompletionOutput, RequestOutput
from .engine_config import EngineConfig
from .generate import SpeculativeStats, generate_batch, generate_cached, generate_naive, generate_speculative
from .loading.loader import load_model
from .sampling import SamplingParams

__all__ = ["formulas", "simulate", "LLM", "LLMEngine", "RequestOutput", "CompletionOutput", "EngineConfig",
           "ModelConfig", "PRESETS", "load_model", "generate_naive", "generate_cached", "generate_batch",
           "generate_speculative", "SpeculativeStats", "SamplingParams", "default_dtype"]


def __getattr__(name: str):
    # `me.formulas`, `me.simulate` and `me.default_dtype` are public API, loaded from the course support on first use.
    if name in ("formulas", "simulate", "default_dtype"):
        module = importlib.import_module(f"mini_engine.course.{'devices' if name == 'default_dtype' else name}")
        return getattr(module, name, module)
    raise AttributeError(f"module 'mini_engine' has no attribute {name!r}")
