"""Cold start of the README's first command: `cadence generate "def " --max-tokens 1`.

Each run starts a fresh process and times, from just before the spawn, the
moment the first generated text reaches its stdout (the prompt's echo does not
count) and the moment the process exits. The result is one JSON line with the
median (and every run) of both.

Beside each run it times a fresh interpreter that imports torch and prints one
character, to that character: the floor any command that runs a torch model
pays on this machine at this moment. The ratio of the two says how much
Cadence adds, whatever else the machine is doing.

An installed package has its bytecode compiled (pip does it at install time),
so the runs let Python write bytecode caches even where PYTHONDONTWRITEBYTECODE
is set, and one untimed run first fills them and the file cache.

    python benchmarks/cold_start.py            # 5 runs
    python benchmarks/cold_start.py --runs 9 --busy 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from busy import busy_processes  # noqa: E402

PROMPT = "def "
IMPORT_TORCH = (sys.executable, "-c", "import sys, torch; sys.stdout.write('.'); sys.stdout.flush()")
READ_BYTES = 1 << 12


def command(max_tokens: int) -> list[str]:
    """The installed `cadence` script beside this interpreter, else the module it runs."""
    script = Path(sys.executable).with_name("cadence")
    head = [str(script)] if script.exists() else [sys.executable, "-m", "cadence.actors.cli"]
    return [*head, "generate", PROMPT, "--max-tokens", str(max_tokens)]


def child_environment() -> dict[str, str]:
    """This environment, with bytecode caching allowed (as in an installed package)."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def cold_start(argv: list[str] | tuple[str, ...], skip: int = len(PROMPT.encode())) -> dict:
    """Seconds to the first byte on stdout past the first `skip` (the prompt's echo),
    and to the exit, of one fresh process."""
    start = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_environment())
    first_token_s = None
    received = b""
    while chunk := os.read(process.stdout.fileno(), READ_BYTES):
        received += chunk
        if first_token_s is None and len(received) > skip:
            first_token_s = time.perf_counter() - start
    _, stderr = process.communicate()
    total_s = time.perf_counter() - start
    if process.returncode != 0 or first_token_s is None:
        raise RuntimeError(f"{' '.join(argv)} exited with {process.returncode}, stdout {received!r}, "
                           f"stderr {stderr.decode(errors='replace')[-2000:]}")
    return dict(first_token_s=first_token_s, total_s=total_s)


def main(argv: list[str] | None = None) -> int:
    """Time `--runs` cold starts and print one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="cold starts to time (default 5)")
    parser.add_argument("--max-tokens", type=int, default=1, help="tokens each run generates (default 1)")
    parser.add_argument("--busy", type=int, default=0, metavar="N",
                        help="run N busy-looping processes beside it (default 0: quiet)")
    args = parser.parse_args(argv)
    argv_ = command(args.max_tokens)
    runs, torch_s = [], []
    cold_start(argv_)  # untimed: fills the bytecode and file caches
    with busy_processes(args.busy):
        for _ in range(args.runs):
            runs.append(cold_start(argv_))
            torch_s.append(cold_start(IMPORT_TORCH, skip=0)["first_token_s"])
    first = [r["first_token_s"] for r in runs]
    total = [r["total_s"] for r in runs]
    print(json.dumps(dict(
        benchmark="cold_start", command=" ".join([Path(argv_[0]).name, *argv_[1:]]), busy=args.busy,
        num_runs=args.runs, median_first_token_s=round(statistics.median(first), 3),
        median_total_s=round(statistics.median(total), 3),
        median_import_torch_s=round(statistics.median(torch_s), 3),
        first_token_over_import_torch=round(statistics.median(f / t for f, t in zip(first, torch_s)), 3),
        first_token_s=[round(x, 3) for x in first], total_s=[round(x, 3) for x in total],
        import_torch_s=[round(x, 3) for x in torch_s],
        cpus=len(os.sched_getaffinity(0)), load_avg_1m=round(os.getloadavg()[0], 2),
    )), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
