"""Which behaviours of the core a check exercised: a registry of behaviour families.

A *family* is one kind of thing the scheduling core does (admit, preempt under
one victim rule, grow a table, evict a cached block, ignore a stale result...).
Families are observed from outside the core: `probing()` wraps a few of its
methods for the duration of a check and records who called them, and
`observe()` compares the harness before and after a move (events, statistics,
block-manager counters). The explorer, the Hypothesis machines and
`cadence check` all report through `Coverage`, so a family added here is
counted everywhere.

To add a family (new core behaviour): `register(Family(name, description,
reachable))`, and have `observe` (or a method wrapper in `_WRAPPED`) return its
name when a move exercises it. `reachable(config, scope)` says whether a policy
and scope can reach it at all; the CI test demands every reachable family be
reached at least once per policy.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from typing import Callable, Iterable, Iterator

import attrs

from cadence.statemachine.blocks import BlockManager
from cadence.statemachine.config import SchedulerConfig
from cadence.statemachine.fsm import FinishReason, RequestEventKind, RequestState
from cadence.statemachine.scheduler import Scheduler

E = RequestEventKind


def _always(config: SchedulerConfig, scope) -> bool:
    return True


@attrs.frozen
class Family:
    """A behaviour family: its name, what it means, and when it can be reached."""

    name: str
    description: str
    reachable: Callable[[SchedulerConfig, object], bool] = _always


FAMILIES: dict[str, Family] = {}
"""Every registered family, by name, in registration order."""


def register(family: Family) -> Family:
    """Add a family to the registry (a new name only)."""
    if family.name in FAMILIES:
        raise ValueError(f"family {family.name!r} is already registered")
    FAMILIES[family.name] = family
    return family


def _scope(attr: str, default=None):
    return lambda config, scope: bool(getattr(scope, attr, default))


def _preempting(config: SchedulerConfig, scope) -> bool:
    """Whether the policy may displace a running request for a waiting one."""
    from cadence.statemachine.policy import make_policy
    # The class's attribute: a policy may say it preempts only once its queue
    # has seen priorities far enough apart (a property, truthy on the class).
    policy = make_policy(config)
    return bool(getattr(type(policy), "preempts_running", True)) and config.preempt_for_priority \
        and config.enable_priority_scheduling and _spread(scope, "priority")


def _spread(scope, field: str) -> bool:
    shapes = getattr(scope, "shapes", None)
    return shapes is None or len({getattr(s, field) for s in shapes}) > 1


def _rejects(config: SchedulerConfig, scope) -> bool:
    from cadence.statemachine.policy import make_policy
    return config.reject_late and hasattr(make_policy(config), "deadline_of")


def _memo(config: SchedulerConfig, scope) -> bool:
    # Rejecting late requests on time rules out skipping an admission pass.
    return not config.reject_late


def _pipelined(config: SchedulerConfig, scope) -> bool:
    return getattr(scope, "max_inflight", 2) > 1


def _over_budget(config: SchedulerConfig, scope) -> bool:
    return config.batch_size_limit > config.max_num_batched_tokens


def _forks(config: SchedulerConfig, scope) -> bool:
    """Whether the scope submits request groups whose prompts have a block to share."""
    shapes = getattr(scope, "shapes", None)
    return shapes is None or any(getattr(s, "n", 1) > 1 and len(s.prompt) > 1 for s in shapes)


def _chunks(config: SchedulerConfig, scope) -> bool:
    shapes = getattr(scope, "shapes", None)
    longest = max((len(s.prompt) for s in shapes), default=0) if shapes else None
    return config.enable_chunked_prefill and (longest is None
                                              or longest > config.max_num_batched_tokens)


for _family in (
    Family("admit", "a waiting request is admitted"),
    Family("readmit.prefix_hit", "a preempted or recomputed request comes back with cached blocks"),
    Family("readmit.no_hit", "a preempted or recomputed request comes back with nothing cached"),
    Family("preempt.grow_other", "a running request's growth preempts another (policy.victim)"),
    Family("preempt.grow_self", "a running request that cannot grow is its own victim"),
    Family("preempt.displace_seat",
           "a waiting request displaces a running one for a seat (may_preempt)", _preempting),
    Family("preempt.displace_blocks",
           "a waiting request displaces a running one for KV blocks (may_preempt)", _preempting),
    Family("grow", "a running request's table gets a fresh block"),
    Family("evict", "a cached block nobody holds is evicted for a fresh one"),
    Family("chunk", "a prefill is split: a request is scheduled short of its tokens", _chunks),
    Family("budget.more_running_than_tokens",
           "a plan is made with more requests running than the budget has tokens", _over_budget),
    Family("inflight.two_plans", "two plans are in flight at once", _pipelined),
    Family("inflight.request_in_two_plans", "one request is scheduled in two plans in flight",
           lambda c, s: _pipelined(c, s) and (_chunks(c, s) or c.async_scheduling)),
    Family("executor_lost", "the executor is lost", _scope("executor_loss", True)),
    Family("executor_lost.inflight", "the executor is lost with plans in flight",
           lambda c, s: _scope("executor_loss", True)(c, s) and _pipelined(c, s)),
    Family("result.stale", "a result names a request preempted, re-admitted or gone since its plan",
           _pipelined),
    Family("result.duplicate", "a result for a plan already answered or voided changes nothing",
           _scope("duplicates", True)),
    Family("reject", "a late waiting request is rejected (reject_late)", _rejects),
    Family("memo.set", "an admission pass that admitted nothing is remembered", _memo),
    Family("memo.hit", "a remembered failed pass stands: the admission pass is skipped", _memo),
    Family("memo.miss.released", "a remembered pass is retried: blocks were released", _memo),
    Family("memo.miss.window", "a remembered pass is retried: its retry window ran out", _memo),
    Family("fork.wait", "a request of a group waits while a sibling computes the shared prompt",
           _forks),
    Family("fork.share", "a request of a group is admitted holding the prompt blocks a sibling "
           "computed", _forks),
    Family("fork.lead_again", "a request of a group computes the shared prompt although a sibling "
           "was admitted before it (and went back to waiting, or was lost with the executor)",
           _forks),
    Family("fork.preempt_shared", "a request holding prompt blocks its siblings hold too is "
           "preempted; they keep the blocks", _forks),
):
    register(_family)


def _overlap(config: SchedulerConfig, scope) -> bool:
    """Async scheduling with two plans in flight: a decode planned ahead."""
    return config.async_scheduling and _pipelined(config, scope)


def _overtaking(config: SchedulerConfig, scope) -> bool:
    """A later plan may be answered first, so the core holds its answer back."""
    return _overlap(config, scope) and _scope("out_of_order", True)(config, scope)


# Overlapped plans (async scheduling); their invariants are OVERLAP_INVARIANTS in
# cadence.spec.invariants.
for _family in (
    Family("overlap.request_in_two_plans",
           "a decoding request is planned ahead: in the next plan before its token arrives",
           _overlap),
    Family("overlap.no_lookahead_at_limit",
           "a request whose token in flight ends it by length is not planned ahead", _overlap),
    Family("overlap.stop_one_step_late",
           "a stop token ends a request that a later plan in flight computes (one extra "
           "token, never emitted)",
           lambda c, s: _overlap(c, s) and _scope("eos", True)(c, s)),
    Family("overlap.answer_deferred",
           "an answer that overtook an older plan sampling for the same request is held back",
           _overtaking),
    Family("overlap.held_answer_applied",
           "a held-back answer is applied once the older plan's answer arrives", _overtaking),
    Family("overlap.preempted_with_token_in_flight",
           "a request whose sampled token is still in flight is preempted", _overlap),
    Family("overlap.executor_lost_ahead",
           "the executor is lost while a request is planned ahead",
           lambda c, s: _overlap(c, s) and _scope("executor_loss", True)(c, s)),
):
    register(_family)


# ---- method wrappers ---------------------------------------------------------------------
_sink: list[str] | None = None


def _hit(name: str) -> None:
    if _sink is not None:
        _sink.append(name)


def _wrap_preempt(real):
    def _preempt(self, victim, *args, **kwargs):
        if victim.pending_steps and self.config.async_scheduling:
            _hit("overlap.preempted_with_token_in_flight")
        caller = sys._getframe(1)
        where = caller.f_code.co_name
        if where == "_preempt_for":
            admit = caller.f_back
            local = admit.f_locals if admit is not None else {}
            seat = (not local.get("has_room", True)
                    or len(self.running) >= self.config.max_num_seqs)
            _hit("preempt.displace_seat" if seat else "preempt.displace_blocks")
        elif caller.f_locals.get("request") is victim:
            _hit("preempt.grow_self")
        else:
            _hit("preempt.grow_other")
        if _holds_shared(self, victim):
            _hit("fork.preempt_shared")
        return real(self, victim, *args, **kwargs)
    return _preempt


def _wrap_sibling_prefix(real):
    def _sibling_prefix(self, request, hits):
        got = real(self, request, hits)
        if got is None:
            _hit("fork.wait")
        elif got is not hits:
            _hit("fork.share")
        elif len(hits) * self.blocks.block_size < request.group.num_shared_tokens and any(
                m is not request and m.first_scheduled_s is not None for m in request.group.members):
            _hit("fork.lead_again")
        return got
    return _sibling_prefix


def _holds_shared(s: Scheduler, request) -> bool:
    """Whether `request` holds prompt blocks of its group that a sibling holds too."""
    group = getattr(request, "group", None)
    tables = s.blocks.tables
    table = tables.get(request.request_id)
    return bool(group is not None and table and any(
        m is not request and tables.get(m.request_id, [None])[0] == table[0] for m in group.members))


def _wrap_admit(real):
    def _admit(self, *args, **kwargs):
        _hit("_admit_called")
        return real(self, *args, **kwargs)
    return _admit


def _wrap_grow(real):
    def grow(self, request_id, num_tokens):
        new = real(self, request_id, num_tokens)
        if new:
            _hit("grow")
        return new
    return grow


_WRAPPED = ((Scheduler, "_preempt", _wrap_preempt), (Scheduler, "_admit", _wrap_admit),
            (BlockManager, "grow", _wrap_grow), (Scheduler, "_sibling_prefix", _wrap_sibling_prefix))


@contextlib.contextmanager
def probing() -> Iterator[None]:
    """Wrap the core's methods that families are read from, for this block only."""
    global _sink
    saved = []
    for cls, name, wrap in _WRAPPED:
        real = cls.__dict__.get(name)
        if real is None:
            continue  # renamed in the core: that family reads as unreached
        saved.append((cls, name, real))
        setattr(cls, name, wrap(real))
    _sink = []
    try:
        yield
    finally:
        for cls, name, real in saved:
            setattr(cls, name, real)
        _sink = None


def take_hits() -> list[str]:
    """The wrapped calls recorded since the last take."""
    global _sink
    if _sink is None:
        return []
    out, _sink = _sink, []
    return out


# ---- one move seen from outside ----------------------------------------------------------
@attrs.frozen
class Before:
    """What `observe` needs of the state a move leaves."""

    num_inflight: int
    num_evictions: int
    memo_hits: int
    resume_hits: int
    memo: tuple | None
    step_id: int
    resumed: frozenset
    stale: bool
    num_held: int = 0
    ahead: frozenset = frozenset()
    at_limit: frozenset = frozenset()


def snapshot(s: Scheduler, plans: list, plan=None) -> Before:
    """The parts of the core's state that `observe` compares (before a move);
    `plans`: the plans in flight; `plan`: the plan about to be answered, if the
    move is a result."""
    failed = getattr(s, "_failed_admission", None)
    memo = None
    if failed is not None and failed[0] == getattr(s, "_queue_version", None):
        memo = (failed[1] == s.blocks.num_releases, s.step_id >= failed[2])
    resumed = frozenset(rid for rid, r in s.requests.items()
                        if r.state is RequestState.PENDING and r.first_scheduled_s is not None)
    stale = False
    if plan is not None:
        for rid in plan.num_scheduled_tokens:
            r = s.requests.get(rid)
            if r is None or r.fsm.state is not RequestState.RUNNING or r.admitted_step > plan.step_id:
                stale = True
                break
    # Overlap: requests computed past their known tokens (planned ahead), and
    # those whose one token in flight ends them by length.
    running = [r for r in s.requests.values() if r.state is RequestState.RUNNING]
    ahead = frozenset(r.request_id for r in running if r.num_computed_tokens > r.num_tokens)
    at_limit = frozenset(r.request_id for r in running if s.config.async_scheduling
                         and r.num_computed_tokens == r.num_tokens
                         and len(r.pending_steps) == 1 and r.num_tokens + 1 >= r.length_limit)
    return Before(len(plans), getattr(s.blocks, "num_evictions", 0),
                  getattr(s.collector, "num_admission_memo_hits", 0), s.num_resume_hit_tokens,
                  memo, s.step_id, resumed, stale, len(getattr(s, "_early", ())), ahead,
                  at_limit)


def observe(kind: str, before: Before, s: Scheduler, plans: list, events: Iterable,
            hits: Iterable[str]) -> set[str]:
    """The families one move exercised. `kind`: schedule, result, lost, duplicate,
    or another move's name; `plans`: the plans in flight after it; `events` the
    core's events; `hits` the wrapped calls (`take_hits`)."""
    out = {x for x in hits if not x.startswith("_")}
    events = list(events)
    kinds = {e.transition for e in events}
    if getattr(s.blocks, "num_evictions", 0) > before.num_evictions:
        out.add("evict")
    if E.REJECT in kinds:
        out.add("reject")
    if kind == "lost":
        out.add("executor_lost")
        if before.num_inflight:
            out.add("executor_lost.inflight")
        if before.ahead:
            out.add("overlap.executor_lost_ahead")
    elif kind == "duplicate":
        out.add("result.duplicate")
    elif kind == "result":
        if before.stale:
            out.add("result.stale")
        held = len(getattr(s, "_early", ()))
        if held > before.num_held:
            out.add("overlap.answer_deferred")
        elif held < before.num_held:
            out.add("overlap.held_answer_applied")
        # A request planned ahead stops on the one token this answer brought: the
        # plan ahead computed a token that is never emitted.
        emitted: Counter = Counter()
        for e in events:
            emitted[e.request_id] += len(e.token_ids)
        if any(e.finish_reason is FinishReason.STOP and e.request_id in before.ahead
               and emitted[e.request_id] == 1 for e in events):
            out.add("overlap.stop_one_step_late")
    if kind != "schedule":
        return out
    requests = s.requests
    newest = plans[-1].num_scheduled_tokens if len(plans) > before.num_inflight else {}
    if any(requests[rid].num_computed_tokens > requests[rid].num_tokens
           for rid in newest if rid in requests):
        out.add("overlap.request_in_two_plans")
    if any(rid not in newest and rid in requests and requests[rid].state is RequestState.RUNNING
           for rid in before.at_limit):
        out.add("overlap.no_lookahead_at_limit")
    called = "_admit_called" in hits
    if E.ADMIT in kinds:
        out.add("admit")
        back = [e.request_id for e in events if e.transition is E.ADMIT
                and e.request_id in before.resumed]
        if back:
            out.add("readmit.prefix_hit" if s.num_resume_hit_tokens > before.resume_hits
                    else "readmit.no_hit")
    if getattr(s.collector, "num_admission_memo_hits", 0) > before.memo_hits:
        out.add("memo.hit")
    elif before.memo is not None and called:
        same_releases, window_over = before.memo
        if window_over:
            out.add("memo.miss.window")
        elif not same_releases:
            out.add("memo.miss.released")
    failed = getattr(s, "_failed_admission", None)
    if failed is not None and failed[0] == getattr(s, "_queue_version", None) \
            and failed[2] > before.step_id and called:
        out.add("memo.set")
    if len(plans) >= 2 and len(plans) > before.num_inflight:
        out.add("inflight.two_plans")
        newest = plans[-1].num_scheduled_tokens
        if any(rid in p.num_scheduled_tokens for p in plans[:-1] for rid in newest):
            out.add("inflight.request_in_two_plans")
    if len(plans) > before.num_inflight:
        plan = plans[-1]
        if len(plan.num_scheduled_tokens) and len(s.running) > s.config.max_num_batched_tokens:
            out.add("budget.more_running_than_tokens")
        for rid in plan.num_scheduled_tokens:
            r = s.requests.get(rid)
            if r is not None and r.num_computed_tokens < r.num_prompt_tokens:
                out.add("chunk")
                break
    return out


def watch(kind: str, s: Scheduler, plans: Callable[[], list], move: Callable[[], list],
          plan=None) -> set[str]:
    """Make one move (`move()` returns its events) and return the families it
    exercised; `plans()` lists the plans in flight (read before and after)."""
    before = snapshot(s, plans(), plan)
    with probing():
        events = move()
        hits = take_hits()
    return observe(kind, before, s, plans(), events, hits)


def hypothesis_report(families: Iterable[str], seen: set[str]) -> None:
    """Tell Hypothesis which families a move exercised (`event`); add them to `seen`."""
    from hypothesis import event
    for name in sorted(families):
        event(f"family: {name}")
    seen.update(families)


def hypothesis_target(seen: set[str]) -> None:
    """Ask Hypothesis to maximise the distinct families a run reaches (once per run)."""
    from hypothesis import target
    target(float(len(seen)), label="behaviour families reached")


# ---- the tally --------------------------------------------------------------------------
@attrs.define
class Coverage:
    """Transitions that exercised each family, for one policy and scope."""

    config: SchedulerConfig
    scope: object = None
    counts: Counter = attrs.Factory(Counter)

    def add(self, families: Iterable[str]) -> None:
        """Count one transition's families."""
        self.counts.update(set(families))

    def reachable(self) -> list[str]:
        """The registered families this policy and scope can reach."""
        return [n for n, f in FAMILIES.items() if f.reachable(self.config, self.scope)]

    def missing(self) -> list[str]:
        """Reachable families no transition exercised."""
        return [n for n in self.reachable() if not self.counts.get(n)]

    def rows(self) -> list[tuple[str, str]]:
        """(family, count or "-" where unreachable) in registry order."""
        able = set(self.reachable())
        return [(n, str(self.counts.get(n, 0)) if n in able else "-") for n in FAMILIES]


def format_table(coverages: dict[str, Coverage]) -> str:
    """A table: one row per family, one column per label (policy @ scope)."""
    labels = list(coverages)
    width = max(len(n) for n in FAMILIES) + 2
    cols = [max(len(label), 7) + 2 for label in labels]
    lines = ["family".ljust(width) + "".join(label.rjust(c) for label, c in zip(labels, cols))]
    rows = {label: dict(cov.rows()) for label, cov in coverages.items()}
    for name in FAMILIES:
        cells = [rows[label][name] for label in labels]
        mark = "  <- not reached" if "0" in cells else ""
        lines.append(name.ljust(width) + "".join(v.rjust(c) for v, c in zip(cells, cols)) + mark)
    return "\n".join(lines)
