"""Deterministic simulation of the whole engine: one seed, one run, one trace.

Everything runs in one `trio.run` with `MockClock(autojump_threshold=0)`:
client arrivals, consumer cancellations, abort bursts, the simulated
executor's latency and its injected faults. Every random choice comes from
the scenario's seed, and Trio's own scheduling order is pinned by seeding its
scheduler RNG and turning on its deterministic batch order, so one seed always
replays the same event trace. Trio offers no public way to seed its scheduler;
it exposes the RNG (`trio._core._run._r`) and the switch for Hypothesis's
plugin, and every Trio from 0.22 to 0.35 has both. A Trio without them still
runs every simulation and checks every property, but only the replay tests
(`SCHEDULER_SEEDABLE`) can tell one seed from one trace, and they skip there.

The oracle:
- the core runs with `debug_checks=True`, so DESIGN §4's invariants are
  checked after every core call, and each request actor drives its own FSM,
  so an illegal event sequence raises and fails the run;
- the simulated executor's tokens are a pure function of (seed, request id,
  position), so every request's expected output is known: a request nobody
  interfered with must produce exactly that output with the right finish
  reason, and an interfered one a prefix of it;
- the trace must replay through the request FSM table, with exactly one
  completing record per accepted request, and no record for refused ones,
  and pass the reference spec's trace validation (`cadence.spec.trace`);
- at the end no request is live and every KV block is free;
- liveness: after the last injected fault, every request still live must
  finish within `liveness_bound_s` (see there for why it holds).
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from typing import Any

import attrs
import trio
import trio.testing

from cadence.actors import (
    CacheConfig, EngineClosedError, EngineConfig, ExecutorError, QueueFullError,
    RequestTooLongError, SamplingParams, SchedulerConfig, open_engine,
)
from cadence.actors.simulated import Fault, FaultPlan, LatencyModel, SimulatedExecutor
from cadence.spec.trace import validate_trace
from cadence.statemachine.errors import RequestNotFoundError
from cadence.statemachine.fsm import FinishReason, RequestEventKind, RequestFSM, RequestState

VOCAB_SIZE = 1000
EOS = VOCAB_SIZE - 1
LATENCY = LatencyModel(base_us=1000.0, prefill_us_per_token=10.0, decode_us_per_seq=50.0)
STEP_TIMEOUT_S = 0.25
# Restart pauses on the simulation's time scale (a step takes about a millisecond).
RESTART_BACKOFF_S = 0.002
RESTART_BACKOFF_MAX_S = 0.05
# How the error of a request failed alone as a poison begins, and what the error
# of one isolated while nothing else ran (no verdict on the request) says.
POISON_ERROR = "PoisonRequestError: "
ISOLATED = "makes the executor fail"
# Slack for comparing virtual times summed in different orders.
TIME_EPSILON_S = 1e-9
POLICIES = ("fcfs", "priority", "fair", "deadline")
QUEUE_LIMITS = (4, 1000)
# How much longer than the serial work bound a healed engine may take (see liveness_bound_s).
LIVENESS_FACTOR = 2.0

_TRACE_EVENTS = {
    "admit": RequestEventKind.ADMIT, "preempt": RequestEventKind.PREEMPT,
    "finish": RequestEventKind.FINISH, "abort": RequestEventKind.ABORT,
    "reject": RequestEventKind.REJECT, "fail": RequestEventKind.FAIL,
    "executor_lost": RequestEventKind.EXECUTOR_LOST,
}


@attrs.frozen
class ClientPlan:
    """One client: when it submits what, and how it may walk away."""

    request_id: str
    arrival_s: float
    prompt: tuple[int, ...]
    max_tokens: int
    min_tokens: int = 0
    priority: int = 0
    tenant: str = "default"
    deadline_s: float | None = None
    timeout_s: float | None = None
    break_after: int | None = None  # leave the loop after this many deltas
    cancel_after_s: float | None = None  # cancel the consuming scope after this long


@attrs.frozen
class Scenario:
    """A whole simulation, fully determined by its fields."""

    seed: int
    clients: tuple[ClientPlan, ...]
    abort_bursts: tuple[tuple[float, tuple[str, ...]], ...] = ()
    faults: FaultPlan = FaultPlan()
    num_fault_calls: int = 0  # faults strike only execute calls below this number
    policy: str = "fcfs"
    num_blocks: int = 64
    block_size: int = 4
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 32
    max_model_len: int = 96
    max_waiting: int = 1000
    eos_probability: float = 0.05
    max_restarts: int = 10_000
    enable_prefix_caching: bool = True
    reject_late: bool = False

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, max_waiting=self.max_waiting, policy=self.policy,
            aging_steps=16, default_deadline_s=0.5, reject_late=self.reject_late, debug_checks=True)


@attrs.define
class ClientOutcome:
    """What one client saw."""

    plan: ClientPlan
    tokens: list[int] = attrs.Factory(list)
    num_finals: int = 0
    finish_reason: str | None = None
    detail: str = ""
    refused: str | None = None
    error: str | None = None
    walked_away: bool = False
    walked_away_s: float | None = None
    submitted_s: float | None = None


class RecordingExecutor(SimulatedExecutor):
    """A SimulatedExecutor that notes when each execute call began."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.call_times: list[float] = []

    async def execute(self, step):
        self.call_times.append(trio.current_time())
        return await super().execute(step)


@attrs.define
class Report:
    """Everything a simulation run produced."""

    scenario: Scenario
    start_s: float
    outcomes: dict[str, ClientOutcome]
    trace: list[dict]
    executor: RecordingExecutor
    num_live_at_end: int
    num_used_blocks_at_end: int
    stats: Any
    num_restarts: int
    num_planned_ahead: int
    closed_reason: str | None


# ---- scenarios ----------------------------------------------------------------
def random_scenario(seed: int) -> Scenario:
    """A scenario drawn from `seed` alone: arrivals, shapes, walk-aways, faults."""
    rng = random.Random(seed)
    block_size = rng.choice((2, 4, 8))
    max_model_len = 96
    num_blocks = rng.randint(max_model_len // block_size + 1, 3 * max_model_len // block_size)
    prefixes = [tuple(rng.randrange(EOS) for _ in range(rng.randint(4, 24))) for _ in range(3)]
    clients = []
    t = 0.0
    for i in range(rng.randint(8, 28)):
        t += rng.expovariate(1 / 0.004)
        clients.append(_random_client(rng, f"r{i}", t, prefixes, max_model_len))
    ids = [c.request_id for c in clients]
    bursts = tuple(
        (rng.uniform(0, t + 0.05), tuple(rng.sample(ids, rng.randint(1, 4))))
        for _ in range(rng.randint(0, 2)))
    num_fault_calls = rng.choice((0, 20, 60, 120))
    faults = FaultPlan(
        probabilities={Fault.CRASH: 0.03, Fault.HANG: 0.02, Fault.SLOW: 0.05,
                       Fault.DUPLICATE: 0.02, Fault.STALE: 0.02} if num_fault_calls else {},
        seed=seed, slow_factor=rng.choice((2.0, 10.0, 100.0)))
    return Scenario(
        seed=seed, clients=tuple(clients), abort_bursts=bursts, faults=faults,
        num_fault_calls=num_fault_calls, policy=rng.choice(POLICIES), num_blocks=num_blocks,
        block_size=block_size, max_num_seqs=rng.choice((2, 4, 8)),
        max_num_batched_tokens=rng.choice((8, 16, 32, 96)), max_model_len=max_model_len,
        max_waiting=rng.choice(QUEUE_LIMITS), eos_probability=rng.choice((0.0, 0.05, 0.2)),
        enable_prefix_caching=rng.random() < 0.8, reject_late=rng.random() < 0.5)


def _random_client(rng: random.Random, rid: str, arrival_s: float, prefixes, max_model_len) -> ClientPlan:
    prefix = rng.choice(prefixes) if rng.random() < 0.5 else ()
    prompt = prefix + tuple(rng.randrange(EOS) for _ in range(rng.randint(1, 40)))
    max_tokens = rng.randint(1, 24)
    if rng.random() < 0.05:
        max_tokens = max_model_len  # refused as too long
    walk = rng.random()
    return ClientPlan(
        request_id=rid, arrival_s=arrival_s, prompt=prompt, max_tokens=max_tokens,
        min_tokens=rng.choice((0, 0, 1, 3)) if max_tokens >= 3 else 0,
        priority=rng.randint(0, 2), tenant=rng.choice(("a", "b", "c")),
        deadline_s=rng.choice((None, 0.05, 0.2)),
        timeout_s=rng.uniform(0.001, 0.1) if walk < 0.08 else None,
        break_after=rng.randint(1, 6) if 0.08 <= walk < 0.16 else None,
        cancel_after_s=rng.uniform(0.0, 0.05) if 0.16 <= walk < 0.24 else None)


# ---- running one scenario -----------------------------------------------------
def _scheduler_module():
    """Trio's run module if it has the seedable scheduler RNG and the deterministic-order
    switch this harness sets, else None."""
    run_module = getattr(getattr(trio, "_core", None), "_run", None)
    if isinstance(getattr(run_module, "_r", None), random.Random) \
            and isinstance(getattr(run_module, "_ALLOW_DETERMINISTIC_SCHEDULING", None), bool):
        return run_module
    return None


SCHEDULER_SEEDABLE = _scheduler_module() is not None
NOT_SEEDABLE_REASON = (f"trio {trio.__version__} has no seedable scheduler RNG "
                       "(trio._core._run._r); task order, hence the trace, is not replayable")


def run_seeded(async_fn, *args, seed: int):
    """Run `async_fn(*args)` under a MockClock with Trio's scheduling order pinned by `seed`
    (where this Trio allows it: `SCHEDULER_SEEDABLE`)."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    run_module = _scheduler_module()
    if run_module is None:
        return trio.run(async_fn, *args, clock=clock)
    saved_state = run_module._r.getstate()
    saved_flag = run_module._ALLOW_DETERMINISTIC_SCHEDULING
    run_module._r.seed(seed)
    run_module._ALLOW_DETERMINISTIC_SCHEDULING = True
    try:
        return trio.run(async_fn, *args, clock=clock)
    finally:
        run_module._r.setstate(saved_state)
        run_module._ALLOW_DETERMINISTIC_SCHEDULING = saved_flag


def run_scenario(scenario: Scenario) -> Report:
    """Simulate `scenario` deterministically and return what happened."""
    return run_seeded(simulate, scenario, seed=scenario.seed)


def make_executor(scenario: Scenario) -> RecordingExecutor:
    faults = attrs.evolve(scenario.faults, heal_after=scenario.num_fault_calls)
    return RecordingExecutor(LATENCY, vocab_size=VOCAB_SIZE, eos_token_id=EOS,
                             eos_probability=scenario.eos_probability, seed=scenario.seed,
                             faults=faults)


async def simulate(scenario: Scenario) -> Report:
    """Run the engine against the scenario's clients (call inside a Trio run)."""
    executor = make_executor(scenario)
    config = EngineConfig(
        scheduler=scenario.scheduler_config(),
        cache=CacheConfig(num_blocks=scenario.num_blocks, block_size=scenario.block_size,
                          enable_prefix_caching=scenario.enable_prefix_caching),
        executor=executor, record_trace=True, step_timeout_s=STEP_TIMEOUT_S,
        max_restarts=scenario.max_restarts, restart_window_s=1.0, seed=scenario.seed,
        restart_backoff_s=RESTART_BACKOFF_S, restart_backoff_max_s=RESTART_BACKOFF_MAX_S)
    start = trio.current_time()
    outcomes = {c.request_id: ClientOutcome(c) for c in scenario.clients}
    async with open_engine(config) as engine:
        with trio.fail_after(hard_limit_s(scenario)):
            async with trio.open_nursery() as nursery:
                for plan in scenario.clients:
                    nursery.start_soon(_client, engine, plan, outcomes[plan.request_id], start)
                for at_s, ids in scenario.abort_bursts:
                    nursery.start_soon(_abort_burst, engine, start + at_s, ids)
            await engine.wait_idle()
        core = engine.core
        report = Report(
            scenario=scenario, start_s=start, outcomes=outcomes,
            trace=list(engine.trace.records), executor=executor,
            num_live_at_end=len(core.requests), num_used_blocks_at_end=core.blocks.num_used_blocks,
            stats=engine.stats(), num_restarts=engine.scheduler.num_restarts,
            num_planned_ahead=engine.scheduler.num_planned_ahead,
            closed_reason=engine.scheduler.closed_reason)
    return report


async def _client(engine, plan: ClientPlan, out: ClientOutcome, start: float) -> None:
    await trio.sleep_until(start + plan.arrival_s)
    out.submitted_s = trio.current_time()
    params = SamplingParams(max_tokens=plan.max_tokens, min_tokens=plan.min_tokens)
    cancel_after = plan.cancel_after_s if plan.cancel_after_s is not None else math.inf
    try:
        with trio.move_on_after(cancel_after) as scope:
            num_deltas = 0
            # No name holds the stream: leaving the loop drops it, which aborts the request.
            async for delta in engine.generate(
                    list(plan.prompt), params, request_id=plan.request_id, priority=plan.priority,
                    tenant=plan.tenant, deadline_s=plan.deadline_s, timeout_s=plan.timeout_s):
                out.tokens.extend(delta.token_ids)
                num_deltas += 1
                if delta.finish_reason is not None:
                    out.num_finals += 1
                    out.finish_reason, out.detail = delta.finish_reason, delta.detail
                elif plan.break_after is not None and num_deltas >= plan.break_after:
                    out.walked_away, out.walked_away_s = True, trio.current_time()
                    break
        if scope.cancelled_caught:
            out.walked_away, out.walked_away_s = True, trio.current_time()
    except (RequestTooLongError, QueueFullError) as exc:
        out.refused = type(exc).__name__
    except (ExecutorError, EngineClosedError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"


async def _abort_burst(engine, at_s: float, request_ids: tuple[str, ...]) -> None:
    await trio.sleep_until(at_s)
    for rid in request_ids:
        try:
            await engine.abort(rid, "abort burst")
        except RequestNotFoundError:
            pass


# ---- the oracle ---------------------------------------------------------------
def expected_output(scenario: Scenario, executor: SimulatedExecutor, plan: ClientPlan) -> tuple[list[int], str]:
    """The tokens and finish reason of `plan` if nobody interferes."""
    tokens: list[int] = []
    position = len(plan.prompt)
    for _ in range(plan.max_tokens):
        token = executor.expected_token(plan.request_id, position)
        tokens.append(token)
        position += 1
        if token == EOS and len(tokens) >= plan.min_tokens:
            return tokens, "stop"
        if position >= scenario.max_model_len:
            break
    return tokens, "length"


def serial_steps(scenario: Scenario, plan: ClientPlan) -> int:
    """Steps to serve `plan` alone: its prefill in budget-sized chunks, then one per token."""
    return math.ceil(len(plan.prompt) / scenario.max_num_batched_tokens) + plan.max_tokens


def liveness_bound_s(scenario: Scenario, live: list[ClientPlan]) -> float:
    """How long a healed engine may take to finish the `live` requests.

    Serving them one after another takes sum(serial_steps) steps, each at most
    one full-budget step long. Continuous batching does no worse than serial
    service except for recomputation after preemption (a preempted request
    recomputes at most its prompt plus output, at most one more serial run
    of itself), hence the factor LIVENESS_FACTOR, plus one step timeout for a
    hang in flight when the faults stop.
    """
    step_s = LATENCY.step_us(scenario.max_num_batched_tokens, scenario.max_num_seqs) / 1e6
    work = sum(serial_steps(scenario, plan) for plan in live)
    return LIVENESS_FACTOR * work * step_s + STEP_TIMEOUT_S + step_s


def hard_limit_s(scenario: Scenario) -> float:
    """A virtual-time cap on the whole run, so a livelock fails instead of spinning."""
    last = max((c.arrival_s for c in scenario.clients), default=0.0)
    fault_phase = scenario.num_fault_calls * (STEP_TIMEOUT_S + 0.1)
    return last + fault_phase + 10 * liveness_bound_s(scenario, list(scenario.clients)) + 10.0


def check_report(report: Report) -> None:
    """Assert every property of a finished simulation (see the module docstring)."""
    scenario, executor = report.scenario, report.executor
    assert report.num_live_at_end == 0, "requests still live after the run"
    assert report.num_used_blocks_at_end == 0, f"{report.num_used_blocks_at_end} blocks still in use"
    by_request = _replay_trace(report.trace)
    validate_trace(report.trace, max_model_len=scenario.max_model_len,
                   max_num_seqs=scenario.max_num_seqs, stop_token_ids=[EOS], require_complete=True)
    gave_up = report.closed_reason is not None
    # Random executor faults that strike one request's calls alone, again and again,
    # look like a fault that follows it: isolation may then fail it alone.
    faulty = bool(scenario.faults.at or scenario.faults.probabilities or scenario.faults.poison)
    for rid, out in report.outcomes.items():
        plan = out.plan
        records = by_request.pop(rid, None)
        if out.refused is not None:
            assert records is None, f"{rid}: refused ({out.refused}) yet traced"
            if out.refused == "RequestTooLongError":
                assert len(plan.prompt) + plan.max_tokens > scenario.max_model_len
            continue
        if records is None:
            assert out.walked_away or gave_up, f"{rid}: never added, never refused"
            continue
        final = records[-1]
        traced_tokens = [t for r in records if r["event"] == "tokens" for t in r["tokens"]]
        expected, reason = expected_output(scenario, executor, plan)
        assert traced_tokens == expected[:len(traced_tokens)], (
            f"{rid}: traced tokens {traced_tokens} are not a prefix of {expected}")
        assert out.tokens == traced_tokens[:len(out.tokens)], (
            f"{rid}: client saw {out.tokens}, trace has {traced_tokens}")
        assert out.num_finals <= 1, f"{rid}: {out.num_finals} final deltas"
        interfered = (out.walked_away or plan.timeout_s is not None or gave_up
                      or any(rid in ids for _, ids in scenario.abort_bursts))
        if final["event"] in ("finish",):
            assert final["reason"] == reason and traced_tokens == expected, (
                f"{rid}: finished {final['reason']} with {traced_tokens}, expected {reason} {expected}")
        elif final["event"] == "reject":
            assert scenario.policy == "deadline", f"{rid}: rejected under {scenario.policy}"
        elif final["event"] == "fail":
            assert gave_up or (isolated(out) and faulty), f"{rid}: failed but the engine did not give up"
        else:
            assert final["event"] == "abort", f"{rid}: ended with {final}"
            assert interfered, f"{rid}: aborted though nobody asked"
        # Walking away and timing out abort at once: no virtual time passes before
        # the core completes the request.
        if out.walked_away_s is not None:
            assert final["t"] <= out.walked_away_s, f"{rid}: completed {final['t'] - out.walked_away_s}s after its consumer left"
        if plan.timeout_s is not None:
            assert final["t"] <= out.submitted_s + plan.timeout_s + TIME_EPSILON_S, f"{rid}: outlived its timeout"
        if not out.walked_away and out.error is None:
            assert out.num_finals == 1, f"{rid}: the consumer saw no final delta"
            if final["event"] == "finish" and out.detail != "timeout":
                assert out.tokens == expected and out.finish_reason == reason, (
                    f"{rid}: consumer saw {out.tokens} {out.finish_reason}, expected {expected} {reason}")
        if gave_up and final["event"] == "fail":
            assert out.error is not None or out.walked_away, f"{rid}: failed silently"
    assert not by_request, f"traced requests no client submitted: {sorted(by_request)}"
    if not gave_up:
        check_liveness(report)


def isolated(out: ClientOutcome) -> bool:
    """Whether the engine failed this request alone, as the cause of executor failures."""
    return out.error is not None and (out.error.startswith(POISON_ERROR) or ISOLATED in out.error)


def _replay_trace(trace: list[dict]) -> dict[str, list[dict]]:
    """Check the trace against the FSM table; return each request's records."""
    by_request: dict[str, list[dict]] = defaultdict(list)
    machines: dict[str, RequestFSM] = {}
    for index, rec in enumerate(trace):
        assert rec["seq"] == index
        rid, event = rec["request_id"], rec["event"]
        if event == "add":
            assert rid not in machines, f"{rid} added twice"
            machines[rid] = RequestFSM(rid)
        else:
            fsm = machines[rid]
            if event == "tokens":
                assert fsm.state is RequestState.RUNNING, f"{rid}: tokens while {fsm.state}"
                assert rec["tokens"], f"{rid}: empty tokens record"
            else:
                reason = FinishReason(rec["reason"]) if rec["reason"] is not None else None
                fsm.fire(_TRACE_EVENTS[event], reason)
        by_request[rid].append(rec)
    for rid, fsm in machines.items():
        assert fsm.finished, f"{rid} never completed"
        completing = [r for r in by_request[rid] if r["reason"] is not None]
        assert len(completing) == 1, f"{rid}: {len(completing)} completing records"
        assert by_request[rid][-1] is completing[0]
    return dict(by_request)


def heal_time(report: Report) -> float:
    """When the first execute call that no fault can strike began (the start if none),
    or when the last poison request completed, if that is later."""
    limit = report.scenario.num_fault_calls
    times = report.executor.call_times
    healed = report.start_s if limit == 0 else times[limit] if len(times) > limit else math.inf
    poison = report.scenario.faults.poison
    for rec in report.trace:
        if rec["request_id"] in poison and rec["reason"] is not None:
            healed = max(healed, rec["t"])
    return healed


def check_liveness(report: Report) -> None:
    """Every request live after the heal finished within the liveness bound."""
    healed = heal_time(report)
    if healed == math.inf:
        return  # the run ended before the faults did
    completed_at: dict[str, float] = {}
    added_at: dict[str, float] = {}
    for rec in report.trace:
        if rec["event"] == "add":
            added_at[rec["request_id"]] = rec["t"]
        elif rec["reason"] is not None:
            completed_at[rec["request_id"]] = rec["t"]
    live = [report.outcomes[rid].plan for rid, done in completed_at.items() if done > healed]
    if not live:
        return
    # Each request from its own start: whatever delays it is work in `live` too.
    bound = liveness_bound_s(report.scenario, live)
    for plan in live:
        rid = plan.request_id
        begin = max(healed, added_at[rid])
        took = completed_at[rid] - begin
        assert took <= bound, (
            f"{rid}: healed at {healed - report.start_s:.4f}s, finished {took:.4f}s after "
            f"{'the heal' if begin == healed else 'its arrival'} > bound {bound:.4f}s "
            f"for {len(live)} live requests")


def trace_fingerprint(report: Report) -> list[tuple]:
    """The trace relative to the run's start, for comparing runs."""
    return [(r["seq"], round(r["t"] - report.start_s, 9), r["step"], r["request_id"], r["event"],
             r["reason"], tuple(r.get("tokens", ()))) for r in report.trace]
