"""(h) continued: every stop condition finishes with the right reason and frees the
request's blocks in the same update."""

from __future__ import annotations

import pytest

from cadence.statemachine.fsm import FinishReason, RequestEventKind, RequestState
from cadence.statemachine.plan import StepResult

from core_helpers import EOS, STOP, make_request, make_scheduler, step

E = RequestEventKind


def feed(s, rid: str, tokens: list[int]) -> list:
    """Run the request one step per token, answering with `tokens` in turn; return
    the events of the step it finished in."""
    for token in tokens:
        plan, events = step(s, token=token)
        finished = [e for e in events if e.request_id == rid and e.finish_reason is not None]
        if finished:
            return finished
    raise AssertionError(f"{rid} did not finish on {tokens}")


def assert_finished(s, rid: str, event, reason: FinishReason, outputs: list[int]) -> None:
    """The finishing event carries the reason and the last token; blocks are free."""
    request = s.requests.get(rid)
    assert request is None, f"{rid} still live"
    assert event.transition is E.FINISH and event.finish_reason is reason
    assert list(event.token_ids) == outputs[-1:]
    assert rid not in s.blocks.tables and s.blocks.num_used_blocks == 0
    assert s.stats().completed_by_reason == {reason.value: 1}


def test_max_tokens_finishes_with_length():
    """The max_tokens-th token finishes the request as length."""
    s = make_scheduler()
    request = make_request("r", 5, max_tokens=3)
    s.add_request(request)
    (event,) = feed(s, "r", [7, 7, 7, 7])
    assert request.output_token_ids == [7, 7, 7]
    assert_finished(s, "r", event, FinishReason.LENGTH, request.output_token_ids)


def test_eos_finishes_with_stop():
    """EOS finishes the request as stop, EOS included in the output."""
    s = make_scheduler()
    request = make_request("r", 5, max_tokens=8)
    s.add_request(request)
    (event,) = feed(s, "r", [7, EOS])
    assert request.output_token_ids == [7, EOS]
    assert_finished(s, "r", event, FinishReason.STOP, request.output_token_ids)


def test_min_tokens_suppresses_eos():
    """EOS before min_tokens outputs is kept as an ordinary token; from min_tokens on it stops."""
    s = make_scheduler()
    request = make_request("r", 5, max_tokens=8, min_tokens=3)
    s.add_request(request)
    (event,) = feed(s, "r", [EOS, EOS, EOS])
    assert request.output_token_ids == [EOS, EOS, EOS]
    assert_finished(s, "r", event, FinishReason.STOP, request.output_token_ids)


def test_min_tokens_also_suppresses_stop_token_ids():
    """Stop token ids, like EOS, do not end a request before min_tokens."""
    s = make_scheduler()
    request = make_request("r", 5, max_tokens=8, min_tokens=2, stop=(STOP,))
    s.add_request(request)
    (event,) = feed(s, "r", [STOP, STOP])
    assert request.output_token_ids == [STOP, STOP]
    assert event.finish_reason is FinishReason.STOP


def test_ignore_eos_runs_to_max_tokens():
    """With ignore_eos, EOS is an ordinary token and the request ends at max_tokens."""
    s = make_scheduler()
    request = make_request("r", 5, max_tokens=3, ignore_eos=True)
    s.add_request(request)
    (event,) = feed(s, "r", [EOS, EOS, EOS])
    assert request.output_token_ids == [EOS, EOS, EOS]
    assert_finished(s, "r", event, FinishReason.LENGTH, request.output_token_ids)


def test_stop_token_ids_stop_even_with_ignore_eos():
    """stop_token_ids always stop, ignore_eos or not."""
    s = make_scheduler()
    request = make_request("r", 5, max_tokens=8, ignore_eos=True, stop=(STOP,))
    s.add_request(request)
    (event,) = feed(s, "r", [7, EOS, STOP])
    assert request.output_token_ids == [7, EOS, STOP]
    assert_finished(s, "r", event, FinishReason.STOP, request.output_token_ids)


def test_max_model_len_finishes_with_length():
    """A request reaching max_model_len tokens finishes as length and is never
    scheduled past it."""
    s = make_scheduler(max_model_len=8)
    request = make_request("r", 5, max_tokens=3, ignore_eos=True)
    s.add_request(request)
    (event,) = feed(s, "r", [7, 7, 7, 7])
    assert request.num_tokens == 8 and request.num_computed_tokens <= 8
    assert_finished(s, "r", event, FinishReason.LENGTH, request.output_token_ids)


def test_eos_and_max_tokens_on_the_same_token_is_stop():
    """A stop token that is also the last allowed token reports stop."""
    s = make_scheduler()
    request = make_request("r", 5, max_tokens=2)
    s.add_request(request)
    (event,) = feed(s, "r", [7, EOS])
    assert event.finish_reason is FinishReason.STOP


@pytest.mark.parametrize(("tokens", "kept", "reason"), [
    ([7, EOS, 8, 9], [7, EOS], FinishReason.STOP),
    ([7, 8, 9, 10], [7, 8, 9], FinishReason.LENGTH),
])
def test_several_tokens_in_one_result_are_cut_at_the_stop(tokens, kept, reason):
    """A result carrying several tokens (speculative decoding) is cut where the
    request stops; the rest are dropped and not counted."""
    s = make_scheduler()
    request = make_request("r", 5, max_tokens=3)
    s.add_request(request)
    plan = s.schedule()
    events = s.take_events() + s.update(plan, StepResult(plan.step_id, {"r": tokens}))
    (event,) = [e for e in events if e.finish_reason is not None]
    assert request.output_token_ids == kept and list(event.token_ids) == kept
    assert event.finish_reason is reason
    assert s.stats().num_tokens_generated == len(kept)
    assert s.blocks.num_used_blocks == 0


def test_finishing_frees_blocks_for_an_admission_in_the_next_step():
    """Blocks freed by a finish in update() are available to the very next schedule()."""
    s = make_scheduler(num_blocks=2, block_size=4)
    s.add_request(make_request("a", 7, max_tokens=1))
    s.add_request(make_request("b", 7, max_tokens=1))
    plan, events = step(s)
    assert list(plan.num_scheduled_tokens) == ["a"]
    assert s.blocks.num_free_blocks == 2
    plan, events = step(s)
    assert list(plan.num_scheduled_tokens) == ["b"] and plan.finished_ids == ["a"]


def test_no_token_for_a_prefill_chunk_short_of_the_prompt():
    """A token reported for a chunk that did not reach the prompt's end is ignored."""
    s = make_scheduler(max_num_batched_tokens=4)
    request = make_request("r", 10, max_tokens=2)
    s.add_request(request)
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"r": 4}
    s.update(plan, StepResult(plan.step_id, {"r": [7]}))
    assert request.output_token_ids == [] and request.state is RequestState.RUNNING
