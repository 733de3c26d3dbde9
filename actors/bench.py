"""`cadence bench`: replay a workload against a server or an embedded engine and
report serving latencies.

Workloads (cadence.actors.workloads): `nano-vllm`, the exact workload of
nano-vllm's bench.py (256 requests, prompt and output lengths uniform in
[100, 1024], 133,966 output tokens); the trace presets (`nano`, the same
shape drawn by the trace generator, `poisson`, `prefix`, `overload`, `backlog`,
`starve`); or a
JSON-lines trace in the presets' format. Every request
asks for exactly its output length (EOS ignored). Arrivals follow
`--request-rate` (Poisson, seeded) or all come at once.

Reported, from the client's side: time to first token (TTFT), time per output
token after the first (TPOT), inter-token latency (ITL: the gap between
deltas, spread over the tokens a delta carries), end-to-end latency (E2E),
their mean and percentiles; request, output-token and total-token throughput;
and goodput: requests per second that met every SLO given.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import threading
from typing import Any, AsyncIterator, Callable

import attrs
import trio

from cadence.statemachine.errors import CadenceError, ConfigError
from cadence.statemachine.sampling import SamplingParams

from . import workloads
from .client import AsyncClient, open_client
from .engine import Engine, open_engine
from .engine_args import add_engine_arguments, engine_config_from_args
from .serve.http import DEFAULT_HTTP_PORT
from .serve.http_client import HttpApiClient, HttpApiError
from .unwrap import unwrap_sole_error
from .wire import DEFAULT_PORT

__all__ = [
    "BenchRequest",
    "RequestTiming",
    "Sample",
    "BenchResult",
    "load_workload",
    "run_benchmark",
    "summarize",
    "format_result",
    "write_plot",
    "add_bench_parser",
    "run_bench",
]

NANO_VLLM = "nano-vllm"
_DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
# Streams per connection when the benchmark opens several (the server's default
# per-connection limit is 256).
_STREAMS_PER_CONNECTION = 128
# The exit status of a user's mistake, as for every `cadence` command.
USAGE_ERROR = 2
# Exit status of a run ended by Ctrl-C (128 + SIGINT, as shells report it).
INTERRUPTED = 130


@attrs.frozen
class BenchRequest:
    """One request of a workload: its prompt and how many tokens to generate."""

    prompt_token_ids: list[int]
    max_tokens: int
    priority: int = 0


@attrs.define
class RequestTiming:
    """What the benchmark measured for one request (seconds on the Trio clock)."""

    num_prompt_tokens: int
    start_s: float
    first_token_s: float | None = None
    end_s: float | None = None
    num_tokens: int = 0
    itl_s: list[float] = attrs.Factory(list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the request finished without error."""
        return self.error is None and self.end_s is not None


@attrs.frozen
class Sample:
    """The engine's state at one moment of the run."""

    t_s: float
    num_running: int
    num_waiting: int
    kv_usage: float
    num_batches: int
    num_scheduled_requests: float


@attrs.frozen
class BenchResult:
    """The summary `cadence bench` prints (and writes as JSON)."""

    workload: str
    target: str
    num_requests: int
    num_completed: int
    num_failed: int
    duration_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float
    slo: dict[str, float]
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    first_error: str | None


# ---- workloads -------------------------------------------------------------------------------


def load_workload(name: str, num_requests: int | None = None) -> list[BenchRequest]:
    """The requests of `nano-vllm`, a trace preset or a .jsonl trace, in arrival order."""
    if name == NANO_VLLM:
        workload = workloads.nano()
        if num_requests is not None:
            workload = workload.head(num_requests)
        return [BenchRequest(list(p), o) for p, o in zip(workload.prompts, workload.output_lens)]
    if name.endswith(".jsonl"):
        records = workloads.load(name)
    elif name in workloads.PRESETS:
        records = workloads.generate(name)
    else:
        raise ConfigError(f"unknown workload {name!r}; choose from {NANO_VLLM}, "
                          f"{', '.join(workloads.PRESETS)} or give a .jsonl trace")
    if num_requests is not None:
        records = records[:num_requests]
    return [BenchRequest(workloads.prompt_tokens(r), r["output_len"], r.get("priority", 0))
            for r in records]


def _fit_vocab(requests: list[BenchRequest], vocab_size: int) -> tuple[list[BenchRequest], bool]:
    """Fold token ids into the target's vocabulary (the simulated model's is small);
    equal ids stay equal, so shared prefixes stay shared."""
    if all(t < vocab_size for r in requests for t in r.prompt_token_ids):
        return requests, False
    return [attrs.evolve(r, prompt_token_ids=[t % vocab_size for t in r.prompt_token_ids])
            for r in requests], True


# ---- targets ---------------------------------------------------------------------------------


class _ServerTarget:
    """Requests spread over a few connections to a running server."""

    def __init__(self, clients: list[AsyncClient], stats_client: AsyncClient) -> None:
        self.clients = clients
        self.stats_client = stats_client
        self.vocab_size = stats_client.welcome.vocab_size
        self._next = 0

    async def stream(self, request: BenchRequest) -> AsyncIterator[int]:
        client = self.clients[self._next % len(self.clients)]
        self._next += 1
        stream = await client.generate(request.prompt_token_ids, max_tokens=request.max_tokens,
                                       ignore_eos=True, priority=request.priority)
        async with stream:
            async for out in stream:
                yield len(out.token_ids)

    async def sample(self) -> dict[str, Any]:
        return await self.stats_client.stats()


class _HttpTarget:
    """Requests streamed from the OpenAI HTTP API, one kept-alive connection per
    request in flight; token counts come from the `return_token_ids` extension."""

    def __init__(self, client, model: dict) -> None:
        self.client = client
        self.vocab_size = model["vocab_size"]
        self.model = model["id"]

    async def stream(self, request: BenchRequest) -> AsyncIterator[int]:
        body = {"model": self.model, "prompt": request.prompt_token_ids, "stream": True,
                "max_tokens": request.max_tokens, "ignore_eos": True, "priority": request.priority,
                "return_token_ids": True}
        try:
            async for data in self.client.stream("/v1/completions", body):
                choices = json.loads(data)["choices"]
                yield len(choices[0]["token_ids"]) if choices else 0
        except OSError as exc:
            raise HttpApiError(f"the connection failed: {exc}") from None


class _EngineTarget:
    """Requests submitted straight to an engine in this process."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.vocab_size = engine.vocab_size

    async def stream(self, request: BenchRequest) -> AsyncIterator[int]:
        params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)
        stream = self.engine.generate(request.prompt_token_ids, params, priority=request.priority)
        try:
            async for out in stream:
                yield len(out.token_ids)
        finally:
            await stream.aclose()

    async def sample(self) -> dict[str, Any]:
        return self.engine.stats().as_dict()


# ---- running ---------------------------------------------------------------------------------


async def _one(target, request: BenchRequest, timing: RequestTiming) -> None:
    previous = None
    try:
        async for num_new in target.stream(request):
            if not num_new:
                continue
            now = trio.current_time()
            if timing.first_token_s is None:
                timing.first_token_s = now
            elif previous is not None:
                timing.itl_s.extend([(now - previous) / num_new] * num_new)
            previous = now
            timing.num_tokens += num_new
        timing.end_s = trio.current_time()
    except CadenceError as exc:
        timing.error = f"{type(exc).__name__}: {exc}"


async def _sampler(target, samples: list[Sample], start_s: float, interval_s: float) -> None:
    while True:
        stats = await target.sample()
        samples.append(Sample(
            t_s=trio.current_time() - start_s, num_running=stats["num_running"],
            num_waiting=stats["num_waiting"], kv_usage=stats["kv_usage"],
            num_batches=stats["num_batches_scheduled"],
            num_scheduled_requests=stats["avg_batch_size"] * stats["num_batches_scheduled"]))
        await trio.sleep(interval_s)


async def run_benchmark(target, requests: list[BenchRequest], *, request_rate: float = math.inf,
                        max_concurrency: int | None = None, seed: int = 0,
                        sample_interval_s: float | None = None,
                        on_done: Callable[[], None] | None = None,
                        stop: trio.Event | None = None,
                        ) -> tuple[list[RequestTiming], list[Sample], float]:
    """Send every request (Poisson arrivals at `request_rate`, at most
    `max_concurrency` at once) and time each; returns the timings, the engine
    samples (when `sample_interval_s` is set) and the run's duration. When `stop`
    is set the run ends there: what was sent and had not finished counts as
    failed ("interrupted"), what was not sent yet is left out."""
    rng = random.Random(seed)
    limiter = trio.CapacityLimiter(max_concurrency) if max_concurrency else None
    timings: list[RequestTiming] = []
    samples: list[Sample] = []

    async def send(request: BenchRequest, timing: RequestTiming) -> None:
        if limiter is not None:
            async with limiter:
                timing.start_s = trio.current_time()
                await _one(target, request, timing)
        else:
            await _one(target, request, timing)
        if on_done is not None:
            on_done()

    start = trio.current_time()
    async with trio.open_nursery() as outer:
        if sample_interval_s:
            outer.start_soon(_sampler, target, samples, start, sample_interval_s)
        if stop is not None:
            outer.start_soon(_cancel_when_set, stop, outer.cancel_scope)
        async with trio.open_nursery() as nursery:
            for request in requests:
                timing = RequestTiming(len(request.prompt_token_ids), trio.current_time())
                timings.append(timing)
                nursery.start_soon(send, request, timing)
                if math.isfinite(request_rate):
                    await trio.sleep(rng.expovariate(request_rate))
        outer.cancel_scope.cancel()
    for timing in timings:
        if timing.end_s is None and timing.error is None:
            timing.error = "interrupted"
    return timings, samples, trio.current_time() - start


async def _cancel_when_set(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def _set_on_sigint(event: trio.Event) -> None:
    """Ctrl-C ends the run with a summary of what finished (a second one is not caught)."""
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async for _ in signals:
            event.set()
            return


def _stats_ms(values: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, **{f"p{p:g}": math.nan for p in percentiles}}
    ordered = sorted(values)
    out = {"mean": 1000.0 * sum(ordered) / len(ordered)}
    for p in percentiles:
        # Linear interpolation between closest ranks, as numpy's default.
        rank = (len(ordered) - 1) * p / 100.0
        low, high = math.floor(rank), math.ceil(rank)
        value = ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
        out[f"p{p:g}"] = 1000.0 * value
    return out


def summarize(workload: str, target: str, timings: list[RequestTiming], duration_s: float,
              slo: dict[str, float], percentiles: tuple[float, ...] = _DEFAULT_PERCENTILES) -> BenchResult:
    """Latency statistics, throughput and goodput of a run. `slo` maps "ttft_ms",
    "tpot_ms" and/or "e2e_ms" to the most a good request may take."""
    done = [t for t in timings if t.ok]
    ttft = [t.first_token_s - t.start_s for t in done if t.first_token_s is not None]
    e2e = [t.end_s - t.start_s for t in done]
    tpot = [(t.end_s - t.first_token_s) / (t.num_tokens - 1)
            for t in done if t.first_token_s is not None and t.num_tokens > 1]
    itl = [gap for t in done for gap in t.itl_s]
    good = sum(1 for t in done if _meets(t, slo))
    num_output = sum(t.num_tokens for t in timings)
    num_prompt = sum(t.num_prompt_tokens for t in done)
    per_s = 1.0 / duration_s if duration_s > 0 else math.nan
    failed = [t for t in timings if not t.ok]
    return BenchResult(
        workload=workload, target=target, num_requests=len(timings), num_completed=len(done),
        num_failed=len(failed), duration_s=duration_s, num_prompt_tokens=num_prompt,
        num_output_tokens=num_output, request_throughput=len(done) * per_s,
        output_throughput=num_output * per_s, total_token_throughput=(num_prompt + num_output) * per_s,
        goodput=good * per_s, slo=dict(slo), ttft_ms=_stats_ms(ttft, percentiles),
        tpot_ms=_stats_ms(tpot, percentiles), itl_ms=_stats_ms(itl, percentiles),
        e2e_ms=_stats_ms(e2e, percentiles), first_error=failed[0].error if failed else None)


def _meets(timing: RequestTiming, slo: dict[str, float]) -> bool:
    ttft_ms = 1000.0 * (timing.first_token_s - timing.start_s) if timing.first_token_s else math.inf
    e2e_ms = 1000.0 * (timing.end_s - timing.start_s)
    tpot_ms = (1000.0 * (timing.end_s - timing.first_token_s) / (timing.num_tokens - 1)
               if timing.first_token_s is not None and timing.num_tokens > 1 else 0.0)
    measured = {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "e2e_ms": e2e_ms}
    return all(measured[name] <= limit for name, limit in slo.items())


def format_result(result: BenchResult) -> str:
    """The result as an aligned table."""
    slo = ", ".join(f"{name.removesuffix('_ms').upper()} <= {limit:g} ms"
                    for name, limit in result.slo.items()) or "none"
    rows = [
        ("workload", result.workload), ("target", result.target),
        ("requests completed", f"{result.num_completed} of {result.num_requests}"),
        ("requests failed", str(result.num_failed)),
        ("duration (s)", f"{result.duration_s:.2f}"),
        ("prompt tokens", str(result.num_prompt_tokens)),
        ("output tokens", str(result.num_output_tokens)),
        ("request throughput (req/s)", f"{result.request_throughput:.2f}"),
        ("output throughput (tok/s)", f"{result.output_throughput:.1f}"),
        ("total throughput (tok/s)", f"{result.total_token_throughput:.1f}"),
        (f"goodput (req/s), SLO {slo}", f"{result.goodput:.2f}"),
    ]
    lines = [f"{name:<52} {value}" for name, value in rows]
    for title, stats in (("time to first token", result.ttft_ms),
                         ("time per output token (after the first)", result.tpot_ms),
                         ("inter-token latency", result.itl_ms), ("end-to-end latency", result.e2e_ms)):
        lines.append(f"-- {title} (ms) ".ljust(60, "-"))
        lines.extend(f"  {name:<50} {value:.2f}" for name, value in stats.items())
    if result.first_error:
        lines.append(f"first error: {result.first_error}")
    return "\n".join(lines)


# ---- plotting --------------------------------------------------------------------------------


def _require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib, which is not installed (pip install 'cadence[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plot(path: str, samples: list[Sample], timings: list[RequestTiming]) -> None:
    """A PNG with batch size, KV usage, running/waiting over time and latency CDFs."""
    plt = _require_matplotlib()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    t = [s.t_s for s in samples]
    batch = []
    for before, after in zip(samples, samples[1:]):
        steps = after.num_batches - before.num_batches
        batch.append((after.num_scheduled_requests - before.num_scheduled_requests) / steps
                     if steps else 0.0)
    axes[0][0].plot(t[1:], batch)
    axes[0][0].set(title="batch size (requests per step)", xlabel="time (s)")
    axes[0][1].plot(t, [100.0 * s.kv_usage for s in samples])
    axes[0][1].set(title="KV cache usage (%)", xlabel="time (s)", ylim=(0, 100))
    axes[1][0].plot(t, [s.num_running for s in samples], label="running")
    axes[1][0].plot(t, [s.num_waiting for s in samples], label="waiting")
    axes[1][0].set(title="requests", xlabel="time (s)")
    axes[1][0].legend()
    done = [x for x in timings if x.ok]
    for label, values in (("TTFT", [x.first_token_s - x.start_s for x in done if x.first_token_s]),
                          ("E2E", [x.end_s - x.start_s for x in done])):
        ordered = sorted(values)
        if ordered:
            axes[1][1].plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)
    axes[1][1].set(title="latency CDF", xlabel="seconds", ylabel="fraction of requests")
    axes[1][1].legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---- the command -----------------------------------------------------------------------------


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `bench` subcommand to an argparse subparsers object."""
    parser = subparsers.add_parser(
        "bench", help="measure serving latency and throughput on a workload",
        description="Replay a workload against a running server (default 127.0.0.1:%d) or, with "
                    "--embedded, an engine in this process; print TTFT, TPOT, ITL and E2E "
                    "percentiles, throughput and goodput." % DEFAULT_PORT)
    work = parser.add_argument_group("workload")
    work.add_argument("--workload", default=NANO_VLLM,
                      help="nano-vllm (the exact workload of nano-vllm's benchmark), nano, poisson, "
                           "prefix, overload, backlog, starve (trace presets), or a .jsonl trace "
                           "(default: %(default)s)")
    work.add_argument("--num-requests", type=int, default=None, help="use only the first N requests")
    work.add_argument("--request-rate", type=float, default=math.inf,
                      help="Poisson arrivals per second (default: inf, all at once)")
    work.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    work.add_argument("--arrival-seed", type=int, default=0, help="seed of the arrival times")
    target = parser.add_argument_group("target")
    target.add_argument("--embedded", action="store_true",
                        help="run an engine in this process (engine options below) instead of "
                             "connecting to a server")
    target.add_argument("--host", default="127.0.0.1", help="the server's address (default: %(default)s)")
    target.add_argument("--port", type=int, default=None,
                        help=f"the server's port (default: {DEFAULT_PORT}, or {DEFAULT_HTTP_PORT} with --http)")
    target.add_argument("--http", action="store_true",
                        help="drive the server's OpenAI HTTP API instead of the msgpack protocol")
    target.add_argument("--api-key", default=None,
                        help="with --http: the server's API key (also from CADENCE_API_KEY)")
    target.add_argument("--unix", metavar="PATH", default=None, help="connect to this Unix socket")
    target.add_argument("--token-file", metavar="PATH", default=None,
                        help="the server's shared token (also from CADENCE_TOKEN)")
    target.add_argument("--connections", type=int, default=None,
                        help=f"connections to the server (default: one per {_STREAMS_PER_CONNECTION} "
                             "concurrent requests)")
    slo = parser.add_argument_group("service level objectives (goodput)")
    slo.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="default: %(default)s")
    slo.add_argument("--slo-tpot-ms", type=float, default=100.0, help="default: %(default)s")
    slo.add_argument("--slo-e2e-ms", type=float, default=None, help="default: none")
    out = parser.add_argument_group("output")
    out.add_argument("--percentiles", default="50,90,99", help="default: %(default)s")
    out.add_argument("--json", metavar="PATH", default=None,
                     help="also write the result as one JSON line ('-': standard output)")
    out.add_argument("--plot", metavar="PNG", default=None,
                     help="write batch size, KV usage, running/waiting and latency CDF plots "
                          "(needs matplotlib)")
    out.add_argument("--sample-interval-s", type=float, default=0.1,
                     help="how often --plot samples the engine (default: %(default)s)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_arguments(parser)
    parser.set_defaults(func=run_bench)
    return parser


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr)


def _token(args: argparse.Namespace) -> str | None:
    if args.token_file is not None:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                return f.read().strip() or None
        except OSError as exc:
            raise ConfigError(f"cannot read the token file: {exc.strerror}: {args.token_file}") from None
    return os.environ.get("CADENCE_TOKEN") or None


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ConfigError(f"--percentiles must be numbers separated by commas, got {text!r}") from None
    if not values or not all(0 <= p <= 100 for p in values):
        raise ConfigError(f"--percentiles must be in [0, 100], got {text!r}")
    return values


def run_bench(args: argparse.Namespace) -> int:
    """Run `cadence bench`: 0 when every request completed, 1 when some failed,
    2 for a mistake in the options (one line on stderr)."""
    try:
        percentiles = _percentiles(args.percentiles)
        if args.http and (args.plot is not None or args.unix or args.embedded):
            raise ConfigError("--http drives a server's HTTP port: it goes with neither --plot, "
                              "--unix nor --embedded")
        if args.plot is not None:
            _require_matplotlib()  # fail before the run, not after it
        if not args.request_rate > 0:
            raise ConfigError(f"--request-rate must be > 0, got {args.request_rate}")
        requests = load_workload(args.workload, args.num_requests)
        if not requests:
            raise ConfigError("the workload has no requests")
        with unwrap_sole_error():
            result, samples, timings, interrupted = trio.run(_bench, args, requests, percentiles)
    except (CadenceError, OSError) as exc:
        print(f"cadence bench: {exc}", file=sys.stderr)
        return USAGE_ERROR
    if interrupted:
        print(f"cadence bench: interrupted after {result.duration_s:.1f} s; the summary covers the "
              f"{result.num_requests} requests sent ({result.num_completed} finished)", file=sys.stderr)
    print(format_result(result))
    if args.json is not None:
        line = json.dumps(attrs.asdict(result))
        if args.json == "-":
            print(line)
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(line + "\n")
    if args.plot is not None:
        write_plot(args.plot, samples, timings)
        print(f"plot written to {args.plot}")
    if interrupted:
        return INTERRUPTED
    return 0 if result.num_failed == 0 else 1


async def _bench(args: argparse.Namespace, requests: list[BenchRequest], percentiles: tuple[float, ...]
                 ) -> tuple[BenchResult, list[Sample], list[RequestTiming], bool]:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        if threading.current_thread() is threading.main_thread():
            nursery.start_soon(_set_on_sigint, stop)
        result = await _measure(args, requests, percentiles, stop)
        nursery.cancel_scope.cancel()
    return (*result, stop.is_set())


async def _measure(args: argparse.Namespace, requests: list[BenchRequest], percentiles: tuple[float, ...],
                   stop: trio.Event) -> tuple[BenchResult, list[Sample], list[RequestTiming]]:
    bar = _progress(len(requests), not args.no_progress)
    on_done = (lambda: bar.update(1)) if bar is not None else None
    interval = args.sample_interval_s if args.plot is not None else None
    options = dict(request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                   seed=args.arrival_seed, sample_interval_s=interval, on_done=on_done, stop=stop)
    try:
        if args.embedded:
            async with open_engine(engine_config_from_args(args)) as engine:
                target = _EngineTarget(engine)
                requests, folded = _fit_vocab(requests, target.vocab_size)
                _note_folded(folded, target.vocab_size)
                timings, samples, duration = await run_benchmark(target, requests, **options)
            name = f"embedded {args.model}"
        elif args.http:
            port = args.port if args.port is not None else DEFAULT_HTTP_PORT
            timings, samples, duration = await _bench_http(args.host, port, args.api_key, requests,
                                                           options)
            name = f"http://{args.host}:{port}"
        else:
            port = args.port if args.port is not None else DEFAULT_PORT
            address = f"unix:{args.unix}" if args.unix else (args.host, port)
            concurrency = min(len(requests), args.max_concurrency or len(requests))
            num_connections = args.connections or max(1, math.ceil(concurrency / _STREAMS_PER_CONNECTION))
            timings, samples, duration = await _bench_server(
                address, _token(args), num_connections, requests, options)
            name = f"unix:{args.unix}" if args.unix else f"{args.host}:{port}"
    finally:
        if bar is not None:
            bar.close()
    slo = {name_: value for name_, value in (("ttft_ms", args.slo_ttft_ms), ("tpot_ms", args.slo_tpot_ms),
                                            ("e2e_ms", args.slo_e2e_ms)) if value is not None}
    return summarize(args.workload, name, timings, duration, slo, percentiles), samples, timings


async def _bench_server(address, token: str | None, num_connections: int,
                        requests: list[BenchRequest], options: dict):
    async with open_client(address, token=token, client_name="cadence-bench") as stats_client:
        clients: list[AsyncClient] = []
        async with trio.open_nursery() as nursery:
            ready = trio.Event()

            async def connect() -> None:
                async with open_client(address, token=token, client_name="cadence-bench") as client:
                    clients.append(client)
                    if len(clients) == num_connections:
                        ready.set()
                    await trio.sleep_forever()

            for _ in range(num_connections):
                nursery.start_soon(connect)
            await ready.wait()
            target = _ServerTarget(clients, stats_client)
            requests, folded = _fit_vocab(requests, target.vocab_size)
            _note_folded(folded, target.vocab_size)
            result = await run_benchmark(target, requests, **options)
            nursery.cancel_scope.cancel()
    return result


async def _bench_http(host: str, port: int, api_key: str | None, requests: list[BenchRequest],
                      options: dict):
    client = HttpApiClient(host, port, api_key or os.environ.get("CADENCE_API_KEY") or None)
    try:
        [model] = (await client.get("/v1/models"))["data"]
        target = _HttpTarget(client, model)
        requests, folded = _fit_vocab(requests, target.vocab_size)
        _note_folded(folded, target.vocab_size)
        return await run_benchmark(target, requests, **options)
    finally:
        await client.aclose()


def _note_folded(folded: bool, vocab_size: int) -> None:
    if folded:
        print(f"note: prompt token ids folded into the target's vocabulary of {vocab_size}",
              file=sys.stderr)
