"""Deterministic request traces for replaying through the scheduler.

The presets, the token-id scheme and the JSON-lines format live in the package
(`cadence.actors.workloads`, so that `cadence bench` runs from a wheel); this
script writes a preset's trace:

    python benchmarks/workloads.py prefix -o prefix.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys

from cadence.actors.workloads import (  # noqa: F401  (the benchmarks import them from here)
    ENGINE_DEFAULTS, PRESETS, STARVATION_STEP, STARVATION_VICTIM, engine_config, generate, load,
    output_token, prompt_tokens,
    splitmix64, token_id,
)


def main(argv: list[str] | None = None) -> int:
    """Write a preset's trace as JSON lines."""
    ap = argparse.ArgumentParser(description="Write a preset trace as JSON lines.")
    ap.add_argument("preset", choices=sorted(PRESETS))
    ap.add_argument("-o", "--out", default="-")
    args = ap.parse_args(argv)
    text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in generate(args.preset))
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
