"""Async scheduling: plan N+1 is made while plan N is in flight, and a decoding
request is in both (the executor feeds its own sampled token back).

`Pipeline` plays an executor that runs plans in order and keeps every request's
tokens on its side, as the real ones do: the token a plan samples at a position
is `token_at(request_id, position)`, so an overlapped run and a serial run of the
same requests must emit the same tokens.
"""

from __future__ import annotations

import random
import zlib
from collections import deque

import pytest

from cadence.statemachine.fsm import FinishReason
from cadence.statemachine.plan import StepResult
from core_helpers import EOS, FILLER, make_request, make_scheduler


def token_at(request_id: str, position: int) -> int:
    """A token that depends only on the request and the position."""
    return 100 + zlib.crc32(f"{request_id}:{position}".encode()) % 1000


class Pipeline:
    """An in-order executor with a persistent batch, for up to `depth` plans in flight."""

    def __init__(self, scheduler, depth: int, token_fn=token_at) -> None:
        self.s = scheduler
        self.depth = depth
        self.token_fn = token_fn
        self.inflight: deque = deque()
        self.known: dict[str, int] = {}  # tokens the executor holds per request
        self.computed: dict[str, int] = {}
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, FinishReason] = {}
        self.num_plans = 0
        self.num_sampled = 0

    def _run(self, plan) -> StepResult:
        """Apply the plan to the batch and sample where a chunk reaches the last token."""
        for rid in (*plan.finished_ids, *plan.preempted_ids):
            self.known.pop(rid, None)
            self.computed.pop(rid, None)
        for data in plan.new_requests:
            self.known[data.request_id] = len(data.token_ids)
            self.computed[data.request_id] = data.num_computed_tokens
        sampled = {}
        for rid, n in plan.num_scheduled_tokens.items():
            after = self.computed[rid] + n
            assert after <= self.known[rid], f"{rid}: computes {after} of {self.known[rid]} known tokens"
            self.computed[rid] = after
            if after == self.known[rid]:
                sampled[rid] = [self.token_fn(rid, after)]
                self.known[rid] += 1
                self.num_sampled += 1
        return StepResult(plan.step_id, sampled)

    def _deliver(self, plan, result) -> None:
        for event in self.s.update(plan, result):
            self._note(event)

    def _note(self, event) -> None:
        rid = event.request_id
        if event.token_ids:
            assert rid not in self.finished, f"{rid} emitted a token after it finished"
            self.outputs.setdefault(rid, []).extend(event.token_ids)
        if event.finish_reason is not None:
            self.finished[rid] = event.finish_reason

    def tick(self) -> bool:
        """Plan one step (answering the oldest plan first once `depth` are in flight)."""
        if len(self.inflight) >= self.depth:
            plan, result = self.inflight.popleft()
            self._deliver(plan, result)
        plan = self.s.schedule()
        for event in self.s.take_events():
            self._note(event)
        if plan.is_empty:
            if not self.inflight:
                return False
            self._deliver(*self.inflight.popleft())
            return True
        self.num_plans += 1
        self.inflight.append((plan, self._run(plan)))
        return True

    @property
    def extra_tokens(self) -> int:
        """Tokens sampled and never emitted (a finished request's, or a preempted one's)."""
        return self.num_sampled - sum(map(len, self.outputs.values()))

    def run(self, max_plans: int = 500) -> None:
        while self.s.has_work() or self.inflight:
            assert self.num_plans < max_plans, "did not finish"
            self.tick()


def add_three(s, *, max_tokens=6, eos=(EOS,)) -> None:
    s.add_request(make_request("a", 5, max_tokens=max_tokens, eos=eos, arrival_s=0.0))
    s.add_request(make_request("b", 9, max_tokens=max_tokens + 2, eos=eos, arrival_s=0.0))
    s.add_request(make_request("c", 3, max_tokens=max_tokens - 2, eos=eos, arrival_s=0.0))


def run(depth: int, async_scheduling: bool, token_fn=token_at, **config) -> Pipeline:
    s = make_scheduler(async_scheduling=async_scheduling, **config)
    add_three(s)
    p = Pipeline(s, depth, token_fn)
    p.run()
    assert not s.requests and s.blocks.num_used_blocks == 0
    return p


def test_a_decoding_request_is_in_the_next_plan_before_its_token_arrives():
    s = make_scheduler(async_scheduling=True, block_size=4)
    s.add_request(make_request("a", 4, max_tokens=8))
    first = s.schedule()  # the prompt: samples position 4
    second = s.schedule()  # made before the first's result
    assert second.num_scheduled_tokens == {"a": 1}
    assert second.new_block_ids == {"a": [s.blocks.tables["a"][1]]}, "its block is reserved before the result"
    request = s.requests["a"]
    assert request.pending_steps == [first.step_id, second.step_id]
    assert s.schedule().is_empty, "one plan ahead at most"
    events = s.update(first, StepResult(first.step_id, {"a": [7]}))
    assert [e.token_ids for e in events if e.token_ids] == [[7]] and request.pending_steps == [second.step_id]


def test_without_async_scheduling_a_request_waits_for_its_token():
    s = make_scheduler(block_size=4)
    s.add_request(make_request("a", 4, max_tokens=8))
    s.schedule()
    assert s.schedule().is_empty


def test_overlapped_plans_emit_what_serial_plans_emit():
    serial = run(depth=1, async_scheduling=False)
    overlapped = run(depth=2, async_scheduling=True)
    assert overlapped.outputs == serial.outputs
    assert overlapped.finished == serial.finished
    assert overlapped.extra_tokens == 0, "length limits are known ahead: nothing computed in vain"


def test_a_stop_token_takes_effect_a_step_late_and_the_extra_token_is_never_emitted():
    def stops_b(rid: str, position: int) -> int:
        return EOS if (rid, position) == ("b", 11) else token_at(rid, position)

    serial = run(depth=1, async_scheduling=False, token_fn=stops_b)
    overlapped = run(depth=2, async_scheduling=True, token_fn=stops_b)
    assert overlapped.outputs == serial.outputs and overlapped.outputs["b"][-1] == EOS
    assert overlapped.finished["b"] is FinishReason.STOP
    assert overlapped.extra_tokens == 1


def test_no_plan_ahead_when_the_token_in_flight_ends_the_request():
    s = make_scheduler(async_scheduling=True)
    s.add_request(make_request("a", 4, max_tokens=1))
    s.schedule()
    assert s.schedule().is_empty


def test_an_answer_out_of_order_is_applied_after_the_older_one():
    s = make_scheduler(async_scheduling=True)
    s.add_request(make_request("a", 4, max_tokens=8))
    first, second = s.schedule(), s.schedule()
    assert not [e for e in s.update(second, StepResult(second.step_id, {"a": [8]})) if e.token_ids]
    assert s.requests["a"].output_token_ids == []
    events = s.update(first, StepResult(first.step_id, {"a": [7]}))
    assert [t for e in events for t in e.token_ids] == [7, 8]
    assert s.requests["a"].output_token_ids == [7, 8] and not s.requests["a"].pending_steps


def test_preempting_a_request_with_a_token_in_flight_discards_that_token_and_recomputes():
    """Few blocks: the overlapped run preempts; outputs still equal the serial run's."""
    serial = run(depth=1, async_scheduling=False, num_blocks=6)
    overlapped = run(depth=2, async_scheduling=True, num_blocks=6)
    assert overlapped.s.stats().num_preemptions > 0
    assert overlapped.outputs == serial.outputs


def test_losing_the_executor_with_two_plans_in_flight_clears_what_was_pending():
    s = make_scheduler(async_scheduling=True)
    add_three(s)
    p = Pipeline(s, depth=2)
    for _ in range(4):
        p.tick()
    assert any(r.pending_steps for r in s.requests.values())
    s.executor_lost()
    p.inflight.clear()
    p.known.clear()
    p.computed.clear()
    assert all(not r.pending_steps and r.num_computed_tokens == 0 for r in s.requests.values())
    p.run()
    assert not s.requests and s.blocks.num_used_blocks == 0
    assert p.outputs == run(depth=1, async_scheduling=False).outputs


def test_the_prefix_cache_keys_only_tokens_the_core_knows():
    """A plan ahead advances num_computed_tokens past the known tokens; the blocks
    cached on the older answer are those whose tokens are all known."""
    s = make_scheduler(async_scheduling=True, block_size=4)
    s.add_request(make_request("a", 7, max_tokens=8))
    first, second = s.schedule(), s.schedule()  # computes 0..6, then position 7 from the executor
    s.update(first, StepResult(first.step_id, {"a": [FILLER]}))
    s.update(second, StepResult(second.step_id, {"a": [FILLER]}))
    s.add_request(make_request("b", s.requests["a"].all_token_ids[:8] + [3], max_tokens=1))
    plan = s.schedule()
    assert {d.request_id: d.num_computed_tokens for d in plan.new_requests} == {"b": 8}


class CheckedPipeline(Pipeline):
    """A Pipeline that compares, plan by plan, the requests its own batch samples
    for with what the core says samples (`Scheduler.sampling_ids`)."""

    num_checked = 0

    def _run(self, plan) -> StepResult:
        said = self.s.sampling_ids(plan)
        result = super()._run(plan)
        assert said == list(result.sampled_token_ids), f"plan {plan.step_id}"
        self.num_checked += len(said)
        return result


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("depth, overlap, num_blocks", [(1, False, 64), (1, False, 6), (2, True, 64),
                                                        (2, True, 6)])
def test_the_core_names_the_requests_each_plan_samples_for(depth, overlap, num_blocks, seed):
    """Sync and overlapped, with chunked prompts and preemptions: exactly those the
    executor's batch samples for, in the plan's order."""
    rng = random.Random(seed)
    s = make_scheduler(async_scheduling=overlap, num_blocks=num_blocks, max_num_batched_tokens=12)
    for i in range(6):
        s.add_request(make_request(f"r{i}", rng.randint(2, 14), max_tokens=rng.randint(1, 9),
                                   arrival_s=float(i)))
    p = CheckedPipeline(s, depth)
    p.run()
    assert p.num_checked >= 6 and len(p.finished) == 6  # each request sampled at least once
    if num_blocks == 6:
        assert s.stats().num_preemptions > 0, "the trace was meant to preempt"
