"""Validation at the door over the wire: the server and the router refuse a request
that the model cannot run with a documented code for that stream, before it is
queued, and keep serving (simulated engines on loopback)."""

from __future__ import annotations

import msgpack
import pytest

from cadence.actors.serve.router import RouterConfig, open_router
from cadence.actors.serve.server import open_server
from cadence.actors.wire import Error, HealthQuery, HealthReply, Output, decode_request, pack_frame

from test_server_support import (
    BYTE_VOCAB, RawConnection, engine_config, server_config, settled,
)


def generate_frame(stream: int, prompt, **params) -> bytes:
    """A raw Generate frame: values no Python client would build pass through msgpack as is."""
    body = [1, "Generate", {"stream": stream, "prompt": prompt, "params": params}]
    return pack_frame(msgpack.packb(body, use_bin_type=True))


async def answer(conn: RawConnection, stream: int):
    """The stream's first Error, or its last Output."""
    while True:
        message = await conn.receive()
        assert message is not None, "the connection closed"
        if type(message) is Error and message.stream == stream:
            return message
        if type(message) is Output and message.stream == stream and message.finished:
            return message


POISON = [
    # (prompt, params, code, words the message holds)
    ([1, 2], {"top_k": 2**63}, "invalid_request", ("top_k", str(2**63))),
    ([1, 2], {"top_k": BYTE_VOCAB + 1}, "invalid_request", ("top_k", f"vocab_size={BYTE_VOCAB}")),
    ([1, 2], {"stop_token_ids": [2**64 - 1]}, "invalid_request", ("stop_token_ids", str(2**64 - 1))),
    ([1, 2], {"min_tokens": 2, "stop_token_ids": [100000]}, "invalid_request",
     ("stop_token_ids", "100000")),
    ([1, 2], {"stop_token_ids": [-1]}, "invalid_request", ("stop_token_ids", "-1")),
    ([1, 2], {"temperature": 1e-308}, "invalid_request", ("temperature", "1e-308")),
    ([1, 2], {"temperature": float("inf")}, "bad_message", ("temperature", "finite")),
    ([1, 2], {"repetition_penalty": 1e-308}, "invalid_request", ("repetition_penalty", "1e-308")),
    ([1, 2], {"top_k": 2.5}, "bad_message", ("top_k", "int")),
    ([1, 2], {"max_tokens": True}, "bad_message", ("max_tokens", "bool")),
    ([1, 2], {"logprobs": 21}, "invalid_request", ("logprobs", "21")),
    ([1, -1], {}, "invalid_request", ("prompt[1]", "-1")),
    ([1, BYTE_VOCAB], {}, "invalid_request", ("prompt[1]", f"vocab_size={BYTE_VOCAB}")),
    ([], {}, "invalid_request", ("prompt",)),
    ("", {}, "invalid_request", ("prompt", "empty")),
]


@pytest.mark.parametrize(("prompt", "params", "code", "words"), POISON)
async def test_the_server_refuses_what_the_model_cannot_run(prompt, params, code, words):
    async with open_server(engine_config(), server_config()) as server:
        conn = await RawConnection.greeted(server)
        await conn.send_bytes(generate_frame(7, prompt, **{"max_tokens": 2, **params}))
        error = await answer(conn, 7)
        assert type(error) is Error and (error.code, error.stream, error.fatal) == (code, 7, False)
        assert all(word in error.message for word in words), error.message
        await conn.send_bytes(generate_frame(8, [1, 2, 3], max_tokens=3))
        assert (await answer(conn, 8)).finish_reason == "length"
        assert not server.engine.closed and server.engine.scheduler.num_restarts == 0
        await conn.aclose()
        await settled(server)


async def test_a_bare_stop_string_is_one_stop_string_on_the_wire():
    async with open_server(engine_config(), server_config()) as server:
        conn = await RawConnection.greeted(server)
        frame = generate_frame(1, "hi", max_tokens=3, stop="abc")
        assert decode_request(frame[4:]).params.stop == ("abc",)
        await conn.send_bytes(frame)
        assert type(await answer(conn, 1)) is Output
        await conn.send_bytes(generate_frame(2, "hi", max_tokens=3, stop=["x" * 257]))
        error = await answer(conn, 2)
        assert error.code == "invalid_request" and "max_stop_chars=256" in error.message
        await conn.aclose()


async def test_a_one_mib_frame_of_half_a_million_stop_strings_is_refused_at_the_door():
    """The frame fits the 1 MiB limit; its stop list is over max_stop_strings, so it
    is refused before any matching, and a Health query right behind it is answered."""
    async with open_server(engine_config(), server_config()) as server:
        conn = await RawConnection.greeted(server)
        frame = generate_frame(1, "hi", max_tokens=16, stop=["\x01"] * 500_000)
        assert len(frame) < server.config.max_frame_bytes
        await conn.send_bytes(frame)
        await conn.send(HealthQuery(2))
        replies = [await conn.receive(), await conn.receive()]  # in either order
        (error,) = [m for m in replies if type(m) is Error]
        assert [type(m) for m in replies].count(HealthReply) == 1
        assert (error.code, error.stream) == ("invalid_request", 1)
        assert "500000 strings" in error.message and "max_stop_strings=16" in error.message
        assert server.engine.stats().num_requests_added == 0
        await conn.aclose()


@pytest.mark.parametrize(("params", "code"), [
    ({"top_k": 2**63}, "invalid_request"),
    ({"stop_token_ids": [BYTE_VOCAB]}, "invalid_request"),
    ({"max_tokens": 10_000}, "request_too_long"),
])
async def test_the_router_refuses_before_any_replica_sees_the_request(params, code):
    """A request no replica could run is refused by the router itself: it is neither
    retried nor sent to a replica."""
    async with open_server(engine_config(max_model_len=8192), server_config()) as replica:
        config = RouterConfig(replicas=(replica.tcp_address,), port=0, max_retries=3)
        async with open_router(config) as router:
            conn = await RawConnection.greeted(router)
            await conn.send_bytes(generate_frame(3, [1, 2], **params))
            error = await answer(conn, 3)
            assert (error.code, error.stream) == (code, 3)
            await conn.send_bytes(generate_frame(4, [1, 2], max_tokens=2))
            assert (await answer(conn, 4)).finish_reason == "length"
            assert replica.engine.stats().num_requests_added == 1
            assert router.num_retries == 0
            await conn.aclose()
