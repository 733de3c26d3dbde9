"""OpenAI request and response bodies: JSON in, engine requests out, and back.

`parse_request` checks a completions or chat body field by field (a bad one
is a 400 naming it) and turns it into an `ApiRequest`: the prompts (a chat's
messages rendered with the model's chat template), one `SamplingParams`, and
Cadence's own extensions (`priority`, `tenant`, `deadline_s`). `Choice`
accumulates one engine stream and renders its deltas and its whole answer
in OpenAI's shapes (text or message, `logprobs`, `finish_reason`, `usage`).
The transport lives in http.py.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from typing import Any, Callable

import attrs

from cadence.statemachine.errors import InvalidRequestError, ProtocolError
from cadence.statemachine.sampling import SamplingParams, StructuredOutput

from ..chat import check_messages, encode_text, text_size
from ..validation import check_token_ids
from ..engine import Engine, RequestStream
from ..fields import (
    check_bool, check_dict, check_finite_float, check_ids, check_int, check_str, check_strs, kind,
)
from ..validation import MAX_CACHE_SALT_CHARS
from ..wire import MAX_ID, MAX_TENANT_CHARS, ErrorCode
from .server import _StreamState
from .tools import ToolCallStream, ToolChoice, parse_tool_choice

__all__ = ["ApiError", "ApiRequest", "Choice", "parse_request", "status_of",
           "usage_of", "ChunkEncoder", "completion_body", "tokenize", "detokenize"]

# OpenAI's default when a completion names no max_tokens.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Most choices one request may ask for (n times the number of prompts).
MAX_CHOICES = 128
# JSON has no -inf: a token the sampler could never pick reports this logprob.
MIN_LOGPROB = -9999.0
_NULL = b"null"
# An ignored field's name is logged up to this many characters.
MAX_LOGGED_NAME_CHARS = 64
_log = logging.getLogger("cadence.http")
# The most alternatives per token SamplingParams allows.
MAX_TOP_LOGPROBS = 20

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "invalid_request_error",
                405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                500: "server_error", 503: "service_unavailable"}
# The error type of a request failed as a poison (see ApiError).
POISON_ERROR_TYPE = "poison_request_error"
# Its status: the request is at fault, and a 4xx is not retried by clients.
POISON_STATUS = 400
_STATUS_OF_CODE = {
    ErrorCode.INVALID_REQUEST: 400, ErrorCode.REQUEST_TOO_LONG: 400, ErrorCode.QUEUE_FULL: 429,
    ErrorCode.TENANT_LIMIT: 429, ErrorCode.TOO_MANY_REQUESTS: 429, ErrorCode.SHUTDOWN: 503,
    ErrorCode.ENGINE_CLOSED: 503, ErrorCode.EXECUTOR_ERROR: 500, ErrorCode.INTERNAL: 500,
}

# vLLM's spellings of a structured output: each maps onto one StructuredOutput.
_VLLM_STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                    "structured_outputs")
_STRUCTURED_FIELDS = ("response_format", "regex", "grammar", *_VLLM_STRUCTURED)


_SAMPLING_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty")
# vLLM's sampling fields passed to SamplingParams as they are (it checks them).
_VLLM_SAMPLING = ("logit_bias", "allowed_token_ids", "bad_words", "skip_special_tokens",
                  "truncate_prompt_tokens")
_COMMON_FIELDS = frozenset({
    "model", "stream", "stream_options", "max_tokens", "n", "stop", "seed", "logprobs", "user",
    "top_k", "priority", "tenant", "deadline_s", "min_tokens", "ignore_eos", "stop_token_ids",
    "include_stop_str_in_output", "best_of", "return_token_ids", "cache_salt", *_STRUCTURED_FIELDS,
    *_SAMPLING_FLOATS, *_VLLM_SAMPLING})
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo"}
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs",
                                 "add_generation_prompt", "chat_template_kwargs", "tools", "tool_choice",
                                 "parallel_tool_calls"}
# OpenAI fields Cadence does not implement and whose loss would change the answer:
# refused (a 400 naming them) even where unknown fields are ignored.
_UNSUPPORTED = frozenset({"suffix", "functions", "function_call", "modalities", "audio",
                          "prediction"})


class ApiError(Exception):
    """A request answered with an error status, in OpenAI's error shape.

    poison: the engine found the request itself to be what makes its executor
    fail (the msgpack Error's `poison` flag): the body says so with its own
    `type` and `"poison": true`, and the status is a 4xx so that clients (the
    OpenAI SDKs retry 5xx answers) do not send it again.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, poison: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.poison = poison

    def body(self) -> dict:
        """The JSON error object."""
        error = {"message": self.message,
                 "type": POISON_ERROR_TYPE if self.poison else _ERROR_TYPES.get(self.status, "error"),
                 "param": self.param, "code": self.code}
        if self.poison:
            error["poison"] = True
        return {"error": error}


def status_of(code: ErrorCode) -> int:
    """The HTTP status of an engine refusal, by the msgpack server's error code."""
    return _STATUS_OF_CODE.get(code, 500)


@attrs.frozen
class ApiRequest:
    """A checked completions or chat request."""

    chat: bool
    response_id: str
    created: int
    model: str
    prompts: list  # each a str or a list of token ids
    params: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    # Top alternatives to report per token (0: the sampled token only); None: no logprobs.
    logprobs: int | None = None
    priority: int = 0
    tenant: str = "default"
    deadline_s: float | None = None
    # Cadence's extension: each choice (and chunk) carries its token ids too.
    return_token_ids: bool = False
    # Requests share cached prompt blocks only with requests of the same salt (and tenant).
    cache_salt: str | None = None
    # A chat's tools and tool_choice (None: no tool calls are read from the answer).
    tools: ToolChoice | None = None
    # The field that holds the structured output, named in its errors (None: none).
    structured_field: str | None = None

    def samples(self) -> list[SamplingParams]:
        """The parameters of each of the n choices of a prompt: seeded choices differ."""
        return attrs.evolve(self.params, n=self.n).samples()


def _field(body: dict, name: str, check: Callable, *args) -> Any:
    """A field's value through a fields.py check; None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    try:
        return check(value, name, *args)
    except ProtocolError as exc:
        raise ApiError(400, str(exc), param=name) from None


async def parse_request(body: object, chat: bool, http) -> ApiRequest:
    """Check a request body and build the ApiRequest; raises ApiError (400 naming the
    field, 404 for an unknown model). A large conversation is rendered in a worker
    thread (`Front.run_sized`)."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, got {kind(body)}")
    _check_names(body, _CHAT_FIELDS if chat else _COMPLETION_FIELDS, http)
    _check_model(body, http)
    engine: Engine = http.engine
    tools = _tool_choice(body, http) if chat else None
    if chat:
        prompts = [await _chat_prompt(body, http, tools)]
    else:
        prompts = _completion_prompts(body.get("prompt"))
    n = _field(body, "n", check_int, 1, MAX_CHOICES) or 1
    best_of = _field(body, "best_of", check_int, 1)
    if best_of is not None and best_of != n:
        raise ApiError(400, f"best_of must equal n ({n}) here, got {best_of}", param="best_of")
    if n * len(prompts) > MAX_CHOICES:
        raise ApiError(400, f"n times the number of prompts is {n * len(prompts)}, the limit is "
                            f"{MAX_CHOICES}", param="n")
    stream = bool(_field(body, "stream", check_bool))
    options = _field(body, "stream_options", check_dict) or {}
    include_usage = options.get("include_usage", False)
    if type(include_usage) is not bool:
        raise ApiError(400, "stream_options.include_usage: expected bool", param="stream_options")
    logprobs = _logprobs(body, chat)
    echo = bool(_field(body, "echo", check_bool))
    # Built entry by entry: a worker thread takes a large one (`run_sized`), so that a
    # request carrying 10^5 logit biases cannot stall every other stream meanwhile.
    params = await http.server.run_sized(_sampling_size(body), _sampling_params, body, chat, prompts,
                                         logprobs, engine)
    if tools is not None and tools.forced:
        if params.structured_output is not None:
            raise ApiError(400, f"tool_choice {tools.choice!r} constrains the answer to a tool call; "
                                "it cannot be combined with another structured output",
                           param="tool_choice")
        params = attrs.evolve(params, structured_output=tools.structured_output())
    if echo and logprobs is not None:
        # The echoed prompt's tokens carry their logprobs too, as OpenAI's do.
        params = attrs.evolve(params, prompt_logprobs=logprobs)
    tenant = _field(body, "tenant", check_str, MAX_TENANT_CHARS)
    _field(body, "user", check_str)
    return ApiRequest(
        chat=chat, response_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        created=int(time.time()), model=http.model_name, prompts=prompts, params=params, n=n,
        stream=stream, include_usage=stream and include_usage, echo=echo, logprobs=logprobs,
        priority=_field(body, "priority", check_int, -MAX_ID - 1, MAX_ID) or 0,
        tenant=tenant if tenant is not None else "default",
        deadline_s=_field(body, "deadline_s", check_finite_float),
        return_token_ids=bool(_field(body, "return_token_ids", check_bool)), tools=tools,
        cache_salt=_field(body, "cache_salt", check_str, MAX_CACHE_SALT_CHARS),
        structured_field="tool_choice" if tools is not None and tools.forced else structured_field(body))


def _tool_choice(body: dict, http) -> ToolChoice | None:
    try:
        return parse_tool_choice(body.get("tools"), body.get("tool_choice"),
                                 body.get("parallel_tool_calls"), http.config.tool_call_parser)
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), param=getattr(exc, "field", "tools")) from None


def _check_names(body: dict, allowed: frozenset, http) -> None:
    """Fields this server does not know are ignored and logged once per name, as
    vLLM does (SDKs add fields from version to version); with strict_fields they
    are refused, naming the field. OpenAI fields that would change the answer
    and are not implemented (`_UNSUPPORTED`) are refused either way."""
    for name, value in body.items():
        if name in allowed or value is None:
            continue
        if name in _UNSUPPORTED:
            raise ApiError(400, f"{name} is not supported by this server", param=name)
        if http.config.strict_fields:
            raise ApiError(400, f"unknown field {name!r}", param=name)
        if name not in http.ignored_fields:
            http.ignored_fields.add(name)
            _log.warning("the request field %r is not supported and is ignored (logged once per "
                         "field name; --strict-fields refuses it)", name[:MAX_LOGGED_NAME_CHARS])


_TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                              "chat_template_kwargs", "tools", "return_token_strs"})


async def tokenize(body: object, http) -> dict:
    """POST /tokenize, as vLLM answers it: a `prompt`'s token ids (with the
    tokenizer's special tokens unless `add_special_tokens` is false), or a chat's
    `messages` rendered with the template (and `tools`), as a chat request would be."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, got {kind(body)}")
    _check_names(body, _TOKENIZE_FIELDS, http)
    _check_model(body, http)
    tokenizer = http.engine.tokenizer
    if tokenizer is None:
        raise ApiError(400, f"the model {http.model_name!r} has no tokenizer")
    if body.get("messages") is not None:
        tools = _tool_choice(body, http)
        ids = await _chat_prompt(body, http, tools)
    else:
        prompt = _field(body, "prompt", check_str)
        if prompt is None:
            raise ApiError(400, "tokenize needs a prompt (a string) or messages", param="prompt")
        special = _field(body, "add_special_tokens", check_bool)
        ids = await http.server.run_sized(len(prompt), encode_text, tokenizer, prompt, special is not False)
    answer = {"count": len(ids), "max_model_len": http.engine.core.config.max_model_len, "tokens": ids}
    if _field(body, "return_token_strs", check_bool):
        answer["token_strs"] = [http.token_text(token_id) for token_id in ids]
    return answer


def detokenize(body: object, http) -> dict:
    """POST /detokenize: the text of `tokens` (ids), as vLLM answers it."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, got {kind(body)}")
    _check_names(body, frozenset({"model", "tokens"}), http)
    _check_model(body, http)
    tokens = _field(body, "tokens", check_ids)
    if tokens is None:
        raise ApiError(400, "detokenize needs tokens (a list of token ids)", param="tokens")
    try:
        check_token_ids("tokens", tokens, http.engine.vocab_size)
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), param="tokens") from None
    tokenizer = http.engine.tokenizer
    if tokenizer is None:
        raise ApiError(400, f"the model {http.model_name!r} has no tokenizer")
    return {"prompt": tokenizer.decode(tokens)}


def _check_model(body: dict, http) -> None:
    model = _field(body, "model", check_str)
    if model is not None and model != http.model_name:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                            f"{http.model_name!r}", param="model", code="model_not_found")


def _completion_prompts(prompt: object) -> list:
    """A completion's prompt: a string, a list of strings, token ids or lists of them."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids "
                            "or a list of such lists (and not empty)", param="prompt")
    try:
        if all(type(item) is int for item in prompt):
            return [check_ids(prompt, "prompt")]
        return [item if isinstance(item, str) else check_ids(item, f"prompt[{i}]")
                for i, item in enumerate(prompt)]
    except ProtocolError as exc:
        raise ApiError(400, str(exc), param="prompt") from None


async def _chat_prompt(body: dict, http, tools: ToolChoice | None) -> list[int]:
    """A chat's messages (and tools) rendered with the model's template, as token ids."""
    add_generation_prompt = _field(body, "add_generation_prompt", check_bool)
    variables = _field(body, "chat_template_kwargs", check_dict) or {}
    if tools is not None:
        variables = {**variables, "tools": tools.tools}
    messages = body.get("messages")
    try:
        check_messages(messages)  # its limits, before any cost that grows with the conversation
        return await http.server.run_sized(
            text_size(messages) + text_size(variables), http.chat.prompt_ids, messages,
            add_generation_prompt=add_generation_prompt is not False, **variables)
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), param="messages") from None


def _logprobs(body: dict, chat: bool) -> int | None:
    if not chat:
        return _field(body, "logprobs", check_int, 0, MAX_TOP_LOGPROBS)
    wanted = _field(body, "logprobs", check_bool)
    top = _field(body, "top_logprobs", check_int, 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if wanted else None


# Request fields whose entries the sampling parameters check and convert one by one.
_SIZED_SAMPLING_FIELDS = ("logit_bias", "allowed_token_ids", "bad_words", "stop_token_ids", "stop")


def _sampling_size(body: dict) -> int:
    """The entries (or characters) a request's sampling fields hold: what building
    its parameters costs, for `run_sized`."""
    size = 0
    for name in _SIZED_SAMPLING_FIELDS:
        value = body.get(name)
        if isinstance(value, (dict, list, str)):
            size += len(value)
    return size


def _sampling_params(body: dict, chat: bool, prompts: list, logprobs: int | None,
                     engine: Engine) -> SamplingParams:
    fields: dict[str, Any] = {}
    max_tokens = _field(body, "max_tokens", check_int, 1)
    if chat:
        newer = _field(body, "max_completion_tokens", check_int, 1)
        max_tokens = newer if newer is not None else max_tokens
    if max_tokens is None:
        if chat:
            # As vLLM does: as long as the context allows.
            max_tokens = max(1, engine.core.config.max_model_len - len(prompts[0]))
        else:
            max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    fields["max_tokens"] = max_tokens
    for name in _SAMPLING_FLOATS:
        value = _field(body, name, check_finite_float)
        if value is not None:
            fields[name] = value
    top_k = _field(body, "top_k", check_int, None)
    if top_k is not None:
        fields["top_k"] = 0 if top_k == -1 else top_k  # vLLM spells "off" as -1
    stop = body.get("stop")
    if isinstance(stop, str):
        fields["stop"] = (stop,)
    elif stop is not None:
        fields["stop"] = tuple(_field(body, "stop", check_strs))
    for name, check, args in (("seed", check_int, (None,)), ("min_tokens", check_int, (0,)),
                              ("ignore_eos", check_bool, ()),
                              ("include_stop_str_in_output", check_bool, ()),
                              ("stop_token_ids", check_ids, ())):
        value = _field(body, name, check, *args)
        if value is not None:
            fields[name] = value
    for name in _VLLM_SAMPLING:
        if body.get(name) is not None:
            fields[name] = body[name]
    fields["logprobs"] = logprobs
    fields["structured_output"] = _structured_output(body)
    try:
        return SamplingParams(**fields)
    except InvalidRequestError as exc:
        name = str(exc).split(" ", 1)[0]
        if name == "logprobs" and chat:
            name = "top_logprobs"
        raise ApiError(400, str(exc), param=name if name in body or name == "max_tokens" else None) from None


def _structured_output(body: dict) -> StructuredOutput | None:
    """OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema"}),
    Cadence's `regex` / `grammar` (a string each), or vLLM's `guided_json`,
    `guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs`
    ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}): at most one."""
    given = [name for name in _STRUCTURED_FIELDS if body.get(name) is not None]
    if len(given) > 1:
        raise ApiError(400, f"only one structured output may be given, got "
                            f"{' and '.join(given)}", param=given[1])
    if not given:
        return None
    name = given[0]
    try:
        return _structured_field(name, body[name])
    except (ProtocolError, InvalidRequestError) as exc:
        raise ApiError(400, http_structured_message(str(exc), name), param=name) from None


def structured_field(body: dict) -> str | None:
    """The request field that holds its structured output (None: none given)."""
    return next((name for name in _STRUCTURED_FIELDS if body.get(name) is not None), None)


def http_structured_message(message: str, name: str) -> str:
    """An engine message about a JSON structured output names `structured_output`,
    the engine's field: over HTTP it names the field the request used."""
    prefix = "structured_output"
    return name + message[len(prefix):] if message.startswith(prefix) else message


def _structured_field(name: str, value: object) -> StructuredOutput | None:
    if name == "response_format":
        return _response_format(check_dict(value, name))
    if name == "structured_outputs":
        inner = {key: item for key, item in check_dict(value, name).items()
                 if item is not None and item is not False}
        if len(inner) != 1:
            raise InvalidRequestError(f"structured_outputs must hold exactly one of json, regex, "
                                      f"choice, grammar and json_object, got {sorted(inner)}")
        (key, item), = inner.items()
        if key == "json_object":
            return StructuredOutput("json_object")
        if key not in ("json", "regex", "choice", "grammar"):
            raise InvalidRequestError(f"structured_outputs.{key} is not supported by this server")
        return _structured_field(f"guided_{key}", item)
    if name == "guided_json":
        return StructuredOutput.json_schema(value if isinstance(value, str) else check_dict(value, name))
    if name == "guided_choice":
        choices = check_strs(value, name)
        if not choices:
            raise InvalidRequestError(f"{name} must be a non-empty list of strings")
        return StructuredOutput("regex", "|".join(f"({_literal(choice)})" for choice in choices))
    kind = {"guided_regex": "regex", "guided_grammar": "grammar"}.get(name, name)
    return StructuredOutput(kind, check_str(value, name))


def _literal(text: str) -> str:
    """A regular expression matching exactly `text` (only metacharacters escaped,
    which every regex dialect reads alike)."""
    return re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", text)


def _response_format(value: dict) -> StructuredOutput | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise InvalidRequestError(f"response_format.type must be text, json_object or json_schema, "
                                  f"got {kind!r}")
    inner = check_dict(value.get("json_schema"), "response_format.json_schema")
    schema = inner.get("schema")
    if schema is None:
        raise InvalidRequestError("response_format.json_schema.schema is missing")
    return StructuredOutput.json_schema(check_dict(schema, "response_format.json_schema.schema"))


# ---------------------------------------------------------------------------
# Responses.


def _logprob(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB


@attrs.define(eq=False)
class Choice:
    """One engine stream of a response, and what it has produced so far."""

    index: int
    prompt_index: int
    stream: RequestStream
    state: _StreamState
    started: bool = False
    released: bool = False
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_tokens: int = 0
    texts: list = attrs.Factory(list)
    token_ids: list = attrs.Factory(list)
    logprobs: list = attrs.Factory(list)  # (token id, pairs) per generated token
    # The prompt's entries (None for its first token) when echo asks for its logprobs.
    prompt_logprobs: list | None = None
    echoed: bool = False
    finish_reason: str | None = None
    error: Exception | None = None
    text_offset: int = 0
    # Reads tool calls out of the text when the request has tools.
    tool_stream: ToolCallStream | None = None

    def add(self, out, whole: bool) -> None:
        """Take one engine delta; `whole`: keep its text, tokens and logprobs for a
        non-streamed answer (a streamed one only needs the counts)."""
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if whole:
            if out.text:
                self.texts.append(out.text)
            self.token_ids.extend(out.token_ids)
            if out.logprobs is not None:
                self.logprobs.extend(zip(out.token_ids, out.logprobs))
        self.num_tokens = out.num_tokens
        self.num_cached_tokens = out.num_cached_tokens
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason

    def role_delta(self) -> dict:
        """A chat stream's first chunk for this choice."""
        return {"index": self.index, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}

    def echo_delta(self, request: ApiRequest, http) -> dict:
        """A completion stream's first chunk when the prompt is echoed (with its
        tokens' logprobs when asked: it is then sent with the first output)."""
        self.echoed = True
        text = _prompt_text(request.prompts[self.prompt_index], http)
        logprobs = self._prompt_logprobs(request, http) if request.logprobs is not None else None
        self.text_offset = len(text)
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": None}

    def delta_json(self, request: ApiRequest, out, token_text: Callable[[int], str]) -> bytes | None:
        """The chunk entry for one engine delta as JSON (None when it says nothing).
        The common entry (text, no logprobs, no token ids) is written without
        building a dict: it is on the hot path of every streamed token."""
        text = out.text or ""
        if not text and out.finish_reason is None and not out.token_ids:
            return None
        if request.tools is not None:
            entry = self.delta(request, out, token_text)
            if not entry["delta"] and entry["finish_reason"] is None and entry["logprobs"] is None \
                    and not request.return_token_ids:
                return None
            return json.dumps(entry, separators=(",", ":")).encode("utf-8")
        if request.logprobs is None and not request.return_token_ids:
            reason = _NULL if out.finish_reason is None else json.dumps(out.finish_reason).encode()
            if request.chat:
                content = b'{"content":' + json.dumps(text).encode() + b"}" if text else b"{}"
                return (b'{"index":%d,"delta":%b,"logprobs":null,"finish_reason":%b}'
                        % (self.index, content, reason))
            return (b'{"index":%d,"text":%b,"logprobs":null,"finish_reason":%b}'
                    % (self.index, json.dumps(text).encode(), reason))
        return json.dumps(self.delta(request, out, token_text), separators=(",", ":")).encode("utf-8")

    def delta(self, request: ApiRequest, out, token_text: Callable[[int], str]) -> dict:
        """The chunk entry for one engine delta."""
        text = out.text or ""
        logprobs = None
        if request.logprobs is not None and out.logprobs is not None:
            logprobs = self._render_logprobs(request, list(zip(out.token_ids, out.logprobs)),
                                             token_text)
        if request.tools is not None:
            entry = {"index": self.index, "delta": self._tool_delta(request, text, out.finish_reason),
                     "logprobs": logprobs, "finish_reason": self._finish_reason(out.finish_reason)}
        elif request.chat:
            entry = {"index": self.index, "delta": {"content": text} if text else {},
                     "logprobs": logprobs, "finish_reason": out.finish_reason}
        else:
            entry = {"index": self.index, "text": text, "logprobs": logprobs,
                     "finish_reason": out.finish_reason}
        if request.return_token_ids:
            entry["token_ids"] = out.token_ids
        return entry

    def whole(self, request: ApiRequest, http) -> dict:
        """The choice of a non-streamed answer."""
        text = "".join(self.texts)
        logprobs = None
        if request.logprobs is not None:
            echoed = None
            if not request.chat and request.echo:
                echoed = self._prompt_logprobs(request, http)
                self.text_offset = len(_prompt_text(request.prompts[self.prompt_index], http))
            logprobs = self._render_logprobs(request, self.logprobs, http.token_text)
            if echoed is not None:
                logprobs = {key: echoed[key] + logprobs[key] for key in logprobs}
        if request.tools is not None:
            message = {"role": "assistant", **self._tool_delta(request, text, self.finish_reason)}
            message.setdefault("content", None)
            whole = {"index": self.index, "message": message, "logprobs": logprobs,
                     "finish_reason": self._finish_reason(self.finish_reason)}
        elif request.chat:
            whole = {"index": self.index, "message": {"role": "assistant", "content": text},
                     "logprobs": logprobs, "finish_reason": self.finish_reason}
        else:
            if request.echo:
                text = _prompt_text(request.prompts[self.prompt_index], http) + text
            whole = {"index": self.index, "text": text, "logprobs": logprobs,
                     "finish_reason": self.finish_reason}
        if request.return_token_ids:
            whole["token_ids"] = self.token_ids
        return whole

    def _tool_delta(self, request: ApiRequest, text: str, finish_reason: str | None) -> dict:
        """The message (or delta) fields of `text` read for tool calls: its content
        and the calls it completed, numbered in the order the choice made them."""
        if self.tool_stream is None:
            self.tool_stream = ToolCallStream(request.tools)
        content, calls = self.tool_stream.feed(text)
        if finish_reason is not None:
            rest, more = self.tool_stream.finish()
            content, calls = content + rest, calls + more
        fields: dict = {}
        if content and (content.strip() or not self.tool_stream.calls):
            fields["content"] = content
        if calls:
            first = len(self.tool_stream.calls) - len(calls)
            fields["tool_calls"] = [call.body(first + i if request.stream else None)
                                    for i, call in enumerate(calls)]
        return fields

    def _finish_reason(self, finish_reason: str | None) -> str | None:
        """"tool_calls" for an answer that ended by itself after making calls."""
        if finish_reason == "stop" and self.tool_stream is not None and self.tool_stream.calls:
            return "tool_calls"
        return finish_reason

    def _prompt_logprobs(self, request: ApiRequest, http) -> dict:
        """The echoed prompt's tokens in OpenAI's completion logprobs shape, offsets
        from 0; the first token (and any the engine did not score) has null logprobs."""
        token_ids = self.stream.prompt_token_ids or []
        entries = self.prompt_logprobs or [None] * len(token_ids)
        self.text_offset = 0
        return self._render_logprobs(request, list(zip(token_ids, entries)), http.token_text)

    def _render_logprobs(self, request: ApiRequest, tokens: list, token_text) -> dict:
        """OpenAI's logprobs of (token id, pairs) entries; pairs None renders as null."""
        top = request.logprobs
        if request.chat:
            content = []
            for token_id, pairs in tokens:
                text = token_text(token_id)
                content.append({
                    "token": text, "logprob": _logprob(pairs[0][1]), "bytes": list(text.encode()),
                    "top_logprobs": [_chat_alternative(token_text(alt), lp) for alt, lp in pairs[1:1 + top]],
                })
            return {"content": content}
        texts, values, tops, offsets = [], [], [], []
        for token_id, pairs in tokens:
            text = token_text(token_id)
            texts.append(text)
            values.append(None if pairs is None else _logprob(pairs[0][1]))
            tops.append({token_text(alt): _logprob(lp) for alt, lp in pairs[1:1 + top]}
                        if top and pairs is not None else None)
            offsets.append(self.text_offset)
            self.text_offset += len(text)
        return {"tokens": texts, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _chat_alternative(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode())}


def _prompt_text(prompt, http) -> str:
    if isinstance(prompt, str):
        return prompt
    tokenizer = http.engine.tokenizer
    return tokenizer.decode(prompt) if tokenizer is not None else ""


def usage_of(request: ApiRequest, choices: list[Choice]) -> dict:
    """Token counts: each prompt once (however many samples it had), every completion."""
    firsts = [c for c in choices if c.index % request.n == 0]
    prompt_tokens = sum(c.num_prompt_tokens for c in firsts)
    completion_tokens = sum(c.num_tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_tokens for c in firsts)}}


class ChunkEncoder:
    """Server-sent events of one streamed answer; what every chunk repeats (id,
    object, created, model) is encoded once."""

    def __init__(self, request: ApiRequest) -> None:
        head = json.dumps({"id": request.response_id,
                           "object": "chat.completion.chunk" if request.chat else "text_completion",
                           "created": request.created, "model": request.model},
                          separators=(",", ":"))
        self._prefix = b"data: " + head[:-1].encode("utf-8") + b',"choices":'
        self._suffix = b',"usage":null}\n\n' if request.include_usage else b"}\n\n"

    def event(self, entries: list[dict]) -> bytes:
        """A chunk with these choice entries."""
        return self._prefix + json.dumps(entries, separators=(",", ":")).encode("utf-8") + self._suffix

    def event_json(self, entry: bytes) -> bytes:
        """A chunk with one choice entry already written as JSON."""
        return self._prefix + b"[" + entry + b"]" + self._suffix

    def usage_event(self, usage: dict) -> bytes:
        """The last chunk when usage was asked for: no choices, the usage."""
        return (self._prefix + b'[],"usage":' + json.dumps(usage, separators=(",", ":")).encode("utf-8")
                + b"}\n\n")


def completion_body(request: ApiRequest, choices: list[Choice], http) -> dict:
    """A non-streamed answer."""
    return {"id": request.response_id,
            "object": "chat.completion" if request.chat else "text_completion",
            "created": request.created, "model": request.model,
            "choices": [choice.whole(request, http) for choice in choices],
            "usage": usage_of(request, choices)}

