"""The request state machine: every legal edge of DESIGN §3, and nothing else."""

from __future__ import annotations

import itertools

import pytest

from cadence.statemachine.errors import CadenceError, IllegalTransition
from cadence.statemachine.fsm import (
    FINISH_REASONS, TRANSITIONS, FinishReason, RequestEventKind, RequestFSM, RequestState,
    check_finish_reason, next_state,
)

P, R, C = RequestState.PENDING, RequestState.RUNNING, RequestState.COMPLETED
E = RequestEventKind
F = FinishReason

# DESIGN §3, written out independently of the code's table.
DESIGN_EDGES = {
    (P, E.ADMIT): R,
    (P, E.ABORT): C,
    (P, E.REJECT): C,
    (P, E.FAIL): C,
    (R, E.PREEMPT): P,
    (R, E.FINISH): C,
    (R, E.ABORT): C,
    (R, E.FAIL): C,
    (R, E.EXECUTOR_LOST): P,
}
DESIGN_REASONS = {
    E.FINISH: {F.STOP, F.LENGTH},
    E.ABORT: {F.ABORT},
    E.REJECT: {F.REJECTED},
    E.FAIL: {F.ERROR},
}
ILLEGAL = [(s, e) for s, e in itertools.product(RequestState, RequestEventKind)
           if (s, e) not in DESIGN_EDGES]


def fsm_in(state: RequestState, request_id: str = "req-7") -> RequestFSM:
    """A state machine driven through legal edges into `state`."""
    fsm = RequestFSM(request_id)
    if state is not P:
        fsm.fire(E.ADMIT)
    if state is C:
        fsm.fire(E.FINISH, F.STOP)
    assert fsm.state is state
    return fsm


def reason_for(event: RequestEventKind) -> FinishReason | None:
    """A finish reason `event` may carry, or None for non-completing events."""
    reasons = DESIGN_REASONS.get(event)
    return min(reasons, key=lambda r: r.value) if reasons else None


def test_table_is_exactly_the_design_table():
    """TRANSITIONS holds the edges of DESIGN §3 and no others; Completed is terminal."""
    flat = {(s, e): t for s, edges in TRANSITIONS.items() for e, t in edges.items()}
    assert flat == DESIGN_EDGES
    assert TRANSITIONS[C] == {}
    assert {k: set(v) for k, v in FINISH_REASONS.items()} == DESIGN_REASONS


@pytest.mark.parametrize(("state", "event"), sorted(DESIGN_EDGES, key=lambda k: (k[0].value, k[1].value)),
                         ids=lambda v: v.value)
def test_every_legal_edge(state, event):
    """Each legal edge moves the request to the table's target state."""
    fsm = fsm_in(state)
    reason = reason_for(event)
    assert fsm.fire(event, reason) is DESIGN_EDGES[state, event]
    assert fsm.state is DESIGN_EDGES[state, event]
    assert next_state("x", state, event) is DESIGN_EDGES[state, event]
    if fsm.state is C:
        assert fsm.finished and fsm.finish_reason is reason


@pytest.mark.parametrize(("state", "event"), ILLEGAL, ids=lambda v: v.value)
def test_every_illegal_edge_raises_naming_request_state_and_event(state, event):
    """Any other (state, event) raises IllegalTransition naming all three, and the
    state does not move."""
    fsm = fsm_in(state, "req-42")
    with pytest.raises(IllegalTransition) as info:
        fsm.fire(event, reason_for(event))
    message = str(info.value)
    assert "req-42" in message and state.value in message and event.value in message
    assert fsm.state is state
    with pytest.raises(IllegalTransition):
        next_state("req-42", state, event)
    assert issubclass(IllegalTransition, CadenceError)


@pytest.mark.parametrize("event", sorted(DESIGN_REASONS, key=lambda e: e.value), ids=lambda v: v.value)
def test_completing_event_needs_a_matching_reason(event):
    """A completing event without a reason, or with another event's reason, raises
    and leaves the state alone."""
    start = R if (R, event) in DESIGN_EDGES else P
    fsm = fsm_in(start, "req-9")
    with pytest.raises(IllegalTransition, match="needs a finish reason"):
        fsm.fire(event)
    assert fsm.state is start and fsm.finish_reason is None
    for wrong in set(FinishReason) - DESIGN_REASONS[event]:
        with pytest.raises(IllegalTransition) as info:
            fsm.fire(event, wrong)
        assert "req-9" in str(info.value) and wrong.value in str(info.value)
        assert fsm.state is start and fsm.finish_reason is None
        with pytest.raises(IllegalTransition):
            check_finish_reason("req-9", event, wrong)
    for right in DESIGN_REASONS[event]:
        check_finish_reason("req-9", event, right)


def test_completed_is_terminal_and_keeps_its_reason():
    """Once Completed, no event moves the request or changes its finish reason."""
    fsm = fsm_in(P)
    fsm.fire(E.ABORT, F.ABORT)
    for event in RequestEventKind:
        with pytest.raises(IllegalTransition):
            fsm.fire(event, reason_for(event))
    assert fsm.state is C and fsm.finish_reason is F.ABORT


def test_preempt_and_executor_lost_cycle_back_to_pending():
    """Running -> Pending edges can be taken repeatedly before completion."""
    fsm = RequestFSM("r")
    for event in (E.PREEMPT, E.EXECUTOR_LOST, E.PREEMPT):
        fsm.fire(E.ADMIT)
        assert fsm.fire(event) is P and fsm.finish_reason is None
    fsm.fire(E.REJECT, F.REJECTED)
    assert fsm.finish_reason is F.REJECTED
