"""The synchronous LLM facade: results in prompt order, text, retries when the
waiting queue is full, and validation errors raised to the caller."""

from __future__ import annotations

import json
import logging
import shutil
import threading

import pytest

from cadence.actors import (
    LLM, CadenceError, ConfigError, EngineConfig, InvalidRequestError, RequestTooLongError,
    SamplingParams,
)
from cadence.actors.engine import demo_model_dir


def test_results_come_back_in_prompt_order_with_text():
    llm = LLM(executor="simulated", max_num_seqs=2, max_waiting=3, block_size=4, num_blocks=64)
    prompts = [f"prompt {i}" for i in range(7)]
    results = llm.generate(prompts, SamplingParams(max_tokens=3), use_tqdm=False)
    assert [r.prompt_token_ids for r in results] == [list(p.encode()) for p in prompts]
    assert all(r.finish_reason == "length" and len(r.token_ids) == 3 for r in results)
    assert all(r.text == bytes(r.token_ids).decode() for r in results)
    assert llm.last_stats.num_requests_completed == 7


def test_one_prompt_and_per_prompt_params():
    llm = LLM(EngineConfig(executor="simulated"))
    [single] = llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(single.token_ids) == 2
    both = llm.generate(["a", "b"], [SamplingParams(max_tokens=1), SamplingParams(max_tokens=4)],
                        use_tqdm=False)
    assert [len(r.token_ids) for r in both] == [1, 4]


def test_mistakes_raise():
    with pytest.raises(ConfigError, match="unknown engine option"):
        LLM(max_num_sequences=2)
    with pytest.raises(ConfigError):
        LLM(EngineConfig(), max_num_seqs=2)
    llm = LLM(executor="simulated", max_model_len=16)
    with pytest.raises(RequestTooLongError):
        llm.generate(["x" * 20], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ConfigError, match="2 prompts but 1"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def _llm_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "cadence-llm" and t.is_alive())


def test_one_engine_serves_every_call_until_close():
    """The engine (and its executor) starts once: the core's counters run on across
    calls; close() ends its thread, and a later call starts a fresh engine."""
    before = _llm_threads()
    with LLM(executor="simulated", max_num_seqs=2) as llm:
        llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=False)
        llm.generate(["c", "d", "e"], SamplingParams(max_tokens=2), use_tqdm=False)
        assert llm.last_stats.num_requests_added == 5
        assert _llm_threads() == before + 1
        llm.close()
        assert _llm_threads() == before
        llm.generate(["f"], SamplingParams(max_tokens=2), use_tqdm=False)
        assert llm.last_stats.num_requests_added == 1
    assert _llm_threads() == before


def test_logprobs_come_back_from_generate():
    with LLM(executor="simulated") as llm:
        [result] = llm.generate("hi", SamplingParams(max_tokens=4, logprobs=1), use_tqdm=False)
    assert [entry[0][0] for entry in result.logprobs] == result.token_ids


# ---- vLLM's names -------------------------------------------------------------------------


def test_vllm_keywords_map_to_the_engine_config():
    llm = LLM("demo", tensor_parallel_size=1, gpu_memory_utilization=0.5, max_model_len=64,
              dtype="float32", seed=7, max_num_seqs=4, enable_prefix_caching=False, block_size=32,
              max_num_batched_tokens=512, num_gpu_blocks_override=100)
    config = llm.config
    assert (config.model, config.executor, config.dtype, config.seed) == ("demo", "inprocess", "float32", 7)
    assert dict(config.executor_options) == {"tp": 1, "gpu_memory_utilization": 0.5}
    assert (config.scheduler.max_model_len, config.scheduler.max_num_seqs,
            config.scheduler.max_num_batched_tokens) == (64, 4, 512)
    assert (config.cache.enable_prefix_caching, config.cache.block_size, config.cache.num_blocks) == (False, 32, 100)
    assert LLM().config.model == "demo" and LLM().config.executor == "inprocess"
    with pytest.raises(ConfigError, match="unknown engine option 'quantization'"):
        LLM(quantization="awq")
    with pytest.raises(ConfigError, match="given twice"):
        LLM(num_blocks=10, num_gpu_blocks_override=20)


def test_every_vllm_prompt_shape_and_the_vllm_result_shape():
    with LLM(executor="simulated", max_num_seqs=4) as llm:
        results = llm.generate(["ab", {"prompt": "cd"}, {"prompt_token_ids": [104, 105]}, [106, 107]],
                               sampling_params=SamplingParams(max_tokens=3, logprobs=2), use_tqdm=False)
        [single] = llm.generate({"prompt_token_ids": [97], "prompt": "a"}, SamplingParams(max_tokens=1),
                                use_tqdm=False)
    assert [r.prompt for r in results] == ["ab", "cd", None, None]
    assert [r.prompt_token_ids for r in results] == [[97, 98], [99, 100], [104, 105], [106, 107]]
    assert single.prompt == "a" and single.prompt_token_ids == [97]
    for result in results:
        [completion] = result.outputs
        assert result.finished and completion.finished()
        assert completion.token_ids == result.token_ids and len(completion.token_ids) == 3
        assert completion.text == result.text == bytes(completion.token_ids).decode()
        assert completion.finish_reason == "length"
        assert [set(entry) >= {token} for entry, token in zip(completion.logprobs, completion.token_ids)] == [True] * 3
        sampled = [entry[token].logprob for entry, token in zip(completion.logprobs, completion.token_ids)]
        assert completion.cumulative_logprob == pytest.approx(sum(sampled))
        ranks = sorted(lp.rank for lp in completion.logprobs[0].values())
        assert ranks[0] == 1
        assert result.metrics.finished_time >= result.metrics.arrival_time


@pytest.mark.parametrize("prompts, match", [
    ([3.5], "each prompt must be a str, a list of token ids"),
    ({"text": "x"}, "'prompt' \\(str\\) or 'prompt_token_ids'"),
    (42, "prompts must be a str"),
    ([["a", "b"]], "each prompt must be"),
])
def test_other_prompt_shapes_are_named(prompts, match):
    with pytest.raises(InvalidRequestError, match=match):
        LLM(executor="simulated").generate(prompts, use_tqdm=False)


def test_max_tokens_none_runs_up_to_max_model_len():
    with LLM(executor="simulated", max_model_len=16) as llm:
        [result] = llm.generate("abcd", SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)
        with pytest.raises(RequestTooLongError, match="max_model_len is 16"):
            llm.generate("x" * 16, SamplingParams(max_tokens=None), use_tqdm=False)
    assert len(result.token_ids) == 12 and result.finish_reason == "length"


def test_the_simulated_executor_says_so_first(caplog):
    with caplog.at_level(logging.WARNING, logger="cadence.actors.engine"):
        with LLM(executor="simulated") as llm:
            llm.generate("a", SamplingParams(max_tokens=1), use_tqdm=False)
    assert caplog.records and "simulated executor" in caplog.records[0].getMessage()
    assert caplog.records[0].levelno == logging.WARNING


def test_a_sliding_window_checkpoint_is_refused_at_load(tmp_path):
    model = tmp_path / "mistral"
    shutil.copytree(demo_model_dir(), model)
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=8)
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(CadenceError, match="sliding_window 8.*max_model_len <= 8"):
        LLM(model=str(model)).generate("def ", SamplingParams(max_tokens=2), use_tqdm=False)
    with LLM(model=str(model), max_model_len=8) as llm:
        [result] = llm.generate("def ", SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(result.token_ids) == 2
