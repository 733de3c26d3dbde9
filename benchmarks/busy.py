"""Busy-looping processes to run beside a benchmark: the "machine under load" condition."""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager
from typing import Iterator

BUSY_LOOP = "while True: pass"


@contextmanager
def busy_processes(count: int) -> Iterator[list[subprocess.Popen]]:
    """Start `count` Python processes that spin on one core each; kill them on exit."""
    if count < 0:
        raise ValueError(f"busy process count must be >= 0, got {count}")
    processes = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(count)]
    try:
        yield processes
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.wait()
