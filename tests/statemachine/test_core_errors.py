"""Errors a user catches: each names the field at fault and the numbers involved,
and a rejected call changes nothing."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from cadence.statemachine import errors
from cadence.statemachine.config import CacheConfig, SchedulerConfig
from cadence.statemachine.errors import (
    CadenceError, ConfigError, DuplicateRequestError, InvalidRequestError, QueueFullError,
    RequestNotFoundError, RequestTooLongError,
)
from cadence.statemachine.request import Request, SamplingLimits
from cadence.statemachine.sampling import MIN_TEMPERATURE, SamplingParams
from cadence.statemachine.scheduler import Scheduler

from core_helpers import make_request, make_scheduler, run_until_idle


def numbers_in(message: str) -> set[int]:
    """Every integer written in `message`."""
    return {int(n) for n in re.findall(r"-?\d+", message)}


def fingerprint(s: Scheduler) -> tuple:
    """What a rejected call must leave untouched."""
    return (sorted(s.requests), s.num_waiting, s.num_running, s.collector.num_requests_added,
            dict(s.blocks.tables), s.blocks.num_free_blocks)


def test_every_error_is_exported_and_catchable_as_cadence_error():
    """All user-facing errors live in one module and share one base class."""
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), CadenceError)
    assert issubclass(RequestTooLongError, InvalidRequestError)
    assert issubclass(ConfigError, ValueError) and issubclass(InvalidRequestError, ValueError)
    assert issubclass(RequestNotFoundError, KeyError)


def test_too_long_for_max_model_len_names_the_field_and_both_numbers():
    """Prompt plus max_tokens beyond max_model_len is refused with the total and the limit."""
    s = make_scheduler(max_model_len=32, num_blocks=64)
    before = fingerprint(s)
    with pytest.raises(RequestTooLongError) as info:
        s.add_request(make_request("long", 30, max_tokens=5))
    message = str(info.value)
    assert "max_model_len" in message and "long" in message
    assert {30, 5, 35, 32} <= numbers_in(message)
    assert fingerprint(s) == before


def test_exactly_max_model_len_is_accepted():
    """The limit is inclusive: prompt + max_tokens == max_model_len fits."""
    s = make_scheduler(max_model_len=32)
    s.add_request(make_request("edge", 28, max_tokens=4))
    assert s.num_waiting == 1


def test_too_long_for_the_kv_cache_names_blocks_and_both_numbers():
    """A request needing more blocks than the cache has is refused with both counts."""
    s = make_scheduler(max_model_len=1000, num_blocks=4, block_size=4)
    before = fingerprint(s)
    with pytest.raises(RequestTooLongError) as info:
        s.add_request(make_request("big", 15, max_tokens=2))
    message = str(info.value)
    assert "KV blocks" in message and "big" in message
    assert {17, 5, 4} <= numbers_in(message)  # 17 tokens, 5 blocks needed, 4 in the cache
    assert fingerprint(s) == before


def test_too_long_for_the_kv_cache_names_num_blocks():
    """The message names the configuration field a user would raise."""
    s = make_scheduler(max_model_len=1000, num_blocks=4, block_size=4)
    with pytest.raises(RequestTooLongError, match="num_blocks"):
        s.add_request(make_request("big", 15, max_tokens=2))


def test_queue_full_names_max_waiting_and_both_numbers():
    """Beyond max_waiting queued requests, add_request raises QueueFullError."""
    s = make_scheduler(max_waiting=2)
    s.add_request(make_request("a", 3))
    s.add_request(make_request("b", 3))
    before = fingerprint(s)
    with pytest.raises(QueueFullError) as info:
        s.add_request(make_request("c", 3))
    assert "max_waiting" in str(info.value) and numbers_in(str(info.value)) >= {2}
    assert fingerprint(s) == before
    s.schedule()  # admitting one makes room again
    s.add_request(make_request("c", 3))


def test_max_waiting_zero_refuses_everything():
    """max_waiting=0 is a valid configuration that accepts nothing."""
    s = make_scheduler(max_waiting=0)
    with pytest.raises(QueueFullError, match="max_waiting is 0"):
        s.add_request(make_request("a", 3))


def test_request_not_found_names_the_id():
    """Aborting or looking up an unknown id raises RequestNotFoundError with the id."""
    s = make_scheduler()
    with pytest.raises(RequestNotFoundError, match="ghost"):
        s.abort_request("ghost")
    with pytest.raises(RequestNotFoundError, match="ghost"):
        s.get_request("ghost")
    with pytest.raises(RequestNotFoundError, match="ghost"):
        s.fail_request("ghost", "boom")
    s.add_request(make_request("done", 3, max_tokens=1))
    run_until_idle(s)
    with pytest.raises(RequestNotFoundError, match="done"):
        s.abort_request("done")  # completed requests are no longer live


def test_duplicate_live_id_names_the_id():
    """A second live request with the same id is refused; the first is untouched."""
    s = make_scheduler()
    first = make_request("dup", 3)
    s.add_request(first)
    before = fingerprint(s)
    with pytest.raises(DuplicateRequestError, match="dup"):
        s.add_request(make_request("dup", 5))
    assert fingerprint(s) == before and s.get_request("dup") is first


def test_a_request_object_cannot_be_added_twice():
    """Re-adding a request object that has already run is refused even after it completed."""
    s = make_scheduler()
    request = make_request("once", 3, max_tokens=1)
    s.add_request(request)
    run_until_idle(s)
    with pytest.raises(DuplicateRequestError, match="once"):
        s.add_request(request)


def test_an_id_may_be_reused_after_completion():
    """Only live ids are reserved."""
    s = make_scheduler()
    s.add_request(make_request("again", 3, max_tokens=1))
    run_until_idle(s)
    s.add_request(make_request("again", 3, max_tokens=1))
    assert s.has_work()


BAD_SCHEDULER_FIELDS = [
    ("max_num_seqs", 0), ("max_num_batched_tokens", 0), ("max_model_len", 0), ("max_waiting", -1),
    ("long_prefill_token_threshold", -1), ("aging_steps", -1), ("default_deadline_s", -0.5),
    ("fair_input_weight", -1.0), ("fair_output_weight", -1.0), ("starvation_skip_limit", -1),
    ("max_lookahead", -1), ("admission_watermark", 1.0), ("admission_watermark", -0.1),
    ("admission_growth_share", 1.5), ("admission_growth_share", -0.1),
    ("predicted_watermark", 1.0), ("predicted_watermark", -0.1),
    ("predicted_growth_share", 1.5), ("predicted_growth_share", -0.1),
    ("schedule_interval_us", -1), ("max_batch_size", 0), ("policy", "lottery"), ("policy", 3),
    ("fcfs_victim", "lifo"),
]


@pytest.mark.parametrize(("field", "value"), BAD_SCHEDULER_FIELDS)
def test_bad_scheduler_config_names_the_field(field, value):
    """Each out-of-range SchedulerConfig field raises ConfigError naming it."""
    with pytest.raises(ConfigError) as info:
        SchedulerConfig(**{field: value})
    message = str(info.value)
    assert field in message and (repr(value) in message or str(value) in message)


@pytest.mark.parametrize(("field", "value"), [("num_blocks", 0), ("block_size", 0)])
def test_bad_cache_config_names_the_field(field, value):
    """Each out-of-range CacheConfig field raises ConfigError naming it."""
    with pytest.raises(ConfigError, match=f"{field} must be >= 1, got {value}"):
        CacheConfig(**{field: value})


def test_unchunked_budget_below_max_model_len_names_both_fields_and_numbers():
    """Without chunked prefill a whole prompt must fit one step's budget."""
    with pytest.raises(ConfigError) as info:
        SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=100, max_model_len=200)
    message = str(info.value)
    assert "max_num_batched_tokens" in message and "max_model_len" in message
    assert {100, 200} <= numbers_in(message)


def test_unloadable_user_policy_is_a_config_error():
    """A 'module:Class' policy that cannot be imported fails where the scheduler is made."""
    with pytest.raises(ConfigError, match="no_such_module_xyz"):
        Scheduler(SchedulerConfig(policy="no_such_module_xyz:Policy"))
    with pytest.raises(ConfigError, match="NoSuchClass"):
        Scheduler(SchedulerConfig(policy="cadence.statemachine.policy:NoSuchClass"))


def test_user_policy_must_implement_the_protocol():
    """A loadable class that is not a SchedulingPolicy is refused."""
    with pytest.raises(ConfigError, match="SchedulingPolicy"):
        Scheduler(SchedulerConfig(policy="core_helpers:NotAPolicy"))


def test_user_policy_by_module_path_is_used():
    """A built-in class named by path loads like a user policy."""
    s = Scheduler(SchedulerConfig(policy="cadence.statemachine.policy:FcfsPolicy"))
    assert s.policy.name == "fcfs"


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(max_tokens=2, min_tokens=3), "min_tokens"),
])
def test_bad_sampling_limits_name_the_field(kwargs, field):
    """SamplingLimits refuses impossible stop limits with InvalidRequestError."""
    with pytest.raises(InvalidRequestError, match=field):
        SamplingLimits(**kwargs)


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", 0), ("min_tokens", -1), ("min_tokens", 17), ("temperature", -0.1), ("top_k", -2),
    ("top_p", 0.0), ("top_p", 1.5), ("min_p", 1.5), ("repetition_penalty", 0.0),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.5), ("logprobs", 21), ("logprobs", -1),
    ("stop", ""),
    # Values that reached the model unchecked: overflow, non-finite, wrong type.
    ("temperature", math.inf), ("temperature", math.nan), ("temperature", 1e-308),
    ("repetition_penalty", 1e-308), ("repetition_penalty", math.inf), ("top_k", 2.5),
    ("top_k", 2**63), ("max_tokens", True), ("max_tokens", 2.0), ("seed", 2**70),
    ("seed", -(2**63) - 1), ("logprobs", True), ("top_p", math.nan), ("min_p", -1e-9),
    ("presence_penalty", math.nan), ("temperature", True), ("ignore_eos", 1),
    ("include_stop_str_in_output", "yes"),
])
def test_bad_sampling_params_name_the_field_and_value(field, value):
    """SamplingParams refuses each out-of-range or mistyped field, naming it and the bad value."""
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert str(info.value).startswith(field) and repr(value) in str(info.value)


def test_top_k_minus_one_is_vllms_no_top_k():
    """-1 is vLLM's spelling of "no top-k" and means Cadence's 0; other negatives are refused."""
    assert SamplingParams(top_k=-1).top_k == 0 == SamplingParams().top_k
    with pytest.raises(InvalidRequestError, match="top_k"):
        SamplingParams(top_k=-2)


@pytest.mark.parametrize("value", [[2**64 - 1], [-1], [True], [1.0], 5])
def test_bad_stop_token_ids_are_refused_naming_the_field(value):
    """stop_token_ids: ints (no bool, no float) that fit in 64 bits and are not negative."""
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=value)


def test_a_bare_stop_string_is_one_stop_string():
    """stop="abc" is the one stop string "abc", not three one-character ones."""
    assert SamplingParams(stop="abc").stop == ("abc",)
    assert SamplingParams(stop=["abc", "d"]).stop == ("abc", "d")


def test_none_stop_lists_are_empty_as_in_vllm():
    """stop=None and stop_token_ids=None (vLLM's defaults, and what clients that
    spell out every field send) mean no stop strings and no stop ids."""
    params = SamplingParams(stop=None, stop_token_ids=None)
    assert params.stop == () and params.stop_token_ids == ()
    assert params == SamplingParams()


def test_numbers_are_normalised_and_the_widest_seeds_accepted():
    """An int where a float is expected becomes a float; any 64-bit seed is taken."""
    params = SamplingParams(temperature=1, top_p=1, seed=2**64 - 1)
    assert type(params.temperature) is float and type(params.top_p) is float
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE


def test_sampling_params_limits_carry_the_stop_fields():
    """The core's SamplingLimits are derived from SamplingParams and the model's EOS ids."""
    limits = SamplingParams(max_tokens=9, min_tokens=2, ignore_eos=True, stop_token_ids=[5]).limits({1})
    assert limits == SamplingLimits(max_tokens=9, min_tokens=2, ignore_eos=True,
                                    eos_token_ids=frozenset({1}), stop_token_ids=frozenset({5}))


@pytest.mark.parametrize(("args", "field"), [(("", [1]), "request_id"), (("r", []), "prompt_token_ids")])
def test_bad_request_names_the_field(args, field):
    """A request needs a non-empty id and at least one prompt token."""
    with pytest.raises(InvalidRequestError, match=field):
        Request(*args)


def test_list_fields_are_checked_once_however_often_the_params_are_evolved():
    """attrs.evolve runs every converter again and the server evolves a request's
    parameters once per sample: a list field it has already checked comes back as the
    same object (no entry checked again), equal to and printed as the plain tuple,
    while a plain value is still checked entry by entry."""
    import attrs

    from cadence.statemachine.sampling import SamplingParams

    params = SamplingParams(n=3, seed=1, logit_bias={"7": 1.0, 3: -2}, allowed_token_ids=[4, 5],
                            stop="end", stop_token_ids=[9], bad_words=["x"], bad_words_token_ids=[[1, 2]])
    fields = ("logit_bias", "allowed_token_ids", "stop", "stop_token_ids", "bad_words", "bad_words_token_ids")
    for sample in [attrs.evolve(params, temperature=0.5), *params.samples()]:
        for name in fields:
            assert getattr(sample, name) is getattr(params, name), name
    assert params.logit_bias == ((3, -2.0), (7, 1.0)) and repr(params.stop) == "('end',)"
    with pytest.raises(InvalidRequestError, match="stop"):
        attrs.evolve(params, stop=("ok", ""))
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        attrs.evolve(params, logit_bias=((3, 1000.0),))
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):  # another field's checked value
        attrs.evolve(params, stop_token_ids=params.stop)


_TOKEN_LIKE = st.one_of(st.integers(-3, 5), st.just(2**63), st.booleans(), st.floats(0, 3),
                        st.sampled_from(["1", None]))


@given(st.lists(_TOKEN_LIKE, max_size=6), st.sampled_from(["allowed_token_ids", "stop_token_ids"]))
def test_token_id_lists_are_decided_as_entry_by_entry(values, field):
    """Token-id lists of plain ints are checked by builtins (map, set, min, max): the
    fast path accepts and refuses exactly what checking entry by entry would, with
    the same first offending entry named."""
    import operator

    from cadence.statemachine.sampling import MAX_INT64, SamplingParams

    def reference():
        out = []
        for value in values:
            if isinstance(value, bool):
                return f"an int, not a bool, got {value!r}"
            try:
                token = operator.index(value)
            except TypeError:
                return f"an int, got {value!r}"
            out.append(token)
        for token in out:
            if not 0 <= token <= MAX_INT64:
                return f"token ids in [0, vocab_size), got {token!r}"
        if field == "allowed_token_ids" and not out:
            return "None or a non-empty list"
        return tuple(out)

    want = reference()
    try:
        got = tuple(getattr(SamplingParams(**{field: values}), field))
    except InvalidRequestError as exc:
        assert isinstance(want, str) and want in str(exc), (values, str(exc))
    else:
        assert got == want and all(type(token) is int for token in got)



_BIAS_KEYS = st.one_of(st.integers(-2, 40), st.just(2**63), st.booleans(),
                       st.sampled_from(["7", "07", "²", "٣", " 5", "+5", "1_0", "x", ""]))
_BIASES = st.one_of(st.floats(-150, 150), st.integers(-120, 120), st.booleans(),
                    st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e308, 10**400, -10**400,
                                     None]))


@given(st.dictionaries(_BIAS_KEYS, _BIASES, max_size=6))
@example({3: 1.0, 4: float("nan")})  # a NaN after a number: min and max both skip it
@example({"3": 1.0, "٣": 2.0})
@example({5: 10**400})  # past what a float holds: refused, not an OverflowError
def test_logit_bias_maps_are_decided_as_entry_by_entry(value):
    """A logit_bias map of plain ints / digit strings and numbers is converted by
    builtins; wherever it takes that path, it gives exactly what checking entry by
    entry gives, and it never takes a map the entry-by-entry check refuses."""
    from cadence.statemachine.sampling import _logit_bias_map, _logit_bias_pairs

    try:
        want = _logit_bias_pairs(value)
    except InvalidRequestError as exc:
        want = exc
    fast = _logit_bias_map(value) if value else None
    if fast is not None:
        assert fast == want and all(type(b) is float for _, b in fast)
    try:
        got = SamplingParams(logit_bias=value).logit_bias
    except InvalidRequestError as exc:
        assert isinstance(want, InvalidRequestError) and str(exc) == str(want)
    else:
        assert got == want


@pytest.mark.parametrize("words", [[[]], [[1, 2], []], [[1, -1]], [[True]]])
def test_a_banned_word_is_a_non_empty_list_of_token_ids(words):
    """An empty word bans nothing and the sampler reads each word's last id: refused at
    the door, as a negative or bool id is, never left for the executor to fail on."""
    with pytest.raises(InvalidRequestError, match="bad_words_token_ids"):
        SamplingParams(bad_words_token_ids=words)
    assert SamplingParams(bad_words_token_ids=[[1, 2], [3]]).bad_words_token_ids == ((1, 2), (3,))
