"""How long torch's OpenMP threads spin before they sleep, set before torch loads.

GNU OpenMP (the runtime torch's CPU builds carry) keeps a thread that reaches a
barrier or finishes its share spinning for 300,000 rounds, about a millisecond
here, before it sleeps. On a quiet machine that spin keeps the team warm between
kernels. Beside other busy processes it is time taken from whoever holds the
other cores, and a team member waiting for a core stalls every kernel of the
step: with two busy processes on a 2-core machine, a 2-thread decode ran 2-2.5x
slower than with a tenth of the spin (benchmarks/cpu_peers.py offline --busy 2),
while the quiet run kept its speed.

The runtime reads the count once, when it loads, and offers no call to change it
later: so this is set when Cadence's model executor is imported, and only where
torch is not loaded yet and the user set neither `GOMP_SPINCOUNT` nor
`OMP_WAIT_POLICY` (both left as they are).

Which count is set is decided then, by watching the cores this process may run on
for a moment (`busy_cores`): where other processes keep at least half a core busy,
the shorter `CONTENDED_SPIN_COUNT` (the log's "CPU path" line says which, and why).
Measured on the 2-core machine beside two busy processes, serving the 125M model to
32 clients: 1.90-2.20 requests/s against 1.58-1.65 with `SPIN_COUNT`; on a quiet
machine the shorter spin cost 15% at batch 8 (threads that fall asleep between
kernels wake late), so it is not the default.
"""

from __future__ import annotations

import os
import sys
import time

# Rounds a waiting OpenMP thread spins before it sleeps; GNU OpenMP's own default is 300,000.
SPIN_COUNT = 100_000
# The same where other processes were busy on this process's cores when it loaded.
CONTENDED_SPIN_COUNT = 10_000
# How long the cores are watched, and the cores other processes must keep busy meanwhile
# for the shorter spin.
SAMPLE_S = 0.15
NEIGHBOUR_CORES = 0.5
USER_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


# What `set_spin_count` found: "set", "user" (the user's own setting) or "torch first".
_found = "not asked"
# Cores other processes kept busy while `set_spin_count` watched (None: not watched, or unreadable).
_neighbour_cores: float | None = None


def _cpu_times(path: str = "/proc/stat") -> dict[int, tuple[int, int]]:
    """(busy, total) clock ticks of each CPU, by number, from Linux's /proc/stat."""
    times = {}
    with open(path) as stat:
        for line in stat:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit():
                ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
                idle = ticks[3] + ticks[4]
                times[int(name[3:])] = (sum(ticks) - idle, sum(ticks))
    return times


def busy_cores(sample_s: float = SAMPLE_S, read=_cpu_times, sleep=time.sleep) -> float | None:
    """Cores of this process's CPU set that other processes (or the hypervisor) kept busy
    over `sample_s` seconds; None where the counters cannot be read."""
    try:
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        before, own_before = read(), time.process_time()
        sleep(sample_s)
        after, own = read(), time.process_time() - own_before
    except (OSError, ValueError, IndexError):
        return None
    busy = 0.0
    for cpu, (busy_after, total_after) in after.items():
        if cpu not in before or (allowed is not None and cpu not in allowed):
            continue
        elapsed = total_after - before[cpu][1]
        if elapsed > 0:
            busy += (busy_after - before[cpu][0]) / elapsed
    return max(0.0, busy - own / sample_s) if before else None


def set_spin_count() -> None:
    """Set `GOMP_SPINCOUNT` for the OpenMP runtime torch is about to load (see the module's docstring)."""
    global _found, _neighbour_cores
    if any(name in os.environ for name in USER_SETTINGS):
        _found = "user"
    elif "torch" in sys.modules:
        _found = "torch first"
    else:
        _neighbour_cores = busy_cores()
        os.environ["GOMP_SPINCOUNT"] = str(spin_count_for(_neighbour_cores))
        _found = "set"


def spin_count_for(neighbour_cores: float | None) -> int:
    """The spin count for cores kept busy by other processes (None: not known)."""
    contended = neighbour_cores is not None and neighbour_cores >= NEIGHBOUR_CORES
    return CONTENDED_SPIN_COUNT if contended else SPIN_COUNT


def describe() -> str:
    """The spin setting the OpenMP runtime runs with, in words, for the runner's log."""
    settings = ", ".join(f"{name}={os.environ[name]}" for name in USER_SETTINGS if name in os.environ)
    if _found == "torch first":
        return ("OpenMP spin: the runtime's default (torch was imported before cadence; import "
                "cadence first, or set GOMP_SPINCOUNT, to spin less beside busy neighbours)")
    if _found == "set" and _neighbour_cores is not None:
        settings += (f" (other processes kept {_neighbour_cores:.1f} cores busy when cadence loaded;"
                     f" {CONTENDED_SPIN_COUNT} where they keep {NEIGHBOUR_CORES} or more, else {SPIN_COUNT})")
    return f"OpenMP spin: {settings or 'the runtime default'}"
