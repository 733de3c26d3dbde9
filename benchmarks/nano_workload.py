"""The offline throughput workload of nano-vllm's bench.py, token for token.

The workload lives in the package (`cadence.actors.workloads`: `nano`,
`scaled`, `draw`, `Workload`), so that `cadence bench --workload nano-vllm`
runs from a wheel; this script prints its totals:

    python benchmarks/nano_workload.py            # prints the totals
"""

from __future__ import annotations

import argparse
import json

from cadence.actors.workloads import (  # noqa: F401  (the benchmarks import them from here)
    EXPECTED_OUTPUT_TOKENS, MAX_INPUT_LEN, MAX_OUTPUT_LEN, MAX_TOKEN_ID, MIN_LEN,
    NANO_TEMPERATURE, NUM_REQUESTS, Workload, draw, nano, scaled,
)


def main() -> int:
    """Print the workload's totals as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=NUM_REQUESTS)
    parser.add_argument("--max-input", type=int, default=MAX_INPUT_LEN)
    parser.add_argument("--max-output", type=int, default=MAX_OUTPUT_LEN)
    args = parser.parse_args()
    print(json.dumps(scaled(args.num_requests, args.max_input, args.max_output).summary()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
