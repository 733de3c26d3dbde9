"""The torch attention backends against dense causal attention over contiguous K/V."""

from __future__ import annotations

import math

import pytest
import torch

from cadence.gpu.attention import (
    AttentionMetadata,
    get_attention_backend,
    reference_paged_attention,
    sdpa_paged_attention,
    write_kv,
)
from cadence.statemachine.errors import ConfigError

BLOCK_SIZE = 4
NUM_BLOCKS = 40
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8


def dense_attention(q, k, v, scale):
    """Causal attention of the last q.shape[0] positions of a contiguous sequence k/v."""
    q_len, seq_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = torch.empty_like(q)
    for h in range(q.shape[1]):
        for j in range(q_len):
            pos = seq_len - q_len + j
            weights = ((k[: pos + 1, h] @ q[j, h]) * scale).softmax(0)
            out[j, h] = weights @ v[: pos + 1, h]
    return out


MIXED = [(1, 9), (1, 1), (5, 14), (7, 7)]  # (query len, context len): decodes first, as the runner orders them


def paged_case(seed: int = 0, specs=MIXED):
    """A batch of (query len, context len) sequences, by default two decodes, a chunk after a
    cached prefix and a fresh prefill; blocks shuffled."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    blocks = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables, contexts, queries, slots = [], [], [], []
    for q_len, seq_len in specs:
        n = math.ceil(seq_len / BLOCK_SIZE)
        table, blocks = blocks[:n], blocks[n:]
        k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        seq_slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len)])
        write_kv(k_cache, v_cache, k, v, seq_slots)
        tables.append(table)
        contexts.append((k, v))
        queries.append(torch.randn(q_len, NUM_Q_HEADS, HEAD_DIM, generator=gen))
        slots.append(seq_slots[seq_len - q_len :])
    max_blocks = max(len(t) for t in tables)
    q_lens = torch.tensor([q for q, _ in specs], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).int()]),
        seq_lens=torch.tensor([s for _, s in specs], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=int(q_lens.max()),
        max_seq_len=max(s for _, s in specs),
        num_decode_seqs=sum(q == 1 for q, _ in specs),
    )
    return torch.cat(queries), k_cache, v_cache, meta, contexts


@pytest.mark.parametrize(
    "specs", [MIXED, [(1, 9), (1, 1), (1, 16), (1, 17)], [(1, 16)], [(5, 14), (7, 7)], [(3, 3)]],
    ids=["mixed", "decodes-only", "one-decode-filling-its-blocks", "prefills-only", "one-prefill"])
@pytest.mark.parametrize("attention", [reference_paged_attention, sdpa_paged_attention])
def test_paged_attention_matches_dense(attention, specs):
    query, k_cache, v_cache, meta, contexts = paged_case(specs=specs)
    scale = HEAD_DIM**-0.5
    out = attention(query, k_cache, v_cache, meta, scale)
    starts = meta.query_start_loc.tolist()
    for seq, (k, v) in enumerate(contexts):
        q = query[starts[seq] : starts[seq + 1]]
        torch.testing.assert_close(out[starts[seq] : starts[seq + 1]], dense_attention(q, k, v, scale))


def test_write_kv_places_each_token_at_its_slot():
    k_cache = torch.zeros(3, BLOCK_SIZE, 1, 2)
    v_cache = torch.zeros_like(k_cache)
    key = torch.arange(6.0).view(3, 1, 2)
    write_kv(k_cache, v_cache, key, -key, torch.tensor([9, 0, 4]))
    assert torch.equal(k_cache[2, 1, 0], key[0, 0])
    assert torch.equal(k_cache[0, 0, 0], key[1, 0])
    assert torch.equal(v_cache[1, 0, 0], -key[2, 0])
    assert int((k_cache != 0).sum()) == 5  # key[1] holds one zero


def test_backend_selection():
    assert get_attention_backend("reference").paged_attention is reference_paged_attention
    assert get_attention_backend("sdpa").paged_attention is sdpa_paged_attention
    triton = get_attention_backend("triton")
    assert triton.paged_attention.__module__ == "cadence.gpu.triton_attention"
    with pytest.raises(ConfigError, match="unknown attention backend 'flash'"):
        get_attention_backend("flash")


def test_sdpa_layout_is_computed_once_per_step_and_shared_by_layers():
    query, k_cache, v_cache, meta, _ = paged_case()
    scale = HEAD_DIM**-0.5
    first = sdpa_paged_attention(query, k_cache, v_cache, meta, scale)
    layout = meta.padded_layout
    assert layout is not None and layout.num_decodes == 2 and layout.width == 16
    second = sdpa_paged_attention(query, k_cache, v_cache, meta, scale)
    assert meta.padded_layout is layout
    torch.testing.assert_close(first, second)
