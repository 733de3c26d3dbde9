"""The model executor: Llama-family models, paged KV cache, attention backends, sampler, loading.

The names below load on first use, so importing one light submodule (the
tokenizer, the config) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from . import openmp_env

openmp_env.set_spin_count()  # before anything here loads torch

# Each public name and the submodule that defines it.
_EXPORTS = {
    "AttentionBackend": "attention",
    "AttentionMetadata": "attention",
    "get_attention_backend": "attention",
    "ModelConfig": "config",
    "RopeScaling": "config",
    "preset": "config",
    "CheckpointError": "errors",
    "CheckpointFileNotFoundError": "errors",
    "MissingWeightError": "errors",
    "UnexpectedWeightError": "errors",
    "UnsupportedArchitectureError": "errors",
    "WeightShapeError": "errors",
    "load_weights": "loader",
    "CausalLM": "model",
    "ModelRunner": "runner",
    "Sampler": "sampler",
    "SamplerOutput": "sampler",
    "Tokenizer": "tokenizer",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .attention import AttentionBackend, AttentionMetadata, get_attention_backend
    from .config import ModelConfig, RopeScaling, preset
    from .errors import (
        CheckpointError,
        CheckpointFileNotFoundError,
        MissingWeightError,
        UnexpectedWeightError,
        UnsupportedArchitectureError,
        WeightShapeError,
    )
    from .loader import load_weights
    from .model import CausalLM
    from .runner import ModelRunner
    from .sampler import Sampler, SamplerOutput
    from .tokenizer import Tokenizer


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
