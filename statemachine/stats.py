"""Counters the scheduler keeps, and the summary it reports.

Times are whatever the caller passed in (`arrival_s`, `now_s`); the core never
reads a clock.
"""

from __future__ import annotations

from collections import Counter

import attrs


@attrs.frozen
class StatsSummary:
    """A snapshot of the scheduler's counters.

    wait is from arrival to first scheduled step; elapsed runs from the first to
    the last time the caller passed in. Rates are per second of that span. The
    executor counts are filled in by the engine (the core sees no executor):
    failed calls and start-ups, restarts, and requests failed alone as the
    cause of a failure.
    """

    num_requests_added: int
    num_batches_scheduled: int
    num_requests_completed: int
    completed_by_reason: dict[str, int]
    total_wait_s: float
    avg_wait_s: float
    num_tokens_generated: int
    tokens_per_s: float
    requests_per_s: float
    avg_batch_size: float
    batch_size_distribution: dict[int, int]
    elapsed_s: float
    num_scheduled_tokens: int
    num_preemptions: int
    num_recompute_tokens: int
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int
    prefix_hit_rate: float
    kv_usage: float
    num_running: int
    num_waiting: int
    # Counted by the scheduler actor, which supervises the executor.
    num_executor_failures: int = 0
    num_executor_restarts: int = 0
    num_poisoned_requests: int = 0
    # Prompt tokens a request of a group (`n` > 1) took from a sibling's computed
    # blocks instead of computing them.
    num_shared_prompt_tokens: int = 0
    # Steps that admitted nothing so that the requests running would finish first
    # (`admission_finish_hold_steps`).
    num_admission_finish_holds: int = 0

    def as_dict(self) -> dict:
        return attrs.asdict(self)

    def format(self) -> str:
        """A human-readable summary, one figure per line."""
        lines = [
            f"requests added:        {self.num_requests_added}",
            f"batches scheduled:     {self.num_batches_scheduled}",
            f"requests completed:    {self.num_requests_completed} {dict(self.completed_by_reason)}",
            f"total wait:            {self.total_wait_s:.3f} s",
            f"average wait:          {self.avg_wait_s:.3f} s",
            f"tokens generated:      {self.num_tokens_generated}",
            f"tokens/s:              {self.tokens_per_s:.1f}",
            f"requests/s:            {self.requests_per_s:.2f}",
            f"average batch size:    {self.avg_batch_size:.2f}",
            f"batch sizes:           {dict(sorted(self.batch_size_distribution.items()))}",
            f"elapsed:               {self.elapsed_s:.3f} s",
            f"preemptions:           {self.num_preemptions} ({self.num_recompute_tokens} tokens recomputed)",
            f"prefix cache:          {self.num_prefix_hit_tokens}/{self.num_prefix_query_tokens} tokens hit",
            f"shared prompt tokens:  {self.num_shared_prompt_tokens} (taken from a sibling, n > 1)",
            f"KV usage:              {self.kv_usage:.1%}",
            f"executor:              {self.num_executor_failures} failures, "
            f"{self.num_executor_restarts} restarts, {self.num_poisoned_requests} requests failed alone",
        ]
        return "\n".join(lines)


@attrs.define
class StatsCollector:
    """Mutable counters updated by the scheduler."""

    num_requests_added: int = 0
    num_batches_scheduled: int = 0
    num_scheduled_requests: int = 0
    num_requests_completed: int = 0
    completed_by_reason: Counter = attrs.Factory(Counter)
    total_wait_s: float = 0.0
    num_waits: int = 0
    num_tokens_generated: int = 0
    batch_sizes: Counter = attrs.Factory(Counter)
    first_s: float | None = None
    last_s: float | None = None
    num_scheduled_tokens: int = 0
    num_preemptions: int = 0
    num_recompute_tokens: int = 0
    #: Steps whose admission pass was skipped because the last failed pass stood.
    num_admission_memo_hits: int = 0
    #: Steps that admitted nothing so that the requests running would finish first.
    num_admission_finish_holds: int = 0
    num_shared_prompt_tokens: int = 0

    def saw_time(self, now_s: float) -> None:
        if self.first_s is None:
            self.first_s = now_s
        if self.last_s is None or now_s > self.last_s:
            self.last_s = now_s

    @property
    def elapsed_s(self) -> float:
        if self.first_s is None or self.last_s is None:
            return 0.0
        return self.last_s - self.first_s
