"""User-facing sampling parameters, shared by the actors and the executor."""

from __future__ import annotations

import attrs

from .errors import InvalidRequestError
from .request import SamplingLimits


def _check(field: str, ok: bool, limit: str, value: object) -> None:
    if not ok:
        raise InvalidRequestError(f"{field} must be {limit}, got {value!r}")


@attrs.frozen
class SamplingParams:
    """How to pick each next token, and when to stop.

    temperature 0 means greedy. top_k 0 and top_p 1 and min_p 0 disable those
    filters. `seed` makes a request's samples reproducible regardless of what
    else is in the batch. `logprobs` asks for that many top alternatives per
    token (the sampled token's logprob always comes first). `stop` strings are
    matched on detokenised text by the request actor.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    include_stop_str_in_output: bool = False

    def __attrs_post_init__(self) -> None:
        _check("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, ">= 1", self.max_tokens)
        _check("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "in [0, max_tokens]", self.min_tokens)
        _check("temperature", self.temperature >= 0.0, ">= 0", self.temperature)
        _check("top_k", self.top_k >= 0, ">= 0 (0 disables it)", self.top_k)
        _check("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]", self.top_p)
        _check("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]", self.min_p)
        _check("repetition_penalty", self.repetition_penalty > 0.0, "> 0", self.repetition_penalty)
        _check("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]", self.presence_penalty)
        _check("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]", self.frequency_penalty)
        _check("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "in [0, 20]", self.logprobs)
        _check("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings", self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def limits(self, eos_token_ids: frozenset[int] | set[int] = frozenset()) -> SamplingLimits:
        """The stopping limits the scheduling core applies."""
        return SamplingLimits(
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            eos_token_ids=frozenset(eos_token_ids),
            stop_token_ids=frozenset(self.stop_token_ids),
        )
