"""One implementation of the Llama family: Llama 2/3, Mistral, Qwen2, Qwen3.

Module and parameter names follow the Hugging Face checkpoints
(`model.layers.N.self_attn.q_proj.weight`, ...), so weights load by name, one
tensor at a time. Projections stay separate (q/k/v/o, gate/up/down) and head
counts come from the config, so a tensor-parallel variant can shard each
module along its own dimension.

The forward pass takes the flattened tokens of a whole step (prefill chunks and
decodes together) and the paged KV cache; attention goes through a pluggable
`AttentionBackend`.
"""

from __future__ import annotations

import math
from typing import Sequence

import attrs
import torch
from torch import nn
from torch.nn import functional as F

from .attention import AttentionBackend, AttentionMetadata, last_rows_metadata
from .config import ModelConfig, RopeScaling

KVCache = tuple[torch.Tensor, torch.Tensor]
INIT_STD = 0.02


@attrs.frozen
class LastRows:
    """The rows of a step whose final hidden states are wanted: `rows` [N] int64, the
    last token row of each sequence `seqs` [N] int64 (ascending, on the model's
    device). The others need only their keys and values written."""

    rows: torch.Tensor
    seqs: torch.Tensor


class Linear(nn.Linear):
    """`nn.Linear` whose parameters are allocated but not initialised: the loader
    or `init_random_weights` fills them, so the default initialisation is wasted work
    (and on the meta device it pulls in torch's compiler stack)."""

    def reset_parameters(self) -> None:
        """Leave the parameters as allocated."""


class Embedding(nn.Embedding):
    """`nn.Embedding` whose table is allocated but not initialised (see `Linear`)."""

    def reset_parameters(self) -> None:
        """Leave the table as allocated."""


class RMSNorm(nn.Module):
    """Root-mean-square normalisation over the last dimension, computed in float32.

    `fused` (set through `CausalLM.set_fused_elementwise`) runs it as one Triton
    kernel instead of torch's chain of elementwise ops; rounding is the same.
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.fused = None  # the triton_fused module when fused, else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise `x` and scale by the learned weight."""
        if self.fused is not None:
            return self.fused.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        if x.dtype != torch.float32:
            x32 = x.float()
            return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x) for [T, H] tensors."""
        if self.fused is not None:
            return self.fused.rms_norm(x, self.weight, self.eps, residual)
        total = residual + x
        return self(total), total


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim / 2] in float32, rescaled as the checkpoint asks."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: wavelengths longer than the original context are stretched by
    # `factor`, shorter than original/high_freq_factor kept, the band between
    # interpolated smoothly.
    old_len = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    stretched = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * stretched / scaling.factor + smooth * stretched
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, stretched)


class RotaryEmbedding(nn.Module):
    """Cosine and sine tables for given positions, in the rotate-half layout."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        # Kept out of the state dict and out of dtype casts: frequencies stay float32.
        self._inv_freq = rope_inverse_frequencies(head_dim, theta, scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim] for positions [T]."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by the angles in cos/sin, pairing dimension i with i + D/2."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Grouped-query self-attention over the paged KV cache."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype=None, device=None) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.backend = backend
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        linear = dict(dtype=dtype, device=device)
        self.q_proj = Linear(config.hidden_size, q_size, bias=config.qkv_bias, **linear)
        self.k_proj = Linear(config.hidden_size, kv_size, bias=config.qkv_bias, **linear)
        self.v_proj = Linear(config.hidden_size, kv_size, bias=config.qkv_bias, **linear)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_bias, **linear)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, **linear)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, **linear)
        else:
            self.q_norm = self.k_norm = None
        self.fused = None  # the triton_fused module when fused, else None
        self.qkv_proj = None  # q, k and v as one packed product once `CausalLM.pack` ran
        self.qkv_sizes = (q_size, kv_size, kv_size)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        meta: AttentionMetadata,
        keep: LastRows | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V to the cache and attend; hidden [T, hidden_size]. With
        `keep`, every token's K/V is written but only the kept rows attend: the
        result is [len(rows), hidden_size]."""
        num_tokens = hidden.shape[0]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(hidden).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        if self.fused is not None:
            norms = {}
            if self.q_norm is not None:
                norms = dict(q_norm_weight=self.q_norm.weight, k_norm_weight=self.k_norm.weight,
                             eps=self.q_norm.eps)
            q = self.fused.rope_and_write_kv(q, k, v, *rope, k_cache, v_cache, meta.slot_mapping,
                                             **norms)
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
            self.backend.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        if keep is not None:
            if not keep.rows.shape[0]:
                return hidden.new_empty(0, hidden.shape[1])
            q, meta = q[keep.rows], last_rows_metadata(meta, keep.rows, keep.seqs)
        out = self.backend.paged_attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(q.shape[0], self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, dtype=None, device=None) -> None:
        super().__init__()
        linear = dict(bias=config.mlp_bias, dtype=dtype, device=device)
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, **linear)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, **linear)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, **linear)
        self.fused = None  # the triton_fused module when fused, else None
        self.gate_up_proj = None  # gate and up as one packed product once `CausalLM.pack` ran
        # Rows of the packed products at a time (`CausalLM.pack` sets it from the sizes).
        self.chunk_rows: int | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the feed-forward block. With `residual` (the shape of x's output), the
        output is added into `residual` in place and `residual` returned: the values of
        `residual + mlp(x)`, without a fresh tensor for the block's output."""
        if self.gate_up_proj is not None:
            rows = self.chunk_rows
            if rows is not None and x.dim() == 2 and x.shape[0] > rows:
                # A long prefill a slice of rows at a time: each slice's [rows, 2 x
                # intermediate] product stays in the cache for silu, mul, the down
                # projection and the residual add (the same values: every row's
                # products are its own).
                if residual is None:
                    return torch.cat([self._packed(part) for part in x.split(rows)])
                for part, into in zip(x.split(rows), residual.split(rows)):
                    into.add_(self._packed(part))
                return residual
            out = self._packed(x)
        elif self.fused is not None:
            out = self.down_proj(self.fused.silu_and_mul(self.gate_proj(x), self.up_proj(x)))
        else:
            out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out if residual is None else residual.add_(out)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if self.fused is not None and gate.dim() == 2:
            return self.down_proj(self.fused.silu_and_mul(gate, up))
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: attention then MLP, each with a residual."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype=None, device=None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = Attention(config, backend, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = MLP(config, dtype, device)

    def forward(self, hidden, rope, kv_cache: KVCache, meta: AttentionMetadata,
                keep: LastRows | None = None) -> torch.Tensor:
        """Run the block on hidden [T, hidden_size]; with `keep`, every token's K/V is
        written and the output is the kept rows' only."""
        attn = self.self_attn(self.input_layernorm(hidden), rope, kv_cache, meta, keep)
        if keep is not None:
            if not attn.shape[0]:
                return attn  # no row kept: only the K/V were wanted
            hidden = hidden[keep.rows]
        normed, hidden = self.post_attention_layernorm.add_and_norm(attn, hidden)
        # `hidden` is the sum add_and_norm just made, this layer's own to add into.
        return self.mlp(normed, residual=hidden)


class DecoderStack(nn.Module):
    """Embedding, the decoder layers and the final norm."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype=None, device=None) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend, dtype, device) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        # The CPU kernels' decode-step stack (`cpu_kernels.decode_stack`), set with them,
        # and whether it also takes steps with prompts as they come (`stack_takes_prompts`).
        self.decode_stack = None
        self.stack_takes_prompts = False

    def forward(self, input_ids, positions, kv_caches: Sequence[KVCache], meta,
                keep: LastRows | None = None) -> torch.Tensor:
        """Final hidden states [T, hidden_size] of tokens input_ids [T] at positions [T];
        with `keep`, those of its rows only, [len(keep.rows), hidden_size].

        Only the last layer's K/V is needed of a row that is not kept: that layer's
        attention output, o_proj and MLP are computed for the kept rows alone (in a
        step of long prompts, most of one layer's work)."""
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions, hidden.dtype)
        num_tokens = hidden.shape[0]
        if keep is not None and keep.rows.shape[0] == num_tokens:
            keep = None  # every row is kept, in order (a decode step): nothing to cut
        by_row = meta.row_block_tables is not None
        decodes = meta.num_decode_seqs == num_tokens
        if (self.decode_stack is not None and (by_row or decodes or self.stack_takes_prompts)
                and kv_caches[0][0].dtype == hidden.dtype):
            # A decode step, one whose attention runs a row at a time, or (where the
            # kernels attend prompts in one pass) any step: every layer in one call of the
            # CPU kernels (the same results), the interpreter's lock released throughout.
            cos, sin = (table.view(num_tokens, -1) for table in rope)
            tables, lens = meta.block_tables, meta.seq_lens
            extra = {}
            if by_row:
                tables, lens = meta.row_block_tables, meta.row_seq_lens
            elif not decodes:
                extra["query_start"] = meta.query_start_loc
            if keep is not None:
                extra.update(keep_rows=keep.rows, keep_tables=meta.block_tables[keep.seqs],
                             keep_lens=meta.seq_lens[keep.seqs])
            return self.decode_stack.forward(hidden, cos, sin, [cache for pair in kv_caches for cache in pair],
                                             meta.slot_mapping, tables, lens, **extra)
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            hidden = layer(hidden, rope, kv_cache, meta, keep if i == last else None)
        return self.norm(hidden) if hidden.shape[0] else hidden


class CausalLM(nn.Module):
    """A Llama-family decoder with its language-model head (tied to the embedding or not)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype=None, device=None) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config, backend, dtype, device)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device)
        )
        self.packed_head = None  # the output head as a packed product once `pack` ran

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache],
        meta: AttentionMetadata,
        keep: LastRows | None = None,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden_size], or of `keep`'s rows only; K/V of every
        token is written to `kv_caches`."""
        return self.model(input_ids, positions, kv_caches, meta, keep)

    def set_attention_backend(self, backend: AttentionBackend) -> AttentionBackend:
        """Make every layer attend through `backend`; returns the backend the first layer used before."""
        previous = self.model.layers[0].self_attn.backend
        for layer in self.model.layers:
            layer.self_attn.backend = backend
        return previous

    def set_fused_elementwise(self, on: bool, kernels=None) -> None:
        """Run every RMSNorm (with the residual add after attention), SwiGLU activation,
        and each attention block's query/key norms, rotary embedding and cache write as
        single kernels of `kernels` (default `cadence.gpu.triton_fused`; the CPU's are
        `cadence.gpu.cpu_kernels`), or as torch ops. Results agree up to the float32
        order of the norms' sums."""
        fused = None
        if on:
            if kernels is None:
                from . import triton_fused  # needs triton; imported only when asked for
                kernels = triton_fused
            fused = kernels
        self.model.decode_stack = (kernels.decode_stack(self) if on and hasattr(kernels, "decode_stack")
                                   else None)
        self.model.stack_takes_prompts = (self.model.decode_stack is not None
                                          and kernels.stack_takes_prompts(self))
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP)):
                module.fused = fused
            elif isinstance(module, Attention):
                # The Triton rotary kernel tiles whole heads: powers of two only.
                power_of_two = module.head_dim & (module.head_dim - 1) == 0
                module.fused = fused if power_of_two or getattr(fused, "ANY_HEAD_DIM", False) else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab_size] for hidden states [N, hidden_size]."""
        if self.packed_head is not None:
            return self.packed_head(hidden).float()
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    @torch.no_grad()
    def pack(self, small_batch=None) -> None:
        """Prepack every projection and the output head for oneDNN, merging q/k/v and
        gate/up into one product each (`cadence.gpu.cpu_linear`); CPU only, after the
        weights are loaded. The plain projections are released. `small_batch`, where
        given, also lays each weight out for products of a few rows (see
        `cpu_linear.PackedLinear`), all of them in one `cpu_linear.WeightArena`."""
        from . import cpu_linear

        head = self.lm_head if self.lm_head is not None else self.model.embed_tokens
        # The small-batch layouts in one arena, made below in the order a decode step reads them.
        arena = None
        if small_batch is not None:
            arena = cpu_linear.WeightArena.for_weights([p for p in self.parameters() if p.dim() == 2],
                                                       small_batch.columns)
        for layer in self.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            attention.qkv_proj = cpu_linear.merged(attention.q_proj, attention.k_proj, attention.v_proj,
                                                   small_batch=small_batch, arena=arena)
            attention.q_proj = attention.k_proj = attention.v_proj = None
            attention.o_proj = cpu_linear.packed(attention.o_proj, small_batch=small_batch, arena=arena)
            mlp.gate_up_proj = cpu_linear.merged(mlp.gate_proj, mlp.up_proj, small_batch=small_batch, arena=arena)
            mlp.gate_proj = mlp.up_proj = None
            mlp.down_proj = cpu_linear.packed(mlp.down_proj, small_batch=small_batch, arena=arena)
            mlp.chunk_rows = cpu_linear.rows_in_cache(2 * self.config.intermediate_size,
                                                     mlp.down_proj.dtype)
        self.packed_head = cpu_linear.PackedLinear(head.weight, None, small_batch=small_batch, arena=arena,
                                                   large_copy=False)
        self.lm_head = None


def build_model(
    config: ModelConfig, backend: AttentionBackend, dtype: torch.dtype, device: torch.device | str
) -> CausalLM:
    """A model whose parameters are allocated on `device` but not initialised."""
    return CausalLM(config, backend, dtype, device).eval()


@torch.no_grad()
def init_random_weights(model: CausalLM, seed: int) -> None:
    """Fill the parameters reproducibly: norms 1, biases 0, everything else N(0, 0.02)."""
    generator = None
    for name, param in model.named_parameters():
        if generator is None:
            generator = torch.Generator(param.device).manual_seed(seed)
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, INIT_STD, generator=generator)
