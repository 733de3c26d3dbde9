"""A small Trio client of the OpenAI HTTP API, for `cadence bench --http` and the
benchmarks: kept-alive HTTP/1.1 connections that stream server-sent events.

It reads only what a Cadence server writes (a chunked or close-delimited
event stream, a JSON body with Content-Length), and yields each event's raw
data so a caller that counts tokens need not decode whole events.
"""

from __future__ import annotations

import json
from typing import AsyncIterator

import trio

from cadence.statemachine.errors import CadenceError

__all__ = ["HttpApiError", "SseConnection", "HttpApiClient"]

_READ_BYTES = 1 << 16
_EVENT_END = b"\n\n"
_DATA = b"data: "
_DONE = b"[DONE]"


class HttpApiError(CadenceError):
    """The server answered with an error status (the message is its error body)."""


class SseConnection:
    """One kept-alive HTTP/1.1 connection: a request at a time."""

    def __init__(self, stream: trio.SocketStream, host: str, api_key: str | None = None) -> None:
        self.stream = stream
        self._head = b"host: " + host.encode() + b"\r\ncontent-type: application/json\r\n"
        if api_key is not None:
            self._head += b"authorization: Bearer " + api_key.encode() + b"\r\n"
        self._buffer = bytearray()

    async def _fill(self) -> None:
        data = await self.stream.receive_some(_READ_BYTES)
        if not data:
            raise HttpApiError("the server closed the connection")
        self._buffer += data

    async def _line(self) -> bytes:
        while (end := self._buffer.find(b"\r\n")) < 0:
            await self._fill()
        line = bytes(self._buffer[:end])
        del self._buffer[:end + 2]
        return line

    async def _exactly(self, size: int) -> bytes:
        while len(self._buffer) < size:
            await self._fill()
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data

    async def _send(self, method: bytes, path: str, body: bytes) -> tuple[int, dict[bytes, bytes]]:
        await self.stream.send_all(
            method + b" " + path.encode() + b" HTTP/1.1\r\n" + self._head + b"content-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)
        status = int((await self._line()).split(b" ", 2)[1])
        headers = {}
        while line := await self._line():
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    async def request_json(self, method: str, path: str, body: object = None) -> dict:
        """A request with a JSON answer; raises HttpApiError for an error status."""
        payload = b"" if body is None else json.dumps(body).encode()
        status, headers = await self._send(method.encode(), path, payload)
        answer = json.loads(await self._exactly(int(headers.get(b"content-length", b"0"))))
        if status != 200:
            raise HttpApiError(f"HTTP {status}: {answer.get('error', answer)}")
        return answer

    async def events(self, path: str, body: dict) -> AsyncIterator[bytes]:
        """Stream a request; yield each server-sent event's data (JSON text), up to [DONE]."""
        status, headers = await self._send(b"POST", path, json.dumps(body).encode())
        if status != 200:
            answer = await self._exactly(int(headers.get(b"content-length", b"0")))
            raise HttpApiError(f"HTTP {status}: {answer.decode(errors='replace')}")
        pending = b""
        while True:
            size = int(await self._line(), 16)
            if size == 0:
                await self._line()
                return
            pending += await self._exactly(size)
            await self._exactly(2)
            *events, pending = pending.split(_EVENT_END)
            for event in events:
                data = event[len(_DATA):]
                if data != _DONE:
                    yield data


class HttpApiClient:
    """Connections to one server, opened as needed and kept alive between requests."""

    def __init__(self, host: str, port: int, api_key: str | None = None) -> None:
        self.host, self.port, self.api_key = host, port, api_key
        self._idle: list[SseConnection] = []

    async def _connection(self) -> SseConnection:
        if self._idle:
            return self._idle.pop()
        stream = await trio.open_tcp_stream(self.host, self.port)
        return SseConnection(stream, self.host, self.api_key)

    async def get(self, path: str) -> dict:
        """GET a JSON resource."""
        connection = await self._connection()
        try:
            answer = await connection.request_json("GET", path)
        except BaseException:
            await connection.stream.aclose()
            raise
        self._idle.append(connection)
        return answer

    async def stream(self, path: str, body: dict) -> AsyncIterator[bytes]:
        """Stream a request on an idle connection (or a new one); a connection left
        mid-answer is closed, which aborts the request on the server."""
        connection = await self._connection()
        finished = False
        try:
            async for data in connection.events(path, body):
                yield data
            finished = True
        finally:
            if finished:
                self._idle.append(connection)
            else:
                with trio.CancelScope(shield=True):
                    await connection.stream.aclose()

    async def aclose(self) -> None:
        """Close every idle connection."""
        idle, self._idle = self._idle, []
        for connection in idle:
            await connection.stream.aclose()
