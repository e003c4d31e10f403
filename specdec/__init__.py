"""specdec: lossless speculative decoding for Llama-family models, with the tools to measure it."""

from specdec.api import clear_cache, generate
from specdec.config import SamplingParams, SpecConfig
from specdec.engine import SpecEngine
from specdec.models import load_model

__all__ = ["SamplingParams", "SpecConfig", "SpecEngine", "clear_cache", "generate", "load_model"]
__version__ = "0.1.0"
