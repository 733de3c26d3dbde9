"""Helpers shared by the server, client, metrics, fuzz and load tests (no tests here).

Everything runs on loopback against a real socket; the engine is the simulated
executor, so expected tokens are known in advance (`expected_tokens`).
"""

from __future__ import annotations

import os
import socket

import trio

from cadence.actors.engine import EngineConfig
from cadence.actors.serve.server import Server, ServerConfig
from cadence.actors.simulated import ZERO_LATENCY, LatencyModel, simulated_token
from cadence.actors.wire import (
    MAX_REPLY_FRAME_BYTES, FrameBuffer, Hello, Welcome, decode_reply, encode, pack_frame,
)

# The simulated executor paired with the byte tokenizer samples printable ASCII.
PRINTABLE_IDS = tuple(range(32, 127))
BYTE_VOCAB = 257
BYTE_EOS = 256
# One simulated step takes this long in the tests that need a request to stay
# live while something else happens (abort, disconnect, shutdown).
SLOW_STEP = LatencyModel(base_us=1000.0, prefill_us_per_token=0.0, decode_us_per_seq=0.0)
# Upper bound on any single wait in these tests; generous for a loaded 2-core CI machine.
WAIT_S = 30.0


def engine_config(latency: LatencyModel = ZERO_LATENCY, **kwargs) -> EngineConfig:
    """A small simulated engine."""
    options = dict(max_num_seqs=64, num_blocks=1024, max_model_len=8192, max_num_batched_tokens=8192)
    options.update(kwargs)
    options.setdefault("executor", "simulated")
    return EngineConfig.from_kwargs(latency=latency, **options)


def server_config(**kwargs) -> ServerConfig:
    """A loopback server on a free port."""
    kwargs.setdefault("port", 0)
    return ServerConfig(**kwargs)


def expected_tokens(request_id: str, num_prompt_tokens: int, num_tokens: int, seed: int = 0) -> list[int]:
    """What the simulated executor generates for this request."""
    return [simulated_token(seed, request_id, num_prompt_tokens + k, vocab_size=BYTE_VOCAB,
                            eos_token_id=BYTE_EOS, sample_ids=PRINTABLE_IDS)
            for k in range(num_tokens)]


def assert_engine_clean(server: Server) -> None:
    """No live request anywhere, every KV block free, no stream accounted."""
    engine = server.engine
    core = engine.core
    assert not core.requests, f"live requests left: {list(core.requests)[:5]}"
    assert not engine.scheduler.actors
    assert core.blocks.num_used_blocks == 0, f"{core.blocks.num_used_blocks} blocks still in use"
    assert server.num_inflight == 0
    assert not server.tenant_inflight
    for conn in server.connections.values():
        assert not conn.streams


async def settled(server: Server) -> None:
    """Wait until the engine is idle and every stream task has ended, then
    `assert_engine_clean`."""
    with trio.fail_after(WAIT_S):
        await server.engine.wait_idle()
    await wait_until(lambda: server.num_inflight == 0, what="stream tasks ending")
    assert_engine_clean(server)


async def wait_until(predicate, timeout_s: float = WAIT_S, what: str = "condition") -> None:
    """Poll a condition of the server's state (checked every 5 ms) until it holds."""
    with trio.move_on_after(timeout_s):
        while not predicate():
            await trio.sleep(0.005)
        return
    raise AssertionError(f"{what} did not hold within {timeout_s} s")


class RawConnection:
    """A client that speaks raw frames, for sending what no real client would."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = FrameBuffer(MAX_REPLY_FRAME_BYTES)
        self.eof = False

    @classmethod
    async def open(cls, server: Server, unix: bool = False, rcvbuf: int | None = None) -> RawConnection:
        """Connect (TCP unless `unix`), without saying Hello."""
        if unix:
            return cls(await trio.open_unix_socket(server.unix_path))
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        await sock.connect(server.tcp_address)
        return cls(trio.SocketStream(sock))

    @classmethod
    async def greeted(cls, server: Server, token: str | None = None, **kwargs) -> RawConnection:
        """Connect and complete the handshake."""
        conn = await cls.open(server, **kwargs)
        await conn.send(Hello(token=token))
        welcome = await conn.receive()
        assert type(welcome) is Welcome, welcome
        return conn

    async def send(self, message) -> None:
        await self.stream.send_all(pack_frame(encode(message)))

    async def send_bytes(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def receive(self, timeout_s: float = WAIT_S):
        """The next message, or None at end of stream."""
        with trio.fail_after(timeout_s):
            while True:
                frame = self.buffer.next_frame()
                if frame is not None:
                    return decode_reply(frame)
                if self.eof:
                    return None
                try:
                    data = await self.stream.receive_some(1 << 16)
                except (trio.BrokenResourceError, ConnectionResetError):
                    data = b""
                if not data:
                    self.eof = True
                else:
                    self.buffer.feed(data)

    async def receive_all(self, timeout_s: float = WAIT_S) -> list:
        """Every message until end of stream."""
        out = []
        with trio.fail_after(timeout_s):
            while (message := await self.receive()) is not None:
                out.append(message)
        return out

    async def aclose(self) -> None:
        await self.stream.aclose()


def fd_limit() -> int:
    """The soft limit on open file descriptors of this process."""
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def explore() -> bool:
    """Whether CADENCE_EXPLORE=1 asks for the long randomised runs."""
    return os.environ.get("CADENCE_EXPLORE") == "1"
