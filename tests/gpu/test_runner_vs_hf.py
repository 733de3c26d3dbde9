"""The runner against Hugging Face transformers on the same weights, in float32.

Greedy tokens must be identical and the sampled tokens' logprobs within
LOGPROB_ATOL, whatever the batching: one prefill per request, prefill split in
chunks across steps, prefix-cache hits, and preemption followed by recompute.
"""

from __future__ import annotations

import pytest
import torch

from cadence.gpu.runner import ModelRunner
from cadence.statemachine.sampling import SamplingParams

from conftest import KINDS, hf_greedy, random_prompts

LOGPROB_ATOL = 1e-4
LOGITS_ATOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 96


def make_runner(directory, attention_backend: str = "reference", cpu_path: str = "eager") -> ModelRunner:
    return ModelRunner.from_pretrained(
        directory, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, device="cpu",
        dtype=torch.float32, attention_backend=attention_backend, cpu_path=cpu_path,
    )


# The CPU's two ways through a step: torch's plain ops over the reference attention, and
# the default fast path (prepacked merged products, the in-place decode kernel).
CPU_PATHS = {"eager": dict(attention_backend="reference", cpu_path="eager"),
             "fast": dict(attention_backend="cpu", cpu_path="packed")}


def greedy(num_tokens: int, logprobs: int | None = 2) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=num_tokens, logprobs=logprobs, ignore_eos=True)


def check_against_hf(model, driver, prompts: dict[str, list[int]], num_tokens: int) -> None:
    for request_id, prompt in prompts.items():
        expected, expected_logprobs = hf_greedy(model, prompt, num_tokens)
        request = driver.requests[request_id]
        assert request.outputs == expected, request_id
        got = torch.tensor([entry[0][1] for entry in request.logprobs])
        want = torch.stack([lp[t] for lp, t in zip(expected_logprobs, expected)])
        torch.testing.assert_close(got, want, atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("path", list(CPU_PATHS))
def test_greedy_batch_matches_hf(kind, path, hf_checkpoint, plan_driver):
    directory, model = hf_checkpoint(kind)
    driver = plan_driver(make_runner(directory, **CPU_PATHS[path]))
    prompts = dict(zip("abcd", random_prompts([1, 6, 13, 21], seed=1)))
    for request_id, prompt in prompts.items():
        driver.add(request_id, prompt, greedy(8))
    driver.run()
    assert len(driver.plans[0].num_scheduled_tokens) == 4  # all prefills in one step
    check_against_hf(model, driver, prompts, 8)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("path", list(CPU_PATHS))
def test_chunked_prefill_matches_hf(kind, path, hf_checkpoint, plan_driver):
    directory, model = hf_checkpoint(kind)
    driver = plan_driver(make_runner(directory, **CPU_PATHS[path]), token_budget=5)
    prompts = dict(zip("abc", random_prompts([11, 17, 3], seed=2)))
    for request_id, prompt in prompts.items():
        driver.add(request_id, prompt, greedy(6))
    driver.run()
    # Some step mixed a decode with another request's prefill chunk.
    assert any(
        len(plan.num_scheduled_tokens) > 1 and 1 in plan.num_scheduled_tokens.values() for plan in driver.plans
    )
    check_against_hf(model, driver, prompts, 6)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("path", list(CPU_PATHS))
def test_prefix_cache_hits_match_hf(kind, path, hf_checkpoint, plan_driver):
    directory, model = hf_checkpoint(kind)
    driver = plan_driver(make_runner(directory, **CPU_PATHS[path]), token_budget=64)
    shared, tail_b, tail_c = random_prompts([10, 5, 1], seed=3)
    prompts = {"a": shared + [7, 8], "b": shared + tail_b, "c": shared[:8] + tail_c}
    driver.add("a", prompts["a"], greedy(6))
    driver.step()
    driver.add("b", prompts["b"], greedy(6), share_prefix_of="a", num_cached_tokens=8)
    driver.add("c", prompts["c"], greedy(6), share_prefix_of="a", num_cached_tokens=8)
    plan_result = driver.step()
    admitted = driver.plans[-1]
    assert admitted.num_scheduled_tokens["b"] == len(prompts["b"]) - 8
    assert admitted.num_scheduled_tokens["c"] == 1
    assert set(plan_result.sampled_token_ids) == {"a", "b", "c"}
    driver.run()
    check_against_hf(model, driver, prompts, 6)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("path", list(CPU_PATHS))
def test_preemption_then_recompute_matches_hf(kind, path, hf_checkpoint, plan_driver):
    directory, model = hf_checkpoint(kind)
    driver = plan_driver(make_runner(directory, **CPU_PATHS[path]), token_budget=16)
    prompts = dict(zip("abc", random_prompts([9, 14, 5], seed=4)))
    driver.add("a", prompts["a"], greedy(10))
    driver.add("b", prompts["b"], greedy(10))
    for _ in range(4):
        driver.step()
    a_blocks = list(driver.requests["a"].block_ids)
    driver.preempt("a")
    driver.add("c", prompts["c"], greedy(10))
    driver.step()
    # LIFO reuse: the freed blocks of "a" now hold other tokens, so "a" must truly recompute.
    assert set(driver.requests["a"].block_ids) & set(a_blocks) or set(driver.requests["c"].block_ids) & set(a_blocks)
    assert driver.plans[-1].resumed_ids == ["a"]
    driver.run()
    check_against_hf(model, driver, prompts, 10)


@pytest.mark.parametrize("cpu_path", ["eager", "packed"])
@pytest.mark.parametrize("backend", ["reference", "sdpa", "cpu"])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_prompt_logits_match_hf(kind, backend, cpu_path, hf_checkpoint):
    directory, model = hf_checkpoint(kind)
    runner = make_runner(directory, attention_backend=backend, cpu_path=cpu_path)
    (prompt,) = random_prompts([19], seed=5)
    # Blocks deliberately out of order, and the prompt split in two chunks.
    table = [7, 3, 11, 0, 5]
    hidden = []
    for start, end in [(0, 12), (12, 19)]:
        inputs = runner._build_inputs([(prompt[start:end], start, table)])
        with torch.inference_mode():
            hidden.append(runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta))
    logits = runner.model.compute_logits(torch.cat(hidden))
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(logits, expected, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("path", list(CPU_PATHS))
def test_seeded_sampling_does_not_depend_on_batch(path, hf_checkpoint, plan_driver):
    directory, _ = hf_checkpoint("llama")
    prompts = random_prompts([7, 12, 4], seed=6)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=8, ignore_eos=True)
    alone = plan_driver(make_runner(directory, **CPU_PATHS[path]))
    alone.add("x", prompts[0], seeded)
    crowd = plan_driver(make_runner(directory, **CPU_PATHS[path]), token_budget=9)
    crowd.add("y", prompts[1], SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True))
    crowd.add("x", prompts[0], seeded)
    crowd.add("z", prompts[2], SamplingParams(temperature=1.0, seed=99, max_tokens=8, ignore_eos=True))
    assert alone.run()["x"] == crowd.run()["x"]
