"""The poison-isolation machine (`cadence.statemachine.isolation`) checked in a
world of its own: requests that are innocent or poison, an executor that fails
every call running a poison (and, where the scope allows, a few calls at random),
driven the way the scheduler actor drives the machine.

`World` is that environment; its moves are arrivals, aborts and steps (each
step runs the machine's partition as executor calls, oldest suspect group
last, stopping at the first failure, then clears suspects, blames and
restarts). The named predicates below are checked after every move by the
breadth-first explorer (`explore_isolation`, scopes in `ISOLATION_SCOPES`) and
by the Hypothesis machine in tests/statemachine/test_isolation.py. Ghost
bookkeeping in the world (which counted failure began which request's
suspicion, whether a call succeeded since) is kept apart from the machine's.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from typing import Callable, Iterator

import attrs

from cadence.statemachine.isolation import CONVICTING_FAILURES, Isolation

INNOCENT, POISON = "innocent", "poison"
# Every failure looks alike: the worst case for telling a transient fault from a poison.
_REASON = "step 1 failed: executor crashed"


@attrs.frozen
class IsolationScope:
    """The bounds of one exploration of the machine.

    max_arrivals: requests that arrive in all; max_live: live at once;
    max_poisons: poisons among the arrivals; tokens: successful calls a request
    needs to finish; transients: calls that may fail with no poison in them;
    restart_failures: restarts that may fail; aborts: whether a client may walk
    away; max_restarts: the machine's budget (its window never runs out here).
    """

    name: str
    max_arrivals: int = 4
    max_live: int = 3
    max_poisons: int = 2
    tokens: int = 2
    transients: int = 0
    restart_failures: int = 0
    aborts: bool = False
    max_restarts: int = 1
    max_states: int = 500_000


ISOLATION_SCOPES = {
    # Poisons only, arriving at any step among innocents: every predicate holds
    # with the budget at its least (one restart).
    "poisons": IsolationScope("poisons", max_arrivals=5, max_live=4, max_poisons=3),
    # As poisons, with walk-aways: suspects that leave are cleared.
    "walkaways": IsolationScope("walkaways", max_arrivals=3, aborts=True),
    # One transient fault and one failed restart, two restarts of budget: an
    # innocent is still never convicted, and failures without a culprit count.
    "faults": IsolationScope("faults", max_arrivals=3, max_poisons=1, transients=1,
                             restart_failures=1, max_restarts=2),
    # A broken executor's reach: two transient faults, no budget to spare.
    "broken": IsolationScope("broken", max_arrivals=3, max_poisons=1, transients=2,
                             restart_failures=1, max_restarts=1),
}
CI_ISOLATION_SCOPES = tuple(ISOLATION_SCOPES)


@attrs.define
class World:
    """Requests, an executor that fails on poisons, the machine, and the ghost."""

    scope: IsolationScope
    machine: Isolation
    kinds: dict[str, str] = attrs.Factory(dict)  # every request that arrived
    tokens: dict[str, int] = attrs.Factory(dict)  # the live ones
    now: float = 0.0
    closed: bool = False
    num_poisons: int = 0
    num_transients: int = 0
    num_restart_failures: int = 0
    num_aborts: int = 0
    unaccompanied: bool = False  # a poison was live with no innocent beside it
    crowded: bool = False  # a failed call ran two poisons or more
    # Ghost: requests convicted (with the verdict), counted failures, each
    # request's latest origin, origins with a call succeeded since, refunds due.
    convicted: dict[str, bool] = attrs.Factory(dict)
    counted: list[float] = attrs.Factory(list)
    origin_of: dict[str, float] = attrs.Factory(dict)
    ran_since: set[float] = attrs.Factory(set)
    found: set[float] = attrs.Factory(set)
    refund_due: set[float] = attrs.Factory(set)
    refunded: set[float] = attrs.Factory(set)
    wrong_verdicts: list[str] = attrs.Factory(list)
    families: set[str] = attrs.Factory(set)  # paths the last move took

    @classmethod
    def start(cls, scope: IsolationScope) -> World:
        """A world with no request yet."""
        return cls(scope, Isolation(scope.max_restarts, restart_window_s=1e9))

    def clone(self) -> World:
        """An independent copy."""
        return copy.deepcopy(self)

    # ---- moves ------------------------------------------------------------------
    def moves(self) -> Iterator[tuple]:
        """Every move the environment may make now."""
        scope = self.scope
        if self.closed:
            return
        if len(self.kinds) < scope.max_arrivals and len(self.tokens) < scope.max_live:
            yield ("arrive", INNOCENT)
            if self.num_poisons < scope.max_poisons:
                yield ("arrive", POISON)
        if scope.aborts:
            for rid in self.tokens:
                yield ("abort", rid)
        if self.tokens:
            parts = len(self.machine.partition(self.tokens))
            faults = [None] + (list(range(parts)) if self.num_transients < scope.transients else [])
            restarts = [False] + ([True] if self.num_restart_failures < scope.restart_failures else [])
            for fault in faults:
                for restart_fails in restarts:
                    yield ("step", fault, restart_fails)

    def apply(self, move: tuple) -> None:
        """Make one move."""
        self.families = set()
        kind = move[0]
        if kind == "arrive":
            rid = f"r{len(self.kinds)}"
            self.kinds[rid] = move[1]
            self.num_poisons += move[1] == POISON
            self.tokens[rid] = 0
        elif kind == "abort":
            del self.tokens[move[1]]
            self.num_aborts += 1
            self.families.add("abort")
        else:
            self._step(move[1], move[2])
        if not self.tokens and self.machine.marks:
            # The actor's step loop, idle, clears the suspects that left.
            self._clear()
        live = {self.kinds[rid] for rid in self.tokens}
        self.unaccompanied |= live == {POISON}

    def _step(self, fault: int | None, restart_fails: bool) -> None:
        machine = self.machine
        isolating = bool(machine.groups)
        parts = machine.partition(self.tokens) if isolating else [(None, list(self.tokens))]
        failure = None
        for n, (group, members) in enumerate(parts):
            num_poisons = sum(self.kinds[rid] == POISON for rid in members)
            poisoned = num_poisons > 0
            if poisoned or n == fault:
                self.crowded |= num_poisons > 1
                self.num_transients += not poisoned
                failure = (group, members)
                break
            machine.call_succeeded()
            self._succeeded()
            for rid in members:
                self.tokens[rid] += 1
                if self.tokens[rid] >= self.scope.tokens:
                    del self.tokens[rid]
        if isolating:
            self._clear()
        if failure is not None:
            self._fail(*failure, restart_fails)

    def _succeeded(self) -> None:
        if self.refund_due:
            self.families.add("refund")
        self.refunded |= self.refund_due
        self.refund_due.clear()
        self.ran_since.update(self.origin_of.values())

    def _clear(self) -> None:
        for rid in self.machine.clear(self.tokens):
            self.families.add("clear.gone" if rid not in self.tokens else "clear.token")
            self.origin_of.pop(rid, None)

    def _fail(self, group: int | None, members: list[str], restart_fails: bool) -> None:
        machine = self.machine
        self.now += 1.0
        part = {rid: self.tokens[rid] for rid in members}
        pending_before = bool(machine.groups)
        decision = machine.call_failed(self.now, _REASON, part, group)
        if decision.counted:
            self.counted.append(self.now)
            if group is not None:
                self.families.add("count.beyond_allowance")
            elif part:
                self.families.add("origin.while_isolating" if pending_before else "origin")
                for rid in part:
                    self.origin_of[rid] = self.now
        conviction = decision.conviction
        if conviction is not None:
            rid = conviction.request_id
            origin = self.origin_of.pop(rid, None)
            earned = origin is not None and origin in self.ran_since
            if conviction.verdict != earned:
                self.wrong_verdicts.append(f"{rid}: verdict {conviction.verdict}, earned {earned}")
            self.convicted[rid] = conviction.verdict
            self.families.add("convict.verdict" if conviction.verdict else "convict.no_verdict")
            if origin is not None and origin not in self.found:
                self.found.add(origin)
                self.refund_due.add(origin)
            del self.tokens[rid]
        if decision.give_up:
            self._close()
            return
        if restart_fails:
            self.num_restart_failures += 1
            self.now += 1.0
            self.counted.append(self.now)
            self.families.add("restart.failed")
            if not machine.restart_failed(self.now, "restart failed"):
                self._close()

    def _close(self) -> None:
        self.closed = True
        self.families.add("give_up")
        self.machine.give_up()
        self.tokens.clear()
        self.origin_of.clear()

    # ---- the state, up to time's absolute value --------------------------------------
    def key(self) -> tuple:
        """Equal for worlds that behave alike (times replaced by their order)."""
        m = self.machine
        times = sorted({*self.counted, *self.origin_of.values(), *(t for t, _ in m._times)})
        rank = {t: i for i, t in enumerate(times)}
        ids = {}
        for gid in m.groups:
            ids.setdefault(gid, len(ids))
        origins = {o: i for i, o in enumerate(sorted(m._origins))}
        machine = (tuple((ids[g], tuple(members), origins.get(m._origin_of.get(g), -1))
                         for g, members in m.groups.items()),
                   tuple(sorted(m.marks.items())), tuple(sorted(m._alone.items())),
                   tuple((origins[o], r.excused, r.ran_since, r.found) for o, r in m._origins.items()),
                   m.num_in_a_row, m._max_uncounted,
                   tuple((rank[t], origins.get(o, -1)) for t, o in m._times),
                   tuple(origins.get(o, -1) for o in m._refunds))
        ghost = (tuple(sorted(self.convicted.items())), tuple(rank[t] for t in self.counted),
                 tuple(sorted((r, rank[t]) for r, t in self.origin_of.items())),
                 tuple(sorted(rank[t] for t in self.ran_since if t in rank)),
                 tuple(sorted(rank[t] for t in self.found if t in rank)),
                 tuple(sorted(rank[t] for t in self.refund_due if t in rank)),
                 tuple(sorted(rank[t] for t in self.refunded if t in rank)))
        return (tuple(sorted(self.kinds.items())), tuple(sorted(self.tokens.items())), self.closed,
                self.num_poisons, self.num_transients, self.num_restart_failures, self.num_aborts > 0, self.unaccompanied, self.crowded,
                bool(self.wrong_verdicts), machine, ghost)


# ---- the properties -----------------------------------------------------------------
def no_innocent_convicted(w: World) -> str | None:
    """With fewer transient faults than it takes to convict, and at most one
    request per failed call at fault, no innocent request is ever convicted."""
    if w.num_transients >= CONVICTING_FAILURES:
        return None
    wrong = [rid for rid in w.convicted if w.kinds[rid] == INNOCENT]
    return f"innocent requests convicted: {wrong}" if wrong else None


def poisons_never_close(w: World) -> str | None:
    """Poisons among other traffic, at any spacing, never close the engine while
    max_restarts is at least 1: with at most one poison in each failed call (as
    for `no_innocent_convicted`), never one live without an innocent beside it,
    no other fault and nobody walking away. (Poisons with nothing working beside
    them, or several suspected at once, can fail more often in a row than the
    cap that protects against a broken executor, and then count as its failures would.)"""
    faults = (w.num_transients or w.num_restart_failures or w.num_aborts or w.unaccompanied
              or w.crowded)
    if w.closed and w.scope.max_restarts >= 1 and not faults:
        return f"the engine closed with {w.num_poisons} poisons and no other fault"
    return None


def counted_only_without_culprit(w: World) -> str | None:
    """A counted failure stays counted exactly when no culprit was found for it:
    an origin is refunded once a culprit is convicted for it and a call succeeds
    after (the executor works without the culprit)."""
    if w.closed:
        return None
    expected = sorted(t for t in w.counted if t not in w.refunded)
    actual = sorted(t for t, _ in w.machine._times)
    if expected != actual:
        return f"counted failures {actual}, expected {expected} (refunded: {sorted(w.refunded)})"
    if len(w.machine._refunds) != len(w.refund_due):
        return f"{len(w.machine._refunds)} refunds due, expected {len(w.refund_due)}"
    return None


def verdicts_are_earned(w: World) -> str | None:
    """A conviction is a verdict (PoisonRequestError) exactly when a call succeeded
    after the failure that made the request a suspect."""
    return "; ".join(w.wrong_verdicts) or None


def suspects_end_convicted_or_cleared(w: World) -> str | None:
    """Every suspect is in exactly one suspect group, with no request live nobody
    is suspected (each one ended convicted or cleared), and what is kept about a
    suspect (its failures alone, its origin) goes with it."""
    m = w.machine
    members = [rid for group in m.groups.values() for rid in group]
    if sorted(members) != sorted(m.marks):
        return f"suspect groups {list(m.groups.values())} do not match the suspects {sorted(m.marks)}"
    if not w.tokens and (m.marks or m.groups):
        return f"no request is live, yet suspects {sorted(m.marks)} remain"
    if not set(m._alone) <= set(m.marks):
        return f"failures alone kept for {sorted(set(m._alone) - set(m.marks))}, no longer suspects"
    kept = set(m._origin_of.values()) | set(m._refunds)
    if set(m._origins) != kept:
        return f"origins {sorted(m._origins)} kept, {sorted(kept)} have suspects or a refund due"
    return None


PROPERTIES: tuple[Callable[[World], str | None], ...] = (
    no_innocent_convicted, poisons_never_close, counted_only_without_culprit,
    verdicts_are_earned, suspects_end_convicted_or_cleared,
)
FAMILIES = frozenset({
    "origin", "origin.while_isolating", "convict.verdict", "convict.no_verdict", "refund",
    "clear.token", "clear.gone", "count.beyond_allowance", "restart.failed", "give_up", "abort",
})
"""The paths through the machine each exploration reports reaching."""


def check(w: World) -> list[str]:
    """The properties `w` breaks, by name."""
    return [f"{p.__name__}: {problem}" for p in PROPERTIES if (problem := p(w)) is not None]


# ---- exploration ------------------------------------------------------------------
@attrs.define
class IsolationExploration:
    """What one breadth-first exploration of a scope found."""

    scope: IsolationScope
    num_states: int = 0
    num_transitions: int = 0
    max_depth: int = 0
    seconds: float = 0.0
    complete: bool = True
    families: set[str] = attrs.Factory(set)
    violation: tuple[list[tuple], list[str]] | None = None

    def summary(self) -> str:
        """One line: scope, states, transitions, depth, time."""
        return (f"isolation @ {self.scope.name}: {self.num_states} states, {self.num_transitions} "
                f"transitions, depth {self.max_depth}, {self.seconds:.1f}s")


def explore_isolation(scope: IsolationScope) -> IsolationExploration:
    """Visit every reachable world of `scope`, checking every property in each;
    stops at the first violation with the shortest moves that reach it."""
    started = time.perf_counter()
    result = IsolationExploration(scope)
    init = World.start(scope)
    seen = {init.key(): None}
    frontier = deque([(init, [])])
    while frontier:
        world, path = frontier.popleft()
        for move in world.moves():
            nxt = world.clone()
            nxt.apply(move)
            result.num_transitions += 1
            result.families |= nxt.families
            key = nxt.key()
            if key in seen:
                continue
            seen[key] = None
            problems = check(nxt)
            if problems:
                result.violation = (path + [move], problems)
                result.complete = False
                frontier.clear()
                break
            result.max_depth = max(result.max_depth, len(path) + 1)
            if len(seen) >= scope.max_states:
                result.complete = False
                frontier.clear()
                break
            frontier.append((nxt, path + [move]))
    result.num_states = len(seen)
    result.seconds = time.perf_counter() - started
    return result
