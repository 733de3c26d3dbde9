"""One step at a time: planning ahead of results, stale results, aborts in
flight, executor loss, and the events each call returns."""

from __future__ import annotations

import pytest

from cadence.statemachine.fsm import FinishReason, RequestEventKind, RequestState
from cadence.statemachine.plan import RequestEvent, StepResult

from core_helpers import fabricate, make_request, make_scheduler, run_until_idle, step

E = RequestEventKind


def test_a_request_whose_token_is_in_flight_is_not_scheduled_again():
    """Planning the next step before the result arrives skips requests that await
    their sampled token, and schedules them again once it arrives."""
    s = make_scheduler()
    s.add_request(make_request("r", 4, max_tokens=4))
    first = s.schedule()
    second = s.schedule()
    assert first.num_scheduled_tokens == {"r": 4} and second.is_empty
    s.update(first, fabricate(s, first))
    third = s.schedule()
    assert third.num_scheduled_tokens == {"r": 1}


def test_chunked_prefill_can_be_planned_ahead():
    """Chunks of one prompt can be in flight together; only the last samples."""
    s = make_scheduler(max_num_batched_tokens=4)
    request = make_request("r", 10, max_tokens=2)
    s.add_request(request)
    answered = []
    for _ in range(3):
        plan = s.schedule()
        answered.append((plan, fabricate(s, plan)))
    assert [p.num_scheduled_tokens for p, _ in answered] == [{"r": 4}, {"r": 4}, {"r": 2}]
    assert [r.sampled_token_ids for _, r in answered] == [{}, {}, {"r": [100]}]
    for plan, result in answered:
        s.update(plan, result)
    assert request.output_token_ids == [100]


def test_duplicate_and_stale_results_change_nothing():
    """A result applied twice, or labelled with another step, is ignored."""
    s = make_scheduler()
    s.add_request(make_request("r", 4, max_tokens=4))
    plan = s.schedule()
    result = fabricate(s, plan)
    assert s.update(plan, StepResult(plan.step_id + 1, result.sampled_token_ids)) == [
        RequestEvent("r", E.ADMIT)]  # only the pending admission event comes back
    assert s.get_request("r").output_token_ids == []
    assert [e.token_ids for e in s.update(plan, result)] == [[100]]
    assert s.update(plan, result) == []
    assert s.get_request("r").output_token_ids == [100]


def test_abort_while_a_step_is_in_flight():
    """Aborting frees blocks at once; the late result is ignored for it; the next
    plan tells the executor to drop it."""
    s = make_scheduler()
    s.add_request(make_request("gone", 4, max_tokens=4))
    s.add_request(make_request("kept", 4, max_tokens=4))
    plan = s.schedule()
    result = fabricate(s, plan)
    event = s.abort_request("gone", "client went away")
    assert event == RequestEvent("gone", E.ABORT, (), FinishReason.ABORT, "client went away")
    assert "gone" not in s.blocks.tables
    events = s.update(plan, result)
    assert [e.request_id for e in events if e.token_ids] == ["kept"]
    assert s.schedule().finished_ids == ["gone"]


def test_abort_of_a_waiting_request_is_not_sent_to_the_executor():
    """The executor never saw a waiting request, so it is not in finished_ids."""
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("running", 4, max_tokens=4))
    s.add_request(make_request("waiting", 4, max_tokens=4))
    step(s)
    s.abort_request("waiting")
    assert s.schedule().finished_ids == []


def test_fail_request_completes_with_error():
    """fail_request finishes a live request as error and frees its blocks."""
    s = make_scheduler()
    s.add_request(make_request("r", 4, max_tokens=4))
    step(s)
    event = s.fail_request("r", "step raised")
    assert (event.transition, event.finish_reason, event.detail) == (E.FAIL, FinishReason.ERROR, "step raised")
    assert not s.has_work() and s.blocks.num_used_blocks == 0


def test_executor_lost_sends_running_requests_back_and_voids_plans():
    """Running requests go back to waiting with their tokens, in-flight results
    are void, the prefix cache is forgotten, and the work lost is counted."""
    s = make_scheduler(block_size=4)
    s.add_request(make_request("r", 8, max_tokens=4))
    s.add_request(make_request("w", 4, max_tokens=4))
    step(s)
    in_flight = s.schedule()
    events = s.executor_lost()
    assert [(e.request_id, e.transition) for e in events] == [("r", E.EXECUTOR_LOST), ("w", E.EXECUTOR_LOST)]
    assert s.get_request("r").state is RequestState.PENDING
    assert not s.blocks.cached and s.blocks.num_free_blocks == s.blocks.num_blocks
    assert s.stats().num_recompute_tokens == 9 + 5  # computed when lost, in-flight step included
    assert s.update(in_flight, fabricate(s, in_flight)) == []
    plan, _ = step(s)
    resumed = {d.request_id: d for d in plan.new_requests}
    assert len(resumed["r"].token_ids) == 9 and resumed["r"].num_prompt_tokens == 8
    assert resumed["r"].num_computed_tokens == 0  # nothing cached survives
    run_until_idle(s)


def test_schedule_events_come_back_once():
    """Events made by schedule() are returned by take_events() or, failing that,
    by the next update(), never twice."""
    s = make_scheduler()
    s.add_request(make_request("a", 4, max_tokens=2))
    plan = s.schedule()
    assert s.take_events() == [RequestEvent("a", E.ADMIT)]
    assert s.take_events() == []
    s.add_request(make_request("b", 4, max_tokens=2))
    plan2 = s.schedule()
    events = s.update(plan, fabricate(s, plan))
    assert events[0] == RequestEvent("b", E.ADMIT) and len(events) == 2
    assert s.update(plan2, fabricate(s, plan2))[0].request_id == "b"


def test_default_clock_is_the_step_number():
    """Without now_s the scheduler counts steps as seconds (tests and the checker)."""
    s = make_scheduler()
    s.add_request(make_request("a", 4, max_tokens=1, arrival_s=0.0))
    s.schedule()
    s.schedule()
    assert s.now_s == 1.0


def test_batch_sorting_puts_decodes_first_then_longest_prefills():
    """enable_batch_sorting orders a mixed batch: decodes, then prefills by length."""
    s = make_scheduler(enable_batch_sorting=True)
    s.add_request(make_request("decoder", 4, max_tokens=4))
    step(s)
    s.add_request(make_request("short", 3, max_tokens=4))
    s.add_request(make_request("long", 9, max_tokens=4))
    plan = s.schedule()
    assert list(plan.num_scheduled_tokens) == ["decoder", "long", "short"]


def _projected(max_tokens: int, **config):
    """A scheduler (16 blocks of 4 tokens) with one request running, one decode step in."""
    config = {"admission_headroom_steps": 16, "admission_growth_share": 1.0, **config}
    s = make_scheduler(num_blocks=16, block_size=4, **config)
    s.add_request(make_request("running", 4, max_tokens=max_tokens))
    step(s)
    return s


def test_admission_keeps_free_the_growth_projected_over_the_horizon():
    """A running request far from its end grows a block every 4 steps: over a
    16-step horizon admission keeps 4 blocks free for it. It takes its second block
    in the next step, leaving 14: a request needing 10 fits, one needing 11 does not."""
    s = _projected(max_tokens=50)
    assert s.blocks.num_free_blocks == 15
    s.add_request(make_request("eleven", 44, max_tokens=4))
    plan, _ = step(s)
    assert plan.new_requests == []
    s = _projected(max_tokens=50)
    s.add_request(make_request("ten", 40, max_tokens=4))
    plan, _ = step(s)
    assert [d.request_id for d in plan.new_requests] == ["ten"]


def test_admission_credits_the_blocks_a_request_about_to_finish_gives_back():
    """Two tokens from its end, the running request frees its blocks before it
    needs more than one: a request needing 13 of the 14 free blocks fits."""
    s = _projected(max_tokens=3)
    s.add_request(make_request("thirteen", 52, max_tokens=4))
    plan, _ = step(s)
    assert [d.request_id for d in plan.new_requests] == ["thirteen"]


def test_requests_admitted_in_one_pass_leave_room_for_each_others_growth():
    """With nothing running the first admission reserves nothing; the second must
    leave free the first one's growth over the horizon (16 steps: 4 blocks)."""
    s = make_scheduler(num_blocks=16, block_size=4, admission_headroom_steps=16,
                       admission_growth_share=1.0)
    s.add_request(make_request("first", 8, max_tokens=40))   # 2 blocks, 4 more over 16 steps
    s.add_request(make_request("second", 44, max_tokens=4))  # 11 + 4 > the 14 left
    s.add_request(make_request("third", 36, max_tokens=4))   # 9 + 4 <= 14
    plan, _ = step(s)
    assert [d.request_id for d in plan.new_requests] == ["first", "third"]


def test_growth_share_and_a_zero_horizon_scale_the_reserve():
    """admission_growth_share holds back that fraction of the projection; with no
    horizon only the watermark is kept."""
    for share, admitted in ((1.0, []), (0.5, ["eleven"])):
        s = _projected(max_tokens=50, admission_growth_share=share)
        s.add_request(make_request("eleven", 44, max_tokens=4))
        plan, _ = step(s)
        assert [d.request_id for d in plan.new_requests] == admitted
    s = _projected(max_tokens=50, admission_headroom_steps=0)
    s.add_request(make_request("fourteen", 56, max_tokens=4))
    plan, _ = step(s)
    assert [d.request_id for d in plan.new_requests] == ["fourteen"]
    alone = make_scheduler(num_blocks=3, block_size=4, admission_headroom_steps=64)
    alone.add_request(make_request("x", 11, max_tokens=1))
    plan, _ = step(alone)
    assert plan.num_scheduled_tokens == {"x": 11}


def test_prefix_counters_count_each_request_once_across_executor_loss():
    """Re-admission after an executor loss is not a new prefix-cache query."""
    s = make_scheduler(block_size=4)
    s.add_request(make_request("r", 8, max_tokens=4))
    step(s)
    s.executor_lost()
    run_until_idle(s)
    assert s.stats().num_prefix_query_tokens == 8


def test_update_hands_each_token_event_its_logprobs():
    """The executor's log-probabilities ride on the token events; a request whose
    stop token ends it mid-list keeps only its tokens' entries; one without gets None."""
    s = make_scheduler()
    s.add_request(make_request("with", 4, max_tokens=8, stop=[7]))
    s.add_request(make_request("without", 4, max_tokens=8))
    plan = s.schedule()
    first = [[(5, -0.5), (6, -1.5)]]
    result = StepResult(plan.step_id, {"with": [5], "without": [5]}, {"with": first})
    events = {e.request_id: e for e in s.update(plan, result) if e.token_ids}
    assert events["with"].logprobs == first and events["without"].logprobs is None
    plan = s.schedule()
    two = [[(7, -0.1)], [(9, -2.0)]]
    result = StepResult(plan.step_id, {"with": [7, 9], "without": [5]}, {"with": two})
    events = {e.request_id: e for e in s.update(plan, result) if e.token_ids}
    assert events["with"].token_ids == [7] and events["with"].finish_reason is FinishReason.STOP
    assert events["with"].logprobs == two[:1]
