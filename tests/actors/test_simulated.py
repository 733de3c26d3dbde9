"""The simulated executor: a real persistent batch, modelled latency in virtual time,
tokens that depend only on (seed, request, position), and faults on cue."""

from __future__ import annotations

import pytest
import trio

from cadence.actors.executor import ExecutorBackend
from cadence.actors.messages import ExecuteStep, InitExecutor
from cadence.actors.simulated import (
    Fault, FaultPlan, LatencyModel, SimulatedExecutor, simulated_token,
)
from cadence.statemachine.errors import ExecutorError
from cadence.statemachine.plan import NewRequestData, StepPlan

INIT = InitExecutor(model="simulated", dtype="auto", device="cpu", num_blocks=32, block_size=4,
                    max_model_len=64, max_num_batched_tokens=16, seed=0)


def plan(step_id, scheduled, new=(), new_blocks=None, finished=(), preempted=()):
    return ExecuteStep(StepPlan(
        step_id=step_id, num_scheduled_tokens=dict(scheduled),
        total_num_scheduled_tokens=sum(dict(scheduled).values()), new_requests=list(new),
        new_block_ids=new_blocks or {}, preempted_ids=list(preempted), finished_ids=list(finished),
        resumed_ids=[]))


def new(rid, num_tokens, blocks, computed=0):
    return NewRequestData(rid, list(range(1, num_tokens + 1)), num_tokens, blocks, computed)


def test_it_implements_the_backend_protocol():
    assert isinstance(SimulatedExecutor(), ExecutorBackend)


async def test_prefill_chunks_sample_only_at_the_end_then_decode(autojump_clock):
    ex = SimulatedExecutor(LatencyModel(1000, 10, 100), seed=3)
    ready = await ex.start(INIT)
    assert (ready.num_blocks, ready.block_size, ready.eos_token_ids) == (32, 4, [])
    start = trio.current_time()
    out = await ex.execute(plan(0, {"a": 4}, [new("a", 6, [0, 1])]))
    assert out.result.sampled_token_ids == {}  # 4 of 6 prompt tokens: nothing to sample
    assert trio.current_time() - start == pytest.approx(1000e-6 + 4 * 10e-6)
    out = await ex.execute(plan(1, {"a": 2}))
    first = ex.expected_token("a", 6)
    assert out.result.sampled_token_ids == {"a": [first]}
    assert first == simulated_token(3, "a", 6)
    start = trio.current_time()
    out = await ex.execute(plan(2, {"a": 1}))
    assert out.result.sampled_token_ids == {"a": [ex.expected_token("a", 7)]}
    assert trio.current_time() - start == pytest.approx(1000e-6 + 100e-6)  # one decode


async def test_plans_that_do_not_match_the_batch_are_refused(autojump_clock):
    ex = SimulatedExecutor()
    await ex.start(INIT)
    with pytest.raises(ExecutorError, match="not in the batch"):
        await ex.execute(plan(0, {"ghost": 1}))
    await ex.start(INIT)
    with pytest.raises(ExecutorError, match="blocks hold 4"):
        await ex.execute(plan(0, {"a": 6}, [new("a", 6, [0])]))
    with pytest.raises(ExecutorError, match="not running"):
        await ex.execute(plan(1, {"a": 1}))


async def test_finished_and_preempted_requests_leave_the_batch(autojump_clock):
    ex = SimulatedExecutor(LatencyModel(0, 0, 0))
    await ex.start(INIT)
    await ex.execute(plan(0, {"a": 2, "b": 2}, [new("a", 2, [0]), new("b", 2, [1])]))
    with pytest.raises(ExecutorError):
        await ex.execute(plan(1, {"a": 1, "b": 1}, finished=["a"]))
    await ex.start(INIT)
    await ex.execute(plan(0, {"a": 2}, [new("a", 2, [0])]))
    out = await ex.execute(plan(1, {"b": 3}, [NewRequestData("b", [9, 9, 9], 2, [2], 0, True)],
                                preempted=["a"]))
    assert out.result.sampled_token_ids == {"b": [ex.expected_token("b", 3)]}


async def test_tokens_survive_a_restart_and_ignore_batching(autojump_clock):
    ex = SimulatedExecutor(LatencyModel(0, 0, 0), seed=11)
    await ex.start(INIT)
    alone = await ex.execute(plan(0, {"a": 3}, [new("a", 3, [0])]))
    await ex.kill()
    await ex.start(INIT)
    together = await ex.execute(plan(0, {"b": 2, "a": 3}, [new("b", 2, [1]), new("a", 3, [0])]))
    assert together.result.sampled_token_ids["a"] == alone.result.sampled_token_ids["a"]


async def test_crash_leaves_it_dead_until_restarted(autojump_clock):
    ex = SimulatedExecutor(LatencyModel(0, 0, 0), faults=FaultPlan(at={1: Fault.CRASH}))
    await ex.start(INIT)
    await ex.execute(plan(0, {"a": 2}, [new("a", 3, [0])]))
    with pytest.raises(ExecutorError, match="crash"):
        await ex.execute(plan(1, {"a": 1}))
    assert not ex.alive
    with pytest.raises(ExecutorError):
        await ex.execute(plan(2, {"a": 1}))
    await ex.start(INIT)
    out = await ex.execute(plan(3, {"a": 3}, [new("a", 3, [0])]))
    assert out.result.step_id == 3


async def test_hang_never_answers(autojump_clock):
    ex = SimulatedExecutor(faults=FaultPlan(at={0: Fault.HANG}))
    await ex.start(INIT)
    with trio.move_on_after(3600) as scope:
        await ex.execute(plan(0, {"a": 2}, [new("a", 2, [0])]))
    assert scope.cancelled_caught


async def test_slow_multiplies_the_latency(autojump_clock):
    ex = SimulatedExecutor(LatencyModel(1000, 0, 0), faults=FaultPlan(at={0: Fault.SLOW}, slow_factor=7))
    await ex.start(INIT)
    start = trio.current_time()
    await ex.execute(plan(0, {"a": 2}, [new("a", 2, [0])]))
    assert trio.current_time() - start == pytest.approx(7e-3)


async def test_duplicate_and_stale_answer_for_older_steps(autojump_clock):
    faults = FaultPlan(at={0: Fault.DUPLICATE, 3: Fault.DUPLICATE, 4: Fault.STALE})
    ex = SimulatedExecutor(LatencyModel(0, 0, 0), faults=faults)
    await ex.start(INIT)
    ids = []
    for step in range(5):
        new_requests = [new("a", 2, [0, 1, 2, 3])] if step == 0 else []
        out = await ex.execute(plan(step, {"a": 2 if step == 0 else 1}, new_requests))
        ids.append(out.result.step_id)
    # Call 0 has nothing older to repeat; 3 repeats step 2; 4 answers with the oldest kept (0).
    assert ids == [0, 1, 2, 2, 0]


def test_random_faults_depend_only_on_seed_and_call():
    plan_a = FaultPlan(probabilities={Fault.CRASH: 0.2, Fault.SLOW: 0.2}, seed=5)
    plan_b = FaultPlan(probabilities={Fault.CRASH: 0.2, Fault.SLOW: 0.2}, seed=5)
    faults = [plan_a.fault_for(call) for call in range(2000)]
    assert faults == [plan_b.fault_for(call) for call in range(2000)]
    assert 300 < faults.count(Fault.CRASH) < 500 and 300 < faults.count(Fault.SLOW) < 500
    healed = FaultPlan(probabilities={Fault.CRASH: 1.0}, heal_after=10)
    assert [healed.fault_for(c) for c in (0, 9, 10, 11)] == [Fault.CRASH, Fault.CRASH, None, None]
    with pytest.raises(ValueError):
        FaultPlan(probabilities={Fault.CRASH: 0.7, Fault.HANG: 0.7})


def test_eos_probability_and_sample_ids_shape_the_tokens():
    tokens = [simulated_token(0, "r", p, vocab_size=50, eos_token_id=49, eos_probability=0.25)
              for p in range(4000)]
    assert 800 < tokens.count(49) < 1200
    assert all(0 <= t < 50 for t in tokens)
    never = [simulated_token(0, "r", p, vocab_size=50, eos_token_id=49) for p in range(2000)]
    assert 49 not in never
    letters = {simulated_token(1, "q", p, sample_ids=range(97, 100)) for p in range(200)}
    assert letters == {97, 98, 99}
