"""Whole Generate requests, valid and invalid, against a live server on the real demo
model: each gets its tokens or an Error with a documented code for its stream, the
engine never closes, and afterwards every KV block is free.

One server serves every drawn request (loading the model per example would cost
more than the requests); Hypothesis draws the whole schedule through `st.data()`.
"""

from __future__ import annotations

import math

import msgpack
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cadence.actors.cli import demo_model_dir
from cadence.actors.engine import EngineConfig
from cadence.actors.serve.server import open_server
from cadence.actors.wire import Error, Output, pack_frame

from test_server_support import RawConnection, assert_engine_clean, server_config, settled

DEMO_VOCAB = 260
MAX_MODEL_LEN = 128
# The codes PROTOCOL.md §3.1 gives for a request the server will not run.
REFUSALS = {"bad_message", "invalid_request", "request_too_long"}
NUM_REQUESTS = 16
TIMEOUT_S = 120


def anything() -> st.SearchStrategy:
    """A msgpack value of any type: what a field of the wrong type may hold."""
    return st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
                     st.floats(), st.text(max_size=4), st.lists(st.integers(0, 3), max_size=2))


def ints(low: int, high: int) -> tuple[st.SearchStrategy, st.SearchStrategy]:
    """(in range, out of range or at the 64-bit extremes)."""
    return st.integers(low, high), st.sampled_from(
        [low - 1, high + 1, -(2**63), 2**63 - 1, 2**63, 2**64 - 1])


def floats(low: float, high: float) -> tuple[st.SearchStrategy, st.SearchStrategy]:
    return st.floats(low, high), st.sampled_from(
        [low - 1.0, high + 1.0, 1e-308, -1e-308, 1e308, math.inf, -math.inf, math.nan])


def optional(pair: tuple[st.SearchStrategy, st.SearchStrategy]):
    return st.none() | pair[0], pair[1]


# Per field: (values the model can run, values it cannot).
FIELDS = {
    "max_tokens": ints(1, 4),
    "min_tokens": ints(0, 1),
    "temperature": (st.just(0.0) | st.floats(0.01, 2.0), st.sampled_from([1e-308, 1e-3, math.inf, -1.0])),
    "top_k": ints(0, DEMO_VOCAB),
    "top_p": (st.floats(0.01, 1.0), st.sampled_from([0.0, 1.5, math.nan, -math.inf])),
    "min_p": floats(0.0, 1.0),
    "repetition_penalty": (st.floats(0.01, 100.0), st.sampled_from([1e-308, 0.0, 1e308, math.nan])),
    "presence_penalty": floats(-2.0, 2.0),
    "frequency_penalty": floats(-2.0, 2.0),
    "seed": optional(ints(-(2**63), 2**64 - 1)),
    "logprobs": optional(ints(0, 20)),
    "ignore_eos": (st.booleans(), st.integers(0, 1)),
    "stop": (st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=4),
             st.sampled_from(["", [""], ["x"] * 17, ["y" * 257], [1]])),
    "stop_token_ids": (st.lists(st.integers(0, DEMO_VOCAB - 1), max_size=3),
                       st.sampled_from([[DEMO_VOCAB], [100000], [-1], [2**64 - 1], [True], 5])),
    "include_stop_str_in_output": (st.booleans(), st.sampled_from([None, "yes"])),
}


@st.composite
def params(draw) -> dict:
    """A params map of a few fields; about half the requests carry one bad value
    (out of range, or of the wrong type)."""
    chosen = draw(st.lists(st.sampled_from(sorted(FIELDS)), unique=True, max_size=5))
    out = {name: draw(FIELDS[name][0]) for name in chosen}
    out.setdefault("max_tokens", draw(st.integers(1, 4)))
    if out.get("min_tokens", 0) > out["max_tokens"]:
        out["min_tokens"] = out["max_tokens"]
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(FIELDS)))
        out[name] = draw(FIELDS[name][1] | anything())
    return out


prompts = st.one_of(
    st.text(min_size=1, max_size=40),
    st.lists(st.integers(0, DEMO_VOCAB - 1), min_size=1, max_size=12),
    st.sampled_from(["", [], [-1], [DEMO_VOCAB], [2**64 - 1], "x" * 1000, [1] * (MAX_MODEL_LEN + 1)]),
)


def demo_engine() -> EngineConfig:
    return EngineConfig.from_kwargs(
        executor="inprocess", model=demo_model_dir(), device="cpu", max_model_len=MAX_MODEL_LEN,
        num_blocks=64, max_num_batched_tokens=MAX_MODEL_LEN, max_num_seqs=8, max_restarts=0)


@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
async def test_every_drawn_request_gets_tokens_or_a_documented_error(data):
    config = server_config(max_protocol_errors=10 * NUM_REQUESTS)
    with trio.fail_after(TIMEOUT_S):
        async with open_server(demo_engine(), config) as server:
            conn = await RawConnection.greeted(server)
            for stream in range(NUM_REQUESTS):
                prompt, fields = data.draw(prompts), data.draw(params())
                body = [1, "Generate", {"stream": stream, "prompt": prompt, "params": fields}]
                await conn.send_bytes(pack_frame(msgpack.packb(body, use_bin_type=True)))
                end = await _stream_end(conn, stream)
                if type(end) is Error:
                    assert end.code in REFUSALS and not end.fatal, (prompt, fields, end)
                    assert end.stream in (stream, None)
                else:
                    assert end.finish_reason in ("length", "stop"), (prompt, fields, end)
                assert not server.engine.closed, (prompt, fields)
            assert server.engine.scheduler.num_restarts == 0
            await conn.aclose()
            await settled(server)
            assert_engine_clean(server)


async def _stream_end(conn: RawConnection, stream: int):
    """The stream's Error, or its last Output (a bad_message may not name the stream)."""
    while True:
        message = await conn.receive()
        assert message is not None, "the server closed the connection"
        if type(message) is Error and message.stream in (stream, None):
            return message
        if type(message) is Output and message.stream == stream and message.finished:
            return message
