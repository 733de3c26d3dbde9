"""Core bugs found by the engine simulation, kept as plain regression tests."""

from __future__ import annotations

from cadence.statemachine.config import CacheConfig, SchedulerConfig
from cadence.statemachine.fsm import RequestEventKind
from cadence.statemachine.plan import StepResult
from cadence.statemachine.request import Request, SamplingLimits
from cadence.statemachine.scheduler import Scheduler


def test_higher_priority_waiting_request_preempts_when_all_seats_are_taken():
    """Preemption for priority must not depend on a free seat (DESIGN §5)."""
    core = Scheduler(SchedulerConfig(max_num_seqs=1, policy="priority", debug_checks=True),
                     CacheConfig(num_blocks=16, block_size=4))
    core.add_request(Request("low", [1, 2, 3], SamplingLimits(max_tokens=8), priority=1))
    plan = core.schedule(0.0)
    core.update(plan, StepResult(plan.step_id, {"low": [5]}))
    core.add_request(Request("high", [1, 2, 4], SamplingLimits(max_tokens=8), priority=0,
                             arrival_s=1.0))
    plan = core.schedule(1.0)
    assert plan.preempted_ids == ["low"]
    assert list(plan.num_scheduled_tokens) == ["high"]


def test_equal_priority_waiting_request_does_not_preempt_when_seats_are_taken():
    core = Scheduler(SchedulerConfig(max_num_seqs=1, policy="priority", debug_checks=True),
                     CacheConfig(num_blocks=16, block_size=4))
    core.add_request(Request("first", [1, 2, 3], SamplingLimits(max_tokens=8), priority=1))
    plan = core.schedule(0.0)
    core.update(plan, StepResult(plan.step_id, {"first": [5]}))
    core.add_request(Request("second", [1, 2, 4], SamplingLimits(max_tokens=8), priority=1,
                             arrival_s=1.0))
    plan = core.schedule(1.0)
    assert plan.preempted_ids == []
    assert list(plan.num_scheduled_tokens) == ["first"]


def test_executor_loss_with_a_full_waiting_queue_keeps_the_invariants():
    """Requests sent back by executor loss may exceed max_waiting; the invariants
    bound live requests by max_waiting + max_num_seqs instead."""
    core = Scheduler(SchedulerConfig(max_num_seqs=1, max_waiting=1, debug_checks=True),
                     CacheConfig(num_blocks=16, block_size=4))
    core.add_request(Request("a", [1, 2, 3], SamplingLimits(max_tokens=4)))
    core.schedule(0.0)
    core.add_request(Request("b", [1, 2, 3], SamplingLimits(max_tokens=4)))
    events = core.executor_lost()
    lost = [e.request_id for e in events if e.transition is RequestEventKind.EXECUTOR_LOST]
    assert lost == ["a"]
    assert core.num_waiting == 2
