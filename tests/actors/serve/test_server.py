"""End to end over real sockets: streaming, abort, disconnects, auth, every limit, shutdown.

Each test opens a simulated engine and a server on loopback (TCP port 0
and/or a Unix socket in a temporary directory) inside its own Trio run.
"""

from __future__ import annotations

import os
import stat
import struct

import msgpack
import pytest
import trio

from cadence.actors.client import open_client
from cadence.actors.detokenizer import ByteTokenizer
from cadence.actors.serve.server import ServerConfig, open_server
from cadence.actors.wire import (
    Abort, Accepted, AuthenticationError, Error, ErrorCode, Generate, HealthQuery, HealthReply,
    LimitExceededError, Output, RemoteInvalidRequestError, RemoteQueueFullError,
    RemoteRequestTooLongError, SamplingParams, ServerShutdownError, StatsQuery, StatsReply, encode,
    pack_frame,
)
from cadence.statemachine.errors import ConfigError, QueueFullError, RequestTooLongError

from test_server_support import (
    SLOW_STEP, WAIT_S, RawConnection, assert_engine_clean, settled, engine_config, expected_tokens,
    server_config, wait_until,
)


async def _stream_messages(conn: RawConnection, stream: int) -> list:
    """Messages of one stream until it ends (Output with a finish_reason, or Error)."""
    out = []
    while True:
        message = await conn.receive()
        assert message is not None, f"connection closed before stream {stream} ended"
        if getattr(message, "stream", None) != stream:
            continue
        out.append(message)
        if type(message) is Error or (type(message) is Output and message.finished):
            return out


# ---- streaming -------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["tcp", "unix"])
async def test_two_concurrent_streams_deliver_the_expected_tokens_and_text(transport, tmp_path):
    path = str(tmp_path / "cadence.sock")
    config = server_config(unix_path=path)
    async with open_server(engine_config(), config) as server:
        assert server.tcp_address[0] == "127.0.0.1"  # loopback unless asked otherwise
        address = f"unix:{path}" if transport == "unix" else server.tcp_address
        async with open_client(address) as client:
            assert client.welcome.vocab_size == 257 and client.welcome.has_tokenizer
            text_stream = await client.generate("Hello, world", max_tokens=40)
            ids_stream = await client.generate([5, 6, 7], max_tokens=25, ignore_eos=True)
            text_result = await text_stream.collect()
            ids_result = await ids_stream.collect()
        prompt_len = len(ByteTokenizer().encode("Hello, world"))
        assert text_result.num_prompt_tokens == prompt_len
        assert text_result.token_ids == expected_tokens(text_result.request_id, prompt_len, 40)
        assert text_result.text == ByteTokenizer().decode(text_result.token_ids)
        assert text_result.finish_reason == "length"
        assert ids_result.token_ids == expected_tokens(ids_result.request_id, 3, 25)
        assert ids_result.request_id != text_result.request_id
        await settled(server)


async def test_deltas_arrive_in_order_and_count_every_token():
    async with open_server(engine_config(), server_config()) as server:
        conn = await RawConnection.greeted(server)
        await conn.send(Generate(7, [1, 2, 3], SamplingParams(max_tokens=30)))
        messages = await _stream_messages(conn, 7)
        assert type(messages[0]) is Accepted and messages[0].num_prompt_tokens == 3
        outputs = messages[1:]
        assert all(type(m) is Output for m in outputs)
        counts = [m.num_tokens for m in outputs]
        assert counts == sorted(counts) and counts[-1] == 30
        assert sum(len(m.token_ids) for m in outputs) == 30
        assert [m.finish_reason for m in outputs[:-1]] == [None] * (len(outputs) - 1)
        assert outputs[-1].finish_reason == "length"
        await conn.aclose()


async def test_abort_ends_the_stream_with_abort_and_frees_its_blocks():
    async with open_server(engine_config(SLOW_STEP), server_config()) as server:
        async with open_client(server.tcp_address) as client:
            stream = await client.generate([1] * 40, max_tokens=5000, ignore_eos=True)
            first = await stream.__anext__()
            assert first.token_ids
            await stream.abort()
            rest = [out async for out in stream]
            assert rest[-1].finish_reason == "abort"
            assert rest[-1].detail == "aborted by client"
            assert rest[-1].num_tokens < 5000
            await settled(server)
            # The connection stays usable.
            result = await client.complete([1, 2], max_tokens=3)
            assert result.finish_reason == "length"


async def test_stats_and_health_answer_with_their_ref():
    async with open_server(engine_config(), server_config()) as server:
        conn = await RawConnection.greeted(server)
        await conn.send(Generate(1, [1, 2], SamplingParams(max_tokens=4)))
        await _stream_messages(conn, 1)
        await conn.send(StatsQuery(41))
        await conn.send(HealthQuery(42))
        stats, health = await conn.receive(), await conn.receive()
        assert type(stats) is StatsReply and stats.ref == 41
        assert stats.stats["num_requests_completed"] == 1
        assert stats.stats["num_tokens_generated"] == 4
        assert stats.stats["num_connections"] == 1
        assert stats.stats["num_free_blocks"] == stats.stats["num_blocks"]
        assert all(type(key) is str for key in stats.stats["batch_size_distribution"])
        assert type(health) is HealthReply and health.ref == 42
        assert health.status == "ok" and health.num_running == 0 and health.num_connections == 1
        await conn.aclose()


# ---- disconnects -----------------------------------------------------------------------------


async def test_disconnect_mid_stream_aborts_every_request_of_the_connection_in_one_step():
    engine = engine_config(SLOW_STEP, record_trace=True)
    async with open_server(engine, server_config()) as server:
        bystander = await RawConnection.greeted(server)
        await bystander.send(Generate(0, [9, 9], SamplingParams(max_tokens=200, ignore_eos=True)))
        conn = await RawConnection.greeted(server)
        for sid in range(3):
            await conn.send(Generate(sid, [1, 2, 3, sid], SamplingParams(max_tokens=5000, ignore_eos=True)))
        seen: set[int] = set()
        while len(seen) < 3:
            message = await conn.receive()
            if type(message) is Output and message.token_ids:
                seen.add(message.stream)
        await conn.aclose()
        await wait_until(lambda: server.num_inflight <= 1, what="the three streams ending")
        aborts = [r for r in server.engine.trace.records if r["event"] == "abort"]
        assert len(aborts) == 3
        assert len({r["step"] for r in aborts}) == 1, aborts  # all before the same next step
        # The other client is untouched.
        messages = await _stream_messages(bystander, 0)
        assert messages[-1].finish_reason == "length" and messages[-1].num_tokens == 200
        await settled(server)
        await bystander.aclose()


async def test_truncated_frame_then_close_aborts_and_frees():
    async with open_server(engine_config(SLOW_STEP), server_config()) as server:
        conn = await RawConnection.greeted(server)
        await conn.send(Generate(0, [1, 2, 3], SamplingParams(max_tokens=5000, ignore_eos=True)))
        assert type(await conn.receive()) is Accepted
        await conn.send_bytes(pack_frame(encode(StatsQuery(1)))[:-2])  # cut short
        await conn.aclose()
        with trio.fail_after(WAIT_S):
            await server.engine.wait_idle()
        await wait_until(lambda: not server.connections, what="the connection closing")
        assert_engine_clean(server)


# ---- authentication ----------------------------------------------------------------------------


async def test_token_is_required_when_configured():
    async with open_server(engine_config(), server_config(token="s3cret")) as server:
        async with open_client(server.tcp_address, token="s3cret") as client:
            assert (await client.complete([1], max_tokens=2)).finish_reason == "length"
        for wrong in ("nope", None, "s3cret "):
            with pytest.raises(AuthenticationError) as info:
                async with open_client(server.tcp_address, token=wrong):
                    pass
            assert info.value.code == "unauthorized" and info.value.fatal
        # A request before Hello is refused too.
        conn = await RawConnection.open(server)
        await conn.send(Generate(0, [1], SamplingParams(max_tokens=1)))
        (error,) = await conn.receive_all()
        assert error.code == ErrorCode.HANDSHAKE_REQUIRED and error.fatal
        await conn.aclose()
        assert server.engine.stats().num_requests_added == 1


async def test_a_token_is_ignored_when_auth_is_off():
    async with open_server(engine_config(), server_config()) as server:
        async with open_client(server.tcp_address, token="anything") as client:
            assert (await client.complete([1], max_tokens=2)).finish_reason == "length"


# ---- limits --------------------------------------------------------------------------------------


async def test_frame_size_limit_closes_with_an_error_naming_it():
    async with open_server(engine_config(), server_config(max_frame_bytes=1000)) as server:
        conn = await RawConnection.greeted(server)
        await conn.send(Generate(0, list(range(2000)), SamplingParams(max_tokens=1)))
        (error,) = await conn.receive_all()
        assert error.code == ErrorCode.FRAME_TOO_LARGE and error.limit == "max_frame_bytes"
        assert error.fatal
        await conn.aclose()
        # A header declaring 4 GiB is refused before any body is read.
        conn = await RawConnection.greeted(server)
        await conn.send_bytes(struct.pack(">I", 0xFFFFFFFF))
        (error,) = await conn.receive_all()
        assert error.code == ErrorCode.FRAME_TOO_LARGE and "4294967295" in error.message
        await conn.aclose()


async def test_connection_limit():
    async with open_server(engine_config(), server_config(max_connections=2)) as server:
        async with open_client(server.tcp_address), open_client(server.tcp_address):
            with pytest.raises(LimitExceededError) as info:
                async with open_client(server.tcp_address):
                    pass
            assert info.value.limit == "max_connections"
        await wait_until(lambda: not server.connections, what="connections closing")
        async with open_client(server.tcp_address) as client:  # room again
            await client.health()


async def test_inflight_limit_per_connection():
    async with open_server(engine_config(SLOW_STEP), server_config(max_inflight_per_connection=2)) as server:
        async with open_client(server.tcp_address) as client:
            first = await client.generate([1], max_tokens=50)
            second = await client.generate([2], max_tokens=50)
            third = await client.generate([3], max_tokens=50)
            with pytest.raises(LimitExceededError) as info:
                await third.collect()
            assert info.value.limit == "max_inflight_per_connection"
            assert info.value.code == "too_many_requests" and not info.value.fatal
            assert (await first.collect()).finish_reason == "length"
            assert (await second.collect()).finish_reason == "length"
            # Ended streams free their places.
            assert (await client.complete([4], max_tokens=2)).finish_reason == "length"


async def test_inflight_limit_per_tenant_spans_connections():
    config = server_config(max_inflight_per_tenant=2)
    async with open_server(engine_config(SLOW_STEP), config) as server:
        async with open_client(server.tcp_address) as a, open_client(server.tcp_address) as b:
            live = [await a.generate([1], max_tokens=50, tenant="acme"),
                    await b.generate([2], max_tokens=50, tenant="acme")]
            refused = await b.generate([3], max_tokens=50, tenant="acme")
            other = await b.generate([4], max_tokens=5, tenant="globex")
            with pytest.raises(LimitExceededError) as info:
                await refused.collect()
            assert info.value.limit == "max_inflight_per_tenant" and info.value.code == "tenant_limit"
            assert (await other.collect()).finish_reason == "length"
            for stream in live:
                assert (await stream.collect()).finish_reason == "length"
        await settled(server)


async def test_idle_connections_are_closed_but_busy_ones_are_not():
    async with open_server(engine_config(SLOW_STEP), server_config(idle_timeout_s=0.3)) as server:
        start = trio.current_time()
        idle = await RawConnection.greeted(server)
        busy = await RawConnection.greeted(server)
        await busy.send(Generate(0, [1], SamplingParams(max_tokens=600, ignore_eos=True)))
        (error,) = await idle.receive_all()
        assert error.code == ErrorCode.IDLE_TIMEOUT and error.limit == "idle_timeout_s"
        assert trio.current_time() - start >= 0.3
        messages = await _stream_messages(busy, 0)
        assert messages[-1].finish_reason == "length"  # streamed longer than the idle timeout
        # Idle time counts again once its last stream ended.
        (error,) = await busy.receive_all()
        assert error.code == ErrorCode.IDLE_TIMEOUT
        await idle.aclose()
        await busy.aclose()


async def test_handshake_timeout():
    async with open_server(engine_config(), server_config(handshake_timeout_s=0.2)) as server:
        conn = await RawConnection.open(server)
        await conn.send_bytes(b"\x00\x00")  # half a header, then nothing
        (error,) = await conn.receive_all()
        assert error.code == ErrorCode.HANDSHAKE_TIMEOUT and error.limit == "handshake_timeout_s"
        await conn.aclose()


async def test_protocol_error_limit():
    async with open_server(engine_config(), server_config(max_protocol_errors=2)) as server:
        conn = await RawConnection.greeted(server)
        for _ in range(3):
            await conn.send_bytes(pack_frame(b"\xc1"))  # never valid msgpack
        errors = await conn.receive_all()
        assert [e.code for e in errors] == ["bad_message", "bad_message", "too_many_protocol_errors"]
        assert [e.fatal for e in errors] == [False, False, True]
        assert errors[-1].limit == "max_protocol_errors"
        await conn.aclose()


async def test_a_client_that_stops_reading_is_disconnected_and_its_requests_aborted():
    config = server_config(send_timeout_s=0.5)
    async with open_server(engine_config(max_num_seqs=16), config) as server:
        slow = await RawConnection.greeted(server, rcvbuf=4096)
        for sid in range(8):
            await slow.send(Generate(sid, [1, 2, 3], SamplingParams(max_tokens=8000, ignore_eos=True)))
        async with open_client(server.tcp_address) as client:
            start = trio.current_time()
            while trio.current_time() - start < 1.0:  # keeps streaming while the slow one stalls
                result = await client.complete([4, 5], max_tokens=20)
                assert result.token_ids == expected_tokens(result.request_id, 2, 20)
            await wait_until(lambda: len(server.connections) == 1, what="the slow client's eviction")
            await settled(server)
        await slow.aclose()


# ---- bad requests -------------------------------------------------------------------------------


async def test_engine_refusals_end_only_their_stream():
    engine = engine_config(max_model_len=64)
    async with open_server(engine, server_config()) as server:
        async with open_client(server.tcp_address) as client:
            too_long = await client.generate([1] * 60, max_tokens=10)
            with pytest.raises(RequestTooLongError) as info:
                await too_long.collect()
            assert isinstance(info.value, RemoteRequestTooLongError)
            assert info.value.code == "request_too_long" and "max_model_len is 64" in str(info.value)
            bad_token = await client.generate([100000], max_tokens=1)
            with pytest.raises(RemoteInvalidRequestError):
                await bad_token.collect()
            assert (await client.complete([1], max_tokens=2)).finish_reason == "length"
        conn = await RawConnection.greeted(server)
        bad_params = [1, "Generate", {"stream": 4, "prompt": [1], "params": {"max_tokens": 0}}]
        await conn.send_bytes(pack_frame(msgpack.packb(bad_params)))
        await conn.send(HealthQuery(5))
        error, health = await conn.receive(), await conn.receive()
        assert (error.stream, error.code, error.fatal) == (4, "invalid_request", False)
        assert "max_tokens must be in [1," in error.message
        assert type(health) is HealthReply  # the connection carries on
        await conn.aclose()


async def test_queue_full_maps_to_queue_full_error():
    async with open_server(engine_config(max_waiting=0), server_config()) as server:
        async with open_client(server.tcp_address) as client:
            stream = await client.generate([1], max_tokens=1)
            with pytest.raises(QueueFullError) as info:
                await stream.collect()
            assert isinstance(info.value, RemoteQueueFullError)


async def test_duplicate_and_unknown_streams():
    # duplicate_stream names no stream: an Error for stream 5 would read as the
    # end of the live stream 5, which goes on.
    async with open_server(engine_config(SLOW_STEP), server_config()) as server:
        conn = await RawConnection.greeted(server)
        await conn.send(Generate(5, [1], SamplingParams(max_tokens=100, ignore_eos=True)))
        await conn.send(Generate(5, [2], SamplingParams(max_tokens=1)))
        await conn.send(Abort(99))
        errors = []
        while len(errors) < 2:
            message = await conn.receive()
            if type(message) is Error:
                errors.append(message)
        assert sorted((e.code, e.stream) for e in errors) == [("duplicate_stream", None),
                                                               ("unknown_stream", 99)]
        assert "stream 5" in next(e.message for e in errors if e.code == "duplicate_stream")
        assert not any(e.fatal for e in errors)
        messages = await _stream_messages(conn, 5)
        assert messages[-1].finish_reason == "length" and messages[-1].num_tokens == 100
        await conn.aclose()


# ---- shutdown -----------------------------------------------------------------------------------


async def test_shutdown_lets_running_requests_finish_and_refuses_new_work():
    async with open_server(engine_config(SLOW_STEP), server_config(shutdown_grace_s=WAIT_S)) as server:
        conn = await RawConnection.greeted(server)
        await conn.send(Generate(0, [1, 2], SamplingParams(max_tokens=300, ignore_eos=True)))
        assert type(await conn.receive()) is Accepted
        server.shutdown()
        await conn.send(Generate(1, [3], SamplingParams(max_tokens=1)))
        with pytest.raises(OSError):
            await RawConnection.open(server)  # the listener is closed
        messages = await conn.receive_all()
        refused = [m for m in messages if type(m) is Error and m.stream == 1]
        assert [e.code for e in refused] == ["shutdown"]
        outputs = [m for m in messages if type(m) is Output]
        assert outputs[-1].finish_reason == "length" and outputs[-1].num_tokens == 300
        assert messages[-1].code == "shutdown" and messages[-1].fatal
        await conn.aclose()
        with trio.fail_after(WAIT_S):
            await server.wait_stopped()
        assert_engine_clean(server)


async def test_shutdown_aborts_what_outlives_the_grace_period():
    async with open_server(engine_config(SLOW_STEP), server_config(shutdown_grace_s=0.2)) as server:
        async with open_client(server.tcp_address) as client:
            stream = await client.generate([1, 2], max_tokens=5000, ignore_eos=True)
            await stream.__anext__()
            server.shutdown()
            with pytest.raises(ServerShutdownError) as info:
                async for _ in stream:
                    pass
            assert info.value.stream == stream.stream_id
            with trio.fail_after(WAIT_S):
                await server.wait_stopped()
        await settled(server)


# ---- the Unix socket --------------------------------------------------------------------------


async def test_unix_socket_is_private_replaces_stale_files_and_is_removed(tmp_path):
    path = str(tmp_path / "s.sock")
    stale = trio.socket.socket(trio.socket.AF_UNIX)
    await stale.bind(path)  # a socket file nobody listens on
    stale.close()
    async with open_server(engine_config(), ServerConfig(port=None, unix_path=path)) as server:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with pytest.raises(ConfigError, match="another server is listening"):
            async with open_server(engine_config(), ServerConfig(port=None, unix_path=path)):
                pass
        async with open_client(f"unix:{path}") as client:
            assert (await client.complete("hi", max_tokens=2)).finish_reason == "length"
        assert server.tcp_address is None
    assert not os.path.exists(path)


def test_server_config_is_validated():
    assert ServerConfig().host == "127.0.0.1"
    with pytest.raises(ConfigError, match="TCP port or a Unix socket"):
        ServerConfig(port=None)
    with pytest.raises(ConfigError, match="max_inflight_per_connection"):
        ServerConfig(max_inflight_per_connection=0)
    with pytest.raises(ConfigError, match="token"):
        ServerConfig(token="")
    assert "secret" not in repr(ServerConfig(token="secret"))
