"""Structured output below the engine: the request field, its wire forms, the
grammar compiler and its cache, and the per-request matcher."""

from __future__ import annotations

import json
import threading

import msgpack
import pytest

from cadence.actors import messages, wire
from cadence.actors.detokenizer import ByteTokenizer
from cadence.actors.engine import demo_model_dir
from cadence.statemachine.errors import InvalidRequestError, StructuredOutputError
from cadence.statemachine.plan import StepPlan
from cadence.statemachine.sampling import MAX_STRUCTURED_OUTPUT_CHARS, SamplingParams, StructuredOutput

pytest.importorskip("xgrammar")
torch = pytest.importorskip("torch")

from cadence.actors.structured import GrammarCompiler, compiler_for  # noqa: E402
from cadence.gpu.tokenizer import Tokenizer  # noqa: E402

DEMO_VOCAB = 260
DEMO_EOS = 257
SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def demo_tokenizer():
    return Tokenizer.from_pretrained(demo_model_dir())


def _compiler(tokenizer, cache_size: int = 8) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, DEMO_VOCAB, [DEMO_EOS], cache_size)


# ---- the request field -------------------------------------------------------------------

def test_the_field_checks_its_kind_and_spec_and_names_the_request_field():
    assert StructuredOutput("json_object").field == "structured_output"
    assert StructuredOutput("regex", "a+").field == "regex"
    with pytest.raises(InvalidRequestError, match="structured_output.kind must be one of"):
        StructuredOutput("yaml", "x")
    with pytest.raises(InvalidRequestError, match="^grammar must be a non-empty grammar"):
        StructuredOutput("grammar", "")
    with pytest.raises(InvalidRequestError, match="^structured_output must be empty for json_object"):
        StructuredOutput("json_object", "{}")
    with pytest.raises(InvalidRequestError, match=f"the limit is {MAX_STRUCTURED_OUTPUT_CHARS}"):
        StructuredOutput("regex", "a" * (MAX_STRUCTURED_OUTPUT_CHARS + 1))
    with pytest.raises(InvalidRequestError, match="ignore_eos cannot be combined with regex"):
        SamplingParams(ignore_eos=True, structured_output=StructuredOutput("regex", "a"))


def test_a_schema_is_kept_in_one_spelling_with_its_key_order():
    spaced = json.dumps(SCHEMA, indent=2)
    assert StructuredOutput.json_schema(spaced) == StructuredOutput.json_schema(SCHEMA)
    assert list(json.loads(StructuredOutput.json_schema(SCHEMA).spec)["properties"]) == ["ok", "n"]
    with pytest.raises(InvalidRequestError, match="^structured_output: the schema is not JSON"):
        StructuredOutput.json_schema("{nope")
    with pytest.raises(InvalidRequestError, match="^structured_output must be a JSON schema object"):
        StructuredOutput.json_schema("[1, 2]")


def test_both_wires_carry_it():
    params = SamplingParams(structured_output=StructuredOutput("regex", "[0-9]+"))
    frame = wire.encode(wire.Generate(7, "x", params))
    assert wire.decode_request(frame).params == params
    step = messages.ExecuteStep(StepPlan(1, {}, 0, [], {}, [], [], []),
                                {"r": params})
    assert messages.decode(messages.encode(step)).sampling["r"] == params
    bad_kind = msgpack.packb([wire.PROTOCOL_VERSION, "Generate", {
        "stream": 3, "prompt": "x", "params": {"structured_output": {"kind": "yaml", "spec": "a"}}}])
    with pytest.raises(wire.MessageError) as caught:
        wire.decode_request(bad_kind)
    assert caught.value.code == wire.ErrorCode.INVALID_REQUEST and caught.value.stream == 3
    bad_type = msgpack.packb([wire.PROTOCOL_VERSION, "Generate", {
        "stream": 3, "prompt": "x", "params": {"structured_output": {"kind": "regex", "spec": 5}}}])
    with pytest.raises(wire.MessageError, match=r"structured_output.spec: expected str, got int"):
        wire.decode_request(bad_type)


# ---- the compiler --------------------------------------------------------------------------

@pytest.mark.parametrize("structured, field, reason", [
    (StructuredOutput("json_schema", '{"type": "objectx"}'), "structured_output", 'Unsupported type "objectx"'),
    (StructuredOutput("regex", "(["), "regex", "Unclosed '['"),
    (StructuredOutput("grammar", "root ::= foo"), "grammar", 'Rule "foo" is not defined'),
])
def test_a_bad_spec_is_refused_naming_the_field_and_the_reason(demo_tokenizer, structured, field, reason):
    with pytest.raises(StructuredOutputError) as caught:
        _compiler(demo_tokenizer).compile(structured)
    assert caught.value.field == field and str(caught.value).startswith(f"{field}: invalid ")
    assert reason in str(caught.value) and ".cc:" not in str(caught.value)


def test_the_cache_compiles_each_spec_once_and_drops_the_least_recently_used(demo_tokenizer):
    compiler = _compiler(demo_tokenizer, cache_size=2)
    a, b, c = (StructuredOutput("regex", r) for r in ("a+", "b+", "c+"))
    first = compiler.compile(a)
    assert compiler.compile(a) is first and compiler.num_compiles == 1
    compiler.compile(b)
    compiler.compile(a)  # a is now the most recently used
    compiler.compile(c)  # so b goes
    assert compiler.cached(a) and compiler.cached(c) and not compiler.cached(b)
    assert compiler.num_compiles == 3
    uncached = _compiler(demo_tokenizer, cache_size=0)
    uncached.compile(a)
    uncached.compile(a)
    assert uncached.num_compiles == 2 and not uncached.cached(a)


def test_threads_asking_for_one_spec_at_once_compile_it_once(demo_tokenizer):
    compiler = _compiler(demo_tokenizer)
    structured = StructuredOutput.json_schema(SCHEMA)
    results = []
    threads = [threading.Thread(target=lambda: results.append(compiler.compile(structured)))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert compiler.num_compiles == 1 and all(r is results[0] for r in results)


def test_one_compiler_per_tokenizer_in_a_process(demo_tokenizer):
    again = Tokenizer.from_pretrained(demo_model_dir())
    assert compiler_for(demo_tokenizer, DEMO_VOCAB, [DEMO_EOS]) is compiler_for(again, DEMO_VOCAB, {DEMO_EOS})
    assert compiler_for(demo_tokenizer, DEMO_VOCAB, [DEMO_EOS]) is not compiler_for(
        ByteTokenizer(), 257, [256])


# ---- the matcher ---------------------------------------------------------------------------

def test_a_matcher_allows_a_valid_output_then_only_the_end(demo_tokenizer):
    compiler = _compiler(demo_tokenizer)
    structured = StructuredOutput.json_schema(SCHEMA)
    matcher = compiler.matcher(structured)
    bitmask = compiler.new_bitmask(1)
    for token in demo_tokenizer.encode('{"ok": true, "n": 7}'):
        assert token in matcher.allowed(bitmask)
        assert matcher.accept(token)
    assert matcher.allowed(bitmask) == [DEMO_EOS]
    assert matcher.accept(DEMO_EOS) and matcher.terminated
    assert matcher.allowed(bitmask) == [DEMO_EOS]
    assert not compiler.matcher(structured).accept(ord("x"))  # JSON starts with {


def test_a_matcher_rebuilt_from_output_tokens_stands_where_one_followed_them(demo_tokenizer):
    compiler = _compiler(demo_tokenizer)
    structured = StructuredOutput.json_schema(SCHEMA)
    output = demo_tokenizer.encode('{"ok": false, "n"')
    stepped = compiler.matcher(structured)
    for token in output:
        stepped.accept(token)
    rebuilt = compiler.matcher(structured, output)
    assert rebuilt.allowed(compiler.new_bitmask(1)) == stepped.allowed(compiler.new_bitmask(1)) == [ord(":")]
    with pytest.raises(StructuredOutputError, match=r"output token 1 \(120\) does not follow"):
        compiler.matcher(structured, demo_tokenizer.encode("{x"))


def test_the_byte_tokenizer_takes_a_regex_byte_by_byte():
    compiler = GrammarCompiler(ByteTokenizer(), ByteTokenizer.vocab_size, [ByteTokenizer.eos_token_id])
    matcher = compiler.matcher(StructuredOutput("regex", "[ab]c"))
    bitmask = compiler.new_bitmask(1)
    assert matcher.allowed(bitmask) == [ord("a"), ord("b")]
    matcher.accept(ord("b"))
    assert matcher.allowed(bitmask) == [ord("c")]
    matcher.accept(ord("c"))
    assert matcher.allowed(bitmask) == [ByteTokenizer.eos_token_id]
