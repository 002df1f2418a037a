"""mini_engine: a small, readable, real LLM inference engine for the course."""
from . import formulas, simulate
from .config import PRESETS, ModelConfig
from .generate import generate_batch, generate_cached, generate_naive
from .loader import load_model
from .sampling import SamplingParams

__all__ = ["formulas", "simulate", "ModelConfig", "PRESETS", "load_model", "generate_naive", "generate_cached", "generate_batch",
           "SamplingParams"]
