"""Triton kernels for attention over the paged KV cache.

`write_kv` scatters each new token's key and value into its cache slot;
`paged_attention` computes causal attention of every sequence's new query tokens
over its whole context, read through its block table, for a mixed batch of decodes
and prefill chunks (which may start after a cached prefix).

Both attention launches run one kernel. A program owns one KV head of one sequence
and a tile of query rows; the rows are (query token, query head) pairs of that KV
head's group, so one load of a KV tile serves every query head that shares it. The
kernel walks the context in tiles of `block_n` tokens through the block table with an
online softmax, accumulating in float32. Decodes (the first `num_decode_seqs`
sequences, one query token each) use small row tiles and may split a long context
across programs whose partial results a second kernel merges; prefill chunks use
larger row tiles.

Importing this module decides whether kernels compile for the GPU or run in Triton's
CPU interpreter: set TRITON_INTERPRET=1 before the first import to use the latter.
"""

from __future__ import annotations

import functools
import math

import attrs
import torch
import triton
import triton.language as tl

from cadence.gpu.attention import AttentionMetadata
from cadence.gpu.worklist import DecodeWorklist

LOG2_E = 1.4426950408889634
# The smallest tile the matrix instructions (and tl.dot) accept along any side.
MIN_DOT_TILE = 16
# A context split shorter than this costs more in merging than it gains in parallelism.
MIN_TOKENS_PER_SPLIT = 256
MAX_KV_SPLITS = 16
# Decode programs per multiprocessor below which a long context is split.
SPLIT_TARGET_WAVES = 2
# Work-list tiles one merge step reads at once (the merge loops over more).
MERGE_TILES_PAD = 16

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@attrs.frozen
class KernelConfig:
    """Tile shapes and launch settings of one attention launch.

    block_m: query rows per program (query tokens times the query heads of one KV head);
      raised to the group size and to 16 where smaller.
    block_n: context tokens per step of the inner loop.
    """

    block_m: int = attrs.field(validator=attrs.validators.gt(0))
    block_n: int = attrs.field(validator=attrs.validators.ge(MIN_DOT_TILE))
    num_warps: int = attrs.field(default=4, validator=attrs.validators.gt(0))
    num_stages: int = attrs.field(default=2, validator=attrs.validators.gt(0))

    @block_n.validator
    def _check_power_of_two(self, attribute, value):
        if value & (value - 1):
            raise ValueError(f"{attribute.name} must be a power of two, got {value}")


DECODE_CONFIG = KernelConfig(block_m=MIN_DOT_TILE, block_n=64, num_warps=4, num_stages=3)
PREFILL_CONFIG = KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    if BLOCK_D == HEAD_DIM:
        mask = (offs_h < num_kv_heads)[:, None]
    else:
        mask = (offs_h < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]

    key = tl.load(key_ptr + token * stride_key_t + offs_h[:, None] * stride_key_h
                  + offs_d[None, :], mask=mask)
    value = tl.load(value_ptr + token * stride_value_t + offs_h[:, None] * stride_value_h
                    + offs_d[None, :], mask=mask)
    k_dst = (k_cache_ptr + block * stride_kc_b + offset * stride_kc_s
             + offs_h[:, None] * stride_kc_h + offs_d[None, :])
    v_dst = (v_cache_ptr + block * stride_vc_b + offset * stride_vc_s
             + offs_h[:, None] * stride_vc_h + offs_d[None, :])
    tl.store(k_dst, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    tile_seq_ptr, tile_begin_ptr, tile_end_ptr,
    seq_offset, scale_log2, tokens_per_split,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
    stride_bt_s,
    stride_po_s, stride_po_h, stride_po_k, stride_pl_s, stride_pl_h,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, WORKLIST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Axis 0 is the query tile; or, for decodes (one query tile), the context split
    # when SPLIT, or the work-list entry when WORKLIST (axis 1 is then unused).
    kv_head = tl.program_id(2)
    tile = 0
    split = 0
    if WORKLIST:
        part_row = tl.program_id(0)
        seq_local = tl.load(tile_seq_ptr + part_row)
        if seq_local < 0:
            return
    else:
        seq_local = tl.program_id(1)
        part_row = seq_local
        if SPLIT:
            split = tl.program_id(0)
        else:
            tile = tl.program_id(0)
    seq = seq_local + seq_offset

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - q_len
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    first_q = tile * BLOCK_Q
    if first_q >= q_len:
        return

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_q = first_q + offs_m // GROUP_PAD
    row_g = offs_m % GROUP_PAD
    row_valid = (row_q < q_len) & (row_g < GROUP)
    row_pos = num_cached + row_q
    row_token = (q_start + row_q).to(tl.int64)
    row_head = kv_head * GROUP + row_g
    if BLOCK_D == HEAD_DIM:
        row_mask = row_valid[:, None]
    else:
        row_mask = row_valid[:, None] & (offs_d < HEAD_DIM)[None, :]

    q = tl.load(q_ptr + row_token[:, None] * stride_q_t + row_head[:, None] * stride_q_h
                + offs_d[None, :], mask=row_mask, other=0.0)

    # Context this tile may see: everything up to its last query token's position.
    kv_end = num_cached + tl.minimum(q_len, first_q + BLOCK_Q)
    kv_begin = 0
    if SPLIT:
        kv_begin = split * tokens_per_split
        kv_end = tl.minimum(kv_end, kv_begin + tokens_per_split)
    if WORKLIST:
        kv_begin = tl.load(tile_begin_ptr + part_row)
        kv_end = tl.minimum(kv_end, tl.load(tile_end_ptr + part_row))

    k_base = k_cache_ptr + kv_head * stride_kc_h
    v_base = v_cache_ptr + kv_head * stride_vc_h
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    # A finite start keeps exp2(m_old - m_new) defined for rows with nothing visible yet.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(kv_begin, kv_end, BLOCK_N):
        pos_n = start_n + offs_n
        n_valid = pos_n < kv_end
        block = tl.load(table + pos_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        in_block = pos_n % BLOCK_SIZE
        if BLOCK_D == HEAD_DIM:
            k_mask = n_valid[None, :]
            v_mask = n_valid[:, None]
        else:
            k_mask = n_valid[None, :] & (offs_d < HEAD_DIM)[:, None]
            v_mask = n_valid[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_base + (block * stride_kc_b + in_block * stride_kc_s)[None, :]
                    + offs_d[:, None], mask=k_mask, other=0.0)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        visible = (pos_n[None, :] <= row_pos[:, None]) & n_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + (block * stride_vc_b + in_block * stride_vc_s)[:, None]
                    + offs_d[None, :], mask=v_mask, other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    has_context = l_i > 0.0
    acc = acc / tl.where(has_context, l_i, 1.0)[:, None]
    if SPLIT or WORKLIST:
        # Decode rows only: the query token is the sequence's single one.
        lse = tl.where(has_context, m_i + tl.log2(tl.where(has_context, l_i, 1.0)),
                       float("-inf"))
        part = (part_out_ptr + part_row.to(tl.int64) * stride_po_s
                + row_head[:, None] * stride_po_h + split * stride_po_k + offs_d[None, :])
        tl.store(part, acc, mask=row_mask)
        tl.store(part_lse_ptr + part_row.to(tl.int64) * stride_pl_s + row_head * stride_pl_h
                 + split, lse, mask=row_valid)
    else:
        dst = out_ptr + row_token[:, None] * stride_o_t + row_head[:, None] * stride_o_h
        tl.store(dst + offs_d[None, :], acc.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, query_start_loc_ptr, num_splits,
    stride_po_s, stride_po_h, stride_po_k, stride_pl_s, stride_pl_h,
    stride_o_t, stride_o_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_k = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    k_valid = offs_k < num_splits
    if BLOCK_D == HEAD_DIM:
        mask = k_valid[:, None]
        d_mask = offs_d < BLOCK_D
    else:
        d_mask = offs_d < HEAD_DIM
        mask = k_valid[:, None] & d_mask[None, :]
    lse = tl.load(part_lse_ptr + seq * stride_pl_s + head * stride_pl_h + offs_k,
                  mask=k_valid, other=float("-inf"))
    # Split 0 always holds the sequence's first token, so the maximum is finite.
    weight = tl.exp2(lse - tl.max(lse, 0))
    part = tl.load(part_out_ptr + seq * stride_po_s + head * stride_po_h
                   + offs_k[:, None] * stride_po_k + offs_d[None, :], mask=mask, other=0.0)
    merged = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + offs_d,
             merged.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _merge_tiles_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, query_start_loc_ptr, seq_tile_start_ptr,
    stride_po_t, stride_po_h, stride_pl_t, stride_pl_h, stride_o_t, stride_o_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TILES_PAD: tl.constexpr,
):
    # One program merges one head of one decode sequence over its work-list tiles,
    # TILES_PAD at a time, rescaling the running sum by the running maximum.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    first = tl.load(seq_tile_start_ptr + seq)
    last = tl.load(seq_tile_start_ptr + seq + 1)
    offs_k = tl.arange(0, TILES_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_run = tl.full([1], -1.0e30, dtype=tl.float32)
    w_run = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(first, last, TILES_PAD):
        rows = start + offs_k
        k_valid = rows < last
        lse = tl.load(part_lse_ptr + rows.to(tl.int64) * stride_pl_t + head * stride_pl_h,
                      mask=k_valid, other=float("-inf"))
        m_new = tl.maximum(m_run, tl.max(lse, 0))
        scale = tl.exp2(m_run - m_new)
        weight = tl.exp2(lse - m_new)
        part = tl.load(part_out_ptr + rows.to(tl.int64)[:, None] * stride_po_t
                       + head * stride_po_h + offs_d[None, :],
                       mask=k_valid[:, None] & d_mask[None, :], other=0.0)
        acc = acc * scale + tl.sum(part * weight[:, None], 0)
        w_run = w_run * scale + tl.sum(weight, 0)
        m_run = m_new
    merged = acc / w_run
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + offs_d,
             merged.to(out_ptr.dtype.element_ty), mask=d_mask)


# --------------------------------------------------------------------------- wrappers


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's key and value into the caches at its slot, in place.

    key, value: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int64,
    slot = block * block_size + offset. Tokens with a negative slot (batch padding) are
    skipped.
    """
    _check_cache(k_cache, v_cache)
    num_tokens = key.shape[0]
    expected = (num_tokens, k_cache.shape[2], k_cache.shape[3])
    for name, tensor in (("key", key), ("value", value)):
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {expected} "
                             f"(num_tokens, num_kv_heads, head_dim of the cache)")
        _check_last_dim_contiguous(name, tensor)
        _check_device(name, tensor, k_cache.device)
    if slot_mapping.dtype != torch.int64 or tuple(slot_mapping.shape) != (num_tokens,):
        raise ValueError(f"slot_mapping must be int64 of shape ({num_tokens},), got "
                         f"{slot_mapping.dtype} of shape {tuple(slot_mapping.shape)}")
    _check_device("slot_mapping", slot_mapping, k_cache.device)
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
    )


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
    worklist: DecodeWorklist | None = None,
    decode_config: KernelConfig = DECODE_CONFIG,
    prefill_config: KernelConfig = PREFILL_CONFIG,
) -> torch.Tensor:
    """Causal attention of each sequence's new query tokens over its paged context.

    query: [num_tokens, num_q_heads, head_dim]; caches: [num_blocks, block_size,
    num_kv_heads, head_dim], already holding this step's keys and values (`write_kv`).
    Returns [num_tokens, num_q_heads, head_dim] in the query's dtype, written into `out`
    when given (a static buffer for graph capture). The first
    `meta.num_decode_seqs` sequences must have one query token each; `meta.max_seq_len`
    and `meta.max_query_len` must bound `seq_lens` and the query lengths. Decodes split
    long contexts into `num_kv_splits` parts (chosen from the batch shape when None), or,
    given a `worklist` (`cadence.gpu.worklist`, on the query's device, built from the
    decodes' `seq_lens`), into its length-balanced tiles.
    """
    _check_attention_inputs(query, k_cache, v_cache, meta)
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    elif out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(f"out must match the query: {tuple(query.shape)} {query.dtype} on "
                         f"{query.device}, got {tuple(out.shape)} {out.dtype} on {out.device}")
    _check_last_dim_contiguous("out", out)
    num_seqs = meta.seq_lens.shape[0]
    num_decodes = meta.num_decode_seqs
    if num_tokens == 0:
        return out
    launch = _Launch(query, k_cache, v_cache, out, meta, scale * LOG2_E)
    if num_decodes > 0:
        if worklist is not None:
            _check_worklist(worklist, num_decodes, query.device)
            launch.balanced_decodes(num_decodes, worklist, decode_config)
        else:
            if num_kv_splits is None:
                num_kv_splits = _choose_num_splits(num_decodes * num_kv_heads, meta.max_seq_len,
                                                   query.device)
            launch.decodes(num_decodes, num_kv_splits, decode_config)
    if num_seqs > num_decodes:
        launch.prefills(num_decodes, num_seqs - num_decodes, prefill_config)
    return out


@attrs.frozen(eq=False)
class _Launch:
    """The tensors and derived shapes shared by one call's kernel launches."""

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    out: torch.Tensor
    meta: AttentionMetadata
    scale_log2: float

    @property
    def group(self) -> int:
        return self.query.shape[1] // self.k_cache.shape[2]

    def prefills(self, seq_offset: int, num_seqs: int, config: KernelConfig) -> None:
        """Launch the prefill tiles of sequences [seq_offset, seq_offset + num_seqs)."""
        block_m = _rows_per_tile(config.block_m, self.group)
        block_q = block_m // triton.next_power_of_2(self.group)
        grid = (triton.cdiv(self.meta.max_query_len, block_q), num_seqs, self.k_cache.shape[2])
        self._attend(grid, seq_offset, block_m, config, split=False, tokens_per_split=0,
                     part_out=self.out, part_lse=self.out)

    def decodes(self, num_seqs: int, num_splits: int, config: KernelConfig) -> None:
        """Launch the first num_seqs sequences (one query token each), split num_splits ways."""
        block_m = _rows_per_tile(config.block_m, self.group)
        num_kv_heads = self.k_cache.shape[2]
        if num_splits <= 1:
            self._attend((1, num_seqs, num_kv_heads), 0, block_m, config, split=False,
                         tokens_per_split=0, part_out=self.out, part_lse=self.out)
            return
        per_split = triton.cdiv(triton.cdiv(self.meta.max_seq_len, num_splits), config.block_n)
        tokens_per_split = per_split * config.block_n
        num_splits = triton.cdiv(self.meta.max_seq_len, tokens_per_split)
        _, num_q_heads, head_dim = self.query.shape
        part_out = torch.empty((num_seqs, num_q_heads, num_splits, head_dim),
                               dtype=torch.float32, device=self.query.device)
        part_lse = torch.empty((num_seqs, num_q_heads, num_splits),
                               dtype=torch.float32, device=self.query.device)
        self._attend((num_splits, num_seqs, num_kv_heads), 0, block_m, config, split=True,
                     tokens_per_split=tokens_per_split, part_out=part_out, part_lse=part_lse)
        _merge_splits_kernel[(num_seqs, num_q_heads)](
            part_out, part_lse, self.out, self.meta.query_start_loc, num_splits,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            self.out.stride(0), self.out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
            SPLITS_PAD=triton.next_power_of_2(num_splits),
        )

    def balanced_decodes(self, num_seqs: int, worklist: DecodeWorklist,
                         config: KernelConfig) -> None:
        """Launch the first num_seqs sequences (one query token each) over the work list's
        tiles, one program per entry and KV head, then merge each sequence's tiles."""
        block_m = _rows_per_tile(config.block_m, self.group)
        _, num_q_heads, head_dim = self.query.shape
        capacity = worklist.capacity
        part_out = torch.empty((capacity, num_q_heads, head_dim), dtype=torch.float32,
                               device=self.query.device)
        part_lse = torch.empty((capacity, num_q_heads), dtype=torch.float32,
                               device=self.query.device)
        self._attend((capacity, 1, self.k_cache.shape[2]), 0, block_m, config, split=False,
                     tokens_per_split=0, part_out=part_out, part_lse=part_lse,
                     worklist=worklist)
        _merge_tiles_kernel[(num_seqs, num_q_heads)](
            part_out, part_lse, self.out, self.meta.query_start_loc, worklist.seq_tile_start,
            part_out.stride(0), part_out.stride(1), part_lse.stride(0), part_lse.stride(1),
            self.out.stride(0), self.out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
            TILES_PAD=MERGE_TILES_PAD,
        )

    def _attend(self, grid, seq_offset, block_m, config, *, split, tokens_per_split,
                part_out, part_lse, worklist: DecodeWorklist | None = None):
        query, k_cache, v_cache, out, meta = (self.query, self.k_cache, self.v_cache,
                                              self.out, self.meta)
        head_dim = query.shape[2]
        if split:
            part_strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2),
                            part_lse.stride(0), part_lse.stride(1))
        elif worklist is not None:
            part_strides = (part_out.stride(0), part_out.stride(1), 0,
                            part_lse.stride(0), part_lse.stride(1))
        else:
            part_strides = (0,) * 5
        # Without a work list the kernel never reads these pointers.
        tiles = ((worklist.tile_seq, worklist.tile_begin, worklist.tile_end)
                 if worklist is not None else (meta.seq_lens,) * 3)
        precision = "ieee" if query.dtype == torch.float32 else "tf32"
        _paged_attention_kernel[grid](
            query, k_cache, v_cache, out, part_out, part_lse,
            meta.query_start_loc, meta.seq_lens, meta.block_tables,
            *tiles,
            seq_offset, self.scale_log2, tokens_per_split,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            meta.block_tables.stride(0),
            *part_strides,
            BLOCK_SIZE=k_cache.shape[1], GROUP=self.group,
            GROUP_PAD=triton.next_power_of_2(self.group),
            HEAD_DIM=head_dim, BLOCK_D=max(triton.next_power_of_2(head_dim), MIN_DOT_TILE),
            BLOCK_M=block_m, BLOCK_N=config.block_n,
            SPLIT=split, WORKLIST=worklist is not None, DOT_PRECISION=precision,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )


def _rows_per_tile(block_m: int, group: int) -> int:
    """Rows of a query tile: a power of two holding at least one token's whole group."""
    return max(triton.next_power_of_2(block_m), triton.next_power_of_2(group), MIN_DOT_TILE)


def _choose_num_splits(num_programs: int, max_seq_len: int, device: torch.device) -> int:
    """Split decode contexts when the unsplit launch would leave multiprocessors idle."""
    if device.type != "cuda":
        return 1
    target = SPLIT_TARGET_WAVES * _multiprocessor_count(device.index or 0)
    if num_programs >= target:
        return 1
    by_length = max_seq_len // MIN_TOKENS_PER_SPLIT
    return max(1, min(by_length, math.ceil(target / num_programs), MAX_KV_SPLITS))


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# --------------------------------------------------------------------------- validation


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must share a shape [num_blocks, block_size, "
                         f"num_kv_heads, head_dim], got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"caches must share one of {_SUPPORTED_DTYPES}, got {k_cache.dtype} "
                         f"and {v_cache.dtype}")
    _check_last_dim_contiguous("k_cache", k_cache)
    _check_last_dim_contiguous("v_cache", v_cache)
    _check_device("v_cache", v_cache, k_cache.device)


def _check_attention_inputs(query, k_cache, v_cache, meta: AttentionMetadata) -> None:
    _check_cache(k_cache, v_cache)
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_q_heads, head_dim], got shape "
                         f"{tuple(query.shape)}")
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    if head_dim != k_cache.shape[3]:
        raise ValueError(f"query head_dim {head_dim} differs from the cache's {k_cache.shape[3]}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads cannot share {num_kv_heads} KV heads "
                         f"evenly")
    if query.dtype != k_cache.dtype:
        raise ValueError(f"query is {query.dtype} but the cache is {k_cache.dtype}")
    _check_last_dim_contiguous("query", query)
    _check_device("query", query, k_cache.device)
    num_seqs = meta.seq_lens.shape[0]
    for name, tensor, shape in (("query_start_loc", meta.query_start_loc, (num_seqs + 1,)),
                                ("seq_lens", meta.seq_lens, (num_seqs,))):
        if tensor.dtype != torch.int32 or tuple(tensor.shape) != shape:
            raise ValueError(f"meta.{name} must be int32 of shape {shape}, got "
                             f"{tensor.dtype} of shape {tuple(tensor.shape)}")
        _check_device(f"meta.{name}", tensor, query.device)
    tables = meta.block_tables
    if tables.dtype != torch.int32 or tables.dim() != 2 or tables.shape[0] != num_seqs:
        raise ValueError(f"meta.block_tables must be int32 of shape [{num_seqs}, max_blocks], "
                         f"got {tables.dtype} of shape {tuple(tables.shape)}")
    if tables.stride(1) != 1:
        raise ValueError("meta.block_tables must be contiguous along its last dimension")
    _check_device("meta.block_tables", tables, query.device)
    if not 0 <= meta.num_decode_seqs <= num_seqs:
        raise ValueError(f"meta.num_decode_seqs is {meta.num_decode_seqs}, outside "
                         f"[0, {num_seqs}]")


def _check_worklist(worklist: DecodeWorklist, num_decodes: int, device: torch.device) -> None:
    if worklist.seq_tile_start.shape[0] < num_decodes + 1:
        raise ValueError(f"the work list covers {worklist.seq_tile_start.shape[0] - 1} "
                         f"sequences, the batch has {num_decodes} decodes")
    for name in ("tile_seq", "tile_begin", "tile_end", "seq_tile_start"):
        tensor = getattr(worklist, name)
        if tensor.dtype != torch.int32:
            raise ValueError(f"worklist.{name} must be int32, got {tensor.dtype}")
        _check_device(f"worklist.{name}", tensor, device)


def _check_last_dim_contiguous(name: str, tensor: torch.Tensor) -> None:
    if tensor.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along head_dim, got strides "
                         f"{tensor.stride()}")


def _check_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, expected {device}")
