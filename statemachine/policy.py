"""Scheduling policies: the order of the waiting queue and the choice of victim.

A policy owns the waiting queue, so it can keep whatever structure makes its
order cheap (a heap for static keys, per-tenant queues for fairness). The
scheduler only pushes, pops in order, removes, and asks for victims; a user
policy implements `SchedulingPolicy` (or subclasses `KeyedPolicy`) and is
selected with `policy="package.module:Class"`.
"""

from __future__ import annotations

import heapq
import importlib
import itertools
from typing import Iterator, Protocol, Sequence, runtime_checkable

from .config import SchedulerConfig
from .errors import ConfigError
from .fsm import RequestState
from .request import Request


@runtime_checkable
class SchedulingPolicy(Protocol):
    """What the scheduler needs from a policy.

    Waiting order: `pop` returns the next waiting request to consider;
    requests the scheduler could not admit are given back with `push`.
    Within one priority class and tenant the order must be first-come
    first-served (DESIGN §4 item 9).
    """

    name: str
    preempts_running: bool
    charges_tokens: bool

    def push(self, request: Request) -> None: ...
    def pop(self) -> Request | None: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def ordered(self) -> list[Request]: ...
    def victim(self, running: Sequence[Request]) -> Request: ...
    def may_preempt(self, waiting: Request, running: Request) -> bool: ...
    def on_scheduled(self, request: Request, num_tokens: int) -> None: ...
    def on_tokens(self, request: Request, num_tokens: int) -> None: ...


class KeyedPolicy:
    """A policy whose waiting order is a static sort key per request.

    Subclasses define `key`; the queue is a heap with lazy removal, so pop and
    push cost O(log n) however many requests wait.
    """

    name = "keyed"
    #: Whether `may_preempt` can ever be true; lets the scheduler skip the scan.
    preempts_running = False
    #: Whether `on_scheduled` / `on_tokens` do anything; lets the scheduler skip them.
    charges_tokens = False
    #: Whether the waiting order changes only by arrivals and removals (keys are
    #: static); the scheduler's admission memo is exact only then.
    static_order = True

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.use_priority = config.enable_priority_scheduling
        self._heap: list[tuple] = []
        self._count = 0
        self._seq = itertools.count(1)
        # The lowest and highest priority value queued so far (None before any).
        self._priority_span: tuple[int, int] | None = None

    def key(self, request: Request) -> tuple:
        raise NotImplementedError

    def push(self, request: Request) -> None:
        span, p = self._priority_span, request.priority
        if span is None:
            self._priority_span = (p, p)
        elif not span[0] <= p <= span[1]:
            self._priority_span = (min(span[0], p), max(span[1], p))
        seq = next(self._seq)
        request.queue_seq = seq
        heapq.heappush(self._heap, (self.key(request), request.arrival_seq, seq, request))
        self._count += 1

    def pop(self) -> Request | None:
        heap = self._heap
        while heap:
            _, _, seq, request = heapq.heappop(heap)
            if request.queue_seq == seq:
                request.queue_seq = 0
                self._count -= 1
                return request
        return None

    def peek(self) -> Request | None:
        """The request `pop` would return, left in the queue."""
        heap = self._heap
        while heap:
            _, _, seq, request = heap[0]
            if request.queue_seq == seq:
                return request
            heapq.heappop(heap)  # removed since it was pushed
        return None

    def ties(self, a: Request, b: Request) -> bool:
        """Whether `a` and `b` rank equally (only their arrival sequence tells them apart)."""
        return self.key(a) == self.key(b)

    def sorts_after(self, a: Request, b: Request) -> bool:
        """Whether `a` waits behind `b` in this policy's order (keys are static)."""
        return (self.key(a), a.arrival_seq) > (self.key(b), b.arrival_seq)

    def remove(self, request: Request) -> None:
        if request.queue_seq:
            request.queue_seq = 0
            self._count -= 1
            if self._count == 0:
                self._heap.clear()

    def __len__(self) -> int:
        return self._count

    def ordered(self) -> list[Request]:
        return [r for _, _, seq, r in sorted(self._heap, key=lambda e: e[:3]) if r.queue_seq == seq]

    def victim(self, running: Sequence[Request]) -> Request:
        """The lowest-priority running request that has the least computed work."""
        if self.use_priority:
            return max(running, key=lambda r: (r.priority, -r.num_computed_tokens, r.arrival_s))
        return max(running, key=lambda r: (-r.num_computed_tokens, r.arrival_s))

    def may_preempt(self, waiting: Request, running: Request) -> bool:
        return False

    def on_scheduled(self, request: Request, num_tokens: int) -> None:
        pass

    def on_tokens(self, request: Request, num_tokens: int) -> None:
        pass


class FcfsPolicy(KeyedPolicy):
    """First come, first served; victims lose the least work."""

    name = "fcfs"

    def key(self, request: Request) -> tuple:
        return (request.arrival_s,)

    def victim(self, running: Sequence[Request]) -> Request:
        if self.config.fcfs_victim == "latest_admitted":
            return running[-1]  # the scheduler keeps `running` in admission order
        return max(running, key=lambda r: (-r.num_computed_tokens, r.arrival_s))


class PriorityPolicy(KeyedPolicy):
    """Lower priority value first, aged: a request gains one level per
    `aging_steps` scheduler steps waited, so its key priority * aging_steps +
    arrival_step is static. The promise this makes (the aging bound): a request
    of priority p ranks ahead of every request of priority q that arrives
    (p - q) * aging_steps steps or more after it, so once it has waited that
    long no later arrival goes before it, and none may displace it.
    Nothing here reads a clock: the order, and so which request may displace
    which, is the same whatever a step lasts. A waiting request may preempt a
    running one of strictly lower priority that it is also ahead of in the aged
    order. With every priority equal it decides exactly as `fcfs`."""

    name = "priority"

    @property
    def preempts_running(self) -> bool:
        """Whether two priorities queued so far are `preempt_min_priority_gap`
        apart: before that no request can displace another, and admission
        takes the path that `fcfs` takes."""
        span = self._priority_span
        config = self.config
        return (span is not None and self.use_priority and config.preempt_for_priority
                and span[1] - span[0] >= config.preempt_min_priority_gap)

    def key(self, request: Request) -> tuple:
        if not self.use_priority:
            return (request.arrival_s,)
        return (request.priority * self.config.aging_steps + request.arrival_step,
                request.arrival_s)

    def ties(self, a: Request, b: Request) -> bool:
        """Whether `a` and `b` rank equally: one priority, one arrival time."""
        return a.priority == b.priority and a.arrival_s == b.arrival_s if self.use_priority \
            else a.arrival_s == b.arrival_s

    def may_preempt(self, waiting: Request, running: Request) -> bool:
        """Higher priority by at least `preempt_min_priority_gap`, and ahead in the
        aged order too (a request that has waited its way to the front is not
        displaced by newer arrivals); and only while the work thrown away is small
        for the gap and the running request has not been preempted too often."""
        config = self.config
        gap = running.priority - waiting.priority
        if not (self.use_priority and config.preempt_for_priority
                and gap >= config.preempt_min_priority_gap
                and self.key(waiting) < self.key(running)):
            return False
        limit = config.preempt_max_recompute_tokens
        if limit and running.num_computed_tokens > gap * limit:
            return False
        times = config.preempt_max_times
        return not times or running.num_preemptions < times


class StrictPriorityPolicy(PriorityPolicy):
    """Lower priority value first with no aging: low priorities can starve.
    Kept so the model checker can show it finds starvation."""

    name = "strict-priority"

    def key(self, request: Request) -> tuple:
        if not self.use_priority:
            return (request.arrival_s,)
        return (request.priority, request.arrival_s)


class DeadlinePolicy(KeyedPolicy):
    """Earliest deadline first; a request without a deadline gets arrival plus
    `default_deadline_s`. Late requests keep their place (no starvation); with
    `reject_late` the scheduler rejects waiting ones whose deadline has passed."""

    name = "deadline"

    def key(self, request: Request) -> tuple:
        return (self.deadline_of(request), request.arrival_s)

    def deadline_of(self, request: Request) -> float:
        if request.deadline_s is not None:
            return request.deadline_s
        return request.arrival_s + self.config.default_deadline_s

    def victim(self, running: Sequence[Request]) -> Request:
        """A request without a deadline first (it was promised nothing), least
        work lost as under `fcfs`; else the latest deadline."""
        return max(running, key=lambda r: (
            (1, 0.0, -r.num_computed_tokens, r.arrival_s) if r.deadline_s is None
            else (0, r.deadline_s, -r.num_computed_tokens, r.arrival_s)))


class WeightedPolicy(KeyedPolicy):
    """Ranks by priority_weight * priority + latency_weight * arrival_s +
    throughput_weight * prompt tokens, lowest first."""

    name = "weighted"

    def key(self, request: Request) -> tuple:
        c = self.config
        prio = request.priority if self.use_priority else 0
        return (c.priority_weight * prio + c.latency_weight * request.arrival_s
                + c.throughput_weight * request.num_prompt_tokens, request.arrival_s)


class FairPolicy:
    """Per-tenant fairness with virtual token counters (VTC).

    Each tenant's counter grows by the tokens served to it (prompt tokens times
    `fair_input_weight`, generated tokens times `fair_output_weight`). The
    tenant with the smallest counter among those waiting goes next (ties: the
    tenant seen first), first come first served within the tenant. A tenant that
    becomes active again is lifted to the smallest counter of the active tenants,
    so idling banks no credit.

    Cost: each tenant's queue is a heap by arrival, and the tenants waiting sit
    in a heap by counter. Counters only grow, so a heap entry may be stale low,
    never high: `pop` refreshes the smallest entry until it is current, and a
    counter that grows costs nothing until its tenant reaches the top. Push and
    pop cost O(log n) in the requests waiting (plus O(log t) per stale tenant
    entry met, t tenants); a tenant's reactivation scans the active tenants.
    """

    name = "fair"
    preempts_running = False
    charges_tokens = True

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.counters: dict[str, float] = {}
        # Per tenant, a heap of (queue_seq, request); a request's queue_seq is its
        # (arrival_s, arrival_seq, push number), so the heap is in arrival order and
        # an entry is live while the request's queue_seq is still that tuple.
        self.queues: dict[str, list[tuple]] = {}
        self.num_active: dict[str, int] = {}
        # Tenants with live waiting requests: (counter when pushed, first-seen rank, tenant).
        self._tenants: list[tuple[float, int, str]] = []
        self._in_heap: set[str] = set()
        self._rank: dict[str, int] = {}
        # Requests popped to be considered this step: pushing one back is no new arrival.
        self._examined: set[str] = set()
        self._count = 0
        self._seq = itertools.count(1)

    @property
    def static_order(self) -> bool:
        """Whether the waiting order changes only by arrivals and removals: while
        one tenant has been seen (first come, first served); with more, their
        counters reorder the queue as they are served."""
        return len(self._rank) <= 1

    def push(self, request: Request) -> None:
        tenant = request.tenant
        queue = self.queues.get(tenant)
        if queue is None:
            queue = self.queues[tenant] = []
            self._rank[tenant] = len(self._rank)
        seq = request.queue_seq = (request.arrival_s, request.arrival_seq, next(self._seq))
        heapq.heappush(queue, (seq, request))
        self._count += 1
        self._activate(request)
        if tenant not in self._in_heap:
            self._in_heap.add(tenant)
            heapq.heappush(self._tenants, (self.counters[tenant], self._rank[tenant], tenant))

    def _activate(self, request: Request) -> None:
        tenant = request.tenant
        returning = request.request_id in self._examined
        self._examined.discard(request.request_id)
        if self.num_active.get(tenant, 0) == 0 and not returning:
            active = [self.counters[t] for t, n in self.num_active.items() if n > 0 and t != tenant]
            floor = min(active) if active else 0.0
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
        self.num_active[tenant] = self.num_active.get(tenant, 0) + 1

    def _deactivate(self, request: Request) -> None:
        self.num_active[request.tenant] -= 1

    def pop(self) -> Request | None:
        queue = self._next_queue()
        if queue is None:
            return None
        _, request = heapq.heappop(queue)
        request.queue_seq = 0
        self._count -= 1
        self._deactivate(request)
        self._examined.add(request.request_id)
        return request

    def peek(self) -> Request | None:
        """The request `pop` would return, left in the queue."""
        queue = self._next_queue()
        return None if queue is None else queue[0][1]

    def ties(self, a: Request, b: Request) -> bool:
        """Whether `a` and `b` rank equally: one tenant, one arrival time."""
        return a.tenant == b.tenant and a.arrival_s == b.arrival_s

    def sorts_after(self, a: Request, b: Request) -> bool:
        """Whether `a` is sure to wait behind `b`: the same tenant and a later
        arrival (across tenants the order moves with the counters)."""
        return a.tenant == b.tenant and (a.arrival_s, a.arrival_seq) > (b.arrival_s, b.arrival_seq)

    def _next_queue(self) -> list[tuple] | None:
        """The queue of the tenant to serve next, its head live; None if none waits."""
        tenants, counters, num_active = self._tenants, self.counters, self.num_active
        while tenants:
            counter, rank, tenant = tenants[0]
            if not num_active[tenant]:
                heapq.heappop(tenants)  # nothing of this tenant waits any more
                self._in_heap.discard(tenant)
                self.queues[tenant].clear()
                continue
            current = counters[tenant]
            if counter != current:
                heapq.heapreplace(tenants, (current, rank, tenant))  # stale: it only grew
                continue
            queue = self.queues[tenant]
            while queue[0][1].queue_seq is not queue[0][0]:
                heapq.heappop(queue)  # removed or popped since it was pushed
            return queue
        return None

    def remove(self, request: Request) -> None:
        self._examined.discard(request.request_id)
        if request.queue_seq:
            request.queue_seq = 0
            self._count -= 1
            self._deactivate(request)

    def __len__(self) -> int:
        return self._count

    def ordered(self) -> list[Request]:
        out = []
        for queue in self.queues.values():
            out.extend(r for seq, r in queue if r.queue_seq is seq)
        return sorted(out, key=lambda r: (self.counters[r.tenant], self._rank[r.tenant],
                                          r.arrival_s, r.arrival_seq))

    def victim(self, running: Sequence[Request]) -> Request:
        """The request that has the least computed work, as under `fcfs`; among
        equals the most served tenant's, then the latest arrival. Work lost to a
        preemption is recomputed for nobody's benefit, and a counter moves only
        with service, so choosing by tenant first would cost recompute without
        charging the served tenant anything."""
        return max(running, key=lambda r: (-r.num_computed_tokens, self.counters.get(r.tenant, 0.0),
                                           r.arrival_s))

    def may_preempt(self, waiting: Request, running: Request) -> bool:
        return False

    def on_scheduled(self, request: Request, num_tokens: int) -> None:
        self._examined.discard(request.request_id)
        # Only prompt tokens are charged here; generated ones in on_tokens.
        prompt_left = request.num_prompt_tokens - request.num_computed_tokens
        if prompt_left > 0:
            self.counters[request.tenant] = (
                self.counters.get(request.tenant, 0.0)
                + min(prompt_left, num_tokens) * self.config.fair_input_weight)

    def on_tokens(self, request: Request, num_tokens: int) -> None:
        self.counters[request.tenant] = (
            self.counters.get(request.tenant, 0.0) + num_tokens * self.config.fair_output_weight)


POLICIES: dict[str, type] = {
    "fcfs": FcfsPolicy,
    "priority": PriorityPolicy,
    "strict-priority": StrictPriorityPolicy,
    "deadline": DeadlinePolicy,
    "fair": FairPolicy,
    "weighted": WeightedPolicy,
}


def make_policy(config: SchedulerConfig) -> SchedulingPolicy:
    """Build the policy `config.policy` names (a built-in name or 'module:Class')."""
    name = config.policy
    cls = POLICIES.get(name)
    if cls is None:
        module_name, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"policy {name!r} cannot be loaded: {exc}") from None
    policy = cls(config)
    if not isinstance(policy, SchedulingPolicy):
        raise ConfigError(f"policy {name!r} does not implement SchedulingPolicy")
    return policy


def waiting_requests(policy: SchedulingPolicy) -> Iterator[Request]:
    """The waiting requests in policy order (for checks and tests, O(n log n))."""
    return iter(r for r in policy.ordered() if r.state is RequestState.PENDING)
