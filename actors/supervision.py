"""The executor's supervisor: runs each executor call within the step timeout,
and after a failure kills the executor and starts it again, after a pause that
doubles with each failure in a row (with jitter, up to `restart_backoff_max_s`).
Which failures count toward `max_restarts` is decided by
`cadence.statemachine.isolation`; this is the I/O around it."""

from __future__ import annotations

import logging
import random
from collections import deque
from functools import partial
from typing import Awaitable, Callable

import trio

from cadence.statemachine.blocks import BlockManager
from cadence.statemachine.errors import ExecutorError, ProtocolError
from cadence.statemachine.isolation import restart_pause_s

from .executor import ExecutorBackend
from .messages import ExecuteStep, InitExecutor, StepOutput

__all__ = ["ExecutorSupervisor"]

# Most seconds a kill may take before the restart goes ahead anyway.
_KILL_TIMEOUT_S = 5.0
# Restart pauses remembered in `restart_delays_s`.
_DELAY_LOG = 64

_log = logging.getLogger("cadence.engine")


class ExecutorSupervisor:
    """One executor backend, its calls bounded by `step_timeout_s`, its restarts
    by `start_timeout_s`, the pauses before them drawn from `rng`."""

    def __init__(self, backend: ExecutorBackend, init: InitExecutor, *, step_timeout_s: float = 60.0,
                 start_timeout_s: float = 600.0, restart_backoff_s: float = 0.5,
                 restart_backoff_max_s: float = 30.0, rng: random.Random | None = None) -> None:
        self.backend = backend
        self.init = init
        self.step_timeout_s = step_timeout_s
        self.start_timeout_s = start_timeout_s
        self.restart_backoff_s = restart_backoff_s
        self.restart_backoff_max_s = restart_backoff_max_s
        self.num_restarts = 0
        self.restart_delays_s: deque[float] = deque(maxlen=_DELAY_LOG)
        self._rng = rng if rng is not None else random.Random(0)

    async def execute(self, step: ExecuteStep) -> StepOutput | str:
        """The executor's answer, or why there is none."""
        return await self.outcome(partial(self.backend.execute, step), step.plan.step_id)

    async def outcome(self, answer: Callable[[], Awaitable[StepOutput]], step_id: int) -> StepOutput | str:
        """What `answer()` returns within the step timeout, or why there is none."""
        with trio.move_on_after(self.step_timeout_s):
            try:
                return await answer()
            except (ExecutorError, ProtocolError) as exc:
                return f"step {step_id} failed: {exc}"
        return f"step {step_id} timed out after {self.step_timeout_s} s"

    async def restart(self, num_in_a_row: int, blocks: BlockManager) -> str | None:
        """Pause (longer for more failures in a row), kill the executor and start it
        again with at least `blocks`' blocks; None, or why it did not come back."""
        delay = restart_pause_s(self.restart_backoff_s, self.restart_backoff_max_s,
                                num_in_a_row, self._rng.random())
        self.restart_delays_s.append(delay)
        await trio.sleep(delay)
        with trio.move_on_after(_KILL_TIMEOUT_S):
            await self.backend.kill()
        try:
            with trio.fail_after(self.start_timeout_s):
                ready = await self.backend.start(self.init)
        except (ExecutorError, ProtocolError) as exc:
            return f"restart failed: {exc}"
        except trio.TooSlowError:
            return f"restart did not finish within {self.start_timeout_s} s"
        if ready.num_blocks < blocks.num_blocks or ready.block_size != blocks.block_size:
            return (f"restarted executor has {ready.num_blocks} blocks of {ready.block_size}, "
                    f"the scheduler needs {blocks.num_blocks} of {blocks.block_size}")
        self.num_restarts += 1
        _log.info("executor restarted (restart %d)", self.num_restarts)
        return None
