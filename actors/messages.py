"""Every message between the scheduler actor and an executor, and its msgpack form.

A message travels as the msgpack array ``[PROTOCOL_VERSION, type_name, payload]``
where ``payload`` is a map from field name to value built only from standard
msgpack types (nil, bool, int, float, str, bin, array, map): no ext types and
never pickle, so a peer in any language can speak it. The same classes are used
in-process and across a socket, so moving the executor changes the transport,
not the protocol.

`decode` trusts nothing: whatever bytes it is given, it either returns a valid
message or raises `ProtocolError` whose text names the offending field path,
e.g. ``ExecuteStep.plan.new_requests[2].block_ids[0]: expected int, got str``.
Decoding checks every field's type and range, and SamplingParams' own rules;
it does not check one field against another (a plan's total against its
per-request counts, say): the runner checks a plan against its batch.
Validation is hand-written per message rather than reflected from the attrs
fields, because a decode step's plan is on every step's critical path.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Union

import attrs
import msgpack

from cadence.statemachine.errors import InvalidRequestError, ProtocolError
from cadence.statemachine.plan import NewRequestData, StepPlan, StepResult
from cadence.statemachine.sampling import SamplingParams, StructuredOutput

from .fields import (
    check_bool, check_dict, check_float, check_ids, check_int, check_list, check_str, check_strs,
    check_token_logprobs, find_bad_id, kind, wrong,
)

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_MESSAGE_BYTES",
    "OptionValue",
    "InitExecutor",
    "ExecuteStep",
    "Shutdown",
    "Ready",
    "StepOutput",
    "PromptLogprobs",
    "ExecutorFailed",
    "Heartbeat",
    "Message",
    "ToExecutor",
    "FromExecutor",
    "MESSAGE_TYPES",
    "encode",
    "decode",
]


PROTOCOL_VERSION = 1
# Large enough for a plan that admits hundreds of long prompts in full.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

OptionValue = Union[str, int, float, bool]

# The shared field checks under the names this module's decoders use.
_kind, _wrong, _int, _float, _bool, _str = kind, wrong, check_int, check_float, check_bool, check_str
_list, _dict, _ids, _find_bad_id, _strs = check_list, check_dict, check_ids, find_bad_id, check_strs


def _optional_int(value: object, path: str, minimum: int | None = 0) -> int | None:
    return None if value is None else _int(value, path, minimum)


def _str_keys(mapping: dict, path: str) -> None:
    for key in mapping:
        if type(key) is not str:
            raise ProtocolError(f"{path}: keys must be str, got {_kind(key)} key {key!r}")


def _str_to_count(value: object, path: str) -> dict[str, int]:
    """A map from str to non-negative int, checked in one pass."""
    mapping = _dict(value, path)
    for key, count in mapping.items():
        if type(key) is not str or type(count) is not int or count < 0:
            _str_keys(mapping, path)
            _int(count, f"{path}[{key!r}]")
    return mapping


def _str_to_ids(value: object, path: str) -> dict[str, list[int]]:
    """A map from str to an array of non-negative ints; paths are built only on failure."""
    mapping = _dict(value, path)
    for key, ids in mapping.items():
        if type(key) is not str or type(ids) is not list:
            _str_keys(mapping, path)
            _list(ids, f"{path}[{key!r}]")
        for item in ids:
            if type(item) is not int or item < 0:
                _find_bad_id(ids, f"{path}[{key!r}]")
    return mapping


def _fields(payload: object, path: str, names: frozenset[str]) -> dict:
    """Check that `payload` is a map holding exactly the fields `names`."""
    mapping = _dict(payload, path)
    if mapping.keys() != names:
        _str_keys(mapping, path)
        missing = sorted(names - mapping.keys())
        if missing:
            raise ProtocolError(f"{path}: missing field {missing[0]!r}")
        extra = sorted(mapping.keys() - names)
        raise ProtocolError(f"{path}: unexpected field {extra[0]!r}")
    return mapping


# ---------------------------------------------------------------------------
# The nested core types: StepPlan, NewRequestData, SamplingParams, StepResult.

_NEW_REQUEST_FIELDS = frozenset(f.name for f in attrs.fields(NewRequestData))
_PLAN_FIELDS = frozenset(f.name for f in attrs.fields(StepPlan))
_RESULT_FIELDS = frozenset(f.name for f in attrs.fields(StepResult))
_SAMPLING_FIELDS = frozenset(f.name for f in attrs.fields(SamplingParams))
_SAMPLING_FLOATS = (
    "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
)


def _new_request_to_wire(data: NewRequestData) -> dict[str, Any]:
    return {
        "request_id": data.request_id,
        "token_ids": data.token_ids,
        "num_prompt_tokens": data.num_prompt_tokens,
        "block_ids": data.block_ids,
        "num_computed_tokens": data.num_computed_tokens,
        "resumed": data.resumed,
    }


def _new_request_from_wire(value: object, path: str) -> NewRequestData:
    m = _fields(value, path, _NEW_REQUEST_FIELDS)
    return NewRequestData(
        request_id=_str(m["request_id"], f"{path}.request_id"),
        token_ids=_ids(m["token_ids"], f"{path}.token_ids"),
        num_prompt_tokens=_int(m["num_prompt_tokens"], f"{path}.num_prompt_tokens"),
        block_ids=_ids(m["block_ids"], f"{path}.block_ids"),
        num_computed_tokens=_int(m["num_computed_tokens"], f"{path}.num_computed_tokens"),
        resumed=_bool(m["resumed"], f"{path}.resumed"),
    )


def _plan_to_wire(plan: StepPlan) -> dict[str, Any]:
    return {
        "step_id": plan.step_id,
        "num_scheduled_tokens": plan.num_scheduled_tokens,
        "total_num_scheduled_tokens": plan.total_num_scheduled_tokens,
        "new_requests": [_new_request_to_wire(d) for d in plan.new_requests],
        "new_block_ids": plan.new_block_ids,
        "preempted_ids": plan.preempted_ids,
        "finished_ids": plan.finished_ids,
        "resumed_ids": plan.resumed_ids,
    }


def _plan_from_wire(value: object, path: str) -> StepPlan:
    m = _fields(value, path, _PLAN_FIELDS)
    new_requests = _list(m["new_requests"], f"{path}.new_requests")
    return StepPlan(
        step_id=_int(m["step_id"], f"{path}.step_id"),
        num_scheduled_tokens=_str_to_count(m["num_scheduled_tokens"], f"{path}.num_scheduled_tokens"),
        total_num_scheduled_tokens=_int(
            m["total_num_scheduled_tokens"], f"{path}.total_num_scheduled_tokens"),
        new_requests=[
            _new_request_from_wire(d, f"{path}.new_requests[{i}]") for i, d in enumerate(new_requests)
        ],
        new_block_ids=_str_to_ids(m["new_block_ids"], f"{path}.new_block_ids"),
        preempted_ids=_strs(m["preempted_ids"], f"{path}.preempted_ids"),
        finished_ids=_strs(m["finished_ids"], f"{path}.finished_ids"),
        resumed_ids=_strs(m["resumed_ids"], f"{path}.resumed_ids"),
    )


def _sampling_to_wire(params: SamplingParams) -> dict[str, Any]:
    return {
        "max_tokens": params.max_tokens,
        "min_tokens": params.min_tokens,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "seed": params.seed,
        "logprobs": params.logprobs,
        "prompt_logprobs": params.prompt_logprobs,
        "ignore_eos": params.ignore_eos,
        "stop": params.stop,
        "stop_token_ids": params.stop_token_ids,
        "include_stop_str_in_output": params.include_stop_str_in_output,
        "structured_output": _structured_to_wire(params.structured_output),
        "n": params.n,
        "best_of": params.best_of,
        "logit_bias": [list(pair) for pair in params.logit_bias],
        "allowed_token_ids": None if params.allowed_token_ids is None else list(params.allowed_token_ids),
        "bad_words": list(params.bad_words),
        "bad_words_token_ids": [list(word) for word in params.bad_words_token_ids],
        "skip_special_tokens": params.skip_special_tokens,
        "truncate_prompt_tokens": params.truncate_prompt_tokens,
    }


def _structured_to_wire(structured: StructuredOutput | None) -> dict[str, str] | None:
    return None if structured is None else {"kind": structured.kind, "spec": structured.spec}


def _structured_from_wire(value: object, path: str) -> dict[str, str] | None:
    """A {kind, spec} map of strs, or nil; SamplingParams checks the values."""
    if value is None:
        return None
    m = _fields(value, path, frozenset({"kind", "spec"}))
    return {"kind": _str(m["kind"], f"{path}.kind"), "spec": _str(m["spec"], f"{path}.spec")}


def _bias_pairs(value: object, path: str) -> list[tuple[int, float]]:
    """logit_bias as [token id, bias] pairs."""
    pairs = []
    for index, pair in enumerate(_list(value, path)):
        where = f"{path}[{index}]"
        if len(_list(pair, where)) != 2:
            raise ProtocolError(f"{where}: expected a [token id, bias] pair, got {len(pair)} items")
        pairs.append((_int(pair[0], f"{where}[0]", None), _float(pair[1], f"{where}[1]")))
    return pairs


def _sampling_from_wire(value: object, path: str) -> SamplingParams:
    m = _fields(value, path, _SAMPLING_FIELDS)
    fields: dict[str, Any] = {
        "max_tokens": _int(m["max_tokens"], f"{path}.max_tokens", None),
        "min_tokens": _int(m["min_tokens"], f"{path}.min_tokens", None),
        "top_k": _int(m["top_k"], f"{path}.top_k", None),
        "seed": _optional_int(m["seed"], f"{path}.seed", None),
        "logprobs": _optional_int(m["logprobs"], f"{path}.logprobs", None),
        "prompt_logprobs": _optional_int(m["prompt_logprobs"], f"{path}.prompt_logprobs", None),
        "ignore_eos": _bool(m["ignore_eos"], f"{path}.ignore_eos"),
        "stop": _strs(m["stop"], f"{path}.stop"),
        "stop_token_ids": _ids(m["stop_token_ids"], f"{path}.stop_token_ids"),
        "include_stop_str_in_output": _bool(
            m["include_stop_str_in_output"], f"{path}.include_stop_str_in_output"),
        "structured_output": _structured_from_wire(m["structured_output"], f"{path}.structured_output"),
        "n": _int(m["n"], f"{path}.n", None),
        "best_of": _optional_int(m["best_of"], f"{path}.best_of", None),
        "logit_bias": _bias_pairs(m["logit_bias"], f"{path}.logit_bias"),
        "allowed_token_ids": None if m["allowed_token_ids"] is None
        else _ids(m["allowed_token_ids"], f"{path}.allowed_token_ids"),
        "bad_words": _strs(m["bad_words"], f"{path}.bad_words"),
        "bad_words_token_ids": [_ids(word, f"{path}.bad_words_token_ids[{i}]")
                                for i, word in enumerate(_list(m["bad_words_token_ids"],
                                                               f"{path}.bad_words_token_ids"))],
        "skip_special_tokens": _bool(m["skip_special_tokens"], f"{path}.skip_special_tokens"),
        "truncate_prompt_tokens": _optional_int(m["truncate_prompt_tokens"], f"{path}.truncate_prompt_tokens",
                                                None),
    }
    for name in _SAMPLING_FLOATS:
        fields[name] = _float(m[name], f"{path}.{name}")
    try:
        return SamplingParams(**fields)
    except (InvalidRequestError, TypeError, ValueError) as exc:
        raise ProtocolError(f"{path}: {exc}") from None


def _logprobs_from_wire(value: object, path: str) -> dict[str, list[list[tuple[int, float]]]] | None:
    if value is None:
        return None
    mapping = _dict(value, path)
    _str_keys(mapping, path)
    return {key: check_token_logprobs(per_token, f"{path}[{key!r}]")
            for key, per_token in mapping.items()}


def _result_to_wire(result: StepResult) -> dict[str, Any]:
    return {
        "step_id": result.step_id,
        "sampled_token_ids": result.sampled_token_ids,
        "logprobs": result.logprobs,
        "execute_us": result.execute_us,
    }


def _result_from_wire(value: object, path: str) -> StepResult:
    m = _fields(value, path, _RESULT_FIELDS)
    return StepResult(
        step_id=_int(m["step_id"], f"{path}.step_id"),
        sampled_token_ids=_str_to_ids(m["sampled_token_ids"], f"{path}.sampled_token_ids"),
        logprobs=_logprobs_from_wire(m["logprobs"], f"{path}.logprobs"),
        execute_us=_int(m["execute_us"], f"{path}.execute_us"),
    )


# ---------------------------------------------------------------------------
# The messages.


@attrs.frozen
class InitExecutor:
    """Scheduler -> executor: load the model and allocate the KV cache.

    model: "simulated", a preset name such as "tiny", or a checkpoint directory.
    num_blocks: KV blocks to allocate; 0 lets the executor size the cache from
      free memory (the figure comes back in `Ready`).
    options: backend-specific switches (e.g. attention kernel), flat str -> scalar.
    """

    model: str
    dtype: str
    device: str
    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    seed: int
    options: dict[str, OptionValue] = attrs.field(factory=dict)

    TYPE: ClassVar[str] = "InitExecutor"

    def to_wire(self) -> dict[str, Any]:
        """The msgpack payload map."""
        return {
            "model": self.model, "dtype": self.dtype, "device": self.device,
            "num_blocks": self.num_blocks, "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "seed": self.seed, "options": self.options,
        }

    @classmethod
    def from_wire(cls, payload: object, path: str = "InitExecutor") -> InitExecutor:
        """Validate a payload map and build the message; raises ProtocolError."""
        m = _fields(payload, path, _INIT_FIELDS)
        options = _dict(m["options"], f"{path}.options")
        _str_keys(options, f"{path}.options")
        for key, value in options.items():
            if type(value) not in (str, int, float, bool):
                raise _wrong(f"{path}.options[{key!r}]", "str, int, float or bool", value)
        return cls(
            model=_str(m["model"], f"{path}.model"),
            dtype=_str(m["dtype"], f"{path}.dtype"),
            device=_str(m["device"], f"{path}.device"),
            num_blocks=_int(m["num_blocks"], f"{path}.num_blocks"),
            block_size=_int(m["block_size"], f"{path}.block_size", 1),
            max_model_len=_int(m["max_model_len"], f"{path}.max_model_len", 1),
            max_num_batched_tokens=_int(m["max_num_batched_tokens"], f"{path}.max_num_batched_tokens", 1),
            seed=_int(m["seed"], f"{path}.seed", None),
            options=options,
        )


@attrs.frozen
class ExecuteStep:
    """Scheduler -> executor: run one step plan.

    sampling: the sampling parameters of the plan's new requests (running ones
      keep theirs in the executor's persistent batch).
    """

    plan: StepPlan
    sampling: dict[str, SamplingParams] = attrs.field(factory=dict)

    TYPE: ClassVar[str] = "ExecuteStep"

    def to_wire(self) -> dict[str, Any]:
        """The msgpack payload map."""
        return {
            "plan": _plan_to_wire(self.plan),
            "sampling": {rid: _sampling_to_wire(p) for rid, p in self.sampling.items()},
        }

    @classmethod
    def from_wire(cls, payload: object, path: str = "ExecuteStep") -> ExecuteStep:
        """Validate a payload map and build the message; raises ProtocolError."""
        m = _fields(payload, path, _EXECUTE_FIELDS)
        plan = _plan_from_wire(m["plan"], f"{path}.plan")
        sampling = _dict(m["sampling"], f"{path}.sampling")
        _str_keys(sampling, f"{path}.sampling")
        return cls(
            plan=plan,
            sampling={rid: _sampling_from_wire(p, f"{path}.sampling[{rid!r}]") for rid, p in sampling.items()},
        )


@attrs.frozen
class Shutdown:
    """Scheduler -> executor: release the model and exit."""

    TYPE: ClassVar[str] = "Shutdown"

    def to_wire(self) -> dict[str, Any]:
        """The msgpack payload map (empty)."""
        return {}

    @classmethod
    def from_wire(cls, payload: object, path: str = "Shutdown") -> Shutdown:
        """Validate a payload map and build the message; raises ProtocolError."""
        _fields(payload, path, frozenset())
        return cls()


@attrs.frozen
class Ready:
    """Executor -> scheduler: started; the cache and vocabulary it really has."""

    num_blocks: int
    block_size: int
    vocab_size: int
    eos_token_ids: list[int]
    max_model_len: int

    TYPE: ClassVar[str] = "Ready"

    def to_wire(self) -> dict[str, Any]:
        """The msgpack payload map."""
        return {
            "num_blocks": self.num_blocks, "block_size": self.block_size,
            "vocab_size": self.vocab_size, "eos_token_ids": self.eos_token_ids,
            "max_model_len": self.max_model_len,
        }

    @classmethod
    def from_wire(cls, payload: object, path: str = "Ready") -> Ready:
        """Validate a payload map and build the message; raises ProtocolError."""
        m = _fields(payload, path, _READY_FIELDS)
        return cls(
            num_blocks=_int(m["num_blocks"], f"{path}.num_blocks", 1),
            block_size=_int(m["block_size"], f"{path}.block_size", 1),
            vocab_size=_int(m["vocab_size"], f"{path}.vocab_size", 1),
            eos_token_ids=_ids(m["eos_token_ids"], f"{path}.eos_token_ids"),
            max_model_len=_int(m["max_model_len"], f"{path}.max_model_len", 1),
        )


@attrs.frozen
class PromptLogprobs:
    """The log-probabilities of a run of one request's prompt tokens, computed in one step.

    first_position: the prompt position (>= 1) of the token `entries[0]` scores;
      entries[i] scores the token at first_position + i, from the logits of the
      position before it: [token id, logprob] pairs, that prompt token first,
      then the top alternatives.
    """

    first_position: int
    entries: list[list[tuple[int, float]]]

    def to_wire(self) -> list:
        """The msgpack form: [first_position, entries]."""
        return [self.first_position, self.entries]

    @classmethod
    def from_wire(cls, value: object, path: str) -> PromptLogprobs:
        """Validate [first_position, entries]; raises ProtocolError."""
        pair = _list(value, path)
        if len(pair) != 2:
            raise _wrong(path, "[first_position, entries] array", value)
        return cls(_int(pair[0], f"{path}[0]", 1), check_token_logprobs(pair[1], f"{path}[1]"))


@attrs.frozen
class StepOutput:
    """Executor -> scheduler: the sampled tokens of one step.

    failed: requests the executor could not serve this step, each with a
      one-line reason (an input it cannot encode, a sampling error in its row).
      They get no token; every other request's result stands, and the
      executor has already dropped them from its persistent batch.
    prompt_logprobs: for requests that asked for `prompt_logprobs`, those of
      the prompt tokens this step scored. Left out of the payload when empty, so
      a step where nobody asks costs nothing more on the wire.
    """

    result: StepResult
    failed: dict[str, str] = attrs.field(factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = attrs.field(factory=dict)

    TYPE: ClassVar[str] = "StepOutput"
    # Fields the payload leaves out when they are empty.
    OPTIONAL_FIELDS: ClassVar[frozenset] = frozenset({"prompt_logprobs"})

    def to_wire(self) -> dict[str, Any]:
        """The msgpack payload map."""
        payload = {"result": _result_to_wire(self.result), "failed": self.failed}
        if self.prompt_logprobs:
            payload["prompt_logprobs"] = {rid: p.to_wire() for rid, p in self.prompt_logprobs.items()}
        return payload

    @classmethod
    def from_wire(cls, payload: object, path: str = "StepOutput") -> StepOutput:
        """Validate a payload map and build the message; raises ProtocolError."""
        mapping = _dict(payload, path)
        m = _fields(mapping, path, _OUTPUT_FIELDS if "prompt_logprobs" in mapping
                    else _OUTPUT_FIELDS - cls.OPTIONAL_FIELDS)
        wire_prompt_logprobs = m.get("prompt_logprobs")  # nil reads as absent
        failed = _dict(m["failed"], f"{path}.failed")
        _str_keys(failed, f"{path}.failed")
        for rid, reason in failed.items():
            _str(reason, f"{path}.failed[{rid!r}]")
        prompt_logprobs = {}
        if wire_prompt_logprobs is not None:
            where = f"{path}.prompt_logprobs"
            _str_keys(_dict(wire_prompt_logprobs, where), where)
            prompt_logprobs = {rid: PromptLogprobs.from_wire(value, f"{where}[{rid!r}]")
                               for rid, value in wire_prompt_logprobs.items()}
        return cls(result=_result_from_wire(m["result"], f"{path}.result"), failed=failed,
                   prompt_logprobs=prompt_logprobs)


@attrs.frozen
class Heartbeat:
    """Executor -> scheduler: still alive, sent every few moments while it works
    on a request (start-up or a step), so a stopped process is told from a slow one."""

    TYPE: ClassVar[str] = "Heartbeat"

    def to_wire(self) -> dict[str, Any]:
        """The msgpack payload map (empty)."""
        return {}

    @classmethod
    def from_wire(cls, payload: object, path: str = "Heartbeat") -> Heartbeat:
        """Validate a payload map and build the message; raises ProtocolError."""
        _fields(payload, path, frozenset())
        return cls()


@attrs.frozen
class ExecutorFailed:
    """Executor -> scheduler: a step (or start-up, step_id None) raised.

    error: the exception's type and message, one line; detail: the traceback,
      for the scheduler's log only (never passed on to clients).
    """

    step_id: int | None
    error: str
    detail: str = ""

    TYPE: ClassVar[str] = "ExecutorFailed"

    def to_wire(self) -> dict[str, Any]:
        """The msgpack payload map."""
        return {"step_id": self.step_id, "error": self.error, "detail": self.detail}

    @classmethod
    def from_wire(cls, payload: object, path: str = "ExecutorFailed") -> ExecutorFailed:
        """Validate a payload map and build the message; raises ProtocolError."""
        m = _fields(payload, path, _FAILED_FIELDS)
        return cls(
            step_id=_optional_int(m["step_id"], f"{path}.step_id"),
            error=_str(m["error"], f"{path}.error"),
            detail=_str(m["detail"], f"{path}.detail"),
        )


def _field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in attrs.fields(cls))


_INIT_FIELDS = _field_names(InitExecutor)
_EXECUTE_FIELDS = _field_names(ExecuteStep)
_READY_FIELDS = _field_names(Ready)
_OUTPUT_FIELDS = _field_names(StepOutput)
_FAILED_FIELDS = _field_names(ExecutorFailed)

ToExecutor = Union[InitExecutor, ExecuteStep, Shutdown]
FromExecutor = Union[Ready, StepOutput, ExecutorFailed, Heartbeat]
Message = Union[ToExecutor, FromExecutor]

MESSAGE_TYPES: dict[str, type] = {
    cls.TYPE: cls for cls in (InitExecutor, ExecuteStep, Shutdown, Ready, StepOutput, ExecutorFailed,
                              Heartbeat)
}
_FROM_WIRE: dict[str, Callable[[object], Message]] = {
    name: cls.from_wire for name, cls in MESSAGE_TYPES.items()  # type: ignore[attr-defined]
}


# ---------------------------------------------------------------------------
# Bytes.


def _reject_ext(code: int, data: bytes) -> object:
    raise ProtocolError(f"msgpack ext type {code} is not allowed")


def encode(message: Message) -> bytes:
    """Serialise a message to its msgpack envelope; ProtocolError if it cannot be."""
    try:
        payload = message.to_wire()
        return msgpack.packb([PROTOCOL_VERSION, message.TYPE, payload], use_bin_type=True)
    except AttributeError:
        raise ProtocolError(f"not a message: {type(message).__name__}") from None
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"{type(message).__name__} cannot be encoded: {exc}") from None


def decode(data: bytes | bytearray | memoryview, max_size: int = MAX_MESSAGE_BYTES) -> Message:
    """Parse and validate one message; any defect raises ProtocolError naming the field."""
    if len(data) > max_size:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the limit of {max_size}")
    try:
        envelope = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True, ext_hook=_reject_ext)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"not a valid msgpack message: {type(exc).__name__}: {exc}") from None
    if type(envelope) is not list or len(envelope) != 3:
        raise ProtocolError(
            f"envelope: expected [version, type, payload] array, got {_kind(envelope)}"
            + (f" of length {len(envelope)}" if type(envelope) is list else "")
        )
    version, name, payload = envelope
    if type(version) is not int:
        raise _wrong("envelope.version", "int", version)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"envelope: unsupported protocol version {version} (expected {PROTOCOL_VERSION})")
    if type(name) is not str:
        raise _wrong("envelope.type", "str", name)
    from_wire = _FROM_WIRE.get(name)
    if from_wire is None:
        raise ProtocolError(f"envelope: unknown message type {name[:64]!r}")
    return from_wire(payload)
