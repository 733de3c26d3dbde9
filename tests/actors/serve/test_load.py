"""Load and soak: many connections streaming from one server on loopback, then a
soak with random aborts and disconnects.

Afterwards every KV block is free, no request or stream is live, the server
has no connection and no task left behind, and memory is back to the warm-up
baseline within stated margins: at most `_OBJECT_MARGIN` more objects tracked
by the garbage collector (per-request state would leave thousands) and at
most `_RSS_MARGIN_BYTES` more resident memory.

The connection count is 200 (each costs two descriptors here: both ends live in
this process); set CADENCE_LOAD_CONNECTIONS to change it (1000 needs
`ulimit -n` above about 2100). CADENCE_EXPLORE=1 makes the soak longer.
"""

from __future__ import annotations

import gc
import os
import random

import pytest
import trio

from cadence.actors.client import open_client
from cadence.actors.serve.server import open_server
from cadence.actors.simulated import LatencyModel
from cadence.actors.wire import ConnectionClosedError, Generate, SamplingParams

from test_server_support import (
    WAIT_S, RawConnection, engine_config, expected_tokens, explore, fd_limit, server_config, settled,
    wait_until,
)

_CONNECTIONS = int(os.environ.get("CADENCE_LOAD_CONNECTIONS", "200"))
# What may remain beyond the warm-up baseline: prefix-cache entries, counters
# and allocator slack, not per-request or per-connection state (the soak runs 320
# requests, so one object left behind by each is caught; measured: ~30 remain).
_OBJECT_MARGIN = 300
_RSS_MARGIN_BYTES = 32 << 20
# Resident memory that may remain after clients that never read have left:
# allocator slack, not their queued frames or coalesced outputs.
_ABUSE_RSS_MARGIN_BYTES = 64 << 20
_SOAK_STEP = LatencyModel(base_us=300.0, prefill_us_per_token=0.0, decode_us_per_seq=5.0)


def _rss_bytes() -> int | None:
    """Resident memory of this process (Linux), or None where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def _num_objects() -> int:
    """Objects the collector tracks, less Trio's deadline-heap entries. Every cancel
    scope with a deadline leaves a (deadline, id, scope) entry that Trio discards
    lazily (once the deadline passes, or once over 1,000 are stale), so up to two
    thousand such objects outlive a soak without being ours."""
    objects = gc.get_objects()
    entries = [o for o in objects if type(o) is tuple and len(o) == 3
               and isinstance(o[2], trio.CancelScope) and o[1] == id(o[2])]
    return len(objects) - len(entries) - len({id(e[2]) for e in entries})


def _count_tasks() -> int:
    """Every task of this Trio run."""
    stack, count = [trio.lowlevel.current_root_task()], 0
    while stack:
        task = stack.pop()
        count += 1
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return count


async def test_many_connections_stream_at_once():
    count = _CONNECTIONS
    if 2 * count + 64 > fd_limit():
        pytest.skip(f"{count} connections need about {2 * count + 64} descriptors; ulimit -n is {fd_limit()}")
    engine = engine_config(max_num_seqs=max(count, 64), num_blocks=max(4 * count, 1024))
    config = server_config(max_connections=count + 8)
    async with open_server(engine, config) as server:
        all_connected = trio.Event()
        connected = 0
        results = {}

        async def one(i: int) -> None:
            nonlocal connected
            async with open_client(server.tcp_address, timeout_s=WAIT_S) as client:
                connected += 1
                if connected == count:
                    all_connected.set()
                await all_connected.wait()
                results[i] = await client.complete([1 + i % 200, 2, 3], max_tokens=16, ignore_eos=True)

        start = trio.current_time()
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for i in range(count):
                    nursery.start_soon(one, i)
                await all_connected.wait()
                assert len(server.connections) == count
        elapsed = trio.current_time() - start
        assert len(results) == count
        for result in results.values():
            assert result.token_ids == expected_tokens(result.request_id, 3, 16)
        await settled(server)
        await wait_until(lambda: not server.connections, what="connections closing")
        stats = server.engine.stats()
        assert stats.num_requests_completed == count
        assert stats.num_tokens_generated == 16 * count
        print(f"{count} connections streamed {16 * count} tokens in {elapsed:.2f} s")


async def _soak_client(server, rng: random.Random, num_requests: int, tally: dict) -> None:
    """One user: a connection running requests; some end normally, some are
    aborted, some are cut off by closing the connection (then it reconnects)."""
    remaining = num_requests
    while remaining:
        async with open_client(server.tcp_address, timeout_s=WAIT_S) as client:
            while remaining:
                remaining -= 1
                max_tokens = rng.randint(1, 120)
                action = rng.choices(["finish", "abort", "disconnect", "concurrent"], [5, 2, 2, 1])[0]
                stream = await client.generate([rng.randrange(200) for _ in range(rng.randint(1, 40))],
                                               max_tokens=max_tokens, ignore_eos=True)
                if action == "concurrent":  # a second stream on the same connection, left to finish
                    other = await client.generate([7, 7], max_tokens=rng.randint(1, 30), ignore_eos=True)
                    tally["finish"] += (await other.collect()).finish_reason == "length"
                    action = "finish"
                cut = rng.randint(1, max_tokens)
                num_tokens = 0
                async for out in stream:
                    num_tokens = out.num_tokens
                    if out.finished:
                        break
                    if num_tokens >= cut and action == "abort":
                        await stream.abort()
                        action = "aborted"
                    elif num_tokens >= cut and action == "disconnect":
                        break
                if action == "disconnect":
                    tally["disconnect"] += 1
                    break  # leaving the block closes the connection mid-stream
                tally["abort" if action == "aborted" else "finish"] += 1


async def _soak(server, seed: int, num_clients: int, num_requests: int) -> dict:
    rng = random.Random(seed)
    tally = {"finish": 0, "abort": 0, "disconnect": 0}
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for _ in range(num_clients):
                nursery.start_soon(_soak_client, server, random.Random(rng.random()), num_requests, tally)
    await settled(server)
    await wait_until(lambda: not server.connections, what="connections closing")
    return tally


async def test_soak_with_random_aborts_and_disconnects_leaves_nothing_behind():
    num_clients = 40
    num_requests = 60 if explore() else 8
    engine = engine_config(_SOAK_STEP, max_num_seqs=64, num_blocks=512)
    async with open_server(engine, server_config()) as server:
        await _soak(server, seed=0, num_clients=num_clients, num_requests=2)  # warm-up
        gc.collect()
        baseline_tasks, baseline_objects, baseline_rss = _count_tasks(), _num_objects(), _rss_bytes()
        tally = await _soak(server, seed=1, num_clients=num_clients, num_requests=num_requests)
        gc.collect()
        assert _count_tasks() == baseline_tasks
        grown_objects = _num_objects() - baseline_objects
        assert grown_objects < _OBJECT_MARGIN, f"{grown_objects} more objects after the soak"
        if baseline_rss is not None:
            grown_rss = _rss_bytes() - baseline_rss
            assert grown_rss < _RSS_MARGIN_BYTES, f"{grown_rss} more resident bytes after the soak"
        assert tally["abort"] and tally["disconnect"] and tally["finish"]
        reasons = server.engine.stats().completed_by_reason
        # An abort or disconnect can race with the request's own last token, so the
        # engine may count some of them as finished; every request is counted once.
        assert reasons.get("abort", 0) >= 1
        assert sum(reasons.values()) == server.engine.stats().num_requests_added
        print(f"soak: {tally}, engine {dict(reasons)}, {grown_objects} more objects")


async def test_closing_the_server_under_load_fails_streams_cleanly():
    engine = engine_config(_SOAK_STEP, max_num_seqs=64)
    async with open_server(engine, server_config(shutdown_grace_s=0.05)) as server:
        failures = []

        async def user(i: int) -> None:
            async with open_client(server.tcp_address, timeout_s=WAIT_S) as client:
                stream = await client.generate([i, 1], max_tokens=3000, ignore_eos=True)
                try:
                    async for _ in stream:
                        pass
                except ConnectionClosedError as exc:  # a client that hears nothing more
                    failures.append(exc)
                except Exception as exc:
                    failures.append(exc)

        async with trio.open_nursery() as nursery:
            for i in range(30):
                nursery.start_soon(user, i)
            await wait_until(lambda: server.engine.core.num_running == 30, what="all running")
            server.shutdown()
        assert len(failures) == 30
        assert all(getattr(exc, "code", None) == "shutdown" for exc in failures), failures[:3]
        with trio.fail_after(WAIT_S):
            await server.wait_stopped()
        await settled(server)


async def _never_reading_client(server, index: int, num_streams: int) -> RawConnection:
    """A client that sends a near-1 MiB text prompt (refused as too long), starts
    `num_streams` long streams, and never reads."""
    conn = await RawConnection.greeted(server, rcvbuf=4096)
    await conn.send(Generate(num_streams, "x" * 900_000, SamplingParams(max_tokens=16)))
    for sid in range(num_streams):
        await conn.send(Generate(sid, [1 + index % 200] * 40,
                                 SamplingParams(max_tokens=4000, ignore_eos=True)))
    return conn


async def test_memory_returns_near_baseline_after_clients_that_never_read_leave():
    num_hogs = 60 if explore() else 40
    num_streams = 8
    engine = engine_config(_SOAK_STEP, max_num_seqs=num_hogs * num_streams, num_blocks=32768,
                           max_num_batched_tokens=1 << 20)
    config = server_config(send_timeout_s=2.0, max_connections=num_hogs + 64)
    async with open_server(engine, config) as server:
        await _soak(server, seed=0, num_clients=20, num_requests=2)  # warm-up
        gc.collect()
        baseline_tasks, baseline_rss = _count_tasks(), _rss_bytes()
        hogs = [await _never_reading_client(server, i, num_streams) for i in range(num_hogs)]
        during_rss = _rss_bytes()
        num_hogs_streaming = len(server.connections)
        # Well-behaved clients are served meanwhile, and the hogs are evicted.
        tally = await _soak(server, seed=2, num_clients=10, num_requests=3)
        await wait_until(lambda: not server.connections, what="hogs evicted")
        for hog in hogs:
            await hog.aclose()
        await settled(server)
        gc.collect()
        await trio.sleep(1.5)  # the watchdog's next heap trim
        after_rss = _rss_bytes()
        assert _count_tasks() == baseline_tasks
        assert tally["finish"] and num_hogs_streaming
        if baseline_rss is not None:
            mib = 1 << 20
            print(f"RSS before {baseline_rss / mib:.0f} MiB, during {during_rss / mib:.0f} MiB "
                  f"({num_hogs_streaming} of {num_hogs} clients that never read still connected), "
                  f"after {after_rss / mib:.0f} MiB")
            assert after_rss - baseline_rss < _ABUSE_RSS_MARGIN_BYTES, (baseline_rss, during_rss, after_rss)
