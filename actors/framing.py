"""Length-prefixed frames: a 4-byte big-endian length, then that many payload bytes.

The length is checked against the limit before any of the body is read, so a
peer cannot make us buffer more than `max_size` bytes. End of stream exactly
between frames is a clean close (`None`); anywhere else it is a truncated frame
and raises `ProtocolError`. The async functions work on any Trio stream; the
`_sync` ones on a blocking socket, for the executor worker process, which does
not run Trio.
"""

from __future__ import annotations

import socket
import struct
from typing import TYPE_CHECKING

from cadence.statemachine.errors import ProtocolError

from .messages import MAX_MESSAGE_BYTES

if TYPE_CHECKING:  # the worker process uses only the sync half and never imports trio
    import trio

__all__ = [
    "HEADER_BYTES",
    "MAX_FRAME_BYTES",
    "send_frame",
    "receive_frame",
    "send_frame_sync",
    "receive_frame_sync",
]

_HEADER = struct.Struct(">I")
HEADER_BYTES = _HEADER.size
MAX_FRAME_BYTES = MAX_MESSAGE_BYTES
# Bodies are read in pieces of at most this size so a large frame does not
# ask the kernel for one huge buffer at once.
_CHUNK_BYTES = 1 << 20


def _header(payload: bytes | bytearray | memoryview, max_size: int) -> bytes:
    size = len(payload)
    if size > max_size:
        raise ProtocolError(f"frame of {size} bytes exceeds the limit of {max_size}")
    return _HEADER.pack(size)


def _body_size(header: bytes | bytearray, max_size: int) -> int:
    (size,) = _HEADER.unpack(header)
    if size > max_size:
        raise ProtocolError(f"incoming frame declares {size} bytes, over the limit of {max_size}")
    return size


def _truncated(what: str, received: int, expected: int) -> ProtocolError:
    return ProtocolError(f"stream ended inside a frame {what}: got {received} of {expected} bytes")


async def send_frame(stream: trio.abc.SendStream, payload: bytes, max_size: int = MAX_FRAME_BYTES) -> None:
    """Send one frame; ProtocolError if `payload` is over `max_size`."""
    await stream.send_all(_header(payload, max_size) + payload)


async def _receive_exactly(stream: trio.abc.ReceiveStream, size: int, what: str) -> bytearray | None:
    """`size` bytes, or None if the stream ends before the first of them."""
    # Asking for exactly what is missing means nothing past this frame is ever
    # consumed, so no buffer has to be kept between calls.
    buffer = bytearray()
    while len(buffer) < size:
        chunk = await stream.receive_some(min(size - len(buffer), _CHUNK_BYTES))
        if not chunk:
            if not buffer:
                return None
            raise _truncated(what, len(buffer), size)
        buffer += chunk
    return buffer


async def receive_frame(stream: trio.abc.ReceiveStream, max_size: int = MAX_FRAME_BYTES) -> bytes | None:
    """Receive one frame's payload, or None if the stream closed cleanly between frames."""
    header = await _receive_exactly(stream, HEADER_BYTES, "header")
    if header is None:
        return None
    size = _body_size(header, max_size)
    if size == 0:
        return b""
    body = await _receive_exactly(stream, size, "body")
    if body is None:
        raise _truncated("body", 0, size)
    return bytes(body)


def send_frame_sync(sock: socket.socket, payload: bytes, max_size: int = MAX_FRAME_BYTES) -> None:
    """Blocking `send_frame` for a plain socket."""
    sock.sendall(_header(payload, max_size) + payload)


def _receive_exactly_sync(sock: socket.socket, size: int, what: str) -> bytearray | None:
    """`size` bytes, or None if the socket reaches end of stream before the first of them."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    received = 0
    while received < size:
        count = sock.recv_into(view[received:], min(size - received, _CHUNK_BYTES))
        if count == 0:
            if received == 0:
                return None
            raise _truncated(what, received, size)
        received += count
    return buffer


def receive_frame_sync(sock: socket.socket, max_size: int = MAX_FRAME_BYTES) -> bytes | None:
    """Blocking `receive_frame` for a plain socket."""
    header = _receive_exactly_sync(sock, HEADER_BYTES, "header")
    if header is None:
        return None
    size = _body_size(header, max_size)
    if size == 0:
        return b""
    body = _receive_exactly_sync(sock, size, "body")
    if body is None:
        raise _truncated("body", 0, size)
    return bytes(body)
