"""`cadence serve` as a process: it prints where it listens, drains on SIGTERM and
SIGINT, exits 0, and reports user errors in one line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from cadence.actors.client import Client
from cadence.actors.wire import ServerShutdownError

_WAIT_S = 60.0
_SERVE = [sys.executable, "-m", "cadence.actors.serve.server"]


def start_serve(*args: str, preexec_fn=None, model: str = "simulated") -> tuple[subprocess.Popen, tuple[str, int]]:
    """Start `serve` on a free port with `model` (the simulated one steps every
    millisecond; `preexec_fn` runs in the child before it starts); return it and
    its address once it listens."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CADENCE_TOKEN", None)
    timing = ["--sim-step-us", "1000"] if model == "simulated" else []
    process = subprocess.Popen([*_SERVE, "--port", "0", "--model", model, *timing, *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               preexec_fn=preexec_fn)
    line = process.stdout.readline()  # blocks until the server prints it (or dies)
    match = re.search(r"tcp://([\d.]+):(\d+)", line)
    if match is None:
        process.kill()
        raise AssertionError(f"unexpected first line {line!r}; stderr: {process.stderr.read()}")
    return process, (match.group(1), int(match.group(2)))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_drains_running_requests_then_exits_0(signum):
    process, address = start_serve("--shutdown-grace-s", "60")
    try:
        with Client.connect(address, timeout_s=_WAIT_S) as client:
            stream = client.generate([1, 2, 3], max_tokens=300, ignore_eos=True)
            first = next(stream)
            process.send_signal(signum)
            outputs = [first, *stream]
            assert outputs[-1].finish_reason == "length" and outputs[-1].num_tokens == 300
        assert process.wait(_WAIT_S) == 0
        assert "stopped" in process.stdout.read()
    finally:
        process.kill()


def test_requests_outliving_the_grace_end_with_a_shutdown_error():
    process, address = start_serve("--shutdown-grace-s", "0.1")
    try:
        with Client.connect(address, timeout_s=_WAIT_S) as client:
            stream = client.generate([1, 2, 3], max_tokens=4000, ignore_eos=True)
            next(stream)
            process.send_signal(signal.SIGTERM)
            with pytest.raises(ServerShutdownError):
                for _ in stream:
                    pass
        assert process.wait(_WAIT_S) == 0
    finally:
        process.kill()


def test_token_file_is_enforced(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("hunter2\n")
    process, address = start_serve("--token-file", str(token_file))
    try:
        with Client.connect(address, token="hunter2", timeout_s=_WAIT_S) as client:
            assert client.health().status == "ok"
        process.send_signal(signal.SIGTERM)
        assert process.wait(_WAIT_S) == 0
    finally:
        process.kill()


@pytest.mark.parametrize("args, message", [
    (["--no-tcp"], "--no-tcp needs --unix PATH"),
    (["--token-file", "/nonexistent/token"], "cannot read the token file"),
    (["--host", "example.org"], "--host must be an IP address"),
    (["--max-connections", "0"], "max_connections must be > 0"),
])
def test_user_errors_print_one_line_without_a_traceback(args, message):
    result = subprocess.run([*_SERVE, *args], capture_output=True, text=True, timeout=_WAIT_S)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_help_describes_the_options():
    result = subprocess.run([*_SERVE, "--help"], capture_output=True, text=True, timeout=_WAIT_S)
    assert result.returncode == 0
    for option in ("--host", "--unix", "--token-file", "--max-inflight-per-tenant", "--metrics-port",
                   "--shutdown-grace-s", "--model"):
        assert option in result.stdout


def test_the_serving_process_freezes_startup_and_collects_less_often():
    """`settle_collector` (run once `serve` listens) in a fresh interpreter: startup's
    objects leave the collected generations and generation 0 waits for
    SERVER_GC_THRESHOLD0 allocations, the older thresholds unchanged."""
    code = ("import gc; from cadence.actors.serve.server import settle_collector, SERVER_GC_THRESHOLD0;"
            "before = gc.get_threshold(); settle_collector(); after = gc.get_threshold();"
            "print(before[1:] == after[1:], after[0] == SERVER_GC_THRESHOLD0 != before[0],"
            " gc.get_freeze_count() > 1000, len(gc.get_objects()) < gc.get_freeze_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True"] * 4
