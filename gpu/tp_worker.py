"""One rank of a tensor-parallel model, started by a launcher or by `parallel.start_local_runner`.

    torchrun --nproc-per-node 2 -m cadence.gpu.tp_worker --spec '{"model": DIR, "num_blocks": 64}' \\
        --replay plans.msgpack --out tokens.json

The rendezvous comes from the environment (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE, LOCAL_RANK), so any launcher that sets those works, on one machine
or several. Ranks other than 0 serve rank 0's step plans until it stops them.
Rank 0 either is the engine's executor (local spawn: this module is then only
run for the other ranks) or, with ``--replay``, executes a file of encoded step
commands and writes the sampled tokens of each step as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgpack
import torch

from .parallel import (
    DEFAULT_TIMEOUT_S,
    OP_STEP,
    build_rank_runner,
    decode_command,
    init_rank_group,
)

__all__ = ["main", "replay", "follow_launched"]


def replay(runner, commands: list[bytes], out_path: Path) -> None:
    """Execute encoded step commands on rank 0 and write each step's sampled tokens as a JSON line."""
    with out_path.open("w") as out:
        for payload in commands:
            op, plan, sampling = decode_command(payload)
            if op != OP_STEP:
                continue
            result = runner.execute(plan, sampling)
            out.write(json.dumps({"step_id": result.step_id, "sampled": result.sampled_token_ids}) + "\n")


def follow_launched(timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """A non-zero rank under a launcher running `cadence ...`: take rank 0's runner
    spec, build this shard, and serve rank 0's steps until it stops them."""
    from .parallel import join_launched_group

    runner = join_launched_group(None, timeout_s)
    try:
        runner.follow()
    finally:
        runner.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Join the process group, build this rank's shard, then serve (rank > 0) or replay (rank 0)."""
    parser = argparse.ArgumentParser(prog="python -m cadence.gpu.tp_worker")
    parser.add_argument("--spec", required=True,
                        help='JSON: {"model": preset or directory, plus ModelRunner options}')
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                        help="how long a collective waits for a peer")
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads of this rank")
    parser.add_argument("--replay", type=Path, default=None, help="rank 0: msgpack list of encoded step commands")
    parser.add_argument("--out", type=Path, default=None, help="rank 0: where to write the sampled tokens")
    args = parser.parse_args(argv)
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    spec = json.loads(args.spec)
    group = init_rank_group(spec.get("device", "auto"), args.timeout_s)
    runner = build_rank_runner(group, spec)
    if group.rank != 0:
        runner.follow()
        runner.close()
        return 0
    if args.replay is None or args.out is None:
        print("tp_worker: rank 0 needs --replay and --out when started by a launcher", file=sys.stderr)
        runner.close()
        return 2
    try:
        replay(runner, msgpack.unpackb(args.replay.read_bytes()), args.out)
    finally:
        runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
