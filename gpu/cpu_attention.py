"""The CPU's paged decode attention kernel (`cpu_attention.cpp`), built on first use.

The kernel reads each sequence's keys and values from their cache blocks in
place and attends for a KV head's whole group of query heads at once, in
float32. It is compiled with torch's C++ extension builder the first time a
process asks for it (about a minute; needs a C++ compiler and ninja) and cached
under torch's extension directory, keyed by the source and this CPU's
instruction sets, so a process on another kind of CPU builds its own.
Where it cannot be built, `load` says why and the "cpu" attention backend
falls back to SDPA over gathered blocks.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

_log = logging.getLogger("cadence.gpu")
SOURCE = Path(__file__).with_name("cpu_attention.cpp")
_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def build_name() -> str:
    """The extension's name: the source and the CPU's flags decide it (-march=native)."""
    digest = hashlib.sha256(SOURCE.read_bytes() + _cpu_flags().encode()).hexdigest()[:12]
    return f"cadence_cpu_attention_{digest}"


def load():
    """The compiled kernel module, or None when it cannot be built here (see `unavailable_reason`)."""
    with _lock:
        if "module" in _state or "error" in _state:
            return _state.get("module")
        try:
            from torch.utils import cpp_extension

            flags = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
            _state["module"] = cpp_extension.load(
                name=build_name(), sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                verbose=False)
        except Exception as exc:  # noqa: BLE001 - any build failure means: fall back, and say why
            _state["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
            _log.warning("CPU paged attention kernel unavailable (%s); attention gathers blocks for SDPA",
                         _state["error"])
            return None
        return _state["module"]


def unavailable_reason() -> str | None:
    """Why `load` returned None, or None if it has not failed."""
    return _state.get("error")
