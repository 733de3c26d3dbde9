"""Fuzzing a live server with hostile bytes.

Property: whatever one connection sends (random bytes, truncated frames, valid
msgpack of the wrong shape, envelopes with wrong fields, huge declared lengths,
deep nesting), the server never crashes; it answers that connection with
well-formed frames only (Error frames for what it rejects), closing it at most
once and only after a fatal Error or at the peer's end of stream; and a
well-behaved client on another connection keeps streaming correct tokens
throughout. Afterwards no request is live and every KV block is free.

CI replays a fixed set of examples (the derandomised profile); CADENCE_EXPLORE=1
runs many more with fresh seeds.
"""

from __future__ import annotations

import struct

import msgpack
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cadence.actors.client import open_client
from cadence.actors.serve.server import open_server
from cadence.actors.wire import (
    ErrorCode, Error, Generate, HealthQuery, HealthReply, Hello, SamplingParams, StatsQuery, encode,
    pack_frame,
)

from test_server_support import (
    RawConnection, engine_config, expected_tokens, explore, server_config, settled, wait_until,
)

_MAX_FRAME_BYTES = 1 << 16
_CODES = {code.value for code in ErrorCode}
_TYPE_NAMES = ["Hello", "Generate", "Abort", "Stats", "Health", "Welcome", "Output", "Error",
               "Accepted", "StatsReply", "HealthReply", ""]
_FIELD_NAMES = ["stream", "prompt", "params", "priority", "tenant", "deadline_s", "timeout_s",
                "cache_salt", "token", "client", "ref", "max_tokens", "temperature", "stop",
                "stop_token_ids", "seed", "logprobs", "top_p", "ignore_eos", "x"]


def _examples(count: int) -> settings:
    base = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                          HealthCheck.data_too_large])
    if explore():
        return base
    return settings(base, max_examples=count)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1)
    | st.floats(allow_nan=True) | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.sampled_from(_FIELD_NAMES) | st.text(max_size=5), children, max_size=5),
    max_leaves=25,
)
envelopes = st.tuples(
    st.sampled_from([1, 1, 1, 0, 2, -1]) | st.integers(-(2 ** 63), 2 ** 64 - 1),
    st.sampled_from(_TYPE_NAMES) | st.text(max_size=8),
    st.dictionaries(st.sampled_from(_FIELD_NAMES), msgpack_values, max_size=6) | msgpack_values,
).map(lambda t: msgpack.packb(list(t), use_bin_type=True))
valid_frames = st.sampled_from([
    encode(Generate(900, [1, 2, 3], SamplingParams(max_tokens=3))),
    encode(Generate(901, "text", SamplingParams(max_tokens=2, stop=["x"]))),
    encode(HealthQuery(7)),
    encode(StatsQuery(8)),
    encode(Hello()),
])


def _truncate(data: bytes, cut: int) -> bytes:
    return data[:cut % max(1, len(data))]


pieces = st.one_of(
    st.binary(max_size=300),                                                   # random bytes
    st.binary(max_size=200).map(pack_frame),                                   # framed noise
    msgpack_values.map(lambda v: pack_frame(msgpack.packb(v, use_bin_type=True))),  # wrong shape
    envelopes.map(pack_frame),                                                 # wrong fields
    valid_frames.map(pack_frame),                                              # the real thing
    st.tuples(valid_frames.map(pack_frame), st.integers(0, 200)).map(lambda t: _truncate(*t)),
    st.integers(_MAX_FRAME_BYTES + 1, 2 ** 32 - 1).map(lambda n: struct.pack(">I", n)),  # huge
    st.integers(1, 200_000).map(lambda depth: pack_frame(b"\x91" * depth + b"\xc0")
                                if depth < _MAX_FRAME_BYTES else b"\x91" * depth),  # deep nesting
    st.binary(min_size=1, max_size=8).map(lambda b: pack_frame(b"\xd4" + b[:1] + b"\x00")),  # ext type
)


async def _check_hostile_connection(server, junk: bytes, greeted: bool) -> None:
    """Send `junk` then end of stream; every reply must be a valid frame and any
    fatal Error the last one before the server closes."""
    conn = await (RawConnection.greeted(server) if greeted else RawConnection.open(server))
    try:
        await conn.send_bytes(junk)
        await conn.stream.send_eof()
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass  # the server already closed this connection: allowed
    replies = await conn.receive_all()  # decode_reply raises on any malformed frame
    await conn.aclose()
    errors = [m for m in replies if type(m) is Error]
    for error in errors:
        assert error.code in _CODES, error
    fatal = [i for i, m in enumerate(replies) if type(m) is Error and m.fatal]
    assert len(fatal) <= 1
    if fatal:
        assert fatal[0] == len(replies) - 1, replies
    if not greeted and junk[:4] != pack_frame(encode(Hello()))[:4]:
        # Before a Hello, nothing but a Welcome or an Error is ever sent.
        assert all(type(m) in (Error,) or m.TYPE == "Welcome" for m in replies)


@_examples(60)
@given(junk=st.lists(pieces, min_size=1, max_size=4).map(b"".join), greeted=st.booleans())
async def test_hostile_bytes_never_hurt_the_server_or_other_clients(junk, greeted):
    config = server_config(max_frame_bytes=_MAX_FRAME_BYTES, handshake_timeout_s=5.0,
                           max_protocol_errors=1000)
    async with open_server(engine_config(), config) as server:
        async with open_client(server.tcp_address) as good:
            stream = await good.generate([1, 2, 3], max_tokens=64, ignore_eos=True)
            await _check_hostile_connection(server, junk, greeted)
            result = await stream.collect()
            assert result.token_ids == expected_tokens(result.request_id, 3, 64)
            assert (await good.health()).status == "ok"
        await settled(server)
        await wait_until(lambda: not server.connections, what="connections closing")


@_examples(30)
@given(frames=st.lists(st.one_of(envelopes, st.binary(max_size=100),
                                 msgpack_values.map(lambda v: msgpack.packb(v, use_bin_type=True))),
                       min_size=1, max_size=8))
async def test_each_malformed_frame_gets_an_error_and_the_connection_carries_on(frames):
    config = server_config(max_frame_bytes=_MAX_FRAME_BYTES, max_protocol_errors=1000)
    async with open_server(engine_config(), config) as server:
        conn = await RawConnection.greeted(server)
        for frame in frames:
            await conn.send_bytes(pack_frame(frame))
        await conn.send(HealthQuery(123456))
        with trio.fail_after(30):
            while True:
                reply = await conn.receive()
                assert reply is not None, "the server closed a connection that sent whole frames"
                if type(reply) is HealthReply and reply.ref == 123456:
                    break
                if type(reply) is Error:
                    assert reply.code in _CODES, reply
                    # Only another protocol version is fatal for a whole frame.
                    assert not reply.fatal or reply.code == "unsupported_version", reply
                    if reply.fatal:
                        break
        await conn.aclose()
        await settled(server)


@pytest.mark.parametrize("junk", [
    pytest.param(pack_frame(b"\x91" * 60_000 + b"\xc0"), id="deep-nesting"),
    pytest.param(struct.pack(">I", 2 ** 32 - 1) + b"x" * 100, id="4GiB-header"),
    pytest.param(pack_frame(msgpack.packb([1, "Generate", {"stream": 2 ** 64 - 1, "prompt": [1]}])),
                 id="stream-id-too-big"),
    pytest.param(pack_frame(msgpack.packb([1, "Generate", {"stream": 1, "prompt": [1],
                                                           "params": {"temperature": float("nan")}}])),
                 id="nan-temperature"),
    pytest.param(pack_frame(msgpack.packb([1, "Generate", {"stream": 1, "prompt": [True]}])),
                 id="bool-token"),
    pytest.param(pack_frame(msgpack.packb([1, "Generate", {1: 2}], strict_types=False)), id="int-key"),
    pytest.param(pack_frame(b"\x93\x01\xa8Generate\x81\xa6prompt\xa2\xff\xfe"), id="invalid-utf8"),
    pytest.param(pack_frame(b"\xc7\x01\x05x"), id="ext-type"),
    pytest.param(pack_frame(msgpack.packb([1, "Abort", {"stream": -1}])), id="negative-stream"),
    pytest.param(pack_frame(b""), id="empty-frame"),
])
@pytest.mark.parametrize("greeted", [True, False])
async def test_known_nasty_inputs(junk, greeted):
    config = server_config(max_frame_bytes=_MAX_FRAME_BYTES)
    async with open_server(engine_config(), config) as server:
        async with open_client(server.tcp_address) as good:
            await _check_hostile_connection(server, junk, greeted)
            assert (await good.complete([4, 5], max_tokens=8)).finish_reason == "length"
        await settled(server)
