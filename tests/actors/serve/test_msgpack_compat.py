"""The msgpack protocol as PROTOCOL.md says it behaves, one test per statement that once
differed: nil `stop` / `stop_token_ids`, a stop token's text left out of `text`, the
request limits in `Welcome.limits`, `n` other than 1 refused naming it, vLLM's sampling
fields on the wire, and `prompt` with `messages` refused.
"""

from __future__ import annotations

import msgpack
import pytest

from cadence.actors.client import open_client
from cadence.actors.serve.server import open_server
from cadence.actors.validation import DEFAULT_MAX_STOP_CHARS, DEFAULT_MAX_STOP_STRINGS
from cadence.actors.wire import LimitExceededError, MessageError, decode_request
from cadence.statemachine.sampling import MAX_LOGPROBS
from test_server_support import PRINTABLE_IDS, engine_config, server_config


def _generate(**fields) -> bytes:
    return msgpack.packb([1, "Generate", {"stream": 1, **fields}], use_bin_type=True)


def test_nil_stop_fields_mean_none():
    message = decode_request(_generate(prompt=[1, 2], params={"stop": None, "stop_token_ids": None}))
    assert message.params.stop == () and message.params.stop_token_ids == ()


def test_vllm_sampling_fields_travel_on_the_wire():
    params = {"logit_bias": {"7": 2.5}, "allowed_token_ids": [7, 8], "bad_words": ["x"],
              "skip_special_tokens": False, "truncate_prompt_tokens": 3, "best_of": 1}
    message = decode_request(_generate(prompt=[1, 2], params=params))
    assert message.params.logit_bias == ((7, 2.5),) and message.params.allowed_token_ids == (7, 8)
    assert (message.params.bad_words, message.params.skip_special_tokens,
            message.params.truncate_prompt_tokens) == (("x",), False, 3)
    with pytest.raises(MessageError, match=r"Generate.params.bad_words\[0\]"):
        decode_request(_generate(prompt=[1], params={"bad_words": [3]}))


def test_prompt_and_messages_together_are_a_bad_message():
    with pytest.raises(MessageError, match="exactly one of prompt and messages"):
        decode_request(_generate(prompt="x", messages=[{"role": "user", "content": "x"}]))


async def test_welcome_reports_the_request_limits():
    async with open_server(engine_config(max_stop_strings=3), server_config()) as server:
        async with open_client(server.tcp_address) as client:
            limits = client.welcome.limits
    assert limits["max_stop_strings"] == 3 and limits["max_stop_chars"] == DEFAULT_MAX_STOP_CHARS
    assert limits["max_logprobs"] == MAX_LOGPROBS
    assert DEFAULT_MAX_STOP_STRINGS != 3  # the option, not the default, is reported


async def test_a_stop_tokens_text_is_not_in_text():
    async with open_server(engine_config(), server_config()) as server:
        async with open_client(server.tcp_address) as client:
            # The simulated model writes printable bytes only: the first token is a stop token.
            done = await client.complete([1, 2, 3], max_tokens=8, stop_token_ids=list(PRINTABLE_IDS))
            assert done.finish_reason == "stop" and len(done.token_ids) == 1 and done.text == ""
            kept = await client.complete([1, 2, 3], max_tokens=8, stop_token_ids=list(PRINTABLE_IDS),
                                         include_stop_str_in_output=True)
            assert kept.text == bytes(kept.token_ids).decode()


async def test_n_samples_answer_on_consecutive_streams_as_one_request_group():
    async with open_server(engine_config(), server_config(max_inflight_per_connection=4)) as server:
        async with open_client(server.tcp_address) as client:
            samples = await client.complete([5] * 40, max_tokens=6, n=3, temperature=1.0, seed=7)
            assert [len(c.token_ids) for c in samples] == [6, 6, 6]
            assert len({c.request_id for c in samples}) == 3
            assert server.engine.stats().num_shared_prompt_tokens > 0  # the prompt computed once
            alone = await client.complete([5] * 40, max_tokens=6, temperature=1.0, seed=8)
            assert alone.num_prompt_tokens == samples[1].num_prompt_tokens == 40
            # The samples' streams must be free and within the connection's limit.
            with pytest.raises(LimitExceededError, match="n is 5"):
                await client.complete([1], max_tokens=2, n=5)
            more = await client.complete([1], max_tokens=2, n=2)
            assert len(more) == 2

