"""The client protocol: what a client and the socket server say to each other.

Every message travels as one length-prefixed frame (see `framing`) holding the
msgpack array ``[PROTOCOL_VERSION, type_name, payload]``, the same envelope as
the scheduler <-> executor messages, with a payload map built only from
standard msgpack types. PROTOCOL.md describes each message for implementers
in other languages; this module is the reference.

Decoding trusts nothing: `decode_request` (what a server receives) and
`decode_reply` (what a client receives) either return a valid message or raise
`MessageError`, a `ProtocolError` that also carries the stream id when the
message named one, so the server can fail that one stream and keep the
connection. `FrameBuffer` is a sans-IO frame splitter shared by the server and
by the three clients (sync, Trio, asyncio).

Errors a server sends become exceptions on the client side through
`error_from_frame`: each subclasses `ServerError` and, where one fits, the core
error a local engine would have raised (`QueueFullError`, ...), so
``except QueueFullError`` works the same against an embedded engine and a server.
"""

from __future__ import annotations

import enum
import struct
from typing import Any, Callable, ClassVar, Union

import attrs
import msgpack

from cadence.statemachine.errors import (
    CadenceError, EngineClosedError, ExecutorError, InvalidRequestError, ProtocolError,
    QueueFullError, RequestNotFoundError, RequestTooLongError,
)
from cadence.statemachine.sampling import SamplingParams, StructuredOutput

from .fields import (
    check_bool, check_dict, check_finite_float, check_ids, check_int, check_list, check_str,
    check_alternatives, check_strs, kind, optional, wrong,
)
from .framing import HEADER_BYTES, MAX_FRAME_BYTES
from .validation import MAX_CACHE_SALT_CHARS, MAX_TENANT_CHARS, RequestLimits, validate_request

__all__ = [
    "PROTOCOL_VERSION",
    "DEFAULT_PORT",
    "DEFAULT_MAX_REQUEST_FRAME_BYTES",
    "MAX_REPLY_FRAME_BYTES",
    "MAX_TENANT_CHARS",
    "ErrorCode",
    "Hello",
    "Generate",
    "Abort",
    "StatsQuery",
    "HealthQuery",
    "Welcome",
    "Accepted",
    "Output",
    "Error",
    "StatsReply",
    "HealthReply",
    "ClientMessage",
    "ServerMessage",
    "encode",
    "pack_frame",
    "decode_request",
    "decode_reply",
    "text_prompt_span",
    "EMPTY_STR",
    "sampling_to_wire",
    "MessageError",
    "FrameTooLargeError",
    "FrameBuffer",
    "ServerError",
    "LimitExceededError",
    "AuthenticationError",
    "ServerShutdownError",
    "RemoteInvalidRequestError",
    "RemoteRequestTooLongError",
    "RemoteQueueFullError",
    "RemoteRequestNotFoundError",
    "RemoteEngineClosedError",
    "RemoteExecutorError",
    "RemoteProtocolError",
    "ConnectionClosedError",
    "ClientTimeoutError",
    "error_from_frame",
]

PROTOCOL_VERSION = 1
# The msgpack port `cadence serve` listens on and clients dial unless told otherwise.
DEFAULT_PORT = 8470
# A request frame holds one prompt; a megabyte is far more than max_model_len tokens.
DEFAULT_MAX_REQUEST_FRAME_BYTES = 1 << 20
# Replies are bounded by one request's output (or a stats map); the framing limit is plenty.
MAX_REPLY_FRAME_BYTES = MAX_FRAME_BYTES
# Stream ids and query refs fit in a signed 64-bit int in any language.
MAX_ID = (1 << 63) - 1

_HEADER = struct.Struct(">I")
assert _HEADER.size == HEADER_BYTES


class ErrorCode(str, enum.Enum):
    """The `code` of an Error frame. PROTOCOL.md says when each is sent."""

    BAD_FRAME = "bad_frame"
    FRAME_TOO_LARGE = "frame_too_large"
    BAD_MESSAGE = "bad_message"
    UNSUPPORTED_VERSION = "unsupported_version"
    HANDSHAKE_REQUIRED = "handshake_required"
    HANDSHAKE_TIMEOUT = "handshake_timeout"
    UNAUTHORIZED = "unauthorized"
    TOO_MANY_CONNECTIONS = "too_many_connections"
    TOO_MANY_REQUESTS = "too_many_requests"
    TENANT_LIMIT = "tenant_limit"
    TOO_MANY_PROTOCOL_ERRORS = "too_many_protocol_errors"
    IDLE_TIMEOUT = "idle_timeout"
    DUPLICATE_STREAM = "duplicate_stream"
    UNKNOWN_STREAM = "unknown_stream"
    INVALID_REQUEST = "invalid_request"
    REQUEST_TOO_LONG = "request_too_long"
    QUEUE_FULL = "queue_full"
    ENGINE_CLOSED = "engine_closed"
    EXECUTOR_ERROR = "executor_error"
    SHUTDOWN = "shutdown"
    INTERNAL = "internal"


_ERROR_CODES = frozenset(code.value for code in ErrorCode)

# The shared field checks under the names this module's decoders use; a plain
# ProtocolError from them becomes a MessageError in `_decode`.
_kind, _int, _bool, _str = kind, check_int, check_bool, check_str
_float, _list, _dict, _ids, _strs, _optional = (
    check_finite_float, check_list, check_dict, check_ids, check_strs, optional)


def _wrong(path: str, expected: str, value: object) -> MessageError:
    return MessageError(str(wrong(path, expected, value)))


def _fields(payload: object, path: str, required: frozenset[str],
            optional: frozenset[str] = frozenset()) -> dict:
    """Check that `payload` is a map with every required field and nothing unknown."""
    mapping = _dict(payload, path)
    missing = required - mapping.keys()
    if missing:
        raise MessageError(f"{path}: missing field {sorted(missing)[0]!r}")
    extra = mapping.keys() - required - optional
    if extra:
        raise MessageError(f"{path}: unexpected field {sorted(map(repr, extra))[0]}")
    return mapping


def _number_map(value: object, path: str) -> dict[str, int | float | None]:
    mapping = _dict(value, path)
    for key, item in mapping.items():
        if type(item) not in (int, float, type(None)):
            raise _wrong(f"{path}[{key!r}]", "int, float or nil", item)
    return mapping


# ---------------------------------------------------------------------------
# Sampling parameters: any subset of SamplingParams' fields; the rest default.

_SAMPLING_INTS = ("max_tokens", "min_tokens", "top_k", "n")
_SAMPLING_OPTIONAL_INTS = ("seed", "logprobs", "prompt_logprobs", "best_of", "truncate_prompt_tokens")
_SAMPLING_FLOATS = (
    "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
)
_SAMPLING_BOOLS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")
_SAMPLING_FIELDS = frozenset(f.name for f in attrs.fields(SamplingParams))
_DEFAULT_SAMPLING = SamplingParams()


def sampling_to_wire(params: SamplingParams) -> dict[str, Any]:
    """The fields of `params` that differ from the defaults, as a msgpack map."""
    out: dict[str, Any] = {}
    for name in _SAMPLING_FIELDS:
        value = getattr(params, name)
        if value != getattr(_DEFAULT_SAMPLING, name):
            if isinstance(value, tuple):
                value = [list(item) if isinstance(item, tuple) else item for item in value]
            elif isinstance(value, StructuredOutput):
                value = {"kind": value.kind, "spec": value.spec}
            out[name] = value
    return out


def _sampling_values(value: object, path: str) -> dict[str, Any]:
    """Type-check a params map; the ranges are SamplingParams' own (checked later,
    so a bad range is an invalid request rather than a malformed message)."""
    m = _fields(value, path, frozenset(), _SAMPLING_FIELDS)
    fields: dict[str, Any] = {}
    for name, item in m.items():
        where = f"{path}.{name}"
        if name in _SAMPLING_INTS:
            fields[name] = _int(item, where, None)
        elif name in _SAMPLING_OPTIONAL_INTS:
            fields[name] = _optional(_int, item, where, None)
        elif name in _SAMPLING_FLOATS:
            fields[name] = _float(item, where)
        elif name in _SAMPLING_BOOLS:
            fields[name] = _bool(item, where)
        elif name == "stop":
            # A bare str is one stop string, as in the embedded API.
            fields[name] = item if type(item) is str or item is None else _strs(item, where)
        elif name == "stop_token_ids":
            fields[name] = _optional(_int_array, item, where)  # nil is none, as in vLLM
        elif name == "bad_words":
            fields[name] = _strs(item, where)
        elif name == "logit_bias":
            # [[token id, bias], ...] or {token id: bias}; SamplingParams checks the entries.
            fields[name] = item if isinstance(item, dict) else _list(item, where)
        elif name == "allowed_token_ids":
            fields[name] = _optional(_int_array, item, where)
        elif name == "bad_words_token_ids":
            fields[name] = [_int_array(word, f"{where}[{i}]") for i, word in enumerate(_list(item, where))]
        elif name == "structured_output":
            fields[name] = _optional(_structured_output, item, where)
        else:
            fields[name] = _int_array(item, where)
    return fields


def _structured_output(value: object, path: str) -> dict[str, str]:
    """A {kind, spec} map of strs (spec may be left out for json_object); the
    values are SamplingParams' to check."""
    m = _fields(value, path, frozenset({"kind"}), frozenset({"spec"}))
    fields = {"kind": _str(m["kind"], f"{path}.kind", None)}
    if "spec" in m:
        fields["spec"] = _str(m["spec"], f"{path}.spec", None)
    return fields


def _chat_messages(value: object, path: str) -> list:
    """A conversation: an array of maps, each with a str `role`."""
    for index, message in enumerate(_list(value, path)):
        _str(_dict(message, f"{path}[{index}]").get("role"), f"{path}[{index}].role")
    return value  # type: ignore[return-value]


def _int_array(value: object, path: str) -> list[int]:
    """An array of ints of any value: token ids are typed here and ranged against the
    model by `validate_request`, so one out of range is an invalid request."""
    items = _list(value, path)
    if set(map(type, items)) <= {int}:  # checked by builtins: a prompt may hold 10^5 ids
        return items
    index, item = next((i, x) for i, x in enumerate(items) if type(x) is not int)
    raise _wrong(f"{path}[{index}]", "int", item)


# ---------------------------------------------------------------------------
# Client -> server.


@attrs.frozen
class Hello:
    """The first frame a client sends: its shared token (nil without one) and a
    free-form name for the server's log."""

    token: str | None = None
    client: str = ""

    TYPE: ClassVar[str] = "Hello"
    _FIELDS: ClassVar[frozenset] = frozenset({"token", "client"})

    def to_wire(self) -> dict[str, Any]:
        """The msgpack payload map."""
        return {"token": self.token, "client": self.client}

    @classmethod
    def from_wire(cls, payload: object) -> Hello:
        """Validate a payload map and build the message; raises MessageError."""
        m = _fields(payload, "Hello", frozenset(), cls._FIELDS)
        return cls(token=_optional(_str, m.get("token"), "Hello.token", 4096),
                   client=_str(m.get("client", ""), "Hello.client", 256))


@attrs.frozen
class Generate:
    """Start one request on a new stream.

    stream: the client's id for it, unique among the connection's live streams.
    prompt: text, or token ids; or, instead, `messages`: a conversation the
    server renders with its model's chat template. params: sampling parameters
    (any subset of SamplingParams' fields). priority: lower runs first under priority policies.
    tenant: who the request is accounted to (per-tenant limit, fair policy).
    deadline_s, timeout_s: seconds from arrival; see `Engine.generate`.
    """

    stream: int
    prompt: str | list[int] | None
    params: SamplingParams = attrs.field(factory=SamplingParams)
    priority: int = 0
    tenant: str = "default"
    deadline_s: float | None = None
    timeout_s: float | None = None
    cache_salt: str | None = None
    messages: list[dict] | None = None

    TYPE: ClassVar[str] = "Generate"
    _REQUIRED: ClassVar[frozenset] = frozenset({"stream"})
    _OPTIONAL: ClassVar[frozenset] = frozenset(
        {"prompt", "messages", "params", "priority", "tenant", "deadline_s", "timeout_s", "cache_salt"})

    def to_wire(self) -> dict[str, Any]:
        """The msgpack payload map."""
        wire = {
            "stream": self.stream, "prompt": self.prompt, "params": sampling_to_wire(self.params),
            "priority": self.priority, "tenant": self.tenant, "deadline_s": self.deadline_s,
            "timeout_s": self.timeout_s, "cache_salt": self.cache_salt,
        }
        if self.messages is not None:
            wire["messages"] = self.messages
        return wire

    @classmethod
    def from_wire(cls, payload: object) -> Generate:
        """Validate a payload map and build the message; raises MessageError
        (with `.stream` set once the stream id is known)."""
        # The stream id is read first, so that any later defect (a missing,
        # unknown or mistyped field) is answered on that stream.
        mapping = _dict(payload, "Generate")
        if "stream" not in mapping:
            raise MessageError("Generate: missing field 'stream'")
        stream = _int(mapping["stream"], "Generate.stream", 0, MAX_ID)
        try:
            m = _fields(mapping, "Generate", cls._REQUIRED, cls._OPTIONAL)
            prompt, messages = m.get("prompt"), m.get("messages")
            if (prompt is None) == (messages is None):
                raise MessageError("Generate needs exactly one of prompt and messages")
            if messages is not None:
                _chat_messages(messages, "Generate.messages")
            elif type(prompt) is not str:
                if type(prompt) is not list:
                    raise _wrong("Generate.prompt", "str or array of int", prompt)
                _int_array(prompt, "Generate.prompt")
            fields = _sampling_values(m.get("params", {}), "Generate.params")
            try:
                params = SamplingParams(**fields)
            except (InvalidRequestError, TypeError, ValueError) as exc:
                raise MessageError(f"Generate.params: {exc}", code=ErrorCode.INVALID_REQUEST) from None
            return cls(
                stream=stream, prompt=prompt, params=params,
                priority=_int(m.get("priority", 0), "Generate.priority", -MAX_ID - 1, MAX_ID),
                tenant=_str(m.get("tenant", "default"), "Generate.tenant", MAX_TENANT_CHARS),
                deadline_s=_optional(_float, m.get("deadline_s"), "Generate.deadline_s"),
                timeout_s=_optional(_float, m.get("timeout_s"), "Generate.timeout_s"),
                cache_salt=_optional(_str, m.get("cache_salt"), "Generate.cache_salt",
                                     MAX_CACHE_SALT_CHARS),
                messages=messages,
            )
        except ProtocolError as exc:
            error = exc if isinstance(exc, MessageError) else MessageError(str(exc))
            error.stream = stream
            raise error from None

    def refusal(self, limits: RequestLimits) -> Error | None:
        """The Error that refuses this request for a model with `limits` (see
        `validate_request`), or None when it may be queued."""
        try:
            validate_request(self.prompt, self.params, limits, priority=self.priority,
                             tenant=self.tenant, deadline_s=self.deadline_s,
                             timeout_s=self.timeout_s, cache_salt=self.cache_salt)
        except InvalidRequestError as exc:
            code = (ErrorCode.REQUEST_TOO_LONG if isinstance(exc, RequestTooLongError)
                    else ErrorCode.INVALID_REQUEST)
            return Error(code.value, str(exc), stream=self.stream)
        return None


@attrs.frozen
class Abort:
    """Abort a live stream; it ends with an Output whose finish_reason is "abort"."""

    stream: int

    TYPE: ClassVar[str] = "Abort"

    def to_wire(self) -> dict[str, Any]:
        """The msgpack payload map."""
        return {"stream": self.stream}

    @classmethod
    def from_wire(cls, payload: object) -> Abort:
        """Validate a payload map and build the message; raises MessageError."""
        m = _fields(payload, "Abort", frozenset({"stream"}))
        return cls(stream=_int(m["stream"], "Abort.stream", 0, MAX_ID))


@attrs.frozen
class StatsQuery:
    """Ask for the engine's counters; answered by a StatsReply with the same ref."""

    ref: int

    TYPE: ClassVar[str] = "Stats"

    def to_wire(self) -> dict[str, Any]:
        """The msgpack payload map."""
        return {"ref": self.ref}

    @classmethod
    def from_wire(cls, payload: object) -> StatsQuery:
        """Validate a payload map and build the message; raises MessageError."""
        m = _fields(payload, "Stats", frozenset({"ref"}))
        return cls(ref=_int(m["ref"], "Stats.ref", 0, MAX_ID))


@attrs.frozen
class HealthQuery:
    """Ask whether the server takes requests; answered by a HealthReply with the same ref."""

    ref: int

    TYPE: ClassVar[str] = "Health"

    def to_wire(self) -> dict[str, Any]:
        """The msgpack payload map."""
        return {"ref": self.ref}

    @classmethod
    def from_wire(cls, payload: object) -> HealthQuery:
        """Validate a payload map and build the message; raises MessageError."""
        m = _fields(payload, "Health", frozenset({"ref"}))
        return cls(ref=_int(m["ref"], "Health.ref", 0, MAX_ID))


# ---------------------------------------------------------------------------
# Server -> client.


@attrs.frozen
class Welcome:
    """The server's answer to a good Hello: what it serves and the limits it applies.

    limits: limit name -> value (nil when that limit is off), as in ServerConfig.
    """

    server: str
    model: str
    vocab_size: int
    max_model_len: int
    block_size: int
    eos_token_ids: list[int]
    has_tokenizer: bool
    limits: dict[str, int | float | None]

    TYPE: ClassVar[str] = "Welcome"
    _FIELDS: ClassVar[frozenset] = frozenset(
        {"server", "model", "vocab_size", "max_model_len", "block_size", "eos_token_ids",
         "has_tokenizer", "limits"})

    def to_wire(self) -> dict[str, Any]:
        """The msgpack payload map."""
        return {
            "server": self.server, "model": self.model, "vocab_size": self.vocab_size,
            "max_model_len": self.max_model_len, "block_size": self.block_size,
            "eos_token_ids": self.eos_token_ids, "has_tokenizer": self.has_tokenizer,
            "limits": self.limits,
        }

    @classmethod
    def from_wire(cls, payload: object) -> Welcome:
        """Validate a payload map and build the message; raises MessageError."""
        m = _fields(payload, "Welcome", cls._FIELDS)
        return cls(
            server=_str(m["server"], "Welcome.server"),
            model=_str(m["model"], "Welcome.model"),
            vocab_size=_int(m["vocab_size"], "Welcome.vocab_size", 1),
            max_model_len=_int(m["max_model_len"], "Welcome.max_model_len", 1),
            block_size=_int(m["block_size"], "Welcome.block_size", 1),
            eos_token_ids=_ids(m["eos_token_ids"], "Welcome.eos_token_ids"),
            has_tokenizer=_bool(m["has_tokenizer"], "Welcome.has_tokenizer"),
            limits=_number_map(m["limits"], "Welcome.limits"),
        )


@attrs.frozen
class Accepted:
    """The engine queued the stream's request (sent before its first Output)."""

    stream: int
    request_id: str
    num_prompt_tokens: int

    TYPE: ClassVar[str] = "Accepted"
    _FIELDS: ClassVar[frozenset] = frozenset({"stream", "request_id", "num_prompt_tokens"})

    def to_wire(self) -> dict[str, Any]:
        """The msgpack payload map."""
        return {"stream": self.stream, "request_id": self.request_id,
                "num_prompt_tokens": self.num_prompt_tokens}

    @classmethod
    def from_wire(cls, payload: object) -> Accepted:
        """Validate a payload map and build the message; raises MessageError."""
        m = _fields(payload, "Accepted", cls._FIELDS)
        return cls(stream=_int(m["stream"], "Accepted.stream", 0, MAX_ID),
                   request_id=_str(m["request_id"], "Accepted.request_id"),
                   num_prompt_tokens=_int(m["num_prompt_tokens"], "Accepted.num_prompt_tokens"))


@attrs.frozen
class Output:
    """One delta of a stream: the tokens (and text) since the previous one.

    finish_reason is nil until the stream's last Output, then "stop", "length"
    or "abort"; detail says more ("stop string", "timeout", ...). logprobs (sent
    only when the request asked for them) holds, per token, [token id, logprob]
    pairs, the sampled token first; nil for a token the engine had none for.
    prompt_logprobs (only on the first Output of a request that asked for them)
    holds the same per prompt token, that prompt token first; nil for the first.
    """

    stream: int
    token_ids: list[int]
    text: str | None
    num_tokens: int
    finish_reason: str | None = None
    detail: str = ""
    num_cached_tokens: int = 0
    logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_logprobs: list[list[tuple[int, float]] | None] | None = None

    TYPE: ClassVar[str] = "Output"
    _FIELDS: ClassVar[frozenset] = frozenset(
        {"stream", "token_ids", "text", "num_tokens", "finish_reason", "detail", "num_cached_tokens"})
    _OPTIONAL: ClassVar[frozenset] = frozenset({"logprobs", "prompt_logprobs"})

    @property
    def finished(self) -> bool:
        """Whether this is the stream's last Output."""
        return self.finish_reason is not None

    def to_wire(self) -> dict[str, Any]:
        """The msgpack payload map."""
        payload = {
            "stream": self.stream, "token_ids": self.token_ids, "text": self.text,
            "num_tokens": self.num_tokens, "finish_reason": self.finish_reason,
            "detail": self.detail, "num_cached_tokens": self.num_cached_tokens,
        }
        if self.logprobs is not None:
            payload["logprobs"] = self.logprobs
        if self.prompt_logprobs is not None:
            payload["prompt_logprobs"] = self.prompt_logprobs
        return payload

    @classmethod
    def from_wire(cls, payload: object) -> Output:
        """Validate a payload map and build the message; raises MessageError."""
        m = _fields(payload, "Output", cls._FIELDS, cls._OPTIONAL)
        token_ids = _ids(m["token_ids"], "Output.token_ids")
        logprobs = _optional_entries(m.get("logprobs"), "Output.logprobs")
        if logprobs is not None and len(logprobs) != len(token_ids):
            raise MessageError(f"Output.logprobs: {len(logprobs)} entries for {len(token_ids)} tokens")
        return cls(
            stream=_int(m["stream"], "Output.stream", 0, MAX_ID),
            token_ids=token_ids,
            text=_optional(_str, m["text"], "Output.text"),
            num_tokens=_int(m["num_tokens"], "Output.num_tokens"),
            finish_reason=_optional(_str, m["finish_reason"], "Output.finish_reason"),
            detail=_str(m["detail"], "Output.detail"),
            num_cached_tokens=_int(m["num_cached_tokens"], "Output.num_cached_tokens"),
            logprobs=logprobs,
            prompt_logprobs=_optional_entries(m.get("prompt_logprobs"), "Output.prompt_logprobs"),
        )


def _optional_entries(value: object, path: str) -> list[list[tuple[int, float]] | None] | None:
    """Per-token log-probabilities (nil entries allowed), or None when absent."""
    if value is None:
        return None
    return [None if entry is None else check_alternatives(entry, f"{path}[{i}]")
            for i, entry in enumerate(_list(value, path))]


@attrs.frozen
class Error:
    """Something went wrong. With `stream` set, that stream has ended; with
    `fatal` set, the server closes the connection right after this frame.
    `limit` names the configured limit that was hit, if one was. `poison` is
    set when the engine found the request itself to be what makes its executor
    fail: sending it again (to any server) fails the same way."""

    code: str
    message: str
    stream: int | None = None
    limit: str | None = None
    fatal: bool = False
    poison: bool = False

    TYPE: ClassVar[str] = "Error"
    _FIELDS: ClassVar[frozenset] = frozenset({"code", "message", "stream", "limit", "fatal"})
    _OPTIONAL: ClassVar[frozenset] = frozenset({"poison"})

    def to_wire(self) -> dict[str, Any]:
        """The msgpack payload map (`poison` only when set)."""
        out = {"code": self.code, "message": self.message, "stream": self.stream,
               "limit": self.limit, "fatal": self.fatal}
        if self.poison:
            out["poison"] = True
        return out

    @classmethod
    def from_wire(cls, payload: object) -> Error:
        """Validate a payload map and build the message; raises MessageError."""
        m = _fields(payload, "Error", cls._FIELDS, cls._OPTIONAL)
        return cls(
            code=_str(m["code"], "Error.code"),
            message=_str(m["message"], "Error.message"),
            stream=_optional(_int, m["stream"], "Error.stream", 0, MAX_ID),
            limit=_optional(_str, m["limit"], "Error.limit"),
            fatal=_bool(m["fatal"], "Error.fatal"),
            poison=_bool(m.get("poison", False), "Error.poison"),
        )


@attrs.frozen
class StatsReply:
    """The engine's counters (StatsSummary's fields) plus the server's own."""

    ref: int
    stats: dict[str, Any]

    TYPE: ClassVar[str] = "StatsReply"

    def to_wire(self) -> dict[str, Any]:
        """The msgpack payload map."""
        return {"ref": self.ref, "stats": self.stats}

    @classmethod
    def from_wire(cls, payload: object) -> StatsReply:
        """Validate a payload map and build the message; raises MessageError."""
        m = _fields(payload, "StatsReply", frozenset({"ref", "stats"}))
        return cls(ref=_int(m["ref"], "StatsReply.ref", 0, MAX_ID),
                   stats=_dict(m["stats"], "StatsReply.stats"))


@attrs.frozen
class HealthReply:
    """Whether the server takes requests ("ok"), is draining ("draining"), or its
    engine has failed ("closed"), with a few gauges."""

    ref: int
    status: str
    num_running: int
    num_waiting: int
    kv_usage: float
    num_connections: int

    TYPE: ClassVar[str] = "HealthReply"
    _FIELDS: ClassVar[frozenset] = frozenset(
        {"ref", "status", "num_running", "num_waiting", "kv_usage", "num_connections"})

    def to_wire(self) -> dict[str, Any]:
        """The msgpack payload map."""
        return {"ref": self.ref, "status": self.status, "num_running": self.num_running,
                "num_waiting": self.num_waiting, "kv_usage": self.kv_usage,
                "num_connections": self.num_connections}

    @classmethod
    def from_wire(cls, payload: object) -> HealthReply:
        """Validate a payload map and build the message; raises MessageError."""
        m = _fields(payload, "HealthReply", cls._FIELDS)
        return cls(
            ref=_int(m["ref"], "HealthReply.ref", 0, MAX_ID),
            status=_str(m["status"], "HealthReply.status"),
            num_running=_int(m["num_running"], "HealthReply.num_running"),
            num_waiting=_int(m["num_waiting"], "HealthReply.num_waiting"),
            kv_usage=_float(m["kv_usage"], "HealthReply.kv_usage"),
            num_connections=_int(m["num_connections"], "HealthReply.num_connections"),
        )


ClientMessage = Union[Hello, Generate, Abort, StatsQuery, HealthQuery]
ServerMessage = Union[Welcome, Accepted, Output, Error, StatsReply, HealthReply]

_REQUEST_TYPES: dict[str, Callable[[object], ClientMessage]] = {
    cls.TYPE: cls.from_wire for cls in (Hello, Generate, Abort, StatsQuery, HealthQuery)
}
_REPLY_TYPES: dict[str, Callable[[object], ServerMessage]] = {
    cls.TYPE: cls.from_wire for cls in (Welcome, Accepted, Output, Error, StatsReply, HealthReply)
}


# ---------------------------------------------------------------------------
# Bytes.


class MessageError(ProtocolError):
    """A frame that is not a valid message. `stream` is the stream it named, if
    that much could be read; `code` is the Error code the server answers with."""

    def __init__(self, message: str, *, stream: int | None = None,
                 code: ErrorCode = ErrorCode.BAD_MESSAGE) -> None:
        super().__init__(message)
        self.stream = stream
        self.code = code


class FrameTooLargeError(ProtocolError):
    """A frame header declares more bytes than the receiver's limit."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame declares {size} bytes, over the limit of {limit}")
        self.size = size
        self.limit = limit


def _reject_ext(code: int, data: bytes) -> object:
    raise MessageError(f"msgpack ext type {code} is not allowed")


def encode(message: ClientMessage | ServerMessage) -> bytes:
    """The msgpack envelope of a message (the frame body, without its length)."""
    return msgpack.packb([PROTOCOL_VERSION, message.TYPE, message.to_wire()], use_bin_type=True)


def pack_frame(body: bytes) -> bytes:
    """One whole frame: the 4-byte big-endian length, then `body`."""
    return _HEADER.pack(len(body)) + body


def _decode(data: bytes, table: dict[str, Callable[[object], Any]], side: str) -> Any:
    try:
        envelope = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True,
                                   ext_hook=_reject_ext)
    except MessageError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise MessageError(f"not a valid msgpack message: {type(exc).__name__}: {exc}"[:300]) from None
    if type(envelope) is not list or len(envelope) != 3:
        length = f" of length {len(envelope)}" if type(envelope) is list else ""
        raise MessageError(
            f"envelope: expected [version, type, payload] array, got {_kind(envelope)}{length}")
    version, name, payload = envelope
    if type(version) is not int:
        raise _wrong("envelope.version", "int", version)
    if version != PROTOCOL_VERSION:
        raise MessageError(f"envelope: unsupported protocol version {version} (this side speaks "
                           f"{PROTOCOL_VERSION})", code=ErrorCode.UNSUPPORTED_VERSION)
    if type(name) is not str:
        raise _wrong("envelope.type", "str", name)
    from_wire = table.get(name)
    if from_wire is None:
        raise MessageError(f"envelope: {name[:64]!r} is not a {side} message type")
    try:
        return from_wire(payload)
    except MessageError:
        raise
    except ProtocolError as exc:
        raise MessageError(str(exc)) from None


def decode_request(data: bytes) -> ClientMessage:
    """Parse a frame a client sent; any defect raises MessageError naming the field."""
    return _decode(data, _REQUEST_TYPES, "client")


def decode_reply(data: bytes) -> ServerMessage:
    """Parse a frame a server sent; any defect raises MessageError naming the field."""
    return _decode(data, _REPLY_TYPES, "server")


# msgpack str headers: fixstr (length in the low 5 bits), then str8/16/32 with a
# 1-, 2- or 4-byte big-endian length after the type byte.
_FIXSTR_FIRST, _FIXSTR_LAST, _FIXSTR_LENGTH_MASK = 0xA0, 0xBF, 0x1F
_STR_LENGTH_BYTES = {0xD9: 1, 0xDA: 2, 0xDB: 4}
# The empty str: what an elided text prompt leaves in its frame.
EMPTY_STR = b"\xa0"


def text_prompt_span(prefix: bytes | bytearray) -> tuple[int, int, int] | None:
    """Where the text prompt of a Generate frame lies, read from the first bytes of
    its body without decoding the text: (offset of the prompt's str header, offset
    of its text, the text's length in bytes). None when the prefix shows none: another
    message, a prompt of token ids, a malformed frame, or fields before the prompt
    that run past the prefix."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, ext_hook=_reject_ext,
                                max_buffer_size=max(1, len(prefix)))
    unpacker.feed(prefix)
    try:
        if unpacker.read_array_header() != 3 or unpacker.unpack() != PROTOCOL_VERSION \
                or unpacker.unpack() != Generate.TYPE:
            return None
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key == "prompt":
                return _str_span(prefix, unpacker.tell())
            unpacker.skip()
    except Exception:  # msgpack raises several unrelated types for cut or bad input
        return None
    return None


def _str_span(data: bytes | bytearray, start: int) -> tuple[int, int, int] | None:
    """The msgpack str at `start`: (start, offset of its bytes, their count), or None."""
    if start >= len(data):
        return None
    kind = data[start]
    if _FIXSTR_FIRST <= kind <= _FIXSTR_LAST:
        return start, start + 1, kind & _FIXSTR_LENGTH_MASK
    width = _STR_LENGTH_BYTES.get(kind)
    if width is None or start + 1 + width > len(data):
        return None
    return start, start + 1 + width, int.from_bytes(data[start + 1:start + 1 + width], "big")


class FrameBuffer:
    """Split a byte stream into frames, sans-IO: `feed` what arrives, then take
    frames with `next_frame` until it returns None.

    The declared length is checked as soon as the 4 header bytes are in, so
    the buffer never holds more than one frame's limit plus one read.
    """

    __slots__ = ("max_frame_bytes", "_buffer")

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()

    def feed(self, data: bytes | bytearray) -> None:
        """Append received bytes."""
        self._buffer += data

    @property
    def num_pending_bytes(self) -> int:
        """Bytes of an incomplete frame held back (non-zero at end of stream means truncation)."""
        return len(self._buffer)

    def next_frame(self) -> bytes | None:
        """The next whole frame's body, or None until more bytes arrive; raises
        FrameTooLargeError when a header declares more than the limit."""
        buffer = self._buffer
        if len(buffer) < HEADER_BYTES:
            return None
        (size,) = _HEADER.unpack_from(buffer)
        if size > self.max_frame_bytes:
            raise FrameTooLargeError(size, self.max_frame_bytes)
        end = HEADER_BYTES + size
        if len(buffer) < end:
            return None
        body = bytes(buffer[HEADER_BYTES:end])
        del buffer[:end]  # bytearray drops a prefix without copying the rest
        return body

    def declared_size(self) -> int | None:
        """The body size the next frame's header declares (None until its 4 bytes are in)."""
        if len(self._buffer) < HEADER_BYTES:
            return None
        return _HEADER.unpack_from(self._buffer)[0]

    def body_prefix(self, max_bytes: int) -> bytes:
        """Up to `max_bytes` of the next frame's body as received so far."""
        return bytes(self._buffer[HEADER_BYTES:HEADER_BYTES + max_bytes])

    def elide(self, start: int, end: int, replacement: bytes) -> int:
        """Replace bytes [start, end) of the next frame's body with `replacement` and
        correct its header: what of the range is buffered is dropped now. Returns how
        many bytes of the range are still to arrive; the caller discards them before
        feeding anything more."""
        buffer = self._buffer
        (size,) = _HEADER.unpack_from(buffer)
        received = len(buffer) - HEADER_BYTES
        buffer[HEADER_BYTES + start:HEADER_BYTES + min(end, received)] = replacement
        _HEADER.pack_into(buffer, 0, size - (end - start) + len(replacement))
        return max(0, end - received)


# ---------------------------------------------------------------------------
# Errors as the client raises them.


class ServerError(CadenceError):
    """An Error frame from the server, as an exception.

    code: the ErrorCode value; limit: the configured limit that was hit (or
    None); stream: the stream it ended (or None); fatal: the server closed the
    connection after sending it; poison: the request itself makes the
    executor fail, so it must not be retried.
    """

    def __init__(self, message: str, code: str = ErrorCode.INTERNAL.value, *,
                 limit: str | None = None, stream: int | None = None, fatal: bool = False,
                 poison: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.limit = limit
        self.stream = stream
        self.fatal = fatal
        self.poison = poison

    def __str__(self) -> str:
        text = self.args[0] if self.args else ""
        limit = f", limit {self.limit}" if self.limit else ""
        return f"{text} [{self.code}{limit}]"


class LimitExceededError(ServerError):
    """A configured server limit was hit; `limit` names it."""


class AuthenticationError(ServerError):
    """The server wants a shared token and the one given was missing or wrong."""


class ServerShutdownError(ServerError, EngineClosedError):
    """The server is shutting down: the request was refused or cut short."""


class RemoteInvalidRequestError(ServerError, InvalidRequestError):
    """The server's engine refused a request field."""


class RemoteRequestTooLongError(ServerError, RequestTooLongError):
    """The prompt plus max_tokens does not fit the server's engine."""


class RemoteQueueFullError(ServerError, QueueFullError):
    """The server's waiting queue is full."""


class RemoteRequestNotFoundError(ServerError, RequestNotFoundError):
    """The stream named is not live on this connection."""

    def __str__(self) -> str:
        return ServerError.__str__(self)


class RemoteEngineClosedError(ServerError, EngineClosedError):
    """The server's engine has failed or closed."""


class RemoteExecutorError(ServerError, ExecutorError):
    """The server's executor failed while running the request."""


class RemoteProtocolError(ServerError, ProtocolError):
    """The server could not make sense of what this client sent."""


class ConnectionClosedError(CadenceError, ConnectionError):
    """The connection to the server is gone; the client does not reconnect by itself."""


class ClientTimeoutError(CadenceError, TimeoutError):
    """No answer from the server within the client's timeout."""


_LIMIT_CODES = {
    ErrorCode.FRAME_TOO_LARGE, ErrorCode.TOO_MANY_CONNECTIONS, ErrorCode.TOO_MANY_REQUESTS,
    ErrorCode.TENANT_LIMIT, ErrorCode.TOO_MANY_PROTOCOL_ERRORS, ErrorCode.IDLE_TIMEOUT,
    ErrorCode.HANDSHAKE_TIMEOUT,
}
_ERROR_CLASSES: dict[str, type[ServerError]] = {
    **{code.value: LimitExceededError for code in _LIMIT_CODES},
    ErrorCode.UNAUTHORIZED.value: AuthenticationError,
    ErrorCode.SHUTDOWN.value: ServerShutdownError,
    ErrorCode.INVALID_REQUEST.value: RemoteInvalidRequestError,
    ErrorCode.DUPLICATE_STREAM.value: RemoteInvalidRequestError,
    ErrorCode.REQUEST_TOO_LONG.value: RemoteRequestTooLongError,
    ErrorCode.QUEUE_FULL.value: RemoteQueueFullError,
    ErrorCode.UNKNOWN_STREAM.value: RemoteRequestNotFoundError,
    ErrorCode.ENGINE_CLOSED.value: RemoteEngineClosedError,
    ErrorCode.EXECUTOR_ERROR.value: RemoteExecutorError,
    ErrorCode.BAD_FRAME.value: RemoteProtocolError,
    ErrorCode.BAD_MESSAGE.value: RemoteProtocolError,
    ErrorCode.UNSUPPORTED_VERSION.value: RemoteProtocolError,
    ErrorCode.HANDSHAKE_REQUIRED.value: RemoteProtocolError,
}


def error_from_frame(frame: Error) -> ServerError:
    """The exception a client raises for an Error frame (unknown codes give ServerError)."""
    cls = _ERROR_CLASSES.get(frame.code, ServerError)
    return cls(frame.message, frame.code, limit=frame.limit, stream=frame.stream, fatal=frame.fatal,
               poison=frame.poison)
