"""What the scheduler hands the executor each step, and what comes back.

A `StepPlan` carries deltas against the executor's persistent batch: new (or
resumed) requests in full, running ones only as new block ids and the number
of tokens to compute, so a decode step is O(batch) small integers.
"""

from __future__ import annotations

import attrs

from .fsm import FinishReason, RequestEventKind


@attrs.define(slots=True)
class NewRequestData:
    """A request the executor has not seen, or sees again after a preemption.

    token_ids: prompt plus any tokens generated before a preemption (immutable;
      the request's own tuple of prompt ids on a first admission).
    num_computed_tokens: tokens whose KV is already cached (prefix hits).
    """

    request_id: str
    token_ids: tuple[int, ...] = attrs.field(converter=tuple)
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    resumed: bool = False


@attrs.define(slots=True)
class StepPlan:
    """One step's decision.

    num_scheduled_tokens: tokens each request computes this step (its order is the
      batch order).
    new_requests: requests to add to the persistent batch, in full.
    new_block_ids: blocks appended to running requests' tables this step.
    preempted_ids / finished_ids: requests to drop from the persistent batch
      (finished_ids: finished or aborted since the previous plan).
    resumed_ids: the subset of `new_requests` coming back after a preemption.
    """

    step_id: int
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    new_requests: list[NewRequestData]
    new_block_ids: dict[str, list[int]]
    preempted_ids: list[str]
    finished_ids: list[str]
    resumed_ids: list[str]

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@attrs.define(slots=True)
class StepResult:
    """The executor's answer to one plan.

    sampled_token_ids: tokens sampled per request; a request whose prefill chunk
      did not reach the end of its prompt has no entry.
    logprobs: optional per-request, per-token list of (token id, logprob) pairs,
      the sampled token first.
    """

    step_id: int
    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[list[tuple[int, float]]]] | None = None
    execute_us: int = 0


class RequestEvent:
    """What happened to one request: a state change, new tokens, or both.

    transition: the FSM event the request went through (None: tokens only).
    token_ids: tokens generated this step (possibly empty).
    finish_reason: set when `transition` completes the request.
    logprobs: for each of `token_ids`, the executor's (token id, logprob) pairs,
      when the request asked for them and the executor sent them; else None.
    """

    __slots__ = ("request_id", "transition", "token_ids", "finish_reason", "detail", "logprobs")

    def __init__(
        self,
        request_id: str,
        transition: RequestEventKind | None,
        token_ids: list[int] | tuple[int, ...] = (),
        finish_reason: FinishReason | None = None,
        detail: str = "",
    ) -> None:
        self.request_id = request_id
        self.transition = transition
        self.token_ids = token_ids
        self.finish_reason = finish_reason
        self.detail = detail
        self.logprobs: list[list[tuple[int, float]]] | None = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RequestEvent):
            return NotImplemented
        return (
            self.request_id == other.request_id
            and self.transition == other.transition
            and list(self.token_ids) == list(other.token_ids)
            and self.finish_reason == other.finish_reason
            and self.detail == other.detail
            and self.logprobs == other.logprobs
        )

    def __repr__(self) -> str:
        kind = self.transition.value if self.transition else "tokens"
        reason = f", {self.finish_reason.value}" if self.finish_reason else ""
        return f"RequestEvent({self.request_id!r}, {kind}, {list(self.token_ids)}{reason})"
