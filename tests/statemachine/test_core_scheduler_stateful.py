"""The Scheduler driven like the shell drives it, under every policy.

Rules add requests (some too long, duplicated or beyond the queue) and request
groups (`n` in 2..4 sharing one prompt), abort live and unknown ids, abort or
fail single members of a group or make one the next preemption's victim, fail
requests, run steps with fabricated executor results (EOS
and stop tokens at random points), hold a step's result for one more step (the
pipelined shell), replay stale or duplicated results, and lose the executor.
After every rule the invariants of DESIGN §4 items 1-10 hold: the shared
predicates of `cadence.statemachine.invariants`, plus what only an observer of
the whole run can check (each request completes exactly once, events replayed
through the FSM table are legal, the executor's view of block tables built from
plan deltas matches the core's, FCFS admission within a class). At the end the
run is drained: every request completes exactly once and every block is free or
evictable with no references.
"""

from __future__ import annotations

import sys
from collections import Counter

import attrs
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cadence.statemachine.config import CacheConfig, SchedulerConfig
from cadence.statemachine.errors import (
    DuplicateRequestError, QueueFullError, RequestNotFoundError, RequestTooLongError,
)
from cadence.statemachine.fsm import FinishReason, RequestEventKind, RequestFSM, RequestState
from cadence.statemachine.invariants import (
    group_prompt_computed_once, plan_within_budget, violations,
)
from cadence.statemachine.plan import RequestEvent, StepPlan, StepResult
from cadence.statemachine.request import Request, SamplingLimits
from cadence.statemachine.scheduler import Scheduler

from cadence.spec import coverage as cov
from cadence.spec.harness import VictimPreference
from cadence.spec.coverage import hypothesis_report as report_families

from core_helpers import EOS, FILLER, STOP, examples, make_request, make_scheduler, step

E = RequestEventKind
PENDING, RUNNING = RequestState.PENDING, RequestState.RUNNING
COMPLETING = {E.FINISH, E.ABORT, E.REJECT, E.FAIL}
TENANTS = ("a", "b", "c")
SAMPLED = st.sampled_from([FILLER, FILLER, FILLER, FILLER, FILLER, EOS, STOP])


def fcfs_checked(scheduler: Scheduler) -> bool:
    """Whether the policy orders requests by arrival within a class (see `class_of`)."""
    config = scheduler.config
    name = scheduler.policy.name
    if name == "weighted":
        return config.throughput_weight == 0 and config.latency_weight > 0
    return name in ("fcfs", "priority", "strict-priority", "fair")


def class_of(scheduler: Scheduler, request: Request) -> tuple:
    """The class within which admission must be first-come first-served."""
    name = scheduler.policy.name
    if name == "fcfs":
        return ()
    if name == "fair":
        return (request.tenant,)
    return (request.priority if scheduler.config.enable_priority_scheduling else 0,)


class SchedulerMachine(RuleBasedStateMachine):
    """One Scheduler, a shadow of every request's state machine as the request
    actor would keep it, and a mirror of the executor's persistent batch."""

    policy = "fcfs"

    def __init__(self) -> None:
        super().__init__()
        self.s: Scheduler | None = None

    # ---- set-up -------------------------------------------------------------
    @initialize(data=st.data())
    def setup(self, data) -> None:
        """A small scheduler with randomly chosen limits, so every limit binds."""
        draw = data.draw
        block_size = draw(st.sampled_from([1, 2, 4]), label="block_size")
        max_model_len = draw(st.integers(6, 32), label="max_model_len")
        chunked = draw(st.sampled_from([True, True, True, False]), label="chunked prefill")
        # With chunking, budgets reach below one prompt and below the seats.
        budget = (draw(st.integers(1, 24), label="budget") if chunked
                  else max_model_len + draw(st.integers(0, 6), label="extra budget"))
        max_num_seqs = draw(st.integers(1, 6), label="max_num_seqs")
        config = SchedulerConfig(
            policy=self.policy,
            max_num_seqs=max_num_seqs,
            max_batch_size=draw(st.sampled_from([None, None, 1, 2, 3]), label="max_batch_size"),
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            max_waiting=draw(st.integers(1, 8), label="max_waiting"),
            # Without chunking a threshold still splits prompts: a known core bug, see
            # the regression test test_threshold_does_not_split_prompts_without_chunking below
            long_prefill_token_threshold=(draw(st.sampled_from([0, 0, 2, 5]), label="threshold")
                                          if chunked else 0),
            enable_chunked_prefill=chunked,
            admission_delay_budget=draw(st.sampled_from([0, 0, 0, 8, 40]), label="delay budget"),
            admission_min_tokens=draw(st.sampled_from([1, 4]), label="admission min tokens"),
            mixed_prefill_tokens=draw(st.sampled_from([0, 0, 0, 2, 6]), label="mixed prefill tokens"),
            mixed_prefill_per_decode=draw(st.sampled_from([0.0, 2.0]), label="mixed per decode"),
            admission_burst_split=draw(st.sampled_from([0, 2, 3]), label="burst split"),
            enable_priority_scheduling=draw(st.sampled_from([True, True, False]), label="priorities"),
            aging_steps=draw(st.sampled_from([0, 2, 16]), label="aging_steps"),
            default_deadline_s=draw(st.sampled_from([1.0, 4.0, 60.0]), label="default_deadline_s"),
            reject_late=draw(st.booleans(), label="reject_late"),
            throughput_weight=draw(st.sampled_from([0.0, 0.0, 1.0]), label="throughput_weight"),
            enable_batch_sorting=draw(st.booleans(), label="batch sorting"),
            starvation_skip_limit=draw(st.integers(0, 3), label="starvation_skip_limit"),
            max_lookahead=draw(st.integers(0, 4), label="max_lookahead"),
            fcfs_victim=draw(st.sampled_from(["least_work", "least_work", "latest_admitted"]),
                             label="fcfs victim"),
            admit_after_preemption=draw(st.sampled_from([True, True, False]),
                                        label="admit after preemption"),
            preempt_for_priority=draw(st.sampled_from([True, True, False]), label="preempt_for_priority"),
            admission_watermark=draw(st.sampled_from([0.0, 0.0, 0.1, 0.3]), label="watermark"),
            admission_headroom_steps=draw(st.sampled_from([0, 0, 2, 16, 128]), label="headroom steps"),
            admission_growth_share=draw(st.sampled_from([0.0, 0.5, 0.95, 1.0]), label="growth share"),
            admission_prefix_wait_blocks=draw(st.sampled_from([0, 1, 2]), label="prefix wait blocks"),
            prefix_tie_lookahead=draw(st.sampled_from([1, 2, 8]), label="prefix tie lookahead"),
            predict_output_lengths=draw(st.sampled_from([True, True, False]), label="predict lengths"),
            length_estimate_window=draw(st.integers(1, 6), label="length window"),
            length_estimate_min_samples=draw(st.integers(1, 3), label="length min samples"),
            length_estimate_quantile=draw(st.sampled_from([0.0, 0.2, 0.5, 1.0]), label="length quantile"),
            predicted_watermark=draw(st.sampled_from([0.0, 0.0, 0.1, 0.3]), label="predicted watermark"),
            thrash_window_steps=draw(st.sampled_from([0, 2, 64]), label="thrash window"),
            predicted_growth_share=draw(st.sampled_from([0.0, 0.5, 0.8, 1.0]),
                                        label="predicted growth share"),
            preempt_min_priority_gap=draw(st.integers(1, 2), label="preempt gap"),
            preempt_max_recompute_tokens=draw(st.sampled_from([0, 1, 4]), label="preempt recompute"),
            preempt_max_times=draw(st.sampled_from([0, 1, 2]), label="preempt times"),
            mixed_prefill_drain_steps=draw(st.sampled_from([16, 1, 64]), label="mixed drain steps"),
            mixed_prefill_chunks=draw(st.sampled_from([0, 0, 2]), label="mixed chunks"),
            debug_checks=True,
        )
        full = -(-max_model_len // block_size)  # blocks one request of max_model_len needs
        cache = CacheConfig(num_blocks=draw(st.integers(max(1, full // 2), 2 * full + 2), label="num_blocks"),
                            block_size=block_size,
                            enable_prefix_caching=draw(st.sampled_from([True, True, False]), label="caching"),
                            retain_preempted_blocks=draw(st.booleans(), label="retain preempted"))
        # Async scheduling: a held step's decodes may be planned ahead of its tokens.
        overlap = draw(st.booleans(), label="async scheduling")
        event(f"async_scheduling: {overlap}")
        self.s = Scheduler(attrs.evolve(config, async_scheduling=overlap), cache)
        self.victim = VictimPreference(self.s.policy)
        self.clock = 0.0
        self.num_ids = 0
        self.added: dict[str, Request] = {}
        self.shadow: dict[str, RequestFSM] = {}
        self.completed: Counter[str] = Counter()
        self.client_tokens: dict[str, list[int]] = {}
        self.prompts: list[tuple[int, ...]] = []
        self.executor: dict[str, list[int]] = {}
        self.held: tuple[StepPlan, StepResult] | None = None
        self.answered: list[tuple[StepPlan, StepResult]] = []
        self.lost: list[StepPlan] = []
        self.families: set[str] = set()
        if max_num_seqs > budget:
            event("more seats than budget tokens")
        for _ in range(draw(st.integers(0, 4), label="initial requests")):
            self._add(data)

    # ---- observing ----------------------------------------------------------
    def _observe(self, events: list[RequestEvent]) -> None:
        """Replay events as the request actor would: through the FSM table."""
        for e in events:
            rid = e.request_id
            request = self.added[rid]
            if e.token_ids:
                assert self.shadow[rid].state is RUNNING, f"tokens for {rid} while {self.shadow[rid].state}"
                self.client_tokens[rid].extend(e.token_ids)
            if e.transition is None:
                self._check_not_stopped(request)
                continue
            self.shadow[rid].fire(e.transition, e.finish_reason)
            if e.transition in COMPLETING:
                self.completed[rid] += 1
                assert self.completed[rid] == 1, f"{rid} completed twice"
                assert rid not in self.s.requests and rid not in self.s.blocks.tables
                if e.transition is E.FINISH:
                    self._check_stop_reason(request, e.finish_reason)

    def _check_stop_reason(self, request: Request, reason: FinishReason) -> None:
        """§4.8 and the stop rules: a finished request stopped for the reason given."""
        limits, out = request.limits, request.output_token_ids
        if reason is FinishReason.STOP:
            assert out[-1] in request.stop_token_set and len(out) >= limits.min_tokens
        else:
            assert len(out) == limits.max_tokens or request.num_tokens == self.s.config.max_model_len
        event(f"finished: {reason.value}")

    def _check_not_stopped(self, request: Request) -> None:
        limits, out = request.limits, request.output_token_ids
        assert len(out) < limits.max_tokens and request.num_tokens < self.s.config.max_model_len
        assert not (out[-1] in request.stop_token_set and len(out) >= limits.min_tokens)

    def _fingerprint(self) -> tuple:
        s = self.s
        return (
            {rid: (r.state, r.num_computed_tokens, len(r.all_token_ids), r.num_skips)
             for rid, r in s.requests.items()},
            [r.request_id for r in s.policy.ordered()], [r.request_id for r in s.running],
            {rid: list(t) for rid, t in s.blocks.tables.items()}, list(s.blocks.free_ids),
            list(s.blocks.evictable), dict(s.blocks.cached), s.stats(), s.step_id,
            list(s._finished_ids),
        )

    # ---- requests -----------------------------------------------------------
    @rule(data=st.data())
    def add_request(self, data) -> None:
        """Add a request; too long, unfittable and over-the-queue ones raise and change nothing."""
        self._add(data)

    def _add(self, data) -> None:
        s, config, draw = self.s, self.s.config, data.draw
        max_tokens = draw(st.integers(1, 6), label="max_tokens")
        fitting = max(1, config.max_model_len - max_tokens)
        length = draw(st.one_of(st.integers(1, fitting), st.integers(1, fitting),
                                st.integers(1, config.max_model_len + 2)), label="prompt length")
        priority = draw(st.integers(0, 2), label="priority")
        tenant = draw(st.sampled_from(TENANTS), label="tenant")
        deadline = draw(st.sampled_from([None, None, 0.5, 3.0, 10.0]), label="deadline in")
        salt = draw(st.sampled_from([None, None, "s"]), label="salt")
        ignore_eos = draw(st.booleans(), label="ignore_eos")
        stop = draw(st.sampled_from([(), (), (STOP,)]), label="stop_token_ids")
        if self.prompts and data.draw(st.booleans(), label="share a prefix"):
            base = data.draw(st.sampled_from(self.prompts), label="base prompt")
            prompt = list(base[:data.draw(st.integers(1, len(base)), label="cut")]) + [FILLER + 1] * (length % 5)
        else:
            prompt = [FILLER + i % 3 for i in range(length)]
        min_tokens = data.draw(st.integers(0, max_tokens), label="min_tokens")
        self.num_ids += 1
        rid = f"r{self.num_ids}"
        request = Request(rid, prompt, SamplingLimits(max_tokens, min_tokens, ignore_eos, {EOS}, stop),
                          priority=priority, tenant=tenant, arrival_s=self.clock, cache_salt=salt,
                          deadline_s=None if deadline is None else self.clock + deadline)
        total = len(prompt) + max_tokens
        if total > config.max_model_len:
            expected = RequestTooLongError, "max_model_len"
        elif s.blocks.blocks_for(total) > s.cache_config.num_blocks:
            expected = RequestTooLongError, "KV blocks"
        elif s.num_waiting >= config.max_waiting:
            expected = QueueFullError, "max_waiting"
        else:
            expected = None
        before = self._fingerprint()
        if expected is not None:
            with pytest.raises(expected[0], match=expected[1]):
                s.add_request(request)
            assert self._fingerprint() == before
            event(f"add: {expected[0].__name__} ({expected[1]})")
            return
        s.add_request(request)
        self.added[rid] = request
        self.shadow[rid] = RequestFSM(rid)
        self.client_tokens[rid] = []
        self.prompts.append(tuple(prompt))

    @rule(data=st.data(), n=st.integers(2, 4))
    def add_group(self, data, n: int) -> None:
        """Add `n` requests with one prompt as a group: all are queued or, if one
        is too long or the queue lacks room for all, none is and nothing changes."""
        s, config, draw = self.s, self.s.config, data.draw
        max_tokens = draw(st.integers(1, 6), label="max_tokens")
        length = draw(st.integers(1, max(1, config.max_model_len - max_tokens)), label="prompt length")
        if self.prompts and draw(st.booleans(), label="share a prefix"):
            base = draw(st.sampled_from(self.prompts), label="base prompt")
            prompt = list(base[:length])
        else:
            prompt = [FILLER + i % 3 for i in range(length)]
        priority = draw(st.integers(0, 2), label="priority")
        tenant = draw(st.sampled_from(TENANTS), label="tenant")
        salt = draw(st.sampled_from([None, None, "s"]), label="salt")
        ignore_eos = draw(st.booleans(), label="ignore_eos")
        requests = []
        for _ in range(n):
            self.num_ids += 1
            requests.append(Request(f"r{self.num_ids}", prompt, SamplingLimits(max_tokens, 0, ignore_eos, {EOS}),
                                    priority=priority, tenant=tenant, arrival_s=self.clock,
                                    cache_salt=salt))
        total = len(prompt) + max_tokens
        before = self._fingerprint()
        if total > config.max_model_len or s.blocks.blocks_for(total) > s.cache_config.num_blocks:
            expected = RequestTooLongError
        elif s.num_waiting + n > config.max_waiting:
            expected = QueueFullError
        else:
            expected = None
        if expected is not None:
            with pytest.raises(expected):
                s.add_group(requests)
            assert self._fingerprint() == before
            event(f"add_group: {expected.__name__}")
            return
        group = s.add_group(requests)
        shared = (len(prompt) - 1) // s.blocks.block_size * s.blocks.block_size
        assert (group is None) == (shared == 0)
        assert group is None or (group.members == requests and group.num_shared_tokens == shared)
        for request in requests:
            rid = request.request_id
            self.added[rid] = request
            self.shadow[rid] = RequestFSM(rid)
            self.client_tokens[rid] = []
        self.prompts.append(tuple(prompt))
        event("add_group")

    def _siblings(self, running: bool = False) -> list[str]:
        """Live members of request groups (only the running ones with `running`)."""
        return sorted(rid for rid, r in self.s.requests.items() if r.group is not None
                      and (not running or r.state is RUNNING))

    @precondition(lambda self: self.s is not None and self._siblings())
    @rule(data=st.data(), fail=st.booleans())
    def abort_sibling(self, data, fail: bool) -> None:
        """Abort (or fail) one member of a group: its siblings keep the blocks they
        share with it, and its own go back."""
        s = self.s
        rid = data.draw(st.sampled_from(self._siblings()), label="sibling")
        shared = set(s.blocks.tables.get(rid, ())) & {
            b for m in s.requests[rid].group.members if m.request_id != rid
            for b in s.blocks.tables.get(m.request_id, ())}
        e = s.fail_request(rid, "executor step failed") if fail else s.abort_request(rid)
        self._observe([e])
        held = {b for t in s.blocks.tables.values() for b in t}
        assert shared <= held, f"blocks {shared - held} shared with {rid}'s siblings were released"
        event("aborted a sibling holding shared blocks" if shared else "aborted a sibling")

    @precondition(lambda self: self.s is not None and self._siblings(running=True))
    @rule(data=st.data())
    def preempt_sibling(self, data) -> None:
        """The next preemption takes this running group member as its victim where
        the policy may pick it."""
        self.victim.request_id = data.draw(st.sampled_from(self._siblings(running=True)), label="victim")

    @precondition(lambda self: self.s is not None and self.s.requests)
    @rule(data=st.data())
    def add_duplicate(self, data) -> None:
        """A second request with a live id is refused and changes nothing."""
        rid = data.draw(st.sampled_from(sorted(self.s.requests)), label="live id")
        before = self._fingerprint()
        with pytest.raises(DuplicateRequestError, match=rid):
            self.s.add_request(Request(rid, [FILLER], arrival_s=self.clock))
        with pytest.raises(DuplicateRequestError, match=rid):
            self.s.add_request(self.added[rid])
        assert self._fingerprint() == before

    @precondition(lambda self: self.s is not None and self.s.requests)
    @rule(data=st.data(), fail=st.sampled_from([False, False, False, True]))
    def abort_live(self, data, fail: bool) -> None:
        """Abort (or fail) any live request: it completes now and frees its blocks."""
        rid = data.draw(st.sampled_from(sorted(self.s.requests)), label="live id")
        if fail:
            e = self.s.fail_request(rid, "executor step failed")
            assert (e.transition, e.finish_reason) == (E.FAIL, FinishReason.ERROR)
        else:
            e = self.s.abort_request(rid)
            assert (e.transition, e.finish_reason) == (E.ABORT, FinishReason.ABORT)
        self._observe([e])
        assert rid not in self.s.blocks.tables and self.s.policy.ordered().count(self.added[rid]) == 0

    @rule(data=st.data())
    def abort_unknown(self, data) -> None:
        """Aborting an id that is not live raises and changes nothing."""
        gone = sorted(self.completed)
        rid = data.draw(st.sampled_from(gone + ["never-added"]), label="dead id")
        before = self._fingerprint()
        with pytest.raises(RequestNotFoundError, match=rid):
            self.s.abort_request(rid)
        assert self._fingerprint() == before

    # ---- steps --------------------------------------------------------------
    @rule(data=st.data(), dt=st.sampled_from([0.0, 0.5, 1.0, 4.0]), hold=st.sampled_from([False, False, True]))
    def step(self, data, dt: float, hold: bool) -> None:
        """Schedule a step; answer the held step first (results come back in order),
        then answer this one now or hold it for one more step."""
        self.clock += dt
        plan = self._schedule()
        result = self._fabricate(data, plan)
        if self.held is not None:
            self._answer(*self.held)
            self.held = None
        if hold:
            self.held = (plan, result)
        else:
            self._answer(plan, result)

    @rule()
    def step_whose_result_is_lost(self) -> None:
        """Schedule a step whose result never arrives. The core stays consistent;
        requests awaiting that result are stuck until the shell declares the
        executor lost (done at the latest when the run is drained)."""
        plan = self._schedule()
        if self.held is not None:
            self._answer(*self.held)
            self.held = None
        if not plan.is_empty:
            self.lost.append(plan)

    @precondition(lambda self: self.s is not None and self.held is not None)
    @rule()
    def answer_held(self) -> None:
        """The held step's result arrives."""
        self._answer(*self.held)
        self.held = None

    @precondition(lambda self: self.s is not None and self.answered)
    @rule(data=st.data(), wrong_step=st.booleans())
    def replay_stale_result(self, data, wrong_step: bool) -> None:
        """A duplicated, stale or mislabelled result changes nothing."""
        plan, result = data.draw(st.sampled_from(self.answered[-4:]), label="answered step")
        if wrong_step:
            result = StepResult(plan.step_id + 1000, result.sampled_token_ids)
        assert self.s.take_events() == []
        before = self._fingerprint()
        assert self.s.update(plan, result) == []
        assert self._fingerprint() == before

    @precondition(lambda self: self.s is not None and self.held is not None)
    @rule()
    def mislabelled_result_for_the_held_step(self) -> None:
        """A result whose step id is not the plan's is ignored; the real one still counts."""
        plan, result = self.held
        before = self._fingerprint()
        assert self.s.update(plan, StepResult(plan.step_id - 1, result.sampled_token_ids)) == []
        assert self._fingerprint() == before

    @precondition(lambda self: self.s is not None)
    @rule()
    def executor_lost(self) -> None:
        """The executor dies: running requests go back to waiting, in-flight plans are void."""
        running = {r.request_id for r in self.s.running}
        events = self.s.executor_lost()
        self._observe(events)
        lost = {e.request_id for e in events if e.transition is E.EXECUTOR_LOST}
        assert lost == running
        assert not self.s.running and not self.s.blocks.tables and not self.s.blocks.cached
        if self.held is not None:
            self.answered.append(self.held)  # its result can only be stale now
            self.held = None
        self.lost.clear()
        self.executor.clear()

    def _schedule(self) -> StepPlan:
        s = self.s
        before = {rid: (r.state, r.num_computed_tokens, r.num_skips, len(r.output_token_ids))
                  for rid, r in s.requests.items()}
        made = []

        def move() -> list[RequestEvent]:
            made.append(s.schedule(self.clock))
            return list(s._events)
        in_flight = lambda: [self.held[0]] if self.held is not None else []  # noqa: E731
        report_families(cov.watch("schedule", s, in_flight, move), self.families)
        plan = made[0]
        events = s.take_events()
        self._observe(events)
        self._check_plan(plan, before, events)
        self._apply_to_executor(plan)
        return plan

    def _check_plan(self, plan: StepPlan, before: dict, events: list[RequestEvent]) -> None:
        """§4.7, §4.8 and §4.9 for one plan, plus the delta protocol's consistency."""
        s, config = self.s, self.s.config
        assert plan_within_budget(s, plan) == []
        assert group_prompt_computed_once(s, plan) == []
        scheduled = plan.num_scheduled_tokens
        assert plan.total_num_scheduled_tokens == sum(scheduled.values())
        new = {d.request_id: d for d in plan.new_requests}
        admitted_then_preempted = set(new) & set(plan.preempted_ids) - set(scheduled)
        assert not admitted_then_preempted, \
            f"admitted and preempted in one step: {admitted_then_preempted} (see the regression test below)"
        assert set(new) <= set(scheduled)
        assert set(plan.new_block_ids) <= set(scheduled)
        assert not set(plan.preempted_ids) & set(scheduled)
        assert set(plan.resumed_ids) == {rid for rid, d in new.items() if d.resumed}
        for rid, n in scheduled.items():
            request = s.requests[rid]
            assert request.state is RUNNING and request in s.running
            # Planned ahead, it has computed the position of the token still in flight.
            ahead = len(request.pending_steps) - 1 if config.async_scheduling else 0
            assert request.num_computed_tokens <= request.num_tokens + ahead
            if request.num_computed_tokens > request.num_tokens:
                event("family: overlap.request_in_two_plans")
            assert request.num_tokens <= config.max_model_len
            assert len(request.output_token_ids) < request.limits.max_tokens
            if rid in new:
                d = new[rid]
                assert d.num_computed_tokens + n == request.num_computed_tokens
                assert d.num_computed_tokens % s.blocks.block_size == 0
                assert list(d.token_ids) == request.all_token_ids and d.block_ids == s.blocks.tables[rid]
                assert d.resumed == (request.num_preemptions > 0)
                if not config.enable_chunked_prefill:
                    assert request.num_computed_tokens == request.num_tokens, "prompt split without chunking"
            else:
                state, computed, _, _ = before[rid]
                assert state is RUNNING and computed + n == request.num_computed_tokens
            if config.long_prefill_token_threshold:
                assert n <= config.long_prefill_token_threshold
        for rid in plan.preempted_ids:
            assert s.requests[rid].state is PENDING and s.requests[rid].num_computed_tokens == 0
        if plan.preempted_ids:
            event("preemption")
        if config.enable_batch_sorting:
            self._check_batch_order(plan)
        self._check_fcfs(before, events, plan)
        for r in s.policy.ordered():
            assert r.num_skips <= config.starvation_skip_limit

    def _check_batch_order(self, plan: StepPlan) -> None:
        requests = self.s.requests
        keys = []
        for rid, n in plan.num_scheduled_tokens.items():
            r = requests[rid]
            keys.append((0, 0) if n == 1 and r.num_computed_tokens > r.num_prompt_tokens else (1, -n))
        assert keys == sorted(keys), "batch sorting: decodes first, then prefills longest first"

    def _check_fcfs(self, before: dict, events: list[RequestEvent], plan: StepPlan) -> None:
        """§4.9: a request admitted past an earlier one of its class means the earlier
        one did not fit, and the skip was counted (the starvation bound needs it)."""
        s = self.s
        if not fcfs_checked(s):
            return
        admitted = [e.request_id for e in events if e.transition is E.ADMIT]
        for x in admitted:
            rx = s.requests.get(x)
            if rx is None or rx.state is not RUNNING:
                continue
            for y, (state, _, skips, _) in before.items():
                ry = s.requests.get(y)
                if (state is not PENDING or ry is None or ry.state is not PENDING or y == x
                        or class_of(s, ry) != class_of(s, rx) or not ry.arrival_s < rx.arrival_s
                        or self._waits_for_sibling(ry, before, plan)):
                    continue
                assert ry.num_skips == skips + 1, f"{x} admitted before earlier {y} without a counted skip"
                event("admitted past an earlier request that did not fit")

    def _waits_for_sibling(self, request: Request, before: dict, plan: StepPlan) -> bool:
        """Whether a waiting group member may have waited, uncounted as a skip, for a
        sibling computing the shared prompt in this step: one running with less than
        the shared prompt computed when the step began or when it was admitted in it,
        or one preempted in it."""
        group = request.group
        if group is None:
            return False
        shared, scheduled = group.num_shared_tokens, plan.num_scheduled_tokens
        for m in group.members:
            rid = m.request_id
            if m is request:
                continue
            if m.state is RUNNING and m.num_computed_tokens - scheduled.get(rid, 0) < shared:
                return True
            if rid in plan.preempted_ids and before[rid][1] < shared:
                return True
        return False

    def _apply_to_executor(self, plan: StepPlan) -> None:
        """The executor's batch, built only from plan deltas, matches the core's tables."""
        for rid in (*plan.finished_ids, *plan.preempted_ids):
            self.executor.pop(rid, None)
        for d in plan.new_requests:
            self.executor[d.request_id] = list(d.block_ids)
        for rid, blocks in plan.new_block_ids.items():
            self.executor[rid].extend(blocks)
        tables = self.s.blocks.tables
        assert set(self.executor) == {r.request_id for r in self.s.running}
        for rid, blocks in self.executor.items():
            assert blocks == tables[rid], f"executor's table for {rid} is {blocks}, core's {tables[rid]}"

    def _fabricate(self, data, plan: StepPlan) -> StepResult:
        # A chunk that reaches the known tokens samples; so does a decode planned
        # ahead (async scheduling), which computes the position of a token in flight.
        sampling = [rid for rid in plan.num_scheduled_tokens
                    if self.s.requests[rid].num_computed_tokens >= self.s.requests[rid].num_tokens]
        tokens = data.draw(st.lists(SAMPLED, min_size=len(sampling), max_size=len(sampling)), label="tokens")
        return StepResult(plan.step_id, {rid: [t] for rid, t in zip(sampling, tokens)})

    def _answer(self, plan: StepPlan, result: StepResult) -> None:
        events = self.s.update(plan, result)
        self._observe(events)
        self.answered.append((plan, result))
        del self.answered[:-8]

    # ---- invariants ---------------------------------------------------------
    @invariant()
    def core_invariants_hold(self) -> None:
        """§4 items 1-8 through the shared predicates."""
        if self.s is not None:
            found = violations(self.s)
            assert not found, found

    @invariant()
    def observers_agree_with_the_core(self) -> None:
        """§4.10: the shadow FSMs (fed only events) match the core; each request
        completes at most once; clients saw exactly the generated tokens."""
        s = self.s
        if s is None:
            return
        assert set(s.requests) == {rid for rid in self.added if not self.completed[rid]}
        for rid, request in self.added.items():
            assert self.shadow[rid].state is request.state
            assert self.client_tokens[rid] == request.output_token_ids
            assert self.completed[rid] == (1 if request.is_finished else 0)
        stats = s.stats()
        assert stats.num_requests_added == len(self.added)
        assert stats.num_requests_completed == sum(self.completed.values())
        assert stats.num_running == len(s.running) and stats.num_waiting == len(s.policy)

    @invariant()
    def waiting_order_is_fcfs_within_a_class(self) -> None:
        """§4.9 for the queue: within a class, the policy's order is arrival order."""
        s = self.s
        if s is None or not fcfs_checked(s):
            return
        last: dict = {}
        for r in s.policy.ordered():
            cls = class_of(s, r)
            assert last.get(cls, r.arrival_s) <= r.arrival_s, f"{r.request_id} queued before an earlier arrival"
            last[cls] = r.arrival_s

    # ---- the end ------------------------------------------------------------
    def teardown(self) -> None:
        """Drain: step until nothing is live, bounded; then every request has
        completed exactly once and no block is referenced."""
        s = self.s
        if s is not None:
            cov.hypothesis_target(self.families)
        if s is None or sys.exc_info()[0] is not None:
            return  # set-up never ran, or the run already failed: draining would only add noise
        if self.held is not None:
            self._answer(*self.held)
            self.held = None
        if self.lost:
            self.executor_lost()  # how the shell recovers from a result that never came
        bound = 50 + 10 * sum(r.num_tokens + r.limits.max_tokens for r in s.requests.values())
        for _ in range(bound):
            if not s.has_work():
                break
            self.clock += 1.0
            plan = self._schedule()
            # An empty plan is fine only if it completed the rest (late requests rejected).
            assert not plan.is_empty or not s.has_work(), \
                f"deadlock: nothing scheduled while {list(s.requests.values())} are live"
            self._answer(plan, StepResult(plan.step_id, {
                rid: [FILLER] for rid in plan.num_scheduled_tokens
                if s.requests[rid].num_computed_tokens == s.requests[rid].num_tokens}))
        assert not s.has_work(), f"no quiescence after {bound} steps: {list(s.requests.values())}"
        assert all(self.completed[rid] == 1 for rid in self.added)
        assert not s.running and len(s.policy) == 0 and not s.blocks.tables
        assert all(c == 0 for c in s.blocks.ref_counts)
        assert s.blocks.num_free_blocks == s.blocks.num_blocks
        assert violations(s) == []
        event(f"drained {len(self.added)} requests")


SETTINGS = settings(max_examples=examples(150), stateful_step_count=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def machine_for(policy: str) -> type[SchedulerMachine]:
    """The state machine bound to one policy."""
    machine = type(f"SchedulerMachine_{policy.replace('-', '_')}", (SchedulerMachine,), {"policy": policy})
    machine.TestCase.settings = SETTINGS
    return machine


TestFcfs = machine_for("fcfs").TestCase
TestPriority = machine_for("priority").TestCase
TestStrictPriority = machine_for("strict-priority").TestCase
TestDeadline = machine_for("deadline").TestCase
TestFair = machine_for("fair").TestCase
TestWeighted = machine_for("weighted").TestCase


# ---- shrunk failures of the machine above, as plain regression tests ------------

def test_regression_a_request_is_never_admitted_and_preempted_in_one_step():
    """Shrunk from the priority machine: aging puts l first and l is admitted; h,
    of strictly higher priority but behind l in the aged order, must not then
    preempt l within the same schedule(). (It did: l stayed in plan.new_requests
    with block ids given to h, was also in plan.preempted_ids, and its skip went
    uncounted.)"""
    s = make_scheduler("priority", num_blocks=4, block_size=4, aging_steps=10)
    s.add_request(make_request("l", 12, max_tokens=4, priority=1, arrival_s=0.0))  # key 10
    s.step_id = 15  # h arrives 15 steps later
    s.add_request(make_request("h", 8, max_tokens=4, priority=0, arrival_s=15.0))  # key 15
    plan = s.schedule(16.0)
    new = [d.request_id for d in plan.new_requests]
    assert set(new) <= set(plan.num_scheduled_tokens), (new, plan.preempted_ids)
    assert not set(new) & set(plan.preempted_ids)
    assert s.stats().num_preemptions == 0


def test_threshold_does_not_split_prompts_without_chunking():
    """Without chunked prefill a prompt is computed in one step whatever the threshold,
    or the configuration is refused."""
    s = make_scheduler(enable_chunked_prefill=False, long_prefill_token_threshold=2,
                       max_num_batched_tokens=64, max_model_len=64)
    s.add_request(make_request("p", 3, max_tokens=1))
    plan, _ = step(s)
    assert plan.num_scheduled_tokens == {"p": 3}


def test_regression_a_step_may_be_empty_because_it_rejected_everything_left():
    """Shrunk from the deadline machine: a drain step that rejects every late request
    schedules nothing, yet leaves nothing live, so it is not a deadlock."""
    s = make_scheduler("deadline", reject_late=True, default_deadline_s=1.0, max_num_seqs=1)
    for rid in ("r1", "r2", "r3"):
        s.add_request(make_request(rid, 1, max_tokens=1, arrival_s=0.0))
    plan, events = step(s, now_s=1.0)
    assert list(plan.num_scheduled_tokens) == ["r1"]
    plan, events = step(s, now_s=2.0)
    assert plan.is_empty and not s.has_work()
    assert [(e.request_id, e.finish_reason) for e in events] == [
        ("r2", FinishReason.REJECTED), ("r3", FinishReason.REJECTED)]
