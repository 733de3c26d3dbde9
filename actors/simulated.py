"""An executor with no model: a latency model, deterministic tokens, and faults.

`SimulatedExecutor` implements `ExecutorBackend` the way a real executor
does (it keeps a persistent batch keyed by request id, applies each plan's
deltas, and samples only when a request has computed all of its known
tokens) but its "forward pass" is a `trio.sleep` whose length a
`LatencyModel` gives (virtual under a MockClock) and its tokens are a pure
function of (seed, request id, position). The same request therefore gets the
same tokens however it was batched, preempted or recomputed, which makes the
expected output of every request known in advance.

A request with structured output draws its token the same way, then, if the
grammar does not allow it, takes an allowed token chosen by it (still a pure
function of the request and its history); its matcher is rebuilt from the
output tokens whenever the request arrives in full, as in the real runner.
The engine gives the executor its `matcher_factory`; without one, such a
request fails alone.

A `FaultPlan` makes chosen (or seeded random) execute calls misbehave, so the
scheduler actor's supervision can be exercised: crash, hang, slow step, and
answers for an older step (duplicate / stale).
"""

from __future__ import annotations

import enum
import zlib
from collections import deque
from typing import Callable, Mapping, Sequence

import attrs
import trio

from cadence.statemachine.errors import ExecutorError
from cadence.statemachine.plan import StepPlan, StepResult

from .executor_worker import fabricated_logprobs, fabricated_prompt_logprobs
from .messages import ExecuteStep, InitExecutor, PromptLogprobs, Ready, StepOutput

__all__ = ["LatencyModel", "ZERO_LATENCY", "Fault", "Poison", "FaultPlan", "SimulatedExecutor",
           "simulated_token"]

_MASK64 = (1 << 64) - 1
# Results remembered for replaying as stale answers.
_HISTORY = 4
# The cache size reported when the scheduler leaves it to the executor (num_blocks 0).
DEFAULT_NUM_BLOCKS = 8192


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijective scramble of 64 bits."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _request_key(seed: int, request_id: str) -> int:
    return _mix64((seed & 0xFFFFFFFF) << 32 | zlib.crc32(request_id.encode("utf-8")))


def simulated_token(seed: int, request_id: str, position: int, *, vocab_size: int = 32000,
                    eos_token_id: int | None = None, eos_probability: float = 0.0,
                    sample_ids: Sequence[int] | None = None) -> int:
    """The token a `SimulatedExecutor` with these settings samples at `position`
    (0-based over prompt plus output) of `request_id`."""
    return _token(_request_key(seed, request_id), position, vocab_size, eos_token_id,
                  int(eos_probability * (1 << 32)), sample_ids)


def _token(key: int, position: int, vocab_size: int, eos: int | None, eos_threshold: int,
           sample_ids: Sequence[int] | None) -> int:
    x = _mix64(key ^ position)
    if eos is not None and (x & 0xFFFFFFFF) < eos_threshold:
        return eos
    if sample_ids is not None:
        return sample_ids[(x >> 32) % len(sample_ids)]
    token = (x >> 32) % vocab_size
    if token == eos:
        token = (token + 1) % vocab_size
    return token


@attrs.frozen
class LatencyModel:
    """How long a simulated step takes (microseconds): on the device, a fixed cost plus
    a cost per prefill token plus a cost per decoding sequence; before it, `host_us`
    on the host (input preparation and output handling). The host works on one step
    at a time and so does the device; a step handed over while the previous one is
    still on the device has its host part done meanwhile."""

    base_us: float = attrs.field(default=2000.0, validator=attrs.validators.ge(0))
    prefill_us_per_token: float = attrs.field(default=20.0, validator=attrs.validators.ge(0))
    decode_us_per_seq: float = attrs.field(default=100.0, validator=attrs.validators.ge(0))
    host_us: float = attrs.field(default=0.0, validator=attrs.validators.ge(0))

    def step_us(self, num_prefill_tokens: int, num_decode_seqs: int) -> float:
        """Duration of one step in microseconds."""
        return (self.base_us + self.prefill_us_per_token * num_prefill_tokens
                + self.decode_us_per_seq * num_decode_seqs)


ZERO_LATENCY = LatencyModel(0.0, 0.0, 0.0)


class SimulatedCall:
    """A step handed to the simulated executor: its answer, or its failure, at the
    virtual time the device finishes it."""

    __slots__ = ("_answer", "_error", "_done_s", "_hang")

    def __init__(self, answer: StepOutput | None = None, error: ExecutorError | None = None,
                 done_s: float = 0.0, hang: bool = False) -> None:
        self._answer, self._error, self._done_s, self._hang = answer, error, done_s, hang

    async def result(self) -> StepOutput:
        """Wait until the step is done and return its output (or raise its failure)."""
        if self._hang:
            await trio.sleep_forever()
        if self._done_s > trio.current_time():
            await trio.sleep_until(self._done_s)
        else:
            await trio.lowlevel.checkpoint()
        if self._error is not None:
            raise self._error
        return self._answer


class Fault(enum.Enum):
    """How one execute call misbehaves.

    CRASH: raise ExecutorError; the executor stays dead until restarted.
    HANG: never answer (the caller's step timeout must fire).
    SLOW: take `FaultPlan.slow_factor` times the modelled latency.
    DUPLICATE: run the step but answer with the previous step's output again.
    STALE: run the step but answer with an output from several steps back.
    """

    CRASH = "crash"
    HANG = "hang"
    SLOW = "slow"
    DUPLICATE = "duplicate"
    STALE = "stale"


class Poison(enum.Enum):
    """How the executor fails whenever one given request is in a step: a fault
    that follows a request, not the executor.

    CRASH: the step raises ExecutorError, naming no request.
    HANG: the step never answers.
    REPORTED: the executor names the request in `StepOutput.failed` and serves the rest.
    """

    CRASH = "crash"
    HANG = "hang"
    REPORTED = "reported"


@attrs.frozen
class FaultPlan:
    """Which execute calls misbehave.

    at: execute call number (0-based, counted across restarts) -> fault.
    probabilities: per-call chance of each fault for calls not in `at`, drawn
      from `seed` and the call number, so the same plan always hits the same calls.
    slow_factor: latency multiplier of a SLOW call.
    fail_starts: start call numbers (0 is the first start) that raise ExecutorError.
    heal_after: calls from this number on never fault (None: no healed phase).
    poison: request id (str), or a token id (int) that marks any request whose
      tokens hold it -> how every execute call that schedules it fails (whatever
      `heal_after` says: the fault follows the request).
    """

    at: Mapping[int, Fault] = attrs.field(factory=dict)
    probabilities: Mapping[Fault, float] = attrs.field(factory=dict)
    seed: int = 0
    slow_factor: float = attrs.field(default=10.0, validator=attrs.validators.ge(1.0))
    fail_starts: frozenset[int] = attrs.field(default=frozenset(), converter=frozenset)
    heal_after: int | None = None
    poison: Mapping[str | int, Poison] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if any(p < 0 for p in self.probabilities.values()) or sum(self.probabilities.values()) > 1:
            raise ValueError("fault probabilities must be >= 0 and sum to at most 1")

    def fault_for(self, call: int) -> Fault | None:
        """The fault of execute call number `call`, or None."""
        if self.heal_after is not None and call >= self.heal_after:
            return None
        fault = self.at.get(call)
        if fault is not None or not self.probabilities:
            return fault
        u = _mix64((self.seed & _MASK64) ^ _mix64(call)) / float(1 << 64)
        for kind in Fault:  # fixed order, so a seed means one schedule
            u -= self.probabilities.get(kind, 0.0)
            if u < 0:
                return kind
        return None


class _Sequence:
    """One request in the persistent batch."""

    __slots__ = ("key", "token_ids", "num_prompt_tokens", "num_computed_tokens", "block_ids",
                 "logprobs", "prompt_logprobs", "matcher")

    def __init__(self, key: int, token_ids: list[int], num_prompt_tokens: int,
                 num_computed_tokens: int, block_ids: list[int], logprobs: int | None = None,
                 prompt_logprobs: int | None = None, matcher=None) -> None:
        self.logprobs = logprobs  # alternatives to report per sampled token (None: no logprobs)
        self.prompt_logprobs = prompt_logprobs  # likewise per prompt token
        self.matcher = matcher  # the structured output's grammar matcher, if it has one
        self.key = key
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.num_computed_tokens = num_computed_tokens
        self.block_ids = block_ids


class SimulatedExecutor:
    """`ExecutorBackend` without a model: latency from a `LatencyModel`, tokens
    from `simulated_token`, faults from a `FaultPlan`.

    sample_ids: the ids tokens are drawn from (default: all of range(vocab_size)
      except the end-of-sequence id); the engine narrows it to printable bytes
      when it pairs this executor with the byte tokenizer.
    eos_probability: chance that a sampled token is `eos_token_id`.
    token_fn: if given, token_fn(request_id, position) picks every token instead
      (tests script exact outputs with it).
    matcher_factory: makes the grammar matcher of a request with structured
      output (see `cadence.gpu.runner.MatcherFactory`); None fails such requests.
    """

    def __init__(
        self,
        latency: LatencyModel | None = None,
        vocab_size: int = 32000,
        eos_token_id: int | None = None,
        eos_probability: float = 0.0,
        seed: int = 0,
        faults: FaultPlan | None = None,
        sample_ids: Sequence[int] | None = None,
        token_fn: Callable[[str, int], int] | None = None,
    ) -> None:
        if not 0.0 <= eos_probability <= 1.0:
            raise ValueError(f"eos_probability must be in [0, 1], got {eos_probability}")
        if eos_probability and eos_token_id is None:
            raise ValueError("eos_probability needs an eos_token_id")
        self.latency = latency if latency is not None else LatencyModel()
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.eos_probability = eos_probability
        self.seed = seed
        self.faults = faults
        self.sample_ids = tuple(sample_ids) if sample_ids is not None else None
        self.token_fn = token_fn
        self.matcher_factory = None
        self._bitmask = None
        self._eos_threshold = int(eos_probability * (1 << 32))
        self._batch: dict[str, _Sequence] = {}
        self._history: deque[StepOutput] = deque(maxlen=_HISTORY)
        self._alive = False
        self._block_size = 1
        # When the host and the device are next free (virtual seconds).
        self._host_free_s = self._device_free_s = 0.0
        # Requests it failed and dropped, until a plan names them finished: a plan made
        # before it answered may still schedule them, and is answered the same way.
        self._dropped: dict[str, str] = {}
        self.num_starts = 0
        self.num_calls = 0
        self.injected: list[tuple[int, Fault]] = []

    def expected_token(self, request_id: str, position: int) -> int:
        """The token this executor samples at `position` of `request_id`."""
        if self.token_fn is not None:
            return self.token_fn(request_id, position)
        return _token(_request_key(self.seed, request_id), position, self.vocab_size,
                      self.eos_token_id, self._eos_threshold, self.sample_ids)

    @property
    def alive(self) -> bool:
        """Whether it was started and has not crashed or been killed since."""
        return self._alive

    async def start(self, init: InitExecutor) -> Ready:
        """Start with an empty persistent batch (a restart forgets everything)."""
        attempt = self.num_starts
        self.num_starts += 1
        await trio.lowlevel.checkpoint()
        if self.faults is not None and attempt in self.faults.fail_starts:
            raise ExecutorError(f"simulated executor failed to start (attempt {attempt})")
        self._batch.clear()
        self._history.clear()
        self._dropped.clear()
        self._block_size = init.block_size
        self._host_free_s = self._device_free_s = trio.current_time()
        self._alive = True
        return Ready(
            num_blocks=init.num_blocks or DEFAULT_NUM_BLOCKS,
            block_size=init.block_size,
            vocab_size=self.vocab_size,
            eos_token_ids=[] if self.eos_token_id is None else [self.eos_token_id],
            max_model_len=init.max_model_len,
        )

    async def execute(self, step: ExecuteStep) -> StepOutput:
        """Apply the plan to the persistent batch, wait the modelled latency,
        and return one token for each request that reached its last known token."""
        return await self.submit(step).result()

    def submit(self, step: ExecuteStep) -> SimulatedCall:
        """Hand a step over behind those handed over before it; it is applied to the
        batch at once (steps are applied in the order given) and answered when the
        modelled host and device time has passed."""
        if not self._alive:
            return SimulatedCall(error=ExecutorError("simulated executor is not running"))
        call = self.num_calls
        self.num_calls += 1
        fault = self.faults.fault_for(call) if self.faults is not None else None
        if fault is not None:
            self.injected.append((call, fault))
        poison = self._poison_in(step.plan)
        if fault is Fault.CRASH or poison is Poison.CRASH:
            self._alive = False
            self._batch.clear()
            return SimulatedCall(error=ExecutorError(f"simulated crash in step {step.plan.step_id}"))
        if poison is Poison.HANG:
            return SimulatedCall(hang=True)
        try:
            output, step_us = self._run(step.plan, step.sampling)
        except ExecutorError as exc:
            return SimulatedCall(error=exc)
        if fault is Fault.HANG:
            return SimulatedCall(hang=True)
        if fault is Fault.SLOW:
            step_us *= self.faults.slow_factor
        host_end = max(trio.current_time(), self._host_free_s) + self.latency.host_us / 1e6
        self._host_free_s = host_end
        self._device_free_s = done = max(host_end, self._device_free_s) + step_us / 1e6
        history = self._history
        answer = output
        if fault is Fault.DUPLICATE and history:
            answer = history[-1]
        elif fault is Fault.STALE and history:
            answer = history[0]
        history.append(output)
        return SimulatedCall(answer, done_s=done)

    async def kill(self) -> None:
        """Drop everything at once."""
        self._alive = False
        self._batch.clear()

    async def aclose(self) -> None:
        """Shut down."""
        await self.kill()

    def _poison_of(self, request_id: str, token_ids) -> Poison | None:
        """How the fault plan poisons this request, if it does."""
        poison = self.faults.poison if self.faults is not None else None
        if not poison:
            return None
        kind = poison.get(request_id)
        if kind is None:
            marked = [poison[t] for t in set(token_ids) if t in poison]
            kind = marked[0] if marked else None
        return kind

    def _poison_in(self, plan: StepPlan) -> Poison | None:
        """The worst poison among the plan's requests (a crash or hang beats a report)."""
        if self.faults is None or not self.faults.poison:
            return None
        new = {d.request_id: d.token_ids for d in plan.new_requests}
        found = set()
        for rid in plan.num_scheduled_tokens:
            seq = self._batch.get(rid)
            found.add(self._poison_of(rid, new.get(rid, seq.token_ids if seq is not None else ())))
        for kind in (Poison.CRASH, Poison.HANG, Poison.REPORTED):
            if kind in found:
                return kind
        return None

    def _run(self, plan: StepPlan, sampling: Mapping | None = None) -> tuple[StepOutput, float]:
        batch, dropped = self._batch, self._dropped
        for rid in plan.finished_ids:
            batch.pop(rid, None)
            dropped.pop(rid, None)
        for rid in plan.preempted_ids:
            batch.pop(rid, None)
            dropped.pop(rid, None)
        seed = self.seed
        failed: dict[str, str] = {}
        for data in plan.new_requests:
            params = sampling.get(data.request_id) if sampling else None
            matcher = None
            if params is not None and params.structured_output is not None:
                matcher, why = self._matcher(params.structured_output, data)
                if why is not None:
                    batch.pop(data.request_id, None)
                    failed[data.request_id] = dropped[data.request_id] = why
                    continue
            batch[data.request_id] = _Sequence(
                _request_key(seed, data.request_id), list(data.token_ids), data.num_prompt_tokens,
                data.num_computed_tokens, list(data.block_ids),
                params.logprobs if params is not None else None,
                params.prompt_logprobs if params is not None else None, matcher)
        for rid, block_ids in plan.new_block_ids.items():
            seq = batch.get(rid)
            if seq is None:
                self._protocol_violation(f"new blocks for request {rid!r} not in the batch")
            seq.block_ids.extend(block_ids)
        vocab, eos, threshold, ids = self.vocab_size, self.eos_token_id, self._eos_threshold, self.sample_ids
        block_size, token_fn = self._block_size, self.token_fn
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[list[tuple[int, float]]]] = {}
        prompt_logprobs: dict[str, PromptLogprobs] = {}
        poisoned = self.faults is not None and bool(self.faults.poison)
        num_prefill = num_decode = 0
        for rid, n in plan.num_scheduled_tokens.items():
            if rid in failed:
                continue
            seq = batch.get(rid)
            if poisoned and self._poison_of(rid, seq.token_ids if seq is not None else ()) is Poison.REPORTED:
                batch.pop(rid, None)
                failed[rid] = dropped[rid] = "simulated sampling error"
                continue
            if seq is None and rid in dropped:
                failed[rid] = dropped[rid]
                continue
            if seq is None:
                self._protocol_violation(f"plan schedules request {rid!r} not in the batch")
            before = seq.num_computed_tokens
            after = seq.num_computed_tokens = before + n
            tokens = seq.token_ids
            if after > len(tokens) or after > len(seq.block_ids) * block_size:
                self._protocol_violation(
                    f"request {rid!r}: step computes {after} tokens but only {len(tokens)} are "
                    f"known and its {len(seq.block_ids)} blocks hold {len(seq.block_ids) * block_size}")
            if seq.prompt_logprobs is not None:
                scored = fabricated_prompt_logprobs(tokens, seq.num_prompt_tokens, before, n,
                                                    seq.prompt_logprobs, vocab)
                if scored is not None:
                    prompt_logprobs[rid] = PromptLogprobs(*scored)
            if n == 1 and before >= seq.num_prompt_tokens:
                num_decode += 1
            else:
                num_prefill += n
            if after == len(tokens):
                if token_fn is None:
                    token = _token(seq.key, after, vocab, eos, threshold, ids)
                else:
                    token = token_fn(rid, after)
                if seq.matcher is not None:
                    token = self._follow_grammar(seq.matcher, token)
                tokens.append(token)
                sampled[rid] = [token]
                if seq.logprobs is not None:
                    logprobs[rid] = [fabricated_logprobs(token, seq.logprobs, vocab)]
        step_us = self.latency.step_us(num_prefill, num_decode)
        result = StepResult(plan.step_id, sampled, logprobs or None, int(step_us))
        return StepOutput(result, failed, prompt_logprobs), step_us

    def _matcher(self, structured, data) -> tuple[object, str | None]:
        """A new request's grammar matcher, advanced over its output; or why it has none."""
        if self.matcher_factory is None:
            return None, "this executor has no structured-output support"
        try:
            return self.matcher_factory(structured, data.token_ids[data.num_prompt_tokens:]), None
        except Exception as exc:
            return None, f"structured output: {exc}"

    def _follow_grammar(self, matcher, token: int) -> int:
        """`token` if the grammar allows it, else an allowed token it picks; taken by the matcher."""
        if self._bitmask is None:
            import torch  # the grammar library has loaded it already

            self._bitmask = torch.full((1, -(-self.vocab_size // 32)), -1, dtype=torch.int32)
        allowed = matcher.allowed(self._bitmask)
        if token not in allowed:
            token = allowed[token % len(allowed)]
        matcher.accept(token)
        return token

    def _protocol_violation(self, message: str) -> None:
        self._alive = False
        self._batch.clear()
        raise ExecutorError(f"simulated executor: {message}")
