"""Prompt log-probabilities against transformers on the same weights, in float32.

Each prompt token's logprob (and its top alternatives) must equal
`log_softmax(model(prompt).logits)` at the position before it, whether the
prompt is computed in one step, in chunks across steps (down to one token a
step, which would otherwise take the padded decode path), after a prefix-cache
hit handed to the runner, or, through the engine, when the same prompt is
already cached by an earlier request.
"""

from __future__ import annotations

import pytest
import torch

from cadence.actors import LLM
from cadence.gpu.runner import ModelRunner
from cadence.statemachine.sampling import SamplingParams

from conftest import random_prompts

LOGPROB_ATOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 96
NUM_TOP = 3


@torch.no_grad()
def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """Row p: the log-softmax of the logits at position p (it scores token p + 1)."""
    return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def check_entries(entries: dict[int, list], prompt: list[int], reference: torch.Tensor,
                  num_top: int, positions: range) -> None:
    """`entries` (position -> pairs) score exactly `positions`, as transformers does."""
    assert sorted(entries) == list(positions)
    for position in positions:
        (token, logprob), *alternatives = entries[position]
        row = reference[position - 1]
        assert token == prompt[position]
        assert logprob == pytest.approx(row[token].item(), abs=LOGPROB_ATOL)
        top = row.topk(num_top)
        assert [t for t, _ in alternatives] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([lp for _, lp in alternatives]), top.values,
                                   atol=LOGPROB_ATOL, rtol=0)


def scored_positions(driver, runner: ModelRunner) -> dict[str, dict[int, list]]:
    """Run the driver to the end, gathering every step's prompt logprobs by position;
    a position scored twice fails."""
    gathered: dict[str, dict[int, list]] = {}
    while driver.waiting or driver.running:
        driver.step()
        for request_id, (first, entries) in runner.take_prompt_logprobs().items():
            by_position = gathered.setdefault(request_id, {})
            for offset, entry in enumerate(entries):
                assert first + offset not in by_position
                by_position[first + offset] = entry
    return gathered


def make_runner(directory, **options) -> ModelRunner:
    return ModelRunner.from_pretrained(directory, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                       device="cpu", dtype=torch.float32,
                                       attention_backend="reference", **options)


def params(prompt_logprobs: int | None = NUM_TOP) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=prompt_logprobs)


@pytest.mark.parametrize("token_budget", [1, 5, 64])
def test_runner_scores_every_prompt_token_whatever_the_chunking(token_budget, hf_checkpoint, plan_driver):
    directory, model = hf_checkpoint("llama")
    # Padded decode batches: one-token prefill chunks would take that path, which keeps no prompt rows.
    runner = make_runner(directory, pad_decode_batches=True)
    driver = plan_driver(runner, token_budget=token_budget)
    scored, plain = random_prompts([13, 6], seed=4)
    driver.add("scored", scored, params())
    driver.add("plain", plain, params(None))
    gathered = scored_positions(driver, runner)
    assert set(gathered) == {"scored"}
    check_entries(gathered["scored"], scored, hf_prompt_logprobs(model, scored), NUM_TOP,
                  range(1, len(scored)))


def test_runner_scores_only_what_it_computes_after_a_prefix_hit(hf_checkpoint, plan_driver):
    directory, model = hf_checkpoint("qwen3")
    runner = make_runner(directory)
    driver = plan_driver(runner)
    [prompt] = random_prompts([14], seed=5)
    driver.add("owner", prompt, params(None))
    driver.step()
    driver.add("sharer", prompt, params(), share_prefix_of="owner", num_cached_tokens=2 * BLOCK_SIZE)
    gathered = scored_positions(driver, runner)
    check_entries(gathered["sharer"], prompt, hf_prompt_logprobs(model, prompt), NUM_TOP,
                  range(2 * BLOCK_SIZE + 1, len(prompt)))


def test_engine_prompt_logprobs_match_hf_with_chunks_and_a_warm_cache(hf_checkpoint):
    directory, model = hf_checkpoint("llama")
    [prompt] = random_prompts([21], seed=6)
    reference = hf_prompt_logprobs(model, prompt)
    with LLM(executor="inprocess", model=str(directory), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
             max_num_batched_tokens=8, max_model_len=64, dtype="float32", device="cpu") as llm:
        warm = llm.generate([prompt], params(None), use_tqdm=False)[0]
        scored = llm.generate([prompt], params(), use_tqdm=False)[0]
        again = llm.generate([prompt], params(None), use_tqdm=False)[0]
    # The prompt was cached (the next plain request hits it), but the scored one computed it all.
    assert warm.num_cached_tokens == 0 and again.num_cached_tokens == 5 * BLOCK_SIZE
    assert scored.num_cached_tokens == 0
    assert scored.token_ids == warm.token_ids
    entries = scored.prompt_token_logprobs
    assert entries[0] is None and len(entries) == len(prompt)
    check_entries({p: e for p, e in enumerate(entries) if p}, prompt, reference, NUM_TOP,
                  range(1, len(prompt)))
    # vLLM's shape: the prompt token and the top alternatives, ranked.
    first = scored.prompt_logprobs[1]
    assert prompt[1] in first
    assert [first[t].rank for t in reference[0].topk(NUM_TOP).indices.tolist()] == [1, 2, 3]
