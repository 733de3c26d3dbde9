"""The router: transparent to clients, cache-aware placement, global queue, replica failure.

Replicas are simulated engines behind real servers on loopback: in-process
(`open_server` in the same Trio run) or, where a replica must die abruptly, a
child process killed with SIGKILL. Placement order and queue order are also
checked on the sans-IO pieces (`AdmissionQueue`, `PrefixIndex`,
`prompt_block_keys`) with Hypothesis.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from contextlib import AsyncExitStack, asynccontextmanager

import attrs
import pytest
import trio
from hypothesis import given, strategies as st

from cadence.actors.client import open_client
from cadence.actors.serve.router import (
    AdmissionQueue, PrefixAffinityPolicy, PrefixIndex, RoundRobinPolicy, RouterConfig,
    open_router, prompt_block_keys,
)
from cadence.actors.serve.server import open_server
from cadence.actors.wire import (
    Abort, ConnectionClosedError, Accepted, AuthenticationError, Error, Generate, Output, RemoteExecutorError,
    RemoteInvalidRequestError, RemoteQueueFullError, SamplingParams, StatsQuery,
)
from cadence.statemachine.errors import ConfigError

from test_server_support import (
    SLOW_STEP, WAIT_S, RawConnection, engine_config, expected_tokens, server_config, wait_until,
)

BLOCK = 16


@asynccontextmanager
async def replicas(count: int, **engine_kwargs):
    """`count` in-process servers with simulated engines."""
    async with AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(
            open_server(engine_config(**engine_kwargs), server_config())) for _ in range(count)]
        yield servers


def router_config(servers, **kwargs) -> RouterConfig:
    """A loopback router on a free port in front of `servers`."""
    kwargs.setdefault("port", 0)
    return RouterConfig(replicas=tuple(s.tcp_address for s in servers), **kwargs)


def ended(message) -> bool:
    """Whether `message` is a stream's last: an Error or a finished Output."""
    return type(message) is Error or (type(message) is Output and message.finished)


def remote_id(request_id: str) -> str:
    """The replica's own request id inside the router's `r<i>/<id>`."""
    return request_id.split("/", 1)[1]


# ---- sans-IO pieces ----------------------------------------------------------------------------


@attrs.define(eq=False)
class _Item:
    priority: int
    tenant: str
    seq: int


@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from("abc")), max_size=40),
       st.randoms(use_true_random=False))
def test_admission_queue_orders_by_priority_then_tenant_turns_then_arrival(entries, rng):
    items = [_Item(p, t, seq) for seq, (p, t) in enumerate(entries)]
    queue = AdmissionQueue()
    shuffled = items[:]
    rng.shuffle(shuffled)  # tasks may reach the queue in any order; seq decides
    for item in shuffled:
        queue.push(item)
    out = [queue.pop() for _ in range(len(queue))]
    assert sorted(out, key=lambda i: i.seq) == items and not len(queue)
    # Priority classes leave in order; within one, each tenant's items in arrival order.
    assert [i.priority for i in out] == sorted(i.priority for i in items)
    for priority in {i.priority for i in items}:
        level = [i for i in out if i.priority == priority]
        for tenant in "abc":
            seqs = [i.seq for i in level if i.tenant == tenant]
            assert seqs == sorted(seqs)
        # Round robin: while two tenants both still wait, neither is served twice in a row
        # before the other is served once.
        remaining = {t: sum(i.tenant == t for i in level) for t in "abc"}
        for a, b in zip(level, level[1:]):
            remaining[a.tenant] -= 1
            if a.tenant == b.tenant:
                assert all(n == 0 for t, n in remaining.items() if t != a.tenant)


def test_admission_queue_remove_and_round_robin_example():
    queue = AdmissionQueue()
    items = [_Item(1, "a", 0), _Item(1, "a", 1), _Item(1, "b", 2), _Item(0, "c", 3), _Item(1, "b", 4)]
    for item in items:
        queue.push(item)
    assert queue.remove(items[1]) and not queue.remove(items[1])
    assert [queue.pop().seq for _ in range(len(queue))] == [3, 0, 2, 4]
    with pytest.raises(IndexError):
        queue.pop()


def test_block_keys_are_chained_per_whole_block_and_salted():
    base = list(range(100))
    keys = prompt_block_keys(base, BLOCK)
    assert len(keys) == 100 // BLOCK
    fork = base[:40] + [999] + base[41:]
    assert prompt_block_keys(fork, BLOCK)[:2] == keys[:2]  # blocks before position 40 agree
    assert not set(prompt_block_keys(fork, BLOCK)[2:]) & set(keys)  # chained: all later differ
    assert not set(prompt_block_keys(base, BLOCK, "salt")) & set(keys)
    text = prompt_block_keys("x" * 200, BLOCK)  # UTF-8 bytes, BLOCK * 4 per block
    assert len(text) == 200 // (BLOCK * 4)


def test_prefix_index_matches_leading_blocks_and_evicts_least_recent():
    index = PrefixIndex(capacity=4)
    index.add([1, 2, 3])
    assert index.match([1, 2, 3, 4]) == 3 and index.match([5, 2, 3]) == 0
    index.add([9, 8])  # 5 keys > 4: the least recent (1) goes
    assert len(index) == 4 and index.match([1, 2]) == 0 and index.match([9, 8]) == 2


def test_config_is_checked_where_it_is_made():
    with pytest.raises(ConfigError):
        RouterConfig(replicas=())
    with pytest.raises(ConfigError):
        RouterConfig(replicas=("127.0.0.1:1",), policy="random")
    with pytest.raises(ConfigError):
        RouterConfig(replicas=("127.0.0.1:1",), max_inflight_per_replica=0)
    assert RouterConfig(replicas="127.0.0.1:1").replicas == ("127.0.0.1:1",)


async def test_router_refuses_to_start_when_no_replica_answers():
    with trio.socket.socket() as sock:  # a port nobody listens on
        await sock.bind(("127.0.0.1", 0))
        address = sock.getsockname()
    config = RouterConfig(replicas=(address,), port=0, start_timeout_s=0.2,
                          reconnect_interval_s=0.05)
    with pytest.raises(ConnectionClosedError, match="no replica answered"):
        async with open_router(config):
            pass


# ---- a client cannot tell ----------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["tcp", "unix"])
async def test_router_speaks_the_server_protocol(transport, tmp_path):
    path = str(tmp_path / "router.sock")
    async with replicas(2) as servers, open_router(router_config(servers, unix_path=path)) as router:
        address = f"unix:{path}" if transport == "unix" else router.tcp_address
        async with open_client(address) as client, open_client(servers[0].tcp_address) as direct:
            welcome = client.welcome
            assert attrs.evolve(welcome, server="", limits={}) == attrs.evolve(
                direct.welcome, server="", limits={})
            text = await client.complete("Hello, router", max_tokens=12)
            ids = await client.complete([5, 6, 7], max_tokens=9, ignore_eos=True)
            assert text.token_ids == expected_tokens(remote_id(text.request_id), 13, 12)
            assert text.text == bytes(text.token_ids).decode()
            assert ids.token_ids == expected_tokens(remote_id(ids.request_id), 3, 9)
            assert (await client.health()).status == "ok"
            stats = await client.stats()
            assert stats["num_requests_added"] == 2 and stats["num_replicas_healthy"] == 2
            assert len(stats["replicas"]) == 2
            with pytest.raises(RemoteInvalidRequestError):
                await client.complete([5, 300], max_tokens=2)  # the replica's refusal, relayed
            with pytest.raises(RemoteInvalidRequestError, match="n is 2: the router places one sample"):
                await client.complete([5, 6], max_tokens=2, n=2)
            assert (await client.complete([5, 6], max_tokens=2)).token_ids  # the connection goes on
            # Welcome passes the replicas' request limits on beside the router's own.
            assert welcome.limits["max_stop_strings"] == direct.welcome.limits["max_stop_strings"]
            assert welcome.limits["max_logprobs"] == direct.welcome.limits["max_logprobs"] == 20


async def test_abort_of_running_and_of_queued_requests_ends_with_an_abort_output():
    async with replicas(1, latency=SLOW_STEP) as servers, \
            open_router(router_config(servers, max_inflight_per_replica=1)) as router:
        conn = await RawConnection.greeted(router)
        await conn.send(Generate(1, [1, 2, 3], SamplingParams(max_tokens=5000, ignore_eos=True)))
        await conn.send(Generate(2, [4, 5, 6], SamplingParams(max_tokens=4)))
        await wait_until(lambda: len(router.queue) == 1, what="second request queued")
        first = await conn.receive()
        assert type(first) is Accepted and first.stream == 1
        await conn.send(Abort(2))  # still queued in the router
        await conn.send(Abort(1))  # running on the replica
        await conn.send(Abort(77))
        seen: dict[int, list] = {1: [first], 2: [], 77: []}
        while not all(seen[s] and ended(seen[s][-1]) for s in seen):
            message = await conn.receive()
            seen[message.stream].append(message)
        for stream in (1, 2):
            assert type(seen[stream][0]) is Accepted
            assert seen[stream][-1].finish_reason == "abort"
            assert seen[stream][-1].detail == "aborted by client"
        assert seen[77][-1].code == "unknown_stream"
        await wait_until(lambda: servers[0].num_inflight == 0 and router.num_inflight == 0,
                         what="everything released")
        await conn.aclose()


async def test_token_duplicate_stream_and_bad_messages_behave_as_on_a_server():
    async with replicas(1, latency=SLOW_STEP) as servers, \
            open_router(router_config(servers, token="s3cret")) as router:
        with pytest.raises(AuthenticationError):
            async with open_client(router.tcp_address, token="wrong"):
                pass
        conn = await RawConnection.greeted(router, token="s3cret")
        await conn.send(Generate(1, [1], SamplingParams(max_tokens=5000, ignore_eos=True)))
        await conn.send(Generate(1, [1], SamplingParams(max_tokens=2)))
        await conn.send_bytes(b"\x00\x00\x00\x01\xc1")  # not msgpack
        codes = []
        while len(codes) < 2:
            message = await conn.receive()
            if type(message) is Error:
                assert not message.fatal
                codes.append(message.code)
        assert sorted(codes) == ["bad_message", "duplicate_stream"]
        await conn.aclose()  # disconnecting aborts the request on the replica
        await wait_until(lambda: servers[0].num_inflight == 0, what="replica request aborted")


async def test_a_replica_that_stays_full_ends_the_request_with_its_own_error_after_retries():
    async with replicas(1, latency=SLOW_STEP, max_num_seqs=1, max_waiting=1) as servers, \
            open_router(router_config(servers, max_retries=2)) as router, \
            open_client(router.tcp_address) as client:
        running = await client.generate([1], max_tokens=5000, ignore_eos=True)
        waiting = await client.generate([2], max_tokens=5000, ignore_eos=True)
        await wait_until(lambda: servers[0].engine.core.num_waiting == 1, what="replica queue full")
        with pytest.raises(RemoteQueueFullError, match="in 3 attempts"):
            await client.complete([3], max_tokens=2)
        assert router.num_retries == 2
        for stream in (running, waiting):
            await stream.aclose()
        await wait_until(lambda: servers[0].num_inflight == 0, what="requests aborted")


# ---- placement -----------------------------------------------------------------------------------


def prefix_trace(num_groups: int = 10, per_group: int = 4, prefix_len: int = 256,
                 seed: int = 2) -> list[list[int]]:
    """Prompts of the "prefix" workload, scaled down: groups share a long prefix."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(257) for _ in range(prefix_len)] for _ in range(num_groups)]
    groups = [rng.randrange(num_groups) for _ in range(num_groups * per_group)]
    return [prefixes[g] + [rng.randrange(257) for _ in range(rng.randint(16, 48))] for g in groups]


async def run_prefix_trace(num_replicas: int, policy, prompts: list[list[int]]) -> float:
    """The prefix-cache hit rate over all replicas for `prompts` sent through a router."""
    async with replicas(num_replicas) as servers, \
            open_router(router_config(servers, policy=policy)) as router, \
            open_client(router.tcp_address) as client:
        limit = trio.Semaphore(4)

        async def one(prompt):
            async with limit:
                result = await client.complete(prompt, max_tokens=2)
                assert result.finish_reason == "length"

        async with trio.open_nursery() as nursery:
            for prompt in prompts:
                await limit.acquire()  # keeps arrivals in trace order
                limit.release()
                nursery.start_soon(one, prompt)
        stats = await client.stats()
    return stats["num_prefix_hit_tokens"] / stats["num_prefix_query_tokens"]


@pytest.mark.parametrize("num_replicas", [2, 4])
async def test_prefix_affinity_raises_the_hit_rate_over_round_robin(num_replicas):
    prompts = prefix_trace()
    affinity = await run_prefix_trace(num_replicas, PrefixAffinityPolicy(), prompts)
    round_robin = await run_prefix_trace(num_replicas, RoundRobinPolicy(), prompts)
    # Round robin warms every group's prefix on every replica; affinity only once.
    # Here: 0.67 against 0.47 (two replicas) and 0.31 (four).
    assert affinity > round_robin + 0.12, (affinity, round_robin)
    assert affinity > 0.55


async def test_global_queue_admits_by_priority_then_tenant_turns_when_replicas_are_full():
    async with replicas(2, latency=SLOW_STEP) as servers, \
            open_router(router_config(servers, max_inflight_per_replica=1)) as router, \
            open_client(router.tcp_address) as client:
        blockers = [await client.generate([1, 2], max_tokens=5000, ignore_eos=True)
                    for _ in range(2)]
        await wait_until(lambda: all(r.num_inflight == 1 for r in router.replicas),
                         what="both replicas full")
        waiting = [(2, "a"), (1, "a"), (1, "a"), (1, "b"), (0, "c"), (1, "b"), (0, "c")]
        streams = []
        for number, (priority, tenant) in enumerate(waiting, start=1):
            streams.append(await client.generate([3, 4], max_tokens=1, priority=priority,
                                                 tenant=tenant))
            await wait_until(lambda: len(router.queue) == number, what="request queued")
        first_seq = router.recent_admissions[-1][0] + 1
        for blocker in blockers:
            await blocker.abort()
        for stream in streams:
            assert (await stream.collect()).finish_reason == "length"
        admitted = [seq - first_seq for seq, _, _ in list(router.recent_admissions)[2:]]
        # priority 0: c, c; priority 1: a, b, a, b (tenants alternate); priority 2: a
        assert admitted == [4, 6, 1, 3, 2, 5, 0]
        for blocker in blockers:
            assert (await blocker.collect()).finish_reason == "abort"


# ---- replica failure ---------------------------------------------------------------------------


@asynccontextmanager
async def child_replica(*extra: str):
    """A `cadence serve` child process with a simulated engine; yields (process, address)."""
    command = [sys.executable, "-m", "cadence.actors.serve.server", "--port", "0", "--log-level", "error",
               "--model", "simulated", *extra]
    process = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE)
    try:
        buffer = b""
        with trio.fail_after(WAIT_S):
            while b"\n" not in buffer:
                chunk = await process.stdout.receive_some(4096)
                assert chunk, "the replica exited before listening"
                buffer += chunk
        line = buffer.split(b"\n", 1)[0].decode()
        address = line.split("listening on tcp://", 1)[1].split()[0].rstrip(";")
        yield process, address
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGKILL)
        with trio.CancelScope(shield=True):
            await process.wait()
        await process.stdout.aclose()


async def test_killed_replica_requests_without_output_are_retried_the_others_fail_clearly():
    async with replicas(1, latency=SLOW_STEP) as servers, \
            child_replica("--sim-step-us", "3000", "--max-num-seqs", "2") as (process, address):
        config = RouterConfig(replicas=(servers[0].tcp_address, address), port=0,
                              policy="round_robin")
        async with open_router(config) as router, open_client(router.tcp_address) as client:
            outputs: dict[int, list] = {}
            results: dict[int, object] = {}
            streams = [await client.generate([7, i + 1], max_tokens=400, ignore_eos=True)
                       for i in range(6)]

            async def consume(index, stream):
                outputs[index] = []
                try:
                    async for out in stream:
                        outputs[index].append(out)
                    results[index] = stream.request_id
                except RemoteExecutorError as exc:
                    results[index] = exc

            async with trio.open_nursery() as nursery:
                for index, stream in enumerate(streams):
                    nursery.start_soon(consume, index, stream)

                def streaming_on_child() -> int:
                    return sum(1 for i, s in enumerate(streams)
                               if outputs.get(i) and s.request_id.startswith("r1/"))

                await wait_until(lambda: streaming_on_child() == 2
                                 and router.replicas[1].num_inflight == 3,
                                 what="two requests streaming on the child, one waiting there")
                process.send_signal(signal.SIGKILL)
            failed = [i for i, r in results.items() if isinstance(r, RemoteExecutorError)]
            finished = [i for i, r in results.items() if isinstance(r, str)]
            assert len(failed) == 2 and len(finished) == 4
            for index in failed:
                assert results[index].code == "executor_error"
                assert "lost after the request had started streaming" in str(results[index])
                assert streams[index].request_id.startswith("r1/")
            for index in finished:
                rid = results[index]
                assert rid.startswith("r0/")  # the survivor; the child's waiting one moved here
                tokens = [t for out in outputs[index] for t in out.token_ids]
                assert tokens == expected_tokens(remote_id(rid), 2, 400)
                assert outputs[index][-1].finish_reason == "length"
            assert router.num_retries == 1
            assert not router.replicas[1].healthy
            health = await client.health()
            assert health.status == "ok"
            assert (await client.stats())["num_replicas_healthy"] == 1


async def test_a_stalled_replica_leaves_the_rotation_and_rejoins_when_it_answers_again():
    async with replicas(1) as servers, child_replica() as (process, address):
        config = RouterConfig(replicas=(servers[0].tcp_address, address), port=0,
                              policy="round_robin", health_interval_s=0.05, health_timeout_s=1.0,
                              reconnect_interval_s=0.05, rejoin_after_s=0.2)
        async with open_router(config) as router, open_client(router.tcp_address) as client:
            process.send_signal(signal.SIGSTOP)
            try:
                await wait_until(lambda: not router.replicas[1].healthy, what="stalled replica out")
                for i in range(4):
                    result = await client.complete([i + 1], max_tokens=3)
                    assert result.request_id.startswith("r0/")
            finally:
                process.send_signal(signal.SIGCONT)
            await wait_until(lambda: router.replicas[1].healthy, what="replica back in rotation")
            ids = [(await client.complete([9], max_tokens=3)).request_id for _ in range(2)]
            assert sorted(i.split("/")[0] for i in ids) == ["r0", "r1"]
            assert router.num_replica_failures >= 1


async def test_a_replica_reporting_closed_stays_out_until_healthy_for_a_while():
    async with replicas(2) as servers:
        config = router_config(servers, policy="round_robin", health_interval_s=0.02,
                               reconnect_interval_s=0.02, rejoin_after_s=0.5)
        async with open_router(config) as router, open_client(router.tcp_address) as client:
            ok_health = servers[1].health
            servers[1].health = lambda ref: attrs.evolve(ok_health(ref), status="closed")
            await wait_until(lambda: not router.replicas[1].healthy, what="closed replica out")
            # Many reconnect and health intervals later it has never come back.
            seen_healthy = False
            with trio.move_on_after(0.3):
                while True:
                    seen_healthy |= router.replicas[1].healthy
                    await trio.sleep(0.005)
            assert not seen_healthy and router.num_replica_failures == 1
            for i in range(3):
                assert (await client.complete([i + 1], max_tokens=2)).request_id.startswith("r0/")
            healthy_again_s = trio.current_time()
            servers[1].health = ok_health
            await wait_until(lambda: router.replicas[1].healthy, what="replica back in rotation")
            assert trio.current_time() - healthy_again_s >= config.rejoin_after_s
            assert router.num_replica_failures == 1


async def test_stats_queries_cannot_pile_up_while_the_replicas_are_slow_to_answer():
    async with replicas(1) as servers, open_router(router_config(servers)) as router:
        answer = trio.Event()
        real_stats = router.stats

        async def slow_stats(ref):
            await answer.wait()
            return await real_stats(ref)

        router.stats = slow_stats
        conn = await RawConnection.greeted(router)
        for ref in range(200):
            await conn.send(StatsQuery(ref))
        (client_conn,) = router.connections.values()
        await trio.sleep(0.2)  # time for the reader to take every frame it may
        assert len(client_conn.streams_nursery.child_tasks) <= 4
        answer.set()
        replies = [await conn.receive() for _ in range(200)]
        assert sorted(r.ref for r in replies) == list(range(200))
        await conn.aclose()


async def test_the_router_refuses_a_conversation_on_its_stream_and_keys_blocks_by_tenant():
    async with replicas(1) as servers, open_router(router_config(servers)) as router:
        conn = await RawConnection.greeted(router)
        await conn.send(Generate(3, None, SamplingParams(max_tokens=2),
                                 messages=[{"role": "user", "content": "hi"}]))
        reply = await conn.receive()
        assert (type(reply), reply.code, reply.stream) == (Error, "invalid_request", 3)
        await conn.aclose()
        prompt = [1] * (4 * BLOCK)
        keys = {tenant: (await router.make_request(Generate(0, prompt, tenant=tenant))).keys
                for tenant in ("a", "b")}
        assert keys["a"] != keys["b"] and len(keys["a"]) == 4
    with pytest.raises(ConfigError, match="prefix_cache_sharing"):
        router_config(servers, prefix_cache_sharing="everyone")
