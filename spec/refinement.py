"""Refinement: every move of the real core, seen through the abstraction
function, is a step the reference spec allows, and every invariant holds.

`StepChecker` checks one move given the harness before and after it;
`CheckedHarness` is a `Harness` that runs those checks after each move and
raises `SpecViolation` at the first failure. Counterexamples printed by the
explorer are plain `CheckedHarness` scripts.
"""

from __future__ import annotations

from cadence.statemachine.invariants import violations

from .harness import EOS_TOKEN, TOKEN, Harness
from .invariants import PLAN_INVARIANTS, inflight_violations, transition_events
from .reference import Abstraction, ReferenceSpec, RefRequest, RefState


class SpecViolation(AssertionError):
    """A move of the real core broke an invariant or left the reference spec."""


class StepChecker:
    """Checks moves of one scheduler configuration against the spec and the invariants."""

    def __init__(self, config, cache_config, class_of=None) -> None:
        self.spec = ReferenceSpec(config, cache_config, class_of)
        self.abstract = Abstraction()

    def state(self, h: Harness) -> RefState:
        """The abstract state of the harness's scheduler."""
        return self.abstract(h.scheduler)

    def check_state(self, h: Harness) -> list[str]:
        """The state invariants of DESIGN §4 on the real core, and the predicates
        over its plans in flight (budgets, overlap)."""
        return violations(h.scheduler) + inflight_violations(
            h.scheduler, [f.plan for f in h.inflight])

    def check_add(self, before: RefState, after: RefState, request) -> list[str]:
        """Submitting `request` (a core `Request`) queued it or, if it had to be refused, changed nothing."""
        return _diff("add", self.spec.add(before, _ref_of(request, after)), after)

    def check_add_group(self, before: RefState, after: RefState, requests) -> list[str]:
        """Submitting a group (core `Request`s with one prompt) queued all of them
        in one group or, if any had to be refused, changed nothing."""
        group = [_ref_of(r, after) for r in requests]
        out = _diff("add_group", self.spec.add_group(before, group), after)
        queued = [after.requests[r.request_id] for r in requests if r.request_id in after.requests]
        if queued:
            # A group exists where there is something to share: a full block before the last token.
            sharing = len(queued) > 1 and queued[0].num_prompt_tokens > self.spec.block_size
            groups = {r.group for r in queued}
            if len(groups) != 1 or (None in groups) == sharing:
                out.append(f"add_group: the members are in groups {[r.group for r in queued]}")
        return out

    def check_remove(self, before: RefState, after: RefState, request_id: str, events) -> list[str]:
        """An abort or failure removed exactly that request."""
        out = _diff("abort/fail", self.spec.remove(before, request_id), after)
        return out + transition_events(before, after, events)

    def check_executor_lost(self, before: RefState, after: RefState, events) -> list[str]:
        """Losing the executor sent every running request back to waiting."""
        out = _diff("executor_lost", self.spec.executor_lost(before), after)
        return out + transition_events(before, after, events)

    def check_schedule(self, h_after: Harness, before: RefState, after: RefState, plan,
                       events) -> list[str]:
        """A plan is one of the steps the spec allows, within budget."""
        s = h_after.scheduler
        out = [f"{name}: {m}" for name, pred in PLAN_INVARIANTS.items() for m in pred(s, plan)]
        out += self.spec.schedule_problems(before, after, plan.step_id, plan.num_scheduled_tokens,
                                           s.now_s)
        return out + transition_events(before, after, events)

    def check_update(self, before: RefState, after: RefState, step_id: int, sampled,
                     events) -> list[str]:
        """A result appended exactly the sampled tokens the plan was waiting for."""
        after = self.abstract.learn(after, self.spec.answer(before, step_id, sampled)[3])
        out = self.spec.update_problems(before, after, step_id, sampled)
        return out + transition_events(before, after, events)


def _ref_of(request, after: RefState) -> RefRequest:
    """A newly submitted core `Request` as the spec sees it (its group as the core
    reports it after the move, since the core names groups)."""
    lim = request.limits
    queued = after.requests.get(request.request_id)
    return RefRequest(request.request_id, "pending", tuple(request.all_token_ids),
                      request.num_prompt_tokens, lim.max_tokens, lim.min_tokens,
                      request.stop_token_set, 0, request.priority, request.tenant,
                      request.arrival_s, queued.deadline_s if queued is not None else request.deadline_s,
                      (), queued.group if queued is not None else None)


def _diff(what: str, expected: RefState, actual: RefState) -> list[str]:
    out = []
    for rid in sorted(set(expected.requests) | set(actual.requests)):
        e, a = expected.requests.get(rid), actual.requests.get(rid)
        if e != a:
            out.append(f"{what}: {rid} is {a}, spec says {e}")
    if dict(expected.contents) != dict(actual.contents):
        out.append(f"{what}: cached contents {dict(actual.contents)}, spec says {dict(expected.contents)}")
    if dict(expected.awaiting) != dict(actual.awaiting):
        out.append(f"{what}: awaiting {dict(actual.awaiting)}, spec says {dict(expected.awaiting)}")
    if tuple(expected.inflight) != tuple(actual.inflight):
        out.append(f"{what}: plans in flight {actual.inflight}, spec says {expected.inflight}")
    if dict(expected.deferred) != dict(actual.deferred):
        out.append(f"{what}: answers held back {dict(actual.deferred)}, "
                   f"spec says {dict(expected.deferred)}")
    return out


class CheckedHarness(Harness):
    """A `Harness` that checks every move against the spec and the invariants,
    raising `SpecViolation` at the first failure."""

    def __init__(self, config=None, cache_config=None, policy=None, *, record: bool = False,
                 class_of=None) -> None:
        super().__init__(config, cache_config, policy, record=record)
        s = self.scheduler
        self.checker = StepChecker(s.config, s.cache_config, class_of)

    def _raise(self, move: str, problems: list[str]) -> None:
        problems = problems + self.checker.check_state(self)
        if problems:
            raise SpecViolation(f"after {move}: " + "; ".join(problems))

    def add(self, request_id=None, prompt=(1, 2, 3), max_tokens=2, **kw) -> bool:
        """`Harness.add`, checked."""
        before = self.checker.state(self)
        rid = self.fresh_id() if request_id is None else request_id
        ok = super().add(rid, prompt, max_tokens, **kw)
        after = self.checker.state(self)
        request = self.scheduler.requests.get(rid) if ok else None
        if request is not None:
            self._raise(f"add({rid!r})", self.checker.check_add(before, after, request))
        else:
            self._raise(f"add({rid!r}) refused", _diff("refused add", before, after))
        return ok

    def add_group(self, prompt=(1, 2, 3), n=2, max_tokens=2, **kw) -> bool:
        """`Harness.add_group`, checked."""
        before = self.checker.state(self)
        ids = [f"r{self.num_added + i}" for i in range(n)]
        ok = super().add_group(prompt, n, max_tokens, **kw)
        after = self.checker.state(self)
        requests = [self.scheduler.requests[rid] for rid in ids] if ok else []
        if ok:
            self._raise(f"add_group({ids})", self.checker.check_add_group(before, after, requests))
        else:
            self._raise(f"add_group({ids}) refused", _diff("refused add_group", before, after))
        return ok

    def abort(self, request_id: str) -> None:
        """`Harness.abort`, checked."""
        before = self.checker.state(self)
        super().abort(request_id)
        after = self.checker.state(self)
        self._raise(f"abort({request_id!r})",
                    self.checker.check_remove(before, after, request_id, self.last_events))

    def fail(self, request_id: str) -> None:
        """`Harness.fail`, checked."""
        before = self.checker.state(self)
        super().fail(request_id)
        after = self.checker.state(self)
        self._raise(f"fail({request_id!r})",
                    self.checker.check_remove(before, after, request_id, self.last_events))

    def executor_lost(self) -> None:
        """`Harness.executor_lost`, checked."""
        before = self.checker.state(self)
        super().executor_lost()
        after = self.checker.state(self)
        self._raise("executor_lost()",
                    self.checker.check_executor_lost(before, after, self.last_events))

    def schedule(self):
        """`Harness.schedule`, checked."""
        before = self.checker.state(self)
        plan = super().schedule()
        after = self.checker.state(self)
        self._raise(f"schedule() of step {plan.step_id}",
                    self.checker.check_schedule(self, before, after, plan, self.last_events))
        return plan

    def complete(self, eos=(), index: int = 0):
        """`Harness.complete`, checked."""
        before = self.checker.state(self)
        flight = self.inflight[index]
        stop = set(eos)
        sampled = {rid: [EOS_TOKEN if rid in stop else TOKEN] for rid in flight.samplers}
        events = super().complete(eos, index)
        after = self.checker.state(self)
        self._raise(f"complete() of step {flight.plan.step_id}",
                    self.checker.check_update(before, after, flight.plan.step_id, sampled, events))
        return events
