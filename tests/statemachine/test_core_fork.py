"""Request groups (`n` > 1): one prompt computed once, its full blocks shared by
reference count, each member scheduled, preempted and finished on its own."""

from __future__ import annotations

import zlib

import pytest

from cadence.statemachine.errors import (
    DuplicateRequestError, InvalidRequestError, QueueFullError, RequestTooLongError,
)
from cadence.statemachine.fsm import FinishReason, RequestEventKind, RequestState
from cadence.statemachine.invariants import (
    group_prompt_computed_once, groups_share_prompt_blocks, violations,
)
from cadence.statemachine.scheduler import Scheduler

from core_helpers import EOS, FILLER, completions, make_request, make_scheduler, run_until_idle, step

E = RequestEventKind
BLOCK = 4
PROMPT = [FILLER + 1 + i % 5 for i in range(30)]  # 7 full blocks and a 2-token tail
SHARED = (len(PROMPT) - 1) // BLOCK * BLOCK


def group(n: int, prompt=PROMPT, max_tokens: int = 4, prefix: str = "g", **kwargs):
    """`n` requests with one prompt, ids g0.. (end-of-sequence ignored unless asked)."""
    kwargs.setdefault("ignore_eos", True)
    return [make_request(f"{prefix}{i}", prompt, max_tokens=max_tokens, **kwargs) for i in range(n)]


def token_of(s: Scheduler):
    """A fabricated executor: the sampled token depends on the request id and its
    position only, like a seeded sampler, so runs can be compared."""
    def pick(rid: str) -> int:
        return 200 + zlib.crc32(f"{rid}:{s.requests[rid].num_tokens}".encode()) % 50
    return pick


def outputs(requests) -> dict[str, list[int]]:
    return {r.request_id: list(r.output_token_ids) for r in requests}


def assert_nothing_held(s: Scheduler) -> None:
    assert not s.blocks.tables and all(c == 0 for c in s.blocks.ref_counts)
    assert s.blocks.num_free_blocks == s.blocks.num_blocks
    assert violations(s) == []


@pytest.mark.parametrize("caching", [False, True])
def test_four_samples_compute_the_prompt_once_and_three_tails(caching):
    s = make_scheduler(enable_prefix_caching=caching, block_size=BLOCK, max_num_batched_tokens=16)
    members = group(4, max_tokens=5)
    g = s.add_group(members)
    assert g is not None and g.num_shared_tokens == SHARED == 28 and g.members == members
    plans, events = run_until_idle(s, token=token_of(s))
    stats = s.stats()
    tail = len(PROMPT) - SHARED
    decodes = 4 * (5 - 1)  # the first token of each comes from its prefill
    assert stats.num_scheduled_tokens == len(PROMPT) + 3 * tail + decodes
    assert stats.num_shared_prompt_tokens == 3 * SHARED
    assert stats.num_prefix_hit_tokens == 0  # shared by the fork, not found in the cache
    assert completions(events) == {r.request_id: FinishReason.LENGTH for r in members}
    # The followers start from the leader's blocks, computed, and add a block of their own.
    leader_blocks = next(d.block_ids for p in plans for d in p.new_requests if d.request_id == "g0")
    followers = [d for p in plans for d in p.new_requests if d.request_id != "g0"]
    assert len(followers) == 3
    for d in followers:
        assert d.num_computed_tokens == SHARED and d.block_ids[:SHARED // BLOCK] == leader_blocks[:SHARED // BLOCK]
        assert d.block_ids[SHARED // BLOCK] not in leader_blocks
    assert_nothing_held(s)


def test_followers_wait_for_the_leader_and_hold_its_blocks_by_reference():
    s = make_scheduler(enable_prefix_caching=False, block_size=BLOCK, max_num_batched_tokens=16)
    s.add_group(group(4))
    plan, _ = step(s)
    assert plan.num_scheduled_tokens == {"g0": 16}  # the followers wait: the budget is not the reason
    plan, _ = step(s)
    assert plan.num_scheduled_tokens == {"g0": 14}
    plan, _ = step(s)
    assert plan.num_scheduled_tokens == {"g0": 1, "g1": 2, "g2": 2, "g3": 2}
    tables = s.blocks.tables
    for b in tables["g0"][:SHARED // BLOCK]:
        assert s.blocks.ref_counts[b] == 4
    assert s.blocks.ref_counts[tables["g0"][-1]] == 1
    assert groups_share_prompt_blocks(s) == []


def test_members_finish_on_their_own():
    s = make_scheduler(enable_prefix_caching=False, block_size=BLOCK)
    members = group(3, max_tokens=6, ignore_eos=False)
    s.add_group(members)
    stop_at = {"g0": 2, "g1": 7, "g2": 4}  # g1 never samples EOS: it ends at max_tokens

    def pick(rid):
        return EOS if s.requests[rid].num_output_tokens + 1 == stop_at[rid] else FILLER

    _, events = run_until_idle(s, token=pick)
    assert completions(events) == {"g0": FinishReason.STOP, "g1": FinishReason.LENGTH,
                                   "g2": FinishReason.STOP}
    assert {r.request_id: r.num_output_tokens for r in members} == {"g0": 2, "g1": 6, "g2": 4}
    assert_nothing_held(s)


def test_aborting_one_member_keeps_the_others_blocks_and_outputs():
    def run(abort: bool):
        s = make_scheduler(enable_prefix_caching=False, block_size=BLOCK)
        members = group(4, max_tokens=6)
        s.add_group(members)
        pick = token_of(s)
        for _ in range(4):
            step(s, token=pick)
        if abort:
            held_by_g0 = list(s.blocks.tables["g0"])
            s.abort_request("g0")
            shared = held_by_g0[:SHARED // BLOCK]
            # Its own last block is free again; the shared ones stay, one reference fewer.
            assert all(s.blocks.ref_counts[b] == 3 for b in shared)
            assert s.blocks.ref_counts[held_by_g0[-1]] == 0 and held_by_g0[-1] in s.blocks.free_ids
            assert groups_share_prompt_blocks(s) == [] and violations(s) == []
        run_until_idle(s, token=pick)
        assert_nothing_held(s)
        return outputs(members[1:])

    assert run(abort=True) == run(abort=False)


def test_preempting_the_leader_mid_prompt_still_completes_every_member():
    # Priority 1 group; a priority 0 request that needs most blocks displaces its leader mid-prompt.
    s = make_scheduler("priority", enable_prefix_caching=False, block_size=BLOCK, num_blocks=12,
                       max_num_batched_tokens=8, max_model_len=48, aging_steps=1000)
    members = group(3, max_tokens=3, priority=1)
    s.add_group(members)
    step(s, 0.0)
    assert 0 < s.requests["g0"].num_computed_tokens < SHARED
    s.add_request(make_request("urgent", 36, max_tokens=4, priority=0, arrival_s=1.0, ignore_eos=True))
    plan, events = step(s, 1.0)
    assert (("g0", E.PREEMPT) in [(e.request_id, e.transition) for e in events]
            and s.requests["g0"].state is RequestState.PENDING)
    _, rest = run_until_idle(s, start_s=2.0)
    assert set(completions(rest)) == {"urgent", "g0", "g1", "g2"}
    assert all(r.num_output_tokens == 3 for r in members)
    assert s.stats().num_shared_prompt_tokens == 2 * SHARED  # still computed once, by whoever led
    assert_nothing_held(s)


def test_another_member_leads_when_the_leader_is_aborted_mid_prompt():
    s = make_scheduler(enable_prefix_caching=False, block_size=BLOCK, max_num_batched_tokens=8)
    members = group(3)
    s.add_group(members)
    step(s)
    s.abort_request("g0")
    plan, _ = step(s)
    assert plan.num_scheduled_tokens == {"g1": 8}  # g1 computes the prompt now; g2 waits for it
    _, events = run_until_idle(s)
    assert set(completions(events)) == {"g1", "g2"}
    assert s.stats().num_shared_prompt_tokens == SHARED
    assert_nothing_held(s)


def test_executor_loss_leaves_no_shared_block_behind_and_the_group_recovers():
    s = make_scheduler(enable_prefix_caching=False, block_size=BLOCK)
    members = group(4)
    s.add_group(members)
    for _ in range(3):
        step(s)
    assert len(s.running) == 4
    events = s.executor_lost()
    assert {e.request_id for e in events if e.transition is E.EXECUTOR_LOST} == {"g0", "g1", "g2", "g3"}
    assert_nothing_held(s)
    _, events = run_until_idle(s)
    assert set(completions(events)) == {"g0", "g1", "g2", "g3"}
    assert all(r.num_output_tokens == 4 for r in members)
    assert_nothing_held(s)


def test_a_member_recomputing_after_executor_loss_is_not_waited_for():
    """The loss may follow the member that computes the prompt: its siblings do not
    wait for it until it has finished a step again."""
    s = make_scheduler(enable_prefix_caching=False, block_size=BLOCK, max_num_batched_tokens=64)
    s.add_group(group(2))
    s.schedule()  # g0 leads; its step is never answered
    s.executor_lost()
    plan = s.schedule()
    # g0 was lost while computing: g1 does not wait for it and computes the prompt too.
    assert plan.num_scheduled_tokens == {"g0": len(PROMPT), "g1": len(PROMPT)}
    assert group_prompt_computed_once(s, plan) == []


def test_no_group_without_a_full_block_to_share():
    s = make_scheduler(block_size=BLOCK)
    assert s.add_group(group(3, prompt=[5, 6, 7, 8])) is None  # the last token's block is all there is
    assert s.add_group(group(1, prefix="h")) is None
    assert all(r.group is None for r in s.requests.values())


def test_a_group_is_queued_whole_or_not_at_all():
    s = make_scheduler(block_size=BLOCK, max_waiting=5)
    s.add_request(make_request("x", 3))
    with pytest.raises(QueueFullError, match="a group of 5 requests"):
        s.add_group(group(5))
    with pytest.raises(InvalidRequestError, match="'g1' of a group must have the prompt"):
        s.add_group([make_request("g0", PROMPT), make_request("g1", PROMPT[:-1])])
    with pytest.raises(InvalidRequestError, match="prompt and cache_salt"):
        s.add_group([make_request("g0", PROMPT), make_request("g1", PROMPT, cache_salt="s")])
    with pytest.raises(DuplicateRequestError, match="'g0' is twice"):
        s.add_group([make_request("g0", PROMPT), make_request("g0", PROMPT)])
    with pytest.raises(DuplicateRequestError, match="'x' is already live"):
        s.add_group([make_request("g0", PROMPT), make_request("x", PROMPT)])
    with pytest.raises(RequestTooLongError, match="max_model_len"):
        s.add_group([make_request("g0", PROMPT), make_request("g1", PROMPT, max_tokens=60)])
    with pytest.raises(InvalidRequestError, match="at least one"):
        s.add_group([])
    assert set(s.requests) == {"x"} and s.num_waiting == 1


def test_the_invariants_catch_a_core_that_computes_the_prompt_twice(monkeypatch):
    """If members did not wait for the one computing the prompt, the plan invariant says so."""
    monkeypatch.setattr(Scheduler, "_sibling_prefix", lambda self, request, hits: hits)
    s = make_scheduler(enable_prefix_caching=False, block_size=BLOCK)
    s.add_group(group(2))
    plan = s.schedule()
    assert set(plan.num_scheduled_tokens) == {"g0", "g1"}
    found = group_prompt_computed_once(s, plan)
    assert any("admits 'g1' to compute the shared prompt" in m and "while 'g0' computes it" in m
               for m in found)


def test_the_invariants_catch_a_block_shared_outside_a_group():
    s = make_scheduler(enable_prefix_caching=False, block_size=BLOCK, debug_checks=False)
    s.add_request(make_request("a", 8))
    s.add_request(make_request("b", 8))
    step(s)
    # Point b's first block at a's, as a broken fork would.
    tables, refs = s.blocks.tables, s.blocks.ref_counts
    refs[tables["b"][0]] -= 1
    s.blocks.free_ids.append(tables["b"][0])
    tables["b"][0] = tables["a"][0]
    refs[tables["a"][0]] += 1
    found = groups_share_prompt_blocks(s)
    assert found and "neither cached nor a group's shared prompt block" in found[0]


@pytest.mark.parametrize("caching", [False, True])
def test_a_group_under_async_scheduling_samples_as_it_does_serially(caching):
    """Two plans in flight (the executor feeds sampled tokens back): the members
    still share the prompt once and emit what a serial run emits."""
    from test_core_async_scheduling import Pipeline

    def drive(depth: int, overlap: bool):
        s = make_scheduler(enable_prefix_caching=caching, block_size=BLOCK, async_scheduling=overlap,
                           max_num_batched_tokens=16)
        s.add_group(group(3, max_tokens=5))
        p = Pipeline(s, depth)
        p.run()
        assert s.stats().num_shared_prompt_tokens == 2 * SHARED
        assert_nothing_held(s)
        return p

    serial, overlapped = drive(1, False), drive(2, True)
    assert overlapped.outputs == serial.outputs and all(len(t) == 5 for t in serial.outputs.values())
