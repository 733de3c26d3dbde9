"""Faults that follow one request stay with it: the runner reports the request and
serves the rest of the batch (reproductions of requests that once failed whole steps)."""

from __future__ import annotations

import pytest

from cadence.gpu import ModelRunner, preset
from cadence.statemachine.plan import NewRequestData, StepPlan
from cadence.statemachine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
NUM_BLOCKS, BLOCK_SIZE = 32, 4


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(preset("tiny"), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, device="cpu")


@pytest.fixture(autouse=True)
def fresh_batch(runner):
    runner.reset()
    runner.take_failed()


def first_step(runner, prompts: dict[str, list[int]], params: dict[str, SamplingParams]):
    news, scheduled, block = [], {}, 0
    for rid, tokens in prompts.items():
        blocks = list(range(block, block + -(-len(tokens) // BLOCK_SIZE)))
        block += len(blocks)
        news.append(NewRequestData(rid, tokens, len(tokens), blocks, 0))
        scheduled[rid] = len(tokens)
    plan = StepPlan(0, scheduled, sum(scheduled.values()), news, {}, [], [], [])
    return runner.execute(plan, params)


@pytest.mark.parametrize(("poison", "why"), [
    (SamplingParams(temperature=1.0, top_k=2**63), "sampling failed"),
    # Refused before the device sees it: on a GPU the bad index would fault the device.
    (SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[100_000]), "outside the model's vocabulary"),
], ids=["top_k_2_63", "stop_token_out_of_vocab"])
def test_a_request_whose_sampling_fails_is_reported_and_the_others_sample(runner, poison, why):
    prompts = {"good": [1, 2, 3], "bad": [4, 5, 6], "also-good": [7, 8]}
    params = {"good": GREEDY, "bad": poison, "also-good": GREEDY}
    result = first_step(runner, prompts, params)
    failed = runner.take_failed()
    assert list(failed) == ["bad"] and why in failed["bad"]
    assert set(result.sampled_token_ids) == {"good", "also-good"}
    assert runner.num_requests == 2  # the failed request left the batch
    alone = {}
    for rid in ("good", "also-good"):
        runner.reset()
        alone[rid] = first_step(runner, {rid: prompts[rid]}, {rid: GREEDY}).sampled_token_ids[rid]
    assert {rid: result.sampled_token_ids[rid] for rid in alone} == alone


def test_a_prompt_token_outside_the_vocabulary_is_refused_before_the_forward_pass(runner):
    vocab = runner.vocab_size
    result = first_step(runner, {"ok": [1, 2], "foreign": [3, vocab + 5]}, {"ok": GREEDY, "foreign": GREEDY})
    failed = runner.take_failed()
    assert list(failed) == ["foreign"] and str(vocab + 5) in failed["foreign"]
    assert list(result.sampled_token_ids) == ["ok"]


def test_a_sampling_fault_of_every_row_fails_the_step(runner):
    """When no row samples alone, the fault is not any one request's: the step raises."""
    bad = SamplingParams(temperature=1.0, top_k=2**63)
    with pytest.raises(ValueError, match="Overflow"):
        first_step(runner, {"a": [1, 2], "b": [3, 4]}, {"a": bad, "b": bad})
    assert runner.take_failed() == {}
