"""The OpenAI HTTP API, driven by the official `openai` client against the demo model.

One server (msgpack and HTTP, the demo model on the in-process executor) serves
the module from a background thread; each test talks to it over loopback.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from cadence.actors.cli import demo_model_dir
from cadence.actors.engine import EngineConfig
from cadence.actors.serve.http import HttpConfig
from cadence.actors.serve.server import ServerConfig, ServerThread
from cadence.gpu.tokenizer import Tokenizer

openai = pytest.importorskip("openai")

API_KEY = "test-key"
MODEL = "demo"
WAIT_S = 60.0
MAX_BODY_BYTES = 64 * 1024
TENANT_LIMIT = 2
PROMPT = "def fibonacci(n):\n"
MESSAGES = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "a function that adds two numbers"}]


@pytest.fixture(scope="module")
def served():
    # float32, so that logprobs compare with transformers' float32 ones.
    engine = EngineConfig.from_kwargs(executor="inprocess", model=demo_model_dir(), max_model_len=512,
                                      num_blocks=128, block_size=16, dtype="float32")
    http = HttpConfig(port=0, api_key=API_KEY, max_body_bytes=MAX_BODY_BYTES, served_model_name=MODEL)
    with ServerThread(engine, ServerConfig(port=0, max_inflight_per_tenant=TENANT_LIMIT),
                      http=http) as thread:
        yield thread


@pytest.fixture
def client(served):
    host, port = served.server.http.address
    with openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key=API_KEY, max_retries=0,
                       timeout=WAIT_S) as client:
        yield client


def _engine_state(served) -> tuple[int, int, int]:
    """(live requests, KV blocks in use, streams in flight), read in the server's thread."""
    def read():
        server = served.server
        return (len(server.engine.core.requests), server.engine.core.blocks.num_used_blocks,
                server.num_inflight)
    return served.call(read)


def _wait_idle(served) -> None:
    deadline = time.monotonic() + WAIT_S
    while _engine_state(served) != (0, 0, 0):
        assert time.monotonic() < deadline, f"engine not idle: {_engine_state(served)}"
        time.sleep(0.01)


def _prompt_ids(text: str) -> list[int]:
    return Tokenizer.from_pretrained(demo_model_dir()).encode(text)


# ---- completions -----------------------------------------------------------------------------


def test_a_completion_matches_its_stream_and_reports_usage(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    [choice] = whole.choices
    assert whole.object == "text_completion" and whole.model == MODEL
    assert choice.finish_reason == "length" and choice.text
    assert whole.usage.prompt_tokens == len(_prompt_ids(PROMPT))
    assert whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert len({c.id for c in chunks}) == 1


def test_prompts_as_lists_and_token_ids_and_echo(client):
    ids = _prompt_ids(PROMPT)
    out = client.completions.create(model=MODEL, prompt=[PROMPT, ids], max_tokens=5, temperature=0,
                                    echo=True)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == out.choices[1].text  # the same prompt, greedy
    assert out.choices[0].text.startswith(PROMPT) and len(out.choices[0].text) > len(PROMPT)
    assert out.usage.prompt_tokens == 2 * len(ids)


def test_n_gives_n_choices_of_one_prompt(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=2, seed=3,
                                    temperature=1.0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.choices[0].text != out.choices[1].text  # each sample has a seed of its own
    assert out.usage.prompt_tokens == len(_prompt_ids(PROMPT))  # the prompt counted once
    assert out.usage.completion_tokens == 2 * 6


def test_logprobs_in_openai_shape(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True})
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert "".join(logprobs.tokens) == out.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    for value, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert value <= 0 and len(top) == 3
        # Greedy: the chosen token is the most likely one.
        assert value == pytest.approx(max(top.values()), abs=1e-4)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == chat.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)


def _hf_prompt_logprobs(ids: list[int]):
    """Row p: transformers' log-softmax at position p (it scores token p + 1) on the demo model."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(demo_model_dir(), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(client):
    ids = _prompt_ids(PROMPT)
    num_prompt, num_top = len(ids), 2
    ask = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=num_top,
               extra_body={"ignore_eos": True})
    plain = client.completions.create(**ask).choices[0]
    echoed = client.completions.create(echo=True, **ask).choices[0]
    logprobs = echoed.logprobs
    assert echoed.text == PROMPT + plain.text
    assert len(logprobs.tokens) == num_prompt + 4
    assert "".join(logprobs.tokens[:num_prompt]) == PROMPT
    # The completion's part is the plain answer's, its offsets after the prompt's text.
    assert logprobs.tokens[num_prompt:] == plain.logprobs.tokens
    assert logprobs.token_logprobs[num_prompt:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-4)
    assert logprobs.text_offset[num_prompt:] == [len(PROMPT) + o for o in plain.logprobs.text_offset]
    assert logprobs.text_offset[:num_prompt] == [len("".join(logprobs.tokens[:i])) for i in range(num_prompt)]
    # The prompt's part: nothing for its first token, transformers' values for the others.
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    reference = _hf_prompt_logprobs(ids)
    for position in range(1, num_prompt):
        row = reference[position - 1]
        assert logprobs.token_logprobs[position] == pytest.approx(row[ids[position]].item(), abs=1e-4)
        top = sorted(logprobs.top_logprobs[position].values(), reverse=True)
        assert top == pytest.approx(row.topk(num_top).values.tolist(), abs=1e-4)
    # Streamed: the first chunk echoes the prompt with the same logprobs.
    chunks = list(client.completions.create(echo=True, stream=True, **ask))
    first = chunks[0].choices[0]
    assert first.text == PROMPT
    assert first.logprobs.tokens == logprobs.tokens[:num_prompt]
    assert first.logprobs.token_logprobs[1:] == pytest.approx(logprobs.token_logprobs[1:num_prompt], abs=1e-4)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.text
    # Each of n samples echoes the prompt with its logprobs (the streamed request's
    # places are given back before its [DONE], so the tenant has room for both).
    pair = client.completions.create(echo=True, n=2, **ask).choices
    for choice in pair:
        assert choice.logprobs.tokens == logprobs.tokens
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(logprobs.token_logprobs[1:], abs=1e-4)


def test_a_stop_string_ends_the_text_before_it(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[10:13]
    cut = base.index(stop)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                    stop=[stop])
    assert out.choices[0].text == base[:cut]
    assert out.choices[0].finish_reason == "stop"


def test_a_seed_reproduces_a_sampled_completion(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text
    first = sample(11)
    assert sample(11) == first
    assert sample(12) != first


# ---- chat ------------------------------------------------------------------------------------


def test_chat_streams_what_it_answers_whole(client):
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10,
                                           temperature=0, extra_body={"ignore_eos": True})
    [choice] = whole.choices
    assert whole.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


# ---- errors ----------------------------------------------------------------------------------


def test_an_invalid_field_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, top_p=3.0)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == "top_p" and "top_p" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens="many")
    assert caught.value.body["param"] == "max_tokens"


def test_unknown_fields_are_ignored_and_logged_once_per_name(client, caplog):
    extra = {"store": True, "metadata": {"k": "v"}, "service_tier": "auto", "temprature": 1}
    with caplog.at_level("WARNING", logger="cadence.http"):
        for _ in range(2):
            response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                                      extra_body=extra)
            assert response.usage.completion_tokens == 3
    logged = [record.getMessage() for record in caplog.records if "is ignored" in record.getMessage()]
    assert sorted(logged) == sorted(f"the request field {name!r} is not supported and is ignored "
                                    "(logged once per field name; --strict-fields refuses it)"
                                    for name in extra)


async def test_strict_fields_refuse_an_unknown_field_and_an_answer_changing_one_is_always_refused():
    from types import SimpleNamespace

    from cadence.actors.serve.openai_api import ApiError, parse_request

    for strict, name, message in ((True, "temprature", "unknown field 'temprature'"),
                                  (True, "suffix", "suffix is not supported by this server"),
                                  (False, "suffix", "suffix is not supported by this server")):
        http = SimpleNamespace(config=HttpConfig(strict_fields=strict), ignored_fields=set(), model_name=MODEL)
        with pytest.raises(ApiError) as caught:
            await parse_request({"prompt": PROMPT, name: 1}, False, http)
        assert (caught.value.status, caught.value.param, caught.value.message) == (400, name, message)


def test_a_wrong_key_is_a_401_and_an_unknown_model_a_404(served, client):
    host, port = served.server.http.address
    with openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as caught:
            bad.completions.create(model=MODEL, prompt=PROMPT)
        assert caught.value.status_code == 401
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-model", prompt=PROMPT)
    assert caught.value.body["param"] == "model"
    assert [m.id for m in client.models.list()] == [MODEL]


def test_a_body_over_the_limit_is_a_413(served):
    host, port = served.server.http.address
    body = json.dumps({"model": MODEL, "prompt": "x" * MAX_BODY_BYTES}).encode()
    with socket.create_connection((host, port), timeout=WAIT_S) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer "
                     + API_KEY.encode() + b"\r\ncontent-length: " + str(len(body)).encode()
                     + b"\r\n\r\n")
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413 ")
    assert b'"code":"body_too_large"' in reply


def test_the_tenant_limit_is_shared_and_a_429(served, client):
    streams = [client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=400, stream=True,
        extra_body={"ignore_eos": True, "tenant": "t"}) for _ in range(TENANT_LIMIT)]
    try:
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"tenant": "t"})
        assert caught.value.body["code"] == "tenant_limit"
        other = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                          extra_body={"tenant": "u"})
        assert other.usage.completion_tokens >= 1
    finally:
        for stream in streams:
            stream.close()
    _wait_idle(served)


def _num_aborted(served) -> int:
    return served.call(lambda: served.server.engine.stats().completed_by_reason.get("abort", 0))


def test_a_client_leaving_mid_stream_aborts_its_request(served, client):
    _wait_idle(served)
    aborted = _num_aborted(served)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].finish_reason is None
    live, used, inflight = _engine_state(served)
    assert live == 1 and used > 0 and inflight == 1
    stream.close()
    _wait_idle(served)  # its blocks freed
    assert _num_aborted(served) == aborted + 1  # by the abort, not by running to its end


def test_a_client_leaving_before_a_whole_answer_aborts_its_request(served):
    """No write to the client would fail here: only watching its socket notices it left."""
    _wait_idle(served)
    aborted = _num_aborted(served)
    host, port = served.server.http.address
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}).encode()
    with socket.create_connection((host, port), timeout=WAIT_S) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer "
                     + API_KEY.encode() + b"\r\ncontent-length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        deadline = time.monotonic() + WAIT_S
        while _engine_state(served)[0] == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    _wait_idle(served)
    assert _num_aborted(served) == aborted + 1


def test_health_and_version_need_no_key_and_metrics_do(served, client):
    import httpx2 as httpx

    host, port = served.server.http.address
    base = f"http://{host}:{port}"
    health = httpx.get(base + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert httpx.get(base + "/metrics").status_code == 401
    metrics = httpx.get(base + "/metrics", headers={"authorization": f"Bearer {API_KEY}"}).text
    assert re.search(r"^cadence_generation_tokens_total \d", metrics, re.M)
    assert httpx.get(base + "/version").json()["version"]


def test_cadence_serve_answers_the_openai_client():
    """The README's example, against a `cadence serve` process."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CADENCE_API_KEY": API_KEY}
    process = subprocess.Popen(
        [sys.executable, "-m", "cadence.actors.serve.server", "--model", "demo", "--port", "0",
         "--max-model-len", "256", "--num-blocks", "64", "--log-level", "error"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = process.stdout.readline()
        match = re.search(r"OpenAI API on (http://[\d.]+:\d+/v1)", line)
        assert match, f"unexpected first line {line!r}; stderr: {process.stderr.read()}"
        with openai.OpenAI(base_url=match.group(1), api_key=API_KEY, max_retries=0) as api:
            chat = api.chat.completions.create(model="demo", max_tokens=8, messages=[
                {"role": "user", "content": "Write a function that adds two numbers."}])
        assert chat.choices[0].message.content and chat.usage.completion_tokens <= 8
    finally:
        process.terminate()
        process.wait(WAIT_S)


async def test_large_sampling_fields_are_built_off_the_event_loop():
    """The entries of logit_bias, allowed_token_ids, bad_words, stop_token_ids and stop
    size the build of the parameters for `run_sized`: past OFF_LOOP_PROMPT_CHARS it goes
    to a worker thread, so a request carrying 10^5 logit biases does not hold up every
    stream while each entry is checked; a small one is built on the loop as before."""
    from types import SimpleNamespace

    from cadence.actors.engine import OFF_LOOP_PROMPT_CHARS
    from cadence.actors.serve.openai_api import parse_request

    sizes = []

    async def run_sized(size, fn, /, *args, **kwargs):
        sizes.append((size, fn.__name__))
        return fn(*args, **kwargs)

    engine = SimpleNamespace(core=SimpleNamespace(config=SimpleNamespace(max_model_len=256)))
    http = SimpleNamespace(config=HttpConfig(), ignored_fields=set(), model_name=MODEL, engine=engine,
                           server=SimpleNamespace(run_sized=run_sized))
    many = {str(i): 1.0 for i in range(100_000)}
    request = await parse_request({"prompt": PROMPT, "max_tokens": 2, "logit_bias": many,
                                   "allowed_token_ids": [5] * 1000, "stop": ["a", "bc"]}, False, http)
    assert sizes == [(100_000 + 1000 + 2, "_sampling_params")] and sizes[0][0] > OFF_LOOP_PROMPT_CHARS
    assert len(request.params.logit_bias) == 100_000
    sizes.clear()
    await parse_request({"prompt": PROMPT, "max_tokens": 2, "stop": "end"}, False, http)
    assert sizes == [(3, "_sampling_params")]
