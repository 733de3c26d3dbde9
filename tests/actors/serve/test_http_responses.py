"""POST /v1/responses, driven by the official `openai` client against the demo model:
a response is the chat it means (same prompt tokens, same greedy text), streamed as
OpenAI's typed events, with function tools, structured text and logprobs, and every
refusal names the Responses field.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from cadence.actors.cli import demo_model_dir
from cadence.actors.engine import EngineConfig
from cadence.actors.serve.http import HttpConfig
from cadence.actors.serve.openai_api import ApiError
from cadence.actors.serve.responses_api import chat_body, renamed
from cadence.actors.serve.server import ServerConfig, ServerThread

openai = pytest.importorskip("openai")
try:  # the HTTP library the openai client of this version uses
    import httpx2 as httpx
except ImportError:
    import httpx

MODEL = "demo"
WAIT_S = 60.0
INSTRUCTIONS = "You write Python."
QUESTION = "a function that adds two numbers"
ADD_TOOL = {"type": "function", "name": "add", "description": "Add two integers",
            "parameters": {"type": "object", "required": ["a", "b"], "additionalProperties": False,
                           "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "b": {"type": "integer", "minimum": 0, "maximum": 9}}}}
CHAT_ADD_TOOL = {"type": "function", "function": {k: v for k, v in ADD_TOOL.items() if k != "type"}}
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def served():
    engine = EngineConfig.from_kwargs(executor="inprocess", model=demo_model_dir(), max_model_len=1024,
                                      num_blocks=256, block_size=16, dtype="float32")
    with ServerThread(engine, ServerConfig(port=0), http=HttpConfig(port=0, served_model_name=MODEL)) as thread:
        yield thread


@pytest.fixture
def base(served):
    host, port = served.server.http.address
    return f"http://{host}:{port}/v1"


@pytest.fixture
def client(base):
    with openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=WAIT_S) as client:
        yield client


def _idle(served) -> bool:
    def read():
        server = served.server
        return (len(server.engine.core.requests), server.engine.core.blocks.num_used_blocks,
                server.num_inflight)
    return served.call(read) == (0, 0, 0)


# ---- the answer ---------------------------------------------------------------------------------


def test_a_response_is_the_chat_it_means(client, served):
    """instructions + input render as the system + user chat: the same prompt tokens,
    the same greedy text; cut off by max_output_tokens it is incomplete, saying why."""
    response = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=QUESTION,
                                       max_output_tokens=12, **GREEDY)
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=12, messages=[{"role": "system", "content": INSTRUCTIONS},
                                              {"role": "user", "content": QUESTION}], **GREEDY)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL
    assert response.output_text == chat.choices[0].message.content and response.output_text
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == 12
    assert response.usage.total_tokens == chat.usage.prompt_tokens + 12
    assert response.store is False and response.instructions == INSTRUCTIONS
    # Ended by itself (here at a stop string, a Cadence extension): completed.
    ended = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=400, temperature=0,
                                    extra_body={"stop": [" "]})
    assert ended.status == "completed" and ended.incomplete_details is None
    assert ended.output[0].status == "completed" and ended.usage.output_tokens < 400
    assert _idle(served)


def test_a_streamed_response_arrives_as_typed_events(client, served):
    """The stream is OpenAI's event sequence, numbered from 0 without a gap; its deltas
    make the text of the same request unstreamed, and the SDK's helper assembles it."""
    whole = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=10, **GREEDY)
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=10, stream=True,
                                          **GREEDY))
    kinds = [event.type for event in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * deltas
                     + ["response.output_text.done", "response.content_part.done",
                        "response.output_item.done", "response.completed"])
    assert deltas >= 1 and [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id
    last = events[-1].response
    assert last.status == "incomplete" and last.output_text == whole.output_text
    assert last.usage.output_tokens == 10
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=10, **GREEDY) as stream:
        assert stream.get_final_response().output_text == whole.output_text
    assert _idle(served)


def test_input_items_render_as_the_conversation_they_stand_for(client):
    """Message items (text parts, a developer turn), a function call and its output
    render as the equivalent chat: the same prompt tokens and the same greedy answer."""
    items = [{"role": "developer", "content": INSTRUCTIONS},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
             {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "5"},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"role": "assistant", "content": [{"type": "output_text", "text": "It is 5."}]},
             {"role": "user", "content": "thanks"}]
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"},
                {"role": "assistant", "content": "It is 5."}, {"role": "user", "content": "thanks"}]
    response = client.responses.create(model=MODEL, input=items, tools=[ADD_TOOL], tool_choice="none",
                                       max_output_tokens=8, **GREEDY)
    chat = client.chat.completions.create(model=MODEL, messages=messages, tools=[CHAT_ADD_TOOL],
                                          tool_choice="none", max_tokens=8, **GREEDY)
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == chat.choices[0].message.content


def test_consecutive_function_calls_are_one_assistant_turn():
    body = {"input": [{"role": "user", "content": "x"},
                      {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
                      {"type": "function_call", "call_id": "b", "name": "g", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "a", "output": [{"type": "input_text", "text": "1"}]}]}
    messages = chat_body(body, _Http())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["a", "b"]
    assert messages[2]["content"] == [{"type": "text", "text": "1"}]


def test_a_function_tool_call_is_a_function_call_item(client, served):
    """A named function constrains the answer to its arguments: the output is one
    function_call item whose arguments parse to the schema; streamed, the same item
    arrives as its added / arguments / done events."""
    response = client.responses.create(model=MODEL, input="add 2 and 3", tools=[ADD_TOOL],
                                       tool_choice={"type": "function", "name": "add"},
                                       max_output_tokens=200, temperature=0)
    [call] = response.output
    assert call.type == "function_call" and call.name == "add" and call.call_id.startswith("call_")
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"a", "b"} and all(0 <= v <= 9 for v in arguments.values())
    assert response.status == "completed"
    events = list(client.responses.create(model=MODEL, input="add 2 and 3", tools=[ADD_TOOL],
                                          tool_choice={"type": "function", "name": "add"},
                                          max_output_tokens=200, temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert kinds[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done",
                         "response.completed"]
    assert events[-1].response.output[0].arguments == call.arguments
    assert _idle(served)


def test_text_format_json_schema_and_logprobs(client):
    schema = {"type": "object", "required": ["ok"], "additionalProperties": False,
              "properties": {"ok": {"type": "boolean"}}}
    response = client.responses.create(
        model=MODEL, input="Is it ok? Answer in JSON.", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    assert response.status == "completed" and isinstance(json.loads(response.output_text)["ok"], bool)
    # top_logprobs: each output token's logprob and its alternatives, as the chat reports them.
    answer = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, top_logprobs=2,
                                     include=["message.output_text.logprobs"], **GREEDY)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY)
    got = answer.output[0].content[0].logprobs
    want = chat.choices[0].logprobs.content
    assert [(g.token, g.logprob) for g in got] == [(w.token, w.logprob) for w in want] and len(got) == 4
    assert all(len(g.top_logprobs) == 2 for g in got)


# ---- refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, param, message", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
    ({"conversation": "conv_1"}, "conversation", "stores no responses"),
    ({"background": True}, "background", "stores no responses"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", r"input\[0\]: this server stores"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     r"input\[0\]\.content\[0\]\.type is 'input_image': this model reads text only"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}, "input",
     r"input\[1\]\.role must be one of"),
    ({"input": [{"type": "web_search_call"}]}, "input", r"input\[0\]\.type is 'web_search_call'"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input",
     r"input\[0\]\.call_id must be a string"),
    ({"input": []}, "input", "non-empty"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]", "function tools only"),
    ({"tools": [ADD_TOOL], "tool_choice": {"type": "file_search"}}, "tool_choice", "tool_choice must be"),
    ({"tools": [ADD_TOOL], "tool_choice": {"type": "function", "name": "mul"}}, "tool_choice", "mul"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", r"text\.format\.schema"),
    ({"text": {"format": {"type": "xml"}}}, "text", r"text\.format\.type"),
    ({"truncation": "auto"}, "truncation", "disabled"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "limit is 16"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"max_output_tokens": 10_000}, "max_output_tokens", "max_output_tokens is 10000"),
    ({"input": "x " * 3000}, "input", "max_model_len is 1024"),
    ({"top_logprobs": 21}, "top_logprobs", "top_logprobs"),
    ({"model": "gpt-4o"}, "model", "does not exist"),
])
def test_a_bad_response_request_names_its_field(client, served, fields, param, message):
    body = {"model": MODEL, "input": QUESTION, **fields}
    with pytest.raises(openai.APIStatusError) as caught:
        client.responses.create(**body)
    error = caught.value
    assert error.status_code == (404 if param == "model" else 400)
    assert error.body["param"] == param
    assert re.search(message, error.body["message"]), error.body["message"]
    assert _idle(served)


def test_no_response_is_kept_to_read_back(client):
    with pytest.raises(openai.NotFoundError, match="stores no responses"):
        client.responses.retrieve("resp_123")


def test_a_conversation_past_the_message_limit_is_refused_as_it_arrives(base):
    """The body check counts `"role"` keys in a response's input as in a chat's messages."""
    from cadence.actors.chat import MAX_MESSAGES

    items = [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)
    answer = httpx.post(base + "/responses", json={"model": MODEL, "input": items}, timeout=WAIT_S)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "input"


def test_a_client_gone_mid_stream_frees_its_request(base, served):
    with httpx.stream("POST", base + "/responses", timeout=WAIT_S,
                      json={"model": MODEL, "input": QUESTION, "max_output_tokens": 500, "stream": True,
                            "ignore_eos": True}) as answer:
        lines = answer.iter_lines()
        assert next(lines) == "event: response.created"

    deadline = time.monotonic() + WAIT_S
    while not _idle(served):
        assert time.monotonic() < deadline, "the abandoned response still holds the engine"
        time.sleep(0.01)


# ---- translation ------------------------------------------------------------------------------------


class _Http:
    """What chat_body reads of the HTTP server."""

    class config:
        strict_fields = False

    ignored_fields: set = set()
    model_name = MODEL


def test_chat_errors_name_the_responses_fields():
    """An error the chat machinery raises names what the Responses request sent:
    messages[i] is input[i] (shifted past the instructions' system message)."""
    body = {"instructions": "x", "input": [{"role": "user", "content": "a"}]}
    error = renamed(ApiError(400, "messages[2].content has 2000 parts", param="messages"), body)
    assert error.message == "input[1].content has 2000 parts" and error.param == "input"
    error = renamed(ApiError(400, "messages[0].content: bad", param="messages"), body)
    assert error.message.startswith("instructions.content")
    error = renamed(ApiError(400, "max_completion_tokens: must be >= 1", param="max_completion_tokens"), {})
    assert error.message == "max_output_tokens: must be >= 1" and error.param == "max_output_tokens"
    error = renamed(ApiError(400, "tools[0].function.name must be a string", param="tools[0].function.name"), {})
    assert error.message == "tools[0].name must be a string" and error.param == "tools[0].name"


def test_a_large_input_is_checked_off_the_event_loop(base, served, monkeypatch):
    """The items of a response's input are checked one by one: a body past
    OFF_LOOP_PROMPT_CHARS goes to a worker thread (`run_sized`, sized by its bytes), so a
    megabyte of parts does not hold up every other stream meanwhile."""
    from cadence.actors.engine import OFF_LOOP_PROMPT_CHARS

    original, calls = served.server.run_sized, []

    async def run_sized(size, fn, /, *args, **kwargs):
        calls.append((fn.__name__, size))
        return await original(size, fn, *args, **kwargs)

    monkeypatch.setattr(served.server, "run_sized", run_sized)
    parts = [{"type": "input_text", "text": "a"}] * 600
    payload = json.dumps({"model": MODEL, "input": [{"role": "user", "content": parts}],
                          "max_output_tokens": 1}).encode()
    answer = httpx.post(base + "/responses", content=payload, timeout=WAIT_S,
                        headers={"content-type": "application/json"})
    assert answer.status_code == 200 and answer.json()["usage"]["output_tokens"] == 1
    assert ("chat_body", len(payload)) in calls and len(payload) > OFF_LOOP_PROMPT_CHARS
