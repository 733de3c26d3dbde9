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


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each new token's key and value [T, Hkv, D] at its cache slot."""
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = key.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = value.to(v_cache.dtype)


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


def sdpa_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Same result as the reference, batched: pad every sequence to the longest and run one SDPA.

    Needs no host synchronisation beyond `max_query_len` and `max_seq_len`, so it
    is a usable GPU path where no paged kernel is available.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = meta.seq_lens.shape[0]
    block_size = k_cache.shape[1]
    device = query.device
    num_blocks = -(-meta.max_seq_len // block_size)
    tables = meta.block_tables[:, :num_blocks].long()
    k = k_cache[tables].flatten(1, 2)[:, : meta.max_seq_len]
    v = v_cache[tables].flatten(1, 2)[:, : meta.max_seq_len]
    starts = meta.query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    seq_of_token = torch.repeat_interleave(
        torch.arange(num_seqs, device=device), q_lens, output_size=num_tokens
    )
    index_in_seq = torch.arange(num_tokens, device=device) - starts[seq_of_token]
    padded = query.new_zeros(num_seqs, meta.max_query_len, num_heads, head_dim)
    padded[seq_of_token, index_in_seq] = query
    query_pos = (meta.seq_lens.long() - q_lens)[:, None] + torch.arange(meta.max_query_len, device=device)
    key_pos = torch.arange(meta.max_seq_len, device=device)
    mask = key_pos[None, None, :] <= query_pos[:, :, None]
    num_queries_per_kv = num_heads // k_cache.shape[2]
    k = k.repeat_interleave(num_queries_per_kv, dim=2)
    v = v.repeat_interleave(num_queries_per_kv, dim=2)
    out = torch.nn.functional.scaled_dot_product_attention(
        padded.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None], scale=scale
    )
    return out.transpose(1, 2)[seq_of_token, index_in_seq]


@attrs.frozen
class AttentionBackend:
    """A named pair of functions: write new K/V into the cache, and attend over it."""

    name: str
    paged_attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]
    write_kv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


ATTENTION_BACKENDS = ("reference", "sdpa", "triton")


def get_attention_backend(name: str) -> AttentionBackend:
    """The backend called `name`: "reference" (per-sequence torch), "sdpa" (batched torch), "triton"."""
    if name == "reference":
        return AttentionBackend(name, reference_paged_attention, write_kv)
    if name == "sdpa":
        return AttentionBackend(name, sdpa_paged_attention, write_kv)
    if name == "triton":
        # Imported on demand: the kernel module needs triton, which CPU-only installs may lack.
        from . import triton_attention

        return AttentionBackend(
            name, triton_attention.paged_attention, getattr(triton_attention, "write_kv", write_kv)
        )
    raise ConfigError(f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}")
