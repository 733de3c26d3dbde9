"""Prometheus metrics: scraped over HTTP during and after a run, they add up to what
the clients saw and to the scheduling core's own counters."""

from __future__ import annotations

import pytest
import trio

from cadence.actors.client import open_client
from cadence.actors.serve.metrics import METRIC_NAMES
from cadence.actors.serve.server import open_server
from cadence.actors.wire import LimitExceededError, RemoteRequestTooLongError, pack_frame

from test_server_support import SLOW_STEP, RawConnection, engine_config, server_config, settled, wait_until

# The metrics need prometheus-client; without it these tests skip rather than fail.
_parser = pytest.importorskip("prometheus_client.parser")
text_string_to_metric_families = _parser.text_string_to_metric_families


async def _http(address: tuple[str, int], request: bytes) -> tuple[int, bytes]:
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(request)
        response = bytearray()
        while data := await stream.receive_some(1 << 16):
            response += data
    head, _, body = bytes(response).partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def scrape(server) -> dict[tuple[str, tuple], float]:
    """Every sample of the endpoint as {(name, sorted labels): value}."""
    status, body = await _http(server.metrics_address, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


class Tally:
    """What the clients saw: tokens, prompt tokens, and how TTFT/ITL should count them."""

    def __init__(self) -> None:
        self.tokens = self.prompt_tokens = self.itl_tokens = self.num_first = 0
        self._started: set[int] = set()

    def add(self, stream_id: int, out) -> None:
        self.tokens += len(out.token_ids)
        if not out.token_ids:
            return
        if stream_id in self._started:
            self.itl_tokens += len(out.token_ids)
        else:
            self._started.add(stream_id)
            self.num_first += 1

    async def consume(self, stream) -> None:
        async for out in stream:
            self.add(stream.stream_id, out)
        self.prompt_tokens += stream.num_prompt_tokens


async def test_counters_add_up_to_what_the_clients_saw():
    config = server_config(metrics_port=0, max_inflight_per_connection=2)
    async with open_server(engine_config(SLOW_STEP, max_model_len=512), config) as server:
        tally = Tally()
        async with open_client(server.tcp_address) as client:
            for i in range(3):  # 6 requests, two at a time (the connection's limit)
                streams = [await client.generate([i + 1] * (5 + i), max_tokens=10 + 7 * i + j)
                           for j in range(2)]
                for stream in streams:
                    await tally.consume(stream)
            finished_tokens = tally.tokens
            long = await client.generate([7] * 9, max_tokens=400, ignore_eos=True)
            tally.add(long.stream_id, await long.__anext__())
            during = await scrape(server)
            assert value(during, "cadence_num_requests_running") == 1
            assert value(during, "cadence_num_connections") == 1
            assert value(during, "cadence_kv_cache_usage_ratio") > 0
            # Live: the running request's tokens count before it finishes. The
            # engine may have stepped again between the client's read and the
            # scrape, so the counter is at least what the client saw, and short of
            # the request's whole length (it is still running).
            assert tally.tokens <= value(during, "cadence_generation_tokens_total") \
                < finished_tokens + 400
            filler = await client.generate([1], max_tokens=1)  # takes the second place
            refused = await client.generate([1], max_tokens=1)
            with pytest.raises(LimitExceededError):
                await refused.collect()
            await tally.consume(filler)
            await long.abort()
            await tally.consume(long)
            too_long = await client.generate([1] * 600, max_tokens=1)
            with pytest.raises(RemoteRequestTooLongError):
                await too_long.collect()
        raw = await RawConnection.greeted(server)
        await raw.send_bytes(pack_frame(b"\x91\xc0"))  # valid msgpack, wrong shape
        assert (await raw.receive()).code == "bad_message"
        await raw.aclose()
        await settled(server)
        await wait_until(lambda: not server.connections, what="connections closing")
        after = await scrape(server)
        stats = server.engine.stats()

    assert value(after, "cadence_generation_tokens_total") == tally.tokens == stats.num_tokens_generated
    assert value(after, "cadence_prompt_tokens_total") == tally.prompt_tokens
    assert value(after, "cadence_requests_finished_total", reason="length") == 7
    assert value(after, "cadence_requests_finished_total", reason="abort") == 1
    assert value(after, "cadence_requests_rejected_total", code="too_many_requests") == 1
    assert value(after, "cadence_requests_rejected_total", code="request_too_long") == 1
    assert value(after, "cadence_protocol_errors_total", code="bad_message") == 1
    assert value(after, "cadence_time_to_first_token_seconds_count") == tally.num_first == 8
    assert value(after, "cadence_inter_token_latency_seconds_count") == tally.itl_tokens
    assert value(after, "cadence_e2e_request_latency_seconds_count") == 8
    assert value(after, "cadence_request_queue_time_seconds_count") == 8
    assert value(after, "cadence_scheduled_tokens_per_step_count") == stats.num_batches_scheduled
    assert value(after, "cadence_scheduled_tokens_per_step_sum") == stats.num_scheduled_tokens
    assert value(after, "cadence_preemptions_total") == stats.num_preemptions
    assert value(after, "cadence_admission_finish_holds_total") == stats.num_admission_finish_holds
    assert value(after, "cadence_prefix_cache_query_tokens_total") == stats.num_prefix_query_tokens
    assert value(after, "cadence_prefix_cache_hit_tokens_total") == stats.num_prefix_hit_tokens
    assert value(after, "cadence_num_requests_running") == 0
    assert value(after, "cadence_num_requests_waiting") == 0
    assert value(after, "cadence_kv_cache_usage_ratio") == 0
    assert value(after, "cadence_num_connections") == 0
    assert value(after, "cadence_connections_closed_total", reason="eof") == 2


async def test_every_metric_is_exposed_under_its_name():
    async with open_server(engine_config(), server_config(metrics_port=0)) as server:
        async with open_client(server.tcp_address) as client:
            await client.complete([1, 2], max_tokens=3)
        _, body = await _http(server.metrics_address, b"GET /metrics HTTP/1.1\r\n\r\n")
    families = {f.name: f.type for f in text_string_to_metric_families(body.decode())}
    for name in METRIC_NAMES:
        base = name.removesuffix("_total")
        assert base in families, name
        assert (families[base] == "counter") == name.endswith("_total"), name
    assert all(name.startswith("cadence_") for name in families)


async def test_each_server_has_its_own_registry():
    async with open_server(engine_config(), server_config(metrics_port=0)) as busy, \
            open_server(engine_config(), server_config(metrics_port=0)) as quiet:
        async with open_client(busy.tcp_address) as client:
            await client.complete([1, 2], max_tokens=5)
        await settled(busy)
        assert value(await scrape(busy), "cadence_generation_tokens_total") == 5
        assert value(await scrape(quiet), "cadence_generation_tokens_total") == 0


async def test_the_endpoint_speaks_just_enough_http():
    async with open_server(engine_config(), server_config(metrics_port=0)) as server:
        address = server.metrics_address
        assert address[0] == "127.0.0.1"
        status, _ = await _http(address, b"GET /nope HTTP/1.1\r\n\r\n")
        assert status == 404
        status, _ = await _http(address, b"POST /metrics HTTP/1.1\r\n\r\n")
        assert status == 405
        status, body = await _http(address, b"HEAD /metrics HTTP/1.1\r\n\r\n")
        assert status == 200 and body == b""
        status, _ = await _http(address, b"garbage\r\n\r\n")
        assert status == 400
