"""The HTTP API at the HTTP level, on the simulated engine inside the test's Trio run:
keep-alive, HTTP/1.0, pipelining, routes and methods, limits shared with the msgpack
server, drain, and the expected tokens of the simulated executor."""

from __future__ import annotations

import json

import h11
import pytest
import trio

from cadence.actors.client import open_client
from cadence.actors.serve.http import HttpConfig, HttpServer
from cadence.actors.serve.openai_api import MAX_CHOICES, POISON_ERROR_TYPE, POISON_STATUS
from cadence.actors.serve.server import open_server
from cadence.actors.simulated import Fault, FaultPlan, Poison, SimulatedExecutor

from test_server_support import SLOW_STEP, WAIT_S, engine_config, server_config, settled, wait_until

# A prompt token that marks the poison request of the simulated executor's fault plan.
_MARK = 1


class _HttpClient:
    """A client speaking HTTP/1.1 through h11, for requests no SDK would send."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)

    async def request(self, method: str, path: str, body: object = None, headers=()) -> tuple[int, bytes]:
        data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        head = [("host", "test"), ("content-length", str(len(data))), *headers]
        await self.stream.send_all(
            self.conn.send(h11.Request(method=method, target=path, headers=head))
            + self.conn.send(h11.Data(data=data)) + self.conn.send(h11.EndOfMessage()))
        status, chunks = None, []
        with trio.fail_after(WAIT_S):
            while True:
                event = self.conn.next_event()
                if event is h11.NEED_DATA:
                    self.conn.receive_data(await self.stream.receive_some(1 << 16))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    chunks.append(event.data)
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    break
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        return status, b"".join(chunks)


async def _connect(server) -> _HttpClient:
    return _HttpClient(await trio.open_tcp_stream(*server.http.address))


def _events(body: bytes) -> list:
    """The JSON of each server-sent event ([DONE] as None)."""
    out = []
    for block in body.split(b"\n\n"):
        if block:
            assert block.startswith(b"data: ")
            data = block[len(b"data: "):]
            out.append(None if data == b"[DONE]" else json.loads(data))
    return out


async def test_a_kept_alive_connection_serves_requests_one_after_another():
    async with open_server(engine_config(), server_config(), http=HttpConfig(port=0)) as server:
        client = await _connect(server)
        first = await client.request("POST", "/v1/completions",
                                     {"prompt": [5, 6, 7], "max_tokens": 5, "ignore_eos": True})
        streamed = await client.request("POST", "/v1/completions",
                                        {"prompt": [5, 6, 7], "max_tokens": 5, "ignore_eos": True,
                                         "stream": True})
        assert first[0] == streamed[0] == 200
        whole = json.loads(first[1])
        events = _events(streamed[1])
        assert events[-1] is None
        # The simulated executor's tokens depend on the request id: each answer has its own.
        assert len(whole["choices"][0]["text"]) == 5
        assert len("".join(e["choices"][0]["text"] for e in events[:-1])) == 5
        await client.stream.aclose()
        await settled(server)


async def test_http_1_0_gets_a_close_delimited_stream():
    async with open_server(engine_config(), server_config(), http=HttpConfig(port=0)) as server:
        stream = await trio.open_tcp_stream(*server.http.address)
        body = json.dumps({"prompt": "ab", "max_tokens": 3, "stream": True}).encode()
        await stream.send_all(b"POST /v1/completions HTTP/1.0\r\ncontent-length: "
                              + str(len(body)).encode() + b"\r\n\r\n" + body)
        received = b""
        with trio.fail_after(WAIT_S):
            while data := await stream.receive_some(1 << 16):
                received += data
        head, _, payload = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and b"chunked" not in head.lower()
        assert _events(payload)[-1] is None
        await settled(server)


async def test_routes_methods_and_malformed_bodies():
    async with open_server(engine_config(), server_config(), http=HttpConfig(port=0)) as server:
        client = await _connect(server)
        status, body = await client.request("GET", "/v1/completions")
        assert status == 405
        status, body = await client.request("GET", "/nowhere")
        assert status == 404 and json.loads(body)["error"]["code"] == "not_found"
        status, body = await client.request("POST", "/v1/completions", b"{not json")
        assert status == 400 and "not JSON" in json.loads(body)["error"]["message"]
        status, body = await client.request("POST", "/v1/completions", {"prompt": ["a", 3]})
        assert status == 400 and json.loads(body)["error"]["param"] == "prompt"
        status, body = await client.request(
            "POST", "/v1/completions", {"prompt": "a", "n": MAX_CHOICES + 1})
        assert status == 400 and json.loads(body)["error"]["param"] == "n"
        status, body = await client.request(
            "POST", "/v1/completions", {"prompt": "a", "suffix": "b"})
        assert status == 400 and "not supported" in json.loads(body)["error"]["message"]
        status, body = await client.request("POST", "/v1/completions",
                                            {"prompt": [1] * 9000, "max_tokens": 1})
        error = json.loads(body)["error"]
        assert status == 400 and error["code"] == "request_too_long" and error["param"] == "prompt"
        status, body = await client.request("POST", "/v1/chat/completions",
                                            {"messages": [{"role": "user", "content": "x"}]})
        assert status == 400 and "no chat template" in json.loads(body)["error"]["message"]
        await client.stream.aclose()
        await settled(server)


async def test_the_tenant_limit_counts_msgpack_and_http_streams_together():
    config = server_config(max_inflight_per_tenant=1)
    async with open_server(engine_config(SLOW_STEP), config, http=HttpConfig(port=0)) as server:
        async with open_client(server.tcp_address) as msgpack_client:
            stream = await msgpack_client.generate([1, 2], max_tokens=1000, ignore_eos=True, tenant="t")
            client = await _connect(server)
            status, body = await client.request("POST", "/v1/completions",
                                                {"prompt": [1], "max_tokens": 2, "tenant": "t"})
            assert status == 429 and json.loads(body)["error"]["code"] == "tenant_limit"
            status, _ = await client.request("POST", "/v1/completions",
                                             {"prompt": [1], "max_tokens": 2, "tenant": "u"})
            assert status == 200
            await stream.abort()
            await client.stream.aclose()
        await settled(server)


async def test_draining_answers_503_and_health_says_so():
    async with open_server(engine_config(SLOW_STEP), server_config(shutdown_grace_s=WAIT_S),
                           http=HttpConfig(port=0)) as server:
        client = await _connect(server)
        status, body = await client.request("GET", "/health")
        assert status == 200 and json.loads(body)["status"] == "ok"
        async with open_client(server.tcp_address) as msgpack_client:
            stream = await msgpack_client.generate([1, 2], max_tokens=1000, ignore_eos=True)
            server.shutdown()  # drains while the msgpack stream runs
            status, body = await client.request("GET", "/health")
            assert status == 503 and json.loads(body)["status"] == "draining"
            status, body = await client.request("POST", "/v1/completions", {"prompt": [1]})
            assert status == 503 and json.loads(body)["error"]["code"] == "shutdown"
            await stream.abort()
        await client.stream.aclose()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_poison_request_answers_with_the_poison_flag_as_msgpack_does(stream):
    """The msgpack Error's `poison` flag has its HTTP twin: a 4xx (not retried by
    SDKs) whose error object has its own type, the same code and `poison: true`."""
    executor = SimulatedExecutor(engine_config().latency, vocab_size=257, eos_token_id=256,
                                 sample_ids=range(32, 127),
                                 faults=FaultPlan(poison={_MARK: Poison.REPORTED}))
    config = engine_config(executor=executor, restart_backoff_s=0.01)
    async with open_server(config, server_config(), http=HttpConfig(port=0)) as server:
        client = await _connect(server)
        status, body = await client.request(
            "POST", "/v1/completions", {"prompt": [_MARK, 72, 105], "max_tokens": 4, "stream": stream})
        if stream:
            assert status == 200  # the headers went before the failure
            error = next(e for e in _events(body) if e is not None and "error" in e)["error"]
        else:
            assert status == POISON_STATUS
            error = json.loads(body)["error"]
        assert error["poison"] is True and error["type"] == POISON_ERROR_TYPE
        assert error["code"] == "executor_error"
        status, body = await client.request("POST", "/v1/completions", {"prompt": [72], "max_tokens": 2})
        error = json.loads(body).get("error")
        assert status == 200 and error is None
        status, body = await client.request("POST", "/v1/completions", {"prompt": [1] * 9000})
        assert "poison" not in json.loads(body)["error"]  # only a poison carries the flag
        await client.stream.aclose()
        await settled(server)


async def test_health_answers_200_while_degraded_as_the_engine_still_takes_requests():
    executor = SimulatedExecutor(engine_config().latency, vocab_size=257, eos_token_id=256,
                                 faults=FaultPlan(at={0: Fault.CRASH}))
    config = engine_config(executor=executor, restart_backoff_s=3600.0)
    async with open_server(config, server_config(), http=HttpConfig(port=0)) as server:
        async with open_client(server.tcp_address) as msgpack_client:
            await msgpack_client.generate([1, 2], max_tokens=2)
            await wait_until(lambda: server.engine.scheduler.num_failures == 1, what="the crash")
            client = await _connect(server)
            status, body = await client.request("GET", "/health")
            assert (await msgpack_client.health()).status == "degraded"
            assert status == 200 and json.loads(body)["status"] == "degraded"
            await client.stream.aclose()


@pytest.mark.parametrize("stream", [False, True])
async def test_an_api_key_guards_v1_but_not_health(stream):
    http = HttpConfig(port=0, api_key="secret")
    async with open_server(engine_config(), server_config(), http=http) as server:
        client = await _connect(server)
        body = {"prompt": [1], "max_tokens": 2, "stream": stream}
        status, reply = await client.request("POST", "/v1/completions", body)
        assert status == 401 and json.loads(reply)["error"]["code"] == "invalid_api_key"
        status, _ = await client.request("POST", "/v1/completions", body,
                                         headers=[("authorization", "Bearer secrets")])
        assert status == 401
        status, _ = await client.request("POST", "/v1/completions", body,
                                         headers=[("authorization", "Bearer secret")])
        assert status == 200
        status, _ = await client.request("GET", "/health")
        assert status == 200
        await client.stream.aclose()
        await settled(server)


async def test_pipelined_requests_are_answered_in_order():
    async with open_server(engine_config(SLOW_STEP), server_config(), http=HttpConfig(port=0)) as server:
        stream = await trio.open_tcp_stream(*server.http.address)
        requests = b""
        for max_tokens in (4, 2):
            body = json.dumps({"prompt": [1], "max_tokens": max_tokens, "ignore_eos": True}).encode()
            requests += (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
        await stream.send_all(requests)  # the second arrives while the first is answered
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method="POST", target="/", headers=[("host", "x"), ("content-length", "0")]))
        conn.send(h11.EndOfMessage())
        answers = []
        with trio.fail_after(WAIT_S):
            while len(answers) < 2:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(1 << 16))
                elif isinstance(event, h11.Data):
                    answers.append(json.loads(event.data)["usage"]["completion_tokens"])
                elif isinstance(event, h11.EndOfMessage):
                    conn.start_next_cycle()
                    conn.send(h11.Request(method="POST", target="/",
                                          headers=[("host", "x"), ("content-length", "0")]))
                    conn.send(h11.EndOfMessage())
        assert answers == [4, 2]
        await stream.aclose()
        await settled(server)


@pytest.mark.parametrize("stream,caching", [(False, True), (True, True), (False, False)])
async def test_n_samples_share_their_prompts_computed_blocks(stream, caching):
    block_size, prompt = 16, list(range(1, 41))
    async with open_server(engine_config(block_size=block_size, enable_prefix_caching=caching),
                           server_config(), http=HttpConfig(port=0)) as server:
        client = await _connect(server)
        before = server.engine.stats()
        status, body = await client.request("POST", "/v1/completions", {
            "prompt": prompt, "n": 4, "max_tokens": 6, "ignore_eos": True, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None})
        assert status == 200
        answer = _events(body)[-2] if stream else json.loads(body)
        assert answer["usage"] == {"prompt_tokens": 40, "completion_tokens": 24, "total_tokens": 64,
                                   "prompt_tokens_details": {"cached_tokens": 0}}
        # The four samples are one request group: one computes the prompt, the three
        # others hold its full blocks (all but the block of the last prompt token,
        # which each computes itself), with or without the prefix cache.
        shared = block_size * ((len(prompt) - 1) // block_size)
        after = server.engine.stats()
        assert after.num_shared_prompt_tokens - before.num_shared_prompt_tokens == 3 * shared
        assert after.num_prefix_hit_tokens == before.num_prefix_hit_tokens
        tails, decodes = 3 * (len(prompt) - shared), 4 * (6 - 1)
        assert (after.num_scheduled_tokens - before.num_scheduled_tokens
                == len(prompt) + tails + decodes)
        if stream:
            texts = {}
            for event in _events(body)[:-2]:
                for choice in event["choices"]:
                    texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            assert sorted(texts) == [0, 1, 2, 3] and all(len(t) == 6 for t in texts.values())
        await client.stream.aclose()
        await settled(server)


def _serve_args(*argv: str):
    import argparse

    from cadence.actors.serve.server import add_serve_parser

    parser = argparse.ArgumentParser(prog="cadence")
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_serve_options_describe_the_http_api(tmp_path, monkeypatch):
    from cadence.actors.serve.http import DEFAULT_HTTP_PORT, http_config_from_args
    from cadence.statemachine.errors import ConfigError

    monkeypatch.delenv("CADENCE_API_KEY", raising=False)
    config = http_config_from_args(_serve_args())
    assert (config.host, config.port, config.api_key) == ("127.0.0.1", DEFAULT_HTTP_PORT, None)
    assert http_config_from_args(_serve_args("--port", "0")).port == 0  # beside a free msgpack port
    assert http_config_from_args(_serve_args("--port", "0", "--http-port", "9")).port == 9
    assert http_config_from_args(_serve_args("--no-http")) is None
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    assert http_config_from_args(_serve_args("--api-key-file", str(key_file))).api_key == "s3cret"
    monkeypatch.setenv("CADENCE_API_KEY", "from-env")
    assert http_config_from_args(_serve_args()).api_key == "from-env"
    key_file.write_text("  \n")
    with pytest.raises(ConfigError, match="API key file .* is empty"):
        http_config_from_args(_serve_args("--api-key-file", str(key_file)))
    assert http_config_from_args(_serve_args("--model", "demo")).served_model_name == "demo"


@pytest.mark.parametrize("stream", [False, True])
async def test_requests_outliving_the_drain_end_with_abort(stream):
    async with open_server(engine_config(SLOW_STEP), server_config(shutdown_grace_s=WAIT_S),
                           http=HttpConfig(port=0)) as server:
        client = await _connect(server)
        async with trio.open_nursery() as nursery:
            answers = []

            async def ask() -> None:
                answers.append(await client.request("POST", "/v1/completions", {
                    "prompt": [1, 2], "max_tokens": 5000, "ignore_eos": True, "stream": stream}))

            nursery.start_soon(ask)
            with trio.fail_after(WAIT_S):
                while not server.engine.core.requests:
                    await trio.sleep(0.005)
            server.shutdown(0.05)
        [(status, body)] = answers
        assert status == 200
        if stream:
            events = _events(body)
            assert events[-1] is None and events[-2]["choices"][0]["finish_reason"] == "abort"
        else:
            [choice] = json.loads(body)["choices"]
            assert choice["finish_reason"] == "abort" and 0 < len(choice["text"]) < 5000
        await server.wait_stopped()
        assert not server.http.live and server.num_inflight == 0


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("text, finish_reason", [
    ("plain", None), ('quote " and \\ backslash', "stop"), ("naïve ☃\n\t", "length"), ("", "stop"),
    ("\u2028 line separator", None)])
def test_the_fast_chunk_entry_is_the_entry_json_would_write(chat, text, finish_reason):
    from cadence.actors.request_actor import RequestOutput
    from cadence.actors.serve.openai_api import ApiRequest, Choice
    from cadence.statemachine.sampling import SamplingParams

    request = ApiRequest(chat=chat, response_id="x", created=0, model="m", prompts=[[1]],
                         params=SamplingParams(), stream=True)
    out = RequestOutput("r", [65], text, 1, finish_reason, "", 0.0, None, 0.0, 0)
    choice = Choice(3, 0, None, None)
    fast = choice.delta_json(request, out, str)
    assert json.loads(fast) == choice.delta(request, out, str)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tenant_at_its_limit_may_send_the_next_request_once_an_answer_ends(
        stream, monkeypatch):
    """With one live request allowed per tenant, a client that sends its next
    request the moment the last answer ends (over a new connection, as a pooled
    SDK may) is never refused: the place is given back before the answer's end,
    however long giving it back takes (stretched here, so the order shows)."""
    release = HttpServer._release

    async def slow_release(self, choice):
        await trio.sleep(0.05)
        await release(self, choice)

    monkeypatch.setattr(HttpServer, "_release", slow_release)
    config = server_config(max_inflight_per_tenant=1)
    async with open_server(engine_config(), config, http=HttpConfig(port=0)) as server:
        statuses = []
        for _ in range(10):
            client = await _connect(server)
            status, body = await client.request(
                "POST", "/v1/completions",
                {"prompt": [1, 2], "max_tokens": 2, "tenant": "t", "stream": stream})
            statuses.append((status, body if status != 200 else b""))
            await client.stream.aclose()
        assert statuses == [(200, b"")] * 10
        await settled(server)
