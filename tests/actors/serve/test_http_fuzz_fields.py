"""Fuzzing the OpenAI HTTP API's fields with hostile values.

Property: whatever value one field of an otherwise valid request holds (a number
past what a float holds, a superscript digit, the wrong container, a part of the
wrong type), every endpoint answers with a status a client can act on (200, or a
4xx whose error has a message), never a 5xx or a connection dropped without an
answer; and afterwards no request is live and every KV block is free. Found this
way: `logit_bias: {"²": 1}` and `temperature: 10**400` each dropped the connection, as
did a chat message's `tool_calls: 1` (the template iterates it) and a response's
`input[0].role: []`. The same holds for values nested inside valid messages, parts,
tools, schemas and items.

CI replays a fixed set of examples; CADENCE_EXPLORE=1 runs many more with fresh seeds.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cadence.actors.cli import demo_model_dir
from cadence.actors.engine import EngineConfig
from cadence.actors.serve.http import HttpConfig
from cadence.actors.serve.server import ServerConfig, ServerThread

from test_server_support import explore

openai = pytest.importorskip("openai")
try:  # the HTTP library the openai client of this version uses
    import httpx2 as httpx
except ImportError:
    import httpx

WAIT_S = 60.0
_ANSWERS = (200, 400, 404, 413, 429)
_WEIRD = st.sampled_from([
    "²", "٣", "", "\u0000", "NaN", "-1", 10**400, -10**400, 1e308, -1e308, 2**63, 2**64, -1, 0, 1, 0.5, True,
    None, [], {}, [[]], [{}], {"a": {}}, ["²"], {"²": 1}, {"1": "x"}, {"1": None}, {"1": [1]}, [None], [True],
    [1e308], [10**400], [-1], [2**63], ["a", 1], {"type": "x"}, {"type": "function"}, {"type": "json_schema"},
    [{"type": "function"}], [{"type": "function", "name": 5}], [{"role": "user"}], [{"role": 5, "content": "x"}],
    [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": {"a": 1}}],
    [{"type": "function_call_output"}], [{"type": "function_call", "call_id": 1}], "x" * 3000,
])
_SAMPLING = ["max_tokens", "n", "temperature", "top_p", "top_k", "min_p", "stop", "seed", "logit_bias",
             "allowed_token_ids", "bad_words", "stop_token_ids", "min_tokens", "stream", "stream_options",
             "response_format", "guided_json", "guided_choice", "structured_outputs", "priority", "tenant",
             "deadline_s", "cache_salt", "presence_penalty", "repetition_penalty", "ignore_eos", "user", "model"]
_ENDPOINTS = {
    "/v1/completions": ({"model": "demo", "prompt": "def ", "max_tokens": 2},
                        _SAMPLING + ["prompt", "echo", "logprobs", "best_of", "truncate_prompt_tokens"]),
    "/v1/chat/completions": ({"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                             _SAMPLING + ["messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                                          "tool_choice", "parallel_tool_calls", "chat_template_kwargs"]),
    "/v1/responses": ({"model": "demo", "input": "hi", "max_output_tokens": 2},
                      _SAMPLING + ["input", "instructions", "max_output_tokens", "tools", "tool_choice", "text",
                                   "top_logprobs", "include", "metadata", "store", "truncation", "reasoning",
                                   "previous_response_id", "background", "conversation"]),
    "/tokenize": ({"model": "demo", "prompt": "hi"}, ["prompt", "messages", "add_special_tokens", "tools"]),
    "/detokenize": ({"model": "demo", "tokens": [5, 6]}, ["tokens"]),
}
_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
_CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
# (path, a valid body, places inside it (key paths) a hostile value is put)
_NESTED = [
    ("/v1/chat/completions",
     {"model": "demo", "max_tokens": 2, "tools": [_TOOL],
      "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                   {"role": "assistant", "content": None, "tool_calls": [_CALL]},
                   {"role": "tool", "tool_call_id": "c", "content": "5"}]},
     [("messages", 0, "content", 0, "text"), ("messages", 0, "content", 0, "type"), ("messages", 0, "name"),
      ("messages", 0, "tool_calls"), ("messages", 1, "tool_calls", 0, "function", "arguments"),
      ("messages", 1, "tool_calls", 0, "function"), ("messages", 1, "tool_calls", 0, "id"),
      ("messages", 2, "tool_call_id"), ("tools", 0, "function", "parameters"), ("tools", 0, "function", "name")]),
    ("/v1/chat/completions",
     {"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "stream": True,
      "stream_options": {"include_usage": True},
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     [("response_format", "json_schema", "schema"), ("response_format", "json_schema", "schema", "type"),
      ("response_format", "json_schema"), ("stream_options", "include_usage")]),
    ("/v1/responses",
     {"model": "demo", "max_output_tokens": 2, "tools": [{"type": "function", "name": "f"}],
      "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "5"}],
      "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}},
     [("input", 0, "role"), ("input", 0, "type"), ("input", 0, "content"), ("input", 0, "content", 0, "text"),
      ("input", 1, "arguments"), ("input", 1, "call_id"), ("input", 2, "output"), ("tools", 0, "parameters"),
      ("text", "format", "schema"), ("text", "format", "name")]),
]
_NESTED_CASES = st.integers(0, len(_NESTED) - 1).flatmap(
    lambda i: st.tuples(st.just(i), st.sampled_from(_NESTED[i][2]), _WEIRD))
_CASES = st.sampled_from(sorted(_ENDPOINTS)).flatmap(
    lambda path: st.tuples(st.just(path), st.sampled_from(_ENDPOINTS[path][1]), _WEIRD))


@pytest.fixture(scope="module")
def base():
    engine = EngineConfig.from_kwargs(executor="inprocess", model=demo_model_dir(), max_model_len=256,
                                      num_blocks=64, block_size=16)
    with ServerThread(engine, ServerConfig(port=0), http=HttpConfig(port=0, served_model_name="demo")) as thread:
        host, port = thread.server.http.address
        with httpx.Client(base_url=f"http://{host}:{port}", timeout=WAIT_S) as client:
            yield client
        state = thread.call(lambda: (len(thread.server.engine.core.requests),
                                     thread.server.engine.core.blocks.num_used_blocks, thread.server.num_inflight))
        assert state == (0, 0, 0), f"left behind (requests, blocks, streams): {state}"


_SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@(_SETTINGS if explore() else settings(_SETTINGS, max_examples=300))
@given(_CASES)
@example(("/v1/completions", "temperature", 10**400))  # the two found this way, always run
@example(("/v1/chat/completions", "logit_bias", {"²": 1}))
def test_a_hostile_field_value_gets_an_answer(base, case):
    path, field, value = case
    body, _ = _ENDPOINTS[path]
    _assert_answered(base, path, {**body, field: value}, (path, field, value))


def _assert_answered(base, path: str, body: dict, what) -> None:
    answer = base.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert answer.status_code in _ANSWERS, (what, answer.status_code, answer.text[:300])
    if answer.status_code != 200:
        assert answer.json()["error"]["message"], answer.text[:300]
    assert base.get("/health").status_code == 200


@(_SETTINGS if explore() else settings(_SETTINGS, max_examples=200))
@given(_NESTED_CASES)
@example((0, ("messages", 0, "tool_calls"), 1))  # found this way, always run
@example((2, ("input", 0, "role"), []))
def test_a_hostile_nested_value_gets_an_answer(base, case):
    import copy

    index, keys, value = case
    path, body, _ = _NESTED[index]
    body = copy.deepcopy(body)
    inner = body
    for key in keys[:-1]:
        inner = inner[key]
    inner[keys[-1]] = value
    _assert_answered(base, path, body, (path, keys, value))
