"""`cadence serve` as a process under pressure: out of file descriptors it
refuses the clients it cannot take (no hang, no traceback), and a second
SIGINT closes it at once, even with a client that does not read."""

from __future__ import annotations

import re
import resource
import signal
import socket
import subprocess
import time

from cadence.actors.wire import (
    MAX_REPLY_FRAME_BYTES, Error, FrameBuffer, Generate, Hello, SamplingParams, Welcome,
    decode_reply, encode, pack_frame,
)

from test_server_cli import start_serve

_WAIT_S = 60.0
# Descriptors the server process may hold: enough to start and serve a few
# clients, far fewer than the connections the test opens.
_FD_LIMIT = 64
_NUM_CLIENTS = 3 * _FD_LIMIT


def _start(*args: str, fd_limit: int | None = None) -> tuple[subprocess.Popen, tuple[str, int]]:
    """Start `serve` (with at most `fd_limit` open descriptors); return it and its address."""

    def limit_fds() -> None:
        if fd_limit is not None:
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, hard))

    return start_serve(*args, preexec_fn=limit_fds)


def _receive(sock: socket.socket, buffer: FrameBuffer):
    """The next message, or None at end of stream (a socket timeout fails the test)."""
    while (frame := buffer.next_frame()) is None:
        try:
            data = sock.recv(1 << 16)
        except ConnectionResetError:
            return None
        if not data:
            return None
        buffer.feed(data)
    return decode_reply(frame)


def test_out_of_descriptors_clients_are_refused_promptly_and_without_tracebacks():
    process, address = _start("--log-level", "info", fd_limit=_FD_LIMIT)
    sockets = []
    try:
        answers = []
        for _ in range(_NUM_CLIENTS):
            sock = socket.create_connection(address, timeout=_WAIT_S)
            sockets.append(sock)
            sock.sendall(pack_frame(encode(Hello(client="fd-test"))))
            answers.append(_receive(sock, FrameBuffer(MAX_REPLY_FRAME_BYTES)))
        welcomed = [a for a in answers if type(a) is Welcome]
        refused = [a for a in answers if type(a) is Error]
        # A refused client whose Hello arrives after the server closed may see a
        # reset instead of the Error: closed, never left hanging.
        closed = [a for a in answers if a is None]
        assert welcomed and refused and len(welcomed) + len(refused) + len(closed) == len(answers)
        assert all(e.code == "too_many_connections" and e.fatal for e in refused)
        for sock in sockets:
            sock.close()
        sockets.clear()
        # Once the server has seen those clients leave, a new client is served.
        deadline = time.monotonic() + _WAIT_S
        while True:
            with socket.create_connection(address, timeout=_WAIT_S) as sock:
                sock.sendall(pack_frame(encode(Hello())))
                answer = _receive(sock, FrameBuffer(MAX_REPLY_FRAME_BYTES))
            if type(answer) is Welcome:
                break
            assert answer is None or answer.code == "too_many_connections", answer
            assert time.monotonic() < deadline, "no descriptor came free"
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        assert process.wait(_WAIT_S) == 0
        stderr = process.stderr.read()
        assert "Traceback" not in stderr, stderr[-2000:]
        assert len(re.findall("cannot accept connections", stderr)) <= len(refused)
        assert "accepting connections again" in stderr
    finally:
        for sock in sockets:
            sock.close()
        process.kill()


def test_a_second_sigint_closes_at_once_even_with_a_client_that_does_not_read():
    # Without the second signal the drain would wait for the grace period and
    # for the client that does not read (send timeout), each far longer than _WAIT_S.
    process, address = _start("--shutdown-grace-s", "600", "--send-timeout-s", "600")
    try:
        hog = socket.create_connection(address, timeout=_WAIT_S)
        hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        hog.sendall(pack_frame(encode(Hello())))
        assert type(_receive(hog, FrameBuffer(MAX_REPLY_FRAME_BYTES))) is Welcome
        for sid in range(4):
            hog.sendall(pack_frame(encode(Generate(sid, [1, 2, 3], SamplingParams(
                max_tokens=100_000, ignore_eos=True)))))
        process.send_signal(signal.SIGINT)
        assert "draining" in process.stdout.readline()
        process.send_signal(signal.SIGINT)
        assert process.wait(_WAIT_S) == 0
        assert "stopped" in process.stdout.read()
        hog.close()
    finally:
        process.kill()
