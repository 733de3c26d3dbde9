"""Faults of a real executor child process: a stopped child, requests the child
cannot take, a fault that follows a request, and running out of file descriptors.

The child runs the simulated model (`DeterministicRunner`), whose options make
it refuse or crash on a marker token, so each test knows which request is the
poison and what every other request must produce.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import sys

import attrs

import pytest
import trio

from cadence.actors import (
    CacheConfig, EngineConfig, PoisonRequestError, SamplingParams, SchedulerConfig,
    open_engine,
)
from cadence.actors.executor_worker import deterministic_token
from cadence.actors.executors import ChildProcessExecutor
from engine_helpers import gather_outcomes, watch_health

# A guard against a hang, far above what each test needs; never a measure of speed.
GUARD_S = 60.0
MAX_TOKENS = 4
MARKER = 7
# Descriptors fewer than are open that the starved process may hold (see the last test).
FD_MARGIN = 3


def process_config(max_num_batched_tokens: int = 256, **kwargs) -> EngineConfig:
    options = kwargs.pop("executor_options", {})
    kwargs.setdefault("restart_backoff_s", 0.01)
    return EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=128),
        cache=CacheConfig(num_blocks=64, block_size=4), executor="process", model="simulated",
        executor_options=options, record_trace=True, **kwargs)


def prompt(rid: str) -> list[int]:
    return [100 + ord(c) for c in rid]


def expected(rid: str, prompt_ids: list[int]) -> list[int]:
    return [deterministic_token(rid, len(prompt_ids) + k) for k in range(MAX_TOKENS)]


async def run_all(engine, prompts: dict[str, list[int]], params=None, on_token=None) -> dict[str, object]:
    params = {rid: SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0) for rid in prompts} | (params or {})
    return await gather_outcomes(engine, prompts, params, on_token=on_token)


async def test_a_stopped_child_is_caught_by_its_heartbeat_long_before_the_step_timeout():
    """SIGSTOP freezes the child mid-generation; its heartbeats stop, the engine kills
    and restarts it within the heartbeat timeout, and the request loses no token."""
    cfg = process_config(heartbeat_timeout_s=1.0, step_timeout_s=3600.0,
                         executor_options={"step_delay_s": 0.02})
    stopped: list[int] = []
    with trio.fail_after(GUARD_S):
        async with open_engine(cfg) as engine:
            backend = engine.scheduler.backend

            def stop_once(rid: str) -> None:
                if not stopped:
                    stopped.append(backend.pid)
                    os.kill(backend.pid, signal.SIGSTOP)

            prompts = {"r0": prompt("r0")}
            params = {"r0": SamplingParams(max_tokens=12, temperature=0.0)}
            outcomes = await run_all(engine, prompts, params, on_token=stop_once)
            scheduler = engine.scheduler
            assert scheduler.num_failures == 1 and scheduler.num_restarts == 1
            assert "no heartbeat" in scheduler.last_failure
            assert backend.pid != stopped[0]
    assert outcomes["r0"] == [deterministic_token("r0", 2 + k) for k in range(12)]


async def test_a_prompt_the_child_refuses_fails_alone_without_a_restart():
    prompts = {"ok": prompt("ok"), "bad": [1, MARKER, 2], "ok2": prompt("ok2")}
    with trio.fail_after(GUARD_S):
        async with open_engine(process_config(executor_options={"bad_token": MARKER})) as engine:
            outcomes = await run_all(engine, prompts)
            assert engine.scheduler.num_restarts == 0 and not engine.closed
    assert isinstance(outcomes["bad"], PoisonRequestError) and "'bad'" in str(outcomes["bad"])
    for rid in ("ok", "ok2"):
        assert outcomes[rid] == expected(rid, prompts[rid])


async def test_a_refused_prompt_leaves_the_step_planned_ahead_too():
    """Long prompts in small chunks make the scheduler plan step N+1 while N runs;
    when N's answer refuses a request, N+1 goes out without it."""
    prompts = {"long": list(range(10, 40)), "bad": [MARKER, *range(10, 40)]}
    cfg = process_config(max_num_batched_tokens=8, executor_options={"bad_token": MARKER})
    with trio.fail_after(GUARD_S):
        async with open_engine(cfg) as engine:
            outcomes = await run_all(engine, prompts)
            scheduler = engine.scheduler
            assert scheduler.num_planned_ahead > 0
            assert scheduler.num_failures == 0 and not engine.closed
    assert isinstance(outcomes["bad"], PoisonRequestError)
    assert outcomes["long"] == expected("long", prompts["long"])


async def test_sampling_parameters_that_cannot_be_sent_fail_that_request_alone():
    """A seed past 64 bits cannot be encoded for the child: that request fails,
    named, and the step goes out without it. SamplingParams refuses such a seed
    where it is built; it is forced in here to reach this second line of defence."""
    prompts = {"a": prompt("a"), "huge-seed": prompt("huge-seed"), "b": prompt("b")}
    huge = SamplingParams(max_tokens=MAX_TOKENS)
    object.__setattr__(huge, "seed", 2**70)
    params = {"huge-seed": huge}
    with trio.fail_after(GUARD_S):
        async with open_engine(process_config()) as engine:
            outcomes = await run_all(engine, prompts, params)
            assert engine.scheduler.num_failures == 0 and not engine.closed
    error = outcomes["huge-seed"]
    assert isinstance(error, PoisonRequestError) and "cannot be sent" in str(error)
    for rid in ("a", "b"):
        assert outcomes[rid] == expected(rid, prompts[rid])


async def test_a_crash_that_follows_a_request_is_bisected_through_real_restarts():
    prompts = {f"r{i}": prompt(f"r{i}") for i in range(4)}
    prompts["r2"] = [3, MARKER, 3]
    with trio.fail_after(GUARD_S):
        async with open_engine(process_config(max_restarts=1, executor_options={"crash_token": MARKER})) as engine:
            outcomes = await run_all(engine, prompts)
            assert not engine.closed and engine.stats().num_poisoned_requests == 1
    error = outcomes["r2"]
    assert isinstance(error, PoisonRequestError) and "'r2'" in str(error)
    assert "Traceback" not in str(error) and ".py" not in str(error)
    for rid in ("r0", "r1", "r3"):
        assert outcomes[rid] == expected(rid, prompts[rid])


@pytest.fixture
def restore_fd_limit():
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, limits)


async def test_out_of_file_descriptors_the_restarts_back_off_instead_of_burning_out(restore_fd_limit):
    """The child is killed while the process cannot open another file: each restart
    fails, but the pauses between them double, so the engine is still there when
    descriptors are available again, and the request finishes."""
    cfg = process_config(max_restarts=20, restart_backoff_s=0.02, restart_backoff_max_s=1.0,
                         executor_options={"step_delay_s": 0.02})
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with trio.fail_after(GUARD_S):
        async with open_engine(cfg) as engine:
            scheduler = engine.scheduler
            backend = scheduler.backend

            async def starve_then_relieve() -> None:
                while not scheduler.actors:
                    await trio.sleep(0.01)
                # Below what is open now: the killed child's descriptors, once freed, are not enough.
                num_open = len(os.listdir("/proc/self/fd"))
                resource.setrlimit(resource.RLIMIT_NOFILE, (num_open - FD_MARGIN, hard))
                os.kill(backend.pid, signal.SIGKILL)
                while scheduler.num_failures < 5:
                    await trio.sleep(0.01)
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(starve_then_relieve)
                params = {"r0": SamplingParams(max_tokens=30, temperature=0.0)}
                outcomes = await run_all(engine, {"r0": prompt("r0")}, params)
            assert not engine.closed and scheduler.num_restarts == 1
            assert "Too many open files" in scheduler.last_failure
            delays = list(scheduler.supervisor.restart_delays_s)
    assert outcomes["r0"] == [deterministic_token("r0", 2 + k) for k in range(30)]
    assert len(delays) >= 5
    assert all(later > earlier for earlier, later in zip(delays[:4], delays[1:5]))


# A worker that first forks a helper holding every descriptor it has, the socket
# to the engine included (as a compiler's worker pool forked mid-step may): once
# the worker dies, its socket stays open and no end of stream ever comes.
_FORKING_WORKER = """
import os, sys, time
if os.fork() == 0:
    with open(sys.argv[sys.argv.index("--helper-pid-file") + 1], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
    os._exit(0)
from cadence.actors.executor_worker import main
args = sys.argv[1:]
i = args.index("--helper-pid-file")
sys.exit(main(args[:i] + args[i + 2:]))
"""


async def test_a_child_killed_in_the_first_step_is_noticed_though_its_socket_stays_open(tmp_path):
    """The child dies in the engine's first step while a helper it forked keeps the
    socket open, and the heartbeat timeout is long: the engine sees the child exit,
    is degraded while it restarts it, and the request is computed again, whole."""
    pid_file = tmp_path / "helper.pid"
    command = [sys.executable, "-c", _FORKING_WORKER, "--helper-pid-file", str(pid_file)]
    backend = ChildProcessExecutor(command, heartbeat_timeout_s=GUARD_S)
    cfg = attrs.evolve(process_config(step_timeout_s=3600.0, executor_options={"step_delay_s": 0.2}),
                       executor=backend)
    killed: list[int] = []
    health: list[str] = []

    def kill_in_first_step(plan, now) -> None:
        if not killed:
            killed.append(backend.pid)
            os.kill(backend.pid, signal.SIGKILL)

    try:
        with trio.fail_after(GUARD_S / 2):
            async with open_engine(cfg, on_step=kill_in_first_step) as engine:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch_health, engine, health, 0.01)
                    outcomes = await run_all(engine, {"r0": prompt("r0")})
                    nursery.cancel_scope.cancel()
                scheduler = engine.scheduler
                assert scheduler.num_failures == 1 and scheduler.num_restarts == 1
                assert "SIGKILL" in scheduler.last_failure and "step 0" in scheduler.last_failure
    finally:
        for line in pid_file.read_text().split() if pid_file.exists() else ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line), signal.SIGKILL)
    assert killed and "degraded" in health and health[-1] == "ok"
    assert outcomes["r0"] == expected("r0", prompt("r0"))
