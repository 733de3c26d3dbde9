"""The request state machine: one table holds every legal edge.

Both the scheduling core and each request actor drive a request through
`TRANSITIONS`; anything not in the table raises `IllegalTransition`, so an
illegal sequence of events is caught on whichever side sees it first.
"""

from __future__ import annotations

import enum

from .errors import IllegalTransition


class RequestState(enum.Enum):
    """Where a request is in its life."""

    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"


class RequestEventKind(enum.Enum):
    """The events that move a request between states."""

    ADMIT = "admit"
    PREEMPT = "preempt"
    FINISH = "finish"
    ABORT = "abort"
    REJECT = "reject"
    FAIL = "fail"
    EXECUTOR_LOST = "executor_lost"


class FinishReason(enum.Enum):
    """Why a request reached `COMPLETED`."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    REJECTED = "rejected"


P, R, C = RequestState.PENDING, RequestState.RUNNING, RequestState.COMPLETED
E = RequestEventKind

TRANSITIONS: dict[RequestState, dict[RequestEventKind, RequestState]] = {
    P: {E.ADMIT: R, E.ABORT: C, E.REJECT: C, E.FAIL: C},
    R: {E.PREEMPT: P, E.FINISH: C, E.ABORT: C, E.FAIL: C, E.EXECUTOR_LOST: P},
    C: {},
}

# The finish reasons each completing event may carry.
FINISH_REASONS: dict[RequestEventKind, frozenset[FinishReason]] = {
    E.FINISH: frozenset({FinishReason.STOP, FinishReason.LENGTH}),
    E.ABORT: frozenset({FinishReason.ABORT}),
    E.REJECT: frozenset({FinishReason.REJECTED}),
    E.FAIL: frozenset({FinishReason.ERROR}),
}


def next_state(request_id: str, state: RequestState, event: RequestEventKind) -> RequestState:
    """Return the state `event` leads to from `state`, or raise `IllegalTransition`."""
    try:
        return TRANSITIONS[state][event]
    except KeyError:
        raise IllegalTransition(
            f"request {request_id!r}: no transition from {state.value} on {event.value}"
        ) from None


def check_finish_reason(request_id: str, event: RequestEventKind, reason: FinishReason) -> None:
    """Raise `IllegalTransition` if `reason` cannot accompany `event`."""
    if reason not in FINISH_REASONS.get(event, ()):
        raise IllegalTransition(
            f"request {request_id!r}: event {event.value} cannot finish with reason {reason.value}"
        )


class RequestFSM:
    """A request's state, moved only through `TRANSITIONS`."""

    __slots__ = ("request_id", "state", "finish_reason")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.state = RequestState.PENDING
        self.finish_reason: FinishReason | None = None

    def fire(self, event: RequestEventKind, reason: FinishReason | None = None) -> RequestState:
        """Apply `event`; completing events must carry a matching finish reason."""
        new = next_state(self.request_id, self.state, event)
        if new is RequestState.COMPLETED:
            if reason is None:
                raise IllegalTransition(
                    f"request {self.request_id!r}: event {event.value} needs a finish reason"
                )
            check_finish_reason(self.request_id, event, reason)
            self.finish_reason = reason
        self.state = new
        return new

    @property
    def finished(self) -> bool:
        return self.state is RequestState.COMPLETED
