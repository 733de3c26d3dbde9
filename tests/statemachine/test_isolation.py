"""The poison-isolation machine: unit tests of its bookkeeping, and a Hypothesis
state machine that drives it in the world of `cadence.spec.isolation` at
larger scopes than the explorer's, checking every named property after every move."""

from __future__ import annotations

import math

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cadence.spec.isolation import INNOCENT, POISON, IsolationScope, World, check
from cadence.statemachine.isolation import (
    BASE_UNCOUNTED_IN_A_ROW, CONVICTING_FAILURES, Isolation, restart_pause_s,
)

CRASH = "step 3 failed: crash"


def test_bad_budgets_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="max_restarts must be at least 0, got -1"):
        Isolation(-1, 10.0)
    with pytest.raises(ValueError, match="restart_window_s must be positive, got 0"):
        Isolation(1, 0.0)
    # The least of each is taken: no restart at all, and a window under a second.
    assert Isolation(0, 0.5).call_failed(0.0, CRASH, {"a": 0}, None).give_up


def test_a_step_runs_unsuspected_requests_first_then_each_group_oldest_first():
    m = Isolation(3, 100.0)
    m.call_failed(1.0, CRASH, {"a": 0, "b": 0, "c": 0}, None)
    assert list(m.groups.values()) == [["a", "b"], ["c"]]
    parts = m.partition(["c", "x", "a", "b"])
    assert [members for _, members in parts] == [["x"], ["a", "b"], ["c"]]
    assert parts[0][0] is None
    assert [members for _, members in m.partition(["c"])] == [["c"]]


def test_a_lone_poison_is_convicted_within_the_allowance_and_refunded_after_a_success():
    """The batch, then twice alone: the third failure in a row is the last that may go
    uncounted (BASE_UNCOUNTED_IN_A_ROW), and it convicts."""
    m = Isolation(1, 100.0)
    first = m.call_failed(1.0, CRASH, {"p": 0}, None)
    assert first.counted and not first.give_up and first.conviction is None
    (gid, _), = m.partition(["p"])
    second = m.call_failed(2.0, CRASH, {"p": 0}, gid)
    assert not second.counted and second.conviction is None
    (gid, _), = m.partition(["p"])
    third = m.call_failed(3.0, CRASH, {"p": 0}, gid)
    assert m.num_in_a_row == BASE_UNCOUNTED_IN_A_ROW == 1 + CONVICTING_FAILURES == m.num_failures
    assert m.last_failure == CRASH
    assert not third.counted and not third.give_up
    assert third.conviction is not None and third.conviction.request_id == "p"
    assert not third.conviction.verdict, "nothing else ran: the executor may be at fault"
    assert not m.groups and not m.marks
    assert m.num_charged == 0, "a culprit was found: the origin awaits its refund"
    assert m.call_succeeded() == 1 and m.num_charged == 0
    assert m.call_failed(4.0, CRASH, {}, None).counted


def test_one_failure_past_the_allowance_counts_and_convicts_nobody():
    m = Isolation(3, 100.0)
    m.call_failed(1.0, CRASH, {"p": 0}, None)
    for now in (2.0, 3.0):
        (gid, _), = m.partition(["p"])
        m.call_failed(now, "step 9 failed: another fault" if now == 2.0 else CRASH, {"p": 0}, gid)
    # Two different failures alone: the count started again, so no conviction yet.
    assert m.marks == {"p": 0}
    (gid, _), = m.partition(["p"])
    beyond = m.call_failed(4.0, CRASH, {"p": 0}, gid)
    assert beyond.counted and beyond.conviction is None
    assert m.num_charged == 2, "the origin lost its excuse, and this failure counts"


def test_the_allowance_grows_with_the_halvings_a_batch_needs():
    """Eight suspects: the batch, three halvings and two failures alone may go
    uncounted in a row; the next failure counts."""
    m = Isolation(1, 100.0)
    batch = {f"r{i}": 0 for i in range(8)}
    m.call_failed(1.0, CRASH, batch, None)
    allowance = BASE_UNCOUNTED_IN_A_ROW + math.ceil(math.log2(8))
    for now in range(2, allowance + 2):
        gid, members = m.partition(batch)[0]
        decision = m.call_failed(float(now), CRASH, dict.fromkeys(members, 0), gid)
        assert decision.counted == (now > allowance), now
    assert m.num_in_a_row == allowance + 1


def test_a_second_origin_while_the_first_is_isolated_does_not_count_either():
    m = Isolation(1, 100.0)
    m.call_failed(1.0, CRASH, {"a": 0, "p": 0}, None)
    assert m.call_succeeded() == 0
    second = m.call_failed(2.0, CRASH, {"q": 0}, None)
    assert second.counted and not second.give_up and m.num_charged == 0
    assert sorted(m.marks) == ["a", "p", "q"]


def test_an_isolation_that_finds_nobody_counts_once_its_suspects_are_cleared():
    m = Isolation(1, 100.0)
    m.call_failed(1.0, CRASH, {"a": 0, "b": 1}, None)
    assert m.num_charged == 0
    assert m.clear({"a": 1, "b": 1}) == ["a"], "a got a token past its mark; b did not"
    assert m.clear({}) == ["b"], "b is gone"
    assert m.num_charged == 1 and not m.groups
    assert m.call_failed(2.0, CRASH, {"c": 0}, None).give_up


def test_suspects_the_failed_call_did_not_run_stay_suspects_in_a_group_of_their_own():
    """A group of two fails with only one of them scheduled (the other waits): the
    one that ran is split off as before, the other stays suspected, apart."""
    m = Isolation(1, 100.0)
    m.call_failed(1.0, CRASH, {"a": 0, "b": 0, "c": 0, "d": 0}, None)
    gid, members = m.partition(["a", "b", "c", "d"])[0]
    assert members == ["a", "b"]
    m.call_failed(2.0, CRASH, {"a": 0}, gid)
    assert sorted(map(sorted, m.groups.values())) == [["a"], ["b"], ["c", "d"]]
    assert sorted(m.marks) == ["a", "b", "c", "d"]


def test_a_different_failure_alone_starts_the_count_again_at_one():
    """Alone: one failure, then another kind twice; the second of the new kind convicts."""
    m = Isolation(1, 100.0)
    m.call_failed(1.0, CRASH, {"p": 0, "q": 0}, None)
    (gid, _), = m.partition(["p"])
    assert m.call_failed(2.0, CRASH, {"p": 0}, gid).conviction is None
    other = "step 5 failed: out of memory"
    for now in (3.0, 4.0):
        (gid, _), = m.partition(["p"])
        decision = m.call_failed(now, other, {"p": 0}, gid)
    assert not decision.counted and decision.conviction is not None
    assert "2 times alone" in decision.conviction.detail and "out of memory" in decision.conviction.detail


def test_a_named_failure_forgets_the_suspect():
    m = Isolation(1, 100.0)
    m.call_failed(1.0, CRASH, {"a": 0, "b": 0}, None)
    m.forget("a")
    assert list(m.groups.values()) == [["b"]] and m.marks == {"b": 0}
    m.forget("b")
    assert not m.groups and not m._origins


def test_failed_restarts_count_and_close_the_budget():
    m = Isolation(2, 10.0)
    assert m.restart_failed(1.0, "restart failed: x") and m.restart_failed(2.0, "restart failed: x")
    assert not m.restart_failed(3.0, "restart failed: x")
    assert m.num_failures == 3 and m.num_in_a_row == 3 and m.last_failure == "restart failed: x"
    assert m.restart_failed(12.5, "restart failed: x"), "the first two left the window"


def test_a_success_with_nothing_to_note_refunds_nothing():
    m = Isolation(1, 100.0)
    assert m.call_succeeded() == 0 and m.num_in_a_row == 0


def test_a_failure_nobody_is_blamed_for_still_ends_its_row_at_the_next_success():
    """An answer out of turn blames nobody (no requests): it counts, begins no
    isolation, and the next successful call ends the row of failures."""
    m = Isolation(1, 100.0)
    decision = m.call_failed(1.0, "executor answered step 4 when step 5 was sent", {}, None)
    assert decision.counted and not m.groups and m.num_charged == 1
    m.call_succeeded()
    assert m.num_in_a_row == 0 and m.num_charged == 1


def test_the_allowance_of_a_fresh_row_is_that_of_its_own_isolation():
    """A batch of eight raised the allowance; once a call succeeds and a lone request
    fails anew, its row may cost only what one request's isolation needs."""
    m = Isolation(5, 100.0)
    m.call_failed(1.0, CRASH, {f"r{i}": 0 for i in range(8)}, None)
    m.give_up()
    m.call_succeeded()
    m.call_failed(2.0, CRASH, {"p": 0}, None)
    for now in (3.0, 4.0):
        (gid, _), = m.partition(["p", "q"])[-1:]
        m.call_failed(now, "step 9 failed: another fault" if now == 3.0 else CRASH, {"p": 0}, gid)
    (gid, _), = m.partition(["p"])
    assert m.call_failed(5.0, CRASH, {"p": 0}, gid).counted, "the fourth failure in a row counts"


def test_a_failure_leaves_the_window_exactly_when_the_window_has_passed():
    m = Isolation(1, 10.0)
    assert m.restart_failed(2.0, "restart failed: x")
    assert not m.restart_failed(11.5, "restart failed: x")
    assert m.restart_failed(12.0, "restart failed: x"), "2.0 is 10 s old at 12.0: out of the window"


def test_giving_up_forgets_every_suspect():
    m = Isolation(1, 100.0)
    m.call_failed(1.0, CRASH, {"a": 0, "b": 0}, None)
    m.give_up()
    assert not m.groups and not m.marks and not m._origins


@pytest.mark.parametrize("in_a_row, draw, expected", [
    (1, 0.5, 0.5), (2, 0.5, 1.0), (3, 0.5, 2.0), (0, 0.5, 0.5),
    (1, 0.0, 0.375), (1, 1.0, 0.625), (10, 0.5, 4.0),
])
def test_restart_pauses_double_with_jitter_up_to_the_maximum(in_a_row, draw, expected):
    assert restart_pause_s(0.5, 4.0, in_a_row, draw) == pytest.approx(expected)


def test_a_world_starts_empty_and_a_poison_batch_begins_an_isolation():
    w = World.start(IsolationScope("unit", max_restarts=1))
    w.apply(("arrive", INNOCENT))
    w.apply(("arrive", POISON))
    w.apply(("step", None, False))
    assert w.families == {"origin"} and sorted(w.machine.marks) == ["r0", "r1"]
    assert check(w) == []


# Last in the file: the unit tests above fail faster, for the mutation runner.
class IsolationMachine(RuleBasedStateMachine):
    """Requests arrive (innocent or poison), walk away, and steps run; the scope
    (budget, faults allowed) is drawn once per run."""

    @initialize(max_restarts=st.integers(1, 3), transients=st.integers(0, 2),
                restart_failures=st.integers(0, 2), aborts=st.booleans())
    def start(self, max_restarts, transients, restart_failures, aborts):
        scope = IsolationScope("hypothesis", max_arrivals=10, max_live=6, max_poisons=4,
                               tokens=3, transients=transients, restart_failures=restart_failures,
                               aborts=aborts, max_restarts=max_restarts)
        self.world = World.start(scope)

    @rule(data=st.data())
    def move(self, data):
        moves = list(self.world.moves())
        if moves:
            self.world.apply(data.draw(st.sampled_from(moves), label="move"))

    @invariant()
    def every_property_holds(self):
        assert check(self.world) == []


TestIsolationMachine = IsolationMachine.TestCase
