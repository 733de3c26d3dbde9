"""Poison isolation and restart accounting: whom to suspect when the executor
fails, when a suspect is the culprit, and which failures count toward
`max_restarts`. Pure and synchronous: time enters as an argument, requests as
their ids and token counts; the scheduler actor runs the executor calls and
applies the verdicts.

A failure of a call that ran unsuspected requests is counted and begins an
isolation (its *origin*): those requests become suspects, split in halves,
each half run from then on as an executor call of its own. A failing suspect
group is split again; a suspect failing alone, twice the same way, is the
culprit. A suspect that gets a token past the point where its step failed is
cleared. Each origin is refunded (no longer counts) once its isolation found
a culprit and a call succeeds after, so the executor is seen to work without
it; while its isolation is under way it does not count against the budget
either, so poisons arriving at any spacing each cost nothing. Failures of suspect
groups are not counted, up to an allowance of failures in a row (no
successful call between them) that covers the halvings and the confirmations
of each culprit; beyond it every failure counts, so a broken executor still
closes the engine.
"""

from __future__ import annotations

import math
import re
from collections import deque
from typing import Iterable, Mapping

import attrs

__all__ = ["Isolation", "Conviction", "FailureDecision", "restart_pause_s",
           "CONVICTING_FAILURES", "BASE_UNCOUNTED_IN_A_ROW"]

# Failures of a suspect alone that make it the culprit: one could be a transient
# fault striking twice; a fault that follows the request strikes every time.
CONVICTING_FAILURES = 2
# Failures in a row that may go uncounted while a culprit is isolated: the
# batch, one per halving of its requests (added per isolation), and the culprit
# alone; beyond this the executor itself is suspect.
BASE_UNCOUNTED_IN_A_ROW = 1 + CONVICTING_FAILURES
# Step numbers and the like, left out when comparing two failures.
_DIGITS = re.compile(r"\d+")


@attrs.frozen
class Conviction:
    """A request found to make the executor fail. `verdict`: the executor ran
    other requests meanwhile, so the request is the poison (else the executor
    itself may be at fault, and the request fails with a plain executor error)."""

    request_id: str
    verdict: bool
    detail: str


@attrs.frozen
class FailureDecision:
    """What one executor failure means: whether it counts toward max_restarts,
    the request it convicts (if any), and whether the engine must give up."""

    counted: bool
    conviction: Conviction | None
    give_up: bool


@attrs.define
class _Origin:
    """A counted failure that began an isolation. `excused`: within the allowance
    of failures in a row, so it does not count while its isolation is under way."""

    excused: bool
    ran_since: bool = False
    found: bool = False


def restart_pause_s(base_s: float, max_s: float, num_in_a_row: int, draw: float,
                    factor: float = 2.0, jitter: float = 0.25) -> float:
    """The pause before a restart: `base_s` doubled (by `factor`) for each failure in
    a row after the first, times a jitter in [1 - jitter, 1 + jitter] picked by
    `draw` in [0, 1), at most `max_s`."""
    nominal = base_s * factor ** max(0, num_in_a_row - 1)
    return min(max_s, nominal * (1.0 + jitter * (2.0 * draw - 1.0)))


class Isolation:
    """The suspects, the culprits and the restart budget of one engine."""

    def __init__(self, max_restarts: int, restart_window_s: float) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be at least 0, got {max_restarts}")
        if not restart_window_s > 0:
            raise ValueError(f"restart_window_s must be positive, got {restart_window_s}")
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.groups: dict[int, list[str]] = {}  # suspect groups by id, oldest first
        self.marks: dict[str, int] = {}  # a suspect's tokens when its step failed
        self.num_failures = 0
        self.num_in_a_row = 0  # failures since the last successful executor call
        self.last_failure = ""
        self._origin_of: dict[int, int] = {}  # suspect group -> the origin it descends from
        self._origins: dict[int, _Origin] = {}
        self._next_id = 0
        self._alone: dict[str, tuple[int, str]] = {}  # failures alone, and what they looked like
        self._max_uncounted = BASE_UNCOUNTED_IN_A_ROW
        self._times: deque[tuple[float, int | None]] = deque()  # counted failures, their origins
        self._refunds: list[int] = []  # origins to forget once a call succeeds

    # ---- what the actor asks ------------------------------------------------------
    def partition(self, request_ids: Iterable[str]) -> list[tuple[int | None, list[str]]]:
        """A step's requests as executor calls: the unsuspected ones (group None)
        first, then each suspect group, oldest first; empty calls left out."""
        member = {rid: gid for gid, group in self.groups.items() for rid in group}
        parts: dict[int | None, list[str]] = {None: []}
        parts.update((gid, []) for gid in self.groups)
        for rid in request_ids:
            parts[member.get(rid)].append(rid)
        return [(gid, part) for gid, part in parts.items() if part]

    @property
    def num_charged(self) -> int:
        """Counted failures within the window that count against max_restarts now."""
        pending = self._pending()
        return sum(origin not in pending for _, origin in self._times)

    # ---- what the actor tells ---------------------------------------------------------
    def call_succeeded(self) -> int:
        """An executor call answered: failures are no longer in a row, and the
        origins whose culprit was found are forgotten. Returns how many were."""
        if not (self.num_in_a_row or self._origins):
            return 0  # nothing to note: the common case, once per step
        self.num_in_a_row = 0
        for origin in self._origins.values():
            origin.ran_since = True
        refunded = set(self._refunds)
        before = len(self._times)
        if refunded:
            self._times = deque(entry for entry in self._times if entry[1] not in refunded)
        self._refunds.clear()
        self._drop_resolved()
        return before - len(self._times)

    def call_failed(self, now_s: float, reason: str, part: Mapping[str, int],
                    group: int | None) -> FailureDecision:
        """An executor call failed at `now_s`. part: its live requests and the tokens
        each has; group: the suspect group the call ran (None: unsuspected requests)."""
        self.num_failures += 1
        self.num_in_a_row += 1
        self.last_failure = reason
        within = self.num_in_a_row <= self._max_uncounted
        counted = group is None or not within
        if not within:
            # The executor itself is suspect: isolations under way are no excuse.
            for origin in self._origins.values():
                origin.excused = False
        conviction, origin = self._blame(part, group, counted, excused=within)
        give_up = counted and not self._charge(now_s, origin)
        return FailureDecision(counted, conviction, give_up)

    def restart_failed(self, now_s: float, reason: str) -> bool:
        """A restart failed at `now_s` (always counted); whether the engine may try again."""
        self.num_failures += 1
        self.num_in_a_row += 1
        self.last_failure = reason
        return self._charge(now_s, None)

    def clear(self, tokens: Mapping[str, int]) -> list[str]:
        """Drop suspects that are gone (not in `tokens`) or got a token past the point
        their step failed at; returns them."""
        marks = self.marks
        cleared = [rid for rid, mark in marks.items() if rid not in tokens or tokens[rid] > mark]
        for rid in cleared:
            self.forget(rid)
        return cleared

    def forget(self, request_id: str) -> None:
        """A request is no longer a suspect (it failed, completed or was cleared)."""
        self.marks.pop(request_id, None)
        self._alone.pop(request_id, None)
        for gid, group in list(self.groups.items()):
            if request_id in group:
                group.remove(request_id)
                if not group:
                    del self.groups[gid]
                    self._origin_of.pop(gid, None)
        self._drop_resolved()

    def give_up(self) -> None:
        """The engine closed: nobody is a suspect any more."""
        self.groups.clear()
        self.marks.clear()
        self._alone.clear()
        self._origin_of.clear()
        self._origins.clear()
        self._refunds.clear()

    # ---- inside ---------------------------------------------------------------------
    def _blame(self, part: Mapping[str, int], group: int | None, counted: bool,
               excused: bool) -> tuple[Conviction | None, int | None]:
        """Split the failed call's requests into halves that run apart from now on; a
        suspect group of one that failed again holds the culprit (unless the failure
        counted: then the executor itself is suspect). Returns the conviction and the
        origin the failure began (None if it began none)."""
        live = list(part)
        self.marks.update(part)
        origin = None
        if group is not None:
            members = self.groups.pop(group, [])
            lineage = self._origin_of.pop(group, None)
            # Members the failed call did not run (not scheduled in that step) stay suspects.
            rest = [rid for rid in members if rid not in part and rid in self.marks]
            if rest:
                self._add_group(rest, lineage)
            if len(live) == 1:
                rid = live[0]
                # A fault that follows a request fails the same way each time; a
                # different failure starts the count again.
                signature = _DIGITS.sub("#", self.last_failure)
                count, seen = self._alone.get(rid, (0, signature))
                alone = count + 1 if seen == signature else 1
                self._alone[rid] = (alone, signature)
                if alone >= CONVICTING_FAILURES and not counted:
                    return self._convict(rid, lineage), None
        elif live:
            lineage = origin = self._next_id
            self._next_id += 1
            self._origins[origin] = _Origin(excused)
            fresh = BASE_UNCOUNTED_IN_A_ROW + math.ceil(math.log2(len(self.marks)))
            self._max_uncounted = max(fresh, self._max_uncounted if self.num_in_a_row > 1 else fresh)
        else:
            return None, None
        half = (len(live) + 1) // 2
        for suspects in (live[:half], live[half:]):
            if suspects:
                self._add_group(suspects, lineage)
        return None, origin

    def _convict(self, request_id: str, lineage: int | None) -> Conviction:
        origin = self._origins.get(lineage) if lineage is not None else None
        verdict = origin is not None and origin.ran_since
        detail = (f"request {request_id!r} makes the executor fail: it failed in a batch, then "
                  f"{self._alone[request_id][0]} times alone (last: {self.last_failure})")
        if origin is not None and not origin.found:
            # Refunded once a call succeeds: then the executor works without the culprit.
            origin.found = True
            self._refunds.append(lineage)
        self.forget(request_id)
        return Conviction(request_id, verdict, detail)

    def _add_group(self, suspects: list[str], lineage: int | None) -> None:
        gid = self._next_id
        self._next_id += 1
        self.groups[gid] = suspects
        if lineage is not None:
            self._origin_of[gid] = lineage

    def _pending(self) -> set[int]:
        """Origins that do not count for now: isolations under way, and those whose
        culprit was found and await a successful call (unless the executor itself
        became suspect meanwhile)."""
        return {o for o in (*self._origin_of.values(), *self._refunds) if self._origins[o].excused}

    def _drop_resolved(self) -> None:
        """Forget origins with no suspects left and no refund due."""
        live = set(self._origin_of.values()) | set(self._refunds)
        for origin in [o for o in self._origins if o not in live]:
            del self._origins[origin]

    def _charge(self, now_s: float, origin: int | None) -> bool:
        """Record a counted failure; False if max_restarts are used up within the window."""
        times = self._times
        while times and times[0][0] <= now_s - self.restart_window_s:
            times.popleft()
        if self.num_charged >= self.max_restarts:
            return False
        times.append((now_s, origin))
        return True
