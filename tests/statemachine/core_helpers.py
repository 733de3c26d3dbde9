"""Small builders and drivers shared by the scheduling-core tests.

They stand in for the shell: they build requests and schedulers with small,
readable numbers, fabricate the executor's answer to a plan, and run steps.
"""

from __future__ import annotations

import os
import random
import zlib
from typing import Callable, Iterable

from hypothesis import settings

from cadence.statemachine.config import CacheConfig, SchedulerConfig
from cadence.statemachine.fsm import FinishReason, RequestEventKind
from cadence.statemachine.plan import RequestEvent, StepPlan, StepResult
from cadence.statemachine.request import Request, SamplingLimits
from cadence.statemachine.scheduler import Scheduler

EOS = 1
STOP = 2
FILLER = 9

EXPLORE = os.environ.get("CADENCE_EXPLORE") == "1"


def examples(count: int) -> int:
    """Examples for a stateful test: `count` (sized for the CI time budget) in the
    ci and dev profiles, the explore profile's count under CADENCE_EXPLORE=1."""
    if EXPLORE:
        return max(count, settings.default.max_examples)
    return count


def make_request(
    request_id: str,
    prompt: Iterable[int] | int,
    *,
    max_tokens: int = 4,
    min_tokens: int = 0,
    ignore_eos: bool = False,
    eos: Iterable[int] = (EOS,),
    stop: Iterable[int] = (),
    **kwargs,
) -> Request:
    """A request; an int `prompt` means that many tokens unique to this request id,
    so requests share no prefix unless a test gives them the same tokens."""
    tokens = unique_tokens(request_id, prompt) if isinstance(prompt, int) else list(prompt)
    limits = SamplingLimits(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
                            eos_token_ids=frozenset(eos), stop_token_ids=frozenset(stop))
    return Request(request_id, tokens, limits, **kwargs)


def unique_tokens(request_id: str, n: int) -> list[int]:
    """`n` token ids derived from `request_id`, never EOS or STOP."""
    base = 1000 + (zlib.crc32(request_id.encode()) % 100_000) * 4096
    return [base + i for i in range(n)]


def make_scheduler(
    policy: str = "fcfs",
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    enable_prefix_caching: bool = True,
    **config,
) -> Scheduler:
    """A scheduler with small defaults and invariant checks after every call.

    Admission keeps no blocks in reserve (no watermark, no growth headroom) unless
    a test asks for it, so block arithmetic in tests stays exact."""
    defaults = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                    admission_watermark=0.0, admission_headroom_steps=0, debug_checks=True)
    defaults.update(config)
    return Scheduler(SchedulerConfig(policy=policy, **defaults),
                     CacheConfig(num_blocks=num_blocks, block_size=block_size,
                                 enable_prefix_caching=enable_prefix_caching))


def sampling_ids(scheduler: Scheduler, plan: StepPlan) -> list[str]:
    """Requests of `plan` that sample a token: their computed tokens reach their
    end once `schedule()` has returned."""
    out = []
    for rid in plan.num_scheduled_tokens:
        request = scheduler.requests.get(rid)
        if request is not None and request.num_computed_tokens == request.num_tokens:
            out.append(rid)
    return out


def fabricate(scheduler: Scheduler, plan: StepPlan,
              token: Callable[[str], int] | int = 100) -> StepResult:
    """The executor's answer: one token per request that samples in `plan`."""
    pick = token if callable(token) else (lambda rid: token)
    return StepResult(plan.step_id, {rid: [pick(rid)] for rid in sampling_ids(scheduler, plan)})


def step(scheduler: Scheduler, now_s: float | None = None,
         token: Callable[[str], int] | int = 100) -> tuple[StepPlan, list[RequestEvent]]:
    """Schedule one step, answer it at once, and return the plan and every event."""
    plan = scheduler.schedule(now_s)
    events = scheduler.take_events()
    events += scheduler.update(plan, fabricate(scheduler, plan, token))
    return plan, events


def run_until_idle(scheduler: Scheduler, max_steps: int = 500, *, start_s: float | None = None,
                   token: Callable[[str], int] | int = 100) -> tuple[list[StepPlan], list[RequestEvent]]:
    """Step until no request is live; fail if that takes more than `max_steps`."""
    plans, events = [], []
    for i in range(max_steps):
        if not scheduler.has_work():
            return plans, events
        now = None if start_s is None else start_s + i
        plan, new = step(scheduler, now, token)
        plans.append(plan)
        events += new
    raise AssertionError(f"still busy after {max_steps} steps: {list(scheduler.requests.values())}")


def admissions(events: Iterable[RequestEvent]) -> list[str]:
    """Request ids in the order of their admit events."""
    return [e.request_id for e in events if e.transition is RequestEventKind.ADMIT]


def first_admissions(events: Iterable[RequestEvent]) -> list[str]:
    """Request ids in the order they were first admitted."""
    seen: dict[str, None] = {}
    for rid in admissions(events):
        seen.setdefault(rid, None)
    return list(seen)


def completions(events: Iterable[RequestEvent]) -> dict[str, FinishReason]:
    """Finish reason per completed request; fails if one completes twice."""
    out: dict[str, FinishReason] = {}
    for e in events:
        if e.finish_reason is not None:
            assert e.request_id not in out, f"{e.request_id} completed twice"
            out[e.request_id] = e.finish_reason
    return out


class NotAPolicy:
    """Loadable as a user policy ('core_helpers:NotAPolicy') but implements none of
    the SchedulingPolicy methods."""

    def __init__(self, config) -> None:
        self.config = config


def random_request(rng: random.Random, request_id: str, arrival_s: float, *, mixed: bool = True):
    """A request of 4-30 prompt tokens and 2-30 output tokens; with `mixed`, of a
    random priority (0-2) and tenant ("a" or "b")."""
    extra = dict(priority=rng.randint(0, 2), tenant=rng.choice("ab")) if mixed else {}
    return make_request(request_id, rng.randint(4, 30), max_tokens=rng.randint(2, 30),
                        arrival_s=arrival_s, **extra)


def arrive(scheduler: Scheduler, rng: random.Random, arrivals: list[int], now: int, total: int,
           *, mixed: bool = True) -> None:
    """Add the requests of `arrivals` (sorted arrival steps, popped as they come; `total`
    at first) due by `now`, as random_request "r<i>"."""
    while arrivals and arrivals[0] <= now:
        i = total - len(arrivals)
        scheduler.add_request(random_request(rng, f"r{i}", float(arrivals.pop(0)), mixed=mixed))


def random_arrival_plans(seed: int, policy: str = "fcfs", *, mixed: bool = True, **config) -> list[tuple]:
    """Each plan's decisions (tokens scheduled, preempted ids) over 800 steps of 24
    random requests arriving in the first 120, on a scheduler of 40 blocks of 4,
    6 seats and 32 tokens a step (and `config`), which must finish them all."""
    rng = random.Random(seed)
    s = make_scheduler(policy, **{"num_blocks": 40, "block_size": 4, "max_num_seqs": 6,
                                  "max_num_batched_tokens": 32, **config})
    arrivals = sorted(rng.randint(0, 120) for _ in range(24))
    out = []
    for t in range(800):
        arrive(s, rng, arrivals, t, 24, mixed=mixed)
        plan, _ = step(s, float(t))
        out.append((dict(plan.num_scheduled_tokens), list(plan.preempted_ids)))
    assert not s.has_work() and not arrivals
    return out


def drive(s, arrivals: dict[int, list], eos_after: dict[str, int], steps: int) -> list[tuple]:
    """Run `steps` steps adding `arrivals[step]`; a request samples EOS once it
    has `eos_after[rid]` tokens (else a filler). Returns each plan's decisions."""
    return [drive_step(s, arrivals, eos_after, t) for t in range(steps)]


def drive_step(s, arrivals: dict[int, list], eos_after: dict[str, int], t: int) -> tuple:
    """One step of `drive` at time `t`: its plan's decisions."""
    for r in arrivals.get(t, []):
        s.add_request(r)
    plan = s.schedule(float(t))
    sampled = {}
    for rid in sampling_ids(s, plan):
        r = s.requests[rid]
        sampled[rid] = [EOS if len(r.output_token_ids) + 1 >= eos_after.get(rid, 10**9) else 100]
    s.update(plan, StepResult(plan.step_id, sampled))
    return (dict(plan.num_scheduled_tokens), [d.request_id for d in plan.new_requests],
            list(plan.preempted_ids))
