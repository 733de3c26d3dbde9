"""Where DESIGN §5 promises to do better than vLLM, one test each.

Every test is built so that vLLM's behaviour (strict FCFS admission that stops
at the first request that does not fit, the most recent arrival as victim, no
admission in a step that preempted, per-chunk block allocation, accepting
requests that can never fit) would make it fail.
"""

from __future__ import annotations

import pytest

from cadence.statemachine.errors import RequestTooLongError
from cadence.statemachine.fsm import RequestEventKind, RequestState
from cadence.statemachine.policy import FcfsPolicy, PriorityPolicy
from cadence.statemachine.config import SchedulerConfig

from core_helpers import (
    admissions, first_admissions, make_request, make_scheduler, run_until_idle, step,
)

E = RequestEventKind


def test_a_no_head_of_line_blocking():
    """(a) A big waiting request that does not fit is skipped for a smaller one that does."""
    s = make_scheduler(num_blocks=8, block_size=4)
    s.add_request(make_request("running", 20, max_tokens=8, arrival_s=0.0))
    step(s)  # holds 5 of 8 blocks
    s.add_request(make_request("big", 16, max_tokens=4, arrival_s=1.0))  # needs 4 blocks
    s.add_request(make_request("small", 4, max_tokens=4, arrival_s=2.0))  # needs 1
    plan, events = step(s)
    assert admissions(events) == ["small"]
    assert s.get_request("big").state is RequestState.PENDING
    assert s.get_request("big").num_skips == 1


def test_b_bounded_skipping_reserves_capacity_for_the_starved_request():
    """(b) After starvation_skip_limit passes the big request holds capacity: nothing
    behind it is admitted, even what fits, and it is admitted as soon as it fits."""
    s = make_scheduler(num_blocks=8, block_size=4, starvation_skip_limit=2)
    s.add_request(make_request("running", 20, max_tokens=6, arrival_s=0.0))
    step(s)
    s.add_request(make_request("big", 16, max_tokens=4, arrival_s=1.0))
    all_events = []
    for i in range(1, 3):  # two small requests overtake it
        s.add_request(make_request(f"small{i}", 3, max_tokens=1, arrival_s=1.0 + i))
        _, events = step(s)
        assert admissions(events) == [f"small{i}"]
        all_events += events
    assert s.get_request("big").num_skips == 2
    s.add_request(make_request("small3", 3, max_tokens=1, arrival_s=4.0))
    num_held_steps = 0
    while "big" not in admissions(events):
        assert s.blocks.num_free_blocks >= 1, "small3 would fit"
        plan, events = step(s)
        admitted = admissions(events)
        assert "small3" not in admitted or admitted.index("small3") > admitted.index("big"), \
            "admitted ahead of the starved request"
        num_held_steps += 1
        all_events += events
    assert num_held_steps > 1  # capacity was held for at least one step
    _, events = run_until_idle(s)
    assert first_admissions(all_events + events)[-2:] == ["big", "small3"]


def test_b_aborting_the_starved_request_releases_what_it_held():
    """Once the request holding capacity is aborted, the next one that fits is
    admitted at the next step."""
    s = make_scheduler(num_blocks=12, block_size=4, starvation_skip_limit=0)
    s.add_request(make_request("running", 28, max_tokens=16, arrival_s=0.0))
    step(s)
    s.add_request(make_request("big", 20, max_tokens=4, arrival_s=1.0))   # 5 blocks, 4 free
    s.add_request(make_request("small", 3, max_tokens=1, arrival_s=2.0))  # 1 block
    _, events = step(s)
    assert admissions(events) == []  # big holds capacity at once (limit 0)
    s.abort_request("big")
    _, events = step(s)
    assert admissions(events) == ["small"]


def test_c_victim_is_lowest_priority_with_least_computed_work():
    """(c) When a running request cannot grow, the victim is the lowest-priority
    request that loses the least work, not the most recent arrival."""
    s = make_scheduler("priority", num_blocks=6, block_size=4)
    s.add_request(make_request("a", 8, max_tokens=4, priority=0, arrival_s=0.0))   # 2 blocks, grows next
    s.add_request(make_request("d", 1, max_tokens=4, priority=0, arrival_s=1.0))   # least work, high prio
    s.add_request(make_request("b", 2, max_tokens=4, priority=1, arrival_s=2.0))   # low prio, less work
    s.add_request(make_request("c", 5, max_tokens=4, priority=1, arrival_s=3.0))   # low prio, newest
    step(s)
    assert s.blocks.num_free_blocks == 0
    plan, events = step(s)
    assert plan.preempted_ids == ["b"]
    assert [e.request_id for e in events if e.transition is E.PREEMPT] == ["b"]
    assert {"a", "c", "d"} <= set(plan.num_scheduled_tokens)


def test_c_victim_choice_of_each_policy():
    """(c) The policies' victim functions directly: least work among the lowest
    priority (priority), least work regardless of arrival (fcfs)."""
    def running(rid, priority, computed, arrival):
        """A request as if running with `computed` tokens done."""
        r = make_request(rid, 8, priority=priority, arrival_s=arrival)
        r.num_computed_tokens = computed
        return r
    reqs = [running("old-light", 1, 2, 0.0), running("new-heavy", 1, 7, 5.0), running("vip", 0, 1, 9.0)]
    assert PriorityPolicy(SchedulerConfig()).victim(reqs).request_id == "old-light"
    assert FcfsPolicy(SchedulerConfig()).victim(reqs).request_id == "vip"
    no_prio = PriorityPolicy(SchedulerConfig(enable_priority_scheduling=False))
    assert no_prio.victim(reqs).request_id == "vip"


def test_d_higher_priority_waiting_request_preempts_when_blocks_run_out():
    """(d) A strictly higher-priority arrival preempts a lower-priority running
    request holding the blocks it needs, and runs in that same step."""
    s = make_scheduler("priority", num_blocks=6, block_size=4)
    s.add_request(make_request("low", 16, max_tokens=8, priority=2))
    step(s)  # low holds 5 of 6 blocks
    s.add_request(make_request("high", 8, max_tokens=2, priority=0, arrival_s=1.0))
    plan, events = step(s)
    assert plan.preempted_ids == ["low"]
    assert "high" in plan.num_scheduled_tokens
    assert s.get_request("low").state is RequestState.PENDING


def test_d_equal_priority_never_preempts():
    """(d) Only a strictly higher priority preempts; equals wait their turn."""
    s = make_scheduler("priority", num_blocks=6, block_size=4)
    s.add_request(make_request("first", 16, max_tokens=8, priority=1))
    step(s)
    s.add_request(make_request("second", 8, max_tokens=2, priority=1, arrival_s=1.0))
    plan, _ = step(s)
    assert plan.preempted_ids == [] and "second" not in plan.num_scheduled_tokens


@pytest.mark.parametrize("policy", ["fcfs", "fair", "deadline", "weighted"])
def test_d_only_the_priority_policy_preempts_for_priority(policy):
    """(d) Other policies never preempt a running request for a waiting one."""
    s = make_scheduler(policy, num_blocks=6, block_size=4)
    s.add_request(make_request("low", 16, max_tokens=8, priority=2))
    step(s)
    s.add_request(make_request("high", 8, max_tokens=2, priority=0, arrival_s=1.0))
    plan, _ = step(s)
    assert plan.preempted_ids == []


def test_d_higher_priority_waiting_request_preempts_when_all_seats_are_taken():
    """(d) With max_num_seqs running requests of lower priority, a strictly
    higher-priority arrival preempts one of them in the next step."""
    s = make_scheduler("priority", max_num_seqs=2)
    s.add_request(make_request("low1", 3, max_tokens=20, priority=5))
    s.add_request(make_request("low2", 3, max_tokens=20, priority=5))
    step(s)
    s.add_request(make_request("high", 3, max_tokens=2, priority=0, arrival_s=1.0))
    plan, events = step(s)
    assert len(plan.preempted_ids) == 1
    assert "high" in admissions(events)


def test_d_preemption_counts_the_reserve_left_after_the_victims_are_gone():
    """A lone lower-priority request is preempted when the higher-priority one fits
    the cache without it, whatever growth headroom the victim itself caused."""
    s = make_scheduler("priority", num_blocks=8, block_size=4, admission_headroom_steps=8)
    s.add_request(make_request("low", 20, max_tokens=8, priority=2))
    step(s)
    s.add_request(make_request("high", 28, max_tokens=4, priority=0, arrival_s=1.0))  # 7 of 8 blocks
    plan, _ = step(s)
    assert plan.preempted_ids == ["low"] and "high" in plan.num_scheduled_tokens


def test_e_admission_reserves_the_whole_prompt():
    """(e) A long prompt admitted chunk by chunk holds blocks for its whole prompt
    from the first chunk, so no later arrival can take them and it is never
    preempted mid-prefill."""
    s = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=16,
                       long_prefill_token_threshold=4)
    s.add_request(make_request("long", 16, max_tokens=2))
    plan, _ = step(s)
    assert plan.num_scheduled_tokens == {"long": 4}
    assert len(plan.new_requests[0].block_ids) == 4
    s.add_request(make_request("later", 12, max_tokens=2, arrival_s=1.0))  # 3 blocks; 2 are free
    for _ in range(3):
        plan, events = step(s)
        assert plan.num_scheduled_tokens.get("long") == 4
        assert "long" not in plan.new_block_ids and not plan.preempted_ids
        assert "later" not in admissions(events)
    assert s.get_request("long").num_computed_tokens == 16
    run_until_idle(s)
    assert s.stats().num_preemptions == 0


def test_f_capacity_freed_by_priority_preemption_is_used_in_the_same_step():
    """(f) The step that preempts also admits: the plan holds both."""
    s = make_scheduler("priority", num_blocks=6, block_size=4)
    s.add_request(make_request("low", 16, max_tokens=8, priority=2))
    step(s)
    s.add_request(make_request("high", 8, max_tokens=2, priority=0, arrival_s=1.0))
    plan, _ = step(s)
    assert plan.preempted_ids == ["low"]
    assert [d.request_id for d in plan.new_requests] == ["high"]


def test_f_capacity_freed_by_growth_preemption_admits_a_waiting_request_in_the_same_step():
    """(f) A victim preempted so a running request can grow frees blocks that a
    waiting request gets in the same step (the victim itself waits a step)."""
    s = make_scheduler(num_blocks=4, block_size=4)
    s.add_request(make_request("heavy", 8, max_tokens=4, arrival_s=0.0))
    s.add_request(make_request("light", 5, max_tokens=4, arrival_s=1.0))
    step(s)
    assert s.blocks.num_free_blocks == 0
    s.add_request(make_request("waiting", 2, max_tokens=1, arrival_s=2.0))
    plan, events = step(s)
    assert plan.preempted_ids == ["light"]
    assert [d.request_id for d in plan.new_requests] == ["waiting"]
    assert "heavy" in plan.new_block_ids


def test_g_a_request_that_can_never_fit_is_rejected_at_once():
    """(g) A request larger than the whole KV cache is refused by add_request, so
    it can never sit in the queue forever."""
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(RequestTooLongError):
        s.add_request(make_request("never", 10, max_tokens=10))
    assert not s.has_work()
    s.add_request(make_request("exactly", 10, max_tokens=6))  # 16 tokens: the whole cache
    _, events = run_until_idle(s, 50)
    assert [e.request_id for e in events if e.finish_reason] == ["exactly"]


def test_h_recompute_tax_is_counted():
    """(h) A preemption counts the victim's computed tokens as recompute tax, and
    the resumed request is sent in full, generated tokens included."""
    s = make_scheduler("priority", num_blocks=6, block_size=4, enable_prefix_caching=False)
    s.add_request(make_request("low", 16, max_tokens=8, priority=2))
    step(s)
    step(s)  # low: 16 prompt tokens + 1 decode computed, 2 tokens generated
    computed = s.get_request("low").num_computed_tokens
    assert computed == 17
    s.add_request(make_request("high", 8, max_tokens=2, priority=0, arrival_s=1.0))
    plan, _ = step(s)
    assert plan.preempted_ids == ["low"]
    stats = s.stats()
    assert stats.num_preemptions == 1 and stats.num_recompute_tokens == computed
    plans, _ = run_until_idle(s)
    resumed = [d for p in plans for d in p.new_requests if d.request_id == "low"]
    assert resumed[0].resumed and len(resumed[0].token_ids) == 18
    assert any("low" in p.resumed_ids for p in plans)


COLD_START = [(12, 12), (16, 15), (23, 36), (23, 32), (14, 14), (23, 9), (20, 35), (8, 36),
              (16, 22), (11, 28), (8, 9), (8, 8)]  # (prompt, max_tokens), all arriving at once


def _cold_start(headroom_steps: int):
    s = make_scheduler(num_blocks=64, block_size=4, admission_headroom_steps=headroom_steps,
                       admission_growth_share=1.0, max_num_seqs=16)
    for i, (prompt, max_tokens) in enumerate(COLD_START):
        s.add_request(make_request(f"r{i}", prompt, max_tokens=max_tokens, arrival_s=float(i)))
    plans, _ = run_until_idle(s)
    return s.stats(), len(plans)


def test_i_a_cold_start_is_not_admitted_into_certain_preemptions():
    """(i) Twelve requests arrive at once; at their ends they would need far more
    than the 64 blocks. Admitting every prompt that fits (vLLM) fills the cache
    with growth nobody can pay for, and preempts. The projected admission leaves
    that growth free: nothing is preempted or recomputed, in no more steps."""
    projected, projected_steps = _cold_start(128)
    assert projected.num_requests_completed == len(COLD_START)
    assert projected.num_preemptions == 0 and projected.num_recompute_tokens == 0
    flat, flat_steps = _cold_start(0)
    assert flat.num_preemptions > 0, "without the projection the same arrivals preempt"
    assert projected_steps <= flat_steps
