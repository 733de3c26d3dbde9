"""How many threads torch's CPU kernels may use while a runner computes.

torch splits each matrix product and elementwise kernel across an OpenMP team
whose threads spin at every barrier. When the model's products are small, or
other processes want the same cores, a team member waiting for a core stalls
every kernel of the step: on a 2-core machine shared with two busy processes a
decode step of a small model took 30-100 times longer with 2 threads than with
1. So the runner sets its own count before its first kernel, in the thread that
runs the model, instead of inheriting torch's default (every core).

The "auto" policy: 1 thread for models whose per-token work is too small to
split profitably, else half the cores this process may run on, so that a few
competing processes still leave every team member a core.

A team of two or more compute threads is then pinned one thread per core
(`pin_compute_threads`), on the cores of the process's set its other runners took
least, as vLLM's CPU backend binds its OpenMP threads: a team member the scheduler
moves between cores loses its caches and, at a barrier, stalls the others; the
engine's own threads (event loop, clients) keep the remaining cores. A single
compute thread has no barrier to stall and is left to the kernel's scheduler:
pinned beside neighbours it shares its one core with one of them for the whole
run, while unpinned it runs wherever a core frees. Measured on the 125M benchmark
model, bfloat16, one thread, 2 cores, two busy processes beside it: 96-130 tokens/s
unpinned against 81-92 pinned at batch 1, 458-478 against 353-368 at batch 8 and
587-599 against 442-474 at batch 64; on the quiet machine the same within noise.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from pathlib import Path

import torch

from cadence.statemachine.errors import ConfigError

from .config import SMALL_MODEL_MACS, ModelConfig, macs_per_token

AUTO = "auto"
# Share of the usable cores the auto policy takes for larger models.
CORE_SHARE = 2
# Elements per thread of the kernel that starts an OpenMP team: past torch's grain size.
TEAM_START_ELEMENTS = 1 << 16


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def auto_num_threads(config: ModelConfig, num_cores: int) -> int:
    """The "auto" policy's thread count for `config` on `num_cores` usable cores."""
    if macs_per_token(config) < SMALL_MODEL_MACS:
        return 1
    return max(1, num_cores // CORE_SHARE)


def resolve_num_threads(value: int | str | None, config: ModelConfig, device: torch.device) -> int | None:
    """The thread count to set for `value` ("auto", an int >= 1, or None to leave torch's own).

    On an accelerator the host threads only launch kernels, so "auto" leaves them alone there.
    """
    if value is None:
        return None
    if value == AUTO:
        return auto_num_threads(config, usable_cores()) if device.type == "cpu" else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"num_threads must be 'auto' or an integer >= 1, got {value!r}")
    return value


def set_num_threads(num_threads: int | None) -> None:
    """Set torch's intra-op thread count from the calling thread (None: leave it).

    torch keeps one count per thread, taken from a process-wide default when a
    thread runs its first kernel: the calling thread and threads that have not
    yet run one get `num_threads`; threads that already have keep theirs. The
    inter-op pool is left alone: the runner starts no inter-op work.
    """
    if num_threads is not None and torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)


# Compute threads pinned to each core by this process's runners so far.
_pins: Counter[int] = Counter()
_pins_lock = threading.Lock()


def _thread_ids() -> set[int]:
    try:
        return {int(name) for name in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def pin_compute_threads(num_threads: int | None) -> tuple[int, ...] | None:
    """Pin the calling thread and the OpenMP team it leads to one core each; the cores
    used, or None where nothing was pinned (no count set, a single thread (see the
    module's docstring), more threads than usable cores, or no way to pin on this
    platform).

    Call it from the thread that runs the model, after `set_num_threads`: its first
    parallel kernel here starts the team, whose threads are told apart as the ones
    that appear meanwhile.
    """
    if num_threads is None or num_threads < 2:
        return None
    if not hasattr(os, "sched_setaffinity") or not Path("/proc/self/task").is_dir():
        return None
    cores = sorted(os.sched_getaffinity(0))
    if num_threads > len(cores):
        return None
    with _pins_lock:
        # The cores this process's runners have taken least, the last ones first, so
        # that several engines of one process do not share a core while others idle.
        chosen = tuple(sorted(sorted(cores, reverse=True), key=_pins.__getitem__)[:num_threads])
        _pins.update(chosen)
    before = _thread_ids()
    os.sched_setaffinity(0, {chosen[0]})
    torch.ones(num_threads * TEAM_START_ELEMENTS).add_(1.0)  # runs on the whole team
    team = sorted(_thread_ids() - before - {threading.get_native_id()})
    for core, thread_id in zip(chosen[1:], team):
        try:
            os.sched_setaffinity(thread_id, {core})
        except OSError:
            return None
    return chosen
