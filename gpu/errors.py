"""Errors raised while reading a model: config, weights and tokenizer.

Each derives from `CadenceError` (and `ValueError`), and its message names the
file, tensor or field at fault.
"""

from __future__ import annotations

from cadence.statemachine.errors import CadenceError


class CheckpointError(CadenceError, ValueError):
    """A model directory cannot be used; the message names the file or tensor."""


class CheckpointFileNotFoundError(CheckpointError):
    """A file the checkpoint needs (config, weights shard, tokenizer) is missing."""


class UnsupportedArchitectureError(CheckpointError):
    """config.json describes a model family or feature Cadence does not implement."""


class WeightShapeError(CheckpointError):
    """A tensor in the checkpoint has a different shape than the model expects."""


class MissingWeightError(CheckpointError):
    """The checkpoint lacks tensors the model needs."""


class UnexpectedWeightError(CheckpointError):
    """The checkpoint holds a tensor the model has no parameter for."""


__all__ = [
    "CheckpointError",
    "CheckpointFileNotFoundError",
    "UnsupportedArchitectureError",
    "WeightShapeError",
    "MissingWeightError",
    "UnexpectedWeightError",
]
