"""The waiting order of each policy, through the real Scheduler.

Most tests give the scheduler one seat (max_num_seqs=1) and requests that finish
in the step they are admitted (max_tokens=1), so the order of admissions is
exactly the policy's order.
"""

from __future__ import annotations

import pytest

from cadence.statemachine.config import SchedulerConfig
from cadence.statemachine.fsm import FinishReason, RequestEventKind, RequestState
from cadence.statemachine.policy import POLICIES, FairPolicy, SchedulingPolicy, make_policy
from cadence.statemachine.request import Request

from core_helpers import (
    admissions, completions, first_admissions, make_request, make_scheduler, run_until_idle, step,
)

E = RequestEventKind


def order_of(policy: str, requests: list[dict], now_s: float = 100.0, **config) -> list[str]:
    """Add `requests` (keyword dicts for make_request, with 'rid' and 'prompt'), then
    run one request per step and return the admission order."""
    s = make_scheduler(policy, max_num_seqs=1, **config)
    for spec in requests:
        spec = dict(spec)
        s.add_request(make_request(spec.pop("rid"), spec.pop("prompt", 2), max_tokens=1, **spec))
    _, events = run_until_idle(s, start_s=now_s)
    return first_admissions(events)


def test_every_builtin_policy_implements_the_protocol():
    """make_policy builds each named policy and each satisfies SchedulingPolicy."""
    for name in POLICIES:
        policy = make_policy(SchedulerConfig(policy=name))
        assert isinstance(policy, SchedulingPolicy) and policy.name == name


def test_fcfs_orders_by_arrival_not_by_call_order():
    """fcfs admits by arrival time, whatever order add_request was called in."""
    reqs = [dict(rid="c", arrival_s=2.0), dict(rid="a", arrival_s=0.0), dict(rid="b", arrival_s=1.0)]
    assert order_of("fcfs", reqs) == ["a", "b", "c"]


def test_fcfs_ignores_priority_and_tenant():
    """fcfs looks at nothing but arrival."""
    reqs = [dict(rid="a", arrival_s=0.0, priority=5, tenant="x"), dict(rid="b", arrival_s=1.0, priority=0)]
    assert order_of("fcfs", reqs) == ["a", "b"]


def test_priority_orders_lower_value_first():
    """Without much waiting, priority order wins over arrival order."""
    reqs = [dict(rid="low", priority=2, arrival_s=0.0), dict(rid="mid", priority=1, arrival_s=0.5),
            dict(rid="high", priority=0, arrival_s=1.0)]
    assert order_of("priority", reqs, aging_steps=16) == ["high", "mid", "low"]


def queued(rid: str, priority: int, arrival_step: int, seq: int) -> Request:
    """A request as the scheduler stamps it on arrival at `arrival_step`."""
    r = make_request(rid, 2, max_tokens=1, priority=priority)
    r.arrival_step, r.arrival_seq = arrival_step, seq
    return r


def test_priority_aging_lets_an_old_low_priority_request_overtake():
    """A low-priority request that has waited more than aging_steps per level
    goes before a newer high-priority one."""
    policy = make_policy(SchedulerConfig(policy="priority", aging_steps=10))
    for r in (queued("old-low", 2, 0, 1),      # key 2 * 10 + 0 = 20
              queued("mid-high", 0, 15, 2),    # key 15
              queued("new-high", 0, 25, 3)):   # key 25
        policy.push(r)
    assert [policy.pop().request_id for _ in range(3)] == ["mid-high", "old-low", "new-high"]


def test_priority_ages_in_steps_whatever_the_clock_reads():
    """The order depends on the steps a request arrived at, not on arrival_s:
    the same arrivals stamped a thousand times further apart in seconds keep it."""
    orders = []
    for scale in (0.001, 1.0, 1000.0):
        policy = make_policy(SchedulerConfig(policy="priority", aging_steps=10))
        for r in (queued("old-low", 2, 0, 1), queued("new-high", 0, 25, 2)):
            r.arrival_s = r.arrival_step * scale
            policy.push(r)
        orders.append([policy.pop().request_id for _ in range(2)])
    assert orders == [["old-low", "new-high"]] * 3


def test_strict_priority_never_ages():
    """strict-priority keeps the old low-priority request last, however long it waited."""
    reqs = [dict(rid="old-low", priority=2, arrival_s=0.0), dict(rid="new-high", priority=0, arrival_s=1e6),
            dict(rid="mid", priority=1, arrival_s=5e5)]
    assert order_of("strict-priority", reqs, aging_steps=10) == ["new-high", "mid", "old-low"]


@pytest.mark.parametrize("policy", ["priority", "strict-priority", "weighted"])
def test_priorities_are_ignored_when_priority_scheduling_is_off(policy):
    """enable_priority_scheduling=False makes every policy order by arrival."""
    reqs = [dict(rid="a", priority=3, arrival_s=0.0), dict(rid="b", priority=0, arrival_s=1.0)]
    assert order_of(policy, reqs, enable_priority_scheduling=False) == ["a", "b"]


def test_deadline_is_earliest_deadline_first():
    """deadline admits the earliest deadline first, whatever the arrival order."""
    reqs = [dict(rid="d30", deadline_s=30.0, arrival_s=0.0), dict(rid="d10", deadline_s=10.0, arrival_s=1.0),
            dict(rid="d20", deadline_s=20.0, arrival_s=2.0)]
    assert order_of("deadline", reqs, now_s=3.0) == ["d10", "d20", "d30"]


def test_deadline_default_is_arrival_plus_default_deadline_s():
    """A request without a deadline is due at arrival + default_deadline_s."""
    reqs = [dict(rid="explicit", deadline_s=10.0, arrival_s=0.0),
            dict(rid="default", arrival_s=2.0)]  # due at 2 + 5 = 7
    assert order_of("deadline", reqs, now_s=3.0, default_deadline_s=5.0) == ["default", "explicit"]
    assert order_of("deadline", reqs, now_s=3.0, default_deadline_s=9.0) == ["explicit", "default"]


def test_deadline_reject_late_rejects_waiting_requests_past_their_deadline():
    """With reject_late a waiting request whose deadline has passed completes as
    rejected, exactly once, and takes no capacity."""
    s = make_scheduler("deadline", reject_late=True)
    s.add_request(make_request("late", 4, deadline_s=5.0))
    s.add_request(make_request("ok", 4, max_tokens=1, deadline_s=50.0))
    plan, events = step(s, now_s=6.0)
    assert completions(events) == {"late": FinishReason.REJECTED, "ok": FinishReason.LENGTH}
    assert "late" not in plan.num_scheduled_tokens
    rejected = [e for e in events if e.transition is E.REJECT]
    assert len(rejected) == 1 and "deadline" in rejected[0].detail
    assert s.stats().completed_by_reason == {"rejected": 1, "length": 1}


def test_deadline_without_reject_late_keeps_late_requests():
    """Late requests keep their place (no starvation) unless reject_late is on."""
    s = make_scheduler("deadline")
    s.add_request(make_request("late", 4, max_tokens=1, deadline_s=5.0))
    _, events = step(s, now_s=6.0)
    assert completions(events) == {"late": FinishReason.LENGTH}


def test_reject_late_applies_only_to_the_deadline_policy():
    """Other policies have no deadlines to miss."""
    s = make_scheduler("fcfs", reject_late=True)
    s.add_request(make_request("a", 4, max_tokens=1, deadline_s=1.0))
    _, events = step(s, now_s=10.0)
    assert completions(events) == {"a": FinishReason.LENGTH}


def test_reject_late_happens_even_while_admission_is_blocked():
    """A late request is rejected at the first step after its deadline, even when
    nothing can be admitted."""
    s = make_scheduler("deadline", num_blocks=12, block_size=4, reject_late=True)
    s.add_request(make_request("running", 28, max_tokens=16, arrival_s=0.0))
    step(s, now_s=0.0)
    s.add_request(make_request("late", 20, max_tokens=4, arrival_s=0.0, deadline_s=5.0))  # does not fit
    step(s, now_s=1.0)
    _, events = step(s, now_s=6.0)
    assert completions(events) == {"late": FinishReason.REJECTED}


def test_fair_heavy_tenant_cannot_starve_a_light_one():
    """A tenant with a long backlog does not keep a later, light tenant waiting
    behind all of it (fcfs would)."""
    reqs = [dict(rid=f"heavy{i}", tenant="heavy", prompt=8, arrival_s=i * 0.01) for i in range(8)]
    reqs.append(dict(rid="light", tenant="light", prompt=8, arrival_s=1.0))
    fair = order_of("fair", reqs)
    assert fair.index("light") <= 1
    assert order_of("fcfs", reqs).index("light") == 8
    assert [r for r in fair if r != "light"] == [f"heavy{i}" for i in range(8)]  # FCFS within a tenant


def test_fair_alternates_between_equally_loaded_tenants():
    """Two tenants with equal requests take turns."""
    reqs = [dict(rid=f"{t}{i}", tenant=t, prompt=4, arrival_s=i + (0.5 if t == "b" else 0.0))
            for i in range(3) for t in "ab"]
    order = order_of("fair", reqs)
    assert [r[0] for r in order] == ["a", "b", "a", "b", "a", "b"]


def test_fair_counters_charge_prompt_and_output_tokens_by_weight():
    """A tenant is charged fair_input_weight per prompt token and
    fair_output_weight per generated token."""
    for input_weight in (1.0, 0.5):  # a fractional weight: a product, not a quotient
        s = make_scheduler("fair", fair_input_weight=input_weight, fair_output_weight=3.0)
        s.add_request(make_request("x", 5, max_tokens=2, tenant="t"))
        run_until_idle(s)
        assert s.policy.counters["t"] == 5 * input_weight + 2 * 3.0


def test_fair_counter_is_lifted_on_reactivation():
    """A tenant that comes back after idling starts at the smallest counter of the
    active tenants, so idle time banks no credit."""
    config = SchedulerConfig(policy="fair")
    policy = FairPolicy(config)
    busy = make_request("busy", 4, tenant="busy")
    policy.push(busy)
    policy.on_tokens(busy, 50)  # busy's counter: 100
    idle = make_request("idle", 4, tenant="idle")
    policy.push(idle)
    assert policy.counters["idle"] == policy.counters["busy"] == 100.0
    # An already active tenant is not lifted again, and a tenant above the floor keeps its counter.
    policy.on_tokens(busy, 10)
    policy.push(make_request("idle2", 4, tenant="idle"))
    assert policy.counters["idle"] == 100.0
    policy.counters["idle"] = 500.0
    assert policy.pop().request_id == "busy"


def test_fair_lifted_tenant_does_not_jump_the_queue():
    """A tenant new to the scheduler starts level with the active tenants, not
    with a head start worth everything they were served."""
    s = make_scheduler("fair", max_num_seqs=1)
    for i in range(3):
        s.add_request(make_request(f"busy{i}", 4, max_tokens=4, tenant="busy", arrival_s=float(i)))
    run_until_idle(s)
    s.add_request(make_request("busy-next", 4, max_tokens=4, tenant="busy", arrival_s=10.0))
    s.add_request(make_request("idle-next", 4, max_tokens=4, tenant="idle", arrival_s=11.0))
    assert s.policy.counters["busy"] > 0.0
    assert s.policy.counters["idle"] == s.policy.counters["busy"]


def test_fair_a_tenant_that_never_stopped_waiting_keeps_its_credit():
    """A tenant whose request did not fit keeps its low counter: lifting is for
    tenants coming back from idle, not for ones passed over."""
    s = make_scheduler("fair", num_blocks=8, block_size=4, max_num_seqs=2)
    s.add_request(make_request("runner", 20, max_tokens=10, tenant="B", arrival_s=0.0))
    step(s)  # B is charged for 20 prompt tokens and one output token; runner holds 5 blocks
    s.add_request(make_request("A-big", 16, max_tokens=2, tenant="A", arrival_s=1.0))  # 4 blocks: no fit
    for i in range(3):
        s.add_request(make_request(f"B{i}", 2, max_tokens=1, tenant="B", arrival_s=2.0 + i))
    assert s.policy.counters["A"] == 0.0
    _, events = step(s)
    assert admissions(events) == ["B0"] and s.get_request("A-big").state is RequestState.PENDING
    assert s.policy.counters["A"] == 0.0


def test_fair_victim_loses_the_least_work_then_takes_the_most_served_tenant():
    """fair preempts the running request with the least computed work, whatever
    its tenant's counter (the counter does not move with a preemption, so the
    served tenant pays nothing for the recompute); among equal work, the most
    served tenant's request, then the latest arrival."""
    policy = FairPolicy(SchedulerConfig(policy="fair"))
    policy.counters.update({"served": 1000.0, "light": 10.0})

    def running(rid: str, tenant: str, computed: int, arrival_s: float) -> Request:
        r = make_request(rid, 64, tenant=tenant, arrival_s=arrival_s)
        r.num_computed_tokens = computed
        return r

    long_served = running("long-served", "served", 500, 0.0)
    short_light = running("short-light", "light", 20, 1.0)
    assert policy.victim([long_served, short_light]) is short_light
    equal_served = running("equal-served", "served", 20, 0.0)
    assert policy.victim([short_light, equal_served, long_served]) is equal_served
    later_light = running("later-light", "light", 20, 2.0)
    assert policy.victim([short_light, later_light]) is later_light


def test_fair_growth_preemption_takes_the_request_with_least_work_from_any_tenant():
    """Through the scheduler: when a running request cannot grow, fair takes the
    least-work request as its victim, here the one of the least served tenant."""
    s = make_scheduler("fair", num_blocks=8, block_size=4, max_num_seqs=3,
                       admission_headroom_steps=0, admission_watermark=0.0)
    s.add_request(make_request("heavy", 16, max_tokens=12, tenant="served", arrival_s=0.0))
    step(s)  # heavy: 16 prompt tokens in 4 blocks, its tenant charged for them
    s.add_request(make_request("light", 4, max_tokens=12, tenant="light", arrival_s=1.0))
    step(s)
    assert s.policy.counters["served"] > s.policy.counters["light"]
    preempted = []
    for _ in range(12):
        plan, _ = step(s)
        preempted += plan.preempted_ids
        if preempted:
            break
    assert preempted == ["light"]
    assert s.get_request("heavy").state is RequestState.RUNNING


def test_weighted_score_ranks_priority_age_and_prompt_length():
    """weighted ranks by priority_weight * priority + latency_weight * arrival +
    throughput_weight * prompt tokens, lowest first."""
    reqs = [dict(rid="long-early", prompt=30, arrival_s=0.0, priority=0),
            dict(rid="short-late", prompt=2, arrival_s=5.0, priority=0),
            dict(rid="mid-vip", prompt=10, arrival_s=9.0, priority=-2)]
    # Shortest job first: only the prompt length counts.
    assert order_of("weighted", reqs, priority_weight=0.0, latency_weight=0.0,
                    throughput_weight=1.0) == ["short-late", "mid-vip", "long-early"]
    # Age only.
    assert order_of("weighted", reqs, priority_weight=0.0, latency_weight=1.0,
                    throughput_weight=0.0) == ["long-early", "short-late", "mid-vip"]
    # Scores: long-early 0+0+30=30, short-late 0+5+2=7, mid-vip -20+9+10=-1.
    assert order_of("weighted", reqs, priority_weight=10.0, latency_weight=1.0,
                    throughput_weight=1.0) == ["mid-vip", "short-late", "long-early"]


@pytest.mark.parametrize("policy", ["fcfs", "fair", "priority"])
def test_a_preempted_request_keeps_its_place_by_arrival(policy):
    """A preempted request goes back ahead of later arrivals of its class."""
    s = make_scheduler(policy, num_blocks=4, block_size=4, max_num_seqs=3)
    s.add_request(make_request("first", 8, max_tokens=6, tenant="t", arrival_s=0.0))
    s.add_request(make_request("second", 5, max_tokens=6, tenant="t", arrival_s=1.0))
    step(s)
    s.add_request(make_request("third", 8, max_tokens=1, tenant="t", arrival_s=2.0))  # 2 blocks
    plan, _ = step(s)
    assert plan.preempted_ids == ["second"]
    assert [r.request_id for r in s.policy.ordered()] == ["second", "third"]
    _, events = run_until_idle(s)
    assert first_admissions(events) == ["second", "third"]
