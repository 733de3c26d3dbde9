"""The invariants of DESIGN §4 as named predicates.

State invariants (items 1-8 on one state) are defined once, in
`cadence.statemachine.invariants`, and re-exported here. This module adds the
ones that need a plan, a transition or a whole event sequence:

- `plan_within_budget` (item 7, per plan), re-exported;
- `group_prompt_computed_once` (per plan, re-exported): a request group's
  shared prompt blocks are computed by one member while the others wait;
- `plan_gives_every_request_a_token`: a request in a plan is scheduled for at
  least one token (a plan made at zero budget must leave it out);
- `inflight_within_budget` (item 7 with several plans in flight): every plan
  in flight is within the budget and no request has more tokens scheduled
  across them than it has computed;
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
    "plan_within_budget", "violations", "check_scheduler", "transition_events",
    "fcfs_within_class", "table_edges_only", "completed_exactly_once",
    "core_table_matches_design", "trace_violations", "plan_gives_every_request_a_token",
    "inflight_within_budget", "INFLIGHT_INVARIANTS", "OVERLAP_INVARIANTS",
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


PLAN_INVARIANTS = {"plan_within_budget": plan_within_budget,
                   "plan_gives_every_request_a_token": plan_gives_every_request_a_token,
                   "group_prompt_computed_once": group_prompt_computed_once}
"""Predicates over one plan as made: (scheduler, plan) -> messages."""

INFLIGHT_INVARIANTS = {"inflight_within_budget": inflight_within_budget}
"""Predicates over every plan in flight after a move: (scheduler, plans) -> messages."""

OVERLAP_INVARIANTS: dict[str, Callable] = {}
"""Predicates for overlapped plans (a request in two plans at once, the second
planned before the first's result), (scheduler, plans) -> messages; checked
beside INFLIGHT_INVARIANTS after every move once overlapped scheduling lands."""

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
