"""Chat templates: turn a list of messages into a model's prompt text.

    template = ChatTemplate.from_dir("path/to/model")
    prompt = template.render([{"role": "user", "content": "Hi"}])

The template is the model folder's `chat_template.jinja`, or the
`chat_template` of its `tokenizer_config.json`. It is rendered the way the
Hugging Face ecosystem renders it, so a prompt is the same token for token:
Jinja2's immutable sandbox (templates come from model hubs and are untrusted
code) with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension,
`raise_exception`, a `tojson` that does not escape HTML, `strftime_now`, and
the tokenizer's special-token strings (`bos_token`, `eos_token`, ...) as
variables. The rendered text already holds any special tokens it needs, so
it is encoded without adding more.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

import attrs

from cadence.statemachine.errors import ConfigError, InvalidRequestError

__all__ = ["CHAT_TEMPLATE_FILE", "ChatTemplate", "ChatTemplateError", "EngineChat",
           "check_content_parts", "check_messages", "encode_rendered", "encode_text",
           "template_messages", "text_size", "MAX_MESSAGES", "MAX_CONTENT_PARTS", "TEXT_PART_TYPES"]

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# tokenizer_config.json keys whose strings a template may use by name.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                      "mask_token")
# Most messages in one conversation, and content parts in one message: a longer
# conversation is refused before any of it is rendered.
MAX_MESSAGES = 8192
MAX_CONTENT_PARTS = 1024
# Content part types a text-only model reads. A part of any other type (an image,
# audio, a file) is refused, not left for the template to drop without a word.
TEXT_PART_TYPES = ("text", "input_text")
# A tokenizer_config.json may hold several named templates; this one is used.
DEFAULT_TEMPLATE_NAME = "default"


class ChatTemplateError(InvalidRequestError):
    """A conversation the template refuses (its `raise_exception`), or a model with
    no chat template."""


def _raise_exception(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, > and & for HTML, which would change prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ConfigError(f"the chat template does not parse: {exc} (line {exc.lineno})") from None


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _config_template(value: object) -> str | None:
    """tokenizer_config.json's chat_template: one string, or a list of named ones."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, Mapping)}
        template = named.get(DEFAULT_TEMPLATE_NAME)
        return template if isinstance(template, str) else None
    return None


def check_messages(messages: object, path: str = "messages") -> list[dict]:
    """Validate a conversation: a non-empty list of at most MAX_MESSAGES maps with a
    string `role`, each content a string or at most MAX_CONTENT_PARTS parts; raises
    InvalidRequestError naming the first bad element. Its cost is bounded by the
    limits, whatever the conversation's size."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError(f"{path} must be a non-empty list of messages")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequestError(f"{path} has {len(messages)} messages, the limit is {MAX_MESSAGES}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"{path}[{index}] must be an object, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"{path}[{index}].role must be a string")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InvalidRequestError(f"{path}[{index}].content must be a string or a list of parts")
        if isinstance(content, list) and len(content) > MAX_CONTENT_PARTS:
            raise InvalidRequestError(f"{path}[{index}].content has {len(content)} parts, the limit "
                                      f"is {MAX_CONTENT_PARTS}")
    return messages  # type: ignore[return-value]


def check_content_parts(messages: Sequence[Mapping[str, Any]], path: str = "messages") -> None:
    """Refuse a content part the model cannot read: every part of a list content must
    be an object of a type in TEXT_PART_TYPES with a string `text`; raises
    InvalidRequestError naming the part. Run where the conversation is rendered (its
    cost grows with the parts, as rendering's does); `check_messages` first."""
    for index, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for number, part in enumerate(content):
            where = f"{path}[{index}].content[{number}]"
            if not isinstance(part, dict):
                raise InvalidRequestError(f"{where} must be an object, got {type(part).__name__}")
            kind = part.get("type")
            if kind not in TEXT_PART_TYPES:
                raise InvalidRequestError(
                    f"{where}.type is {kind!r:.40}: this model reads text only (parts of type "
                    f"{' or '.join(map(repr, TEXT_PART_TYPES))})")
            if not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{where}.text must be a string")


def template_messages(messages: object) -> object:
    """The conversation as templates expect it: an assistant's tool call arguments
    (JSON text in OpenAI's shape) as objects, as Hugging Face templates read them.
    Other messages pass unchanged."""
    if not isinstance(messages, list):
        return messages
    out = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list):
            message = {**message, "tool_calls": [_template_call(call) for call in calls]}
        out.append(message)
    return out


def _template_call(call: object) -> object:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def text_size(value: object) -> int:
    """Characters of every string in a conversation (or any JSON-like value), plus
    one per other item: a cheap, linear measure of what rendering it will cost,
    whatever fields the template reads. Iterative, so deep nesting cannot overflow."""
    total, pending = 0, [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, Mapping):
            total += len(item)
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            total += len(item)
            pending.extend(item)
        else:
            total += 1
    return total


@attrs.frozen
class ChatTemplate:
    """A compiled chat template with the special-token strings it may use."""

    source: str
    special_tokens: Mapping[str, Any] = attrs.field(factory=dict)
    _compiled: Any = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_compiled", _compile(self.source))

    @classmethod
    def from_dir(cls, directory: str | Path) -> ChatTemplate | None:
        """The template of a model folder (None when it has none)."""
        directory = Path(directory)
        config: dict = {}
        config_path = directory / TOKENIZER_CONFIG_FILE
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ConfigError(f"{config_path} could not be read: {exc}") from None
        special: dict[str, Any] = {}
        for key in SPECIAL_TOKEN_KEYS:
            text = _token_text(config.get(key))
            if text is not None:
                special[key] = text
        extra = [t for t in map(_token_text, config.get("additional_special_tokens") or ()) if t]
        if extra:
            special["additional_special_tokens"] = extra
        template_path = directory / CHAT_TEMPLATE_FILE
        if template_path.is_file():
            source = template_path.read_text(encoding="utf-8")
        else:
            source = _config_template(config.get("chat_template"))
        return None if source is None else cls(source, special)

    @classmethod
    def for_model(cls, model: str) -> ChatTemplate | None:
        """The template of an engine's model: its folder's, or None (the simulated
        model, presets, folders without one); "demo" names the built-in demo model."""
        from .engine import resolve_model  # imported here: the engine builds on more than chat needs

        model = resolve_model(model)
        return cls.from_dir(model) if Path(model).is_dir() else None

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: list | None = None, documents: list | None = None, **variables: Any) -> str:
        """The prompt text of a conversation; `add_generation_prompt` ends it with
        the opening of the assistant's turn. Extra keywords reach the template as
        variables (e.g. `enable_thinking`)."""
        import jinja2

        check_messages(list(messages))
        check_content_parts(messages)
        values = {**self.special_tokens, **variables}
        try:
            return self._compiled.render(messages=list(messages), tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt, **values)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the conversation: {exc}") from None
        except Exception as exc:
            # The template is the model's and fixed: what fails in it is this request's
            # conversation (`tool_calls: 1`, which a template iterates), not the engine.
            raise ChatTemplateError(f"the chat template could not render the conversation: "
                                    f"{type(exc).__name__}: {str(exc)[:200]}") from None


def encode_rendered(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered conversation: the template wrote its special tokens,
    so the tokenizer adds none of its own."""
    return encode_text(tokenizer, text, add_special_tokens=False)


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`, with or without the tokenizer's own special tokens."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except TypeError:  # a tokenizer that never adds any (the byte tokenizer)
        return list(tokenizer.encode(text))


class EngineChat:
    """Chat prompts for one engine's model: its template, loaded on first use, and
    its tokenizer. Shared by the HTTP API, the msgpack server and `LLM.chat`."""

    def __init__(self, model: str, tokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self._loaded = False
        self._template: ChatTemplate | None = None

    @property
    def template(self) -> ChatTemplate | None:
        """The model's template (None when it has none)."""
        if not self._loaded:
            self._template = ChatTemplate.for_model(self.model)
            self._loaded = True
        return self._template

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                   **variables: Any) -> list[int]:
        """The token ids of a conversation's prompt; raises ChatTemplateError when the
        model has no template or tokenizer, or the template refuses the conversation."""
        template = self.template
        if template is None:
            raise ChatTemplateError(
                f"the model {self.model!r} has no chat template (chat_template.jinja or "
                "tokenizer_config.json's chat_template); send a prompt instead")
        if self.tokenizer is None:
            raise ChatTemplateError(f"chat needs a tokenizer; the model {self.model!r} has none")
        text = template.render(template_messages(messages), add_generation_prompt=add_generation_prompt,
                               **variables)
        return encode_rendered(self.tokenizer, text)
