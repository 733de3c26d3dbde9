"""Executor round trip: the cost of one decode step's trip through each executor backend.

A batch of `--requests` requests (prompts of 8 to 23 tokens, so block boundaries
are staggered and a few requests get a new block each step) is admitted in one
prefill step, then `--steps` decode steps are timed: wall time of `execute()`,
from the scheduler actor's side. The runner is the simulated model: "echo"
costs nothing (the figure is the transport alone); "deterministic" also keeps
the persistent batch and hashes each token, as the simulated model in tests
does. Backends: the runner called directly (no executor), in-process (worker
thread), in-process with every message through encode/decode, child process
(msgpack frames over a Unix socket).

Prints one JSON line per (backend, runner). Usage:
    python benchmarks/executor_roundtrip.py
    python benchmarks/executor_roundtrip.py --requests 512 --steps 5000
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import trio

from cadence.actors.executor_worker import DeterministicRunner
from cadence.actors.executors import ChildProcessExecutor, InProcessExecutor
from cadence.actors.messages import ExecuteStep, InitExecutor, StepOutput, encode
from cadence.statemachine.plan import NewRequestData, StepPlan
from cadence.statemachine.sampling import SamplingParams

BLOCK_SIZE = 16
MIN_PROMPT = 8


class Batch:
    """Builds the plans of a steady decode batch, as the scheduler would."""

    def __init__(self, num_requests: int) -> None:
        self.ids = [f"req-{i}" for i in range(num_requests)]
        self.lengths = {rid: MIN_PROMPT + i % BLOCK_SIZE for i, rid in enumerate(self.ids)}
        self.next_block = 0
        self.step_id = 0

    def _blocks(self, count: int) -> list[int]:
        first, self.next_block = self.next_block, self.next_block + count
        return list(range(first, first + count))

    def prefill(self) -> ExecuteStep:
        """The step that admits every request, prompts in full."""
        new = []
        for rid in self.ids:
            length = self.lengths[rid]
            new.append(NewRequestData(rid, list(range(1, length + 1)), length,
                                      self._blocks(-(-(length + 1) // BLOCK_SIZE)), 0))
        plan = self._plan({d.request_id: len(d.token_ids) for d in new}, new, {})
        return ExecuteStep(plan, {rid: SamplingParams(max_tokens=1_000_000, temperature=0.0) for rid in self.ids})

    def decode(self) -> ExecuteStep:
        """One decode step: a token for every request, a new block where one fills up."""
        new_block_ids = {}
        for rid in self.ids:
            self.lengths[rid] += 1
            # The token computed this step is at position length - 1; the token it
            # samples goes at `length`, which may need the next block.
            if self.lengths[rid] % BLOCK_SIZE == 0:
                new_block_ids[rid] = self._blocks(1)
        return ExecuteStep(self._plan(dict.fromkeys(self.ids, 1), [], new_block_ids), {})

    def _plan(self, scheduled: dict[str, int], new: list[NewRequestData], new_block_ids: dict) -> StepPlan:
        plan = StepPlan(self.step_id, scheduled, sum(scheduled.values()), new, new_block_ids, [], [], [])
        self.step_id += 1
        return plan


class DirectExecutor:
    """The runner called on the event loop's thread: the floor under every backend."""

    def __init__(self) -> None:
        self.runner: DeterministicRunner | None = None

    async def start(self, init: InitExecutor) -> None:
        """Build the runner."""
        self.runner = DeterministicRunner(init)

    async def execute(self, step: ExecuteStep) -> StepOutput:
        """Run the step on this thread."""
        return StepOutput(self.runner.execute(step.plan, step.sampling))

    async def aclose(self) -> None:
        """Nothing to release."""


def _init(num_requests: int, runner: str) -> InitExecutor:
    num_blocks = num_requests * 4096 // BLOCK_SIZE
    return InitExecutor("simulated", "float32", "cpu", num_blocks, BLOCK_SIZE, 1 << 20, 1 << 20, 0,
                        {"echo": runner == "echo"})


async def measure(backend: str, runner: str, num_requests: int, num_steps: int, warmup: int) -> dict:
    """Time `num_steps` decode steps through one backend; return the figures."""
    executor = {
        "direct": DirectExecutor,
        "in_process": InProcessExecutor,
        "in_process_codec": lambda: InProcessExecutor(round_trip=True),
        "child_process": ChildProcessExecutor,
    }[backend]()
    batch = Batch(num_requests)
    await executor.start(_init(num_requests, runner))
    await executor.execute(batch.prefill())
    samples_us = []
    plan_bytes = output_bytes = 0
    gc.collect()
    for index in range(warmup + num_steps):
        step = batch.decode()
        start = time.perf_counter_ns()
        output = await executor.execute(step)
        elapsed_us = (time.perf_counter_ns() - start) / 1000
        if index >= warmup:
            samples_us.append(elapsed_us)
        if index == 0:
            plan_bytes, output_bytes = len(encode(step)), len(encode(output))
    await executor.aclose()
    samples_us.sort()
    return {
        "bench": "executor_roundtrip", "backend": backend, "runner": runner,
        "num_requests": num_requests, "num_steps": num_steps,
        "median_us": round(statistics.median(samples_us), 1),
        "p90_us": round(samples_us[int(0.9 * (len(samples_us) - 1))], 1),
        "p99_us": round(samples_us[int(0.99 * (len(samples_us) - 1))], 1),
        "plan_bytes": plan_bytes, "output_bytes": output_bytes,
    }


async def run(args: argparse.Namespace) -> None:
    """Measure every (runner, backend) pair asked for, one JSON line each."""
    for runner in args.runners:
        for backend in args.backends:
            figures = await measure(backend, runner, args.requests, args.steps, args.warmup)
            print(json.dumps(figures), flush=True)


def main() -> None:
    """Parse arguments and print one JSON line per backend and runner."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--backends", nargs="+", default=["direct", "in_process", "in_process_codec", "child_process"])
    parser.add_argument("--runners", nargs="+", default=["echo", "deterministic"], choices=["echo", "deterministic"])
    trio.run(run, parser.parse_args())


if __name__ == "__main__":
    main()
