"""Poison requests and supervision as a client sees them: an Error flagged `poison`
that a router does not retry elsewhere, Health "degraded" while the executor
restarts, and the executor's failures and restarts in Prometheus."""

from __future__ import annotations

import pytest
import trio

from cadence.actors import EngineConfig
from cadence.actors.client import open_client
from cadence.actors.serve.router import RouterConfig, open_router
from cadence.actors.serve.server import open_server
from cadence.actors.simulated import Fault, FaultPlan, Poison, SimulatedExecutor
from cadence.actors.wire import Error, RemoteExecutorError, decode_reply, encode

from test_server_support import engine_config, server_config, wait_until

# A prompt token that marks the poison request (any request whose prompt holds it).
MARK = 1
PROMPT = [72, 105]


def poisoned_config(kind: Poison = Poison.REPORTED, **faults) -> EngineConfig:
    """A simulated engine whose executor fails any request with MARK in its prompt."""
    base = engine_config()
    executor = SimulatedExecutor(base.latency, vocab_size=257, eos_token_id=256, sample_ids=range(32, 127),
                                 faults=FaultPlan(poison={MARK: kind}, **faults))
    return engine_config(executor=executor, restart_backoff_s=0.01)


@pytest.mark.parametrize("error", [
    Error("executor_error", "request 'x' failed in the executor", stream=3, poison=True),
    Error("executor_error", "the executor failed", stream=3),
])
def test_the_poison_flag_round_trips_and_is_left_out_when_unset(error):
    body = encode(error)
    assert (b"poison" in body) is error.poison
    assert decode_reply(body) == error


async def test_a_poison_request_ends_with_a_flagged_error_and_others_are_served():
    async with open_server(poisoned_config(), server_config()) as server, \
            open_client(server.tcp_address) as client:
        good = await client.generate(PROMPT, max_tokens=4)
        bad = await client.generate([MARK, *PROMPT], max_tokens=4)
        with pytest.raises(RemoteExecutorError) as info:
            await bad.collect()
        assert info.value.poison and info.value.code == "executor_error"
        assert "failed in the executor" in str(info.value) and "Traceback" not in str(info.value)
        assert len((await good.collect()).token_ids) == 4
        assert (await client.health()).status == "ok"
        stats = await client.stats()
        assert stats["num_poisoned_requests"] == 1 and stats["num_executor_restarts"] == 0


async def test_the_router_does_not_retry_a_poison_on_another_replica():
    async with open_server(poisoned_config(), server_config()) as first, \
            open_server(poisoned_config(), server_config()) as second:
        config = RouterConfig(replicas=(first.tcp_address, second.tcp_address), port=0,
                              policy="round_robin", max_retries=2)
        async with open_router(config) as router, open_client(router.tcp_address) as client:
            bad = await client.generate([MARK, *PROMPT], max_tokens=4)
            with pytest.raises(RemoteExecutorError) as info:
                await bad.collect()
            assert info.value.poison
            good = await client.complete(PROMPT, max_tokens=3)
            assert len(good.token_ids) == 3
            assert router.num_retries == 0
    added = [server.engine.stats().num_requests_added for server in (first, second)]
    assert sum(added) == 2, f"the poison ran once, not on every replica: {added}"


async def test_health_is_degraded_while_the_executor_restarts_then_ok():
    """The first step crashes and the restart waits a long backoff: Health says
    "degraded" meanwhile (not "ok", not "closed")."""
    base = engine_config()
    executor = SimulatedExecutor(base.latency, vocab_size=257, eos_token_id=256,
                                 faults=FaultPlan(at={0: Fault.CRASH}))
    config = engine_config(executor=executor, restart_backoff_s=3600.0)
    async with open_server(config, server_config()) as server, open_client(server.tcp_address) as client:
        assert (await client.health()).status == "ok"
        await client.generate(PROMPT, max_tokens=2)
        await wait_until(lambda: server.engine.scheduler.num_failures == 1, what="the crash")
        assert (await client.health()).status == "degraded"
        assert server.health(0).status == "degraded" and not server.engine.closed


async def test_executor_failures_and_restarts_are_prometheus_counters():
    _parser = pytest.importorskip("prometheus_client.parser")
    base = engine_config()
    executor = SimulatedExecutor(base.latency, vocab_size=257, eos_token_id=256,
                                 faults=FaultPlan(at={1: Fault.CRASH}, fail_starts={1}))
    config = engine_config(executor=executor, restart_backoff_s=0.01)
    async with open_server(config, server_config(), metrics=True) as server, \
            open_client(server.tcp_address) as client:
        assert len((await client.complete(PROMPT, max_tokens=4)).token_ids) == 4
        body = server.metrics.exposition().decode()
    samples = {sample.name: sample.value for family in _parser.text_string_to_metric_families(body)
               for sample in family.samples}
    assert samples["cadence_executor_failures_total"] == 2  # the crash and the failed restart
    assert samples["cadence_executor_restarts_total"] == 1


async def test_a_request_convicted_by_step_timeouts_ends_with_a_flagged_error():
    executor = poisoned_config(Poison.HANG).executor  # hangs on any request with MARK
    config = engine_config(executor=executor, restart_backoff_s=0.01, step_timeout_s=0.3)
    async with open_server(config, server_config()) as server, open_client(server.tcp_address) as client:
        good = await client.generate(PROMPT, max_tokens=4)
        bad = await client.generate([MARK, *PROMPT], max_tokens=4)
        with pytest.raises(RemoteExecutorError) as info:
            await bad.collect()
        assert info.value.poison and "timed out" in str(info.value), str(info.value)
        assert len((await good.collect()).token_ids) == 4
