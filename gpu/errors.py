"""Errors raised while reading a model: config, weights and tokenizer.

They are defined with every other user-facing error in
`cadence.statemachine.errors`; this module names the ones the loader raises.
"""

from __future__ import annotations

from cadence.statemachine.errors import (
    CheckpointError,
    CheckpointFileNotFoundError,
    MissingWeightError,
    UnexpectedWeightError,
    UnsupportedArchitectureError,
    WeightShapeError,
)

__all__ = [
    "CheckpointError",
    "CheckpointFileNotFoundError",
    "UnsupportedArchitectureError",
    "WeightShapeError",
    "MissingWeightError",
    "UnexpectedWeightError",
]
