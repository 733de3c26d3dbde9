"""The scheduler actor: the only caller of the scheduling core, and the
supervisor of the executor.

It runs two tasks. The inbox task applies submissions and aborts to the core
as they arrive (an abort frees its blocks at once, even mid-step). The step
task loops: plan a step with `core.schedule()`, send it to the executor,
apply the result with `core.update()`, and route every event the core
returns to the request actors. While the executor runs step N it plans step
N+1 when that cannot split the batch: only if no request of step N awaits a
sampled token (step N is all prefill chunks), since the core does not
reschedule a request whose token is in flight.

Why this cannot deadlock: the scheduler never waits on anything but the
executor (bounded by `step_timeout_s`) and its own inbox. Everything it sends
is synchronous and unbounded-by-construction: a request actor's mailbox holds
at most that request's own events (one per generated token plus one per
admission, preemption or executor loss), and the inbox holds at most one
submission per waiting submitter plus one abort per live request (an actor
sends its abort once). No task ever waits for room in a channel, so there is
no cycle of full buffers to wait on.

Supervision: a step that raises `ExecutorError`, outlives `step_timeout_s`,
or answers for another step makes the core forget the executor
(`executor_lost()`: running requests go back to waiting and are recomputed,
the prefix cache is reset) and the executor is killed and started again.
More than `max_restarts` failures within `restart_window_s` fail every live
request and close the engine to new ones.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Callable

import trio
from trio.lowlevel import Abort, current_task, reschedule, wait_task_rescheduled

from cadence.statemachine.errors import (
    CadenceError, EngineClosedError, ExecutorError, ProtocolError, RequestNotFoundError,
)
from cadence.statemachine.fsm import RequestEventKind
from cadence.statemachine.plan import RequestEvent, StepPlan
from cadence.statemachine.scheduler import Scheduler

from .executor import ExecutorBackend
from .messages import ExecuteStep, InitExecutor, Ready, StepOutput
from .request_actor import RequestActor
from .trace import TraceRecorder

__all__ = ["SchedulerActor", "StepListener"]

# A step listener sees each non-empty plan as it is made, with the Trio time.
StepListener = Callable[[StepPlan, float], None]

_EVENT_NAMES = {kind: kind.value for kind in RequestEventKind}
# How long an idle scheduler with live but unschedulable requests waits before
# planning again without being woken (no core state should need it; it keeps a
# surprise from turning into a hang).
_STALL_POLL_S = 0.01
# Most seconds a kill may take before the restart goes ahead anyway.
_KILL_TIMEOUT_S = 5.0


class SchedulerActor:
    """Owns the core `Scheduler`: feeds it submissions, aborts and executor
    results, routes its events to the request actors, supervises the executor."""

    def __init__(
        self,
        core: Scheduler,
        backend: ExecutorBackend,
        init: InitExecutor,
        ready: Ready,
        spawn: Callable,
        *,
        step_timeout_s: float = 60.0,
        start_timeout_s: float = 600.0,
        max_restarts: int = 3,
        restart_window_s: float = 300.0,
        plan_ahead: bool = True,
        trace: TraceRecorder | None = None,
        on_step: StepListener | None = None,
    ) -> None:
        self.core = core
        self.backend = backend
        self.init = init
        self.ready = ready
        self.actors: dict[str, RequestActor] = {}
        self.trace = trace
        self.on_step = on_step
        self.step_timeout_s = step_timeout_s
        self.start_timeout_s = start_timeout_s
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.plan_ahead = plan_ahead
        self.closed_reason: str | None = None
        self.num_restarts = 0
        self.num_failures = 0
        self.num_ignored_results = 0
        self.num_planned_ahead = 0
        self.last_failure = ""
        self._spawn = spawn
        self._inbox: deque = deque()
        self._inbox_task = None
        self._step_task = None
        self._ahead: tuple[StepPlan, ExecuteStep] | None = None
        self._failure_times: deque[float] = deque()
        self._interval_s = core.config.schedule_interval_us / 1e6
        self._last_step_s = -math.inf
        self._idle: trio.Event | None = None

    # ---- what other tasks call (synchronous, never blocks) ---------------------
    def submit(self, actor: RequestActor) -> None:
        """Queue a request for the core; the actor learns the verdict."""
        if self.closed_reason is not None:
            raise EngineClosedError(self.closed_reason)
        self._inbox.append(actor)
        self._wake_inbox()

    def abort_nowait(self, request_id: str, detail: str = "aborted") -> None:
        """Queue an abort; a request that already completed is left alone."""
        if self.closed_reason is None:
            self._inbox.append((request_id, detail))
            self._wake_inbox()

    def close(self, reason: str = "engine closed") -> None:
        """Stop taking requests and abort every live one (used at shutdown)."""
        if self.closed_reason is None:
            self.closed_reason = reason
        error = EngineClosedError(self.closed_reason)
        for actor in self._inbox:
            if isinstance(actor, RequestActor):
                actor.refuse(error)
        self._inbox.clear()
        for request_id, actor in list(self.actors.items()):
            actor.close_stream(error)
            self._route([self.core.abort_request(request_id, reason)], self.core.step_id)

    async def wait_idle(self) -> None:
        """Wait until no request is live and the inbox is empty."""
        while self.actors or self._inbox:
            if self._idle is None:
                self._idle = trio.Event()
            await self._idle.wait()

    # ---- the tasks -------------------------------------------------------------
    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run the inbox and step tasks until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._inbox_loop)
            nursery.start_soon(self._step_loop)
            task_status.started()

    async def _inbox_loop(self) -> None:
        inbox = self._inbox
        while True:
            if not inbox:
                self._inbox_task = current_task()
                await wait_task_rescheduled(self._abort_inbox_wait)
            while inbox:
                item = inbox.popleft()
                if type(item) is tuple:
                    self._abort(*item)
                else:
                    self._add(item)
            self._wake_step_loop()
            self._check_idle()

    def _add(self, actor: RequestActor) -> None:
        if self.closed_reason is not None:
            actor.refuse(EngineClosedError(self.closed_reason))
            return
        if actor.withdrawn:
            return
        request = actor.request
        try:
            self.core.add_request(request)
        except CadenceError as exc:
            actor.refuse(exc)
            return
        self.actors[actor.request_id] = actor
        if self.trace is not None:
            self.trace.record(trio.current_time(), self.core.step_id, actor.request_id, "add",
                              prompt_len=request.num_prompt_tokens,
                              max_tokens=request.limits.max_tokens,
                              priority=request.priority, tenant=request.tenant)
        self._spawn(actor.run)
        actor.accept()

    def _abort(self, request_id: str, detail: str) -> None:
        if request_id not in self.actors:
            return  # completed while the abort was queued
        try:
            event = self.core.abort_request(request_id, detail)
        except RequestNotFoundError:
            return
        self._route([event], self.core.step_id)

    async def _step_loop(self) -> None:
        while self.closed_reason is None:
            if self._ahead is not None:
                step, self._ahead = self._ahead, None
            else:
                if self._interval_s:
                    await trio.sleep_until(self._last_step_s + self._interval_s)
                step = self._plan()
            if step is None:
                await self._wait_for_work()
                continue
            await self._run_step(*step)

    def _plan(self) -> tuple[StepPlan, ExecuteStep] | None:
        """Plan one step; None if there is nothing to run."""
        core = self.core
        if not core.has_work():
            return None
        now = trio.current_time()
        plan = core.schedule(now_s=now)
        self._route(core.take_events(), plan.step_id)
        if plan.is_empty:
            return None
        self._last_step_s = now
        actors = self.actors
        sampling = {d.request_id: actors[d.request_id].params for d in plan.new_requests}
        if self.on_step is not None:
            self.on_step(plan, now)
        return plan, ExecuteStep(plan, sampling)

    async def _run_step(self, plan: StepPlan, step: ExecuteStep) -> None:
        if self.plan_ahead and self._no_token_awaited(plan):
            outcome = await self._execute_and_plan_ahead(step)
        else:
            outcome = await self._execute(step)
        if type(outcome) is StepOutput:
            result = outcome.result
            events = self.core.update(plan, result)
            self._route(events, plan.step_id)
            if result.step_id == plan.step_id:
                return
            # The core ignored an answer for another step; this step's answer is lost.
            self.num_ignored_results += 1
            outcome = f"executor answered step {result.step_id} when step {plan.step_id} was sent"
        await self._recover(outcome)

    def _no_token_awaited(self, plan: StepPlan) -> bool:
        """Whether no request of `plan` will sample a token (all prefill chunks)."""
        requests = self.core.requests
        for rid in plan.num_scheduled_tokens:
            request = requests.get(rid)
            if request is not None and request.num_computed_tokens >= len(request.all_token_ids):
                return False
        return True

    async def _execute(self, step: ExecuteStep) -> StepOutput | str:
        """The executor's answer, or why there is none."""
        with trio.move_on_after(self.step_timeout_s):
            try:
                return await self.backend.execute(step)
            except (ExecutorError, ProtocolError) as exc:
                return f"step {step.plan.step_id} failed: {exc}"
        return f"step {step.plan.step_id} timed out after {self.step_timeout_s} s"

    async def _execute_and_plan_ahead(self, step: ExecuteStep) -> StepOutput | str:
        box: list[StepOutput | str] = []

        async def execute() -> None:
            box.append(await self._execute(step))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(execute)
            await trio.lowlevel.checkpoint()  # the executor takes step N first
            if self.closed_reason is None and not box:
                self._ahead = self._plan()
                if self._ahead is not None:
                    self.num_planned_ahead += 1
        return box[0]

    # ---- supervision -----------------------------------------------------------
    async def _recover(self, reason: str) -> None:
        """Forget the executor's state, then restart it or give up."""
        core = self.core
        self._ahead = None
        self.num_failures += 1
        self.last_failure = reason
        self._route(core.executor_lost(), core.step_id)
        while True:
            if not self._may_restart(trio.current_time()):
                self._give_up(reason)
                return
            with trio.move_on_after(_KILL_TIMEOUT_S):
                await self.backend.kill()
            try:
                with trio.fail_after(self.start_timeout_s):
                    ready = await self.backend.start(self.init)
            except (ExecutorError, ProtocolError) as exc:
                reason = f"restart failed: {exc}"
            except trio.TooSlowError:
                reason = f"restart did not finish within {self.start_timeout_s} s"
            else:
                if ready.num_blocks >= core.blocks.num_blocks and ready.block_size == core.blocks.block_size:
                    self.num_restarts += 1
                    return
                reason = (f"restarted executor has {ready.num_blocks} blocks of {ready.block_size}, "
                          f"the scheduler needs {core.blocks.num_blocks} of {core.blocks.block_size}")
            self.num_failures += 1
            self.last_failure = reason

    def _may_restart(self, now: float) -> bool:
        times = self._failure_times
        while times and times[0] <= now - self.restart_window_s:
            times.popleft()
        if len(times) >= self.max_restarts:
            return False
        times.append(now)
        return True

    def _give_up(self, reason: str) -> None:
        """Fail every live request and refuse new ones."""
        self.closed_reason = (f"executor failed {len(self._failure_times) + 1} times within "
                              f"{self.restart_window_s} s; last failure: {reason}")
        error = EngineClosedError(self.closed_reason)
        for actor in self._inbox:
            if isinstance(actor, RequestActor):
                actor.refuse(error)
        self._inbox.clear()
        core = self.core
        for request_id in list(self.actors):
            self._route([core.fail_request(request_id, self.closed_reason)], core.step_id)
        self._check_idle()

    # ---- routing ---------------------------------------------------------------
    def _route(self, events: list[RequestEvent], step: int) -> None:
        """Deliver each event to its request's actor, in the core's order."""
        actors = self.actors
        trace = self.trace
        for event in events:
            rid = event.request_id
            if trace is not None:
                self._record(trace, event, step)
            actors[rid].deliver(event)
            if event.finish_reason is not None:
                del actors[rid]
        if not actors:
            self._check_idle()

    @staticmethod
    def _record(trace: TraceRecorder, event: RequestEvent, step: int) -> None:
        now = trio.current_time()
        rid = event.request_id
        if event.token_ids:
            trace.record(now, step, rid, "tokens", tokens=event.token_ids)
        if event.transition is not None:
            reason = event.finish_reason.value if event.finish_reason is not None else None
            trace.record(now, step, rid, _EVENT_NAMES[event.transition], reason)

    # ---- waiting and waking ----------------------------------------------------
    def _abort_inbox_wait(self, raise_cancel) -> Abort:
        self._inbox_task = None
        return Abort.SUCCEEDED

    def _abort_step_wait(self, raise_cancel) -> Abort:
        self._step_task = None
        return Abort.SUCCEEDED

    def _wake_inbox(self) -> None:
        task = self._inbox_task
        if task is not None:
            self._inbox_task = None
            reschedule(task)

    def _wake_step_loop(self) -> None:
        task = self._step_task
        if task is not None:
            self._step_task = None
            reschedule(task)

    async def _wait_for_work(self) -> None:
        """Sleep until the inbox changes something (or, with live requests that
        could not be scheduled, until a short poll interval passes)."""
        stalled = self.core.has_work()
        with trio.move_on_after(_STALL_POLL_S if stalled else math.inf):
            self._step_task = current_task()
            await wait_task_rescheduled(self._abort_step_wait)

    def _check_idle(self) -> None:
        if self._idle is not None and not self.actors and not self._inbox:
            self._idle.set()
            self._idle = None
