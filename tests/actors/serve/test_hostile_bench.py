"""benchmarks/hostile_http.py, small: its scenarios run, its attacks reach the server
and are refused as the door refuses them, and the well-behaved clients are served."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "hostile_http.py"


def test_the_hostile_http_benchmark_attacks_and_reports():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--seconds", "1.5", "--clients", "2", "--slow", "30",
         "--slow-peers", "3"], capture_output=True, text=True, timeout=120, env=os.environ)
    assert result.returncode == 0, result.stderr[-2000:]
    alone, attacked, comparison = (json.loads(line) for line in result.stdout.strip().splitlines())
    assert alone["scenario"] == "alone" and attacked["scenario"] == "attacked"
    for scenario in (alone, attacked):
        assert scenario["num_requests"] > 0 and scenario["num_refused"] == 0
        assert scenario["num_health"] > 0 and scenario["health_p99_ms"] is not None
    attack = attacked["attack"]
    assert attack["opened"] >= 30
    # Every flood was refused (answered 400, or cut off mid-body by the refusal).
    floods = {name: count for name, count in attack.items() if name.startswith(("chunk_flood", "long_chat"))}
    assert floods and all(name.endswith(("_400", "_BrokenResourceError")) for name in floods), floods
    assert comparison["num_refused"] == 0 and comparison["p99_ratio"] is not None
