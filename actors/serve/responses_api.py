"""OpenAI's Responses API (POST /v1/responses) on the chat machinery.

A Responses body is checked field by field and rewritten as the chat request it
means (`chat_body`): `instructions` and `input` (a string, or message,
`function_call` and `function_call_output` items) become the conversation,
`max_output_tokens` the token limit, `text.format` the structured output, the
flat function `tools` the chat's nested ones. `parse_request` then checks and
renders it as it does a chat, so both endpoints share every limit and the
template. `ResponseWriter` renders the choice back: the response object
(`output` items of type `message` and `function_call`, `usage` in input/output
tokens) and, when streamed, the typed events OpenAI's SDKs read
(`response.created` ... `response.output_text.delta` ... `response.completed`),
each with its `sequence_number`.

The server keeps no responses: `store` is answered false, and what needs a
stored one (`previous_response_id`, `conversation`, `background`, item
references, GET /v1/responses/{id}) is refused naming the field, as vLLM does
by default. The conversation travels in `input`.
"""

from __future__ import annotations

import json
import re
import time
import uuid

from ..chat import MAX_CONTENT_PARTS, MAX_MESSAGES
from ..fields import check_bool, check_dict, check_int, check_str, kind
from .openai_api import MAX_TOP_LOGPROBS, ApiError, ApiRequest, Choice, _check_model, _check_names, _field

__all__ = ["RESPONSES_PATH", "chat_body", "renamed", "ResponseWriter"]

RESPONSES_PATH = "/v1/responses"
# The most metadata entries, and characters of a key and of a value (OpenAI's limits).
MAX_METADATA_ENTRIES, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512

# Passed to the chat request as they are: sampling fields vLLM's Responses API also
# takes, and Cadence's own extensions.
_PASSED = ("temperature", "top_p", "seed", "top_k", "min_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
           "include_stop_str_in_output", "logit_bias", "allowed_token_ids", "bad_words",
           "skip_special_tokens", "priority", "tenant", "deadline_s", "cache_salt", "user", "stream")
# Read here, or accepted and without effect on the answer (echoed where OpenAI echoes them).
_OWN = ("model", "input", "instructions", "max_output_tokens", "tools", "tool_choice",
        "parallel_tool_calls", "text", "top_logprobs", "include", "metadata", "store", "truncation",
        "reasoning", "service_tier", "prompt_cache_key", "safety_identifier", "stream_options",
        "max_tool_calls", "previous_response_id", "conversation", "background", "prompt")
_FIELDS = frozenset(_PASSED + _OWN)
_NO_STORE = "this server stores no responses: send the whole conversation in input"
# Fields that need a stored response or another service; refused when given.
_NEEDS_STORE = {"previous_response_id": _NO_STORE, "conversation": _NO_STORE,
                "prompt": "stored prompt templates are not supported by this server"}
_MESSAGE_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")
# Include values honoured (others ask for content this server does not produce, and
# are accepted without effect).
_LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Chat fields in errors, as the Responses request spells them.
_RENAMED = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
            "messages": "input", "response_format": "text.format", "logprobs": "top_logprobs"}
_RENAMED_RE = re.compile(r"\b(max_completion_tokens|max_tokens|response_format|logprobs)\b")
_MESSAGES_RE = re.compile(r"\bmessages(\[(\d+)\])?")


def chat_body(body: object, http) -> dict:
    """The chat request a Responses body means; ApiError (400 naming the Responses
    field, 404 for an unknown model) for a bad one."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, got {kind(body)}")
    _check_names(body, _FIELDS, http)
    _check_model(body, http)
    for name, why in _NEEDS_STORE.items():
        if body.get(name) is not None:
            raise ApiError(400, f"{name}: {why}", param=name)
    if _field(body, "background", check_bool):
        raise ApiError(400, f"background: {_NO_STORE}", param="background")
    _field(body, "store", check_bool)
    truncation = _field(body, "truncation", check_str)
    if truncation not in (None, "disabled"):
        raise ApiError(400, f"truncation must be 'disabled' here (a prompt longer than the model's "
                            f"context is refused, not cut), got {truncation!r:.40}", param="truncation")
    _metadata(body)
    for name in ("reasoning", "stream_options"):
        _field(body, name, check_dict)
    chat = {name: body[name] for name in _PASSED if body.get(name) is not None}
    chat["messages"] = _messages(body)
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = _field(body, "max_output_tokens", check_int, 1)
    top = _field(body, "top_logprobs", check_int, 0, MAX_TOP_LOGPROBS)
    include = body.get("include")
    if include is not None and (not isinstance(include, list)
                                or not all(isinstance(item, str) for item in include)):
        raise ApiError(400, "include must be a list of strings", param="include")
    if top or (include is not None and _LOGPROBS_INCLUDE in include):
        chat["logprobs"] = True
        chat["top_logprobs"] = top or 0
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    response_format = _text_format(body)
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


def renamed(error: ApiError, body: object) -> ApiError:
    """An error of the chat request, naming the Responses request's fields: its
    `param` and the field names in its message (`messages[i]` becomes the input
    item it came from: instructions, when given, are message 0)."""
    offset = 1 if isinstance(body, dict) and body.get("instructions") is not None else 0

    def item(match: re.Match) -> str:
        if match.group(2) is None:
            return "input"
        index = int(match.group(2)) - offset
        return "instructions" if index < 0 else f"input[{index}]"

    message = _RENAMED_RE.sub(lambda m: _RENAMED[m.group(1)], _MESSAGES_RE.sub(item, error.message))
    param = error.param
    if param is not None:
        param = _RENAMED.get(param, param)
        param = re.sub(r"^tools\[(\d+)\]\.function", r"tools[\1]", param)
    message = re.sub(r"\btools\[(\d+)\]\.function\b", r"tools[\1]", message)
    return ApiError(error.status, message, param=param, code=error.code, poison=error.poison)


def _metadata(body: dict) -> None:
    metadata = _field(body, "metadata", check_dict)
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise ApiError(400, f"metadata has {len(metadata)} entries, the limit is {MAX_METADATA_ENTRIES}",
                       param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or not isinstance(value, str) \
                or len(value) > MAX_METADATA_VALUE_CHARS:
            raise ApiError(400, f"metadata: keys of at most {MAX_METADATA_KEY_CHARS} characters, "
                                f"string values of at most {MAX_METADATA_VALUE_CHARS}", param="metadata")


def _messages(body: dict) -> list[dict]:
    """`instructions` and `input` as chat messages."""
    messages: list[dict] = []
    instructions = _field(body, "instructions", check_str)
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError(400, "input must be a string or a non-empty list of items", param="input")
    if len(items) > MAX_MESSAGES:
        raise ApiError(400, f"input has {len(items)} items, the limit is {MAX_MESSAGES}", param="input")
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where} must be an object, got {kind(item)}", param="input")
        item_type = item.get("type", "message")
        if item_type == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in _MESSAGE_ROLES:
                raise ApiError(400, f"{where}.role must be one of {', '.join(_MESSAGE_ROLES)}, "
                                    f"got {role!r:.40}", param="input")
            messages.append({"role": _MESSAGE_ROLES[role], "content": _content(item.get("content"), f"{where}.content")})
        elif item_type == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item_type == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _content(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": content})
        elif item_type == "reasoning":
            continue  # a reasoning model's hidden thoughts: not part of the conversation it reads
        elif item_type == "item_reference":
            raise ApiError(400, f"{where}: {_NO_STORE}", param="input")
        else:
            raise ApiError(400, f"{where}.type is {item_type!r:.40}: this server takes message, "
                                "function_call and function_call_output items", param="input")
    return messages


def _string(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{name} must be a string, got {kind(value)}", param="input")
    return value


def _content(content: object, path: str) -> str | list:
    """A message's content (at `path`): a string, or text parts (input_text,
    output_text) as the chat's text parts; any other part is refused (this model
    reads text only)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{path} must be a string or a list of parts", param="input")
    if len(content) > MAX_CONTENT_PARTS:
        raise ApiError(400, f"{path} has {len(content)} parts, the limit is {MAX_CONTENT_PARTS}",
                       param="input")
    parts = []
    for number, part in enumerate(content):
        part_type = part.get("type") if isinstance(part, dict) else None
        if part_type not in _TEXT_PARTS:
            raise ApiError(400, f"{path}[{number}].type is {part_type!r:.40}: this model reads text only "
                                "(parts of type input_text or output_text)", param="input")
        if not isinstance(part.get("text"), str):
            raise ApiError(400, f"{path}[{number}].text must be a string", param="input")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _tools(tools: object) -> list:
    """Responses' flat function tools as the chat's nested ones."""
    if not isinstance(tools, list):
        raise ApiError(400, "tools must be a list", param="tools")
    out = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            found = tool.get("type") if isinstance(tool, dict) else kind(tool)
            raise ApiError(400, f"tools[{index}].type is {found!r:.40}: this server runs function "
                                "tools only", param=f"tools[{index}]")
        function = {key: tool[key] for key in ("name", "description", "parameters")
                    if tool.get(key) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: object) -> object:
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    found = choice.get("type") if isinstance(choice, dict) else kind(choice)
    raise ApiError(400, f"tool_choice must be auto, none, required or {{type: function, name}}, "
                        f"got {found!r:.40}", param="tool_choice")


def _text_format(body: dict) -> dict | None:
    """`text.format` as the chat's response_format (None: plain text)."""
    text = _field(body, "text", check_dict)
    if text is None or text.get("format") is None:
        return None
    fmt = text["format"]
    if not isinstance(fmt, dict):
        raise ApiError(400, f"text.format must be an object, got {kind(fmt)}", param="text")
    fmt_type = fmt.get("type")
    if fmt_type == "text":
        return None
    if fmt_type == "json_object":
        return {"type": "json_object"}
    if fmt_type != "json_schema":
        raise ApiError(400, f"text.format.type must be text, json_object or json_schema, got "
                            f"{fmt_type!r:.40}", param="text")
    if not isinstance(fmt.get("schema"), dict):
        raise ApiError(400, "text.format.schema must be an object (a JSON schema)", param="text")
    return {"type": "json_schema", "json_schema": {key: fmt[key] for key in ("name", "schema", "strict")
                                                   if fmt.get(key) is not None}}


# ---------------------------------------------------------------------------
# The answer.

def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseWriter:
    """One response's object and, when streamed, its events (`event` frames them as
    server-sent events, numbered). Items are opened and closed as the choice's text
    and tool calls arrive: a message item holds text, a function_call item each call."""

    def __init__(self, body: dict, request: ApiRequest) -> None:
        self.body, self.request = body, request
        self.id, self.created_at = _new_id("resp"), int(time.time())
        self.output: list[dict] = []
        self.sequence = 0
        self._message: dict | None = None  # the message item open for text, if any
        self._texts: list[str] = []  # its text so far, joined when it closes
        self._echo = {
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {}, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "top_logprobs": body.get("top_logprobs"), "reasoning": body.get("reasoning"),
            "truncation": "disabled", "store": False, "previous_response_id": None,
            "service_tier": body.get("service_tier") or "default", "user": body.get("user"),
        }

    # ---- the response object --------------------------------------------------------------
    def response(self, status: str, choice: Choice | None = None, error: ApiError | None = None) -> dict:
        """The response object; `choice` given: its usage, and (status "completed")
        the status its end makes."""
        incomplete, failure = None, None if error is None else {"code": error.code or "server_error",
                                                                 "message": error.message}
        if choice is not None and status == "completed":
            status, incomplete, failure = _end_of(choice.finish_reason)
        usage = None
        if choice is not None:
            usage = {"input_tokens": choice.num_prompt_tokens,
                     "input_tokens_details": {"cached_tokens": choice.num_cached_tokens},
                     "output_tokens": choice.num_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": choice.num_prompt_tokens + choice.num_tokens}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.request.model, "output": self.output if status != "in_progress" else [],
                "incomplete_details": incomplete, "error": failure, "usage": usage, **self._echo}

    def whole(self, choice: Choice, http) -> dict:
        """The response of a non-streamed request, from its finished choice."""
        message = choice.whole(self.request, http)
        content = message["message"].get("content")
        calls = message["message"].get("tool_calls") or []
        logprobs = (message["logprobs"] or {}).get("content") if self.request.logprobs is not None else None
        if content or not calls:
            self._open_message()
            self._add_text(content or "", logprobs)
            self._close_message(choice)
        for call in calls:
            self.output.append(self._call_item(call, "completed"))
        return self.response("completed", choice)

    # ---- events -----------------------------------------------------------------------------
    def event(self, event_type: str, **fields) -> bytes:
        """One server-sent event: `event:` its type, `data:` the object with its number."""
        data = {"type": event_type, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return (b"event: " + event_type.encode() + b"\ndata: "
                + json.dumps(data, separators=(",", ":")).encode("utf-8") + b"\n\n")

    def opening(self) -> list[bytes]:
        """The events before any output."""
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def delta_events(self, choice: Choice, out, token_text) -> list[bytes]:
        """The events of one engine delta: text into the open message item (opened on
        the first), each finished tool call as a function_call item of its own."""
        request = self.request
        logprobs = None
        if request.tools is None:
            text, calls = out.text or "", []
            if request.logprobs is not None and out.logprobs is not None:
                logprobs = choice.delta(request, out, token_text)["logprobs"]["content"]
        else:
            entry = choice.delta(request, out, token_text)
            text, calls = entry["delta"].get("content", ""), entry["delta"].get("tool_calls") or []
            logprobs = (entry["logprobs"] or {}).get("content")
        events = []
        if text or (logprobs and not calls):
            if self._message is None:
                events += self._open_message(stream=True)
            events += self._add_text(text, logprobs, stream=True)
        for call in calls:
            events += self._close_message(choice, stream=True)
            events += self._call_events(call)
        return events

    def closing(self, choice: Choice, error: ApiError | None) -> list[bytes]:
        """The events after the last output: the open item closed, then the response's
        end (response.completed, or response.failed with the error)."""
        events = []
        if error is None and not self.output and self._message is None:
            events += self._open_message(stream=True)  # no text and no call: an empty message
        events += self._close_message(choice, stream=True)
        if error is not None:
            return events + [self.event("response.failed", response=self.response("failed", choice, error))]
        # Ended by the model or by max_output_tokens alike: response.completed, its status
        # in the object (as vLLM sends it; the SDKs' stream helpers wait for this event).
        return events + [self.event("response.completed", response=self.response("completed", choice))]

    # ---- items ----------------------------------------------------------------------------------
    def _open_message(self, stream: bool = False) -> list[bytes]:
        part = {"type": "output_text", "text": "", "annotations": []}
        if self.request.logprobs is not None:
            part["logprobs"] = []
        self._message = {"id": _new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                         "content": [part]}
        self.output.append(self._message)
        if not stream:
            return []
        index = len(self.output) - 1
        return [self.event("response.output_item.added", output_index=index,
                           item={**self._message, "content": []}),
                self.event("response.content_part.added", item_id=self._message["id"], output_index=index,
                           content_index=0, part=part)]

    def _add_text(self, text: str, logprobs: list | None, stream: bool = False) -> list[bytes]:
        part = self._message["content"][0]
        self._texts.append(text)  # joined once at the close: += would copy the text per token
        if logprobs is not None and "logprobs" in part:
            part["logprobs"].extend(logprobs)
        if not stream:
            return []
        return [self.event("response.output_text.delta", item_id=self._message["id"],
                           output_index=len(self.output) - 1, content_index=0, delta=text,
                           logprobs=logprobs or [])]

    def _close_message(self, choice: Choice, stream: bool = False) -> list[bytes]:
        message = self._message
        if message is None:
            return []
        self._message = None
        message["status"] = "incomplete" if choice.finish_reason in ("length", "abort") else "completed"
        part = message["content"][0]
        part["text"], self._texts = "".join(self._texts), []
        if not stream:
            return []
        index = self.output.index(message)
        return [self.event("response.output_text.done", item_id=message["id"], output_index=index,
                           content_index=0, text=part["text"], logprobs=part.get("logprobs", [])),
                self.event("response.content_part.done", item_id=message["id"], output_index=index,
                           content_index=0, part=part),
                self.event("response.output_item.done", output_index=index, item=message)]

    def _call_item(self, call: dict, status: str) -> dict:
        function = call["function"]
        return {"id": _new_id("fc"), "type": "function_call", "status": status, "call_id": call["id"],
                "name": function["name"], "arguments": function["arguments"]}

    def _call_events(self, call: dict) -> list[bytes]:
        item = self._call_item(call, "in_progress")
        index = len(self.output)
        self.output.append(item)
        events = [self.event("response.output_item.added", output_index=index, item={**item, "arguments": ""}),
                  self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                             delta=item["arguments"]),
                  self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             arguments=item["arguments"])]
        item["status"] = "completed"
        return events + [self.event("response.output_item.done", output_index=index, item=item)]


def _end_of(finish_reason: str | None) -> tuple[str, dict | None, dict | None]:
    """A finished choice's response status, incomplete_details and error: cut off by
    max_output_tokens is incomplete; aborted (a shutdown's grace ran out) failed."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    if finish_reason == "abort":
        return "failed", None, {"code": "aborted", "message": "the request was aborted before it finished "
                                                              "(the server is shutting down)"}
    return "completed", None, None
