"""The HTTP API's smaller endpoints as vLLM users call them: `/tokenize` and `/detokenize`,
`/v1/models/{id}` (the openai client's `models.retrieve`), HEAD on every GET route, and
CORS for `--allowed-origins` (an OPTIONS preflight, and the header on answers).
"""

from __future__ import annotations

import http.client
import json

import pytest

from cadence.actors.chat import ChatTemplate
from cadence.actors.engine import EngineConfig, demo_model_dir
from cadence.actors.serve.http import HttpConfig, add_http_arguments, http_config_from_args
from cadence.actors.serve.server import ServerConfig, ServerThread
from cadence.gpu.tokenizer import Tokenizer
from cadence.statemachine.errors import ConfigError

openai = pytest.importorskip("openai")

API_KEY = "endpoints-key"
ORIGIN = "https://app.example"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GET_ROUTES = ("/v1/models", "/v1/models/demo", "/health", "/metrics", "/version")


@pytest.fixture(scope="module")
def served():
    engine = EngineConfig.from_kwargs(executor="inprocess", model=demo_model_dir(), max_model_len=256,
                                      num_blocks=64, block_size=16)
    http = HttpConfig(port=0, api_key=API_KEY, served_model_name="demo", allowed_origins=(ORIGIN,))
    with ServerThread(engine, ServerConfig(port=0), http=http) as thread:
        yield thread


class _Answer:
    def __init__(self, response: http.client.HTTPResponse) -> None:
        self.status_code = response.status
        self.headers = {name.lower(): value for name, value in response.getheaders()}
        self.content = response.read()
        self.text = self.content.decode()

    def json(self):
        return json.loads(self.content)


class _Web:
    """One kept-alive HTTP/1.1 connection (http.client reads no body for HEAD)."""

    def __init__(self, address) -> None:
        self.conn = http.client.HTTPConnection(*address, timeout=30.0)

    def request(self, method: str, path: str, json_body=None, headers=None) -> _Answer:
        body = None if json_body is None else json.dumps(json_body).encode()
        headers = {**({"Content-Type": "application/json"} if body else {}), **(headers or {})}
        self.conn.request(method, path, body=body, headers=headers)
        return _Answer(self.conn.getresponse())

    def get(self, path, headers=None):
        return self.request("GET", path, headers=headers)

    def head(self, path, headers=None):
        return self.request("HEAD", path, headers=headers)

    def options(self, path, headers=None):
        return self.request("OPTIONS", path, headers=headers)

    def post(self, path, json=None, headers=None):
        return self.request("POST", path, json, headers)


@pytest.fixture
def web(served):
    client = _Web(served.server.http.address)
    yield client
    client.conn.close()


def _tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(demo_model_dir())


def test_models_retrieve_names_the_served_model(served):
    host, port = served.server.http.address
    with openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key=API_KEY, max_retries=0) as client:
        model = client.models.retrieve("demo")
        assert (model.id, model.object, model.owned_by) == ("demo", "model", "cadence")
        assert model.model_dump()["max_model_len"] == 256
        with pytest.raises(openai.NotFoundError) as caught:
            client.models.retrieve("gpt-4")
        assert caught.value.body["code"] == "model_not_found" and "'gpt-4'" in caught.value.body["message"]


def test_tokenize_and_detokenize_round_trip(web):
    text = "def fibonacci(n):\n    return n"
    answer = web.post("/tokenize", json={"model": "demo", "prompt": text, "return_token_strs": True},
                      headers=AUTH).json()
    ids = _tokenizer().encode(text)
    assert answer["tokens"] == ids and answer["count"] == len(ids) and answer["max_model_len"] == 256
    assert "".join(answer["token_strs"]) == text
    assert web.post("/detokenize", json={"tokens": ids}, headers=AUTH).json() == {"prompt": text}


def test_tokenize_renders_messages_as_a_chat_request_does(web):
    messages = [{"role": "user", "content": "hello"}]
    answer = web.post("/tokenize", json={"messages": messages}, headers=AUTH).json()
    rendered = ChatTemplate.from_dir(demo_model_dir()).render(messages)
    assert answer["tokens"] == _tokenizer().encode(rendered, add_special_tokens=False)
    host_answer = web.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1},
                           headers=AUTH).json()
    assert host_answer["usage"]["prompt_tokens"] == answer["count"]


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/detokenize", {"tokens": [1, -2]}, "tokens"),
    ("/detokenize", {"tokens": [10 ** 6]}, "tokens"),
    ("/detokenize", {"model": "other", "tokens": [1]}, "model"),
])
def test_bad_tokenizer_requests_name_the_field(web, path, body, param):
    response = web.post(path, json=body, headers=AUTH)
    assert response.status_code in (400, 404) and response.json()["error"]["param"] == param


@pytest.mark.parametrize("path, body, param", [
    # The prompt fits: max_tokens is the field to lower (as large as a client may send).
    ("/v1/completions", {"prompt": "hello", "max_tokens": 10 ** 9}, "max_tokens"),
    ("/v1/completions", {"prompt": [5] * 200, "max_tokens": 100}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 300}, "max_tokens"),
    # The prompt alone does not fit (max_model_len 256): the prompt, or a chat's messages.
    ("/v1/completions", {"prompt": [5] * 256, "max_tokens": 1}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 300}], "max_tokens": 1},
     "messages"),
])
def test_a_request_too_long_names_the_field_to_change(web, path, body, param):
    response = web.post(path, json=body, headers=AUTH)
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "request_too_long", error
    assert error["param"] == param and "max_model_len is 256" in error["message"]


def test_the_tokenizer_routes_need_the_key(web):
    assert web.post("/tokenize", json={"prompt": "x"}).status_code == 401
    assert web.get("/tokenize", headers=AUTH).status_code == 405


@pytest.mark.parametrize("path", GET_ROUTES)
def test_head_answers_every_get_route_with_its_head_only(web, path):
    got = web.get(path, headers=AUTH)
    head = web.head(path, headers=AUTH)
    assert got.status_code == head.status_code == 200
    assert head.content == b"" and head.headers["content-type"] == got.headers["content-type"]
    if path != "/metrics":  # the exposition changes between the two calls
        assert head.headers["content-length"] == got.headers["content-length"]
    # The connection is still good after a HEAD (no body was left half-sent).
    assert web.get("/health").status_code == 200


def test_head_on_a_post_route_is_a_405(web):
    response = web.head("/v1/completions", headers=AUTH)
    assert response.status_code == 405 and response.content == b""


def test_cors_preflight_and_headers_for_an_allowed_origin(web):
    preflight = web.options("/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization, content-type"
    answer = web.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                      headers={**AUTH, "Origin": ORIGIN})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == ORIGIN
    stream = web.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True},
                      headers={**AUTH, "Origin": ORIGIN})
    assert stream.headers["access-control-allow-origin"] == ORIGIN and stream.text.endswith("[DONE]\n\n")
    refused = web.post("/v1/completions", json={"prompt": "x"}, headers={"Origin": ORIGIN})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN


def test_another_origin_gets_no_cors_headers(web):
    for response in (web.options("/v1/models", headers={"Origin": "https://evil.example",
                                                        "Access-Control-Request-Method": "GET"}),
                     web.get("/health", headers={"Origin": "https://evil.example"})):
        assert "access-control-allow-origin" not in response.headers
    assert web.options("/health").headers["allow"] == "GET, HEAD, POST, OPTIONS"


def test_allowed_origins_option_takes_vllms_json_list_or_commas():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--model", default="demo")
    add_http_arguments(parser)
    for value, origins in (('["*"]', ("*",)), ("https://a, https://b", ("https://a", "https://b")),
                           (None, ())):
        args = parser.parse_args([] if value is None else ["--allowed-origins", value])
        assert http_config_from_args(args).allowed_origins == origins
    with pytest.raises(ConfigError, match="--allowed-origins"):
        http_config_from_args(parser.parse_args(["--allowed-origins", '["a", 1]']))


def test_vllm_sampling_fields_reach_the_sampler(served):
    host, port = served.server.http.address
    tokenizer = _tokenizer()
    favourite = tokenizer.encode("q", add_special_tokens=False)[0]
    allowed = tokenizer.encode("xyz", add_special_tokens=False)
    with openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key=API_KEY, max_retries=0) as client:
        biased = client.completions.create(model="demo", prompt="def ", max_tokens=4, temperature=0,
                                           logit_bias={str(favourite): 100})
        assert biased.choices[0].text == "q" * 4
        limited = client.completions.create(model="demo", prompt="def ", max_tokens=8, temperature=1.0,
                                            seed=0, extra_body={"allowed_token_ids": allowed})
        assert set(limited.choices[0].text) <= set("xyz")
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="demo", prompt="def ", max_tokens=2,
                                      extra_body={"truncate_prompt_tokens": 0})
        assert caught.value.body["param"] == "truncate_prompt_tokens"


def test_each_request_gets_one_access_log_line(web, caplog):
    import time

    expected = ["GET /health 200", "POST /v1/completions 200", "GET /nowhere 404"]

    def lines():
        return [record.getMessage() for record in caplog.records if record.name == "cadence.http.access"]

    with caplog.at_level("INFO", logger="cadence.http.access"):
        web.get("/health")
        web.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=AUTH)
        web.get("/nowhere")
        deadline = time.monotonic() + 10
        # The line is written once the answer is sent: the client may see the answer first.
        while [line.rsplit(" ", 2)[0] for line in lines()][-3:] != expected:
            assert time.monotonic() < deadline, lines()
            time.sleep(0.01)
    assert all(float(line.split()[-2]) >= 0 for line in lines()[-3:])


def test_an_image_part_is_refused_not_dropped_and_the_engine_serves_on(served):
    """A chat whose message holds an image, as the openai client sends one, gets a 400
    naming the part (param `messages`), streamed or not, and the next request is served:
    a text-only model would otherwise answer about a picture the template dropped."""
    host, port = served.server.http.address
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    question = [{"role": "user", "content": [{"type": "text", "text": "what is this"}, image]}]
    with openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key=API_KEY, max_retries=0) as client:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as caught:
                client.chat.completions.create(model="demo", messages=question, max_tokens=2, stream=stream)
            body = caught.value.body
            assert body["param"] == "messages"
            assert "messages[0].content[1].type is 'image_url': this model reads text only" in body["message"]
        text_only = [{"role": "user", "content": [{"type": "text", "text": "what is this"}]}]
        answer = client.chat.completions.create(model="demo", messages=text_only, max_tokens=2, temperature=0)
        assert answer.usage.completion_tokens == 2


@pytest.mark.parametrize(("field", "value", "says"), [
    ("stop", [f"s{i}" for i in range(17)], "the limit is max_stop_strings=16"),
    ("stop", ["y" * 300], "the limit is max_stop_chars=256"),
    ("logit_bias", {"100000": 1}, "must be a token id in [0, vocab_size="),
    # int() reads "²" as no number and "٣" as 3: only ASCII digits are token ids.
    ("logit_bias", {"²": 1}, "logit_bias must be an int, got '²'"),
    ("logit_bias", {"٣": 1}, "logit_bias must be an int, got '٣'"),
    # JSON integers of any size: past what a float holds (the connection was dropped).
    ("temperature", 10**400, "temperature: must be a finite number, got an integer of 401 digits"),
    ("deadline_s", -10**400, "deadline_s: must be a finite number, got an integer of 401 digits"),
    ("prompt", [1, 2, 10**6], "prompt[2] must be a token id"),
    ("stop_token_ids", [10**6], "stop_token_ids[0] must be a token id"),
])
def test_a_refused_field_is_the_errors_param(served, field, value, says):
    """A field the engine's validation refuses (not the HTTP parser) is named in the
    error's `param`, where the openai client's users look for it, beside the message."""
    host, port = served.server.http.address
    prompt, extra = (value, {}) if field == "prompt" else ("def ", {field: value})
    with openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key=API_KEY, max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="demo", prompt=prompt, max_tokens=2, extra_body=extra)
    assert caught.value.body["param"] == field and says in caught.value.body["message"]
