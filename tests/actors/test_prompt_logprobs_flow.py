"""Prompt log-probabilities outside the model: the field's checks, the executor and
client messages that carry them, and the engine that routes them to the request
(simulated executors, whose values are known: `fabricated_prompt_logprobs`).

The model's own values are checked against transformers in
tests/gpu/test_prompt_logprobs.py.
"""

from __future__ import annotations

import msgpack
import pytest

from cadence.actors import LLM, SamplingParams
from cadence.actors.engine import EngineConfig, open_engine
from cadence.actors.executor_worker import fabricated_prompt_logprobs
from cadence.actors.executors import InProcessExecutor
from cadence.actors.messages import PromptLogprobs, StepOutput, decode, encode
from cadence.actors.validation import RequestLimits, validate_request
from cadence.actors.wire import Output, decode_reply
from cadence.actors.wire import encode as encode_reply
from cadence.statemachine.errors import InvalidRequestError, ProtocolError
from cadence.statemachine.plan import StepResult
from cadence.statemachine.sampling import MAX_LOGPROBS

BLOCK_SIZE = 4
PROMPT = [7, 3, 9, 12, 5, 8, 1, 4, 11, 6, 10, 2, 13]  # 13 tokens: three full blocks and one more
VOCAB_SIZE = 32000  # the simulated executors' vocabulary without a tokenizer of their own


# ---- the field -------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, True, 1.5, "2"])
def test_out_of_range_prompt_logprobs_name_the_field(value):
    with pytest.raises(InvalidRequestError, match="prompt_logprobs must be"):
        SamplingParams(prompt_logprobs=value)


def test_prompt_logprobs_are_checked_against_the_vocabulary():
    limits = RequestLimits(vocab_size=4, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs must be at most vocab_size=4, got 5"):
        validate_request([1, 2], SamplingParams(prompt_logprobs=5), limits)
    assert validate_request([1, 2], SamplingParams(prompt_logprobs=4), limits).prompt_logprobs == 4


# ---- the executor's message ------------------------------------------------------------------


def test_step_output_carries_prompt_logprobs_only_when_there_are_some():
    plain = StepOutput(StepResult(3, {"a": [5]}))
    payload = msgpack.unpackb(encode(plain))[2]
    assert "prompt_logprobs" not in payload  # a decode step costs nothing more
    assert decode(encode(plain)) == plain
    scored = StepOutput(StepResult(3, {}), prompt_logprobs={
        "a": PromptLogprobs(2, [[(9, -0.5), (4, -0.25)], [(12, -1.5)]])})
    assert decode(encode(scored)) == scored


@pytest.mark.parametrize("wire, path", [
    ({"a": [0, [[[9, -0.5]]]]}, "StepOutput.prompt_logprobs['a'][0]"),
    ({"a": [1]}, "StepOutput.prompt_logprobs['a']"),
    ({"a": [1, [[[9, "x"]]]]}, "StepOutput.prompt_logprobs['a'][1][0][0][1]"),
    ([1, 2], "StepOutput.prompt_logprobs"),
])
def test_malformed_prompt_logprobs_name_the_field(wire, path):
    payload = StepOutput(StepResult(3, {})).to_wire()
    payload["prompt_logprobs"] = wire
    with pytest.raises(ProtocolError, match=path.replace("[", r"\[").replace("]", r"\]")):
        StepOutput.from_wire(payload)


def test_client_output_carries_prompt_logprobs():
    entries = [None, [(3, -0.5), (1, -0.25)], [(9, -2.0)]]
    out = decode_reply(encode_reply(Output(1, [4], "x", 1, prompt_logprobs=entries)))
    assert out.prompt_logprobs == entries
    assert decode_reply(encode_reply(Output(1, [4], "x", 1))).prompt_logprobs is None


# ---- through the engine ----------------------------------------------------------------------


def _expected(prompt: list[int], num_top: int) -> list:
    first, entries = fabricated_prompt_logprobs(prompt, len(prompt), 0, len(prompt), num_top, VOCAB_SIZE)
    assert first == 1
    return [None, *entries]


@pytest.mark.parametrize("executor, overlapped", [
    ("simulated", False), ("round trip", False), ("simulated", True), ("round trip", True)])
async def test_chunked_prompt_logprobs_arrive_whole_on_the_first_delta_and_skip_the_cache(executor, overlapped):
    backend = InProcessExecutor(round_trip=True) if executor == "round trip" else "simulated"
    config = EngineConfig.from_kwargs(executor=backend, model="simulated", block_size=BLOCK_SIZE,
                                      num_blocks=64, max_num_batched_tokens=5, max_model_len=64,
                                      async_scheduling=overlapped)
    async with open_engine(config) as engine:
        warm = await engine.generate(PROMPT, SamplingParams(max_tokens=2)).collect()
        deltas = [out async for out in engine.generate(
            PROMPT, SamplingParams(max_tokens=3, prompt_logprobs=2))]
        again = await engine.generate(PROMPT, SamplingParams(max_tokens=2)).collect()
    assert warm.num_cached_tokens == 0 and again.num_cached_tokens == 3 * BLOCK_SIZE
    # It reads nothing from the cache, though the same prompt is there.
    assert deltas[0].num_cached_tokens == 0
    assert deltas[0].prompt_logprobs == _expected(PROMPT, 2)
    assert all(out.prompt_logprobs is None for out in deltas[1:])


def test_llm_results_have_vllms_prompt_logprobs():
    with LLM(executor="simulated", model="simulated", block_size=BLOCK_SIZE, num_blocks=64) as llm:
        plain, scored = llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=1),
                                                         SamplingParams(max_tokens=1, prompt_logprobs=0)],
                                     use_tqdm=False)
    assert plain.prompt_logprobs is None and plain.prompt_token_logprobs is None
    assert scored.prompt_token_logprobs == _expected(PROMPT, 0)
    vllm_shape = scored.prompt_logprobs
    assert vllm_shape[0] is None and len(vllm_shape) == len(PROMPT)
    for position, candidates in enumerate(vllm_shape[1:], 1):
        [(token, logprob)] = candidates.items()
        assert token == PROMPT[position]
        assert logprob.logprob == scored.prompt_token_logprobs[position][0][1]
