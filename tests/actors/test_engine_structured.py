"""Structured output through the engine: every output valid under preemption, executor
restarts and a child-process executor; the cache changes no token; a bad spec is
refused at the door naming its field, and nothing else is affected.

These use the real clock: compilation runs in worker threads, which a MockClock
cannot see.
"""

from __future__ import annotations

import json
import re

import attrs
import pytest
import trio

from cadence.actors import EngineConfig, SamplingParams, open_engine
from cadence.actors.engine import demo_model_dir
from cadence.actors.simulated import Fault, FaultPlan, SimulatedExecutor
from cadence.actors.structured import total_compiles
from cadence.statemachine.errors import StructuredOutputError
from cadence.statemachine.sampling import StructuredOutput
from engine_helpers import config, text_executor

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

TIMEOUT_S = 120
# Booleans, a bounded integer and an enum: a random tiny model finishes it in a few dozen tokens.
SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
                         "colour": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "n", "colour"], "additionalProperties": False}
MAX_TOKENS = 64


def demo_config(**kwargs) -> EngineConfig:
    options = dict(executor="inprocess", model=demo_model_dir(), max_model_len=256, num_blocks=64,
                   block_size=4, max_num_seqs=8, max_num_batched_tokens=256, step_timeout_s=TIMEOUT_S,
                   start_timeout_s=TIMEOUT_S, debug_checks=True)
    options.update(kwargs)
    return EngineConfig.from_kwargs(**options)


def structured_params(seed: int, schema: dict = SCHEMA) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
                          structured_output=StructuredOutput.json_schema(schema))


async def run_all(engine, prompts: list, params: list[SamplingParams]):
    results = [None] * len(prompts)

    async def one(i: int) -> None:
        results[i] = await engine.generate(prompts[i], params[i], request_id=f"s{i}").collect()

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return results


def assert_valid(results, schema: dict = SCHEMA) -> None:
    for result in results:
        assert result.finish_reason == "stop", (result.finish_reason, result.text)
        jsonschema.validate(json.loads(result.text), schema)


async def test_a_cache_too_small_for_the_batch_preempts_and_every_output_is_still_valid():
    # Short prompts are all admitted (admission looks no step ahead); their outputs,
    # 30-odd tokens each, outgrow the cache.
    prompts = [f"v{i} = " for i in range(8)]
    with trio.fail_after(TIMEOUT_S):
        async with open_engine(demo_config(num_blocks=24, admission_headroom_steps=0)) as engine:
            results = await run_all(engine, prompts, [structured_params(i) for i in range(8)])
            assert engine.stats().num_preemptions > 0
    assert_valid(results)


async def test_the_grammar_cache_changes_no_token_and_a_second_request_compiles_nothing():
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"], "cache_test": {"type": "boolean"}}}
    params = [structured_params(seed, schema) for seed in range(4)]
    tokens = {}
    for cache_size in (0, 16):
        with trio.fail_after(TIMEOUT_S):
            async with open_engine(demo_config(grammar_cache_size=cache_size)) as engine:
                results = await run_all(engine, ["x = "] * 4, params)
                compiled = total_compiles()
                again = await engine.generate("y = ", params[0]).collect()
                if cache_size:
                    assert total_compiles() == compiled  # at the door, nor in the runner
                else:
                    assert total_compiles() == compiled + 2  # at the door and in the runner
        assert_valid([*results, again], schema)
        tokens[cache_size] = [r.token_ids for r in results]
    assert tokens[0] == tokens[16]


async def test_an_executor_restart_rebuilds_each_matcher_from_its_output():
    structured = StructuredOutput("regex", r"[a-z]{3,8}-[0-9]{2,4}( [a-z]{2,6}){2,5}")
    params = SamplingParams(max_tokens=MAX_TOKENS, structured_output=structured)
    prompts = [f"prompt {i}" for i in range(4)]
    outputs = {}
    for faults in (None, FaultPlan(at={6: Fault.CRASH, 15: Fault.CRASH})):
        executor = text_executor(faults=faults)
        with trio.fail_after(TIMEOUT_S):
            async with open_engine(config(executor, max_num_seqs=4)) as engine:
                results = await run_all(engine, prompts, [params] * 4)
        assert executor.num_starts == (1 if faults is None else 3)
        for result in results:
            assert result.finish_reason == "stop" and re.fullmatch(structured.spec, result.text)
        outputs[faults is None] = [r.token_ids for r in results]
    # The simulated model is deterministic: a matcher that lost its place would differ.
    assert outputs[True] == outputs[False]


async def test_a_child_process_executor_follows_the_grammar():
    with trio.fail_after(TIMEOUT_S):
        async with open_engine(demo_config(executor="process")) as engine:
            results = await run_all(engine, ["a", "b"], [structured_params(1), structured_params(2)])
    assert_valid(results)


async def test_a_bad_spec_is_refused_at_the_door_naming_its_field_and_nothing_else_is_hurt():
    bad = [StructuredOutput("json_schema", '{"type": "objectx"}'), StructuredOutput("regex", "(["),
           StructuredOutput("grammar", 'root ::= "a" missing')]
    with trio.fail_after(TIMEOUT_S):
        async with open_engine(config()) as engine:
            running = engine.generate("prompt", SamplingParams(max_tokens=8))
            first = await running.__anext__()
            for structured in bad:
                with pytest.raises(StructuredOutputError) as caught:
                    await engine.submit("p", SamplingParams(structured_output=structured))
                assert caught.value.field == structured.field
                assert str(caught.value).startswith(f"{structured.field}: invalid ")
                with pytest.raises(StructuredOutputError):
                    await engine.generate("p", SamplingParams(structured_output=structured)).enqueue().start()
            rest = [out async for out in running]
            assert len(first.token_ids) + sum(len(out.token_ids) for out in rest) == 8
            assert not engine.core.requests


async def test_an_engine_without_a_tokenizer_refuses_structured_output():
    executor = SimulatedExecutor(vocab_size=100, eos_token_id=99)
    with trio.fail_after(TIMEOUT_S):
        async with open_engine(EngineConfig(executor=executor)) as engine:
            with pytest.raises(StructuredOutputError, match="^structured_output: structured output needs a tokenizer"):
                await engine.submit([1, 2], SamplingParams(structured_output=StructuredOutput("json_object")))


async def test_seeded_structured_samples_do_not_depend_on_the_batch():
    alone, together = {}, {}
    with trio.fail_after(TIMEOUT_S):
        async with open_engine(demo_config()) as engine:
            params = structured_params(7)
            alone = (await engine.generate("z = ", params).collect()).token_ids
            batch = await run_all(engine, ["z = ", "w = ", "v = "],
                                  [params, structured_params(8), attrs.evolve(params, temperature=0.0)])
            together = batch[0].token_ids
    assert alone == together
    assert_valid(batch)
