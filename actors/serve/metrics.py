"""Prometheus metrics of one server, and a small Trio HTTP endpoint serving them.

Each `ServerMetrics` has its own `CollectorRegistry` (never the process-wide
one), so a test can run several servers side by side. What the server sees
per request (tokens streamed, latencies, finish reasons, refusals, protocol
errors) is counted as it happens; what the scheduling core already counts
(running, waiting, KV usage, preemptions, prefix-cache lookups) is read from
the core when the endpoint is scraped. The endpoint runs in the server's own
Trio thread, so a scrape sees the core between two steps, never in the middle
of one.

Names start with `cadence_` and carry their unit: `_seconds`, `_tokens`,
`_ratio`; counters end in `_total`.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING, Iterator

import trio

from cadence.statemachine.errors import ConfigError
from cadence.statemachine.plan import StepPlan

if TYPE_CHECKING:
    from ..engine import Engine

__all__ = ["ServerMetrics", "NullMetrics", "serve_metrics", "METRIC_NAMES"]

_log = logging.getLogger("cadence.metrics")

# Bucket edges in seconds (or tokens), spanning an interactive chat to a long batch job.
_TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                  0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_REQUEST_BUCKETS_S = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                      30.0, 40.0, 60.0, 120.0, 240.0, 480.0, 960.0)
_STEP_TOKEN_BUCKETS = tuple(float(1 << k) for k in range(15))

METRIC_NAMES = (
    "cadence_num_requests_running",
    "cadence_num_requests_waiting",
    "cadence_kv_cache_usage_ratio",
    "cadence_num_connections",
    "cadence_preemptions_total",
    "cadence_admission_finish_holds_total",
    "cadence_prefix_cache_query_tokens_total",
    "cadence_prefix_cache_hit_tokens_total",
    "cadence_prompt_tokens_total",
    "cadence_generation_tokens_total",
    "cadence_requests_finished_total",
    "cadence_requests_rejected_total",
    "cadence_protocol_errors_total",
    "cadence_connections_closed_total",
    "cadence_time_to_first_token_seconds",
    "cadence_inter_token_latency_seconds",
    "cadence_e2e_request_latency_seconds",
    "cadence_request_queue_time_seconds",
    "cadence_scheduled_tokens_per_step",
    "cadence_executor_failures_total",
    "cadence_executor_restarts_total",
)

# The most bytes of an HTTP request head the endpoint reads, and how long it waits for it.
_MAX_HTTP_HEAD_BYTES = 8192
_HTTP_READ_TIMEOUT_S = 10.0


class NullMetrics:
    """The do-nothing stand-in the server uses when metrics are off."""

    registry = None

    def bind(self, engine: Engine) -> None:
        """Nothing to bind."""

    def on_step(self, plan: StepPlan, now_s: float) -> None:
        """Ignore a step."""

    def on_accepted(self, num_prompt_tokens: int) -> None:
        """Ignore an accepted request."""

    def on_tokens(self, num_tokens: int, first_token_s: float | None, arrival_s: float,
                  previous_s: float | None, now_s: float) -> None:
        """Ignore streamed tokens."""

    def on_finished(self, reason: str, arrival_s: float, now_s: float) -> None:
        """Ignore a finished request."""

    def on_rejected(self, code: str) -> None:
        """Ignore a refused request."""

    def on_protocol_error(self, code: str) -> None:
        """Ignore a protocol error."""

    def on_connection(self, delta: int) -> None:
        """Ignore a connection opening or closing."""

    def on_connection_closed(self, reason: str) -> None:
        """Ignore why a connection closed."""


class ServerMetrics(NullMetrics):
    """The metrics of one server, in a registry of their own.

    `bind(engine)` once the engine is open; pass `on_step` to `open_engine` so
    the tokens-per-step and queue-time histograms see every plan. The other
    `on_*` methods are called by the server as requests progress.
    """

    def __init__(self) -> None:
        try:
            from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        except ImportError:
            raise ConfigError("metrics need the prometheus-client package "
                              "(pip install prometheus-client)") from None

        self.registry = registry = CollectorRegistry(auto_describe=True)
        self._engine: Engine | None = None
        self.prompt_tokens = Counter(
            "cadence_prompt_tokens", "Prompt tokens of accepted requests.", registry=registry)
        self.generation_tokens = Counter(
            "cadence_generation_tokens", "Generated tokens streamed to clients.", registry=registry)
        self.requests_rejected = Counter(
            "cadence_requests_rejected", "Generate requests refused before acceptance, by error code.",
            ["code"], registry=registry)
        self.protocol_errors = Counter(
            "cadence_protocol_errors", "Malformed frames or messages received, by error code.",
            ["code"], registry=registry)
        self.connections = Gauge(
            "cadence_num_connections", "Open client connections.", registry=registry)
        self.connections_closed = Counter(
            "cadence_connections_closed", "Client connections closed, by reason.",
            ["reason"], registry=registry)
        self.ttft = Histogram(
            "cadence_time_to_first_token_seconds", "From arrival to the first generated token.",
            buckets=_TTFT_BUCKETS_S, registry=registry)
        self.itl = Histogram(
            "cadence_inter_token_latency_seconds", "Between consecutive generated tokens.",
            buckets=_ITL_BUCKETS_S, registry=registry)
        self.e2e = Histogram(
            "cadence_e2e_request_latency_seconds", "From arrival to the last output of a request.",
            buckets=_REQUEST_BUCKETS_S, registry=registry)
        self.queue_time = Histogram(
            "cadence_request_queue_time_seconds", "From arrival to first admission into a batch.",
            buckets=_REQUEST_BUCKETS_S, registry=registry)
        self.step_tokens = Histogram(
            "cadence_scheduled_tokens_per_step", "Tokens scheduled in one engine step.",
            buckets=_STEP_TOKEN_BUCKETS, registry=registry)
        registry.register(_CoreCollector(self))

    def bind(self, engine: Engine) -> None:
        """Read the gauges and core counters from this engine from now on."""
        self._engine = engine

    @property
    def engine(self) -> Engine | None:
        """The bound engine, if any."""
        return self._engine

    def on_step(self, plan: StepPlan, now_s: float) -> None:
        """Observe one step plan (an `open_engine` step listener)."""
        self.step_tokens.observe(plan.total_num_scheduled_tokens)
        engine = self._engine
        if engine is None or not plan.new_requests:
            return
        actors = engine.scheduler.actors
        for data in plan.new_requests:
            actor = actors.get(data.request_id)
            if actor is not None and not data.resumed:
                self.queue_time.observe(max(0.0, now_s - actor.request.arrival_s))

    def on_accepted(self, num_prompt_tokens: int) -> None:
        """Count an accepted request's prompt tokens."""
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_tokens(self, num_tokens: int, first_token_s: float | None, arrival_s: float,
                  previous_s: float | None, now_s: float) -> None:
        """Count streamed tokens; `previous_s` is when the stream's previous tokens
        went out (None for its first), which gives TTFT or inter-token latency."""
        if num_tokens <= 0:
            return
        self.generation_tokens.inc(num_tokens)
        if previous_s is None:
            start = first_token_s if first_token_s is not None else now_s
            self.ttft.observe(max(0.0, start - arrival_s))
            return
        # A coalesced delta carries several tokens: spread its gap over them.
        gap = max(0.0, now_s - previous_s) / num_tokens
        for _ in range(num_tokens):
            self.itl.observe(gap)

    def on_finished(self, reason: str, arrival_s: float, now_s: float) -> None:
        """Observe the end-to-end latency of a stream that ran to its last output
        (finishes are counted by the core, see `_CoreCollector`)."""
        self.e2e.observe(max(0.0, now_s - arrival_s))

    def on_rejected(self, code: str) -> None:
        """Count a Generate refused before the engine accepted it."""
        self.requests_rejected.labels(code=code).inc()

    def on_protocol_error(self, code: str) -> None:
        """Count a malformed frame or message."""
        self.protocol_errors.labels(code=code).inc()

    def on_connection(self, delta: int) -> None:
        """A connection opened (+1) or closed (-1)."""
        self.connections.inc(delta)

    def on_connection_closed(self, reason: str) -> None:
        """Count why a connection closed."""
        self.connections_closed.labels(reason=reason).inc()

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _CoreCollector:
    """Reads the scheduling core's gauges and counters at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list:
        # Declaring no names up front lets the registry accept this collector
        # before an engine is bound.
        return []

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        engine = self._metrics.engine
        if engine is None:
            return
        core = engine.core
        blocks = core.blocks
        yield GaugeMetricFamily("cadence_num_requests_running", "Requests holding KV blocks.",
                                value=core.num_running)
        yield GaugeMetricFamily("cadence_num_requests_waiting", "Requests queued for admission.",
                                value=core.num_waiting)
        yield GaugeMetricFamily("cadence_kv_cache_usage_ratio", "Fraction of KV blocks in use.",
                                value=blocks.usage)
        yield CounterMetricFamily("cadence_preemptions", "Running requests preempted (recomputed later).",
                                  value=core.collector.num_preemptions)
        yield CounterMetricFamily("cadence_admission_finish_holds",
                                  "Steps that admitted nothing so that the running requests finished first.",
                                  value=core.collector.num_admission_finish_holds)
        # Read from the core, so that every finish counts, the requests cut short
        # by a disconnect too, and the figures are the ones Stats reports.
        finished = CounterMetricFamily("cadence_requests_finished",
                                       "Requests finished in the engine, by finish reason.",
                                       labels=["reason"])
        for reason, count in sorted(core.collector.completed_by_reason.items()):
            finished.add_metric([reason], count)
        yield finished
        yield CounterMetricFamily("cadence_prefix_cache_query_tokens",
                                  "Prompt tokens looked up in the prefix cache.",
                                  value=blocks.num_query_tokens)
        yield CounterMetricFamily("cadence_prefix_cache_hit_tokens",
                                  "Prompt tokens found in the prefix cache.",
                                  value=blocks.num_hit_tokens)
        scheduler = engine.scheduler
        yield CounterMetricFamily("cadence_executor_failures",
                                  "Executor steps and start-ups that failed (crash, hang, error).",
                                  value=scheduler.num_failures)
        yield CounterMetricFamily("cadence_executor_restarts",
                                  "Executor restarts that succeeded.", value=scheduler.num_restarts)


async def serve_metrics(metrics: ServerMetrics, host: str = "127.0.0.1", port: int = 0, *,
                        task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve `GET /metrics` over HTTP until cancelled; `nursery.start` returns the
    bound (host, port)."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    task_status.started(tuple(listeners[0].socket.getsockname()[:2]))
    await trio.serve_listeners(partial(_handle_http, metrics), listeners)


async def _handle_http(metrics: ServerMetrics, stream: trio.abc.Stream) -> None:
    try:
        async with stream:
            head = await _read_head(stream)
            if head is None:
                return
            await stream.send_all(_respond(metrics, head))
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        _log.debug("metrics connection dropped: %s", exc)


async def _read_head(stream: trio.abc.Stream) -> bytes | None:
    head = bytearray()
    with trio.move_on_after(_HTTP_READ_TIMEOUT_S):
        while b"\r\n\r\n" not in head and b"\n\n" not in head:
            data = await stream.receive_some(_MAX_HTTP_HEAD_BYTES)
            if not data:
                break
            head += data
            if len(head) > _MAX_HTTP_HEAD_BYTES:
                return b""
        return bytes(head)
    return None


def _respond(metrics: ServerMetrics, head: bytes) -> bytes:
    from prometheus_client import CONTENT_TYPE_LATEST

    request_line = head.split(b"\n", 1)[0].decode("latin-1").strip().split()
    if len(request_line) != 3:
        return _http(400, "Bad Request", b"bad request\n")
    method, target, _version = request_line
    path = target.split("?", 1)[0]
    if path not in ("/metrics", "/"):
        return _http(404, "Not Found", b"try /metrics\n")
    if method not in ("GET", "HEAD"):
        return _http(405, "Method Not Allowed", b"use GET\n", extra="Allow: GET, HEAD\r\n")
    body = metrics.exposition()
    return _http(200, "OK", b"" if method == "HEAD" else body, CONTENT_TYPE_LATEST, len(body))


def _http(status: int, reason: str, body: bytes, content_type: str = "text/plain; charset=utf-8",
          length: int | None = None, extra: str = "") -> bytes:
    length = len(body) if length is None else length
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {length}\r\nConnection: close\r\n{extra}\r\n")
    return head.encode("latin-1") + body
