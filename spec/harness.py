"""A driver for the real scheduling core, playing clients and executor.

`Harness` wraps a `cadence.statemachine.scheduler.Scheduler` and offers the
moves an environment can make: add, abort or fail a request, plan a step,
deliver a plan's result (choosing which sampled tokens are end-of-sequence),
lose the executor. The explorer, the Hypothesis state machines and every
counterexample the checkers print use these same moves, so a printed trace
replays exactly what was checked.

Time is the step counter: a request added before plan k arrives at `k`, and
plan k is made at `now_s = k`.
"""

from __future__ import annotations

import copy
import itertools
import operator
from typing import Iterable, Sequence

import attrs

from cadence.statemachine.config import CacheConfig, SchedulerConfig
from cadence.statemachine.errors import InvalidRequestError, QueueFullError
from cadence.statemachine.fsm import RequestEventKind
from cadence.statemachine.plan import StepPlan, StepResult
from cadence.statemachine.policy import FairPolicy, KeyedPolicy, SchedulingPolicy
from cadence.statemachine.request import Request, RequestGroup, SamplingLimits
from cadence.statemachine.scheduler import Scheduler

from .trace import TraceRecorder

EOS_TOKEN = 0
"""The token the harness samples for a request chosen to stop."""
TOKEN = 1
"""The token the harness samples otherwise."""


class InFlight:
    """A plan handed to the executor and not yet answered.

    `samplers` are the requests whose scheduled chunk reaches the end of their
    tokens, so the executor samples one token for each of them. With async
    scheduling a decode planned ahead computes the position of a token still in
    flight (its computed count passes its known tokens): it samples too, so a
    request in two plans in flight gets one token from each.
    """

    __slots__ = ("plan", "samplers")

    def __init__(self, plan: StepPlan, samplers: tuple[str, ...]) -> None:
        self.plan = plan
        self.samplers = samplers


class VictimPreference:
    """Installed as a policy's `victim`: the next preemption takes the request named
    in `request_id` when it is among the candidates (once), else the policy's
    own choice. The environment's way to make one request, say one member of a
    request group, lose its blocks when memory runs short."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.request_id: str | None = None
        self._choose = policy.victim
        policy.victim = self

    def __call__(self, running):
        for request in running:
            if request.request_id == self.request_id:
                self.request_id = None
                return request
        return self._choose(running)


class Harness:
    """The real scheduler plus the environment's view of it (plans in flight, ids, trace).

    `record=True` keeps a trace in the format `cadence.spec.trace` validates;
    `async_scheduling` (when not None) sets that option of `config`: plans may
    then overlap, a decoding request planned before its token arrives.
    """

    def __init__(self, config: SchedulerConfig | None = None,
                 cache_config: CacheConfig | None = None,
                 policy: SchedulingPolicy | None = None, *, record: bool = False,
                 async_scheduling: bool | None = None) -> None:
        if async_scheduling is not None:
            config = attrs.evolve(config or SchedulerConfig(), async_scheduling=async_scheduling)
        self.scheduler = Scheduler(config, cache_config, policy)
        self.inflight: list[InFlight] = []
        self.num_added = 0
        self.recorder: TraceRecorder | None = TraceRecorder() if record else None
        self.last_events: list = []
        # The last plan answered or voided by executor loss, with what was sampled:
        # `redeliver` sends its result again.
        self.last_answered: tuple[StepPlan, dict] | None = None

    # ---- queries -----------------------------------------------------------------
    @property
    def tick(self) -> int:
        """The time (and step id) of the next plan."""
        return self.scheduler.step_id

    @property
    def records(self) -> list[dict]:
        """The trace recorded so far (empty when not recording)."""
        return self.recorder.records if self.recorder is not None else []

    def state_of(self, request_id: str) -> str:
        """'pending', 'running', or 'gone' once the request completed."""
        request = self.scheduler.requests.get(request_id)
        return "gone" if request is None else request.state.value

    def violations(self) -> list[str]:
        """Every state invariant of DESIGN §4 that fails now."""
        from .invariants import violations
        return violations(self.scheduler)

    def fresh_id(self) -> str:
        """An id no request of this harness has used."""
        return f"r{self.num_added}"

    # ---- moves -------------------------------------------------------------------
    def add(self, request_id: str | None = None, prompt: Sequence[int] = (1, 2, 3),
            max_tokens: int = 2, *, priority: int = 0, tenant: str = "a",
            deadline_after_s: float | None = None, min_tokens: int = 0,
            ignore_eos: bool = False) -> bool:
        """Submit a request arriving now; False (nothing changes) if the core refuses it.

        `deadline_after_s` sets an explicit deadline relative to arrival.
        """
        rid = self.fresh_id() if request_id is None else request_id
        limits = SamplingLimits(max_tokens=max_tokens, min_tokens=min_tokens,
                                ignore_eos=ignore_eos, eos_token_ids=frozenset({EOS_TOKEN}))
        now = float(self.tick)
        deadline = None if deadline_after_s is None else now + deadline_after_s
        request = Request(rid, list(prompt), limits, priority=priority, tenant=tenant,
                          deadline_s=deadline, arrival_s=now)
        self.num_added += 1
        try:
            self.scheduler.add_request(request)
        except (QueueFullError, InvalidRequestError):
            return False
        # The canonical key ages requests by arrival_s alone: it stands for the
        # arrival step the priority policy ages by only while the two agree.
        assert request.arrival_step == now, (request.arrival_step, now)
        self._record(self.tick, rid, "add", prompt_len=len(prompt), max_tokens=max_tokens,
                     priority=priority, tenant=tenant)
        return True

    def add_group(self, prompt: Sequence[int] = (1, 2, 3), n: int = 2, max_tokens: int = 2, *,
                  priority: int = 0, tenant: str = "a", deadline_after_s: float | None = None,
                  min_tokens: int = 0, ignore_eos: bool = False) -> bool:
        """Submit `n` requests with one prompt as a group (`Scheduler.add_group`),
        arriving now, with fresh ids; False (nothing changes) if the core refuses them."""
        limits = SamplingLimits(max_tokens=max_tokens, min_tokens=min_tokens,
                                ignore_eos=ignore_eos, eos_token_ids=frozenset({EOS_TOKEN}))
        now = float(self.tick)
        deadline = None if deadline_after_s is None else now + deadline_after_s
        requests = []
        for _ in range(n):
            requests.append(Request(self.fresh_id(), list(prompt), limits, priority=priority,
                                    tenant=tenant, deadline_s=deadline, arrival_s=now))
            self.num_added += 1
        try:
            self.scheduler.add_group(requests)
        except (QueueFullError, InvalidRequestError):
            return False
        group = requests[0].group
        extra = {} if group is None else {"group": group.group_id}
        for request in requests:
            self._record(self.tick, request.request_id, "add", prompt_len=len(prompt),
                         max_tokens=max_tokens, priority=priority, tenant=tenant, **extra)
        return True

    def abort(self, request_id: str) -> None:
        """A client cancels a live request."""
        event = self.scheduler.abort_request(request_id)
        self.last_events = [event]
        self._record_events(self.tick, [event])

    def fail(self, request_id: str) -> None:
        """The executor reports that a live request failed."""
        event = self.scheduler.fail_request(request_id, "executor error")
        self.last_events = [event]
        self._record_events(self.tick, [event])

    def executor_lost(self) -> None:
        """The executor dies: plans in flight are void."""
        events = self.scheduler.executor_lost()
        if self.inflight:
            flight = self.inflight[-1]
            self.last_answered = (flight.plan, {rid: [TOKEN] for rid in flight.samplers})
        self.inflight.clear()
        self.last_events = events
        self._record_events(self.tick, events)

    def schedule(self) -> StepPlan:
        """Plan the next step at `now_s = tick` and hand it to the executor."""
        s = self.scheduler
        plan = s.schedule(float(s.step_id))
        requests = s.requests
        samplers = tuple(rid for rid in plan.num_scheduled_tokens
                         if requests[rid].num_computed_tokens >= requests[rid].num_tokens)
        if not plan.is_empty:
            self.inflight.append(InFlight(plan, samplers))
        self.last_events = s.take_events()
        self._record_events(plan.step_id, self.last_events)
        return plan

    def complete(self, eos: Iterable[str] = (), index: int = 0) -> list:
        """Deliver the result of the `index`-th oldest plan in flight; requests in
        `eos` sample the end-of-sequence token, the others a plain one. Any plan
        may be answered first: the core holds an answer that overtook an older
        plan sampling for the same request until that one's comes."""
        flight = self.inflight.pop(index)
        stop = set(eos)
        sampled = {rid: [EOS_TOKEN if rid in stop else TOKEN] for rid in flight.samplers}
        events = self.scheduler.update(flight.plan, StepResult(flight.plan.step_id, sampled))
        self.last_answered = (flight.plan, sampled)
        self.last_events = events
        self._record_events(flight.plan.step_id, events)
        return events

    def redeliver(self) -> list:
        """The executor sends the last answered (or voided) plan's result again: a
        duplicated or stale result, which the core must ignore."""
        plan, sampled = self.last_answered
        events = self.scheduler.update(plan, StepResult(plan.step_id, sampled))
        self.last_events = events
        self._record_events(plan.step_id, events)
        return events

    def step(self, eos: Iterable[str] = ()) -> StepPlan:
        """Plan a step and deliver its result at once (no pipelining)."""
        plan = self.schedule()
        before = self.last_events
        if not plan.is_empty:
            self.complete(eos, len(self.inflight) - 1)
            self.last_events = before + self.last_events
        return plan

    def run_until_idle(self, max_steps: int = 1000) -> int:
        """Step with no end-of-sequence tokens until no request is live; return the steps taken."""
        for n in itertools.count():
            if not self.scheduler.has_work() or n >= max_steps:
                return n
            self.step()
        raise AssertionError("unreachable")

    # ---- snapshots ---------------------------------------------------------------
    def clone(self, *, stats: bool = True) -> "Harness":
        """An independent copy, much faster than `copy.deepcopy` (`stats=False`:
        the statistics collector is shared, see `clone_scheduler`)."""
        new = Harness.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.scheduler = clone_scheduler(self.scheduler, stats=stats)
        new.inflight = list(self.inflight)  # InFlight and plans are never mutated
        new.num_added = self.num_added
        new.recorder = None
        if self.recorder is not None:
            new.recorder = copy.copy(self.recorder)
            new.recorder.records = list(self.recorder.records)
        new.last_events = []
        return new

    # ---- trace -------------------------------------------------------------------
    def _record(self, step: int, rid: str, event: str, reason: str | None = None,
                tokens: Sequence[int] = (), **extra) -> None:
        if self.recorder is not None:
            self.recorder.record(float(self.tick), step, rid, event, reason, list(tokens), **extra)

    def _record_events(self, step: int, events: list) -> None:
        if self.recorder is None:
            return
        for e in events:
            if e.token_ids:
                self._record(step, e.request_id, "tokens", tokens=e.token_ids)
            if e.transition is None:
                continue
            name = _EVENT_NAMES[e.transition]
            reason = e.finish_reason.value if e.finish_reason is not None else None
            self._record(step, e.request_id, name, reason)


_EVENT_NAMES = {
    RequestEventKind.ADMIT: "admit",
    RequestEventKind.PREEMPT: "preempt",
    RequestEventKind.FINISH: "finish",
    RequestEventKind.ABORT: "abort",
    RequestEventKind.REJECT: "reject",
    RequestEventKind.FAIL: "fail",
    RequestEventKind.EXECUTOR_LOST: "executor_lost",
}

# Scheduler attributes `clone_scheduler` copies by hand; any other attribute
# (one the core may gain later) falls back to `copy.deepcopy`.
_SHARED = frozenset({"config", "cache_config", "step_id", "now_s", "num_resume_hit_tokens",
                     "_watermark_blocks", "_predicted_watermark_blocks", "_thrash_watermark_blocks",
                     "_checker"})
_HANDLED = _SHARED | {"policy", "blocks", "requests", "running", "collector", "_finished_ids",
                      "_events", "_inflight", "_deadline_of", "_early", "_lost"}


def clone_scheduler(s: Scheduler, *, stats: bool = True) -> Scheduler:
    """Copy a scheduler: immutable parts shared, mutable ones copied.

    Known structures are copied by hand (about ten times faster than
    `copy.deepcopy`); anything unknown, a user policy included, is deep-copied
    with the live requests already mapped to their copies. With `stats=False`
    the copy shares the statistics collector, which no decision reads.
    """
    new = Scheduler.__new__(Scheduler)
    d, nd = s.__dict__, new.__dict__
    for name in _SHARED:
        if name in d:
            nd[name] = d[name]
    rmap = {id(r): _clone_request(r) for r in s.requests.values()}
    _clone_groups(rmap.values(), rmap)
    nd["requests"] = {rid: rmap[id(r)] for rid, r in s.requests.items()}
    nd["running"] = [rmap[id(r)] for r in s.running]
    nd["policy"] = _clone_policy(s.policy, rmap, s.config)
    nd["blocks"] = _clone_blocks(s.blocks)
    nd["collector"] = _clone_collector(s.collector) if stats else s.collector
    nd["_finished_ids"] = list(s._finished_ids)
    nd["_events"] = list(s._events)
    nd["_inflight"] = dict(s._inflight)
    if "_early" in d:  # answers held back: results are never mutated, the map is copied
        nd["_early"] = dict(d["_early"])
    if "_lost" in d:
        nd["_lost"] = set(d["_lost"])
    nd["_deadline_of"] = getattr(new.policy, "deadline_of", None)
    memo = {id(s.config): s.config, id(s.cache_config): s.cache_config}
    memo.update((k, v) for k, v in rmap.items())
    for name, value in d.items():
        if name not in _HANDLED:
            nd[name] = value if isinstance(value, _IMMUTABLE) else copy.deepcopy(value, memo)
    return new


_IMMUTABLE = (int, float, str, bool, type(None), tuple, frozenset)


def _clone_collector(c):
    new = copy.copy(c)
    for field in attrs.fields(type(c)):
        value = getattr(c, field.name)
        if isinstance(value, (dict, list)):
            setattr(new, field.name, type(value)(value))
    return new


_REQUEST_SLOTS = tuple(Request.__slots__)
_get_request_slots = operator.attrgetter(*_REQUEST_SLOTS)


def _clone_request(r: Request) -> Request:
    new = Request.__new__(Request)
    for name, value in zip(_REQUEST_SLOTS, _get_request_slots(r)):
        setattr(new, name, value)
    new.output_token_ids = list(r.output_token_ids)
    new.all_token_ids = list(r.all_token_ids)
    new.block_hashes = list(r.block_hashes)
    new.pending_steps = list(r.pending_steps)
    new.fsm = _clone_fsm(r.fsm)
    return new


def _clone_groups(requests, rmap: dict) -> None:
    """Give copied requests copies of their groups, listing the copied members."""
    groups: dict[int, RequestGroup] = {}
    for r in requests:
        group = r.group
        if group is None:
            continue
        new = groups.get(id(group))
        if new is None:
            new = groups[id(group)] = RequestGroup(
                group.group_id, [rmap.get(id(m), m) for m in group.members], group.num_shared_tokens)
        r.group = new


def _clone_fsm(fsm):
    cls = type(fsm)
    new = cls.__new__(cls)
    for name in cls.__slots__:
        setattr(new, name, getattr(fsm, name))
    return new


def _clone_count(counter: itertools.count) -> itertools.count:
    # repr is "count(N)"; reading it leaves the original untouched.
    return itertools.count(int(repr(counter)[6:-1]))


def _remap(entry: tuple, rmap: dict) -> tuple:
    """A queue entry with its request replaced by the copy (entries are tuples
    whose last element is the request)."""
    *rest, request = entry
    return (*rest, rmap.get(id(request), request))


def _clone_policy(policy, rmap: dict, config) -> SchedulingPolicy:
    cls = type(policy)
    if isinstance(policy, KeyedPolicy) and set(vars(policy)) <= _KEYED_FIELDS:
        new = cls.__new__(cls)
        new.__dict__.update(vars(policy))
        new._heap = [_remap(entry, rmap) for entry in policy._heap]
        new._seq = _clone_count(policy._seq)
        return new
    if isinstance(policy, FairPolicy) and set(vars(policy)) <= _FAIR_FIELDS:
        new = cls.__new__(cls)
        new.__dict__.update(vars(policy))
        new.counters = dict(policy.counters)
        new.num_active = dict(policy.num_active)
        # The heap over tenants holds (key, rank, tenant) tuples: a list copy will do.
        new._tenants = list(policy._tenants)
        new._in_heap = set(policy._in_heap)
        new._rank = dict(policy._rank)
        if "_examined" in vars(policy):
            new._examined = set(policy._examined)
        new.queues = {t: type(q)(_remap(entry, rmap) for entry in q)
                      for t, q in policy.queues.items()}
        new._seq = _clone_count(policy._seq)
        return new
    memo = {id(config): config}
    memo.update(rmap)
    return copy.deepcopy(policy, memo)


_KEYED_FIELDS = frozenset({"config", "use_priority", "_heap", "_count", "_seq", "_priority_span"})
_FAIR_FIELDS = frozenset({"config", "counters", "queues", "num_active", "_count", "_seq",
                          "_examined", "_tenants", "_in_heap", "_rank"})


_BLOCK_FIELDS = frozenset({"num_blocks", "block_size", "enable_prefix_caching", "ref_counts",
                           "free_ids", "evictable", "retained", "_unretained", "block_key",
                           "cached", "tables", "num_hashed", "num_query_tokens", "num_hit_tokens",
                           "num_evictions", "num_releases", "num_registered"})


def _clone_blocks(bm):
    cls = type(bm)
    if not set(vars(bm)) <= _BLOCK_FIELDS:
        return copy.deepcopy(bm)
    new = cls.__new__(cls)
    d = dict(vars(bm))
    d["ref_counts"] = list(bm.ref_counts)
    d["free_ids"] = list(bm.free_ids)
    d["evictable"] = bm.evictable.copy()
    d["retained"] = set(bm.retained)
    d["_unretained"] = bm._unretained.copy()
    d["block_key"] = list(bm.block_key)
    d["cached"] = dict(bm.cached)
    d["tables"] = {rid: list(t) for rid, t in bm.tables.items()}
    d["num_hashed"] = dict(bm.num_hashed)
    new.__dict__.update(d)
    return new
