"""Attention over the paged KV cache: shared metadata and the backend interface.

Every backend takes the same `AttentionMetadata`, built once per step by the
model runner from the persistent batch, and computes causal attention of each
sequence's new query tokens over that sequence's whole context, read through
its block table.
"""

from __future__ import annotations

from typing import Callable

import attrs
import torch

from cadence.statemachine.errors import ConfigError


@attrs.define(slots=True)
class AttentionMetadata:
    """Flattened per-step inputs shared by every layer's attention.

    slot_mapping: [num_tokens] int64, cache slot (block * block_size + offset) each
      new token's K and V are written to.
    query_start_loc: [num_seqs + 1] int32, offsets of each sequence's queries in the
      flattened token dimension.
    seq_lens: [num_seqs] int32, context length of each sequence after this step
      (cached tokens plus this step's tokens).
    block_tables: [num_seqs, max_blocks_per_seq] int32, padded with 0.
    max_query_len, max_seq_len: host ints, maxima of the above.
    num_decode_seqs: the first sequences that each have exactly one query token.
    padded_layout: what the "sdpa" backend derives from the above on a step's
      first layer, for the others to reuse; None until then.
    row_block_tables / row_seq_lens: where the runner chose to attend a row at a time
      (the "cpu" backend, `row_attention_pays`), each query row's own block table
      [num_tokens, width] and context length [num_tokens] (its position + 1): every
      row is then a one-token query, as a decode is. None otherwise.
    The query token j of sequence s sits at position seq_lens[s] - q_len[s] + j and
    attends to context positions <= its own.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_decode_seqs: int = 0
    padded_layout: PaddedLayout | None = attrs.field(default=None, repr=False, eq=False)
    row_block_tables: torch.Tensor | None = attrs.field(default=None, repr=False, eq=False)
    row_seq_lens: torch.Tensor | None = attrs.field(default=None, repr=False, eq=False)


# A prompt's causal attention a row at a time (the CPU decode kernel) against one
# product over its blocks padded to the longest (SDPA with a mask, which computes the
# masked half too): per position read, the row kernel took 1.6-1.9x SDPA's time here
# (1 thread, AVX2, heads of 64), so it pays where the padded work is at least this many
# times the causal work: a whole prompt (about 2x) but not a chunk over a long cached
# context. Measured against SDPA, 125M model's heads: 7 prompts of 128 tokens 9.6 ms
# against 12.8, one of 2,048 237 against 337, 256 tokens after 1,024 cached 30.6
# against 19.0 (the row kernel before its prompt rows reused the row before's slots,
# which made it 0.82-0.88x of that: the chunk after a long context still pays padded).
ROW_ATTENTION_MIN_RATIO = 1.8


# Per-row tables are the step's rows times its widest table (a long decode beside a
# burst of prompts widens every prompt row's): past this many entries (4 MB) their copy
# would cost more than the padded path saves, and the step attends padded.
ROW_TABLES_MAX_ENTRIES = 1 << 20


def row_attention_pays(prefills: list[tuple[int, int]], block_size: int, num_rows: int = 0,
                       table_width: int = 0) -> bool:
    """Whether the prompts of a step, (tokens computed before, tokens now) each, are cheaper
    attended a row at a time than padded to the longest (`ROW_ATTENTION_MIN_RATIO`), with
    `num_rows` query rows and tables `table_width` blocks wide (`ROW_TABLES_MAX_ENTRIES`)."""
    if num_rows * table_width > ROW_TABLES_MAX_ENTRIES:
        return False
    if not prefills:
        return True
    longest = max(start + n for start, n in prefills)
    width = -(-longest // block_size) * block_size
    padded = len(prefills) * max(n for _, n in prefills) * width
    causal = sum(n * start + n * (n + 1) // 2 for start, n in prefills)
    return padded >= ROW_ATTENTION_MIN_RATIO * causal


def last_rows_metadata(meta: AttentionMetadata, rows: torch.Tensor, seqs: torch.Tensor) -> AttentionMetadata:
    """The metadata of a step cut down to the last query row of each sequence in
    `seqs` (rows `rows` of the step's tokens): each such row is then a one-token
    query over its sequence's whole context, as a decode is. `max_seq_len` stays the
    step's, a bound the backends take."""
    num = rows.shape[0]
    seq_lens, block_tables = meta.seq_lens[seqs], meta.block_tables[seqs]
    by_row = meta.row_block_tables is not None
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[rows],
        query_start_loc=torch.arange(num + 1, dtype=torch.int32, device=rows.device),
        seq_lens=seq_lens, block_tables=block_tables,
        max_query_len=1, max_seq_len=meta.max_seq_len, num_decode_seqs=num,
        row_block_tables=block_tables if by_row else None, row_seq_lens=seq_lens if by_row else None,
    )


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each new token's key and value [T, Hkv, D] at its cache slot."""
    if key.dtype != k_cache.dtype:
        key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def reference_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of query [T, Hq, D] over each sequence's cached context.

    One sequence at a time: gather its keys and values through its block table,
    then softmax(q k^T * scale) v in float32 with the causal mask. Plain and
    slow on purpose; the other backends are checked against it.
    """
    out = torch.empty_like(query)
    block_size = k_cache.shape[1]
    num_queries_per_kv = query.shape[1] // k_cache.shape[2]
    starts = meta.query_start_loc.tolist()
    for seq, seq_len in enumerate(meta.seq_lens.tolist()):
        q = query[starts[seq] : starts[seq + 1]].float()
        q_len = q.shape[0]
        blocks = meta.block_tables[seq, : -(-seq_len // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:seq_len].float()
        v = v_cache[blocks].flatten(0, 1)[:seq_len].float()
        k = k.repeat_interleave(num_queries_per_kv, dim=1)
        v = v.repeat_interleave(num_queries_per_kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        key_pos = torch.arange(seq_len, device=query.device)
        scores.masked_fill_(key_pos[None, None, :] > query_pos[None, :, None], float("-inf"))
        probs = scores.softmax(dim=-1)
        out[starts[seq] : starts[seq + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


@attrs.frozen
class PaddedLayout:
    """One step's sequences as padded rows for batched attention; the same for every layer.

    block_ids: [num_seqs * num_blocks] int64, each sequence's first `num_blocks`
      cache blocks, row after row: one gather brings its keys (or values) as
      [num_seqs, num_blocks * block_size] rows.
    decode_mask: [num_decodes, 1, 1, width] bool, which keys each decode attends to.
    The prefill fields cover the sequences after the decodes:
    prefill_mask: [num_prefills, 1, group * max_query_len, width] bool, causal,
      the query rows of one KV head's group of query heads stacked (see
      `_grouped_queries`).
    token_rows: [num_prefill_tokens] int64, the padded row (sequence * max_query_len
      + index in sequence) of each prefill token.
    """

    block_ids: torch.Tensor
    width: int
    num_decodes: int
    decode_mask: torch.Tensor
    prefill_mask: torch.Tensor | None
    token_rows: torch.Tensor | None


def padded_layout(meta: AttentionMetadata, num_tokens: int, block_size: int, group: int,
                  device: torch.device) -> PaddedLayout:
    """The layout of `meta` (a step of `num_tokens` query tokens) for `group` query heads per KV head."""
    num_seqs = meta.seq_lens.shape[0]
    num_blocks = -(-meta.max_seq_len // block_size)
    width = num_blocks * block_size
    block_ids = meta.block_tables[:, :num_blocks].reshape(-1).long()
    seq_lens = meta.seq_lens.long()
    key_pos = torch.arange(width, device=device)
    num_decodes = meta.num_decode_seqs
    decode_mask = (key_pos < seq_lens[:num_decodes, None])[:, None, None, :]
    prefill_mask = token_rows = None
    if num_decodes < num_seqs:
        starts = meta.query_start_loc[num_decodes:].long()
        q_lens = starts[1:] - starts[:-1]
        num_prefills, max_query_len = num_seqs - num_decodes, meta.max_query_len
        # Each decode has one token, so the prefills hold the rest: no need to read `starts` back.
        num_prefill_tokens = num_tokens - num_decodes
        seq_of_token = torch.repeat_interleave(
            torch.arange(num_prefills, device=device), q_lens, output_size=num_prefill_tokens)
        index_in_seq = torch.arange(num_prefill_tokens, device=device) + starts[0] - starts[seq_of_token]
        token_rows = seq_of_token * max_query_len + index_in_seq
        query_pos = (seq_lens[num_decodes:] - q_lens)[:, None] + torch.arange(max_query_len, device=device)
        causal = key_pos[None, None, :] <= query_pos[:, :, None]
        prefill_mask = causal[:, None].expand(num_prefills, group, max_query_len, width).reshape(
            num_prefills, 1, group * max_query_len, width)
    return PaddedLayout(block_ids, width, num_decodes, decode_mask, prefill_mask, token_rows)


def _gather_rows(cache: torch.Tensor, layout: PaddedLayout, first: int, last: int) -> torch.Tensor:
    """Keys or values of sequences [first, last) as [num, num_kv_heads, width, head_dim]."""
    num_blocks = layout.width // cache.shape[1]
    rows = cache.index_select(0, layout.block_ids[first * num_blocks : last * num_blocks])
    return rows.view(last - first, layout.width, *cache.shape[2:]).transpose(1, 2)


def _grouped_queries(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[num, max_query_len, num_heads, D] as [num, num_kv_heads, group * max_query_len, D].

    Each KV head attends for its whole group of query heads in one product, so
    keys and values are never repeated per query head.
    """
    num, max_query_len, num_heads, head_dim = query.shape
    group = num_heads // num_kv_heads
    grouped = query.view(num, max_query_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    return grouped.reshape(num, num_kv_heads, group * max_query_len, head_dim)


def sdpa_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Same result as the reference, batched: decodes in one SDPA, prefills padded to the longest in another.

    Keys and values are gathered a whole block at a time (positions past a
    sequence's end are masked out); the indices and masks are computed once per
    step (`PaddedLayout`, kept on `meta`) and reused by every layer. Needs no
    host synchronisation beyond `max_query_len` and `max_seq_len`, so it is a
    usable GPU path where no paged kernel is available.
    """
    return _decodes_then_prefills(query, k_cache, v_cache, meta, scale, _sdpa_decodes)


def cpu_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Same result as the reference, reading the cache blocks in place
    (`cadence.gpu.cpu_kernels`): decodes and prefills in one kernel where it takes the
    query's dtype and head size (AVX-512; float32 or bfloat16, heads of 32-256), unless
    the step carries per-row tables (`row_block_tables`, which the runner makes only
    where that kernel is missing): then every row through the decode kernel; else
    decodes through the decode kernel and prefills as in `sdpa_paged_attention`. Where
    the kernels cannot be built, exactly `sdpa_paged_attention`."""
    from . import cpu_kernels

    kernel = cpu_kernels.load()
    if kernel is None or query.device.type != "cpu":
        return sdpa_paged_attention(query, k_cache, v_cache, meta, scale)
    if meta.row_block_tables is not None:  # a row at a time, prompt rows as decodes (the stack's way)
        return kernel.paged_decode_attention(query, k_cache, v_cache, meta.row_block_tables, meta.row_seq_lens,
                                             scale)
    if kernel.has_paged_attention(query):  # decodes and prefills in one pass over the blocks
        return kernel.paged_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                      meta.query_start_loc, scale)

    def decodes(query, k_cache, v_cache, meta, layout, scale):
        num = meta.num_decode_seqs
        return kernel.paged_decode_attention(query[:num], k_cache, v_cache, meta.block_tables[:num],
                                             meta.seq_lens[:num], scale)

    return _decodes_then_prefills(query, k_cache, v_cache, meta, scale, decodes,
                                  needs_layout=meta.num_decode_seqs < meta.seq_lens.shape[0])


def _sdpa_decodes(query, k_cache, v_cache, meta: AttentionMetadata, layout: PaddedLayout,
                  scale: float) -> torch.Tensor:
    """Attention of the step's decodes, [num_decodes, num_heads, head_dim], over gathered blocks."""
    num_decodes, num_heads, head_dim = layout.num_decodes, query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    q = query[:num_decodes].view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
    k = _gather_rows(k_cache, layout, 0, num_decodes)
    v = _gather_rows(v_cache, layout, 0, num_decodes)
    attend = torch.nn.functional.scaled_dot_product_attention
    return attend(q, k, v, attn_mask=layout.decode_mask, scale=scale).view(num_decodes, num_heads, head_dim)


def _decodes_then_prefills(query, k_cache, v_cache, meta: AttentionMetadata, scale: float, decodes,
                           needs_layout: bool = True) -> torch.Tensor:
    """The step's decodes through `decodes`, then its prefills padded to the longest in one SDPA."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    layout = meta.padded_layout
    if layout is None and needs_layout:
        layout = meta.padded_layout = padded_layout(meta, num_tokens, k_cache.shape[1], group, query.device)
    num_seqs, num_decodes = meta.seq_lens.shape[0], meta.num_decode_seqs
    if num_decodes:
        decoded = decodes(query, k_cache, v_cache, meta, layout, scale)
        if num_decodes == num_seqs:
            return decoded
    out = torch.empty_like(query)
    if num_decodes:
        out[:num_decodes] = decoded
    num_prefills, max_query_len = num_seqs - num_decodes, meta.max_query_len
    padded = query.new_zeros(num_prefills * max_query_len, num_heads, head_dim)
    padded[layout.token_rows] = query[num_decodes:]
    q = _grouped_queries(padded.view(num_prefills, max_query_len, num_heads, head_dim), num_kv_heads)
    k = _gather_rows(k_cache, layout, num_decodes, num_seqs)
    v = _gather_rows(v_cache, layout, num_decodes, num_seqs)
    attend = torch.nn.functional.scaled_dot_product_attention
    grouped = attend(q, k, v, attn_mask=layout.prefill_mask, scale=scale)
    rows = grouped.view(num_prefills, num_kv_heads, group, max_query_len, head_dim).permute(0, 3, 1, 2, 4)
    out[num_decodes:] = rows.reshape(num_prefills * max_query_len, num_heads, head_dim)[layout.token_rows]
    return out


@attrs.frozen
class AttentionBackend:
    """A named pair of functions: write new K/V into the cache, and attend over it."""

    name: str
    paged_attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]
    write_kv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


ATTENTION_BACKENDS = ("reference", "sdpa", "cpu", "triton")


def get_attention_backend(name: str) -> AttentionBackend:
    """The backend called `name`: "reference" (per-sequence torch), "sdpa" (batched torch),
    "cpu" (the CPU's in-place decode kernel, SDPA for prefills), "triton"."""
    if name == "reference":
        return AttentionBackend(name, reference_paged_attention, write_kv)
    if name == "sdpa":
        return AttentionBackend(name, sdpa_paged_attention, write_kv)
    if name == "cpu":
        return AttentionBackend(name, cpu_paged_attention, write_kv)
    if name == "triton":
        # Imported on demand: the kernel module needs triton, which CPU-only installs may lack.
        from . import triton_attention

        return AttentionBackend(
            name, triton_attention.paged_attention, getattr(triton_attention, "write_kv", write_kv)
        )
    raise ConfigError(f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}")
