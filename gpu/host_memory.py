"""Host memory of a CPU runner: freed tensors kept for reuse, and the KV cache's
first blocks faulted in before the first step.

A page of anonymous memory costs a page fault the first time it is written: the
kernel finds a page, zeroes it and maps it. On the 2-core VM this project is
measured on, that took 1.2-6.7 us per 4 KiB page (3.4 to 0.6 GB/s; the slow end
where the host had not backed the memory lately), and a CPU engine's steps write
fresh memory in two ways:

- glibc's malloc serves a request above its mmap threshold (128 KiB, rising as
  large blocks are freed, to at most 32 MiB) with a fresh mapping that it unmaps
  when freed, and gives the top of a heap back to the kernel once 128 KiB lies
  free there. A step's activations (an 8,192-token prefill of the 125M
  benchmark model makes tensors of 25-42 MB) were faulted in again and again:
  330 k faults in the first 64-sequence run of `cpu_peers.py offline`, 250 k in
  each run after it. `keep_freed_memory` raises both thresholds, so that freed
  tensors stay in the heap and later steps reuse their pages: the process keeps
  its high-water mark, as a server's allocator does.
- The KV cache is one mapping left untouched until used (`zeroed_cpu_tensor`),
  and the block pool hands out never-used blocks in id order before it reuses
  any (cached prefixes live longest that way), so each block's pages fault when
  a step first writes them, inside the step's kernels. `prefault` faults in the
  first blocks of every layer, as many as the running requests can hold at
  once (at most as many bytes as the weights take, so that start-up at most
  doubles the footprint: a default `LLM` of the 125M model faulted in 1 GiB
  and peaked at 1.8 GB against 1.0 before that bound), in one call per layer (MADV_POPULATE_WRITE, Linux 5.14 and later) when
  the runner is built: no step meets those faults, and memory the machine cannot
  give shows at start, not in a step.

Measured on that VM (`cpu_peers.py offline`, 125M model, float32, the engine alone,
old and new code alternated in fresh processes, 3 runs each): the 64-sequence run
took 48 k page faults instead of 330 k, and ran at 824-917 output tokens/s against
794-890 on 2 threads (medians 862 and 822), 498-538 against 494-526 on one (523 and
508). The price: a peak RSS 100-250 MB higher offline (freed memory stays with the
process), 34 MB serving 64 requests at concurrency 32, and 0.1-0.7 s at start for the
408 MiB faulted in.

Kept memory has a shape cost besides: torch asks malloc for 64-byte-aligned blocks,
which glibc serves from a block a little larger than the one it returns, so a freed
block is a little too small for the next request of the same size. A loop making and
freeing one 96 MiB tensor settled at 8 copies in the heap (8 and 24 MiB ones do the
same by default; above 32 MiB the default maps them afresh instead). A 32 MiB
threshold, which keeps the default's mapping of the largest tensors, measured 5%
slower at batch 64 on 2 threads (878-924 tok/s against 895-988) for 30-50 MB less
peak RSS, so the threshold is 1 GiB.

Both apply only where they can: glibc for the first, Linux for the second;
elsewhere the runner works as before. The user's own malloc settings
(`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, `GLIBC_TUNABLES`) are left
as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
import os
import sys
from typing import Sequence

import torch

_log = logging.getLogger("cadence.gpu")

# mallopt's parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Free bytes at a heap's top before malloc gives them back, and the size from which
# it maps a request on its own: both past any one step's needs.
TRIM_THRESHOLD = 2**31 - 1
MMAP_THRESHOLD = 1 << 30
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
# madvise's "fault these pages in, writable" (Linux 5.14).
MADV_POPULATE_WRITE = 23
# The most KV cache memory faulted in at start: beyond it, blocks fault on first use.
PREFAULT_MAX_BYTES = 1 << 30

_kept: bool | None = None  # what keep_freed_memory found: None until asked


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse (once per process); whether it does."""
    global _kept
    if _kept is None:
        libc = _libc()
        user = [name for name in USER_SETTINGS if name in os.environ]
        if libc is None or not hasattr(libc, "mallopt") or user:
            _kept = False
            if user:
                _log.info("host memory: malloc left to the user's settings (%s)", ", ".join(user))
        else:
            _kept = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
                libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _kept


def release_free_memory() -> bool:
    """Give the kernel back the free pages malloc holds anywhere in its heaps (glibc's
    malloc_trim), once the model is built: loading and packing a checkpoint frees
    copies of the weights in the middle of the heap, where the trim threshold (which
    looks at a heap's top) never returns them; whether glibc did give some back."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    return bool(libc.malloc_trim(0))


def prefault(slabs: list[torch.Tensor], num_blocks: int) -> int:
    """Fault in blocks [0, num_blocks) of each slab (a layer's keys or values: [blocks,
    ...], contiguous, page-aligned as `zeroed_cpu_tensor` maps them); the bytes faulted
    in, 0 where the kernel cannot (the blocks then fault on first use)."""
    libc = _libc()
    if libc is None or num_blocks < 1:
        return 0
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = os.sysconf("SC_PAGE_SIZE")
    done = 0
    for slab in slabs:
        start = slab.data_ptr()
        length = min(num_blocks, slab.shape[0]) * slab.stride(0) * slab.element_size()
        aligned = start - start % page
        if madvise(aligned, length + start - aligned, MADV_POPULATE_WRITE) != 0:
            return done  # EINVAL before Linux 5.14: first use faults them, as without this
        done += length
    return done


def zeroed_cpu_tensor(shape: Sequence[int], dtype: torch.dtype, huge_pages: bool = False) -> torch.Tensor:
    """A zero CPU tensor in anonymous memory: the kernel hands out zero pages as they
    are first touched, so a large cache costs nothing until used (torch.zeros writes every byte).

    `huge_pages` asks the kernel (where transparent huge pages are on "madvise" or
    "always") to back the memory 2 MiB at a time. The KV cache does not ask: where the
    kernel compacts memory to find a huge page at the fault ("defrag" on "madvise", a
    common default), the first touch is the cost. Measured on a 2-core VM: 0.2 GB/s
    first-touch with huge pages against 3.4 GB/s with 4 KiB pages, so the 200 MB of
    cache a 64-sequence batch of the 125M model fills cost ~1 s of its ~12 s run;
    without them the run was 8-20% faster. What huge pages save (TLB misses of the
    attention's reads, page faults of 4 KiB) was inside the noise on both machines
    measured. The mapping is private: a shared anonymous mapping is shmem, which
    `madvise` leaves at 4 KiB pages where shmem's own huge pages are off.
    """
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    memory = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and hasattr(memory, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(memory, dtype=dtype).view(*shape)
