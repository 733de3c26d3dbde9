"""Hypothesis state machines that drive the real scheduling core.

`SchedulerStateMachine` plays clients and executor at random: submissions with
shared prefixes, priorities and tenants, request groups (`n` in 2..4 sharing
one prompt), aborts, failures, plans (several in flight), results with or
without end-of-sequence tokens, stale results, and executor loss, with or
without async scheduling (drawn per run: a decode planned before its token
arrives, answers in any order); single members of a group are aborted, failed,
or made the victim of the next preemption. After every move it checks the
invariants of DESIGN §4 and that the move refines the reference spec
(`cadence.spec.refinement`); at the
end it validates the recorded trace (`cadence.spec.trace`) and item 9. Each
move reports the behaviour families it exercised (`cadence.spec.coverage`)
through `hypothesis.event`, and the number reached through `target`. With
`draw_config`, each run draws its own limits first, tight ones included: more
seats than budget tokens, a budget below one prompt, few blocks.

It is parameterised by configuration and policy, so a user checks their own
policy the way they would test a store against a published state machine:

    from cadence.spec.stateful import scheduler_state_machine
    from cadence.statemachine.config import SchedulerConfig

    TestMyPolicy = scheduler_state_machine(
        SchedulerConfig(policy="mypkg.policies:MyPolicy", max_num_seqs=4)).TestCase

or subclass `SchedulerStateMachine` and set `config`, `cache_config` and
`make_policy`.
"""

from __future__ import annotations

import os
from typing import Callable

import attrs
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cadence.statemachine.config import CacheConfig, SchedulerConfig
from cadence.statemachine.fsm import RequestState
from cadence.statemachine.plan import StepPlan, StepResult
from cadence.statemachine.policy import SchedulingPolicy

from . import coverage as cov
from .invariants import fcfs_within_class
from .harness import Harness, VictimPreference
from .refinement import CheckedHarness, _diff
from .trace import validate_trace

SMALL_CONFIG = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=8, max_model_len=12,
                               aging_steps=3, default_deadline_s=6.0, starvation_skip_limit=3,
                               admission_headroom_steps=1)
SMALL_CACHE = CacheConfig(num_blocks=7, block_size=2)

# A few shared prefixes so the prefix cache hits, shares and evicts blocks.
PREFIXES = ((), (1, 2), (1, 2, 3, 4), (5, 6))


def state_machine_settings(max_examples: int | None = None) -> settings:
    """Settings for the scheduler state machines: no deadline, long runs; more
    and randomised examples with CADENCE_EXPLORE=1."""
    explore = os.environ.get("CADENCE_EXPLORE") == "1"
    n = max_examples if max_examples is not None else (2000 if explore else 60)
    return settings(max_examples=n, stateful_step_count=60 if explore else 40, deadline=None,
                    derandomize=not explore and bool(os.environ.get("CI")),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


class SchedulerStateMachine(RuleBasedStateMachine):
    """Random moves on the real core, each checked against the spec and the invariants.

    Class attributes to override: `config`, `cache_config`, `make_policy` (a
    callable from config to a policy object, or None to build `config.policy`),
    `max_inflight`, `priorities`, `tenants`.
    """

    config: SchedulerConfig = SMALL_CONFIG
    cache_config: CacheConfig = SMALL_CACHE
    make_policy: Callable[[SchedulerConfig], SchedulingPolicy] | None = None
    max_inflight: int = 2
    priorities: tuple[int, ...] = (0, 1, 2)
    tenants: tuple[str, ...] = ("a", "b")
    draw_config: bool = False
    async_scheduling: bool | None = None
    """None: each run draws whether plans overlap (decodes planned ahead)."""

    def __init__(self) -> None:
        super().__init__()
        self._build()
        self.answered: list = []
        self.families: set[str] = set()

    def _build(self) -> None:
        factory = type(self).make_policy
        policy = factory(self.config) if factory is not None else None
        self.h = CheckedHarness(self.config, self.cache_config, policy, record=True)
        self.victim = VictimPreference(self.h.scheduler.policy)

    def _watch(self, kind: str, move, plan=None):
        """Make a move, reporting the families it exercised to Hypothesis."""
        h = self.h

        def run() -> list:
            got = move()
            return got if isinstance(got, list) else h.last_events
        found = cov.watch(kind, h.scheduler, lambda: [f.plan for f in h.inflight], run, plan)
        cov.hypothesis_report(found, self.families)

    # ---- clients -------------------------------------------------------------------
    @initialize(data=st.data())
    def start(self, data) -> None:
        """Begin with an empty engine, with or without async scheduling (drawn
        unless the class fixes it); with `draw_config`, under limits drawn now:
        seats up to twice the budget, budgets down to one token, few blocks."""
        draw = data.draw
        if self.draw_config:
            budget = draw(st.sampled_from([1, 2, 2, 3, 4, 6]), label="max_num_batched_tokens")
            # Half the runs have more seats than budget tokens.
            over = draw(st.booleans(), label="more seats than budget tokens")
            seats = budget + draw(st.integers(1, 3)) if over else draw(st.integers(1, budget))
            self.config = attrs.evolve(
                self.config, max_num_seqs=seats, max_num_batched_tokens=budget,
                enable_chunked_prefill=True,
                admission_headroom_steps=draw(st.sampled_from([0, 0, 1, 4]), label="headroom"),
                admission_delay_budget=draw(st.sampled_from([0, 0, 4, 12]), label="delay budget"))
            # The prompt bound beside decodes, the burst split and the finish hold (the
            # CPU server's pair) ride on the delay budget's draw (draws of their own
            # would move the derandomized runs off the families they reach); at 12 the
            # bound gives way to any queue it would take more than a step to admit; at 4
            # it is at least half the longest prompt waiting or begun.
            budget = self.config.admission_delay_budget
            self.config = attrs.evolve(self.config, mixed_prefill_tokens=budget // 4,
                                       mixed_prefill_per_decode=1.0,
                                       mixed_prefill_drain_steps=1 if budget == 12 else 16,
                                       mixed_prefill_chunks=2 if budget == 4 else 0,
                                       admission_burst_split=2 if budget == 4 else 0,
                                       admission_finish_hold_steps=2 if budget == 4 else 0)
            full = -(-self.config.max_model_len // self.cache_config.block_size)
            self.cache_config = attrs.evolve(
                self.cache_config, num_blocks=draw(st.integers(full, full + 4), label="num_blocks"))
        overlap = self.async_scheduling
        if overlap is None:
            overlap = draw(st.booleans(), label="async_scheduling")
        event(f"async_scheduling: {overlap}")
        if self.draw_config or overlap != self.config.async_scheduling:
            self.config = attrs.evolve(self.config, async_scheduling=overlap)
            self._build()

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(2, 9), min_size=1, max_size=5),
          max_tokens=st.integers(1, 4), priority=st.data(), tenant=st.data(),
          deadline=st.one_of(st.none(), st.integers(0, 8)), min_tokens=st.integers(0, 1),
          ignore_eos=st.booleans())
    def add(self, prefix, tail, max_tokens, priority, tenant, deadline, min_tokens, ignore_eos):
        """A client submits a request (refused ones change nothing)."""
        prio = priority.draw(st.sampled_from(self.priorities))
        ten = tenant.draw(st.sampled_from(self.tenants))
        self.h.add(None, prefix + tuple(tail), max_tokens, priority=prio, tenant=ten,
                   deadline_after_s=deadline, min_tokens=min(min_tokens, max_tokens),
                   ignore_eos=ignore_eos)

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(2, 9), min_size=1, max_size=4),
          n=st.integers(2, 4), max_tokens=st.integers(1, 4), priority=st.data(), tenant=st.data(),
          ignore_eos=st.booleans())
    def add_group(self, prefix, tail, n, max_tokens, priority, tenant, ignore_eos):
        """A client asks for `n` samples of one prompt: a request group."""
        prio = priority.draw(st.sampled_from(self.priorities))
        ten = tenant.draw(st.sampled_from(self.tenants))
        self.h.add_group(prefix + tuple(tail), n, max_tokens, priority=prio, tenant=ten,
                         ignore_eos=ignore_eos)

    def _siblings(self, running: bool = False) -> list[str]:
        """Live members of request groups (only the running ones with `running`)."""
        return sorted(rid for rid, r in self.h.scheduler.requests.items() if r.group is not None
                      and (not running or r.state is RequestState.RUNNING))

    @precondition(lambda self: self._siblings())
    @rule(data=st.data(), kind=st.sampled_from(["abort", "abort", "fail"]))
    def cancel_sibling(self, data, kind):
        """One member of a group is aborted or fails; the others go on with their blocks."""
        rid = data.draw(st.sampled_from(self._siblings()))
        self._watch(kind, lambda: getattr(self.h, kind)(rid))

    @precondition(lambda self: self._siblings(running=True))
    @rule(data=st.data())
    def preempt_sibling(self, data):
        """The executor's memory runs short for one running group member: the next
        preemption (growth under pressure, or a displacement) takes it as its
        victim where the policy may pick it."""
        self.victim.request_id = data.draw(st.sampled_from(self._siblings(running=True)))

    @precondition(lambda self: self.h.scheduler.requests)
    @rule(data=st.data(), kind=st.sampled_from(["abort", "abort", "fail"]))
    def cancel(self, data, kind):
        """A client aborts a request, or the executor reports it failed."""
        rid = data.draw(st.sampled_from(sorted(self.h.scheduler.requests)))
        self._watch(kind, lambda: getattr(self.h, kind)(rid))

    # ---- executor ------------------------------------------------------------------
    @precondition(lambda self: len(self.h.inflight) < self.max_inflight)
    @rule()
    def schedule(self):
        """Plan a step without answering it yet."""
        self._watch("schedule", self.h.schedule)

    @precondition(lambda self: self.h.inflight)
    @rule(data=st.data())
    def complete(self, data):
        """Answer one plan in flight, some sampled requests drawing end-of-sequence."""
        index = data.draw(st.integers(0, len(self.h.inflight) - 1)) if self.max_inflight > 1 else 0
        flight = self.h.inflight[index]
        eos = data.draw(st.lists(st.sampled_from(flight.samplers), unique=True)) \
            if flight.samplers else []
        self.answered.append(flight.plan)
        self._watch("result", lambda: self.h.complete(eos, index), flight.plan)

    @precondition(lambda self: self.h.inflight and self.max_inflight > 1
                  and self.config.async_scheduling)
    @rule(eos=st.booleans())
    def overtake(self, eos):
        """Plan one more step if there is room, then answer the newest plan before
        the older ones (with async scheduling the core holds that answer back when
        an older plan samples for the same request)."""
        if len(self.h.inflight) < self.max_inflight:
            self._watch("schedule", self.h.schedule)
        if len(self.h.inflight) < 2:
            return
        index = len(self.h.inflight) - 1
        flight = self.h.inflight[index]
        self.answered.append(flight.plan)
        self._watch("result", lambda: self.h.complete(flight.samplers[:1] if eos else [], index),
                    flight.plan)

    @precondition(lambda self: self.answered)
    @rule(data=st.data())
    def stale_result(self, data):
        """A duplicated or late result changes nothing."""
        plan = data.draw(st.sampled_from(self.answered[-4:]))
        checker = self.h.checker
        before = checker.state(self.h)
        self._watch("duplicate", lambda: self.h.scheduler.update(
            plan, StepResult(plan.step_id, {r: [1] for r in plan.num_scheduled_tokens})))
        problems = _diff("stale result", before, checker.state(self.h))
        assert not problems, problems

    @rule(eos=st.booleans())
    def step(self, eos):
        """Plan a step and answer it at once, the common case."""
        if len(self.h.inflight) < self.max_inflight:
            self._watch("schedule", self.h.schedule)
        if self.h.inflight:
            flight = self.h.inflight[0]
            self.answered.append(flight.plan)
            self._watch("result", lambda: self.h.complete(flight.samplers[:1] if eos else [], 0),
                        flight.plan)

    @rule(roll=st.integers(0, 3))
    def executor_lost(self, roll):
        """The executor dies (on one roll in four, to leave runs time to build up)."""
        if roll == 0:
            self._watch("lost", self.h.executor_lost)

    # ---- whole-run checks ----------------------------------------------------------
    @invariant()
    def trace_is_valid(self):
        """The recorded trace so far is one the spec can take."""
        # Validating the whole trace each step is quadratic; it is short here.
        validate_trace(self.h.records, max_model_len=self.config.max_model_len,
                       max_num_seqs=self.config.max_num_seqs, stop_token_ids={0})

    def teardown(self):
        """Item 9 over the whole run; the families it reached go to `target`."""
        cov.hypothesis_target(self.families)
        c = self.config
        found = fcfs_within_class(
            self.h.records, self.cache_config.block_size,
            prefix_caching=self.cache_config.enable_prefix_caching,
            chunked_prefill=c.enable_chunked_prefill,
            class_of=_trace_class(c.policy))
        assert not found, found


class MirroredHarness(CheckedHarness):
    """A `CheckedHarness` whose every move is made on shadow harnesses too, one
    per policy in `shadows`, each asserted to decide exactly as this one: the
    same plans (entries in the same order), events and refusals. The identities
    `fair` with one tenant, `priority` with one priority and `deadline` with no
    deadlines against `fcfs` are checked this way."""

    def __init__(self, config, cache_config, shadows: tuple[str, ...], **kw) -> None:
        super().__init__(config, cache_config, **kw)
        self.shadows = {name: Harness(attrs.evolve(config, policy=name), cache_config)
                        for name in shadows}

    def _mirror(self, move: str, mine, *args, **kw):
        for name, shadow in self.shadows.items():
            theirs = getattr(shadow, move)(*args, **kw)
            same = _same_decision(mine, theirs) and shadow.last_events == self.last_events
            assert same, (f"{move}{args}: {name} decided {theirs!r} with events "
                          f"{shadow.last_events}; {self.scheduler.config.policy} decided "
                          f"{mine!r} with events {self.last_events}")
        return mine

    def add(self, request_id=None, prompt=(1, 2, 3), max_tokens=2, **kw) -> bool:
        rid = self.fresh_id() if request_id is None else request_id
        return self._mirror("add", super().add(rid, prompt, max_tokens, **kw), rid, prompt,
                            max_tokens, **kw)

    def add_group(self, prompt=(1, 2, 3), n=2, max_tokens=2, **kw) -> bool:
        return self._mirror("add_group", super().add_group(prompt, n, max_tokens, **kw),
                            prompt, n, max_tokens, **kw)

    def abort(self, request_id: str) -> None:
        return self._mirror("abort", super().abort(request_id), request_id)

    def fail(self, request_id: str) -> None:
        return self._mirror("fail", super().fail(request_id), request_id)

    def executor_lost(self) -> None:
        return self._mirror("executor_lost", super().executor_lost())

    def schedule(self):
        return self._mirror("schedule", super().schedule())

    def complete(self, eos=(), index: int = 0) -> list:
        eos = list(eos)
        return self._mirror("complete", super().complete(eos, index), eos, index)

    def redeliver(self) -> list:
        return self._mirror("redeliver", super().redeliver())


def _same_decision(mine, theirs) -> bool:
    """Equal results of a move; plans also with their entries in the same order."""
    if isinstance(mine, StepPlan):
        return mine == theirs and list(mine.num_scheduled_tokens) == list(theirs.num_scheduled_tokens)
    return mine == theirs


class _Victims:
    """`VictimPreference` on several harnesses at once (the main one and its shadows)."""

    def __init__(self, harnesses) -> None:
        self._all = [VictimPreference(h.scheduler.policy) for h in harnesses]

    @property
    def request_id(self):
        return self._all[0].request_id

    @request_id.setter
    def request_id(self, value) -> None:
        for v in self._all:
            v.request_id = value


class PolicyIdentityMachine(SchedulerStateMachine):
    """`fcfs` driven as `SchedulerStateMachine` drives it, with one tenant, one
    priority and no deadlines, while `fair`, `priority` and `deadline` shadow
    every move: each must make exactly fcfs's decisions (`MirroredHarness`)."""

    config = attrs.evolve(SMALL_CONFIG, policy="fcfs")
    priorities = (1,)
    tenants = ("a",)
    shadow_policies: tuple[str, ...] = ("fair", "priority", "deadline")

    def _build(self) -> None:
        self.h = MirroredHarness(self.config, self.cache_config, self.shadow_policies, record=True)
        self.victim = _Victims([self.h, *self.h.shadows.values()])

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(2, 9), min_size=1, max_size=5),
          max_tokens=st.integers(1, 4), min_tokens=st.integers(0, 1), ignore_eos=st.booleans())
    def add(self, prefix, tail, max_tokens, min_tokens, ignore_eos):
        """A client submits a request without a deadline."""
        self.h.add(None, prefix + tuple(tail), max_tokens, priority=self.priorities[0],
                   tenant=self.tenants[0], min_tokens=min(min_tokens, max_tokens),
                   ignore_eos=ignore_eos)


def _trace_class(policy: str):
    if policy == "deadline":
        # Deadlines are not in the trace; under earliest-deadline-first only
        # requests with equal slack would be ordered by arrival.
        return lambda add: (add["priority"], add["tenant"], add["request_id"])
    return None


def scheduler_state_machine(config: SchedulerConfig | None = None,
                            cache_config: CacheConfig | None = None,
                            make_policy: Callable[[SchedulerConfig], SchedulingPolicy] | None = None,
                            *, max_inflight: int = 2, name: str | None = None,
                            max_examples: int | None = None,
                            draw_config: bool = False,
                            async_scheduling: bool | None = None) -> type[SchedulerStateMachine]:
    """A `SchedulerStateMachine` subclass for one configuration; use its `.TestCase`.
    `draw_config`: each run draws tight limits first (see `SchedulerStateMachine.start`);
    `async_scheduling`: fixed on or off (None: drawn per run)."""
    attrs_ = {"config": config or SMALL_CONFIG, "cache_config": cache_config or SMALL_CACHE,
              "make_policy": make_policy, "max_inflight": max_inflight,
              "draw_config": draw_config, "async_scheduling": async_scheduling}
    cls = type(name or f"StateMachine_{(config or SMALL_CONFIG).policy}",
               (SchedulerStateMachine,), attrs_)
    cls.TestCase.settings = state_machine_settings(max_examples)
    return cls
