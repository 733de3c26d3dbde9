"""The sampler: each filter and penalty against a direct computation, seeds, distribution, logprobs."""

from __future__ import annotations

import pytest
import torch

from cadence.gpu.sampler import Sampler, apply_penalties, apply_top_k_top_p_min_p, token_seed
from cadence.statemachine.sampling import SamplingParams

VOCAB = 32
NEG_INF = float("-inf")


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def kept(logits_row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(logits_row > NEG_INF).flatten().tolist())


def direct_top_k(row: torch.Tensor, k: int) -> set[int]:
    ordered = sorted(range(VOCAB), key=lambda t: -row[t].item())
    return set(ordered[:k]) if k else set(range(VOCAB))


def direct_top_p(row: torch.Tensor, p: float) -> set[int]:
    probs = row.double().softmax(0).tolist()
    chosen, mass = set(), 0.0
    for t in sorted(range(VOCAB), key=lambda t: -probs[t]):
        if mass >= p:
            break
        chosen.add(t)
        mass += probs[t]
    return chosen


def direct_min_p(row: torch.Tensor, min_p: float) -> set[int]:
    probs = row.softmax(0)
    return {t for t in range(VOCAB) if probs[t] >= min_p * probs.max()}


def test_top_k_top_p_min_p_each_match_direct_computation():
    logits = random_logits(6)
    top_k = torch.tensor([0, 1, 5, 0, 0, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.5, 0.9, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.2])
    out = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    assert kept(out[0]) == set(range(VOCAB))
    assert kept(out[1]) == direct_top_k(logits[1], 1)
    assert kept(out[2]) == direct_top_k(logits[2], 5)
    assert kept(out[3]) == direct_top_p(logits[3], 0.5)
    assert kept(out[4]) == direct_top_p(logits[4], 0.9)
    assert kept(out[5]) == direct_min_p(logits[5], 0.2)
    survivors = out > NEG_INF
    assert torch.equal(out[survivors], logits[survivors])


def test_filters_compose_in_order_k_then_p_then_min_p():
    logits = random_logits(1, seed=1)
    out = apply_top_k_top_p_min_p(logits, torch.tensor([8]), torch.tensor([0.8]), torch.tensor([0.1]))
    after_k = logits[0].clone()
    after_k[[t for t in range(VOCAB) if t not in direct_top_k(logits[0], 8)]] = NEG_INF
    after_p = after_k.clone()
    after_p[[t for t in range(VOCAB) if t not in direct_top_p(after_k, 0.8)]] = NEG_INF
    assert kept(out[0]) == direct_min_p(after_p, 0.1) & kept(after_p)


def test_penalties_match_direct_computation():
    logits = random_logits(2, seed=2)
    prompts = [[1, 2, 2, 5], [7]]
    outputs = [[2, 3, 3, 3], []]
    rep, presence, frequency = torch.tensor([1.3, 2.0]), torch.tensor([0.5, 1.0]), torch.tensor([0.25, 1.0])
    out = apply_penalties(logits, prompts, outputs, rep, presence, frequency)
    expected = logits.clone()
    for i in range(2):
        for t in set(prompts[i]) | set(outputs[i]):
            value = expected[i, t]
            expected[i, t] = value / rep[i] if value > 0 else value * rep[i]
        for t in set(outputs[i]):
            expected[i, t] -= presence[i] + frequency[i] * outputs[i].count(t)
    torch.testing.assert_close(out, expected)


def test_greedy_takes_the_argmax_of_penalised_logits():
    logits = torch.zeros(2, VOCAB)
    logits[:, 4] = 2.0
    logits[:, 9] = 1.9
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, repetition_penalty=1.5)]
    out = Sampler()(logits, params, [[4], [4]], [[], []])
    assert out.token_ids == [4, 9]


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.zeros(3, VOCAB)
    logits[:, 2] = 10.0  # eos
    logits[:, 3] = 9.0  # stop token
    sampler = Sampler(eos_token_ids=[2])
    params = [
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3]),
        SamplingParams(temperature=0.0, min_tokens=2),
        SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[3]),
    ]
    out = sampler(logits, params, [[5]] * 3, [[6], [6], [6]])
    assert out.token_ids[0] not in (2, 3)
    assert out.token_ids[1] == 3
    assert out.token_ids[2] == 2


def sample_rows(sampler, rows, order):
    """Sample the given (logits, params, outputs) rows in `order`; results by original index."""
    logits = torch.stack([rows[i][0] for i in order])
    out = sampler(logits, [rows[i][1] for i in order], [[1]] * len(order), [rows[i][2] for i in order])
    return {i: t for i, t in zip(order, out.token_ids)}


def test_seeded_rows_do_not_depend_on_batch_order_or_neighbours():
    logits = random_logits(4, seed=3) / 3
    rows = [
        (logits[0], SamplingParams(temperature=1.0, seed=7), [3, 4]),
        (logits[1], SamplingParams(temperature=0.7, top_k=10, seed=11), []),
        (logits[2], SamplingParams(temperature=1.0), []),
        (logits[3], SamplingParams(temperature=1.2, top_p=0.9, seed=7), [5]),
    ]
    first = sample_rows(Sampler(seed=0), rows, [0, 1, 2, 3])
    second = sample_rows(Sampler(seed=5), rows, [3, 1, 0])
    alone = sample_rows(Sampler(seed=9), rows, [1])
    assert first[0] == second[0] and first[1] == second[1] == alone[1] and first[3] == second[3]


def test_seeded_draws_differ_per_token_index():
    assert len({token_seed(7, i) for i in range(100)}) == 100
    logits = torch.zeros(1, VOCAB)
    params = [SamplingParams(temperature=1.0, seed=7)]
    tokens = {Sampler()(logits, params, [[1]], [[0] * i]).token_ids[0] for i in range(40)}
    assert len(tokens) > 10


@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_temperature_sampling_follows_softmax(temperature):
    """Chi-square goodness of fit of 8000 draws over 8 tokens; critical value 24.32 is p = 0.001 at 7 df."""
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3, 1.5])
    draws = 8000
    logits = row.expand(draws, -1).clone()
    out = Sampler(seed=123)(logits, [SamplingParams(temperature=temperature)] * draws, [[]] * draws, [[]] * draws)
    observed = torch.bincount(torch.tensor(out.token_ids), minlength=8).double()
    expected = (row.double() / temperature).softmax(0) * draws
    chi_square = float(((observed - expected) ** 2 / expected).sum())
    assert chi_square < 24.32


def test_top_k_sampling_never_leaves_the_top_k():
    row = random_logits(1, seed=4)[0]
    draws = 2000
    out = Sampler()(row.expand(draws, -1).clone(), [SamplingParams(top_k=3)] * draws, [[]] * draws, [[]] * draws)
    assert set(out.token_ids) == direct_top_k(row, 3)


def test_logprobs_sampled_first_then_top_n_of_the_raw_distribution():
    logits = random_logits(3, seed=5)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, repetition_penalty=2.0, logprobs=0, seed=1),
    ]
    out = Sampler()(logits, params, [[1]] * 3, [[2]] * 3)
    raw = logits.log_softmax(-1)
    assert out.logprobs[1] is None
    first = out.logprobs[0]
    assert len(first) == 4 and first[0][0] == out.token_ids[0]
    top = raw[0].topk(3)
    assert [t for t, _ in first[1:]] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor([lp for _, lp in first[1:]]), top.values)
    (only,) = out.logprobs[2]
    assert only[0] == out.token_ids[2]
    assert only[1] == pytest.approx(raw[2, out.token_ids[2]].item(), abs=1e-6)
