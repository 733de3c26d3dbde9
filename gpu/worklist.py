"""Length-balanced work lists for decode attention.

A decode batch mixes short and long contexts. One program per sequence leaves the
multiprocessors that drew short contexts idle while the long ones finish; a fixed
split count per sequence splits the short ones for nothing. A work list instead cuts
every context into tiles of one length `tile_tokens`, the smallest multiple of the
kernel's inner step for which the tiles fit the list's capacity: a long context gets
many tiles, a short one a single tile, and every program reads about the same bytes.

The list is built on the host with the step's plan (the runner knows each context
length without a device sync) and lives in fixed-size buffers, so a CUDA graph can
take it as an input: unused entries carry `tile_seq = -1` and their programs return
at once. Tiles of one sequence are contiguous, so the merge reads them as a range.
"""

from __future__ import annotations

import math
from typing import Sequence

import attrs
import numpy as np
import torch

__all__ = ["BalanceConfig", "DecodeWorklist", "choose_tile_tokens", "build_worklist", "count_tiles"]

# Tiles shorter than this cost more in partial results and merging than they gain.
DEFAULT_MIN_TILE_TOKENS = 128
# Capacity of a list, in tiles per sequence of the batch it serves.
DEFAULT_TILES_PER_SEQ = 2


@attrs.frozen
class BalanceConfig:
    """How a decode batch is cut into tiles.

    tiles_per_seq: list capacity per sequence of the (padded) batch; more tiles balance
      finer but add partial results to merge.
    granularity: tile lengths are multiples of this (the kernel's inner step).
    min_tile_tokens: no tile is cut shorter than this (rounded up to the granularity).
    """

    tiles_per_seq: int = attrs.field(default=DEFAULT_TILES_PER_SEQ, validator=attrs.validators.ge(1))
    granularity: int = attrs.field(default=64, validator=attrs.validators.ge(1))
    min_tile_tokens: int = attrs.field(default=DEFAULT_MIN_TILE_TOKENS, validator=attrs.validators.ge(0))

    def capacity(self, num_seqs: int) -> int:
        """List entries for a batch of `num_seqs` sequences."""
        return self.tiles_per_seq * num_seqs


@attrs.frozen(eq=False)
class DecodeWorklist:
    """A decode batch's tiles, in buffers of fixed capacity.

    tile_seq, tile_begin, tile_end: [capacity] int32; tile t covers context positions
      [tile_begin[t], tile_end[t]) of sequence tile_seq[t]; unused entries have
      tile_seq = -1 (and an empty range).
    seq_tile_start: [num_seqs + 1] int32; sequence s owns tiles
      [seq_tile_start[s], seq_tile_start[s + 1]).
    tile_tokens: the tile length chosen (host int); num_tiles: entries in use.
    """

    tile_seq: torch.Tensor
    tile_begin: torch.Tensor
    tile_end: torch.Tensor
    seq_tile_start: torch.Tensor
    tile_tokens: int
    num_tiles: int

    @property
    def capacity(self) -> int:
        """Entries in the buffers (programs the attention launch starts)."""
        return self.tile_seq.shape[0]

    @property
    def max_tiles_per_seq(self) -> int:
        """The most tiles any sequence has (bounds the merge's inner loop)."""
        counts = self.seq_tile_start[1:] - self.seq_tile_start[:-1]
        return int(counts.max()) if counts.numel() else 0

    def to(self, device: torch.device | str, non_blocking: bool = False) -> DecodeWorklist:
        """The same list with its tensors on `device`."""
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return attrs.evolve(self, tile_seq=move(self.tile_seq), tile_begin=move(self.tile_begin),
                            tile_end=move(self.tile_end), seq_tile_start=move(self.seq_tile_start))


def count_tiles(seq_lens: Sequence[int] | np.ndarray, tile_tokens: int) -> int:
    """Tiles a batch needs when every context is cut into pieces of `tile_tokens`."""
    lengths = np.asarray(seq_lens, dtype=np.int64)
    return int(((lengths + (tile_tokens - 1)) // tile_tokens).sum())


def choose_tile_tokens(seq_lens: Sequence[int] | np.ndarray, capacity: int, granularity: int,
                       min_tile_tokens: int = DEFAULT_MIN_TILE_TOKENS) -> int:
    """The smallest tile length (a multiple of `granularity`, at least `min_tile_tokens`
    rounded up to it) whose tiles fit `capacity`.

    Every context must be >= 1 token and `capacity` >= the number of sequences (one tile
    each always fits, at a tile as long as the longest context).
    """
    if granularity < 1:
        raise ValueError(f"granularity must be >= 1, got {granularity}")
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    num_seqs = seq_lens.shape[0]
    if capacity < num_seqs:
        raise ValueError(f"capacity {capacity} is below the {num_seqs} sequences of the batch")
    if num_seqs == 0:
        return max(granularity, _round_up(min_tile_tokens, granularity))
    if int(seq_lens.min()) < 1:
        raise ValueError(f"every context needs at least one token, got {int(seq_lens.min())}")
    lo = max(1, math.ceil(min_tile_tokens / granularity))
    hi = max(lo, math.ceil(int(seq_lens.max()) / granularity))  # one tile a sequence: fits
    total = int(seq_lens.sum())
    # A tile count is at least total / T, so no T below total / capacity fits; and at most
    # total / T + num_seqs, so every T from total / (capacity - num_seqs) on fits.
    lo = max(lo, min(hi, math.ceil(total / (capacity * granularity))))
    if capacity > num_seqs:
        hi = max(lo, min(hi, math.ceil(total / ((capacity - num_seqs) * granularity))))
    while lo < hi:
        mid = (lo + hi) // 2
        if count_tiles(seq_lens, mid * granularity) <= capacity:
            hi = mid
        else:
            lo = mid + 1
    return lo * granularity


def build_worklist(seq_lens: Sequence[int], capacity: int, granularity: int,
                   min_tile_tokens: int = DEFAULT_MIN_TILE_TOKENS, *,
                   out: DecodeWorklist | None = None) -> DecodeWorklist:
    """Cut each context into tiles of one chosen length and lay them out in order.

    out: a list whose buffers (host tensors, e.g. pinned) are written in place, so a
    captured graph keeps reading the same addresses; its capacity is used and its
    `seq_tile_start` must have room for the batch. Returns the list (a new one when
    `out` is None).
    """
    lengths = np.asarray(seq_lens, dtype=np.int64)
    num_seqs = lengths.shape[0]
    if out is not None:
        capacity = out.capacity
        if out.seq_tile_start.shape[0] < num_seqs + 1:
            raise ValueError(f"out holds {out.seq_tile_start.shape[0] - 1} sequences, "
                             f"the batch has {num_seqs}")
    tile_tokens = choose_tile_tokens(lengths, capacity, granularity, min_tile_tokens)
    counts = (lengths + (tile_tokens - 1)) // tile_tokens
    starts = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    num_tiles = int(starts[-1])
    tile_seq = np.repeat(np.arange(num_seqs, dtype=np.int64), counts)
    tile_begin = (np.arange(num_tiles, dtype=np.int64) - starts[tile_seq]) * tile_tokens
    tile_end = np.minimum(tile_begin + tile_tokens, lengths[tile_seq])
    if out is None:
        out = DecodeWorklist(
            tile_seq=torch.empty(capacity, dtype=torch.int32),
            tile_begin=torch.empty(capacity, dtype=torch.int32),
            tile_end=torch.empty(capacity, dtype=torch.int32),
            seq_tile_start=torch.empty(num_seqs + 1, dtype=torch.int32),
            tile_tokens=tile_tokens, num_tiles=num_tiles)
    else:
        out = attrs.evolve(out, tile_tokens=tile_tokens, num_tiles=num_tiles)
    _write(out.tile_seq, tile_seq, -1)
    _write(out.tile_begin, tile_begin, 0)
    _write(out.tile_end, tile_end, 0)
    _write(out.seq_tile_start, starts, num_tiles)
    return out


def _write(buffer: torch.Tensor, values: np.ndarray, fill: int) -> None:
    """Write `values` at the start of `buffer` and `fill` after them."""
    count = values.shape[0]
    buffer[:count].copy_(torch.from_numpy(values))
    buffer[count:] = fill


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
