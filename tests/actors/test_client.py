"""The three Python clients (sync, Trio, asyncio) and their shared sans-IO core.

The sync and asyncio clients talk to a server running in a background thread
(`ServerThread`); the Trio client to one in the test's own run.
"""

from __future__ import annotations

import asyncio
import socket

import msgpack
import pytest
import trio

from cadence.actors.client import (
    AsyncioClient, Client, ClientProtocol, open_client, parse_address,
)
from cadence.actors.serve.server import ServerThread, open_server
from cadence.actors.simulated import LatencyModel
from cadence.actors.wire import (
    Accepted, ClientTimeoutError, ConnectionClosedError, Error, LimitExceededError, Output,
    RemoteQueueFullError, ServerShutdownError, Welcome, decode_request, encode, pack_frame,
)
from cadence.statemachine.errors import ConfigError, InvalidRequestError, ProtocolError, QueueFullError
from cadence.statemachine.sampling import SamplingParams

from test_server_support import SLOW_STEP, engine_config, expected_tokens, server_config, settled

_TIMEOUT_S = 30.0
_SLUGGISH_STEP = LatencyModel(base_us=300_000.0, prefill_us_per_token=0.0, decode_us_per_seq=0.0)


@pytest.fixture
def served():
    """A server in a background thread, for the blocking and asyncio clients."""
    with ServerThread(engine_config(SLOW_STEP), server_config()) as thread:
        yield thread


@pytest.fixture
def sluggish():
    """A server whose every engine step takes 0.3 s: long enough to time a client out."""
    with ServerThread(engine_config(_SLUGGISH_STEP), server_config()) as thread:
        yield thread


def _frame(message) -> bytes:
    return pack_frame(encode(message))


# ---- addresses -------------------------------------------------------------------------------


@pytest.mark.parametrize("address, expected", [
    (("127.0.0.1", 80), ("tcp", ("127.0.0.1", 80))),
    ("localhost:8470", ("tcp", ("localhost", 8470))),
    ("tcp://10.0.0.1:1", ("tcp", ("10.0.0.1", 1))),
    ("[::1]:9", ("tcp", ("::1", 9))),
    ("unix:/tmp/x.sock", ("unix", "/tmp/x.sock")),
    ("unix:///tmp/x.sock", ("unix", "/tmp/x.sock")),
])
def test_parse_address(address, expected):
    assert parse_address(address) == expected


@pytest.mark.parametrize("address", ["", "nohost", "host:port", "unix:", ("a", 1, 2)])
def test_parse_address_rejects(address):
    with pytest.raises(ConfigError):
        parse_address(address)


# ---- the sans-IO core ------------------------------------------------------------------------


def _welcomed() -> ClientProtocol:
    protocol = ClientProtocol()
    protocol.receive_data(_frame(Welcome("s", "m", 10, 100, 16, [0], False, {})))
    assert protocol.welcome is not None
    return protocol


def test_protocol_routes_frames_split_anywhere():
    protocol = _welcomed()
    state, _ = protocol.generate([1, 2], None, {}, {"max_tokens": 2})
    data = (_frame(Accepted(state.stream, "r1", 2)) + _frame(Output(state.stream, [4], None, 1))
            + _frame(Output(state.stream, [5], None, 2, "length")))
    for i in range(len(data)):  # one byte at a time
        protocol.receive_data(data[i:i + 1])
    assert state.request_id == "r1" and state.num_prompt_tokens == 2
    assert [o.token_ids for o in state.outputs] == [[4], [5]]
    assert state.finished and state.stream not in protocol.streams


def test_protocol_stream_errors_are_raised_on_that_stream_only():
    protocol = _welcomed()
    one, _ = protocol.generate([1], None, {}, {})
    two, _ = protocol.generate([1], None, {}, {})
    protocol.receive_data(_frame(Error("queue_full", "full", stream=one.stream)))
    with pytest.raises(QueueFullError) as info:
        protocol.take_output(one)
    assert isinstance(info.value, RemoteQueueFullError) and info.value.stream == one.stream
    assert protocol.take_output(two) is None and not two.done


def test_protocol_fatal_error_fails_every_stream_and_later_calls():
    protocol = _welcomed()
    state, _ = protocol.generate([1], None, {}, {})
    protocol.receive_data(_frame(Error("shutdown", "bye", fatal=True)))
    with pytest.raises(ServerShutdownError):
        protocol.take_output(state)
    with pytest.raises(ServerShutdownError):
        protocol.generate([1], None, {}, {})
    protocol.receive_data(b"")  # the close that follows does not replace the reason
    assert isinstance(protocol.error, ServerShutdownError)


def test_protocol_ignores_frames_for_streams_it_forgot():
    protocol = _welcomed()
    state, _ = protocol.generate([1], None, {}, {})
    assert protocol.abort(state) is not None
    protocol.forget(state)
    assert protocol.abort(state) is None
    protocol.receive_data(_frame(Output(state.stream, [1], None, 1)) + _frame(
        Error("unknown_stream", "gone", stream=state.stream)))
    assert protocol.error is None and protocol.take_output(state) is None and state.done


def test_protocol_treats_a_malformed_server_frame_as_a_lost_connection():
    protocol = _welcomed()
    state, _ = protocol.generate([1], None, {}, {})
    protocol.receive_data(pack_frame(b"\x93\x01\xa6Output\x80"))
    with pytest.raises(ConnectionClosedError, match="bad frame"):
        protocol.take_output(state)


def test_params_and_sampling_keywords_are_exclusive():
    protocol = _welcomed()
    with pytest.raises(ConfigError):
        protocol.generate([1], SamplingParams(), {}, {"max_tokens": 3})


# ---- the blocking client ---------------------------------------------------------------------


def test_sync_client_streams_interleaved_requests(served):
    with Client.connect(served.server.tcp_address, timeout_s=_TIMEOUT_S) as client:
        first = client.generate([1, 2], max_tokens=20)
        second = client.generate("abc", max_tokens=10)
        second_result = second.collect()  # read while the first is still streaming
        first_result = first.collect()
        assert first_result.token_ids == expected_tokens(first_result.request_id, 2, 20)
        assert second_result.token_ids == expected_tokens(second_result.request_id, 3, 10)
        assert second_result.text is not None and len(second_result.text) == 10
        assert client.stats()["num_requests_completed"] == 2
        assert client.health().status == "ok"


def test_sync_client_abort_and_close(served):
    with Client.connect(served.server.tcp_address, timeout_s=_TIMEOUT_S) as client:
        stream = client.generate([1], max_tokens=5000, ignore_eos=True)
        next(stream)
        stream.abort()
        assert list(stream)[-1].finish_reason == "abort"
        with client.generate([1], max_tokens=5000, ignore_eos=True) as stream:
            next(stream)  # leaving the block aborts it on the server
        assert list(stream) == []
        assert client.complete([3], max_tokens=2).finish_reason == "length"
    served.call(lambda: None)  # the server thread is alive and answering
    server = served.server
    assert server.engine.stats().completed_by_reason["abort"] == 2


def test_sync_client_times_out_without_breaking_the_connection(sluggish):
    with Client.connect(sluggish.server.tcp_address, timeout_s=0.05) as client:
        stream = client.generate([1], max_tokens=3000, ignore_eos=True)
        with pytest.raises(ClientTimeoutError):
            for _ in stream:
                pass
        client.timeout_s = _TIMEOUT_S
        stream.abort()
        assert list(stream)[-1].finish_reason == "abort"


def test_no_answer_is_a_timeout_and_a_refused_connection_is_a_clear_error():
    with socket.socket() as silent:  # accepts connections (backlog) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        with pytest.raises(ClientTimeoutError, match="Welcome"):
            Client.connect(silent.getsockname(), timeout_s=0.2)
        port = silent.getsockname()[1]
    with pytest.raises(ConnectionClosedError, match="cannot connect"):
        Client.connect(("127.0.0.1", port), timeout_s=_TIMEOUT_S)


def test_sync_client_does_not_reconnect_after_the_server_goes_away():
    thread = ServerThread(engine_config(SLOW_STEP), server_config()).__enter__()
    client = Client.connect(thread.server.tcp_address, timeout_s=_TIMEOUT_S)
    stream = client.generate([1], max_tokens=5000, ignore_eos=True)
    next(stream)
    thread.stop(grace_s=0.0)
    with pytest.raises(ServerShutdownError):
        list(stream)
    for _ in range(2):  # every later call fails the same way; nothing reconnects
        with pytest.raises(ServerShutdownError):
            client.generate([1], max_tokens=1)
        with pytest.raises(ServerShutdownError):
            client.health()
    client.close()


# ---- the asyncio client ----------------------------------------------------------------------


def test_asyncio_client_streams_aborts_and_queries(served):
    async def main():
        async with await AsyncioClient.connect(served.server.tcp_address, timeout_s=_TIMEOUT_S) as client:
            streams = [await client.generate([i, i], max_tokens=15) for i in range(4)]
            results = await asyncio.gather(*(s.collect() for s in streams))
            for result in results:
                assert result.token_ids == expected_tokens(result.request_id, 2, 15)
            long = await client.generate([1], max_tokens=5000, ignore_eos=True)
            await long.__anext__()
            await long.abort()
            assert [o async for o in long][-1].finish_reason == "abort"
            health = await client.health()
            assert health.status == "ok"
            assert (await client.stats())["num_requests_completed"] == 5

    asyncio.run(main())


def test_asyncio_client_timeouts_and_refused_connections(sluggish):
    async def main():
        client = await AsyncioClient.connect(sluggish.server.tcp_address, timeout_s=0.05)
        stream = await client.generate([1], max_tokens=3000, ignore_eos=True)
        with pytest.raises(ClientTimeoutError):
            async for _ in stream:
                pass
        await client.aclose()
        with pytest.raises(ConnectionClosedError):
            await client.health()
        with pytest.raises(ConnectionClosedError, match="cannot connect"):
            await AsyncioClient.connect(("127.0.0.1", 1), timeout_s=_TIMEOUT_S)

    asyncio.run(main())


# ---- the Trio client -------------------------------------------------------------------------


async def test_trio_client_shared_by_many_tasks():
    async with open_server(engine_config(), server_config()) as server:
        async with open_client(server.tcp_address, timeout_s=_TIMEOUT_S) as client:
            results = {}

            async def run(i: int) -> None:
                results[i] = await client.complete([i + 1] * 3, max_tokens=10 + i)

            async with trio.open_nursery() as nursery:
                for i in range(20):
                    nursery.start_soon(run, i)
            for i, result in results.items():
                assert result.token_ids == expected_tokens(result.request_id, 3, 10 + i)
        await settled(server)


async def test_trio_client_errors_and_timeouts():
    config = server_config(max_inflight_per_connection=1)
    async with open_server(engine_config(_SLUGGISH_STEP), config) as server:
        async with open_client(server.tcp_address, timeout_s=0.05) as client:
            stream = await client.generate([1], max_tokens=3000, ignore_eos=True)
            refused = await client.generate([1], max_tokens=1)
            with pytest.raises(LimitExceededError):
                await refused.collect()
            with pytest.raises(ClientTimeoutError):
                async for _ in stream:
                    pass
            await stream.aclose()  # aborts it on the server
        await settled(server)


def test_sync_client_receives_logprobs_only_when_asked(served):
    with Client.connect(served.server.tcp_address, timeout_s=_TIMEOUT_S) as client:
        asked = client.generate([1, 2], max_tokens=6, logprobs=3).collect()
        plain = client.generate([1, 2], max_tokens=6).collect()
    assert len(asked.logprobs) == len(asked.token_ids) == 6
    assert all(entry[0][0] == token and len(entry) == 4
               for token, entry in zip(asked.token_ids, asked.logprobs))
    assert plain.logprobs is None


def test_output_logprobs_round_trip_and_are_checked():
    """Output.logprobs crosses msgpack intact and a malformed one names its field."""
    out = Output(3, [5, 6], None, 2, logprobs=[[(5, 0.0), (9, -1.0)], None])
    wire = msgpack.unpackb(msgpack.packb(out.to_wire()))
    assert Output.from_wire(wire) == out
    assert "logprobs" not in Output(3, [5], None, 1).to_wire()
    wire["logprobs"] = [[[5, 0.0]]]
    with pytest.raises(ProtocolError, match="Output.logprobs: 1 entries for 2 tokens"):
        Output.from_wire(wire)
    wire["logprobs"] = [[[5, "x"]], None]
    with pytest.raises(ProtocolError, match=r"Output\.logprobs\[0\]\[0\]\[1\]: expected float"):
        Output.from_wire(wire)


@pytest.mark.parametrize("given, expected", [
    (dict(prompt=[1], messages=[{"role": "user", "content": "x"}]), "got prompt and messages"),
    (dict(prompt="x", prompt_token_ids=[1]), "got prompt and prompt_token_ids"),
    (dict(), "got none"),
    (dict(prompt_token_ids="12"), "prompt_token_ids must be a list of token ids"),
    (dict(messages="hello"), "messages must be a list"),
    (dict(messages=[{"content": "x"}]), r"messages\[0\].role"),
    (dict(messages=[]), "messages must be a non-empty list"),
])
def test_a_prompt_is_given_exactly_one_way(given, expected):
    protocol = _welcomed()
    prompt = given.pop("prompt", None)
    with pytest.raises(InvalidRequestError, match=expected):
        protocol.generate(prompt, None, given, {})
    assert not protocol.streams  # nothing was started


def test_messages_and_prompt_token_ids_reach_the_generate_frame():
    protocol = _welcomed()
    conversation = ({"role": "user", "content": "x"},)
    _, frame = protocol.generate(None, None, {"messages": conversation}, {})
    message = decode_request(frame[4:])
    assert message.prompt is None and message.messages == [{"role": "user", "content": "x"}]
    _, frame = protocol.generate(None, None, {"prompt_token_ids": (4, 5)}, {})
    message = decode_request(frame[4:])
    assert message.prompt == [4, 5] and message.messages is None
