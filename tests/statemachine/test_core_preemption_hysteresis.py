"""Priority preemption only when it is worth the recomputation (hysteresis), and the
blocks of a preempted request kept for its return."""

from __future__ import annotations

import pytest

from cadence.statemachine.blocks import BlockManager
from cadence.statemachine.config import SchedulerConfig
from cadence.statemachine.policy import PriorityPolicy
from cadence.statemachine.request import Request

from core_helpers import make_request, make_scheduler, run_until_idle, step


def running(rid: str, priority: int, computed: int, preemptions: int = 0) -> Request:
    r = make_request(rid, 4, priority=priority, arrival_s=0.0)
    r.num_computed_tokens = computed
    r.num_preemptions = preemptions
    return r


def waiting(priority: int) -> Request:
    return make_request("w", 4, priority=priority, arrival_s=0.0)


@pytest.mark.parametrize("gap_needed, victim_priority, allowed", [
    (1, 1, True), (2, 1, False), (2, 2, True), (1, 0, False)])
def test_a_preemption_needs_the_priority_gap(gap_needed, victim_priority, allowed):
    policy = PriorityPolicy(SchedulerConfig(preempt_min_priority_gap=gap_needed,
                                            preempt_max_recompute_tokens=0, preempt_max_times=0))
    assert policy.may_preempt(waiting(0), running("v", victim_priority, 5)) is allowed


@pytest.mark.parametrize("computed, gap, allowed", [(10, 1, True), (11, 1, False), (20, 2, True),
                                                    (21, 2, False)])
def test_the_work_thrown_away_is_bounded_per_level_of_gap(computed, gap, allowed):
    policy = PriorityPolicy(SchedulerConfig(preempt_max_recompute_tokens=10, preempt_max_times=0))
    assert policy.may_preempt(waiting(0), running("v", gap, computed)) is allowed


def test_no_recompute_limit_when_zero():
    policy = PriorityPolicy(SchedulerConfig(preempt_max_recompute_tokens=0, preempt_max_times=0))
    assert policy.may_preempt(waiting(0), running("v", 1, 10**6))


@pytest.mark.parametrize("times, limit, allowed", [(0, 1, True), (1, 1, False), (1, 2, True),
                                                   (5, 0, True)])
def test_a_request_is_displaced_at_most_preempt_max_times(times, limit, allowed):
    policy = PriorityPolicy(SchedulerConfig(preempt_max_times=limit))
    assert policy.may_preempt(waiting(0), running("v", 1, 1, preemptions=times)) is allowed


def scenario(**config):
    """A low-priority request holds most of the cache after 12 tokens; a
    high-priority one arrives that needs its blocks."""
    s = make_scheduler("priority", num_blocks=6, block_size=4, **config)
    s.add_request(make_request("low", 16, max_tokens=8, priority=2))
    step(s)
    s.add_request(make_request("high", 8, max_tokens=2, priority=0, arrival_s=1.0))
    plan, _ = step(s)
    return s, plan


def test_a_victim_with_too_much_work_done_is_not_preempted():
    """Hysteresis: `low` has computed 16 tokens and the gap is 2 levels. With at
    most 7 tokens per level (14) the arrival waits; with 8 (16) it preempts.
    Both runs finish everything."""
    s, plan = scenario(preempt_max_recompute_tokens=7)
    assert plan.preempted_ids == [] and "high" not in plan.num_scheduled_tokens
    run_until_idle(s)
    s, plan = scenario(preempt_max_recompute_tokens=8)
    assert plan.preempted_ids == ["low"] and "high" in plan.num_scheduled_tokens
    run_until_idle(s)


def test_a_request_preempted_once_is_not_displaced_again():
    """After its first preemption `low` runs on when a second high-priority
    request arrives (it yields only if the cache runs out)."""
    s, plan = scenario(preempt_max_times=1)
    assert plan.preempted_ids == ["low"]
    while "low" not in [r.request_id for r in s.running]:
        step(s)
    s.add_request(make_request("high2", 8, max_tokens=2, priority=0, arrival_s=50.0))
    plan, _ = step(s, 50.0)
    assert plan.preempted_ids == []
    run_until_idle(s)


def two_freed(retain_a: bool) -> tuple[BlockManager, int, int]:
    """Requests a then b computed one cached block each and were freed in that
    order (a as a preemption when `retain_a`); 3 of 5 blocks are free."""
    bm = BlockManager(num_blocks=5, block_size=2)
    a, b = Request("a", [1, 2, 3]), Request("b", [4, 5, 6])
    for r in (a, b):
        assert bm.allocate(r.request_id, [], 3)
        bm.cache_full_blocks(r, 2)
    a_head, b_head = bm.table("a")[0], bm.table("b")[0]
    bm.free("a", retain=retain_a)
    bm.free("b")
    return bm, a_head, b_head


def test_blocks_of_a_preempted_request_are_evicted_after_all_others():
    """b was freed after a (preempted, retained): b's cached block goes first."""
    bm, a_head, b_head = two_freed(retain_a=True)
    assert bm.retained == {a_head}
    assert bm.allocate("c", [], 8)  # 4 blocks: the 3 free ones, then one evicted
    assert b_head in bm.table("c") and a_head not in bm.table("c")
    assert bm.find_cached_prefix(Request("a2", [1, 2, 3])) == [a_head]
    # With only retained blocks left to evict, they are evicted too.
    assert bm.allocate("d", [], 1) and bm.table("d") == [a_head] and not bm.retained


def test_without_retention_the_least_recently_freed_goes_first():
    bm, a_head, _ = two_freed(retain_a=False)
    assert bm.allocate("c", [], 8) and a_head in bm.table("c")


def test_a_failed_pass_does_not_stand_over_a_request_preempted_in_its_step():
    """x is preempted in step 1 and skipped by that step's pass, which fails for y
    (7 fresh blocks). z's finish then frees blocks: fewer than y needs, but x needs
    only a block or two beside its cached ones. The failed pass must not stand
    on y's need: x is readmitted in step 2."""
    s = make_scheduler("priority", num_blocks=10, block_size=4, max_num_seqs=4)
    s.add_request(make_request("a", 16, max_tokens=20, priority=1, arrival_s=0.0))
    s.add_request(make_request("x", 16, max_tokens=20, priority=1, arrival_s=0.1))
    s.add_request(make_request("z", 4, max_tokens=2, priority=0, arrival_s=0.2))
    s.add_request(make_request("y", 28, max_tokens=2, priority=1, arrival_s=0.3))
    plan, _ = step(s, 0.0)
    assert sorted(plan.num_scheduled_tokens) == ["a", "x", "z"]
    plan, _ = step(s, 1.0)
    assert plan.preempted_ids == ["x"] and "z" in plan.finished_ids + list(plan.num_scheduled_tokens)
    assert "z" not in s.requests  # finished: its blocks are back
    plan, _ = step(s, 2.0)
    assert [d.request_id for d in plan.new_requests] == ["x"]
    assert plan.new_requests[0].num_computed_tokens >= 12  # its retained blocks, found again
