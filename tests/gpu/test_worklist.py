"""Length-balanced decode work lists: every (sequence, context position) is covered by
exactly one tile, the tiles fit the list's capacity, and the tile length is the smallest
that fits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from cadence.gpu.worklist import DecodeWorklist, build_worklist, choose_tile_tokens, count_tiles

GRANULARITIES = st.sampled_from([1, 16, 64])


@st.composite
def batches(draw):
    """Context lengths, a capacity of at least one tile per sequence, a granularity and a
    minimum tile length."""
    seq_lens = draw(st.lists(st.integers(1, 3000), min_size=1, max_size=40))
    capacity = len(seq_lens) + draw(st.integers(0, 3 * len(seq_lens) + 8))
    return seq_lens, capacity, draw(GRANULARITIES), draw(st.sampled_from([0, 64, 128, 256]))


def covered(worklist: DecodeWorklist, num_seqs: int) -> list[list[int]]:
    """How many tiles cover each position of each sequence."""
    lengths = [0] * num_seqs
    tiles = []
    for t in range(worklist.capacity):
        seq = int(worklist.tile_seq[t])
        if seq < 0:
            assert t >= worklist.num_tiles, "an unused entry sits among the used ones"
            continue
        begin, end = int(worklist.tile_begin[t]), int(worklist.tile_end[t])
        tiles.append((seq, begin, end))
        lengths[seq] = max(lengths[seq], end)
    counts = [[0] * length for length in lengths]
    for seq, begin, end in tiles:
        for pos in range(begin, end):
            counts[seq][pos] += 1
    return counts


@given(batches())
def test_every_position_is_covered_exactly_once(batch):
    seq_lens, capacity, granularity, min_tokens = batch
    worklist = build_worklist(seq_lens, capacity, granularity, min_tokens)
    counts = covered(worklist, len(seq_lens))
    assert [len(c) for c in counts] == seq_lens
    assert all(n == 1 for c in counts for n in c)
    assert worklist.num_tiles <= capacity


@given(batches())
def test_tiles_are_contiguous_per_sequence_and_no_longer_than_the_tile(batch):
    seq_lens, capacity, granularity, min_tokens = batch
    worklist = build_worklist(seq_lens, capacity, granularity, min_tokens)
    starts = worklist.seq_tile_start.tolist()
    assert starts[0] == 0 and starts[-1] == worklist.num_tiles
    for seq in range(len(seq_lens)):
        owned = worklist.tile_seq[starts[seq]:starts[seq + 1]].tolist()
        assert owned and set(owned) == {seq}
    used = slice(0, worklist.num_tiles)
    lengths = worklist.tile_end[used] - worklist.tile_begin[used]
    assert int(lengths.min()) >= 1 and int(lengths.max()) <= worklist.tile_tokens
    assert worklist.tile_tokens % granularity == 0


@given(batches())
def test_the_tile_length_is_the_smallest_that_fits(batch):
    """Balance: one granule shorter would need more tiles than the capacity (or break the
    minimum tile length), so no long context holds more than it must."""
    seq_lens, capacity, granularity, min_tokens = batch
    tile = choose_tile_tokens(seq_lens, capacity, granularity, min_tokens)
    assert count_tiles(seq_lens, tile) <= capacity
    shorter = tile - granularity
    if shorter >= max(1, min_tokens):
        assert count_tiles(seq_lens, shorter) > capacity


def test_long_contexts_get_more_tiles_than_short_ones():
    worklist = build_worklist([100, 1000, 200, 2000], capacity=8, granularity=64)
    per_seq = (worklist.seq_tile_start[1:] - worklist.seq_tile_start[:-1]).tolist()
    assert per_seq[1] > per_seq[0] and per_seq[3] > per_seq[1]
    assert sum(per_seq) <= 8


def test_rebuilding_into_the_same_buffers_keeps_their_addresses():
    """A captured graph reads fixed addresses: `out` is written in place, stale entries
    from a longer earlier list are cleared."""
    first = build_worklist([4000, 4000, 4000], capacity=12, granularity=16)
    pointers = [t.data_ptr() for t in (first.tile_seq, first.tile_begin, first.tile_end,
                                       first.seq_tile_start)]
    second = build_worklist([10, 20], capacity=12, granularity=16, out=first)
    assert [t.data_ptr() for t in (second.tile_seq, second.tile_begin, second.tile_end,
                                   second.seq_tile_start)] == pointers
    assert second.num_tiles == 2
    assert second.tile_seq[2:].eq(-1).all()
    assert second.seq_tile_start.tolist() == [0, 1, 2, 2]


@pytest.mark.parametrize("seq_lens,capacity,message", [
    ([10, 20, 30], 2, "capacity 2 is below the 3 sequences"),
    ([0, 5], 4, "at least one token"),
])
def test_impossible_requests_are_refused(seq_lens, capacity, message):
    with pytest.raises(ValueError, match=message):
        build_worklist(seq_lens, capacity, granularity=16)


def test_lists_move_between_devices_with_their_shape():
    worklist = build_worklist([5, 300], capacity=6, granularity=16)
    moved = worklist.to("cpu")
    assert moved.tile_tokens == worklist.tile_tokens and moved.num_tiles == worklist.num_tiles
    assert torch.equal(moved.tile_seq, worklist.tile_seq)
