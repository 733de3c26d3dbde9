"""The OpenAI-compatible HTTP API, served from the same engine as the msgpack protocol.

    POST /v1/completions, POST /v1/chat/completions   (JSON, or server-sent events)
    POST /v1/responses                                 (stateless; responses_api.py)
    POST /tokenize, /detokenize                        (vLLM's shapes)
    GET /v1/models, /v1/models/{id}, /health, /metrics, /version   (and HEAD)
    OPTIONS (CORS preflight for --allowed-origins)

`cadence serve` runs it beside the msgpack listener (`--http-port`, default
8000). It is an `HttpServer` bound to the msgpack `Server`: the same engine,
the same in-flight and per-tenant counts and limits, the same drain, the
same Prometheus registry and the same error classification; only the framing
differs. HTTP/1.1 is spoken with h11, a sans-IO protocol library, so every
byte moves in this Trio run: a request's stream is an engine `RequestStream`
iterated by the connection's own task, and a client that goes away cancels
that task at once, which aborts the request and frees its blocks before the
scheduler plans its next step.

The door holds under slow and abusive clients: connections per peer address
are capped, a request head must arrive within a deadline and a body at a
minimum rate, and at the connection limit a connection that has not sent a
request head yet is closed to make room for a newcomer. A body is checked as
it arrives (its size, its chunks' sizes, a chat's message count), parsed a
slice of h11 events per event-loop turn, and its JSON checked for depth and
lone surrogates before any field is read; each refusal is one WARNING line and
a 400 in OpenAI's shape. Credentials are checked here too: one well-formed
`Authorization: Bearer` header, and with an API-key file (identity.py) the key
names the request's tenant.

Request translation (`openai_api.py`) is kept apart from the transport here.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import time
from collections import Counter
import urllib.parse
from http import HTTPStatus
from importlib import metadata
from typing import Callable

import attrs
import h11
import trio

from cadence.statemachine.errors import CadenceError, ConfigError, PoisonRequestError, StructuredOutputError

from ..chat import MAX_MESSAGES
from ..detokenizer import token_text_function
from ..wire import ErrorCode
from .openai_api import (
    POISON_STATUS, ApiError, ApiRequest, Choice, ChunkEncoder, completion_body, detokenize,
    http_structured_message, parse_request, status_of, tokenize, usage_of,
)
from .responses_api import RESPONSES_PATH, ResponseWriter, chat_body, renamed
from .connection import _CAPACITY_ERRNOS, _linger_and_close, positive
from .identity import TOKEN68, IdentityError, KeyGrant
from .tools import DEFAULT_TOOL_CALL_PARSER, TOOL_CALL_PARSERS
from .server import Server, _engine_error_code, _StreamState, read_secret_file, tokens_match

__all__ = ["DEFAULT_HTTP_PORT", "HttpConfig", "HttpServer", "serve_http", "add_http_arguments",
           "http_config_from_args"]

_log = logging.getLogger("cadence.http")
_access_log = logging.getLogger("cadence.http.access")

DEFAULT_HTTP_PORT = 8000
# Largest request head (request line and headers) and body accepted.
MAX_HEAD_BYTES = 16 * 1024
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
_READ_BYTES = 1 << 16
# Most HTTP connections one peer address may hold open (see HttpConfig).
DEFAULT_MAX_CONNECTIONS_PER_PEER = 64
# Seconds a request head (request line and headers) may take to arrive whole.
DEFAULT_HEAD_TIMEOUT_S = 10.0
# The slowest a request body may arrive on average, after the head's grace.
DEFAULT_MIN_BODY_BYTES_PER_S = 8192.0
# h11 events handled in a row before the connection yields to the others: a body of
# a hundred thousand one-byte chunks is parsed a slice at a time.
_EVENTS_PER_TURN = 64
# Each piece of a body (a chunk, or what one read brought) costs the same to parse
# whatever its size: past this many, they must average _MIN_PIECE_BYTES, so a body
# of 10^5 one-byte chunks is refused after a few milliseconds of parsing.
_FREE_BODY_PIECES = 4096
_MIN_PIECE_BYTES = 64
# Deepest nesting of arrays and objects a request body may have.
MAX_JSON_DEPTH = 64
# Peers whose pause after refusals is remembered before the lapsed ones are dropped.
_MAX_PAUSED_PEERS = 4096
# How long a connection refused at once may hold its descriptor while its answer goes
# out: short, so a flood of connections past a peer's cap cannot run the process out
# of descriptors (what it sent by then, a request head, is read first).
_REFUSAL_LINGER_S = 0.1
# Pause after accept() fails for lack of descriptors (they free as connections close).
_ACCEPT_RETRY_S = 0.1
# Bytes a client may send while its response streams (a pipelined next
# request is kept for later); past this the connection is closed.
_MAX_PIPELINED_BYTES = 1 << 20
_SSE_DONE = b"data: [DONE]\n\n"
# How many times per send_timeout_s the watchdog looks for stalled writes.
_WATCHDOG_CHECKS = 4
_JSON = [(b"content-type", b"application/json")]
_EVENT_STREAM = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
# Each generation path, and the field holding its conversation (None: a prompt).
_GENERATION_PATHS = {"/v1/completions": None, "/v1/chat/completions": "messages",
                     RESPONSES_PATH: "input"}
_TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize"})
_ALLOWED_METHODS = b"GET, HEAD, POST, OPTIONS"
# How long a browser may keep a CORS preflight's answer.
CORS_MAX_AGE_S = 600
# Health statuses of a server that takes no requests (GET /health answers 503).
_NOT_SERVING = frozenset({"draining", "closed"})


def _port(instance, attribute, value) -> None:
    if not 0 <= value <= 65535:
        raise ConfigError(f"{attribute.name} must be in [0, 65535], got {value!r}")


def _positive(instance, attribute, value) -> None:
    if not value > 0:
        raise ConfigError(f"{attribute.name} must be > 0, got {value!r}")


def _tool_call_parser(instance, attribute, value) -> None:
    if value not in TOOL_CALL_PARSERS:
        raise ConfigError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {value!r}")


@attrs.frozen
class HttpConfig:
    """Where the HTTP API listens and what it asks of clients.

    host, port: TCP address (port 0: any free port).
    api_key: the Bearer token every /v1/ request must carry (None: no auth, or
      the server's `api_keys`, whose keys then name each request's tenant).
    max_body_bytes: largest request body (a larger one is answered 413).
    served_model_name: the model id clients name (default: the engine's model).
    max_connections_per_peer: open connections one peer address may hold; more
      are answered 429 at once (None: no cap; behind a reverse proxy every client
      is the proxy's address).
    head_timeout_s: a request head must arrive whole this long after the
      connection opens (or, kept alive, after the request's first byte).
    min_body_bytes_per_s: after `head_timeout_s` of grace from the head, the body
      must keep arriving at least this fast on average.
    metrics_public: /metrics answers without the API key.
    tool_call_parser: how tool calls are read out of an "auto" answer: "tags"
      (JSON in <tool_call> tags) or "json" (the answer is the call); see tools.py.
    allowed_origins: origins whose browser pages may call the API (CORS; "*" any).
    strict_fields: refuse a request field this server does not know (400 naming
      it) instead of ignoring it and logging its name once.
    A peer whose requests are refused (4xx) has its next ones read only after the
    time their bytes take at the server's `refused_bytes_per_s`.
    The other connection limits are the msgpack server's: its `max_connections`
    (at the limit, a connection that has not sent a whole request head yet, from
    the peer holding the most, is closed to make room), `idle_timeout_s` (between
    requests on a kept-alive connection) and `send_timeout_s` (a write that makes
    no progress).
    """

    host: str = "127.0.0.1"
    port: int = attrs.field(default=DEFAULT_HTTP_PORT, validator=_port)
    api_key: str | None = attrs.field(default=None, repr=False)
    max_body_bytes: int = attrs.field(default=DEFAULT_MAX_BODY_BYTES, validator=_positive)
    served_model_name: str | None = None
    max_connections_per_peer: int | None = attrs.field(default=DEFAULT_MAX_CONNECTIONS_PER_PEER,
                                                       validator=positive)
    head_timeout_s: float = attrs.field(default=DEFAULT_HEAD_TIMEOUT_S, validator=_positive)
    min_body_bytes_per_s: float = attrs.field(default=DEFAULT_MIN_BODY_BYTES_PER_S,
                                              validator=_positive)
    metrics_public: bool = False
    strict_fields: bool = False
    allowed_origins: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    tool_call_parser: str = attrs.field(default=DEFAULT_TOOL_CALL_PARSER, validator=_tool_call_parser)

    def __attrs_post_init__(self) -> None:
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key must not be empty (use None for no authentication)")


def _version() -> str:
    try:
        return metadata.version("cadence")
    except metadata.PackageNotFoundError:
        return "unknown"


class _ClientGone(Exception):
    """The client closed its connection or stopped reading."""


class _Exchange:
    """One HTTP connection: h11 state, and the only writer of its socket."""

    def __init__(self, stream: trio.SocketStream, peer: str) -> None:
        self.stream = stream
        self.peer = peer
        self.opened_s = self.head_since_s = trio.current_time()
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        # When the write in progress began (None: none); the server's watchdog
        # cancels `scope`, closing the connection, if one lasts send_timeout_s.
        self.send_started_s: float | None = None
        self.scope = trio.CancelScope()
        # Whole request heads received, and whether it waits for the next one: such a
        # connection may be closed to make room for another (see HttpServer._make_room).
        self.num_heads = 0
        self.awaiting_head = True
        # Whether it still counts against the connection limits (False once evicted).
        self.counted = True
        # Called with the size of each read while a request arrives (moves its deadline).
        self.on_bytes: Callable[[int], None] | None = None
        self._num_events = 0
        # The response in progress answers HEAD (its head only) and carries these
        # headers too (CORS).
        self.head_only = False
        self.response_headers: list = []
        self.status: int | None = None  # of the response in progress, once its head is sent

    async def next_event(self):
        """The next h11 event, reading from the socket as needed; after every
        _EVENTS_PER_TURN events it yields, so a body of tiny chunks cannot hold the
        event loop."""
        self._num_events += 1
        if self._num_events % _EVENTS_PER_TURN == 0:
            await trio.lowlevel.checkpoint()
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = await self.stream.receive_some(_READ_BYTES)
            if self.on_bytes is not None and data:
                self.on_bytes(len(data))
            self.conn.receive_data(data)

    async def send(self, *events) -> None:
        """Write h11 events; raises _ClientGone if the client is gone."""
        await self.send_bytes(b"".join(self.conn.send(event) for event in map(self._finish, events)
                                       if event is not None))

    def _finish(self, event):
        """A response head with the exchange's extra headers; no body for HEAD."""
        if isinstance(event, h11.Response):
            self.status = event.status_code
        if isinstance(event, h11.Response) and self.response_headers:
            return h11.Response(status_code=event.status_code, reason=event.reason,
                                headers=[*event.headers, *self.response_headers])
        if self.head_only and isinstance(event, h11.Data):
            return None
        return event

    async def send_bytes(self, data: bytes) -> None:
        """Write bytes already framed; raises _ClientGone if the client is gone."""
        self.send_started_s = trio.current_time()
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            raise _ClientGone() from None
        finally:
            self.send_started_s = None

    def body_frame(self, data: bytes) -> bytes:
        """Body bytes of a streamed response, framed as h11 frames them: chunked for
        an HTTP/1.1 peer, raw (close-delimited) for HTTP/1.0. Framing events on the
        hot path here rather than through h11 halves their cost; h11 still writes
        the head and the end of the message, so its state stays right."""
        if self.conn.their_http_version == b"1.0":
            return data
        return b"%x\r\n%b\r\n" % (len(data), data)

    async def send_json(self, status: int, body: object, headers: list | None = None) -> None:
        """A whole JSON response."""
        payload = json.dumps(body, separators=(",", ":")).encode("utf-8")
        head = [*_JSON, (b"content-length", str(len(payload)).encode()), *(headers or ())]
        await self.send(_response(status, head), h11.Data(data=payload),
                        h11.EndOfMessage())

    async def send_error(self, error: ApiError, close: bool = False) -> None:
        """An error in OpenAI's JSON shape."""
        headers = [(b"connection", b"close")] if close else []
        if error.status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await self.send_json(error.status, error.body(), headers)

    async def watch_for_disconnect(self, cancel_scope: trio.CancelScope) -> None:
        """While a response is produced: cancel it as soon as the client closes."""
        received = 0
        while True:
            try:
                data = await self.stream.receive_some(_READ_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                data = b""
            if not data:
                cancel_scope.cancel()
                return
            received += len(data)
            if received > _MAX_PIPELINED_BYTES:
                cancel_scope.cancel()
                return
            self.conn.receive_data(data)  # a pipelined request, parsed after this one


class HttpServer:
    """Serves the OpenAI HTTP API for a msgpack `Server`'s engine; see the module docstring."""

    def __init__(self, server: Server, config: HttpConfig | None = None) -> None:
        self.server = server
        self.engine = server.engine
        self.config = config if config is not None else HttpConfig()
        self.model_name = self.config.served_model_name or self.engine.config.model
        self.api_keys = server.config.api_keys
        if self.api_keys is not None and self.config.api_key is not None:
            raise ConfigError("give the HTTP API an API key or the server an API-key file, not both")
        self.address: tuple[str, int] | None = None
        self.exchanges: set[_Exchange] = set()
        self.peer_connections: Counter[str] = Counter()
        # Connections that have not sent a request head yet, by peer, oldest first.
        self._never_headed: dict[str, dict[_Exchange, None]] = {}
        # Until when each peer's requests wait after refusals (see `_note_refusal`).
        self.peer_read_after: dict[str, float] = {}
        self.num_evicted = 0
        self.live: dict[str, Choice] = {}  # by request id, from admission to release
        self._none_live = trio.Event()  # set when `live` empties (see wait_released)
        self.chat = server.chat
        self.token_text = token_text_function(self.engine.tokenizer)
        self.ignored_fields: set[str] = set()  # unknown request fields already logged
        self._num_requests = 0
        self._created = int(time.time())

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen and serve until cancelled; `nursery.start` returns this server once
        it listens (its `address` set)."""
        config = self.config
        backlog = min(65535, max(128, self.server.config.max_connections))
        listeners = await trio.open_tcp_listeners(config.port, host=config.host, backlog=backlog)
        self.address = tuple(listeners[0].socket.getsockname()[:2])
        if (config.host not in ("127.0.0.1", "::1", "localhost") and config.api_key is None
                and self.api_keys is None):
            _log.warning("HTTP API on %s without an API key: anyone who can reach it may use "
                         "the engine", config.host)
        task_status.started(self)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_sends)
            for listener in listeners:
                nursery.start_soon(self._accept, listener, nursery)

    async def _accept(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        async with listener:
            while True:
                try:
                    stream = await listener.accept()
                except OSError as exc:
                    if exc.errno not in _CAPACITY_ERRNOS:
                        raise
                    _log.warning("cannot accept HTTP connections: %s (%d open)", exc.strerror,
                                 len(self.exchanges))
                    await trio.sleep(_ACCEPT_RETRY_S)
                    continue
                nursery.start_soon(self._handle, stream)

    async def _watch_sends(self) -> None:
        """Close connections whose current write has made no progress for
        send_timeout_s (the client is not reading); one watchdog for them all."""
        timeout = self.server.config.send_timeout_s
        while True:
            await trio.sleep(timeout / _WATCHDOG_CHECKS)
            now = trio.current_time()
            for exchange in list(self.exchanges):
                started = exchange.send_started_s
                if started is not None and now - started >= timeout:
                    _log.info("HTTP client not reading for %.1f s; closing", timeout)
                    exchange.scope.cancel()

    # ---- a connection ------------------------------------------------------------
    async def _handle(self, stream: trio.SocketStream) -> None:
        peer = _peer_of(stream)
        refusal = self._make_room(peer)
        if refusal is not None:
            self._reject(refusal.code)
            await _refuse(stream, refusal)
            return
        exchange = _Exchange(stream, peer)
        self.exchanges.add(exchange)
        self.peer_connections[peer] += 1
        self._never_headed.setdefault(peer, {})[exchange] = None
        try:
            with exchange.scope:
                await self._serve_connection(exchange)
        except (_ClientGone, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        except Exception:  # a bug here must cost one connection, never the server
            _log.exception("HTTP connection failed")
        finally:
            self._forget(exchange)
            with trio.CancelScope(shield=True):
                await stream.aclose()

    def _forget(self, exchange: _Exchange) -> None:
        """Take a connection out of the counts (once, whether it ended or was evicted)."""
        if not exchange.counted:
            return
        exchange.counted = False
        self.exchanges.discard(exchange)
        self._headed(exchange)
        peers = self.peer_connections
        peers[exchange.peer] -= 1
        if peers[exchange.peer] <= 0:
            del peers[exchange.peer]

    def _make_room(self, peer: str) -> ApiError | None:
        """Admit a new connection from `peer`, or say why not. A peer holds at most
        max_connections_per_peer; at max_connections, the oldest connection that has
        not sent a whole request head yet, of the peer holding the most connections,
        is closed to make room, so slow clients cannot keep new peers out."""
        per_peer = self.config.max_connections_per_peer
        held = self.peer_connections[peer]
        if per_peer is not None and held >= per_peer:
            return ApiError(429, f"this address already has {held} HTTP connections; "
                                 f"max_connections_per_peer is {per_peer}", code="too_many_connections")
        limit = self.server.config.max_connections
        if len(self.exchanges) < limit:
            return None
        victim = self._eviction_victim()
        if victim is None:
            return ApiError(503, f"the server already has {limit} HTTP connections, each "
                                 "with a request under way", code="too_many_connections")
        _log.info("HTTP connections at the limit (%d): closing one from %s waiting for a request "
                  "head (%d requests in %.1f s)", limit, victim.peer, victim.num_heads,
                  trio.current_time() - victim.opened_s)
        self._forget(victim)
        victim.scope.cancel()
        self.num_evicted += 1
        return None

    def _eviction_victim(self) -> _Exchange | None:
        """The connection to close for a newcomer: one waiting for a request head, those
        that never sent one first, then of the peer holding the most, the oldest. The
        ones that never sent one are kept by peer in the order they came, so the common
        case costs a look at each peer, not at each connection."""
        peers = self.peer_connections
        fresh = self._never_headed
        if fresh:
            peer = max(fresh, key=peers.__getitem__)
            return next(iter(fresh[peer]))
        waiting = [e for e in self.exchanges if e.awaiting_head]
        if not waiting:
            return None
        return max(waiting, key=lambda e: (peers[e.peer], -e.opened_s))

    def _headed(self, exchange: _Exchange) -> None:
        """A connection sent its first request head (or left): no longer a fresh one."""
        by_peer = self._never_headed.get(exchange.peer)
        if by_peer is not None and by_peer.pop(exchange, False) is None and not by_peer:
            del self._never_headed[exchange.peer]

    async def _serve_connection(self, exchange: _Exchange) -> None:
        while True:
            request = None
            await self._wait_turn(exchange)
            try:
                request = await self._receive_request(exchange)
            except h11.RemoteProtocolError as exc:
                if exchange.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    await exchange.send_error(ApiError(exc.error_status_hint, f"bad HTTP request: {exc}"),
                                              close=True)
                return
            if request is None:  # timed out, closed, or answered 413
                return
            await self._respond(exchange, *request)
            if not self._next_cycle(exchange):
                return

    async def _receive_request(self, exchange: _Exchange):
        """The next request of a connection (see `_read_request`), under its deadlines:
        the head whole within head_timeout_s (of the connection's start, or of the
        first byte after a kept-alive idle wait), then the body at min_body_bytes_per_s
        after as much grace again; None when a deadline passes or the peer leaves."""
        config = self.config
        now = trio.current_time()
        idle = exchange.num_heads > 0 and not exchange.conn.trailing_data[0]
        if idle:
            deadline = now + (self.server.config.idle_timeout_s or math.inf)
        else:
            deadline = (now if exchange.num_heads else exchange.head_since_s) + config.head_timeout_s
        exchange.awaiting_head = True
        with trio.CancelScope(deadline=deadline) as scope:

            def on_head_bytes(num_bytes: int) -> None:
                nonlocal idle
                if idle:
                    idle = False
                    scope.deadline = trio.current_time() + config.head_timeout_s

            exchange.on_bytes = on_head_bytes
            try:
                event = await exchange.next_event()
                exchange.awaiting_head = False
                if not isinstance(event, h11.Request):
                    return None
                if not exchange.num_heads:
                    self._headed(exchange)
                exchange.num_heads += 1
                body_start = trio.current_time()
                scope.deadline = body_start + config.head_timeout_s
                received = 0

                def on_body_bytes(num_bytes: int) -> None:
                    nonlocal received
                    received += num_bytes
                    scope.deadline = (body_start + config.head_timeout_s
                                      + received / config.min_body_bytes_per_s)

                exchange.on_bytes = on_body_bytes
                return await self._read_request(exchange, event)
            finally:
                exchange.on_bytes = None
                exchange.awaiting_head = False
        _log.info("HTTP client %s too slow sending its request; closing", exchange.peer)
        return None

    def _next_cycle(self, exchange: _Exchange) -> bool:
        conn = exchange.conn
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
            return True
        return False

    async def _read_request(self, exchange: _Exchange, request: h11.Request):
        """The method, path, headers (by lower-case name), the values of its Authorization
        headers, and its body;
        None after refusing the body as it arrives (see `_BodyCheck`: 413 or 400, and
        the connection closes)."""
        headers = {name.lower(): value for name, value in request.headers}
        path = request.target.split(b"?", 1)[0].decode("ascii", "replace")
        check = _BodyCheck(self.config.max_body_bytes, conversation=_GENERATION_PATHS.get(path))
        declared = headers.get(b"content-length")
        error = None if declared is None else check.declared(int(declared))
        body = bytearray()
        while error is None:
            event = await exchange.next_event()
            if isinstance(event, h11.EndOfMessage):
                break
            if isinstance(event, h11.Data):
                body += event.data
                error = check.add(event.data)
        if error is not None:
            if error.status == 400:
                _log.warning("HTTP client %s: %s; closing", exchange.peer, error.message[:200])
                self._note_refusal(exchange.peer, check.num_bytes)
            await exchange.send_error(error, close=True)
            # What the client still sends is read and dropped for a moment, so the close
            # does not reset the connection and destroy the answer before it is read.
            await _linger_and_close(exchange.stream)
            return None
        authorization = [value for name, value in request.headers if name == b"authorization"]
        return request.method.decode("ascii", "replace"), path, headers, authorization, bytes(body)

    async def _respond(self, exchange: _Exchange, method: str, path: str, headers: dict,
                       authorization: list[bytes], body: bytes) -> None:
        started_s = trio.current_time()
        exchange.status = None
        try:
            await self._route(exchange, method, path, headers, authorization, body)
        finally:
            # One line per request (logger cadence.http.access): what, its answer, how long.
            _access_log.info("%s %s %s %.3f s", method, path[:200], exchange.status or "-",
                             trio.current_time() - started_s)

    async def _route(self, exchange: _Exchange, method: str, path: str, headers: dict,
                     authorization: list[bytes], body: bytes) -> None:
        exchange.head_only = method == "HEAD"
        exchange.response_headers = self._cors_headers(headers)
        if method == "HEAD":
            method = "GET"  # answered as GET, without the body
        try:
            if method == "OPTIONS":
                await self._preflight(exchange, headers)
                return
            grant = None
            if (path.startswith("/v1/") or path in _TOKENIZER_PATHS
                    or (path == "/metrics" and not self.config.metrics_public)):
                grant = self._authenticate(authorization)
            if path in _GENERATION_PATHS:
                _allow(method, "POST")
                await self._generate(exchange, body, path, grant)
            elif path.startswith(RESPONSES_PATH + "/"):
                raise ApiError(404, "this server stores no responses (each is answered and "
                                    "forgotten): there is none to read or cancel", code="not_found")
            elif path.startswith("/v1/models/"):
                _allow(method, "GET")
                await exchange.send_json(200, self._model(path[len("/v1/models/"):]))
            elif path in _TOKENIZER_PATHS:
                _allow(method, "POST")
                await self._tokenizer_route(exchange, path, body)
            elif path in _GET_ROUTES:
                _allow(method, "GET")
                await _GET_ROUTES[path](self, exchange)
            else:
                raise ApiError(404, f"no route {path}", code="not_found")
        except ApiError as error:
            if 400 <= error.status < 500:
                self._note_refusal(exchange.peer, len(body))
            if exchange.conn.our_state is h11.SEND_RESPONSE:
                await exchange.send_error(error)

    def _note_refusal(self, peer: str, num_bytes: int) -> None:
        """A request of `num_bytes` from `peer` was refused: its next requests, on any
        of its connections, are read only after the time those bytes take at the
        server's `refused_bytes_per_s`, so what refusing costs is the peer's, not the
        other clients' (as the msgpack server does per connection)."""
        rate = self.server.config.refused_bytes_per_s
        if rate is None or not num_bytes:
            return
        now = trio.current_time()
        pauses = self.peer_read_after
        if len(pauses) >= _MAX_PAUSED_PEERS:
            for other in [p for p, until in pauses.items() if until <= now]:
                del pauses[other]
        pauses[peer] = max(pauses.get(peer, now), now) + num_bytes / rate

    async def _wait_turn(self, exchange: _Exchange) -> None:
        """Before reading a request: wait out its peer's pause after refusals; its
        head deadline then counts from the end of the wait."""
        until = self.peer_read_after.get(exchange.peer)
        if until is not None and until > trio.current_time():
            await trio.sleep_until(until)
            exchange.head_since_s = max(exchange.head_since_s, until)

    def _authenticate(self, authorization: list[bytes]) -> KeyGrant | None:
        """Check a request's credentials: exactly one `Authorization: Bearer KEY` header,
        well formed, with the API key (or one of the API-key file's, whose grant is
        returned); 401 otherwise."""
        expected, keys = self.config.api_key, self.api_keys
        if expected is None and keys is None:
            return None
        if len(authorization) != 1:
            raise ApiError(401, "missing API key (send Authorization: Bearer KEY)" if not authorization
                           else f"{len(authorization)} Authorization headers; send exactly one",
                           code="invalid_api_key")
        match = _BEARER.fullmatch(authorization[0])
        if match is None:
            raise ApiError(401, "malformed Authorization header (send Authorization: Bearer KEY)",
                           code="invalid_api_key")
        token = match.group(1).decode("ascii")
        grant = keys.grant_of(token) if keys is not None else None
        if grant is None and (expected is None or not tokens_match(token, expected)):
            raise ApiError(401, "wrong API key", code="invalid_api_key")
        return grant

    def _cors_headers(self, headers: dict) -> list:
        """The CORS headers of a response to a request from an allowed origin."""
        origin = headers.get(b"origin")
        allowed = self.config.allowed_origins
        if origin is None or not allowed:
            return []
        if "*" in allowed:
            return [(b"access-control-allow-origin", b"*")]
        if origin.decode("latin-1") in allowed:
            return [(b"access-control-allow-origin", origin), (b"vary", b"origin")]
        return []

    async def _preflight(self, exchange: _Exchange, headers: dict) -> None:
        """OPTIONS: the methods this server takes, and for an allowed origin's CORS
        preflight the methods and headers it may send (no key needed, as browsers
        send none with a preflight)."""
        extra = [(b"allow", _ALLOWED_METHODS)]
        if exchange.response_headers:
            requested = headers.get(b"access-control-request-headers", b"authorization, content-type")
            extra += [(b"access-control-allow-methods", _ALLOWED_METHODS),
                      (b"access-control-allow-headers", requested),
                      (b"access-control-max-age", str(CORS_MAX_AGE_S).encode())]
        await exchange.send(_response(204, extra), h11.EndOfMessage())

    # ---- small endpoints ---------------------------------------------------------
    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self._created, "owned_by": "cadence",
                "root": self.engine.config.model, "max_model_len": self.engine.core.config.max_model_len,
                "vocab_size": self.engine.vocab_size}

    def _models(self) -> dict:
        return {"object": "list", "data": [self._model_card()]}

    def _model(self, model_id: str) -> dict:
        """GET /v1/models/{id}: the served model's card, or 404."""
        model_id = urllib.parse.unquote(model_id)
        if model_id != self.model_name:
            raise ApiError(404, f"the model {model_id[:200]!r} does not exist; this server serves "
                                f"{self.model_name!r}", param="model", code="model_not_found")
        return self._model_card()

    async def _tokenizer_route(self, exchange: _Exchange, path: str, body: bytes) -> None:
        """POST /tokenize (a prompt or a chat's messages to token ids) and /detokenize
        (token ids to text), in vLLM's shapes."""
        payload = await self._json_body(body)
        if path == "/tokenize":
            answer = await tokenize(payload, self)
        else:
            answer = detokenize(payload, self)
        await exchange.send_json(200, answer)

    async def _json_body(self, body: bytes) -> object:
        """A request body's JSON, checked before any field is read (see `decode_body`)."""
        return await self.server.run_sized(len(body), decode_body, body)

    async def _list_models(self, exchange: _Exchange) -> None:
        await exchange.send_json(200, self._models())

    async def _version_route(self, exchange: _Exchange) -> None:
        await exchange.send_json(200, {"version": _version()})

    async def _health(self, exchange: _Exchange) -> None:
        reply = self.server.health(0)
        body = {"status": reply.status, "num_running": reply.num_running,
                "num_waiting": reply.num_waiting, "kv_usage": reply.kv_usage,
                "num_connections": reply.num_connections + len(self.exchanges)}
        # As the msgpack Health: "degraded" still takes requests (they wait for the
        # restart), so only a server that takes none answers 503.
        await exchange.send_json(503 if reply.status in _NOT_SERVING else 200, body)

    async def _metrics(self, exchange: _Exchange) -> None:
        exposition = getattr(self.server.metrics, "exposition", None)
        if exposition is None:
            raise ApiError(404, "metrics are off on this server", code="not_found")
        payload = exposition()
        await exchange.send(
            _response(200, [
                (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
                (b"content-length", str(len(payload)).encode())]),
            h11.Data(data=payload), h11.EndOfMessage())

    # ---- generation --------------------------------------------------------------
    async def _generate(self, exchange: _Exchange, body: bytes, path: str,
                        grant: KeyGrant | None) -> None:
        """A completion, chat or response: parsed, admitted, run and answered."""
        payload = writer = None
        try:
            try:
                payload = await self._json_body(body)
                if path == RESPONSES_PATH:
                    # Its items are checked one by one: a large body's in a worker thread.
                    chat = await self.server.run_sized(len(body), chat_body, payload, self)
                    request = await parse_request(chat, True, self)
                    writer = ResponseWriter(payload, request)
                else:
                    request = await parse_request(payload, path != "/v1/completions", self)
            except ApiError as exc:
                if exc.status == 400:
                    _log.warning("HTTP client %s: %s", exchange.peer, exc.message[:200])
                raise
            await self._answer(exchange, request, writer, grant)
        except ApiError as exc:
            # A response's errors name its own fields (input, max_output_tokens, ...).
            raise renamed(exc, payload) if path == RESPONSES_PATH else exc

    async def _answer(self, exchange: _Exchange, request: ApiRequest, writer: ResponseWriter | None,
                      grant: KeyGrant | None) -> None:
        choices = self._admit(_narrowed(request, grant), grant)
        # Cancelled when the client goes away: every choice's stream is then
        # abandoned mid-iteration, which aborts its request. What ends the answer
        # is raised after the nursery, never through it (no exception group).
        ending: ApiError | _ClientGone | None = None
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(exchange.watch_for_disconnect, scope)
                try:
                    await self._start(request, choices)
                    if request.stream and writer is not None:
                        await self._stream_response(exchange, request, choices[0], writer, scope)
                    elif request.stream:
                        await self._stream(exchange, request, choices, scope)
                    else:
                        await self._run_choices(request, choices, None)
                        _raise_first_error(choices, self.server.draining)
                        body = (completion_body(request, choices, self) if writer is None
                                else writer.whole(choices[0], self))
                        await self._give_back(choices)
                        await exchange.send_json(200, body)
                except (ApiError, _ClientGone) as exc:
                    ending = exc
                finally:
                    nursery.cancel_scope.cancel()
                    with trio.CancelScope(shield=True):  # the nursery's scope is cancelled
                        await self._release(choices)
        if ending is not None:
            raise ending

    def _admit(self, request: ApiRequest, grant: KeyGrant | None) -> list[Choice]:
        """Check the shared limits and take the request's places in the in-flight counts."""
        server = self.server
        num_choices = len(request.prompts) * request.n
        if server.draining:
            self._reject("shutdown")
            raise ApiError(503, "the server is shutting down", code="shutdown")
        refusal = server.inflight_refusal(request.tenant, grant, num_choices)
        if refusal is not None:
            self._reject("tenant_limit")
            raise ApiError(429, refusal[0], code="tenant_limit")
        choices: list[Choice] = []
        options = dict(priority=request.priority, tenant=request.tenant, deadline_s=request.deadline_s,
                       cache_salt=request.cache_salt)
        samples = request.samples()
        for prompt_index, prompt in enumerate(request.prompts):
            request_ids = []
            for _ in range(request.n):
                self._num_requests += 1
                request_ids.append(f"h{self._num_requests}")
            # With n > 1 the samples are one request group: the prompt is computed once.
            streams = (self.engine.generate_group(prompt, samples, request_ids=request_ids, **options)
                       if request.n > 1
                else [self.engine.generate(prompt, samples[0], request_id=request_ids[0],
                                           **options)])
            for request_id, stream in zip(request_ids, streams):
                state = _StreamState(len(choices), tenant=request.tenant, request_id=request_id,
                                     grant=grant)
                server.stream_started(state)
                choice = Choice(len(choices), prompt_index, stream, state)
                self.live[request_id] = choice
                choices.append(choice)
        return choices

    def _reject(self, code: str) -> None:
        self.server.metrics.on_rejected(code)

    async def _start(self, request: ApiRequest, choices: list[Choice]) -> None:
        """Submit the choices together (each prompt's n samples as one request
        group); a refusal becomes the response's error."""
        try:
            # Every choice shares the one grammar: compiled (off the loop) before any is queued.
            await self.engine.prepare_structured_output(request.params)
            for choice in choices:
                choice.stream.enqueue()
            for choice in choices:
                await self._admitted(request, choice)
        except CadenceError as exc:
            code = _engine_error_code(exc, self.server.draining)
            self._reject(code.value)
            raise _api_error(exc, self.server.draining, request) from None

    async def _admitted(self, request: ApiRequest, choice: Choice) -> None:
        await choice.stream.start()
        choice.started = True
        choice.num_prompt_tokens = choice.stream.num_prompt_tokens
        self.server.metrics.on_accepted(choice.num_prompt_tokens)

    async def _give_back(self, choices: list[Choice]) -> None:
        """Give back the choices' places in the in-flight counts before the answer's
        end goes out: a client may send its next request (on another connection)
        the moment it sees that end, and must find its tenant's place free. They
        stay in `live` until the answer is written (see `_release`)."""
        with trio.CancelScope(shield=True):
            for choice in choices:
                await choice.stream.aclose()  # aborts the request unless it finished
                if not choice.released:
                    choice.released = True
                    self.server.stream_finished(choice.state)

    async def _release(self, choices: list[Choice]) -> None:
        """The exchange is over (answered, failed or its client gone): give back
        what is still held and let a drain know nothing of it is left."""
        await self._give_back(choices)
        live = self.live
        for choice in choices:
            live.pop(choice.state.request_id, None)
        if not live:
            self._none_live.set()

    async def wait_released(self) -> None:
        """Wait until every admitted request has been released (its answer sent or
        its client gone), so a drained server holds none."""
        while self.live:
            if self._none_live.is_set():
                self._none_live = trio.Event()
            await self._none_live.wait()

    def abort_for_shutdown(self) -> None:
        """The drain's grace is over: abort every running request (its answer ends
        with finish_reason "abort"); samples not yet started are refused."""
        for request_id, choice in self.live.items():
            if choice.started and not choice.released:  # released: its answer is being written
                self.engine.scheduler.abort_nowait(request_id, "shutdown")

    async def _relay(self, request: ApiRequest, choice: Choice, emit: Callable | None) -> None:
        """Iterate one choice's stream, recording metrics and (streaming) emitting
        deltas; an engine error is kept on the choice."""
        metrics = self.server.metrics
        previous_s = None
        whole = emit is None
        try:
            async for out in choice.stream:
                if out.token_ids:
                    metrics.on_tokens(len(out.token_ids), out.first_token_s, out.arrival_s,
                                      previous_s, out.now_s)
                    previous_s = out.now_s
                choice.add(out, whole)
                if out.finish_reason is not None:
                    metrics.on_finished(out.finish_reason, out.arrival_s, out.now_s)
                if emit is not None:
                    await emit(choice, out)
        except CadenceError as exc:
            choice.error = exc

    async def _run_choices(self, request: ApiRequest, choices: list[Choice],
                           emit: Callable | None) -> None:
        if len(choices) == 1:
            await self._relay(request, choices[0], emit)
            return
        async with trio.open_nursery() as nursery:
            for choice in choices:
                nursery.start_soon(self._relay, request, choice, emit)

    async def _stream(self, exchange: _Exchange, request: ApiRequest, choices: list[Choice],
                      scope: trio.CancelScope) -> None:
        encoder = ChunkEncoder(request)
        frame = exchange.body_frame
        await exchange.send(_response(200, _EVENT_STREAM))
        if request.chat:
            await exchange.send_bytes(b"".join(frame(encoder.event([c.role_delta()])) for c in choices))
        elif request.echo and request.logprobs is None:
            await exchange.send_bytes(b"".join(
                frame(encoder.event([c.echo_delta(request, self)])) for c in choices))
        token_text = self.token_text
        # Several choices share the socket: one write at a time.
        lock = trio.Lock() if len(choices) > 1 else None

        async def emit(choice: Choice, out) -> None:
            entry = choice.delta_json(request, out, token_text)
            data = b""
            if request.echo and not choice.echoed:
                # With logprobs the echo waits for the first output, which brings the prompt's.
                data = frame(encoder.event([choice.echo_delta(request, self)]))
            elif entry is None:
                return
            if entry is not None:
                data += frame(encoder.event_json(entry))
            try:
                if lock is None:
                    await exchange.send_bytes(data)
                else:
                    async with lock:
                        await exchange.send_bytes(data)
            except _ClientGone:
                scope.cancel()

        await self._run_choices(request, choices, emit)
        tail = []
        for choice in choices:
            if choice.error is not None:
                # The headers are gone: the error travels as an event in OpenAI's shape.
                tail.append(frame(_event(_api_error(choice.error, self.server.draining).body())))
        if request.include_usage:
            tail.append(frame(encoder.usage_event(usage_of(request, choices))))
        tail.append(frame(_SSE_DONE))
        await self._give_back(choices)
        await exchange.send_bytes(b"".join(tail))
        await exchange.send(h11.EndOfMessage())

    async def _stream_response(self, exchange: _Exchange, request: ApiRequest, choice: Choice,
                               writer: ResponseWriter, scope: trio.CancelScope) -> None:
        """A streamed response: its typed events, as the choice's text and calls arrive."""
        frame = exchange.body_frame
        await exchange.send(_response(200, _EVENT_STREAM))
        await exchange.send_bytes(frame(b"".join(writer.opening())))
        token_text = self.token_text

        async def emit(choice: Choice, out) -> None:
            events = writer.delta_events(choice, out, token_text)
            if events:
                try:
                    await exchange.send_bytes(frame(b"".join(events)))
                except _ClientGone:
                    scope.cancel()

        await self._run_choices(request, [choice], emit)
        error = None
        if choice.error is not None:
            # The headers are gone: the error ends the stream as a failed response.
            error = renamed(_api_error(choice.error, self.server.draining, request), writer.body)
        tail = writer.closing(choice, error)
        await self._give_back([choice])
        await exchange.send_bytes(frame(b"".join(tail)))
        await exchange.send(h11.EndOfMessage())


def _peer_of(stream: trio.SocketStream) -> str:
    """The peer's address without its port: what max_connections_per_peer counts."""
    try:
        name = stream.socket.getpeername()
    except OSError:
        return "?"
    return str(name[0]) if isinstance(name, tuple) else "unix"


async def _refuse(stream: trio.SocketStream, error: ApiError) -> None:
    """Answer a connection that is not admitted with `error` at once, before it sends
    anything (HTTP lets a server answer early and close), and close it; what it sends
    meanwhile is read and dropped for a moment, so the close does not destroy the
    answer."""
    payload = json.dumps(error.body(), separators=(",", ":")).encode("utf-8")
    reason = HTTPStatus(error.status).phrase.encode()
    head = (b"HTTP/1.1 %d %b\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % (error.status, reason, len(payload)))
    try:
        with trio.move_on_after(_REFUSAL_LINGER_S):
            await stream.send_all(head + payload)
            await _linger_and_close(stream)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()
_GET_ROUTES = {"/v1/models": HttpServer._list_models, "/health": HttpServer._health,
               "/metrics": HttpServer._metrics, "/version": HttpServer._version_route}


def _response(status: int, headers: list) -> h11.Response:
    try:
        reason = HTTPStatus(status).phrase.encode()
    except ValueError:
        reason = b""
    return h11.Response(status_code=status, headers=headers, reason=reason)


def _event(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode("utf-8") + b"\n\n"


def _api_error(exc: CadenceError, draining: bool, request: ApiRequest | None = None) -> ApiError:
    """An engine error as an HTTP error, classified as the msgpack server classifies it
    (a poison keeps the msgpack code and carries the flag, see ApiError); a structured
    output the library refuses names the request's own field."""
    code = _engine_error_code(exc, draining)
    if isinstance(exc, PoisonRequestError):
        return ApiError(POISON_STATUS, str(exc), code=code.value, poison=True)
    if isinstance(exc, StructuredOutputError) and request is not None and request.structured_field:
        name = request.structured_field
        return ApiError(status_of(code), http_structured_message(str(exc), name), code=code.value, param=name)
    param = getattr(exc, "field", None)
    if code is ErrorCode.REQUEST_TOO_LONG and param == "prompt" and request is not None and request.chat:
        param = "messages"  # a chat request's prompt
    return ApiError(status_of(code), str(exc), code=code.value, param=param)


def _raise_first_error(choices: list[Choice], draining: bool) -> None:
    for choice in choices:
        if choice.error is not None:
            raise _api_error(choice.error, draining)


def decode_body(body: bytes, walk_every_entry: bool = False) -> object:
    """A request body's JSON, checked before any field is read: no nesting deeper
    than MAX_JSON_DEPTH, and no string holding a lone surrogate (`\\ud800`, which
    JSON can spell but UTF-8 cannot carry); ApiError 400 otherwise. Iterative, so
    its cost is linear in the body, whatever its shape. `walk_every_entry` turns off
    the skipping of flat containers (below): the decisions the tests hold it to."""
    try:
        payload = json.loads(body)
    except RecursionError:
        raise ApiError(400, f"the body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not JSON: {exc}") from None
    check_surrogates = _SURROGATE_ESCAPE.search(body) is not None
    # Each pending value with its depth and where it is: (the parent's trail, its key),
    # spelled out as a path only for an error.
    pending: list[tuple[object, int, tuple | None]] = [(payload, 0, None)]
    while pending:
        value, depth, trail = pending.pop()
        if isinstance(value, str):
            if check_surrogates:
                _check_encodable(value, trail)
            continue
        if isinstance(value, dict):
            items = value.items()
            inner = value.values()
        elif isinstance(value, list):
            items = inner = value
        else:
            continue
        if depth >= MAX_JSON_DEPTH:
            path = _path_of(trail)
            raise ApiError(400, f"{path or 'the body'} is nested deeper than {MAX_JSON_DEPTH} levels",
                           param=_top_field(trail))
        # A container of numbers (and, without escaped surrogates, strings) holds nothing
        # to check: its types are read by builtins, not its entries pushed one by one (a
        # list of 10^5 token ids took 86 ms that way).
        if not walk_every_entry and not (check_surrogates and isinstance(value, dict)) \
                and set(map(type, inner)) <= (_UNCHECKED_SCALARS if check_surrogates else _UNCHECKED_LEAVES):
            continue
        if isinstance(value, list):
            items = enumerate(value)
        for key, item in items:
            if check_surrogates and isinstance(key, str):
                _check_encodable(key, trail)
            pending.append((item, depth + 1, (trail, key)))
    return payload


class _BodyCheck:
    """The limits a request body is held to as it arrives, each piece (a chunk, or what
    one read brought) checked once: at most `max_bytes`; past _FREE_BODY_PIECES
    pieces, at least _MIN_PIECE_BYTES a piece on average (a flood of one-byte chunks
    is refused after milliseconds of parsing); for a chat or a response, at most MAX_MESSAGES
    `"role"` keys (each message has one), so a conversation of 10^5 turns is refused
    after its first quarter megabyte, never parsed. One that spells its keys
    otherwise (escapes) is still refused by `check_messages` once parsed."""

    def __init__(self, max_bytes: int, conversation: str | None) -> None:
        self.max_bytes, self.conversation = max_bytes, conversation
        self.num_bytes = self.num_pieces = self.num_roles = 0
        self._tail = b""  # the last bytes of the body, for a key split across pieces

    def declared(self, num_bytes: int) -> ApiError | None:
        """The refusal of a body whose Content-Length is too large, or None."""
        if num_bytes > self.max_bytes:
            return ApiError(413, f"the request body has {num_bytes} bytes, the limit is "
                                 f"{self.max_bytes}", code="body_too_large")
        return None

    def add(self, data: bytes) -> ApiError | None:
        """Take the next piece; the refusal it brings, or None."""
        self.num_bytes += len(data)
        self.num_pieces += 1
        if self.num_bytes > self.max_bytes:
            return ApiError(413, f"the request body has more than {self.max_bytes} bytes, the limit",
                            code="body_too_large")
        if self.num_pieces > _FREE_BODY_PIECES and self.num_pieces * _MIN_PIECE_BYTES > self.num_bytes:
            return ApiError(400, f"the request body came in {self.num_pieces} chunks of "
                                 f"{self.num_bytes // self.num_pieces} bytes on average; past "
                                 f"{_FREE_BODY_PIECES}, chunks must average {_MIN_PIECE_BYTES} bytes",
                            code="body_chunks_too_small")
        if self.conversation is not None:
            window = self._tail + data
            self.num_roles += window.count(_ROLE_KEY)
            self._tail = window[1 - len(_ROLE_KEY):]
            if self.num_roles > MAX_MESSAGES:
                return ApiError(400, f"{self.conversation}: the body holds more than {MAX_MESSAGES} "
                                     f"\"role\" keys, the most messages a conversation may have",
                                param=self.conversation)
        return None


_ROLE_KEY = b'"role"'
# A JSON escape of a UTF-16 surrogate: only bodies holding one can decode to a lone one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# Leaves decode_body need not look at: numbers, booleans and null always; strings too
# where the body escapes no surrogate.
_UNCHECKED_SCALARS = frozenset({int, float, bool, type(None)})
_UNCHECKED_LEAVES = _UNCHECKED_SCALARS | {str}
# RFC 6750's b64token after the scheme (case-insensitive), one space between.
_BEARER = re.compile(rb"[Bb][Ee][Aa][Rr][Ee][Rr] (" + TOKEN68.encode() + rb")")


def _check_encodable(text: str, trail: tuple | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{_path_of(trail) or 'the body'} holds a lone UTF-16 surrogate "
                            f"({text[exc.start]!r} at character {exc.start}); send valid Unicode",
                       param=_top_field(trail)) from None


def _keys_of(trail: tuple | None) -> list:
    keys = []
    while trail is not None:
        trail, key = trail
        keys.append(key)
    return keys[::-1]


def _path_of(trail: tuple | None) -> str:
    """A value's place in the body, as `messages[0].content`."""
    path = ""
    for key in _keys_of(trail):
        path = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
    return path


def _top_field(trail: tuple | None) -> str | None:
    """The body's field a value is under (its `param`)."""
    keys = _keys_of(trail)
    return keys[0] if keys and isinstance(keys[0], str) else None


def _narrowed(request: ApiRequest, grant: KeyGrant | None) -> ApiRequest:
    """The request as its API key allows it: the key's tenant (or a sub-tenant of it),
    a priority no more urgent than the key's ceiling; 403 naming the tenant otherwise."""
    if grant is None:
        return request
    try:
        tenant = grant.tenant_of(request.tenant)
    except IdentityError as exc:
        raise ApiError(403, str(exc), param=exc.field, code="tenant_not_allowed") from None
    return attrs.evolve(request, tenant=tenant, priority=grant.priority_of(request.priority))


def _allow(method: str, allowed: str) -> None:
    if method != allowed:
        raise ApiError(405, f"method {method} is not allowed here; use {allowed}", code="method_not_allowed")


async def serve_http(server: Server, config: HttpConfig, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the HTTP API for `server` until cancelled; `nursery.start` returns the
    `HttpServer` once it listens."""
    await HttpServer(server, config).serve(task_status=task_status)


# ---------------------------------------------------------------------------
# `cadence serve` options.

API_KEY_ENV = "CADENCE_API_KEY"


def add_http_arguments(parser: argparse.ArgumentParser) -> None:
    """The HTTP API's options of `cadence serve`."""
    group = parser.add_argument_group("OpenAI HTTP API")
    group.add_argument("--http-port", type=int, default=None,
                       help=f"port of the OpenAI-compatible HTTP API on --host (default: "
                            f"{DEFAULT_HTTP_PORT}, or any free port when --port is 0)")
    group.add_argument("--no-http", action="store_true", help="no HTTP API")
    group.add_argument("--api-key", default=None,
                       help="require Authorization: Bearer KEY on /v1/ (also read from the "
                            f"{API_KEY_ENV} environment variable)")
    group.add_argument("--api-key-file", metavar="PATH", default=None,
                       help="read the API key from this file")
    group.add_argument("--served-model-name", default=None,
                       help="the model id clients name (default: --model)")
    group.add_argument("--strict-fields", action="store_true",
                       help="refuse request fields this server does not know (default: ignore "
                            "them, logging each name once)")
    group.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=DEFAULT_TOOL_CALL_PARSER,
                       help='how tool calls are read out of a tool_choice "auto" answer: JSON in '
                            "<tool_call> tags, or the whole answer as JSON (default: %(default)s)")
    group.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                       help='origins allowed to call the API from a browser (CORS): a JSON list, as '
                            'vLLM takes it (\'["*"]\'), or comma-separated (default: none)')
    group.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                       help="largest HTTP request body (default: %(default)s)")
    group.add_argument("--max-connections-per-peer", type=int, default=DEFAULT_MAX_CONNECTIONS_PER_PEER,
                       help="HTTP connections one client address may hold open; 0: no cap, as behind "
                            "a reverse proxy (default: %(default)s)")
    group.add_argument("--head-timeout-s", type=float, default=DEFAULT_HEAD_TIMEOUT_S,
                       help="seconds a client has to send a whole request head (default: %(default)s)")
    group.add_argument("--min-body-bytes-per-s", type=float, default=DEFAULT_MIN_BODY_BYTES_PER_S,
                       help="slowest average rate of a request body, after --head-timeout-s of "
                            "grace (default: %(default)s)")
    group.add_argument("--metrics-public", action="store_true",
                       help="serve /metrics without the API key")


def http_config_from_args(args: argparse.Namespace) -> HttpConfig | None:
    """The HttpConfig the options describe (None with --no-http)."""
    if args.no_http:
        return None
    port = args.http_port
    if port is None:
        # A server on any free port is a test or a second instance: its HTTP API too.
        port = 0 if args.port == 0 else DEFAULT_HTTP_PORT
    return HttpConfig(host=args.host, port=port, api_key=_read_api_key(args),
                      max_body_bytes=args.max_body_bytes,
                      served_model_name=args.served_model_name or args.model,
                      max_connections_per_peer=args.max_connections_per_peer or None,
                      head_timeout_s=args.head_timeout_s,
                      min_body_bytes_per_s=args.min_body_bytes_per_s,
                      metrics_public=args.metrics_public,
                      strict_fields=args.strict_fields, tool_call_parser=args.tool_call_parser,
                      allowed_origins=_origins(args.allowed_origins))


def _origins(value: str | None) -> tuple[str, ...]:
    """--allowed-origins: a JSON list of strings, or comma-separated origins."""
    if not value:
        return ()
    if value.lstrip().startswith("["):
        try:
            origins = json.loads(value)
        except ValueError as exc:
            raise ConfigError(f"--allowed-origins is not a JSON list: {exc}") from None
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise ConfigError("--allowed-origins must be a list of strings")
        return tuple(origins)
    return tuple(origin.strip() for origin in value.split(",") if origin.strip())


def _read_api_key(args: argparse.Namespace) -> str | None:
    given = args.api_key is not None or args.api_key_file is not None
    if getattr(args, "api_keys", None) is not None:
        if given:
            raise ConfigError("give --api-key (or --api-key-file) or --api-keys, not both")
        return None
    if args.api_key is not None:
        return args.api_key
    if args.api_key_file is not None:
        return read_secret_file(args.api_key_file, "API key")
    return os.environ.get(API_KEY_ENV) or None
