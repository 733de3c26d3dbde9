"""Chat over the msgpack protocol: a Generate with `messages` instead of `prompt` is
rendered with the model's chat template (the demo model's tokenizer and template,
the simulated executor); the Python clients send `messages=` and get, on the demo
model itself, what `LLM.chat` gives."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import trio

from cadence.actors import LLM
from cadence.actors.chat import ChatTemplate, encode_rendered
from cadence.actors.client import AsyncioClient, Client, open_client
from cadence.actors.cli import demo_model_dir
from cadence.actors.engine import EngineConfig
from cadence.actors.serve.server import ServerThread, open_server
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
    ({"stream": 1, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type is 'image_url': this model reads text only"),
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


# ---- the Python clients send messages --------------------------------------------------------

CONVERSATION = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "a function that adds two numbers"}]
NUM_CHAT_TOKENS = 8


def test_the_clients_send_messages_and_get_what_llm_chat_gives():
    demo = demo_model_dir()
    options = dict(executor="inprocess", model=demo, max_model_len=256, num_blocks=64)
    greedy = SamplingParams(max_tokens=NUM_CHAT_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(**options) as llm:
        [expected] = llm.chat(CONVERSATION, greedy, use_tqdm=False)
    assert len(expected.token_ids) == NUM_CHAT_TOKENS

    async def with_trio(address):
        async with open_client(address) as client:
            return await client.complete(messages=CONVERSATION, params=greedy)

    async def with_asyncio(address):
        client = await AsyncioClient.connect(address)
        try:
            return await client.complete(messages=CONVERSATION, params=greedy)
        finally:
            await client.aclose()

    with ServerThread(EngineConfig.from_kwargs(**options), server_config()) as thread:
        address = thread.server.tcp_address
        with Client.connect(address) as client:
            completions = [client.complete(messages=CONVERSATION, params=greedy)]
        completions.append(trio.run(with_trio, address))
        completions.append(asyncio.run(with_asyncio(address)))
    for completion in completions:
        assert completion.num_prompt_tokens == len(expected.prompt_token_ids)
        assert completion.token_ids == expected.token_ids
        assert completion.text == expected.text
