"""Scheduler and cache configuration: frozen, validated where they are made."""

from __future__ import annotations

import math

import attrs

from .errors import ConfigError

# How far cached prefix blocks are shared: within a tenant, or among everyone.
PREFIX_CACHE_SHARING = ("tenant", "global")
FCFS_VICTIMS = ("least_work", "latest_admitted")
POLICY_NAMES = ("fcfs", "priority", "strict-priority", "deadline", "fair", "weighted")


# Under `mixed_prefill_tokens`, a queue whose tokens the bound would take more steps
# than this to admit is admitted as without it (`mixed_prefill_drain_steps`'s default).
MIXED_DRAIN_STEPS = 16


def _at_least(minimum: float):
    def check(instance, attribute, value) -> None:
        if not value >= minimum:  # NaN too
            raise ConfigError(f"{attribute.name} must be >= {minimum}, got {value!r}")
    return check


def _finite(instance, attribute, value) -> None:
    if not math.isfinite(value):
        raise ConfigError(f"{attribute.name} must be finite, got {value!r}")


def _one_of(name: str, choices: tuple[str, ...]):
    def check(instance, attribute, value) -> None:
        if value not in choices:
            raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return check


def _fraction(instance, attribute, value) -> None:
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"{attribute.name} must be in [0, 1), got {value!r}")


def _share(instance, attribute, value) -> None:
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"{attribute.name} must be in [0, 1], got {value!r}")


def _policy_name(instance, attribute, value) -> None:
    if not isinstance(value, str) or (value not in POLICY_NAMES and ":" not in value):
        raise ConfigError(
            f"{attribute.name} must be one of {', '.join(POLICY_NAMES)} "
            f"or 'package.module:Class', got {value!r}"
        )


@attrs.frozen
class CacheConfig:
    """The paged KV cache as the scheduler accounts for it.

    num_blocks: KV blocks available (the executor reports the real figure at start-up).
    block_size: tokens per block.
    enable_prefix_caching: reuse full blocks whose chained hash is already cached.
    retain_preempted_blocks: a preempted request's cached blocks are evicted only
      after every other evictable block, so it finds them when it resumes.
    prefix_cache_sharing: "tenant" (default): cached blocks are shared only among
      requests of one tenant, so no tenant learns anything about another's
      prompts from cache hits or timing; "global": shared by every request with
      the same cache salt.
    """

    num_blocks: int = attrs.field(default=8192, validator=_at_least(1))
    block_size: int = attrs.field(default=16, validator=_at_least(1))
    enable_prefix_caching: bool = True
    retain_preempted_blocks: bool = True
    prefix_cache_sharing: str = attrs.field(
        default="tenant", validator=_one_of("prefix_cache_sharing", PREFIX_CACHE_SHARING))

    def block_salt(self, tenant: str, cache_salt: str | None) -> str | None:
        """The salt of a request's block keys: its cache salt, and under
        "tenant" sharing its tenant too (length-prefixed, so no tenant and salt
        pair can spell another's)."""
        if self.prefix_cache_sharing == "global":
            return cache_salt
        tail = "" if cache_salt is None else f"s{cache_salt}"
        return f"t{len(tenant)}:{tenant}{tail}"


@attrs.frozen
class SchedulerConfig:
    """How the scheduler batches, orders and limits requests.

    Limits
      max_num_seqs: requests running at once (holding KV blocks).
      max_batch_size: requests in one step's batch; defaults to `max_num_seqs`.
      max_num_batched_tokens: tokens scheduled in one step (the token budget).
      max_model_len: prompt plus output tokens one request may reach.
      max_waiting: requests queued; beyond it `add_request` raises `QueueFullError`.
      long_prefill_token_threshold: most prefill tokens one request gets per step
        (0: no cap beyond the budget), so one long prompt cannot take a whole step.
      enable_chunked_prefill: split prompts across steps; when off, a prompt must
        fit the budget whole.
      admission_delay_budget: in a step that runs requests admitted before, the
        requests it admits get at most this many tokens divided by the number of
        requests held (running and waiting), and at least `admission_min_tokens`
        (0: whatever the budget has left). Each prompt token computed beside the
        running requests delays their next token; sharing the budget among the
        requests held keeps that delay short where many run, and lets a burst of
        arrivals join over several steps instead of in one step that stalls them
        all and turns the burst into a wave whose requests all finish, and all
        come back, in the same step. Beside a few requests a burst joins at once,
        and a step with nothing running (the first of an offline batch) admits up
        to the whole budget. Applies only with chunked prefill (a share may split
        a prompt).
      admission_min_tokens: tokens the step's admissions may always take under
        `admission_delay_budget`, so admission keeps up with arrivals however
        many requests run.
      admission_drain_steps: under `admission_delay_budget`, one in this many
        waiting requests joins in each step whatever the share (the first ones in
        policy order), so a burst of any size has joined within about this many
        steps; and the share holds only while every waiting request has a free
        seat (`max_num_seqs`): a backlog is admitted as without it, keeping the
        seats filled.
      admission_burst_split: in a step that runs requests admitted before,
        while more requests wait than run, only the oldest 1/N of the waiting
        requests (rounded up) are admitted, each whole, and the share of
        `admission_delay_budget` does not apply (0 or 1: off). With 2 a burst
        joins over two steps: its older half starts decoding a step sooner than
        if all of it shared one long step, and the requests running are held up
        twice, not once a step for many steps.
      admission_finish_hold_steps: while every running request decodes in the
        step and reaches its length limit within this many tokens, whatever it
        samples, the step admits nothing: they finish first, over at most this
        many steps, and the requests waiting then join together, without a
        long prefill step stalling requests one or two tokens from their end
        (0: off). A closed loop of clients whose requests came back one or two
        steps apart otherwise stays split into groups for good, each group's
        prefill stalling the others once per round.
      mixed_prefill_tokens: in a step that runs decoding requests (past their
        prompts), and while no more requests wait than decode, the prompt tokens
        it computes (new admissions and the next chunks of prompts begun earlier,
        together) are at most this many, or `mixed_prefill_per_decode` times the
        number decoding where that is more (0: no bound). Each prompt token in
        such a step delays every decoding request's next token: the bound keeps
        that step within a small multiple of a decode-only step, so the time
        between tokens stays even, and prompts that arrive together join over a
        few steps, one after another, instead of sharing one long step. A step
        with nothing decoding is admitted as without it, and so is a queue of
        more requests than decode, or of more tokens (prompt and output) than the
        bound admits in `mixed_prefill_drain_steps` steps. Applies only with
        chunked prefill.
      mixed_prefill_per_decode: see `mixed_prefill_tokens`.
      mixed_prefill_chunks: under `mixed_prefill_tokens`, the bound is at least
        the longest prompt waiting or begun (its whole length, not what is left
        of it, so the share holds from its first chunk to its last) divided by
        this, rounded up, so that one prompt joins beside decoding requests in at
        most this many steps however long it is (0: the bound alone). A small
        bound then keeps the gaps between tokens short where prompts are short
        without spreading a long prompt over so many steps that the queue
        behind it outgrows the drain.
      mixed_prefill_drain_steps: see `mixed_prefill_tokens` (default
        MIXED_DRAIN_STEPS, 16). A larger figure keeps the bound on for longer
        queues: a closed loop of clients that come back in rounds is then split
        up instead of admitted round by round in long steps.

    Ordering
      policy: `fcfs`, `priority` (lower value first, aged), `strict-priority` (no
        aging: can starve, kept for the checker), `deadline` (earliest deadline
        first), `fair` (per-tenant virtual token counters), `weighted` (the score
        below), or `package.module:Class` for a user policy.
      enable_priority_scheduling: when off, request priorities are ignored by every
        policy and never cause preemption.
      aging_steps: under `priority`, a waiting request gains one priority level per
        `aging_steps` scheduler steps waited. The aging bound: a request of
        priority p ranks ahead of every request of priority q that arrives
        (p - q) * aging_steps steps or more after it, so after that long no later
        arrival is admitted before it (beyond `starvation_skip_limit` passes for
        one that does not fit) and none may displace it. Counted in steps rather
        than seconds, so the bound is the same on a fast engine and a slow one
        (250 steps: 5 s at 20 ms per step; the `starve` benchmark trace's
        priority-2 request waits 685 steps behind a stream of priority 0 that
        overloads the engine by a quarter, 2,136 at 800).
      default_deadline_s: under `deadline`, the deadline of a request without one is
        its arrival plus this.
      reject_late: under `deadline`, a waiting request whose deadline has passed
        finishes as rejected instead of taking capacity it can no longer use well.
      fair_input_weight / fair_output_weight: tokens charged to a tenant's virtual
        counter per prompt and per generated token under `fair`.
      priority_weight, latency_weight, throughput_weight: the `weighted` policy ranks a
        waiting request by priority_weight * priority + latency_weight * arrival_s +
        throughput_weight * prompt tokens (lowest first): priority, age, and shortest
        job first for throughput.
      enable_batch_sorting: order each plan's requests decodes first, then prefills by
        length, which lets the executor treat the decode part as one block.

    Protection against vLLM's failure modes
      starvation_skip_limit: steps a waiting request may be passed over for smaller
        ones before it reserves capacity (nothing behind it is admitted until it is).
      max_lookahead: waiting requests examined per step after one does not fit
        (0: admission stops at the first, as vLLM's does).
      fcfs_victim: whom `fcfs` preempts when a running request cannot grow:
        `least_work` (the running request with the fewest computed tokens, so the
        least recomputation) or `latest_admitted` (the last one admitted, vLLM's
        choice).
      admit_after_preemption: whether a step whose running pass preempted may still
        admit waiting requests; off, it admits none (vLLM's rule). With
        `max_lookahead` 0, `latest_admitted`, every admission margin at 0 and one
        block fewer (vLLM keeps a null block), the core plans step for step what
        the vLLM scheduler model in `benchmarks/vllm_model.py` plans without prefix
        caching wherever a step's budget holds the prompts it admits (a split
        prompt's blocks vLLM takes a chunk at a time, the core all at admission;
        `tests/test_vllm_model.py` checks it), so a difference in the benchmark's
        counters comes from these rules and the margins alone.
      preempt_for_priority: a waiting request may preempt a running one of strictly
        lower priority, within the three limits below (hysteresis: a preemption
        must be worth the recomputation it throws away).
      preempt_min_priority_gap: the running request's priority value must exceed
        the waiting one's by at least this much.
      preempt_max_recompute_tokens: the running request may have computed at most
        this many tokens per level of priority gap (the work a preemption throws
        away); 0: no limit.
      preempt_max_times: a request already preempted this many times (for any
        reason) is not displaced by a waiting request again; 0: no limit. It still
        yields when the cache runs out.
      admission_watermark: fraction of blocks kept free when admitting, so running
        requests can grow without immediate preemption. Small, because the
        headroom projection below already reserves the running requests' growth:
        on the benchmark traces a margin of 1% on top left memory idle in
        memory-bound stretches (the poisson family, exact mode, 32-46 steps
        behind the vLLM model on 3 of 5 seeds; 0.2%: 1-15).
      admission_headroom_steps: how far ahead admission looks (0: the watermark
        alone). Each running request grows a token per decode step until its
        length limit (prompt + max_tokens), then frees its blocks; admission keeps
        free the most blocks this projection of the running requests needs at
        any point before the releases it expects have paid for the growth, or
        before this many steps, whichever comes first. A request admitted in the
        same pass adds its own growth. The projection runs each request to its
        length limit, or to its predicted end (`predict_output_lengths`).
      admission_growth_share: the fraction of that projected growth admission holds
        back; below 1 admits a little ahead of the projection, betting that some
        requests stop early (EOS) and accepting an occasional preemption.
      admission_prefix_wait_blocks: with prefix caching, a waiting request whose
        next this many uncached prompt blocks are being computed in this step by
        a request admitted before it ends the step's admissions: from the next
        step it finds them cached, rather than computing them a second time
        (0: never wait). Nothing behind it is admitted first, so arrival order
        holds.
      prefix_tie_lookahead: with prefix caching, among waiting requests the policy
        ranks equally (same key; under `fair`, one tenant and arrival time), up to
        this many are looked at together and the one with the longest cached
        prefix is examined first (1: policy order only). A request that ran
        before (preempted, or back after an executor loss) keeps its slot in
        policy order: its own retained blocks are no shared prefix.
      predict_output_lengths: project each running request's growth to its
        predicted end rather than its declared max_tokens. The prediction is the
        `length_estimate_quantile` of the outcomes of the last
        `length_estimate_window` finished requests that are still possible for
        it (stopped on EOS after more tokens than it has, or ran to its own
        limit); until `length_estimate_min_samples` have finished, and whenever
        every finished request ran to its limit, it is the declared limit. A
        request that outlives its prediction is preempted if blocks run out.
      predicted_watermark, predicted_growth_share: `admission_watermark` and
        `admission_growth_share` while predicted ends are in force. With declared
        limits a margin makes admission nearly preemption-free; with predicted
        ends it cannot (a request that outlives its prediction grows past any
        fixed margin, and preemption is the safety net by design), so a full
        margin there mostly leaves blocks idle, and idle blocks cost steps where
        memory bounds the batch. Used once `length_estimate_min_samples`
        requests have finished and some stopped early; traffic that runs to its
        declared limits is scheduled exactly as with the margins above.
      thrash_window_steps: when a running request's growth preempts one while
        predicted ends are in force, and another such preemption came at most
        this many steps before, the predictions are running short (requests
        outlive them, one preemption after another): admission keeps the
        thrash margins below until this many steps pass without another. A
        lone preemption changes nothing. 0: always the predicted margins.
      thrash_watermark, thrash_growth_share: `admission_watermark` and
        `admission_growth_share` while the thrash window holds (by default 1%
        and 0.95). The projection still runs to predicted ends, which have just
        proved short, so these keep a margin beyond it whatever the declared-limit
        margins are.

    Overlap
      async_scheduling: a running request whose sampled token is still in flight
        may be scheduled for that token's position in the next plan, made before the
        result arrives (the executor feeds its own sampled token back). Plans then
        overlap the executor's work: while step N runs, step N+1 is planned and
        handed over. Stop tokens take effect a step late: at most one more token
        is computed for a finished request and never emitted. A request whose
        in-flight token reaches its length limit is not scheduled again.

    Shell
      schedule_interval_us: the scheduler actor waits at least this long between
        steps (0: step as soon as there is work); the core ignores it.
      debug_checks: check the invariants of DESIGN §4 after every call (slow).
    """

    max_num_seqs: int = attrs.field(default=256, validator=_at_least(1))
    max_num_batched_tokens: int = attrs.field(default=8192, validator=_at_least(1))
    max_model_len: int = attrs.field(default=4096, validator=_at_least(1))
    max_waiting: int = attrs.field(default=1_000_000, validator=_at_least(0))
    max_batch_size: int | None = None
    long_prefill_token_threshold: int = attrs.field(default=0, validator=_at_least(0))
    admission_delay_budget: int = attrs.field(default=0, validator=_at_least(0))
    admission_min_tokens: int = attrs.field(default=128, validator=_at_least(1))
    admission_drain_steps: int = attrs.field(default=32, validator=_at_least(1))
    admission_burst_split: int = attrs.field(default=0, validator=_at_least(0))
    admission_finish_hold_steps: int = attrs.field(default=0, validator=_at_least(0))
    mixed_prefill_tokens: int = attrs.field(default=0, validator=_at_least(0))
    mixed_prefill_per_decode: float = attrs.field(default=2.0, validator=[_at_least(0.0), _finite])
    mixed_prefill_drain_steps: int = attrs.field(default=MIXED_DRAIN_STEPS, validator=_at_least(1))
    mixed_prefill_chunks: int = attrs.field(default=0, validator=_at_least(0))
    enable_chunked_prefill: bool = True
    policy: str = attrs.field(default="fcfs", validator=_policy_name)
    enable_priority_scheduling: bool = True
    aging_steps: int = attrs.field(default=250, validator=_at_least(0))
    default_deadline_s: float = attrs.field(default=60.0, validator=_at_least(0.0))
    reject_late: bool = False
    fair_input_weight: float = attrs.field(default=1.0, validator=_at_least(0.0))
    fair_output_weight: float = attrs.field(default=2.0, validator=_at_least(0.0))
    priority_weight: float = 1.0
    latency_weight: float = 1.0
    throughput_weight: float = 0.0
    enable_batch_sorting: bool = False
    starvation_skip_limit: int = attrs.field(default=32, validator=_at_least(0))
    max_lookahead: int = attrs.field(default=16, validator=_at_least(0))
    fcfs_victim: str = attrs.field(default="least_work", validator=_one_of("fcfs_victim", FCFS_VICTIMS))
    admit_after_preemption: bool = True
    preempt_for_priority: bool = True
    preempt_min_priority_gap: int = attrs.field(default=1, validator=_at_least(1))
    preempt_max_recompute_tokens: int = attrs.field(default=1024, validator=_at_least(0))
    preempt_max_times: int = attrs.field(default=1, validator=_at_least(0))
    admission_watermark: float = attrs.field(default=0.002, validator=_fraction)
    admission_headroom_steps: int = attrs.field(default=128, validator=_at_least(0))
    admission_growth_share: float = attrs.field(default=0.95, validator=_share)
    admission_prefix_wait_blocks: int = attrs.field(default=2, validator=_at_least(0))
    prefix_tie_lookahead: int = attrs.field(default=8, validator=_at_least(1))
    predict_output_lengths: bool = True
    length_estimate_window: int = attrs.field(default=512, validator=_at_least(1))
    length_estimate_min_samples: int = attrs.field(default=16, validator=_at_least(1))
    length_estimate_quantile: float = attrs.field(default=0.2, validator=_share)
    predicted_watermark: float = attrs.field(default=0.0025, validator=_fraction)
    predicted_growth_share: float = attrs.field(default=0.8, validator=_share)
    thrash_window_steps: int = attrs.field(default=16, validator=_at_least(0))
    thrash_watermark: float = attrs.field(default=0.01, validator=_fraction)
    thrash_growth_share: float = attrs.field(default=0.95, validator=_share)
    async_scheduling: bool = False
    schedule_interval_us: int = attrs.field(default=0, validator=_at_least(0))
    debug_checks: bool = False

    def __attrs_post_init__(self) -> None:
        if self.max_batch_size is not None and not 1 <= self.max_batch_size:
            raise ConfigError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) when enable_chunked_prefill is off"
            )

    @property
    def batch_size_limit(self) -> int:
        """Requests one step may schedule."""
        if self.max_batch_size is None:
            return self.max_num_seqs
        return min(self.max_batch_size, self.max_num_seqs)
