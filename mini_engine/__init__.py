"""mini_engine: a small, readable, real LLM inference engine for the course."""
from .config import ModelConfig, PRESETS
