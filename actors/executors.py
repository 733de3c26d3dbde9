"""The two real executor backends: a model runner in a worker thread, or in a child process.

Both implement `ExecutorBackend` (actors/executor.py) over the message classes
of actors/messages.py. `InProcessExecutor` calls the runner directly, in a
worker thread so the event loop never blocks; `ChildProcessExecutor` sends the
same messages as length-prefixed msgpack frames over a Unix socket to
``python -m cadence.actors.executor_worker``, so a crash in the model (or a
SIGKILL) costs a restart, not the engine.

Failure contract, the same for both: `execute` returns a `StepOutput` or raises
`ExecutorError`. After an `ExecutorError` for a dead child, garbage on the
wire, or an `execute` cancelled mid-step (a caller's timeout), the executor is
unusable until `kill()` and `start()`; after a step the runner merely failed
(`ExecutorFailed`), the stream is still in step, but the runner's batch may not
be, so callers normally restart then too.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import signal
import socket
import sys
from typing import Sequence

import attrs
import outcome
import trio

from cadence.statemachine.errors import ExecutorError, ProtocolError

from .executor import select_requests
from .executor_worker import ModelRunnerLike, RunnerFactory, build_runner, ready_from_runner, run_step
from .framing import MAX_FRAME_BYTES, receive_frame, send_frame
from .messages import (
    ExecuteStep,
    ExecutorFailed,
    Heartbeat,
    InitExecutor,
    Message,
    Ready,
    Shutdown,
    StepOutput,
    decode,
    encode,
)

_log = logging.getLogger("cadence.executor")

__all__ = ["InProcessExecutor", "ChildProcessExecutor", "WORKER_COMMAND", "describe_exit"]

WORKER_COMMAND = (sys.executable, "-m", "cadence.actors.executor_worker")
# How long a child that closed its socket gets to exit on its own before we
# kill it, so the error can name its real exit code rather than our SIGKILL.
_EXIT_GRACE_S = 1.0
_SHUTDOWN_TIMEOUT_S = 5.0
# Heartbeats a working child sends per heartbeat timeout: missing several in a
# row, not one late beat, is what counts as stopped.
HEARTBEATS_PER_TIMEOUT = 5

async def wait_for_future(future: concurrent.futures.Future):
    """The result of `future`, the waiting task woken straight from the thread that completes it.

    Waiting through `trio.to_thread` would park a helper thread on the future and
    add a thread switch to every step; on busy cores each switch can cost a
    scheduler tick. Cancelling abandons the future (it still runs to its end).
    """
    task = trio.lowlevel.current_task()
    token = trio.lowlevel.current_trio_token()
    abandoned = False

    def wake() -> None:
        if not abandoned:
            trio.lowlevel.reschedule(task, outcome.capture(future.result))

    def done(_: concurrent.futures.Future) -> None:
        try:
            token.run_sync_soon(wake)
        except trio.RunFinishedError:
            pass  # the run that waited is gone; nobody is left to wake

    def abort(_) -> trio.lowlevel.Abort:
        nonlocal abandoned
        abandoned = True
        return trio.lowlevel.Abort.SUCCEEDED

    future.add_done_callback(done)
    return await trio.lowlevel.wait_task_rescheduled(abort)


def describe_exit(returncode: int | None) -> str:
    """A process's fate in words: 'exited with code 3', 'was killed by signal SIGKILL'."""
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"was killed by signal {name}"
    return f"exited with code {returncode}"


def _failed_error(failed: ExecutorFailed, what: str) -> ExecutorError:
    """The error for a failure the executor reported; its traceback goes to the log
    only, since the message may reach clients."""
    if failed.detail:
        _log.debug("executor failed %s: %s\n%s", what, failed.error, failed.detail)
    return ExecutorError(f"executor failed {what}: {failed.error}")


def _strip_unencodable(step: ExecuteStep) -> tuple[ExecuteStep, dict[str, str]]:
    """`step` without the new requests whose sampling parameters cannot be
    encoded, and those requests with the reason: one such request fails alone."""
    failed: dict[str, str] = {}
    for rid, params in step.sampling.items():
        try:
            encode(ExecuteStep(attrs.evolve(step.plan, num_scheduled_tokens={}, new_requests=[]),
                               {rid: params}))
        except ProtocolError as exc:
            failed[rid] = f"its sampling parameters cannot be sent to the executor: {exc}"
    if not failed:
        return step, failed
    plan = step.plan
    keep = {*plan.num_scheduled_tokens, *plan.new_block_ids, *step.sampling} - failed.keys()
    return select_requests(step, keep), failed


def _encode_step(step: ExecuteStep) -> tuple[bytes, ExecuteStep, dict[str, str]]:
    """The step's frame, leaving out (and naming) requests that cannot be encoded."""
    try:
        return encode(step), step, {}
    except ProtocolError:
        step, failed = _strip_unencodable(step)
        if not failed:
            raise
        return encode(step), step, failed


def _with_failed(output: StepOutput, failed: dict[str, str]) -> StepOutput:
    return output if not failed else attrs.evolve(output, failed={**output.failed, **failed})


def _check_output(reply: Message, step: ExecuteStep) -> StepOutput:
    step_id = step.plan.step_id
    if isinstance(reply, ExecutorFailed):
        raise _failed_error(reply, f"step {step_id}")
    if not isinstance(reply, StepOutput):
        raise ExecutorError(f"executor answered step {step_id} with {type(reply).__name__}")
    if reply.result.step_id != step_id:
        raise ExecutorError(f"executor answered step {step_id} with the output of step {reply.result.step_id}")
    return reply


class ThreadCall:
    """A step queued on an `InProcessExecutor`'s model thread.

    Awaiting `result()` and being cancelled abandons the model thread: the
    executor then counts as interrupted until it is killed and started again.
    """

    __slots__ = ("_owner", "_future", "_step", "_unsent", "_error")

    def __init__(self, owner: InProcessExecutor, future: concurrent.futures.Future | None = None,
                 step: ExecuteStep | None = None, unsent: dict[str, str] | None = None,
                 error: ExecutorError | None = None) -> None:
        self._owner, self._future, self._step, self._unsent, self._error = owner, future, step, unsent, error

    async def result(self) -> StepOutput:
        """The step's output once the model thread has run it."""
        if self._error is not None:
            await trio.lowlevel.checkpoint()
            raise self._error
        owner, step = self._owner, self._step
        try:
            output = await wait_for_future(self._future)
        except Exception as exc:
            failed = ExecutorFailed(step.plan.step_id, f"{type(exc).__name__}: {exc}")
            raise _failed_error(failed, f"step {step.plan.step_id}") from exc
        except BaseException:
            owner._interrupted = True  # cancelled: the model thread goes on unseen
            raise
        return _with_failed(_check_output(owner._wire(output), step), self._unsent)


class InProcessExecutor:
    """The model runner in this process, each step run in a worker thread.

    runner_factory(init) builds the runner (default: the simulated model or
    cadence.gpu's ModelRunner). With round_trip=True every message is encoded
    and decoded on the way, as it would be across a process boundary, to test
    that both backends see the same thing.

    It has no heartbeat, and `step_timeout_s` is its guard against a hang. A
    heartbeat shows that another process still works (a stopped or frozen child
    stops sending it); here there is no other process. If this process is stopped,
    nothing of it runs to notice, the event loop included; if only the model thread
    hangs (a driver or kernel that never returns), a beating helper thread would go
    on beating and prove nothing. What a hung model thread does show is a step that
    does not return, and that is what `step_timeout_s` bounds. A thread cannot be
    killed, so a timed-out step's thread is abandoned (`kill`) and the restarted
    runner gets a fresh one. A model that may hang is better run with
    executor="process": its child is watched by heartbeats and can be killed.
    """

    def __init__(self, runner_factory: RunnerFactory = build_runner, *, round_trip: bool = False) -> None:
        self._runner_factory = runner_factory
        self._round_trip = round_trip
        self._runner: ModelRunnerLike | None = None
        self._interrupted = False
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None

    async def _in_model_thread(self, fn, *args):
        """Run `fn` on this executor's own model thread and wait for it without
        blocking the event loop. The model lives on one thread that aclose() joins:
        torch state left on an idle daemon thread at interpreter exit can abort
        the process."""
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="cadence-model")
        return await wait_for_future(self._thread.submit(fn, *args))

    def _drop_thread(self, wait: bool) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.shutdown(wait=wait, cancel_futures=True)

    @property
    def runner(self) -> ModelRunnerLike | None:
        """The current runner, None before start or after kill."""
        return self._runner

    def _wire(self, message: Message) -> Message:
        if not self._round_trip:
            return message
        try:
            return decode(encode(message))
        except ProtocolError as exc:
            raise ExecutorError(f"{type(message).__name__} does not survive the wire: {exc}") from exc

    async def start(self, init: InitExecutor) -> Ready:
        """Build a fresh runner (in a thread: loading weights takes a while) and report its size."""
        await self.kill()
        init = self._wire(init)  # type: ignore[assignment]
        try:
            runner = await self._in_model_thread(self._runner_factory, init)
            ready = ready_from_runner(runner, init)
        except Exception as exc:
            raise ExecutorError(f"executor failed to start: {type(exc).__name__}: {exc}") from exc
        self._runner = runner
        return self._wire(ready)  # type: ignore[return-value]

    async def execute(self, step: ExecuteStep) -> StepOutput:
        """Run one step in a worker thread; cancelling abandons the thread and the runner."""
        return await self.submit(step).result()

    def submit(self, step: ExecuteStep) -> ThreadCall:
        """Queue a step on the model thread behind those queued before it (it runs
        while the event loop goes on); await `result()` for its output."""
        runner = self._runner
        if runner is None:
            return ThreadCall(self, error=ExecutorError("executor is not running; call start() first"))
        if self._interrupted:
            return ThreadCall(self, error=ExecutorError(
                "executor was interrupted mid-step; kill() and start() it again"))
        unsent: dict[str, str] = {}
        if self._round_trip:
            try:
                frame, step, unsent = _encode_step(step)
                step = decode(frame)  # type: ignore[assignment]
            except ProtocolError as exc:
                return ThreadCall(self, error=ExecutorError(f"ExecuteStep does not survive the wire: {exc}"))
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="cadence-model")
        return ThreadCall(self, self._thread.submit(run_step, runner, step), step, unsent)

    async def kill(self) -> None:
        """Drop the runner; a step still running in an abandoned thread finishes unseen."""
        self._runner = None
        self._interrupted = False
        self._drop_thread(wait=False)

    async def aclose(self) -> None:
        """Close the runner if it has a close method, then drop it."""
        runner, self._runner = self._runner, None
        close = getattr(runner, "close", None)
        if close is not None and not self._interrupted:
            await self._in_model_thread(close)
        thread, interrupted = self._thread, self._interrupted
        self._thread, self._interrupted = None, False
        if thread is not None:
            # Join the model thread off the event loop; an abandoned step is not waited for.
            await trio.to_thread.run_sync(thread.shutdown, not interrupted)


class ChildProcessExecutor:
    """The model runner in a child process, spoken to in msgpack frames over a Unix socket.

    command: the worker's command line (default `WORKER_COMMAND`); ``--fd N`` is
    appended, naming the inherited socket. A dead child, a closed socket or an
    invalid frame raises `ExecutorError` naming the exit code or signal.
    heartbeat_timeout_s: with a value, the child is asked to send a Heartbeat
    `HEARTBEATS_PER_TIMEOUT` times per this period while it works, and one
    that sends nothing for this long (stopped, frozen) is killed and reported;
    None (the default) waits for the answer as long as the caller does.
    """

    def __init__(
        self,
        command: Sequence[str] = WORKER_COMMAND,
        *,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        shutdown_timeout_s: float = _SHUTDOWN_TIMEOUT_S,
        heartbeat_timeout_s: float | None = None,
    ) -> None:
        if heartbeat_timeout_s is not None and not heartbeat_timeout_s > 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0 or None, got {heartbeat_timeout_s!r}")
        self._command = list(command)
        self._max_frame_bytes = max_frame_bytes
        self._shutdown_timeout_s = shutdown_timeout_s
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._process: trio.Process | None = None
        self._stream: trio.SocketStream | None = None
        # Set while a request is on the wire; still set afterwards means an
        # exchange was interrupted and the next reply would be out of step.
        self._in_flight = False

    @property
    def pid(self) -> int | None:
        """The process id of the current (or last) child; None before the first start."""
        return None if self._process is None else self._process.pid

    @property
    def returncode(self) -> int | None:
        """The current (or last) child's exit status once it has exited (negative: killed by that signal)."""
        return None if self._process is None else self._process.returncode

    async def start(self, init: InitExecutor) -> Ready:
        """Spawn a fresh child (killing any previous one), send InitExecutor and wait for Ready."""
        await self.kill()
        try:
            parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as exc:  # out of file descriptors, typically
            raise ExecutorError(f"could not open a socket to the executor process: {exc}") from exc
        command = [*self._command, "--fd", str(child_sock.fileno())]
        if self._heartbeat_timeout_s is not None:
            interval_s = self._heartbeat_timeout_s / HEARTBEATS_PER_TIMEOUT
            command += ["--heartbeat-s", repr(interval_s)]
        try:
            self._process = await trio.lowlevel.open_process(command, pass_fds=(child_sock.fileno(),))
        except BaseException as exc:
            parent_sock.close()
            if isinstance(exc, OSError):
                raise ExecutorError(f"could not start the executor process {command[0]!r}: {exc}") from exc
            raise
        finally:
            child_sock.close()
        self._stream = trio.SocketStream(trio.socket.from_stdlib_socket(parent_sock))
        try:
            reply = await self._exchange(encode(init), "start-up")
            if isinstance(reply, ExecutorFailed):
                raise _failed_error(reply, "to start")
            if not isinstance(reply, Ready):
                raise ExecutorError(f"executor answered InitExecutor with {type(reply).__name__}")
        except BaseException:
            await self.kill()
            raise
        return reply

    async def execute(self, step: ExecuteStep) -> StepOutput:
        """Send one step and wait for its output."""
        try:
            frame, step, unsent = _encode_step(step)
        except ProtocolError as exc:
            raise ExecutorError(f"step {step.plan.step_id} cannot be sent to the executor: {exc}") from exc
        reply = await self._exchange(frame, f"step {step.plan.step_id}")
        try:
            return _with_failed(_check_output(reply, step), unsent)
        except ExecutorError:
            if not isinstance(reply, ExecutorFailed):
                await self.kill()  # it answered a different question: nothing it says can be trusted
            raise

    async def _exchange(self, frame: bytes, what: str) -> Message:
        """Send one encoded request and return the answer, skipping heartbeats."""
        stream = self._stream
        if stream is None:
            raise ExecutorError("executor is not running; call start() first")
        if self._in_flight:
            raise ExecutorError("executor was interrupted mid-step; kill() and start() it again")
        self._in_flight = True
        try:
            await send_frame(stream, frame, self._max_frame_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError) as exc:
            raise await self._lost(what, exc) from exc
        while True:
            reply = await self._receive(stream, what)
            if not isinstance(reply, Heartbeat):
                break
        self._in_flight = False
        return reply

    async def _receive(self, stream: trio.SocketStream, what: str) -> Message:
        """The next message from the child; a silence past the heartbeat timeout kills it."""
        timeout_s = self._heartbeat_timeout_s
        with trio.move_on_after(math.inf if timeout_s is None else timeout_s):
            try:
                frame = await self._frame_while_alive(stream)
            except (trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError) as exc:
                raise await self._lost(what, exc) from exc
            if frame is None:
                raise await self._lost(what, None)
            try:
                return decode(frame, self._max_frame_bytes)
            except ProtocolError as exc:
                await self.kill()
                raise ExecutorError(
                    f"executor sent an invalid message during {what} and was killed: {exc}") from exc
        await self.kill()
        raise ExecutorError(f"executor process sent no heartbeat for {timeout_s} s during {what} "
                            f"(stopped or frozen) and was killed")

    async def _frame_while_alive(self, stream: trio.SocketStream) -> bytes | None:
        """The next frame, or None at end of stream or once the child has exited
        (a process it forked may hold the socket open after it died)."""
        process = self._process
        if process is None:
            return await receive_frame(stream, self._max_frame_bytes)
        box: list = []
        async with trio.open_nursery() as nursery:

            async def receive() -> None:
                try:
                    box.append(await receive_frame(stream, self._max_frame_bytes))
                except (trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError) as exc:
                    box.append(exc)  # raised below, outside the nursery's exception group
                nursery.cancel_scope.cancel()

            async def exited() -> None:
                await process.wait()
                await trio.sleep(_EXIT_GRACE_S)  # what it sent before exiting still arrives
                nursery.cancel_scope.cancel()

            nursery.start_soon(receive)
            nursery.start_soon(exited)
        if box and isinstance(box[0], BaseException):
            raise box[0]
        return box[0] if box else None

    async def _lost(self, what: str, cause: BaseException | None) -> ExecutorError:
        """The connection broke: give the child a moment to exit, reap it, and say how it ended."""
        process = self._process
        if process is not None:
            with trio.move_on_after(_EXIT_GRACE_S):
                await process.wait()
        returncode = None if process is None else process.returncode
        await self.kill()
        fate = "did not exit and was killed" if returncode is None else describe_exit(returncode)
        reason = f" ({cause})" if cause is not None and str(cause) else ""
        return ExecutorError(f"executor process {fate} during {what}{reason}")

    async def kill(self) -> None:
        """SIGKILL the child and reap it; safe to call in any state, and under cancellation."""
        process, stream = self._process, self._stream
        self._stream = None
        self._in_flight = False
        with trio.CancelScope(shield=True):
            if stream is not None:
                await stream.aclose()
            if process is not None:
                if process.returncode is None:
                    process.kill()
                await process.wait()

    async def aclose(self) -> None:
        """Ask the child to shut down, wait for it a while, then kill whatever is left."""
        stream, process = self._stream, self._process
        try:
            if stream is not None and process is not None and not self._in_flight:
                with trio.move_on_after(self._shutdown_timeout_s):
                    await send_frame(stream, encode(Shutdown()))
                    await process.wait()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # already gone; kill() below reaps it
        finally:
            await self.kill()
