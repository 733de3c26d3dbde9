"""The Triton paged-attention kernels against a float64 reference.

Without CUDA the kernels run in Triton's CPU interpreter, which this module switches on
before the kernels are first imported; with CUDA the same tests run compiled on the GPU,
and the tests marked `requires_cuda` add larger shapes and bfloat16. The interpreter
cannot multiply bfloat16 tiles (it holds them as raw 16-bit integers), so bfloat16
attention is checked on the GPU only.
"""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from hypothesis import given, settings, strategies as st

from cadence.gpu import attention
from cadence.gpu.worklist import build_worklist

import triton_modules
from triton_modules import DEVICE, HAS_CUDA

triton_attention = triton_modules.load("triton_attention", "_paged_attention_kernel")
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU; the interpreter "
                                   "runs the other tests on the CPU")
FP32_TOLERANCE = 1e-4
HALF_TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 3e-2}


@attrs.frozen
class Batch:
    """One step's inputs: query, filled caches, metadata and the contexts in float64."""

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: attention.AttentionMetadata
    scale: float
    keys: list[torch.Tensor]  # per sequence, [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]


def make_batch(decodes, prefills, *, block_size, head_dim, num_kv_heads, group,
               dtype=torch.float32, seed=0, spare_blocks=3) -> Batch:
    """Build a batch of decodes then prefill chunks, each given as (num_cached, q_len).

    Blocks are handed out in a random order, unused cache slots hold NaN so that any read
    past a sequence's context shows, and block tables carry padding columns.
    """
    gen = torch.Generator().manual_seed(seed)
    specs = [(cached, 1) for cached in decodes] + list(prefills)
    seq_lens = [cached + q_len for cached, q_len in specs]
    blocks_per_seq = [math.ceil(length / block_size) for length in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.zeros(len(specs), max(blocks_per_seq) + 1, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    keys, values, next_block = [], [], 0
    for seq, length in enumerate(seq_lens):
        blocks = order[next_block:next_block + blocks_per_seq[seq]]
        next_block += blocks_per_seq[seq]
        tables[seq, :len(blocks)] = blocks
        key = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
        value = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
        slots = _slots(tables[seq], length, block_size)
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = key
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = value
        keys.append(key.double())
        values.append(value.double())
    q_lens = [q_len for _, q_len in specs]
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    new_slots = torch.cat([_slots(tables[seq], length, block_size)[length - q_len:]
                           for seq, (length, q_len) in enumerate(zip(seq_lens, q_lens))])
    starts = torch.tensor([0] + q_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    meta = attention.AttentionMetadata(
        slot_mapping=new_slots.to(DEVICE), query_start_loc=starts.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE), max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), num_decode_seqs=len(decodes))
    return Batch(query.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), meta,
                 head_dim ** -0.5, keys, values)


def _slots(table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions 0..length-1 of a sequence with this block table."""
    positions = torch.arange(length)
    return table.long()[positions // block_size] * block_size + positions % block_size


def reference_attention(query, k_cache, v_cache, meta, scale) -> torch.Tensor:
    """Float64 causal attention, gathering each sequence's context through its table."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    block_size = k_cache.shape[1]
    group = query.shape[1] // num_kv_heads
    flat_k = k_cache.double().cpu().reshape(-1, num_kv_heads, head_dim)
    flat_v = v_cache.double().cpu().reshape(-1, num_kv_heads, head_dim)
    starts = meta.query_start_loc.cpu().tolist()
    out = torch.empty(query.shape, dtype=torch.float64)
    for seq, length in enumerate(meta.seq_lens.cpu().tolist()):
        slots = _slots(meta.block_tables[seq].cpu(), length, block_size)
        q = query[starts[seq]:starts[seq + 1]].double().cpu().transpose(0, 1)
        k = flat_k[slots].repeat_interleave(group, 1).transpose(0, 1)
        v = flat_v[slots].repeat_interleave(group, 1).transpose(0, 1)
        q_len = q.shape[1]
        positions = torch.arange(length - q_len, length)
        visible = torch.arange(length)[None, :] <= positions[:, None]
        out[starts[seq]:starts[seq + 1]] = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=visible, scale=scale).transpose(0, 1)
    return out


def run_attention(batch: Batch, **kwargs) -> torch.Tensor:
    """Run the kernel into a NaN-poisoned buffer and check every element was written."""
    out = torch.full_like(batch.query, float("nan"))
    result = triton_attention.paged_attention(batch.query, batch.k_cache, batch.v_cache,
                                              batch.meta, batch.scale, out=out, **kwargs)
    assert result is out
    assert not out.isnan().any(), "some outputs were never written"
    return out


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute error over each token-head row, relative to the row's largest value."""
    diff = (actual.double().cpu() - expected).abs().amax(-1)
    return (diff / expected.abs().amax(-1)).max().item()


def check_batch(batch: Batch, tolerance: float = FP32_TOLERANCE, **kwargs) -> None:
    """Assert the kernel's output for the batch is within tolerance of the reference."""
    out = run_attention(batch, **kwargs)
    expected = reference_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta,
                                   batch.scale)
    assert relative_error(out, expected) < tolerance


# Each case: decodes as cached lengths, prefills as (num_cached, q_len).
SHAPES = [
    pytest.param(16, 64, 2, 1, [0, 5, 16, 33], [], id="decodes-only"),
    pytest.param(16, 64, 1, 2, [], [(0, 21)], id="one-prompt"),
    pytest.param(16, 64, 2, 2, [], [(0, 40), (16, 9), (31, 1)], id="prefill-chunks"),
    pytest.param(16, 128, 8, 1, [47, 15], [(0, 17), (20, 33)], id="mixed-gqa8-d128"),
    pytest.param(32, 64, 8, 2, [63, 64, 1], [(31, 2), (32, 40)], id="mixed-bs32-gqa8"),
    pytest.param(32, 128, 1, 2, [95], [(0, 65), (7, 16)], id="mixed-bs32-d128"),
    pytest.param(16, 64, 2, 1, [70], [(5, 70)], id="tiles-past-64"),
]


@pytest.mark.parametrize("block_size,head_dim,group,num_kv_heads,decodes,prefills", SHAPES)
def test_matches_reference(block_size, head_dim, group, num_kv_heads, decodes, prefills):
    batch = make_batch(decodes, prefills, block_size=block_size, head_dim=head_dim,
                       num_kv_heads=num_kv_heads, group=group)
    check_batch(batch)


@pytest.mark.parametrize("num_kv_splits", [2, 3, 5])
def test_split_decodes_merge_to_the_reference(num_kv_splits):
    """Some sequences are shorter than one split, so trailing splits see no context."""
    batch = make_batch([0, 3, 40, 130], [(10, 6)], block_size=16, head_dim=64,
                       num_kv_heads=2, group=2)
    check_batch(batch, num_kv_splits=num_kv_splits)


def balanced(batch: Batch, capacity: int, granularity: int = 16, min_tile_tokens: int = 16,
             spare_seqs: int = 0):
    """A work list over the batch's decodes; `spare_seqs` widens it as a graph's would."""
    decode_lens = batch.meta.seq_lens[:batch.meta.num_decode_seqs].cpu().tolist()
    worklist = build_worklist(decode_lens, capacity, granularity, min_tile_tokens)
    if spare_seqs:
        wide = torch.full((len(decode_lens) + 1 + spare_seqs,), worklist.num_tiles,
                          dtype=torch.int32)
        wide[:len(decode_lens) + 1] = worklist.seq_tile_start
        worklist = attrs.evolve(worklist, seq_tile_start=wide)
    return worklist.to(DEVICE)


@pytest.mark.parametrize("capacity", [4, 7, 12, 40])
def test_balanced_decodes_merge_to_the_reference(capacity):
    """Mixed context lengths cut into equal tiles (long ones into many, short ones into
    one), unused list entries past the tiles, and prefills after the decodes."""
    batch = make_batch([0, 3, 40, 130, 300], [(10, 6)], block_size=16, head_dim=64,
                       num_kv_heads=2, group=2)
    if capacity < batch.meta.num_decode_seqs:
        capacity = batch.meta.num_decode_seqs
    check_batch(batch, worklist=balanced(batch, capacity))


def test_balanced_decodes_with_many_tiles_per_sequence_and_gqa():
    """More tiles for one sequence than the merge reads at once, grouped query heads."""
    batch = make_batch([600, 5], [], block_size=16, head_dim=64, num_kv_heads=2, group=8)
    worklist = balanced(batch, capacity=triton_attention.MERGE_TILES_PAD + 10)
    assert worklist.max_tiles_per_seq > triton_attention.MERGE_TILES_PAD
    check_batch(batch, worklist=worklist)


def test_balanced_decodes_accept_a_wider_list_than_the_batch():
    batch = make_batch([20, 70], [], block_size=16, head_dim=64, num_kv_heads=1, group=2)
    check_batch(batch, worklist=balanced(batch, capacity=9, spare_seqs=3))


def test_a_work_list_shorter_than_the_batch_is_refused():
    batch = make_batch([20, 70, 9], [], block_size=16, head_dim=64, num_kv_heads=1, group=2)
    worklist = build_worklist([20, 70], 4, 16).to(DEVICE)
    with pytest.raises(ValueError, match="covers 2 sequences, the batch has 3 decodes"):
        run_attention(batch, worklist=worklist)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 32), (128, 128)])
def test_other_tile_shapes_match_reference(block_m, block_n):
    """Context tiles smaller and larger than a cache block, and splits of one tile each."""
    config = triton_attention.KernelConfig(block_m=block_m, block_n=block_n)
    batch = make_batch([150, 31, 0], [(33, 40), (0, 7)], block_size=32, head_dim=64,
                       num_kv_heads=2, group=2)
    check_batch(batch, num_kv_splits=6, decode_config=config, prefill_config=config)


def test_float16_matches_reference():
    batch = make_batch([12, 50], [(17, 20)], block_size=16, head_dim=64, num_kv_heads=2,
                       group=2, dtype=torch.float16)
    check_batch(batch, tolerance=HALF_TOLERANCE[torch.float16])


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_any_mixed_batch_matches_reference(data):
    """Invariant: every query token's output equals float64 causal attention over its context."""
    block_size = data.draw(st.sampled_from([16, 32]), label="block_size")
    group = data.draw(st.sampled_from([1, 2, 8]), label="group")
    num_kv_heads = data.draw(st.sampled_from([1, 2]), label="num_kv_heads")
    decodes = data.draw(st.lists(st.integers(0, 80), max_size=3), label="decodes")
    prefills = data.draw(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 40)),
                                  min_size=0 if decodes else 1, max_size=2), label="prefills")
    splits = data.draw(st.sampled_from([None, 2, 3]), label="num_kv_splits")
    batch = make_batch(decodes, prefills, block_size=block_size, head_dim=64,
                       num_kv_heads=num_kv_heads, group=group,
                       seed=data.draw(st.integers(0, 2**16), label="seed"))
    check_batch(batch, num_kv_splits=splits)


def test_matches_the_torch_reference_backend():
    reference = getattr(attention, "reference_paged_attention", None)
    if reference is None:
        pytest.skip("cadence.gpu.attention.reference_paged_attention is not written yet")
    batch = make_batch([9, 33], [(16, 20)], block_size=16, head_dim=64, num_kv_heads=2,
                       group=2)
    out = run_attention(batch)
    expected = reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert relative_error(out, expected.double().cpu()) < FP32_TOLERANCE


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv_fills_exactly_the_mapped_slots(dtype):
    num_blocks, block_size, num_kv_heads, head_dim = 5, 16, 2, 64
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:23]
    slots[4] = -1  # a padding token, which must leave the cache alone
    # Keys and values as views of one fused projection, as a model produces them.
    fused = torch.randn(len(slots), 3, num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = fused[:, 1], fused[:, 2]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    real = slots >= 0
    expected_k.view(-1, num_kv_heads, head_dim)[slots[real]] = key[real]
    expected_v.view(-1, num_kv_heads, head_dim)[slots[real]] = value[real]

    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    triton_attention.write_kv(k_cache, v_cache, key.to(DEVICE), value.to(DEVICE),
                              slots.to(DEVICE))
    torch.testing.assert_close(k_cache.cpu(), expected_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache.cpu(), expected_v, rtol=0, atol=0, equal_nan=True)


def test_write_kv_then_attend_is_attention_over_the_new_tokens():
    batch = make_batch([20], [(5, 12)], block_size=16, head_dim=64, num_kv_heads=2, group=2)
    new_slots = batch.meta.slot_mapping
    flat_k = batch.k_cache.view(-1, *batch.k_cache.shape[2:])
    flat_v = batch.v_cache.view(-1, *batch.v_cache.shape[2:])
    new_k, new_v = flat_k[new_slots].clone(), flat_v[new_slots].clone()
    flat_k[new_slots] = float("nan")
    flat_v[new_slots] = float("nan")
    triton_attention.write_kv(batch.k_cache, batch.v_cache, new_k, new_v, new_slots)
    check_batch(batch)


def test_mismatched_heads_are_rejected():
    batch = make_batch([3], [], block_size=16, head_dim=64, num_kv_heads=2, group=2)
    with pytest.raises(ValueError, match="cannot share"):
        triton_attention.paged_attention(batch.query[:, :3], batch.k_cache, batch.v_cache,
                                         batch.meta, batch.scale)


def test_mismatched_dtypes_are_rejected():
    batch = make_batch([3], [], block_size=16, head_dim=64, num_kv_heads=2, group=2)
    with pytest.raises(ValueError, match="cache is"):
        triton_attention.paged_attention(batch.query.half(), batch.k_cache, batch.v_cache,
                                         batch.meta, batch.scale)


# --------------------------------------------------------------------------- GPU only


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_size,head_dim,group", [(16, 128, 2), (32, 64, 8), (16, 64, 1)])
def test_gpu_large_mixed_batch(dtype, block_size, head_dim, group):
    decodes = [int(n) for n in torch.randint(0, 2000, (24,), generator=torch.Generator()
                                             .manual_seed(2))]
    batch = make_batch(decodes, [(0, 300), (700, 129), (1500, 1)], block_size=block_size,
                       head_dim=head_dim, num_kv_heads=4, group=group, dtype=dtype)
    tolerance = HALF_TOLERANCE.get(dtype, FP32_TOLERANCE)
    check_batch(batch, tolerance=tolerance)
    check_batch(batch, tolerance=tolerance, num_kv_splits=4)


@requires_cuda
def test_gpu_default_splits_for_few_long_decodes():
    batch = make_batch([4000, 1, 2500], [], block_size=16, head_dim=128, num_kv_heads=8,
                       group=2, dtype=torch.bfloat16)
    check_batch(batch, tolerance=HALF_TOLERANCE[torch.bfloat16])
