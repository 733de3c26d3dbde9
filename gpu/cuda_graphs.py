"""The decode fast path: one host-to-device copy per step, and CUDA graphs for pure-decode steps.

A step's inputs are a handful of small integer arrays (token ids, positions,
cache slots, context lengths, block tables). `StagingBuffer` lays them out in
one pinned host buffer and moves them to the device in a single non-blocking
copy, instead of one copy (and one synchronisation hazard) per array.

A pure-decode step depends on the batch only through those arrays, so
`DecodeGraphs` captures its forward pass and logits once per batch size of a
ladder and replays the graph with new contents in the same buffers. A batch of
n sequences runs as the smallest captured size P >= n. The P - n padding rows
decode a dummy token with context length 1 whose key and value go to a scratch
block the scheduler never hands out, so they read and write nothing real; their
logits are dropped. Without capture (a CPU, or debugging) the same padded
buffers run through the model eagerly, which is how the CPU tests check the
padding.
"""

from __future__ import annotations

import bisect
import functools
import math
from typing import Sequence

import attrs
import torch

from .attention import AttentionBackend, AttentionMetadata
from .worklist import BalanceConfig, DecodeWorklist, build_worklist

# Alignment of each field in a staging buffer: enough for any dtype view and
# for full-width device loads.
FIELD_ALIGN_BYTES = 64
# Batch sizes captured up to 256: fine steps where a padding row costs most
# (small batches), coarser ones above.
LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)
LADDER_STEP_ABOVE = 32


def graph_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """The captured batch sizes up to `max_batch_size`, which is always included."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = [s for s in LADDER if s < max_batch_size]
    next_size = LADDER[-1] + LADDER_STEP_ABOVE
    while next_size < max_batch_size:
        sizes.append(next_size)
        next_size += LADDER_STEP_ABOVE
    return (*sizes, max_batch_size)


def padded_batch_size(num_seqs: int, batch_sizes: Sequence[int]) -> int | None:
    """The smallest of the sorted `batch_sizes` that holds `num_seqs` rows; None when none does."""
    index = bisect.bisect_left(batch_sizes, num_seqs)
    return batch_sizes[index] if index < len(batch_sizes) else None


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // FIELD_ALIGN_BYTES) * FIELD_ALIGN_BYTES


@attrs.frozen
class FieldSlot:
    """Where one typed array lives in a staging buffer."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        """Bytes the array occupies."""
        return math.prod(self.shape) * _element_size(self.dtype)


def plan_layout(fields: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> tuple[list[FieldSlot], int]:
    """Aligned, consecutive slots for arrays of the given dtypes and shapes, and the bytes they span."""
    slots, offset = [], 0
    for dtype, shape in fields:
        slot = FieldSlot(offset, dtype, tuple(shape))
        slots.append(slot)
        offset = _aligned(offset + slot.num_bytes)
    return slots, offset


def _view(buffer: torch.Tensor, slot: FieldSlot) -> torch.Tensor:
    return buffer[slot.offset : slot.offset + slot.num_bytes].view(slot.dtype).view(slot.shape)


class StagingBuffer:
    """Host bytes (pinned on CUDA) and device bytes of one layout, moved across in one copy.

    The host side may be rewritten only after the previous copy has left it;
    `wait_for_copy` (called by `send` and before any direct host write) ensures that.
    """

    def __init__(self, num_bytes: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._on_gpu = self.device.type == "cuda"
        self._allocate(max(num_bytes, FIELD_ALIGN_BYTES))
        self._copied = torch.cuda.Event() if self._on_gpu else None
        self._copy_pending = False

    def _allocate(self, num_bytes: int) -> None:
        self.host = torch.zeros(num_bytes, dtype=torch.uint8, pin_memory=self._on_gpu)
        self.target = torch.zeros(num_bytes, dtype=torch.uint8, device=self.device)

    @property
    def num_bytes(self) -> int:
        """Capacity in bytes."""
        return self.host.numel()

    def host_view(self, slot: FieldSlot) -> torch.Tensor:
        """The host array at `slot`."""
        return _view(self.host, slot)

    def device_view(self, slot: FieldSlot) -> torch.Tensor:
        """The device array at `slot`."""
        return _view(self.target, slot)

    def wait_for_copy(self) -> None:
        """Block until the last upload has read the host buffer, so it may be rewritten."""
        if self._copy_pending:
            self._copied.synchronize()
            self._copy_pending = False

    def upload(self, num_bytes: int) -> None:
        """Start copying the first `num_bytes` to the device; the host does not wait for it."""
        self.target[:num_bytes].copy_(self.host[:num_bytes], non_blocking=self._on_gpu)
        if self._copied is not None:
            self._copied.record()
            self._copy_pending = True

    def send(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Device copies of host tensors, made by one upload; valid until the next `send`.

        The buffer grows when the tensors do not fit.
        """
        slots, num_bytes = plan_layout([(t.dtype, tuple(t.shape)) for t in tensors])
        self.wait_for_copy()
        if num_bytes > self.num_bytes:
            self._allocate(max(num_bytes, 2 * self.num_bytes))
        for slot, tensor in zip(slots, tensors):
            self.host_view(slot).copy_(tensor)
        self.upload(num_bytes)
        return [self.device_view(slot) for slot in slots]


@attrs.frozen
class DecodeInputs:
    """Host arrays of one pure-decode step, one row per sequence.

    input_ids, positions, slot_mapping: [n] int64; seq_lens: [n] int32;
    block_tables: [n, w] int32, where w covers every row's context.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor

    @property
    def num_seqs(self) -> int:
        """Rows in the batch."""
        return self.input_ids.shape[0]


class DecodeGraphs:
    """Pure-decode forward passes (hidden states and logits), padded to a ladder of batch sizes.

    model, kv_caches: the runner's model and its per-layer caches (fixed addresses).
    batch_sizes: the ladder; batches larger than its top cannot use this path.
    max_blocks_per_seq: block-table width, enough for the longest context.
    scratch_block: a cache block outside the scheduler's range, written by padding rows.
    capture: record a CUDA graph per batch size (needs CUDA and the Triton backend);
      when False the padded batches run eagerly through the model's own backend.
    balance: cut decode contexts into length-balanced tiles (`cadence.gpu.worklist`):
      the work list is built on the host in `prepare` and read by the Triton kernel
      from static buffers, so graphs replay it; eagerly, it applies where the model's
      backend is Triton (the CPU interpreter's twin of the graph path).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        batch_sizes: Sequence[int],
        max_blocks_per_seq: int,
        block_size: int,
        scratch_block: int,
        device: torch.device | str,
        capture: bool,
        balance: BalanceConfig | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = list(kv_caches)
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        if not self.batch_sizes or self.batch_sizes[0] < 1:
            raise ValueError(f"batch sizes must be >= 1, got {batch_sizes}")
        self.max_batch_size = size = self.batch_sizes[-1]
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.device = torch.device(device)
        self.balance = balance
        capacity = balance.capacity(size) if balance is not None else 1
        # Block tables come last: `prepare` copies the buffer up to the rows in use.
        names = ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc",
                 "tile_seq", "tile_begin", "tile_end", "seq_tile_start", "block_tables")
        slots, num_bytes = plan_layout([
            (torch.int64, (size,)), (torch.int64, (size,)), (torch.int64, (size,)),
            (torch.int32, (size,)), (torch.int32, (size + 1,)),
            (torch.int32, (capacity,)), (torch.int32, (capacity,)), (torch.int32, (capacity,)),
            (torch.int32, (size + 1,)), (torch.int32, (size, max_blocks_per_seq)),
        ])
        self._slots = dict(zip(names, slots))
        self.staging = StagingBuffer(num_bytes, self.device)
        self._host = {name: self.staging.host_view(slot) for name, slot in self._slots.items()}
        self._static = {name: self.staging.device_view(slot) for name, slot in self._slots.items()}
        self._host["query_start_loc"].copy_(torch.arange(size + 1, dtype=torch.int32))
        self._fill_padding(0, size)
        self.staging.upload(num_bytes)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        if capture:
            self.capture()

    @property
    def captured(self) -> bool:
        """Whether steps replay CUDA graphs (else they run eagerly)."""
        return bool(self._graphs)

    @property
    def context_capacity(self) -> int:
        """Longest context the block-table width covers."""
        return self.max_blocks_per_seq * self.block_size

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured batch size a batch of `num_seqs` runs as; None when it is too large."""
        return padded_batch_size(num_seqs, self.batch_sizes)

    def prepare(self, inputs: DecodeInputs) -> int:
        """Write a step's rows and its padding into the static buffers; returns the padded size."""
        n = inputs.num_seqs
        padded = self.padded_size(n)
        if padded is None:
            raise ValueError(f"{n} sequences exceed the largest captured batch, {self.max_batch_size}")
        width = inputs.block_tables.shape[1]
        if width > self.max_blocks_per_seq:
            raise ValueError(f"block tables of width {width} exceed {self.max_blocks_per_seq}")
        self.staging.wait_for_copy()
        host = self._host
        host["input_ids"][:n] = inputs.input_ids
        host["positions"][:n] = inputs.positions
        host["slot_mapping"][:n] = inputs.slot_mapping
        host["seq_lens"][:n] = inputs.seq_lens
        host["block_tables"][:n, :width] = inputs.block_tables
        self._fill_padding(n, padded)
        if self.balance is not None:
            build_worklist(host["seq_lens"][:padded].tolist(), self.balance.capacity(padded),
                           self.balance.granularity, self.balance.min_tile_tokens,
                           out=self._worklist(host, padded))
        # Block tables come last, so the rows in use end the copied range; the
        # columns past `width` keep stale ids that no context length reaches.
        slot = self._slots["block_tables"]
        self.staging.upload(slot.offset + padded * self.max_blocks_per_seq * _element_size(slot.dtype))
        return padded

    def run(self, padded_size: int, max_seq_len: int) -> torch.Tensor:
        """Logits [padded_size, vocab] of the prepared step (graph replay, or eagerly)."""
        graph = self._graphs.get(padded_size)
        if graph is None:
            return self._forward(padded_size, max_seq_len)
        graph.replay()
        return self._logits[padded_size]

    def capture(self) -> None:
        """Record one graph per batch size, largest first so smaller ones reuse its memory pool."""
        config = self.model.config
        attention_out = torch.empty(
            self.max_batch_size, config.num_heads, config.head_dim,
            dtype=self.model.model.embed_tokens.weight.dtype, device=self.device,
        )
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.batch_sizes):
            # One static output buffer, and no context split: the split count
            # would depend on the step's longest context, which a graph cannot.
            if self.balance is not None:
                # Warm-up and capture run on the padding rows: give them a valid list.
                self.staging.wait_for_copy()
                build_worklist([1] * size, self.balance.capacity(size), self.balance.granularity,
                               self.balance.min_tile_tokens, out=self._worklist(self._host, size))
                self.staging.upload(self.staging.num_bytes)
            previous = self.model.set_attention_backend(self._graph_backend(attention_out[:size], size))
            try:
                self._forward(size, self.context_capacity)  # compiles kernels, settles library choices
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(size, self.context_capacity)
            finally:
                self.model.set_attention_backend(previous)
            self._graphs[size] = graph
            self._logits[size] = logits
        torch.cuda.synchronize(self.device)

    def _graph_backend(self, out: torch.Tensor | None, size: int) -> AttentionBackend:
        """Triton attention reading the static buffers: one output buffer and, without a
        work list, no context split (its count would depend on the step's longest
        context, which a graph cannot)."""
        from . import triton_attention

        worklist = self._worklist(self._static, size) if self.balance is not None else None
        attend = functools.partial(triton_attention.paged_attention, out=out, num_kv_splits=1,
                                   worklist=worklist)
        return AttentionBackend("triton-decode-graph", attend, triton_attention.write_kv)

    def _worklist(self, views: dict[str, torch.Tensor], size: int) -> DecodeWorklist:
        """The work-list buffers of a padded batch of `size` rows, as host or device views."""
        capacity = self.balance.capacity(size)
        return DecodeWorklist(
            tile_seq=views["tile_seq"][:capacity], tile_begin=views["tile_begin"][:capacity],
            tile_end=views["tile_end"][:capacity], seq_tile_start=views["seq_tile_start"][:size + 1],
            tile_tokens=0, num_tiles=0)

    def _forward(self, size: int, max_seq_len: int) -> torch.Tensor:
        own_backend = self.model.model.layers[0].self_attn.backend
        if self.balance is not None and not self._graphs and own_backend.name == "triton":
            previous = self.model.set_attention_backend(self._graph_backend(None, size))
            try:
                return self._forward_with_backend(size, max_seq_len)
            finally:
                self.model.set_attention_backend(previous)
        return self._forward_with_backend(size, max_seq_len)

    def _forward_with_backend(self, size: int, max_seq_len: int) -> torch.Tensor:
        static = self._static
        meta = AttentionMetadata(
            slot_mapping=static["slot_mapping"][:size],
            query_start_loc=static["query_start_loc"][: size + 1],
            seq_lens=static["seq_lens"][:size],
            block_tables=static["block_tables"][:size],
            max_query_len=1,
            max_seq_len=max_seq_len,
            num_decode_seqs=size,
        )
        hidden = self.model(static["input_ids"][:size], static["positions"][:size], self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    def _fill_padding(self, start: int, stop: int) -> None:
        host = self._host
        host["input_ids"][start:stop] = 0
        host["positions"][start:stop] = 0
        host["slot_mapping"][start:stop] = self.scratch_block * self.block_size
        host["seq_lens"][start:stop] = 1
        host["block_tables"][start:stop, 0] = self.scratch_block

    def host_rows(self, num_rows: int) -> DecodeInputs:
        """The first `num_rows` rows of the host buffers as last prepared (for tests and debugging)."""
        host = self._host
        return DecodeInputs(
            host["input_ids"][:num_rows].clone(), host["positions"][:num_rows].clone(),
            host["slot_mapping"][:num_rows].clone(), host["seq_lens"][:num_rows].clone(),
            host["block_tables"][:num_rows].clone(),
        )
