"""What hostile HTTP clients cost the well-behaved ones: p99 latency of `--clients`
well-behaved clients of the OpenAI HTTP API, alone and beside three attacks at
once, the requests of theirs refused, and the p99 of GET /health meanwhile. One
JSON line per scenario, then one comparing them; the targets are a p99 with the
attacks at most 1.5x the p99 without, none of their requests refused, and a
health p99 of at most 50 ms.

    python benchmarks/hostile_http.py [--clients 8] [--seconds 10] [--slow 1100]

The server is `cadence serve` in a child process on the simulated executor (each
step `--step-us`), loopback only. The well-behaved clients (this process, from
127.0.0.1) each keep one connection alive and send completions one after another
(a 32-token prompt, `--max-tokens` tokens); health is probed on a new connection
every 20 ms. The attacks run in a process of their own (this script with
--attack), from other loopback addresses:

- slowloris: `--slow` connections over `--slow-peers` addresses, each sending a
  request head one byte a second and never finishing it (reconnecting whenever
  the server closes one);
- chunk flood: one completion body after another as 100,000 one-byte chunks;
- long chat: one chat of 10^5 turns after another;
- big bias: one completion after another whose sampling fields hold 10^5
  entries (a logit_bias for each of the simulated model's 257 token ids and
  99,743 allowed_token_ids), each a valid request of one token (`--attacks bias`; not in the default set,
  which the recorded figures were taken with).

The attack's own counts (connections opened, refused, closed by the server,
answers to the floods) are in the attack line. Client, attacks and server share
the machine's cores (`cpus` says how many; the attack process is niced, as its
CPU would be another machine's on a real network; `server_cpu_s` and
`attacker_cpu_s` say what each used), and the file-descriptor limit is raised
to its hard limit for the attack's connections.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import trio

from server_child import cpu_s, serve_child

_HEALTH_EVERY_S = 0.02
# Between the attack's start and the attacked scenario's (the slow connections open).
_RAMP_S = 2.0
_RECONNECT_S = 0.5
_SLOW_BYTE_EVERY_S = 1.0
_IO_TIMEOUT_S = 30.0
_FLOOD_CHUNKS = 100_000
_CHAT_TURNS = 100_000
# Where the floods come from (the slowloris peers are 127.0.0.2 onwards).
_FLOOD_ADDRESS = "127.0.1.1"
_ATTACKS = ("slowloris", "chunks", "chat")
_ALL_ATTACKS = _ATTACKS + ("bias",)
_BIAS_TOKENS = 257  # the simulated model's vocabulary (its byte tokenizer's)
_BIAS_ALLOWED = 100_000 - _BIAS_TOKENS
_BIAS_ADDRESS = "127.0.1.3"
# The attacks run niced: on a real network their CPU is another machine's, and here it
# would otherwise be taken from the server's few cores.
_ATTACKER_NICENESS = 10
_CHAT_ADDRESS = "127.0.1.2"


def _raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _post(path: str, body: bytes) -> bytes:
    return (b"POST %b HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (path.encode(), len(body), body))


class _Reader:
    """Whole HTTP/1.1 responses (content-length framed) off one stream."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream, self.buffer = stream, b""

    async def response(self) -> tuple[int, bytes]:
        while b"\r\n\r\n" not in self.buffer:
            await self._more()
        head, _, rest = self.buffer.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(rest) < length:
            self.buffer = rest
            await self._more()
            rest = self.buffer
        self.buffer = rest[length:]
        return status, rest[:length]

    async def _more(self) -> None:
        data = await self.stream.receive_some(1 << 16)
        if not data:
            raise ConnectionError("closed by the server")
        self.buffer += data


def _percentile(values: list[float], fraction: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


# ---- the well-behaved side -------------------------------------------------------------------

_FAILURES = (OSError, ConnectionError, trio.BrokenResourceError, trio.TooSlowError)


async def _timed(exchange, latencies: list, refused: list) -> bool:
    """Run one exchange (it returns the answer's status): its latency is kept when it
    is a 200, what it got otherwise; False when it failed without an answer."""
    start = time.perf_counter()
    try:
        with trio.fail_after(_IO_TIMEOUT_S):
            status = await exchange()
    except _FAILURES as exc:
        refused.append(type(exc).__name__)
        return False
    if status == 200:
        latencies.append(time.perf_counter() - start)
    else:
        refused.append(status)
    return True


async def _client(address, body: bytes, until_s: float, latencies: list, refused: list) -> None:
    connection: list = []  # [stream, reader] while one is open

    async def exchange() -> int:
        if not connection:
            stream = await trio.open_tcp_stream(*address, local_address="127.0.0.1")
            connection.extend((stream, _Reader(stream)))
        await connection[0].send_all(_post("/v1/completions", body))
        return (await connection[1].response())[0]

    while time.monotonic() < until_s:
        if not await _timed(exchange, latencies, refused) and connection:
            await connection[0].aclose()
            connection.clear()
    if connection:
        await connection[0].aclose()


async def _health(address, until_s: float, latencies: list, refused: list) -> None:
    async def exchange() -> int:
        async with await trio.open_tcp_stream(*address, local_address="127.0.0.1") as stream:
            await stream.send_all(b"GET /health HTTP/1.1\r\nhost: bench\r\n\r\n")
            return (await _Reader(stream).response())[0]

    while time.monotonic() < until_s:
        await _timed(exchange, latencies, refused)
        await trio.sleep(_HEALTH_EVERY_S)


async def _well_behaved(address, args) -> dict:
    body = json.dumps({"prompt": list(range(1, 33)), "max_tokens": args.max_tokens,
                       "ignore_eos": True}).encode()
    latencies: list[float] = []
    refused: list = []
    health: list[float] = []
    health_refused: list = []
    until_s = time.monotonic() + args.seconds
    async with trio.open_nursery() as nursery:
        for _ in range(args.clients):
            nursery.start_soon(_client, address, body, until_s, latencies, refused)
        nursery.start_soon(_health, address, until_s, health, health_refused)
    return {"num_requests": len(latencies), "num_refused": len(refused),
            "refused": sorted(set(map(str, refused))),
            "p50_ms": _ms(_percentile(latencies, 0.5)), "p99_ms": _ms(_percentile(latencies, 0.99)),
            "health_p99_ms": _ms(_percentile(health, 0.99)), "health_max_ms": _ms(max(health, default=None)),
            "num_health": len(health), "num_health_refused": len(health_refused)}


def _spent(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else round(after - before, 2)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


# ---- the attacks (their own process) --------------------------------------------------------

async def _slow_connection(address, source: str, counts: dict) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\n" + b"x-slow: " + b"a" * 10_000
    while True:
        try:
            stream = await trio.open_tcp_stream(*address, local_address=source)
        except OSError:
            counts["connect_failed"] += 1
            await trio.sleep(_RECONNECT_S)
            continue
        counts["opened"] += 1
        reply = []

        async def trickle(cancel_scope):
            try:
                for byte in head:
                    await stream.send_all(bytes([byte]))
                    await trio.sleep(_SLOW_BYTE_EVERY_S)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                cancel_scope.cancel()

        async with stream:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trickle, nursery.cancel_scope)
                try:
                    while data := await stream.receive_some(1 << 16):
                        reply.append(data)
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
                nursery.cancel_scope.cancel()
        refused = b"".join(reply).startswith((b"HTTP/1.1 429", b"HTTP/1.1 503"))
        counts["refused" if refused else "closed"] += 1
        await trio.sleep(_RECONNECT_S)


async def _flood(address, source: str, raw: bytes, counts: dict, name: str) -> None:
    while True:
        try:
            with trio.fail_after(_IO_TIMEOUT_S):
                stream = await trio.open_tcp_stream(*address, local_address=source)
                async with stream:
                    await stream.send_all(raw)
                    status, _ = await _Reader(stream).response()
            counts[f"{name}_{status}"] += 1
        except _FAILURES as exc:
            counts[f"{name}_{type(exc).__name__}"] += 1
            await trio.sleep(_RECONNECT_S)


async def _attack(address, args) -> None:
    from collections import Counter

    counts: Counter = Counter()
    chunk_body = json.dumps({"prompt": "a" * (_FLOOD_CHUNKS - 40), "max_tokens": 1}).encode()
    chunked = (b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ntransfer-encoding: chunked\r\n\r\n"
               + b"".join(b"1\r\n%c\r\n" % byte for byte in chunk_body) + b"0\r\n\r\n")
    chat = _post("/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "hi"}] * _CHAT_TURNS, "max_tokens": 1}).encode())
    async with trio.open_nursery() as nursery:
        for index in range(args.slow if "slowloris" in args.attacks else 0):
            source = f"127.0.0.{2 + index % args.slow_peers}"
            nursery.start_soon(_slow_connection, address, source, counts)
            if index % 100 == 99:
                await trio.sleep(0.05)
        if "chunks" in args.attacks:
            nursery.start_soon(_flood, address, _FLOOD_ADDRESS, chunked, counts, "chunk_flood")
        if "chat" in args.attacks:
            nursery.start_soon(_flood, address, _CHAT_ADDRESS, chat, counts, "long_chat")
        if "bias" in args.attacks:
            bias = _post("/v1/completions", json.dumps(
                {"prompt": "hi", "max_tokens": 1, "logit_bias": {str(i): 0.0 for i in range(_BIAS_TOKENS)},
                 "allowed_token_ids": [i % _BIAS_TOKENS for i in range(_BIAS_ALLOWED)]}).encode())
            nursery.start_soon(_flood, address, _BIAS_ADDRESS, bias, counts, "big_bias")
        print("ready", flush=True)
        await trio.sleep(args.seconds)
        nursery.cancel_scope.cancel()
    print(json.dumps(dict(counts)), flush=True)


# ---- the run ----------------------------------------------------------------------------------

def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each scenario")
    parser.add_argument("--slow", type=int, default=1100, help="slowloris connections")
    parser.add_argument("--slow-peers", type=int, default=22, help="addresses they come from")
    parser.add_argument("--attacks", default=",".join(_ATTACKS),
                        help=f"which attacks, comma-separated, of {','.join(_ALL_ATTACKS)} "
                             f"(default: {','.join(_ATTACKS)})")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--step-us", type=float, default=2000.0, help="simulated step time")
    parser.add_argument("--attack", metavar="HOST:PORT", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    fd_limit = _raise_fd_limit()
    if args.attack is not None:
        host, port = args.attack.rsplit(":", 1)
        trio.run(_attack, (host, int(port)), args)
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with serve_child("--sim-step-us", str(args.step_us), "--log-level", "error") as child:
        address, pid = child.http, child.process.pid
        before = cpu_s(pid)
        alone = trio.run(_well_behaved, address, args)
        alone["server_cpu_s"] = _spent(before, cpu_s(pid))
        print(json.dumps({"scenario": "alone", "clients": args.clients, "cpus": cpus, **alone}), flush=True)
        attacker = subprocess.Popen(
            [sys.executable, __file__, "--attack", f"{address[0]}:{address[1]}",
             "--seconds", str(args.seconds + _RAMP_S + 1), "--slow", str(args.slow),
             "--slow-peers", str(args.slow_peers), "--attacks", args.attacks],
            stdout=subprocess.PIPE, text=True, preexec_fn=lambda: os.nice(_ATTACKER_NICENESS))
        try:
            assert attacker.stdout.readline().strip() == "ready"
            time.sleep(_RAMP_S)  # the slow connections are all open
            before, attacker_before = cpu_s(pid), cpu_s(attacker.pid)
            attacked = trio.run(_well_behaved, address, args)
            attacked["server_cpu_s"] = _spent(before, cpu_s(pid))
            attacked["attacker_cpu_s"] = _spent(attacker_before, cpu_s(attacker.pid))
            counts = attacker.communicate(timeout=_IO_TIMEOUT_S)[0].strip().splitlines()
        finally:
            attacker.kill()
        print(json.dumps({"scenario": "attacked", "attacks": args.attacks, "clients": args.clients, "cpus": cpus,
                          "slow": args.slow, "slow_peers": args.slow_peers, "fd_limit": fd_limit,
                          **attacked, "attack": json.loads(counts[-1]) if counts else None}), flush=True)
    ratio = (attacked["p99_ms"] / alone["p99_ms"]) if alone["p99_ms"] and attacked["p99_ms"] else None
    met = (ratio is not None and ratio <= 1.5 and attacked["num_refused"] == 0
           and attacked["health_p99_ms"] is not None and attacked["health_p99_ms"] <= 50.0)
    print(json.dumps({"scenario": "comparison", "p99_ratio": None if ratio is None else round(ratio, 3),
                      "num_refused": attacked["num_refused"], "health_p99_ms": attacked["health_p99_ms"],
                      "targets_met": met}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
