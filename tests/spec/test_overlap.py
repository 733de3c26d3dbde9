"""The formal side of async scheduling: overlap's named invariants hold on the
real core and each fails on a state broken by hand; the reference spec accepts
overlapped runs (answers in any order, a stop one step late) and rejects a core
that plans ahead where it must not; the overlap scope's canonical key keeps
pending steps and held answers; the overlap scope catches a broken core."""

import inspect
import textwrap

import attrs
import pytest

from cadence.spec import invariants as inv
from cadence.spec.explore import SCOPES, canonical_key, explore
from cadence.spec.harness import Harness
from cadence.spec.refinement import CheckedHarness, SpecViolation, StepChecker
from cadence.statemachine import scheduler as core
from cadence.statemachine.config import CacheConfig, SchedulerConfig
from cadence.statemachine.plan import StepResult

CONFIG = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=4, max_model_len=8,
                         admission_headroom_steps=1, async_scheduling=True)
CACHE = CacheConfig(num_blocks=6, block_size=2)


def ahead(h=None) -> Harness:
    """r (prompt 3 tokens, 4 to generate) in plan 0 (its prefill) and plan 1 (the
    decode of plan 0's token, planned ahead)."""
    h = h or CheckedHarness(CONFIG, CACHE)
    h.add("r", (1, 2, 3), 4)
    h.schedule()
    h.schedule()
    return h


def held() -> Harness:
    """As `ahead`, with plan 1 answered first: the core holds its answer back."""
    h = ahead()
    h.complete([], index=1)
    return h


def problems(h: Harness, name: str) -> list[str]:
    return inv.OVERLAP_INVARIANTS[name](h.scheduler, [f.plan for f in h.inflight])


def test_the_overlap_invariants_hold_along_an_overlapped_run():
    h = ahead()
    r = h.scheduler.requests["r"]
    assert r.pending_steps == [0, 1] and r.num_computed_tokens == 4 == r.num_tokens + 1
    h.complete([], index=1)
    assert set(h.scheduler._early) == {1}
    h.complete([], index=0)  # plan 0's token, then the held one
    assert r.output_token_ids == [1, 1] and not h.scheduler._early
    for _ in range(8):  # two plans in flight, the newer always answered first
        while len(h.inflight) < 2 and not h.schedule().is_empty:
            pass
        h.complete([], index=len(h.inflight) - 1)
        if h.state_of("r") == "gone":
            break
    assert h.state_of("r") == "gone" and r.output_token_ids == [1, 1, 1, 1]
    # CheckedHarness checked every predicate after every move; they are all there.
    assert len(inv.OVERLAP_INVARIANTS) == 6


@pytest.mark.parametrize("name, break_it, message", [
    ("pending_steps_name_plans_in_flight",
     lambda s, r: r.pending_steps.reverse(), "not increasing"),
    ("pending_steps_name_plans_in_flight",
     lambda s, r: r.pending_steps.append(9), "neither in flight nor held back"),
    ("pending_steps_name_plans_in_flight",
     lambda s, r: r.pending_steps.insert(0, -1), "at most 2"),
    ("pending_steps_name_plans_in_flight",
     lambda s, r: s._inflight[1].num_scheduled_tokens.pop("r"), "does not schedule it"),
    ("computed_covers_tokens_in_flight",
     lambda s, r: setattr(r, "num_computed_tokens", 3), "expected 4"),
    ("request_in_two_plans_only_ahead",
     lambda s, r: s._inflight[1].num_scheduled_tokens.update(r=2), "for 2 tokens"),
    ("request_in_two_plans_only_ahead",
     lambda s, r: setattr(s, "config", attrs.evolve(s.config, async_scheduling=False)),
     "without async scheduling"),
    ("lookahead_blocks_reserved",
     lambda s, r: s.blocks.tables["r"].pop(), "holds 1 blocks for 4 computed"),
    ("no_lookahead_past_length_limit",
     lambda s, r: setattr(r, "length_limit", 4), "past its length limit 4"),
])
def test_each_overlap_invariant_fails_on_a_state_broken_by_hand(name, break_it, message):
    h = ahead(Harness(CONFIG, CACHE))
    assert problems(h, name) == []
    break_it(h.scheduler, h.scheduler.requests["r"])
    found = problems(h, name)
    assert any(message in m for m in found), found


@pytest.mark.parametrize("break_it, message", [
    (lambda s, h, held: s._early.update({0: StepResult(0, {"r": [1]})}), "the oldest in flight"),
    (lambda s, h, held: s._early.update({7: StepResult(7, {})}), "not in flight"),
    (lambda s, h, held: s._early.update({1: StepResult(0, {})}), "is plan 0's"),
    (lambda s, h, held: h.inflight.append(held), "has not answered"),
])
def test_held_answers_wait_fails_on_a_state_broken_by_hand(break_it, message):
    h = ahead(Harness(CONFIG, CACHE))
    flight = h.inflight[1]
    h.complete([], index=1)
    name = "held_answers_wait_for_older_plans"
    assert problems(h, name) == [] and set(h.scheduler._early) == {1}
    break_it(h.scheduler, h, flight)
    found = problems(h, name)
    assert any(message in m for m in found), found


def test_pending_steps_without_async_scheduling_are_one_at_most():
    h = Harness(attrs.evolve(CONFIG, async_scheduling=False), CACHE)
    h.add("r", (1, 2, 3), 4)
    h.schedule()
    assert h.schedule().is_empty
    r = h.scheduler.requests["r"]
    assert problems(h, "pending_steps_name_plans_in_flight") == []
    r.pending_steps.append(0)
    assert any("at most 1" in m for m in problems(h, "pending_steps_name_plans_in_flight"))


def test_the_budget_holds_across_overlapped_plans():
    h = ahead(Harness(CONFIG, CACHE))
    plans = [f.plan for f in h.inflight]
    assert inv.inflight_within_budget(h.scheduler, plans) == []
    plans[1].num_scheduled_tokens["r"] = 5
    found = inv.inflight_within_budget(h.scheduler, plans)
    assert any("in flight schedules 5 tokens" in m for m in found), found
    assert any("has 8 tokens scheduled in flight" in m for m in found), found


def test_a_stop_token_ends_the_request_a_step_late_and_the_spec_agrees():
    """Plan 0 samples end-of-sequence; plan 1 already computes after it: its token
    is never emitted, whichever answer comes first."""
    for first in (0, 1):
        h = ahead()
        if first:
            h.complete(["r"], index=1)  # held back
            events = h.complete(["r"], index=0)
        else:
            events = h.complete(["r"], index=0)
            h.complete(["r"], index=0)  # plan 1's answer: r is gone, nothing changes
        assert [t for e in events for t in e.token_ids] == [0]
        assert h.state_of("r") == "gone" and not h.scheduler._inflight


def test_the_spec_rejects_planning_ahead_without_async_scheduling():
    h = CheckedHarness(CONFIG, CACHE)
    h.checker = StepChecker(attrs.evolve(CONFIG, async_scheduling=False), CACHE)
    h.add("r", (1, 2, 3), 4)
    h.schedule()
    with pytest.raises(SpecViolation, match="without async scheduling"):
        h.schedule()


def test_the_spec_rejects_an_answer_applied_before_an_older_one(monkeypatch):
    monkeypatch.setattr(core.Scheduler, "_answered_early", lambda self, plan: False)
    h = ahead()
    with pytest.raises(SpecViolation, match="held back"):
        h.complete([], index=1)


def test_the_canonical_key_keeps_pending_steps_and_held_answers_up_to_renaming():
    a, b = held(), Harness(CONFIG, CACHE)
    b.add("other", (1, 2, 3), 4)
    b.schedule()
    b.schedule()
    b.complete([], index=1)
    assert canonical_key(a, 3)[0] == canonical_key(b, 3)[0]
    c = b.clone()
    c.scheduler._early[1] = StepResult(1, {"other": [0]})  # another token held back
    assert canonical_key(c, 3)[0] != canonical_key(b, 3)[0]
    d = b.clone()
    d.scheduler.requests["other"].pending_steps.pop()
    assert canonical_key(d, 3)[0] != canonical_key(b, 3)[0]
    assert b.scheduler.requests["other"].pending_steps == [0, 1], "clones share no lists"


def _patched_schedule(monkeypatch, guard: str, replacement: str) -> None:
    """Replace one line of `Scheduler.schedule` (a seeded bug)."""
    source = textwrap.dedent(inspect.getsource(core.Scheduler.schedule))
    assert guard in source, "the guard moved; update this test"
    namespace = dict(vars(core))
    exec(compile(source.replace(guard, replacement), core.__file__, "exec"), namespace)
    monkeypatch.setattr(core.Scheduler, "schedule", namespace["schedule"])


def test_the_overlap_scope_catches_planning_ahead_past_the_length_limit(monkeypatch):
    _patched_schedule(monkeypatch, "if len(request.all_token_ids) + 1 >= request.length_limit:",
                      "if False:")
    ex = explore("fcfs", SCOPES["overlap"], keep_graph=False)
    assert ex.violations
    text = "\n".join(ex.violations[0].problems)
    assert "length" in text, text


def test_the_overlap_scope_catches_planning_two_plans_ahead(monkeypatch):
    _patched_schedule(monkeypatch, "if not overlap or len(pending) != 1 or n + 1 <= 0:",
                      "if not overlap or len(pending) > 2:")
    ex = explore("fcfs", SCOPES["overlap"], keep_graph=False)
    assert ex.violations
    assert "ahead" in "\n".join(ex.violations[0].problems) or "at most 2" in str(ex.violations[0])


# Answers in any order with three plans in flight: which held answers the core
# applies, and when (each test also runs every move past the reference spec).
def three_requests() -> CheckedHarness:
    return CheckedHarness(attrs.evolve(CONFIG, max_num_seqs=3, max_num_batched_tokens=8),
                          attrs.evolve(CACHE, num_blocks=9))


def test_an_answer_that_overtakes_an_unrelated_plan_is_applied_at_once():
    """Plan 1 samples only for b, which plan 0 does not schedule (a's token in
    flight ends it by length, so a is not planned ahead): nothing to wait for."""
    h = three_requests()
    h.add("a", (1, 2, 3), 1)
    h.schedule()
    h.add("b", (4, 5), 3)
    assert h.schedule().num_scheduled_tokens == {"b": 2}
    h.complete([], index=1)
    assert h.scheduler.requests["b"].output_token_ids == [1] and not h.scheduler._early


def test_a_held_answer_stays_held_while_its_elder_is_unanswered():
    """Plan 1 (a planned ahead) is held behind plan 0; plan 2 (b's prefill) is
    answered and applied, and plan 1 must still wait for plan 0."""
    h = three_requests()
    h.add("a", (1, 2, 3), 4)
    h.schedule()
    h.schedule()
    h.complete([], index=1)
    h.add("b", (4, 5), 3)
    assert h.schedule().num_scheduled_tokens == {"b": 2}
    h.complete([], index=1)
    s = h.scheduler
    assert s.requests["b"].output_token_ids == [1]
    assert set(s._early) == {1} and s.requests["a"].output_token_ids == []
    h.complete(["a"], index=0)  # plan 0 stops a; plan 1's token is never emitted
    assert h.state_of("a") == "gone" and not s._early and not s._inflight


def test_a_held_answer_is_applied_once_unblocked_though_an_older_plan_is_in_flight():
    """Plan 0 prefills x; plan 1 prefills a; plan 2 decodes a ahead and is held
    behind plan 1. Plan 1's answer unblocks it while plan 0 is still in flight:
    both of a's tokens are applied then."""
    h = three_requests()
    h.add("x", (7, 8, 9), 3)
    h.schedule()
    h.add("a", (1, 2, 3), 4)
    assert set(h.schedule().num_scheduled_tokens) == {"x", "a"}
    h.abort("x")  # x leaves plan 0 and plan 1 behind, still in flight
    assert h.schedule().num_scheduled_tokens == {"a": 1}
    h.complete([], index=2)
    assert set(h.scheduler._early) == {2}
    h.complete([], index=1)
    assert h.scheduler.requests["a"].output_token_ids == [1, 1] and not h.scheduler._early
    assert list(h.scheduler._inflight) == [0]


def test_two_held_answers_are_applied_in_order_after_their_elder():
    """Plan 1 (a ahead, b's prefill) and plan 2 (b ahead) are both held; plan 0's
    answer releases plan 1, which releases plan 2."""
    h = three_requests()
    h.add("a", (1, 2, 3), 4)
    h.schedule()
    h.add("b", (4, 5), 3)
    assert h.schedule().num_scheduled_tokens == {"a": 1, "b": 2}
    assert h.schedule().num_scheduled_tokens == {"b": 1}
    h.complete([], index=2)
    h.complete([], index=1)
    s = h.scheduler
    assert set(s._early) == {1, 2}
    h.complete([], index=0)
    assert s.requests["a"].output_token_ids == [1, 1] and s.requests["b"].output_token_ids == [1, 1]
    assert not s._early and not s._inflight
