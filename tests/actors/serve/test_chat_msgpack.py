"""Chat over the msgpack protocol: a Generate with `messages` instead of `prompt` is
rendered with the model's chat template (the demo model's tokenizer and template,
the simulated executor)."""

from __future__ import annotations

import msgpack
import pytest

from cadence.actors.chat import ChatTemplate, encode_rendered
from cadence.actors.cli import demo_model_dir
from cadence.actors.engine import EngineConfig
from cadence.actors.serve.server import open_server
from cadence.actors.wire import Accepted, Error, ErrorCode, Generate, Output, SamplingParams
from cadence.gpu.tokenizer import Tokenizer

from test_server_support import RawConnection, engine_config, server_config, settled

MESSAGES = [{"role": "user", "content": "a function that adds"}]


def _demo_engine() -> EngineConfig:
    demo = demo_model_dir()
    return EngineConfig.from_kwargs(executor="simulated", model=demo,
                                    tokenizer=Tokenizer.from_pretrained(demo), max_model_len=512)


async def _answer(conn: RawConnection, stream: int) -> list:
    out = []
    while True:
        message = await conn.receive()
        out.append(message)
        if type(message) is Error or (type(message) is Output and message.finished):
            return out


async def test_messages_are_rendered_with_the_models_template():
    demo = demo_model_dir()
    expected = encode_rendered(Tokenizer.from_pretrained(demo), ChatTemplate.from_dir(demo).render(MESSAGES))
    async with open_server(_demo_engine(), server_config()) as server:
        conn = await RawConnection.greeted(server)
        await conn.send(Generate(stream=1, prompt=None, messages=MESSAGES,
                                 params=SamplingParams(max_tokens=3, ignore_eos=True)))
        accepted, *outputs = await _answer(conn, 1)
        assert type(accepted) is Accepted and accepted.num_prompt_tokens == len(expected)
        assert outputs[-1].finish_reason == "length" and outputs[-1].num_tokens == 3
        await conn.stream.aclose()
        await settled(server)


async def test_a_model_without_a_template_refuses_messages():
    async with open_server(engine_config(), server_config()) as server:
        conn = await RawConnection.greeted(server)
        await conn.send(Generate(stream=1, prompt=None, messages=MESSAGES))
        [error] = await _answer(conn, 1)
        assert error.code == ErrorCode.INVALID_REQUEST.value and "no chat template" in error.message
        await conn.stream.aclose()
        await settled(server)


@pytest.mark.parametrize("payload, expected", [
    ({"stream": 1, "prompt": "x", "messages": MESSAGES}, "exactly one of prompt and messages"),
    ({"stream": 1}, "exactly one of prompt and messages"),
    ({"stream": 1, "messages": [{"content": "x"}]}, "Generate.messages[0].role"),
])
async def test_malformed_chat_requests_name_the_problem(payload, expected):
    async with open_server(_demo_engine(), server_config()) as server:
        conn = await RawConnection.greeted(server)
        body = msgpack.packb([1, "Generate", payload])
        await conn.send_bytes(len(body).to_bytes(4, "big") + body)
        [error] = await _answer(conn, 1)
        assert type(error) is Error and expected in error.message
        await conn.stream.aclose()
        await settled(server)
