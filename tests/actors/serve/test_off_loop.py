"""One large request's own work (rendering a conversation, hashing a long prompt's
blocks for the router) runs off the event loop: while it is under way, another
client's stream gets every one of its tokens.

Each test makes that work wait for the test's go-ahead, as a very large request
would take long. Run on the event loop, it would hold every other stream until
then, and the other client's tokens would come only after it returned; off the
loop, they all come while it still waits. No timing is asserted: only the order
of the two events.
"""

from __future__ import annotations

import json
import threading

import trio

from cadence.actors.client import open_client
from cadence.actors.engine import OFF_LOOP_PROMPT_CHARS
from cadence.actors.serve import connection as connection_module
from cadence.actors.serve import router as router_module
from cadence.actors.serve.http import HttpConfig
from cadence.actors.serve.router import RouterConfig, open_router
from cadence.actors.serve.server import open_server
from cadence.actors.wire import Generate, Output, SamplingParams

from test_server_support import WAIT_S, RawConnection, engine_config, server_config, settled, wait_until

# How long the held-up work waits at most (only reached when it runs on the event
# loop, i.e. when the test fails).
_HOLD_S = 5.0
# Tokens the other client's request streams while the large request's work waits.
_OTHER_TOKENS = 16
_LARGE_TEXT = "x" * (OFF_LOOP_PROMPT_CHARS + 1)


class _HeldWork:
    """Wraps a function so that a call on a large first argument waits for
    `release()`, noting which thread ran it and whether it had returned when the
    other client was served (calls on small ones just run)."""

    def __init__(self, fn) -> None:
        self._fn = fn
        self.started = threading.Event()
        self._go = threading.Event()
        self.returned = False
        self.thread: int | None = None

    def __call__(self, *args, **kwargs):
        if len(str(args[0])) <= OFF_LOOP_PROMPT_CHARS:
            return self._fn(*args, **kwargs)
        self.thread = threading.get_ident()
        self.started.set()
        self._go.wait(_HOLD_S)
        self.returned = True
        return self._fn(*args, **kwargs)

    def release(self) -> None:
        self._go.set()


class _HeldChat:
    """Stands in for `EngineChat`: its rendering is the held work."""

    def __init__(self, held: _HeldWork) -> None:
        self.prompt_ids = held


async def _other_client_is_served_meanwhile(address, held: _HeldWork) -> None:
    """While `held` waits, another client's request streams all its tokens."""
    await wait_until(held.started.is_set, what="the large request's work started")
    async with open_client(address, timeout_s=WAIT_S) as client:
        result = await client.complete([5, 6, 7], max_tokens=_OTHER_TOKENS, ignore_eos=True)
    assert len(result.token_ids) == _OTHER_TOKENS
    assert not held.returned, "the other client waited for the large request's work"
    held.release()
    assert held.thread != threading.get_ident()


async def _read_finished_output(conn: RawConnection, stream: int) -> Output:
    while True:
        message = await conn.receive()
        assert type(message) is Output and message.stream == stream, message
        if message.finished:
            return message


async def test_a_large_conversation_is_rendered_off_the_loop_over_msgpack():
    async with open_server(engine_config(), server_config()) as server:
        held = _HeldWork(lambda messages, **_: [72, 105])
        server.chat = _HeldChat(held)
        conn = await RawConnection.greeted(server)
        await conn.send(Generate(1, None, SamplingParams(max_tokens=2),
                                 messages=[{"role": "user", "content": _LARGE_TEXT}]))
        await _other_client_is_served_meanwhile(server.tcp_address, held)
        accepted = await conn.receive()
        assert accepted.num_prompt_tokens == 2  # the rendered prompt's count, from the engine
        assert (await _read_finished_output(conn, 1)).num_tokens == 2
        await conn.aclose()
        await settled(server)


async def test_a_large_frame_is_decoded_off_the_loop(monkeypatch):
    """Decoding a Generate checks each of its entries (a 2.6 MB frame of prompt ids and
    logit biases took 0.2 s): a frame past OFF_LOOP_PROMPT_CHARS bytes is decoded in a
    worker thread, so another client's tokens keep coming meanwhile."""
    held = _HeldWork(connection_module.decode_request)
    monkeypatch.setattr(connection_module, "decode_request", held)
    engine = engine_config(max_model_len=2 * OFF_LOOP_PROMPT_CHARS)
    async with open_server(engine, server_config()) as server:
        conn = await RawConnection.greeted(server)
        await conn.send(Generate(1, [7] * (OFF_LOOP_PROMPT_CHARS + 1), SamplingParams(max_tokens=2)))
        await _other_client_is_served_meanwhile(server.tcp_address, held)
        accepted = await conn.receive()
        assert accepted.num_prompt_tokens == OFF_LOOP_PROMPT_CHARS + 1
        assert (await _read_finished_output(conn, 1)).num_tokens == 2
        await conn.aclose()
        await settled(server)


async def test_a_large_conversation_is_rendered_off_the_loop_over_http():
    async with open_server(engine_config(), server_config(), http=HttpConfig(port=0)) as server:
        held = _HeldWork(lambda messages, **_: [72, 105])
        server.http.chat = _HeldChat(held)
        body = json.dumps({"messages": [{"role": "user", "content": _LARGE_TEXT}],
                           "max_tokens": 2}).encode()
        stream = await trio.open_tcp_stream(*server.http.address)
        await stream.send_all(b"POST /v1/chat/completions HTTP/1.0\r\ncontent-length: "
                              + str(len(body)).encode() + b"\r\n\r\n" + body)
        await _other_client_is_served_meanwhile(server.tcp_address, held)
        received = b""
        with trio.fail_after(WAIT_S):
            while data := await stream.receive_some(1 << 16):
                received += data
        head, _, payload = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 "), head
        assert json.loads(payload)["usage"]["prompt_tokens"] == 2
        await stream.aclose()
        await settled(server)


async def test_the_router_hashes_a_long_prompt_off_the_loop(monkeypatch):
    held = _HeldWork(router_module.prompt_block_keys)
    monkeypatch.setattr(router_module, "prompt_block_keys", held)
    engine = engine_config(max_model_len=2 * OFF_LOOP_PROMPT_CHARS)
    async with open_server(engine, server_config()) as replica:
        config = RouterConfig(replicas=(replica.tcp_address,), port=0)
        async with open_router(config) as router:
            conn = await RawConnection.greeted(router)
            await conn.send(Generate(1, [7] * (OFF_LOOP_PROMPT_CHARS + 1), SamplingParams(max_tokens=2)))
            await _other_client_is_served_meanwhile(router.tcp_address, held)
            await conn.receive()  # Accepted
            assert (await _read_finished_output(conn, 1)).num_tokens == 2
            await conn.aclose()
