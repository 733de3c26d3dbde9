"""The seed article's simulation on the real engine: 15 requests with prompts of
10 to 24 tokens, at most 8 requests per batch, 4 tokens each.

The engine runs with the simulated executor (a latency model instead of a
model) under a virtual clock, so the run takes milliseconds and prints the same
thing every time: each step's batch (request id: tokens scheduled) as the
scheduler sends it, then each request's output and the scheduler's stats.

    python examples/seed_simulation.py

`cadence demo` runs the same simulation with options.
"""

from __future__ import annotations

import trio
import trio.testing

from cadence.actors import CacheConfig, EngineConfig, SamplingParams, SchedulerConfig, open_engine

NUM_REQUESTS = 15
FIRST_PROMPT_LEN = 10
MAX_TOKENS = 4
MAX_BATCH_SIZE = 8


def show_step(plan, now_s: float) -> None:
    """Called by the engine with every step plan as it goes to the executor."""
    batch = ", ".join(f"{rid}:{n}" for rid, n in plan.num_scheduled_tokens.items())
    print(f"step {plan.step_id:2d} at {now_s * 1000:6.2f} ms: {batch}")


async def main() -> None:
    """Run the 15 requests and print what happened."""
    config = EngineConfig(
        scheduler=SchedulerConfig(max_batch_size=MAX_BATCH_SIZE),
        cache=CacheConfig(num_blocks=256, block_size=16), executor="simulated")
    async with open_engine(config, on_step=show_step) as engine:
        # Hand every request over before the first step, in order: they all arrive at once.
        streams = [
            engine.generate(list(range(1, FIRST_PROMPT_LEN + i + 1)),
                            SamplingParams(max_tokens=MAX_TOKENS), request_id=f"req-{i:02d}").enqueue()
            for i in range(NUM_REQUESTS)
        ]

        results = {}

        async def consume(stream) -> None:
            result = await stream.collect()
            results[result.request_id] = result

        async with trio.open_nursery() as nursery:
            for stream in streams:
                nursery.start_soon(consume, stream)
        print()
        for rid, result in sorted(results.items()):
            print(f"{rid}: {len(result.prompt_token_ids)} prompt tokens ({result.num_cached_tokens} "
                  f"cached), output {result.token_ids}, finished by {result.finish_reason}")
        print()
        print(engine.stats().format())


if __name__ == "__main__":
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
