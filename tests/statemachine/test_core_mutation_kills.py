"""Tests written against mutants of the core that survived the fast suites
(`python -m cadence.spec.mutation`): each pins a behaviour no other test did."""

from __future__ import annotations

import pytest

from cadence.statemachine.blocks import NO_PARENT, block_keys_for
from cadence.statemachine.config import SchedulerConfig
from cadence.statemachine.policy import make_policy

from core_helpers import make_request, make_scheduler, step


def test_a_wide_token_key_is_parent_header_then_the_tokens_spelled_out():
    """The documented layout, parent hash in 8 bytes then one header byte, also
    when a token id does not fit in 32 bits."""
    wide = 2 ** 40
    key = block_keys_for([wide, 7], 2, None)[0]
    assert key[:8] == NO_PARENT.to_bytes(8, "little", signed=True)
    assert key[8] == 1  # the header: tokens spelled out, no salt
    assert key[9:] == repr((wide, 7)).encode()
    salted = block_keys_for([wide, 7], 2, "s")[0]
    assert salted[8] == 3 and salted.endswith(b"s")


BUILT_IN = ("fcfs", "priority", "strict-priority", "deadline", "fair", "weighted")


@pytest.mark.parametrize("name", BUILT_IN)
def test_removing_a_request_already_popped_changes_nothing(name):
    """A request the policy handed out is no longer its to remove: the count and
    the order of those still waiting are untouched."""
    policy = make_policy(SchedulerConfig(policy=name))
    a, b = make_request("a", 3, arrival_s=0.0), make_request("b", 3, arrival_s=1.0)
    policy.push(a)
    policy.push(b)
    first = policy.pop()
    policy.remove(first)
    assert len(policy) == 1
    assert policy.pop() is (b if first is a else a)
    assert len(policy) == 0 and policy.pop() is None


@pytest.mark.parametrize("name", BUILT_IN)
def test_a_policy_that_never_preempts_says_so_for_every_pair(name):
    """`preempts_running` False is a promise that `may_preempt` is never true
    between the requests queued so far (the scheduler skips the scan on it);
    the priority policies make no such promise once they have queued priorities
    a gap apart."""
    for wp, rp in ((0, 5), (5, 0), (1, 1)):
        policy = make_policy(SchedulerConfig(policy=name))
        waiting = make_request("w", 3, priority=wp, arrival_s=0.0)
        running = make_request("r", 3, priority=rp, arrival_s=9.0)
        policy.push(waiting)
        policy.push(running)
        if getattr(policy, "preempts_running", True):
            assert name in ("priority", "strict-priority") and wp != rp
            assert policy.may_preempt(waiting, running) is (wp < rp)
        else:
            assert not policy.may_preempt(waiting, running)
    assert make_policy(SchedulerConfig(policy=name)).preempts_running is False


def test_cached_blocks_that_already_hold_every_token_take_no_fresh_block():
    """`allocate` given more cached blocks than its tokens need shares them and takes
    no fresh block (the scheduler never asks this, the block manager still honours it)."""
    from cadence.statemachine.blocks import BlockManager

    manager = BlockManager(num_blocks=4, block_size=2)
    assert manager.allocate("a", [], num_tokens=4)
    shared = list(manager.tables["a"])
    assert manager.allocate("b", shared, num_tokens=2)
    assert manager.tables["b"] == shared
    assert manager.num_free_blocks == 2


def test_fair_keeps_no_entries_of_a_tenant_with_nothing_waiting():
    """Entries of requests removed or handed out are dropped lazily; once a
    tenant has nothing waiting, its queue is emptied when the policy next looks,
    so requests long gone (aborted ones included) are not held in memory."""
    policy = make_policy(SchedulerConfig(policy="fair"))
    a = make_request("a", 3, arrival_s=0.0, tenant="t")
    b = make_request("b", 3, arrival_s=1.0, tenant="t")
    policy.push(a)
    policy.push(b)
    policy.remove(b)
    assert policy.pop() is a
    assert policy.pop() is None
    assert policy.queues["t"] == []


def test_cached_blocks_a_staying_request_holds_do_not_block_a_displacement():
    """h shares s's two prompt blocks and needs one fresh block; the cache is full.
    Displacing l (lower priority, two blocks) makes room: the blocks h finds
    cached are held by s, which stays, so they cost h nothing either way."""
    shared = list(range(500, 508))  # two full blocks of four tokens
    s = make_scheduler("priority", num_blocks=5, max_num_batched_tokens=64)
    s.add_request(make_request("s", shared + [1], max_tokens=8, priority=0, arrival_s=0.0))
    s.add_request(make_request("l", 6, max_tokens=8, priority=5, arrival_s=0.0))
    step(s, now_s=0.0)
    assert s.blocks.num_free_blocks == 0
    s.add_request(make_request("h", shared + [2], max_tokens=8, priority=0, arrival_s=1.0))
    plan, _ = step(s, now_s=1.0)
    assert [d.request_id for d in plan.new_requests] == ["h"]
    assert plan.new_requests[0].num_computed_tokens == 8
    assert s.get_request("l").num_preemptions == 1
