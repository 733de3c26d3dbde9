"""What the OpenAI HTTP API costs next to the msgpack protocol, on one server in one run.

    python benchmarks/http_vs_msgpack.py [--streams 1,10,100] [--duration-s 5] [--max-tokens 64]

One `cadence serve` child process serves both ports from one engine on the
simulated executor (`--sim-step-us`, default 0: a free executor, so what is
measured is the server, the scheduler and the request actors, not a model).
For each stream count, the msgpack phase and then the HTTP phase run the same
closed loop: that many concurrent streams, each on its own connection (HTTP
kept alive), one request of `--max-tokens` tokens after another.

Per phase: tokens/s received, p50/p99 inter-token latency as the client sees
it (a delta of k tokens counts k gaps of 1/k of its wait), and the server
process's CPU time per token (from /proc); per count, one JSON line with both
phases and the HTTP/msgpack ratios. The clients run in this process and share
the machine's cores with the server, so tokens/s also carries client costs;
the CPU time per token is the server's alone. The HTTP client is the small
server-sent-events reader of `cadence bench --http`, and it counts tokens
without decoding whole events, so neither side pays for a heavy client.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import sys

import trio

from cadence.actors.client import open_client
from cadence.actors.serve.http_client import HttpApiError, SseConnection
from server_child import serve_child

_PROMPT = [1, 2, 3, 4]
# Seconds a phase's connections may take to open before the clock starts.
_CONNECT_TIMEOUT_S = 120.0


def _cpu_s(pid: int) -> float:
    """User plus system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Tally:
    """What the streams of one phase received."""

    def __init__(self) -> None:
        self.tokens = 0
        self.errors = 0
        self.gaps: list[float] = []

    def delta(self, num_tokens: int, previous: float | None, now: float) -> None:
        self.tokens += num_tokens
        if previous is not None and num_tokens:
            self.gaps.extend([(now - previous) / num_tokens] * num_tokens)


async def _msgpack_stream(address, max_tokens: int, tally: _Tally, ready, deadline) -> None:
    async with open_client(address, timeout_s=_CONNECT_TIMEOUT_S) as client:
        await ready()
        while trio.current_time() < deadline():
            stream = await client.generate(_PROMPT, max_tokens=max_tokens, ignore_eos=True)
            previous = None
            async for out in stream:
                if out.token_ids:
                    now = trio.current_time()
                    tally.delta(len(out.token_ids), previous, now)
                    previous = now


_TEXT = re.compile(rb'"text":"((?:[^"\\]|\\.)*)"')


def _num_tokens(event: bytes) -> int:
    """Tokens in an event: the simulated executor's are printable bytes, one character
    each (found without decoding the whole event: the client should cost little)."""
    match = _TEXT.search(event)
    return len(json.loads(b'"' + match.group(1) + b'"')) if match else 0


async def _http_stream(address, max_tokens: int, tally: _Tally, ready, deadline) -> None:
    host, port = address
    stream = await trio.open_tcp_stream(host, port)
    connection = SseConnection(stream, host)
    body = {"prompt": _PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    try:
        await ready()
        while trio.current_time() < deadline():
            previous = None
            async for event in connection.events("/v1/completions", body):
                num_tokens = _num_tokens(event)
                if num_tokens:
                    now = trio.current_time()
                    tally.delta(num_tokens, previous, now)
                    previous = now
    finally:
        await stream.aclose()


async def _phase(kind: str, address, num_streams: int, max_tokens: int, duration_s: float,
                 server_pid: int) -> dict:
    """Closed loop on every stream for `duration_s`."""
    tally = _Tally()
    all_ready = trio.Event()
    clock = {"started": 0.0, "deadline": 0.0, "cpu": 0.0, "num_ready": 0}

    async def ready() -> None:
        clock["num_ready"] += 1
        if clock["num_ready"] == num_streams:  # every connection is open: start the clock
            clock["started"] = trio.current_time()
            clock["deadline"] = clock["started"] + duration_s
            clock["cpu"] = _cpu_s(server_pid)
            all_ready.set()
        await all_ready.wait()

    async def user() -> None:
        run = _msgpack_stream if kind == "msgpack" else _http_stream
        try:
            await run(address, max_tokens, tally, ready, lambda: clock["deadline"])
        except (OSError, HttpApiError, trio.BrokenResourceError):
            tally.errors += 1

    async with trio.open_nursery() as nursery:
        for _ in range(num_streams):
            nursery.start_soon(user)
    elapsed = trio.current_time() - clock["started"]
    cpu = _cpu_s(server_pid) - clock["cpu"]
    gaps = sorted(tally.gaps)
    return {
        "tokens_per_s": round(tally.tokens / elapsed, 1),
        "itl_p50_ms": round(1000 * gaps[len(gaps) // 2], 3) if gaps else None,
        "itl_p99_ms": round(1000 * gaps[int(len(gaps) * 0.99)], 3) if gaps else None,
        "server_cpu_us_per_token": round(1e6 * cpu / tally.tokens, 2) if tally.tokens else None,
        "errors": tally.errors,
    }


def _ratio(http: float | None, msgpack: float | None) -> float | None:
    return round(http / msgpack, 3) if http and msgpack else None


def main(argv: list[str] | None = None) -> int:
    """Start a server, measure each stream count over both protocols, print one JSON line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="1,10,100", help="concurrent streams (default: %(default)s)")
    parser.add_argument("--duration-s", type=float, default=5.0, help="seconds per phase")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--sim-step-us", type=float, default=0.0,
                        help="simulated step time (default: 0, a free executor)")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.streams.split(",")]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2 * max(counts) + 64:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4 * max(counts) + 64), hard))
    with serve_child("--http-port", "0", "--sim-step-us", str(args.sim_step_us),
                     "--max-num-seqs", "1024", "--max-num-batched-tokens", "32768",
                     "--num-blocks", "32768", "--max-connections", str(max(counts) + 16),
                     "--log-level", "warning") as child:
        process, tcp, http = child
        for count in counts:
            phases = {kind: trio.run(_phase, kind, address, count, args.max_tokens, args.duration_s,
                                     process.pid)
                      for kind, address in (("msgpack", tcp), ("http", http))}
            m, h = phases["msgpack"], phases["http"]
            print(json.dumps({
                "benchmark": "http_vs_msgpack", "streams": count, "max_tokens": args.max_tokens,
                "sim_step_us": args.sim_step_us, "duration_s": args.duration_s, "cpus": os.cpu_count(),
                "msgpack": m, "http": h,
                "http_over_msgpack_cpu_per_token": _ratio(h["server_cpu_us_per_token"],
                                                          m["server_cpu_us_per_token"]),
                "msgpack_over_http_tokens_per_s": _ratio(m["tokens_per_s"], h["tokens_per_s"]),
                "http_over_msgpack_itl_p50": _ratio(h["itl_p50_ms"], m["itl_p50_ms"]),
                "http_over_msgpack_itl_p99": _ratio(h["itl_p99_ms"], m["itl_p99_ms"]),
            }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
