"""The reference specification: a deliberately naive model of scheduling and
block accounting, and the abstraction function from the real core to it.

The model is a set of plain records (`RefState`): live requests with their
tokens, progress and block tables, and the token prefix each cached block
holds. It does not schedule anything. For each kind of step it says what
outcomes are ALLOWED:

- `add`, `abort`, `fail` and `executor_lost` have exactly one allowed outcome,
  computed here and compared with the core's;
- a plan (`schedule_problems`) may admit any waiting requests that fit, grow
  running ones, preempt under memory pressure or for a higher priority, within
  the budgets, with first-come first-served order inside one class;
- a result (`update_problems`) appends the sampled tokens to the requests the
  plan was going to sample, finishing them exactly when a stop token or a
  length limit says so.

With async scheduling a plan may schedule a running request for the position
of the token its previous plan samples, before that token is known (one plan
ahead, never when that token ends it by length). Each request then awaits up
to two plans, oldest first; a result is applied only to requests awaiting it
first, and a result that overtakes an older plan awaited by the same request
is held (`deferred`) and applied right after that plan's, so a stop token
takes effect one step late and the token sampled after it is never emitted.

`Abstraction` maps a `cadence.statemachine.scheduler.Scheduler` to a
`RefState`; "the core refines the spec" means every step of the core, seen
through it, is an allowed step here (or changes nothing).
"""

from __future__ import annotations

from typing import Callable, Mapping

import attrs

from cadence.statemachine.blocks import block_keys_for
from cadence.statemachine.config import CacheConfig, SchedulerConfig
from cadence.statemachine.fsm import RequestState

PENDING, RUNNING, COMPLETED = "pending", "running", "completed"

# DESIGN §3, written out again on purpose: the tests compare it with the core's table.
EDGES: dict[tuple[str, str], str] = {
    (PENDING, "admit"): RUNNING,
    (PENDING, "abort"): COMPLETED,
    (PENDING, "reject"): COMPLETED,
    (PENDING, "fail"): COMPLETED,
    (RUNNING, "preempt"): PENDING,
    (RUNNING, "finish"): COMPLETED,
    (RUNNING, "abort"): COMPLETED,
    (RUNNING, "fail"): COMPLETED,
    (RUNNING, "executor_lost"): PENDING,
}
REASONS: dict[str, frozenset[str]] = {
    "finish": frozenset({"stop", "length"}),
    "abort": frozenset({"abort"}),
    "reject": frozenset({"rejected"}),
    "fail": frozenset({"error"}),
}


@attrs.frozen
class RefRequest:
    """One live request as the spec sees it."""

    request_id: str
    phase: str
    tokens: tuple[int, ...]
    num_prompt_tokens: int
    max_tokens: int
    min_tokens: int
    stop_tokens: frozenset[int]
    num_computed_tokens: int
    priority: int
    tenant: str
    arrival_s: float
    deadline_s: float | None
    table: tuple[int, ...]
    # The request group it was submitted in (`n` > 1), or None.
    group: str | None = None

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.tokens) - self.num_prompt_tokens


@attrs.frozen
class RefState:
    """Live requests, the prefix each cached block holds, the in-flight plans
    that sample each running request's next tokens (oldest first), the plans in
    flight, and the answers held back until an older plan's comes."""

    requests: Mapping[str, RefRequest]
    contents: Mapping[int, tuple[int, ...]]
    awaiting: Mapping[str, tuple[int, ...]]
    inflight: tuple[int, ...] = ()
    deferred: Mapping[int, Mapping[str, tuple[int, ...]]] = attrs.Factory(dict)

    def held(self) -> dict[int, list[str]]:
        """Block id -> the requests whose tables hold it."""
        out: dict[int, list[str]] = {}
        for r in self.requests.values():
            for b in r.table:
                out.setdefault(b, []).append(r.request_id)
        return out

    def computed(self, block_size: int) -> dict[int, tuple[int, ...]]:
        """Block id -> the token prefix a running request has computed into it
        (its full blocks up to its computed tokens), cached or not."""
        out: dict[int, tuple[int, ...]] = {}
        for r in self.requests.values():
            if r.phase == RUNNING:
                for i, b in enumerate(r.table[:r.num_computed_tokens // block_size]):
                    out[b] = r.tokens[:(i + 1) * block_size]
        return out


def default_class(r: RefRequest) -> tuple:
    """Requests in one class must be admitted first come, first served (DESIGN §4.9)."""
    return (r.priority, r.tenant)


def deadline_class(r: RefRequest) -> tuple:
    """Under earliest-deadline-first only requests with the same slack are ordered by arrival."""
    slack = None if r.deadline_s is None else r.deadline_s - r.arrival_s
    return (r.priority, r.tenant, slack)


def class_for(policy_name: str) -> Callable[[RefRequest], tuple]:
    """The class function item 9 uses for a policy."""
    return deadline_class if policy_name == "deadline" else default_class


class Abstraction:
    """The abstraction function: real `Scheduler` -> `RefState`.

    Cached blocks are identified by chained keys in the core; the spec wants the
    token prefix a block holds, so this object remembers the prefix behind every
    key it has seen a live request produce (or, through `learn`, a request the
    spec grew within one move, as when a held-back answer follows its elder).
    """

    def __init__(self) -> None:
        self._prefix: dict = {}
        self._learned: set = set()
        self._salt: dict = {}
        self._block_size = 1

    def __call__(self, s) -> RefState:
        bs = self._block_size = s.blocks.block_size
        deadline_of = getattr(s.policy, "deadline_of", None)
        requests = {}
        for rid, r in s.requests.items():
            self._learn(r.all_token_ids, r.cache_salt, bs)
            self._salt[rid] = r.cache_salt
            lim = r.limits
            group = getattr(r, "group", None)
            requests[rid] = RefRequest(
                rid, r.state.value, tuple(r.all_token_ids), r.num_prompt_tokens, lim.max_tokens,
                lim.min_tokens, r.stop_token_set, r.num_computed_tokens, r.priority, r.tenant,
                r.arrival_s, deadline_of(r) if deadline_of else r.deadline_s,
                tuple(s.blocks.tables.get(rid, ())), None if group is None else group.group_id)
        contents = {}
        for b, key in enumerate(s.blocks.block_key):
            if key is not None:
                contents[b] = self._prefix.get(key, ("unknown", key))
        inflight = tuple(sorted(s._inflight))
        early = getattr(s, "_early", {})
        deferred = {k: {rid: tuple(t) for rid, t in early[k].sampled_token_ids.items()}
                    for k in sorted(early)}
        return RefState(requests, contents, _awaiting(s, inflight), inflight, deferred)

    def learn(self, state: RefState, grown: list[RefRequest]) -> RefState:
        """`state` with cached contents resolved also from `grown`: versions of
        requests seen before, with tokens the core knew only within one move."""
        for r in grown:
            if r.request_id in self._salt:
                self._learn(r.tokens, self._salt[r.request_id], self._block_size)
        contents = {b: self._prefix.get(p[1], p) if p[:1] == ("unknown",) else p
                    for b, p in state.contents.items()}
        return attrs.evolve(state, contents=contents)

    def _learn(self, tokens, salt, bs) -> None:
        mark = (tuple(tokens), salt)
        if mark in self._learned:
            return
        self._learned.add(mark)
        for i, key in enumerate(block_keys_for(list(tokens), bs, salt)):
            self._prefix[key] = tuple(tokens[:(i + 1) * bs])


def _awaiting(s, inflight: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Per running request, the plans in flight (made since its last admission)
    that sample a token for it, read from the plans alone: walking them oldest
    first from the progress before the first, a plan samples when its chunk
    reaches the known tokens plus those sampled by the plans before it."""
    mine: dict[str, list[tuple[int, int]]] = {}
    for step_id in inflight:
        for rid, n in s._inflight[step_id].num_scheduled_tokens.items():
            mine.setdefault(rid, []).append((step_id, n))
    out = {}
    for rid, chunks in mine.items():
        r = s.requests.get(rid)
        if r is None or r.state is not RequestState.RUNNING:
            continue
        chunks = [(k, n) for k, n in chunks if k >= r.admitted_step]
        position = r.num_computed_tokens - sum(n for _, n in chunks)
        samplers: list[int] = []
        for step_id, n in chunks:
            position += n
            if position >= r.num_tokens + len(samplers):
                samplers.append(step_id)
        if samplers:
            out[rid] = tuple(samplers)
    return out


class ReferenceSpec:
    """What each step of the scheduler may do, for one configuration."""

    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig,
                 class_of: Callable[[RefRequest], tuple] | None = None) -> None:
        self.config = config
        self.num_blocks = cache_config.num_blocks
        self.block_size = cache_config.block_size
        self.class_of = class_of or class_for(config.policy)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    # ---- steps with one allowed outcome ---------------------------------------------
    def add(self, before: RefState, r: RefRequest) -> RefState:
        """The state after `r` is submitted: queued, or unchanged if it must be refused."""
        c = self.config
        total = r.num_prompt_tokens + r.max_tokens
        waiting = sum(1 for x in before.requests.values() if x.phase == PENDING)
        if (r.request_id in before.requests or total > c.max_model_len
                or self.blocks_for(total) > self.num_blocks or waiting >= c.max_waiting):
            return before
        return attrs.evolve(before, requests={**before.requests, r.request_id: r})

    def add_group(self, before: RefState, group: list[RefRequest]) -> RefState:
        """The state after a group of requests with one prompt is submitted: all
        queued, or unchanged if any must be refused or the queue lacks room for all."""
        c = self.config
        waiting = sum(1 for x in before.requests.values() if x.phase == PENDING)
        ids = [r.request_id for r in group]
        if waiting + len(group) > c.max_waiting or len(set(ids)) != len(ids) or any(
                r.request_id in before.requests or r.num_prompt_tokens + r.max_tokens > c.max_model_len
                or self.blocks_for(r.num_prompt_tokens + r.max_tokens) > self.num_blocks
                or r.tokens != group[0].tokens for r in group):
            return before
        return attrs.evolve(before, requests={**before.requests, **{r.request_id: r for r in group}})

    def shared_tokens(self, r: RefRequest) -> int:
        """The prompt tokens a group member may take from a sibling: its full
        blocks, all but the block of its last token (0 outside a group)."""
        if r.group is None:
            return 0
        return (r.num_prompt_tokens - 1) // self.block_size * self.block_size

    def waits_for_sibling(self, before: RefState, after: RefState, r: RefRequest,
                          scheduled: Mapping[str, int]) -> bool:
        """Whether a waiting group member may wait, in the plan `before` -> `after`,
        for a sibling computing the group's shared prompt blocks: one running after
        it with less than those computed when the step began or when it was admitted
        in it, or one running before it, with less computed, and preempted by it."""
        shared = self.shared_tokens(r)
        if not shared:
            return False
        for x in after.requests.values():
            if x.group != r.group or x.request_id == r.request_id:
                continue
            was = before.requests.get(x.request_id)
            if x.phase == RUNNING and x.num_computed_tokens - scheduled.get(x.request_id, 0) < shared:
                return True
            if x.phase == PENDING and was is not None and was.phase == RUNNING \
                    and was.num_computed_tokens < shared:
                return True
        return False

    def remove(self, before: RefState, request_id: str) -> RefState:
        """Abort or fail: the request is gone, its blocks are released, cached contents stay."""
        requests = {k: v for k, v in before.requests.items() if k != request_id}
        awaiting = {k: v for k, v in before.awaiting.items() if k != request_id}
        return attrs.evolve(before, requests=requests, awaiting=awaiting)

    def executor_lost(self, before: RefState) -> RefState:
        """Running requests wait again with nothing computed; every cached block is
        forgotten; plans in flight and answers held back are void."""
        requests = {k: attrs.evolve(v, phase=PENDING, num_computed_tokens=0, table=())
                    if v.phase == RUNNING else v for k, v in before.requests.items()}
        return RefState(requests, {}, {})

    def length_limit(self, r: RefRequest) -> int:
        """The token count at which `r` finishes for length."""
        return min(r.num_prompt_tokens + r.max_tokens, self.config.max_model_len)

    # ---- a plan ------------------------------------------------------------------------
    def schedule_problems(self, before: RefState, after: RefState, step_id: int,
                          scheduled: Mapping[str, int], now_s: float) -> list[str]:
        """Why the step `before` -> `after` with plan `scheduled` is not allowed ([] if it is)."""
        c = self.config
        out: list[str] = []
        admitted, grown, preempted, kept = [], [], [], []
        for rid, b in before.requests.items():
            a = after.requests.get(rid)
            n = scheduled.get(rid, 0)
            if a is None:
                late = b.deadline_s is not None and b.deadline_s < now_s
                if not (b.phase == PENDING and c.reject_late and late):
                    out.append(f"{rid} disappeared in a plan without being a late rejection")
                continue
            if a.tokens != b.tokens:
                out.append(f"{rid}: tokens changed in a plan")
            if (b.phase, a.phase) == (RUNNING, RUNNING):
                grown.append(rid)
                if a.num_computed_tokens != b.num_computed_tokens + n:
                    out.append(f"{rid}: computed {b.num_computed_tokens} + scheduled {n} "
                               f"!= {a.num_computed_tokens}")
                want = max(len(b.table), self.blocks_for(a.num_computed_tokens))
                if a.table[:len(b.table)] != b.table or len(a.table) != want:
                    out.append(f"{rid}: table {b.table} -> {a.table}, expected {want} blocks "
                               "extending the old table")
                if n and a.num_computed_tokens > len(a.tokens):
                    out += self._ahead_problems(before, b, n)
            elif (b.phase, a.phase) == (RUNNING, PENDING):
                preempted.append(rid)
                if a.num_computed_tokens or a.table or n:
                    out.append(f"{rid}: preempted but keeps progress, blocks or a schedule")
            elif (b.phase, a.phase) == (PENDING, RUNNING):
                admitted.append(rid)
                out += self._admission_problems(before, b, a, n)
            else:
                kept.append(rid)
                if a != b:
                    out.append(f"{rid}: changed while waiting")
        out += [f"{rid} appeared in a plan" for rid in after.requests if rid not in before.requests]
        out += self._budget_problems(after, scheduled)
        out += self._share_problems(before, admitted, grown, preempted, scheduled)
        out += self._mixed_problems(before, admitted, grown, scheduled)
        out += self._block_problems(before, after, admitted, grown, preempted, scheduled)
        out += self._order_problems(before, after, admitted, grown, preempted, scheduled)
        return out

    def _ahead_problems(self, before: RefState, b: RefRequest, n: int) -> list[str]:
        """A plan computes a position whose token is not known yet: allowed only with
        async scheduling, for the token the one plan it awaits samples, one token,
        and only if that token cannot end it by length."""
        rid, known = b.request_id, len(b.tokens)
        if not self.config.async_scheduling:
            return [f"{rid}: scheduled past its {known} known tokens without async scheduling"]
        out = []
        awaited = before.awaiting.get(rid, ())
        if len(awaited) != 1 or b.num_computed_tokens != known or n != 1:
            out.append(f"{rid}: planned ahead from {b.num_computed_tokens} computed of {known} "
                       f"known tokens for {n} tokens while awaiting plans {awaited}; only "
                       "the one token in flight may be computed ahead")
        if known + 1 >= self.length_limit(b):
            out.append(f"{rid}: planned ahead although the token in flight ends it by length "
                       f"({known} + 1 tokens, limit {self.length_limit(b)})")
        return out

    def _admission_problems(self, before: RefState, b: RefRequest, a: RefRequest, n: int) -> list[str]:
        bs, rid = self.block_size, b.request_id
        out = []
        if len(a.table) != self.blocks_for(len(a.tokens)):
            out.append(f"{rid}: admitted with {len(a.table)} blocks, its "
                       f"{len(a.tokens)} tokens need {self.blocks_for(len(a.tokens))}")
        cached = a.num_computed_tokens - n
        if n < 1 or cached < 0 or cached % bs or cached > len(a.tokens) - 1:
            out.append(f"{rid}: admitted with {a.num_computed_tokens} computed after {n} scheduled")
            return out
        computed = before.computed(bs)
        for i in range(cached // bs):
            want = a.tokens[:(i + 1) * bs]
            held = before.contents.get(a.table[i])
            if held != want and computed.get(a.table[i]) != want:
                out.append(f"{rid}: prefix hit on block {a.table[i]} holding {held}, "
                           f"wanted {want}")
        if not self.config.enable_chunked_prefill and not self.config.long_prefill_token_threshold:
            if a.num_computed_tokens != len(a.tokens):
                out.append(f"{rid}: prompt split although chunked prefill is off")
        return out

    def _budget_problems(self, after: RefState, scheduled: Mapping[str, int]) -> list[str]:
        c = self.config
        out = []
        if sum(scheduled.values()) > c.max_num_batched_tokens:
            out.append(f"plan schedules {sum(scheduled.values())} > {c.max_num_batched_tokens} tokens")
        if len(scheduled) > c.batch_size_limit:
            out.append(f"plan batches {len(scheduled)} > {c.batch_size_limit} requests")
        running = [r for r in after.requests.values() if r.phase == RUNNING]
        if len(running) > c.max_num_seqs:
            out.append(f"{len(running)} running > max_num_seqs {c.max_num_seqs}")
        for rid, n in scheduled.items():
            r = after.requests.get(rid)
            if r is None or r.phase != RUNNING or n < 1:
                out.append(f"plan schedules {rid} for {n} tokens but it is not running")
            elif r.num_computed_tokens > len(r.tokens) + len(after.awaiting.get(rid, ())):
                out.append(f"{rid}: scheduled past its tokens and those in flight")
            elif c.long_prefill_token_threshold and n > c.long_prefill_token_threshold:
                out.append(f"{rid}: {n} tokens > long_prefill_token_threshold")
        return out

    def _share_problems(self, before: RefState, admitted, grown, preempted, scheduled) -> list[str]:
        """Beside running requests, and while every waiting request has a free seat,
        admissions take at most their share of `admission_delay_budget` among the
        requests held, beyond the first one in `admission_drain_steps` waiting;
        under `admission_burst_split` N, while more requests wait than run, at
        most the oldest 1/N of them are admitted."""
        c = self.config
        if not any(scheduled.get(rid) for rid in grown):
            return []
        num_waiting = sum(r.phase == PENDING for r in before.requests.values())
        split = c.admission_burst_split
        if split > 1 and num_waiting > len(before.requests) - num_waiting:
            # 1/split of the waiting requests (a growth preemption may add some).
            most = -(-(num_waiting + len(preempted)) // split)
            if len(admitted) > most:
                return [f"{len(admitted)} admitted beside running requests while {num_waiting} "
                        f"wait, more than 1/{split} of them ({most})"]
            return []
        if not (c.admission_delay_budget and c.enable_chunked_prefill):
            return []
        if num_waiting > c.max_num_seqs - (len(before.requests) - num_waiting):
            return []
        share = max(c.admission_delay_budget // len(before.requests), c.admission_min_tokens)
        # The first admissions go uncapped; a growth preemption may have added a waiter.
        num_uncapped = -(-(num_waiting + len(preempted)) // c.admission_drain_steps)
        taken = sorted((scheduled.get(rid, 0) for rid in admitted), reverse=True)
        if sum(taken) > max(share, sum(taken[:num_uncapped])):
            return [f"admissions take {sum(taken)} tokens beside running requests, their share "
                    f"is {share} beyond the first {num_uncapped}"]
        return []

    def _mixed_problems(self, before: RefState, admitted, grown, scheduled) -> list[str]:
        """Beside decoding requests, while no more requests wait than decode and
        their tokens would join within `mixed_prefill_drain_steps` steps of the bound, a
        plan's prompt tokens (admissions, and chunks of more than one token for
        running requests) stay within `mixed_prefill_tokens`, or
        `mixed_prefill_per_decode` per decoding request where that is more, or the
        longest prompt waiting or begun over `mixed_prefill_chunks`."""
        c = self.config
        if not (c.mixed_prefill_tokens and c.enable_chunked_prefill):
            return []
        requests = before.requests.values()
        num_decoding = sum(r.phase == RUNNING and len(r.tokens) - r.num_computed_tokens <= 1
                           for r in requests)
        num_waiting = sum(r.phase == PENDING for r in requests)
        if not num_decoding or num_waiting > num_decoding:
            return []
        limit = max(c.mixed_prefill_tokens, int(c.mixed_prefill_per_decode * num_decoding))
        if c.mixed_prefill_chunks:
            longest = max((len(r.tokens) for r in requests if r.phase == PENDING
                           or (r.phase == RUNNING and len(r.tokens) - r.num_computed_tokens > 1)),
                          default=0)
            limit = max(limit, -(-longest // c.mixed_prefill_chunks))
        if sum(len(r.tokens) for r in requests if r.phase == PENDING) > limit * c.mixed_prefill_drain_steps:
            return []
        chunks = [scheduled.get(rid, 0) for rid in grown]
        taken = sum(scheduled.get(rid, 0) for rid in admitted) + sum(n for n in chunks if n > 1)
        if taken > limit:
            return [f"plan computes {taken} prompt tokens beside {num_decoding} decoding "
                    f"requests, more than {limit}"]
        return []

    def _block_problems(self, before, after, admitted, grown, preempted, scheduled) -> list[str]:
        bs = self.block_size
        out = []
        held_before, held_after = before.held(), after.held()
        releasable = {b for b, owners in held_before.items()
                      if all(o in preempted or o not in after.requests for o in owners)}
        fresh: list[int] = []
        for rid in admitted:
            a = after.requests[rid]
            fresh += a.table[max(0, a.num_computed_tokens - scheduled.get(rid, 0)) // bs:]
        for rid in grown:
            fresh += after.requests[rid].table[len(before.requests[rid].table):]
        if len(set(fresh)) != len(fresh):
            out.append(f"a block was handed out twice: {sorted(fresh)}")
        for b in fresh:
            if b in held_before and b not in releasable:
                out.append(f"block {b} handed out while {held_before[b]} still hold it")
        computed = after.computed(bs)
        for b, owners in held_after.items():
            if len(owners) < 2:
                continue
            prefixes = {_prefix_at(after.requests[o], b, bs) for o in owners}
            known = after.contents.get(b, computed.get(b))
            if len(prefixes) != 1 or known not in prefixes:
                out.append(f"block {b} shared by {owners} without matching cached or computed contents")
        # A block a request took and then gave back, preempted later in the same step,
        # was reused too: in a step that preempts, a block unheld at its end (and unheld
        # or released by a preemption at its start) may lose its contents.
        fresh_set = set(fresh)
        transient = ({b for b in before.contents if (b not in held_before or b in releasable)
                      and b not in held_after} if preempted else set())
        after_contents = dict(after.contents)
        changed = any(after_contents.get(b) != p for b, p in before.contents.items()
                      if b not in fresh_set and not (b in transient and b not in after_contents))
        if changed or set(after_contents) - set(before.contents) - fresh_set:
            out.append("cached contents changed other than by evicting reused blocks")
        return out

    def _order_problems(self, before, after, admitted, grown, preempted, scheduled) -> list[str]:
        c = self.config
        out = []
        # Preemption needs memory pressure or a strictly more important admission.
        if preempted:
            unheld = self.num_blocks - len(before.held())
            demand = sum(len(after.requests[r].table) - len(before.requests[r].table) for r in grown)
            for rid in preempted:
                p = before.requests[rid]
                # With async scheduling the token in flight's position may be demanded too.
                ahead = c.async_scheduling and len(before.awaiting.get(rid, ())) == 1
                upto = min(len(p.tokens) + ahead, p.num_computed_tokens + c.max_num_batched_tokens)
                demand += max(0, self.blocks_for(upto) - len(p.table))
            by_priority = c.preempt_for_priority and c.enable_priority_scheduling
            for rid in preempted:
                p = before.requests[rid]
                if demand > unheld:
                    continue
                if by_priority and any(before.requests[x].priority < p.priority for x in admitted):
                    continue
                out.append(f"{rid} preempted with {unheld} blocks free for a demand of {demand} "
                           "and no more important admission")
        # DESIGN §4.9: inside one class, a later request overtakes an earlier one only if
        # the earlier one could not fit where the later one did.
        for bid in admitted:
            b_after = after.requests[bid]
            others = {b for r in after.requests.values() if r.request_id != bid for b in r.table}
            min_need = sum(1 for blk in b_after.table
                           if blk not in before.held() and blk not in others)
            for a in before.requests.values():
                if (a.phase != PENDING or a.request_id == bid or a.request_id not in after.requests
                        or after.requests[a.request_id].phase != PENDING
                        or self.class_of(a) != self.class_of(before.requests[bid])
                        or not a.arrival_s < b_after.arrival_s):
                    continue
                if self.blocks_for(len(a.tokens)) > min_need:
                    continue
                if self.waits_for_sibling(before, after, a, scheduled):
                    continue  # it shares the blocks its sibling is computing, once computed
                if not c.enable_chunked_prefill and len(a.tokens) > scheduled.get(bid, 0):
                    continue
                out.append(f"{bid} admitted before {a.request_id} of the same class "
                           f"{self.class_of(a)}, which arrived earlier and needed no more blocks")
        # Work conservation: nothing running after a plan while a request waits that
        # was not preempted by this very plan.
        if not any(r.phase == RUNNING for r in after.requests.values()):
            idle = [r for r in after.requests if after.requests[r].phase == PENDING
                    and r not in preempted]
            if idle:
                out.append(f"nothing runs although {idle} wait")
        return out

    # ---- a result ------------------------------------------------------------------------
    def update_problems(self, before: RefState, after: RefState, step_id: int,
                        sampled: Mapping[str, list[int]]) -> list[str]:
        """Why `before` -> `after` is not the result of plan `step_id` sampling `sampled`.

        A result for a plan not in flight, or already held back, changes nothing.
        One that samples for a request awaiting an older plan first is held back
        whole; otherwise it is applied, then every held answer no older plan
        blocks any more, oldest first."""
        bs = self.block_size
        out = []
        requests, awaiting, deferred, grown = self.answer(before, step_id, sampled)
        for rid, b in before.requests.items():
            want, got = requests.get(rid), after.requests.get(rid)
            if want is None and got is not None:
                out.append(f"{rid} should have finished, still {got.phase} with {got.tokens}")
            elif want is not None and got != want:
                out.append(f"{rid}: after the result of plan {step_id}: {got}, expected {want}")
        for rid in after.requests:
            if rid not in before.requests:
                out.append(f"{rid} appeared in a result")
        if dict(after.awaiting) != awaiting:
            out.append(f"after the result of plan {step_id} requests await plans "
                       f"{dict(after.awaiting)}, expected {awaiting}")
        if {k: dict(v) for k, v in after.deferred.items()} != deferred:
            out.append(f"after the result of plan {step_id} answers held back are "
                       f"{dict(after.deferred)}, expected {deferred}")
        for b, prefix in after.contents.items():
            if before.contents.get(b, prefix) != prefix:
                out.append(f"block {b} changed contents in a result")
            elif b not in before.contents:
                holders = [r for r in (*after.requests.values(), *before.requests.values(),
                                       *grown) if b in r.table]
                if not any(_prefix_at(h, b, bs) == prefix
                           and len(prefix) <= h.num_computed_tokens for h in holders):
                    out.append(f"block {b} cached as {prefix} which no computed table holds")
        if any(b not in after.contents for b in before.contents):
            out.append("a result forgot cached contents")
        return out

    def answer(self, before: RefState, step_id: int, sampled: Mapping[str, list[int]]):
        """The result of plan `step_id` applied to `before`: the live requests,
        the plans they await, the answers held back, and every version of a
        request it grew (finished ones included: blocks may be cached with them)."""
        requests, awaiting = dict(before.requests), dict(before.awaiting)
        deferred = dict(before.deferred)
        grown: list[RefRequest] = []
        if step_id in before.inflight and step_id not in deferred:
            if _blocked(step_id, awaiting):
                deferred[step_id] = {rid: tuple(t) for rid, t in sampled.items()}
            else:
                grown += self._apply(requests, awaiting, step_id, sampled)
                while True:
                    ready = [k for k in sorted(deferred) if not _blocked(k, awaiting)]
                    if not ready:
                        break
                    grown += self._apply(requests, awaiting, ready[0], deferred.pop(ready[0]))
        return requests, awaiting, deferred, grown

    def _apply(self, requests: dict, awaiting: dict, step_id: int,
               sampled: Mapping[str, list[int]]) -> list[RefRequest]:
        """Plan `step_id`'s tokens, appended to the requests awaiting it first;
        those a stop token or a length limit ends are gone. Returns each request
        grown, with every token appended (a finished one's last included)."""
        grown = []
        for rid, tokens in sampled.items():
            r = requests.get(rid)
            if r is None or not tokens or awaiting.get(rid, ())[:1] != (step_id,):
                continue
            awaiting[rid] = awaiting[rid][1:]
            if not awaiting[rid]:
                del awaiting[rid]
            out_tokens = list(r.tokens)
            done = False
            for t in tokens:
                out_tokens.append(t)
                n_out = len(out_tokens) - r.num_prompt_tokens
                if (t in r.stop_tokens and n_out >= r.min_tokens) or \
                        len(out_tokens) >= self.length_limit(r):
                    done = True
                    break
            grown.append(attrs.evolve(r, tokens=tuple(out_tokens)))
            if done:
                del requests[rid]
                awaiting.pop(rid, None)
            else:
                requests[rid] = grown[-1]
        return grown


def _blocked(step_id: int, awaiting: Mapping[str, tuple[int, ...]]) -> bool:
    """Whether plan `step_id` samples for a request that awaits an older plan first."""
    return any(step_id in plans[1:] for plans in awaiting.values())


def _prefix_at(r: RefRequest, block: int, bs: int):
    i = r.table.index(block)
    return r.tokens[:(i + 1) * bs] if (i + 1) * bs <= len(r.tokens) else None
