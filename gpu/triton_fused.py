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
- `rope_and_write_kv(q, k, v, cos, sin, ...)`: the attention block's work between
  the QKV projections and the attention kernel, one program per token: optional
  per-head RMSNorm of queries and keys (Qwen3's q_norm / k_norm), rotary embedding
  of both, queries written back in place and keys and values stored at the token's
  cache slot. Unfused that is about twenty kernels per layer.

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


@triton.jit
def _norm_halves(x1, x2, w_ptr, offs_half, eps, HEAD_DIM: tl.constexpr, dtype: tl.constexpr):
    # RMSNorm over each head's whole row, given as its two halves [heads, D/2]; rounds
    # where RMSNorm's torch path does: the normalised row, then the product with weight.
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    mean_square = (tl.sum(a1 * a1, axis=1) + tl.sum(a2 * a2, axis=1)) / HEAD_DIM
    inv = tl.rsqrt(mean_square + eps)[:, None]
    w1 = tl.load(w_ptr + offs_half).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HEAD_DIM // 2 + offs_half).to(tl.float32)[None, :]
    n1 = (a1 * inv).to(dtype).to(tl.float32)
    n2 = (a2 * inv).to(dtype).to(tl.float32)
    return (w1 * n1).to(dtype), (w2 * n2).to(dtype)


@triton.jit
def _rotate_halves(x1, x2, c, s, dtype: tl.constexpr):
    # x * cos + rotate_half(x) * sin, rounding each product and the sum to `dtype` as
    # the torch path's three ops do; cos and sin are equal over both halves.
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    out1 = (a1 * c).to(dtype).to(tl.float32) + (-a2 * s).to(dtype).to(tl.float32)
    out2 = (a2 * c).to(dtype).to(tl.float32) + (a1 * s).to(dtype).to(tl.float32)
    return out1.to(dtype), out2.to(dtype)


@triton.jit
def _rope_kv_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_cos_t, stride_sin_t,
    stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
    eps, num_q_heads, num_kv_heads,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr, HAS_NORM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    dtype = q_ptr.dtype.element_ty
    offs_half = tl.arange(0, HALF)
    c = tl.load(cos_ptr + token * stride_cos_t + offs_half).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + token * stride_sin_t + offs_half).to(tl.float32)[None, :]

    # Queries: normalised, rotated, written back in place.
    qh = tl.arange(0, BLOCK_QH)
    q_mask = (qh < num_q_heads)[:, None]
    q_rows = q_ptr + token * stride_q_t + qh[:, None] * stride_q_h
    q1 = tl.load(q_rows + offs_half[None, :], mask=q_mask, other=0.0)
    q2 = tl.load(q_rows + HALF + offs_half[None, :], mask=q_mask, other=0.0)
    if HAS_NORM:
        q1, q2 = _norm_halves(q1, q2, qw_ptr, offs_half, eps, HEAD_DIM, dtype)
    q1, q2 = _rotate_halves(q1, q2, c, s, dtype)
    tl.store(q_rows + offs_half[None, :], q1, mask=q_mask)
    tl.store(q_rows + HALF + offs_half[None, :], q2, mask=q_mask)

    # Keys and values: to the token's cache slot, unless it is a padding row.
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        kh = tl.arange(0, BLOCK_KH)
        k_mask = (kh < num_kv_heads)[:, None]
        k_rows = k_ptr + token * stride_k_t + kh[:, None] * stride_k_h
        k1 = tl.load(k_rows + offs_half[None, :], mask=k_mask, other=0.0)
        k2 = tl.load(k_rows + HALF + offs_half[None, :], mask=k_mask, other=0.0)
        if HAS_NORM:
            k1, k2 = _norm_halves(k1, k2, kw_ptr, offs_half, eps, HEAD_DIM, dtype)
        k1, k2 = _rotate_halves(k1, k2, c, s, dtype)
        kc = (k_cache_ptr + block * stride_kc_b + offset * stride_kc_s
              + kh[:, None] * stride_kc_h)
        tl.store(kc + offs_half[None, :], k1.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
        tl.store(kc + HALF + offs_half[None, :], k2.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
        offs_d = tl.arange(0, HEAD_DIM)
        v = tl.load(v_ptr + token * stride_v_t + kh[:, None] * stride_v_h + offs_d[None, :],
                    mask=k_mask, other=0.0)
        vc = (v_cache_ptr + block * stride_vc_b + offset * stride_vc_s
              + kh[:, None] * stride_vc_h + offs_d[None, :])
        tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=k_mask)


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


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, *, q_norm_weight: torch.Tensor | None = None,
                      k_norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """Rotate queries and keys, store keys and values in the paged cache; returns q.

    q [T, Hq, D], k and v [T, Hkv, D] (last dimension contiguous; q is rotated in place);
    cos, sin [T, 1, D] or [T, D] in the rotate-half layout (both halves equal);
    caches [num_blocks, block_size, Hkv, D]; slot_mapping [T] int64, negative for padding
    rows (their keys and values are not stored). With the norm weights [D], each head's
    query and key are RMS-normalised first (both weights or neither).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape != v.shape or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be "
                         f"[{num_tokens}, num_kv_heads, {head_dim}]")
    if head_dim % 2 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be an even power of two, got {head_dim}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("give both q_norm_weight and k_norm_weight, or neither")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along head_dim")
    cos2, sin2 = cos.reshape(num_tokens, head_dim), sin.reshape(num_tokens, head_dim)
    if k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"caches must be [num_blocks, block_size, {num_kv_heads}, {head_dim}], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must have shape ({num_tokens},), got "
                         f"{tuple(slot_mapping.shape)}")
    if num_tokens:
        has_norm = q_norm_weight is not None
        _rope_kv_kernel[(num_tokens,)](
            q, k, v, cos2, sin2, q_norm_weight if has_norm else q,
            k_norm_weight if has_norm else q, k_cache, v_cache, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos2.stride(0), sin2.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            eps, num_q_heads, num_kv_heads,
            HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
            BLOCK_QH=triton.next_power_of_2(num_q_heads),
            BLOCK_KH=triton.next_power_of_2(num_kv_heads), HAS_NORM=has_norm)
    return q
