"""Tool calling in OpenAI's shape: a chat request's `tools`, `tool_choice` and
`parallel_tool_calls` checked, and the calls read back out of the model's text.

`tool_choice` "auto" lets the model write text or calls; a named parser reads
the calls out of what it wrote (`--tool-call-parser`):

    tags   {"name": ..., "arguments": {...}} inside <tool_call>...</tool_call>,
           text around the tags is the message's content (the demo model's
           template teaches this form);
    json   the whole answer is one such object, or a list of them.

"required" and a named function constrain the output with the structured-output
machinery, so the call always parses: "required" to a JSON list of calls of the
given tools (one when `parallel_tool_calls` is false), a named function to its
`parameters` schema (the answer is that call's arguments). "none" renders the
tools but reads no calls. `ToolCallStream` follows one choice's text as it
arrives, holding back only what may still turn into a call, so a streamed answer
sends its content as it comes and each call as an OpenAI `tool_calls` delta.
"""

from __future__ import annotations

import json
import uuid

import attrs

from cadence.statemachine.errors import InvalidRequestError
from cadence.statemachine.sampling import StructuredOutput

__all__ = ["TOOL_CALL_PARSERS", "DEFAULT_TOOL_CALL_PARSER", "ToolCall", "ToolChoice",
           "ToolCallStream", "parse_tool_choice"]

TOOL_CALL_PARSERS = ("tags", "json")
DEFAULT_TOOL_CALL_PARSER = "tags"
START_TAG, END_TAG = "<tool_call>", "</tool_call>"
# Schema of a function that declares no parameters: any object.
_ANY_OBJECT = {"type": "object"}


@attrs.frozen
class ToolCall:
    """One call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = attrs.field(factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def body(self, index: int | None = None) -> dict:
        """OpenAI's tool_calls entry (with `index` in a streamed delta)."""
        entry = {"id": self.id, "type": "function",
                 "function": {"name": self.name, "arguments": self.arguments}}
        return entry if index is None else {"index": index, **entry}


@attrs.frozen
class ToolChoice:
    """A request's tools and how the model may call them.

    tools: the request's `tools`, as given (the chat template renders them).
    choice: "auto", "none", "required", or the name of the one function to call.
    parallel: more than one call per answer is allowed.
    parser: how calls are read out of text in "auto" ("tags" or "json").
    """

    tools: list
    choice: str
    parallel: bool
    parser: str

    @property
    def forced(self) -> bool:
        """The output is constrained to calls (required, or a named function)."""
        return self.choice not in ("auto", "none")

    def structured_output(self) -> StructuredOutput | None:
        """The constraint that makes a forced answer a call that parses (None for
        auto and none)."""
        if not self.forced:
            return None
        schemas = {tool["function"]["name"]: tool["function"].get("parameters") or _ANY_OBJECT
                   for tool in self.tools}
        if self.choice != "required":
            return StructuredOutput.json_schema(schemas[self.choice])
        calls = [{"type": "object", "properties": {"name": {"enum": [name]}, "arguments": schema},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name, schema in schemas.items()]
        array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutput.json_schema(array)


def _refuse(field: str, message: str) -> InvalidRequestError:
    error = InvalidRequestError(message)
    error.field = field
    return error


def _check_tools(tools: object) -> list:
    if not isinstance(tools, list):
        raise _refuse("tools", f"tools must be a list of tools, got {type(tools).__name__}")
    for index, tool in enumerate(tools):
        path = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise _refuse("tools", f'{path} must be {{"type": "function", "function": {{...}}}}')
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise _refuse("tools", f"{path}.function.name must be a non-empty string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise _refuse("tools", f"{path}.function.parameters must be a JSON schema object")
    return tools


def _check_choice(value: object, names: list[str]) -> str:
    if value in ("auto", "none", "required"):
        if value == "required" and not names:
            raise _refuse("tool_choice", 'tool_choice "required" needs at least one tool')
        return value
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise _refuse("tool_choice", 'tool_choice must be "auto", "none", "required" or '
                                     '{"type": "function", "function": {"name": ...}}')
    if name not in names:
        raise _refuse("tool_choice", f"tool_choice names the function {name[:64]!r}, which is not "
                                     f"among the tools ({', '.join(names) or 'none given'})")
    return name


def parse_tool_choice(tools: object, tool_choice: object, parallel: object,
                      parser: str) -> ToolChoice | None:
    """The checked tool fields of a chat request (None: no tools, or none given);
    raises InvalidRequestError naming the field (its `field` attribute)."""
    tools = _check_tools(tools) if tools is not None else []
    if parallel is not None and type(parallel) is not bool:
        raise _refuse("parallel_tool_calls", f"parallel_tool_calls must be a bool, got {type(parallel).__name__}")
    if not tools and tool_choice in (None, "none", "auto"):
        return None
    choice = _check_choice("auto" if tool_choice is None else tool_choice,
                           [tool["function"]["name"] for tool in tools])
    return ToolChoice(tools=tools, choice=choice, parallel=parallel is not False, parser=parser)


def _call_of(value: object, *, arguments_key: str = "arguments") -> ToolCall | None:
    """A call from a parsed {"name": ..., "arguments" (or "parameters"): {...}} object."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("parameters", {}))
    if isinstance(arguments, str):
        return ToolCall(value["name"], arguments)
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _calls_of(text: str) -> list[ToolCall] | None:
    """The calls of a bare-JSON answer: one call object or a non-empty list of them."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_call_of(item) for item in items]
    return calls if calls and all(call is not None for call in calls) else None


def _partial_tag(text: str) -> int:
    """Length of the longest end of `text` that begins START_TAG (held back: the
    next delta may complete the tag)."""
    for size in range(min(len(text), len(START_TAG) - 1), 0, -1):
        if START_TAG.startswith(text[-size:]):
            return size
    return 0


class ToolCallStream:
    """Follows one choice's text: `feed` each delta and `finish` at the end, each
    giving (content to send, calls completed). The whole answer is one feed."""

    def __init__(self, tools: ToolChoice) -> None:
        self.tools = tools
        self.calls: list[ToolCall] = []  # every call made so far
        self._pending = ""  # text held back
        self._in_call = False  # tags: inside <tool_call>
        # json: the answer began with { or [ (it may be calls: held to the end).
        self._held: bool | None = None

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.tools.choice == "none":
            return text, []
        self._pending += text
        if self.tools.forced:
            return "", []
        if self.tools.parser == "json":
            return self._feed_json()
        return self._feed_tags()

    def finish(self) -> tuple[str, list[ToolCall]]:
        pending, self._pending = self._pending, ""
        if self.tools.choice == "none":
            return "", []
        if self.tools.forced:
            return self._forced(pending)
        if self.tools.parser == "json":
            calls = _calls_of(pending) if pending.strip() else None
            return ("", self._made(calls)) if calls else (pending, [])
        if self._in_call:
            # An unclosed last call still counts when what follows its tag parses.
            call = _call_of(_loads(pending))
            return ("", self._made([call])) if call else (START_TAG + pending, [])
        return pending, []

    def _forced(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.tools.choice == "required":
            calls = _calls_of(text)
        else:
            calls = [ToolCall(self.tools.choice, text)] if _loads(text) is not None else None
        return ("", self._made(calls)) if calls else (text, [])

    def _feed_json(self) -> tuple[str, list[ToolCall]]:
        if self._held is None:
            stripped = self._pending.lstrip()
            if not stripped:
                return "", []
            self._held = stripped[0] in "{["
        if self._held:
            return "", []
        text, self._pending = self._pending, ""
        return text, []

    def _feed_tags(self) -> tuple[str, list[ToolCall]]:
        content, calls = [], []
        while True:
            if self._in_call:
                end = self._pending.find(END_TAG)
                if end < 0:
                    break
                call = _call_of(_loads(self._pending[:end]))
                if call is None:
                    content.append(START_TAG + self._pending[:end + len(END_TAG)])
                else:
                    calls.append(call)
                self._pending = self._pending[end + len(END_TAG):]
                self._in_call = False
                continue
            start = self._pending.find(START_TAG)
            if start < 0:
                keep = _partial_tag(self._pending)
                content.append(self._pending[:len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                break
            content.append(self._pending[:start])
            self._pending = self._pending[start + len(START_TAG):]
            self._in_call = True
        return "".join(content), self._made(calls)

    def _made(self, calls: list[ToolCall] | None) -> list[ToolCall]:
        """Record new calls; past the first, dropped unless parallel calls are allowed."""
        calls = list(calls or ())
        if not self.tools.parallel:
            calls = calls[:max(0, 1 - len(self.calls))]
        self.calls.extend(calls)
        return calls


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None
