"""Fused Triton kernels for the elementwise work between the matrix multiplies.

Unfused, one RMSNorm is about seven kernels (cast, square, mean, rsqrt, scale,
cast back, weight) and SwiGLU's activation two; in a decode step of a small
model these launches, not their bytes, dominate the time outside attention and
the matrix multiplies. Here each is one kernel:

- `rms_norm(x, weight, eps, residual=None)`: one program per row. With
  `residual`, it first forms `residual + x` (rounded to the input dtype, as the
  unfused `hidden + attn` is) and returns it beside the normalised rows.
- `silu_and_mul(gate, up)`: `silu(gate) * up`, each rounded to the input dtype
  where the unfused ops round.

Both compute in float32 and round exactly where `cadence.gpu.model`'s torch
path rounds, so results differ from it only by the order of the float32 sum
of squares. Importing this module decides whether kernels compile for the GPU
or run in Triton's CPU interpreter (TRITON_INTERPRET=1 before the first import).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns one SwiGLU program handles.
SILU_BLOCK = 1024


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, n_cols, x_stride, res_stride,
                     out_stride, sum_stride, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * sum_stride + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / n_cols
    normed = (x32 * tl.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(gate_ptr, up_ptr, out_ptr, n_cols, gate_stride, up_stride, out_stride,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gate_ptr + row * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * up_stride + cols, mask=mask, other=0.0)
    activated = (g / (1.0 + tl.exp(-g))).to(up_ptr.dtype.element_ty)
    y = activated.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dim() != 2:
        raise ValueError(f"{name} must be [rows, columns], got shape {tuple(t.shape)}")
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """RMSNorm of the rows of `x` [T, H] scaled by `weight` [H]. With `residual`,
    normalise `x + residual` instead and return (normalised, x + residual)."""
    x = _rows(x, "x")
    rows, cols = x.shape
    if weight.shape != (cols,):
        raise ValueError(f"weight must have shape ({cols},), got {tuple(weight.shape)}")
    out = torch.empty_like(x)
    total = None
    if residual is not None:
        residual = _rows(residual, "residual")
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} differs from x's {tuple(x.shape)}")
        total = torch.empty_like(x)
    if rows:
        _rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out,
            total if total is not None else out, cols, x.stride(0),
            residual.stride(0) if residual is not None else 0, out.stride(0),
            total.stride(0) if total is not None else 0, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(cols))
    return out if residual is None else (out, total)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [T, I] tensors, in one kernel."""
    gate, up = _rows(gate, "gate"), _rows(up, "up")
    if gate.shape != up.shape:
        raise ValueError(f"gate shape {tuple(gate.shape)} differs from up's {tuple(up.shape)}")
    rows, cols = gate.shape
    out = torch.empty_like(up)
    if rows:
        block = min(SILU_BLOCK, triton.next_power_of_2(cols))
        _silu_and_mul_kernel[(rows, triton.cdiv(cols, block))](
            gate, up, out, cols, gate.stride(0), up.stride(0), out.stride(0), BLOCK=block)
    return out
