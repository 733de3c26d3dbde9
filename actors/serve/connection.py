"""The connection core shared by the msgpack server and the router.

Both speak the client protocol of PROTOCOL.md to their clients, so everything
about a client connection lives here once: listening (TCP and a private Unix
socket), the accept loop (with a clean refusal when the process runs out of
file descriptors), the connection registry and its limit, the handshake, the
reader with its deadlines, bad-message handling and the protocol-error limit,
the per-stream checks every Generate passes (draining, duplicate id, streams
per connection), text prompts too long for any request dropped as they arrive,
large per-request work sent to worker threads, the bounded outbox and its
writer, the closing of clients that do not read (`max_unsent_bytes`, and the
watchdog's `send_timeout_s`), and the linger before a close.

What differs lives in the subclasses: where a Generate goes (the engine, or a
replica), how an Abort reaches it, and how Stats and Health are answered.
`Front` is the listening side (the server or the router); `Connection` is one
client connection of it.

Per connection there are three kinds of task: the reader (handshake, then one
frame at a time), one task per live stream (subclass code that queues Output
frames), and the writer (the only task that writes to the socket). Closing a
connection, for whatever reason, cancels its stream tasks in one go.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hmac
import logging
import math
import os
import socket
import stat
from collections import deque
from contextlib import contextmanager
from functools import partial

import attrs
import trio

from cadence.statemachine.errors import ConfigError, RequestTooLongError

from ..engine import OFF_LOOP_PROMPT_CHARS
from ..framing import HEADER_BYTES, MAX_FRAME_BYTES
from ..validation import check_prompt_num_bytes
from ..wire import (
    DEFAULT_MAX_REQUEST_FRAME_BYTES, EMPTY_STR, Abort, Error, ErrorCode, FrameBuffer,
    FrameTooLargeError, Generate, HealthQuery, Hello, MessageError, StatsQuery, decode_request,
    encode, pack_frame, text_prompt_span,
)
from .identity import IdentityError, KeyGrant
from .metrics import NullMetrics

__all__ = ["ConnectionConfig", "Front", "Connection", "StreamState", "Outbox", "Fatal", "fatal", "refuse",
           "tokens_match", "bare_errors", "positive", "port_number", "DEFAULT_OUTPUT_QUEUE_BYTES",
           "DEFAULT_MAX_UNSENT_BYTES", "DEFAULT_REFUSED_BYTES_PER_S"]

_log = logging.getLogger("cadence.connection")

# Bytes asked of the kernel per read: many small frames arrive in one read.
READ_BYTES = 1 << 16
# Most frames (or bytes) the writer joins into one socket write.
_WRITE_BATCH_FRAMES = 64
_WRITE_BATCH_BYTES = 1 << 18
# After a fatal Error frame: how long to keep reading (and discarding) what the
# peer still sends, so closing does not reset the connection and destroy the
# Error frame before the peer reads it.
LINGER_S = 1.0
_LINGER_BYTES = 1 << 20
# How many times per send_timeout_s the watchdog looks for stalled writes.
_WATCHDOG_CHECKS = 4
# accept() errors that mean the process (or system) is out of a resource, not
# that the listener is broken.
_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# Pause after a capacity error that could not be answered (no spare descriptor):
# doubles from the first value up to the last.
_ACCEPT_BACKOFF_S = (0.01, 1.0)
# Pending connections answered in a row while out of descriptors before the
# accept loop yields to the connections it already serves.
_SHED_BATCH = 64
# Bytes of queued frames per connection before its streams wait (one frame
# always fits, however large).
DEFAULT_OUTPUT_QUEUE_BYTES = 1 << 20
# Bytes the server may hold for one client that the kernel has not taken (the outbox,
# frames waiting for it, and the output its streams' requests hold back): a client
# past it is not reading and is closed at once.
DEFAULT_MAX_UNSENT_BYTES = 4 * DEFAULT_OUTPUT_QUEUE_BYTES
# Bytes of refused requests a connection may send per second: past that its next
# frames are read later, so requests that are costly to refuse (megabyte prompts)
# cannot take the event loop from other clients.
DEFAULT_REFUSED_BYTES_PER_S = 4 << 20
# A frame declaring more than this is looked at before it is buffered whole: when
# its text prompt is longer than any prompt can be (`RequestLimits.max_prompt_bytes`),
# the text is dropped as it arrives, never copied into a frame or decoded, and the
# request is refused on its stream. The look needs the body's first bytes: up to
# _SKIM_PREFIX_BYTES of them (the envelope and the fields before the prompt).
_SKIM_FRAME_BYTES = 1 << 16
_SKIM_PREFIX_BYTES = 1 << 16
# Bytes of an elided prompt received per read (into one scratch buffer per front).
_DISCARD_READ_BYTES = 1 << 18
# After connections close, hand freed heap pages back to the system at most this often.
_TRIM_INTERVAL_S = 1.0
# Worker threads doing one request's large work at once (`Front.run_sized`), so
# large requests queue for them rather than crowd the event loop.
_WORKER_THREADS = 2


def positive(instance, attribute, value) -> None:
    """attrs validator: None or a number > 0."""
    if value is not None and not value > 0:
        raise ConfigError(f"{attribute.name} must be > 0, got {value!r}")


def port_number(instance, attribute, value) -> None:
    """attrs validator: None or a TCP port."""
    if value is not None and not 0 <= value <= 65535:
        raise ConfigError(f"{attribute.name} must be in [0, 65535], got {value!r}")


@attrs.frozen(kw_only=True)
class ConnectionConfig:
    """Where a front (the server, the router) listens for clients and the limits it
    applies to each of them; `ServerConfig` and `RouterConfig` add their own.

    host, port: TCP address (port 0: any free port; None: no TCP listener). The
      default host is loopback; listening elsewhere must be asked for.
    unix_path: also (or only) listen on this Unix socket (created mode 0600).
    token: shared secret every client must present in its Hello (None: no auth).
    max_frame_bytes: largest frame a client may send.
    max_connections: open connections at once; more are refused.
    max_inflight_per_connection: live streams per connection.
    max_protocol_errors: malformed messages tolerated per connection.
    idle_timeout_s: a connection with no live stream that sends nothing for this
      long is closed (None: never).
    handshake_timeout_s: time a new connection has to send its Hello.
    send_timeout_s: a socket write to a client that makes no progress for this
      long closes the connection (the client is not reading).
    output_queue_frames, output_queue_bytes: frames (and their bytes) queued
      per connection before its streams wait.
    max_unsent_bytes: bytes held for a client that the kernel has not taken (its
      queued frames, and the output its waiting streams hold back); past it the
      client is not reading, and is closed at once (None: only send_timeout_s).
    refused_bytes_per_s: bytes of refused requests a connection may send per second;
      past that its next frames are read later (None: no pause).
    """

    host: str = "127.0.0.1"
    port: int | None = attrs.field(default=None, validator=port_number)
    unix_path: str | None = None
    token: str | None = attrs.field(default=None, repr=False)
    max_frame_bytes: int = attrs.field(default=DEFAULT_MAX_REQUEST_FRAME_BYTES, validator=positive)
    max_connections: int = attrs.field(default=1024, validator=positive)
    max_inflight_per_connection: int = attrs.field(default=256, validator=positive)
    max_protocol_errors: int = attrs.field(default=16, validator=positive)
    idle_timeout_s: float | None = attrs.field(default=None, validator=positive)
    handshake_timeout_s: float = attrs.field(default=10.0, validator=positive)
    send_timeout_s: float = attrs.field(default=30.0, validator=positive)
    output_queue_frames: int = attrs.field(default=64, validator=positive)
    output_queue_bytes: int = attrs.field(default=DEFAULT_OUTPUT_QUEUE_BYTES, validator=positive)
    max_unsent_bytes: int | None = attrs.field(default=DEFAULT_MAX_UNSENT_BYTES, validator=positive)
    refused_bytes_per_s: float | None = attrs.field(default=DEFAULT_REFUSED_BYTES_PER_S,
                                                    validator=positive)

    def __attrs_post_init__(self) -> None:
        if self.port is None and self.unix_path is None:
            raise ConfigError(f"the {self.kind} needs a TCP port or a Unix socket path")
        if self.max_frame_bytes > MAX_FRAME_BYTES:
            raise ConfigError(f"max_frame_bytes must be <= {MAX_FRAME_BYTES}, got {self.max_frame_bytes}")
        if self.token is not None and not self.token:
            raise ConfigError("token must not be empty (use None for no authentication)")
        if self.max_unsent_bytes is not None and self.max_unsent_bytes < self.output_queue_bytes:
            raise ConfigError(f"max_unsent_bytes must be >= output_queue_bytes "
                              f"({self.output_queue_bytes}), got {self.max_unsent_bytes}")

    #: What the front is called in messages ("server", "router").
    kind = "server"

    def limits(self) -> dict[str, int | float | None]:
        """The limits a client is told about in Welcome."""
        return {
            "max_frame_bytes": self.max_frame_bytes,
            "max_connections": self.max_connections,
            "max_inflight_per_connection": self.max_inflight_per_connection,
            "max_protocol_errors": self.max_protocol_errors,
            "idle_timeout_s": self.idle_timeout_s,
            "handshake_timeout_s": self.handshake_timeout_s,
            "send_timeout_s": self.send_timeout_s,
        }


class Fatal(Exception):
    """Raised inside a connection's reader to close it with this Error frame."""

    def __init__(self, frame: Error, reason: str) -> None:
        super().__init__(frame.message)
        self.frame = frame
        self.reason = reason


def fatal(code: ErrorCode, message: str, reason: str, limit: str | None = None) -> Fatal:
    """A `Fatal` for `code`, counted as closing reason `reason`."""
    return Fatal(Error(code.value, message, limit=limit, fatal=True), reason)


@attrs.define(eq=False)
class StreamState:
    """One live stream of a connection; subclasses add what their streams need."""

    stream: int
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    abort_requested: bool = False
    shutdown: bool = False
    # Size of the Generate frame that opened it (a refusal pauses reads for it).
    frame_bytes: int = 0


_CLOSE_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


class _Truncated(Exception):
    """The peer closed its side in the middle of a frame."""


async def _linger_and_close(stream: trio.SocketStream) -> None:
    try:
        await stream.send_eof()
        with trio.move_on_after(LINGER_S):
            discarded = 0
            while discarded < _LINGER_BYTES:
                data = await stream.receive_some(READ_BYTES)
                if not data:
                    break
                discarded += len(data)
    except _CLOSE_ERRORS:
        pass


async def refuse(stream: trio.SocketStream, frame: Error) -> None:
    """Send one fatal Error frame and close, lingering so the peer can read it."""
    try:
        with trio.move_on_after(LINGER_S):
            await stream.send_all(pack_frame(encode(frame)))
        await _linger_and_close(stream)
    except _CLOSE_ERRORS:
        pass
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()


def _refuse_now(sock: socket.socket, frame: bytes) -> None:
    """Answer a connection at once and close it, without waiting: used while the
    process is out of descriptors, when no task may hold one for long. What the
    peer already sent is read first, so the close is not a reset that would
    destroy the Error frame."""
    try:
        sock.setblocking(False)
        sock.send(frame)
        while sock.recv(READ_BYTES):
            pass
    except OSError:
        pass
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    sock.close()


@contextmanager
def bare_errors():
    """At an API edge: an exception group holding one exception (as nurseries
    raise them under trio >= 0.25) is re-raised as that exception, so callers
    catch `ConfigError` or `OSError` on any Trio version."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaf: BaseException = group
        while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
            leaf = leaf.exceptions[0]
        if isinstance(leaf, BaseExceptionGroup):
            raise
        raise leaf from leaf.__cause__  # its own cause, not the group around it


def tokens_match(given: str | None, expected: str) -> bool:
    """Whether a client's secret is the expected one, compared in constant time."""
    if given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


def _load_malloc_trim():
    """glibc's malloc_trim, or None elsewhere."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_malloc_trim = _load_malloc_trim()


class Outbox:
    """The frames waiting for a connection's writer.

    Counted frames (stream output, replies) take one of `capacity` places, and
    together at most `max_bytes` bytes (one frame always fits an empty outbox);
    their producer waits while there is no room. Uncounted ones (a stream's
    ending Error, the final fatal Error) never wait: there is at most one per
    live stream plus one.
    """

    __slots__ = ("_frames", "_free", "_max_bytes", "num_bytes", "num_waiting_bytes", "_room",
                 "_writer", "closed", "on_wait")

    def __init__(self, capacity: int, max_bytes: int, on_wait=None) -> None:
        self._frames: deque[tuple[bytes, bool]] = deque()
        self._free = capacity
        self._max_bytes = max_bytes
        # Counted bytes queued or being written, and bytes of frames waiting for room.
        self.num_bytes = 0
        self.num_waiting_bytes = 0
        self._room = trio.lowlevel.ParkingLot()
        self._writer = trio.lowlevel.ParkingLot()
        self.closed = False
        # Called (no arguments) whenever a producer is about to wait for room.
        self.on_wait = on_wait

    def __len__(self) -> int:
        return len(self._frames)

    @property
    def congested(self) -> bool:
        """Whether some producer waits for room."""
        return bool(self._room)

    async def put(self, frame: bytes) -> None:
        """Queue a counted frame, waiting for a free place and room for its bytes."""
        while self._free <= 0 or (self.num_bytes and self.num_bytes + len(frame) > self._max_bytes):
            self.num_waiting_bytes += len(frame)
            try:
                if self.on_wait is not None:
                    self.on_wait()
                await self._room.park()
            finally:
                self.num_waiting_bytes -= len(frame)
        self._free -= 1
        self.num_bytes += len(frame)
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

    def clear(self) -> None:
        """Drop every queued frame (the connection is being evicted)."""
        self._frames.clear()
        self.num_bytes = 0
        self.on_wait = None

    async def take(self) -> tuple[list[bytes], int, int] | None:
        """The next frames to write (joined up to a batch size), how many of them
        were counted and their counted bytes; None once closed and empty."""
        frames = self._frames
        while not frames:
            if self.closed:
                return None
            await self._writer.park()
        batch, num_counted, num_bytes, size = [], 0, 0, 0
        while frames and len(batch) < _WRITE_BATCH_FRAMES and size < _WRITE_BATCH_BYTES:
            frame, counted = frames.popleft()
            batch.append(frame)
            size += len(frame)
            if counted:
                num_counted += 1
                num_bytes += len(frame)
        return batch, num_counted, num_bytes

    def release(self, count: int, num_bytes: int) -> None:
        """`count` counted frames of `num_bytes` bytes were written: their room is free again."""
        if count:
            self._free += count
            self.num_bytes = max(0, self.num_bytes - num_bytes)
            self._room.unpark_all()


class Front:
    """The listening side shared by the server and the router: listeners, the
    accept loop, the connection registry, the token check and the watchdog.

    Subclasses set `welcome_frame` and implement `make_connection`; `config` is
    a `ConnectionConfig` (or a subclass of it).
    """

    #: How the front names itself in refusals ("server", "router").
    kind = "server"
    #: What requests are checked against here, if known (a `RequestLimits`): with a
    #: byte estimate, text prompts too long for the model are refused as they arrive.
    request_limits = None

    def __init__(self, config, metrics: NullMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else NullMetrics()
        self.connections: dict[int, Connection] = {}
        self.tcp_address: tuple[str, int] | None = None
        self.unix_path: str | None = None
        self.welcome_frame = b""
        self.draining = False
        self.num_refused_at_capacity = 0
        self._num_connections_opened = 0
        self._connections_gone = trio.Event()
        self._accept_scope = trio.CancelScope()
        self._unix_identity: tuple[int, int] | None = None
        self._reserve_fd: int | None = None
        self._at_capacity = False
        self._last_trim_s = -math.inf
        self._trim_pending = False
        self._workers = trio.CapacityLimiter(_WORKER_THREADS)
        self._scratch: memoryview | None = None
        # Connections some of whose streams wait for room in their outbox.
        self.congested: set[Connection] = set()

    @property
    def scratch(self) -> memoryview:
        """A buffer that reads whose bytes are dropped go into (its content is never
        read, so every connection shares it)."""
        if self._scratch is None:
            self._scratch = memoryview(bytearray(_DISCARD_READ_BYTES))
        return self._scratch

    # ---- work on one request ----------------------------------------------------
    async def run_sized(self, size: int, fn, /, *args, **kwargs):
        """`fn(*args, **kwargs)` for a request of `size` (characters, token ids): on
        the event loop when small, in a worker thread past the size at which the
        engine tokenises off the loop, so one large request (a conversation to render,
        a prompt to hash) cannot hold up the tokens of every other stream."""
        if size <= OFF_LOOP_PROMPT_CHARS:
            return fn(*args, **kwargs)
        return await trio.to_thread.run_sync(partial(fn, *args, **kwargs), limiter=self._workers)

    # ---- what subclasses provide -------------------------------------------------
    def make_connection(self, stream: trio.SocketStream, conn_id: int) -> Connection:
        """The connection object serving `stream`."""
        raise NotImplementedError

    def stream_finished(self, state: StreamState) -> None:
        """A stream of some connection ended (release its place in shared counts)."""

    # ---- addresses and listeners -------------------------------------------------
    @property
    def addresses(self) -> list[str]:
        """Where it listens, as `tcp://host:port` and `unix:/path` strings."""
        out = []
        if self.tcp_address is not None:
            host, port = self.tcp_address
            out.append(f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}")
        if self.unix_path is not None:
            out.append(f"unix:{self.unix_path}")
        return out

    async def open_listeners(self) -> list[trio.SocketListener]:
        """Listen on the configured TCP address and/or Unix socket."""
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
            _log.warning("listening on %s without a token: anyone who can reach it may use the %s",
                         config.host, self.kind)
        self._take_reserve_fd()
        return listeners

    async def close_listeners(self, listeners: list[trio.SocketListener]) -> None:
        """Close the listeners, remove our Unix socket file and the spare descriptor."""
        with trio.CancelScope(shield=True):
            for listener in listeners:
                await listener.aclose()
        self.remove_unix_socket()
        if self._reserve_fd is not None:
            os.close(self._reserve_fd)
            self._reserve_fd = None

    async def _open_unix_listener(self, path: str, backlog: int) -> trio.SocketListener:
        if os.path.exists(path):
            if not stat.S_ISSOCK(os.stat(path).st_mode):
                raise ConfigError(f"{path} exists and is not a socket")
            if await _unix_socket_answers(path):
                raise ConfigError(f"another {self.kind} is listening on {path}")
            os.unlink(path)  # left behind by a process that died
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

    def remove_unix_socket(self) -> None:
        """Remove the Unix socket file, if it is still ours (not a successor's)."""
        path, identity = self.unix_path, self._unix_identity
        if path is None or identity is None:
            return
        self._unix_identity = None
        try:
            info = os.stat(path)
            if (info.st_dev, info.st_ino) == identity:
                os.unlink(path)
        except FileNotFoundError:
            pass

    # ---- accepting ---------------------------------------------------------------
    async def accept(self, listeners: list[trio.SocketListener], nursery: trio.Nursery) -> None:
        """Accept on every listener until `stop_accepting()` (which closes them);
        each connection's task runs in `nursery`."""
        with self._accept_scope:
            async with trio.open_nursery() as accepting:
                for listener in listeners:
                    accepting.start_soon(self._accept_loop, listener, nursery)

    def stop_accepting(self) -> None:
        """Accept no more connections (the listeners stay open until closed)."""
        self._accept_scope.cancel()

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        async with listener:
            await self._accept_from(listener, nursery)

    async def _accept_from(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        backoff = _ACCEPT_BACKOFF_S[0]
        while True:
            try:
                stream = await listener.accept()
            except trio.ClosedResourceError:
                return
            except OSError as exc:
                if exc.errno not in _CAPACITY_ERRNOS:
                    raise
                self._note_capacity(exc)
                if await self._shed(listener):
                    backoff = _ACCEPT_BACKOFF_S[0]
                else:
                    await trio.sleep(backoff)
                    backoff = min(2 * backoff, _ACCEPT_BACKOFF_S[1])
                continue
            if self._at_capacity:
                self._at_capacity = False
                _log.warning("accepting connections again; %d were refused for lack of descriptors",
                             self.num_refused_at_capacity)
            nursery.start_soon(self._handle, stream)

    def _note_capacity(self, exc: OSError) -> None:
        if not self._at_capacity:
            self._at_capacity = True
            _log.warning("cannot accept connections: %s (%d open); refusing new ones with "
                         "too_many_connections until descriptors are free", exc.strerror,
                         len(self.connections))

    def _take_reserve_fd(self) -> None:
        if self._reserve_fd is None:
            try:
                self._reserve_fd = os.open(os.devnull, os.O_RDONLY)
            except OSError:
                self._reserve_fd = None

    async def _shed(self, listener: trio.SocketListener) -> bool:
        """Out of descriptors: free the spare one, take waiting connections one by
        one and refuse each with `too_many_connections`, then take the spare back.
        False when none could be answered (then the caller backs off)."""
        if self._reserve_fd is None:
            self._take_reserve_fd()
            return False
        frame = pack_frame(encode(Error(
            ErrorCode.TOO_MANY_CONNECTIONS.value,
            f"the {self.kind} cannot take more connections now (out of file descriptors)",
            limit="max_connections", fatal=True)))
        raw = listener.socket._sock
        num_refused = 0
        for _ in range(_SHED_BATCH):
            os.close(self._reserve_fd)
            self._reserve_fd = None
            try:
                sock, _ = raw.accept()
            except OSError:
                break  # nobody is waiting, or another task took the descriptor
            num_refused += 1
            self.num_refused_at_capacity += 1
            self.metrics.on_connection_closed("too_many_connections")
            _refuse_now(sock, frame)
            self._take_reserve_fd()
            if self._reserve_fd is None:
                break
        self._take_reserve_fd()
        await trio.sleep(0)
        return num_refused > 0

    async def _handle(self, stream: trio.SocketStream) -> None:
        if self.draining:
            await refuse(stream, Error(ErrorCode.SHUTDOWN.value, f"the {self.kind} is shutting down",
                                       fatal=True))
            return
        limit = self.config.max_connections
        if len(self.connections) >= limit:
            self.metrics.on_connection_closed("too_many_connections")
            await refuse(stream, Error(ErrorCode.TOO_MANY_CONNECTIONS.value,
                                       f"the {self.kind} already has {limit} connections",
                                       limit="max_connections", fatal=True))
            return
        self._num_connections_opened += 1
        conn = self.make_connection(stream, self._num_connections_opened)
        await conn.run()

    # ---- the registry ------------------------------------------------------------
    def register(self, conn: Connection) -> None:
        """A connection opened."""
        self.connections[conn.conn_id] = conn
        self.metrics.on_connection(1)

    def unregister(self, conn: Connection) -> None:
        """A connection closed."""
        del self.connections[conn.conn_id]
        self.congested.discard(conn)
        self.metrics.on_connection(-1)
        self.metrics.on_connection_closed(conn.close_reason)
        if not self.connections:
            self._connections_gone.set()
        self._trim_heap()

    def _trim_heap(self) -> None:
        """Give freed heap pages back to the system: the frames of a connection
        that left are large and short-lived, and without this the allocator keeps
        their pages, so resident memory stays at its peak. At most once per
        _TRIM_INTERVAL_S; a trim skipped for that is done by the watchdog later."""
        if _malloc_trim is None:
            return
        now = trio.current_time()
        if now - self._last_trim_s >= _TRIM_INTERVAL_S:
            self._last_trim_s = now
            self._trim_pending = False
            _malloc_trim(0)
        else:
            self._trim_pending = True

    def check_congested(self) -> None:
        """Close every congested connection that holds more than `max_unsent_bytes`
        for its client (forgetting those no longer congested). The server calls it
        after every engine step, when a waiting stream's output grows; the watchdog
        calls it too."""
        for conn in list(self.congested):
            if conn.congested:
                conn.check_unsent()
            else:
                self.congested.discard(conn)

    async def wait_connections_gone(self) -> None:
        """Wait until no connection is open."""
        while self.connections:
            self._connections_gone = trio.Event()
            await self._connections_gone.wait()

    def check_token(self, token: str | None) -> bool:
        """Whether a Hello's token is acceptable (compared in constant time)."""
        expected = self.config.token
        return expected is None or tokens_match(token, expected)

    def authenticate(self, token: str | None) -> tuple[bool, KeyGrant | None]:
        """Whether a Hello's token is acceptable, and the grant it carries: with an
        API-key file (`api_keys`), the token must be one of its keys."""
        keys = getattr(self.config, "api_keys", None)
        if keys is None:
            return self.check_token(token), None
        grant = keys.grant_of(token)
        return grant is not None, grant

    # ---- slow clients ------------------------------------------------------------
    async def watch_sends(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Evict connections whose current write has made no progress for
        send_timeout_s (checked a few times per timeout, so one watchdog serves
        every connection and a write costs no timer of its own). It also does
        the heap trims that `unregister` put off."""
        timeout = self.config.send_timeout_s
        with trio.CancelScope() as scope:
            task_status.started(scope)
            while True:
                await trio.sleep(min(timeout / _WATCHDOG_CHECKS, _TRIM_INTERVAL_S))
                if self._trim_pending:
                    self._trim_heap()
                self.check_congested()
                now = trio.current_time()
                for conn in list(self.connections.values()):
                    started = conn.send_started_s
                    if started is not None and now - started >= timeout:
                        conn.evict_slow_consumer()


async def _unix_socket_answers(path: str) -> bool:
    try:
        stream = await trio.open_unix_socket(path)
    except OSError:
        return False
    await stream.aclose()
    return True


class Connection:
    """One client connection: handshake, frames in, streams, frames out.

    Subclasses implement `open_stream` (start a Generate that passed the
    shared checks), `abort_stream`, `answer_stats` and `answer_health`, and may
    add checks in `refuse_generate`.
    """

    def __init__(self, front: Front, stream: trio.SocketStream, conn_id: int) -> None:
        self.front = front
        self.config = front.config
        self.metrics = front.metrics
        self.stream = stream
        self.conn_id = conn_id
        self.streams: dict[int, StreamState] = {}
        self.num_protocol_errors = 0
        self.close_reason = "closed"
        self._final: Error | None = None
        self._outbox = Outbox(self.config.output_queue_frames, self.config.output_queue_bytes,
                              self._on_outbox_wait)
        # When the write in progress began (None: no write in progress); the
        # front's watchdog closes the connection if one lasts send_timeout_s.
        self.send_started_s: float | None = None
        self._scope: trio.CancelScope | None = None
        self._reader_scope = trio.CancelScope()
        self._receive_scope: trio.CancelScope | None = None
        self.streams_nursery: trio.Nursery | None = None
        self._greeted = False
        # What the Hello's API key grants (None: no API-key file, or not greeted yet).
        self.grant: KeyGrant | None = None
        # Deadlines count from the connection's start and from its last whole
        # frame, so trickling bytes cannot keep a connection alive.
        self._handshake_deadline = trio.current_time() + self.config.handshake_timeout_s
        self._idle_since = trio.current_time()
        # Reads pause until then after refused requests (`note_refusal`).
        self._read_after = 0.0
        self._frame_bytes = 0
        try:
            self.peer = str(stream.socket.getpeername()) or "unix"
        except OSError:
            self.peer = "?"

    # ---- what subclasses provide -------------------------------------------------
    def refuse_generate(self, message: Generate) -> Error | None:
        """An Error refusing `message` beyond the shared checks, or None."""
        return None

    async def open_stream(self, message: Generate) -> None:
        """Start the stream of a Generate that passed every check (`add_stream`)."""
        raise NotImplementedError

    async def abort_stream(self, state: StreamState) -> None:
        """The client asked to abort a live stream (`abort_requested` is set)."""
        raise NotImplementedError

    async def answer_stats(self, ref: int) -> None:
        """Answer a Stats query."""
        raise NotImplementedError

    async def answer_health(self, ref: int) -> None:
        """Answer a Health query."""
        raise NotImplementedError

    # ---- the connection task -----------------------------------------------------
    async def run(self) -> None:
        """Serve the connection until the peer leaves or it is closed."""
        front = self.front
        front.register(self)
        _log.debug("connection %d from %s", self.conn_id, self.peer)
        try:
            async with trio.open_nursery() as nursery:
                self._scope = nursery.cancel_scope
                nursery.start_soon(self._writer)
                async with trio.open_nursery() as streams:
                    self.streams_nursery = streams
                    with self._reader_scope:
                        await self._read_loop()
                    # Every stream ends its request as its task is cancelled.
                    streams.cancel_scope.cancel()
                if self._final is None:
                    nursery.cancel_scope.cancel()
                else:
                    self._outbox.put_nowait(pack_frame(encode(self._final)))
                    self._outbox.close()
        finally:
            self._outbox.clear()
            front.unregister(self)
            with trio.CancelScope(shield=True):
                if self._final is not None and self.close_reason != "slow_consumer":
                    with trio.move_on_after(LINGER_S):
                        await _linger_and_close(self.stream)
                await self.stream.aclose()
            _log.debug("connection %d closed: %s", self.conn_id, self.close_reason)

    def close(self, frame: Error, reason: str) -> None:
        """Close the connection after sending `frame` (its live streams are ended)."""
        if self._final is None:
            self._final = frame
            self.close_reason = reason
        self._reader_scope.cancel()

    def close_now(self, reason: str) -> None:
        """Close at once, sending nothing more (live streams are ended)."""
        self.close_reason = reason
        if self._scope is not None:
            self._scope.cancel()

    def close_if_idle(self) -> None:
        """During shutdown: close now if no stream is live."""
        if not self.streams:
            self.close(Error(ErrorCode.SHUTDOWN.value, f"the {self.front.kind} is shutting down",
                             fatal=True), "shutdown")

    def abort_for_shutdown(self) -> None:
        """The grace period is over: end every live stream with a shutdown error."""
        for state in self.streams.values():
            state.shutdown = True
            state.scope.cancel()
        self.close_if_idle()

    # ---- reading -----------------------------------------------------------------
    async def _read_loop(self) -> None:
        buffer = FrameBuffer(self.config.max_frame_bytes)
        # Whether the frame at the head of the buffer was looked at (`_skim`), and what
        # was dropped of it: (its text prompt's bytes, the frame's size as sent).
        skimmed, elided = False, None
        try:
            while True:
                if self._read_after > trio.current_time():
                    await trio.sleep_until(self._read_after)
                try:
                    frame = buffer.next_frame()
                except FrameTooLargeError as exc:
                    self.metrics.on_protocol_error(ErrorCode.FRAME_TOO_LARGE.value)
                    raise fatal(ErrorCode.FRAME_TOO_LARGE, str(exc), "frame_too_large",
                                "max_frame_bytes") from None
                if frame is not None:
                    skimmed, frame_elided, elided = False, elided, None
                    await self._on_frame(frame, frame_elided)
                    continue
                if not skimmed and self._greeted:
                    skimmed, elided = await self._skim(buffer)
                    if elided is not None:
                        continue
                data = await self._receive()
                if not data:
                    self._end_of_input(buffer.num_pending_bytes)
                    return
                buffer.feed(data)
        except Fatal as exc:
            self.close(exc.frame, exc.reason)
        except _Truncated:
            self._end_of_input(1)
        except _CLOSE_ERRORS as exc:
            self.close_reason = "reset"
            _log.debug("connection %d: %s", self.conn_id, exc)
        except Exception:  # a bug here must cost one connection, never the server
            _log.exception("connection %d: internal error", self.conn_id)
            self.close(Error(ErrorCode.INTERNAL.value, "internal server error", fatal=True), "internal")

    def _end_of_input(self, num_pending_bytes: int) -> None:
        if num_pending_bytes:
            self.metrics.on_protocol_error(ErrorCode.BAD_FRAME.value)
            self.close_reason = "truncated_frame"
        else:
            self.close_reason = "eof"

    async def _skim(self, buffer: FrameBuffer) -> tuple[bool, tuple[int, int] | None]:
        """Look at a large frame before it is buffered whole: a text prompt longer than
        any prompt can be is dropped as it arrives (the frame keeps an empty one, and
        `_on_generate` refuses it by the dropped length). Returns whether the frame was
        looked at (False: not enough of it yet) and, if its prompt was dropped, (the
        prompt's bytes, the frame's size)."""
        size = buffer.declared_size()
        limits = self.front.request_limits
        if size is None or size <= _SKIM_FRAME_BYTES or limits is None or limits.max_prompt_bytes is None:
            return size is not None, None
        if buffer.num_pending_bytes - HEADER_BYTES < min(size, _SKIM_PREFIX_BYTES):
            return False, None
        span = text_prompt_span(buffer.body_prefix(_SKIM_PREFIX_BYTES))
        if span is None:
            return True, None
        header_start, text_start, num_bytes = span
        if num_bytes <= limits.max_prompt_bytes:
            return True, None
        remaining = buffer.elide(header_start, text_start + num_bytes, EMPTY_STR)
        await self._discard(remaining)
        return True, (num_bytes, size)

    async def _discard(self, count: int) -> None:
        """Read and drop the next `count` bytes, in large reads into the shared scratch
        buffer: nothing is copied into a Python object."""
        scratch = self.front.scratch
        while count:
            received = await self._receive_into(scratch[:min(count, len(scratch))])
            if not received:
                raise _Truncated
            count -= received

    async def _receive(self) -> bytes:
        with self._receive_deadline() as scope:
            data = await self.stream.receive_some(READ_BYTES)
        self._receive_scope = None
        if scope.cancelled_caught:
            self._deadline_passed()
        return data

    async def _receive_into(self, view: memoryview) -> int:
        with self._receive_deadline() as scope:
            received = await self.stream.socket.recv_into(view, len(view))
        self._receive_scope = None
        if scope.cancelled_caught:
            self._deadline_passed()
        return received

    def _receive_deadline(self) -> trio.CancelScope:
        """The scope of one read, with the deadline that applies now."""
        config = self.config
        if not self._greeted:
            deadline = self._handshake_deadline
        elif self.streams or config.idle_timeout_s is None:
            deadline = math.inf
        else:
            deadline = self._idle_since + config.idle_timeout_s
        self._receive_scope = trio.CancelScope(deadline=deadline)
        return self._receive_scope

    def _deadline_passed(self) -> None:
        config = self.config
        if not self._greeted:
            raise fatal(ErrorCode.HANDSHAKE_TIMEOUT,
                        f"no Hello within {config.handshake_timeout_s} s", "handshake_timeout",
                        "handshake_timeout_s")
        raise fatal(ErrorCode.IDLE_TIMEOUT, f"idle for {config.idle_timeout_s} s", "idle_timeout",
                    "idle_timeout_s")

    def _idle_clock_restart(self) -> None:
        """The last stream ended: the idle timeout counts from now."""
        self._idle_since = now = trio.current_time()
        scope, idle = self._receive_scope, self.config.idle_timeout_s
        if scope is not None and idle is not None and not self.streams and self._greeted:
            scope.deadline = now + idle

    def note_refusal(self, num_bytes: int) -> None:
        """A request of `num_bytes` from this client was refused: read its next
        frames only after the time those bytes take at `refused_bytes_per_s`, so the
        cost of refusing is the client's, not the other clients'. Small refusals
        cost microseconds; a megabyte prompt a quarter second at the default."""
        rate = self.config.refused_bytes_per_s
        if rate is None:
            return
        self._read_after = max(self._read_after, trio.current_time()) + num_bytes / rate

    async def _on_frame(self, frame: bytes, elided: tuple[int, int] | None = None) -> None:
        """One whole frame; `elided`: (bytes of its text prompt, its size as sent) when
        `_skim` dropped the prompt."""
        self._idle_since = trio.current_time()
        self._frame_bytes = len(frame) if elided is None else elided[1]
        try:
            # Decoding checks every entry (a prompt's ids, 10^5 logit biases): a large
            # frame is decoded in a worker thread, so it does not hold up every stream.
            message = await self.front.run_sized(len(frame), decode_request, frame)
        except MessageError as exc:
            await self._on_bad_message(exc)
            return
        if not self._greeted:
            await self._handshake(message)
            return
        kind = type(message)
        if kind is Generate:
            await self._on_generate(message, None if elided is None else elided[0])
        elif kind is Abort:
            await self._on_abort(message)
        elif kind is StatsQuery:
            await self.answer_stats(message.ref)
        elif kind is HealthQuery:
            await self.answer_health(message.ref)
        else:
            await self._on_bad_message(MessageError("Hello was already received on this connection"))

    async def _on_bad_message(self, exc: MessageError) -> None:
        metrics = self.metrics
        if not self._greeted or exc.code is ErrorCode.UNSUPPORTED_VERSION:
            # A well-formed Generate with bad values, sent before Hello, is still not a Hello.
            code = ErrorCode.HANDSHAKE_REQUIRED if exc.code is ErrorCode.INVALID_REQUEST else exc.code
            metrics.on_protocol_error(code.value)
            raise Fatal(Error(code.value, str(exc), fatal=True), "protocol_error")
        # An Error naming a stream ends that stream for the client: a refused
        # Generate whose id is live elsewhere on the connection names none.
        stream = exc.stream if exc.stream not in self.streams else None
        if exc.code is ErrorCode.INVALID_REQUEST or stream is not None:
            # A refusal of one request: the client speaks the protocol, so it is
            # not counted against max_protocol_errors.
            metrics.on_rejected(exc.code.value)
            self.note_refusal(self._frame_bytes)
            await self.send(Error(exc.code.value, str(exc), stream=stream))
            return
        metrics.on_protocol_error(exc.code.value)
        self.num_protocol_errors += 1
        limit = self.config.max_protocol_errors
        if self.num_protocol_errors > limit:
            metrics.on_protocol_error(ErrorCode.TOO_MANY_PROTOCOL_ERRORS.value)
            raise fatal(ErrorCode.TOO_MANY_PROTOCOL_ERRORS,
                        f"more than {limit} malformed messages; last: {exc}", "protocol_error",
                        "max_protocol_errors")
        await self.send(Error(exc.code.value, str(exc), stream=None))

    async def _handshake(self, message) -> None:
        if type(message) is not Hello:
            self.metrics.on_protocol_error(ErrorCode.HANDSHAKE_REQUIRED.value)
            raise fatal(ErrorCode.HANDSHAKE_REQUIRED,
                        f"the first message must be Hello, got {message.TYPE}", "protocol_error")
        accepted, self.grant = self.front.authenticate(message.token)
        if not accepted:
            raise fatal(ErrorCode.UNAUTHORIZED, "missing or wrong token", "unauthorized")
        self._greeted = True
        if message.client:
            _log.debug("connection %d is %r", self.conn_id, message.client[:64])
        await self.send_frame(self.front.welcome_frame)

    # ---- requests ----------------------------------------------------------------
    async def _on_generate(self, message: Generate, dropped_prompt_bytes: int | None = None) -> None:
        sid = message.stream
        if self.front.draining:
            refusal = Error(ErrorCode.SHUTDOWN.value, f"the {self.front.kind} is shutting down",
                            stream=sid)
        elif sid in self.streams:
            # No stream id: an Error naming the live stream would read as its end.
            refusal = Error(ErrorCode.DUPLICATE_STREAM.value,
                            f"stream {sid} is already live on this connection; this Generate "
                            "was refused and the live stream goes on")
        elif len(self.streams) >= self.config.max_inflight_per_connection:
            refusal = Error(ErrorCode.TOO_MANY_REQUESTS.value,
                            f"this connection already has {len(self.streams)} live streams",
                            stream=sid, limit="max_inflight_per_connection")
        elif dropped_prompt_bytes is not None:
            refusal = self._refuse_prompt_bytes(message, dropped_prompt_bytes)
        else:
            try:
                message = self._identify(message)
                refusal = self.refuse_generate(message)
            except IdentityError as exc:
                refusal = Error(ErrorCode.INVALID_REQUEST.value, str(exc), stream=sid)
        if refusal is not None:
            self.metrics.on_rejected(refusal.code)
            self.note_refusal(self._frame_bytes)
            await self.send(refusal)
            return
        await self.open_stream(message)

    def _identify(self, message: Generate) -> Generate:
        """The Generate as the connection's API key allows it: its tenant narrowed to
        the key's, its priority no more urgent than the key's ceiling."""
        grant = self.grant
        if grant is None:
            return message
        return attrs.evolve(message, tenant=grant.tenant_of(message.tenant),
                            priority=grant.priority_of(message.priority))

    def _refuse_prompt_bytes(self, message: Generate, num_bytes: int) -> Error:
        """The refusal of a Generate whose text prompt of `num_bytes` was dropped unread
        for being longer than any prompt can be: the engine's own words for it."""
        max_tokens = message.params.max_tokens
        try:
            check_prompt_num_bytes(num_bytes, 1 if max_tokens is None else max_tokens,
                                   self.front.request_limits)
        except RequestTooLongError as exc:
            return Error(ErrorCode.REQUEST_TOO_LONG.value, str(exc), stream=message.stream)
        raise AssertionError(f"a dropped prompt of {num_bytes} bytes fits")  # max_prompt_bytes says not

    def add_stream(self, state: StreamState, run, *args) -> None:
        """Make `state` live and run `run(state, *args)` in the streams' nursery;
        `run` must end with `end_stream`."""
        state.frame_bytes = self._frame_bytes
        self.streams[state.stream] = state
        self.streams_nursery.start_soon(run, state, *args)

    def end_stream(self, state: StreamState, error: Error | None) -> None:
        """A stream task is over: forget it and send its ending Error, if any
        (past the outbox's bound: there is at most one per stream)."""
        del self.streams[state.stream]
        self.front.stream_finished(state)
        if error is not None:
            self._outbox.put_nowait(pack_frame(encode(error)))
        if self.front.draining:
            self.close_if_idle()
        else:
            self._idle_clock_restart()

    async def _on_abort(self, message: Abort) -> None:
        state = self.streams.get(message.stream)
        if state is None:
            await self.send(Error(ErrorCode.UNKNOWN_STREAM.value,
                                  f"no live stream {message.stream} on this connection",
                                  stream=message.stream))
            return
        state.abort_requested = True
        await self.abort_stream(state)

    # ---- writing -----------------------------------------------------------------
    async def send(self, message) -> None:
        """Queue a frame, waiting while the connection's outbox is full."""
        await self._outbox.put(pack_frame(encode(message)))

    async def send_frame(self, frame: bytes) -> None:
        """Queue an encoded frame, waiting while the outbox is full."""
        await self._outbox.put(frame)

    # ---- clients that do not read ------------------------------------------------
    @property
    def congested(self) -> bool:
        """Whether some stream waits for room in the outbox."""
        return self._outbox.congested

    def _on_outbox_wait(self) -> None:
        self.front.congested.add(self)
        self.check_unsent()

    def unsent_bytes(self) -> int:
        """What is held for this client that the kernel has not taken: the outbox
        (with the write under way), the frames waiting for room in it, and the output
        its streams' sources hold back meanwhile (`pending_output_bytes`)."""
        outbox = self._outbox
        return outbox.num_bytes + outbox.num_waiting_bytes + self.pending_output_bytes()

    def pending_output_bytes(self) -> int:
        """Wire bytes (an estimate) of the output this connection's streams have not
        taken from where it is made; subclasses that can see it say."""
        return 0

    def check_unsent(self) -> None:
        """Close the connection at once if it holds more than `max_unsent_bytes`."""
        limit = self.config.max_unsent_bytes
        if limit is None or self.close_reason == "overflow":
            return
        unsent = self.unsent_bytes()
        if unsent > limit:
            _log.warning("connection %d from %s: %d bytes wait for a client that is not reading "
                         "(max_unsent_bytes=%d); closing it and aborting its %d requests",
                         self.conn_id, self.peer, unsent, limit, len(self.streams))
            self._outbox.clear()
            self.close_now("overflow")

    def evict_slow_consumer(self) -> None:
        """The client has not taken a frame for send_timeout_s: close the connection
        (no Error frame can get through a full socket)."""
        _log.info("connection %d: client not reading for %.1f s; closing", self.conn_id,
                  self.config.send_timeout_s)
        self._outbox.clear()
        self.close_now("slow_consumer")

    async def _writer(self) -> None:
        outbox = self._outbox
        try:
            while (batch := await outbox.take()) is not None:
                frames, num_counted, num_bytes = batch
                self.send_started_s = trio.current_time()
                await self.stream.send_all(frames[0] if len(frames) == 1 else b"".join(frames))
                self.send_started_s = None
                outbox.release(num_counted, num_bytes)
        except _CLOSE_ERRORS as exc:
            _log.debug("connection %d: write failed: %s", self.conn_id, exc)
            self.close_now("reset")
