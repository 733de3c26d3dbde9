"""Exhaustive breadth-first exploration of the real scheduling core at small scope.

The environment is the only source of nondeterminism: requests arrive (from a
small menu of shapes), clients abort, the executor samples end-of-sequence or
not for each request it samples, results come back (one or several plans in
flight), and the executor can be lost. Time is the step counter. From every
reachable state every move is tried on a copy of the real `Scheduler`; each
state is checked against the invariants of DESIGN §4 and each move against the
reference spec (refinement). A violation comes back with the shortest trace
that reaches it, printed as a runnable test.

States are compared up to renaming (`canonical_key`): request ids by their
place in the running list and the waiting order, block ids by first use, free
blocks by count, and times relative to now with gaps between arrivals cut at a
horizon (see spec/README.md for why that is exact for the built-in policies).

`find_starvation` then searches the state graph for a reachable cycle in which
one waiting request is never admitted while others keep producing tokens
(DESIGN §4 item 11).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import deque
from typing import Callable, Iterator

import attrs

from cadence.statemachine.config import CacheConfig, SchedulerConfig
from cadence.statemachine.fsm import RequestEventKind, RequestState
from cadence.statemachine.policy import FairPolicy, KeyedPolicy, PriorityPolicy

from . import coverage as cov
from .harness import Harness
from .refinement import StepChecker

RUNNING = RequestState.RUNNING


@attrs.frozen
class Shape:
    """A request the environment may submit: prompt, output limit, priority,
    tenant; with `n` > 1, a group of that many with the one prompt (`add_group`)."""

    prompt: tuple[int, ...]
    max_tokens: int
    priority: int = 0
    tenant: str = "a"
    deadline_after_s: float | None = None
    n: int = 1

    def kwargs(self) -> dict:
        """The keyword arguments of `Harness.add` (or `add_group`) for this shape."""
        out = {"prompt": self.prompt, "max_tokens": self.max_tokens,
               "priority": self.priority, "tenant": self.tenant}
        if self.deadline_after_s is not None:
            out["deadline_after_s"] = self.deadline_after_s
        if self.n > 1:
            out["n"] = self.n
        return out


@attrs.frozen
class Scope:
    """The bounds of one exploration.

    max_live: requests live at once (arrivals stop while that many are live).
    max_inflight: plans in flight; 1 plans and answers a step in one move.
    time_horizon: gaps between arrival times (and the age of the newest) are
      cut at this many ticks; None derives it from the configuration.
    counter_cap: the fair policy's counters may spread this far apart; states
      beyond are counted as cut and not expanded.
    duplicates: the environment may deliver the last answered (or voided) plan's
      result again; the core must ignore it.
    max_depth: states this many moves from the start are kept but not expanded
      (a bounded search where breadth-first to the end is too big); None: no bound.
    admission_retry_steps: the admission memo's retry window for this
      exploration (the core's constant is patched while it runs), so that the
      window runs out within a few steps; None keeps the core's.
    prefix_caching: the cache's `enable_prefix_caching`.
    out_of_order: any plan in flight may be answered next, not only the oldest
      (with async scheduling an answer that overtakes an older plan sampling
      for the same request is held back by the core).
    """

    name: str = "small"
    num_blocks: int = 4
    block_size: int = 2
    max_num_seqs: int = 2
    max_num_batched_tokens: int = 4
    max_model_len: int = 6
    shapes: tuple[Shape, ...] = (
        Shape((1, 2, 3), 2, priority=0, tenant="a"),
        Shape((1, 2, 5), 1, priority=1, tenant="b"),
        Shape((4,), 2, priority=1, tenant="a"),
    )
    max_live: int = 3
    max_inflight: int = 1
    eos: bool = True
    aborts: bool = True
    executor_loss: bool = True
    fails: bool = False
    config_overrides: dict = attrs.field(factory=lambda: {
        "aging_steps": 2, "default_deadline_s": 3.0, "starvation_skip_limit": 2,
        "admission_headroom_steps": 1,
        # The length estimator's window is history without bound; the Hypothesis
        # machines cover predicted lengths instead.
        "predict_output_lengths": False})
    time_horizon: int | None = None
    counter_cap: float = 3.0
    max_states: int = 2_000_000
    duplicates: bool = False
    max_depth: int | None = None
    admission_retry_steps: int | None = None
    prefix_caching: bool = True
    out_of_order: bool = False

    def configs(self, policy: str) -> tuple[SchedulerConfig, CacheConfig]:
        """The scheduler and cache configuration this scope explores for `policy`."""
        known = {f.name for f in attrs.fields(SchedulerConfig)}
        config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, policy=policy,
            **{k: v for k, v in self.config_overrides.items() if k in known})
        return config, CacheConfig(num_blocks=self.num_blocks, block_size=self.block_size,
                                   enable_prefix_caching=self.prefix_caching)

    def horizon(self, config: SchedulerConfig) -> int:
        """Ticks beyond which arrival gaps cannot change any decision of the built-in policies."""
        if self.time_horizon is not None:
            return self.time_horizon
        prios = [s.priority for s in self.shapes]
        offsets = [s.deadline_after_s for s in self.shapes if s.deadline_after_s is not None]
        spans = [config.aging_steps * (max(prios) - min(prios)), config.default_deadline_s]
        spans += [abs(o) for o in offsets] + [abs(a - b) for a in offsets for b in offsets]
        spans += [abs(o - config.default_deadline_s) for o in offsets]
        return int(max(spans)) + 2


_TIGHT = {"aging_steps": 2, "default_deadline_s": 3.0, "starvation_skip_limit": 2,
          "admission_headroom_steps": 0, "predict_output_lengths": False}
_REACH_SHAPES = (Shape((1, 2, 3), 4, priority=0, tenant="a"),
                 Shape((4,), 3, priority=1, tenant="b"))

SCOPES = {
    # Plans answered at once; 3 shapes, 3 live requests, 4 blocks of 2 tokens; the
    # admission memo's retry window is one step, so it stands and runs out. The
    # fair policy's tenants may drift two tokens of service apart (not three): at
    # three its state space is 2.6 times larger and holds no family the CI scopes
    # do not reach otherwise (tests/spec/test_coverage.py).
    "small": Scope(admission_retry_steps=1, counter_cap=2.0),
    # Chosen for reach (see spec/README.md, "Coverage"): more seats (3) than budget
    # tokens (2), a prompt longer than the budget, no admission headroom, so
    # running requests outgrow the blocks and preempt under every policy; a
    # retry window of one step, so the admission memo stands and runs out.
    # Depth-bounded: breadth-first to depth 11.
    "tight": Scope(
        name="tight", num_blocks=4, max_num_seqs=3, max_num_batched_tokens=2, max_model_len=7,
        shapes=_REACH_SHAPES, max_live=3, aborts=False, executor_loss=False,
        config_overrides=_TIGHT, max_depth=11, admission_retry_steps=1),
    # Two plans in flight: results arrive late, stale (after aborts, preemptions,
    # executor loss) and twice; more requests run than the budget has tokens;
    # late requests are rejected (deadline). Depth-bounded: to depth 7.
    "pipelined": Scope(
        name="pipelined", num_blocks=4, max_num_seqs=3, max_num_batched_tokens=2,
        max_model_len=6, shapes=(Shape((1, 2, 3), 2, priority=0, tenant="a"),
                                 Shape((4,), 2, priority=1, tenant="b")),
        max_live=3, max_inflight=2, eos=False, duplicates=True,
        config_overrides={**_TIGHT, "reject_late": True}, max_depth=7),
    # Request groups: two samples of a 3-token prompt (one shared block) beside a
    # one-token request, prefix caching off, so blocks are shared only by the fork;
    # 4 blocks, no headroom: members wait for, share, recompute (after their
    # leader is preempted, aborted or lost) and lose to preemption the prompt
    # block. Depth-bounded: to depth 11 (fair, which preempts the least work
    # first, first preempts a member holding the shared block at depth 10).
    "forked": Scope(
        name="forked", num_blocks=4, max_num_seqs=3, max_num_batched_tokens=4, max_model_len=6,
        shapes=(Shape((1, 2, 3), 3, priority=1, n=2), Shape((4,), 2, tenant="b")),
        max_live=3, config_overrides=_TIGHT, max_depth=11, prefix_caching=False),
    # Async scheduling: a decode planned ahead of its token, so a request is in two
    # plans in flight; any plan may be answered first (the core holds an answer
    # back behind an older one); end-of-sequence choices (a stop one step late),
    # executor loss, and too few blocks for both shapes (preemption with a token
    # in flight). Depth-bounded.
    "overlap": Scope(
        name="overlap", num_blocks=4, max_num_seqs=2, max_num_batched_tokens=4,
        max_model_len=6, shapes=(Shape((1, 2, 3), 3, priority=0, tenant="a"),
                                 Shape((4,), 2, priority=1, tenant="b")),
        max_live=2, max_inflight=2, out_of_order=True, aborts=False, counter_cap=5.0,
        config_overrides={**_TIGHT, "async_scheduling": True}, max_depth=9),
    # As small, with two plans in flight (pipelining) and failures.
    "medium": Scope(name="medium", max_inflight=2, fails=True),
    # More blocks, seats, shapes and live requests, two plans in flight.
    "large": Scope(
        name="large", num_blocks=6, max_num_batched_tokens=6, max_model_len=7,
        shapes=(Shape((1, 2, 3), 2, priority=0, tenant="a"),
                Shape((1, 2, 5), 1, priority=1, tenant="b"),
                Shape((4,), 2, priority=1, tenant="a"),
                Shape((1, 2, 3, 4, 5), 1, priority=0, tenant="b")),
        max_live=4, max_inflight=2, fails=True),
}


@contextlib.contextmanager
def scope_patches(scope: Scope) -> Iterator[None]:
    """Apply the scope's settings that live in the core's module constants."""
    if scope.admission_retry_steps is None:
        yield
        return
    from cadence.statemachine import scheduler as core
    saved = core.ADMISSION_RETRY_STEPS
    core.ADMISSION_RETRY_STEPS = scope.admission_retry_steps
    try:
        yield
    finally:
        core.ADMISSION_RETRY_STEPS = saved


CI_SCOPES = ("small", "tight", "pipelined", "forked", "overlap")
"""The scopes the test suite explores by default; between them every behaviour
family reachable by a built-in policy is reached (tests/spec/test_coverage.py)."""


# ---- canonical form -------------------------------------------------------------------
def waiting_order(policy) -> list:
    """The waiting requests in the exact order the policy would consider them."""
    if isinstance(policy, FairPolicy):
        return [e[-1] for q in policy.queues.values() for e in q if e[-1].queue_seq == e[0]]
    return list(policy.ordered())


class Cut(Exception):
    """A state beyond the scope's bounds (not expanded)."""


def canonical_key(h: Harness, horizon: int, counter_cap: float = float("inf"),
                  tenants: frozenset = frozenset()) -> tuple[tuple, list[str]]:
    """A key equal for states that behave alike up to renaming, and the request
    ids in canonical order (running list, then waiting order)."""
    s = h.scheduler
    running = s.running
    names = [r.request_id for r in running] + [r.request_id for r in waiting_order(s.policy)]
    pos = {rid: i for i, rid in enumerate(names)}
    requests = s.requests
    now = float(s.step_id)
    ages, acc, prev = {}, 0.0, now
    for t in sorted({r.arrival_s for r in requests.values()}, reverse=True):
        acc += min(prev - t, horizon)
        ages[t] = acc
        prev = t
    early = getattr(s, "_early", {})
    order = {k: i for i, k in enumerate(sorted(s._inflight))}
    bm = s.blocks
    bname: dict[int, int] = {}
    for rid in names:
        for b in bm.tables.get(rid, ()):
            bname.setdefault(b, len(bname))
    for b in bm.evictable:
        bname.setdefault(b, len(bname))
    reqs = []
    for rid in names:
        r = requests[rid]
        group = getattr(r, "group", None)
        reqs.append((
            # Its group, named by the first member's position.
            None if group is None else min(pos[m.request_id] for m in group.members),
            r.fsm.state is RUNNING, r.prompt_token_ids, tuple(r.output_token_ids), r.limits,
            r.priority, r.tenant, None if r.deadline_s is None else r.deadline_s - r.arrival_s,
            ages[r.arrival_s], r.num_computed_tokens, r.num_preemptions > 0, r.num_skips,
            bm.num_hashed.get(rid), tuple(bname[b] for b in bm.tables.get(rid, ())), r.cache_salt,
            # Whether each plan in flight predates its last admission (its result is stale).
            tuple(r.admitted_step > f.plan.step_id for f in h.inflight),
            # The plans in flight that sample for it, by place among the core's plans.
            tuple(order[k] for k in r.pending_steps)))
    blocks = (tuple(bm.block_key[b] for b in bname), tuple(bname[b] for b in bm.evictable),
              len(bm.free_ids), tuple(sorted(bname[b] for b in getattr(bm, "retained", ()))))
    inflight = tuple((tuple((pos.get(rid, -1), n) for rid, n in f.plan.num_scheduled_tokens.items()),
                      tuple(pos.get(rid, -1) for rid in f.samplers)) for f in h.inflight)
    # Answers the core holds back (async scheduling), by place among its plans.
    held = tuple((order[k], tuple(sorted((pos[rid], tuple(t)) for rid, t in
                                         early[k].sampled_token_ids.items() if rid in pos)))
                 for k in sorted(early))
    # Ties between equal arrival times are broken by arrival order.
    arrival_order = tuple(pos[r.request_id] for r in sorted(
        requests.values(), key=lambda r: (r.arrival_s, getattr(r, "arrival_seq", 0))))
    key = (len(running), tuple(reqs), blocks, inflight, held, arrival_order,
           _policy_key(s.policy, pos, counter_cap, tenants), _scheduler_extra(s, pos))
    return key, names


# Scheduler attributes the key above covers, or that never change a decision
# (statistics, the step counter, the caller's clock).
_COVERED = frozenset({
    "config", "cache_config", "policy", "blocks", "requests", "running", "step_id", "now_s",
    "collector", "num_resume_hit_tokens", "_watermark_blocks", "_predicted_watermark_blocks",
    "_thrash_watermark_blocks", "_finished_ids", "_events", "_inflight", "_deadline_of",
    "_checker", "_queue_version", "_failed_admission", "_num_arrivals", "_admission_cut",
    "_min_need", "_early", "_lost"})


def _scheduler_extra(s, pos: dict[str, int] | None = None) -> tuple:
    """Scheduler state outside the requests, blocks and policy that can change a decision.

    The failed-admission memo is kept relative to the state (whether its counters
    still match, steps left in its window, the need, the cut request's position),
    never as absolute counters, so equal situations merge."""
    failed = getattr(s, "_failed_admission", None)
    memo = None
    if failed is not None and failed[0] == getattr(s, "_queue_version", None):
        cut = getattr(s, "_admission_cut", None)
        memo = (failed[1] == s.blocks.num_releases, max(0, failed[2] - s.step_id),
                failed[3] == getattr(s.blocks, "num_registered", 0),
                getattr(s, "_min_need", 0),
                None if cut is None else (pos or {}).get(cut.request_id, cut.request_id))
    # Requests whose computation was lost with the executor, by position.
    lost = tuple(sorted((pos or {}).get(rid, -1) for rid in getattr(s, "_lost", ())))
    # An attribute this function does not know is kept whole: exact, if perhaps larger.
    unknown = tuple((k, repr(v)) for k, v in sorted(vars(s).items()) if k not in _COVERED)
    return (memo, lost, unknown)


def _policy_key(policy, pos, cap, tenants) -> tuple:
    if isinstance(policy, KeyedPolicy) and type(policy).__init__ is KeyedPolicy.__init__:
        # The priorities queued so far decide whether `priority` may preempt.
        return (policy._priority_span,) if isinstance(policy, PriorityPolicy) else ()
    if isinstance(policy, FairPolicy):
        counters = policy.counters
        base = min(counters.values()) if counters and tenants <= set(counters) else 0.0
        rel = tuple(sorted((t, c - base) for t, c in counters.items()))
        if any(v > cap for _, v in rel):
            raise Cut(f"virtual counters spread past {cap}")
        active = tuple(sorted((t, n) for t, n in policy.num_active.items() if n))
        # Requests popped and put back in the last pass keep their place on return.
        examined = tuple(sorted(pos.get(rid, -1) for rid in getattr(policy, "_examined", ())))
        return (tuple(policy.queues), rel, active, examined)
    return _generic(vars(policy), pos)


def _generic(value, pos):
    """A hashable image of a user policy's state, requests replaced by their names."""
    from cadence.statemachine.request import Request
    if isinstance(value, Request):
        return ("request", pos.get(value.request_id, -1))
    if isinstance(value, dict):
        return tuple((_generic(k, pos), _generic(v, pos)) for k, v in value.items()
                     if k != "config")
    if isinstance(value, (list, tuple, deque)):
        return tuple(_generic(v, pos) for v in value)
    if isinstance(value, (set, frozenset)):
        return tuple(sorted(repr(_generic(v, pos)) for v in value))
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    if isinstance(value, itertools.count):
        return ()
    if hasattr(value, "__dict__"):
        return _generic(vars(value), pos)
    return repr(value)


# ---- moves ------------------------------------------------------------------------------
# A move names requests by their canonical position in the state it leaves, so
# the same move applies to any state with the same key.
Move = tuple


def apply_move(h: Harness, move: Move, names: list[str], scope: Scope) -> bool:
    """Make the move on `h`; False if it changed nothing (a refused submission)."""
    kind = move[0]
    if kind == "add":
        shape = scope.shapes[move[1]]
        return h.add_group(**shape.kwargs()) if shape.n > 1 else h.add(None, **shape.kwargs())
    if kind == "abort":
        h.abort(names[move[1]])
    elif kind == "fail":
        h.fail(names[move[1]])
    elif kind == "lost":
        h.executor_lost()
    elif kind == "schedule":
        h.schedule()
    elif kind == "complete":
        h.complete([names[i] for i in move[1]], move[2] if len(move) > 2 else 0)
    elif kind == "step":
        h.step([names[i] for i in move[1]])
    elif kind == "duplicate":
        h.redeliver()
    return True


def _subsets(items: tuple) -> Iterator[tuple]:
    for n in range(len(items) + 1):
        yield from itertools.combinations(items, n)


# ---- exploration ------------------------------------------------------------------------
@attrs.define
class Violation:
    """An invariant or refinement failure, with the shortest trace that reaches it."""

    problems: list[str]
    moves: list[Move]
    code: str = ""

    def __str__(self) -> str:
        return "\n".join(self.problems) + "\n\n" + self.code


@attrs.define
class Exploration:
    """The explored state graph of one configuration and what was found in it."""

    scope: Scope
    policy: str
    config: SchedulerConfig
    cache_config: CacheConfig
    num_states: int = 0
    num_transitions: int = 0
    num_cut: int = 0
    max_depth: int = 0
    num_bounded: int = 0
    seconds: float = 0.0
    complete: bool = True
    coverage: cov.Coverage | None = None
    violations: list[Violation] = attrs.Factory(list)
    # Graph, kept for the liveness search: per state its parent, move, number of
    # running requests and number of live requests; per edge source, target,
    # move, progress flag and the renaming of the source's requests.
    parent: list[int] = attrs.Factory(list)
    move: list[Move] = attrs.Factory(list)
    num_running: list[int] = attrs.Factory(list)
    num_live: list[int] = attrs.Factory(list)
    edges: list[tuple] = attrs.Factory(list)

    def path_to(self, state: int) -> list[Move]:
        """The moves of the shortest path from the initial state."""
        out = []
        while state:
            out.append(self.move[state])
            state = self.parent[state]
        return out[::-1]

    def summary(self) -> str:
        """One line: policy, scope, states, transitions, depth, cuts, time."""
        bounded = f", {self.num_bounded} at the depth bound" if self.num_bounded else ""
        return (f"{self.policy} @ {self.scope.name}: {self.num_states} states, "
                f"{self.num_transitions} transitions, depth {self.max_depth}, "
                f"{self.num_cut} cut{bounded}, {self.seconds:.1f}s")


def explore(policy: str = "fcfs", scope: Scope | None = None, *, check_refinement: bool = True,
            keep_graph: bool = True, stop_at_first: bool = True,
            make_harness: Callable[[], Harness] | None = None,
            coverage: bool = True) -> Exploration:
    """Visit every reachable state of the real core for `policy` within `scope`.

    Every state is checked against the state invariants; every move against the
    plan budget, the event table and (with `check_refinement`) the reference
    spec. Violations carry a runnable test reproducing them. With `coverage`,
    `Exploration.coverage` counts the transitions that exercised each behaviour
    family (`cadence.spec.coverage`).
    """
    scope = scope or SCOPES["small"]
    with scope_patches(scope), (cov.probing() if coverage else contextlib.nullcontext()):
        return _explore(policy, scope, check_refinement, keep_graph, stop_at_first,
                        make_harness, coverage)


def _explore(policy, scope, check_refinement, keep_graph, stop_at_first, make_harness,
             coverage) -> Exploration:
    config, cache = scope.configs(policy)
    make_harness = make_harness or (lambda: Harness(config, cache))
    result = Exploration(scope, policy, config, cache)
    tally = result.coverage = cov.Coverage(config, scope) if coverage else None
    horizon = scope.horizon(config)
    tenants = frozenset(s.tenant for s in scope.shapes)
    checker = StepChecker(config, cache)
    started = time.perf_counter()

    def key_of(h):
        return canonical_key(h, horizon, scope.counter_cap, tenants)

    init = make_harness()
    key0, _ = key_of(init)
    index = {key0: 0}
    result.parent.append(0)
    result.move.append(("init",))
    result.num_running.append(0)
    result.num_live.append(0)
    depth = [0]
    frontier = deque([(0, init)])
    edges = result.edges
    interned: dict[tuple, tuple] = {}

    def report(src: int, move: Move, problems: list[str]) -> None:
        moves = result.path_to(src) + [move]
        result.violations.append(Violation(problems, moves,
                                           counterexample_test(result, moves, problems)))

    while frontier:
        src, h = frontier.popleft()
        key, names = key_of(h)
        before = checker.state(h) if check_refinement else None
        for move, h2, problems, progress, families in _successors(
                h, names, scope, checker, before, tally is not None):
            result.num_transitions += 1
            if tally is not None:
                tally.add(families)
            if problems:
                report(src, move, problems)
                if stop_at_first:
                    result.complete = False
                    frontier.clear()
                    break
                continue
            try:
                key2, names2 = key_of(h2)
            except Cut:
                result.num_cut += 1
                continue
            dst = index.get(key2)
            if dst is None:
                state_problems = checker.check_state(h2)
                if state_problems:
                    report(src, move, state_problems)
                    if stop_at_first:
                        result.complete = False
                        frontier.clear()
                        break
                dst = index[key2] = len(result.parent)
                result.parent.append(src)
                result.move.append(move)
                result.num_running.append(len(h2.scheduler.running))
                result.num_live.append(len(names2))
                depth.append(depth[src] + 1)
                result.max_depth = max(result.max_depth, depth[dst])
                if len(index) >= scope.max_states:
                    result.complete = False
                elif scope.max_depth is not None and depth[dst] >= scope.max_depth:
                    result.num_bounded += 1
                else:
                    frontier.append((dst, h2))
            if keep_graph:
                where = {rid: i for i, rid in enumerate(names2)}
                rename = tuple(where.get(rid, -1) for rid in names)
                rename = interned.setdefault(rename, rename)
                edges.append((src, dst, move, progress, rename))
    result.num_states = len(index)
    result.seconds = time.perf_counter() - started
    return result


def _successors(h: Harness, names: list[str], scope: Scope, checker: StepChecker, before,
                probe: bool = False):
    """Yield (move, new harness, problems, progress, families) for every move from `h`."""
    s = h.scheduler
    live = len(names)
    check = before is not None
    snap = cov.snapshot(s, [f.plan for f in h.inflight]) if probe else None
    cov.take_hits()

    def families(kind, h2, events):
        if not probe:
            return ()
        return cov.observe(kind, snap, h2.scheduler, [f.plan for f in h2.inflight], events,
                           cov.take_hits())

    def after_simple(move, fn, kind=None):
        h2 = h.clone(stats=False)
        if not apply_move(h2, move, names, scope):
            cov.take_hits()
            return None
        problems = fn(h2) if check else []
        return move, h2, problems, False, families(kind or move[0], h2, h2.last_events)

    if live < scope.max_live:
        for k, shape in enumerate(scope.shapes):
            if live + shape.n > scope.max_live:
                continue

            def add_check(h2, n=shape.n):
                added = [h2.scheduler.requests[f"r{h2.num_added - n + i}"] for i in range(n)]
                if n > 1:
                    return checker.check_add_group(before, checker.state(h2), added)
                return checker.check_add(before, checker.state(h2), added[0])
            got = after_simple(("add", k), add_check)
            if got is not None:
                yield got
    if scope.aborts or scope.fails:
        kinds = (["abort"] if scope.aborts else []) + (["fail"] if scope.fails else [])
        for kind in kinds:
            for i in range(live):
                yield after_simple((kind, i), lambda h2, i=i: checker.check_remove(
                    before, checker.state(h2), names[i], h2.last_events))
    if scope.executor_loss and (s.running or s.blocks.evictable):
        yield after_simple(("lost",), lambda h2: checker.check_executor_lost(
            before, checker.state(h2), h2.last_events))
    if scope.duplicates and h.last_answered is not None:
        key = canonical_key(h, scope.horizon(s.config))[0] if check else None

        def unchanged(h2):
            problems = [f"a duplicated result produced events {h2.last_events}"] \
                if h2.last_events else []
            if canonical_key(h2, scope.horizon(s.config))[0] != key:
                problems.append("a duplicated result (of a plan answered or voided) changed "
                                "the core's state")
            return problems
        yield after_simple(("duplicate",), unchanged)
    if not live and not h.inflight:
        return
    if scope.max_inflight == 1:
        h1 = h.clone(stats=False)
        plan = h1.schedule()
        sched_events = h1.last_events
        planned = families("schedule", h1, sched_events)
        mid = checker.state(h1) if check else None
        problems = checker.check_schedule(h1, before, mid, plan, sched_events) if check else []
        if plan.is_empty:
            yield ("step", ()), h1, problems, False, planned
            return
        yield from _results(h1, names, scope, checker, mid, problems, "step", len(h1.inflight) - 1,
                            planned if probe else None)
        return
    if live and len(h.inflight) < scope.max_inflight:
        h1 = h.clone(stats=False)
        plan = h1.schedule()
        problems = (checker.check_schedule(h1, before, checker.state(h1), plan, h1.last_events)
                    if check else [])
        yield ("schedule",), h1, problems, False, families("schedule", h1, h1.last_events)
    for index in range(len(h.inflight) if scope.out_of_order else min(1, len(h.inflight))):
        yield from _results(h, names, scope, checker, before, [], "complete", index,
                            set() if probe else None)


def _results(h, names, scope, checker, before, problems, kind, index, planned=None):
    """Every outcome of answering the plan in flight at `index` (with the families
    each exercised, on top of `planned`, when probing)."""
    flight = h.inflight[index]
    where = {rid: i for i, rid in enumerate(names)}
    snap = (cov.snapshot(h.scheduler, [f.plan for f in h.inflight], flight.plan)
            if planned is not None else None)
    # Sampling end-of-sequence for a request already gone changes nothing.
    live = tuple(rid for rid in flight.samplers if rid in where)
    choices = list(_subsets(live)) if scope.eos else [()]
    for n, eos in enumerate(choices):
        # The last outcome may consume `h` itself when it is a private copy.
        h2 = h if (n == len(choices) - 1 and kind == "step") else h.clone(stats=False)
        cov.take_hits()
        events = h2.complete(eos, index)
        families = ()
        if planned is not None:
            families = set(planned) | cov.observe("result", snap, h2.scheduler,
                                                  [f.plan for f in h2.inflight], events,
                                                  cov.take_hits())
        out = list(problems)
        if before is not None:
            sampled = {rid: [0 if rid in eos else 1] for rid in flight.samplers}
            out += checker.check_update(before, checker.state(h2), flight.plan.step_id,
                                        sampled, events)
        progress = any(e.token_ids or e.transition is RequestEventKind.FINISH for e in events)
        move = (kind, tuple(sorted(where[r] for r in eos)))
        if kind == "complete" and index:
            move += (index,)  # a later plan answered first
        yield move, h2, out, progress, families


# ---- counterexamples --------------------------------------------------------------------
def replay(exploration: Exploration, moves: list[Move], *, checked: bool = True):
    """Replay canonical moves on a fresh harness; return it and the calls made, as code lines."""
    from .refinement import CheckedHarness
    scope = exploration.scope
    config, cache = exploration.config, exploration.cache_config
    h = CheckedHarness(config, cache) if checked else Harness(config, cache)
    horizon = scope.horizon(config)
    lines = []
    with scope_patches(scope):
        for move in moves:
            _, names = canonical_key(h, horizon)
            lines.append(_call(h, move, names, scope))
            try:
                apply_move(h, move, names, scope)
            except AssertionError:
                break
    return h, lines


def _call(h: Harness, move: Move, names: list[str], scope: Scope) -> str:
    kind = move[0]
    if kind == "add":
        shape = scope.shapes[move[1]]
        args = ", ".join(f"{k}={v!r}" for k, v in shape.kwargs().items())
        return f"h.add_group({args})" if shape.n > 1 else f"h.add({h.fresh_id()!r}, {args})"
    if kind in ("abort", "fail"):
        return f"h.{kind}({names[move[1]]!r})"
    if kind == "lost":
        return "h.executor_lost()"
    if kind == "duplicate":
        return "h.redeliver()"
    if kind == "schedule":
        return "h.schedule()"
    if len(move) > 2:
        return f"h.{kind}(eos={[names[i] for i in move[1]]!r}, index={move[2]})"
    return f"h.{kind}(eos={[names[i] for i in move[1]]!r})"


def counterexample_test(exploration: Exploration, moves: list[Move], problems: list[str]) -> str:
    """A pytest function that rebuilds the trace against the real `Scheduler`; each
    move is checked by `CheckedHarness`, so the test fails where the explorer did."""
    _, lines = replay(exploration, moves, checked=False)
    retry = exploration.scope.admission_retry_steps
    head = [
        "from cadence.statemachine.config import CacheConfig, SchedulerConfig",
        "from cadence.spec.refinement import CheckedHarness",
        "",
        "",
        f"def test_{exploration.policy.replace('-', '_').replace(':', '_').replace('.', '_')}"
        f"_counterexample({'monkeypatch' if retry is not None else ''}):",
        f'    """Found by the explorer: {problems[0][:100]!s}"""'.replace('\\', '\\\\'),
    ]
    if retry is not None:  # the scope's admission retry window
        head += ["    from cadence.statemachine import scheduler as core",
                 f'    monkeypatch.setattr(core, "ADMISSION_RETRY_STEPS", {retry})']
    head += [
        f"    h = CheckedHarness({exploration.config!r}, {exploration.cache_config!r})",
    ]
    return "\n".join(head + [f"    {line}" for line in lines] + [""])


# ---- identities -------------------------------------------------------------------------
@attrs.define
class IdentityResult:
    """A lockstep exploration of two policies: states and transitions visited,
    and the first move after which their decisions differed (with the path to it)."""

    policy: str
    reference: str
    scope: Scope
    num_states: int = 0
    num_transitions: int = 0
    difference: str | None = None
    moves: list[Move] = attrs.Factory(list)
    complete: bool = True

    def summary(self) -> str:
        """One line: the pair, scope, states, transitions and the verdict."""
        verdict = "identical" if self.difference is None else "DIFFER"
        return (f"{self.policy} = {self.reference} @ {self.scope.name}: {self.num_states} states, "
                f"{self.num_transitions} transitions, {verdict}")


def uniform_scope(scope: Scope) -> Scope:
    """`scope` with every shape made one tenant and one priority, without deadlines:
    the traces on which `fair`, `priority` and `deadline` must decide as `fcfs`."""
    first = scope.shapes[0]
    shapes = tuple(attrs.evolve(s, priority=first.priority, tenant=first.tenant,
                                deadline_after_s=None) for s in scope.shapes)
    return attrs.evolve(scope, name=f"{scope.name}-uniform", shapes=shapes)


def decisions(h: Harness) -> tuple:
    """What a move made the core decide: its events, the plans in flight and the
    last plan answered, with each plan's entries in order."""
    def plan_of(plan):
        return (plan, tuple(plan.num_scheduled_tokens))
    answered = None if h.last_answered is None else (plan_of(h.last_answered[0]),
                                                     h.last_answered[1])
    return (tuple(h.last_events), tuple(plan_of(f.plan) for f in h.inflight), answered)


def explore_identity(policy: str, scope: Scope | None = None,
                     reference: str = "fcfs") -> IdentityResult:
    """Explore `reference` on `uniform_scope(scope)` with `policy` shadowing every
    move of the environment: after each, both cores must have decided the same
    (`decisions`). Every state pair reachable within the scope is visited."""
    scope = uniform_scope(scope or SCOPES["small"])
    result = IdentityResult(policy, reference, scope)
    config, cache = scope.configs(reference)
    other = attrs.evolve(config, policy=policy)
    horizon = scope.horizon(config)
    tenants = frozenset(s.tenant for s in scope.shapes)
    checker = StepChecker(config, cache)

    def key_of(h, g):
        a, names = canonical_key(h, horizon, scope.counter_cap, tenants)
        return (a, canonical_key(g, horizon, scope.counter_cap, tenants)[0]), names

    with scope_patches(scope):
        start = (Harness(config, cache), Harness(other, cache))
        key0, _ = key_of(*start)
        parent: dict[tuple, tuple | None] = {key0: None}
        frontier = deque([(key0, start)])
        while frontier:
            key, (h, g) = frontier.popleft()
            _, names = key_of(h, g)
            # The moves the environment has here; each is made afresh on both cores.
            moves = [m[0] for m in _successors(h, names, scope, checker, None)]
            for move in moves:
                result.num_transitions += 1
                h2, g2 = h.clone(stats=False), g.clone(stats=False)
                made = apply_move(h2, move, names, scope)
                if made != apply_move(g2, move, names, scope) or decisions(h2) != decisions(g2):
                    path = [move]
                    back = key
                    while parent[back] is not None:
                        back, step = parent[back]
                        path.append(step)
                    result.moves = path[::-1]
                    result.difference = (f"after {result.moves}: {reference} decided "
                                         f"{decisions(h2)}, {policy} decided {decisions(g2)}")
                    result.num_states = len(parent)
                    return result
                try:
                    key2, _ = key_of(h2, g2)
                except Cut:
                    continue
                if key2 not in parent:
                    parent[key2] = (key, move)
                    if len(parent) >= scope.max_states:
                        result.complete = False
                    elif scope.max_depth is None or _depth(parent, key2) < scope.max_depth:
                        frontier.append((key2, (h2, g2)))
    result.num_states = len(parent)
    return result


def _depth(parent: dict, key) -> int:
    n = 0
    while parent[key] is not None:
        key = parent[key][0]
        n += 1
    return n
