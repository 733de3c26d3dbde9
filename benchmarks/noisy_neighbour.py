"""What abusive clients cost the well-behaved ones: p99 time to first token and
inter-token latency of `--clients` well-behaved clients, alone and next to
`--abusers` abusive ones (in a process of their own). One JSON line per scenario, then one with the ratios
(with / without); the target is a ratio of at most 1.5.

    python benchmarks/noisy_neighbour.py [--clients 8] [--abusers 4] [--requests 16]

The server is `cadence serve` in a child process with the simulated executor,
each step taking `--step-us` whatever its batch, so a slower token can only
come from the server's own work (event loop, tokenisation, stop strings,
writes), not from a bigger batch. Every client is the msgpack client of
`cadence.actors.client`, in this process (Trio). A well-behaved client runs
`--requests` requests one after another (a 32-token prompt, `--max-tokens`
tokens). The abusers take turns at the kinds of abuse in `--kinds`, cycling:

- stop: requests with `--stop-strings` stop strings of `--stop-chars`
  characters each (by default the server's default limit), none of which
  ever matches, so each is checked against every token;
- prompt: text prompts of `--prompt-bytes` bytes (just under the frame limit),
  over and over (refused as too long, after the server has read them);
- frame: valid one-token requests whose frames hold 10^5 sampling entries (a
  logit_bias for each of the simulated model's 257 token ids and 99,743
  allowed_token_ids), one after another: each entry is checked as the frame is
  decoded (not in the default kinds, which the recorded figures were taken with);
- silent: a connection that starts `--silent-streams` streams as long as the
  model allows and never reads after the Welcome (the server holds their output,
  then closes the connection once it holds `max_unsent_bytes`, or after its send
  timeout).

Client and server share the machine's cores; `cpus` in each line says how many.
`--elsewhere` points the abusers at a second server process instead: the
well-behaved clients' server then does none of the abusers' work, and what is
left of the ratio is the abuse's CPU taken from a machine with few cores.
`--runs N` repeats both scenarios N times and ends with a summary line of the
ratios (each run's are printed as they come).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack

import trio

from cadence.actors.client import open_client
from server_child import cpu_s, serve_child
from cadence.actors.wire import (
    MAX_REPLY_FRAME_BYTES, FrameBuffer, Generate, Hello, SamplingParams, ServerError, decode_reply,
    encode, pack_frame,
)

# Printable ASCII: what the simulated executor samples with the byte tokenizer.
_FIRST_PRINTABLE, _NUM_PRINTABLE = 32, 95
# Bytes of the socket receive buffer of a client that never reads, and the prompt
# of each of its requests.
_SILENT_RCVBUF = 4096
_SILENT_PROMPT_TOKENS = 32
_WAIT_S = 120.0
# The most a p99 may grow next to the abusers (with / alone).
_TARGET = 1.5


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _well_behaved(address, index: int, args, ttft: list[float], itl: list[float]) -> None:
    prompt = [_FIRST_PRINTABLE + (index * 7 + k) % _NUM_PRINTABLE for k in range(32)]
    async with open_client(address, timeout_s=_WAIT_S) as client:
        for _ in range(args.requests):
            sent = previous = time.perf_counter()
            stream = await client.generate(prompt, max_tokens=args.max_tokens, ignore_eos=True)
            first = True
            async for out in stream:
                if not out.token_ids:
                    continue
                now = time.perf_counter()
                if first:
                    ttft.append(now - sent)
                    first = False
                else:
                    # A coalesced delta carries several tokens: its gap is theirs together.
                    itl.extend([(now - previous) / len(out.token_ids)] * len(out.token_ids))
                previous = now


async def _abuse_stop(address, args, done: trio.Event) -> None:
    stops = [chr(1 + k % 30) * args.stop_chars for k in range(args.stop_strings)]
    async with open_client(address, timeout_s=_WAIT_S) as client:
        while not done.is_set():
            try:
                await client.complete("hello", max_tokens=args.max_tokens, stop=stops, ignore_eos=True)
            except ServerError:
                await trio.sleep(0)  # refused (a limit on stop strings): try again


async def _abuse_prompt(address, args, done: trio.Event) -> None:
    text = "x" * args.prompt_bytes
    async with open_client(address, timeout_s=_WAIT_S) as client:
        while not done.is_set():
            try:
                await client.complete(text, max_tokens=1)
            except ServerError:
                pass  # too long: the point was making the server read and refuse it


_FRAME_VOCAB = 257  # the simulated model's vocabulary (its byte tokenizer's)
_FRAME_ENTRIES = 100_000


async def _abuse_frame(address, args, done: trio.Event) -> None:
    params = SamplingParams(max_tokens=1, logit_bias={i: 0.0 for i in range(_FRAME_VOCAB)},
                            allowed_token_ids=[i % _FRAME_VOCAB for i in range(_FRAME_ENTRIES - _FRAME_VOCAB)])
    async with open_client(address, timeout_s=_WAIT_S) as client:
        while not done.is_set():
            await client.complete("hi", params)


async def _abuse_silent(address, args, done: trio.Event) -> None:
    while not done.is_set():
        sock = trio.socket.socket()
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, _SILENT_RCVBUF)
        await sock.connect(address)
        stream = trio.SocketStream(sock)
        try:
            await stream.send_all(pack_frame(encode(Hello(client="silent"))))
            # The one frame it reads: the Welcome, for the longest request that is
            # not refused (a refused one would hold nothing on the server).
            welcome = await _first_frame(stream)
            max_tokens = welcome.max_model_len - _SILENT_PROMPT_TOKENS
            for sid in range(args.silent_streams):
                await stream.send_all(pack_frame(encode(Generate(
                    sid, [_FIRST_PRINTABLE] * _SILENT_PROMPT_TOKENS,
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True)))))
            # Never read; wait until the server gives up on us (or the run ends).
            with trio.move_on_after(_WAIT_S):
                await done.wait()
        except (trio.BrokenResourceError, OSError):
            pass
        finally:
            await stream.aclose()


async def _first_frame(stream: trio.SocketStream):
    buffer = FrameBuffer(MAX_REPLY_FRAME_BYTES)
    while (frame := buffer.next_frame()) is None:
        data = await stream.receive_some(_SILENT_RCVBUF)
        if not data:
            raise trio.BrokenResourceError("the server closed before its Welcome")
        buffer.feed(data)
    return decode_reply(frame)


_ABUSE = {"stop": _abuse_stop, "prompt": _abuse_prompt, "silent": _abuse_silent, "frame": _abuse_frame}


async def _abuse(address, args) -> None:
    """The abusers (this process is a child of the benchmark): until killed."""
    kinds = args.kinds.split(",")
    done = trio.Event()
    async with trio.open_nursery() as nursery:
        for k in range(args.abusers):
            nursery.start_soon(_ABUSE[kinds[k % len(kinds)]], address, args, done)


def _start_abusers(address, args) -> subprocess.Popen:
    """The abusers in a process of their own, so that their client-side work
    (building megabyte frames) is not charged to the well-behaved clients."""
    command = [sys.executable, os.path.abspath(__file__), "--abuse-at", f"{address[0]}:{address[1]}",
               "--abusers", str(args.abusers), "--kinds", args.kinds,
               "--max-tokens", str(args.max_tokens), "--stop-strings", str(args.stop_strings),
               "--stop-chars", str(args.stop_chars), "--prompt-bytes", str(args.prompt_bytes),
               "--silent-streams", str(args.silent_streams)]
    return subprocess.Popen(command)


async def _scenario(address, args) -> dict:
    ttft: list[float] = []
    itl: list[float] = []
    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for index in range(args.clients):
            nursery.start_soon(_well_behaved, address, index, args, ttft, itl)
    return {
        "clients": args.clients, "requests": len(ttft),
        "ttft_p50_s": _percentile(ttft, 0.5), "ttft_p99_s": _percentile(ttft, 0.99),
        "itl_p50_s": _percentile(itl, 0.5), "itl_p99_s": _percentile(itl, 0.99),
        "elapsed_s": time.perf_counter() - start,
    }


def _serve(args):
    # Two signals: the second closes at once, whatever the abusers left behind.
    return serve_child("--sim-step-us", str(args.step_us), "--log-level", "error", num_signals=2)


def _run(args, num_abusers: int) -> dict:
    """One scenario; with CPU seconds each process spent while the clients ran (the
    well-behaved clients' server, the abusers' process and, with --elsewhere, their
    server), to tell the server's own work from the abuse's share of the cores."""
    with _serve(args) as child, ExitStack() as stack:
        abusers = other = None
        try:
            if num_abusers:
                other = stack.enter_context(_serve(args)) if args.elsewhere else None
                abusers = _start_abusers((other or child).tcp, args)
                time.sleep(args.warmup_s)  # let the abuse reach its steady state
            pids = {"server": child.process.pid, "abusers": abusers and abusers.pid,
                    "abusers_server": other and other.process.pid}
            before = {name: cpu_s(pid) for name, pid in pids.items() if pid}
            result = trio.run(_scenario, child.tcp, args)
            for name, start in before.items():
                end = cpu_s(pids[name])
                if start is not None and end is not None:
                    result[f"{name}_cpu_s"] = round(end - start, 3)
            return result
        finally:
            if abusers is not None:
                abusers.kill()
                abusers.wait()


def main(argv: list[str] | None = None) -> int:
    """Run both scenarios and print one JSON line for each and one for the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--abusers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=16, help="per well-behaved client")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--step-us", type=float, default=2000.0, help="simulated step time")
    parser.add_argument("--stop-strings", type=int, default=16)
    parser.add_argument("--stop-chars", type=int, default=256)
    parser.add_argument("--prompt-bytes", type=int, default=(1 << 20) - 1024)
    parser.add_argument("--silent-streams", type=int, default=8)
    parser.add_argument("--kinds", default="stop,prompt,silent",
                        help="kinds of abuse the abusers take in turn (stop, prompt, silent, frame)")
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--elsewhere", action="store_true",
                        help="abusers load a second server process (CPU contention alone)")
    parser.add_argument("--runs", type=int, default=1, help="repeat both scenarios this many times")
    parser.add_argument("--abuse-at", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.abuse_at is not None:
        host, port = args.abuse_at.rsplit(":", 1)
        trio.run(_abuse, (host, int(port)), args)
        return 0
    cpus = os.cpu_count()
    common = {"bench": "noisy_neighbour", "cpus": cpus, "kinds": args.kinds,
              "elsewhere": args.elsewhere}
    ratios: dict[str, list[float]] = {"ttft_p99_ratio": [], "itl_p99_ratio": []}
    for run in range(args.runs):
        results = {}
        for name, num_abusers in (("alone", 0), ("with_abusers", args.abusers)):
            results[name] = _run(args, num_abusers)
            print(json.dumps({**common, "scenario": name, "run": run, "abusers": num_abusers,
                              "load_avg_1m": os.getloadavg()[0], **results[name]}), flush=True)
        alone, noisy = results["alone"], results["with_abusers"]
        ratio = {"ttft_p99_ratio": noisy["ttft_p99_s"] / alone["ttft_p99_s"],
                 "itl_p99_ratio": noisy["itl_p99_s"] / alone["itl_p99_s"]}
        for key, value in ratio.items():
            ratios[key].append(value)
        print(json.dumps({**common, "scenario": "ratio", "run": run, **ratio, "target": _TARGET}),
              flush=True)
    if args.runs > 1:
        summary = {f"{key}_{name}": fn(values) for key, values in ratios.items()
                   for name, fn in (("min", min), ("median", statistics.median), ("max", max))}
        met = sum(all(ratios[key][run] <= _TARGET for key in ratios) for run in range(args.runs))
        print(json.dumps({**common, "scenario": "summary", "runs": args.runs, **summary,
                          "runs_meeting_target": met, "target": _TARGET}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
