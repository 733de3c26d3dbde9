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
the prefix cache is reset) and the executor is killed and started again,
after a pause that doubles with each failure in a row (with jitter, up to
`restart_backoff_max_s`). More than `max_restarts` counted failures within
`restart_window_s` fail every live request and close the engine to new ones.

Poison requests: a request the executor names in `StepOutput.failed` fails
alone (`PoisonRequestError`) and the step's other results stand. A failure
that names nobody makes its requests suspects: they are split in halves, each
half run as an executor call of its own (the unsuspected requests in another)
until failures narrow the blame to one request that then fails twice more
alone, the same way; it fails with `PoisonRequestError` (a plain
`ExecutorError` if the executor ran nothing else meanwhile, since then the
executor may be at fault). The others keep every token they had. A suspect
that gets a token past the point where its step failed is cleared. Failures
while isolating a culprit, and the failure that started it once a culprit is
found and the executor has run a step since, do not count toward
`max_restarts`; beyond a few failures in a row with no successful call
between them (see `_BASE_UNCOUNTED_IN_A_ROW`) every failure counts, so a
broken executor still closes the engine.
"""

from __future__ import annotations

import logging
import math
import random
import re
from collections import deque
from functools import partial
from typing import Awaitable, Callable

import attrs
import trio
from trio.lowlevel import Abort, current_task, reschedule, wait_task_rescheduled

from cadence.statemachine.errors import (
    CadenceError, EngineClosedError, ExecutorError, PoisonRequestError, ProtocolError,
    RequestNotFoundError,
)
from cadence.statemachine.fsm import RequestEventKind, RequestState
from cadence.statemachine.plan import RequestEvent, StepPlan, StepResult
from cadence.statemachine.scheduler import Scheduler
from cadence.statemachine.stats import StatsSummary

from .executor import ExecutorBackend, select_requests
from .messages import ExecuteStep, InitExecutor, PromptLogprobs, Ready, StepOutput
from .request_actor import RequestActor
from .trace import TraceRecorder

__all__ = ["SchedulerActor", "StepListener", "HEALTH_OK", "HEALTH_DEGRADED", "HEALTH_CLOSED"]

# A step listener sees each non-empty plan as it is made, with the Trio time.
StepListener = Callable[[StepPlan, float], None]

_EVENT_NAMES = {kind: kind.value for kind in RequestEventKind}
# How long an idle scheduler with live but unschedulable requests waits before
# planning again without being woken (no core state should need it; it keeps a
# surprise from turning into a hang).
_STALL_POLL_S = 0.01
# Most seconds a kill may take before the restart goes ahead anyway.
_KILL_TIMEOUT_S = 5.0
# Failures of a suspect alone that make it the culprit: one could be a transient
# fault striking twice; a fault that follows the request strikes every time.
_CONVICTING_FAILURES = 2
# Failures in a row (no successful executor call between them) that may go
# uncounted while a culprit is isolated: the batch, one per halving of its
# requests (when every half holds a culprit, no clean call comes between), and
# the culprit alone; beyond this the executor itself is suspect.
_BASE_UNCOUNTED_IN_A_ROW = 1 + _CONVICTING_FAILURES
# Each restart pause is the previous one times this, before jitter.
_BACKOFF_FACTOR = 2.0
# A pause is drawn from [1 - J, 1 + J] times its nominal length, so that many
# engines restarting at once do not retry in lockstep.
_BACKOFF_JITTER = 0.25
# Restart pauses remembered in `restart_delays_s`.
_DELAY_LOG = 64

# Step numbers and the like, left out when comparing two failures.
_DIGITS = re.compile(r"\d+")

_log = logging.getLogger("cadence.engine")

HEALTH_OK, HEALTH_DEGRADED, HEALTH_CLOSED = "ok", "degraded", "closed"


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
        restart_backoff_s: float = 0.5,
        restart_backoff_max_s: float = 30.0,
        rng: random.Random | None = None,
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
        self.restart_backoff_s = restart_backoff_s
        self.restart_backoff_max_s = restart_backoff_max_s
        self.plan_ahead = plan_ahead
        self.closed_reason: str | None = None
        self.num_restarts = 0
        self.num_failures = 0
        self.num_ignored_results = 0
        self.num_planned_ahead = 0
        self.num_poisoned = 0
        self.last_failure = ""
        self.restart_delays_s: deque[float] = deque(maxlen=_DELAY_LOG)
        self._rng = rng if rng is not None else random.Random(0)
        self._restarting = False
        # Poison isolation: suspect groups (oldest first), each run as an executor
        # call of its own; the tokens each suspect had when its step failed.
        self._groups: list[list[str]] = []
        self._marks: dict[str, int] = {}
        # A suspect's failures in a group of its own, all alike, and what they looked like.
        self._alone: dict[str, tuple[int, str]] = {}
        self._num_in_a_row = 0  # failures since the last successful executor call
        self._ran_since_isolation = True  # a call succeeded since the isolation began
        self._origin_s: float | None = None  # the counted failure that began it
        self._max_uncounted = _BASE_UNCOUNTED_IN_A_ROW  # failures in a row it may cost
        self._refunds: list[float] = []  # counted failures to forget once a call succeeds
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

    def submit_group(self, actors: list[RequestActor]) -> None:
        """Queue requests with one prompt as a request group (`n` > 1): the core
        computes the prompt once and shares its blocks; each actor learns the
        verdict, the same for all."""
        if self.closed_reason is not None:
            raise EngineClosedError(self.closed_reason)
        self._inbox.append(list(actors))
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
        self._refuse_inbox(error)
        for request_id, actor in list(self.actors.items()):
            actor.close_stream(error)
            self._route([self.core.abort_request(request_id, reason)], self.core.step_id)

    def _refuse_inbox(self, error: BaseException) -> None:
        """Refuse every submission still in the inbox (aborts there need nothing)."""
        for item in self._inbox:
            for actor in (item if type(item) is list else (item,)):
                if isinstance(actor, RequestActor):
                    actor.refuse(error)
        self._inbox.clear()

    async def wait_idle(self) -> None:
        """Wait until no request is live and the inbox is empty."""
        while self.actors or self._inbox:
            if self._idle is None:
                self._idle = trio.Event()
            await self._idle.wait()

    @property
    def health(self) -> str:
        """"closed" once given up or shut, "degraded" while the executor is being
        restarted, else "ok"."""
        if self.closed_reason is not None:
            return HEALTH_CLOSED
        return HEALTH_DEGRADED if self._restarting else HEALTH_OK

    def stats(self) -> StatsSummary:
        """The core's counters plus the executor's failures, restarts and poisoned requests."""
        return attrs.evolve(self.core.stats(), num_executor_failures=self.num_failures,
                            num_executor_restarts=self.num_restarts,
                            num_poisoned_requests=self.num_poisoned)

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
                elif type(item) is list:
                    self._add_group(item)
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
        self._start_actor(actor)

    def _add_group(self, actors: list[RequestActor]) -> None:
        """Submit a request group: all members the consumers have not withdrawn."""
        if self.closed_reason is not None:
            for actor in actors:
                actor.refuse(EngineClosedError(self.closed_reason))
            return
        actors = [actor for actor in actors if not actor.withdrawn]
        if not actors:
            return
        try:
            self.core.add_group([actor.request for actor in actors])
        except CadenceError as exc:
            for actor in actors:
                actor.refuse(exc)
            return
        for actor in actors:
            self._start_actor(actor)

    def _start_actor(self, actor: RequestActor) -> None:
        """An accepted request: record it, run its actor, tell the consumer."""
        request = actor.request
        self.actors[actor.request_id] = actor
        if self.trace is not None:
            group = request.group
            extra = {} if group is None else {"group": group.group_id}
            self.trace.record(trio.current_time(), self.core.step_id, actor.request_id, "add",
                              prompt_len=request.num_prompt_tokens,
                              max_tokens=request.limits.max_tokens,
                              priority=request.priority, tenant=request.tenant, **extra)
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
        if self._groups:
            await self._run_isolated(plan, step)
            return
        if self._pipelined():
            await self._run_pipelined(plan, step)
            return
        if self.plan_ahead and self._no_token_awaited(plan):
            outcome = await self._execute_and_plan_ahead(step)
        else:
            outcome = await self._execute(step)
        failure = self._settle(plan, outcome)
        if failure is not None:
            await self._recover(*failure, None)

    def _settle(self, plan: StepPlan, outcome: StepOutput | str) -> tuple[str, list[str]] | None:
        """Apply the executor's answer to `plan`; None, or why the executor must be
        recovered and which requests the failure may be blamed on."""
        if type(outcome) is StepOutput:
            result = outcome.result
            if outcome.failed and result.step_id == plan.step_id:
                self._fail_named(outcome.failed)
            if outcome.prompt_logprobs and result.step_id == plan.step_id:
                self._route_prompt_logprobs(outcome.prompt_logprobs, plan.step_id)
            events = self.core.update(plan, result)
            self._route(events, plan.step_id)
            if result.step_id == plan.step_id:
                if self._num_in_a_row or self._refunds or not self._ran_since_isolation:
                    self._call_succeeded()
                return None
            # The core ignored an answer for another step; this step's answer is lost.
            # No request can make the executor answer out of turn: nobody is to blame.
            self.num_ignored_results += 1
            return f"executor answered step {result.step_id} when step {plan.step_id} was sent", []
        return outcome, list(plan.num_scheduled_tokens)

    def _pipelined(self) -> bool:
        """Whether steps overlap: the core plans ahead of results (async scheduling),
        the executor takes a step while it runs another, and steps are not paced."""
        return (self.plan_ahead and self.core.config.async_scheduling and not self._interval_s
                and hasattr(self.backend, "submit"))

    async def _run_pipelined(self, plan: StepPlan, step: ExecuteStep) -> None:
        """Hand step N+1 to the executor while step N runs, until there is nothing to
        plan ahead or something fails: the host's planning and input preparation for
        N+1 overlap N's device time, and N+1 computes from N's tokens on the executor's side."""
        submit = self.backend.submit
        call = submit(step)
        while True:
            await trio.lowlevel.checkpoint()  # arrivals and aborts reach the core first
            ahead = None
            if self.closed_reason is None:
                ahead = self._plan()
                if ahead is not None:
                    self.num_planned_ahead += 1
                    ahead_call = submit(ahead[1])
            failure = self._settle(plan, await self._outcome(call.result, plan.step_id))
            if failure is not None:
                # The step handed over behind it is void with the executor's state.
                await self._recover(*failure, None)
                return
            if ahead is None or self.closed_reason is not None:
                return
            (plan, step), call = ahead, ahead_call

    async def _run_isolated(self, plan: StepPlan, step: ExecuteStep) -> None:
        """Run a step as one executor call for the unsuspected requests, then one per
        suspect group (oldest first), so that a failure names its group."""
        groups = self._groups
        member = {rid: i for i, group in enumerate(groups) for rid in group}
        parts: dict[int | None, set[str]] = {}
        for rid in (*plan.num_scheduled_tokens, *plan.new_block_ids):
            parts.setdefault(member.get(rid), set()).add(rid)
        order = sorted(parts, key=lambda index: -1 if index is None else index)
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list] = {}
        failed: dict[str, str] = {}
        prompt_logprobs: dict[str, PromptLogprobs] = {}
        execute_us = 0
        failure: tuple[str, int | None, set[str]] | None = None
        for n, index in enumerate(order):
            part = select_requests(step, parts[index], with_drops=n == 0)
            outcome = await self._execute(part)
            if type(outcome) is not StepOutput:
                failure = (outcome, index, parts[index])
                break
            problem = self._check_part(outcome, part.plan, parts[index])
            if problem is not None:
                failure = (problem, None, set())  # an answer out of turn blames nobody
                break
            result = outcome.result
            sampled.update(result.sampled_token_ids)
            logprobs.update(result.logprobs or {})
            failed.update(outcome.failed)
            prompt_logprobs.update(outcome.prompt_logprobs)
            execute_us += result.execute_us
            self._call_succeeded()
        if failed:
            self._fail_named(failed)
        self._route_prompt_logprobs(prompt_logprobs, plan.step_id)
        result = StepResult(plan.step_id, sampled, logprobs or None, execute_us)
        self._route(self.core.update(plan, result), plan.step_id)
        self._clear_suspects()
        if failure is not None:
            reason, index, members = failure
            group = None if index is None else groups[index]
            await self._recover(reason, [rid for rid in plan.num_scheduled_tokens if rid in members], group)

    def _check_part(self, output: StepOutput, plan: StepPlan, members: set[str]) -> str | None:
        """Why `output` cannot be the answer to one part of a step, or None: calls of
        one step share a step id, so an answer to another part is told by its requests."""
        result = output.result
        if result.step_id != plan.step_id:
            self.num_ignored_results += 1
            return f"executor answered step {result.step_id} when part of step {plan.step_id} was sent"
        answered = result.sampled_token_ids.keys() | output.failed.keys()
        requests = self.core.requests
        awaited = {rid for rid in plan.num_scheduled_tokens
                   if (r := requests.get(rid)) is not None and r.num_computed_tokens >= len(r.all_token_ids)}
        if not answered <= members or not awaited <= answered:
            self.num_ignored_results += 1
            return (f"executor answered part of step {plan.step_id} for {sorted(answered - members)[:4]} "
                    f"and not for {sorted(awaited - answered)[:4]}")
        return None

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
        return await self._outcome(partial(self.backend.execute, step), step.plan.step_id)

    async def _outcome(self, answer: Callable[[], Awaitable[StepOutput]], step_id: int) -> StepOutput | str:
        """What `answer()` returns within the step timeout, or why there is none."""
        with trio.move_on_after(self.step_timeout_s):
            try:
                return await answer()
            except (ExecutorError, ProtocolError) as exc:
                return f"step {step_id} failed: {exc}"
        return f"step {step_id} timed out after {self.step_timeout_s} s"

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
    async def _recover(self, reason: str, part: list[str], group: list[str] | None) -> None:
        """Forget the executor's state, narrow down the blame, then restart it or give up.

        part: the requests of the executor call that failed; group: the suspect
        group that call ran (None: it ran unsuspected requests).
        """
        core = self.core
        self._ahead = None
        counted = self._note_failure(reason, counts=group is None)
        self._blame(part, group, counted)
        self._route(core.executor_lost(), core.step_id)
        self._restarting = True
        try:
            while True:
                if counted and not self._may_restart(trio.current_time()):
                    self._give_up(reason)
                    return
                await trio.sleep(self._backoff_s())
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
                        _log.info("executor restarted (restart %d)", self.num_restarts)
                        return
                    reason = (f"restarted executor has {ready.num_blocks} blocks of {ready.block_size}, "
                              f"the scheduler needs {core.blocks.num_blocks} of {core.blocks.block_size}")
                counted = self._note_failure(reason, counts=True)
        finally:
            self._restarting = False

    def _note_failure(self, reason: str, counts: bool) -> bool:
        """Log and count one executor failure; whether it counts toward max_restarts."""
        self.num_failures += 1
        self._num_in_a_row += 1
        self.last_failure = reason
        counted = counts or self._num_in_a_row > self._max_uncounted
        _log.warning("executor failure %d (%d in a row%s): %s", self.num_failures, self._num_in_a_row,
                     "" if counted else ", isolating a request", reason)
        return counted

    def _backoff_s(self) -> float:
        """The pause before the next restart: doubling with each failure in a row, jittered, bounded."""
        nominal = self.restart_backoff_s * _BACKOFF_FACTOR ** max(0, self._num_in_a_row - 1)
        jitter = 1.0 + _BACKOFF_JITTER * (2.0 * self._rng.random() - 1.0)
        delay = min(self.restart_backoff_max_s, nominal * jitter)
        self.restart_delays_s.append(delay)
        return delay

    def _call_succeeded(self) -> None:
        """An executor call answered: failures are no longer in a row, and the
        counted failures of isolations that found their culprit are forgotten."""
        self._num_in_a_row = 0
        self._ran_since_isolation = True
        times = self._failure_times
        for at in self._refunds:
            if at in times:
                times.remove(at)
        self._refunds.clear()

    def _blame(self, part: list[str], group: list[str] | None, counted: bool) -> None:
        """Split the failed call's live requests into halves that run apart from now
        on; a suspect group of one that failed again holds the culprit (unless so
        many calls failed in a row that the executor itself is suspect)."""
        core = self.core
        live = [rid for rid in part if rid in core.requests]
        for rid in live:
            self._marks[rid] = len(core.requests[rid].all_token_ids)
        if group is not None:
            self._groups = [g for g in self._groups if g is not group]
            # Members the failed call did not run (not scheduled in that step) stay suspects.
            rest = [rid for rid in group if rid not in part and rid in self._marks]
            if rest:
                self._groups.append(rest)
            if len(live) == 1:
                rid = live[0]
                # A fault that follows a request fails the same way each time; a
                # different failure starts the count again.
                signature = _DIGITS.sub("#", self.last_failure)
                count, seen = self._alone.get(rid, (0, signature))
                alone = count + 1 if seen == signature else 1
                self._alone[rid] = (alone, signature)
                if alone >= _CONVICTING_FAILURES and not counted:
                    self._convict(rid)
                    return
        elif live and not self._groups:
            self._ran_since_isolation = False
            # The time `_may_restart` is about to record for this failure.
            self._origin_s = trio.current_time() if counted else None
            self._max_uncounted = _BASE_UNCOUNTED_IN_A_ROW + math.ceil(math.log2(max(1, len(live))))
        half = (len(live) + 1) // 2
        self._groups.extend(g for g in (live[:half], live[half:]) if g)

    def _convict(self, request_id: str) -> None:
        """Fail the request that made the executor fail in a batch, then alone, the same way each time."""
        detail = (f"request {request_id!r} makes the executor fail: it failed in a batch, then "
                  f"{self._alone[request_id][0]} times alone (last: {self.last_failure})")
        if self._ran_since_isolation:
            error: ExecutorError = PoisonRequestError(detail)
            if self._origin_s is not None:
                self._refunds.append(self._origin_s)
                self._origin_s = None
        else:
            # Nothing else ran since: the executor may be what fails, so this is no verdict.
            error = ExecutorError(detail)
        self._fail_poisoned(request_id, error, detail)

    def _fail_named(self, failed: dict[str, str]) -> None:
        """Fail the requests the executor could not serve; nothing else is touched."""
        for request_id, why in failed.items():
            if request_id in self.actors and request_id in self.core.requests:
                detail = f"request {request_id!r} failed in the executor: {why}"
                self._fail_poisoned(request_id, PoisonRequestError(detail), detail)
        ahead = self._ahead
        if ahead is not None and not failed.keys().isdisjoint(ahead[0].num_scheduled_tokens):
            # The step planned ahead goes out after this one; the executor no longer has them.
            plan, step = ahead
            keep = {*plan.num_scheduled_tokens, *plan.new_block_ids, *step.sampling} - failed.keys()
            self._ahead = (plan, select_requests(step, keep))

    def _fail_poisoned(self, request_id: str, error: ExecutorError, detail: str) -> None:
        self.num_poisoned += 1
        self._marks.pop(request_id, None)
        self._alone.pop(request_id, None)
        _log.warning("failing request %s alone: %s", request_id, detail)
        self.actors[request_id].close_stream(error)
        self._route([self.core.fail_request(request_id, detail)], self.core.step_id)

    def _clear_suspects(self) -> None:
        """Drop suspects that completed or got a token past the point their step failed at."""
        requests, marks = self.core.requests, self._marks
        for rid in list(marks):
            request = requests.get(rid)
            if request is None or len(request.all_token_ids) > marks[rid]:
                del marks[rid]
                self._alone.pop(rid, None)
        for group in self._groups:
            group[:] = [rid for rid in group if rid in marks]  # in place: a failure may name it
        self._groups = [group for group in self._groups if group]

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
        _log.error("engine closed: %s", self.closed_reason)
        error = EngineClosedError(self.closed_reason)
        self._refuse_inbox(error)
        core = self.core
        for request_id in list(self.actors):
            self._route([core.fail_request(request_id, self.closed_reason)], core.step_id)
        self._groups.clear()
        self._marks.clear()
        self._alone.clear()
        self._check_idle()

    # ---- routing ---------------------------------------------------------------
    def _route_prompt_logprobs(self, scored: dict[str, PromptLogprobs], step: int) -> None:
        """Hand each request's scored prompt tokens to its actor, before the step's
        events (the step that ends a prompt also samples its first token); as the
        core does with tokens, a request admitted again since the step gets none."""
        actors = self.actors
        for rid, part in scored.items():
            actor = actors.get(rid)
            if actor is None:
                continue
            request = actor.request
            if request.fsm.state is RequestState.RUNNING and request.admitted_step <= step:
                actor.add_prompt_logprobs(part.first_position, part.entries)

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
