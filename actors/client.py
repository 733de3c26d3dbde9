"""Python clients for the socket server: synchronous, Trio, and asyncio.

    with Client.connect("127.0.0.1:8470") as client:          # blocking
        for out in client.generate("Hello", max_tokens=16):
            print(out.text, end="")

    async with open_client("unix:/tmp/cadence.sock") as client:   # Trio
        stream = await client.generate([1, 2, 3], max_tokens=8)
        async for out in stream: ...

    client = await AsyncioClient.connect(("127.0.0.1", 8470))       # asyncio

All three share `ClientProtocol`, a sans-IO core that builds frames and routes
what the server sends to streams and query replies; they differ only in how
they wait for bytes. A stream yields the server's `Output` deltas and ends
after the one with a finish_reason, or raises the `ServerError` the server
ended it with. Any wait longer than the client's `timeout_s` raises
`ClientTimeoutError` (the connection stays usable). A lost connection fails
every live stream and every later call with `ConnectionClosedError` (or the
fatal `ServerError` that came before it): the clients never reconnect on their
own.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Mapping, Sequence, Union

import attrs
import trio

from cadence.statemachine.errors import CadenceError, ConfigError, InvalidRequestError
from cadence.statemachine.sampling import SamplingParams

from .chat import check_messages
from .request_actor import join_logprobs
from .unwrap import unwrapping
from .wire import (
    MAX_REPLY_FRAME_BYTES, Abort, Accepted, ClientTimeoutError, ConnectionClosedError, Error,
    FrameBuffer, Generate, HealthQuery, HealthReply, Hello, MessageError, Output, ServerError,
    StatsQuery, StatsReply, Welcome, decode_reply, encode, error_from_frame, pack_frame,
)

__all__ = [
    "Address",
    "parse_address",
    "Completion",
    "StreamState",
    "ClientProtocol",
    "Client",
    "SyncStream",
    "AsyncClient",
    "AsyncStream",
    "open_client",
    "AsyncioClient",
    "AsyncioStream",
]

Address = Union[str, tuple]
Prompt = Union[str, Sequence[int]]

DEFAULT_TIMEOUT_S = 60.0
_READ_BYTES = 1 << 16


def parse_address(address: Address) -> tuple[str, Any]:
    """("tcp", (host, port)) or ("unix", path) from `(host, port)`, "host:port",
    "tcp://host:port", "[::1]:port", "unix:/path" or "unix:///path"."""
    if isinstance(address, tuple):
        if len(address) != 2:
            raise ConfigError(f"a TCP address is (host, port), got {address!r}")
        return "tcp", (str(address[0]), int(address[1]))
    if not isinstance(address, str) or not address:
        raise ConfigError(f"not a server address: {address!r}")
    if address.startswith("unix:"):
        path = address[len("unix:"):]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise ConfigError(f"no socket path in {address!r}")
        return "unix", path
    rest = address[len("tcp://"):] if address.startswith("tcp://") else address
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"expected host:port, tcp://host:port or unix:/path, got {address!r}")
    return "tcp", (host.strip("[]") or "127.0.0.1", int(port))


@attrs.frozen
class Completion:
    """A finished stream as a whole (prompt_logprobs: as in the first `Output`)."""

    request_id: str
    token_ids: list[int]
    text: str | None
    finish_reason: str
    detail: str
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_logprobs: list[list[tuple[int, float]] | None] | None = None


def _generate_message(stream: int, prompt: Prompt | None, params: SamplingParams | None,
                      options: dict, sampling: dict) -> Generate:
    if params is not None and sampling:
        raise ConfigError("pass either params or sampling keywords, not both")
    if params is None:
        params = SamplingParams(**sampling)
    options = dict(options)
    prompt, messages = _prompt_or_messages(prompt, options.pop("prompt_token_ids", None),
                                           options.pop("messages", None))
    return Generate(stream=stream, prompt=prompt, params=params, messages=messages, **options)


def _prompt_or_messages(prompt: Prompt | None, prompt_token_ids: Sequence[int] | None,
                        messages: Sequence[Any] | None) -> tuple[str | list[int] | None, list[dict] | None]:
    """(prompt, messages) of a Generate from exactly one of the three ways to give a prompt."""
    given = [name for name, value in (("prompt", prompt), ("prompt_token_ids", prompt_token_ids),
                                      ("messages", messages)) if value is not None]
    if len(given) != 1:
        raise InvalidRequestError(
            "give exactly one of prompt, prompt_token_ids and messages; got "
            + (" and ".join(given) if given else "none"))
    if messages is not None:
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise InvalidRequestError(
                f"messages must be a list of {{'role': ..., 'content': ...}} maps, got {type(messages).__name__}")
        conversation = [dict(m) if isinstance(m, Mapping) else m for m in messages]
        return None, check_messages(conversation)
    if prompt_token_ids is not None:
        if isinstance(prompt_token_ids, str):
            raise InvalidRequestError("prompt_token_ids must be a list of token ids, got a str")
        return list(prompt_token_ids), None
    return (prompt if isinstance(prompt, str) else list(prompt)), None  # type: ignore[arg-type]


class StreamState:
    """What the client knows of one stream: deltas not yet consumed, and how it ended."""

    __slots__ = ("stream", "request_id", "num_prompt_tokens", "outputs", "error", "finished",
                 "closed_locally")

    def __init__(self, stream: int) -> None:
        self.stream = stream
        self.request_id: str | None = None
        self.num_prompt_tokens: int | None = None
        self.outputs: deque[Output] = deque()
        self.error: BaseException | None = None
        self.finished = False
        self.closed_locally = False

    @property
    def done(self) -> bool:
        """Whether nothing more will arrive for this stream."""
        return self.finished or self.error is not None


class ClientProtocol:
    """The sans-IO half of every client: frames out, routing in.

    `receive_data` feeds bytes and returns the keys whose waiters should wake:
    ("stream", id), ("reply", ref), or ("connection", None) when the
    connection failed.
    """

    def __init__(self, token: str | None = None, client_name: str = "cadence-python",
                 max_frame_bytes: int = MAX_REPLY_FRAME_BYTES) -> None:
        self.token = token
        self.client_name = client_name
        self.buffer = FrameBuffer(max_frame_bytes)
        self.welcome: Welcome | None = None
        self.streams: dict[int, StreamState] = {}
        self.replies: dict[int, StatsReply | HealthReply | None] = {}
        self.error: BaseException | None = None
        self.last_error: ServerError | None = None
        self._num_streams = 0
        self._num_refs = 0

    # ---- frames out ---------------------------------------------------------------
    def hello(self) -> bytes:
        """The Hello frame."""
        return pack_frame(encode(Hello(token=self.token, client=self.client_name)))

    def generate(self, prompt: Prompt | None, params: SamplingParams | None, options: dict,
                 sampling: dict) -> tuple[StreamState, bytes]:
        """A new stream and its Generate frame (`options` may hold `prompt_token_ids`
        or `messages` in place of `prompt`); one sample (see `generate_samples`)."""
        states, frame = self.generate_samples(prompt, params, options, sampling)
        if len(states) != 1:
            for state in states:
                self.streams.pop(state.stream, None)
            raise ConfigError(f"n is {len(states)}: use generate_samples for one stream per sample")
        return states[0], frame

    def generate_samples(self, prompt: Prompt | None, params: SamplingParams | None, options: dict,
                         sampling: dict) -> tuple[list[StreamState], bytes]:
        """The new streams of a Generate, one per sample (params.n; the server answers
        sample i on the Generate's stream id + i), and its frame."""
        self.check_open()
        sid = self._num_streams
        message = _generate_message(sid, prompt, params, options, sampling)
        self._num_streams += message.params.n
        states = [StreamState(sid + i) for i in range(message.params.n)]
        for state in states:
            self.streams[state.stream] = state
        return states, pack_frame(encode(message))

    def abort(self, state: StreamState) -> bytes | None:
        """The Abort frame for a live stream, or None when it has ended."""
        if state.done or self.error is not None:
            return None
        return pack_frame(encode(Abort(state.stream)))

    def forget(self, state: StreamState) -> None:
        """The caller gave up on the stream: drop whatever still arrives for it."""
        state.closed_locally = True
        if state.error is None and not state.finished:
            state.error = ConnectionClosedError("stream closed by the client")
        self.streams.pop(state.stream, None)

    def query(self, kind: type) -> tuple[int, bytes]:
        """A new ref and the Stats or Health query frame for it."""
        self.check_open()
        ref = self._num_refs
        self._num_refs += 1
        self.replies[ref] = None
        return ref, pack_frame(encode(kind(ref)))

    # ---- frames in ----------------------------------------------------------------
    def receive_data(self, data: bytes) -> list[tuple[str, Any]]:
        """Feed received bytes; route every whole frame."""
        if not data:
            return self.connection_lost(ConnectionClosedError("the server closed the connection"))
        self.buffer.feed(data)
        woken: list[tuple[str, Any]] = []
        try:
            while (frame := self.buffer.next_frame()) is not None:
                woken.append(self._route(decode_reply(frame)))
        except (MessageError, CadenceError) as exc:
            woken.extend(self.connection_lost(ConnectionClosedError(f"the server sent a bad frame: {exc}")))
        return woken

    def _route(self, message) -> tuple[str, Any]:
        kind = type(message)
        if kind is Output:
            state = self.streams.get(message.stream)
            if state is not None:
                state.outputs.append(message)
                if message.finish_reason is not None:
                    state.finished = True
                    del self.streams[message.stream]
            return "stream", message.stream
        if kind is Accepted:
            state = self.streams.get(message.stream)
            if state is not None:
                state.request_id = message.request_id
                state.num_prompt_tokens = message.num_prompt_tokens
            return "stream", message.stream
        if kind is Error:
            return self._route_error(message)
        if kind is StatsReply or kind is HealthReply:
            if message.ref in self.replies:
                self.replies[message.ref] = message
            return "reply", message.ref
        if kind is Welcome and self.welcome is None:
            self.welcome = message
            return "connection", None
        raise MessageError(f"unexpected {kind.TYPE} frame")

    def _route_error(self, frame: Error) -> tuple[str, Any]:
        error = error_from_frame(frame)
        if frame.fatal:
            self.connection_lost(error)
            return "connection", None
        if frame.stream is None:
            self.last_error = error
            return "connection", None
        state = self.streams.pop(frame.stream, None)
        if state is not None:  # else: an answer about a stream that already ended
            state.error = error
        return "stream", frame.stream

    def connection_lost(self, error: BaseException) -> list[tuple[str, Any]]:
        """Fail every live stream and every later call with `error`."""
        if self.error is None:
            self.error = error
        for state in self.streams.values():
            if state.error is None:
                state.error = self.error
        woken = [("stream", sid) for sid in self.streams]
        woken.append(("connection", None))
        woken.extend(("reply", ref) for ref in self.replies)
        self.streams.clear()
        return woken

    def check_open(self) -> None:
        """Raise the connection's error if it is gone."""
        if self.error is not None:
            raise self.error

    # ---- what waiters look at ----------------------------------------------------
    def take_output(self, state: StreamState) -> Output | None:
        """The stream's next delta; None if none has arrived; raises how it failed."""
        if state.outputs:
            return state.outputs.popleft()
        if state.error is not None and not state.closed_locally:
            raise state.error
        return None

    def take_reply(self, ref: int):
        """The reply to `ref`, or None if it has not arrived; raises if the connection failed."""
        reply = self.replies.get(ref)
        if reply is not None:
            del self.replies[ref]
            return reply
        self.check_open()
        return None


def _completion(state: StreamState, outputs: list[Output]) -> Completion:
    last = outputs[-1]
    texts = [o.text for o in outputs if o.text is not None]
    return Completion(
        request_id=state.request_id or "", token_ids=[t for o in outputs for t in o.token_ids],
        text="".join(texts) if last.text is not None else None, finish_reason=last.finish_reason,
        detail=last.detail, num_prompt_tokens=state.num_prompt_tokens or 0,
        num_cached_tokens=last.num_cached_tokens,
        logprobs=join_logprobs((len(o.token_ids), o.logprobs) for o in outputs),
        prompt_logprobs=outputs[0].prompt_logprobs)


def _timeout_error(timeout_s: float, what: str) -> ClientTimeoutError:
    return ClientTimeoutError(f"no {what} from the server within {timeout_s} s")


class _StreamHandle:
    """What every client's stream tells about itself: ids and the prompt's length."""

    def __init__(self, client, state: StreamState) -> None:
        self._client = client
        self._state = state

    @property
    def stream_id(self) -> int:
        """The stream's id on this connection."""
        return self._state.stream

    @property
    def request_id(self) -> str | None:
        """The server's request id, once the server has accepted the request."""
        return self._state.request_id

    @property
    def num_prompt_tokens(self) -> int | None:
        """The prompt's length in tokens, once the server has accepted the request."""
        return self._state.num_prompt_tokens


# ---------------------------------------------------------------------------
# Synchronous client.


class SyncStream(_StreamHandle):
    """A stream of the synchronous client: iterate it for `Output` deltas."""

    def __iter__(self) -> SyncStream:
        return self

    def __next__(self) -> Output:
        state, protocol = self._state, self._client.protocol
        deadline = time.monotonic() + self._client.timeout_s
        while True:
            out = protocol.take_output(state)
            if out is not None:
                return out
            if state.done:
                raise StopIteration
            self._client._pump(deadline, "output")

    def abort(self) -> None:
        """Ask the server to abort; keep iterating to see the final "abort" delta."""
        self._client._send_bytes(self._client.protocol.abort(self._state))

    def close(self) -> None:
        """Abort if still live and drop whatever else arrives for the stream."""
        frame = self._client.protocol.abort(self._state)
        self._client.protocol.forget(self._state)
        if frame is not None and self._client.protocol.error is None:
            self._client._send_bytes(frame)

    def __enter__(self) -> SyncStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def collect(self) -> Completion:
        """Consume the stream and return it as a whole."""
        outputs = list(self)
        return _completion(self._state, outputs)


class Client:
    """A blocking client over one connection; not thread-safe (one thread at a time).

    Reads happen while the caller waits on a stream or a query, so several
    streams can be open at once and consumed in any order.
    """

    def __init__(self, sock: socket.socket, protocol: ClientProtocol, timeout_s: float) -> None:
        self.sock = sock
        self.protocol = protocol
        self.timeout_s = timeout_s

    @classmethod
    def connect(cls, address: Address, *, token: str | None = None,
                timeout_s: float = DEFAULT_TIMEOUT_S, client_name: str = "cadence-python") -> Client:
        """Connect, say Hello, and wait for the server's Welcome."""
        kind, where = parse_address(address)
        family = socket.AF_UNIX if kind == "unix" else socket.AF_INET
        try:
            if kind == "tcp":
                sock = socket.create_connection(where, timeout=timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            else:
                sock = socket.socket(family, socket.SOCK_STREAM)
                sock.settimeout(timeout_s)
                sock.connect(where)
        except socket.timeout:
            raise _timeout_error(timeout_s, "connection") from None
        except OSError as exc:
            raise ConnectionClosedError(f"cannot connect to {address!r}: {exc.strerror or exc}") from None
        client = cls(sock, ClientProtocol(token, client_name), timeout_s)
        try:
            client._send_bytes(client.protocol.hello())
            deadline = time.monotonic() + timeout_s
            while client.protocol.welcome is None:
                client._pump(deadline, "Welcome")
        except BaseException:
            sock.close()
            raise
        return client

    @property
    def welcome(self) -> Welcome:
        """What the server said about itself."""
        return self.protocol.welcome

    def generate(self, prompt: Prompt | None = None, params: SamplingParams | None = None, *,
                 prompt_token_ids: Sequence[int] | None = None,
                 messages: Sequence[Mapping[str, Any]] | None = None,
                 priority: int = 0, tenant: str = "default", deadline_s: float | None = None,
                 timeout_s: float | None = None, cache_salt: str | None = None,
                 **sampling) -> SyncStream | list[SyncStream]:
        """Start a request and return its stream. The prompt is exactly one of
        `prompt` (text or token ids), `prompt_token_ids`, or `messages` (a
        conversation of {"role", "content"} maps the server renders with its
        model's chat template). Sampling fields may be given as keywords
        (max_tokens=16) instead of params. timeout_s: the server aborts the
        request after this long (detail "timeout"). With n > 1 the samples are
        one request group on the server, and a list of n streams comes back."""
        options = dict(priority=priority, tenant=tenant, deadline_s=deadline_s, timeout_s=timeout_s,
                       cache_salt=cache_salt, prompt_token_ids=prompt_token_ids, messages=messages)
        states, frame = self.protocol.generate_samples(prompt, params, options, sampling)
        self._send_bytes(frame)
        streams = [SyncStream(self, state) for state in states]
        return streams[0] if len(streams) == 1 else streams

    def complete(self, prompt: Prompt | None = None, params: SamplingParams | None = None,
                 **options) -> Completion | list[Completion]:
        """Run one request to the end and return it whole (arguments as `generate`;
        with n > 1, one Completion per sample)."""
        streams = self.generate(prompt, params, **options)
        if not isinstance(streams, list):
            with streams:
                return streams.collect()
        completions = []
        for stream in streams:
            with stream:
                completions.append(stream.collect())
        return completions

    def stats(self) -> dict[str, Any]:
        """The engine's and the server's counters."""
        return self._query(StatsQuery).stats

    def health(self) -> HealthReply:
        """Whether the server takes requests, with a few gauges."""
        return self._query(HealthQuery)

    def close(self) -> None:
        """Close the connection (the server aborts whatever is still running)."""
        if self.protocol.error is None:
            self.protocol.connection_lost(ConnectionClosedError("the client closed the connection"))
        self.sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _query(self, kind: type):
        ref, frame = self.protocol.query(kind)
        self._send_bytes(frame)
        deadline = time.monotonic() + self.timeout_s
        while (reply := self.protocol.take_reply(ref)) is None:
            self._pump(deadline, f"{kind.TYPE} reply")
        return reply

    def _send_bytes(self, frame: bytes | None) -> None:
        if frame is None:
            return
        self.protocol.check_open()
        try:
            self.sock.settimeout(self.timeout_s)
            self.sock.sendall(frame)
        except socket.timeout:
            # Part of the frame may be out: the stream can no longer be framed.
            self.protocol.connection_lost(_timeout_error(self.timeout_s, "room to send"))
            self.sock.close()
            self.protocol.check_open()
        except OSError as exc:
            self._lost(exc)

    def _pump(self, deadline: float, what: str) -> None:
        """Read once (waiting at most until `deadline`) and route what came."""
        self.protocol.check_open()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _timeout_error(self.timeout_s, what)
        try:
            self.sock.settimeout(remaining)
            data = self.sock.recv(_READ_BYTES)
        except socket.timeout:
            raise _timeout_error(self.timeout_s, what) from None
        except OSError as exc:
            self._lost(exc)
        self.protocol.receive_data(data)
        if self.protocol.error is not None:
            self.sock.close()  # over either way; closing lets the server finish at once

    def _lost(self, exc: OSError) -> None:
        self.protocol.connection_lost(ConnectionClosedError(f"connection lost: {exc.strerror or exc}"))
        self.sock.close()
        self.protocol.check_open()


# ---------------------------------------------------------------------------
# Trio client.


class AsyncStream(_StreamHandle):
    """A stream of the Trio client: `async for out in stream`. Leaving an
    `async with stream` block early aborts the request."""

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Output:
        client, state = self._client, self._state
        out = client.protocol.take_output(state)
        if out is not None:  # already here: no timer needed
            await trio.lowlevel.checkpoint_if_cancelled()
            return out
        with trio.move_on_after(client.timeout_s):
            while True:
                out = client.protocol.take_output(state)
                if out is not None:
                    return out
                if state.done:
                    raise StopAsyncIteration
                await client._wait(("stream", state.stream))
        raise _timeout_error(client.timeout_s, "output")

    async def abort(self) -> None:
        """Ask the server to abort; keep iterating to see the final "abort" delta."""
        await self._client._send_bytes(self._client.protocol.abort(self._state))

    async def aclose(self) -> None:
        """Abort if still live and drop whatever else arrives for the stream."""
        protocol = self._client.protocol
        frame = protocol.abort(self._state)
        protocol.forget(self._state)
        if frame is not None and protocol.error is None:
            with trio.CancelScope(shield=True), trio.move_on_after(self._client.timeout_s):
                try:
                    await self._client._send_bytes(frame)
                except CadenceError:
                    pass

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    async def collect(self) -> Completion:
        """Consume the stream and return it as a whole."""
        outputs = [out async for out in self]
        return _completion(self._state, outputs)


class _AsyncClientCalls:
    """The calls the Trio and asyncio clients share; each subclass supplies its
    transport (`_send_bytes`, `_query`) and its stream class."""

    _stream_class: type

    @property
    def welcome(self) -> Welcome:
        """What the server said about itself."""
        return self.protocol.welcome

    async def generate(self, prompt: Prompt | None = None, params: SamplingParams | None = None, *,
                       prompt_token_ids: Sequence[int] | None = None,
                       messages: Sequence[Mapping[str, Any]] | None = None,
                       priority: int = 0, tenant: str = "default", deadline_s: float | None = None,
                       timeout_s: float | None = None, cache_salt: str | None = None,
                       **sampling):
        """Start a request and return its stream (see `Client.generate`)."""
        options = dict(priority=priority, tenant=tenant, deadline_s=deadline_s, timeout_s=timeout_s,
                       cache_salt=cache_salt, prompt_token_ids=prompt_token_ids, messages=messages)
        states, frame = self.protocol.generate_samples(prompt, params, options, sampling)
        await self._send_bytes(frame)
        streams = [self._stream_class(self, state) for state in states]
        return streams[0] if len(streams) == 1 else streams

    async def complete(self, prompt: Prompt | None = None, params: SamplingParams | None = None,
                       **options) -> Completion | list[Completion]:
        """Run one request to the end and return it whole (arguments as `generate`;
        with n > 1, one Completion per sample)."""
        streams = await self.generate(prompt, params, **options)
        if not isinstance(streams, list):
            async with streams:
                return await streams.collect()
        completions = []
        for stream in streams:
            async with stream:
                completions.append(await stream.collect())
        return completions

    async def stats(self) -> dict[str, Any]:
        """The engine's and the server's counters."""
        return (await self._query(StatsQuery)).stats

    async def health(self) -> HealthReply:
        """Whether the server takes requests, with a few gauges."""
        return await self._query(HealthQuery)

    async def _wait(self, key: tuple[str, Any]) -> None:
        """Wait until `_wake` is called with `key` (or the connection is lost)."""
        event = self._waiters.get(key)
        if event is None:
            event = self._waiters[key] = self._new_event()
        await event.wait()

    def _wake(self, keys) -> None:
        for key in keys:
            event = self._waiters.pop(key, None)
            if event is not None:
                event.set()
        if ("connection", None) in keys and self.protocol.error is not None:
            for event in self._waiters.values():
                event.set()
            self._waiters.clear()


class AsyncClient(_AsyncClientCalls):
    """A Trio client over one connection, safe to share between tasks.

    Create it with `open_client`, whose block owns the background reader task.
    """

    _stream_class = AsyncStream
    _new_event = trio.Event

    def __init__(self, stream: trio.abc.Stream, protocol: ClientProtocol, timeout_s: float) -> None:
        self.stream = stream
        self.protocol = protocol
        self.timeout_s = timeout_s
        self._waiters: dict[tuple[str, Any], trio.Event] = {}
        self._send_lock = trio.Lock()

    async def _query(self, kind: type):
        ref, frame = self.protocol.query(kind)
        await self._send_bytes(frame)
        with trio.move_on_after(self.timeout_s):
            while (reply := self.protocol.take_reply(ref)) is None:
                await self._wait(("reply", ref))
            return reply
        raise _timeout_error(self.timeout_s, f"{kind.TYPE} reply")

    async def _send_bytes(self, frame: bytes | None) -> None:
        if frame is None:
            return
        self.protocol.check_open()
        try:
            async with self._send_lock:
                with trio.move_on_after(self.timeout_s):
                    await self.stream.send_all(frame)
                    return
            # Part of the frame may be out: the stream can no longer be framed.
            self._wake(self.protocol.connection_lost(_timeout_error(self.timeout_s, "room to send")))
            await self.stream.aclose()
            self.protocol.check_open()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self._wake(self.protocol.connection_lost(ConnectionClosedError(f"connection lost: {exc}")))
            self.protocol.check_open()

    async def _handshake(self) -> None:
        protocol = self.protocol
        await self._send_bytes(protocol.hello())
        with trio.move_on_after(self.timeout_s):
            while protocol.welcome is None:
                try:
                    data = await self.stream.receive_some(_READ_BYTES)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    protocol.connection_lost(ConnectionClosedError(f"connection lost: {exc}"))
                    data = b""
                if protocol.error is None:
                    protocol.receive_data(data)
                protocol.check_open()
            return
        raise _timeout_error(self.timeout_s, "Welcome")

    async def _read_loop(self) -> None:
        try:
            while self.protocol.error is None:
                data = await self.stream.receive_some(_READ_BYTES)
                self._wake(self.protocol.receive_data(data))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self._wake(self.protocol.connection_lost(ConnectionClosedError(f"connection lost: {exc}")))
        # The connection is over either way; closing lets the server finish at once.
        await self.stream.aclose()


@unwrapping
@asynccontextmanager
async def open_client(address: Address, *, token: str | None = None,
                      timeout_s: float = DEFAULT_TIMEOUT_S,
                      client_name: str = "cadence-python") -> AsyncIterator[AsyncClient]:
    """Connect, say Hello, wait for Welcome, and keep a reader task for the block's duration."""
    kind, where = parse_address(address)
    try:
        with trio.fail_after(timeout_s):
            if kind == "tcp":
                stream = await trio.open_tcp_stream(*where)
            else:
                stream = await trio.open_unix_socket(where)
    except trio.TooSlowError:
        raise _timeout_error(timeout_s, "connection") from None
    except OSError as exc:
        raise ConnectionClosedError(f"cannot connect to {address!r}: {exc.strerror or exc}") from None
    client = AsyncClient(stream, ClientProtocol(token, client_name), timeout_s)
    async with stream:
        # The handshake reads in this task, so its errors reach the caller as
        # they are rather than from inside the reader's nursery.
        await client._handshake()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client._read_loop)
            try:
                yield client
            finally:
                client._wake(client.protocol.connection_lost(
                    ConnectionClosedError("the client closed the connection")))
                nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------------
# asyncio client.


class AsyncioStream(_StreamHandle):
    """A stream of the asyncio client: `async for out in stream`."""

    def __aiter__(self) -> AsyncioStream:
        return self

    async def __anext__(self) -> Output:
        client, state = self._client, self._state
        out = client.protocol.take_output(state)
        if out is not None:  # already here: no timer needed
            return out
        try:
            async with asyncio.timeout(client.timeout_s):
                while True:
                    out = client.protocol.take_output(state)
                    if out is not None:
                        return out
                    if state.done:
                        raise StopAsyncIteration
                    await client._wait(("stream", state.stream))
        except TimeoutError as exc:
            if isinstance(exc, ClientTimeoutError):
                raise
            raise _timeout_error(client.timeout_s, "output") from None

    async def abort(self) -> None:
        """Ask the server to abort; keep iterating to see the final "abort" delta."""
        await self._client._send_bytes(self._client.protocol.abort(self._state))

    async def aclose(self) -> None:
        """Abort if still live and drop whatever else arrives for the stream."""
        protocol = self._client.protocol
        frame = protocol.abort(self._state)
        protocol.forget(self._state)
        if frame is not None and protocol.error is None:
            try:
                await self._client._send_bytes(frame)
            except CadenceError:
                pass

    async def __aenter__(self) -> AsyncioStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    async def collect(self) -> Completion:
        """Consume the stream and return it as a whole."""
        outputs = [out async for out in self]
        return _completion(self._state, outputs)


class AsyncioClient(_AsyncClientCalls):
    """The same client for asyncio programs: `await AsyncioClient.connect(...)`,
    then `await client.aclose()` (or `async with`)."""

    _stream_class = AsyncioStream
    _new_event = asyncio.Event

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 protocol: ClientProtocol, timeout_s: float) -> None:
        self.reader = reader
        self.writer = writer
        self.protocol = protocol
        self.timeout_s = timeout_s
        self._waiters: dict[tuple[str, Any], asyncio.Event] = {}
        self._reader_task: asyncio.Task | None = None

    @classmethod
    async def connect(cls, address: Address, *, token: str | None = None,
                      timeout_s: float = DEFAULT_TIMEOUT_S,
                      client_name: str = "cadence-python") -> AsyncioClient:
        """Connect, say Hello, and wait for the server's Welcome."""
        kind, where = parse_address(address)
        try:
            async with asyncio.timeout(timeout_s):
                if kind == "tcp":
                    reader, writer = await asyncio.open_connection(*where)
                else:
                    reader, writer = await asyncio.open_unix_connection(where)
        except TimeoutError:
            raise _timeout_error(timeout_s, "connection") from None
        except OSError as exc:
            raise ConnectionClosedError(f"cannot connect to {address!r}: {exc.strerror or exc}") from None
        client = cls(reader, writer, ClientProtocol(token, client_name), timeout_s)
        client._reader_task = asyncio.get_running_loop().create_task(client._read_loop())
        try:
            await client._send_bytes(client.protocol.hello())
            async with asyncio.timeout(timeout_s):
                while client.protocol.welcome is None:
                    client.protocol.check_open()
                    await client._wait(("connection", None))
        except TimeoutError as exc:
            await client.aclose()
            if isinstance(exc, ClientTimeoutError):
                raise
            raise _timeout_error(timeout_s, "Welcome") from None
        except BaseException:
            await client.aclose()
            raise
        return client

    async def aclose(self) -> None:
        """Close the connection (the server aborts whatever is still running)."""
        if self.protocol.error is None:
            self._wake(self.protocol.connection_lost(
                ConnectionClosedError("the client closed the connection")))
        task = self._reader_task
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except OSError:
            pass

    async def __aenter__(self) -> AsyncioClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    async def _query(self, kind: type):
        ref, frame = self.protocol.query(kind)
        await self._send_bytes(frame)
        try:
            async with asyncio.timeout(self.timeout_s):
                while (reply := self.protocol.take_reply(ref)) is None:
                    await self._wait(("reply", ref))
                return reply
        except TimeoutError as exc:
            if isinstance(exc, ClientTimeoutError):
                raise
            raise _timeout_error(self.timeout_s, f"{kind.TYPE} reply") from None

    async def _send_bytes(self, frame: bytes | None) -> None:
        if frame is None:
            return
        self.protocol.check_open()
        try:
            self.writer.write(frame)
            async with asyncio.timeout(self.timeout_s):
                await self.writer.drain()
        except TimeoutError:
            raise _timeout_error(self.timeout_s, "room to send") from None
        except OSError as exc:
            self._wake(self.protocol.connection_lost(ConnectionClosedError(f"connection lost: {exc}")))
            self.protocol.check_open()

    async def _read_loop(self) -> None:
        try:
            while self.protocol.error is None:
                data = await self.reader.read(_READ_BYTES)
                self._wake(self.protocol.receive_data(data))
        except OSError as exc:
            self._wake(self.protocol.connection_lost(ConnectionClosedError(f"connection lost: {exc}")))
        self.writer.close()
