"""How much the socket server takes: requests per second it accepts and tokens per
second it streams, for 1, 10, 100 and 1000 connections. One JSON line per count.

    python benchmarks/server_throughput.py [--connections 1,10,100,1000] [--duration-s 5]

The server runs `cadence serve` in a child process with the simulated executor
made free (`--sim-step-us 0`), so the figures measure the server, the
scheduler and the request actors, not a model. The clients run in this
process (Trio), one request at a time per connection (closed loop):

- accept: requests of one output token; requests_per_s counts completed ones.
- stream: requests of `--max-tokens` tokens; tokens_per_s counts tokens received.

Client and server share the machine's cores, so on a small machine the client
side is part of what is measured; `cpus` in each line says how many there were.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import trio

from cadence.actors.client import open_client
from server_child import serve_child


async def _phase(address, num_connections: int, max_tokens: int, duration_s: float) -> dict:
    """Closed loop on every connection for `duration_s`; counts what completed."""
    counts = {"requests": 0, "tokens": 0, "errors": 0}
    ttfts: list[float] = []
    ready = trio.Event()
    num_ready = 0
    started = deadline = 0.0

    async def user(i: int) -> None:
        nonlocal num_ready, started, deadline
        async with open_client(address, timeout_s=120.0) as client:
            num_ready += 1
            if num_ready == num_connections:  # every connection is open: start the clock
                started = trio.current_time()
                deadline = started + duration_s
                ready.set()
            await ready.wait()
            while trio.current_time() < deadline:
                start = trio.current_time()
                try:
                    stream = await client.generate([1 + i % 250, 2, 3, 4], max_tokens=max_tokens,
                                                   ignore_eos=True)
                    first = True
                    async for out in stream:
                        if first and out.token_ids:
                            ttfts.append(trio.current_time() - start)
                            first = False
                        counts["tokens"] += len(out.token_ids)
                    counts["requests"] += 1
                except Exception:
                    counts["errors"] += 1

    async with trio.open_nursery() as nursery:
        for i in range(num_connections):
            nursery.start_soon(user, i)
    elapsed = trio.current_time() - started  # includes the requests in flight at the deadline
    ttfts.sort()
    return {
        "requests_per_s": round(counts["requests"] / elapsed, 1),
        "tokens_per_s": round(counts["tokens"] / elapsed, 1),
        "ttft_p50_ms": round(1000 * ttfts[len(ttfts) // 2], 2) if ttfts else None,
        "ttft_p99_ms": round(1000 * ttfts[int(len(ttfts) * 0.99)], 2) if ttfts else None,
        "errors": counts["errors"],
        "elapsed_s": round(elapsed, 2),
    }


async def _measure(address, num_connections: int, max_tokens: int, duration_s: float) -> dict:
    accept = await _phase(address, num_connections, 1, duration_s)
    stream = await _phase(address, num_connections, max_tokens, duration_s)
    return {
        "benchmark": "server_throughput", "connections": num_connections, "executor": "simulated-free",
        "accept_requests_per_s": accept["requests_per_s"], "accept_ttft_p50_ms": accept["ttft_p50_ms"],
        "stream_max_tokens": max_tokens, "stream_tokens_per_s": stream["tokens_per_s"],
        "stream_requests_per_s": stream["requests_per_s"], "stream_ttft_p50_ms": stream["ttft_p50_ms"],
        "stream_ttft_p99_ms": stream["ttft_p99_ms"],
        "errors": accept["errors"] + stream["errors"], "duration_s": duration_s,
        "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    """Start a server, measure each connection count, print one JSON line per count."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", default="1,10,100,1000",
                        help="connection counts, comma-separated (default: %(default)s)")
    parser.add_argument("--duration-s", type=float, default=5.0, help="seconds per phase")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per streaming request")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.connections.split(",")]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < max(counts) + 64:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(counts) * 2 + 64), hard))
    with serve_child("--sim-step-us", "0", "--max-num-seqs", "1024",
                     "--max-num-batched-tokens", "32768", "--num-blocks", "32768",
                     "--max-connections", str(max(counts) + 16), "--log-level", "warning") as child:
        for count in counts:
            started = time.perf_counter()
            result = trio.run(_measure, child.tcp, count, args.max_tokens, args.duration_s)
            result["wall_s"] = round(time.perf_counter() - started, 1)
            print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
