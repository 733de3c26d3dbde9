"""How long a running request will still generate, learnt from the requests that finished.

Clients often declare a generous `max_tokens` and stop at EOS, so the declared
limit overstates how far a request will grow. Admission projects KV growth
from `OutputLengthEstimator.predict` instead of the limit; when a request
outlives its prediction the running pass preempts as it always did.

A finished request is one outcome of a window of recent ones: it either stopped
on its own after L tokens, or ran to its limit. A running request that has
generated `o` tokens under a limit `M` is predicted to end at the `quantile` of
the outcomes still possible for it, each "stopped at L" counted as L (only
those with L > o) and each "ran to its limit" counted as its own limit M. When
every request runs to its limit (max_tokens exact), every prediction is M,
which is what admission used before it learnt anything; so is the prediction
until `min_samples` requests have finished (the safe prior).

The object is pure and sans-IO: `observe` on each finish, `predict` on demand.
"""

from __future__ import annotations

import bisect
import math
from collections import deque

# Slack for float rounding in quantile * count (0.9 * 10 is 9.000000000000002).
_ROUNDING = 1e-9


class OutputLengthEstimator:
    """A window of finished requests' output lengths and the predictions it implies."""

    __slots__ = ("window", "min_samples", "quantile", "_recent", "_early", "_num_at_limit")

    def __init__(self, window: int, min_samples: int, quantile: float) -> None:
        self.window = window
        self.min_samples = min_samples
        self.quantile = quantile
        # Outcomes in arrival order (for eviction): a length, or -1 for "ran to its limit".
        self._recent: deque[int] = deque()
        self._early: list[int] = []  # lengths of requests that stopped on their own, sorted
        self._num_at_limit = 0

    @property
    def learnt(self) -> bool:
        """Whether predictions may fall short of declared limits: enough requests
        have finished and some of them stopped on their own."""
        return bool(self._early) and len(self._recent) >= self.min_samples

    @property
    def declared_only(self) -> bool:
        """Whether every prediction is the declared limit (no early stop seen, or
        too few finishes yet): callers may skip `predict` and use the limit."""
        return not self.learnt

    def observe(self, num_output: int, at_limit: bool) -> None:
        """Record a finished request: `num_output` tokens, and whether it ran to its limit."""
        if at_limit:
            self._recent.append(-1)
            self._num_at_limit += 1
        else:
            self._recent.append(num_output)
            bisect.insort(self._early, num_output)
        if len(self._recent) > self.window:
            old = self._recent.popleft()
            if old < 0:
                self._num_at_limit -= 1
            else:
                del self._early[bisect.bisect_left(self._early, old)]

    def predict(self, num_output: int, limit: int) -> int:
        """The output length at which a request with `num_output` tokens so far and
        a limit of `limit` is predicted to stop: between num_output + 1 and limit."""
        early = self._early
        if not early or len(self._recent) < self.min_samples or num_output >= limit:
            return limit
        first = bisect.bisect_right(early, num_output)
        num_early = len(early) - first
        possible = num_early + self._num_at_limit
        if not possible:
            return limit  # it outlived every outcome seen: fall back to its limit
        # The outcomes sorted: early lengths above num_output, then the limits.
        index = max(0, math.ceil(self.quantile * possible - _ROUNDING) - 1)
        if index >= num_early:
            return limit
        length = early[first + index]
        return length if length < limit else limit

    def __repr__(self) -> str:
        return (f"OutputLengthEstimator(recent={list(self._recent)!r}, window={self.window}, "
                f"min_samples={self.min_samples}, quantile={self.quantile})")
