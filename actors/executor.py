"""The executor interface the scheduler actor drives, whatever runs the model.

Three backends implement it: `SimulatedExecutor` (a latency model, no model;
`actors/simulated.py`), `InProcessExecutor` (the model runner in a worker
thread) and `ChildProcessExecutor` (the same messages over a socket to a child
process); the latter two live in `actors/executors.py`. They exchange the
message classes of `actors/messages.py`, so swapping one for another changes
the transport, not the protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from cadence.statemachine.errors import ExecutorError

if TYPE_CHECKING:  # annotations only
    from .messages import ExecuteStep, InitExecutor, Ready, StepOutput

__all__ = ["ExecutorBackend", "ExecutorError"]


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
