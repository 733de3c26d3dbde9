"""The scheduler actor: the only caller of the scheduling core, and the
supervisor of the executor.

It runs two tasks. The inbox task (`RequestRouter`, actors/routing.py) applies
submissions and aborts to the core as they arrive (an abort frees its blocks at
once, even mid-step). The step task, this class, loops: plan a step with `core.schedule()`, send it to the executor,
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
the prefix cache is reset) and the executor is killed and started again
(`ExecutorSupervisor`, actors/supervision.py), after a pause that doubles with
each failure in a row (with jitter, up to `restart_backoff_max_s`). More than `max_restarts` counted failures within
`restart_window_s` fail every live request and close the engine to new ones.

Poison requests: a request the executor names in `StepOutput.failed` fails
alone (`PoisonRequestError`) and the step's other results stand. A failure
that names nobody makes its requests suspects, run apart from the others
until the blame narrows to one request (`cadence.statemachine.isolation`,
which also decides which failures count toward `max_restarts`); it fails with
`PoisonRequestError` (a plain `ExecutorError` if the executor ran nothing else
meanwhile, since then the executor may be at fault). The others keep every
token they had.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import attrs
import trio

from cadence.statemachine.errors import ExecutorError, PoisonRequestError
from cadence.statemachine.isolation import Isolation
from cadence.statemachine.plan import StepPlan, StepResult
from cadence.statemachine.scheduler import Scheduler
from cadence.statemachine.stats import StatsSummary

from .executor import ExecutorBackend, select_requests
from .messages import ExecuteStep, PromptLogprobs, StepOutput
from .request_actor import RequestActor
from .routing import Bell, RequestRouter
from .supervision import ExecutorSupervisor
from .trace import TraceRecorder

__all__ = ["SchedulerActor", "StepListener", "HEALTH_OK", "HEALTH_DEGRADED", "HEALTH_CLOSED"]

# A step listener sees each non-empty plan as it is made, with the Trio time.
StepListener = Callable[[StepPlan, float], None]

# How long an idle scheduler with live but unschedulable requests waits before
# planning again without being woken (no core state should need it; it keeps a
# surprise from turning into a hang).
_STALL_POLL_S = 0.01

_log = logging.getLogger("cadence.engine")

HEALTH_OK, HEALTH_DEGRADED, HEALTH_CLOSED = "ok", "degraded", "closed"


class SchedulerActor:
    """Owns the core `Scheduler`: feeds it submissions, aborts and executor
    results, routes its events to the request actors, supervises the executor."""

    def __init__(self, core: Scheduler, supervisor: ExecutorSupervisor, spawn: Callable, *,
                 max_restarts: int = 3, restart_window_s: float = 300.0, plan_ahead: bool = True,
                 trace: TraceRecorder | None = None, on_step: StepListener | None = None) -> None:
        self.core = core
        self.supervisor = supervisor
        self.router = RequestRouter(core, spawn, trace, self._wake)
        self.isolation = Isolation(max_restarts, restart_window_s)
        self.trace = trace
        self.on_step = on_step
        self.plan_ahead = plan_ahead
        self.num_ignored_results = 0
        self.num_planned_ahead = 0
        self.num_poisoned = 0
        self._restarting = False
        self._step_bell = Bell()
        self._ahead: tuple[StepPlan, ExecuteStep] | None = None
        self._interval_s = core.config.schedule_interval_us / 1e6
        self._last_step_s = -math.inf

    # ---- what other tasks call (synchronous, never blocks) ---------------------
    @property
    def actors(self) -> dict[str, RequestActor]:
        """The live requests' actors by request id."""
        return self.router.actors

    @property
    def closed_reason(self) -> str | None:
        """Why the engine takes no more requests, or None while it does."""
        return self.router.closed_reason

    @property
    def num_failures(self) -> int:
        """Executor failures so far (failed calls and failed restarts)."""
        return self.isolation.num_failures

    @property
    def last_failure(self) -> str:
        """What the last executor failure looked like ("" before the first)."""
        return self.isolation.last_failure

    @property
    def num_restarts(self) -> int:
        """Restarts of the executor that succeeded."""
        return self.supervisor.num_restarts

    @property
    def backend(self) -> ExecutorBackend:
        """The executor backend being supervised."""
        return self.supervisor.backend

    def abort_nowait(self, request_id: str, detail: str = "aborted") -> None:
        """Queue an abort (`RequestRouter.abort_nowait`)."""
        self.router.abort_nowait(request_id, detail)

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
            nursery.start_soon(self.router.run_inbox)
            nursery.start_soon(self._step_loop)
            task_status.started()

    async def _step_loop(self) -> None:
        while self.closed_reason is None:
            if self._ahead is not None:
                step, self._ahead = self._ahead, None
            else:
                if self._interval_s:
                    await trio.sleep_until(self._last_step_s + self._interval_s)
                step = self._plan()
            if step is None:
                if self.isolation.marks:  # suspects that completed or left meanwhile
                    self.isolation.clear(self._num_tokens())
                # Live requests that could not be scheduled: look again after a short poll.
                await self._step_bell.wait(_STALL_POLL_S if self.core.has_work() else math.inf)
                continue
            await self._run_step(*step)

    def _plan(self) -> tuple[StepPlan, ExecuteStep] | None:
        """Plan one step; None if there is nothing to run."""
        core = self.core
        if not core.has_work():
            return None
        now = trio.current_time()
        plan = core.schedule(now_s=now)
        self.router.route(core.take_events(), plan.step_id)
        if plan.is_empty:
            return None
        self._last_step_s = now
        actors = self.actors
        sampling = {d.request_id: actors[d.request_id].params for d in plan.new_requests}
        if self.on_step is not None:
            self.on_step(plan, now)
        return plan, ExecuteStep(plan, sampling)

    async def _run_step(self, plan: StepPlan, step: ExecuteStep) -> None:
        if self.isolation.groups:
            await self._run_isolated(plan, step)
        elif self._pipelined():
            await self._run_pipelined(plan, step)
        else:
            if self.plan_ahead and not awaits_token(plan, self.core):
                outcome = await self._execute_and_plan_ahead(step)
            else:
                outcome = await self.supervisor.execute(step)
            failure = self._settle(plan, outcome)
            if failure is not None:
                await self._recover(*failure, None)

    def _settle(self, plan: StepPlan, outcome: StepOutput | str) -> tuple[str, list[str]] | None:
        """Apply the executor's answer to `plan`; None, or why the executor must be
        recovered and which requests the failure may be blamed on."""
        if type(outcome) is not StepOutput:
            return outcome, list(plan.num_scheduled_tokens)
        result = outcome.result
        if result.step_id != plan.step_id:
            # The core ignores an answer for another step; this step's answer is lost.
            # No request can make the executor answer out of turn: nobody is to blame.
            self.router.route(self.core.update(plan, result), plan.step_id)
            self.num_ignored_results += 1
            return f"executor answered step {result.step_id} when step {plan.step_id} was sent", []
        if outcome.failed:
            self._fail_named(outcome.failed)
        if outcome.prompt_logprobs:
            self.router.route_prompt_logprobs(outcome.prompt_logprobs, plan.step_id)
        self.router.route(self.core.update(plan, result), plan.step_id)
        self.isolation.call_succeeded()
        return None

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
            failure = self._settle(plan, await self.supervisor.outcome(call.result, plan.step_id))
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
        answers: list[StepOutput] = []
        failure: tuple[str, list[str], int | None] | None = None
        parts = self.isolation.partition((*plan.num_scheduled_tokens, *plan.new_block_ids))
        for n, (group, members) in enumerate(parts):
            part = select_requests(step, set(members), with_drops=n == 0)
            outcome = await self.supervisor.execute(part)
            if type(outcome) is not StepOutput:
                failure = (outcome, [rid for rid in plan.num_scheduled_tokens if rid in members], group)
                break
            problem = part_problem(outcome, part.plan, set(members), self.core)
            if problem is not None:
                self.num_ignored_results += 1
                failure = (problem, [], None)  # an answer out of turn blames nobody
                break
            answers.append(outcome)
            self.isolation.call_succeeded()
        result, failed, prompt_logprobs = merge_answers(plan.step_id, answers)
        self._fail_named(failed)
        self.router.route_prompt_logprobs(prompt_logprobs, plan.step_id)
        self.router.route(self.core.update(plan, result), plan.step_id)
        self.isolation.clear(self._num_tokens())
        if failure is not None:
            await self._recover(*failure)

    async def _execute_and_plan_ahead(self, step: ExecuteStep) -> StepOutput | str:
        box: list[StepOutput | str] = []

        async def execute() -> None:
            box.append(await self.supervisor.execute(step))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(execute)
            await trio.lowlevel.checkpoint()  # the executor takes step N first
            if self.closed_reason is None and not box:
                self._ahead = self._plan()
                if self._ahead is not None:
                    self.num_planned_ahead += 1
        return box[0]

    # ---- supervision -----------------------------------------------------------
    async def _recover(self, reason: str, part: list[str], group: int | None) -> None:
        """Forget the executor's state, narrow down the blame, then restart it or give up.

        part: the requests of the executor call that failed; group: the suspect
        group that call ran (None: it ran unsuspected requests).
        """
        core = self.core
        self._ahead = None
        tokens = self._num_tokens(part)
        decision = self.isolation.call_failed(trio.current_time(), reason, tokens, group)
        _log.warning("executor failure %d (%d in a row%s): %s", self.num_failures,
                     self.isolation.num_in_a_row, "" if decision.counted else ", isolating a request", reason)
        if (convicted := decision.conviction) is not None:
            error = PoisonRequestError if convicted.verdict else ExecutorError
            self._fail_poisoned(convicted.request_id, error(convicted.detail), convicted.detail)
        self.router.route(core.executor_lost(), core.step_id)
        self._restarting = True
        try:
            may_restart = not decision.give_up
            while may_restart:
                reason = await self.supervisor.restart(self.isolation.num_in_a_row, core.blocks)
                if reason is None:
                    return
                may_restart = self.isolation.restart_failed(trio.current_time(), reason)
            self._give_up(reason)
        finally:
            self._restarting = False

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
        self.isolation.forget(request_id)
        _log.warning("failing request %s alone: %s", request_id, detail)
        self.router.fail(request_id, error, detail)

    def _give_up(self, reason: str) -> None:
        """Fail every live request and refuse new ones."""
        isolation = self.isolation
        self.router.give_up(f"executor failed {isolation.num_charged + 1} times within "
                            f"{isolation.restart_window_s} s; last failure: {reason}")
        _log.error("engine closed: %s", self.closed_reason)
        isolation.give_up()

    def _num_tokens(self, request_ids=None) -> dict[str, int]:
        """The tokens each live request (of `request_ids`, or all) has."""
        requests = self.core.requests
        ids = requests if request_ids is None else [rid for rid in request_ids if rid in requests]
        return {rid: len(requests[rid].all_token_ids) for rid in ids}

    def _wake(self) -> None:
        self._step_bell.ring()


def awaits_token(plan: StepPlan, core: Scheduler) -> bool:
    """Whether some request of `plan` will sample a token (not all prefill chunks)."""
    requests = core.requests
    for rid in plan.num_scheduled_tokens:
        request = requests.get(rid)
        if request is not None and request.num_computed_tokens >= len(request.all_token_ids):
            return True
    return False


def part_problem(output: StepOutput, plan: StepPlan, members: set[str], core: Scheduler) -> str | None:
    """Why `output` cannot be the answer to one part of a step, or None: calls of
    one step share a step id, so an answer to another part is told by its requests."""
    result = output.result
    if result.step_id != plan.step_id:
        return f"executor answered step {result.step_id} when part of step {plan.step_id} was sent"
    answered = result.sampled_token_ids.keys() | output.failed.keys()
    requests = core.requests
    awaited = {rid for rid in plan.num_scheduled_tokens
               if (r := requests.get(rid)) is not None and r.num_computed_tokens >= len(r.all_token_ids)}
    if not answered <= members or not awaited <= answered:
        return (f"executor answered part of step {plan.step_id} for {sorted(answered - members)[:4]} "
                f"and not for {sorted(awaited - answered)[:4]}")
    return None


def merge_answers(step_id: int, answers: list[StepOutput]
                  ) -> tuple[StepResult, dict[str, str], dict[str, PromptLogprobs]]:
    """The answers to the parts of one step as one result, with the requests they
    name as failed and their scored prompt tokens."""
    sampled: dict[str, list[int]] = {}
    logprobs: dict[str, list] = {}
    failed: dict[str, str] = {}
    prompt_logprobs: dict[str, PromptLogprobs] = {}
    for output in answers:
        sampled.update(output.result.sampled_token_ids)
        logprobs.update(output.result.logprobs or {})
        failed.update(output.failed)
        prompt_logprobs.update(output.prompt_logprobs)
    execute_us = sum(output.result.execute_us for output in answers)
    return StepResult(step_id, sampled, logprobs or None, execute_us), failed, prompt_logprobs
