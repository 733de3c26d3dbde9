"""The request record the scheduling core keeps for each request."""

from __future__ import annotations

from typing import Sequence

import attrs

from .errors import InvalidRequestError
from .fsm import FinishReason, RequestFSM, RequestState


def _non_negative(field: str, value: int) -> None:
    if value < 0:
        raise InvalidRequestError(f"{field} must be >= 0, got {value}")


@attrs.frozen
class SamplingLimits:
    """The part of the sampling parameters the core needs to decide when to stop.

    `eos_token_ids` end a request unless `ignore_eos`; `stop_token_ids` always
    do. Neither ends it before `min_tokens` tokens have been generated.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    eos_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=frozenset)
    stop_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=frozenset)

    def __attrs_post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _non_negative("min_tokens", self.min_tokens)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )


class Request:
    """One request as the core sees it: identity, limits, progress and state.

    `arrival_s` and `deadline_s` are given by the caller; the core never reads a
    clock. `num_computed_tokens` counts tokens whose KV is in the cache or is
    being written by the step just planned.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "limits", "priority", "tenant", "deadline_s",
        "arrival_s", "cache_salt", "fsm", "output_token_ids", "all_token_ids",
        "num_prompt_tokens", "num_computed_tokens", "num_preemptions", "block_hashes",
        "num_skips", "queue_seq", "first_scheduled_s", "num_cached_tokens",
        "stop_token_set", "finish_detail", "arrival_seq", "arrival_step",
        "admitted_step", "length_limit", "pending_steps", "group",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        limits: SamplingLimits | None = None,
        *,
        priority: int = 0,
        tenant: str = "default",
        deadline_s: float | None = None,
        arrival_s: float = 0.0,
        cache_salt: str | None = None,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string")
        if len(prompt_token_ids) == 0:
            raise InvalidRequestError("prompt_token_ids must hold at least one token")
        if min(prompt_token_ids) < 0:
            raise InvalidRequestError(
                f"prompt_token_ids must be >= 0, got {min(prompt_token_ids)}")
        self.request_id = request_id
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.limits = limits if limits is not None else SamplingLimits()
        self.priority = priority
        self.tenant = tenant
        self.deadline_s = deadline_s
        self.arrival_s = arrival_s
        self.cache_salt = cache_salt
        self.fsm = RequestFSM(request_id)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []  # prefix-cache keys of its full blocks
        self.num_skips = 0
        self.queue_seq = 0
        # Set by the scheduler on arrival: breaks ties between equal arrival times.
        self.arrival_seq = 0
        # Set by the scheduler on arrival: the step it arrived before (ages in steps).
        self.arrival_step = 0
        # The step that last admitted it: older plans' results no longer apply.
        self.admitted_step = -1
        # The plans in flight that sample a token for it, oldest first: the tokens
        # it has computed reach past its known ones by as many (async scheduling).
        self.pending_steps: list[int] = []
        # Set by the scheduler on arrival: the token count at which it stops for
        # length (prompt + max_tokens, or max_model_len if that is smaller).
        self.length_limit = self.num_prompt_tokens + self.limits.max_tokens
        self.first_scheduled_s: float | None = None
        self.num_cached_tokens = 0
        # Set by the scheduler when the request is one of several sharing its prompt.
        self.group: RequestGroup | None = None
        limits = self.limits
        stops = set(limits.stop_token_ids)
        if not limits.ignore_eos:
            stops |= limits.eos_token_ids
        self.stop_token_set = frozenset(stops)
        self.finish_detail = ""

    @property
    def state(self) -> RequestState:
        return self.fsm.state

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.fsm.finish_reason

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.fsm.state is RequestState.COMPLETED

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.fsm.state.value}, prompt={self.num_prompt_tokens}, "
            f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens}, "
            f"prio={self.priority}, tenant={self.tenant!r})"
        )


class RequestGroup:
    """Requests forked from one prompt (`n` > 1): the prompt's full blocks, all
    but the block of its last token, are computed by one member and then held by
    every member's table, so the others compute only the tail.

    `members` are the live ones, in the order given; `num_shared_tokens` is the
    length of the shared part, a whole number of blocks, below the prompt's length.
    """

    __slots__ = ("group_id", "members", "num_shared_tokens")

    def __init__(self, group_id: str, members: Sequence[Request], num_shared_tokens: int) -> None:
        self.group_id = group_id
        self.members = list(members)
        self.num_shared_tokens = num_shared_tokens

    def __repr__(self) -> str:
        return (f"RequestGroup({self.group_id!r}, members={[r.request_id for r in self.members]}, "
                f"shared={self.num_shared_tokens})")
