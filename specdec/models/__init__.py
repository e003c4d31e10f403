"""Target and draft models: the native Llama family, the transformers adapter, and their loaders."""

from specdec.models.llama import LlamaModel, ModelConfig, ModelOutput
from specdec.models.loading import load_model

__all__ = ["LlamaModel", "ModelConfig", "ModelOutput", "load_model"]
