"""Every error a Cadence user may catch, defined in one place.

The actors, the server and the clients re-raise these same classes, so
`except cadence.statemachine.errors.QueueFullError` works whichever layer
raised it.
"""

from __future__ import annotations


class CadenceError(Exception):
    """Base class of every error Cadence raises on purpose."""


class ConfigError(CadenceError, ValueError):
    """A configuration field is out of range; the message names the field."""


class InvalidRequestError(CadenceError, ValueError):
    """A request field is invalid; the message names the field and the limit, and
    `field`, where the raiser knows it, is the field's name (the HTTP API's `param`)."""

    field: str | None = None

    def __init__(self, *args: object, field: str | None = None) -> None:
        super().__init__(*args)
        if field is not None:
            self.field = field


class RequestTooLongError(InvalidRequestError):
    """The prompt plus `max_tokens` cannot fit in `max_model_len` or in the KV cache.
    `field` is the request field to change: "max_tokens" where the prompt alone fits
    (`naming`), "prompt" otherwise."""

    field = "prompt"

    @classmethod
    def naming(cls, num_prompt_tokens: int, limit: int, message: str) -> "RequestTooLongError":
        """The error for a prompt of `num_prompt_tokens` (at least) against a bound of
        `limit` tokens: a prompt below the bound leaves room for some output."""
        error = cls(message)
        error.field = "prompt" if num_prompt_tokens >= limit else "max_tokens"
        return error


class StructuredOutputError(InvalidRequestError):
    """A request's structured output cannot be compiled (a bad JSON schema, regular
    expression or grammar); `field` is what the message names ("structured_output",
    "regex" or "grammar"; the HTTP API puts its own field's name in its place)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class QueueFullError(CadenceError):
    """The waiting queue already holds `max_waiting` requests."""


class RequestNotFoundError(CadenceError, KeyError):
    """No live request has this id."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "request not found"


class DuplicateRequestError(InvalidRequestError):
    """A live request already has this id."""


class IllegalTransition(CadenceError):
    """An event arrived that the request state machine has no edge for."""


class ProtocolError(CadenceError):
    """A message could not be decoded or violates the wire protocol."""


class ExecutorError(CadenceError):
    """The executor failed a step, died, or stopped answering."""


class PoisonRequestError(ExecutorError):
    """The executor fails on this request and on no other: the request itself
    causes the failure, so running it again (here or elsewhere) fails the same way."""


class EngineClosedError(CadenceError):
    """The engine is shutting down or has shut down."""


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
    "CadenceError",
    "ConfigError",
    "InvalidRequestError",
    "RequestTooLongError",
    "StructuredOutputError",
    "QueueFullError",
    "RequestNotFoundError",
    "DuplicateRequestError",
    "IllegalTransition",
    "ProtocolError",
    "ExecutorError",
    "PoisonRequestError",
    "EngineClosedError",
    "CheckpointError",
    "CheckpointFileNotFoundError",
    "UnsupportedArchitectureError",
    "WeightShapeError",
    "MissingWeightError",
    "UnexpectedWeightError",
]
