"""Length-balanced decode attention on the padded decode path (the CUDA-graph path's
eager twin), run in Triton's CPU interpreter: the same greedy tokens and log-probabilities
as the reference backend, with contexts cut into several tiles each."""

from __future__ import annotations

import pytest
import torch

from cadence.gpu import ModelRunner, preset
from cadence.gpu.worklist import BalanceConfig
from cadence.statemachine.errors import ConfigError
from cadence.statemachine.sampling import SamplingParams

import triton_modules
from conftest import random_prompts
from triton_modules import DEVICE, HAS_CUDA

# The runner picks the kernels up from the module the interpreter now runs.
triton_modules.load("triton_attention", "_paged_attention_kernel")
# Tiles of a cache block or two, so short test contexts still split into several.
FINE = BalanceConfig(tiles_per_seq=3, granularity=4, min_tile_tokens=4)


def runner(**kwargs) -> ModelRunner:
    options = dict(num_blocks=64, block_size=4, device=DEVICE, dtype="float32", seed=3,
                   max_num_seqs=8)
    return ModelRunner(preset("tiny"), **{**options, **kwargs})


def drive(plan_driver, model_runner, prompts):
    driver = plan_driver(model_runner, token_budget=64)
    for i, prompt in enumerate(prompts):
        driver.add(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=5 + i, logprobs=1,
                                                   ignore_eos=True))
    outputs = driver.run()
    logprobs = {rid: [entry[0][1] for entry in r.logprobs] for rid, r in driver.requests.items()}
    return outputs, logprobs


def test_balanced_padded_decodes_match_the_reference_backend(plan_driver):
    prompts = random_prompts([5, 19, 2, 14, 7, 3], seed=5, vocab_size=512)
    balanced = runner(attention_backend="triton", pad_decode_batches=True,
                      balanced_decode_attention=FINE)
    graphs = balanced.decode_graphs
    tiles_per_step = []
    real_run = graphs.run

    def spy(size, max_len):
        starts = graphs._host["seq_tile_start"][:size + 1]
        tiles_per_step.append((size, int(starts[-1])))
        return real_run(size, max_len)

    graphs.run = spy
    expected, expected_logprobs = drive(plan_driver, runner(), prompts)
    got, got_logprobs = drive(plan_driver, balanced, prompts)
    assert got == expected
    for rid, values in expected_logprobs.items():
        torch.testing.assert_close(torch.tensor(got_logprobs[rid]), torch.tensor(values),
                                   atol=1e-4, rtol=0)
    # The decode steps really ran through work lists with more tiles than rows.
    assert tiles_per_step and any(tiles > size for size, tiles in tiles_per_step)


def test_balanced_decodes_need_the_triton_backend():
    with pytest.raises(ConfigError, match="balanced_decode_attention needs attention_backend"):
        runner(attention_backend="reference", pad_decode_batches=True,
               balanced_decode_attention=True)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU to capture graphs; the padded "
                    "eager twin above checks the same work lists on the CPU")
def test_captured_graphs_with_balanced_decodes_match_the_reference_backend(plan_driver):
    prompts = random_prompts([5, 190, 2, 140, 70, 3, 33], seed=7, vocab_size=512)
    balanced = runner(attention_backend="triton", use_cuda_graphs=True,
                      balanced_decode_attention=FINE, num_blocks=256)
    assert balanced.decode_graphs.captured
    expected, _ = drive(plan_driver, runner(num_blocks=256), prompts)
    got, _ = drive(plan_driver, balanced, prompts)
    assert got == expected
