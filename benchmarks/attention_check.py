"""Check the Triton paged-attention kernels against float64 and time them.

On a CUDA machine: checks several mixed batches (fresh random inputs each) in bfloat16,
float16 and float32, then times decode attention, a prefill batch, the cache write and a
plain device copy (the bandwidth ceiling). On a CPU, `--smoke` runs tiny checks and
timings through Triton's interpreter. Prints one JSON object per line.

    python benchmarks/attention_check.py            # on the GPU machine
    python benchmarks/attention_check.py --sweep    # also try decode tile shapes
    python benchmarks/attention_check.py --smoke    # anywhere, tiny
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

if not torch.cuda.is_available():
    # Must precede the first import of triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from cadence.gpu.attention import AttentionMetadata  # noqa: E402
from cadence.gpu import triton_attention  # noqa: E402
from cadence.gpu.worklist import BalanceConfig, build_worklist  # noqa: E402

# Qwen3-0.6B attention.
QWEN3_06B = dict(num_q_heads=16, num_kv_heads=8, head_dim=128)
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def emit(**record) -> None:
    """Print one result as a JSON line."""
    print(json.dumps(record), flush=True)


def make_inputs(specs, *, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device,
                num_decodes, seed):
    """Random query, caches and metadata for sequences given as (num_cached, q_len).

    The first num_decodes specs must have q_len 1. Blocks are assigned in a random order.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    seq_lens = [cached + q_len for cached, q_len in specs]
    q_lens = [q_len for _, q_len in specs]
    blocks_per_seq = [math.ceil(length / block_size) for length in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    order = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    tables = torch.zeros(len(specs), max(blocks_per_seq), dtype=torch.int32, device=device)
    used = 0
    for seq, count in enumerate(blocks_per_seq):
        tables[seq, :count] = order[used:used + count]
        used += count
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen,
                        device=device).to(dtype)
    starts = torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32)
    slots = torch.cat([_slots(tables[s], length, block_size)[length - q_len:]
                       for s, (length, q_len) in enumerate(zip(seq_lens, q_lens))])
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        num_decode_seqs=num_decodes)
    return query, k_cache, v_cache, meta


def _slots(table, length, block_size):
    positions = torch.arange(length, device=table.device)
    return table.long()[positions // block_size] * block_size + positions % block_size


def reference(query, k_cache, v_cache, meta, scale):
    """Float64 causal attention over each sequence's context gathered through its table."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = query.shape[1] // num_kv_heads
    flat_k = k_cache.reshape(-1, num_kv_heads, head_dim)
    flat_v = v_cache.reshape(-1, num_kv_heads, head_dim)
    starts = meta.query_start_loc.tolist()
    out = torch.empty(query.shape, dtype=torch.float64, device=query.device)
    for seq, length in enumerate(meta.seq_lens.tolist()):
        slots = _slots(meta.block_tables[seq], length, block_size)
        q = query[starts[seq]:starts[seq + 1]].double().transpose(0, 1)
        k = flat_k[slots].double().repeat_interleave(group, 1).transpose(0, 1)
        v = flat_v[slots].double().repeat_interleave(group, 1).transpose(0, 1)
        positions = torch.arange(length - q.shape[1], length, device=query.device)
        visible = torch.arange(length, device=query.device)[None, :] <= positions[:, None]
        out[starts[seq]:starts[seq + 1]] = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=visible, scale=scale).transpose(0, 1)
    return out


def decode_worklist(meta, num_decodes, device, balance=None):
    """A length-balanced work list over the batch's decodes, on `device`."""
    balance = balance or BalanceConfig()
    lengths = meta.seq_lens[:num_decodes].tolist()
    return build_worklist(lengths, balance.capacity(num_decodes), balance.granularity,
                          balance.min_tile_tokens).to(device)


def check_attention(name, specs, *, num_decodes, dtype, device, seed, num_kv_splits=None,
                    block_size=16, balanced=False, **heads):
    """Compare paged_attention on fresh random inputs with float64; True when within tolerance."""
    query, k_cache, v_cache, meta = make_inputs(
        specs, block_size=block_size, dtype=dtype, device=device, num_decodes=num_decodes,
        seed=seed, **heads)
    scale = heads["head_dim"] ** -0.5
    out = torch.full_like(query, float("nan"))
    worklist = decode_worklist(meta, num_decodes, device) if balanced else None
    triton_attention.paged_attention(query, k_cache, v_cache, meta, scale, out=out,
                                     num_kv_splits=num_kv_splits, worklist=worklist)
    expected = reference(query, k_cache, v_cache, meta, scale)
    unwritten = int(out.isnan().sum())
    row_error = ((out.double() - expected).abs().amax(-1) / expected.abs().amax(-1)).max()
    error = float(row_error)
    ok = unwritten == 0 and error < TOLERANCE[dtype]
    emit(check=name, dtype=DTYPE_NAMES[dtype], block_size=block_size, **heads,
         num_seqs=len(specs), num_decodes=num_decodes, num_kv_splits=num_kv_splits,
         balanced=balanced, max_row_rel_error=error, tolerance=TOLERANCE[dtype], unwritten=unwritten, ok=ok)
    return ok


def check_write_kv(*, dtype, device, seed, num_tokens, block_size, num_kv_heads, head_dim):
    """Check that write_kv puts each token's key and value exactly at its slot."""
    gen = torch.Generator(device=device).manual_seed(seed)
    num_blocks = math.ceil(num_tokens / block_size) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=dtype, device=device)
    v_cache = torch.zeros(shape, dtype=dtype, device=device)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=device)[:num_tokens]
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen, device=device)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen, device=device)
    key, value = key.to(dtype), value.to(dtype)
    triton_attention.write_kv(k_cache, v_cache, key, value, slots)
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    ok = bool(torch.equal(flat_k[slots], key) and torch.equal(flat_v[slots], value))
    emit(check="write_kv", dtype=DTYPE_NAMES[dtype], num_tokens=num_tokens, ok=ok)
    return ok


def run_checks(device, smoke: bool) -> bool:
    """Run every correctness check; True when all pass."""
    results = []
    seed = int(time.time_ns() % 2**31)
    emit(event="checks", seed=seed)
    if smoke:
        small = dict(num_q_heads=4, num_kv_heads=2, head_dim=64)
        results.append(check_attention("mixed", [(5, 1), (40, 1), (0, 21), (17, 9)],
                                       num_decodes=2, dtype=torch.float32, device=device,
                                       seed=seed, **small))
        results.append(check_attention("split-decodes", [(70, 1), (3, 1)], num_decodes=2,
                                       dtype=torch.float32, device=device, seed=seed + 1,
                                       num_kv_splits=2, **small))
        results.append(check_attention("balanced-decodes", [(300, 1), (3, 1), (140, 1), (9, 4)],
                                       num_decodes=3, dtype=torch.float32, device=device,
                                       seed=seed + 2, balanced=True, **small))
        results.append(check_write_kv(dtype=torch.float32, device=device, seed=seed,
                                      num_tokens=10, block_size=16, num_kv_heads=2,
                                      head_dim=64))
        return all(results)
    gen = torch.Generator().manual_seed(seed)
    decodes = [(int(n), 1) for n in torch.randint(0, 2000, (64,), generator=gen)]
    prefills = [(0, 512), (1000, 256), (37, 1), (15, 17)]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        results.append(check_attention("decodes", decodes, num_decodes=64, dtype=dtype,
                                       device=device, seed=seed, **QWEN3_06B))
        results.append(check_attention("mixed-gqa8-bs32", decodes[:32] + prefills,
                                       num_decodes=32, dtype=dtype, device=device,
                                       seed=seed + 1, block_size=32, num_q_heads=32,
                                       num_kv_heads=4, head_dim=128))
        results.append(check_attention("mixed-mha-d64", decodes[:8] + prefills, num_decodes=8,
                                       dtype=dtype, device=device, seed=seed + 2,
                                       num_q_heads=8, num_kv_heads=8, head_dim=64))
        results.append(check_attention("long-decodes-auto-split",
                                       [(8000, 1), (4000, 1), (1, 1)], num_decodes=3,
                                       dtype=dtype, device=device, seed=seed + 3, **QWEN3_06B))
        results.append(check_attention("decodes-forced-split", decodes[:16] + prefills[:2],
                                       num_decodes=16, dtype=dtype, device=device,
                                       seed=seed + 4, num_kv_splits=5, **QWEN3_06B))
        results.append(check_attention("decodes-balanced", decodes + prefills[:2],
                                       num_decodes=64, dtype=dtype, device=device,
                                       seed=seed + 5, balanced=True, **QWEN3_06B))
        results.append(check_write_kv(dtype=dtype, device=device, seed=seed,
                                      num_tokens=1000, block_size=16, num_kv_heads=8,
                                      head_dim=128))
    return all(results)


def measure(fn, device) -> float:
    """Median milliseconds per call."""
    if device.type == "cuda":
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[1]


def measure_graph(fn) -> float | None:
    """Median milliseconds per replay of fn captured in a CUDA graph (no launch overhead)."""
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as error:  # report and continue: the eager timing still stands
        emit(event="graph-timing-failed", error=repr(error))
        return None


def time_decode(*, batch, context, dtype, device, block_size=16, num_kv_splits=None,
                config=triton_attention.DECODE_CONFIG, heads=QWEN3_06B, graph=False,
                label="decode", lengths=None, balance=None):
    """Time decode attention over contexts of about `context` tokens (or of `lengths`);
    report GB/s. `balance` (a BalanceConfig) cuts the contexts into balanced tiles."""
    gen = torch.Generator().manual_seed(0)
    if lengths is None:
        jitter = torch.randint(-context // 10, context // 10 + 1, (batch,), generator=gen)
        lengths = [max(context + int(j), 0) for j in jitter]
    specs = [(length, 1) for length in lengths]
    query, k_cache, v_cache, meta = make_inputs(
        specs, block_size=block_size, dtype=dtype, device=device, num_decodes=batch, seed=0,
        **heads)
    out = torch.empty_like(query)
    scale = heads["head_dim"] ** -0.5
    worklist, build_us = None, None
    if balance is not None:
        started = time.perf_counter()
        worklist = decode_worklist(meta, batch, device, balance)
        build_us = (time.perf_counter() - started) * 1e6

    def step():
        triton_attention.paged_attention(query, k_cache, v_cache, meta, scale, out=out,
                                         num_kv_splits=num_kv_splits, decode_config=config,
                                         worklist=worklist)

    ms = measure(step, device)
    elt = query.element_size()
    num_tokens = int(meta.seq_lens.sum())
    kv_bytes = 2 * num_tokens * heads["num_kv_heads"] * heads["head_dim"] * elt
    io_bytes = 2 * query.numel() * elt + meta.block_tables.numel() * 4
    record = dict(bench=label, dtype=DTYPE_NAMES[dtype], batch=batch, mean_context=num_tokens / batch,
                  block_size=block_size, **heads, num_kv_splits=num_kv_splits,
                  config=_config_dict(config), median_ms=ms,
                  balanced=balance is not None, worklist_build_us=build_us,
                  num_tiles=worklist.num_tiles if worklist is not None else None,
                  gb_moved=(kv_bytes + io_bytes) / 1e9,
                  gb_per_s=(kv_bytes + io_bytes) / (ms * 1e-3) / 1e9)
    if graph and device.type == "cuda":
        graph_ms = measure_graph(step)
        if graph_ms is not None:
            record.update(graph_median_ms=graph_ms,
                          graph_gb_per_s=(kv_bytes + io_bytes) / (graph_ms * 1e-3) / 1e9)
    emit(**record)


def time_prefill(*, num_prompts, prompt_len, dtype, device, heads=QWEN3_06B, block_size=16):
    """Time whole-prompt prefill attention; report TFLOP/s beside torch's unpaged kernel."""
    specs = [(0, prompt_len)] * num_prompts
    query, k_cache, v_cache, meta = make_inputs(
        specs, block_size=block_size, dtype=dtype, device=device, num_decodes=0, seed=0,
        **heads)
    out = torch.empty_like(query)
    scale = heads["head_dim"] ** -0.5
    ms = measure(lambda: triton_attention.paged_attention(query, k_cache, v_cache, meta, scale,
                                                          out=out), device)
    # Two matrix products over the causal half (including the diagonal) of each prompt.
    pairs = num_prompts * prompt_len * (prompt_len + 1) / 2
    flops = 4 * pairs * heads["num_q_heads"] * heads["head_dim"]
    record = dict(bench="prefill", dtype=DTYPE_NAMES[dtype], num_prompts=num_prompts,
                  prompt_len=prompt_len, block_size=block_size, **heads, median_ms=ms,
                  tflop_per_s=flops / (ms * 1e-3) / 1e12)
    if device.type == "cuda":
        # The same attention, contiguous and unpaged, through torch's fused kernel.
        q = query.view(num_prompts, prompt_len, heads["num_q_heads"], -1).transpose(1, 2)
        k = torch.randn(num_prompts, heads["num_kv_heads"], prompt_len, heads["head_dim"],
                        device=device, dtype=dtype)
        torch_ms = measure(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, k, is_causal=True, enable_gqa=True), device)
        record.update(torch_sdpa_median_ms=torch_ms,
                      torch_sdpa_tflop_per_s=flops / (torch_ms * 1e-3) / 1e12)
    emit(**record)


def time_write_kv(*, num_tokens, dtype, device, heads=QWEN3_06B, block_size=16):
    """Time the cache write of num_tokens tokens scattered over random slots."""
    num_kv_heads, head_dim = heads["num_kv_heads"], heads["head_dim"]
    num_blocks = math.ceil(num_tokens / block_size) * 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=dtype, device=device)
    v_cache = torch.zeros(shape, dtype=dtype, device=device)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device=device, dtype=dtype)
    value = torch.randn_like(key)
    ms = measure(lambda: triton_attention.write_kv(k_cache, v_cache, key, value, slots), device)
    moved = 4 * key.numel() * key.element_size() + slots.numel() * 8
    emit(bench="write_kv", dtype=DTYPE_NAMES[dtype], num_tokens=num_tokens, median_ms=ms,
         gb_per_s=moved / (ms * 1e-3) / 1e9)


def time_copy(device, gigabytes: float = 1.0):
    """The device copy bandwidth (bytes read plus written), the ceiling for decode."""
    src = torch.empty(int(gigabytes * 1e9) // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = measure(lambda: dst.copy_(src), device)
    emit(bench="copy", gb_moved=2 * gigabytes, median_ms=ms,
         gb_per_s=2 * gigabytes / (ms * 1e-3))


def _config_dict(config):
    """The kernel settings as a JSON-ready dict."""
    return dict(block_m=config.block_m, block_n=config.block_n, num_warps=config.num_warps,
                num_stages=config.num_stages)


def sweep_decode(device):
    """Time the main decode shape under a grid of tile shapes and pipeline depths."""
    for block_n in (16, 32, 64, 128):
        for num_warps in (2, 4, 8):
            for num_stages in (2, 3, 4):
                config = triton_attention.KernelConfig(
                    block_m=16, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
                try:
                    time_decode(batch=256, context=1000, dtype=torch.bfloat16, device=device,
                                config=config, label="decode-sweep")
                except Exception as error:  # a shape the compiler rejects: note and go on
                    emit(bench="decode-sweep", config=_config_dict(config),
                         error=repr(error)[:300])


def main() -> int:
    """Parse arguments, run the checks and the timings; exit non-zero if a check fails."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes; runs on a CPU through the Triton interpreter")
    parser.add_argument("--sweep", action="store_true", help="also time decode tile shapes")
    parser.add_argument("--skip-checks", action="store_true")
    args = parser.parse_args()
    has_cuda = torch.cuda.is_available()
    if not has_cuda and not args.smoke:
        parser.error("no CUDA device: run with --smoke to use the Triton interpreter")
    device = torch.device("cuda" if has_cuda else "cpu")
    emit(event="start", device=torch.cuda.get_device_name() if has_cuda else "cpu",
         torch=torch.__version__, triton=triton.__version__,
         interpreter=os.environ.get("TRITON_INTERPRET") == "1")

    ok = True if args.skip_checks else run_checks(device, args.smoke)
    if args.smoke:
        time_decode(batch=4, context=40, dtype=torch.float32, device=device,
                    heads=dict(num_q_heads=4, num_kv_heads=2, head_dim=64))
        time_decode(batch=4, context=0, lengths=[10, 300, 40, 150], dtype=torch.float32,
                    device=device, heads=dict(num_q_heads=4, num_kv_heads=2, head_dim=64),
                    balance=BalanceConfig(), label="decode-mixed-balanced")
        time_write_kv(num_tokens=8, dtype=torch.float32, device=device,
                      heads=dict(num_kv_heads=2, head_dim=64))
    else:
        time_copy(device)
        time_decode(batch=256, context=1000, dtype=torch.bfloat16, device=device, graph=True)
        # The nano workload's decode mix: contexts spread over [100, 1024] plus outputs.
        mixed = torch.randint(100, 1280, (256,), generator=torch.Generator().manual_seed(1)).tolist()
        time_decode(batch=256, context=0, lengths=mixed, dtype=torch.bfloat16, device=device,
                    graph=True, num_kv_splits=1, label="decode-mixed-unsplit")
        for tiles_per_seq in (2, 4):
            time_decode(batch=256, context=0, lengths=mixed, dtype=torch.bfloat16, device=device,
                        graph=True, balance=BalanceConfig(tiles_per_seq=tiles_per_seq),
                        label=f"decode-mixed-balanced-x{tiles_per_seq}")
        time_decode(batch=64, context=4000, dtype=torch.bfloat16, device=device)
        time_decode(batch=4, context=16000, dtype=torch.bfloat16, device=device)
        time_decode(batch=4, context=16000, dtype=torch.bfloat16, device=device,
                    num_kv_splits=1, label="decode-unsplit")
        time_prefill(num_prompts=4, prompt_len=2048, dtype=torch.bfloat16, device=device)
        time_write_kv(num_tokens=8192, dtype=torch.bfloat16, device=device)
        if args.sweep:
            sweep_decode(device)
    emit(event="done", all_checks_ok=ok)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
