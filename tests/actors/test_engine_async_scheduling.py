"""Async scheduling in the engine: step N+1 is planned and handed to the executor
while step N runs (simulated executor, virtual time).

An overlapped engine must emit exactly what a serial one emits, lose no block,
and keep poison isolation and supervision working with two steps in flight.
"""

from __future__ import annotations

import pytest
import trio

from cadence.actors import (
    CacheConfig, EngineConfig, PoisonRequestError, SamplingParams, SchedulerConfig,
    open_engine,
)
from cadence.actors.simulated import FaultPlan, Poison
from engine_helpers import config, gather_outcomes, text_executor

MAX_TOKENS = 12
# A guard against a hang on a busy machine, not a measure of speed.
GUARD_S = 120


class CountingExecutor:
    """A simulated executor that records how many steps it holds at once."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.in_flight = 0
        self.most_in_flight = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def submit(self, step):
        call = self.inner.submit(step)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        counter = self

        class Counted:
            async def result(self):
                try:
                    return await call.result()
                finally:
                    counter.in_flight -= 1

        return Counted()


async def run_all(engine, request_ids, max_tokens=MAX_TOKENS) -> dict[str, object]:
    params = SamplingParams(max_tokens=max_tokens)
    return await gather_outcomes(engine, {rid: f"{rid} prompt" for rid in request_ids},
                                 dict.fromkeys(request_ids, params))


async def outcomes_of(async_scheduling: bool, ids, executor=None, **kwargs):
    executor = executor if executor is not None else text_executor(eos_probability=0.08, seed=3)
    cfg = config(executor, async_scheduling=async_scheduling, **kwargs)
    async with open_engine(cfg) as engine:
        outcomes = await run_all(engine, ids)
        assert not engine.closed, engine.scheduler.closed_reason
        assert not engine.core.requests and engine.core.blocks.num_used_blocks == 0
        return outcomes, engine


async def test_overlapped_steps_emit_what_serial_steps_emit(autojump_clock):
    ids = [f"r{i}" for i in range(6)]
    serial, _ = await outcomes_of(False, ids)
    counting = CountingExecutor(text_executor(eos_probability=0.08, seed=3))
    overlapped, engine = await outcomes_of(True, ids, counting)
    assert overlapped == serial
    assert any(len(t) < MAX_TOKENS for t in serial.values()), "some stop on EOS, a step late"
    assert counting.most_in_flight == 2 and engine.scheduler.num_planned_ahead > 0


async def test_overlap_under_preemption_emits_what_serial_emits(autojump_clock):
    ids = [f"r{i}" for i in range(6)]
    tight = dict(num_blocks=8, admission_headroom_steps=0)
    serial, _ = await outcomes_of(False, ids, **tight)
    overlapped, engine = await outcomes_of(True, ids, **tight)
    assert engine.stats().num_preemptions > 0
    assert overlapped == serial


async def test_a_reported_failure_with_a_step_in_flight_fails_that_request_alone(autojump_clock):
    """r2 fails in step N while step N+1, already handed over, schedules it too: the
    executor answers N+1 for it the same way, and nobody else is touched."""
    executor = text_executor(faults=FaultPlan(poison={"r2": Poison.REPORTED}))
    outcomes, engine = await outcomes_of(True, [f"r{i}" for i in range(4)], executor, max_restarts=0)
    assert isinstance(outcomes["r2"], PoisonRequestError)
    assert engine.scheduler.num_failures == 0
    assert all(len(outcomes[r]) == MAX_TOKENS for r in ("r0", "r1", "r3"))


async def test_a_crash_with_a_step_in_flight_is_isolated_and_others_keep_their_tokens(autojump_clock):
    ids = [f"r{i}" for i in range(6)]
    expected, _ = await outcomes_of(False, ids, text_executor())
    executor = text_executor(faults=FaultPlan(poison={"r4": Poison.CRASH}))
    outcomes, engine = await outcomes_of(True, ids, executor, max_num_seqs=8, max_restarts=1,
                                         restart_backoff_s=0.01)
    assert isinstance(outcomes.pop("r4"), PoisonRequestError)
    assert outcomes == {rid: tokens for rid, tokens in expected.items() if rid != "r4"}


async def test_on_a_real_model_overlapped_greedy_output_equals_serial():
    """The CPU model runner on its own thread: step N+1 is queued behind N and reads
    N's sampled tokens from the runner's batch."""
    pytest.importorskip("torch")
    prompts = {f"g{i}": [5 + i, 6, 7, 8 + 2 * i] for i in range(4)}
    params = SamplingParams(max_tokens=10, temperature=0.0)
    outputs = {}
    for overlap in (False, True):
        cfg = EngineConfig(
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                                      async_scheduling=overlap),
            cache=CacheConfig(num_blocks=64, block_size=4), executor="inprocess", model="tiny",
            device="cpu", step_timeout_s=GUARD_S, start_timeout_s=GUARD_S)
        with trio.fail_after(GUARD_S):
            async with open_engine(cfg) as engine:
                got = {}

                async def one(rid: str) -> None:
                    got[rid] = (await engine.generate(prompts[rid], params, request_id=rid).collect()).token_ids

                async with trio.open_nursery() as nursery:
                    for rid in prompts:
                        nursery.start_soon(one, rid)
                assert not engine.core.requests and engine.core.blocks.num_used_blocks == 0
                outputs[overlap] = (got, engine.scheduler.num_planned_ahead)
    assert outputs[True][0] == outputs[False][0]
    assert all(len(t) == 10 for t in outputs[True][0].values())
    assert outputs[True][1] > outputs[False][1], "decode steps were planned ahead"


async def test_a_prompt_the_runner_refuses_with_the_next_step_already_queued_fails_alone():
    """The in-process runner refuses "bad" in step N, while step N+1, queued behind it,
    schedules "bad" again: the runner answers it the same way and the step stands."""
    marker = 7
    prompts = {"ok": [10, 11, 12], "bad": [1, marker, 2], "ok2": [13, 14, 15]}
    cfg = EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                                  async_scheduling=True),
        cache=CacheConfig(num_blocks=64, block_size=4), executor="inprocess", model="simulated",
        executor_options={"bad_token": marker}, max_restarts=0, step_timeout_s=GUARD_S)
    outcomes: dict[str, object] = {}
    with trio.fail_after(GUARD_S):
        async with open_engine(cfg) as engine:

            async def one(rid: str) -> None:
                try:
                    params = SamplingParams(max_tokens=6, ignore_eos=True)
                    outcomes[rid] = (await engine.generate(prompts[rid], params, request_id=rid).collect()).token_ids
                except PoisonRequestError as exc:
                    outcomes[rid] = exc

            async with trio.open_nursery() as nursery:
                for rid in prompts:
                    nursery.start_soon(one, rid)
            assert engine.scheduler.num_failures == 0 and not engine.closed
            assert engine.scheduler.num_planned_ahead > 0
            assert not engine.core.requests and engine.core.blocks.num_used_blocks == 0
    assert isinstance(outcomes["bad"], PoisonRequestError)
    assert len(outcomes["ok"]) == len(outcomes["ok2"]) == 6
