"""One check of a whole request against the loaded model, before it is queued.

`SamplingParams` checks its own fields' types and ranges where it is built;
`validate_request` adds what depends on the model and the operator: token ids
below the vocabulary size (prompt and stop ids), `top_k`, `logprobs` and `prompt_logprobs` within
the vocabulary, the number and length of stop strings, the request options
(priority, tenant, deadline, timeout, cache salt), and the cheapest length
check there is: a text prompt with more UTF-8 bytes than `max_model_len`
tokens could ever hold is refused before it is tokenised.

The embedded engine (`Engine.generate`, and through it the socket server) and
the router call it; each refusal raises `InvalidRequestError` (or
`RequestTooLongError`) naming the field, the value and the limit.
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence, Union

import attrs

from cadence.statemachine.errors import ConfigError, InvalidRequestError, RequestTooLongError
from cadence.statemachine.sampling import MAX_INT64, MAX_LOGPROBS, SamplingParams

__all__ = [
    "Prompt", "RequestLimits", "REQUEST_LIMIT_NAMES", "validate_request", "plural", "check_fits", "check_token_ids", "check_prompt_bytes",
    "check_prompt_num_bytes",
    "DEFAULT_MAX_STOP_STRINGS", "DEFAULT_MAX_STOP_CHARS", "MAX_TENANT_CHARS",
    "MAX_CACHE_SALT_CHARS",
]

# Stop strings a request may carry, and characters in each, unless the operator
# raises them (EngineConfig, `cadence serve --max-stop-strings/--max-stop-chars`).
DEFAULT_MAX_STOP_STRINGS = 16
DEFAULT_MAX_STOP_CHARS = 256
MAX_TENANT_CHARS = 256
MAX_CACHE_SALT_CHARS = 1024

Prompt = Union[str, Sequence[int]]


def _at_least_one(instance, attribute, value) -> None:
    if value is not None and value < 1:
        raise ConfigError(f"{attribute.name} must be >= 1 (or None), got {value!r}")


# The request limits Welcome.limits reports, beside the connection limits.
REQUEST_LIMIT_NAMES = ("max_stop_strings", "max_stop_chars", "max_logprobs")


@attrs.frozen
class RequestLimits:
    """What a request is checked against: the loaded model and the operator's limits.

    vocab_size, max_model_len: the model's (token ids must be below vocab_size).
    has_tokenizer: whether text prompts and stop strings can work.
    max_bytes_per_token: most UTF-8 bytes one token stands for, when the
      tokenizer is known to keep every byte of a text (None: no byte estimate).
    max_stop_strings, max_stop_chars: per request (None: not checked here).
    """

    vocab_size: int = attrs.field(validator=_at_least_one)
    max_model_len: int = attrs.field(validator=_at_least_one)
    has_tokenizer: bool = True
    max_bytes_per_token: int | None = attrs.field(default=None, validator=_at_least_one)
    max_stop_strings: int | None = attrs.field(default=DEFAULT_MAX_STOP_STRINGS,
                                               validator=_at_least_one)
    max_stop_chars: int | None = attrs.field(default=DEFAULT_MAX_STOP_CHARS,
                                             validator=_at_least_one)

    @property
    def max_prompt_bytes(self) -> int | None:
        """Most UTF-8 bytes a text prompt can have and still fit with one output token
        (None: no byte estimate); a longer one is refused whatever else it asks."""
        if self.max_bytes_per_token is None:
            return None
        return (self.max_model_len - 1) * self.max_bytes_per_token

    def welcome_limits(self) -> dict[str, int | None]:
        """The request limits a server reports in Welcome.limits (PROTOCOL.md §5.1)."""
        return dict(zip(REQUEST_LIMIT_NAMES, (self.max_stop_strings, self.max_stop_chars, MAX_LOGPROBS)))

    @classmethod
    def from_welcome(cls, welcome) -> RequestLimits:
        """The limits a server's Welcome describes (stop-string limits where it reports them)."""
        reported = welcome.limits
        return cls(
            vocab_size=welcome.vocab_size, max_model_len=welcome.max_model_len,
            has_tokenizer=welcome.has_tokenizer,
            max_stop_strings=reported.get("max_stop_strings"),
            max_stop_chars=reported.get("max_stop_chars"))


def validate_request(
    prompt: Prompt | None,
    params: SamplingParams | None,
    limits: RequestLimits,
    *,
    priority: int = 0,
    tenant: str = "default",
    deadline_s: float | None = None,
    timeout_s: float | None = None,
    cache_salt: str | None = None,
) -> SamplingParams:
    """Check a whole request; return its sampling parameters (the defaults for None).

    A prompt of None is left to be checked once it exists (a chat conversation the
    server renders later); everything else is checked now. Raises InvalidRequestError for a field out of range for this model, and
    RequestTooLongError when the prompt cannot fit `max_model_len`.
    """
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
    _check_params(params, limits)
    _check_options(priority, tenant, deadline_s, timeout_s, cache_salt)
    if prompt is None:
        return params
    # max_tokens=None asks for whatever room the prompt leaves: at least one token must fit.
    num_output = 1 if params.max_tokens is None else params.max_tokens
    if isinstance(prompt, str):
        if not limits.has_tokenizer:
            raise InvalidRequestError("prompt: text prompts need a tokenizer; this engine has "
                                      "none, send token ids instead", field="prompt")
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", field="prompt")
        check_prompt_bytes(prompt, num_output, limits)
    else:
        if isinstance(prompt, (bytes, bytearray, dict)) or not isinstance(prompt, Sequence):
            raise InvalidRequestError(f"prompt must be a str or a list of token ids, "
                                      f"got {type(prompt).__name__}", field="prompt")
        if len(prompt) == 0:
            raise InvalidRequestError("prompt must hold at least one token", field="prompt")
        check_fits(len(prompt), num_output, limits.max_model_len)
        check_token_ids("prompt", prompt, limits.vocab_size)
    return params


def _check_params(params: SamplingParams, limits: RequestLimits) -> None:
    vocab = limits.vocab_size
    if params.top_k > vocab:
        raise InvalidRequestError(f"top_k must be in [0, vocab_size={vocab}], got {params.top_k}",
                                  field="top_k")
    for field in ("logprobs", "prompt_logprobs"):
        wanted = getattr(params, field)
        if wanted is not None and wanted > vocab:
            raise InvalidRequestError(f"{field} must be at most vocab_size={vocab}, got {wanted}",
                                      field=field)
    check_token_ids("stop_token_ids", params.stop_token_ids, vocab)
    check_token_ids("logit_bias", [token for token, _ in params.logit_bias], vocab)
    check_token_ids("allowed_token_ids", params.allowed_token_ids or (), vocab)
    for word in params.bad_words_token_ids:
        check_token_ids("bad_words_token_ids", word, vocab)
    if params.bad_words and not limits.has_tokenizer:
        raise InvalidRequestError("bad_words need a tokenizer; this engine has none (send "
                                  "bad_words_token_ids instead)", field="bad_words")
    stops = params.stop
    if not stops:
        return
    if not limits.has_tokenizer:
        raise InvalidRequestError("stop: stop strings need a tokenizer; this engine has none",
                                  field="stop")
    most = limits.max_stop_strings
    if most is not None and len(stops) > most:
        raise InvalidRequestError(
            f"stop holds {len(stops)} strings; the limit is max_stop_strings={most}", field="stop")
    longest = max(stops, key=len)
    most = limits.max_stop_chars
    if most is not None and len(longest) > most:
        raise InvalidRequestError(f"stop: a string of {len(longest)} characters "
                                  f"({longest[:32]!r}...); the limit is max_stop_chars={most}",
                                  field="stop")


def _check_options(priority, tenant, deadline_s, timeout_s, cache_salt) -> None:
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral) \
            or not -MAX_INT64 - 1 <= priority <= MAX_INT64:
        raise InvalidRequestError(f"priority must be an int in [-2^63, 2^63 - 1], got {priority!r}",
                                  field="priority")
    if type(tenant) is not str or len(tenant) > MAX_TENANT_CHARS:
        raise InvalidRequestError(
            f"tenant must be a str of at most {MAX_TENANT_CHARS} characters, got {tenant!r:.80}",
            field="tenant")
    if cache_salt is not None and (type(cache_salt) is not str
                                   or len(cache_salt) > MAX_CACHE_SALT_CHARS):
        raise InvalidRequestError(f"cache_salt must be None or a str of at most "
                                  f"{MAX_CACHE_SALT_CHARS} characters, got {cache_salt!r:.80}",
                                  field="cache_salt")
    if deadline_s is not None and not _finite(deadline_s):
        raise InvalidRequestError(f"deadline_s must be None or a finite number, got {deadline_s!r}",
                                  field="deadline_s")
    if timeout_s is not None and not (_finite(timeout_s) and timeout_s > 0):
        raise InvalidRequestError(f"timeout_s must be None or a finite number > 0, got {timeout_s!r}",
                                  field="timeout_s")


def _finite(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def plural(count: int, noun: str) -> str:
    """"1 token", "2 tokens": a count as a message says it."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def check_fits(num_prompt_tokens: int, max_tokens: int, max_model_len: int,
               cache_tokens: int | None = None) -> None:
    """A prompt of this many tokens and max_tokens more fit max_model_len (and the
    KV cache's `cache_tokens`, when given); else RequestTooLongError saying so."""
    total = num_prompt_tokens + max_tokens
    counts = f"prompt has {plural(num_prompt_tokens, 'token')} and max_tokens is {max_tokens}, {total} in all"
    if total > max_model_len:
        raise RequestTooLongError.naming(num_prompt_tokens, max_model_len,
                                         f"{counts}; max_model_len is {max_model_len}")
    if cache_tokens is not None and total > cache_tokens:
        raise RequestTooLongError.naming(num_prompt_tokens, cache_tokens,
                                         f"{counts}; the KV cache holds {cache_tokens} tokens")


def check_token_ids(field: str, token_ids: Sequence[int], vocab_size: int) -> None:
    """Every id an int (not a bool) in [0, vocab_size); else InvalidRequestError naming one."""
    if not token_ids:
        return
    types = set(map(type, token_ids))
    if types == {int} and 0 <= min(token_ids) and max(token_ids) < vocab_size:
        return
    for index, token in enumerate(token_ids):
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) \
                or not 0 <= token < vocab_size:
            raise InvalidRequestError(
                f"{field}[{index}] must be a token id in [0, vocab_size={vocab_size}), got {token!r}",
                field=field)


def check_prompt_bytes(prompt: str, max_tokens: int, limits: RequestLimits) -> None:
    """Refuse a text prompt that cannot fit before tokenising it: a prompt of B UTF-8
    bytes has at least ceil(B / max_bytes_per_token) tokens."""
    per_token = limits.max_bytes_per_token
    if per_token is None:
        return
    room = limits.max_model_len - max_tokens
    # A character is 1 to 4 bytes: count them only when the length alone cannot settle it.
    if len(prompt) <= room * per_token // 4:
        return
    try:
        num_bytes = len(prompt.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"prompt is not valid Unicode: {exc.reason} at {exc.start}",
                                  field="prompt") from None
    check_prompt_num_bytes(num_bytes, max_tokens, limits)


def check_prompt_num_bytes(num_bytes: int, max_tokens: int, limits: RequestLimits) -> None:
    """Refuse a text prompt of `num_bytes` UTF-8 bytes that cannot fit with
    `max_tokens` more (RequestTooLongError naming both and the limit)."""
    per_token = limits.max_bytes_per_token
    if per_token is None:
        return
    room = limits.max_model_len - max_tokens
    least = -(-num_bytes // per_token)
    if least > room:
        raise RequestTooLongError.naming(
            least, limits.max_model_len,
            f"prompt has {num_bytes} bytes, so at least {plural(least, 'token')} (at most {per_token} bytes "
            f"per token), and max_tokens is {max_tokens}; max_model_len is {limits.max_model_len}")
