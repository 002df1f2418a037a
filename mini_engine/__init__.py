"""mini_engine: a small, readable, real LLM inference engine for the course."""
from . import formulas, simulate
from .config import PRESETS, ModelConfig
from .engine import LLM, CompletionOutput, LLMEngine, RequestOutput
from .engine_config import EngineConfig
from .generate import SpeculativeStats, generate_batch, generate_cached, generate_naive, generate_speculative
from .loader import load_model
from .sampling import SamplingParams

__all__ = ["formulas", "simulate", "LLM", "LLMEngine", "RequestOutput", "CompletionOutput", "EngineConfig", "ModelConfig", "PRESETS", "load_model", "generate_naive", "generate_cached", "generate_batch",
           "generate_speculative",
           "SpeculativeStats", "SamplingParams"]
