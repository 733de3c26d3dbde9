"""The executor interface the scheduler actor drives, whatever runs the model.

Three backends implement it: `SimulatedExecutor` (a latency model, no model;
`actors/simulated.py`), `InProcessExecutor` (the model runner in a worker
thread) and `ChildProcessExecutor` (the same messages over a socket to a child
process); the latter two live in `actors/executors.py`. They exchange the
message classes of `actors/messages.py`, so swapping one for another changes
the transport, not the protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Container, Protocol, runtime_checkable

from cadence.statemachine.errors import ExecutorError
from cadence.statemachine.plan import StepPlan

from .messages import ExecuteStep

if TYPE_CHECKING:  # annotations only
    from .messages import InitExecutor, Ready, StepOutput

__all__ = ["ExecutorBackend", "ExecutorError", "select_requests"]


def select_requests(step: ExecuteStep, request_ids: Container[str], *, with_drops: bool = True) -> ExecuteStep:
    """The part of `step` about `request_ids` alone, as a step of its own with the
    same step id: a batch can be run as several executor calls, since the
    executor's persistent batch is keyed by request.

    with_drops: keep the plan's finished and preempted ids (send them with
    exactly one of the parts).
    """
    plan = step.plan
    scheduled = {rid: n for rid, n in plan.num_scheduled_tokens.items() if rid in request_ids}
    part = StepPlan(
        step_id=plan.step_id,
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        new_requests=[d for d in plan.new_requests if d.request_id in request_ids],
        new_block_ids={rid: ids for rid, ids in plan.new_block_ids.items() if rid in request_ids},
        preempted_ids=list(plan.preempted_ids) if with_drops else [],
        finished_ids=list(plan.finished_ids) if with_drops else [],
        resumed_ids=[rid for rid in plan.resumed_ids if rid in request_ids],
    )
    return ExecuteStep(part, {rid: p for rid, p in step.sampling.items() if rid in request_ids})


@runtime_checkable
class ExecutorBackend(Protocol):
    """One executor: started, asked to run steps, killed or closed.

    `execute` either returns the step's output or raises `ExecutorError` (the
    executor died or sent garbage); a hang is detected by the caller with a
    timeout around `execute`, after which it calls `kill` and `start` again.
    """

    async def start(self, init: InitExecutor) -> Ready:
        """Start (or restart) the executor and return what it can hold."""

    async def execute(self, step: ExecuteStep) -> StepOutput:
        """Run one step plan and return the sampled tokens."""

    async def kill(self) -> None:
        """Stop at once, whatever state it is in (used before a restart)."""

    async def aclose(self) -> None:
        """Shut down gracefully."""
