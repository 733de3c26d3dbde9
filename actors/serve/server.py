"""The socket server: an engine behind TCP and/or a Unix socket, msgpack frames on the wire.

    async with open_server(EngineConfig(), ServerConfig(port=0)) as server:
        print(server.tcp_address)     # ('127.0.0.1', 43211)

PROTOCOL.md is the contract. The connection machinery (listening, accepting,
handshake, bad messages, limits, the outbox and its writer, the watchdog) is
the core in `connection.py`, shared with the router; what is the server's own
is where a Generate goes: one task per live stream iterates the engine's
`RequestStream` and queues Output frames.

Why a slow client cannot stall anything else: the request actor coalesces a
stream's deltas while its consumer waits, so a stream task blocked on a full
output queue costs the engine nothing; the queue is bounded
(`output_queue_frames`, `output_queue_bytes`); a client for which more than
`max_unsent_bytes` wait (queued frames and the tokens its waiting streams pile
up, looked at after every engine step) is closed at once, and a socket write that
makes no progress for `send_timeout_s` closes the connection too; closing aborts
its requests. Closing a
connection, for whatever reason, cancels its stream tasks in one go, and each
cancelled stream aborts its request synchronously, so all of a connection's
requests are aborted before the scheduler plans its next step.

Shutdown drains: listeners close at once, new requests are refused with
`shutdown`, running ones get `shutdown_grace_s` to finish, the rest end with
an Error frame `shutdown`, and every connection is closed with a fatal
`shutdown` Error. `abort_now()` (a second signal) closes everything at once.
"""

from __future__ import annotations

import argparse
import gc
import ipaddress
import logging
import os
import signal
import sys
from collections import Counter
from contextlib import asynccontextmanager
from typing import AsyncIterator

import attrs
import trio

from cadence.statemachine.errors import (
    CadenceError, ConfigError, EngineClosedError, ExecutorError, InvalidRequestError, PoisonRequestError,
    QueueFullError, RequestNotFoundError, RequestTooLongError,
)

from ..chat import EngineChat, check_messages, text_size
from ..engine import Engine, EngineConfig, RequestStream, open_engine
from ..trio_thread import TrioThread
from ..unwrap import unwrap_sole_error, unwrapping
from ..engine_args import add_engine_arguments, engine_config_from_args
from ..wire import (
    DEFAULT_PORT, MAX_ID, Accepted, Error, ErrorCode, Generate,
    HealthReply, Output, StatsReply, Welcome, encode, pack_frame,
)
from .connection import (
    Connection, ConnectionConfig, Front, StreamState, bare_errors, port_number, positive, tokens_match,
)
from .identity import ApiKeys, KeyGrant
from .metrics import NullMetrics, ServerMetrics, serve_metrics

__all__ = [
    "DEFAULT_PORT",
    "ServerConfig",
    "Server",
    "open_server",
    "ServerThread",
    "add_serve_parser",
    "run_serve",
    "main",
    "tokens_match",
]

_log = logging.getLogger("cadence.server")

# The exit status of a user's mistake, as for every `cadence` command.
USAGE_ERROR = 2
SERVER_NAME = "cadence/0.1"


@attrs.frozen
class ServerConfig(ConnectionConfig):
    """Where the server listens and the limits it applies: the connection limits of
    `ConnectionConfig` (all keyword-only), and

    port: the msgpack port (default DEFAULT_PORT; 0: any free port; None: none).
    idle_timeout_s: as `ConnectionConfig`, 300 s by default.
    max_inflight_per_tenant: live streams per tenant (None: no per-tenant limit).
    shutdown_grace_s: on shutdown, how long running requests may finish.
    metrics_host, metrics_port: Prometheus endpoint (None: off).
    api_keys: the API keys of HTTP and msgpack clients, each granting a tenant
      (identity.py); instead of `token` (None: `token`, or no auth).
    """

    port: int | None = attrs.field(default=DEFAULT_PORT, validator=port_number, kw_only=True)
    idle_timeout_s: float | None = attrs.field(default=300.0, validator=positive, kw_only=True)
    max_inflight_per_tenant: int | None = attrs.field(default=None, validator=positive, kw_only=True)
    shutdown_grace_s: float = attrs.field(default=30.0, validator=attrs.validators.ge(0), kw_only=True)
    metrics_host: str = attrs.field(default="127.0.0.1", kw_only=True)
    metrics_port: int | None = attrs.field(default=None, validator=port_number, kw_only=True)
    api_keys: ApiKeys | None = attrs.field(default=None, kw_only=True, repr=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.api_keys is not None and self.token is not None:
            raise ConfigError("give a token or an API-key file, not both")

    def limits(self) -> dict[str, int | float | None]:
        """The limits a client is told about in Welcome."""
        return {**super().limits(), "max_inflight_per_tenant": self.max_inflight_per_tenant}


def _engine_error_code(exc: BaseException, draining: bool) -> ErrorCode:
    """The Error code for an exception the engine raised about one request."""
    if isinstance(exc, RequestTooLongError):
        return ErrorCode.REQUEST_TOO_LONG
    if isinstance(exc, InvalidRequestError):
        return ErrorCode.INVALID_REQUEST
    if isinstance(exc, QueueFullError):
        return ErrorCode.QUEUE_FULL
    if isinstance(exc, EngineClosedError):
        return ErrorCode.SHUTDOWN if draining else ErrorCode.ENGINE_CLOSED
    if isinstance(exc, ExecutorError):
        return ErrorCode.EXECUTOR_ERROR
    return ErrorCode.INTERNAL


@attrs.define(eq=False)
class _StreamState(StreamState):
    """One live stream of the server (a msgpack stream, or one answer of the HTTP API):
    its tenant, its engine request and whether that was submitted yet."""

    tenant: str = attrs.field(kw_only=True)
    request_id: str = attrs.field(kw_only=True)
    # The API key's grant it was made under (None: no API-key file).
    grant: KeyGrant | None = attrs.field(default=None, kw_only=True)
    started: bool = False
    request_stream: RequestStream | None = None
    # Estimated wire bytes of each token it has not sent yet (see `_wire_bytes_per_token`).
    bytes_per_token: int = 0


# Wire bytes of one token of an Output frame, to estimate output not yet sent: its id
# (at most a msgpack uint32, 5 bytes) and its text (at most the tokenizer's bytes per
# token); with log-probabilities, a [token id, float64] pair (1 + 5 + 9 bytes) for the
# token and for each alternative.
_TOKEN_ID_WIRE_BYTES = 5
_LOGPROB_WIRE_BYTES = 15


def _wire_bytes_per_token(message: Generate, max_bytes_per_token: int | None) -> int:
    logprobs = message.params.logprobs
    return (_TOKEN_ID_WIRE_BYTES + (max_bytes_per_token or 0)
            + (0 if logprobs is None else (logprobs + 1) * _LOGPROB_WIRE_BYTES))


class Server(Front):
    """Serves one engine to many clients; see the module docstring.

    Run it with `await server.serve()` (or `nursery.start(server.serve)`, which
    returns once it listens); `shutdown()` makes `serve` drain and return.
    """

    kind = "server"

    def __init__(self, engine: Engine, config: ServerConfig | None = None,
                 metrics: NullMetrics | None = None) -> None:
        super().__init__(config if config is not None else ServerConfig(), metrics)
        self.engine = engine
        self.request_limits = engine.request_limits
        self.tenant_inflight: Counter[str] = Counter()
        # Live streams per API key's tenant (with an API-key file), for `max_inflight`.
        self.key_inflight: Counter[str] = Counter()
        self.num_inflight = 0
        self.metrics_address: tuple[str, int] | None = None
        self.http = None  # the HttpServer beside it, if any
        self.chat = EngineChat(engine.config.model, engine.tokenizer)
        self._num_requests = 0
        self._shutdown_requested = trio.Event()
        self._all_idle = trio.Event()
        self._grace_scope = trio.CancelScope()
        self._stopped = trio.Event()
        self.welcome_frame = pack_frame(encode(self._make_welcome()))
        self._listen_to_steps(engine)

    def _listen_to_steps(self, engine: Engine) -> None:
        """After every engine step, look at the connections whose streams wait for
        room (`check_congested`): their requests' output grows with each step, and a
        client that does not read is closed as soon as it holds too much."""
        previous = engine.scheduler.on_step

        def on_step(plan, now_s: float) -> None:
            if previous is not None:
                previous(plan, now_s)
            if self.congested:
                self.check_congested()

        engine.scheduler.on_step = on_step

    # ---- lifecycle ---------------------------------------------------------------
    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen and serve until `shutdown()` has drained every connection."""
        listeners = await self.open_listeners()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.accept, listeners, nursery)
                watchdog = await nursery.start(self.watch_sends)
                task_status.started(self)
                await self._shutdown_requested.wait()
                await self._drain()
                # The watchdog still guards the connections' last writes.
                await self.wait_connections_gone()
                if self.http is not None:
                    await self.http.wait_released()
                watchdog.cancel()
        finally:
            await self.close_listeners(listeners)
            self._stopped.set()

    def shutdown(self, grace_s: float | None = None) -> None:
        """Stop accepting and drain: running requests get `grace_s` seconds
        (default: the config's) to finish. A second call may shorten the grace."""
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        deadline = trio.current_time() + grace
        if not self.draining:
            self.draining = True
            self._grace_scope.deadline = deadline
            _log.info("shutting down: %d requests in flight, %.1f s grace", self.num_inflight, grace)
        else:
            self._grace_scope.deadline = min(self._grace_scope.deadline, deadline)
        self.stop_accepting()
        self._shutdown_requested.set()

    def abort_now(self) -> None:
        """Shut down without waiting for anything: end every stream and close every
        connection at once, without lingering for slow clients."""
        self.shutdown(0.0)
        for conn in list(self.connections.values()):
            conn.close_now("shutdown")

    async def wait_stopped(self) -> None:
        """Wait until `serve` has returned."""
        await self._stopped.wait()

    async def _drain(self) -> None:
        self.stop_accepting()
        self.remove_unix_socket()
        for conn in list(self.connections.values()):
            conn.close_if_idle()
        with self._grace_scope:
            while self.num_inflight:
                self._all_idle = trio.Event()
                await self._all_idle.wait()
        for conn in list(self.connections.values()):
            conn.abort_for_shutdown()
        if self.http is not None:
            self.http.abort_for_shutdown()

    # ---- what connections ask of the server ---------------------------------------
    def make_connection(self, stream: trio.SocketStream, conn_id: int) -> _ServerConnection:
        """A connection serving this engine."""
        return _ServerConnection(self, stream, conn_id)

    def next_request_id(self, conn_id: int) -> str:
        """A request id unique for the server's lifetime."""
        self._num_requests += 1
        return f"c{conn_id}-{self._num_requests}"

    def stream_started(self, state: _StreamState) -> None:
        """Count a new stream in the in-flight counts."""
        self.num_inflight += 1
        self.tenant_inflight[state.tenant] += 1
        if state.grant is not None:
            self.key_inflight[state.grant.tenant] += 1

    def stream_finished(self, state: _StreamState) -> None:
        """Release a stream's place in the in-flight counts."""
        self.num_inflight -= 1
        tenants = self.tenant_inflight
        tenants[state.tenant] -= 1
        if tenants[state.tenant] <= 0:
            del tenants[state.tenant]
        if state.grant is not None:
            keys = self.key_inflight
            keys[state.grant.tenant] -= 1
            if keys[state.grant.tenant] <= 0:
                del keys[state.grant.tenant]
        if self.num_inflight == 0:
            self._all_idle.set()

    def inflight_refusal(self, tenant: str, grant: KeyGrant | None,
                         num_streams: int) -> tuple[str, str] | None:
        """Why `num_streams` more live streams of `tenant` (under `grant`) would pass a
        limit, and the limit's name; None when they fit. Shared by msgpack and HTTP."""
        limit = self.config.max_inflight_per_tenant
        live = self.tenant_inflight[tenant]
        if limit is not None and live + num_streams > limit:
            return (f"tenant {tenant[:64]!r} already has {live} live streams and asks for "
                    f"{num_streams}; max_inflight_per_tenant is {limit}", "max_inflight_per_tenant")
        if grant is not None and grant.max_inflight is not None:
            live = self.key_inflight[grant.tenant]
            if live + num_streams > grant.max_inflight:
                return (f"the API key of tenant {grant.tenant[:64]!r} already has {live} live "
                        f"streams and asks for {num_streams}; its max_inflight is "
                        f"{grant.max_inflight}", "max_inflight")
        return None

    def health(self, ref: int) -> HealthReply:
        """The answer to a Health query."""
        engine = self.engine
        status = "closed" if engine.closed else "draining" if self.draining else engine.health
        core = engine.core
        return HealthReply(ref=ref, status=status, num_running=core.num_running,
                           num_waiting=core.num_waiting, kv_usage=core.blocks.usage,
                           num_connections=len(self.connections))

    def stats(self, ref: int) -> StatsReply:
        """The answer to a Stats query: the core's summary plus the server's counts."""
        stats = self.engine.stats().as_dict()
        # msgpack map keys must be str for clients that decode strictly.
        stats["batch_size_distribution"] = {
            str(size): count for size, count in stats["batch_size_distribution"].items()}
        stats["num_connections"] = len(self.connections)
        stats["num_inflight_streams"] = self.num_inflight
        stats["num_free_blocks"] = self.engine.core.blocks.num_free_blocks
        stats["num_blocks"] = self.engine.core.blocks.num_blocks
        return StatsReply(ref=ref, stats=stats)

    def _make_welcome(self) -> Welcome:
        engine = self.engine
        return Welcome(
            server=SERVER_NAME, model=engine.config.model, vocab_size=engine.vocab_size,
            max_model_len=engine.core.config.max_model_len, block_size=engine.core.blocks.block_size,
            eos_token_ids=sorted(engine.eos_token_ids), has_tokenizer=engine.tokenizer is not None,
            limits={**self.config.limits(), **engine.request_limits.welcome_limits()})


class _ServerConnection(Connection):
    """A client connection of the server: each Generate becomes an engine request."""

    server: Server

    def __init__(self, server: Server, stream: trio.SocketStream, conn_id: int) -> None:
        super().__init__(server, stream, conn_id)
        self.server = server

    async def answer_stats(self, ref: int) -> None:
        """The server's Stats."""
        await self.send(self.server.stats(ref))

    async def answer_health(self, ref: int) -> None:
        """The server's Health."""
        await self.send(self.server.health(ref))

    def refuse_generate(self, message: Generate) -> Error | None:
        """The per-tenant limit and the API key's in-flight limit, across connections;
        with n > 1, the n streams the samples answer on (`stream` to `stream` + n - 1)
        must be free and within the connection's limit."""
        n = message.params.n
        refusal = self.server.inflight_refusal(message.tenant, self.grant, n)
        if refusal is not None:
            text, limit = refusal
            return Error(ErrorCode.TENANT_LIMIT.value, text, stream=message.stream, limit=limit)
        if n == 1:
            return None
        last = message.stream + n - 1
        taken = [sid for sid in range(message.stream + 1, last + 1) if sid in self.streams]
        if taken or last > MAX_ID:
            why = f"stream {taken[0]} is live" if taken else f"the last id would pass {MAX_ID}"
            return Error(ErrorCode.INVALID_REQUEST.value,
                         f"n is {n}: the samples answer on streams {message.stream} to {last}, but {why}",
                         stream=message.stream)
        most = self.config.max_inflight_per_connection
        if len(self.streams) + n > most:
            return Error(ErrorCode.TOO_MANY_REQUESTS.value,
                         f"this connection has {len(self.streams)} live streams and n is {n}",
                         stream=message.stream, limit="max_inflight_per_connection")
        return None

    async def open_stream(self, message: Generate) -> None:
        """Start the engine request in a task of its own (a conversation is
        rendered into its prompt first)."""
        server = self.server
        if message.messages is not None:
            try:
                check_messages(message.messages)  # its limits, before costs that grow with it
                prompt = await server.run_sized(text_size(message.messages), server.chat.prompt_ids,
                                                message.messages)
                message = attrs.evolve(message, prompt=prompt, messages=None)
            except InvalidRequestError as exc:
                server.metrics.on_rejected(ErrorCode.INVALID_REQUEST.value)
                self.note_refusal(self._frame_bytes)
                await self.send(Error(ErrorCode.INVALID_REQUEST.value, str(exc), stream=message.stream))
                return
        bytes_per_token = _wire_bytes_per_token(message, server.request_limits.max_bytes_per_token)
        samples = message.params.samples()
        request_ids = [server.next_request_id(self.conn_id) for _ in samples]
        groups: list = [None]
        if len(samples) > 1:
            # One request group: the prompt is computed once; sample i answers on stream + i.
            groups = server.engine.generate_group(
                message.prompt, samples, priority=message.priority, tenant=message.tenant,
                deadline_s=message.deadline_s, request_ids=request_ids, timeout_s=message.timeout_s,
                cache_salt=message.cache_salt)
        for index, (request_id, request_stream) in enumerate(zip(request_ids, groups)):
            state = _StreamState(message.stream + index, tenant=message.tenant, grant=self.grant,
                                 request_id=request_id, bytes_per_token=bytes_per_token)
            server.stream_started(state)
            self.add_stream(state, self._run_stream, attrs.evolve(message, stream=state.stream),
                            request_stream)

    def pending_output_bytes(self) -> int:
        """The output the engine holds for this connection's streams (estimated)."""
        return sum(state.request_stream.num_undelivered_tokens * state.bytes_per_token
                   for state in self.streams.values() if state.request_stream is not None)

    async def abort_stream(self, state: _StreamState) -> None:
        """Abort the engine request (once it has one; `_run_stream` sees the flag otherwise)."""
        if state.started:
            try:
                await self.server.engine.abort(state.request_id, "aborted by client")
            except RequestNotFoundError:
                pass  # it finished while the Abort was on its way

    async def _run_stream(self, state: _StreamState, message: Generate,
                          request_stream: RequestStream | None = None) -> None:
        """Run one engine request (given: a sample of a request group) and relay it."""
        server = self.server
        engine, metrics = server.engine, server.metrics
        if request_stream is None:
            request_stream = engine.generate(
                message.prompt, message.params, priority=message.priority, tenant=message.tenant,
                deadline_s=message.deadline_s, request_id=state.request_id, timeout_s=message.timeout_s,
                cache_salt=message.cache_salt)
        state.request_stream = request_stream
        error: Error | None = None
        try:
            with state.scope:
                try:
                    await request_stream.start()
                except CadenceError as exc:
                    code = _engine_error_code(exc, server.draining)
                    metrics.on_rejected(code.value)
                    self.note_refusal(state.frame_bytes)
                    error = Error(code.value, str(exc), stream=state.stream)
                    return
                state.started = True
                if state.abort_requested:
                    await self.abort_stream(state)
                num_prompt = request_stream.num_prompt_tokens
                metrics.on_accepted(num_prompt)
                await self.send(Accepted(state.stream, state.request_id, num_prompt))
                await self._relay(state, request_stream)
            if state.shutdown:
                error = Error(ErrorCode.SHUTDOWN.value,
                              "the server shut down before the request finished", stream=state.stream)
        except CadenceError as exc:
            error = Error(_engine_error_code(exc, server.draining).value, str(exc), stream=state.stream,
                          poison=isinstance(exc, PoisonRequestError))
        except Exception:
            _log.exception("stream %d of connection %d failed", state.stream, self.conn_id)
            error = Error(ErrorCode.INTERNAL.value, "internal server error", stream=state.stream)
        finally:
            with trio.CancelScope(shield=True):
                await request_stream.aclose()  # aborts the request unless it finished
            self.end_stream(state, error)

    async def _relay(self, state: _StreamState, request_stream: RequestStream) -> None:
        metrics = self.metrics
        previous_s = None
        async for out in request_stream:
            if out.token_ids:
                metrics.on_tokens(len(out.token_ids), out.first_token_s, out.arrival_s, previous_s,
                                  out.now_s)
                previous_s = out.now_s
            if out.finish_reason is not None:
                metrics.on_finished(out.finish_reason, out.arrival_s, out.now_s)
            await self.send(Output(state.stream, out.token_ids, out.text, out.num_tokens,
                                   out.finish_reason, out.detail, out.num_cached_tokens,
                                   out.logprobs, out.prompt_logprobs))


# ---------------------------------------------------------------------------
# Running a server.


@unwrapping
@asynccontextmanager
async def open_server(engine_config: EngineConfig | None = None,
                      server_config: ServerConfig | None = None, *,
                      metrics: bool | None = None, http=None) -> AsyncIterator[Server]:
    """Open an engine and serve it for the duration of an `async with` block.

    metrics: keep Prometheus metrics (default: when `metrics_port` is set or
    the HTTP API is on); with a port, the endpoint is served too
    (`server.metrics_address`). http: an `HttpConfig` to serve the OpenAI HTTP
    API beside the msgpack protocol (`server.http.address`).
    Leaving the block shuts the server down with no grace, then the engine.
    """
    server_config = server_config if server_config is not None else ServerConfig()
    if metrics is None:
        metrics = server_config.metrics_port is not None or http is not None
    recorder = ServerMetrics() if metrics else NullMetrics()
    with bare_errors():
        async with open_engine(engine_config, on_step=recorder.on_step if metrics else None) as engine:
            recorder.bind(engine)
            server = Server(engine, server_config, recorder)
            async with trio.open_nursery() as nursery:
                await nursery.start(server.serve)
                if http is not None:
                    from .http import serve_http  # it builds on this module

                    server.http = await nursery.start(serve_http, server, http)
                if metrics and server_config.metrics_port is not None:
                    server.metrics_address = await nursery.start(
                        serve_metrics, recorder, server_config.metrics_host,
                        server_config.metrics_port)
                try:
                    yield server
                finally:
                    server.shutdown(0.0)
                    with trio.CancelScope(shield=True):
                        await server.wait_stopped()
                    nursery.cancel_scope.cancel()


class ServerThread:
    """A server in a background thread with its own Trio run, for synchronous
    programs and tests:

        with ServerThread(EngineConfig(), ServerConfig(port=0)) as thread:
            client = Client.connect(thread.server.tcp_address)
    """

    def __init__(self, engine_config: EngineConfig | None = None,
                 server_config: ServerConfig | None = None, *, metrics: bool | None = None,
                 http=None) -> None:
        self._host: TrioThread[Server] = TrioThread(
            lambda: open_server(engine_config, server_config, metrics=metrics, http=http),
            name="cadence-server", until=lambda server: server.wait_stopped())

    @property
    def server(self) -> Server | None:
        """The running server (None before `__enter__`)."""
        return self._host.resource

    def __enter__(self) -> ServerThread:
        self._host.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def call(self, fn, *args):
        """Run a synchronous function in the server's Trio thread and return its result."""
        return self._host.call(fn, *args)

    def stop(self, grace_s: float = 0.0) -> None:
        """Shut the server down and wait for the thread to end."""
        if self._host.running:
            try:
                self.call(self.server.shutdown, grace_s)
            except trio.RunFinishedError:
                pass
        self._host.stop()


# ---------------------------------------------------------------------------
# The `cadence serve` command.


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to an argparse subparsers object."""
    from .http import DEFAULT_HTTP_PORT  # it builds on this module

    parser = subparsers.add_parser(
        "serve", help="serve an engine: the msgpack protocol and the OpenAI-compatible HTTP API",
        description="Serve an engine to clients speaking the msgpack protocol of PROTOCOL.md "
                    f"(--port, default {DEFAULT_PORT}) and to OpenAI-API clients over HTTP "
                    f"(--http-port, default {DEFAULT_HTTP_PORT}: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
                    "...). Listens on 127.0.0.1 unless --host says otherwise. SIGINT or SIGTERM "
                    "drains: running requests get --shutdown-grace-s to finish; a second "
                    "signal aborts them at once.")
    add_engine_arguments(parser)
    # A server's cache fills with its traffic: its memory grows with use, not at start.
    parser.set_defaults(prefault_blocks=0)
    net = parser.add_argument_group("sockets")
    net.add_argument("--host", default="127.0.0.1",
                     help="TCP address to listen on (default: 127.0.0.1, this machine only)")
    net.add_argument("--port", type=int, default=DEFAULT_PORT,
                     help=f"TCP port; 0 picks a free one (default: {DEFAULT_PORT})")
    net.add_argument("--no-tcp", action="store_true", help="no TCP listener (needs --unix)")
    net.add_argument("--unix", metavar="PATH", default=None, help="also listen on this Unix socket")
    net.add_argument("--token-file", metavar="PATH", default=None,
                     help="require the shared token in this file (also read from the "
                          "CADENCE_TOKEN environment variable)")
    net.add_argument("--api-keys", metavar="FILE", default=None,
                     help="API keys of msgpack and HTTP clients, one a line: KEY TENANT "
                          "[min_priority=N] [max_inflight=N]; each key's requests are its tenant "
                          "(or a sub-tenant TENANT/...), whatever they name (instead of "
                          "--token-file and --api-key)")
    limits = parser.add_argument_group("limits")
    defaults = ServerConfig()
    limits.add_argument("--max-frame-bytes", type=int, default=defaults.max_frame_bytes,
                        help="largest frame a client may send, in bytes (default: %(default)s)")
    limits.add_argument("--max-connections", type=int, default=defaults.max_connections,
                        help="open connections at once; more are refused (default: %(default)s)")
    limits.add_argument("--max-inflight-per-connection", type=int,
                        default=defaults.max_inflight_per_connection,
                        help="live streams per connection (default: %(default)s)")
    limits.add_argument("--max-inflight-per-tenant", type=int, default=None,
                        help="live streams per tenant (default: no limit)")
    limits.add_argument("--max-protocol-errors", type=int, default=defaults.max_protocol_errors,
                        help="malformed messages a connection may send before it is closed "
                             "(default: %(default)s)")
    limits.add_argument("--idle-timeout-s", type=float, default=defaults.idle_timeout_s,
                        help="close connections idle this long; 0 disables (default: %(default)s)")
    limits.add_argument("--handshake-timeout-s", type=float, default=defaults.handshake_timeout_s,
                        help="seconds a new connection has to say Hello (default: %(default)s)")
    limits.add_argument("--send-timeout-s", type=float, default=defaults.send_timeout_s,
                        help="close a client whose socket accepts nothing for this long "
                             "(default: %(default)s)")
    limits.add_argument("--output-queue-frames", type=int, default=defaults.output_queue_frames,
                        help="frames queued for a slow client before its streams wait "
                             "(default: %(default)s)")
    limits.add_argument("--max-unsent-bytes", type=int, default=defaults.max_unsent_bytes,
                        help="bytes held for a client that is not reading (queued output and "
                             "what its streams pile up) before it is closed; 0: only "
                             "--send-timeout-s (default: %(default)s)")
    limits.add_argument("--shutdown-grace-s", type=float, default=defaults.shutdown_grace_s,
                        help="seconds running requests get to finish after SIGINT or SIGTERM "
                             "(default: %(default)s)")
    obs = parser.add_argument_group("observability")
    obs.add_argument("--metrics-port", type=int, default=None,
                     help="serve Prometheus metrics over HTTP on this port (0: any free port)")
    obs.add_argument("--metrics-host", default="127.0.0.1",
                     help="address of the metrics endpoint (default: %(default)s)")
    obs.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                     help="log messages at this level and above to stderr (default: %(default)s)")
    from .http import add_http_arguments  # it builds on this module

    add_http_arguments(parser)
    parser.set_defaults(func=run_serve)
    return parser


def read_secret_file(path: str, what: str) -> str:
    """A shared secret kept in a file (surrounding whitespace dropped); ConfigError
    naming `what` and the path if it cannot be read or is empty."""
    try:
        with open(path, encoding="utf-8") as f:
            secret = f.read().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} file: {exc.strerror}: {path}") from None
    if not secret:
        raise ConfigError(f"the {what} file {path} is empty")
    return secret


def _read_token(args: argparse.Namespace) -> str | None:
    if args.token_file is not None:
        if args.api_keys is not None:
            raise ConfigError("give --token-file or --api-keys, not both")
        return read_secret_file(args.token_file, "token")
    if args.api_keys is not None:
        return None
    return os.environ.get("CADENCE_TOKEN") or None


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig the `serve` options describe."""
    if args.no_tcp and args.unix is None:
        raise ConfigError("--no-tcp needs --unix PATH")
    try:
        ipaddress.ip_address(args.host)
    except ValueError:
        if args.host != "localhost":
            raise ConfigError(f"--host must be an IP address, got {args.host!r}") from None
    return ServerConfig(
        host=args.host, port=None if args.no_tcp else args.port, unix_path=args.unix,
        token=_read_token(args), max_frame_bytes=args.max_frame_bytes,
        max_connections=args.max_connections,
        max_inflight_per_connection=args.max_inflight_per_connection,
        max_inflight_per_tenant=args.max_inflight_per_tenant,
        max_protocol_errors=args.max_protocol_errors,
        idle_timeout_s=args.idle_timeout_s or None, handshake_timeout_s=args.handshake_timeout_s,
        send_timeout_s=args.send_timeout_s, output_queue_frames=args.output_queue_frames,
        max_unsent_bytes=args.max_unsent_bytes or None,
        shutdown_grace_s=args.shutdown_grace_s, metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        api_keys=None if args.api_keys is None else ApiKeys.from_file(args.api_keys))


def run_serve(args: argparse.Namespace) -> int:
    """Run `cadence serve` until SIGINT or SIGTERM: 0 after a clean drain, 2 for a
    mistake in the options or an address that cannot be used (one line on stderr)."""
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine_config = engine_config_from_args(args)
        server_config = server_config_from_args(args)
        from .http import http_config_from_args

        with unwrap_sole_error():
            trio.run(_serve_until_signalled, engine_config, server_config, http_config_from_args(args))
    except (CadenceError, OSError) as exc:
        print(f"cadence serve: {_one_line(exc)}", file=sys.stderr)
        return USAGE_ERROR
    return 0


# The youngest generation of the cyclic garbage collector in a serving process: with
# CPython's 700, a thousand open connections (each a task, its cancel scopes, an h11
# state) make collections frequent, and each pauses every reply; the slow-client
# benchmark (benchmarks/hostile_http.py) measured a p99 ratio of 1.60 with it and 1.25
# with 5,000-20,000 (medians of 3). The older generations keep CPython's thresholds.
SERVER_GC_THRESHOLD0 = 10_000


def settle_collector() -> None:
    """Tune the garbage collector of a process that now only serves: what startup
    built (the model, the tokenizer, the modules) is frozen out of every later
    collection, and the youngest generation collects after SERVER_GC_THRESHOLD0
    allocations. For `cadence serve`'s own process, not an embedding host's."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(SERVER_GC_THRESHOLD0, older, oldest)


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} ({type(exc).__name__})"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


async def _serve_until_signalled(engine_config: EngineConfig, server_config: ServerConfig,
                                 http=None) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with open_server(engine_config, server_config, http=http) as server:
            settle_collector()
            print(f"cadence serve: listening on {' and '.join(server.addresses)}"
                  + (f"; OpenAI API on http://{server.http.address[0]}:{server.http.address[1]}/v1"
                     if server.http is not None else "")
                  + (f"; metrics on http://{server.metrics_address[0]}:{server.metrics_address[1]}/metrics"
                     if server.metrics_address else ""), flush=True)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_on_signals, server, signals)
                await server.wait_stopped()
                nursery.cancel_scope.cancel()
    print("cadence serve: stopped", flush=True)


async def _on_signals(server: Server, signals) -> None:
    num_signals = 0
    async for signum in signals:
        num_signals += 1
        name = signal.Signals(signum).name
        if num_signals == 1:
            print(f"cadence serve: {name}: draining (up to {server.config.shutdown_grace_s} s); "
                  "send it again to abort running requests", flush=True)
            server.shutdown()
        else:
            print(f"cadence serve: {name}: aborting running requests and closing now", flush=True)
            server.abort_now()


def main(argv: list[str] | None = None) -> int:
    """`python -m cadence.actors.serve.server`: the `serve` command on its own."""
    parser = argparse.ArgumentParser(prog="cadence")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(subparsers)
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
