"""Poison requests: a fault that follows one request fails that request alone.

With the simulated executor (virtual time): a failure the executor names costs
no restart; an anonymous crash or hang is bisected until the culprit fails
alone; the others keep every token; such failures do not use up max_restarts.
"""

from __future__ import annotations

import pytest

from cadence.actors import ExecutorError, PoisonRequestError, SamplingParams, open_engine
from cadence.actors.simulated import Fault, FaultPlan, Poison
from engine_helpers import config, gather_outcomes, text_executor

MAX_TOKENS = 6


def prompt(rid: str, shared: bool) -> str:
    """Prompts of one length; shared ones begin with the same two blocks."""
    return f"prompt {rid}" if shared else f"{rid} prompt"


async def run_all(engine, request_ids: list[str], stagger_s: float = 0.0,
                  shared: bool = False) -> dict[str, object]:
    """Each request's tokens, or the exception it ended with. The first step takes
    every request that arrived with the first unless `shared` makes them wait for its prefix."""
    params = SamplingParams(max_tokens=MAX_TOKENS)
    return await gather_outcomes(engine, {rid: prompt(rid, shared) for rid in request_ids},
                                 dict.fromkeys(request_ids, params),
                                 delays={rid: i * stagger_s for i, rid in enumerate(request_ids)})


def expected(executor, rid: str) -> list[int]:
    prompt_len = len(prompt(rid, False))
    return [executor.expected_token(rid, prompt_len + k) for k in range(MAX_TOKENS)]


def check_innocents(executor, outcomes: dict[str, object], culprits: set[str]) -> None:
    for rid, outcome in outcomes.items():
        if rid in culprits:
            assert isinstance(outcome, PoisonRequestError), f"{rid}: {outcome!r}"
            assert repr(rid) in str(outcome)
        else:
            assert outcome == expected(executor, rid), f"{rid}: {outcome!r}"


async def test_a_failure_the_executor_names_fails_that_request_alone_without_a_restart(autojump_clock):
    executor = text_executor(faults=FaultPlan(poison={"r2": Poison.REPORTED}))
    async with open_engine(config(executor, max_restarts=0)) as engine:
        outcomes = await run_all(engine, [f"r{i}" for i in range(5)])
        scheduler = engine.scheduler
        assert (scheduler.num_failures, scheduler.num_restarts) == (0, 0) and not engine.closed
        stats = engine.stats()
        assert stats.num_poisoned_requests == 1 and stats.num_executor_failures == 0
        assert not engine.core.requests and engine.core.blocks.num_used_blocks == 0
    check_innocents(executor, outcomes, {"r2"})
    assert "simulated sampling error" in str(outcomes["r2"])


async def test_an_anonymous_crash_is_bisected_to_its_culprit(autojump_clock):
    """Eight requests share the batch; each crash halves the suspects until one fails alone."""
    executor = text_executor(faults=FaultPlan(poison={"r5": Poison.CRASH}))
    cfg = config(executor, max_num_seqs=8, max_restarts=1, restart_backoff_s=0.01)
    async with open_engine(cfg) as engine:
        outcomes = await run_all(engine, [f"r{i}" for i in range(8)])
        scheduler = engine.scheduler
        assert not engine.closed
        # At most: the whole batch, three halvings (8 -> 4 -> 2 -> 1), the confirmation alone.
        assert 2 <= scheduler.num_failures == scheduler.num_restarts <= 5
        assert engine.stats().num_executor_failures == scheduler.num_failures
        assert not engine.core.requests and engine.core.blocks.num_used_blocks == 0
    check_innocents(executor, outcomes, {"r5"})
    lost = {r["request_id"] for r in engine.trace.records if r["event"] == "executor_lost"}
    assert len(lost - {"r5"}) >= 3, "others were in the failed steps, and kept their tokens"


async def test_a_culprit_first_in_line_does_not_hold_back_those_sharing_its_prefix(autojump_clock):
    """r5 comes first and alone; the rest share its prompt's first blocks. Once its step
    has died, the rest are admitted beside it rather than waiting for its prefix, so the
    executor is seen to work without r5 and r5 is convicted."""
    executor = text_executor(faults=FaultPlan(poison={"r5": Poison.CRASH}))
    cfg = config(executor, max_num_seqs=8, max_restarts=1, restart_backoff_s=0.01)
    async with open_engine(cfg) as engine:
        order = ["r5"] + [f"r{i}" for i in range(8) if i != 5]
        outcomes = await run_all(engine, order, stagger_s=0.001, shared=True)
        assert not engine.closed and engine.scheduler.num_poisoned == 1
    check_innocents(executor, outcomes, {"r5"})


async def test_a_hang_that_follows_a_request_is_isolated_too(autojump_clock):
    executor = text_executor(faults=FaultPlan(poison={"r1": Poison.HANG}))
    cfg = config(executor, step_timeout_s=0.5, max_restarts=1, restart_backoff_s=0.01)
    async with open_engine(cfg) as engine:
        outcomes = await run_all(engine, ["r0", "r1", "r2"], stagger_s=0.003)
        assert not engine.closed and "timed out" in engine.scheduler.last_failure
    check_innocents(executor, outcomes, {"r1"})


async def test_poison_faults_do_not_use_up_max_restarts(autojump_clock):
    """Three poisons in a row with max_restarts=1: the engine survives them, and still
    has its one restart for a real executor fault afterwards."""
    poison = {f"p{i}": Poison.CRASH for i in range(3)}
    executor = text_executor(faults=FaultPlan(poison=poison))
    cfg = config(executor, max_restarts=1, restart_window_s=1000.0, restart_backoff_s=0.01)
    async with open_engine(cfg) as engine:
        for i in range(3):
            outcomes = await run_all(engine, [f"a{i}", f"p{i}", f"b{i}"])
            check_innocents(executor, outcomes, {f"p{i}"})
            assert not engine.closed
        executor.faults = FaultPlan(at={executor.num_calls: Fault.CRASH}, poison=poison)
        outcomes = await run_all(engine, ["c0", "c1"])
        check_innocents(executor, outcomes, set())
        assert not engine.closed
        assert engine.stats().num_poisoned_requests == 3
        # One more real fault is one too many: the budget was intact, and is now used.
        executor.faults = FaultPlan(at={executor.num_calls: Fault.CRASH,
                                        executor.num_calls + 1: Fault.CRASH})
        outcomes = await run_all(engine, ["d0"])
        assert engine.closed and isinstance(outcomes["d0"], ExecutorError)
        assert not isinstance(outcomes["d0"], PoisonRequestError)


async def test_two_poisons_among_many_each_fail_alone(autojump_clock):
    executor = text_executor(faults=FaultPlan(poison={"r1": Poison.CRASH, "r6": Poison.CRASH}))
    cfg = config(executor, max_num_seqs=8, max_restarts=1, restart_backoff_s=0.01)
    async with open_engine(cfg) as engine:
        outcomes = await run_all(engine, [f"r{i}" for i in range(8)])
        assert not engine.closed
    check_innocents(executor, outcomes, {"r1", "r6"})


async def test_a_transient_fault_in_a_suspect_group_blames_nobody(autojump_clock):
    """One crash with four requests in the batch: the halves run apart once, nobody fails."""
    executor = text_executor(faults=FaultPlan(at={2: Fault.CRASH}))
    async with open_engine(config(executor, max_restarts=1, restart_backoff_s=0.01)) as engine:
        outcomes = await run_all(engine, [f"r{i}" for i in range(4)])
        scheduler = engine.scheduler
        assert scheduler.num_failures == 1 and scheduler.num_poisoned == 0
        assert not scheduler.isolation.groups, "every suspect was cleared once it produced a token"
    check_innocents(executor, outcomes, set())


STREAM_TOKENS = 80


@pytest.mark.parametrize("apart_s", [1.0, 3.0, 6.0])
async def test_two_poisons_arriving_seconds_apart_do_not_close_the_engine(autojump_clock, apart_s):
    """Eight innocent streams, a poison, and another poison seconds later, while the
    first is still being isolated: with one restart to spare, each isolation's
    failure is its own and is refunded when its culprit is found."""
    executor = text_executor(faults=FaultPlan(poison={"p0": Poison.CRASH, "p1": Poison.CRASH}))
    cfg = config(executor, max_num_seqs=10, max_restarts=1, restart_window_s=1e6,
                 schedule_interval_us=100_000)
    innocents = [f"r{i}" for i in range(8)]
    params = {rid: SamplingParams(max_tokens=STREAM_TOKENS) for rid in innocents}
    params |= {p: SamplingParams(max_tokens=MAX_TOKENS) for p in ("p0", "p1")}
    async with open_engine(cfg) as engine:
        outcomes = await gather_outcomes(engine, {rid: prompt(rid, False) for rid in [*innocents, "p0", "p1"]},
                                         params, delays={"p0": 0.5, "p1": 0.5 + apart_s})
        assert not engine.closed, engine.scheduler.closed_reason
        assert engine.stats().num_poisoned_requests == 2
        assert engine.scheduler.isolation.num_charged == 0, "both culprits found: nothing counts"
    for p in ("p0", "p1"):
        assert isinstance(outcomes[p], PoisonRequestError) and repr(p) in str(outcomes[p])
    for rid in innocents:
        prompt_len = len(prompt(rid, False))
        assert outcomes[rid] == [executor.expected_token(rid, prompt_len + k) for k in range(STREAM_TOKENS)]


async def test_a_lone_poison_costs_no_more_failures_in_a_row_than_its_isolation_allows(autojump_clock):
    """A poison with nothing else running fails the batch, then twice alone: the third
    failure in a row is the last that may go uncounted, so at the default
    max_restarts one more counted failure there would close the engine by the
    third such poison. Each is refunded once the next request runs, so a fourth
    does not close it either."""
    poisons = {f"p{i}": Poison.CRASH for i in range(4)}
    executor = text_executor(faults=FaultPlan(poison=poisons))
    # A window no restart leaves: the simulated executor's starts take virtual minutes.
    async with open_engine(config(executor, restart_backoff_s=0.01, restart_window_s=1e6)) as engine:
        assert engine.scheduler.isolation.max_restarts == 3  # the default
        for i in range(4):
            outcomes = await run_all(engine, [f"p{i}"])
            error = outcomes[f"p{i}"]
            # Nothing else ran while it was isolated: no verdict, the executor may be at fault.
            assert isinstance(error, ExecutorError) and not isinstance(error, PoisonRequestError)
            assert "makes the executor fail" in str(error) and "2 times alone" in str(error)
            assert engine.scheduler.num_failures == 3 * (i + 1), "the batch, then twice alone"
            assert not engine.closed, engine.scheduler.closed_reason
            outcomes = await run_all(engine, [f"a{i}"])
            check_innocents(executor, outcomes, set())
            assert engine.scheduler.isolation.num_charged == 0
