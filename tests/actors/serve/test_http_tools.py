"""Tool calling through the HTTP API, driven by the official `openai` client against the
demo model: tools rendered by its chat template, `tool_choice` "required" and a named
function constrained so the call always parses (streamed and not), "auto" reading
<tool_call> tags out of the text, "none", and a multi-turn conversation with tool
results. The parsers themselves are checked on any split of their input.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cadence.actors.chat import ChatTemplate, template_messages
from cadence.actors.engine import EngineConfig, demo_model_dir
from cadence.actors.serve.http import HttpConfig
from cadence.actors.serve.server import ServerConfig, ServerThread
from cadence.actors.serve.tools import ToolCallStream, parse_tool_choice
from cadence.gpu.tokenizer import Tokenizer
from cadence.statemachine.errors import InvalidRequestError

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

API_KEY = "tools-key"
MAX_TOKENS = 200
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}},
           "required": ["city"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# What "auto" reads: content, then a call in tags (forced here with a regex, since the
# demo model was never taught to call tools).
TAGGED = 'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'


@pytest.fixture(scope="module")
def served():
    pytest.importorskip("xgrammar")
    engine = EngineConfig.from_kwargs(executor="inprocess", model=demo_model_dir(), max_model_len=1024,
                                      num_blocks=256, block_size=16, max_num_seqs=16)
    http = HttpConfig(port=0, api_key=API_KEY, served_model_name="demo")
    with ServerThread(engine, ServerConfig(port=0), http=http) as thread:
        yield thread


@pytest.fixture
def client(served):
    host, port = served.server.http.address
    with openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key=API_KEY, max_retries=0,
                       timeout=60.0) as client:
        yield client


def _prompt_tokens(messages, tools=None) -> int:
    template = ChatTemplate.from_dir(demo_model_dir())
    text = template.render(template_messages(messages), tools=tools)
    return len(Tokenizer.from_pretrained(demo_model_dir()).encode(text))


def _check_calls(calls, names=SCHEMAS) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed_calls(stream) -> tuple[str, dict, str]:
    """(content, {index: (id, name, arguments)}, finish_reason) of a streamed answer."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                call_id, name, arguments = calls.get(delta.index, (None, "", ""))
                calls[delta.index] = (delta.id or call_id, name + (delta.function.name or ""),
                                      arguments + (delta.function.arguments or ""))
            finish = choice.finish_reason or finish
    return content, calls, finish


def test_the_template_renders_the_tools(client):
    plain = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=1)
    with_tools = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=1, tools=TOOLS,
                                                tool_choice="none")
    assert plain.usage.prompt_tokens == _prompt_tokens(MESSAGES)
    assert with_tools.usage.prompt_tokens == _prompt_tokens(MESSAGES, TOOLS) > plain.usage.prompt_tokens


# A random model goes on adding calls to a list at will: with parallel calls allowed
# one seed that ends within the tokens given is used (a seed gives one answer).
@pytest.mark.parametrize("parallel, n, seed, max_tokens", [(False, 4, 1, MAX_TOKENS), (True, 1, 2, 300)])
def test_required_always_makes_calls_that_parse(client, parallel, n, seed, max_tokens):
    response = client.chat.completions.create(
        model="demo", messages=MESSAGES, tools=TOOLS, tool_choice="required", n=n, temperature=1.0,
        seed=seed, max_tokens=max_tokens, parallel_tool_calls=parallel)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        _check_calls(choice.message.tool_calls)
        assert len(choice.message.tool_calls) == 1 if not parallel else len(choice.message.tool_calls) > 1


def test_a_named_function_is_the_call_streamed_and_not(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    response = client.chat.completions.create(model="demo", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                              temperature=1.0, seed=3, max_tokens=MAX_TOKENS)
    (call,) = response.choices[0].message.tool_calls
    _check_calls([call], names={"get_time"})
    content, calls, finish = _streamed_calls(client.chat.completions.create(
        model="demo", messages=MESSAGES, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=3,
        max_tokens=MAX_TOKENS, stream=True))
    assert content == "" and finish == "tool_calls" and list(calls) == [0]
    call_id, name, arguments = calls[0]
    assert call_id.startswith("call_") and name == "get_time"
    assert arguments == call.function.arguments  # the same seed, the same call


def test_required_streamed_gives_tool_call_deltas(client):
    content, calls, finish = _streamed_calls(client.chat.completions.create(
        model="demo", messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0, seed=5,
        max_tokens=300, stream=True))
    assert content == "" and finish == "tool_calls" and sorted(calls) == list(range(len(calls)))
    assert len(calls) > 1 and len({call_id for call_id, _, _ in calls.values()}) == len(calls)
    for _, name, arguments in calls.values():
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_auto_reads_a_tagged_call_out_of_the_text(client):
    regex = {"guided_choice": [TAGGED]}
    response = client.chat.completions.create(model="demo", messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS,
                                              extra_body=regex)
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me look. "
    (call,) = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Rome"})
    content, calls, finish = _streamed_calls(client.chat.completions.create(
        model="demo", messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS, extra_body=regex, stream=True))
    assert (content, finish) == ("Let me look. ", "tool_calls")
    assert [(name, json.loads(arguments)) for _, name, arguments in calls.values()] == [
        ("get_weather", {"city": "Rome"})]
    # tool_choice "none": the same text is content, no call is read.
    response = client.chat.completions.create(model="demo", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                              max_tokens=MAX_TOKENS, extra_body=regex)
    assert response.choices[0].message.content == TAGGED and not response.choices[0].message.tool_calls
    assert response.choices[0].finish_reason == "stop"


def test_a_conversation_with_tool_results_round_trips(client):
    first = client.chat.completions.create(model="demo", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, seed=2, temperature=1.0,
                                           max_tokens=MAX_TOKENS)
    (call,) = first.choices[0].message.tool_calls
    messages = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "22 degrees and sunny"}]
    second = client.chat.completions.create(model="demo", messages=messages, tools=TOOLS, max_tokens=4)
    assert second.usage.prompt_tokens == _prompt_tokens(messages, TOOLS)
    rendered = ChatTemplate.from_dir(demo_model_dir()).render(template_messages(messages), tools=TOOLS)
    assert f'<tool_call>{{"name": "{call.function.name}", "arguments": {call.function.arguments}' in rendered
    assert "# tool: 22 degrees and sunny" in rendered


@pytest.mark.parametrize("fields, message", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tool_choice": "sometimes"}, 'tool_choice must be "auto"'),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls must be a bool"),
])
def test_bad_tool_fields_are_a_400_naming_them(client, fields, message):
    body = {"tools": TOOLS, **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=2, extra_body=body)
    param = next(name for name in ("tool_choice", "parallel_tool_calls", "tools") if name in fields)
    assert caught.value.body["param"] == param and message in caught.value.body["message"]


def test_empty_tools_are_no_tools(client):
    response = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=3, tools=[])
    assert response.choices[0].message.content and response.usage.prompt_tokens == _prompt_tokens(MESSAGES)


# ---- the parsers, without a server -------------------------------------------------------------

def _read(tools, pieces):
    stream = ToolCallStream(tools)
    content, calls = "", []
    for piece in pieces:
        text, made = stream.feed(piece)
        content, calls = content + text, calls + made
    text, made = stream.finish()
    return content + text, [(call.name, json.loads(call.arguments)) for call in calls + made]


def _splits(text: str):
    return st.lists(st.integers(0, len(text)), max_size=8).map(
        lambda cuts: [text[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(text)])])


TWO_CALLS = ('a<b <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> mid <tool_'
             '<tool_call>{"name": "g", "parameters": {}}</tool_call><tool_call>not json</tool_call> end <tool')


@given(_splits(TWO_CALLS))
def test_the_tags_parser_reads_the_same_calls_however_the_text_is_cut(pieces):
    tools = parse_tool_choice(TOOLS, None, None, "tags")
    assert _read(tools, pieces) == (
        "a<b  mid <tool_<tool_call>not json</tool_call> end <tool", [("f", {"x": 1}), ("g", {})])
    single = parse_tool_choice(TOOLS, None, False, "tags")
    assert _read(single, pieces)[1] == [("f", {"x": 1})]


BARE = ' [{"name": "f", "arguments": {"x": [1, 2]}}, {"name": "g", "arguments": "{}"}]'


@given(_splits(BARE))
def test_the_json_parser_takes_a_whole_answer_of_calls(pieces):
    tools = parse_tool_choice(TOOLS, "auto", None, "json")
    assert _read(tools, pieces) == ("", [("f", {"x": [1, 2]}), ("g", {})])
    assert _read(tools, ["plain ", "text {"]) == ("plain text {", [])
    assert _read(tools, ['{"not": "a call"}']) == ('{"not": "a call"}', [])


def test_an_unclosed_last_tag_still_counts_when_it_parses():
    tools = parse_tool_choice(TOOLS, None, None, "tags")
    assert _read(tools, ['<tool_call>{"name": "f", "arguments": {}}']) == ("", [("f", {})])
    assert _read(tools, ["<tool_call>{broken"]) == ("<tool_call>{broken", [])


def test_no_tools_and_no_choice_is_no_tool_handling():
    assert parse_tool_choice(None, None, None, "tags") is None
    assert parse_tool_choice([], "auto", True, "tags") is None
    with pytest.raises(InvalidRequestError, match="needs at least one tool"):
        parse_tool_choice([], "required", None, "tags")
