"""What a hostile or simply newer client cannot do to the server: requests it
cannot read are answered on their own stream, a duplicate id never reads as
the live stream's end, disconnect aborts are counted where Stats counts them,
a client that never reads costs bounded memory."""

from __future__ import annotations

import msgpack
import pytest
import trio

from cadence.actors.client import open_client
from cadence.actors.serve import connection
from cadence.actors.serve.connection import Outbox
from cadence.actors.serve.server import open_server
from cadence.actors.wire import (
    Error, Generate, HealthQuery, HealthReply, Output, SamplingParams, decode_request, pack_frame,
)

from cadence.statemachine.errors import ConfigError

from test_server_support import (
    SLOW_STEP, WAIT_S, RawConnection, engine_config, expected_tokens, server_config, settled,
    wait_until,
)


def _generate_frame(payload: dict) -> bytes:
    return pack_frame(msgpack.packb([1, "Generate", payload], use_bin_type=True))


@pytest.mark.parametrize("payload, field", [
    pytest.param({"stream": 7}, "prompt", id="missing-prompt"),
    pytest.param({"stream": 7, "prompt": [1], "grammar": "x"}, "grammar", id="unknown-field"),
    pytest.param({"stream": 7, "prompt": [1], "params": {"json_schema": {}}}, "json_schema",
                 id="unknown-param"),
    pytest.param({"stream": 7, "prompt": {"a": 1}}, "prompt", id="mistyped-prompt"),
])
async def test_a_generate_with_a_readable_stream_is_refused_on_that_stream(payload, field):
    # max_protocol_errors=1: refusals of one request are not malformed traffic,
    # so three of them do not close the connection.
    async with open_server(engine_config(), server_config(max_protocol_errors=1)) as server:
        conn = await RawConnection.greeted(server)
        for _ in range(3):
            await conn.send_bytes(_generate_frame(payload))
            reply = await conn.receive()
            assert type(reply) is Error and reply.code == "bad_message" and reply.stream == 7, reply
            assert field in reply.message and not reply.fatal
        await conn.send(Generate(7, [1, 2], SamplingParams(max_tokens=2)))
        message = await conn.receive()
        while not (type(message) is Output and message.finished):
            assert type(message) is not Error, message
            message = await conn.receive()
        await conn.aclose()
        await settled(server)


async def test_a_bad_generate_reusing_a_live_id_does_not_end_the_live_stream():
    async with open_server(engine_config(SLOW_STEP), server_config()) as server:
        conn = await RawConnection.greeted(server)
        await conn.send(Generate(5, [1], SamplingParams(max_tokens=40, ignore_eos=True)))
        await conn.send_bytes(_generate_frame({"stream": 5, "prompt": [1], "x": 1}))
        errors, last = [], None
        while last is None:
            message = await conn.receive()
            if type(message) is Error:
                errors.append(message)
            elif type(message) is Output and message.finished:
                last = message
        assert [(e.code, e.stream) for e in errors] == [("bad_message", None)]
        assert last.stream == 5 and last.num_tokens == 40 and last.finish_reason == "length"
        await conn.aclose()


async def test_a_generate_without_a_readable_stream_still_counts_as_malformed():
    async with open_server(engine_config(), server_config(max_protocol_errors=1)) as server:
        conn = await RawConnection.greeted(server)
        await conn.send_bytes(_generate_frame({"prompt": [1]}))
        await conn.send_bytes(_generate_frame({"stream": -1, "prompt": [1]}))
        replies = await conn.receive_all()
        assert [(r.code, r.stream, r.fatal) for r in replies] == [
            ("bad_message", None, False), ("too_many_protocol_errors", None, True)]


async def test_aborts_from_disconnects_are_counted_in_stats_and_metrics_alike():
    from test_metrics import scrape, value

    config = server_config(metrics_port=0)
    async with open_server(engine_config(SLOW_STEP), config) as server:
        for _ in range(3):
            async with open_client(server.tcp_address, timeout_s=WAIT_S) as client:
                streams = [await client.generate([1, 2], max_tokens=500, ignore_eos=True)
                           for _ in range(2)]
                for stream in streams:
                    await stream.__anext__()
            # Leaving the block disconnects with both streams running.
        async with open_client(server.tcp_address, timeout_s=WAIT_S) as client:
            await client.complete([3], max_tokens=2)
        await settled(server)
        samples = await scrape(server)
        reasons = server.engine.stats().completed_by_reason
        assert reasons == {"abort": 6, "length": 1}
        for reason, count in reasons.items():
            assert value(samples, "cadence_requests_finished_total", reason=reason) == count


async def test_the_outbox_holds_at_most_its_frames_and_bytes():
    outbox = Outbox(capacity=4, max_bytes=100)
    await outbox.put(b"x" * 60)
    with trio.move_on_after(0.05) as blocked:
        await outbox.put(b"y" * 60)  # 120 bytes would pass the bound
    assert blocked.cancelled_caught and len(outbox) == 1
    await outbox.put(b"z" * 40)
    frames, num_counted, num_bytes = await outbox.take()
    assert (frames, num_counted, num_bytes) == ([b"x" * 60, b"z" * 40], 2, 100)
    outbox.release(num_counted, num_bytes)
    await outbox.put(b"w" * 500)  # one frame always fits an empty outbox
    assert outbox.num_bytes == 500


async def test_health_answers_while_a_client_never_reads():
    config = server_config(send_timeout_s=0.5, output_queue_frames=4, output_queue_bytes=4096)
    async with open_server(engine_config(SLOW_STEP), config) as server:
        hog = await RawConnection.greeted(server, rcvbuf=4096)
        for sid in range(16):
            await hog.send(Generate(sid, [1] * 8, SamplingParams(max_tokens=5000, ignore_eos=True)))
        await wait_until(lambda: server.engine.core.num_running == 16, what="hog running")
        other = await RawConnection.greeted(server)
        await other.send(HealthQuery(1))
        assert type(await other.receive()) is HealthReply
        # The hog is evicted for not reading; its requests are aborted.
        await wait_until(lambda: len(server.connections) == 1, what="hog evicted")
        await settled(server)
        await other.aclose()
        await hog.aclose()


@pytest.mark.parametrize("sharing", ["tenant", "global"])
async def test_a_tenant_cannot_probe_another_tenants_prompt_through_the_prefix_cache(sharing):
    # The secret shares its first two blocks with a public preamble; a prober
    # compares a right and a wrong guess of the rest (each from a tenant of its
    # own, so neither probe is helped by the other).
    preamble, secret, wrong = [5] * 32, list(range(40, 136)), list(range(140, 236))
    engine = engine_config(block_size=16, prefix_cache_sharing=sharing)
    async with open_server(engine, server_config()) as server:
        async with open_client(server.tcp_address, timeout_s=WAIT_S) as client:

            async def cached(prompt: list[int], tenant: str) -> int:
                stream = await client.generate(prompt, max_tokens=1, tenant=tenant)
                return (await stream.collect()).num_cached_tokens

            await cached(preamble + secret, "victim")
            right_guess = await cached(preamble + secret, "prober-1")
            wrong_guess = await cached(preamble + wrong, "prober-2")
            victim_again = await cached(preamble + secret, "victim")
        await settled(server)
    assert victim_again == 112  # a tenant still shares with itself
    if sharing == "tenant":
        assert right_guess == wrong_guess == 0
    else:
        assert (right_guess, wrong_guess) == (112, 32)


@pytest.mark.parametrize("refusal", ["too_long_text", "bad_message"])
async def test_a_costly_refusal_pauses_that_connection_alone(refusal):
    """A refused request of N bytes holds back its connection's next frame for
    N / refused_bytes_per_s, while another connection is answered at once: the cost
    of refusing megabyte prompts falls on the client that sends them."""
    rate = 200_000  # bytes per second: a 100 kB refusal pauses half a second
    config = server_config(refused_bytes_per_s=rate)
    async with open_server(engine_config(), config) as server:
        abuser = await RawConnection.greeted(server)
        neighbour = await RawConnection.greeted(server)
        if refusal == "too_long_text":
            frame = pack_frame(msgpack.packb(
                [1, "Generate", {"stream": 1, "prompt": "x" * 100_000}], use_bin_type=True))
        else:
            frame = _generate_frame({"stream": 1, "prompt": [1], "x": "y" * 100_000})
        await abuser.send_bytes(frame)
        reply = await abuser.receive()
        assert type(reply) is Error and reply.stream == 1 and not reply.fatal, reply
        refused_at = trio.current_time()
        await abuser.send(HealthQuery(9))
        await neighbour.send(HealthQuery(8))
        assert type(await neighbour.receive()) is HealthReply
        neighbour_s = trio.current_time() - refused_at
        assert type(await abuser.receive()) is HealthReply
        abuser_s = trio.current_time() - refused_at
        assert abuser_s >= 0.8 * len(frame) / rate
        assert neighbour_s < abuser_s
        await abuser.aclose()
        await neighbour.aclose()
        await settled(server)


async def test_small_refusals_do_not_slow_a_client_down():
    """Twenty refused one-token requests in a row cost microseconds of pause each."""
    async with open_server(engine_config(), server_config()) as server:
        conn = await RawConnection.greeted(server)
        started = trio.current_time()
        for stream in range(20):
            await conn.send_bytes(_generate_frame({"stream": stream, "prompt": [-1]}))
            reply = await conn.receive()
            assert type(reply) is Error and reply.stream == stream, reply
        # The pause is frame bytes over 4 MiB/s: far below what the round trips take.
        assert server.config.refused_bytes_per_s == 4 << 20
        assert trio.current_time() - started < 20 * 0.25
        await conn.aclose()
        await settled(server)


@pytest.mark.parametrize("stream_first", [True, False])
async def test_a_text_prompt_too_long_for_any_request_is_dropped_unread(monkeypatch, stream_first):
    """A megabyte text prompt that no request could use is refused on its stream
    without being buffered whole or decoded: every frame the server decodes is
    small, and the connection goes on serving. A large prompt that fits is read."""
    decoded: list[int] = []

    def recording_decode(frame):
        decoded.append(len(frame))
        return decode_request(frame)

    monkeypatch.setattr(connection, "decode_request", recording_decode)
    fits = 70_000  # bytes: over the frame size that is looked at first, under max_model_len
    engine = engine_config(max_model_len=fits + 100, num_blocks=(fits + 100) // 16 + 64)
    async with open_server(engine, server_config(refused_bytes_per_s=None)) as server:
        conn = await RawConnection.greeted(server)
        too_long = (1 << 20) - 1024
        fields = [("stream", 4), ("prompt", "x" * too_long), ("params", {"max_tokens": 3})]
        if not stream_first:
            fields.reverse()
        await conn.send_bytes(pack_frame(msgpack.packb([1, "Generate", dict(fields)])))
        reply = await conn.receive()
        assert type(reply) is Error and reply.code == "request_too_long", reply
        assert reply.stream == 4 and not reply.fatal
        assert f"prompt has {too_long} bytes" in reply.message and "max_tokens is 3" in reply.message
        assert max(decoded) < 1024, decoded
        await conn.send(Generate(5, "y" * fits, SamplingParams(max_tokens=2)))
        while not (type(message := await conn.receive()) is Output and message.finished):
            assert type(message) is not Error, message
        assert max(decoded) > fits
        await conn.aclose()
        await settled(server)


async def test_a_client_that_never_reads_is_closed_once_it_holds_max_unsent_bytes(caplog):
    """Long before its send timeout (an hour here): once what the server holds for
    the client (queued frames, and the tokens its waiting streams pile up in the
    engine) passes max_unsent_bytes, the connection is closed, its requests are
    aborted and every block comes back; another client is served all along."""
    limit = 32_768
    config = server_config(send_timeout_s=3600.0, output_queue_frames=4, output_queue_bytes=4096,
                           max_unsent_bytes=limit)
    async with open_server(engine_config(SLOW_STEP), config, metrics=True) as server:
        hog = await RawConnection.greeted(server, rcvbuf=4096)
        for sid in range(16):
            await hog.send(Generate(sid, [1] * 8, SamplingParams(max_tokens=8000, ignore_eos=True)))
        async with open_client(server.tcp_address) as client:
            with trio.fail_after(WAIT_S):
                while len(server.connections) == 2:
                    result = await client.complete([4, 5], max_tokens=8, ignore_eos=True)
                    assert result.token_ids == expected_tokens(result.request_id, 2, 8)
            # The hog was closed long before its requests came near their max_tokens.
            assert server.engine.stats().num_tokens_generated < 16 * 8000 // 2
            await settled(server)
        body = server.metrics.exposition().decode()
        assert 'cadence_connections_closed_total{reason="overflow"} 1.0' in body
        assert any("not reading" in r.message and "max_unsent_bytes=32768" in r.message
                   for r in caplog.records)
        await hog.aclose()


def test_max_unsent_bytes_must_hold_the_outbox():
    with pytest.raises(ConfigError, match="max_unsent_bytes must be >= output_queue_bytes"):
        server_config(output_queue_bytes=4096, max_unsent_bytes=1024)
