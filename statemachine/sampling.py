"""User-facing sampling parameters, shared by the actors and the executor.

`SamplingParams` checks every field's type and range where it is built, with
no knowledge of the model: what depends on the loaded model (token ids below
the vocabulary size, `top_k` at most the vocabulary, the operator's stop-string
limits) is checked by `cadence.actors.validation.validate_request` before a
request is queued. `SAMPLING_RANGES` is the one table of the ranges below;
PROTOCOL.md §3.1 prints it for client authors.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
import operator
from collections.abc import Mapping
from typing import Any

import attrs

from .errors import InvalidRequestError
from .request import SamplingLimits

__all__ = [
    "SamplingParams", "StructuredOutput", "STRUCTURED_OUTPUT_KINDS", "MAX_STRUCTURED_OUTPUT_CHARS",
    "MAX_N", "MAX_LOGIT_BIAS",
    "SAMPLING_RANGES", "MAX_LOGPROBS", "MIN_TEMPERATURE",
    "MIN_REPETITION_PENALTY", "MAX_REPETITION_PENALTY", "MAX_PENALTY", "MAX_INT64", "MIN_SEED", "MAX_SEED",
]

# Every integer a request carries fits a signed 64-bit int, so any client
# language and the msgpack link to an executor can hold it.
MAX_INT64 = (1 << 63) - 1
# A seed is any 64-bit value, signed or unsigned: the executor folds it into a
# 64-bit generator seed, and msgpack carries either form.
MIN_SEED = -(1 << 63)
MAX_SEED = (1 << 64) - 1
# Top alternatives a request may ask for per token.
MAX_LOGPROBS = 20
# Below this (and above 0) logits / temperature overflow in half precision;
# 0 asks for greedy decoding, which is what such a temperature would mean.
MIN_TEMPERATURE = 1e-2
# A penalty divides or multiplies logits: outside these bounds the result
# overflows or collapses to one token.
MIN_REPETITION_PENALTY = 1e-2
MAX_REPETITION_PENALTY = 100.0
# presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY].
MAX_PENALTY = 2.0
# Samples of one prompt (`n`), as the HTTP API allows per request.
MAX_N = 128
# A logit_bias value lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS], as OpenAI's does.
MAX_LOGIT_BIAS = 100.0


# What a structured output may constrain the text to: any JSON object, JSON valid
# against a schema, a regular expression, or an EBNF grammar (with a `root` rule).
STRUCTURED_OUTPUT_KINDS = ("json_object", "json_schema", "regex", "grammar")
# Longest schema, expression or grammar a request may carry (characters): far more
# than a real schema needs, and small enough that compiling it stays cheap.
MAX_STRUCTURED_OUTPUT_CHARS = 65536


def _refuse(field: str, limit: str, value: object) -> InvalidRequestError:
    return InvalidRequestError(f"{field} must be {limit}, got {value!r}")


def _as_int(field: str, value: object) -> int:
    """An integer (a bool is not one, nor is a float with an integral value)."""
    if isinstance(value, bool):
        raise _refuse(field, "an int, not a bool", value)
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise _refuse(field, "an int", value) from None


def _as_float(field: str, value: object) -> float:
    """A finite real number (ints are taken as floats; bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _refuse(field, "a number", value)
    try:
        number = float(value)  # type: ignore[arg-type]
    except (OverflowError, TypeError, ValueError):
        raise _refuse(field, "a finite number", value) from None
    if not math.isfinite(number):
        raise _refuse(field, "a finite number", value)
    return number


# field -> (kind, low, high, the range as a reader sees it); "int?" allows None.
# Checked in this order; max_tokens comes first so min_tokens can refer to it.
SAMPLING_RANGES: dict[str, tuple[str, float, float, str]] = {
    "max_tokens": ("int?", 1, MAX_INT64, "in [1, 2^63 - 1], or None (up to max_model_len)"),
    "min_tokens": ("int", 0, MAX_INT64, "in [0, max_tokens]"),
    "temperature": ("float", 0.0, math.inf, f"0 (greedy) or a finite number >= {MIN_TEMPERATURE}"),
    "top_k": ("int", 0, MAX_INT64, "in [0, vocab_size] (0 disables it)"),
    "top_p": ("float", 0.0, 1.0, "in (0, 1]"),
    "min_p": ("float", 0.0, 1.0, "in [0, 1]"),
    "repetition_penalty": ("float", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY,
                           f"in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}]"),
    "presence_penalty": ("float", -MAX_PENALTY, MAX_PENALTY, f"in [-{MAX_PENALTY}, {MAX_PENALTY}]"),
    "frequency_penalty": ("float", -MAX_PENALTY, MAX_PENALTY, f"in [-{MAX_PENALTY}, {MAX_PENALTY}]"),
    "seed": ("int?", MIN_SEED, MAX_SEED, "None or in [-2^63, 2^64 - 1]"),
    "logprobs": ("int?", 0, MAX_LOGPROBS, f"None or in [0, {MAX_LOGPROBS}]"),
    "prompt_logprobs": ("int?", 0, MAX_LOGPROBS, f"None or in [0, {MAX_LOGPROBS}]"),
    "n": ("int", 1, MAX_N, f"in [1, {MAX_N}]"),
    "best_of": ("int?", 1, MAX_N, f"None or in [1, {MAX_N}] (equal to n)"),
    "truncate_prompt_tokens": ("int?", 1, MAX_INT64, "None or >= 1 (keep the prompt's last k tokens)"),
}


_RANGES = tuple((field, kind == "float", kind == "int?", low, high, text)
                for field, (kind, low, high, text) in SAMPLING_RANGES.items())


def _check_number(field: str, is_float: bool, optional: bool, low: float, high: float,
                  text: str, value: Any) -> Any:
    """The value as an int or a float, if it is one in range; else InvalidRequestError."""
    if is_float:
        if type(value) is not float or value != value or value in _INFINITIES:
            value = _as_float(field, value)
    elif type(value) is not int:
        if value is None and optional:
            return None
        value = _as_int(field, value)
    if not low <= value <= high:
        raise _refuse(field, text, value)
    return value


_INFINITIES = (math.inf, -math.inf)


class _Checked(tuple):
    """A list field's value as its converter returns it. `attrs.evolve` runs every
    converter again, and the server evolves a request's parameters once per sample:
    converting a checked value again returns it at once, so a request carrying 10^5
    logit biases is checked entry by entry once, not n + 1 times on the event loop.
    Equal to, and printed as, the plain tuple. Each converter has its own subclass,
    so one field's checked value is checked afresh when given to another field."""

    __slots__ = ()


def _checked(convert):
    """`convert` with a constant-time answer for a value it has already returned."""
    kind = type(f"_Checked{convert.__name__}", (_Checked,), {"__slots__": ()})

    @functools.wraps(convert)
    def wrapper(value: object):
        if type(value) is kind:
            return value
        out = convert(value)
        return out if out is None else kind(out)
    return wrapper


@_checked
def _stop_strings(value: object) -> tuple[str, ...]:
    # A bare string is one stop string, not one per character; None is none (as vLLM's default).
    items = (value,) if isinstance(value, str) else _as_tuple("stop", value)
    for item in items:
        if type(item) is not str or not item:
            raise _refuse("stop", "non-empty strings", item)
    return items


@_checked
def _stop_token_ids(value: object) -> tuple[int, ...]:
    return _token_ids("stop_token_ids", value)


def _as_tuple(field: str, value: object) -> tuple:
    """A list field's items; None (vLLM's default for `stop` and `stop_token_ids`) is none."""
    if value is None:
        return ()
    if isinstance(value, (bytes, dict, numbers.Number)):
        raise _refuse(field, "a list", value)
    try:
        return tuple(value)  # type: ignore[arg-type]
    except TypeError:
        raise _refuse(field, "a list", value) from None


@attrs.frozen
class StructuredOutput:
    """A constraint on the generated text, enforced token by token by a mask on the logits.

    kind: "json_object" (any JSON object; `spec` empty), "json_schema" (`spec` is
    the schema as JSON text), "regex" (`spec` is a regular expression the whole
    output matches) or "grammar" (`spec` is an EBNF grammar whose start rule is
    `root`). Once the text is complete, only end-of-sequence may follow, so the
    request ends with finish_reason "stop". Errors name it by `field`:
    "structured_output" (the SamplingParams and msgpack field) for JSON, else the
    kind; the HTTP API names its own field instead (`response_format`, ...).
    """

    kind: str
    spec: str = ""

    def __attrs_post_init__(self) -> None:
        if self.kind not in STRUCTURED_OUTPUT_KINDS:
            raise _refuse("structured_output.kind", f"one of {', '.join(STRUCTURED_OUTPUT_KINDS)}", self.kind)
        if type(self.spec) is not str:
            raise _refuse(self.field, "a str", self.spec)
        if self.kind == "json_object":
            if self.spec:
                raise _refuse(self.field, "empty for json_object (any JSON object)", self.spec[:80])
        elif not self.spec:
            raise _refuse(self.field, f"a non-empty {self.kind.replace('_', ' ')}", self.spec)
        if len(self.spec) > MAX_STRUCTURED_OUTPUT_CHARS:
            raise InvalidRequestError(f"{self.field} holds {len(self.spec)} characters; the limit is "
                                      f"{MAX_STRUCTURED_OUTPUT_CHARS}")

    @property
    def field(self) -> str:
        """What errors about this constraint name: "structured_output", "regex" or "grammar"."""
        return "structured_output" if self.kind.startswith("json") else self.kind

    @classmethod
    def json_schema(cls, schema: Mapping | str) -> StructuredOutput:
        """JSON valid against `schema` (a dict, or its JSON text), kept in one compact
        spelling so equal schemas share one compiled grammar (the order of keys is
        kept: it is the order of the output's properties)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidRequestError(f"structured_output: the schema is not JSON: {exc}") from None
        if not isinstance(schema, Mapping):
            raise _refuse("structured_output", "a JSON schema object", schema)
        try:
            text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"structured_output: the schema is not JSON: {exc}") from None
        return cls("json_schema", text)


def _structured_output(value: object) -> StructuredOutput | None:
    # A map {"kind": ..., "spec": ...} (the wire form) is taken as the class.
    if value is None or isinstance(value, StructuredOutput):
        return value
    if isinstance(value, Mapping) and set(value) <= {"kind", "spec"} and "kind" in value:
        return StructuredOutput(**value)
    raise _refuse("structured_output", "a StructuredOutput, a {kind, spec} map or None", value)


def _top_k(value: object) -> object:
    # vLLM spells "no top-k" as -1; Cadence as 0.
    return 0 if value == -1 and type(value) is int else value


@_checked
def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (keys may be ASCII digit strings, as JSON carries them) or
    (token id, bias) pairs, kept as sorted pairs."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        fast = _logit_bias_map(value)
        if fast is not None:
            return fast
    return _logit_bias_pairs(value)


def _logit_bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """`_logit_bias` entry by entry: any map or list of pairs, refused naming the
    first bad entry."""
    items = value.items() if isinstance(value, Mapping) else _as_tuple("logit_bias", value)
    pairs = {}
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise _refuse("logit_bias", "a map of token ids to numbers", value)
        token, bias = item
        if isinstance(token, str) and token.isascii() and token.isdigit():
            token = int(token)
        token = _as_int("logit_bias", token)
        if not 0 <= token <= MAX_INT64:
            raise _refuse("logit_bias", "keyed by token ids in [0, vocab_size)", token)
        bias = _as_float("logit_bias", bias)
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise _refuse("logit_bias", f"values in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]", bias)
        pairs[token] = bias
    return tuple(sorted(pairs.items()))


def _logit_bias_map(value: Mapping) -> tuple[tuple[int, float], ...] | None:
    """A logit_bias map of plain int (or ASCII digit string) keys and plain float or
    int biases, all in range, converted by builtins (10^5 entries took 142 ms one by
    one); None for any other map, which `_logit_bias` then checks entry by entry (and
    refuses naming the first bad entry)."""
    keys, biases = list(value), list(value.values())
    if not keys or not set(map(type, biases)) <= {float, int}:
        return None
    # The range first (exact for ints of any size), then NaN, which min and max can pass over.
    if not -MAX_LOGIT_BIAS <= min(biases) <= max(biases) <= MAX_LOGIT_BIAS or not math.isfinite(sum(biases)):
        return None
    kinds = set(map(type, keys))
    if kinds == {str} and "".join(keys).isascii() and all(map(str.isdigit, keys)):
        keys = list(map(int, keys))
    elif kinds != {int}:
        return None
    if not 0 <= min(keys) <= max(keys) <= MAX_INT64:
        return None
    return tuple(sorted(dict(zip(keys, map(float, biases))).items()))


@_checked
def _allowed_token_ids(value: object) -> tuple[int, ...] | None:
    if value is None:
        return None
    tokens = _token_ids("allowed_token_ids", value)
    if not tokens:
        raise _refuse("allowed_token_ids", "None or a non-empty list of token ids", list(tokens))
    return tokens


@_checked
def _bad_words(value: object) -> tuple[str, ...]:
    items = _as_tuple("bad_words", value)
    for item in items:
        if type(item) is not str or not item:
            raise _refuse("bad_words", "non-empty strings", item)
    return items


@_checked
def _bad_words_token_ids(value: object) -> tuple[tuple[int, ...], ...]:
    words = tuple(_token_ids("bad_words_token_ids", word) for word in _as_tuple("bad_words_token_ids", value))
    empty = next((index for index, word in enumerate(words) if not word), None)
    if empty is not None:  # an empty word bans nothing, and the sampler indexes its last id
        raise InvalidRequestError(f"bad_words_token_ids[{empty}] is empty: each banned word must be a "
                                  "non-empty list of token ids")
    return words


def _token_ids(field: str, value: object) -> tuple[int, ...]:
    """A list of token ids, each an int in [0, MAX_INT64]. A list of plain ints (the
    common case, and 10^5 of them in a hostile request) is checked by builtins
    (`map`, `set`, `min`, `max`) rather than entry by entry in Python."""
    items = _as_tuple(field, value)
    if not set(map(type, items)) <= {int}:  # a bool, a numpy integer, anything else
        items = tuple(_as_int(field, item) for item in items)
    if items and not (0 <= min(items) and max(items) <= MAX_INT64):
        bad = next(token for token in items if not 0 <= token <= MAX_INT64)
        raise _refuse(field, "token ids in [0, vocab_size)", bad)
    return items


@attrs.frozen
class SamplingParams:
    """How to pick each next token, and when to stop.

    temperature 0 means greedy. top_k 0 and top_p 1 and min_p 0 disable those
    filters. `seed` makes a request's samples reproducible regardless of what
    else is in the batch. `logprobs` asks for that many top alternatives per
    token (the sampled token's logprob always comes first); `prompt_logprobs`
    asks for the same of every prompt token after the first (such a request
    computes its whole prompt: it reads nothing from the prefix cache). `stop` strings are
    matched on detokenised text by the request actor; a bare string is one stop
    string. `structured_output` constrains the text to JSON, a regular expression
    or a grammar (`StructuredOutput`); it cannot be combined with `ignore_eos`,
    since a complete output can only end. Every field is checked on
    construction (`SAMPLING_RANGES`).
    `max_tokens=None` means up to the engine's max_model_len (the engine fills it
    in per request, with `bounded`).

    vLLM's names too: `n` samples of the prompt (`best_of`, if given, equals n;
    `LLM.generate` and the HTTP API run them as one request group, a single
    engine request takes n=1), `top_k=-1` for no top-k, `logit_bias` ({token id:
    bias} added to the logits), `allowed_token_ids` (only these may be sampled),
    `bad_words` (never generated: the engine tokenises each, with and without a
    leading space, into `bad_words_token_ids`), `skip_special_tokens` (False keeps
    special tokens in the text) and `truncate_prompt_tokens` (only the prompt's
    last k tokens are used).
    """

    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = attrs.field(default=0, converter=_top_k)
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop_strings)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_stop_token_ids)
    include_stop_str_in_output: bool = False
    structured_output: StructuredOutput | None = attrs.field(default=None, converter=_structured_output)
    n: int = 1
    best_of: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_logit_bias)
    allowed_token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_allowed_token_ids)
    bad_words: tuple[str, ...] = attrs.field(default=(), converter=_bad_words)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = attrs.field(default=(), converter=_bad_words_token_ids)
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None

    def __attrs_post_init__(self) -> None:
        for field, is_float, optional, low, high, text in _RANGES:
            value = getattr(self, field)
            # The common case, a number of the right type in range, costs one test;
            # `value - value == 0` is false for inf and nan.
            if type(value) is (float if is_float else int) and low <= value <= high \
                    and value - value == 0:
                continue
            checked = _check_number(field, is_float, optional, low, high, text, value)
            if checked is not value:
                object.__setattr__(self, field, checked)  # ints as int, reals as float
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _refuse("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            raise _refuse("temperature", SAMPLING_RANGES["temperature"][3], self.temperature)
        if self.top_p == 0.0:
            raise _refuse("top_p", SAMPLING_RANGES["top_p"][3], self.top_p)
        if self.best_of is not None and self.best_of != self.n:
            raise _refuse("best_of", f"equal to n ({self.n}) here", self.best_of)
        for field in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if type(getattr(self, field)) is not bool:
                raise _refuse(field, "a bool", getattr(self, field))
        if self.structured_output is not None and self.ignore_eos:
            raise InvalidRequestError(f"ignore_eos cannot be combined with {self.structured_output.field}: "
                                      f"a complete structured output can only end")

    def samples(self) -> list[SamplingParams]:
        """The parameters of each of the n samples (n=1 each, best_of cleared); a
        seeded sample i draws with seed + i, so the samples differ."""
        if self.n == 1:
            return [self if self.best_of is None else attrs.evolve(self, best_of=None)]
        return [attrs.evolve(self, n=1, best_of=None, seed=None if self.seed is None else self.seed + i)
                for i in range(self.n)]

    @property
    def greedy(self) -> bool:
        """Whether the next token is the most likely one (temperature 0)."""
        return self.temperature == 0.0

    def bounded(self, max_tokens: int) -> SamplingParams:
        """These parameters with `max_tokens` filled in where it is None."""
        return self if self.max_tokens is not None else attrs.evolve(self, max_tokens=max_tokens)

    def limits(self, eos_token_ids: frozenset[int] | set[int] = frozenset()) -> SamplingLimits:
        """The stopping limits the scheduling core applies."""
        return SamplingLimits(
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            eos_token_ids=frozenset(eos_token_ids),
            stop_token_ids=frozenset(self.stop_token_ids),
        )
