"""Length-prefixed frames: payloads arrive whole however the bytes are split, the limit is
checked before the body is read, and a clean close differs from a truncated frame."""

from __future__ import annotations

import os
import socket
import struct

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from cadence.actors.framing import (
    HEADER_BYTES,
    receive_frame,
    receive_frame_sync,
    send_frame,
    send_frame_sync,
)
from cadence.statemachine.errors import ProtocolError


def examples(count: int) -> settings:
    """`count` examples normally; the profile's (many more) under CADENCE_EXPLORE=1."""
    if os.environ.get("CADENCE_EXPLORE") == "1":
        return settings()
    return settings(max_examples=count)


class ScriptedStream(trio.abc.ReceiveStream):
    """Hands out `data` in pieces no larger than the next of `piece_sizes`, then EOF."""

    def __init__(self, data: bytes, piece_sizes: list[int] | None = None) -> None:
        self.data = data
        self.offset = 0
        self.piece_sizes = list(piece_sizes or [])

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """The next piece, b"" once everything is handed out."""
        await trio.lowlevel.checkpoint()
        size = self.piece_sizes.pop(0) if self.piece_sizes else len(self.data)
        size = min(size, max_bytes or len(self.data), len(self.data) - self.offset)
        piece = self.data[self.offset:self.offset + size]
        self.offset += size
        return piece

    async def aclose(self) -> None:
        """Nothing to release."""


def _frames(*payloads: bytes) -> bytes:
    return b"".join(struct.pack(">I", len(p)) + p for p in payloads)


@examples(100)
@given(st.lists(st.binary(max_size=300), max_size=5), st.lists(st.integers(1, 7), max_size=200))
async def test_frames_survive_any_split(payloads, piece_sizes):
    stream = ScriptedStream(_frames(*payloads), piece_sizes)
    received = []
    while (frame := await receive_frame(stream)) is not None:
        received.append(frame)
    assert received == payloads
    assert stream.offset == len(stream.data)


async def test_send_then_receive_over_a_memory_stream():
    send_stream, receive_stream = trio.testing.memory_stream_pair()
    payloads = [b"", b"x", os.urandom(3 * 1024 * 1024 + 5)]
    async with trio.open_nursery() as nursery:
        async def sender():
            """Send every payload, then close."""
            for payload in payloads:
                await send_frame(send_stream, payload)
            await send_stream.aclose()
        nursery.start_soon(sender)
        assert [await receive_frame(receive_stream) for _ in payloads] == payloads
        assert await receive_frame(receive_stream) is None


@pytest.mark.parametrize("cut", [1, HEADER_BYTES - 1])
async def test_end_of_stream_inside_the_header_is_truncation(cut):
    with pytest.raises(ProtocolError, match=f"inside a frame header: got {cut} of 4 bytes"):
        await receive_frame(ScriptedStream(_frames(b"hello")[:cut]))


async def test_end_of_stream_inside_the_body_is_truncation():
    stream = ScriptedStream(_frames(b"first", b"hello")[:-2])
    assert await receive_frame(stream) == b"first"
    with pytest.raises(ProtocolError, match="inside a frame body: got 3 of 5 bytes"):
        await receive_frame(stream)


async def test_end_of_stream_right_after_a_header_is_truncation():
    with pytest.raises(ProtocolError, match="inside a frame body: got 0 of 5 bytes"):
        await receive_frame(ScriptedStream(_frames(b"hello")[:HEADER_BYTES]))
    left, right = socket.socketpair()
    with left, right:
        left.sendall(_frames(b"hello")[:HEADER_BYTES])
        left.shutdown(socket.SHUT_WR)
        with pytest.raises(ProtocolError, match="inside a frame body: got 0 of 5 bytes"):
            receive_frame_sync(right)


async def test_end_of_stream_between_frames_is_a_clean_close():
    stream = ScriptedStream(_frames(b"only"))
    assert await receive_frame(stream) == b"only"
    assert await receive_frame(stream) is None


async def test_oversize_frame_is_rejected_before_its_body_is_read():
    stream = ScriptedStream(_frames(b"x" * 101))
    with pytest.raises(ProtocolError, match="declares 101 bytes, over the limit of 100"):
        await receive_frame(stream, max_size=100)
    assert stream.offset == HEADER_BYTES
    declared_huge = ScriptedStream(struct.pack(">I", 2**32 - 1))
    with pytest.raises(ProtocolError, match="over the limit"):
        await receive_frame(declared_huge)


async def test_oversize_send_is_refused_and_sends_nothing():
    send_stream, receive_stream = trio.testing.memory_stream_pair()
    with pytest.raises(ProtocolError, match="exceeds the limit of 3"):
        await send_frame(send_stream, b"four", max_size=3)
    await send_stream.aclose()
    assert await receive_frame(receive_stream) is None


def test_sync_frames_over_a_socketpair():
    left, right = socket.socketpair()
    with left, right:
        # Small enough to sit in the socket buffer, so one thread can do both ends.
        for payload in (b"", b"abc", os.urandom(10_000)):
            send_frame_sync(left, payload)
            assert receive_frame_sync(right) == payload
        left.shutdown(socket.SHUT_WR)
        assert receive_frame_sync(right) is None


def test_sync_truncation_and_oversize():
    left, right = socket.socketpair()
    with left, right:
        left.sendall(_frames(b"hello")[:-1])
        left.shutdown(socket.SHUT_WR)
        with pytest.raises(ProtocolError, match="inside a frame body: got 4 of 5 bytes"):
            receive_frame_sync(right)
    left, right = socket.socketpair()
    with left, right:
        left.sendall(_frames(b"x" * 11))
        with pytest.raises(ProtocolError, match="declares 11 bytes"):
            receive_frame_sync(right, max_size=10)
        with pytest.raises(ProtocolError, match="exceeds the limit"):
            send_frame_sync(left, b"x" * 11, max_size=10)


async def test_sync_and_async_sides_interoperate_with_large_frames():
    # The sync side runs in a thread, as the worker process would run it.
    left, right = socket.socketpair()
    payloads = [os.urandom(n) for n in (0, 1, 5 * 1024 * 1024)]

    def echo_back() -> None:
        """Answer each frame with its bytes reversed until end of stream."""
        while (frame := receive_frame_sync(right)) is not None:
            send_frame_sync(right, frame[::-1])
        right.close()

    stream = trio.SocketStream(trio.socket.from_stdlib_socket(left))
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, echo_back)
            for payload in payloads:
                await send_frame(stream, payload)
                assert await receive_frame(stream) == payload[::-1]
            await stream.send_eof()
            assert await receive_frame(stream) is None
    await stream.aclose()
