"""The two rules by which the core can plan as vLLM's scheduler does: whom `fcfs`
preempts (`fcfs_victim`) and whether a step that preempted admits (`admit_after_preemption`).

Three requests fill a pool of five blocks of 4: a (7 tokens, 2 blocks), b (2, 1 block)
and c (6, 2 blocks), admitted in that order. After one decoded token each, a's
ninth token needs a third block and none is free, so one of them is preempted."""

from __future__ import annotations

import pytest

from core_helpers import make_request, make_scheduler, step


def fill(**config):
    s = make_scheduler(num_blocks=5, block_size=4, enable_prefix_caching=False, **config)
    for rid, n in (("a", 7), ("b", 2), ("c", 6)):
        s.add_request(make_request(rid, n, max_tokens=8, ignore_eos=True))
    plan, _ = step(s)
    assert list(plan.num_scheduled_tokens) == ["a", "b", "c"]
    plan, _ = step(s)  # one decoded token each: a holds 8 tokens in its 2 blocks
    assert not plan.preempted_ids and s.blocks.num_free_blocks == 0
    return s


@pytest.mark.parametrize(("victim", "expected"), [("least_work", "b"), ("latest_admitted", "c")])
def test_fcfs_victim_names_whom_a_growing_request_displaces(victim, expected):
    """least_work: b, which has computed the fewest tokens (3, against a's 8 and c's 7);
    latest_admitted: c, the last one admitted (vLLM's choice). a grows either way."""
    s = fill(fcfs_victim=victim)
    plan, _ = step(s)
    assert plan.preempted_ids == [expected]
    assert plan.num_scheduled_tokens["a"] == 1 and expected not in plan.num_scheduled_tokens


@pytest.mark.parametrize("admit", [True, False])
def test_a_step_that_preempted_admits_only_if_told_to(admit):
    """c's two blocks come back as a takes one: the one left holds d (2 tokens), which
    joins in that step unless `admit_after_preemption` is off (the same step, the same
    room: only the rule differs)."""
    s = fill(fcfs_victim="latest_admitted", admit_after_preemption=admit)
    s.add_request(make_request("d", 2, max_tokens=1, ignore_eos=True))
    plan, _ = step(s)
    assert plan.preempted_ids == ["c"]
    assert ("d" in plan.num_scheduled_tokens) is admit
    assert "c" not in plan.num_scheduled_tokens  # never readmitted in the step that preempted it
