"""Validation at the door: one check of a whole request against the loaded model,
before it is queued, and a length check on bytes before any tokenisation.

The simulated engine serves most tests; the demo model (a real byte-level BPE
checkpoint run in process) serves the reproduction that crashed its sampler.
"""

from __future__ import annotations

import math
import threading

import pytest
import trio

from cadence.actors.cli import demo_model_dir
from cadence.actors.detokenizer import ByteTokenizer, max_bytes_per_token
from cadence.actors.engine import EngineConfig, open_engine
from cadence.actors.validation import (
    DEFAULT_MAX_STOP_CHARS, DEFAULT_MAX_STOP_STRINGS, MAX_TENANT_CHARS, RequestLimits,
    validate_request,
)
from cadence.statemachine.errors import InvalidRequestError, RequestTooLongError
from cadence.statemachine.sampling import SamplingParams

VOCAB = 100
LIMITS = RequestLimits(vocab_size=VOCAB, max_model_len=64, max_bytes_per_token=4)
MiB = 1 << 20
TIMEOUT_S = 60


def refused(prompt, params=None, limits=LIMITS, **options) -> str:
    """The message of the InvalidRequestError `validate_request` raises."""
    with pytest.raises(InvalidRequestError) as info:
        validate_request(prompt, params, limits, **options)
    return str(info.value)


# ---- the shared check ----------------------------------------------------------------------


@pytest.mark.parametrize(("prompt", "params", "names"), [
    ([1, VOCAB], None, ("prompt[1]", f"vocab_size={VOCAB}", str(VOCAB))),
    ([1, -1], None, ("prompt[1]", "-1")),
    ([1, True], None, ("prompt[1]", "True")),
    ([1, 2.0], None, ("prompt[1]", "2.0")),
    ([1], SamplingParams(stop_token_ids=[VOCAB]), ("stop_token_ids[0]", str(VOCAB))),
    ([1], SamplingParams(min_tokens=2, stop_token_ids=[100000]), ("stop_token_ids[0]", "100000")),
    ([1], SamplingParams(top_k=VOCAB + 1), ("top_k", f"vocab_size={VOCAB}", str(VOCAB + 1))),
    ([], None, ("prompt", "at least one token")),
    ("", None, ("prompt", "empty")),
])
def test_token_ids_and_counts_are_checked_against_the_model(prompt, params, names):
    """Every refusal names the field, the value and the limit."""
    message = refused(prompt, params)
    assert all(name in message for name in names), message


def test_values_at_the_model_limits_are_accepted():
    params = SamplingParams(top_k=VOCAB, stop_token_ids=[VOCAB - 1], min_tokens=2, logprobs=20)
    assert validate_request([0, VOCAB - 1], params, LIMITS) is params
    assert validate_request("x", None, LIMITS) == SamplingParams()


def test_logprobs_may_not_exceed_the_vocabulary():
    assert "logprobs" in refused([1], SamplingParams(logprobs=11), RequestLimits(10, 64))


def test_stop_strings_are_counted_and_measured_against_raisable_limits():
    most = [chr(65 + i) for i in range(DEFAULT_MAX_STOP_STRINGS)]
    validate_request("x", SamplingParams(stop=most), LIMITS)
    message = refused("x", SamplingParams(stop=most + ["z"]))
    assert f"{DEFAULT_MAX_STOP_STRINGS + 1} strings" in message
    assert f"max_stop_strings={DEFAULT_MAX_STOP_STRINGS}" in message
    long = "y" * (DEFAULT_MAX_STOP_CHARS + 1)
    message = refused("x", SamplingParams(stop=["a", long]))
    assert f"{DEFAULT_MAX_STOP_CHARS + 1} characters" in message
    assert f"max_stop_chars={DEFAULT_MAX_STOP_CHARS}" in message
    raised = RequestLimits(VOCAB, 64, max_stop_strings=100, max_stop_chars=1000)
    validate_request("x", SamplingParams(stop=most + ["z", long]), raised)


def test_text_and_stop_strings_need_a_tokenizer():
    ids_only = RequestLimits(VOCAB, 64, has_tokenizer=False)
    assert "tokenizer" in refused("hi", None, ids_only)
    assert "stop" in refused([1], SamplingParams(stop="x"), ids_only)


@pytest.mark.parametrize(("option", "value"), [
    ("priority", True), ("priority", 1.5), ("priority", 2**63),
    ("tenant", "t" * (MAX_TENANT_CHARS + 1)), ("tenant", 5),
    ("deadline_s", math.inf), ("deadline_s", math.nan), ("deadline_s", "1"),
    ("timeout_s", 0), ("timeout_s", -1.0), ("timeout_s", math.inf), ("timeout_s", True),
    ("cache_salt", "s" * 1025), ("cache_salt", b"salt"),
])
def test_request_options_are_checked_too(option, value):
    assert refused([1], None, **{option: value}).startswith(option)


def test_params_must_be_sampling_params():
    assert "SamplingParams" in refused([1], {"max_tokens": 2})


def test_the_byte_count_settles_a_text_prompt_that_cannot_fit():
    """64 tokens of context, 16 of them for output, at most 4 bytes a token: 192
    bytes may fit, 193 cannot; multi-byte characters count by their bytes."""
    params = SamplingParams(max_tokens=16)
    validate_request("a" * 192, params, LIMITS)
    validate_request("é" * 96, params, LIMITS)
    for prompt in ("a" * 193, "é" * 97, "🙂" * 49):
        with pytest.raises(RequestTooLongError, match="max_model_len is 64"):
            validate_request(prompt, params, LIMITS)
    # Without a bound on bytes per token, only tokenising can tell.
    validate_request("a" * 10_000, params, RequestLimits(VOCAB, 64))


def test_bytes_per_token_is_read_from_a_byte_level_vocabulary():
    from cadence.gpu.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(demo_model_dir())
    bound = max_bytes_per_token(tokenizer)
    assert bound is not None
    for text in ("hello world, hello world", "ünïcödé 🙂 text", "x" * 300):
        ids = tokenizer.encode(text)
        assert len(text.encode()) <= len(ids) * bound  # the bound never refuses what fits
    assert max_bytes_per_token(ByteTokenizer()) == 1


# ---- the embedded engine -------------------------------------------------------------------


class CountingTokenizer(ByteTokenizer):
    """The byte tokenizer, counting its encode calls and the threads they ran on."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.get_ident())
        return super().encode(text)


def engine_config(tokenizer=None, **kwargs) -> EngineConfig:
    options = dict(executor="simulated", max_model_len=4096, num_blocks=1024, max_num_batched_tokens=4096)
    options.update(kwargs)
    return EngineConfig.from_kwargs(tokenizer=tokenizer, **options)


async def test_twenty_one_mib_text_prompts_are_refused_without_tokenising(autojump_clock):
    """Each is refused on its byte count; the tokenizer is never called."""
    tokenizer = CountingTokenizer()
    async with open_engine(engine_config(tokenizer)) as engine:
        prompt = "x" * MiB
        for _ in range(20):
            with pytest.raises(RequestTooLongError, match="1048576 bytes"):
                await engine.submit(prompt, SamplingParams(max_tokens=4))
        assert tokenizer.threads == []
        assert not engine.closed and not engine.core.requests


async def test_a_long_text_prompt_that_fits_is_tokenised_off_the_event_loop(autojump_clock):
    tokenizer = CountingTokenizer()
    async with open_engine(engine_config(tokenizer, max_model_len=32768,
                                         max_num_batched_tokens=32768, num_blocks=4096)) as engine:
        loop_thread = threading.get_ident()
        result = await engine.generate("y" * 20_000, SamplingParams(max_tokens=2)).collect()
        assert result.finish_reason == "length" and len(result.prompt_token_ids) == 20_000
        short = await engine.generate("short", SamplingParams(max_tokens=2)).collect()
        assert short.prompt_token_ids == list(b"short")
    assert len(tokenizer.threads) == 2
    assert tokenizer.threads[0] != loop_thread and tokenizer.threads[1] == loop_thread


async def test_a_refused_request_leaves_the_engine_serving(autojump_clock):
    """Out-of-vocabulary stop ids (with min_tokens, the sampler masks them by index)
    are refused at submission; the next request runs."""
    async with open_engine(engine_config()) as engine:
        bad = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[100000])
        with pytest.raises(InvalidRequestError, match="stop_token_ids"):
            await engine.submit([1, 2, 3], bad)
        with pytest.raises(InvalidRequestError, match="top_k"):
            await engine.submit([1, 2, 3], SamplingParams(top_k=1000))
        stream = engine.generate([1, 2, 3], SamplingParams(max_tokens=4))
        with pytest.raises(InvalidRequestError, match="stop_token_ids"):
            # enqueue validates too, before the request reaches the scheduler
            engine.generate([1, 2, 3], bad).enqueue()
        result = await stream.collect()
        assert result.finish_reason == "length" and not engine.closed


async def test_stop_limits_come_from_the_engine_config(autojump_clock):
    stops = [f"s{i}" for i in range(20)]
    async with open_engine(engine_config()) as engine:
        with pytest.raises(InvalidRequestError, match="max_stop_strings=16"):
            await engine.submit("x", SamplingParams(stop=stops))
    async with open_engine(engine_config(max_stop_strings=32)) as engine:
        result = await engine.generate("x", SamplingParams(stop=stops, max_tokens=2)).collect()
        assert result.finish_reason in ("length", "stop")


async def test_demo_model_refuses_out_of_vocabulary_stop_ids_and_keeps_serving():
    """The reproduction that crashed the sampler of a real model: min_tokens with a stop
    id past the vocabulary (260 for the demo model). Refused at the door; the engine
    stays open and the next request generates."""
    config = EngineConfig.from_kwargs(executor="inprocess", model=demo_model_dir(), device="cpu",
                                      max_model_len=256, num_blocks=64,
                                      max_num_batched_tokens=256, max_restarts=0)
    with trio.fail_after(TIMEOUT_S):
        async with open_engine(config) as engine:
            assert engine.vocab_size == 260
            for bad in (dict(min_tokens=2, stop_token_ids=[100000]),
                        dict(stop_token_ids=[2**64 - 1]), dict(top_k=261)):
                with pytest.raises(InvalidRequestError):
                    await engine.submit("def ", SamplingParams(max_tokens=4, **bad))
            with pytest.raises(InvalidRequestError, match="prompt"):
                await engine.submit([1, 260], SamplingParams(max_tokens=2))
            result = await engine.generate("def ", SamplingParams(max_tokens=4, min_tokens=2,
                                                                  stop_token_ids=[257])).collect()
            assert len(result.token_ids) >= 2 and not engine.closed
            assert engine.scheduler.num_restarts == 0


def test_serve_options_raise_the_stop_limits():
    """`--max-stop-strings` / `--max-stop-chars` reach EngineConfig, checked there."""
    import argparse

    from cadence.actors.engine_args import add_engine_arguments, engine_config_from_args
    from cadence.statemachine.errors import ConfigError

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config = engine_config_from_args(parser.parse_args(["--max-stop-strings", "40",
                                                         "--max-stop-chars", "1000"]))
    assert (config.max_stop_strings, config.max_stop_chars) == (40, 1000)
    defaults = engine_config_from_args(parser.parse_args([]))
    assert (defaults.max_stop_strings, defaults.max_stop_chars) == (
        DEFAULT_MAX_STOP_STRINGS, DEFAULT_MAX_STOP_CHARS)
    with pytest.raises(ConfigError, match="max_stop_chars"):
        engine_config_from_args(parser.parse_args(["--max-stop-chars", "0"]))


def test_a_prompt_still_to_be_rendered_leaves_only_its_parameters_to_check():
    """A chat conversation becomes a prompt later; its parameters are checked now."""
    assert validate_request(None, SamplingParams(max_tokens=3), LIMITS).max_tokens == 3
    assert "top_k" in refused(None, SamplingParams(top_k=VOCAB + 1))


async def test_an_executor_reporting_an_eos_id_outside_its_vocabulary_is_refused(autojump_clock):
    """EOS ids are token ids too: the engine refuses to start on ones past the vocabulary."""
    from cadence.actors.simulated import SimulatedExecutor, ZERO_LATENCY
    from cadence.statemachine.errors import ExecutorError

    backend = SimulatedExecutor(ZERO_LATENCY, vocab_size=10, eos_token_id=10)
    with pytest.raises(ExecutorError, match=r"eos_token_ids\[0\].*vocab_size=10"):
        async with open_engine(EngineConfig(executor=backend, tokenizer=None)):
            pass


def test_counts_in_messages_agree_in_number():
    with pytest.raises(RequestTooLongError, match="^prompt has 1 token and max_tokens is 64, 65 in all"):
        validate_request([1], SamplingParams(max_tokens=64), LIMITS)
    with pytest.raises(RequestTooLongError, match="^prompt has 2 tokens and"):
        validate_request([1, 2], SamplingParams(max_tokens=63), LIMITS)


def test_a_request_larger_than_the_kv_cache_is_refused_with_counts_not_an_internal_id():
    from cadence.actors import LLM

    with LLM(executor="simulated", num_blocks=4, block_size=16, max_model_len=512) as llm:
        with pytest.raises(RequestTooLongError) as caught:
            llm.generate([[1] * 60], SamplingParams(max_tokens=8), use_tqdm=False)
        assert str(caught.value) == ("prompt has 60 tokens and max_tokens is 8, 68 in all; "
                                     "the KV cache holds 64 tokens")
        assert llm.generate([[1] * 56], SamplingParams(max_tokens=8), use_tqdm=False)[0].finish_reason
