"""How fast the CPU decode attention kernel reads a cold paged KV cache.

A decode step reads every layer's keys and values of every running sequence
once; at batch 64 and a few hundred positions that is hundreds of megabytes,
far more than the last-level cache holds, so the kernel's speed there is a
matter of memory bandwidth. A benchmark over one layer's cache measures
something else: the cache fits in L3 and reads from it run at twice the
memory's pace. This one keeps `--layers` layers of random-valued caches (the
blocks of each sequence scattered in random order, as a long-running engine
leaves them, in one private mapping of 4 KiB pages as the runner's cache is) and
attends over all of them per step, as the model does; it
prints the bytes read per second next to a plain streaming read
(`cpu_peers.memory_bandwidth_gb_s`, the figure `cpu_peers.py limit` compares
the batch-1 decode with) on the same threads.

One JSON line per block size, then one for the streaming read:

    python benchmarks/cpu_attention_read.py --threads 1 --block-sizes 16 64
"""

from __future__ import annotations

import argparse
import time

import torch
from cpu_peers import emit, memory_bandwidth_gb_s

from cadence.gpu.runner import zeroed_cpu_tensor


def attention_read(kernels, *, batch: int, context: int, block_size: int, layers: int, heads: int,
                   kv_heads: int, head_dim: int, dtype: torch.dtype, steps: int, seed: int = 0) -> dict:
    """Time `steps` decode steps of `layers` layers' attention over cold caches."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    # One mapping for every layer's keys and values, as the runner allocates its cache
    # (`zeroed_cpu_tensor`: private, 4 KiB pages).
    memory = zeroed_cpu_tensor((layers, 2, num_blocks, block_size, kv_heads, head_dim), dtype)
    memory.copy_(torch.randn(memory.shape, generator=generator).to(dtype))
    caches = [(memory[layer, 0], memory[layer, 1]) for layer in range(layers)]
    tables = torch.randperm(num_blocks, generator=generator).to(torch.int32).view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32)
    query = torch.randn(batch, heads, head_dim, generator=generator).to(dtype)
    scale = head_dim ** -0.5

    def step():
        for k_cache, v_cache in caches:
            kernels.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale)

    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    seconds = (time.perf_counter() - start) / steps
    read = layers * 2 * batch * context * kv_heads * head_dim * dtype.itemsize
    return dict(step_ms=round(seconds * 1e3, 3), gbps=round(read / seconds / 1e9, 2),
                cache_mib=round(2 * layers * num_blocks * block_size * kv_heads * head_dim * dtype.itemsize
                                / (1 << 20), 1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)

    from cadence.gpu import cpu_kernels

    kernels = cpu_kernels.load()
    if kernels is None:
        raise SystemExit(f"the CPU kernels could not be built: {cpu_kernels.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    where = dict(threads=args.threads, dtype=args.dtype, batch=args.batch, context=args.context,
                 layers=args.layers)
    for block_size in args.block_sizes:
        figures = attention_read(kernels, batch=args.batch, context=args.context, block_size=block_size,
                                 layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                                 head_dim=args.head_dim, dtype=getattr(torch, args.dtype), steps=args.steps)
        emit(bench="cpu_attention_read", block_size=block_size, **where, **figures)
    emit(bench="cpu_stream_read", gbps=round(memory_bandwidth_gb_s(), 2), threads=args.threads)


if __name__ == "__main__":
    main()
