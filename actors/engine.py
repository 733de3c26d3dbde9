"""The embedded API: open an engine in a Trio program and stream generations.

    async with open_engine(EngineConfig()) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=8)):
            print(out.text, end="")

`open_engine` starts the executor, builds the scheduling core with the cache
size the executor reports, and runs the scheduler actor and one request
actor per request in its own nursery. Leaving the block aborts whatever is
still live (its consumers get `EngineClosedError`) and shuts the executor down.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import random
import secrets
from contextlib import asynccontextmanager
from typing import AsyncIterator, Mapping, Sequence, Union

import attrs
import trio

from cadence.statemachine.config import CacheConfig, SchedulerConfig
from cadence.statemachine.errors import (
    ConfigError, ExecutorError, InvalidRequestError, RequestNotFoundError, StructuredOutputError,
)
from cadence.statemachine.request import Request
from cadence.statemachine.sampling import SamplingParams, StructuredOutput
from cadence.statemachine.scheduler import Scheduler
from cadence.statemachine.stats import StatsSummary

from .chat import encode_text
from .detokenizer import (
    ByteTokenizer, KeepSpecialTokens, StopAutomaton, TextAssembler, Tokenizer, max_bytes_per_token,
    stop_automaton, token_text_function,
)
from .executor import ExecutorBackend
from .messages import InitExecutor, OptionValue
from .request_actor import RequestActor, RequestOutput, RequestResult, join_logprobs
from .scheduler_actor import SchedulerActor, StepListener
from .supervision import ExecutorSupervisor
from .simulated import LatencyModel, SimulatedExecutor
from .structured import DEFAULT_GRAMMAR_CACHE_SIZE, GrammarCompiler, compiler_for
from .trace import TraceRecorder
from .validation import (
    DEFAULT_MAX_STOP_CHARS, DEFAULT_MAX_STOP_STRINGS, Prompt, RequestLimits, check_fits, check_token_ids,
    validate_request,
)
from .unwrap import unwrap_sole_error

__all__ = ["EngineConfig", "Engine", "RequestStream", "open_engine", "EXECUTOR_KINDS",
           "DEMO_MODEL", "demo_model_dir", "resolve_model", "OFF_LOOP_PROMPT_CHARS"]

logger = logging.getLogger(__name__)

EXECUTOR_KINDS = ("simulated", "inprocess", "process")
# The name of the built-in demo model, the default everywhere.
DEMO_MODEL = "demo"
# The model name that selects the simulated executor when no executor is named.
SIMULATED_MODEL = "simulated"
# The ids the simulated executor draws from when it is paired with the byte
# tokenizer: printable ASCII, so demo output reads as text.
_PRINTABLE_IDS = tuple(range(32, 127))
_CLOSE_TIMEOUT_S = 10.0
# The simulated executor's vocabulary when no tokenizer says otherwise.
SIMULATED_VOCAB_SIZE = 32000
# Text prompts longer than this (characters), and stop lists longer than this in all,
# are tokenised / compiled in a worker thread rather than on the event loop; below
# it the thread hand-off costs more than the work.
OFF_LOOP_PROMPT_CHARS = 8192
_OFF_LOOP_STOP_CHARS = 2048
# Worker threads tokenising at once, so large prompts queue rather than crowd the loop.
_TOKENIZER_THREADS = 2


def _positive(instance, attribute, value) -> None:
    if not value > 0:
        raise ConfigError(f"{attribute.name} must be > 0, got {value!r}")


def _non_negative(instance, attribute, value) -> None:
    if value < 0:
        raise ConfigError(f"{attribute.name} must be >= 0, got {value!r}")


def _optional_positive(instance, attribute, value) -> None:
    if value is not None:
        _positive(instance, attribute, value)


def demo_model_dir() -> str:
    """The built-in demo model shipped inside the package (found without importing torch)."""
    spec = importlib.util.find_spec("cadence.gpu")
    return os.path.join(list(spec.submodule_search_locations)[0], "demo_model")


def resolve_model(model: str) -> str:
    """'demo' is the built-in demo model's directory; anything else is kept as given."""
    return demo_model_dir() if model == DEMO_MODEL else model


def _executor_kind(instance, attribute, value) -> None:
    if value is None:  # filled in from the model by EngineConfig.__attrs_post_init__
        return
    if isinstance(value, str):
        if value not in EXECUTOR_KINDS:
            raise ConfigError(f"executor must be one of {', '.join(EXECUTOR_KINDS)} "
                              f"or an ExecutorBackend, got {value!r}")
    elif not isinstance(value, ExecutorBackend):
        raise ConfigError(f"executor must be a name or an ExecutorBackend, got {type(value).__name__}")


@attrs.frozen
class EngineConfig:
    """Everything `open_engine` needs.

    scheduler, cache: the core's configuration (the cache size is replaced by
      what the executor reports at start-up).
    model: "demo" (the built-in demo model, the default), a checkpoint directory,
      a preset name (random weights), or "simulated" (no model at all; the
      default with a simulated executor).
    executor: "inprocess" (model runner in a worker thread; the default),
      "process" (in a child process), "simulated" (latency model, no weights;
      the default only for model="simulated"), or a ready `ExecutorBackend`
      instance (tests pass a SimulatedExecutor with faults).
    dtype, device, executor_options: passed to the executor in InitExecutor.
    latency: the simulated executor's latency model.
    tokenizer: encodes text prompts and detokenises output; the simulated
      executor defaults to a byte-level tokenizer. Without one, prompts must be
      token ids and outputs carry no text.
    step_timeout_s: a step taking longer counts as an executor failure.
    start_timeout_s: most seconds a (re)start of the executor may take.
    max_restarts, restart_window_s: more than max_restarts failures within the
      window fail every live request and close the engine (failures that follow
      one request, which then fails alone, do not count).
    restart_backoff_s, restart_backoff_max_s: the pause before a restart, doubled
      for each failure in a row (with jitter from `seed`) up to the maximum.
    heartbeat_timeout_s: an executor child process that sends no heartbeat for
      this long while it works (stopped, frozen) counts as failed; None: only
      `step_timeout_s` applies. An executor in this process has no heartbeat:
      `step_timeout_s` is its guard (see `InProcessExecutor`).
    plan_ahead: plan step N+1 while step N runs when that cannot split the batch.
    max_stop_strings, max_stop_chars: most stop strings one request may carry,
      and most characters in each (requests over them are refused).
    trace_path, record_trace: write the event trace as JSON lines to a file,
      and/or keep it in memory (`engine.trace.records`).
    grammar_cache_size: compiled structured-output grammars kept per tokenizer
      (least recently used dropped first; 0 compiles every request's anew).
    seed: the executor's seed.
    """

    scheduler: SchedulerConfig = attrs.field(factory=SchedulerConfig)
    cache: CacheConfig = attrs.field(factory=CacheConfig)
    model: str | None = None
    executor: Union[str, ExecutorBackend, None] = attrs.field(default=None, validator=_executor_kind)
    dtype: str = "auto"
    device: str = "auto"
    executor_options: Mapping[str, OptionValue] = attrs.field(factory=dict)
    latency: LatencyModel = attrs.field(factory=LatencyModel)
    tokenizer: Tokenizer | None = None
    step_timeout_s: float = attrs.field(default=60.0, validator=_positive)
    start_timeout_s: float = attrs.field(default=600.0, validator=_positive)
    max_restarts: int = attrs.field(default=3, validator=_non_negative)
    restart_window_s: float = attrs.field(default=300.0, validator=_positive)
    restart_backoff_s: float = attrs.field(default=0.5, validator=_non_negative)
    restart_backoff_max_s: float = attrs.field(default=30.0, validator=_non_negative)
    heartbeat_timeout_s: float | None = attrs.field(default=5.0, validator=_optional_positive)
    plan_ahead: bool = True
    max_stop_strings: int = attrs.field(default=DEFAULT_MAX_STOP_STRINGS, validator=_positive)
    max_stop_chars: int = attrs.field(default=DEFAULT_MAX_STOP_CHARS, validator=_positive)
    trace_path: str | None = None
    record_trace: bool = False
    grammar_cache_size: int = attrs.field(default=DEFAULT_GRAMMAR_CACHE_SIZE, validator=_non_negative)
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        # Each of model and executor, left out, follows the other: naming the simulated
        # model names the simulated executor and the reverse; otherwise the demo model
        # runs in this process. (Set through object.__setattr__: the class is frozen.)
        simulated = self.executor == "simulated" or isinstance(self.executor, SimulatedExecutor)
        if self.model is None:
            object.__setattr__(self, "model", SIMULATED_MODEL if simulated else DEMO_MODEL)
        if self.executor is None:
            object.__setattr__(self, "executor",
                               "simulated" if self.model == SIMULATED_MODEL else "inprocess")

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Build from flat keywords: EngineConfig fields, plus any SchedulerConfig or
        CacheConfig field (e.g. max_num_seqs=8, block_size=16)."""
        own = {f.name for f in attrs.fields(cls)}
        sched_fields = {f.name for f in attrs.fields(SchedulerConfig)}
        cache_fields = {f.name for f in attrs.fields(CacheConfig)}
        top, sched, cache = {}, {}, {}
        for key, value in kwargs.items():
            if key in own:
                top[key] = value
            elif key in sched_fields:
                sched[key] = value
            elif key in cache_fields:
                cache[key] = value
            else:
                raise ConfigError(f"unknown engine option {key!r}")
        if sched:
            top["scheduler"] = attrs.evolve(top.get("scheduler", SchedulerConfig()), **sched)
        if cache:
            top["cache"] = attrs.evolve(top.get("cache", CacheConfig()), **cache)
        return cls(**top)


class RequestStream:
    """The deltas of one request, as an async iterator.

    Submission happens on the first iteration (or `await stream.start()`), so
    validation errors raise there. Leaving the loop early (break, an exception,
    a cancelled scope) aborts the request and frees its blocks. A stream of a
    request group (`Engine.generate_group`) submits its whole group.
    """

    __slots__ = ("_engine", "_submission", "_actor", "_group")

    def __init__(self, engine: Engine, submission: tuple,
                 group: list[RequestStream] | None = None) -> None:
        self._engine = engine
        self._submission = submission
        self._actor: RequestActor | None = None
        self._group = group

    @property
    def request_id(self) -> str | None:
        """The request's id once submitted."""
        return self._actor.request_id if self._actor is not None else None

    @property
    def num_prompt_tokens(self) -> int | None:
        """The prompt's length in tokens once submitted."""
        return self._actor.request.num_prompt_tokens if self._actor is not None else None

    @property
    def num_undelivered_tokens(self) -> int:
        """Tokens produced that this stream's consumer has not taken yet (0 before
        submission)."""
        return self._actor.num_undelivered_tokens if self._actor is not None else 0

    def enqueue(self) -> RequestStream:
        """Hand the request to the scheduler now, without waiting for its verdict;
        a refusal raises from the first iteration (or `start()`). Enqueueing many
        streams before awaiting any submits them together, in order. A text
        prompt is tokenised here, on the event loop; `start()` tokenises a long
        one in a worker thread."""
        if self._actor is None:
            engine = self._engine
            if self._group is None:
                self._submit(engine._make_actor(self._submission))
            else:
                engine._submit_group(self._group, engine._make_group(self._group))
        return self

    def _submit(self, actor: RequestActor) -> None:
        self._engine.scheduler.router.submit(actor)
        self._actor = actor

    async def start(self) -> RequestStream:
        """Submit the request and wait until the core accepts it; raises the
        validation error if it is refused."""
        if self._actor is None:
            await trio.lowlevel.checkpoint_if_cancelled()
            engine = self._engine
            if self._group is None:
                actor = await engine._prepare(self._submission)
                if self._actor is None:
                    self._submit(actor)
            else:
                actors = await engine._prepare_group(self._group)
                if self._actor is None:
                    engine._submit_group(self._group, actors)
        actor = self._actor
        try:
            await actor.wait_accepted()
        except BaseException:
            actor.cancel("cancelled before admission")
            raise
        return self

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        actor = self._actor
        if actor is None or not actor.accepted:
            await self.start()
            actor = self._actor
        try:
            return await actor.next_output()
        except StopAsyncIteration:
            raise
        except BaseException:
            actor.cancel()
            raise

    async def aclose(self) -> None:
        """Abort the request if it is still running."""
        if self._actor is not None:
            self._actor.cancel("closed by the consumer")
        await trio.lowlevel.checkpoint()

    @property
    def prompt_token_ids(self) -> list[int] | None:
        """The prompt's token ids once submitted."""
        return list(self._actor.request.prompt_token_ids) if self._actor is not None else None

    async def collect(self) -> RequestResult:
        """Consume the stream and return the request as a whole."""
        deltas = [out async for out in self]
        prompt = self._submission[0]
        result = result_of(deltas, self.prompt_token_ids, prompt if isinstance(prompt, str) else None)
        tokenizer = self._engine.tokenizer
        if tokenizer is None or result.logprobs is None and result.prompt_token_logprobs is None:
            return result
        return attrs.evolve(result, token_text=token_text_function(tokenizer))

    def __del__(self) -> None:
        # Runs when a consumer breaks out of `async for` and drops the stream.
        actor = self._actor
        if actor is not None and not actor.stream_done:
            try:
                actor.cancel("consumer went away")
            except Exception:
                # A finaliser may run anywhere (after the Trio run, at interpreter exit),
                # where there is nothing left to abort and nothing to raise to.
                pass


def result_of(deltas: Sequence[RequestOutput], prompt_token_ids: list[int],
              prompt: str | None) -> RequestResult:
    """A finished request as a whole, from every delta of its stream."""
    last = deltas[-1]
    assert last.finish_reason is not None, "the stream has not finished"
    tokens = [token for out in deltas for token in out.token_ids]
    return RequestResult(
        request_id=last.request_id,
        prompt_token_ids=prompt_token_ids,
        token_ids=tokens,
        text="".join(out.text for out in deltas if out.text is not None) if last.text is not None else None,
        finish_reason=last.finish_reason,
        detail=last.detail,
        arrival_s=last.arrival_s,
        first_token_s=last.first_token_s,
        finish_s=last.now_s,
        num_cached_tokens=last.num_cached_tokens,
        logprobs=join_logprobs((len(out.token_ids), out.logprobs) for out in deltas),
        prompt=prompt,
        prompt_token_logprobs=deltas[0].prompt_logprobs,
        stop_reason=last.stop_reason,
    )


class Engine:
    """A running engine: submit requests, stream their outputs, abort them.

    Create it with `open_engine`; every method must be called from a task of
    the Trio run that opened it.
    """

    def __init__(self, config: EngineConfig, scheduler: SchedulerActor,
                 tokenizer: Tokenizer | None, eos_token_ids: frozenset[int], vocab_size: int,
                 trace: TraceRecorder | None, bytes_per_token: int | None = None) -> None:
        self.config = config
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.trace = trace
        self.request_limits = RequestLimits(
            vocab_size=vocab_size, max_model_len=scheduler.core.config.max_model_len,
            has_tokenizer=tokenizer is not None, max_bytes_per_token=bytes_per_token,
            max_stop_strings=config.max_stop_strings, max_stop_chars=config.max_stop_chars)
        self._num_ids = 0
        # Requests asking for prompt logprobs get cache salts of their own (see
        # `_block_salt`); the key makes them unguessable, the count unique.
        self._private_salt_key = secrets.token_hex(16)
        self._num_private_salts = 0
        self._tokenizer_threads = trio.CapacityLimiter(_TOKENIZER_THREADS)
        self._grammars: GrammarCompiler | None = None

    @property
    def core(self):
        """The scheduling core, for inspection only (the scheduler actor owns it)."""
        return self.scheduler.core

    @property
    def closed(self) -> bool:
        """Whether the engine refuses new requests."""
        return self.scheduler.closed_reason is not None

    @property
    def health(self) -> str:
        """"ok", "degraded" (the executor is being restarted) or "closed"."""
        return self.scheduler.health

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        tenant: str = "default",
        deadline_s: float | None = None,
        request_id: str | None = None,
        timeout_s: float | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Stream a request's `RequestOutput` deltas: `async for out in engine.generate(...)`.

        prompt: text (needs a tokenizer) or token ids. priority: lower runs first
        (under priority policies). deadline_s: seconds from now, for the deadline
        policy. timeout_s: the request is aborted (detail "timeout") after this many
        seconds. Validation errors raise on the first iteration.
        """
        prompt, params = self._vllm_options(prompt, params)
        return RequestStream(self, (prompt, params, priority, tenant, deadline_s, request_id,
                                    timeout_s, cache_salt))

    def generate_group(
        self,
        prompt: Prompt,
        params: Sequence[SamplingParams | None],
        *,
        priority: int = 0,
        tenant: str = "default",
        deadline_s: float | None = None,
        request_ids: Sequence[str] | None = None,
        timeout_s: float | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestStream]:
        """One stream per entry of `params`, all of one prompt (`n` = len(params)):
        a request group, whose prompt the core computes once and whose samples then
        share its blocks. Starting (or iterating) any stream submits them all; each
        is then scheduled, preempted, aborted and finished on its own. Options as
        for `generate`; `request_ids`, if given, one per stream. Samples that ask for
        prompt logprobs are independent requests: each needs the logits of every
        prompt position, which shared blocks do not give."""
        if request_ids is not None and len(request_ids) != len(params):
            raise InvalidRequestError(
                f"request_ids has {len(request_ids)} entries for {len(params)} samples")
        ids = list(request_ids) if request_ids is not None else [None] * len(params)
        if params and params[0] is not None:
            prompt, _ = self._vllm_options(prompt, params[0])
            params = [self._vllm_options(prompt, p)[1] if p is not None else p for p in params]
        shared = all(p is None or p.prompt_logprobs is None for p in params)
        group: list[RequestStream] | None = [] if shared else None
        streams: list[RequestStream] = []
        for sample, request_id in zip(params, ids):
            streams.append(RequestStream(self, (prompt, sample, priority, tenant, deadline_s,
                                                request_id, timeout_s, cache_salt), group))
        if group is not None:
            group.extend(streams)
        return streams

    async def submit(self, prompt: Prompt, params: SamplingParams | None = None, **options) -> RequestStream:
        """Like `generate`, but submits at once: raises here if the request is refused."""
        return await self.generate(prompt, params, **options).start()

    async def abort(self, request_id: str, detail: str = "aborted") -> None:
        """Abort a live request; its stream ends with finish_reason "abort".

        Raises RequestNotFoundError if no live request has this id.
        """
        if request_id not in self.scheduler.actors:
            raise RequestNotFoundError(f"no live request with id {request_id!r}")
        self.scheduler.router.abort_nowait(request_id, detail)
        await trio.lowlevel.checkpoint()

    def stats(self) -> StatsSummary:
        """The scheduling core's counters, with the executor's failures and restarts."""
        return self.scheduler.stats()

    async def wait_idle(self) -> None:
        """Wait until every submitted request has completed."""
        await self.scheduler.router.wait_idle()

    async def prepare_structured_output(self, params: SamplingParams | None) -> None:
        """Compile the structured output of `params` in a worker thread, unless it is
        compiled already; a request with these parameters then compiles nothing.
        Raises StructuredOutputError naming the field ("structured_output", "regex" or
        "grammar") and the grammar library's reason."""
        structured = None if params is None else params.structured_output
        if structured is None:
            return
        compiler = self._grammars
        if compiler is None:
            # The first one reads the whole vocabulary: off the loop as well.
            compiler = await trio.to_thread.run_sync(self.grammar_compiler, structured,
                                                     limiter=self._tokenizer_threads)
        if not compiler.cached(structured):
            await trio.to_thread.run_sync(compiler.compile, structured, limiter=self._tokenizer_threads)

    def grammar_compiler(self, structured: StructuredOutput) -> GrammarCompiler:
        """The compiler of this engine's tokenizer (shared with an executor in this process)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise StructuredOutputError(f"{structured.field}: structured output needs a tokenizer; "
                                            f"this engine has none", structured.field)
            self._grammars = compiler_for(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                          self.config.grammar_cache_size)
        return self._grammars

    # ---- internals -------------------------------------------------------------
    def _vllm_options(self, prompt: Prompt, params: SamplingParams | None) -> tuple[Prompt, SamplingParams | None]:
        """The prompt cut to `truncate_prompt_tokens` (its last k tokens), and `bad_words`
        as token ids (each word with and without a leading space, as vLLM reads them);
        both need the tokenizer and are left to validation without one."""
        if params is None or self.tokenizer is None:
            return prompt, params
        if params.truncate_prompt_tokens is not None and (isinstance(prompt, str) or isinstance(prompt, list)):
            ids = self._encode(prompt) if isinstance(prompt, str) and prompt else prompt
            prompt = list(ids[-params.truncate_prompt_tokens:])
        if params.bad_words:
            words = list(params.bad_words_token_ids)
            for word in params.bad_words:
                for variant in {word, word if word.startswith(" ") else " " + word}:
                    ids = tuple(encode_text(self.tokenizer, variant, add_special_tokens=False))
                    if ids and ids not in words:
                        words.append(ids)
            params = attrs.evolve(params, bad_words=(), bad_words_token_ids=words)
        return prompt, params

    def _validate(self, submission: tuple) -> SamplingParams:
        prompt, params, priority, tenant, deadline_s, _, timeout_s, cache_salt = submission
        params = validate_request(prompt, params, self.request_limits, priority=priority,
                                  tenant=tenant, deadline_s=deadline_s, timeout_s=timeout_s,
                                  cache_salt=cache_salt)
        if params.n != 1:
            raise InvalidRequestError(
                f"n is {params.n}; one engine request is one sample (generate_group runs n samples "
                f"of a prompt, with params.samples(); LLM.generate and the servers do so for n)")
        return params

    async def _prepare(self, submission: tuple, token_ids: list[int] | None = None) -> RequestActor:
        """Validate a request and build its actor, tokenising a long text prompt
        (unless `token_ids` are given) and compiling a long stop list in a worker thread."""
        params = self._validate(submission)
        await self.prepare_structured_output(params)
        prompt = submission[0]
        stops = None
        if token_ids is None and isinstance(prompt, str) and len(prompt) > OFF_LOOP_PROMPT_CHARS:
            token_ids = await trio.to_thread.run_sync(
                self._encode, prompt, limiter=self._tokenizer_threads)
        if sum(map(len, params.stop)) > _OFF_LOOP_STOP_CHARS:
            stops = await trio.to_thread.run_sync(
                stop_automaton, params.stop, limiter=self._tokenizer_threads)
        return self._make_actor(submission, params, token_ids, stops)

    def _make_group(self, streams: list[RequestStream]) -> list[RequestActor]:
        """The actors of a request group, the prompt tokenised once."""
        first = self._make_actor(streams[0]._submission)
        token_ids = list(first.request.prompt_token_ids)
        return [first] + [self._make_actor(s._submission, token_ids=token_ids) for s in streams[1:]]

    async def _prepare_group(self, streams: list[RequestStream]) -> list[RequestActor]:
        """`_prepare` for each stream of a request group, the prompt tokenised once."""
        first = await self._prepare(streams[0]._submission)
        token_ids = list(first.request.prompt_token_ids)
        return [first] + [await self._prepare(s._submission, token_ids) for s in streams[1:]]

    def _submit_group(self, streams: list[RequestStream], actors: list[RequestActor]) -> None:
        """Hand a request group's actors to the scheduler together."""
        self.scheduler.router.submit(list(actors))
        for stream, actor in zip(streams, actors):
            stream._actor = actor

    def _make_actor(self, submission: tuple, params: SamplingParams | None = None,
                    token_ids: list[int] | None = None,
                    stops: StopAutomaton | None = None) -> RequestActor:
        """The actor of a request: validated here unless `params` says it was."""
        prompt, _, priority, tenant, deadline_s, request_id, timeout_s, cache_salt = submission
        if params is None:
            params = self._validate(submission)
            if params.structured_output is not None:
                # Not prepared off the loop (`enqueue`): compiled here unless cached.
                self.grammar_compiler(params.structured_output).compile(params.structured_output)
        if token_ids is None:
            token_ids = self._encode(prompt) if isinstance(prompt, str) else list(prompt)
        # Refused here with the counts (the core would refuse it too, naming its request id).
        core = self.core
        check_fits(len(token_ids), params.max_tokens or 1, core.config.max_model_len,
                   core.cache_config.num_blocks * core.blocks.block_size)
        # max_tokens=None: whatever room max_model_len leaves (at least one, so that a prompt
        # that fills it is refused by the core with the lengths named).
        params = params.bounded(max(1, self.core.config.max_model_len - len(token_ids)))
        if request_id is None:
            request_id = f"req-{self._num_ids}"
            self._num_ids += 1
        now = trio.current_time()
        request = Request(
            request_id, token_ids, params.limits(self.eos_token_ids), priority=priority,
            tenant=tenant, deadline_s=None if deadline_s is None else now + deadline_s,
            arrival_s=now, cache_salt=self._block_salt(tenant, cache_salt, params))
        assembler = None
        if self.tokenizer is not None:
            tokenizer = self.tokenizer if params.skip_special_tokens else KeepSpecialTokens(self.tokenizer)
            assembler = TextAssembler(tokenizer, token_ids,
                                      stops if stops is not None else params.stop,
                                      params.include_stop_str_in_output)
        return RequestActor(request, params, self.scheduler.router.abort_nowait, assembler, timeout_s)

    def _block_salt(self, tenant: str, cache_salt: str | None, params: SamplingParams) -> str | None:
        """The salt of a request's prefix-cache keys. A request that asks for prompt
        logprobs needs the logits of every prompt position, which a cached block does
        not keep: it gets a salt no other request has, so it finds no cached prefix
        (as in vLLM, such requests skip the prefix cache) and still finds its own
        blocks again when it resumes after a preemption."""
        salt = self.config.cache.block_salt(tenant, cache_salt)
        if params.prompt_logprobs is None:
            return salt
        self._num_private_salts += 1
        return f"{salt or ''}\x00prompt-logprobs:{self._private_salt_key}:{self._num_private_salts}"

    def _encode(self, prompt: str) -> list[int]:
        """A validated text prompt's token ids (safe to run in a worker thread)."""
        token_ids = list(self.tokenizer.encode(prompt))
        check_token_ids("prompt", token_ids, self.vocab_size)
        return token_ids


def _fit_model_len(sched_config: SchedulerConfig, model_len: int) -> SchedulerConfig:
    """The scheduler config limited to the longest sequence the model computes exactly
    (a small model's position limit is below the default max_model_len)."""
    if model_len >= sched_config.max_model_len:
        return sched_config
    logger.info("max_model_len %d is past what the model computes exactly; using %d",
                sched_config.max_model_len, model_len)
    return attrs.evolve(sched_config, max_model_len=model_len)


def _make_backend(config: EngineConfig, tokenizer: Tokenizer | None) -> ExecutorBackend:
    backend = _backend_of(config, tokenizer)
    if (isinstance(backend, SimulatedExecutor) and backend.matcher_factory is None
            and tokenizer is not None and backend.eos_token_id is not None):
        backend.matcher_factory = _simulated_matchers(tokenizer, backend, config.grammar_cache_size)
    return backend


def _backend_of(config: EngineConfig, tokenizer: Tokenizer | None) -> ExecutorBackend:
    kind = config.executor
    if not isinstance(kind, str):
        return kind
    if kind == "simulated":
        if isinstance(tokenizer, ByteTokenizer):
            return SimulatedExecutor(config.latency, vocab_size=tokenizer.vocab_size,
                                     eos_token_id=tokenizer.eos_token_id, seed=config.seed,
                                     sample_ids=_PRINTABLE_IDS)
        # Another tokenizer: draw from its vocabulary, so every token decodes.
        vocab_size = getattr(tokenizer, "vocab_size", None) or SIMULATED_VOCAB_SIZE
        eos_ids = list(getattr(tokenizer, "eos_token_ids", ()) or ())
        return SimulatedExecutor(config.latency, vocab_size=vocab_size,
                                 eos_token_id=eos_ids[0] if eos_ids else None, seed=config.seed)
    from . import executors  # the real backends pull in the model runner only when chosen
    if kind == "inprocess":
        return executors.InProcessExecutor()
    return executors.ChildProcessExecutor(heartbeat_timeout_s=config.heartbeat_timeout_s)


def _simulated_matchers(tokenizer: Tokenizer, backend: SimulatedExecutor, cache_size: int):
    """The simulated executor's matcher factory: the engine's tokenizer, compiled on first use."""
    def matcher(structured: StructuredOutput, output_token_ids):
        compiler = compiler_for(tokenizer, backend.vocab_size, [backend.eos_token_id], cache_size)
        return compiler.matcher(structured, output_token_ids)
    return matcher


@asynccontextmanager
async def open_engine(config: EngineConfig | None = None, *,
                      on_step: StepListener | None = None) -> AsyncIterator[Engine]:
    """Start an engine for the duration of an `async with` block.

    Without a config the built-in demo model runs in this process. on_step(plan,
    now_s) is called with every non-empty step plan when it is made (a plan made
    ahead goes to the executor after the step in flight); the CLI's demo prints
    batches with it. An error comes out as itself, not inside an exception group.
    """
    with unwrap_sole_error():
        async with _run_engine(config if config is not None else EngineConfig(), on_step) as engine:
            yield engine


def _executor_options(config: EngineConfig) -> dict[str, OptionValue]:
    options = dict(config.executor_options)
    # The KV blocks the running requests can hold at once: what a CPU runner faults in
    # at start (`cadence.gpu.host_memory`), so that no step meets their first-touch faults.
    sched, cache = config.scheduler, config.cache
    options.setdefault("prefault_blocks", min(cache.num_blocks, sched.max_num_seqs * -(-sched.max_model_len
                                                                                        // cache.block_size)))
    if config.grammar_cache_size != DEFAULT_GRAMMAR_CACHE_SIZE:
        options.setdefault("grammar_cache_size", config.grammar_cache_size)
    return options


def _tokenizer_for(config: EngineConfig, model_dir: str) -> Tokenizer | None:
    if config.tokenizer is not None:
        return config.tokenizer
    if config.executor == "simulated":
        return ByteTokenizer()
    if os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        # A checkpoint directory brings its own tokenizer.
        from cadence.gpu.tokenizer import Tokenizer as CheckpointTokenizer
        return CheckpointTokenizer.from_pretrained(model_dir)
    return None


@asynccontextmanager
async def _run_engine(config: EngineConfig, on_step: StepListener | None) -> AsyncIterator[Engine]:
    model_dir = resolve_model(config.model)
    if config.executor == "simulated":
        logger.warning("simulated executor: no model runs; outputs are random tokens from a "
                       "latency model (pass executor='inprocess' and a model to run one)")
    tokenizer = _tokenizer_for(config, model_dir)
    backend = _make_backend(config, tokenizer)
    sched_config, cache = config.scheduler, config.cache
    init = InitExecutor(
        model=model_dir, dtype=config.dtype, device=config.device,
        num_blocks=cache.num_blocks, block_size=cache.block_size,
        max_model_len=sched_config.max_model_len,
        max_num_batched_tokens=sched_config.max_num_batched_tokens,
        seed=config.seed, options=_executor_options(config))
    bytes_per_token = None
    if getattr(tokenizer, "max_bytes_per_token", None) is not None:
        bytes_per_token = max_bytes_per_token(tokenizer)
    elif tokenizer is not None:
        # Reading a large vocabulary takes a moment; nothing of this engine runs yet.
        bytes_per_token = await trio.to_thread.run_sync(max_bytes_per_token, tokenizer)
    trace = None
    if config.trace_path is not None or config.record_trace:
        try:
            trace = TraceRecorder(config.trace_path, keep=config.record_trace)
        except OSError as error:
            raise ConfigError(f"trace_path: cannot write {config.trace_path!r}: "
                              f"{error.strerror or error}") from None
    try:
        try:
            with trio.fail_after(config.start_timeout_s):
                ready = await backend.start(init)
        except trio.TooSlowError:
            raise ExecutorError(f"executor did not start within {config.start_timeout_s} s") from None
        if ready.block_size != cache.block_size:
            raise ExecutorError(f"executor uses blocks of {ready.block_size} tokens, "
                                f"the cache config says {cache.block_size}")
        try:
            check_token_ids("eos_token_ids", ready.eos_token_ids, ready.vocab_size)
        except InvalidRequestError as exc:
            raise ExecutorError(f"the executor reports {exc}") from None
        sched_config = _fit_model_len(sched_config, ready.max_model_len)
        core = Scheduler(sched_config, attrs.evolve(cache, num_blocks=ready.num_blocks))
        async with trio.open_nursery() as nursery:
            supervisor = ExecutorSupervisor(
                backend, init, step_timeout_s=config.step_timeout_s,
                start_timeout_s=config.start_timeout_s, restart_backoff_s=config.restart_backoff_s,
                restart_backoff_max_s=config.restart_backoff_max_s, rng=random.Random(config.seed))
            scheduler = SchedulerActor(
                core, supervisor, nursery.start_soon, max_restarts=config.max_restarts,
                restart_window_s=config.restart_window_s, plan_ahead=config.plan_ahead,
                trace=trace, on_step=on_step)
            await nursery.start(scheduler.run)
            engine = Engine(config, scheduler, tokenizer, frozenset(ready.eos_token_ids),
                            ready.vocab_size, trace, bytes_per_token)
            try:
                yield engine
            finally:
                scheduler.router.close()
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            with trio.move_on_after(_CLOSE_TIMEOUT_S):
                await backend.aclose()
        if trace is not None:
            trace.close()
