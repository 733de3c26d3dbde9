"""The engine over the real executor backends (the deterministic runner, so no model):
in a worker thread and in a child process, including a crash of the child mid-run.

These use the real clock: a worker thread or a child process is invisible to a
MockClock, which would jump straight to the step timeout.
"""

from __future__ import annotations

import pytest
import trio

from cadence.actors import EngineConfig, SamplingParams, open_engine
from cadence.actors.executor_worker import deterministic_token
from cadence.statemachine.config import CacheConfig, SchedulerConfig

# Generous: starting a Python child process on a busy two-core machine.
TIMEOUT_S = 60


def engine_config(kind: str, **options) -> EngineConfig:
    return EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                                  debug_checks=True),
        cache=CacheConfig(num_blocks=64, block_size=4), executor=kind, model="simulated",
        executor_options=options, record_trace=True, step_timeout_s=TIMEOUT_S,
        start_timeout_s=TIMEOUT_S)


async def generate_all(engine, num_requests: int, max_tokens: int) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}

    async def one(i: int) -> None:
        rid = f"r{i}"
        tokens = []
        async for out in engine.generate(list(range(1, 6 + i)), SamplingParams(max_tokens=max_tokens),
                                         request_id=rid):
            tokens.extend(out.token_ids)
        outputs[rid] = tokens

    async with trio.open_nursery() as nursery:
        for i in range(num_requests):
            nursery.start_soon(one, i)
    return outputs


def expected(rid: str, max_tokens: int) -> list[int]:
    prompt_len = 5 + int(rid[1:])
    return [deterministic_token(rid, prompt_len + k) for k in range(max_tokens)]


@pytest.mark.parametrize("kind", ["inprocess", "process"])
async def test_real_backends_generate_the_runner_tokens(kind):
    with trio.fail_after(TIMEOUT_S):
        async with open_engine(engine_config(kind)) as engine:
            outputs = await generate_all(engine, 6, 5)
            assert not engine.core.requests and engine.core.blocks.num_used_blocks == 0
    assert outputs == {rid: expected(rid, 5) for rid in outputs}


async def test_a_child_that_exits_mid_run_is_restarted():
    with trio.fail_after(TIMEOUT_S):
        async with open_engine(engine_config("process", exit_at_step=3)) as engine:
            outputs = await generate_all(engine, 3, 6)
            assert engine.scheduler.num_restarts >= 1
            assert "exited with code 3" in engine.scheduler.last_failure
    assert outputs == {rid: expected(rid, 6) for rid in outputs}
    assert {r["event"] for r in engine.trace.records} >= {"executor_lost"}
