"""The socket server: an engine behind TCP and/or a Unix socket, msgpack frames on the wire.

    async with open_server(EngineConfig(), ServerConfig(port=0)) as server:
        print(server.tcp_address)     # ('127.0.0.1', 43211)

PROTOCOL.md is the contract. Per connection there are three kinds of task:
the reader (handshake, then one frame at a time), one task per live stream
(it iterates the engine's `RequestStream` and queues Output frames), and the
writer (the only task that writes to the socket).

Why a slow client cannot stall anything else: the request actor coalesces a
stream's deltas while its consumer waits, so a stream task blocked on a full
output queue costs the engine nothing; the queue is bounded
(`output_queue_frames`); and a socket write that makes no progress for
`send_timeout_s` closes the connection, which aborts its requests. Closing a
connection, for whatever reason, cancels its stream tasks in one go, and each
cancelled stream aborts its request synchronously, so all of a connection's
requests are aborted before the scheduler plans its next step.

Shutdown drains: listeners close at once, new requests are refused with
`shutdown`, running ones get `shutdown_grace_s` to finish, the rest end with
an Error frame `shutdown`, and every connection is closed with a fatal
`shutdown` Error.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import logging
import math
import os
import signal
import socket
import stat
import sys
from collections import Counter, deque
from contextlib import asynccontextmanager
from typing import AsyncIterator

import attrs
import trio

from cadence.statemachine.errors import (
    CadenceError, ConfigError, EngineClosedError, ExecutorError, InvalidRequestError, PoisonRequestError,
    QueueFullError, RequestNotFoundError, RequestTooLongError,
)

from ..chat import EngineChat
from ..engine import Engine, EngineConfig, RequestStream, open_engine
from ..framing import MAX_FRAME_BYTES
from .metrics import NullMetrics, ServerMetrics, serve_metrics
from ..trio_thread import TrioThread
from ..engine_args import add_engine_arguments, engine_config_from_args
from ..wire import (
    DEFAULT_PORT,
    DEFAULT_MAX_REQUEST_FRAME_BYTES, Abort, Accepted, Error, ErrorCode, FrameBuffer,
    FrameTooLargeError, Generate, HealthQuery, HealthReply, Hello, MessageError, Output,
    StatsQuery, StatsReply, Welcome, decode_request, encode, pack_frame,
)

__all__ = [
    "DEFAULT_PORT",
    "ServerConfig",
    "Server",
    "open_server",
    "ServerThread",
    "add_serve_parser",
    "run_serve",
    "main",
]

_log = logging.getLogger("cadence.server")

# The exit status of a user's mistake, as for every `cadence` command.
USAGE_ERROR = 2
SERVER_NAME = "cadence/0.1"
# Bytes asked of the kernel per read: many small frames arrive in one read.
_READ_BYTES = 1 << 16
# Most frames (or bytes) the writer joins into one socket write.
_WRITE_BATCH_FRAMES = 64
_WRITE_BATCH_BYTES = 1 << 18
# After a fatal Error frame: how long to keep reading (and discarding) what the
# peer still sends, so closing does not reset the connection and destroy the
# Error frame before the peer reads it.
_LINGER_S = 1.0
_LINGER_BYTES = 1 << 20
# How many times per send_timeout_s the watchdog looks for stalled writes.
_WATCHDOG_CHECKS = 4


def _positive(instance, attribute, value) -> None:
    if value is not None and not value > 0:
        raise ConfigError(f"{attribute.name} must be > 0, got {value!r}")


def _port(instance, attribute, value) -> None:
    if value is not None and not 0 <= value <= 65535:
        raise ConfigError(f"{attribute.name} must be in [0, 65535], got {value!r}")


@attrs.frozen
class ServerConfig:
    """Where the server listens and the limits it applies.

    host, port: TCP address (port 0: any free port; None: no TCP listener). The
      default host is loopback; listening elsewhere must be asked for.
    unix_path: also (or only) listen on this Unix socket (created mode 0600).
    token: shared secret every client must present in its Hello (None: no auth).
    max_frame_bytes: largest frame a client may send.
    max_connections: open connections at once; more are refused.
    max_inflight_per_connection, max_inflight_per_tenant: live streams per
      connection and per tenant (None: no per-tenant limit).
    max_protocol_errors: malformed messages tolerated per connection.
    idle_timeout_s: a connection with no live stream that sends nothing for this
      long is closed (None: never).
    handshake_timeout_s: time a new connection has to send its Hello.
    send_timeout_s: a socket write to a client that makes no progress for this
      long closes the connection (the client is not reading).
    output_queue_frames: frames queued per connection before its streams wait.
    shutdown_grace_s: on shutdown, how long running requests may finish.
    metrics_host, metrics_port: Prometheus endpoint (None: off).
    """

    host: str = "127.0.0.1"
    port: int | None = attrs.field(default=DEFAULT_PORT, validator=_port)
    unix_path: str | None = None
    token: str | None = attrs.field(default=None, repr=False)
    max_frame_bytes: int = attrs.field(default=DEFAULT_MAX_REQUEST_FRAME_BYTES, validator=_positive)
    max_connections: int = attrs.field(default=1024, validator=_positive)
    max_inflight_per_connection: int = attrs.field(default=256, validator=_positive)
    max_inflight_per_tenant: int | None = attrs.field(default=None, validator=_positive)
    max_protocol_errors: int = attrs.field(default=16, validator=_positive)
    idle_timeout_s: float | None = attrs.field(default=300.0, validator=_positive)
    handshake_timeout_s: float = attrs.field(default=10.0, validator=_positive)
    send_timeout_s: float = attrs.field(default=30.0, validator=_positive)
    output_queue_frames: int = attrs.field(default=64, validator=_positive)
    shutdown_grace_s: float = attrs.field(default=30.0, validator=attrs.validators.ge(0))
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = attrs.field(default=None, validator=_port)

    def __attrs_post_init__(self) -> None:
        if self.port is None and self.unix_path is None:
            raise ConfigError("the server needs a TCP port or a Unix socket path")
        if self.max_frame_bytes > MAX_FRAME_BYTES:
            raise ConfigError(f"max_frame_bytes must be <= {MAX_FRAME_BYTES}, got {self.max_frame_bytes}")
        if self.token is not None and not self.token:
            raise ConfigError("token must not be empty (use None for no authentication)")

    def limits(self) -> dict[str, int | float | None]:
        """The limits a client is told about in Welcome."""
        return {
            "max_frame_bytes": self.max_frame_bytes,
            "max_connections": self.max_connections,
            "max_inflight_per_connection": self.max_inflight_per_connection,
            "max_inflight_per_tenant": self.max_inflight_per_tenant,
            "max_protocol_errors": self.max_protocol_errors,
            "idle_timeout_s": self.idle_timeout_s,
            "handshake_timeout_s": self.handshake_timeout_s,
            "send_timeout_s": self.send_timeout_s,
        }


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


class _Fatal(Exception):
    """Raised inside a connection's reader to close it with this Error frame."""

    def __init__(self, frame: Error, reason: str) -> None:
        super().__init__(frame.message)
        self.frame = frame
        self.reason = reason


def _fatal(code: ErrorCode, message: str, reason: str, limit: str | None = None) -> _Fatal:
    return _Fatal(Error(code.value, message, limit=limit, fatal=True), reason)


@attrs.define(eq=False)
class _StreamState:
    """One live stream of a connection."""

    stream: int
    tenant: str
    request_id: str
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    started: bool = False
    abort_requested: bool = False
    shutdown: bool = False


class Server:
    """Serves one engine to many clients; see the module docstring.

    Run it with `await server.serve()` (or `nursery.start(server.serve)`, which
    returns once it listens); `shutdown()` makes `serve` drain and return.
    """

    def __init__(self, engine: Engine, config: ServerConfig | None = None,
                 metrics: NullMetrics | None = None) -> None:
        self.engine = engine
        self.config = config if config is not None else ServerConfig()
        self.metrics = metrics if metrics is not None else NullMetrics()
        self.connections: dict[int, _Connection] = {}
        self.tenant_inflight: Counter[str] = Counter()
        self.num_inflight = 0
        self.draining = False
        self.tcp_address: tuple[str, int] | None = None
        self.unix_path: str | None = None
        self.metrics_address: tuple[str, int] | None = None
        self.http = None  # the HttpServer beside it, if any
        self.chat = EngineChat(engine.config.model, engine.tokenizer)
        self._num_connections_opened = 0
        self._num_requests = 0
        self._shutdown_requested = trio.Event()
        self._all_idle = trio.Event()
        self._connections_gone = trio.Event()
        self._grace_scope = trio.CancelScope()
        self._accept_scope = trio.CancelScope()
        self._stopped = trio.Event()
        self._unix_identity: tuple[int, int] | None = None
        self.welcome_frame = pack_frame(encode(self._make_welcome()))

    # ---- lifecycle ---------------------------------------------------------------
    @property
    def addresses(self) -> list[str]:
        """Where the server listens, as `tcp://host:port` and `unix:/path` strings."""
        out = []
        if self.tcp_address is not None:
            host, port = self.tcp_address
            out.append(f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}")
        if self.unix_path is not None:
            out.append(f"unix:{self.unix_path}")
        return out

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen and serve until `shutdown()` has drained every connection."""
        listeners = await self._open_listeners()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._accept, listeners, nursery)
                watchdog = await nursery.start(self._watch_sends)
                task_status.started(self)
                await self._shutdown_requested.wait()
                await self._drain()
                # The watchdog still guards the connections' last writes.
                while self.connections:
                    self._connections_gone = trio.Event()
                    await self._connections_gone.wait()
                watchdog.cancel()
        finally:
            for listener in listeners:
                with trio.CancelScope(shield=True):
                    await listener.aclose()
            self._remove_unix_socket()
            self._stopped.set()

    async def _watch_sends(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Evict connections whose current write has made no progress for
        send_timeout_s (checked a few times per timeout, so one watchdog serves
        every connection and a write costs no timer of its own)."""
        timeout = self.config.send_timeout_s
        with trio.CancelScope() as scope:
            task_status.started(scope)
            while True:
                await trio.sleep(timeout / _WATCHDOG_CHECKS)
                now = trio.current_time()
                for conn in list(self.connections.values()):
                    started = conn.send_started_s
                    if started is not None and now - started >= timeout:
                        conn.evict_slow_consumer()

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
        self._accept_scope.cancel()
        self._shutdown_requested.set()

    async def wait_stopped(self) -> None:
        """Wait until `serve` has returned."""
        await self._stopped.wait()

    async def _drain(self) -> None:
        self._accept_scope.cancel()
        self._remove_unix_socket()
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

    # ---- listening ---------------------------------------------------------------
    async def _open_listeners(self) -> list[trio.SocketListener]:
        config = self.config
        backlog = min(65535, max(128, config.max_connections))
        listeners: list[trio.SocketListener] = []
        try:
            if config.port is not None:
                tcp = await trio.open_tcp_listeners(config.port, host=config.host, backlog=backlog)
                listeners.extend(tcp)
                self.tcp_address = tuple(tcp[0].socket.getsockname()[:2])
            if config.unix_path is not None:
                listeners.append(await self._open_unix_listener(config.unix_path, backlog))
        except BaseException:
            for listener in listeners:
                await listener.aclose()
            raise
        if config.host not in ("127.0.0.1", "::1", "localhost") and config.token is None:
            _log.warning("listening on %s without a token: anyone who can reach it may use the engine",
                         config.host)
        return listeners

    async def _open_unix_listener(self, path: str, backlog: int) -> trio.SocketListener:
        if os.path.exists(path):
            if not stat.S_ISSOCK(os.stat(path).st_mode):
                raise ConfigError(f"{path} exists and is not a socket")
            if await _unix_socket_answers(path):
                raise ConfigError(f"another server is listening on {path}")
            os.unlink(path)  # left behind by a server that died
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            await sock.bind(path)
            # Owner-only before listening: until listen() nobody can connect anyway.
            os.chmod(path, 0o600)
            sock.listen(backlog)
        except BaseException:
            sock.close()
            raise
        info = os.stat(path)
        self._unix_identity = (info.st_dev, info.st_ino)
        self.unix_path = path
        return trio.SocketListener(sock)

    def _remove_unix_socket(self) -> None:
        path, identity = self.unix_path, self._unix_identity
        if path is None or identity is None:
            return
        self._unix_identity = None
        try:
            info = os.stat(path)
            if (info.st_dev, info.st_ino) == identity:  # still ours, not a successor's
                os.unlink(path)
        except FileNotFoundError:
            pass

    async def _accept(self, listeners: list[trio.SocketListener], nursery: trio.Nursery) -> None:
        with self._accept_scope:
            await trio.serve_listeners(self._handle, listeners, handler_nursery=nursery)

    async def _handle(self, stream: trio.SocketStream) -> None:
        if self.draining:
            await _refuse(stream, Error(ErrorCode.SHUTDOWN.value, "the server is shutting down",
                                        fatal=True))
            return
        limit = self.config.max_connections
        if len(self.connections) >= limit:
            self.metrics.on_connection_closed("too_many_connections")
            await _refuse(stream, Error(ErrorCode.TOO_MANY_CONNECTIONS.value,
                                        f"the server already has {limit} connections",
                                        limit="max_connections", fatal=True))
            return
        self._num_connections_opened += 1
        conn = _Connection(self, stream, self._num_connections_opened)
        await conn.run()

    # ---- what connections ask of the server ---------------------------------------
    def register(self, conn: _Connection) -> None:
        """A connection opened."""
        self.connections[conn.conn_id] = conn
        self.metrics.on_connection(1)

    def unregister(self, conn: _Connection) -> None:
        """A connection closed."""
        del self.connections[conn.conn_id]
        self.metrics.on_connection(-1)
        self.metrics.on_connection_closed(conn.close_reason)
        if not self.connections:
            self._connections_gone.set()

    def next_request_id(self, conn_id: int) -> str:
        """A request id unique for the server's lifetime."""
        self._num_requests += 1
        return f"c{conn_id}-{self._num_requests}"

    def stream_finished(self, state: _StreamState) -> None:
        """Release a stream's place in the in-flight counts."""
        self.num_inflight -= 1
        tenants = self.tenant_inflight
        tenants[state.tenant] -= 1
        if tenants[state.tenant] <= 0:
            del tenants[state.tenant]
        if self.num_inflight == 0:
            self._all_idle.set()

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
            limits=self.config.limits())

    def check_token(self, token: str | None) -> bool:
        """Whether a Hello's token is acceptable (compared in constant time)."""
        expected = self.config.token
        return expected is None or tokens_match(token, expected)


def tokens_match(given: str | None, expected: str) -> bool:
    """Whether a client's secret is the expected one, compared in constant time."""
    if given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


async def _unix_socket_answers(path: str) -> bool:
    try:
        stream = await trio.open_unix_socket(path)
    except OSError:
        return False
    await stream.aclose()
    return True


async def _refuse(stream: trio.SocketStream, frame: Error) -> None:
    """Send one fatal Error frame and close, lingering so the peer can read it."""
    try:
        with trio.move_on_after(_LINGER_S):
            await stream.send_all(pack_frame(encode(frame)))
        await _linger_and_close(stream)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()


async def _linger_and_close(stream: trio.SocketStream) -> None:
    try:
        await stream.send_eof()
        with trio.move_on_after(_LINGER_S):
            discarded = 0
            while discarded < _LINGER_BYTES:
                data = await stream.receive_some(_READ_BYTES)
                if not data:
                    break
                discarded += len(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass


class _Outbox:
    """The frames waiting for a connection's writer.

    Counted frames (stream output, replies) take one of `capacity` places and
    their producer waits while none is free; uncounted ones (a stream's ending
    Error, the final fatal Error) never wait: there is at most one per live
    stream plus one.
    """

    __slots__ = ("_frames", "_free", "_room", "_writer", "closed")

    def __init__(self, capacity: int) -> None:
        self._frames: deque[tuple[bytes, bool]] = deque()
        self._free = capacity
        self._room = trio.lowlevel.ParkingLot()
        self._writer = trio.lowlevel.ParkingLot()
        self.closed = False

    async def put(self, frame: bytes) -> None:
        """Queue a counted frame, waiting for a free place."""
        while self._free <= 0:
            await self._room.park()
        self._free -= 1
        self._frames.append((frame, True))
        self._writer.unpark()

    def put_nowait(self, frame: bytes) -> None:
        """Queue an uncounted frame (dropped once the outbox is closed)."""
        if not self.closed:
            self._frames.append((frame, False))
            self._writer.unpark()

    def close(self) -> None:
        """No more frames: the writer stops once the queue is empty."""
        self.closed = True
        self._writer.unpark()

    async def take(self) -> tuple[list[bytes], int] | None:
        """The next frames to write (joined up to a batch size) and how many of
        them were counted; None once closed and empty."""
        frames = self._frames
        while not frames:
            if self.closed:
                return None
            await self._writer.park()
        batch, num_counted, size = [], 0, 0
        while frames and len(batch) < _WRITE_BATCH_FRAMES and size < _WRITE_BATCH_BYTES:
            frame, counted = frames.popleft()
            batch.append(frame)
            num_counted += counted
            size += len(frame)
        return batch, num_counted

    def release(self, count: int) -> None:
        """`count` counted frames were written: their places are free again."""
        if count:
            self._free += count
            self._room.unpark(count=count)


class _Connection:
    """One client connection: handshake, frames in, streams, frames out."""

    def __init__(self, server: Server, stream: trio.SocketStream, conn_id: int) -> None:
        self.server = server
        self.config = server.config
        self.stream = stream
        self.conn_id = conn_id
        self.streams: dict[int, _StreamState] = {}
        self.num_protocol_errors = 0
        self.close_reason = "closed"
        self._final: Error | None = None
        self._outbox = _Outbox(self.config.output_queue_frames)
        # When the write in progress began (None: no write in progress); the
        # server's watchdog closes the connection if one lasts send_timeout_s.
        self.send_started_s: float | None = None
        self._scope: trio.CancelScope | None = None
        self._reader_scope = trio.CancelScope()
        self._receive_scope: trio.CancelScope | None = None
        self._streams_nursery: trio.Nursery | None = None
        self._greeted = False
        # Deadlines count from the connection's start and from its last whole
        # frame, so trickling bytes cannot keep a connection alive.
        self._handshake_deadline = trio.current_time() + self.config.handshake_timeout_s
        self._idle_since = trio.current_time()
        try:
            self.peer = str(stream.socket.getpeername()) or "unix"
        except OSError:
            self.peer = "?"

    # ---- the connection task -----------------------------------------------------
    async def run(self) -> None:
        """Serve the connection until the peer leaves or it is closed."""
        server = self.server
        server.register(self)
        _log.debug("connection %d from %s", self.conn_id, self.peer)
        try:
            async with trio.open_nursery() as nursery:
                self._scope = nursery.cancel_scope
                nursery.start_soon(self._writer)
                async with trio.open_nursery() as streams:
                    self._streams_nursery = streams
                    with self._reader_scope:
                        await self._read_loop()
                    # Every stream aborts its request as its task is cancelled.
                    streams.cancel_scope.cancel()
                if self._final is None:
                    nursery.cancel_scope.cancel()
                else:
                    self._outbox.put_nowait(pack_frame(encode(self._final)))
                    self._outbox.close()
        finally:
            server.unregister(self)
            with trio.CancelScope(shield=True):
                if self._final is not None and self.close_reason != "slow_consumer":
                    with trio.move_on_after(_LINGER_S):
                        await _linger_and_close(self.stream)
                await self.stream.aclose()
            _log.debug("connection %d closed: %s", self.conn_id, self.close_reason)

    def close(self, frame: Error, reason: str) -> None:
        """Close the connection after sending `frame` (its live streams are aborted)."""
        if self._final is None:
            self._final = frame
            self.close_reason = reason
        self._reader_scope.cancel()

    def close_if_idle(self) -> None:
        """During shutdown: close now if no stream is live."""
        if not self.streams:
            self.close(Error(ErrorCode.SHUTDOWN.value, "the server is shutting down", fatal=True),
                       "shutdown")

    def abort_for_shutdown(self) -> None:
        """The grace period is over: end every live stream with a shutdown error."""
        for state in self.streams.values():
            state.shutdown = True
            state.scope.cancel()
        self.close_if_idle()

    # ---- reading -----------------------------------------------------------------
    async def _read_loop(self) -> None:
        buffer = FrameBuffer(self.config.max_frame_bytes)
        try:
            while True:
                try:
                    frame = buffer.next_frame()
                except FrameTooLargeError as exc:
                    self.server.metrics.on_protocol_error(ErrorCode.FRAME_TOO_LARGE.value)
                    raise _fatal(ErrorCode.FRAME_TOO_LARGE, str(exc), "frame_too_large",
                                 "max_frame_bytes") from None
                if frame is not None:
                    await self._on_frame(frame)
                    continue
                data = await self._receive()
                if not data:
                    if buffer.num_pending_bytes:
                        self.server.metrics.on_protocol_error(ErrorCode.BAD_FRAME.value)
                        self.close_reason = "truncated_frame"
                    else:
                        self.close_reason = "eof"
                    return
                buffer.feed(data)
        except _Fatal as fatal:
            self.close(fatal.frame, fatal.reason)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self.close_reason = "reset"
            _log.debug("connection %d: %s", self.conn_id, exc)
        except Exception:  # a bug here must cost one connection, never the server
            _log.exception("connection %d: internal error", self.conn_id)
            self.close(Error(ErrorCode.INTERNAL.value, "internal server error", fatal=True), "internal")

    async def _receive(self) -> bytes:
        config = self.config
        if not self._greeted:
            deadline = self._handshake_deadline
        elif self.streams or config.idle_timeout_s is None:
            deadline = math.inf
        else:
            deadline = self._idle_since + config.idle_timeout_s
        with trio.CancelScope(deadline=deadline) as scope:
            self._receive_scope = scope
            data = await self.stream.receive_some(_READ_BYTES)
            self._receive_scope = None
            return data
        self._receive_scope = None
        if not self._greeted:
            raise _fatal(ErrorCode.HANDSHAKE_TIMEOUT,
                         f"no Hello within {config.handshake_timeout_s} s", "handshake_timeout",
                         "handshake_timeout_s")
        raise _fatal(ErrorCode.IDLE_TIMEOUT, f"idle for {config.idle_timeout_s} s", "idle_timeout",
                     "idle_timeout_s")

    def _idle_clock_restart(self) -> None:
        """The last stream ended: the idle timeout counts from now."""
        self._idle_since = now = trio.current_time()
        scope, idle = self._receive_scope, self.config.idle_timeout_s
        if scope is not None and idle is not None and not self.streams and self._greeted:
            scope.deadline = now + idle

    async def _on_frame(self, frame: bytes) -> None:
        self._idle_since = trio.current_time()
        try:
            message = decode_request(frame)
        except MessageError as exc:
            await self._on_bad_message(exc)
            return
        if not self._greeted:
            await self._handshake(message)
            return
        kind = type(message)
        if kind is Generate:
            await self._on_generate(message)
        elif kind is Abort:
            await self._on_abort(message)
        elif kind is StatsQuery:
            await self._send(self.server.stats(message.ref))
        elif kind is HealthQuery:
            await self._send(self.server.health(message.ref))
        else:
            await self._on_bad_message(MessageError("Hello was already received on this connection"))

    async def _on_bad_message(self, exc: MessageError) -> None:
        metrics = self.server.metrics
        if not self._greeted or exc.code is ErrorCode.UNSUPPORTED_VERSION:
            # A well-formed Generate with bad values, sent before Hello, is still not a Hello.
            code = ErrorCode.HANDSHAKE_REQUIRED if exc.code is ErrorCode.INVALID_REQUEST else exc.code
            metrics.on_protocol_error(code.value)
            raise _Fatal(Error(code.value, str(exc), fatal=True), "protocol_error")
        if exc.code is ErrorCode.INVALID_REQUEST:
            metrics.on_rejected(exc.code.value)
            await self._send(Error(exc.code.value, str(exc), stream=exc.stream))
            return
        metrics.on_protocol_error(exc.code.value)
        self.num_protocol_errors += 1
        limit = self.config.max_protocol_errors
        if self.num_protocol_errors > limit:
            metrics.on_protocol_error(ErrorCode.TOO_MANY_PROTOCOL_ERRORS.value)
            raise _fatal(ErrorCode.TOO_MANY_PROTOCOL_ERRORS,
                         f"more than {limit} malformed messages; last: {exc}", "protocol_error",
                         "max_protocol_errors")
        await self._send(Error(exc.code.value, str(exc), stream=exc.stream))

    async def _handshake(self, message) -> None:
        if type(message) is not Hello:
            self.server.metrics.on_protocol_error(ErrorCode.HANDSHAKE_REQUIRED.value)
            raise _fatal(ErrorCode.HANDSHAKE_REQUIRED,
                         f"the first message must be Hello, got {message.TYPE}", "protocol_error")
        if not self.server.check_token(message.token):
            raise _fatal(ErrorCode.UNAUTHORIZED, "missing or wrong token", "unauthorized")
        self._greeted = True
        if message.client:
            _log.debug("connection %d is %r", self.conn_id, message.client[:64])
        await self._send_frame(self.server.welcome_frame)

    # ---- requests ----------------------------------------------------------------
    async def _on_generate(self, message: Generate) -> None:
        server, config = self.server, self.config
        sid = message.stream
        refusal = None
        if server.draining:
            refusal = (ErrorCode.SHUTDOWN, "the server is shutting down", None)
        elif sid in self.streams:
            refusal = (ErrorCode.DUPLICATE_STREAM, f"stream {sid} is already live on this connection",
                       None)
        elif len(self.streams) >= config.max_inflight_per_connection:
            refusal = (ErrorCode.TOO_MANY_REQUESTS,
                       f"this connection already has {len(self.streams)} live streams",
                       "max_inflight_per_connection")
        elif (config.max_inflight_per_tenant is not None
              and server.tenant_inflight[message.tenant] >= config.max_inflight_per_tenant):
            refusal = (ErrorCode.TENANT_LIMIT,
                       f"tenant {message.tenant[:64]!r} already has "
                       f"{server.tenant_inflight[message.tenant]} live streams",
                       "max_inflight_per_tenant")
        if refusal is None and message.messages is not None:
            try:
                message = attrs.evolve(message, prompt=server.chat.prompt_ids(message.messages),
                                       messages=None)
            except InvalidRequestError as exc:
                refusal = (ErrorCode.INVALID_REQUEST, str(exc), None)
        if refusal is not None:
            code, text, limit = refusal
            server.metrics.on_rejected(code.value)
            await self._send(Error(code.value, text, stream=sid, limit=limit))
            return
        state = _StreamState(sid, message.tenant, server.next_request_id(self.conn_id))
        self.streams[sid] = state
        server.num_inflight += 1
        server.tenant_inflight[message.tenant] += 1
        self._streams_nursery.start_soon(self._run_stream, state, message)

    async def _on_abort(self, message: Abort) -> None:
        state = self.streams.get(message.stream)
        if state is None:
            await self._send(Error(ErrorCode.UNKNOWN_STREAM.value,
                                   f"no live stream {message.stream} on this connection",
                                   stream=message.stream))
            return
        state.abort_requested = True
        if state.started:
            try:
                await self.server.engine.abort(state.request_id, "aborted by client")
            except RequestNotFoundError:
                pass  # it finished while the Abort was on its way

    async def _run_stream(self, state: _StreamState, message: Generate) -> None:
        server = self.server
        engine, metrics = server.engine, server.metrics
        request_stream = engine.generate(
            message.prompt, message.params, priority=message.priority, tenant=message.tenant,
            deadline_s=message.deadline_s, request_id=state.request_id, timeout_s=message.timeout_s,
            cache_salt=message.cache_salt)
        error: Error | None = None
        try:
            with state.scope:
                try:
                    await request_stream.start()
                except CadenceError as exc:
                    code = _engine_error_code(exc, server.draining)
                    metrics.on_rejected(code.value)
                    error = Error(code.value, str(exc), stream=state.stream)
                    return
                state.started = True
                if state.abort_requested:
                    try:
                        await engine.abort(state.request_id, "aborted by client")
                    except RequestNotFoundError:
                        pass  # already over (its own timeout)
                num_prompt = self._num_prompt_tokens(state.request_id, message.prompt)
                metrics.on_accepted(num_prompt)
                await self._send(Accepted(state.stream, state.request_id, num_prompt))
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
            del self.streams[state.stream]
            server.stream_finished(state)
            if error is not None:
                self._send_nowait(error)
            if server.draining:
                self.close_if_idle()
            else:
                self._idle_clock_restart()

    async def _relay(self, state: _StreamState, request_stream: RequestStream) -> None:
        metrics = self.server.metrics
        previous_s = None
        async for out in request_stream:
            if out.token_ids:
                metrics.on_tokens(len(out.token_ids), out.first_token_s, out.arrival_s, previous_s,
                                  out.now_s)
                previous_s = out.now_s
            if out.finish_reason is not None:
                metrics.on_finished(out.finish_reason, out.arrival_s, out.now_s)
            await self._send(Output(state.stream, out.token_ids, out.text, out.num_tokens,
                                    out.finish_reason, out.detail, out.num_cached_tokens,
                                    out.logprobs))

    def _num_prompt_tokens(self, request_id: str, prompt: str | list[int]) -> int:
        actor = self.server.engine.scheduler.actors.get(request_id)
        if actor is not None:
            return actor.request.num_prompt_tokens
        if isinstance(prompt, list):
            return len(prompt)
        tokenizer = self.server.engine.tokenizer
        return len(tokenizer.encode(prompt)) if tokenizer is not None else 0

    # ---- writing -----------------------------------------------------------------
    async def _send(self, message) -> None:
        """Queue a frame, waiting while the connection's output queue is full."""
        await self._outbox.put(pack_frame(encode(message)))

    async def _send_frame(self, frame: bytes) -> None:
        await self._outbox.put(frame)

    def _send_nowait(self, message) -> None:
        """Queue a frame past the bound: only for the Error that ends a stream."""
        self._outbox.put_nowait(pack_frame(encode(message)))

    def evict_slow_consumer(self) -> None:
        """The client has not taken a frame for send_timeout_s: close the connection
        (no Error frame can get through a full socket)."""
        _log.info("connection %d: client not reading for %.1f s; closing", self.conn_id,
                  self.config.send_timeout_s)
        self.close_reason = "slow_consumer"
        if self._scope is not None:
            self._scope.cancel()

    async def _writer(self) -> None:
        outbox = self._outbox
        try:
            while (batch := await outbox.take()) is not None:
                frames, num_counted = batch
                self.send_started_s = trio.current_time()
                await self.stream.send_all(frames[0] if len(frames) == 1 else b"".join(frames))
                self.send_started_s = None
                outbox.release(num_counted)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            _log.debug("connection %d: write failed: %s", self.conn_id, exc)
            self.close_reason = "reset"
            self._scope.cancel()


# ---------------------------------------------------------------------------
# Running a server.


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
                    serve_metrics, recorder, server_config.metrics_host, server_config.metrics_port)
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
    parser = subparsers.add_parser(
        "serve", help="serve an engine over TCP and/or a Unix socket",
        description="Serve an engine to clients speaking the msgpack protocol of PROTOCOL.md. "
                    "Listens on 127.0.0.1 unless --host says otherwise. SIGINT or SIGTERM "
                    "drains: running requests get --shutdown-grace-s to finish; a second "
                    "signal aborts them at once.")
    add_engine_arguments(parser)
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
    limits = parser.add_argument_group("limits")
    defaults = ServerConfig()
    limits.add_argument("--max-frame-bytes", type=int, default=defaults.max_frame_bytes)
    limits.add_argument("--max-connections", type=int, default=defaults.max_connections)
    limits.add_argument("--max-inflight-per-connection", type=int,
                        default=defaults.max_inflight_per_connection)
    limits.add_argument("--max-inflight-per-tenant", type=int, default=None,
                        help="live streams per tenant (default: no limit)")
    limits.add_argument("--max-protocol-errors", type=int, default=defaults.max_protocol_errors)
    limits.add_argument("--idle-timeout-s", type=float, default=defaults.idle_timeout_s,
                        help="close connections idle this long; 0 disables (default: %(default)s)")
    limits.add_argument("--handshake-timeout-s", type=float, default=defaults.handshake_timeout_s)
    limits.add_argument("--send-timeout-s", type=float, default=defaults.send_timeout_s,
                        help="close a client whose socket accepts nothing for this long")
    limits.add_argument("--output-queue-frames", type=int, default=defaults.output_queue_frames)
    limits.add_argument("--shutdown-grace-s", type=float, default=defaults.shutdown_grace_s)
    obs = parser.add_argument_group("observability")
    obs.add_argument("--metrics-port", type=int, default=None,
                     help="serve Prometheus metrics over HTTP on this port (0: any free port)")
    obs.add_argument("--metrics-host", default="127.0.0.1")
    obs.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
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
        return read_secret_file(args.token_file, "token")
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
        shutdown_grace_s=args.shutdown_grace_s, metrics_host=args.metrics_host,
        metrics_port=args.metrics_port)


def run_serve(args: argparse.Namespace) -> int:
    """Run `cadence serve` until SIGINT or SIGTERM: 0 after a clean drain, 2 for a
    mistake in the options or an address that cannot be used (one line on stderr)."""
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine_config = engine_config_from_args(args)
        server_config = server_config_from_args(args)
        from .http import http_config_from_args

        trio.run(_serve_until_signalled, engine_config, server_config, http_config_from_args(args))
    except (CadenceError, OSError) as exc:
        print(f"cadence serve: {_one_line(exc)}", file=sys.stderr)
        return USAGE_ERROR
    return 0


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} ({type(exc).__name__})"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


async def _serve_until_signalled(engine_config: EngineConfig, server_config: ServerConfig,
                                 http=None) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with open_server(engine_config, server_config, http=http) as server:
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
            print(f"cadence serve: {name}: aborting running requests", flush=True)
            server.shutdown(0.0)


def main(argv: list[str] | None = None) -> int:
    """`python -m cadence.actors.serve.server`: the `serve` command on its own."""
    parser = argparse.ArgumentParser(prog="cadence")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(subparsers)
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
