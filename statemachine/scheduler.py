"""The continuous-batching scheduler: the single authority over request state,
KV blocks and budgets.

Each step is one decision `{request_id: num_tokens}` under the token budget:
running requests first (a decode token, or the next prefill chunk), then waiting
requests in policy order, prefix-cache hits counted as computed. `schedule()`
advances `num_computed_tokens` at once, so the next step can be planned before
the previous result arrives; a request whose sampled token is still in flight
is simply not scheduled until `update()` delivers it.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import attrs

from .blocks import BlockManager, block_keys_for
from .config import CacheConfig, SchedulerConfig
from .estimate import OutputLengthEstimator
from .errors import (
    DuplicateRequestError, InvalidRequestError, QueueFullError, RequestNotFoundError,
    RequestTooLongError,
)
from .fsm import FinishReason, RequestEventKind, RequestState
from .plan import NewRequestData, RequestEvent, StepPlan, StepResult
from .policy import SchedulingPolicy, make_policy
from .request import Request, RequestGroup
from .stats import StatsCollector, StatsSummary

# Under a policy that may displace running requests: steps after a failed admission
# pass before the same pass is tried again when neither the queue nor the set of
# held blocks has changed.
ADMISSION_RETRY_STEPS = 16
RUNNING = RequestState.RUNNING


def _never(a: Request, b: Request) -> bool:
    return False


PENDING = RequestState.PENDING
E = RequestEventKind


class Scheduler:
    """Pure, synchronous scheduling core. Time enters only as arguments."""

    def __init__(
        self,
        config: SchedulerConfig | None = None,
        cache_config: CacheConfig | None = None,
        policy: SchedulingPolicy | str | None = None,
    ) -> None:
        self.config = config = config if config is not None else SchedulerConfig()
        self.cache_config = cache = cache_config if cache_config is not None else CacheConfig()
        if isinstance(policy, str):
            self.config = config = attrs.evolve(config, policy=policy)
            policy = None
        self.policy: SchedulingPolicy = policy if policy is not None else make_policy(config)
        self.blocks = BlockManager(cache.num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.step_id = 0
        self.now_s = 0.0
        self.collector = StatsCollector()
        self.num_resume_hit_tokens = 0
        self._watermark_blocks = int(config.admission_watermark * cache.num_blocks)
        self._predicted_watermark_blocks = int(config.predicted_watermark * cache.num_blocks)
        self._thrash_watermark_blocks = int(config.thrash_watermark * cache.num_blocks)
        self._finished_ids: list[str] = []
        self._events: list[RequestEvent] = []
        self._inflight: dict[int, StepPlan] = {}
        # Answers to plans in flight that came before an older plan's answer and share
        # a sampling request with it (only an out-of-order executor sends them).
        self._early: dict[int, StepResult] = {}
        # Requests whose computation was lost with the executor and has not finished
        # a step since: their prefix may never get computed (the loss may follow
        # them), so nobody waits for it.
        self._lost: set[str] = set()
        self._deadline_of = getattr(self.policy, "deadline_of", None)
        self._checker = None
        # Admission memo: a pass that admitted nothing for want of blocks is not
        # repeated while it would fail the same way (see `_failed_pass_stands`):
        # the queue version, release count, retry step and prefix-cache
        # registration count it failed at.
        self._queue_version = 0
        self._num_arrivals = 0
        self._failed_admission: tuple[int, int, int, int] | None = None
        # The last request a failed pass examined before its lookahead ran out: an
        # arrival the policy orders after it would not be reached by the same pass.
        self._admission_cut: Request | None = None
        # The fewest fresh blocks any waiting request needs, as of the failed pass
        # (and arrivals since): with fewer free beyond the watermark, nothing fits.
        self._min_need = 0
        # Steps of the last growth preemption under predicted ends, and the step
        # until which admission keeps the thrash margins (see thrash_window_steps).
        self._last_growth_preemption: int | None = None
        self._thrash_margins_until = 0
        # What admission projects each running request will still generate.
        self.lengths = (OutputLengthEstimator(config.length_estimate_window,
                                              config.length_estimate_min_samples,
                                              config.length_estimate_quantile)
                        if config.predict_output_lengths else None)
        # Longest-prefix-first among tied waiting requests, where the policy can
        # tell ties and show its next request without taking it.
        self._prefix_ties = (cache.enable_prefix_caching and config.prefix_tie_lookahead > 1
                             and hasattr(self.policy, "peek") and hasattr(self.policy, "ties"))
        if config.debug_checks:
            from .invariants import check_scheduler
            self._checker = check_scheduler

    # ---- queries ---------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.policy)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request:
        try:
            return self.requests[request_id]
        except KeyError:
            raise RequestNotFoundError(f"no live request with id {request_id!r}") from None

    # ---- requests in and out ---------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; raise if it is a duplicate, too long, or the queue is full."""
        rid = request.request_id
        self._check_new(request)
        config = self.config
        total = request.num_prompt_tokens + request.limits.max_tokens
        if self.blocks.enable_prefix_caching:
            # Hash the prompt's full blocks once, on arrival, rather than in a step.
            block_keys_for(request.all_token_ids, self.blocks.block_size, request.cache_salt,
                           request.block_hashes)
        self._num_arrivals += 1
        request.arrival_seq = self._num_arrivals
        request.arrival_step = self.step_id
        request.length_limit = min(total, config.max_model_len)
        self.requests[rid] = request
        self.policy.push(request)
        cut = self._admission_cut
        if self._failed_admission is not None and not getattr(self.policy, "preempts_running", True):
            # A failed pass stands if no request fits: count this one's need in.
            need = self.blocks.blocks_for(request.num_tokens) - len(self.blocks.find_cached_prefix(request))
            if need < self._min_need:
                self._min_need = need
        elif (cut is None or not getattr(self.policy, "sorts_after", _never)(request, cut)
              or (self._prefix_ties and self.policy.ties(request, cut))):
            self._queue_version += 1  # it may be examined by the next pass
        self.collector.num_requests_added += 1
        self.collector.saw_time(request.arrival_s)
        self._check()

    def add_group(self, requests: Sequence[Request]) -> RequestGroup | None:
        """Queue requests with one prompt (and cache salt) as a group, `n` > 1: one
        of them computes the prompt; once its full blocks are computed, the others
        are admitted holding those same blocks and compute only the tail (the last
        partial block). Each member is then scheduled, preempted and finished on its
        own. All are queued or none is. Returns the group, or None if the prompt
        fits in one block and there is nothing to share."""
        requests = list(requests)
        if not requests:
            raise InvalidRequestError("a request group needs at least one request")
        first = requests[0]
        seen: set[str] = set()
        for request in requests:
            rid = request.request_id
            if (request.prompt_token_ids != first.prompt_token_ids
                    or request.cache_salt != first.cache_salt):
                raise InvalidRequestError(
                    f"request {rid!r} of a group must have the prompt and cache_salt of "
                    f"{first.request_id!r}")
            if rid in seen:
                raise DuplicateRequestError(f"request_id {rid!r} is twice in one group")
            seen.add(rid)
            self._check_new(request)
        room = self.config.max_waiting - len(self.policy)
        if len(requests) > room:
            raise QueueFullError(
                f"a group of {len(requests)} requests does not fit: the waiting queue holds "
                f"{len(self.policy)}; max_waiting is {self.config.max_waiting}")
        block_size = self.blocks.block_size
        num_shared = (first.num_prompt_tokens - 1) // block_size * block_size
        group = RequestGroup(first.request_id, [], num_shared) \
            if len(requests) > 1 and num_shared else None
        for request in requests:
            self.add_request(request)
            if group is not None:
                request.group = group
                group.members.append(request)
        self._check()
        return group

    def _check_new(self, request: Request) -> None:
        """Raise if `request` may not be queued: a duplicate, too long, or no room."""
        rid = request.request_id
        if rid in self.requests:
            raise DuplicateRequestError(f"request_id {rid!r} is already live")
        if request.state is not PENDING or request.num_computed_tokens or request.output_token_ids:
            raise DuplicateRequestError(f"request {rid!r} has already been scheduled once")
        config = self.config
        total = request.num_prompt_tokens + request.limits.max_tokens
        if total > config.max_model_len:
            raise RequestTooLongError.naming(
                request.num_prompt_tokens, config.max_model_len,
                f"request {rid!r}: prompt has {request.num_prompt_tokens} tokens and max_tokens is "
                f"{request.limits.max_tokens}, {total} in all; max_model_len is {config.max_model_len}"
            )
        num_needed = self.blocks.blocks_for(total)
        if num_needed > self.cache_config.num_blocks:
            raise RequestTooLongError.naming(
                request.num_prompt_tokens, self.cache_config.num_blocks * self.cache_config.block_size,
                f"request {rid!r}: {total} tokens need {num_needed} KV blocks of "
                f"{self.cache_config.block_size}; the cache has num_blocks={self.cache_config.num_blocks}"
            )
        if len(self.policy) >= config.max_waiting:
            raise QueueFullError(
                f"waiting queue holds {len(self.policy)} requests; max_waiting is {config.max_waiting}"
            )

    def abort_request(self, request_id: str, detail: str = "aborted") -> RequestEvent:
        """Finish a live request as aborted and free its blocks at once."""
        request = self.get_request(request_id)
        event = self._complete(request, E.ABORT, FinishReason.ABORT, detail)
        if request in self.running:
            self.running.remove(request)
        self._check()
        return event

    def fail_request(self, request_id: str, detail: str) -> RequestEvent:
        """Finish a live request with an error (for example a failed executor step)."""
        request = self.get_request(request_id)
        event = self._complete(request, E.FAIL, FinishReason.ERROR, detail)
        if request in self.running:
            self.running.remove(request)
        self._check()
        return event

    def executor_lost(self) -> list[RequestEvent]:
        """The executor died: running requests go back to waiting to be recomputed,
        plans in flight are void, and the prefix cache is forgotten."""
        events = []
        for request in self.running:
            request.fsm.fire(E.EXECUTOR_LOST)
            self.blocks.free(request.request_id)
            self.collector.num_recompute_tokens += request.num_computed_tokens
            request.num_computed_tokens = 0
            self.policy.push(request)
            self._queue_version += 1
            self._lost.add(request.request_id)
            request.pending_steps.clear()
            events.append(RequestEvent(request.request_id, E.EXECUTOR_LOST))
        self.running = []
        self._inflight.clear()
        self._early.clear()
        self._finished_ids.clear()
        self.blocks.reset_prefix_cache()
        self._check()
        return self.take_events() + events

    def take_events(self) -> list[RequestEvent]:
        """Events produced by `schedule()` (admissions, preemptions, rejections)
        not yet returned; `update()` returns them first as well."""
        events, self._events = self._events, []
        return events

    def sampling_ids(self, plan: StepPlan) -> list[str]:
        """The requests that sample a token in `plan`, in its order: those whose
        chunk reaches their last token (known, or in flight under async
        scheduling). What an executor answers for; ask before `update(plan, ...)`."""
        requests, step_id = self.requests, plan.step_id
        out = []
        for rid in plan.num_scheduled_tokens:
            request = requests.get(rid)
            if request is not None and step_id in request.pending_steps:
                out.append(rid)
        return out

    # ---- one step --------------------------------------------------------------
    def schedule(self, now_s: float | None = None) -> StepPlan:
        """Decide the next step. `now_s` is the caller's clock (default: the step number)."""
        config, blocks, policy = self.config, self.blocks, self.policy
        step_id = self.step_id
        self.step_id += 1
        self.now_s = now_s = float(step_id) if now_s is None else now_s
        self.collector.saw_time(now_s)
        budget = config.max_num_batched_tokens
        seats = config.batch_size_limit
        # The per-request prefill cap splits prompts, so it applies only with chunking.
        threshold = config.long_prefill_token_threshold if config.enable_chunked_prefill else 0
        scheduled: dict[str, int] = {}
        new_block_ids: dict[str, list[int]] = {}
        preempted: list[Request] = []
        tables, block_size = blocks.tables, blocks.block_size

        # 1. Running requests: decode tokens and the next chunks of prefills.
        # Seats can only run out here if more requests run than a step may hold.
        count_seats = len(self.running) > seats
        overlap = config.async_scheduling
        # Beside decoding requests, prompt tokens are bounded (None: no bound).
        prompt_left = self._mixed_prefill_limit()
        # A burst: more requests wait than run, counted before this step preempts any.
        burst = len(policy) > len(self.running)
        for request in list(self.running):
            if budget <= 0 or (count_seats and len(scheduled) >= seats):
                break
            if preempted and request.fsm.state is not RUNNING:
                continue  # preempted earlier in this loop
            computed = request.num_computed_tokens
            n = len(request.all_token_ids) - computed
            if n <= 0:
                # Its sampled token is still in flight. With async scheduling the next
                # plan computes that token's position (the executor holds the token),
                # one plan ahead at most, unless the token ends it by length.
                pending = request.pending_steps
                if not overlap or len(pending) != 1 or n + 1 <= 0:
                    continue
                if len(request.all_token_ids) + 1 >= request.length_limit:
                    continue
                n = 1
            if n > budget:
                n = budget
            if threshold and n > threshold:
                n = threshold
            chunk = prompt_left is not None and n > 1
            if chunk:
                if n > prompt_left:
                    n = prompt_left
                if n <= 0:
                    continue  # the step's prompt tokens are spent: it goes on next step
            rid = request.request_id
            if computed + n <= len(tables[rid]) * block_size:
                scheduled[rid] = n
                budget -= n
                if chunk:
                    prompt_left -= n
                continue
            new = blocks.grow(rid, computed + n)
            while new is None:
                victim = policy.victim(self.running)
                budget += self._preempt(victim, scheduled, new_block_ids, preempted)
                self._note_growth_preemption()
                if victim is request:
                    break
                new = blocks.grow(rid, request.num_computed_tokens + n)
            if new is None:
                continue
            if new:
                new_block_ids[rid] = new
            scheduled[rid] = n
            budget -= n
            if chunk:
                prompt_left -= n

        # 2. Waiting requests, in policy order, skipping those that do not fit.
        new_requests: list[NewRequestData] = []
        if preempted and not config.admit_after_preemption:
            pass  # the running pass preempted: nothing joins in this step
        elif self._failed_admission is not None and self._failed_pass_stands():
            self.collector.num_admission_memo_hits += 1
        elif self._holds_for_finishing(scheduled):
            self.collector.num_admission_finish_holds += 1
        elif len(policy) and ((budget > 0 and len(scheduled) < seats)
                              or getattr(policy, "preempts_running", True)):
            cap, num_uncapped = self._admission_share(burst) if scheduled else (0, 0)
            if prompt_left is not None:  # every admission draws on what is left
                cap, num_uncapped = (min(cap, prompt_left) if cap else prompt_left), 0
            if prompt_left != 0:
                budget = self._admit(budget, seats, scheduled, new_requests, preempted,
                                     new_block_ids, threshold, cap, num_uncapped)

        # 3. Advance progress and build the plan.
        total = 0
        requests = self.requests
        charge = policy.on_scheduled if getattr(policy, "charges_tokens", True) else None
        for rid, n in scheduled.items():
            request = requests[rid]
            if charge is not None:
                charge(request, n)
            computed = request.num_computed_tokens = request.num_computed_tokens + n
            pending = request.pending_steps
            if computed >= len(request.all_token_ids) + len(pending):
                pending.append(step_id)  # the chunk reaches its last token: it samples
            total += n
        if config.enable_batch_sorting and scheduled:
            scheduled = self._sorted_batch(scheduled)
        finished_ids, self._finished_ids = self._finished_ids, []
        plan = StepPlan(
            step_id=step_id,
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=total,
            new_requests=new_requests,
            new_block_ids=new_block_ids,
            preempted_ids=[r.request_id for r in preempted if r.fsm.state is PENDING],
            finished_ids=finished_ids,
            resumed_ids=[d.request_id for d in new_requests if d.resumed],
        )
        collector = self.collector
        if scheduled:
            collector.num_batches_scheduled += 1
            collector.batch_sizes[len(scheduled)] += 1
            collector.num_scheduled_requests += len(scheduled)
            collector.num_scheduled_tokens += total
            self._inflight[step_id] = plan
        self._check()
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestEvent]:
        """Apply the executor's result for `plan`: append tokens, apply stop
        conditions, finish requests and free their blocks. A result for a plan
        that is not in flight (stale or duplicated) changes nothing; one that comes
        before an older plan's and samples for a request that plan samples for too
        is applied after it, so every request's tokens stay in order."""
        events = self.take_events()
        inflight = self._inflight
        if (result.step_id != plan.step_id or inflight.get(plan.step_id) is not plan
                or plan.step_id in self._early):  # answered already, held back
            return events
        if next(iter(inflight)) != plan.step_id and self._answered_early(plan):
            self._early[plan.step_id] = result
            return events
        del inflight[plan.step_id]
        if self._lost:
            self._lost.difference_update(plan.num_scheduled_tokens)
        blocks, requests, policy = self.blocks, self.requests, self.policy
        step_id = plan.step_id
        caching = blocks.enable_prefix_caching
        block_size, num_hashed = blocks.block_size, blocks.num_hashed
        max_model_len = self.config.max_model_len
        sampled = result.sampled_token_ids
        charge = policy.on_tokens if getattr(policy, "charges_tokens", True) else None
        num_generated = 0
        any_finished = False
        first_event = len(events)
        for rid in plan.num_scheduled_tokens:
            request = requests.get(rid)
            if request is None or request.fsm.state is not RUNNING or request.admitted_step > step_id:
                continue  # gone, or preempted and admitted again since this plan
            output, all_ids = request.output_token_ids, request.all_token_ids
            num_tokens = len(all_ids)
            computed = request.num_computed_tokens
            if caching:
                # Tokens a later plan computes from the executor's side are not known yet.
                known = computed if computed < num_tokens else num_tokens
                if known // block_size > num_hashed[rid]:
                    blocks.cache_full_blocks(request, known)
            tokens = sampled.get(rid)
            if not tokens:
                continue
            pending = request.pending_steps
            if not pending or pending[0] != step_id:
                continue  # a partial prefill chunk samples nothing
            del pending[0]
            if len(tokens) == 1:
                # The common case, one token per step, without the loop's overhead:
                # below the length limit and not a stop token, the request goes on.
                token = tokens[0]
                output.append(token)
                all_ids.append(token)
                num_generated += 1
                if num_tokens + 1 < request.length_limit and token not in request.stop_token_set:
                    if charge is not None:
                        charge(request, 1)
                    events.append(RequestEvent(rid, None, tokens))
                    continue
                taken = 1
                reason = self._stop_reason(request, token, len(output), len(all_ids), max_model_len)
                num_generated -= 1
            else:
                reason = None
                taken = 0
                for token in tokens:
                    output.append(token)
                    all_ids.append(token)
                    taken += 1
                    reason = self._stop_reason(request, token, len(output), len(all_ids), max_model_len)
                    if reason is not None:
                        break
            num_generated += taken
            if charge is not None:
                charge(request, taken)
            new_tokens = tokens if taken == len(tokens) else tokens[:taken]
            if reason is None:
                events.append(RequestEvent(rid, None, new_tokens))
            else:
                event = self._complete(request, E.FINISH, reason, "")
                if self.lengths is not None:
                    self.lengths.observe(len(output), reason is FinishReason.LENGTH)
                event.token_ids = new_tokens
                events.append(event)
                any_finished = True
        if any_finished:
            self.running = [r for r in self.running if r.fsm.state is RUNNING]
        if result.logprobs:
            self._attach_logprobs(events, first_event, result.logprobs)
        self.collector.num_tokens_generated += num_generated
        self._check()
        if self._early:
            events += self._update_early()
        return events

    def _answered_early(self, plan: StepPlan) -> bool:
        """Whether `plan` samples a token for a request that an older plan in flight
        samples for too: its answer waits for the older one's, so tokens stay in order."""
        requests, step_id = self.requests, plan.step_id
        for rid in plan.num_scheduled_tokens:
            request = requests.get(rid)
            if request is not None:
                pending = request.pending_steps
                if pending and pending[0] != step_id and step_id in pending:
                    return True
        return False

    def _update_early(self) -> list[RequestEvent]:
        """Apply the answers that arrived before an older plan's, now in order."""
        events: list[RequestEvent] = []
        early, inflight = self._early, self._inflight
        progress = True
        while progress:
            progress = False
            for step_id in sorted(early):
                plan = inflight.get(step_id)
                if plan is None:
                    del early[step_id]
                elif next(iter(inflight)) == step_id or not self._answered_early(plan):
                    events += self.update(plan, early.pop(step_id))
                    progress = True
                    break  # that update may have applied others: look again
        return events

    def stats(self) -> StatsSummary:
        """A snapshot of the counters; rates use the times the caller passed in."""
        c = self.collector
        elapsed = c.elapsed_s
        completed = c.num_requests_completed
        return StatsSummary(
            num_requests_added=c.num_requests_added,
            num_batches_scheduled=c.num_batches_scheduled,
            num_requests_completed=completed,
            completed_by_reason=dict(c.completed_by_reason),
            total_wait_s=c.total_wait_s,
            avg_wait_s=c.total_wait_s / c.num_waits if c.num_waits else 0.0,
            num_tokens_generated=c.num_tokens_generated,
            tokens_per_s=c.num_tokens_generated / elapsed if elapsed > 0 else 0.0,
            requests_per_s=completed / elapsed if elapsed > 0 else 0.0,
            avg_batch_size=(c.num_scheduled_requests / c.num_batches_scheduled
                            if c.num_batches_scheduled else 0.0),
            batch_size_distribution=dict(c.batch_sizes),
            elapsed_s=elapsed,
            num_scheduled_tokens=c.num_scheduled_tokens,
            num_preemptions=c.num_preemptions,
            num_recompute_tokens=c.num_recompute_tokens,
            num_prefix_query_tokens=self.blocks.num_query_tokens,
            num_prefix_hit_tokens=self.blocks.num_hit_tokens,
            prefix_hit_rate=(self.blocks.num_hit_tokens / self.blocks.num_query_tokens
                             if self.blocks.num_query_tokens else 0.0),
            kv_usage=self.blocks.usage,
            num_running=len(self.running),
            num_waiting=len(self.policy),
            num_shared_prompt_tokens=c.num_shared_prompt_tokens,
            num_admission_finish_holds=c.num_admission_finish_holds,
        )

    # ---- internals -------------------------------------------------------------
    def _holds_for_finishing(self, scheduled: dict[str, int]) -> bool:
        """Whether this step admits nothing so that the requests running finish
        first (`admission_finish_hold_steps`): each decodes one token in it and
        reaches its length limit within that many tokens, whatever it samples.
        Every step held brings them a token nearer that end, and nothing is
        admitted meanwhile, so at most that many steps are held in a row."""
        hold = self.config.admission_finish_hold_steps
        if not hold or not scheduled or not len(self.policy):
            return False
        for request in self.running:
            if (scheduled.get(request.request_id) != 1
                    or request.length_limit - len(request.all_token_ids) > hold):
                return False
        return True

    def _mixed_prefill_limit(self) -> int | None:
        """The prompt tokens this step may compute beside decoding requests
        (`mixed_prefill_tokens`, raised to a share of the longest prompt under
        `mixed_prefill_chunks`), or None where no bound applies: the bound is off,
        nothing decodes, or more requests wait than decode, or more prompt tokens
        than it would admit in `mixed_prefill_drain_steps` steps (a burst is
        admitted as without it)."""
        config = self.config
        floor = config.mixed_prefill_tokens
        if not floor or not config.enable_chunked_prefill:
            return None
        chunks = config.mixed_prefill_chunks
        num_decoding = longest = 0
        for request in self.running:
            if request.num_tokens - request.num_computed_tokens <= 1:
                num_decoding += 1
            elif chunks:
                longest = max(longest, request.num_tokens)
        num_waiting = len(self.policy)
        if not num_decoding or num_waiting > num_decoding:
            return None
        waiting_tokens = 0
        if num_waiting:  # no more wait than decode, so this walks at most twice the running
            for request in self.requests.values():
                if request.state is PENDING:
                    waiting_tokens += request.num_tokens
                    longest = max(longest, request.num_tokens)
        limit = max(floor, int(config.mixed_prefill_per_decode * num_decoding))
        if chunks:
            limit = max(limit, -(-longest // chunks))
        if waiting_tokens > limit * config.mixed_prefill_drain_steps:
            return None
        return limit

    def _admission_share(self, burst: bool) -> tuple[int, int]:
        """In a step that runs earlier requests: the tokens its admissions may take
        (`admission_delay_budget`; 0: no limit), and how many of them join whatever
        the share; under `admission_burst_split` N, in a `burst` (more requests
        waited than ran as the step began), the oldest 1/N of them and no more. A
        share splits prompts, so it needs chunking; a backlog beyond the free seats
        is admitted without one, so the seats stay filled."""
        config = self.config
        num_running, num_waiting = len(self.running), len(self.policy)
        if config.admission_burst_split > 1 and burst:
            return 1, -(-num_waiting // config.admission_burst_split)  # whole; then no more
        if (not config.admission_delay_budget or not config.enable_chunked_prefill
                or num_waiting > config.max_num_seqs - num_running):
            return 0, 0
        cap = max(config.admission_delay_budget // (num_running + num_waiting),
                  config.admission_min_tokens)
        return cap, -(-num_waiting // config.admission_drain_steps)

    def _admit(self, budget, seats, scheduled, new_requests, preempted, new_block_ids, threshold,
               cap=0, num_uncapped=0):
        config, blocks, policy = self.config, self.blocks, self.policy
        # `cap` (0: none) bounds the tokens this pass gives the requests it admits
        # after the first `num_uncapped` of them.
        num_admitted = num_admitted_tokens = 0

        def capped() -> bool:
            return cap > 0 and num_admitted >= num_uncapped

        def budget_left() -> int:
            left = config.max_num_batched_tokens - sum(scheduled.values())
            return min(left, cap - num_admitted_tokens) if capped() else left

        if capped():
            budget = min(budget, cap)
        block_size = blocks.block_size
        max_seqs = config.max_num_seqs
        skip_limit = config.starvation_skip_limit
        lookahead = config.max_lookahead
        chunking = config.enable_chunked_prefill
        put_back: list[Request] = []
        blocked: list[tuple[Request, int]] = []
        short_of_blocks = False
        cut = None
        min_need = blocks.num_blocks + 1
        waits_for_sibling = False
        preemptive = getattr(policy, "preempts_running", True)
        prefix_wait = config.admission_prefix_wait_blocks if blocks.enable_prefix_caching else 0
        computing: set[bytes] = set()
        # Requests tied with the one being examined, taken out to be examined next
        # (the longest cached prefix last, as `pop` takes them).
        ahead: list[Request] = []
        prefix_ties = self._prefix_ties
        # Start from a bound on the projection (growth over the whole horizon, no
        # release credited): an admission that fits beside it fits beside the
        # projection, which is only computed when the bound is too tight.
        horizon = config.admission_headroom_steps
        growth, until, exact = len(self.running) * horizon / block_size, horizon, False
        num_releases = blocks.num_releases
        while True:
            if capped() and num_admitted_tokens >= cap:
                break  # displacing a running request gives back no admission tokens
            has_room = budget > 0 and len(scheduled) < seats
            if not has_room and not preemptive:
                break
            if blocks.num_releases != num_releases:  # a preemption changed who runs
                growth, until, reserve, num_releases = self._exact_projection()
                exact = True
            reserve = self._admission_reserve(growth)
            if not preemptive and blocks.num_free_blocks <= reserve and not exact:
                growth, until, reserve, num_releases = self._exact_projection()
                exact = True
            if not preemptive and blocks.num_free_blocks <= reserve:
                # Every admission needs at least one fresh block beyond the reserve.
                short_of_blocks, min_need = True, min(min_need, 1)
                break
            if ahead:
                request = ahead.pop()
            else:
                request = policy.pop()
                if request is None:
                    break
                if prefix_ties:
                    request = self._longest_prefix_first(request, ahead, computing)
            put_back.append(request)
            if request in preempted:
                # Not readmitted in the step that preempted it; its need is not known
                # here (its blocks may still be cached), so no count of free blocks
                # may keep a failed pass standing for it.
                min_need = 0
                continue
            if config.reject_late and self._is_late(request):
                put_back.pop()
                self._events.append(self._complete(request, E.REJECT, FinishReason.REJECTED,
                                                   "deadline passed before admission"))
                continue
            hits = blocks.find_cached_prefix(request)
            num_forked = 0
            if request.group is not None:
                forked = self._sibling_prefix(request, hits)
                if forked is None:
                    waits_for_sibling = True
                    continue  # a sibling is computing the shared prompt blocks: take them, later
                if forked is not hits:
                    num_forked = len(forked) * block_size
                    hits = forked
            if computing and self._shares_computing(request, len(hits), computing):
                break  # next step it finds those blocks cached: wait, rather than compute them twice
            num_cached = len(hits) * block_size
            n = request.num_tokens - num_cached
            fresh = blocks.blocks_for(request.num_tokens) - len(hits)
            # With no seat, budget or running slot left, only a request that may
            # displace a running one goes on, only if displacing could also make
            # room for its blocks, and only once it has made room.
            while not has_room or len(self.running) >= max_seqs:
                # Short of budget or a batch seat, only a victim scheduled in this step
                # gives one back; short of a running slot, any victim does.
                if (not chunking and n > config.max_num_batched_tokens) or not self._preempt_for(
                        request, hits, scheduled, new_block_ids, preempted,
                        only_scheduled=not has_room):
                    break
                budget = budget_left()
                has_room = budget > 0 and len(scheduled) < seats
            if not has_room or len(self.running) >= max_seqs:
                break
            if not chunking and n > budget:
                fits = False
                min_need = 0  # refused for its budget, not its blocks
            else:
                if blocks.num_releases != num_releases:  # a running request made way for it
                    growth, until, reserve, num_releases = self._exact_projection()
                    exact = True
                fits = blocks.allocate(request.request_id, hits, request.num_tokens, reserve)
                if not fits and not exact:  # the bound was too tight: try the projection
                    growth, until, reserve, num_releases = self._exact_projection()
                    exact = True
                    fits = blocks.allocate(request.request_id, hits, request.num_tokens, reserve)
                while not fits and self._preempt_for(request, hits, scheduled, new_block_ids,
                                                     preempted):
                    budget = budget_left()
                    growth, until, reserve, num_releases = self._exact_projection()
                    exact = True
                    fits = blocks.allocate(request.request_id, hits, request.num_tokens, reserve)
            if not fits:
                short_of_blocks = True
                if fresh < min_need:
                    min_need = fresh
                if request.num_skips >= skip_limit:
                    cut = request
                    break  # it has waited long enough: hold capacity for it
                blocked.append((request, num_admitted))
                if len(blocked) > lookahead:
                    cut = request
                    break
                continue
            put_back.pop()
            if n > budget:
                n = budget
            if threshold and n > threshold:
                n = threshold
            self._start(request, num_cached, hits, num_forked)
            if prefix_wait and request.request_id not in self._lost:
                # The prompt blocks this step computes, which later candidates would find
                # cached only from the next step on.
                keys = request.block_hashes
                for i in range(len(hits), min((num_cached + n) // block_size, len(keys))):
                    computing.add(keys[i])
            # Its own growth until the projection's end joins what later admissions leave free.
            left = self._tokens_left(request)
            growth += (left if left < until else until) / block_size
            # A first admission shares the immutable prompt; a resumed one copies its tokens.
            new_requests.append(NewRequestData(
                request.request_id,
                request.all_token_ids if request.output_token_ids else request.prompt_token_ids,
                request.num_prompt_tokens,
                list(blocks.tables[request.request_id]), num_cached, request.num_preemptions > 0))
            scheduled[request.request_id] = n
            budget -= n
            num_admitted += 1
            num_admitted_tokens += n
            if capped():
                budget = min(budget, cap - num_admitted_tokens)
        put_back.extend(ahead)
        for request in put_back:
            policy.push(request)
        if (num_admitted == 0 and short_of_blocks and len(self.running) < max_seqs
                and not config.reject_late  # late requests must still be rejected on time
                and not waits_for_sibling):  # it may go on without any release
            # The projection's reserve shrinks as running requests near their ends,
            # so a pass may succeed without a release: look again now and then.
            self._failed_admission = (self._queue_version, blocks.num_releases,
                                      self.step_id + ADMISSION_RETRY_STEPS, blocks.num_registered)
            self._admission_cut = cut
            self._min_need = min_need
        else:
            self._failed_admission = None
            self._admission_cut = None
        for request, mark in blocked:
            if num_admitted > mark:
                request.num_skips += 1
        return budget

    def _failed_pass_stands(self) -> bool:
        """Whether the last admission pass, which admitted nothing for want of
        blocks, would fail the same way now, so that it need not run.

        It stands while the same requests wait in the same order (arrivals since
        count their need in, see `add_request`), no block was registered in the
        prefix cache since (so no waiting request's need has shrunk), for at most
        ADMISSION_RETRY_STEPS steps, and either fewer blocks are free beyond the
        watermark than the least any of them needs, or nothing was given back
        since and, under a policy whose order is static and that displaces no
        running request, fewer are free beyond the reserve the pass would keep:
        that reserve shrinks as running requests near their ends, with no release.
        Under such a policy the memo changes no decision. Under `fair` (whose order
        moves as tenants are served) and while a policy may displace running
        requests, a pass may succeed sooner than the memo looks again."""
        failed, blocks = self._failed_admission, self.blocks
        # step_id already counts this step.
        if (failed[0] != self._queue_version or self.step_id > failed[2]
                or failed[3] != blocks.num_registered):
            return False
        running, policy = self.running, self.policy
        free, need = blocks.num_free_blocks, self._min_need
        if free - (self._margins()[1] if running else 0) < need:
            return True
        if failed[1] != blocks.num_releases:
            return False
        if getattr(policy, "preempts_running", True) or not getattr(policy, "static_order", False):
            return True
        return bool(running) and free - self._exact_projection()[2] < need

    def _projected_growth(self, excluded: Sequence[Request] = ()) -> tuple[float, int]:
        """How many blocks the running requests (less `excluded`) will take beyond
        what they hold before releases pay for it, and the step where the
        projection stops; see `admission_headroom_steps`.

        Each request is taken to grow one token per step, a block every
        `block_size` steps on average, until its length limit (or its predicted
        end, see `_tokens_left`), and then to free
        every block it holds. The need peaks just before a release; the projection
        stops at the first release after which the blocks freed so far cover all
        the growth so far, or at the horizon.
        """
        horizon = self.config.admission_headroom_steps
        running = self.running
        if not horizon or not running:
            return 0.0, horizon
        tables = self.blocks.tables
        # One int per request, steps left above blocks held, so that a C-level heap
        # orders them; only the first few releases are usually needed.
        shift = 32
        members = running if not excluded else [r for r in running if r not in excluded]
        lengths = self.lengths
        if lengths is None or lengths.declared_only:
            ends = [(r.length_limit - len(r.all_token_ids)) << shift | len(tables[r.request_id])
                    for r in members]
        else:
            left = self._tokens_left
            ends = [left(r) << shift | len(tables[r.request_id]) for r in members]
        alive = len(ends)
        cut = (horizon + 1) << shift
        ends = [e for e in ends if e < cut]
        heapq.heapify(ends)
        mask = (1 << shift) - 1
        per_step = 1.0 / self.blocks.block_size
        peak = 0.0
        released = 0
        while ends:
            end = heapq.heappop(ends)
            left = end >> shift
            need = (left - 1) * alive * per_step - released
            if need > peak:
                peak = need
            released += end & mask
            alive -= 1
            if left * alive * per_step <= released:
                return peak, left
        need = horizon * alive * per_step - released
        return (need if need > peak else peak), horizon

    def _longest_prefix_first(self, first: Request, ahead: list[Request],
                              computing: set[bytes]) -> Request:
        """Among `first` and the waiting requests tied with it (up to
        `prefix_tie_lookahead` in all), the one to examine first: the longest
        cached prefix, and not one that would wait for a prefix being computed;
        policy order among equals. The rest go to `ahead`, best last."""
        policy = self.policy
        group = [first]
        limit = self.config.prefix_tie_lookahead
        while len(group) < limit:
            nxt = policy.peek()
            if nxt is None or not policy.ties(first, nxt):
                break
            group.append(policy.pop())
        if len(group) == 1:
            return first
        find = self.blocks.find_cached_prefix

        def rank(r: Request) -> tuple[bool, int]:
            hits = len(find(r))
            return (bool(computing) and self._shares_computing(r, hits, computing), -hits)

        # A request that ran before finds its own retained blocks, not a shared
        # prefix: it keeps its slot in policy order, and only the new arrivals
        # around it are reordered.
        slots = [i for i, r in enumerate(group) if r.first_scheduled_s is None]
        for i, r in zip(slots, sorted((group[i] for i in slots), key=rank)):
            group[i] = r
        ahead.extend(reversed(group[1:]))
        return group[0]

    def _shares_computing(self, request: Request, num_hits: int, computing: set[bytes]) -> bool:
        """Whether the blocks after `request`'s cached prefix are, for at least
        `admission_prefix_wait_blocks` blocks, being computed in this step by a
        request admitted before it."""
        keys = request.block_hashes
        need = self.config.admission_prefix_wait_blocks
        end = num_hits + need
        if end > len(keys) or end > (request.num_tokens - 1) // self.blocks.block_size:
            return False  # past what a lookup may find: the last token's block is computed anyway
        for i in range(num_hits, end):
            if keys[i] not in computing:
                return False
        return True

    def _sibling_prefix(self, request: Request, hits: list[int]) -> list[int] | None:
        """The blocks a group member is admitted with: the group's shared prompt
        blocks as held by a running sibling that has computed them, unless the
        cached prefix `hits` is longer; None while a sibling is still computing
        them and `hits` fall short (one that has been recomputing since the
        executor was lost is not waited for: the loss may follow it)."""
        group = request.group
        block_size = self.blocks.block_size
        num_shared = group.num_shared_tokens
        num_hit = len(hits) * block_size
        if num_hit > num_shared:
            return hits
        computing = False
        for sibling in group.members:
            if sibling is request or sibling.fsm.state is not RUNNING:
                continue
            if sibling.num_computed_tokens >= num_shared:
                return self.blocks.tables[sibling.request_id][:num_shared // block_size]
            if sibling.request_id not in self._lost:
                computing = True
        return None if computing and num_hit < num_shared else hits

    def _tokens_left(self, request: Request) -> int:
        """Tokens the request is projected to add before it finishes: up to its
        length limit, or to its predicted end when output lengths are predicted."""
        lengths = self.lengths
        if lengths is None or lengths.declared_only:
            return request.length_limit - len(request.all_token_ids)
        prompt = request.num_prompt_tokens
        end = prompt + lengths.predict(len(request.all_token_ids) - prompt,
                                       request.length_limit - prompt)
        return end - len(request.all_token_ids)

    def _exact_projection(self) -> tuple[float, int, int, int]:
        """The projection of the running set now: growth, where it stops, the
        reserve it implies, and the release count it was taken at."""
        growth, until = self._projected_growth()
        return growth, until, self._admission_reserve(growth), self.blocks.num_releases

    def _margins(self) -> tuple[float, int]:
        """The share of projected growth admission holds back, and the watermark
        (the fewest blocks it leaves free while requests run): the declared-limit
        margins until early stops are learnt, then the predicted-end ones, or
        the thrash ones while growth preemptions come in quick succession."""
        lengths = self.lengths
        if lengths is None or not lengths.learnt:
            return self.config.admission_growth_share, self._watermark_blocks
        if self.step_id > self._thrash_margins_until:
            return self.config.predicted_growth_share, self._predicted_watermark_blocks
        return self.config.thrash_growth_share, self._thrash_watermark_blocks

    def _note_growth_preemption(self) -> None:
        """A running request's growth preempted one. Under predicted ends, a second
        within `thrash_window_steps` of the last (in an earlier step) keeps the
        thrash margins for that many steps: the predictions are falling short."""
        lengths, window = self.lengths, self.config.thrash_window_steps
        if lengths is None or not lengths.learnt or not window:
            return
        step, last = self.step_id, self._last_growth_preemption
        if last is not None and last != step and step - last <= window:
            self._thrash_margins_until = step + window
        self._last_growth_preemption = step

    def _admission_reserve(self, growth: float) -> int:
        """Blocks admission leaves free so running requests can keep growing: the
        watermark, or the held-back share of their projected growth."""
        if not self.running:
            return 0
        share, floor = self._margins()
        held_back = int(-(-(share * growth) // 1))
        return held_back if held_back > floor else floor

    @staticmethod
    def _attach_logprobs(events: list[RequestEvent], first: int,
                         logprobs: dict[str, list[list[tuple[int, float]]]]) -> None:
        """Give each token event of this update the log-probabilities of its tokens."""
        for event in events[first:]:
            per_token = logprobs.get(event.request_id)
            if per_token and event.token_ids:
                event.logprobs = list(per_token[:len(event.token_ids)])

    @staticmethod
    def _stop_reason(request: Request, token: int, num_output: int, num_tokens: int,
                     max_model_len: int) -> FinishReason | None:
        """Why the request stops after `token`, or None if it goes on."""
        if token in request.stop_token_set and num_output >= request.limits.min_tokens:
            return FinishReason.STOP
        if num_output >= request.limits.max_tokens or num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None

    def _start(self, request: Request, num_cached: int, hits: list[int],
               num_forked: int = 0) -> None:
        """Admit `request` with `num_cached` tokens computed: `hits`' blocks, of which
        `num_forked` tokens' were computed by a sibling rather than found cached."""
        request.fsm.fire(E.ADMIT)
        request.admitted_step = self.step_id - 1
        request.num_computed_tokens = num_cached
        request.num_skips = 0
        self.running.append(request)
        if request.first_scheduled_s is not None:
            self.num_resume_hit_tokens += num_cached  # back after a preemption or executor loss
        else:
            self.blocks.record_lookup(request.num_tokens, num_cached - num_forked)
            request.num_cached_tokens = num_cached
        self.collector.num_shared_prompt_tokens += num_forked
        if request.first_scheduled_s is None:
            request.first_scheduled_s = self.now_s
            self.collector.total_wait_s += max(0.0, self.now_s - request.arrival_s)
            self.collector.num_waits += 1
        self._events.append(RequestEvent(request.request_id, E.ADMIT))

    def _preempt_for(self, waiting: Request, hits: list[int], scheduled, new_block_ids,
                     preempted, only_scheduled: bool = False) -> bool:
        """Preempt one running request the policy lets `waiting` displace, but only if
        displacing all of them would free enough blocks for `waiting` to fit.

        only_scheduled: consider only requests scheduled in this step (a request left
        out of it, or whose token is still in flight, holds no budget to give back)."""
        policy = self.policy
        if not getattr(policy, "preempts_running", True):
            return False
        # Requests admitted in this step came earlier in the policy's order: never victims.
        step_id = self.step_id - 1
        group = waiting.group
        candidates = [r for r in self.running
                      if r.admitted_step != step_id and policy.may_preempt(waiting, r)
                      and (not only_scheduled or r.request_id in scheduled)
                      and (group is None or r.group is not group)]
        if not candidates or not self._room_after_preempting(waiting, hits, candidates):
            return False
        self._preempt(policy.victim(candidates), scheduled, new_block_ids, preempted)
        return True

    def _room_after_preempting(self, waiting: Request, hits: list[int],
                               candidates: list[Request]) -> bool:
        """Whether `waiting` would fit if every candidate released its blocks. A block
        shared with a request that stays is not freed by preempting the others."""
        blocks = self.blocks
        releases: dict[int, int] = {}
        for r in candidates:
            for b in blocks.tables[r.request_id]:
                releases[b] = releases.get(b, 0) + 1
        freed = {b for b, n in releases.items() if blocks.ref_counts[b] == n}
        revived = sum(1 for b in hits if b in blocks.evictable or b in freed)
        reserve = (self._admission_reserve(self._projected_growth(candidates)[0])
                   if len(candidates) < len(self.running) else 0)
        need = blocks.blocks_for(waiting.num_tokens) - len(hits) + reserve
        return need + revived <= blocks.num_free_blocks + len(freed)

    def _preempt(self, victim: Request, scheduled, new_block_ids, preempted) -> int:
        """Send a running request back to waiting; return the budget it gives back."""
        rid = victim.request_id
        returned = scheduled.pop(rid, 0)
        new_block_ids.pop(rid, None)
        victim.fsm.fire(E.PREEMPT)
        self.running.remove(victim)
        self.blocks.free(rid, retain=self.cache_config.retain_preempted_blocks)
        self.collector.num_preemptions += 1
        self.collector.num_recompute_tokens += victim.num_computed_tokens
        victim.num_computed_tokens = 0
        victim.pending_steps.clear()
        victim.num_preemptions += 1
        self.policy.push(victim)
        self._queue_version += 1
        preempted.append(victim)
        self._events.append(RequestEvent(rid, E.PREEMPT))
        return returned

    def _complete(self, request: Request, kind: RequestEventKind, reason: FinishReason,
                  detail: str) -> RequestEvent:
        """Move a request to Completed, free its blocks, and tell the executor."""
        was_running = request.fsm.state is RUNNING
        if request.fsm.state is PENDING:
            self.policy.remove(request)
            self._queue_version += 1  # the queue changed: a failed pass may now succeed
        request.fsm.fire(kind, reason)
        request.finish_detail = detail
        if request.group is not None:
            request.group.members.remove(request)
        rid = request.request_id
        self.blocks.free(rid)
        del self.requests[rid]
        self._lost.discard(rid)
        if was_running:
            self._finished_ids.append(rid)
        self.collector.num_requests_completed += 1
        self.collector.completed_by_reason[reason.value] += 1
        return RequestEvent(rid, kind, (), reason, detail)

    def _is_late(self, request: Request) -> bool:
        deadline_of = self._deadline_of
        return deadline_of is not None and deadline_of(request) < self.now_s

    def _sorted_batch(self, scheduled: dict[str, int]) -> dict[str, int]:
        requests = self.requests
        def key(rid: str) -> tuple:
            n = scheduled[rid]
            decode = n == 1 and requests[rid].num_computed_tokens > requests[rid].num_prompt_tokens
            return (0, 0) if decode else (1, -n)
        return {rid: scheduled[rid] for rid in sorted(scheduled, key=key)}

    def _check(self) -> None:
        if self._checker is not None:
            self._checker(self)

