"""Admission that does not compute one prompt prefix twice in a step."""

from __future__ import annotations

import random

import pytest

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


def test_nobody_waits_for_a_prefix_whose_computation_was_lost_with_the_executor():
    """a's step dies with the executor. a may be what kills it, so b and c are admitted
    beside it rather than behind it; the exemption ends with a's next completed step."""
    s = make_scheduler(block_size=4)
    same_step_arrivals(s)
    s.schedule()
    s.executor_lost()
    plan, _ = step(s)
    assert {d.request_id: d.num_computed_tokens for d in plan.new_requests} == {"a": 0, "b": 0, "c": 0}
    assert not s._lost, "a step of theirs completed: a leads a prefix wait again"
    s.schedule()
    s.executor_lost()
    s.abort_request("a", "gone")
    assert s._lost == {"b", "c"}, "a completed request leaves no exemption behind"
    run_until_idle(s)
    assert not s._lost


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


def test_longest_cached_prefix_first_among_tied_requests():
    """x, y and z arrive together; only z's prompt is cached: z is admitted first.
    A request that arrived earlier is not overtaken, whatever its prefix."""
    s = make_scheduler(block_size=4, max_num_seqs=1)
    s.add_request(make_request("warm", SHARED + [1], max_tokens=1, arrival_s=0.0))
    run_until_idle(s, start_s=0.0)
    s.add_request(make_request("early", 9, max_tokens=1, arrival_s=1.0))
    for rid in ("x", "y"):
        s.add_request(make_request(rid, 9, max_tokens=1, arrival_s=2.0))
    s.add_request(make_request("z", SHARED + [2], max_tokens=1, arrival_s=2.0))
    _, events = run_until_idle(s, start_s=3.0)
    assert first_admissions(events) == ["early", "z", "x", "y"]


def test_policy_order_among_ties_without_lookahead():
    s = make_scheduler(block_size=4, max_num_seqs=1, prefix_tie_lookahead=1)
    s.add_request(make_request("warm", SHARED + [1], max_tokens=1, arrival_s=0.0))
    run_until_idle(s, start_s=0.0)
    for rid in ("x", "y"):
        s.add_request(make_request(rid, 9, max_tokens=1, arrival_s=2.0))
    s.add_request(make_request("z", SHARED + [2], max_tokens=1, arrival_s=2.0))
    _, events = run_until_idle(s, start_s=3.0)
    assert first_admissions(events) == ["x", "y", "z"]


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
@pytest.mark.parametrize("seed", range(3))
def test_lookahead_changes_nothing_without_cached_prefixes(policy, seed):
    """Unique prompts and room for every seat's longest request (no preemption), so
    no request ever finds a cached block: every plan is the same with or without
    the tie lookahead, with many ties and seats as the binding limit."""
    def plans(lookahead: int) -> tuple[list, int]:
        rng = random.Random(seed)
        s = make_scheduler(policy, num_blocks=48, block_size=4, max_num_seqs=6,
                           preempt_for_priority=False, prefix_tie_lookahead=lookahead)
        out = []
        for t in range(120):
            for i in range(rng.randint(0, 2)):
                s.add_request(make_request(f"r{t}-{i}", rng.randint(3, 14), max_tokens=rng.randint(1, 12),
                                           priority=rng.randint(0, 2), tenant=rng.choice("ab"),
                                           arrival_s=float(t // 4), ignore_eos=True))
            plan, _ = step(s, float(t))
            out.append((dict(plan.num_scheduled_tokens), list(plan.preempted_ids)))
        assert s.blocks.num_hit_tokens == 0 and s.num_resume_hit_tokens == 0
        return out, s.stats().num_preemptions
    with_lookahead, _ = plans(8)
    without, preemptions = plans(1)
    assert with_lookahead == without and preemptions == 0


def test_fair_ties_are_one_tenant_and_one_arrival_time():
    """Under fair, the prefix lookahead reorders only requests of one tenant that
    arrived together: z (tenant a, cached prompt) goes before x, which arrived
    with it; it does not overtake a's earlier request, and b's cached request
    waits for b's turn however long its cached prefix."""
    s = make_scheduler(block_size=4, max_num_seqs=1, policy="fair")
    s.add_request(make_request("warm", SHARED + [1], max_tokens=1, arrival_s=0.0, tenant="b"))
    run_until_idle(s, start_s=0.0)
    s.add_request(make_request("early", 9, max_tokens=1, arrival_s=1.0, tenant="a"))
    s.add_request(make_request("x", 9, max_tokens=1, arrival_s=2.0, tenant="a"))
    s.add_request(make_request("other", SHARED + [3], max_tokens=1, arrival_s=2.0, tenant="b"))
    s.add_request(make_request("z", SHARED + [2], max_tokens=1, arrival_s=2.0, tenant="a"))
    _, events = run_until_idle(s, start_s=3.0)
    assert first_admissions(events) == ["early", "z", "x", "other"]


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
@pytest.mark.parametrize("seed", range(8))
def test_a_resumed_request_keeps_its_place_among_ties(policy, seed):
    """Unique prompts, everyone arriving at once, memory short of every seat's
    growth: preempted requests come back to find their own retained blocks, and
    the tie lookahead does not rank them by those (they are no shared prefix),
    so every plan is the same with or without it. Ranked by them, a resumed
    request would overtake an earlier arrival that is waiting for room."""
    def plans(lookahead: int) -> list:
        rng = random.Random(seed)
        s = make_scheduler(policy, num_blocks=28, block_size=4, max_num_seqs=6,
                           admission_watermark=0.0, admission_growth_share=0.0,
                           admission_headroom_steps=0, prefix_tie_lookahead=lookahead)
        for i in range(16):
            s.add_request(make_request(f"r{i}", rng.randint(8, 24), max_tokens=rng.randint(8, 30),
                                       priority=rng.randint(0, 1), tenant=rng.choice("ab"),
                                       arrival_s=0.0, ignore_eos=True))
        out = []
        for t in range(600):
            plan, _ = step(s, float(t))
            out.append((dict(plan.num_scheduled_tokens), list(plan.preempted_ids)))
        assert not s.has_work() and s.stats().num_preemptions > 0
        assert s.blocks.num_hit_tokens == 0 and s.num_resume_hit_tokens > 0
        return out
    assert plans(8) == plans(1)
