"""The policies' heaps decide exactly as a plain scan over the waiting set would.

Each test drives a policy and a naive reference (a list scanned in full on every
pop) with the same random operations: arrivals, pops, pushes back, removals and
token charges, and checks that every pop returns the same request.
"""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from cadence.statemachine.config import SchedulerConfig
from cadence.statemachine.policy import FairPolicy, make_policy

from core_helpers import examples, make_request


class ScanFair:
    """VTC as a scan: the smallest counter among tenants with a waiting request
    (ties: the tenant seen first), then the earliest arrival of that tenant."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.counters: dict[str, float] = {}
        self.rank: dict[str, int] = {}
        self.waiting: list = []
        self.examined: set[str] = set()

    def push(self, request) -> None:
        tenant = request.tenant
        self.rank.setdefault(tenant, len(self.rank))
        returning = request.request_id in self.examined
        self.examined.discard(request.request_id)
        if not any(r.tenant == tenant for r in self.waiting) and not returning:
            active = [self.counters[r.tenant] for r in self.waiting]
            floor = min(active) if active else 0.0
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
        self.waiting.append(request)

    def pop(self):
        if not self.waiting:
            return None
        best = min(self.waiting, key=lambda r: (self.counters[r.tenant], self.rank[r.tenant],
                                                r.arrival_s, r.arrival_seq))
        self.waiting.remove(best)
        self.examined.add(best.request_id)
        return best

    def remove(self, request) -> None:
        self.examined.discard(request.request_id)
        if request in self.waiting:
            self.waiting.remove(request)

    def charge(self, request, tokens: float) -> None:
        self.counters[request.tenant] = self.counters.get(request.tenant, 0.0) + tokens


OPS = st.lists(st.tuples(st.sampled_from(["arrive", "pop", "put_back", "remove", "charge"]),
                         st.integers(0, 4), st.integers(0, 3), st.integers(1, 50)),
               min_size=1, max_size=80)


@settings(max_examples=examples(150), deadline=None)
@given(OPS)
def test_fair_heaps_pop_what_a_scan_would(ops):
    """FairPolicy's tenant heap (stale-low entries refreshed on pop) and per-tenant
    arrival heaps give the same pops as a full scan (and `peek` shows each pop), through arrivals, removals,
    requests popped and pushed back out of order, and counters charged meanwhile."""
    config = SchedulerConfig(policy="fair")
    fair, scan = FairPolicy(config), ScanFair(config)
    popped: list = []
    live: list = []
    seq = 0
    for op, tenant, arrival, tokens in ops:
        if op == "arrive":
            seq += 1
            r = make_request(f"r{seq}", 2, tenant=f"t{tenant}", arrival_s=float(arrival))
            r.arrival_seq = seq
            live.append(r)
            fair.push(r)
            scan.push(r)
        elif op == "pop":
            peeked = fair.peek()
            got, want = fair.pop(), scan.pop()
            assert got is want and peeked is got
            if got is not None:
                popped.append(got)
        elif op == "put_back" and popped:
            r = popped.pop(tokens % len(popped))
            fair.push(r)
            scan.push(r)
        elif op == "remove" and live:
            r = live[tokens % len(live)]
            if r in popped:
                continue
            fair.remove(r)
            scan.remove(r)
            live.remove(r)
        elif op == "charge" and live:
            r = live[(tokens + tenant) % len(live)]
            fair.on_tokens(r, tokens)
            scan.charge(r, tokens * config.fair_output_weight)
        assert len(fair) == len(scan.waiting)
        assert fair.ordered() == sorted(
            scan.waiting, key=lambda r: (scan.counters[r.tenant], scan.rank[r.tenant],
                                         r.arrival_s, r.arrival_seq))
    while True:
        got, want = fair.pop(), scan.pop()
        assert got is want
        if got is None:
            break


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.booleans()), max_size=40))
def test_keyed_peek_shows_what_pop_returns(ops):
    """KeyedPolicy.peek skips removed entries and shows the next pop."""
    policy = make_policy(SchedulerConfig(policy="priority"))
    live = []
    for i, (priority, arrival, remove) in enumerate(ops):
        r = make_request(f"r{i}", 2, priority=priority, arrival_s=float(arrival))
        r.arrival_seq = i + 1
        policy.push(r)
        live.append(r)
        if remove:
            victim = live.pop(arrival % len(live))
            policy.remove(victim)
    while True:
        peeked = policy.peek()
        got = policy.pop()
        assert peeked is got
        if got is None:
            break
        live.remove(got)
    assert not live
