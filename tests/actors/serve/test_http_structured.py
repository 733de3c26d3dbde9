"""Structured output through the doors: the official `openai` client's `response_format`
against a live server on the demo model (sampled outputs parse and validate), Cadence's
`regex` extension, and a bad spec refused as a 400 naming its field or as a msgpack
error frame, while the server goes on serving.
"""

from __future__ import annotations

import json
import re

import pytest

from cadence.actors.client import Client
from cadence.actors.engine import EngineConfig, demo_model_dir
from cadence.actors.serve.http import HttpConfig
from cadence.actors.serve.server import ServerConfig, ServerThread
from cadence.actors.wire import RemoteInvalidRequestError
from cadence.statemachine.sampling import SamplingParams, StructuredOutput
from test_http import API_KEY, client  # noqa: F401  (the openai client of this module's server)

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

NUM_SAMPLES = 20
# Booleans, bounded integers, enums and a short string: a random tiny model can only
# finish it, within max_tokens, if every mask is applied right.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
        "role": {"enum": ["reader", "writer", "owner"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "admin", "role", "tags"],
    "additionalProperties": False,
}
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def served():
    engine = EngineConfig.from_kwargs(executor="inprocess", model=demo_model_dir(), max_model_len=512,
                                      num_blocks=256, block_size=16, max_num_seqs=32)
    http = HttpConfig(port=0, api_key=API_KEY, served_model_name="demo")
    with ServerThread(engine, ServerConfig(port=0), http=http) as thread:
        yield thread


def test_sampled_chat_completions_under_a_json_schema_parse_and_validate(client):
    response = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Describe a user."}], n=NUM_SAMPLES,
        temperature=1.0, max_tokens=MAX_TOKENS,
        response_format={"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA}})
    assert len(response.choices) == NUM_SAMPLES
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert len({choice.message.content for choice in response.choices}) > 1  # sampled, not one answer


def test_a_streamed_json_object_is_an_object(client):
    stream = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Some data."}], temperature=1.0, seed=0,
        max_tokens=MAX_TOKENS, stream=True, response_format={"type": "json_object"})
    chunks = [chunk for chunk in stream if chunk.choices]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)  # an object, not any JSON value


def test_the_regex_extension(client):
    pattern = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
    response = client.completions.create(model="demo", prompt="date = ", n=4, temperature=1.0,
                                         max_tokens=32, extra_body={"regex": pattern})
    for choice in response.choices:
        assert choice.finish_reason == "stop" and re.fullmatch(pattern, choice.text), choice.text


# vLLM's spellings, each with a check that the output obeys it.
_VLLM_SPELLINGS = [
    ({"guided_regex": "[a-c]{5}"}, lambda text: re.fullmatch("[a-c]{5}", text)),
    ({"guided_choice": ["yes (sure)", "no.", "a|b"]}, lambda text: text in ("yes (sure)", "no.", "a|b")),
    ({"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                      "additionalProperties": False}},
     lambda text: type(json.loads(text)["ok"]) is bool),
    ({"guided_grammar": 'root ::= "x" [0-9] [0-9]'}, lambda text: re.fullmatch("x[0-9]{2}", text)),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda text: text in ("left", "right")),
    ({"structured_outputs": {"json": {"enum": [1, 2]}, "json_object": False}},
     lambda text: json.loads(text) in (1, 2)),
    ({"structured_outputs": {"regex": "[0-9]{3}", "json": None}}, lambda text: re.fullmatch("[0-9]{3}", text)),
]


@pytest.mark.parametrize("body, obeys", _VLLM_SPELLINGS)
def test_vllm_structured_output_spellings_are_followed(client, body, obeys):
    response = client.completions.create(model="demo", prompt="answer: ", n=3, temperature=1.0,
                                         max_tokens=MAX_TOKENS, extra_body=body)
    for choice in response.choices:
        assert choice.finish_reason == "stop" and obeys(choice.text), choice.text


@pytest.mark.parametrize("body, param, reason", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", 'response_format: invalid JSON schema: Unsupported type "objectx"'),
    ({"guided_json": {"type": "objectx"}}, "guided_json", 'guided_json: invalid JSON schema'),
    ({"guided_json": "{not json"}, "guided_json", "guided_json: the schema is not JSON"),
    ({"regex": "(["}, "regex", "Unclosed '['"),
    ({"grammar": "root ::= missing"}, "grammar", 'Rule "missing" is not defined'),
    ({"response_format": {"type": "yaml"}}, "response_format", "must be text, json_object or json_schema"),
    ({"regex": "a", "grammar": "root ::= \"a\""}, "grammar", "only one structured output"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     "only one structured output"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "not supported"),
])
def test_a_bad_spec_is_a_400_naming_its_field(client, body, param, reason):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="demo", prompt="x", max_tokens=4, extra_body=body)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param and reason in error["message"]
    assert client.completions.create(model="demo", prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_over_msgpack_a_bad_spec_is_an_error_frame_and_a_good_one_is_followed(served):
    with Client.connect(served.server.tcp_address) as msgpack_client:
        with pytest.raises(RemoteInvalidRequestError, match="^regex: invalid regular expression"):
            msgpack_client.complete("x", SamplingParams(structured_output=StructuredOutput("regex", "(")))
        structured = StructuredOutput("regex", "[a-c]{4}")
        done = msgpack_client.complete("x", SamplingParams(max_tokens=8, structured_output=structured))
        assert done.finish_reason == "stop" and re.fullmatch("[a-c]{4}", done.text)


async def test_a_server_on_the_simulated_executor_follows_the_grammar_too():
    """Server tests on the simulator can use structured output: its byte tokens follow the mask."""
    from cadence.actors.client import open_client
    from cadence.actors.serve.server import open_server
    from test_server_support import engine_config, server_config

    pattern = r"\{\"id\": [0-9]{1,3}, \"ok\": (true|false)\}"
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "ok": {"type": "boolean"}},
              "required": ["id", "ok"], "additionalProperties": False}
    async with open_server(engine_config(), server_config()) as server:
        async with open_client(server.tcp_address) as msgpack_client:
            for i in range(4):
                params = SamplingParams(max_tokens=64, structured_output=StructuredOutput.json_schema(schema))
                done = await msgpack_client.complete(f"request {i}", params)
                assert done.finish_reason == "stop" and re.fullmatch(pattern, done.text), done.text
