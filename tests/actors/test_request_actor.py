"""The request actor on its own: it drives its FSM with the events it is given (an
illegal sequence raises), merges deltas for a slow consumer, turns consumer
cancellation and timeouts into one abort, and never blocks the sender."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from cadence.actors.detokenizer import ByteTokenizer, TextAssembler
from cadence.actors.request_actor import RequestActor
from cadence.actors.unwrap import unwrap_sole_error
from cadence.statemachine.errors import ExecutorError, IllegalTransition
from cadence.statemachine.fsm import FinishReason, RequestEventKind as E
from cadence.statemachine.plan import RequestEvent
from cadence.statemachine.request import Request, SamplingLimits
from cadence.statemachine.sampling import SamplingParams


def make_actor(aborts: list, *, timeout_s=None, stops=(), text=False) -> RequestActor:
    request = Request("r", [104, 105], SamplingLimits(max_tokens=10), arrival_s=trio.current_time())
    params = SamplingParams(max_tokens=10, stop=stops)
    assembler = TextAssembler(ByteTokenizer(), [104, 105], stops) if text or stops else None
    actor = RequestActor(request, params, lambda rid, detail: aborts.append((rid, detail)),
                         assembler, timeout_s)
    actor.accept()
    return actor


async def drain(actor) -> list:
    outs = []
    while True:
        try:
            outs.append(await actor.next_output())
        except StopAsyncIteration:
            return outs


@pytest.mark.parametrize("events", [
    [RequestEvent("r", None, [1])],  # tokens while pending
    [RequestEvent("r", E.PREEMPT)],  # preempted while pending
    [RequestEvent("r", E.ADMIT), RequestEvent("r", E.ADMIT)],
    [RequestEvent("r", E.ADMIT), RequestEvent("r", E.FINISH, [1], FinishReason.ABORT)],
    [RequestEvent("r", E.ADMIT), RequestEvent("r", E.FINISH, [1])],  # no reason
])
async def test_an_illegal_event_sequence_raises(events):
    actor = make_actor([])
    with pytest.raises(IllegalTransition), unwrap_sole_error():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(actor.run)
            for event in events:
                actor.deliver(event)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()


async def test_events_after_completion_raise():
    actor = make_actor([])
    with pytest.raises(IllegalTransition), unwrap_sole_error():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(actor.run)
            actor.deliver(RequestEvent("r", E.ABORT, (), FinishReason.ABORT))
            await trio.testing.wait_all_tasks_blocked()
            assert actor.finished
            actor._apply([RequestEvent("r", E.ADMIT)])  # the actor task has ended; apply directly


async def test_a_slow_consumer_gets_one_merged_delta():
    actor = make_actor([], text=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.run)
        actor.deliver(RequestEvent("r", E.ADMIT))
        for token in b"abc":
            actor.deliver(RequestEvent("r", None, [token]))
        actor.deliver(RequestEvent("r", E.PREEMPT))
        actor.deliver(RequestEvent("r", E.ADMIT))
        actor.deliver(RequestEvent("r", E.FINISH, [ord("d")], FinishReason.LENGTH))
        await trio.testing.wait_all_tasks_blocked()
        outs = await drain(actor)
    assert len(outs) == 1
    assert outs[0].token_ids == list(b"abcd") and outs[0].text == "abcd"
    assert outs[0].num_tokens == 4 and outs[0].finish_reason == "length"


async def test_a_stop_string_ends_the_stream_and_aborts_once():
    aborts = []
    actor = make_actor(aborts, stops=["cd"])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.run)
        actor.deliver(RequestEvent("r", E.ADMIT))
        for token in b"abcdef":
            actor.deliver(RequestEvent("r", None, [token]))
        await trio.testing.wait_all_tasks_blocked()
        outs = await drain(actor)
        assert aborts == [("r", "stop string")]
        assert not actor.finished  # still waiting for the core to confirm the abort
        actor.deliver(RequestEvent("r", E.ABORT, (), FinishReason.ABORT))
    assert actor.finished
    assert "".join(o.text for o in outs) == "ab"
    assert outs[-1].finish_reason == "stop" and outs[-1].num_tokens == 4


async def test_cancel_aborts_once_and_ends_the_stream():
    aborts = []
    actor = make_actor(aborts)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.run)
        actor.deliver(RequestEvent("r", E.ADMIT))
        actor.deliver(RequestEvent("r", None, [5]))
        await trio.testing.wait_all_tasks_blocked()
        actor.cancel()
        actor.cancel()
        outs = await drain(actor)
        actor.deliver(RequestEvent("r", E.ABORT, (), FinishReason.ABORT, "cancelled"))
    assert aborts == [("r", "cancelled")]
    assert outs[-1].finish_reason == "abort" and outs[-1].token_ids == [5]


async def test_timeout_aborts_with_detail_timeout(autojump_clock):
    aborts = []
    actor = make_actor(aborts, timeout_s=0.5)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.run)
        actor.deliver(RequestEvent("r", E.ADMIT))
        outs = await drain(actor)
        assert trio.current_time() == pytest.approx(0.5)
        actor.deliver(RequestEvent("r", E.ABORT, (), FinishReason.ABORT, "timeout"))
    assert aborts == [("r", "timeout")]
    assert outs[-1].finish_reason == "abort" and outs[-1].detail == "timeout"


async def test_a_failed_request_raises_executor_error_to_its_consumer():
    actor = make_actor([])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.run)
        actor.deliver(RequestEvent("r", E.FAIL, (), FinishReason.ERROR, "executor gave up"))
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(ExecutorError, match="executor gave up"):
            await actor.next_output()
        with pytest.raises(StopAsyncIteration):
            await actor.next_output()


async def test_the_actor_task_ending_by_cancellation_sends_an_abort():
    aborts = []
    actor = make_actor(aborts)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.run)
        actor.deliver(RequestEvent("r", E.ADMIT))
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert aborts == [("r", "cancelled")]


async def test_logprobs_stay_aligned_with_tokens_through_merges_and_a_stop_string():
    """Each delta carries one log-probability entry per token (None where an event
    had none); tokens after a stop string are dropped with their entries."""
    actor = make_actor([], stops=["cd"])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.run)
        actor.deliver(RequestEvent("r", E.ADMIT))
        actor.deliver(RequestEvent("r", None, [ord("a")]))  # no logprobs for this one
        event = RequestEvent("r", None, list(b"bcde"))
        event.logprobs = [[(t, -float(t))] for t in b"bcde"]
        actor.deliver(event)
        await trio.testing.wait_all_tasks_blocked()
        outs = await drain(actor)
        actor.deliver(RequestEvent("r", E.ABORT, (), FinishReason.ABORT))
    tokens = [t for o in outs for t in o.token_ids]
    logprobs = [entry for o in outs for entry in (o.logprobs or [None] * len(o.token_ids))]
    assert tokens == list(b"abcd")
    assert logprobs == [None] + [[(t, -float(t))] for t in b"bcd"]
