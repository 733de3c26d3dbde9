"""vLLM's offline names on `LLM` and `SamplingParams`, each with vLLM's meaning, on the
demo model: n samples as one request group, top_k=-1, stop_reason, decoded tokens,
logit_bias, allowed_token_ids, bad_words, skip_special_tokens, truncate_prompt_tokens,
and the LLM keywords enforce_eager, trust_remote_code, tokenizer and get_tokenizer().
examples/vllm_offline.py, a vLLM script with only its import changed, runs too.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from cadence.actors import LLM, InvalidRequestError, SamplingParams
from cadence.actors.engine import demo_model_dir
from cadence.gpu.tokenizer import Tokenizer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm_offline.py"
PROMPT = "def "


@pytest.fixture(scope="module")
def llm():
    with LLM(model="demo", tokenizer="demo", max_model_len=512, seed=0, enforce_eager=True,
             trust_remote_code=True) as llm:
        yield llm


def _one(llm, prompt, **params):
    (result,) = llm.generate(prompt, SamplingParams(**params), use_tqdm=False)
    return result


def test_llm_takes_vllms_keywords(llm):
    assert llm.config.executor_options["use_cuda_graphs"] is False  # enforce_eager
    tokenizer = llm.get_tokenizer()
    assert tokenizer.encode("def ") == Tokenizer.from_pretrained(demo_model_dir()).encode("def ")
    # A model folder with the tokenizer named apart (here the same one, by name).
    other = LLM(model=str(demo_model_dir()), tokenizer="demo", max_model_len=64)
    assert other.config.tokenizer is not None and other.get_tokenizer() is other.config.tokenizer
    other.close()
    assert "use_cuda_graphs" not in LLM(model="demo", enforce_eager=False).config.executor_options


def test_n_samples_share_the_prompt_and_are_seeded_apart(llm):
    result = _one(llm, PROMPT, n=3, best_of=3, temperature=1.0, seed=5, max_tokens=8)
    outputs = result.outputs
    assert [o.index for o in outputs] == [0, 1, 2] and len({o.text for o in outputs}) > 1
    for index, output in enumerate(outputs):  # sample i is the request seeded seed + i
        alone = _one(llm, PROMPT, temperature=1.0, seed=5 + index, max_tokens=8)
        assert output.token_ids == alone.token_ids
    with pytest.raises(InvalidRequestError, match="best_of must be equal to n"):
        SamplingParams(n=2, best_of=3)


def test_top_k_minus_one_means_no_top_k(llm):
    assert SamplingParams(top_k=-1).top_k == 0
    assert (_one(llm, PROMPT, temperature=1.0, seed=3, top_k=-1, max_tokens=8).token_ids
            == _one(llm, PROMPT, temperature=1.0, seed=3, max_tokens=8).token_ids)


def test_stop_reason_is_the_stop_string_or_token_id(llm):
    free = _one(llm, PROMPT, temperature=0.0, max_tokens=32)
    assert free.outputs[0].stop_reason is None  # ended by length
    stop = free.text[3:5]
    by_string = _one(llm, PROMPT, temperature=0.0, max_tokens=32, stop=["zzz", stop])
    assert by_string.outputs[0].stop_reason == stop and by_string.text == free.text[:free.text.index(stop)]
    token = free.token_ids[2]
    by_token = _one(llm, PROMPT, temperature=0.0, max_tokens=32, stop_token_ids=[token])
    assert by_token.outputs[0].stop_reason == token and by_token.finish_reason == "stop"
    assert by_token.token_ids == free.token_ids[:3]
    tokenizer = llm.get_tokenizer()
    assert by_token.text == tokenizer.decode(free.token_ids[:2])  # the stop token's text is left out
    kept = _one(llm, PROMPT, temperature=0.0, max_tokens=32, stop_token_ids=[token],
                include_stop_str_in_output=True)
    assert kept.text == tokenizer.decode(free.token_ids[:3])


def test_logprobs_carry_their_decoded_tokens(llm):
    result = _one(llm, PROMPT, temperature=0.0, max_tokens=3, logprobs=2)
    tokenizer = llm.get_tokenizer()
    for position in result.outputs[0].logprobs:
        assert position and all(lp.decoded_token == tokenizer.decode([token])
                                for token, lp in position.items())


def test_logit_bias_and_allowed_token_ids_steer_sampling(llm):
    tokenizer = llm.get_tokenizer()
    favourite = tokenizer.encode("q", add_special_tokens=False)[0]
    biased = _one(llm, PROMPT, temperature=0.0, max_tokens=5, logit_bias={favourite: 100.0})
    assert biased.token_ids == [favourite] * 5
    allowed = tokenizer.encode("abc", add_special_tokens=False)
    limited = _one(llm, PROMPT, temperature=1.0, seed=1, max_tokens=12, allowed_token_ids=allowed)
    assert set(limited.token_ids) <= set(allowed) and len(set(limited.token_ids)) > 1
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        _one(llm, PROMPT, logit_bias={10 ** 6: 1.0})


def test_bad_words_are_never_generated(llm):
    free = _one(llm, PROMPT, temperature=0.0, max_tokens=24)
    tokenizer = llm.get_tokenizer()
    word = tokenizer.decode(free.token_ids[1:3])  # two tokens the model wants to write
    assert len(tokenizer.encode(word, add_special_tokens=False)) >= 2
    banned = _one(llm, PROMPT, temperature=0.0, max_tokens=24, bad_words=[word])
    assert banned.token_ids[:1] == free.token_ids[:1] and banned.token_ids != free.token_ids
    ids = tuple(tokenizer.encode(word, add_special_tokens=False))
    generated = banned.token_ids
    assert all(tuple(generated[i:i + len(ids)]) != ids for i in range(len(generated)))


def test_skip_special_tokens_false_keeps_them_in_the_text(llm):
    tokenizer = llm.get_tokenizer()
    eos = tokenizer.eos_token_ids[0]
    forced = dict(temperature=0.0, max_tokens=3, ignore_eos=True, logit_bias={eos: 100.0})
    assert _one(llm, PROMPT, **forced).text == ""
    assert _one(llm, PROMPT, skip_special_tokens=False, **forced).text == tokenizer.decode(
        [eos] * 3, skip_special_tokens=False) != ""


def test_truncate_prompt_tokens_keeps_the_prompts_end(llm):
    prompt = "import os\nimport sys\ndef main():\n"
    ids = llm.get_tokenizer().encode(prompt)
    cut = _one(llm, prompt, temperature=0.0, max_tokens=4, truncate_prompt_tokens=5)
    assert cut.prompt_token_ids == ids[-5:]
    assert cut.token_ids == _one(llm, ids[-5:], temperature=0.0, max_tokens=4).token_ids


def test_a_vllm_script_runs_with_only_its_import_changed(capsys):
    source = EXAMPLE.read_text()
    assert [line for line in source.splitlines() if "cadence" in line] == [
        "from cadence.actors import LLM, SamplingParams"]
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("sample ") for line in out) == 3
    stops = [line for line in out if line.startswith("stop ")]
    assert len(stops) == 2 and stops[0].split()[-1] in ("'('", "':'")
    assert stops[1].split()[-1].isdigit()
    assert sum(line.startswith("steered ") for line in out) == 4


def test_chat_renders_tools_and_tool_call_turns(llm):
    from cadence.actors.chat import ChatTemplate

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "1 + 2?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    (result,) = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, tools=tools)
    rendered = ChatTemplate.from_dir(demo_model_dir()).render(
        [messages[0], {**messages[1], "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1}}}]},
         messages[2]], tools=tools)
    assert '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>' in rendered
    assert result.prompt_token_ids == llm.get_tokenizer().encode(rendered, add_special_tokens=False)
