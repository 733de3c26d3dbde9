"""The synchronous LLM facade: results in prompt order, text, retries when the
waiting queue is full, and validation errors raised to the caller."""

from __future__ import annotations

import threading

import pytest

from cadence.actors import LLM, ConfigError, EngineConfig, RequestTooLongError, SamplingParams


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
