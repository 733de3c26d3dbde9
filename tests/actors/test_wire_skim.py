"""Reading a Generate frame's text prompt by its header alone (`text_prompt_span`) and
dropping it from a frame as it arrives (`FrameBuffer.elide`): what the server does
with a prompt too long for any request, so that it never copies or decodes it."""

from __future__ import annotations

import msgpack
from hypothesis import given, strategies as st

from cadence.actors.wire import (
    EMPTY_STR, FrameBuffer, Generate, decode_request, pack_frame, text_prompt_span,
)

_OTHER_FIELDS = {"stream": 9, "params": {"max_tokens": 3, "stop": ["ab"]}, "tenant": "t",
                 "priority": 2}


def _frame(prompt, order: list[str]) -> bytes:
    payload = {name: prompt if name == "prompt" else _OTHER_FIELDS[name] for name in order}
    return pack_frame(msgpack.packb([1, "Generate", payload], use_bin_type=True))


@given(length=st.sampled_from([0, 1, 31, 32, 255, 256, 65535, 65536, 70000]),
       order=st.permutations(["stream", "prompt", "params", "tenant", "priority"]),
       chunk=st.integers(1, 1 << 14), data=st.data())
def test_an_elided_prompt_leaves_the_frame_with_an_empty_one(length, order, chunk, data):
    frame = _frame("é" * (length // 2) + "x" * (length % 2), list(order))
    body = frame[4:]
    span = text_prompt_span(body)
    assert span is not None
    header_start, text_start, num_bytes = span
    assert num_bytes == length and body[text_start:text_start + num_bytes].decode() \
        == "é" * (length // 2) + "x" * (length % 2)
    # Fed in chunks, elided once some of the frame is in: what was buffered of the
    # prompt is dropped, the rest is skipped by the caller, the frame is whole again.
    received = data.draw(st.integers(4 + text_start, len(frame)), label="received")
    buffer = FrameBuffer(1 << 21)
    buffer.feed(frame[:received])
    remaining = buffer.elide(header_start, text_start + num_bytes, EMPTY_STR)
    end = 4 + text_start + num_bytes
    assert remaining == max(0, end - received)
    rest = frame[max(received, end):]
    for start in range(0, len(rest), chunk):
        buffer.feed(rest[start:start + chunk])
    message = decode_request(buffer.next_frame())
    expected = decode_request(_frame("", list(order))[4:])
    assert type(message) is Generate and message == expected
    assert buffer.next_frame() is None and buffer.num_pending_bytes == 0


def test_no_span_where_the_prefix_shows_no_text_prompt():
    tokens = _frame([1, 2, 3], ["stream", "prompt"])[4:]
    assert text_prompt_span(tokens) is None
    long_first = _frame("x" * 10, ["params", "prompt"])[4:]
    assert text_prompt_span(long_first[:8]) is None  # the params run past the prefix
    assert text_prompt_span(long_first) is not None
    abort = msgpack.packb([1, "Abort", {"stream": 1}])
    assert text_prompt_span(abort) is None
    assert text_prompt_span(b"\xc1\xc1") is None
    assert text_prompt_span(b"") is None
