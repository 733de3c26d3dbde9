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
"""

from __future__ import annotations

import os
import sys

# Rounds a waiting OpenMP thread spins before it sleeps; GNU OpenMP's own default is 300,000.
SPIN_COUNT = 100_000
USER_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


# What `set_spin_count` found: "set", "user" (the user's own setting) or "torch first".
_found = "not asked"


def set_spin_count() -> None:
    """Set `GOMP_SPINCOUNT` for the OpenMP runtime torch is about to load (see the module's docstring)."""
    global _found
    if any(name in os.environ for name in USER_SETTINGS):
        _found = "user"
    elif "torch" in sys.modules:
        _found = "torch first"
    else:
        os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
        _found = "set"


def describe() -> str:
    """The spin setting the OpenMP runtime runs with, in words, for the runner's log."""
    settings = ", ".join(f"{name}={os.environ[name]}" for name in USER_SETTINGS if name in os.environ)
    if _found == "torch first":
        return ("OpenMP spin: the runtime's default (torch was imported before cadence; import "
                "cadence first, or set GOMP_SPINCOUNT, to spin less beside busy neighbours)")
    return f"OpenMP spin: {settings or 'the runtime default'}"
