"""The invariants of DESIGN §4 as named predicates.

State invariants (items 1-8 on one state) are defined once, in
`cadence.statemachine.invariants`, and re-exported here. This module adds the
ones that need a plan, a transition or a whole event sequence:

- `plan_within_budget` (item 7, per plan), re-exported;
- `group_prompt_computed_once` (per plan, re-exported): a request group's
  shared prompt blocks are computed by one member while the others wait;
- `plan_gives_every_request_a_token`: a request in a plan is scheduled for at
  least one token (a plan made at zero budget must leave it out);
- `overtaken_only_when_skipped` (per plan; with item 11, the aging bound): a
  request admitted ahead of one the policy ranks before it passed it over for
  not fitting, which counts a skip, and nobody is passed over more than
  `starvation_skip_limit` times; so under `priority` a request waits behind
  later arrivals for at most (its priority - theirs) * aging_steps steps plus
  that many passes;
- `inflight_within_budget` (item 7 with several plans in flight): every plan
  in flight is within the budget and no request has more tokens scheduled
  across them than it has computed;
- `OVERLAP_INVARIANTS` (async scheduling, a request in two plans at once):
  pending steps name plans in flight, computed tokens count those in flight,
  a second plan holds a request only as a one-token decode planned ahead, its
  blocks are held, nothing is planned past a length limit, and an answer held
  back waits for an older plan;
- `transition_events` (item 10 on one transition): the events a call returned
  match the phase changes, along table edges only;
- `fcfs_within_class` (item 9) and `table_edges_only` / `completed_exactly_once`
  (item 10) over a trace in the format of `cadence.spec.trace`;
- `core_table_matches_design`: the core's transition table is DESIGN §3.

Every predicate returns a list of violation messages (empty when it holds).
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

from cadence.statemachine import fsm
from cadence.statemachine.invariants import (
    STATE_INVARIANTS, InvariantViolation, blocks_partition, cached_hashes_consistent,
    check_scheduler, completed_hold_nothing_running_hold_enough, group_prompt_computed_once,
    groups_share_prompt_blocks, limits_respected, plan_within_budget, queues_partition, refcounts_match_tables, violations,
)

from .reference import COMPLETED, EDGES, PENDING, REASONS, RUNNING, RefState

__all__ = [
    "STATE_INVARIANTS", "PLAN_INVARIANTS", "TRACE_INVARIANTS", "InvariantViolation",
    "blocks_partition", "refcounts_match_tables", "cached_hashes_consistent",
    "completed_hold_nothing_running_hold_enough", "queues_partition", "limits_respected",
    "groups_share_prompt_blocks", "group_prompt_computed_once",
    "plan_within_budget", "overtaken_only_when_skipped", "violations", "check_scheduler", "transition_events",
    "fcfs_within_class", "table_edges_only", "completed_exactly_once",
    "core_table_matches_design", "trace_violations", "plan_gives_every_request_a_token",
    "inflight_within_budget", "INFLIGHT_INVARIANTS", "OVERLAP_INVARIANTS",
    "pending_steps_name_plans_in_flight", "computed_covers_tokens_in_flight",
    "request_in_two_plans_only_ahead", "lookahead_blocks_reserved",
    "no_lookahead_past_length_limit", "held_answers_wait_for_older_plans",
    "inflight_violations",
]


def plan_gives_every_request_a_token(s, plan) -> list[str]:
    """Every request a plan names is given at least one token."""
    return [f"plan {plan.step_id} schedules {rid!r} for {n} tokens; at least 1 is required"
            for rid, n in plan.num_scheduled_tokens.items() if n < 1]


def inflight_within_budget(s, plans) -> list[str]:
    """Item 7 across the plans in flight: each is within the token budget and
    batch limit, its total is the sum of its entries, and no live request has
    more tokens scheduled in flight than it has computed."""
    c = s.config
    out = []
    in_flight: dict[str, int] = {}
    for plan in plans:
        tokens = plan.num_scheduled_tokens
        total = sum(tokens.values())
        if total != plan.total_num_scheduled_tokens:
            out.append(f"plan {plan.step_id}: total_num_scheduled_tokens is "
                       f"{plan.total_num_scheduled_tokens}, its entries sum to {total}")
        if total > c.max_num_batched_tokens:
            out.append(f"plan {plan.step_id} in flight schedules {total} tokens; "
                       f"max_num_batched_tokens is {c.max_num_batched_tokens}")
        if len(tokens) > c.batch_size_limit:
            out.append(f"plan {plan.step_id} in flight batches {len(tokens)} requests; "
                       f"the batch size limit is {c.batch_size_limit}")
        for rid, n in tokens.items():
            if s.requests.get(rid) is not None and s.requests[rid].admitted_step <= plan.step_id:
                in_flight[rid] = in_flight.get(rid, 0) + n
    for rid, n in in_flight.items():
        r = s.requests[rid]
        if r.state is fsm.RequestState.RUNNING and n > r.num_computed_tokens:
            out.append(f"request {rid!r} has {n} tokens scheduled in flight but "
                       f"num_computed_tokens is {r.num_computed_tokens}")
    return out


def overtaken_only_when_skipped(s, plan) -> list[str]:
    """A request this plan admits goes ahead of a waiting request the policy
    ranks before it (`sorts_after`, ties apart) only by passing it over for not
    fitting, which counted a skip; and no waiting request has been passed over
    more than `starvation_skip_limit` times (it then holds capacity: nothing
    ranked after it is admitted). Requests preempted by this plan and group
    members (which wait for a sibling's prompt) are not passed over."""
    policy = s.policy
    sorts_after = getattr(policy, "sorts_after", None)
    limit = s.config.starvation_skip_limit
    waiting = [r for r in s.requests.values() if r.state is fsm.RequestState.PENDING]
    out = [f"{r.request_id!r} has been passed over {r.num_skips} times; "
           f"starvation_skip_limit is {limit}" for r in waiting if r.num_skips > limit]
    if sorts_after is None:
        return out
    ties = getattr(policy, "ties", None)
    preempted = set(plan.preempted_ids)
    admitted = [s.requests[d.request_id] for d in plan.new_requests if d.request_id in s.requests]
    for w in waiting:
        if w.num_skips or w.group is not None or w.request_id in preempted:
            continue
        for r in admitted:
            if sorts_after(r, w) and not (ties is not None and ties(r, w)):
                out.append(f"plan {plan.step_id} admits {r.request_id!r} ahead of "
                           f"{w.request_id!r}, which the policy ranks first, without "
                           f"counting a skip")
    return out


PLAN_INVARIANTS = {"plan_within_budget": plan_within_budget,
                   "plan_gives_every_request_a_token": plan_gives_every_request_a_token,
                   "overtaken_only_when_skipped": overtaken_only_when_skipped,
                   "group_prompt_computed_once": group_prompt_computed_once}
"""Predicates over one plan as made: (scheduler, plan) -> messages."""

INFLIGHT_INVARIANTS = {"inflight_within_budget": inflight_within_budget}
"""Predicates over every plan in flight after a move: (scheduler, plans) -> messages."""

def _pending(s):
    """The live requests with plans in flight that sample for them."""
    return [r for r in s.requests.values() if r.pending_steps]


def pending_steps_name_plans_in_flight(s, plans) -> list[str]:
    """A request's pending steps are increasing, each a plan in flight that
    schedules it, either unanswered (`plans`) or answered and held back
    (`Scheduler._early`); only running requests have them, at most two with
    async scheduling (the plan ahead) and one without."""
    out = []
    unanswered = {p.step_id for p in plans}
    held = getattr(s, "_early", {})
    limit = 2 if s.config.async_scheduling else 1
    for r in _pending(s):
        rid, pending = r.request_id, r.pending_steps
        if r.state is not fsm.RequestState.RUNNING:
            out.append(f"{rid!r} is {r.state.value} with plans pending {pending}")
        if any(a >= b for a, b in zip(pending, pending[1:])):
            out.append(f"{rid!r} has pending steps {pending}, not increasing")
        if len(pending) > limit:
            out.append(f"{rid!r} has {len(pending)} plans pending {pending}; at most {limit} "
                       f"with async_scheduling={s.config.async_scheduling}")
        for k in pending:
            plan = s._inflight.get(k)
            if k not in unanswered and k not in held:
                out.append(f"{rid!r} waits for plan {k}, which is neither in flight nor held back")
            elif plan is None or rid not in plan.num_scheduled_tokens:
                out.append(f"{rid!r} waits for plan {k}, which does not schedule it")
    return out


def computed_covers_tokens_in_flight(s, plans) -> list[str]:
    """A request with pending steps has computed every known token and, for each
    plan after the first, the position of the token sampled before it:
    num_computed_tokens == num_tokens + len(pending_steps) - 1."""
    out = []
    for r in _pending(s):
        want = r.num_tokens + len(r.pending_steps) - 1
        if r.num_computed_tokens != want:
            out.append(f"{r.request_id!r} computed {r.num_computed_tokens} tokens with "
                       f"{r.num_tokens} known and plans {r.pending_steps} pending; expected {want}")
    return out


def request_in_two_plans_only_ahead(s, plans) -> list[str]:
    """A request in two plans in flight (since its admission) whose older one
    samples for it is in the newer only as a one-token decode planned ahead,
    with async scheduling, and that newer plan samples for it too."""
    out = []
    inflight = [s._inflight[k] for k in sorted(s._inflight)]
    for r in s.requests.values():
        rid = r.request_id
        mine = [p for p in inflight if rid in p.num_scheduled_tokens
                and p.step_id >= r.admitted_step]
        for older, newer in zip(mine, mine[1:]):
            if older.step_id not in r.pending_steps:
                continue  # successive chunks of a prefill
            n = newer.num_scheduled_tokens[rid]
            if not s.config.async_scheduling:
                out.append(f"{rid!r} is in plans {older.step_id} and {newer.step_id} after "
                           "sampling in the first, without async scheduling")
            elif n != 1 or newer.step_id not in r.pending_steps:
                out.append(f"{rid!r} is planned ahead in plan {newer.step_id} for {n} tokens "
                           f"(pending {r.pending_steps}); only a one-token decode that samples "
                           "may follow a plan that samples for it")
    return out


def lookahead_blocks_reserved(s, plans) -> list[str]:
    """The blocks a plan made before the previous result needs are held: the
    table of a request with pending steps covers its num_computed_tokens."""
    bm = s.blocks
    out = []
    for r in _pending(s):
        held, need = len(bm.tables.get(r.request_id, ())), bm.blocks_for(r.num_computed_tokens)
        if held < need:
            out.append(f"{r.request_id!r} holds {held} blocks for {r.num_computed_tokens} "
                       f"computed tokens ({need} needed), plans {r.pending_steps} pending")
    return out


def no_lookahead_past_length_limit(s, plans) -> list[str]:
    """No request is planned ahead past its length limit: its known tokens plus
    those in flight stay within it (a token that ends it is never followed)."""
    return [f"{r.request_id!r} has {r.num_tokens} tokens and {len(r.pending_steps)} in flight "
            f"past its length limit {r.length_limit}"
            for r in _pending(s) if r.num_tokens + len(r.pending_steps) > r.length_limit]


def held_answers_wait_for_older_plans(s, plans) -> list[str]:
    """An answer held back is for an answered plan still in flight behind an
    older one: never the oldest plan's (that one is applied at once), never a
    plan the executor has not answered."""
    out = []
    held = getattr(s, "_early", {})
    if not held:
        return out
    oldest = min(s._inflight, default=None)
    unanswered = {p.step_id for p in plans}
    for k, result in held.items():
        if result.step_id != k:
            out.append(f"the answer held for plan {k} is plan {result.step_id}'s")
        if k not in s._inflight:
            out.append(f"an answer is held for plan {k}, which is not in flight")
        elif k == oldest:
            out.append(f"the answer to plan {k}, the oldest in flight, is held back")
        if k in unanswered:
            out.append(f"an answer is held for plan {k}, which the executor has not answered")
    return out


OVERLAP_INVARIANTS: dict[str, Callable] = {
    "pending_steps_name_plans_in_flight": pending_steps_name_plans_in_flight,
    "computed_covers_tokens_in_flight": computed_covers_tokens_in_flight,
    "request_in_two_plans_only_ahead": request_in_two_plans_only_ahead,
    "lookahead_blocks_reserved": lookahead_blocks_reserved,
    "no_lookahead_past_length_limit": no_lookahead_past_length_limit,
    "held_answers_wait_for_older_plans": held_answers_wait_for_older_plans,
}
"""Predicates for overlapped plans (a request in two plans at once, the second
planned before the first's result), (scheduler, unanswered plans) -> messages;
checked beside INFLIGHT_INVARIANTS after every move."""



def inflight_violations(s, plans) -> list[str]:
    """Every predicate over the plans in flight that fails, as 'name: message'."""
    return [f"{name}: {m}" for group in (INFLIGHT_INVARIANTS, OVERLAP_INVARIANTS)
            for name, pred in group.items() for m in pred(s, plans)]


_KIND_NAMES = {k: k.value for k in fsm.RequestEventKind}


def core_table_matches_design() -> list[str]:
    """Item 10, statically: the core's `TRANSITIONS` holds exactly the edges of DESIGN §3
    and its finish reasons are those of the spec."""
    core = {(src.value, ev.value): dst.value
            for src, row in fsm.TRANSITIONS.items() for ev, dst in row.items()}
    out = [f"core has edge {k} -> {v} not in DESIGN" for k, v in core.items() if EDGES.get(k) != v]
    out += [f"core lacks edge {k} -> {v}" for k, v in EDGES.items() if k not in core]
    reasons = {k.value: frozenset(r.value for r in v) for k, v in fsm.FINISH_REASONS.items()}
    if reasons != REASONS:
        out.append(f"core finish reasons {reasons} differ from DESIGN {REASONS}")
    return out


def transition_events(before: RefState, after: RefState, events: Iterable) -> list[str]:
    """Item 10 on one transition: each request whose phase changed reports exactly one
    event along a table edge; a request completes only by a completing event, once."""
    out = []
    seen: dict[str, list[str]] = {}
    for e in events:
        if e.transition is not None:
            seen.setdefault(e.request_id, []).append(_KIND_NAMES[e.transition])
        elif e.request_id not in before.requests:
            out.append(f"tokens for {e.request_id} which was not live")
    for rid, kinds in seen.items():
        b = before.requests.get(rid)
        if b is None:
            out.append(f"events {kinds} for {rid} which was not live")
            continue
        phase = b.phase
        for kind in kinds:
            nxt = EDGES.get((phase, kind))
            if nxt is None:
                out.append(f"{rid}: no edge from {phase} on {kind}")
                break
            phase = nxt
        a = after.requests.get(rid)
        end = COMPLETED if a is None else a.phase
        if phase != end:
            out.append(f"{rid}: events {kinds} lead to {phase} but it is {end}")
    for rid, b in before.requests.items():
        a = after.requests.get(rid)
        end = COMPLETED if a is None else a.phase
        if end != b.phase and rid not in seen:
            out.append(f"{rid} went from {b.phase} to {end} without an event")
    return out


def _walk(records: Iterable[dict]):
    """Yield (record, phase before, phase after or None if illegal) for each record."""
    phase: dict[str, str] = {}
    for rec in records:
        rid, event = rec["request_id"], rec["event"]
        if event == "add":
            before = phase.get(rid)
            phase[rid] = PENDING
            yield rec, before, PENDING
            continue
        if event == "tokens":
            yield rec, phase.get(rid), phase.get(rid)
            continue
        before = phase.get(rid)
        after = EDGES.get((before, event))
        if after is not None:
            phase[rid] = after
        yield rec, before, after


def table_edges_only(records: Iterable[dict]) -> list[str]:
    """Item 10 over a trace: every event is an edge of the DESIGN §3 table from the
    request's current state, and tokens arrive only while running."""
    out = []
    for rec, before, after in _walk(records):
        ev = rec["event"]
        if ev == "add" and before not in (None, COMPLETED):
            out.append(f"seq {rec['seq']}: {rec['request_id']} added while {before}")
        elif ev == "tokens" and before != RUNNING:
            out.append(f"seq {rec['seq']}: tokens for {rec['request_id']} while {before}")
        elif ev not in ("add", "tokens") and after is None:
            out.append(f"seq {rec['seq']}: no edge from {before} on {ev} for {rec['request_id']}")
    return out


def completed_exactly_once(records: Iterable[dict], require_complete: bool = True) -> list[str]:
    """Item 10 over a trace: each added request completes once (and, with
    `require_complete`, by the end of the trace)."""
    count: dict[str, int] = {}
    for rec, before, after in _walk(records):
        rid = rec["request_id"]
        if rec["event"] == "add":
            count[rid] = 0
        elif after == COMPLETED and before != COMPLETED:
            count[rid] = count.get(rid, 0) + 1
        elif before == COMPLETED:
            count[rid] = count.get(rid, 0) + 1
    out = [f"{rid} completed {n} times" for rid, n in count.items() if n > 1]
    if require_complete:
        out += [f"{rid} never completed" for rid, n in count.items() if n == 0]
    return out


def fcfs_within_class(records: Iterable[dict], block_size: int, *,
                      prefix_caching: bool = True, chunked_prefill: bool = True,
                      class_of: Callable[[Mapping], tuple] | None = None) -> list[str]:
    """Item 9 over a trace: inside one class (priority and tenant by default) a
    request admitted in a step while an earlier arrival waits is allowed only if
    the earlier one could not fit where the later one did.

    The trace carries no block counts, so "could not fit" is bounded from token
    counts: the earlier request needs at most ceil(tokens / block_size) blocks,
    the later one at least that minus its possible prefix-cache hits. A member
    of a request group (an add record's optional "group") may wait while a
    sibling runs (or in the step that preempts it): it waits for the prompt
    blocks the sibling computes. A
    violation reported here is therefore certain; a subtle one may pass.
    """
    class_of = class_of or (lambda add: (add["priority"], add["tenant"]))
    bdiv = lambda n: -(-n // block_size)  # noqa: E731
    adds: dict[str, dict] = {}
    ntok: dict[str, int] = {}
    phase: dict[str, str] = {}
    preempted_in: dict[str, int] = {}
    admitted_in: dict[str, set] = {}
    members: dict[str, list[str]] = {}
    suspects = []
    for rec in records:
        rid, ev, step = rec["request_id"], rec["event"], rec["step"]
        if ev == "add":
            adds[rid], ntok[rid], phase[rid] = rec, rec["prompt_len"], PENDING
            if rec.get("group") is not None:
                members.setdefault(rec["group"], []).append(rid)
            continue
        if ev in ("tokens", "finish"):
            ntok[rid] = ntok.get(rid, 0) + len(rec.get("tokens") or ())
        if ev == "preempt":
            preempted_in[rid] = step
        if ev == "admit":
            admitted_in.setdefault(rid, set()).add(step)
            b = adds[rid]
            need_b = bdiv(ntok[rid]) - ((ntok[rid] - 1) // block_size if prefix_caching else 0)
            for aid, a in adds.items():
                if (aid == rid or phase.get(aid) != PENDING or preempted_in.get(aid) == step
                        or class_of(a) != class_of(b) or not a["t"] < b["t"]):
                    continue
                if bdiv(ntok[aid]) > need_b:
                    continue
                if not chunked_prefill and ntok[aid] > ntok[rid]:
                    continue
                if any(phase.get(x) == RUNNING or preempted_in.get(x) == step
                       for x in members.get(a.get("group"), ()) if x != aid):
                    continue  # it waits for the prompt blocks a sibling computes
                suspects.append((rec, aid, step))
        after = EDGES.get((phase.get(rid), ev))
        if after is not None:
            phase[rid] = after
    return [f"seq {rec['seq']}: {rec['request_id']} admitted in step {step} while {aid} "
            f"of the same class, earlier and no larger, waited"
            for rec, aid, step in suspects if step not in admitted_in.get(aid, ())]


TRACE_INVARIANTS = {
    "table_edges_only": table_edges_only,
    "completed_exactly_once": completed_exactly_once,
}


def trace_violations(records: list[dict], block_size: int | None = None,
                     require_complete: bool = False, **fcfs_options) -> list[str]:
    """Every trace invariant that fails, as 'name: message' (item 9 only with `block_size`)."""
    out = [f"table_edges_only: {m}" for m in table_edges_only(records)]
    out += [f"completed_exactly_once: {m}"
            for m in completed_exactly_once(records, require_complete)]
    if block_size is not None:
        out += [f"fcfs_within_class: {m}"
                for m in fcfs_within_class(records, block_size, **fcfs_options)]
    return out
