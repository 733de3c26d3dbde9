"""The runner on a CUDA device: same greedy tokens as the CPU and as transformers, every backend, profiled cache size.

Skipped without a GPU.
"""

from __future__ import annotations

import time

import pytest
import torch

from cadence.gpu import ModelRunner, preset
from cadence.statemachine.sampling import SamplingParams

from conftest import hf_greedy, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BLOCK_SIZE = 16
LOGPROB_ATOL = 1e-3
BF16_LOGPROB_ATOL = 0.15


def run_driver(driver_class, runner, prompts, params, token_budget):
    driver = driver_class(runner, token_budget=token_budget)
    for request_id, prompt in prompts.items():
        driver.add(request_id, prompt, params)
    outputs = driver.run()
    return outputs, {rid: [e[0][1] for e in r.logprobs] for rid, r in driver.requests.items()}


@pytest.mark.parametrize("backend", ["reference", "sdpa", "triton"])
def test_float32_on_cuda_matches_transformers(backend, hf_checkpoint, plan_driver):
    directory, model = hf_checkpoint("qwen3")
    runner = ModelRunner.from_pretrained(
        directory, num_blocks=64, block_size=BLOCK_SIZE, device="cuda", dtype="float32",
        attention_backend=backend,
    )
    prompts = dict(zip("abcd", random_prompts([1, 9, 30, 45], seed=11)))
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)
    outputs, logprobs = run_driver(plan_driver, runner, prompts, params, token_budget=20)
    for request_id, prompt in prompts.items():
        expected, expected_logprobs = hf_greedy(model, prompt, 8)
        assert outputs[request_id] == expected, request_id
        want = torch.stack([lp[t] for lp, t in zip(expected_logprobs, expected)])
        torch.testing.assert_close(torch.tensor(logprobs[request_id]), want, atol=LOGPROB_ATOL, rtol=0)


def test_profiled_cache_fits_the_memory_budget():
    runner = ModelRunner(
        preset("qwen3-0.6b"), device="cuda", attention_backend="triton",
        gpu_memory_utilization=0.5, max_num_batched_tokens=4096, max_num_seqs=128,
    )
    _, total = torch.cuda.mem_get_info()
    cache_bytes = runner.num_blocks * runner.kv_block_bytes()
    print(f"profiled {runner.num_blocks} blocks, {cache_bytes / 2**30:.1f} GiB of {total / 2**30:.1f} GiB")
    assert runner.num_blocks > 1000
    assert torch.cuda.memory_reserved() <= 0.5 * total


def test_bfloat16_backends_agree_on_a_preset_model(plan_driver):
    prompts = dict(zip("abcdefgh", random_prompts([5, 17, 40, 64, 3, 100, 33, 8], seed=12, vocab_size=151936)))
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1, ignore_eos=True)
    results = {}
    for backend in ["reference", "sdpa", "triton"]:
        runner = ModelRunner(
            preset("qwen3-0.6b"), num_blocks=512, block_size=BLOCK_SIZE, device="cuda", attention_backend=backend
        )
        run_driver(plan_driver, runner, prompts, params, token_budget=64)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        results[backend] = run_driver(plan_driver, runner, prompts, params, token_budget=64)
        print(f"{backend}: {time.perf_counter() - start:.2f} s for 8 requests x 16 tokens")
        del runner
        torch.cuda.empty_cache()
    reference_logprobs = results["reference"][1]
    for backend in ["sdpa", "triton"]:
        for request_id, values in results[backend][1].items():
            # Same tokens while the sequences agree; compare the first token's logprob, which they always share.
            assert abs(values[0] - reference_logprobs[request_id][0]) < BF16_LOGPROB_ATOL, (backend, request_id)
        same = sum(results[backend][0][r] == results["reference"][0][r] for r in prompts)
        print(f"{backend}: {same}/8 greedy sequences identical to the reference in bfloat16")
