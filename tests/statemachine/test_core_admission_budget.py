"""`admission_delay_budget`: while requests run, a step's admissions share a token
budget with every request the engine holds, so a burst of arrivals joins over
several steps; with nothing running, or the budget off, admission is as before."""

from __future__ import annotations

import random

import pytest

from core_helpers import (admissions, arrive, completions, make_request, make_scheduler, random_arrival_plans,
                          run_until_idle, step)

PROMPT = 10


def running_then_burst(num_arrivals: int, **config):
    """A scheduler with one request decoding and `num_arrivals` of PROMPT tokens waiting."""
    s = make_scheduler(max_num_batched_tokens=256, num_blocks=256, max_num_seqs=32, **config)
    s.add_request(make_request("running", PROMPT, max_tokens=50, ignore_eos=True))
    step(s)
    for i in range(num_arrivals):
        s.add_request(make_request(f"b{i}", PROMPT, max_tokens=4, ignore_eos=True, arrival_s=1.0 + i))
    return s


def new_tokens(plan) -> int:
    """Tokens the plan gives the requests it admits."""
    return sum(plan.num_scheduled_tokens[d.request_id] for d in plan.new_requests)


def test_a_burst_beside_running_requests_joins_a_share_at_a_time_in_arrival_order():
    s = running_then_burst(8, admission_delay_budget=90, admission_min_tokens=1)
    order, steps = [], 0
    while len(s.policy):
        held = len(s.running) + len(s.policy)  # first 1 + 8: 10 tokens, one prompt
        plan, events = step(s)
        assert "running" in plan.num_scheduled_tokens  # its decode is never held back
        assert 0 < new_tokens(plan) <= 90 // held
        order += admissions(events)
        steps += 1
    assert order == [f"b{i}" for i in range(8)] and steps == 6  # without the budget: one step


def test_fewer_requests_held_get_a_larger_share():
    # 120 // (1 running + 8 waiting) = 13 tokens: a prompt and a chunk of the next;
    # 120 // (1 + 2) = 40: both prompts whole.
    many = running_then_burst(8, admission_delay_budget=120, admission_min_tokens=1)
    few = running_then_burst(2, admission_delay_budget=120, admission_min_tokens=1)
    assert new_tokens(step(many)[0]) == 13
    assert new_tokens(step(few)[0]) == 2 * PROMPT


def test_with_nothing_running_a_burst_joins_at_once():
    s = make_scheduler(max_num_batched_tokens=256, num_blocks=256, max_num_seqs=32,
                       admission_delay_budget=90, admission_min_tokens=1)
    for i in range(8):
        s.add_request(make_request(f"b{i}", PROMPT, max_tokens=4, arrival_s=float(i)))
    plan, _ = step(s)
    assert len(plan.new_requests) == 8


def test_the_floor_keeps_admission_going_however_many_requests_wait():
    s = running_then_burst(20, admission_delay_budget=1, admission_min_tokens=2 * PROMPT)
    plan, _ = step(s)
    assert new_tokens(plan) == 2 * PROMPT and len(plan.new_requests) == 2
    run_until_idle(s)


def test_one_in_drain_steps_of_the_waiting_joins_whatever_the_share():
    # A share of 1 token, 8 waiting, drain steps 4: two whole prompts a step.
    s = running_then_burst(8, admission_delay_budget=1, admission_min_tokens=1,
                           admission_drain_steps=4)
    plan, _ = step(s)
    assert [d.request_id for d in plan.new_requests] == ["b0", "b1"] and new_tokens(plan) == 2 * PROMPT


def test_a_backlog_beyond_the_free_seats_is_admitted_as_without_a_share():
    def first_admissions_of(budget: int) -> int:
        s = make_scheduler(max_num_batched_tokens=256, num_blocks=256, max_num_seqs=4,
                           admission_delay_budget=budget, admission_min_tokens=1)
        s.add_request(make_request("running", PROMPT, max_tokens=50, ignore_eos=True))
        step(s)
        for i in range(5):  # 5 waiting, 3 free seats
            s.add_request(make_request(f"b{i}", PROMPT, max_tokens=4, arrival_s=1.0 + i))
        return len(step(s)[0].new_requests)
    assert first_admissions_of(1) == first_admissions_of(0) == 3


def test_a_high_priority_arrival_displaces_no_one_for_admission_tokens():
    """With the share spent, a waiting request of higher priority waits for the next
    step: preempting a running request gives back budget, never admission tokens."""
    s = make_scheduler("priority", max_num_batched_tokens=256, num_blocks=256, max_num_seqs=8,
                       admission_delay_budget=1, admission_min_tokens=PROMPT)
    s.add_request(make_request("low", PROMPT, max_tokens=50, priority=5, ignore_eos=True))
    step(s)
    s.add_request(make_request("h1", PROMPT, max_tokens=4, priority=0, arrival_s=1.0))
    s.add_request(make_request("h2", PROMPT, max_tokens=4, priority=0, arrival_s=2.0))
    plan, events = step(s)
    assert admissions(events) == ["h1"] and not plan.preempted_ids
    plan, events = step(s)
    assert admissions(events) == ["h2"] and not plan.preempted_ids
    assert s.stats().num_preemptions == 0


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
@pytest.mark.parametrize("seed", range(6))
def test_a_budget_that_never_binds_changes_no_decision(policy, seed):
    """Arrivals over time, memory short enough to preempt: with a delay budget too
    large to bind, every plan is the one made without it."""
    def plans(budget: int) -> list:
        return random_arrival_plans(seed, policy, admission_watermark=0.0, admission_headroom_steps=0,
                                    admission_delay_budget=budget, admission_min_tokens=1)
    assert plans(10**9) == plans(0)


@pytest.mark.parametrize("seed", range(4))
def test_a_binding_budget_loses_no_request_and_no_block(seed):
    rng = random.Random(seed)
    s = make_scheduler(num_blocks=40, block_size=4, max_num_seqs=6, max_num_batched_tokens=32,
                       admission_delay_budget=24, admission_min_tokens=3)
    events = []
    for i in range(24):
        s.add_request(make_request(f"r{i}", rng.randint(4, 30), max_tokens=rng.randint(2, 30),
                                   arrival_s=float(i)))
        events += step(s, float(i))[1]
    events += run_until_idle(s, 2000, start_s=24.0)[1]
    assert set(completions(events)) == {f"r{i}" for i in range(24)}
    assert s.blocks.num_used_blocks == 0
