"""The way requests reach the scheduling core and its events reach them:
`RequestRouter` holds the inbox of submissions and aborts, applied to the
core by a task of their own as they arrive (an abort frees its blocks at once,
even mid-step), and delivers the core's events, in the core's order, to each
request's actor (and to the trace). Everything here is synchronous but the
inbox task, so other tasks never wait for room in it."""

from __future__ import annotations

import math
from collections import deque
from typing import Callable

import trio
from trio.lowlevel import Abort, current_task, reschedule, wait_task_rescheduled

from cadence.statemachine.errors import CadenceError, EngineClosedError, RequestNotFoundError
from cadence.statemachine.fsm import RequestEventKind, RequestState
from cadence.statemachine.plan import RequestEvent
from cadence.statemachine.scheduler import Scheduler

from .messages import PromptLogprobs
from .request_actor import RequestActor
from .trace import TraceRecorder

__all__ = ["RequestRouter", "Bell"]

_EVENT_NAMES = {kind: kind.value for kind in RequestEventKind}


class RequestRouter:
    """Admits request actors into the core and delivers the core's events to them.

    spawn: starts an accepted actor's task; on_change: called after the inbox
    task has applied what arrived (the step loop may have work)."""

    def __init__(self, core: Scheduler, spawn: Callable, trace: TraceRecorder | None,
                 on_change: Callable[[], None]) -> None:
        self.core = core
        self.actors: dict[str, RequestActor] = {}
        self.trace = trace
        self.closed_reason: str | None = None
        self._spawn = spawn
        self._on_change = on_change
        self._inbox: deque = deque()
        self._bell = Bell()
        self._idle: trio.Event | None = None

    # ---- what other tasks call (synchronous, never blocks) ---------------------
    def submit(self, item: RequestActor | list[RequestActor]) -> None:
        """Queue a request (or, as a list, a request group with one prompt, `n` > 1)
        for the core; each actor learns the verdict."""
        if self.closed_reason is not None:
            raise EngineClosedError(self.closed_reason)
        self._inbox.append(item)
        self._bell.ring()

    def abort_nowait(self, request_id: str, detail: str = "aborted") -> None:
        """Queue an abort; a request that already completed is left alone."""
        if self.closed_reason is None:
            self._inbox.append((request_id, detail))
            self._bell.ring()

    def close(self, reason: str = "engine closed") -> None:
        """Stop taking requests and abort every live one (used at shutdown)."""
        if self.closed_reason is None:
            self.closed_reason = reason
        error = EngineClosedError(self.closed_reason)
        self._refuse_inbox(error)
        core = self.core
        for request_id, actor in list(self.actors.items()):
            actor.close_stream(error)
            self.route([core.abort_request(request_id, reason)], core.step_id)

    def give_up(self, reason: str) -> None:
        """Fail every live request with `reason` and refuse new ones."""
        self.closed_reason = reason
        self._refuse_inbox(EngineClosedError(reason))
        core = self.core
        for request_id in list(self.actors):
            self.route([core.fail_request(request_id, reason)], core.step_id)
        self._check_idle()

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

    # ---- the inbox task ----------------------------------------------------------
    async def run_inbox(self) -> None:
        """Apply submissions and aborts to the core as they arrive, until cancelled."""
        inbox = self._inbox
        while True:
            if not inbox:
                await self._bell.wait(math.inf)
            while inbox:
                item = inbox.popleft()
                if type(item) is tuple:
                    self.abort(*item)
                else:
                    self.add(item)
            self._on_change()
            self._check_idle()

    def _check_idle(self) -> None:
        if self._idle is not None and not self.actors and not self._inbox:
            self._idle.set()
            self._idle = None

    # ---- applied by the inbox task and the step loop ---------------------------------
    def add(self, item: RequestActor | list[RequestActor]) -> None:
        """Submit one request, or a request group (a list, `n` > 1: the core computes
        the prompt once and shares its blocks); each actor learns the verdict.
        Members the consumers have withdrawn are left out."""
        group = type(item) is list
        actors = [actor for actor in (item if group else [item]) if not actor.withdrawn]
        if self.closed_reason is not None:
            for actor in (item if group else [item]):
                actor.refuse(EngineClosedError(self.closed_reason))
            return
        if not actors:
            return
        try:
            if group:
                self.core.add_group([actor.request for actor in actors])
            else:
                self.core.add_request(actors[0].request)
        except CadenceError as exc:
            for actor in actors:
                actor.refuse(exc)
            return
        for actor in actors:
            self._start(actor)

    def _start(self, actor: RequestActor) -> None:
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

    def abort(self, request_id: str, detail: str) -> None:
        """Abort a live request; one that completed meanwhile is left alone."""
        if request_id not in self.actors:
            return
        try:
            event = self.core.abort_request(request_id, detail)
        except RequestNotFoundError:
            return
        self.route([event], self.core.step_id)

    def fail(self, request_id: str, error: BaseException, detail: str) -> None:
        """End one request's stream with `error` and fail it in the core."""
        self.actors[request_id].close_stream(error)
        self.route([self.core.fail_request(request_id, detail)], self.core.step_id)

    def route_prompt_logprobs(self, scored: dict[str, PromptLogprobs], step: int) -> None:
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

    def route(self, events: list[RequestEvent], step: int) -> None:
        """Deliver each event to its request's actor, in the core's order."""
        actors = self.actors
        trace = self.trace
        for event in events:
            rid = event.request_id
            if trace is not None:
                _record(trace, event, step)
            actors[rid].deliver(event)
            if event.finish_reason is not None:
                del actors[rid]
        if not actors:
            self._check_idle()


def _record(trace: TraceRecorder, event: RequestEvent, step: int) -> None:
    now = trio.current_time()
    rid = event.request_id
    if event.token_ids:
        trace.record(now, step, rid, "tokens", tokens=event.token_ids)
    if event.transition is not None:
        reason = event.finish_reason.value if event.finish_reason is not None else None
        trace.record(now, step, rid, _EVENT_NAMES[event.transition], reason)


class Bell:
    """Wakes one waiting task; rung from synchronous code, never blocks."""

    def __init__(self) -> None:
        self._task = None

    def ring(self) -> None:
        """Wake the waiting task, if any."""
        task, self._task = self._task, None
        if task is not None:
            reschedule(task)

    async def wait(self, timeout_s: float) -> None:
        """Sleep until rung or until `timeout_s` passes."""
        with trio.move_on_after(timeout_s):
            self._task = current_task()
            await wait_task_rescheduled(self._abort)

    def _abort(self, raise_cancel) -> Abort:
        self._task = None
        return Abort.SUCCEEDED
