"""What the actor shell costs: routing throughput and memory per idle request.

    python benchmarks/actor_overhead.py [--quick]

Prints one JSON line per result. Times are CPU seconds of this process
(`time.process_time`): the engine runs in one thread, so that is the time it
would take on one idle core, whatever else the machine is doing; the wall
time is reported beside it.

  routing       the whole engine with a zero-cost simulated executor (no
                latency, tokens from a hash): tokens per second routed from the
                executor through the scheduler actor and the request actors to
                the consumers, and the wall time per token split into the
                scheduling core (schedule + update), the executor, and the rest
                (the actor shell: routing, actor and consumer tasks, outputs).
                Best of three runs. Target: >= 100,000 tokens/s.
  idle_memory   bytes per idle request with 100,000 requests live at once
                (tracemalloc): the request actor's task and state plus the
                core's request record, then with a consumer task blocked on each
                stream as well. Target: <= 10 KB per idle request actor.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import tracemalloc

import trio
import trio.testing

from cadence.actors import CacheConfig, EngineConfig, SamplingParams, SchedulerConfig, open_engine
from cadence.actors.simulated import ZERO_LATENCY, LatencyModel, SimulatedExecutor

# A step that never ends: requests stay idle, waiting for their first event.
FOREVER = LatencyModel(base_us=1e15, prefill_us_per_token=0.0, decode_us_per_seq=0.0)


class _Timer:
    """Accumulates the CPU time spent inside wrapped synchronous calls."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):
        """`fn`, timed into this accumulator."""
        def timed(*args, **kwargs):
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.process_time() - start
        return timed


async def _routing(num_requests: int, max_tokens: int, max_num_seqs: int) -> dict:
    executor = SimulatedExecutor(ZERO_LATENCY, seed=1)
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=65536,
                                  max_model_len=max_tokens + 64),
        cache=CacheConfig(num_blocks=max_num_seqs * ((max_tokens + 64) // 16 + 2), block_size=16),
        executor=executor)
    core_timer, executor_timer = _Timer(), _Timer()
    executor._run = executor_timer.wrap(executor._run)
    async with open_engine(config) as engine:
        core = engine.core
        core.schedule = core_timer.wrap(core.schedule)
        core.update = core_timer.wrap(core.update)
        counts = []

        async def consume(stream) -> None:
            n = 0
            async for out in stream:
                n += len(out.token_ids)
            counts.append(n)

        streams = [engine.generate(list(range(1, 33)), SamplingParams(max_tokens=max_tokens)).enqueue()
                   for _ in range(num_requests)]
        start, start_cpu = time.perf_counter(), time.process_time()
        async with trio.open_nursery() as nursery:
            for stream in streams:
                nursery.start_soon(consume, stream)
        cpu = time.process_time() - start_cpu
        wall = time.perf_counter() - start
        steps = engine.stats().num_batches_scheduled
    tokens = sum(counts)
    assert tokens == num_requests * max_tokens
    shell = cpu - core_timer.seconds - executor_timer.seconds
    return {
        "name": "routing", "requests": num_requests, "max_num_seqs": max_num_seqs,
        "max_tokens": max_tokens, "tokens": tokens, "steps": steps, "cpu_s": round(cpu, 3),
        "wall_s": round(wall, 3), "tokens_per_s": round(tokens / cpu),
        "tokens_per_wall_s": round(tokens / wall),
        "us_per_token": round(cpu / tokens * 1e6, 2),
        "core_us_per_token": round(core_timer.seconds / tokens * 1e6, 2),
        "executor_us_per_token": round(executor_timer.seconds / tokens * 1e6, 2),
        "shell_us_per_token": round(shell / tokens * 1e6, 2),
    }


async def _idle_memory(num_requests: int, with_consumers: bool) -> int:
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=1, max_model_len=64),
        cache=CacheConfig(num_blocks=64, block_size=16),
        executor=SimulatedExecutor(FOREVER), step_timeout_s=1e9)
    async with open_engine(config) as engine:
        await trio.testing.wait_all_tasks_blocked()
        prompt = list(range(1, 17))
        params = SamplingParams(max_tokens=16)
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        streams = [engine.generate(prompt, params).enqueue() for _ in range(num_requests)]
        async with trio.open_nursery() as nursery:
            if with_consumers:
                for stream in streams:
                    nursery.start_soon(_consume_quietly, stream)
            await trio.testing.wait_all_tasks_blocked()
            assert len(engine.scheduler.actors) == num_requests
            gc.collect()
            used = tracemalloc.get_traced_memory()[0] - before
            tracemalloc.stop()
            nursery.cancel_scope.cancel()
    return used // num_requests


async def _consume_quietly(stream) -> None:
    async for _ in stream:
        pass


def main() -> None:
    """Run every measurement and print its JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs, for a smoke test")
    args = parser.parse_args()

    shapes = [(64, 200, 64), (256, 100, 256)] if not args.quick else [(32, 20, 32)]
    for num_requests, max_tokens, max_num_seqs in shapes:
        # Best of three: the least disturbed by whatever else shares the machine.
        runs = [trio.run(_routing, num_requests, max_tokens, max_num_seqs) for _ in range(3)]
        print(json.dumps(max(runs, key=lambda run: run["tokens_per_s"])), flush=True)
    num_idle = 100_000 if not args.quick else 2_000
    actors = trio.run(_idle_memory, num_idle, False)
    with_consumers = trio.run(_idle_memory, num_idle, True)
    print(json.dumps({"name": "idle_memory", "requests": num_idle,
                      "bytes_per_request_actor": actors,
                      "bytes_per_request_with_consumer": with_consumers}), flush=True)


if __name__ == "__main__":
    main()
