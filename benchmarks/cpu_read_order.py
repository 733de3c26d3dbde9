"""How the order of a paged cache's reads decides the memory's pace on this CPU.

`cpu_attention_read.py` finds the decode attention kernel reading a cold cache at
about half the pace of a plain streaming read, whatever its software prefetches do.
This one takes the kernel out and reads the same kind of memory (blocks of a
cache in a random order, one mapping far larger than the caches) in two orders
within a block: in address order, and head by head as the kernel reads the
cache's [slot][kv_head][dim] layout (each slot's share of one head, then the
next head). Each order runs without software prefetches and with one prefetch
(into L2) a line, `--ahead` lines on in address order, as the kernel's prefetches
are spread. The reading loop is plain C (`cpu_read_order.c`, built here with the
system's compiler), one thread.

One JSON line per order and prefetch distance, the best of `--reps` alternated
passes, then one for the streaming read:

    python benchmarks/cpu_read_order.py --mib 288 --block-bytes 8192 --slot-bytes 512 --head-bytes 128

The defaults are the 125M benchmark model's bfloat16 key blocks (16 slots of 4 KV
heads of 64 values).
"""

from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path

import torch
from cpu_peers import compiled, emit, memory_bandwidth_gb_s

from cadence.gpu.host_memory import zeroed_cpu_tensor

SOURCE = Path(__file__).with_name("cpu_read_order.c")


def build() -> ctypes.CDLL:
    """The reading loop, compiled for this CPU once per source."""
    lib = compiled(SOURCE)
    lib.read_lines.restype = ctypes.c_uint64
    lib.read_lines.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 6
    return lib


def read_lines(lib: ctypes.CDLL, memory: torch.Tensor, order: torch.Tensor, *, block_bytes: int, slot_bytes: int,
               head_bytes: int, by_head: bool, ahead: int) -> int:
    """One pass over `memory` (uint8) in `order` (int64 block indices); the checksum."""
    return lib.read_lines(memory.data_ptr(), order.data_ptr(), order.numel(), block_bytes, slot_bytes, head_bytes,
                          int(by_head), ahead)


def check_shape(*, mib: int, block_bytes: int, slot_bytes: int, head_bytes: int) -> None:
    """Whole lines, slots and blocks: each line is read exactly once in every order."""
    if head_bytes % 64 or slot_bytes % head_bytes or block_bytes % slot_bytes or (mib << 20) % block_bytes:
        raise SystemExit("--head-bytes must be whole 64-byte lines, --slot-bytes whole heads, --block-bytes "
                         "whole slots and --mib whole blocks")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=288, help="the cache's size (far above the last-level cache)")
    parser.add_argument("--block-bytes", type=int, default=8192)
    parser.add_argument("--slot-bytes", type=int, default=512)
    parser.add_argument("--head-bytes", type=int, default=128)
    parser.add_argument("--ahead", type=int, nargs="+", default=[0, 256],
                        help="prefetch distances in lines (0: no software prefetch)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--huge-pages", action="store_true",
                        help="advise the mapping for huge pages (the runner's KV cache keeps 4 KiB pages)")
    args = parser.parse_args(argv)
    check_shape(mib=args.mib, block_bytes=args.block_bytes, slot_bytes=args.slot_bytes, head_bytes=args.head_bytes)

    lib = build()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    # One private mapping, as the runner allocates its KV cache.
    memory = zeroed_cpu_tensor((args.mib << 20,), torch.uint8, huge_pages=args.huge_pages)
    memory.copy_(torch.randint(0, 256, memory.shape, dtype=torch.uint8, generator=generator))
    order = torch.randperm((args.mib << 20) // args.block_bytes, generator=generator)
    cases = [(by_head, ahead) for by_head in (False, True) for ahead in args.ahead]
    best = {case: float("inf") for case in cases}
    sums = set()
    for _ in range(args.reps):
        for by_head, ahead in cases:
            start = time.perf_counter()
            sums.add(read_lines(lib, memory, order, block_bytes=args.block_bytes, slot_bytes=args.slot_bytes,
                                head_bytes=args.head_bytes, by_head=by_head, ahead=ahead))
            best[(by_head, ahead)] = min(best[(by_head, ahead)], time.perf_counter() - start)
    if len(sums) != 1:
        raise SystemExit("the orders read different lines")
    for (by_head, ahead), seconds in best.items():
        emit(bench="cpu_read_order", order="by_head" if by_head else "address", prefetch_ahead_lines=ahead,
             gbps=round(memory.numel() / seconds / 1e9, 2), mib=args.mib, block_bytes=args.block_bytes,
             slot_bytes=args.slot_bytes, head_bytes=args.head_bytes, huge_pages=args.huge_pages, threads=1)
    emit(bench="cpu_stream_read", gbps=round(memory_bandwidth_gb_s(), 2), threads=1)


if __name__ == "__main__":
    main()
