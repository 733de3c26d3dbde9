"""The model executor: Llama-family models, paged KV cache, attention backends, sampler, loading."""

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

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "CausalLM",
    "CheckpointError",
    "CheckpointFileNotFoundError",
    "MissingWeightError",
    "ModelConfig",
    "ModelRunner",
    "RopeScaling",
    "Sampler",
    "SamplerOutput",
    "Tokenizer",
    "UnexpectedWeightError",
    "UnsupportedArchitectureError",
    "WeightShapeError",
    "get_attention_backend",
    "load_weights",
    "preset",
]
