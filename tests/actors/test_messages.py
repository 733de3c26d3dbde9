"""The executor messages: every valid message survives encode/decode unchanged, and
no input bytes make `decode` raise anything but ProtocolError."""

from __future__ import annotations

import os
import statistics
import time

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cadence.actors.messages import (
    MAX_MESSAGE_BYTES,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
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
from cadence.statemachine.errors import ProtocolError
from cadence.statemachine.plan import NewRequestData, StepPlan, StepResult
from cadence.statemachine.sampling import (
    MAX_INT64, MIN_REPETITION_PENALTY, MIN_TEMPERATURE, SamplingParams,
)


def examples(count: int) -> settings:
    """`count` examples normally; the profile's (many more) under CADENCE_EXPLORE=1."""
    if os.environ.get("CADENCE_EXPLORE") == "1":
        return settings()
    return settings(max_examples=count)


# ---------------------------------------------------------------------------
# Strategies for valid messages.

UINT64 = 2**64 - 1
ids = st.integers(0, UINT64)
id_lists = st.lists(ids, max_size=6)
counts = st.integers(0, 2**40)
# A plain alphabet keeps field paths in error messages easy to find in tests.
request_ids = st.text(alphabet="abcxyz-0123456789", max_size=8)
finite = st.floats(allow_nan=False, allow_infinity=False)

new_requests = st.builds(
    NewRequestData,
    request_id=request_ids, token_ids=id_lists, num_prompt_tokens=counts,
    block_ids=id_lists, num_computed_tokens=counts, resumed=st.booleans(),
)
plans = st.builds(
    StepPlan,
    step_id=counts,
    num_scheduled_tokens=st.dictionaries(request_ids, counts, max_size=5),
    total_num_scheduled_tokens=counts,
    new_requests=st.lists(new_requests, max_size=3),
    new_block_ids=st.dictionaries(request_ids, id_lists, max_size=3),
    preempted_ids=st.lists(request_ids, max_size=3),
    finished_ids=st.lists(request_ids, max_size=3),
    resumed_ids=st.lists(request_ids, max_size=3),
)


@st.composite
def sampling_params(draw) -> SamplingParams:
    """Any valid SamplingParams (min_tokens drawn within max_tokens)."""
    max_tokens = draw(st.integers(1, 2**31))
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens)),
        temperature=draw(st.just(0.0) | st.floats(MIN_TEMPERATURE, 100.0)),
        top_k=draw(st.integers(0, 2**31)),
        top_p=draw(st.floats(0.0, 1.0, exclude_min=True)),
        min_p=draw(st.floats(0.0, 1.0)),
        repetition_penalty=draw(st.floats(MIN_REPETITION_PENALTY, 10.0)),
        presence_penalty=draw(st.floats(-2.0, 2.0)),
        frequency_penalty=draw(st.floats(-2.0, 2.0)),
        seed=draw(st.none() | st.integers(-(2**63), UINT64)),
        logprobs=draw(st.none() | st.integers(0, 20)),
        prompt_logprobs=draw(st.none() | st.integers(0, 20)),
        ignore_eos=draw(st.booleans()),
        stop=draw(st.lists(st.text(min_size=1, max_size=5), max_size=3)),
        stop_token_ids=draw(st.lists(st.integers(0, MAX_INT64), max_size=3)),
        include_stop_str_in_output=draw(st.booleans()),
        n=(n := draw(st.integers(1, 4))),
        best_of=draw(st.sampled_from([None, n])),
        logit_bias=draw(st.dictionaries(st.integers(0, 2**31), st.floats(-100.0, 100.0), max_size=3)),
        allowed_token_ids=draw(st.none() | st.lists(st.integers(0, 2**31), min_size=1, max_size=3)),
        bad_words=draw(st.lists(st.text(min_size=1, max_size=4), max_size=2)),
        bad_words_token_ids=draw(st.lists(st.lists(st.integers(0, 2**31), min_size=1, max_size=3), max_size=2)),
        skip_special_tokens=draw(st.booleans()),
        truncate_prompt_tokens=draw(st.none() | st.integers(1, 2**31)),
    )


option_values = st.one_of(st.text(max_size=6), st.integers(-(2**63), UINT64), finite, st.booleans())
logprob_lists = st.lists(st.lists(st.tuples(ids, st.floats(allow_nan=False)), max_size=3), max_size=3)

init_messages = st.builds(
    InitExecutor,
    model=st.text(max_size=12), dtype=st.sampled_from(["float32", "bfloat16", ""]),
    device=st.sampled_from(["cpu", "cuda", "cuda:1", "auto"]),
    num_blocks=counts, block_size=st.integers(1, 2**20), max_model_len=st.integers(1, 2**31),
    max_num_batched_tokens=st.integers(1, 2**31), seed=st.integers(-(2**63), UINT64),
    options=st.dictionaries(st.text(max_size=6), option_values, max_size=4),
)
execute_messages = st.builds(
    ExecuteStep, plan=plans, sampling=st.dictionaries(request_ids, sampling_params(), max_size=3),
)
ready_messages = st.builds(
    Ready, num_blocks=st.integers(1, 2**40), block_size=st.integers(1, 2**20),
    vocab_size=st.integers(1, 2**31), eos_token_ids=id_lists, max_model_len=st.integers(1, 2**31),
)
output_messages = st.builds(
    StepOutput,
    result=st.builds(
        StepResult, step_id=counts,
        sampled_token_ids=st.dictionaries(request_ids, id_lists, max_size=5),
        logprobs=st.none() | st.dictionaries(request_ids, logprob_lists, max_size=3),
        execute_us=counts,
    ),
    failed=st.dictionaries(request_ids, st.text(max_size=20), max_size=3),
    prompt_logprobs=st.dictionaries(
        request_ids, st.builds(PromptLogprobs, first_position=st.integers(1, 2**31), entries=logprob_lists),
        max_size=2),
)
failed_messages = st.builds(
    ExecutorFailed, step_id=st.none() | counts, error=st.text(max_size=20), detail=st.text(max_size=40),
)
messages = st.one_of(
    init_messages, execute_messages, st.just(Shutdown()), ready_messages, output_messages, failed_messages,
    st.just(Heartbeat()),
)


# ---------------------------------------------------------------------------
# Round trips.


def test_every_message_type_is_registered_under_its_class_name():
    assert set(MESSAGE_TYPES) == {"InitExecutor", "ExecuteStep", "Shutdown", "Ready", "StepOutput",
                                  "ExecutorFailed", "Heartbeat"}
    for name, cls in MESSAGE_TYPES.items():
        assert cls.__name__ == name


@examples(300)
@given(messages)
def test_round_trip_gives_an_equal_message(message):
    data = encode(message)
    decoded = decode(data)
    assert type(decoded) is type(message)
    assert decoded == message
    assert encode(decoded) == data


@examples(50)
@given(messages)
def test_envelope_is_version_type_and_field_map(message):
    version, name, payload = msgpack.unpackb(encode(message))
    assert version == PROTOCOL_VERSION
    assert name == type(message).__name__
    assert isinstance(payload, dict)
    # Every field is in the map, but for those a message leaves out when empty.
    fields = {f.name for f in type(message).__attrs_attrs__}
    assert set(payload) <= fields
    assert fields - set(payload) <= getattr(type(message), "OPTIONAL_FIELDS", frozenset())


def test_logprob_pairs_come_back_as_tuples():
    result = StepResult(3, {"a": [5]}, {"a": [[(5, -0.25), (7, -1.5)]]}, 12)
    decoded = decode(encode(StepOutput(result)))
    assert decoded.result.logprobs == {"a": [[(5, -0.25), (7, -1.5)]]}
    assert isinstance(decoded.result.logprobs["a"][0][0], tuple)


def test_ints_are_accepted_for_floats_and_become_floats():
    wire = msgpack.unpackb(encode(ExecuteStep(_plan(), {"a": SamplingParams(temperature=0.5)})))
    wire[2]["sampling"]["a"]["temperature"] = 2
    params = decode(msgpack.packb(wire)).sampling["a"]
    assert params.temperature == 2.0 and type(params.temperature) is float


# ---------------------------------------------------------------------------
# Precise errors.


def _plan(**changes) -> StepPlan:
    fields = dict(
        step_id=4, num_scheduled_tokens={"a": 3}, total_num_scheduled_tokens=3,
        new_requests=[NewRequestData("a", [1, 2, 3], 3, [0], 0)], new_block_ids={},
        preempted_ids=[], finished_ids=[], resumed_ids=[],
    )
    fields.update(changes)
    return StepPlan(**fields)


def _wire(message) -> list:
    return msgpack.unpackb(encode(message))


def _decode_wire(wire) -> object:
    return decode(msgpack.packb(wire, use_bin_type=True))


def test_error_names_the_full_field_path():
    plan = _plan(new_requests=[NewRequestData(r, [1], 1, [0], 0) for r in "abc"])
    wire = _wire(ExecuteStep(plan, {r: SamplingParams() for r in "abc"}))
    wire[2]["plan"]["new_requests"][2]["block_ids"][0] = "seven"
    with pytest.raises(ProtocolError) as info:
        _decode_wire(wire)
    assert str(info.value) == "ExecuteStep.plan.new_requests[2].block_ids[0]: expected int, got str"


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda w: w[2]["plan"].__setitem__("step_id", True), "ExecuteStep.plan.step_id: expected int, got bool"),
        (lambda w: w[2]["plan"]["num_scheduled_tokens"].__setitem__("a", -1),
         "ExecuteStep.plan.num_scheduled_tokens['a']: must be >= 0, got -1"),
        (lambda w: w[2]["plan"]["new_requests"][0]["token_ids"].append(1.0),
         "ExecuteStep.plan.new_requests[0].token_ids[3]: expected int, got float"),
        (lambda w: w[2]["plan"].pop("finished_ids"), "ExecuteStep.plan: missing field 'finished_ids'"),
        (lambda w: w[2]["plan"].__setitem__("colour", 1), "ExecuteStep.plan: unexpected field 'colour'"),
        (lambda w: w[2].__setitem__("extra", None), "ExecuteStep: unexpected field 'extra'"),
        (lambda w: w[2]["sampling"]["a"].__setitem__("top_p", 0.0),
         "ExecuteStep.sampling['a']: top_p must be in (0, 1], got 0.0"),
        (lambda w: w[2]["sampling"]["a"].__setitem__("ignore_eos", 0),
         "ExecuteStep.sampling['a'].ignore_eos: expected bool, got int"),
        (lambda w: w[2]["sampling"]["a"]["stop"].append(3), "ExecuteStep.sampling['a'].stop[0]: expected str, got int"),
        (lambda w: w[2]["plan"]["new_block_ids"].__setitem__("a", {"x": 1}),
         "ExecuteStep.plan.new_block_ids['a']: expected array, got map"),
        (lambda w: w[2]["plan"]["num_scheduled_tokens"].__setitem__(b"a", 1),
         "ExecuteStep.plan.num_scheduled_tokens: keys must be str, got bin key b'a'"),
        (lambda w: w.__setitem__(0, 99), "envelope: unsupported protocol version 99 (expected 1)"),
        (lambda w: w.__setitem__(0, True), "envelope.version: expected int, got bool"),
        (lambda w: w.__setitem__(1, "Reboot"), "envelope: unknown message type 'Reboot'"),
        (lambda w: w.__setitem__(2, []), "ExecuteStep: expected map, got array"),
        (lambda w: w.append(None), "envelope: expected [version, type, payload] array, got array of length 4"),
    ],
)
def test_each_defect_is_reported_where_it_is(mutate, expected):
    wire = _wire(ExecuteStep(_plan(), {"a": SamplingParams(stop=())}))
    mutate(wire)
    with pytest.raises(ProtocolError) as info:
        _decode_wire(wire)
    assert str(info.value) == expected


def test_step_output_and_options_defects_are_reported():
    wire = _wire(StepOutput(StepResult(1, {"a": [1]}, {"a": [[(1, -0.5)]]}, 0)))
    wire[2]["result"]["logprobs"]["a"][0][0] = [1, -0.5, 3]
    with pytest.raises(ProtocolError, match=r"StepOutput\.result\.logprobs\['a'\]\[0\]\[0\]: expected \[token"):
        _decode_wire(wire)
    wire = _wire(InitExecutor("simulated", "", "cpu", 1, 16, 64, 64, 0, {"k": 1}))
    wire[2]["options"]["k"] = [1]
    expected = r"InitExecutor\.options\['k'\]: expected str, int, float or bool, got array"
    with pytest.raises(ProtocolError, match=expected):
        _decode_wire(wire)
    wire = _wire(Ready(8, 16, 100, [2], 64))
    wire[2]["block_size"] = 0
    with pytest.raises(ProtocolError, match=r"Ready\.block_size: must be >= 1, got 0"):
        _decode_wire(wire)


def _paths(value, prefix=()):
    """Every position in a decoded msgpack tree (map values and array items), outermost first."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield prefix + (key,)
            yield from _paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield prefix + (index,)
            yield from _paths(item, prefix + (index,))


def _replaced(tree, path, replacement):
    tree = msgpack.unpackb(msgpack.packb(tree, use_bin_type=True), strict_map_key=False)
    node = tree
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = replacement
    return tree


def _component(step) -> str:
    # Field names appear bare, map keys as their repr: both contain the escaped text.
    return f"[{step}]" if isinstance(step, int) else repr(step)[1:-1]


@examples(100)
@given(messages, st.data())
def test_bin_is_rejected_anywhere_and_the_error_names_the_spot(message, data):
    # No field of any message is bin, so this must fail wherever it lands.
    wire = _wire(message)
    path = data.draw(st.sampled_from(list(_paths(wire))))
    with pytest.raises(ProtocolError) as info:
        _decode_wire(_replaced(wire, path, b"\x00"))
    if len(path) > 2:  # below the envelope, the path is spelled out
        assert _component(path[-1]) in str(info.value)
        assert "got bin" in str(info.value) or "[token id, logprob] pair" in str(info.value)


@examples(100)
@given(messages, st.data())
def test_bool_is_never_an_int(message, data):
    wire = _wire(message)
    int_paths = [
        p for p in _paths(wire)
        if "options" not in p and type(_get(wire, p)) is int
    ]
    if not int_paths:
        return
    path = data.draw(st.sampled_from(int_paths))
    with pytest.raises(ProtocolError, match="got bool"):
        _decode_wire(_replaced(wire, path, True))


def _get(tree, path):
    for step in path:
        tree = tree[step]
    return tree


# ---------------------------------------------------------------------------
# Garbage in, ProtocolError out.

msgpack_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), UINT64), st.floats(), st.text(max_size=6), st.binary(max_size=6),
)
msgpack_values = st.recursive(
    msgpack_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=25,
)


def _decodes_or_protocol_error(data: bytes) -> None:
    try:
        message = decode(data)
    except ProtocolError:
        return
    assert type(message) in MESSAGE_TYPES.values()
    assert decode(encode(message)) == message


@examples(300)
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_protocol_error(data):
    _decodes_or_protocol_error(data)


@examples(200)
@given(msgpack_values)
def test_msgpack_of_the_wrong_shape_raises_only_protocol_error(value):
    _decodes_or_protocol_error(msgpack.packb(value, use_bin_type=True))


@examples(200)
@given(st.sampled_from(sorted(MESSAGE_TYPES)), msgpack_values)
def test_right_envelope_random_payload_raises_only_protocol_error(name, payload):
    _decodes_or_protocol_error(msgpack.packb([PROTOCOL_VERSION, name, payload], use_bin_type=True))


@examples(200)
@given(messages, st.data())
def test_any_field_replaced_by_anything_raises_only_protocol_error(message, data):
    wire = _wire(message)
    path = data.draw(st.sampled_from(list(_paths(wire))))
    replacement = data.draw(msgpack_values)
    _decodes_or_protocol_error(msgpack.packb(_replaced(wire, path, replacement), use_bin_type=True))


@examples(100)
@given(messages, st.data())
def test_every_truncation_is_a_protocol_error(message, data):
    encoded = encode(message)
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(ProtocolError):
        decode(encoded[:cut])


@examples(50)
@given(messages, st.binary(min_size=1, max_size=8))
def test_trailing_bytes_are_a_protocol_error(message, tail):
    with pytest.raises(ProtocolError):
        decode(encode(message) + tail)


@examples(100)
@given(messages, st.data(), st.integers(0, 127))
def test_ext_types_are_rejected_anywhere(message, data, code):
    wire = _wire(message)
    path = data.draw(st.sampled_from([()] + list(_paths(wire))))
    ext = msgpack.ExtType(code, b"\x01\x02")
    tree = ext if path == () else _replaced(wire, path, ext)
    with pytest.raises(ProtocolError):
        decode(msgpack.packb(tree, use_bin_type=True))


@pytest.mark.parametrize("code", [-1, -5, -128])
def test_reserved_ext_codes_are_rejected(code):
    # fixext 4 with a negative (reserved) type code; -1 is msgpack's timestamp.
    ext = b"\xd6" + code.to_bytes(1, "big", signed=True) + b"\x00\x00\x00\x01"
    with pytest.raises(ProtocolError):
        decode(b"\x93\x01\xa5Ready" + ext)
    with pytest.raises(ProtocolError):
        decode(ext)


def test_timestamps_are_rejected():
    wire = _wire(Ready(8, 16, 100, [2], 64))
    wire[2]["vocab_size"] = msgpack.Timestamp(10**9)
    with pytest.raises(ProtocolError):
        _decode_wire(wire)


@pytest.mark.parametrize(
    "data",
    [
        b"\xdd\xff\xff\xff\xff",  # array32 claiming 4 G items
        b"\xdf\xff\xff\xff\xff",  # map32
        b"\xdb\xff\xff\xff\xff" + b"x" * 10,  # str32
        b"\xc6\xff\xff\xff\xff" + b"x" * 10,  # bin32
        b"\xc9\xff\xff\xff\xff\x01",  # ext32
        b"\x93\x01\xa5Ready\xdf\xff\xff\xff\xff",  # inside a valid envelope
        b"\x93\x01\xdb\x7f\xff\xff\xff",
    ],
)
def test_huge_declared_lengths_fail_fast(data):
    start = time.perf_counter()
    with pytest.raises(ProtocolError):
        decode(data)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_deep_nesting_is_a_protocol_error(depth):
    with pytest.raises(ProtocolError):
        decode(b"\x91" * depth + b"\xc0")
    envelope = b"\x93\x01\xabExecuteStep\x81\xa4plan" + b"\x91" * depth + b"\xc0"
    with pytest.raises(ProtocolError):
        decode(envelope)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # the one byte msgpack never uses
        b"\x93\x01\xa2\xff\xfe\x80",  # invalid UTF-8 in a str
        b"\x93\x01\xa5Ready\x81\x90\x01",  # a map whose key is an array
        b"\x93\x01\xa5Ready\x81\x01\x01",  # a map whose key is an int
    ],
)
def test_malformed_msgpack_is_a_protocol_error(data):
    with pytest.raises(ProtocolError):
        decode(data)


def test_oversize_is_rejected_before_parsing():
    data = encode(Ready(8, 16, 100, [2], 64))
    assert decode(data, max_size=len(data)) == Ready(8, 16, 100, [2], 64)
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        decode(data, max_size=len(data) - 1)
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        decode(b"\x00" * (MAX_MESSAGE_BYTES + 1))


def test_encode_refuses_what_it_cannot_represent():
    with pytest.raises(ProtocolError, match="not a message"):
        encode(object())  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="cannot be encoded"):
        encode(Ready(8, 16, 100, [2**70], 64))
    with pytest.raises(ProtocolError, match="cannot be encoded"):
        encode(InitExecutor("m", "", "cpu", 1, 1, 1, 1, 0, {"k": object()}))  # type: ignore[dict-item]


# ---------------------------------------------------------------------------
# Speed: a decode step for 256 requests is on every step's critical path.


def decode_plan(num_requests: int = 256, block_size: int = 16) -> ExecuteStep:
    """A steady-state decode step: one token each, a new block for one request in `block_size`."""
    ids = [f"req-{i}" for i in range(num_requests)]
    plan = StepPlan(
        step_id=1000, num_scheduled_tokens=dict.fromkeys(ids, 1), total_num_scheduled_tokens=num_requests,
        new_requests=[], new_block_ids={rid: [5000 + i] for i, rid in enumerate(ids) if i % block_size == 0},
        preempted_ids=[], finished_ids=[], resumed_ids=[],
    )
    return ExecuteStep(plan, {})


def test_decode_plan_round_trip_takes_well_under_a_millisecond():
    # Thread CPU time, not wall time, so other processes on a busy machine do not count.
    step = decode_plan()
    output = StepOutput(StepResult(1000, {rid: [17] for rid in step.plan.num_scheduled_tokens}))
    samples = []
    for _ in range(30):
        start = time.thread_time_ns()
        for _ in range(10):
            assert decode(encode(step)) == step
            decode(encode(output))
        samples.append((time.thread_time_ns() - start) / 10 / 1000)
    assert statistics.median(samples) < 1000, f"median plan+output round trip {statistics.median(samples):.0f} us"


@given(st.lists(st.one_of(st.integers(-2, 2**64), st.booleans(), st.floats(0, 1), st.text(max_size=1)),
                max_size=6))
def test_wire_int_arrays_are_decided_as_entry_by_entry(values):
    """The msgpack decoder's int arrays (prompt ids, token-id fields) take the same
    builtins fast path: accepted exactly when every entry is a plain int, the first
    other one named."""
    from cadence.actors.wire import MessageError, _int_array

    bad = next(((i, v) for i, v in enumerate(values) if type(v) is not int), None)
    if bad is None:
        assert _int_array(values, "p") is values
    else:
        with pytest.raises(MessageError, match=rf"p\[{bad[0]}\]: expected int"):
            _int_array(values, "p")
