"""The invariants of DESIGN §4 as named predicates over the real core.

Each predicate returns a list of violations (empty when it holds), so a checker
can report all of them. `check_scheduler` raises on the first failing one; the
scheduler's debug mode, the tests, the model checker and the simulation all use
these same definitions (`cadence.spec.invariants` re-exports them).
"""

from __future__ import annotations

from typing import Callable

from .blocks import block_keys_for
from .fsm import RequestState
from .scheduler import Scheduler


class InvariantViolation(AssertionError):
    """An invariant of the scheduling core does not hold."""


def blocks_partition(s: Scheduler) -> list[str]:
    """§4.1: free + evictable + in use == num_blocks, and the three are disjoint;
    retained blocks are evictable ones."""
    bm = s.blocks
    free, evictable = set(bm.free_ids), set(bm.evictable)
    in_use = {b for b in range(bm.num_blocks) if bm.ref_counts[b] > 0}
    out = []
    if len(free) != len(bm.free_ids):
        out.append("free list holds a block twice")
    if free & evictable or free & in_use or evictable & in_use:
        out.append(f"block sets overlap: free&evictable={free & evictable}, "
                   f"free&in_use={free & in_use}, evictable&in_use={evictable & in_use}")
    if len(free) + len(evictable) + len(in_use) != bm.num_blocks:
        out.append(f"free {len(free)} + evictable {len(evictable)} + in use {len(in_use)} "
                   f"!= {bm.num_blocks}")
    retained = getattr(bm, "retained", set())
    if not retained <= evictable:
        out.append(f"retained blocks that are not evictable: {sorted(retained - evictable)}")
    unretained = getattr(bm, "_unretained", None)
    if unretained is not None and (set(unretained) != evictable - retained
                                   or list(unretained) != [b for b in bm.evictable if b not in retained]):
        out.append("the evictable blocks that are not retained are not listed in eviction order")
    return out


def refcounts_match_tables(s: Scheduler) -> list[str]:
    """§4.2: each block's refcount is the number of tables holding it; refcount 0
    exactly for free or evictable blocks."""
    bm = s.blocks
    counts = [0] * bm.num_blocks
    for table in bm.tables.values():
        for b in table:
            counts[b] += 1
    out = [f"block {b}: refcount {bm.ref_counts[b]} but held by {counts[b]} tables"
           for b in range(bm.num_blocks) if counts[b] != bm.ref_counts[b]]
    for table in bm.tables.values():
        if len(set(table)) != len(table):
            out.append(f"a table holds a block twice: {table}")
    return out


def cached_hashes_consistent(s: Scheduler) -> list[str]:
    """§4.3: every cached block's key matches the chained key of its contents in the
    tables that hold it, and the hash map holds each block once."""
    bm = s.blocks
    out = []
    seen: set[int] = set()
    for key, b in bm.cached.items():
        if b in seen:
            out.append(f"block {b} cached under two keys")
        seen.add(b)
        if bm.block_key[b] != key:
            out.append(f"block {b}: map key and block key differ")
    for b, key in enumerate(bm.block_key):
        if key is not None and bm.cached.get(key) != b:
            out.append(f"block {b} has a key but is not in the map")
    for rid, table in bm.tables.items():
        req = s.requests.get(rid)
        if req is None:
            continue
        keys = block_keys_for(req.all_token_ids, bm.block_size, req.cache_salt)
        for i, (b, key) in enumerate(zip(table, keys)):
            if bm.block_key[b] is not None and bm.block_key[b] != key:
                out.append(f"request {rid!r} block {i} (id {b}) cached with other contents")
    return out


def completed_hold_nothing_running_hold_enough(s: Scheduler) -> list[str]:
    """§4.5: only live requests hold blocks; a running request holds enough blocks for
    its computed tokens and no more than its reservation needs."""
    bm = s.blocks
    out = []
    for rid, table in bm.tables.items():
        req = s.requests.get(rid)
        if req is None or req.state is not RequestState.RUNNING:
            out.append(f"request {rid!r} holds blocks but is not running")
            continue
        low = bm.blocks_for(req.num_computed_tokens)
        high = bm.blocks_for(max(req.num_computed_tokens, req.num_tokens))
        if not low <= len(table) <= high:
            out.append(f"running {rid!r} holds {len(table)} blocks, expected {low}..{high} "
                       f"(computed {req.num_computed_tokens}, tokens {req.num_tokens})")
    for req in s.running:
        if req.request_id not in bm.tables:
            out.append(f"running {req.request_id!r} holds no table")
    return out


def queues_partition(s: Scheduler) -> list[str]:
    """§4.6: every live request is in exactly one of waiting and running."""
    waiting = s.policy.ordered()
    running = s.running
    wid = [r.request_id for r in waiting]
    rid = [r.request_id for r in running]
    out = []
    if len(set(wid)) != len(wid) or len(set(rid)) != len(rid):
        out.append("a request is queued twice")
    if set(wid) & set(rid):
        out.append(f"both waiting and running: {set(wid) & set(rid)}")
    if set(wid) | set(rid) != set(s.requests):
        out.append(f"live {sorted(s.requests)} != waiting {sorted(wid)} + running {sorted(rid)}")
    out += [f"waiting {r.request_id!r} is {r.state.value}" for r in waiting if r.state is not RequestState.PENDING]
    out += [f"running {r.request_id!r} is {r.state.value}" for r in running if r.state is not RequestState.RUNNING]
    return out


def limits_respected(s: Scheduler) -> list[str]:
    """§4.7 and §4.8 on the current state: running <= max_num_seqs, live <=
    max_waiting + max_num_seqs, no request past max_model_len or its max_tokens."""
    c = s.config
    out = []
    if len(s.running) > c.max_num_seqs:
        out.append(f"{len(s.running)} running > max_num_seqs {c.max_num_seqs}")
    # max_waiting bounds admissions to the queue; requests sent back by preemption or
    # executor loss may exceed it, but never by more than the running limit.
    if len(s.requests) > c.max_waiting + c.max_num_seqs:
        out.append(f"{len(s.requests)} live > max_waiting {c.max_waiting} + max_num_seqs {c.max_num_seqs}")
    for req in s.requests.values():
        if req.num_tokens > c.max_model_len:
            out.append(f"{req.request_id!r} has {req.num_tokens} tokens > max_model_len")
        if len(req.output_token_ids) > req.limits.max_tokens:
            out.append(f"{req.request_id!r} generated past max_tokens")
        # Tokens sampled by plans in flight are computed on the executor's side first.
        known = req.num_tokens + len(req.pending_steps)
        if req.num_computed_tokens > known:
            out.append(f"{req.request_id!r} computed {req.num_computed_tokens} > {known} tokens "
                       f"({len(req.pending_steps)} in flight)")
    return out


def plan_within_budget(s: Scheduler, plan) -> list[str]:
    """§4.7 for one plan: scheduled tokens and batch size within the limits."""
    c = s.config
    out = []
    if plan.total_num_scheduled_tokens > c.max_num_batched_tokens:
        out.append(f"plan schedules {plan.total_num_scheduled_tokens} > {c.max_num_batched_tokens} tokens")
    if len(plan.num_scheduled_tokens) > c.batch_size_limit:
        out.append(f"plan batches {len(plan.num_scheduled_tokens)} > {c.batch_size_limit} requests")
    if any(n <= 0 for n in plan.num_scheduled_tokens.values()):
        out.append("plan schedules a request for no tokens")
    return out


def groups_share_prompt_blocks(s: Scheduler) -> list[str]:
    """§4.2 for shared blocks: a block in several tables is a cached block (its
    contents checked by §4.3) or one of a request group's shared prompt blocks, at
    the same place in each member's table; a group lists exactly its live
    members, which share one prompt and salt (`group_prompt_computed_once`
    checks, per plan, that only one member computes the shared blocks)."""
    bm = s.blocks
    out = []
    groups = {}
    for rid, req in s.requests.items():
        group = getattr(req, "group", None)
        if group is not None:
            groups[id(group)] = group
            if req not in group.members:
                out.append(f"request {rid!r} is not a member of its group {group.group_id!r}")
    for group in groups.values():
        members = group.members
        if any(s.requests.get(m.request_id) is not m for m in members):
            out.append(f"group {group.group_id!r} lists a request that is not live")
        if any(m.prompt_token_ids != members[0].prompt_token_ids
               or m.cache_salt != members[0].cache_salt for m in members):
            out.append(f"group {group.group_id!r} mixes prompts or salts")
        shared = group.num_shared_tokens
        if shared % bm.block_size or not 0 < shared < members[0].num_prompt_tokens:
            out.append(f"group {group.group_id!r} shares {shared} tokens of a "
                       f"{members[0].num_prompt_tokens}-token prompt in blocks of {bm.block_size}")
    places: dict[int, list[tuple[str, int]]] = {}
    for rid, table in bm.tables.items():
        for i, b in enumerate(table):
            places.setdefault(b, []).append((rid, i))
    for b, holders in places.items():
        if len(holders) < 2 or bm.block_key[b] is not None:
            continue
        owners = [s.requests.get(rid) for rid, _ in holders]
        group = getattr(owners[0], "group", None) if owners[0] is not None else None
        index = holders[0][1]
        if (group is None or any(getattr(o, "group", None) is not group for o in owners)
                or any(i != index for _, i in holders)
                or (index + 1) * bm.block_size > group.num_shared_tokens):
            out.append(f"block {b} is held by {holders} (request, place) but is neither "
                       "cached nor a group's shared prompt block")
    return out


def group_prompt_computed_once(s: Scheduler, plan) -> list[str]:
    """For one plan: a group member admitted to compute (part of) the group's
    shared prompt blocks is the only member computing them; the others wait for
    those blocks. A member recomputing since the executor was lost is not waited
    for (the loss may follow it), so it does not count."""
    out = []
    lost = getattr(s, "_lost", set())
    new = {d.request_id: d for d in plan.new_requests}
    scheduled = plan.num_scheduled_tokens
    for d in plan.new_requests:
        req = s.requests.get(d.request_id)
        group = getattr(req, "group", None) if req is not None else None
        if group is None or d.num_computed_tokens >= group.num_shared_tokens:
            continue
        for m in group.members:
            rid = m.request_id
            if m is req or m.state is not RequestState.RUNNING or rid in lost:
                continue
            before = new[rid].num_computed_tokens if rid in new else m.num_computed_tokens - scheduled.get(rid, 0)
            if before < group.num_shared_tokens and (rid not in new or d.request_id not in lost):
                out.append(f"plan {plan.step_id} admits {d.request_id!r} to compute the shared prompt "
                           f"of group {group.group_id!r} while {rid!r} computes it")
    return out


STATE_INVARIANTS: dict[str, Callable[[Scheduler], list[str]]] = {
    "blocks_partition": blocks_partition,
    "refcounts_match_tables": refcounts_match_tables,
    "cached_hashes_consistent": cached_hashes_consistent,
    "completed_hold_nothing_running_hold_enough": completed_hold_nothing_running_hold_enough,
    "queues_partition": queues_partition,
    "limits_respected": limits_respected,
    "groups_share_prompt_blocks": groups_share_prompt_blocks,
}


def violations(s: Scheduler) -> list[str]:
    """Every state invariant that fails, as 'name: message'."""
    return [f"{name}: {msg}" for name, pred in STATE_INVARIANTS.items() for msg in pred(s)]


def check_scheduler(s: Scheduler) -> None:
    """Raise `InvariantViolation` listing every failing invariant."""
    found = violations(s)
    if found:
        raise InvariantViolation("; ".join(found))
