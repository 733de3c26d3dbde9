"""The in-process and child-process executors: same tokens for the same plans, and every
way a child can die or misbehave ends in ExecutorError (never a hang), after which
kill() and start() bring it back."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import threading

import attrs
import pytest
import trio
import trio.testing

from cadence.actors.executor import ExecutorBackend
from cadence.actors.executor_worker import DeterministicRunner, deterministic_token
from cadence.actors.executors import ChildProcessExecutor, InProcessExecutor, describe_exit
from cadence.actors.messages import ExecuteStep, InitExecutor, Ready
from cadence.statemachine.config import CacheConfig, SchedulerConfig
from cadence.statemachine.errors import ExecutorError
from cadence.statemachine.plan import NewRequestData, StepPlan, StepResult
from cadence.statemachine.request import Request
from cadence.statemachine.sampling import SamplingParams
from cadence.statemachine.scheduler import Scheduler

# Generous bound on anything that involves starting a Python process on a busy machine.
PROCESS_TIMEOUT_S = 60

INIT = InitExecutor(
    model="simulated", dtype="float32", device="cpu", num_blocks=12, block_size=4,
    max_model_len=64, max_num_batched_tokens=16, seed=0, options={},
)
# Prompts share prefixes (prefix-cache hits) and together outgrow a 12-block cache.
PROMPTS = {
    f"r{i}": [7, 7, 7, 7, 1, 2, 3, 4][: 4 + i % 5] + [100 + i] * (i % 4) for i in range(8)
}
MAX_TOKENS = {rid: 6 + 3 * (i % 3) for i, rid in enumerate(PROMPTS)}
SAMPLING = {rid: SamplingParams(max_tokens=MAX_TOKENS[rid], temperature=0.0, logprobs=i % 3 or None)
            for i, rid in enumerate(PROMPTS)}


def _init(**options) -> InitExecutor:
    return attrs.evolve(INIT, options=options)


class Workload:
    """Drives the real scheduling core against an executor, step by step."""

    def __init__(self, ready: Ready, request_ids: list[str] | None = None) -> None:
        self.core = Scheduler(
            SchedulerConfig(max_num_batched_tokens=INIT.max_num_batched_tokens, max_model_len=INIT.max_model_len,
                            max_num_seqs=6, admission_watermark=0.0),
            CacheConfig(num_blocks=ready.num_blocks, block_size=ready.block_size),
        )
        request_ids = list(PROMPTS) if request_ids is None else request_ids
        for rid in request_ids:
            self.core.add_request(Request(rid, PROMPTS[rid], SAMPLING[rid].limits(ready.eos_token_ids)))
        self.outputs: dict[str, list[int]] = {rid: [] for rid in request_ids}
        self.results: list[tuple] = []

    def next_step(self) -> ExecuteStep:
        """Plan the next step, with the sampling parameters of its new requests."""
        plan = self.core.schedule()
        return ExecuteStep(plan, {d.request_id: SAMPLING[d.request_id] for d in plan.new_requests})

    def apply(self, step: ExecuteStep, result: StepResult) -> None:
        """Hand a step's result to the core and collect the tokens it releases."""
        self.results.append((result.step_id, result.sampled_token_ids, result.logprobs))
        for event in self.core.update(step.plan, result):
            self.outputs[event.request_id].extend(event.token_ids)

    async def run(self, executor: ExecutorBackend, max_steps: int = 500) -> None:
        """Step until every request has finished."""
        for _ in range(max_steps):
            if not self.core.has_work():
                return
            step = self.next_step()
            self.apply(step, (await executor.execute(step)).result)
        raise AssertionError("workload did not finish")


def expected_outputs() -> dict[str, list[int]]:
    """What the simulated model must produce, whatever the batching and preemptions."""
    return {
        rid: [deterministic_token(rid, len(prompt) + i) for i in range(MAX_TOKENS[rid])]
        for rid, prompt in PROMPTS.items()
    }


async def _run_workload(executor: ExecutorBackend) -> Workload:
    with trio.fail_after(PROCESS_TIMEOUT_S):
        workload = Workload(await executor.start(INIT))
        await workload.run(executor)
        await executor.aclose()
    return workload


# ---------------------------------------------------------------------------
# Parity.


async def test_all_backends_return_the_same_steps_and_the_expected_tokens():
    backends = [InProcessExecutor(), InProcessExecutor(round_trip=True), ChildProcessExecutor()]
    workloads = [await _run_workload(executor) for executor in backends]
    for executor in backends:
        assert isinstance(executor, ExecutorBackend)
    assert workloads[0].outputs == expected_outputs()
    stats = workloads[0].core.stats()
    assert stats.num_prefix_hit_tokens > 0, "the prompts are meant to share cached prefixes"
    assert any(r[2] for r in workloads[0].results), "some steps should carry logprobs"
    for other in workloads[1:]:
        assert other.results == workloads[0].results
        assert other.outputs == workloads[0].outputs


def _preempt_and_resume_steps() -> list[ExecuteStep]:
    """Hand-written plans (block size 4): admit a and b, decode, preempt b, resume b with
    the token it had generated, drop a as finished."""
    a, b = [1, 2, 3], [4, 5, 6, 7, 8]
    b_out = deterministic_token("b", 5)
    params = {"a": SamplingParams(logprobs=2), "b": SamplingParams()}
    plans = [
        StepPlan(0, {"a": 3, "b": 5}, 8, [NewRequestData("a", a, 3, [0], 0), NewRequestData("b", b, 5, [1, 2], 0)],
                 {}, [], [], []),
        StepPlan(1, {"a": 1}, 1, [], {"a": [3]}, ["b"], [], []),
        StepPlan(2, {"a": 1, "b": 6}, 7, [NewRequestData("b", [*b, b_out], 5, [4, 5], 0, resumed=True)],
                 {}, [], [], ["b"]),
        StepPlan(3, {"b": 1}, 1, [], {}, [], ["a"], []),
    ]
    return [ExecuteStep(plan, {d.request_id: params[d.request_id] for d in plan.new_requests}) for plan in plans]


async def test_preempted_and_resumed_requests_continue_where_they_were():
    results = []
    for executor in (InProcessExecutor(), InProcessExecutor(round_trip=True), ChildProcessExecutor()):
        with trio.fail_after(PROCESS_TIMEOUT_S):
            await executor.start(INIT)
            results.append([attrs.evolve((await executor.execute(s)).result, execute_us=0)
                            for s in _preempt_and_resume_steps()])
            await executor.aclose()
    token = deterministic_token
    assert [r.sampled_token_ids for r in results[0]] == [
        {"a": [token("a", 3)], "b": [token("b", 5)]},
        {"a": [token("a", 4)]},
        {"a": [token("a", 5)], "b": [token("b", 6)]},
        {"b": [token("b", 7)]},
    ]
    assert results[0][0].logprobs == {"a": [[(token("a", 3), 0.0), ((token("a", 3) + 1) % 32000, -1.0),
                                             ((token("a", 3) + 2) % 32000, -2.0)]]}
    assert results[1] == results[0] and results[2] == results[0]


async def test_ready_reports_what_the_runner_has():
    executor = ChildProcessExecutor()
    with trio.fail_after(PROCESS_TIMEOUT_S):
        ready = await executor.start(_init(vocab_size=1000, eos_token_id=999))
        await executor.aclose()
    assert ready == Ready(num_blocks=12, block_size=4, vocab_size=1000, eos_token_ids=[999], max_model_len=64)
    assert executor.returncode == 0


# ---------------------------------------------------------------------------
# Child deaths.


async def test_sigkill_mid_step_raises_and_a_restart_finishes_the_work():
    executor = ChildProcessExecutor()
    with trio.fail_after(PROCESS_TIMEOUT_S):
        workload = Workload(await executor.start(_init(hang_at_step=3)))
        for _ in range(3):
            step = workload.next_step()
            workload.apply(step, (await executor.execute(step)).result)
        step = workload.next_step()
        assert step.plan.step_id == 3
        failure: list[ExecutorError] = []

        async def execute_expecting_failure():
            """The step in flight when the child is killed."""
            with pytest.raises(ExecutorError) as info:
                await executor.execute(step)
            failure.append(info.value)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(execute_expecting_failure)
            await trio.testing.wait_all_tasks_blocked()
            os.kill(executor.pid, signal.SIGKILL)
        assert "killed by signal SIGKILL" in str(failure[0])
        assert "step 3" in str(failure[0])
        assert executor.returncode == -signal.SIGKILL

        workload.core.executor_lost()
        await executor.start(INIT)
        await workload.run(executor)
        await executor.aclose()
    assert workload.outputs == expected_outputs()


async def test_child_exiting_mid_step_names_its_exit_code():
    executor = ChildProcessExecutor()
    with trio.fail_after(PROCESS_TIMEOUT_S):
        workload = Workload(await executor.start(_init(exit_at_step=1)))
        step = workload.next_step()
        workload.apply(step, (await executor.execute(step)).result)
        with pytest.raises(ExecutorError, match="exited with code 3 during step 1"):
            await executor.execute(workload.next_step())
        with pytest.raises(ExecutorError, match="not running"):
            await executor.execute(workload.next_step())
        await executor.kill()


async def test_a_failed_step_is_reported_and_the_child_keeps_serving(caplog):
    executor = ChildProcessExecutor()
    with trio.fail_after(PROCESS_TIMEOUT_S):
        workload = Workload(await executor.start(_init(fail_at_step=0)))
        step = workload.next_step()
        with caplog.at_level("DEBUG", logger="cadence.executor"), pytest.raises(
                ExecutorError, match="failed step 0: RuntimeError: simulated failure at step 0") as info:
            await executor.execute(step)
        # The traceback (file paths and all) goes to the log, never into the error clients see.
        assert "Traceback" not in str(info.value) and ".py" not in str(info.value)
        assert "Traceback" in caplog.text
        # The fault fires once, before the batch changes, so the same step can be retried.
        workload.apply(step, (await executor.execute(step)).result)
        await workload.run(executor)
        await executor.aclose()
    assert workload.outputs == expected_outputs()


async def test_a_hung_step_is_cut_off_by_the_caller_then_kill_and_start_recover():
    executor = ChildProcessExecutor()
    with trio.fail_after(PROCESS_TIMEOUT_S):
        workload = Workload(await executor.start(_init(hang_at_step=0)))
        step = workload.next_step()
        with trio.move_on_after(0.5) as scope:
            await executor.execute(step)
        assert scope.cancelled_caught
        with pytest.raises(ExecutorError, match="interrupted mid-step"):
            await executor.execute(step)
        old_pid = executor.pid
        await executor.kill()
        assert executor.returncode == -signal.SIGKILL
        with pytest.raises(ProcessLookupError):
            os.kill(old_pid, 0)  # reaped, not a zombie
        workload.core.executor_lost()
        await executor.start(INIT)
        await workload.run(executor)
        await executor.aclose()
    assert workload.outputs == expected_outputs()


async def test_start_failure_is_an_executor_error():
    executor = ChildProcessExecutor()
    with trio.fail_after(PROCESS_TIMEOUT_S):
        with pytest.raises(ExecutorError, match="failed to start: ValueError"):
            await executor.start(_init(vocab_size="many"))
        assert executor.returncode is not None
        with pytest.raises(ExecutorError, match="could not start the executor process"):
            await ChildProcessExecutor(["/nonexistent/python"]).start(INIT)


async def test_restart_replaces_and_reaps_the_previous_child():
    executor = ChildProcessExecutor()
    with trio.fail_after(PROCESS_TIMEOUT_S):
        await executor.start(INIT)
        first = executor.pid
        await executor.start(INIT)
        assert executor.pid != first
        with pytest.raises(ProcessLookupError):
            os.kill(first, 0)
        await executor.aclose()
        await executor.aclose()
        await executor.kill()
    assert executor.returncode == 0


async def test_execute_before_start_is_an_executor_error():
    for executor in (ChildProcessExecutor(), InProcessExecutor()):
        with pytest.raises(ExecutorError, match="call start"):
            await executor.execute(ExecuteStep(_one_request_plan(0), {"a": SamplingParams()}))


# ---------------------------------------------------------------------------
# Corrupt children: each misbehaves after Ready, in its own way, then stays alive
# (or exits) so that only the executor's own checks can end the step.

CORRUPT_WORKER = textwrap.dedent('''
    import os, socket, struct, sys, time
    from cadence.actors.framing import receive_frame_sync, send_frame_sync
    from cadence.actors.messages import Ready, encode

    mode, fd = sys.argv[1], int(sys.argv[3])
    sock = socket.socket(fileno=fd)
    if mode == "exit-before-ready":
        sys.exit(7)
    receive_frame_sync(sock)
    send_frame_sync(sock, encode(Ready(64, 4, 100, [], 512)))
    receive_frame_sync(sock)
    if mode == "garbage":
        send_frame_sync(sock, b"\\xc1 not msgpack")
    elif mode == "oversize":
        sock.sendall(struct.pack(">I", 2**31))
    elif mode == "truncate-and-exit":
        sock.sendall(struct.pack(">I", 100) + b"x" * 10)
        os._exit(5)
    elif mode == "wrong-reply":
        send_frame_sync(sock, encode(Ready(64, 4, 100, [], 512)))
    elif mode == "half-frame-then-hang":
        sock.sendall(struct.pack(">I", 100) + b"x")
    time.sleep(600)
''')


@pytest.fixture
def corrupt_worker(tmp_path):
    """A factory of ChildProcessExecutors running the corrupt worker in a given mode."""
    path = tmp_path / "corrupt_worker.py"
    path.write_text(CORRUPT_WORKER)
    return lambda mode: ChildProcessExecutor([sys.executable, str(path), mode])


def _one_request_plan(step_id: int) -> StepPlan:
    return StepPlan(step_id, {"a": 2}, 2, [NewRequestData("a", [1, 2], 2, [0], 0)], {}, [], [], [])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("garbage", "invalid message during step 0 and was killed: not a valid msgpack"),
        ("oversize", "over the limit"),
        ("truncate-and-exit", "exited with code 5 during step 0"),
        ("wrong-reply", "answered step 0 with Ready"),
    ],
)
async def test_corrupt_child_is_an_executor_error_not_a_hang(corrupt_worker, mode, expected):
    executor = corrupt_worker(mode)
    with trio.fail_after(PROCESS_TIMEOUT_S):
        await executor.start(INIT)
        with pytest.raises(ExecutorError, match=expected):
            await executor.execute(ExecuteStep(_one_request_plan(0), {"a": SamplingParams()}))
        await executor.kill()
    assert executor.returncode is not None


async def test_child_dying_before_ready_names_its_exit_code(corrupt_worker):
    executor = corrupt_worker("exit-before-ready")
    with trio.fail_after(PROCESS_TIMEOUT_S):
        with pytest.raises(ExecutorError, match="exited with code 7 during start-up"):
            await executor.start(INIT)


async def test_half_a_frame_then_silence_is_cut_off_by_the_callers_timeout(corrupt_worker):
    executor = corrupt_worker("half-frame-then-hang")
    with trio.fail_after(PROCESS_TIMEOUT_S):
        await executor.start(INIT)
        with trio.move_on_after(0.5) as scope:
            await executor.execute(ExecuteStep(_one_request_plan(0), {"a": SamplingParams()}))
        assert scope.cancelled_caught
        await executor.aclose()  # must not wait for a reply that will never come
    assert executor.returncode == -signal.SIGKILL


# ---------------------------------------------------------------------------
# In-process specifics.


class GatedRunner(DeterministicRunner):
    """Blocks each step until the test opens the gate (a threading.Event)."""

    def __init__(self, init: InitExecutor) -> None:
        super().__init__(init)
        self.gate = threading.Event()
        self.plans: list[StepPlan] = []

    def execute(self, plan, sampling):
        """Record the plan, wait for the gate, then run the step."""
        self.plans.append(plan)
        if not self.gate.wait(timeout=PROCESS_TIMEOUT_S):
            raise AssertionError("gate never opened: the event loop was blocked")
        return super().execute(plan, sampling)


async def test_in_process_step_runs_off_the_event_loop():
    executor = InProcessExecutor(GatedRunner)
    await executor.start(INIT)
    step = ExecuteStep(_one_request_plan(0), {"a": SamplingParams()})
    outputs = []
    with trio.fail_after(PROCESS_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _append(outputs, executor.execute(step)))
            await trio.testing.wait_all_tasks_blocked()
            # Reaching this line while the step is in its thread is the point.
            executor.runner.gate.set()
    assert outputs[0].result.sampled_token_ids == {"a": [deterministic_token("a", 2)]}


async def _append(into: list, awaitable) -> None:
    into.append(await awaitable)


async def test_in_process_cancelled_step_needs_a_restart():
    executor = InProcessExecutor(GatedRunner)
    await executor.start(INIT)
    step = ExecuteStep(_one_request_plan(0), {"a": SamplingParams()})
    with trio.move_on_after(0.2) as scope:
        await executor.execute(step)
    assert scope.cancelled_caught
    abandoned = executor.runner
    with pytest.raises(ExecutorError, match="interrupted mid-step"):
        await executor.execute(step)
    abandoned.gate.set()
    await executor.kill()
    await executor.start(INIT)
    assert executor.runner is not abandoned
    executor.runner.gate.set()
    output = await executor.execute(step)
    assert output.result.sampled_token_ids == {"a": [deterministic_token("a", 2)]}


@pytest.mark.parametrize("round_trip", [False, True])
async def test_in_process_round_trip_flag_sends_copies_through_the_codec(round_trip):
    executor = InProcessExecutor(GatedRunner, round_trip=round_trip)
    await executor.start(INIT)
    executor.runner.gate.set()
    step = ExecuteStep(_one_request_plan(0), {"a": SamplingParams()})
    await executor.execute(step)
    seen = executor.runner.plans[0]
    assert seen == step.plan
    assert (seen is step.plan) is not round_trip


class NegativeTokenRunner(DeterministicRunner):
    """Returns a token id no wire message may carry."""

    def execute(self, plan, sampling):
        """Answer -1 for every scheduled request."""
        return StepResult(plan.step_id, {rid: [-1] for rid in plan.num_scheduled_tokens})


async def test_in_process_round_trip_turns_an_unsendable_result_into_an_executor_error():
    step = ExecuteStep(_one_request_plan(0), {"a": SamplingParams()})
    lenient = InProcessExecutor(NegativeTokenRunner)
    await lenient.start(INIT)
    assert (await lenient.execute(step)).result.sampled_token_ids == {"a": [-1]}
    strict = InProcessExecutor(NegativeTokenRunner, round_trip=True)
    await strict.start(INIT)
    with pytest.raises(ExecutorError, match=r"StepOutput does not survive the wire: .*\['a'\]\[0\]: must be >= 0"):
        await strict.execute(step)


async def test_in_process_failures_are_executor_errors():
    executor = InProcessExecutor()
    with pytest.raises(ExecutorError, match="failed to start: ValueError"):
        await executor.start(_init(vocab_size="many"))
    await executor.start(_init(fail_at_step=0))
    with pytest.raises(ExecutorError, match="failed step 0: RuntimeError"):
        await executor.execute(ExecuteStep(_one_request_plan(0), {"a": SamplingParams()}))
    with pytest.raises(ExecutorError, match="no SamplingParams for new request 'a'"):
        await executor.execute(ExecuteStep(_one_request_plan(1), {}))
    await executor.aclose()


def test_describe_exit():
    assert describe_exit(0) == "exited with code 0"
    assert describe_exit(-9) == "was killed by signal SIGKILL"
    assert describe_exit(None) == "is still running"


# ---------------------------------------------------------------------------
# A real (tiny, random-weight) model through both transports.


@pytest.mark.slow
async def test_tiny_model_gives_the_same_greedy_tokens_in_process_and_in_a_child():
    pytest.importorskip("torch")
    pytest.importorskip("cadence.gpu.runner")
    init = attrs.evolve(INIT, model="tiny", num_blocks=64, options={"attention_backend": "reference"})
    outputs = []
    for executor in (InProcessExecutor(), ChildProcessExecutor()):
        with trio.fail_after(5 * PROCESS_TIMEOUT_S):
            ready = await executor.start(init)
            assert ready.vocab_size == 512 and ready.eos_token_ids == [2]
            workload = Workload(ready, ["r1", "r6"])  # one step on this model costs real time
            await workload.run(executor)
            await executor.aclose()
        outputs.append(workload.outputs)
    assert all(len(tokens) > 0 for tokens in outputs[0].values())
    assert all(0 <= t < 512 for tokens in outputs[0].values() for t in tokens)
    assert outputs[0] == outputs[1]
