"""The request actor: one Trio task per request, between the scheduler and the consumer.

The scheduler actor delivers the core's `RequestEvent`s to the actor's mailbox;
the actor drives its own `RequestFSM` with them (so an illegal sequence across
the boundary raises `IllegalTransition` at once), turns tokens into text
(incremental detokenisation, stop strings), enforces the request's timeout,
and hands `RequestOutput` deltas to whoever consumes the request.

Neither side ever blocks the other. The mailbox is a list the scheduler
appends to synchronously: it holds at most the events of one request, i.e.
one per generated token plus one per admission, preemption or executor loss,
and it is drained whole at every wake-up. The consumer side is a coalescing
buffer: a slow consumer receives one merged delta instead of many, so what
waits for it is bounded by the request's own output.

Hand-off: the mailbox is drained, in order and exactly once, by whichever of
the request's two tasks runs first. When the consumer is already waiting for
output, the scheduler wakes it directly and it applies the events itself, so
a token costs one task switch rather than two; otherwise the actor task is
woken and applies them (enforcing stop strings and coalescing output however
slow the consumer is). Both run the same synchronous `_drain`, so the FSM,
text and stop-string handling are the actor's either way; an illegal event
raises in the consumer and is re-raised by the actor task, failing the engine.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, NamedTuple

import attrs
import trio
from trio.lowlevel import Abort, current_task, reschedule, wait_task_rescheduled

from cadence.statemachine.errors import ExecutorError, IllegalTransition
from cadence.statemachine.fsm import FinishReason, RequestEventKind, RequestFSM, RequestState
from cadence.statemachine.plan import RequestEvent
from cadence.statemachine.request import Request
from cadence.statemachine.sampling import SamplingParams

from .detokenizer import TextAssembler

__all__ = ["RequestOutput", "RequestResult", "RequestActor", "CompletionOutput", "Logprob",
           "RequestMetrics"]

_RUNNING = RequestState.RUNNING
_FAIL = RequestEventKind.FAIL
_REASON_NAMES = {reason: reason.value for reason in FinishReason}


class RequestOutput(NamedTuple):
    """One streamed delta of a request (immutable).

    token_ids: tokens generated since the previous delta.
    text: their text (None when the engine has no tokenizer); text that may
      begin a stop string or an incomplete UTF-8 character is held back.
    num_tokens: tokens generated so far, this delta included.
    finish_reason: None until the last delta; then "stop", "length", "abort"
      or "rejected". detail says more ("timeout", "stop string", ...).
    arrival_s, first_token_s, now_s: Trio clock times of submission, of the
      first generated token (None before it) and of this delta.
    num_cached_tokens: prompt tokens found in the prefix cache at admission.
    logprobs: when the request asked for `logprobs`, one list per token of
      token_ids: (token id, logprob) pairs, the sampled token first, then the
      top alternatives; None otherwise.
    prompt_logprobs: when the request asked for `prompt_logprobs`, on its first
      delta only: one entry per prompt token, None for the first (nothing
      precedes it), else (token id, logprob) pairs, that prompt token first.
    """

    # A named tuple rather than an attrs class: one is built per delta on the
    # hot path, and a frozen attrs class costs about three times as much to build.
    request_id: str
    token_ids: list[int]
    text: str | None
    num_tokens: int
    finish_reason: str | None
    detail: str
    arrival_s: float
    first_token_s: float | None
    now_s: float
    num_cached_tokens: int
    logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    # On the last delta of a request that stopped: the stop string or stop token id
    # that ended it (None for end-of-sequence or any other end), as vLLM reports it.
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        """Whether this is the request's last delta."""
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """This delta in vLLM's shape: one `CompletionOutput` holding the new tokens."""
        logprobs = None if self.logprobs is None else [_candidates(entry) for entry in self.logprobs]
        return [CompletionOutput(
            index=0, text=self.text if self.text is not None else "", token_ids=list(self.token_ids),
            cumulative_logprob=None, logprobs=logprobs, finish_reason=self.finish_reason,
            stop_reason=self.stop_reason)]


@attrs.frozen
class Logprob:
    """One candidate token's log-probability at a position; rank 1 is the most likely;
    decoded_token is its text (when the result knows its tokenizer)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@attrs.frozen
class CompletionOutput:
    """One completion of a request, with the attribute names vLLM users know.

    logprobs: per generated token, {token id: Logprob} for the sampled token and
    the top alternatives (None unless the request asked for logprobs);
    cumulative_logprob: the sum of the sampled tokens' logprobs (None likewise).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    # The stop string or stop token id that ended the completion (None otherwise).
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        """Whether the completion has ended."""
        return self.finish_reason is not None


@attrs.frozen
class RequestMetrics:
    """A finished request's times (Trio clock seconds) and prefix-cache hits."""

    arrival_time: float
    first_token_time: float | None
    finished_time: float
    num_cached_tokens: int


def _candidates(entry: list[tuple[int, float]] | None,
                decode: Callable[[int], str] | None = None) -> dict[int, Logprob] | None:
    """vLLM's per-position shape from (token id, logprob) pairs, the sampled token
    first; `decode` gives each token's text (`decoded_token`)."""
    if entry is None:
        return None
    text = decode if decode is not None else _no_text
    (sampled, sampled_logprob), alternatives = entry[0], entry[1:]
    out = {token: Logprob(logprob, rank, text(token))
           for rank, (token, logprob) in enumerate(alternatives, 1)}
    if sampled not in out:
        rank = 1 + sum(1 for _, logprob in alternatives if logprob > sampled_logprob)
        out = {sampled: Logprob(sampled_logprob, rank, text(sampled)), **out}
    return out


def _no_text(token_id: int) -> None:
    return None


@attrs.frozen
class RequestResult:
    """A finished request as a whole: every token and all of its text.

    It also answers to vLLM's `RequestOutput` names: `prompt`,
    `prompt_token_ids`, `prompt_logprobs`, `outputs` (one `CompletionOutput`),
    `finished`, `metrics`. `prompt_token_logprobs` holds the prompt's
    log-probabilities as `RequestOutput.prompt_logprobs` does.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    detail: str
    arrival_s: float
    first_token_s: float | None
    finish_s: float
    num_cached_tokens: int
    logprobs: list[list[tuple[int, float]]] | None = None
    prompt: str | None = None
    prompt_token_logprobs: list[list[tuple[int, float]] | None] | None = None
    # The stop string or stop token id that ended the request (None otherwise).
    stop_reason: str | int | None = None
    # The other samples of its prompt when it asked for n > 1 (LLM.generate): `outputs`
    # then holds one completion per sample.
    samples: list[RequestResult] = attrs.field(factory=list, repr=False)
    # The text of one token id, for Logprob.decoded_token (None: not known).
    token_text: Callable[[int], str] | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def finished(self) -> bool:
        """Always true: a result is built once its request has ended."""
        return True

    @property
    def prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """vLLM's shape of the prompt's log-probabilities: per prompt token, None for
        the first, else {token id: Logprob} for that token and the top alternatives
        (None unless the request asked for `prompt_logprobs`)."""
        if self.prompt_token_logprobs is None:
            return None
        return [_candidates(entry, self.token_text) for entry in self.prompt_token_logprobs]

    @property
    def outputs(self) -> list[CompletionOutput]:
        """The request's completions in vLLM's shape: its own, then its samples'."""
        return [self._completion(0)] + [sample._completion(index)
                                        for index, sample in enumerate(self.samples, 1)]

    def _completion(self, index: int) -> CompletionOutput:
        logprobs = cumulative = None
        if self.logprobs is not None:
            logprobs = [_candidates(entry, self.token_text) for entry in self.logprobs]
            cumulative = sum(entry[0][1] for entry in self.logprobs if entry is not None)
        return CompletionOutput(
            index=index, text=self.text if self.text is not None else "", token_ids=list(self.token_ids),
            cumulative_logprob=cumulative, logprobs=logprobs, finish_reason=self.finish_reason,
            stop_reason=self.stop_reason)

    @property
    def metrics(self) -> RequestMetrics:
        """Arrival, first-token and finish times, and prefix-cache hits."""
        return RequestMetrics(self.arrival_s, self.first_token_s, self.finish_s, self.num_cached_tokens)


class RequestActor:
    """The per-request task: FSM, text, stop strings, timeout and output buffer.

    `deliver` is called by the scheduler actor (synchronously, never blocks);
    `next_output` by the consumer; `run` is the actor's own task.
    """

    __slots__ = (
        "request", "request_id", "params", "fsm", "deadline_s", "_abort", "_assembler",
        "_events", "_waiter", "_consumer", "_accepted", "_error", "_out_tokens", "_out_text",
        "_num_tokens", "_finish_reason", "_detail", "_final_taken", "_abort_sent",
        "_fault", "first_token_s", "_out_logprobs", "_prompt_logprobs", "_prompt_logprobs_sent",
        "_stop_reason", "_last_token",
    )

    def __init__(self, request: Request, params: SamplingParams,
                 abort: Callable[[str, str], None], assembler: TextAssembler | None = None,
                 timeout_s: float | None = None) -> None:
        self.request = request
        self.request_id = request.request_id
        self.params = params
        self.fsm = RequestFSM(request.request_id)
        self.deadline_s = request.arrival_s + timeout_s if timeout_s is not None else math.inf
        self._abort = abort
        self._assembler = assembler
        self._events: list[RequestEvent] = []
        self._waiter = None
        self._consumer = None
        self._accepted = False
        self._error: BaseException | None = None
        self._out_tokens: list[int] = []
        self._out_text: list[str] | None = [] if assembler is not None else None
        # Log-probabilities of the tokens in _out_tokens, one entry each, once any arrived.
        self._out_logprobs: list[list[tuple[int, float]] | None] | None = None
        self._num_tokens = 0
        self._finish_reason: str | None = None
        self._detail = ""
        self._final_taken = False
        self._abort_sent = False
        self._fault: IllegalTransition | None = None
        self.first_token_s: float | None = None
        # One entry per prompt token once any arrived; handed out with the first delta.
        self._prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
        self._prompt_logprobs_sent = False
        self._stop_reason: str | int | None = None
        self._last_token: int | None = None

    # ---- scheduler side --------------------------------------------------------
    def deliver(self, event: RequestEvent) -> None:
        """Queue one event and wake the task that will apply it: the consumer if it
        is waiting for output, else the actor task."""
        self._events.append(event)
        consumer = self._consumer
        if consumer is not None:
            self._consumer = None
            reschedule(consumer)
        else:
            self._wake_actor()

    def add_prompt_logprobs(self, first_position: int, entries: list[list[tuple[int, float]]]) -> None:
        """Record the log-probabilities of the prompt tokens from `first_position` on
        (called by the scheduler actor; a prompt computed again after a preemption
        repeats what the first delta already carried, and is ignored)."""
        if self._prompt_logprobs_sent:
            return
        scored = self._prompt_logprobs
        if scored is None:
            scored = self._prompt_logprobs = [None] * self.request.num_prompt_tokens
        end = min(first_position + len(entries), len(scored))
        scored[first_position:end] = entries[: end - first_position]

    def accept(self) -> None:
        """The core accepted the request."""
        self._accepted = True
        self._wake_consumer()

    def refuse(self, error: BaseException) -> None:
        """The request never entered the core: its submitter raises `error`."""
        self._error = error
        self._wake_consumer()

    @property
    def accepted(self) -> bool:
        """Whether the core accepted the request."""
        return self._accepted

    @property
    def withdrawn(self) -> bool:
        """Whether the consumer gave up before the core accepted the request."""
        return not self._accepted and self._finish_reason is not None

    def close_stream(self, error: BaseException) -> None:
        """End the consumer's stream with `error` (engine closing or failed)."""
        if self._finish_reason is None:
            self._error = error
            self._finish_reason = "error"
        self._wake_consumer()

    @property
    def finished(self) -> bool:
        """Whether the actor's FSM reached Completed."""
        return self.fsm.state is RequestState.COMPLETED

    # ---- the actor task --------------------------------------------------------
    async def run(self) -> None:
        """Apply delivered events until the request completes."""
        try:
            if self.deadline_s < math.inf:
                with trio.move_on_at(self.deadline_s):
                    await self._drive()
                if not self.finished:
                    self._end_stream("abort", "timeout")
                    self._send_abort("timeout")
            await self._drive()
        finally:
            if not self.finished:
                self._send_abort("cancelled")

    async def _drive(self) -> None:
        while self.fsm.state is not RequestState.COMPLETED:
            if self._fault is not None:
                raise self._fault
            if not self._events:
                self._waiter = current_task()
                await wait_task_rescheduled(self._abort_wait)
            self._drain()

    def _abort_wait(self, raise_cancel) -> Abort:
        self._waiter = None
        return Abort.SUCCEEDED

    def _wake_actor(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            reschedule(waiter)

    def _drain(self) -> None:
        """Apply every queued event, in order (called by either request-side task)."""
        events = self._events
        if events:
            try:
                self._apply(events)
            finally:
                events.clear()

    def _apply(self, events: list[RequestEvent]) -> None:
        fsm = self.fsm
        for event in events:
            kind = event.transition
            tokens = event.token_ids
            if tokens:
                if fsm.state is not _RUNNING:
                    raise IllegalTransition(
                        f"request {self.request_id!r}: tokens arrived while {fsm.state.value}")
                if self._finish_reason is None:
                    self._on_tokens(tokens, event.logprobs)
            if kind is None:
                continue
            fsm.fire(kind, event.finish_reason)
            if fsm.state is RequestState.COMPLETED:
                self._on_complete(event)
                self._wake_actor()  # so its task ends, if the consumer applied this
        self._wake_consumer()

    def _on_tokens(self, tokens, logprobs=None) -> None:
        if self.first_token_s is None:
            self.first_token_s = trio.current_time()
        if tokens:
            self._last_token = tokens[-1]
        out_logprobs = self._out_logprobs
        if logprobs is not None and out_logprobs is None:
            # The first log-probabilities of this delta: earlier tokens in it had none.
            out_logprobs = self._out_logprobs = [None] * len(self._out_tokens)
        assembler = self._assembler
        if assembler is None:
            self._out_tokens.extend(tokens)
            self._num_tokens += len(tokens)
            if out_logprobs is not None:
                _extend_aligned(out_logprobs, logprobs, 0, len(tokens))
            return
        out_tokens, out_text = self._out_tokens, self._out_text
        # A stop token (or end-of-sequence) ends the request and is no part of its text,
        # unless include_stop_str_in_output asks for it (as in vLLM).
        silent = () if self.params.include_stop_str_in_output else self.request.stop_token_set
        for i, token in enumerate(tokens):
            out_tokens.append(token)
            self._num_tokens += 1
            if out_logprobs is not None:
                _extend_aligned(out_logprobs, logprobs, i, i + 1)
            if token in silent:
                continue
            text, stopped = assembler.push(token)
            if text:
                out_text.append(text)
            if stopped:
                self._last_token = token
                self._stop_reason = assembler.matcher.matched
                self._end_stream("stop", "stop string")
                self._send_abort("stop string")
                return

    def _on_complete(self, event: RequestEvent) -> None:
        if self._finish_reason is not None:
            return  # the consumer's stream already ended (stop string, timeout, close)
        reason = event.finish_reason
        if event.transition is _FAIL:
            self._error = ExecutorError(event.detail or f"request {self.request_id!r} failed")
            self._end_stream("error", event.detail)
            return
        if reason is FinishReason.STOP:
            token, params = self._last_token, self.params
            if token in params.stop_token_ids and (params.ignore_eos
                                                   or token not in self.request.limits.eos_token_ids):
                self._stop_reason = token
        if reason is FinishReason.STOP or reason is FinishReason.LENGTH:
            if self._assembler is not None:
                tail = self._assembler.flush()
                if tail:
                    self._out_text.append(tail)
        self._end_stream(_REASON_NAMES[reason], event.detail)

    def _end_stream(self, reason: str, detail: str) -> None:
        self._finish_reason = reason
        self._detail = detail
        self._wake_consumer()

    def _send_abort(self, detail: str) -> None:
        if not self._abort_sent:
            self._abort_sent = True
            self._abort(self.request_id, detail)

    # ---- consumer side ---------------------------------------------------------
    def cancel(self, detail: str = "cancelled") -> None:
        """The consumer gave up: end its stream and abort the request (synchronous,
        so it is safe in a cancelled or finalising context)."""
        if self._finish_reason is None:
            self._end_stream("abort", detail)
        if self._accepted and not self.finished:
            self._send_abort(detail)
        if self._events:
            self._wake_actor()  # the consumer will not apply them any more

    @property
    def num_undelivered_tokens(self) -> int:
        """Tokens produced that the consumer has not taken yet: what a consumer that
        does not keep up lets pile up (its next delta holds them)."""
        return len(self._out_tokens) + sum(len(event.token_ids) for event in self._events
                                           if event.token_ids)

    @property
    def stream_done(self) -> bool:
        """Whether the consumer has taken the last delta (or the error)."""
        return self._final_taken

    async def wait_accepted(self) -> None:
        """Wait until the core accepted the request; raise why it refused it."""
        while not self._accepted:
            if self._error is not None:
                raise self._error
            await self._wait_for_output()
        await trio.lowlevel.checkpoint_if_cancelled()

    def poll_output(self) -> RequestOutput | None:
        """The next delta if one is ready (everything produced since the last one,
        merged), else None; raises StopAsyncIteration after the last delta, or the
        request's error."""
        if self._events:
            self._drain_as_consumer()
        if self._final_taken:
            raise StopAsyncIteration
        if self._error is not None:
            self._final_taken = True
            raise self._error
        if self._out_tokens or self._out_text or self._finish_reason is not None:
            return self._take_output()
        return None

    async def next_output(self) -> RequestOutput:
        """Wait for the next delta; raises like `poll_output`."""
        out = self.poll_output()
        if out is not None:
            await trio.lowlevel.checkpoint_if_cancelled()
            return out
        while out is None:
            await self._wait_for_output()
            out = self.poll_output()
        return out

    def _drain_as_consumer(self) -> None:
        try:
            self._drain()
        except IllegalTransition as exc:
            self._fault = exc
            self._wake_actor()
            raise

    async def _wait_for_output(self) -> None:
        self._consumer = current_task()
        await wait_task_rescheduled(self._abort_consumer_wait)

    def _abort_consumer_wait(self, raise_cancel) -> Abort:
        self._consumer = None
        if self._events:
            self._wake_actor()
        return Abort.SUCCEEDED

    def _wake_consumer(self) -> None:
        consumer = self._consumer
        if consumer is not None:
            self._consumer = None
            reschedule(consumer)

    def _take_output(self) -> RequestOutput:
        tokens, self._out_tokens = self._out_tokens, []
        logprobs, self._out_logprobs = self._out_logprobs, None
        text = None
        if self._out_text is not None:
            text = "".join(self._out_text)
            self._out_text.clear()
        reason = self._finish_reason
        if reason is not None:
            self._final_taken = True
        prompt_logprobs = None
        if self.params.prompt_logprobs is not None and not self._prompt_logprobs_sent:
            self._prompt_logprobs_sent = True
            prompt_logprobs = self._prompt_logprobs or [None] * self.request.num_prompt_tokens
        return RequestOutput(self.request_id, tokens, text, self._num_tokens, reason,
                             self._detail if reason is not None else "", self.request.arrival_s,
                             self.first_token_s, trio.current_time(), self.request.num_cached_tokens,
                             logprobs, prompt_logprobs, self._stop_reason if reason is not None else None)


def join_logprobs(deltas: Iterable[tuple[int, list | None]]) -> list | None:
    """The log-probabilities of a whole stream from its deltas' (number of tokens,
    logprobs) pairs: one entry per token (None where a delta had none), or None
    if no delta had any."""
    out: list = []
    seen = False
    for num_tokens, logprobs in deltas:
        if logprobs is None:
            out.extend([None] * num_tokens)
        else:
            seen = True
            out.extend(logprobs)
    return out if seen else None


def _extend_aligned(out: list, logprobs: list | None, start: int, end: int) -> None:
    """Append the log-probabilities of tokens[start:end] (None where there are none)."""
    for i in range(start, end):
        out.append(logprobs[i] if logprobs is not None and i < len(logprobs) else None)
