"""Admission that does not compute one prompt prefix twice in a step."""

from __future__ import annotations

from core_helpers import first_admissions, make_request, make_scheduler, run_until_idle, step

SHARED = list(range(500, 516))  # four blocks of four tokens


def same_step_arrivals(s) -> None:
    s.add_request(make_request("a", SHARED + [1, 2], max_tokens=2, arrival_s=0.0))
    s.add_request(make_request("b", SHARED + [3, 4], max_tokens=2, arrival_s=0.0))
    s.add_request(make_request("c", 6, max_tokens=2, arrival_s=0.0))


def test_a_request_waits_a_step_for_a_prefix_being_computed():
    """b shares a's four prompt blocks, which a computes in step 0: b (and c, which
    arrived after it) wait; in step 1 b finds the blocks cached."""
    s = make_scheduler(block_size=4)
    same_step_arrivals(s)
    plan, _ = step(s)
    assert [d.request_id for d in plan.new_requests] == ["a"]
    plan, _ = step(s)
    new = {d.request_id: d.num_computed_tokens for d in plan.new_requests}
    assert new == {"b": 16, "c": 0}
    _, events = run_until_idle(s)
    assert s.stats().num_scheduled_tokens == 18 + 2 + 6 + 3 * 1  # prompts once, outputs


def test_without_waiting_the_prefix_is_computed_twice():
    s = make_scheduler(block_size=4, admission_prefix_wait_blocks=0)
    same_step_arrivals(s)
    plan, _ = step(s)
    assert {d.request_id: d.num_computed_tokens for d in plan.new_requests} == {"a": 0, "b": 0, "c": 0}
    run_until_idle(s)
    assert s.stats().num_scheduled_tokens == 18 + 18 + 6 + 3 * 1


def test_a_short_shared_prefix_does_not_wait():
    """Below admission_prefix_wait_blocks shared blocks, both are admitted at once."""
    s = make_scheduler(block_size=4, admission_prefix_wait_blocks=2)
    s.add_request(make_request("a", SHARED[:4] + [1, 2, 3, 4, 5], max_tokens=2, arrival_s=0.0))
    s.add_request(make_request("b", SHARED[:4] + [6, 7, 8, 9, 10], max_tokens=2, arrival_s=0.0))
    plan, _ = step(s)
    assert [d.request_id for d in plan.new_requests] == ["a", "b"]


def test_waiting_keeps_arrival_order():
    """Nothing behind the waiting request is admitted before it."""
    s = make_scheduler(block_size=4)
    same_step_arrivals(s)
    _, events = run_until_idle(s)
    assert first_admissions(events) == ["a", "b", "c"]
