"""The structured-output token mask in the sampler: a bitmask of allowed tokens applied
to the logits before everything else, on the CPU and (the twin below) on a GPU."""

from __future__ import annotations

import pytest
import torch

from cadence.gpu.sampler import Sampler, apply_token_bitmask
from cadence.statemachine.sampling import SamplingParams

# Not a multiple of 32, so the last word of each row is partly past the vocabulary.
VOCAB = 70
EOS = 69
NUM_DRAWS = 200
NEG_INF = float("-inf")


def bitmask_of(rows: list[set[int]], vocab: int = VOCAB) -> torch.Tensor:
    """The int32 bitmask allowing exactly `rows[i]` in row i, written bit by bit."""
    words = torch.zeros(len(rows), -(-vocab // 32), dtype=torch.int64)
    for i, allowed in enumerate(rows):
        for token in allowed:
            words[i, token // 32] |= 1 << (token % 32)
    # Bit 31 set makes the int32 negative: wrap the int64 words into int32's range.
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def random_rows(num_rows: int, seed: int) -> list[set[int]]:
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_rows):
        keep = torch.rand(VOCAB, generator=generator) < 0.2
        keep[31] = keep[63] = True  # the sign bit of each full word
        rows.append(set(torch.nonzero(keep).flatten().tolist()))
    return rows


def _check_bitmask_on(device: str) -> None:
    rows = random_rows(4, seed=1)
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2)).to(device)
    masked = apply_token_bitmask(logits, bitmask_of(rows).to(device)).cpu()
    for i, allowed in enumerate(rows):
        assert set(torch.nonzero(masked[i] > NEG_INF).flatten().tolist()) == allowed
        assert torch.equal(masked[i, sorted(allowed)], logits.cpu()[i, sorted(allowed)])


def _check_draws_on(device: str) -> None:
    """Greedy and sampled rows, with filters and penalties, pick only allowed tokens."""
    rows = random_rows(4, seed=3)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5),
              SamplingParams(temperature=1.0, top_k=5, top_p=0.9),
              SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5)]
    sampler = Sampler([EOS], seed=0, device=device)
    bitmask = bitmask_of(rows)
    generator = torch.Generator().manual_seed(4)
    for _ in range(NUM_DRAWS // 10):
        logits = (torch.randn(4, VOCAB, generator=generator) * 4).to(device)
        out = sampler(logits, params, [[1, 2, 3]] * 4, [[4, 5]] * 4, bitmask)
        for token, allowed in zip(out.token_ids, rows):
            assert token in allowed
        greedy = max(rows[0], key=lambda t: logits[0, t].item())
        assert out.token_ids[0] == greedy


def test_the_bitmask_keeps_exactly_the_allowed_tokens_and_their_logits():
    _check_bitmask_on("cpu")


def test_every_kind_of_row_draws_only_allowed_tokens():
    _check_draws_on("cpu")


def test_rows_without_a_constraint_are_untouched():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=0.0)] * 2
    free = torch.full((2, -(-VOCAB // 32)), -1, dtype=torch.int32)
    out = Sampler([EOS])(logits, params, [[1]] * 2, [[]] * 2, free)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_a_complete_grammar_ends_even_before_min_tokens():
    """The grammar allows only EOS, min_tokens masks EOS: the grammar wins, the row
    is not left without a token. A row without the conflict keeps min_tokens' mask."""
    logits = torch.zeros(2, VOCAB)
    logits[:, EOS] = -5.0
    params = [SamplingParams(temperature=1.0, min_tokens=4)] * 2
    bitmask = bitmask_of([{EOS}, {EOS, 7}])
    for _ in range(NUM_DRAWS // 10):
        out = Sampler([EOS])(logits, params, [[1]] * 2, [[2]] * 2, bitmask)
        assert out.token_ids == [EOS, 7]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; the CPU twins above run everywhere")
def test_the_bitmask_on_the_gpu_matches_the_cpu():
    _check_bitmask_on("cuda")
    _check_draws_on("cuda")
