"""A `cadence serve` child process on the simulated model, for the benchmarks that
measure a server from outside (its own process, so its CPU time is its own)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from contextlib import contextmanager
from typing import Iterator, NamedTuple

_STOP_WAIT_S = 30.0


class ServedChild(NamedTuple):
    """The child process and the addresses it printed (http is None without HTTP)."""

    process: subprocess.Popen
    tcp: tuple[str, int]
    http: tuple[str, int] | None


@contextmanager
def serve_child(*options: str, num_signals: int = 1) -> Iterator[ServedChild]:
    """Start `cadence serve --port 0 --model simulated *options`, yield where it listens,
    then stop it with `num_signals` SIGTERMs (a second one cuts the drain short)."""
    command = [sys.executable, "-m", "cadence.actors.serve.server", "--port", "0",
               "--model", "simulated", *options]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    tcp = re.search(r"tcp://([\d.]+):(\d+)", line)
    http = re.search(r"http://([\d.]+):(\d+)/v1", line)
    if tcp is None:
        process.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    try:
        yield ServedChild(process, (tcp.group(1), int(tcp.group(2))),
                          (http.group(1), int(http.group(2))) if http else None)
    finally:
        for _ in range(num_signals):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()


def cpu_s(pid: int) -> float | None:
    """CPU seconds (user and system) a process has used so far; None where /proc is missing."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # After the command name: state is field 3, utime and stime fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
