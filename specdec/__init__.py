"""specdec: lossless speculative decoding for Llama-family models, with the tools to measure it."""

import importlib

# name -> module: imported on first use, so `import specdec.server.bench` (in each bench-serve client
# process) or `specdec --help` does not pay for torch and the models.
_EXPORTS = {
    "SamplingParams": "specdec.config",
    "SpecConfig": "specdec.config",
    "SpecEngine": "specdec.engine",
    "clear_cache": "specdec.api",
    "generate": "specdec.api",
    "load_model": "specdec.models",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
