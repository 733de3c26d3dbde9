"""The executor child process: a blocking loop that serves one socket.

Run as ``python -m cadence.actors.executor_worker --fd N`` where N is an
inherited, connected Unix stream socket. It reads an `InitExecutor` frame,
builds the model runner and answers `Ready`; then answers each `ExecuteStep`
with `StepOutput` (or `ExecutorFailed` if the runner raised) until `Shutdown`
or end of stream. It needs no Trio: one request is in flight at a time. With
``--heartbeat-s S`` a second thread sends a `Heartbeat` frame every S seconds
while it works, so the parent can tell a stopped process from a slow step.

This module also defines the runner contract both executor backends rely on,
and `DeterministicRunner`, the model "simulated": a zero-cost fake whose tokens
depend only on the request id and position, so tests and benchmarks can run
the real transports without torch.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
import traceback
import zlib
from typing import Any, Callable, Protocol, Sequence

import attrs

from cadence.statemachine.errors import ConfigError, ExecutorError, ProtocolError
from cadence.statemachine.plan import StepPlan, StepResult
from cadence.statemachine.sampling import SamplingParams

from .framing import receive_frame_sync, send_frame_sync
from .structured import DEFAULT_GRAMMAR_CACHE_SIZE, checkpoint_matchers
from .messages import (
    ExecuteStep,
    ExecutorFailed,
    Heartbeat,
    InitExecutor,
    PromptLogprobs,
    Ready,
    Shutdown,
    StepOutput,
    decode,
    encode,
)

__all__ = [
    "SIMULATED_MODEL",
    "ModelRunnerLike",
    "RunnerFactory",
    "DeterministicRunner",
    "deterministic_token",
    "build_runner",
    "ready_from_runner",
    "run_step",
    "serve",
    "main",
]

SIMULATED_MODEL = "simulated"
DEFAULT_VOCAB_SIZE = 32000
# Used when InitExecutor.num_blocks is 0 ("size it yourself") for the fake runner.
DEFAULT_NUM_BLOCKS = 4096

# How long DeterministicRunner stalls when told to hang: longer than any test waits.
HANG_S = 3600.0

EXIT_OK = 0
EXIT_RUNNER_FAILED = 1
EXIT_PROTOCOL_ERROR = 2
# What DeterministicRunner exits with when told to simulate a crash.
EXIT_SIMULATED_CRASH = 3
# A simulated prompt token's logprob cycles through -k / PROMPT_LOGPROB_PERIOD for
# k in [0, PROMPT_LOGPROB_PERIOD), by position, so a misplaced entry shows.
PROMPT_LOGPROB_PERIOD = 8


class ModelRunnerLike(Protocol):
    """What an executor needs from a model runner (gpu.runner.ModelRunner is one).

    A runner may also have `take_failed() -> dict[str, str]`: the requests its
    last `execute` could not serve (each dropped from its batch, with a one-line
    reason), so one bad request costs itself, not the step; and
    `take_prompt_logprobs()`: per request that asked for prompt logprobs, the
    (first position, entries) its last `execute` scored.
    """

    num_blocks: int
    vocab_size: int
    eos_token_ids: list[int]

    def execute(self, plan: StepPlan, sampling: dict[str, SamplingParams]) -> StepResult:
        """Run one plan against the persistent batch and sample."""


RunnerFactory = Callable[[InitExecutor], ModelRunnerLike]


def run_step(runner: ModelRunnerLike, step: ExecuteStep) -> StepOutput:
    """Run one step on `runner`; the requests it could not serve come back in `failed`,
    the prompt log-probabilities it computed in `prompt_logprobs`."""
    result = runner.execute(step.plan, step.sampling)
    take_failed = getattr(runner, "take_failed", None)
    take_scored = getattr(runner, "take_prompt_logprobs", None)
    scored = take_scored() if take_scored is not None else {}
    return StepOutput(result, take_failed() if take_failed is not None else {},
                      {rid: PromptLogprobs(first, entries) for rid, (first, entries) in scored.items()})


def deterministic_token(request_id: str, position: int, vocab_size: int = DEFAULT_VOCAB_SIZE) -> int:
    """The token the simulated model emits for `request_id` at sequence position `position`."""
    return zlib.crc32(f"{request_id}:{position}".encode()) % vocab_size


@attrs.define
class _Sequence:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingParams
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0


class DeterministicRunner:
    """A zero-cost fake model runner with a real persistent batch.

    Each sampled token is `deterministic_token(request_id, position)`, so a
    request's output is the same whatever it is batched with and across
    restarts. It checks the plan against its batch (unknown requests, tokens
    beyond the blocks given), so a scheduler bug surfaces as a failed step.

    Options (all optional): vocab_size (int); eos_token_id (int) and
    eos_after (int: the request's Nth output token is that eos); step_delay_s
    (float: sleep per step, to test timeouts and kills mid-step);
    fail_at_step / exit_at_step / hang_at_step (int: raise once, exit the
    process with code 3, or stall for an hour, when that step id arrives);
    echo (bool: keep no batch and answer token 0 for every scheduled request,
    a zero-cost runner for measuring the transport alone); faults that follow
    a request whose tokens hold a marker token: bad_token (int: the request is
    refused at input preparation and reported in `take_failed`), crash_token
    (int: the whole step raises), exit_token (int: the process exits with code 3).
    """

    def __init__(self, init: InitExecutor) -> None:
        options = init.options
        self.block_size = init.block_size
        self.max_model_len = init.max_model_len
        self.num_blocks = init.num_blocks or DEFAULT_NUM_BLOCKS
        self.vocab_size = int(options.get("vocab_size", DEFAULT_VOCAB_SIZE))
        eos = options.get("eos_token_id")
        self.eos_token_ids: list[int] = [] if eos is None else [int(eos)]
        self._eos_after = int(options.get("eos_after", 0))
        self._step_delay_s = float(options.get("step_delay_s", 0.0))
        self._fail_at_step = options.get("fail_at_step")
        self._exit_at_step = options.get("exit_at_step")
        self._hang_at_step = options.get("hang_at_step")
        self._echo = bool(options.get("echo", False))
        self._bad_token = options.get("bad_token")
        self._crash_token = options.get("crash_token")
        self._exit_token = options.get("exit_token")
        self._batch: dict[str, _Sequence] = {}
        self._failed: dict[str, str] = {}
        # Requests it refused, until a plan names them finished or preempted (a plan
        # made before the refusal was known may still schedule them).
        self._dropped: dict[str, str] = {}
        self._prompt_logprobs: dict[str, tuple[int, list[list[tuple[int, float]]]]] = {}

    def take_failed(self) -> dict[str, str]:
        """The requests the last step refused, with why (and forget them)."""
        failed, self._failed = self._failed, {}
        return failed

    def take_prompt_logprobs(self) -> dict[str, tuple[int, list[list[tuple[int, float]]]]]:
        """The simulated prompt log-probabilities of the last step (and forget them)."""
        scored, self._prompt_logprobs = self._prompt_logprobs, {}
        return scored

    def execute(self, plan: StepPlan, sampling: dict[str, SamplingParams]) -> StepResult:
        """Apply the plan's deltas to the batch and sample one token per finished prefill or decode."""
        start_ns = time.perf_counter_ns()
        self._maybe_fault(plan.step_id)
        if self._echo:
            return StepResult(plan.step_id, {request_id: [0] for request_id in plan.num_scheduled_tokens})
        dropped = self._dropped
        for request_id in (*plan.finished_ids, *plan.preempted_ids):
            self._batch.pop(request_id, None)
            dropped.pop(request_id, None)
        for data in plan.new_requests:
            params = sampling.get(data.request_id)
            if params is None:
                raise ExecutorError(f"step {plan.step_id}: no SamplingParams for new request {data.request_id!r}")
            if self._bad_token is not None and self._bad_token in data.token_ids:
                self._failed[data.request_id] = dropped[data.request_id] = (
                    f"token {self._bad_token} cannot be embedded")
                continue
            self._batch[data.request_id] = _Sequence(
                list(data.token_ids), list(data.block_ids), data.num_computed_tokens, params,
                num_prompt_tokens=data.num_prompt_tokens)
        self._maybe_follow_request(plan)
        for request_id, block_ids in plan.new_block_ids.items():
            if request_id not in dropped:
                self._sequence(request_id).block_ids.extend(block_ids)
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[list[tuple[int, float]]]] = {}
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            if request_id in dropped:
                self._failed[request_id] = dropped[request_id]
                continue
            sequence = self._sequence(request_id)
            scored = fabricated_prompt_logprobs(
                sequence.token_ids, sequence.num_prompt_tokens, sequence.num_computed_tokens,
                num_tokens, sequence.sampling.prompt_logprobs, self.vocab_size)
            if scored is not None:
                self._prompt_logprobs[request_id] = scored
            token = self._advance(request_id, sequence, num_tokens)
            if token is None:
                continue
            sampled[request_id] = [token]
            wanted = self._batch[request_id].sampling.logprobs
            if wanted is not None:
                logprobs[request_id] = [fabricated_logprobs(token, wanted, self.vocab_size)]
        if self._step_delay_s:
            time.sleep(self._step_delay_s)
        elapsed_us = (time.perf_counter_ns() - start_ns) // 1000
        return StepResult(plan.step_id, sampled, logprobs or None, elapsed_us)

    def _maybe_fault(self, step_id: int) -> None:
        if self._hang_at_step is not None and step_id == self._hang_at_step:
            time.sleep(HANG_S)
        if self._exit_at_step is not None and step_id == self._exit_at_step:
            os._exit(EXIT_SIMULATED_CRASH)
        if self._fail_at_step is not None and step_id == self._fail_at_step:
            self._fail_at_step = None  # a transient fault: a retry of the step succeeds
            raise RuntimeError(f"simulated failure at step {step_id}")

    def _maybe_follow_request(self, plan: StepPlan) -> None:
        """Fail the whole step (raise or exit) when a scheduled request holds a marker token."""
        if self._crash_token is None and self._exit_token is None:
            return
        for request_id in plan.num_scheduled_tokens:
            sequence = self._batch.get(request_id)
            if sequence is None:
                continue
            if self._exit_token is not None and self._exit_token in sequence.token_ids:
                os._exit(EXIT_SIMULATED_CRASH)
            if self._crash_token is not None and self._crash_token in sequence.token_ids:
                raise RuntimeError(f"simulated fault following a request in step {plan.step_id}")

    def _sequence(self, request_id: str) -> _Sequence:
        sequence = self._batch.get(request_id)
        if sequence is None:
            raise ExecutorError(f"plan refers to request {request_id!r}, which is not in the batch")
        return sequence

    def _advance(self, request_id: str, sequence: _Sequence, num_tokens: int) -> int | None:
        computed = sequence.num_computed_tokens + num_tokens
        known = len(sequence.token_ids)
        if computed > known:
            raise ExecutorError(f"{request_id!r}: {computed} tokens scheduled but only {known} are known")
        capacity = len(sequence.block_ids) * self.block_size
        if computed > capacity:
            raise ExecutorError(
                f"{request_id!r}: {computed} tokens computed but its {len(sequence.block_ids)} blocks hold {capacity}"
            )
        sequence.num_computed_tokens = computed
        if computed < known:
            return None  # a prefill chunk short of the prompt's end samples nothing
        sequence.num_output_tokens += 1
        if self.eos_token_ids and self._eos_after and sequence.num_output_tokens == self._eos_after:
            token = self.eos_token_ids[0]
        else:
            token = deterministic_token(request_id, known, self.vocab_size)
        sequence.token_ids.append(token)
        return token


def fabricated_logprobs(token: int, num_alternatives: int, vocab_size: int) -> list[tuple[int, float]]:
    """The log-probabilities a simulated model reports for `token`: the sampled
    token at 0.0, then the next ids at -1, -2, ..."""
    alternatives = [((token + i) % vocab_size, -float(i)) for i in range(1, num_alternatives + 1)]
    return [(token, 0.0), *alternatives]


def fabricated_prompt_logprobs(token_ids: Sequence[int], num_prompt_tokens: int, start: int,
                               num_tokens: int, num_alternatives: int | None, vocab_size: int
                               ) -> tuple[int, list[list[tuple[int, float]]]] | None:
    """The prompt log-probabilities a simulated model reports when it computes
    positions [start, start + num_tokens): (first position scored, entries), or None
    when none of them scores a prompt token or none were asked for. The prompt
    token at position p gets -(p % PROMPT_LOGPROB_PERIOD) / PROMPT_LOGPROB_PERIOD,
    its alternatives follow as in `fabricated_logprobs`."""
    end = min(start + num_tokens, num_prompt_tokens - 1)
    if num_alternatives is None or start >= end:
        return None
    entries = []
    for position in range(start + 1, end + 1):
        token = token_ids[position]
        logprob = -(position % PROMPT_LOGPROB_PERIOD) / PROMPT_LOGPROB_PERIOD
        entries.append([(token, logprob), *fabricated_logprobs(token, num_alternatives, vocab_size)[1:]])
    return start + 1, entries


def build_runner(init: InitExecutor) -> ModelRunnerLike:
    """The default runner factory: the simulated model, or a `cadence.gpu` ModelRunner.

    A runner that takes structured output (`matcher_factory`) gets matchers built
    from the checkpoint's tokenizer, keeping up to the `grammar_cache_size` option
    (int) compiled grammars.

    A model name that is a preset of cadence.gpu gets random weights from
    `init.seed`; anything else is read as a Hugging Face checkpoint directory.
    Options understood for real models: attention_backend (str), fused_elementwise
    (bool, one device only: RMSNorm and SwiGLU as single Triton kernels),
    gpu_memory_utilization (float), max_num_seqs (int), num_threads ("auto" or
    int: torch's CPU threads, set here in the thread that runs the model before
    its first kernel; see cadence.gpu.threads), cpu_path ("auto", "packed" or
    "eager": how a CPU runner computes its products), pin_threads (bool: one core per
    compute thread, default on), and tp (int: shard the model
    across that many local ranks, see `_build_tensor_parallel_runner`).
    """
    runner = _build_model_runner(init)
    if hasattr(runner, "matcher_factory"):
        cache_size = int(init.options.get("grammar_cache_size", DEFAULT_GRAMMAR_CACHE_SIZE))
        runner.matcher_factory = checkpoint_matchers(init.model, runner.vocab_size, runner.eos_token_ids,
                                                     cache_size)
    return runner


def _build_model_runner(init: InitExecutor) -> ModelRunnerLike:
    if init.model == SIMULATED_MODEL:
        return DeterministicRunner(init)
    try:
        # torch is imported only here, so the simulated model never pays for it.
        from cadence.gpu import config as gpu_config
        from cadence.gpu import runner as gpu_runner
    except ImportError as exc:
        raise ExecutorError(
            f"model {init.model!r} needs cadence.gpu.runner, which could not be imported: {exc}"
        ) from exc
    tp = int(init.options.get("tp", 1))
    if tp > 1:
        return _build_tensor_parallel_runner(init, tp)
    model_runner = gpu_runner.ModelRunner
    from_init = getattr(model_runner, "from_init", None)
    if from_init is not None:
        return from_init(init)
    options = init.options
    kwargs: dict[str, Any] = {
        "num_blocks": init.num_blocks or None,
        "block_size": init.block_size,
        "device": init.device,
        "dtype": init.dtype or None,
        "seed": init.seed,
        "max_num_batched_tokens": init.max_num_batched_tokens,
        # The engine's model thread is the runner's own: its compute threads get cores.
        "pin_threads": True,
    }
    for name in ("attention_backend", "gpu_memory_utilization", "max_num_seqs", "fused_elementwise",
                 "num_threads", "cpu_path", "pin_threads", "prefault_blocks"):
        if name in options:
            kwargs[name] = options[name]
    if init.model in gpu_config.PRESETS:
        return model_runner(gpu_config.preset(init.model), **kwargs)
    return model_runner.from_pretrained(init.model, **kwargs)


def _build_tensor_parallel_runner(init: InitExecutor, tp: int) -> ModelRunnerLike:
    """Rank 0 of `tp` ranks on this machine; the others are spawned here and die with this process.

    Options: tp_timeout_s (float: how long a collective waits for a dead or
    stuck rank before the step fails), tp_num_threads (int: torch threads per rank).
    """
    from cadence.gpu import parallel

    spec: dict[str, Any] = {
        "model": init.model,
        "num_blocks": init.num_blocks or None,
        "block_size": init.block_size,
        "device": init.device,
        "dtype": init.dtype or None,
        "seed": init.seed,
        "max_num_batched_tokens": init.max_num_batched_tokens,
        # The engine's model thread is the runner's own: its compute threads get cores.
        "pin_threads": True,
    }
    for name in ("attention_backend", "gpu_memory_utilization", "max_num_seqs", "prefault_blocks"):
        if name in init.options:
            spec[name] = init.options[name]
    timeout_s = float(init.options.get("tp_timeout_s", parallel.DEFAULT_TIMEOUT_S))
    launched = parallel.launched_rank()
    if launched is not None:
        # Started by a launcher (torchrun, possibly across machines): join its group.
        if launched[1] != tp:
            raise ConfigError(f"tp is {tp} but the launcher started WORLD_SIZE={launched[1]} ranks")
        return parallel.join_launched_group(spec, timeout_s)
    num_threads = init.options.get("tp_num_threads")
    return parallel.start_local_runner(
        tp, spec, timeout_s=timeout_s,
        num_threads=None if num_threads is None else int(num_threads),
    )


def ready_from_runner(runner: Any, init: InitExecutor) -> Ready:
    """The `Ready` answer for a runner built from `init`.

    vocab_size and eos_token_ids are read from the runner, or from its model
    config when the runner does not expose them; max_model_len is the smaller
    of what was asked and what the model computes exactly.
    """
    config = getattr(runner, "config", None)
    vocab_size = getattr(runner, "vocab_size", None) or getattr(config, "vocab_size")
    eos_token_ids = getattr(runner, "eos_token_ids", None)
    if eos_token_ids is None:
        eos_token_ids = getattr(config, "eos_token_ids", ())
    window = getattr(config, "sliding_window", None)
    if window is not None and window < init.max_model_len:
        # Attention over the whole sequence equals the checkpoint's sliding window only within it.
        raise ConfigError(f"model {init.model!r} uses sliding-window attention (sliding_window "
                          f"{window}), which Cadence computes exactly only up to the window; "
                          f"max_model_len {init.max_model_len} is longer: pass max_model_len <= {window}")
    max_model_len = min(init.max_model_len, getattr(runner, "max_model_len", init.max_model_len))
    return Ready(
        num_blocks=int(runner.num_blocks),
        block_size=int(getattr(runner, "block_size", init.block_size)),
        vocab_size=int(vocab_size),
        eos_token_ids=[int(t) for t in eos_token_ids],
        max_model_len=int(max_model_len),
    )


def _failure(step_id: int | None, exc: BaseException) -> ExecutorFailed:
    return ExecutorFailed(step_id, f"{type(exc).__name__}: {exc}", traceback.format_exc())


class _Heartbeat:
    """Sends a Heartbeat frame every `interval_s` while the main thread works on a
    request, from a thread of its own: a stopped or frozen process sends none,
    a merely slow step goes on beating."""

    def __init__(self, sock: socket.socket, lock: threading.Lock, interval_s: float) -> None:
        self._sock, self._lock, self._interval_s = sock, lock, interval_s
        self._busy = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cadence-heartbeat", daemon=True)
        self._thread.start()

    def busy(self, working: bool) -> None:
        """Beat from now on (True) or stop beating (False)."""
        if working:
            self._busy.set()
        else:
            self._busy.clear()

    def stop(self) -> None:
        """End the thread."""
        self._stopped.set()
        self._busy.set()

    def _run(self) -> None:
        frame = encode(Heartbeat())
        while not self._stopped.is_set():
            self._busy.wait()
            if self._stopped.wait(self._interval_s):
                return
            if not self._busy.is_set():
                continue
            with self._lock:
                try:
                    send_frame_sync(self._sock, frame)
                except OSError:
                    return  # the parent went away; the main thread finds out too


class _Replier:
    """The worker's side of the socket: replies, and heartbeats while it works."""

    def __init__(self, sock: socket.socket, heartbeat_s: float | None) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self._heartbeat = None if heartbeat_s is None else _Heartbeat(sock, self._lock, heartbeat_s)

    def working(self) -> None:
        """A request arrived: beat until it is answered."""
        if self._heartbeat is not None:
            self._heartbeat.busy(True)

    def send(self, payload: bytes) -> None:
        """Answer the request in hand."""
        if self._heartbeat is not None:
            self._heartbeat.busy(False)
        with self._lock:
            send_frame_sync(self._sock, payload)

    def close(self) -> None:
        """Stop the heartbeat thread."""
        if self._heartbeat is not None:
            self._heartbeat.stop()


def serve(sock: socket.socket, runner_factory: RunnerFactory = build_runner,
          heartbeat_s: float | None = None) -> int:
    """Serve one scheduler over `sock` until Shutdown or end of stream; returns the exit code.

    heartbeat_s: send a Heartbeat this often while building the runner or running a step.
    """
    replier = _Replier(sock, heartbeat_s)
    try:
        return _serve(sock, replier, runner_factory)
    finally:
        replier.close()


def _serve(sock: socket.socket, replier: _Replier, runner_factory: RunnerFactory) -> int:
    frame = receive_frame_sync(sock)
    if frame is None:
        return EXIT_OK
    replier.working()
    try:
        init = decode(frame)
        if not isinstance(init, InitExecutor):
            raise ProtocolError(f"expected InitExecutor first, got {type(init).__name__}")
    except ProtocolError as exc:
        replier.send(encode(_failure(None, exc)))
        return EXIT_PROTOCOL_ERROR
    try:
        runner = runner_factory(init)
        ready = ready_from_runner(runner, init)
    except Exception as exc:
        replier.send(encode(_failure(None, exc)))
        return EXIT_RUNNER_FAILED
    replier.send(encode(ready))
    while (frame := receive_frame_sync(sock)) is not None:
        replier.working()
        try:
            message = decode(frame)
        except ProtocolError as exc:
            # The framing is intact, so the stream is still in step: report and go on.
            replier.send(encode(_failure(None, exc)))
            continue
        if isinstance(message, Shutdown):
            break
        if not isinstance(message, ExecuteStep):
            replier.send(encode(ExecutorFailed(None, f"unexpected {type(message).__name__}")))
            continue
        try:
            payload = encode(run_step(runner, message))
        except Exception as exc:
            payload = encode(_failure(message.plan.step_id, exc))
        replier.send(payload)
    close = getattr(runner, "close", None)
    if close is not None:
        close()
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Entry point of the child process."""
    parser = argparse.ArgumentParser(prog="python -m cadence.actors.executor_worker")
    parser.add_argument("--fd", type=int, required=True, help="inherited connected Unix stream socket")
    parser.add_argument("--heartbeat-s", type=float, default=None,
                        help="send a Heartbeat this often while working (default: never)")
    args = parser.parse_args(argv)
    # A Ctrl-C in the terminal reaches the whole process group; the parent
    # decides when this process ends (Shutdown, end of stream or SIGKILL).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=args.fd)
    try:
        return serve(sock, heartbeat_s=args.heartbeat_s)
    except (BrokenPipeError, ConnectionResetError):
        return EXIT_OK  # the parent went away; nobody is left to tell
    except ProtocolError as exc:
        print(f"executor worker: {exc}", file=sys.stderr)
        return EXIT_PROTOCOL_ERROR
    finally:
        sock.close()


if __name__ == "__main__":
    sys.exit(main())
