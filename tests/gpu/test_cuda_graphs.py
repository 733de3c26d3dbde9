"""The decode fast path: batch-size ladder, one-copy staging, padded decode steps, greedy shortcut.

On a CPU the padded decode batches run eagerly (`pad_decode_batches=True`), the
twin of the CUDA-graph path: same static buffers, same padding rows, so tokens,
logprobs and the cache must match an unpadded runner. The tests marked
`requires_cuda` capture and replay real graphs.
"""

from __future__ import annotations

import pytest
import torch

from cadence.gpu import ModelRunner, preset
from cadence.gpu.cuda_graphs import (
    LADDER, StagingBuffer, graph_batch_sizes, padded_batch_size, plan_layout,
)
from cadence.gpu.runner import TokenSlice
from cadence.statemachine.errors import ConfigError
from cadence.statemachine.sampling import SamplingParams

from conftest import random_prompts

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU to capture graphs")
BLOCK_SIZE = 4
NUM_BLOCKS = 64
EOS = 2  # the tiny preset's end-of-sequence token


def tiny_runner(**kwargs) -> ModelRunner:
    options = dict(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, device="cpu", seed=3, max_num_seqs=8)
    return ModelRunner(preset("tiny"), **{**options, **kwargs})


def drive(plan_driver, runner, prompts, params_of, token_budget=64):
    driver = plan_driver(runner, token_budget=token_budget)
    for i, prompt in enumerate(prompts):
        driver.add(f"r{i}", prompt, params_of(i))
    outputs = driver.run()
    logprobs = {rid: [entry[0][1] for entry in r.logprobs] for rid, r in driver.requests.items()}
    return outputs, logprobs


def test_ladder_is_sorted_and_ends_at_the_maximum():
    assert graph_batch_sizes(256) == LADDER
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    tall = graph_batch_sizes(300)
    assert tall[-3:] == (256, 288, 300) and list(tall) == sorted(set(tall))
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_padded_size_is_the_smallest_that_fits():
    sizes = graph_batch_sizes(64)
    assert [padded_batch_size(n, sizes) for n in (1, 3, 8, 9, 17, 33, 64)] == [1, 4, 8, 16, 24, 48, 64]
    assert padded_batch_size(65, sizes) is None


def test_staging_round_trip_keeps_values_dtypes_and_grows():
    staging = StagingBuffer(64, "cpu")
    tensors = [torch.arange(5, dtype=torch.int64), torch.tensor([7, -1, 3], dtype=torch.int32),
               torch.arange(12, dtype=torch.int32).view(3, 4), torch.empty(0, dtype=torch.int64),
               torch.tensor([2.5, -1.0])]
    sent = staging.send(tensors)
    assert staging.num_bytes >= 64 * 4
    for original, copy in zip(tensors, sent):
        assert copy.dtype == original.dtype and torch.equal(copy, original)
    slots, total = plan_layout([(t.dtype, tuple(t.shape)) for t in tensors])
    assert all(slot.offset % 64 == 0 for slot in slots) and total % 64 == 0
    assert [s.offset for s in slots] == sorted(s.offset for s in slots)


def test_eager_steps_through_one_staging_copy_match_direct_tensors(plan_driver):
    prompts = random_prompts([5, 9, 2, 14], seed=11, vocab_size=512)

    def params_of(i):
        return SamplingParams(temperature=0.0, max_tokens=3 + i, logprobs=1, ignore_eos=True)

    expected = drive(plan_driver, tiny_runner(), prompts, params_of, token_budget=7)
    staged = tiny_runner()
    # On CUDA every eager step crosses in one copy through this buffer; here it is a CPU twin.
    staged._staging = StagingBuffer(64, "cpu")
    assert drive(plan_driver, staged, prompts, params_of, token_budget=7) == expected
    assert staged._staging.num_bytes > 64, "the buffer should have grown to fit a step"


def test_token_slice_reads_like_a_list_slice():
    tokens = list(range(10, 20))
    view = TokenSlice(tokens, 3, 8)
    assert len(view) == 5 and list(view) == tokens[3:8]
    assert view[0] == 13 and view[-1] == 17 and view[1:3] == [14, 15]
    with pytest.raises(IndexError):
        view[5]
    tokens.append(99)  # a window, not a copy, but bounded by its stop
    assert list(view) == [13, 14, 15, 16, 17]


def test_padding_rows_point_at_the_scratch_block(plan_driver):
    runner = tiny_runner(pad_decode_batches=True)
    graphs = runner.decode_graphs
    assert graphs is not None and not graphs.captured and runner.scratch_block == NUM_BLOCKS
    assert runner.kv_caches[0][0].shape[0] == NUM_BLOCKS + 1
    seen = []
    real_run = graphs.run

    def spy(padded_size, max_seq_len):
        seen.append((padded_size, graphs.host_rows(padded_size)))
        return real_run(padded_size, max_seq_len)

    graphs.run = spy
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    drive(plan_driver, runner, random_prompts([5, 9, 2], seed=4, vocab_size=512), lambda i: params)
    assert seen, "no decode step took the padded path"
    padded, rows = seen[0]
    assert padded == 4
    pad = slice(3, 4)
    assert rows.input_ids[pad].tolist() == [0] and rows.positions[pad].tolist() == [0]
    assert rows.slot_mapping[pad].tolist() == [NUM_BLOCKS * BLOCK_SIZE]
    assert rows.seq_lens[pad].tolist() == [1] and rows.block_tables[pad, 0].tolist() == [NUM_BLOCKS]
    # Real rows: the last token of each request at its position, through its own blocks.
    assert rows.seq_lens[:3].tolist() == [6, 10, 3]
    assert (rows.slot_mapping[:3] // BLOCK_SIZE < NUM_BLOCKS).all()


def test_padded_decode_matches_unpadded_tokens_logprobs_and_cache(plan_driver):
    prompts = random_prompts([5, 9, 2, 14, 7, 3], seed=5, vocab_size=512)

    def params_of(i):
        return SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, logprobs=1, ignore_eos=True)

    plain = tiny_runner()
    padded = tiny_runner(pad_decode_batches=True)
    calls = []
    real_run = padded.decode_graphs.run
    padded.decode_graphs.run = lambda size, max_len: calls.append(size) or real_run(size, max_len)
    expected, expected_logprobs = drive(plan_driver, plain, prompts, params_of)
    got, got_logprobs = drive(plan_driver, padded, prompts, params_of)
    assert got == expected
    for rid, values in expected_logprobs.items():
        torch.testing.assert_close(torch.tensor(got_logprobs[rid]), torch.tensor(values), atol=1e-5, rtol=0)
    # Batches shrink from 6 to 1 as requests finish: several padded sizes were used.
    assert {8, 4, 2, 1} <= set(calls)
    for (k_plain, v_plain), (k_pad, v_pad) in zip(plain.kv_caches, padded.kv_caches):
        torch.testing.assert_close(k_pad[:NUM_BLOCKS], k_plain[:NUM_BLOCKS], atol=1e-5, rtol=0)
        torch.testing.assert_close(v_pad[:NUM_BLOCKS], v_plain[:NUM_BLOCKS], atol=1e-5, rtol=0)
    assert k_pad[NUM_BLOCKS].abs().sum() > 0, "padding rows should have written the scratch block"


def test_batches_above_the_ladder_run_unpadded(plan_driver):
    runner = tiny_runner(pad_decode_batches=True, max_num_seqs=2)
    calls = []
    real_run = runner.decode_graphs.run
    runner.decode_graphs.run = lambda size, max_len: calls.append(size) or real_run(size, max_len)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outputs, _ = drive(plan_driver, runner, random_prompts([4, 6, 3], seed=6, vocab_size=512), lambda i: params)
    assert all(len(tokens) == 3 for tokens in outputs.values())
    assert calls == [], "three decodes exceed the ladder's top of 2"


def test_greedy_shortcut_still_masks_stop_tokens_before_min_tokens(plan_driver):
    runner = tiny_runner()
    unbiased = runner.model.compute_logits

    def favour_eos(hidden):
        logits = unbiased(hidden)
        logits[:, EOS] += 1e4
        return logits

    runner.model.compute_logits = favour_eos
    prompts = random_prompts([5, 5, 5], seed=7, vocab_size=512)
    params = {
        0: SamplingParams(temperature=0.0, max_tokens=4, min_tokens=2, ignore_eos=False),
        1: SamplingParams(temperature=0.0, max_tokens=4, min_tokens=2, ignore_eos=True),
        2: SamplingParams(temperature=0.0, max_tokens=4, min_tokens=2, stop_token_ids=[EOS], ignore_eos=True),
    }
    outputs, _ = drive(plan_driver, runner, prompts, params.__getitem__)
    assert outputs["r0"][:2] != [EOS, EOS] and EOS not in outputs["r0"][:2] and outputs["r0"][2:] == [EOS, EOS]
    assert outputs["r1"] == [EOS] * 4  # ignore_eos: nothing to mask
    assert EOS not in outputs["r2"][:2] and outputs["r2"][2:] == [EOS, EOS]


def test_greedy_tokens_agree_with_and_without_the_sampler(plan_driver):
    prompts = random_prompts([6, 11, 3], seed=8, vocab_size=512)
    plain, _ = drive(plan_driver, tiny_runner(), prompts,
                     lambda i: SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    full, _ = drive(plan_driver, tiny_runner(), prompts,
                    lambda i: SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0))
    assert plain == full


def test_cuda_graph_configuration_errors():
    with pytest.raises(ConfigError, match="use_cuda_graphs needs a CUDA device"):
        tiny_runner(use_cuda_graphs=True)
    assert tiny_runner().decode_graphs is None and not tiny_runner().use_cuda_graphs
    with pytest.raises(ConfigError, match="max_model_len must be in"):
        tiny_runner(max_model_len=10**6)
    assert tiny_runner(max_model_len=64).max_model_len == 64


# --------------------------------------------------------------------------- on a GPU


@requires_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_matches_eager_decode(dtype, hf_checkpoint, plan_driver):
    directory, _ = hf_checkpoint("qwen3")
    options = dict(num_blocks=256, block_size=16, device="cuda", dtype=dtype, attention_backend="triton",
                   max_num_seqs=16)
    graphs = ModelRunner.from_pretrained(directory, **options)
    eager = ModelRunner.from_pretrained(directory, use_cuda_graphs=False, **options)
    assert graphs.decode_graphs.captured and eager.decode_graphs is None
    prompts = random_prompts([3, 17, 40, 9, 64, 1, 25, 33, 12, 5], seed=9)

    def params_of(i):
        return SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, logprobs=1, ignore_eos=True)

    expected, expected_logprobs = drive(plan_driver, eager, prompts, params_of, token_budget=256)
    got, got_logprobs = drive(plan_driver, graphs, prompts, params_of, token_budget=256)
    atol = 1e-3 if dtype == "float32" else 0.1
    for rid, tokens in expected.items():
        # Compare up to the first disagreement: one flip of a near tie changes everything after it.
        same = next((i for i, (a, b) in enumerate(zip(tokens, got[rid])) if a != b), len(tokens))
        if dtype == "float32":
            assert same == len(tokens), rid
        torch.testing.assert_close(torch.tensor(got_logprobs[rid][: same + 1]),
                                   torch.tensor(expected_logprobs[rid][: same + 1]), atol=atol, rtol=0)


@requires_cuda
def test_one_step_graph_logits_equal_eager_logits(hf_checkpoint, plan_driver):
    directory, _ = hf_checkpoint("qwen3")
    runner = ModelRunner.from_pretrained(directory, num_blocks=128, block_size=16, device="cuda",
                                         dtype="float32", attention_backend="triton", max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    drive(plan_driver, runner, random_prompts([7, 30, 2], seed=10), lambda i: params)
    graphs = runner.decode_graphs
    # Re-run the last prepared step both ways: the K/V it writes are the same values.
    size = 4
    with torch.inference_mode():
        replayed = graphs.run(size, graphs.context_capacity).clone()
        eager = graphs._forward(size, graphs.context_capacity)
    torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=0)
