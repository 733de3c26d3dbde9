"""The fused RMSNorm and SwiGLU kernels against the model's torch ops.

Without CUDA the kernels run in Triton's CPU interpreter (switched on before the
module is first imported), in float32 and float16; the interpreter cannot do
bfloat16 arithmetic, so bfloat16 and the whole model with fused kernels against
the torch path are checked on a GPU only.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from cadence.gpu.model import RMSNorm

import triton_modules
from triton_modules import DEVICE, HAS_CUDA

triton_fused = triton_modules.load("triton_fused", "_rms_norm_kernel")
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU; the interpreter "
                                   "runs the float32/float16 tests on the CPU")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
# One rounding step of the dtype: the fused sum of squares runs in another order.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _norm(dim: int, dtype) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6, dtype=dtype, device=DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, dim, dtype=dtype))
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols"), [(1, 64), (7, 96), (3, 1000), (0, 32)])
def test_rms_norm_matches_the_torch_path(dtype, rows, cols):
    torch.manual_seed(rows * 1000 + cols)
    x = (torch.randn(rows, cols, device=DEVICE) * 3).to(dtype)
    norm = _norm(cols, dtype)
    got = triton_fused.rms_norm(x, norm.weight, norm.eps)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), norm(x).float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual_returns_the_rounded_sum(dtype):
    torch.manual_seed(1)
    x, residual = (torch.randn(5, 128, device=DEVICE).to(dtype) for _ in range(2))
    norm = _norm(128, dtype)
    normed, total = triton_fused.rms_norm(x, norm.weight, norm.eps, residual)
    assert torch.equal(total, residual + x), "the sum is rounded to the dtype as the torch add is"
    torch.testing.assert_close(normed.float(), norm(residual + x).float(),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_rms_norm_reads_strided_rows_and_checks_shapes():
    wide = torch.randn(4, 200, device=DEVICE)
    x = wide[:, :100]  # rows 200 apart, columns contiguous
    norm = _norm(100, torch.float32)
    torch.testing.assert_close(triton_fused.rms_norm(x, norm.weight, norm.eps), norm(x),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="weight must have shape"):
        triton_fused.rms_norm(x, norm.weight[:10], norm.eps)
    with pytest.raises(ValueError, match="residual shape"):
        triton_fused.rms_norm(x, norm.weight, norm.eps, torch.zeros(4, 99, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols"), [(1, 64), (6, 3000), (0, 8)])
def test_silu_and_mul_matches_the_torch_path(dtype, rows, cols):
    torch.manual_seed(cols)
    gate, up = ((torch.randn(rows, cols, device=DEVICE) * 4).to(dtype) for _ in range(2))
    got = triton_fused.silu_and_mul(gate, up)
    torch.testing.assert_close(got.float(), (F.silu(gate) * up).float(),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def _torch_rope_and_write(q, k, v, rope, k_cache, v_cache, slots, norms):
    """The model's unfused path: per-head norms, rotary, then the cache write."""
    from cadence.gpu.attention import write_kv
    from cadence.gpu.model import apply_rotary

    if norms is not None:
        q, k = norms[0](q), norms[1](k)
    q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
    keep = slots >= 0
    write_kv(k_cache, v_cache, k[keep], v[keep], slots[keep])
    return q


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 2), (6, 3), (2, 2)])
def test_rope_and_write_kv_matches_the_torch_path(dtype, with_norm, num_q_heads, num_kv_heads):
    """Queries rotated in place and keys/values stored at their slots as the unfused ops
    do; a padding row (slot -1) stores nothing; other cache slots stay untouched."""
    from cadence.gpu.model import RotaryEmbedding

    torch.manual_seed(num_q_heads * 10 + num_kv_heads)
    num_tokens, head_dim, block_size, num_blocks = 7, 64, 4, 6
    q = torch.randn(num_tokens, num_q_heads, head_dim, device=DEVICE).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    positions = torch.tensor([0, 5, 9, 130, 2, 77, 1], device=DEVICE)
    rope = RotaryEmbedding(head_dim, 10000.0, None)(positions, dtype)
    slots = torch.tensor([3, 0, 17, 8, -1, 22, 12], dtype=torch.int64, device=DEVICE)
    norms = (_norm(head_dim, dtype), _norm(head_dim, dtype)) if with_norm else None
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.full(shape, 7.0, dtype=dtype, device=DEVICE) for _ in range(4)]
    expected_q = _torch_rope_and_write(q.clone(), k, v, rope, caches[0], caches[1], slots, norms)
    weights = dict(q_norm_weight=norms[0].weight, k_norm_weight=norms[1].weight,
                   eps=norms[0].eps) if with_norm else {}
    q_in = q.clone()
    got_q = triton_fused.rope_and_write_kv(q_in, k, v, *rope, caches[2], caches[3], slots,
                                           **weights)
    assert got_q.data_ptr() == q_in.data_ptr(), "queries are rotated in place"
    tolerance = dict(atol=TOLERANCE[dtype] * 4, rtol=TOLERANCE[dtype] * 4)
    torch.testing.assert_close(got_q.float(), expected_q.float(), **tolerance)
    torch.testing.assert_close(caches[2].float(), caches[0].float(), **tolerance)
    torch.testing.assert_close(caches[3].float(), caches[1].float(), atol=0, rtol=0)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots[slots >= 0]] = False
    assert (caches[2].view(-1, num_kv_heads, head_dim)[untouched] == 7.0).all()


def test_rope_and_write_kv_refuses_mismatched_shapes():
    q = torch.zeros(2, 4, 64, device=DEVICE)
    k = torch.zeros(2, 2, 64, device=DEVICE)
    cache = torch.zeros(2, 4, 2, 64, device=DEVICE)
    cos = torch.zeros(2, 1, 64, device=DEVICE)
    slots = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="both q_norm_weight and k_norm_weight"):
        triton_fused.rope_and_write_kv(q, k, k, cos, cos, cache, cache, slots,
                                       q_norm_weight=torch.ones(64, device=DEVICE))
    with pytest.raises(ValueError, match="caches must be"):
        triton_fused.rope_and_write_kv(q, k, k, cos, cos, cache[:, :, :1], cache[:, :, :1], slots)


def test_the_model_switch_routes_norms_and_mlps_through_the_kernels():
    """set_fused_elementwise(True) gives every RMSNorm and MLP the kernels; a decoder
    layer's output then matches the torch path."""
    from cadence.gpu.attention import get_attention_backend
    from cadence.gpu.config import PRESETS
    from cadence.gpu.model import MLP, Attention, build_model, init_random_weights

    config = PRESETS["tiny"]
    model = build_model(config, get_attention_backend("reference"), torch.float32, DEVICE)
    init_random_weights(model, seed=0)
    layer = model.model.layers[0]
    hidden = torch.randn(3, config.hidden_size, device=DEVICE)
    expected = layer.mlp(layer.post_attention_layernorm.add_and_norm(hidden, hidden)[0])
    model.set_fused_elementwise(True)
    assert all(m.fused is triton_fused for m in model.modules() if isinstance(m, (RMSNorm, MLP, Attention)))
    got = layer.mlp(layer.post_attention_layernorm.add_and_norm(hidden, hidden)[0])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    model.set_fused_elementwise(False)
    assert all(m.fused is None for m in model.modules() if isinstance(m, (RMSNorm, MLP, Attention)))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_a_runner_with_fused_kernels_generates_the_same_greedy_tokens(plan_driver, qk_norm):
    """The whole model through the fused kernels (interpreted on a CPU) against the
    torch path: same greedy tokens, log-probabilities within float32 noise; with and
    without per-head query/key norms (Qwen3's, fused into the rotary kernel)."""
    import attrs

    from cadence.gpu import ModelRunner, preset
    from cadence.statemachine.sampling import SamplingParams

    config = attrs.evolve(preset("tiny"), qk_norm=qk_norm)

    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)
    prompts = {"a": [5, 9, 2, 7], "b": list(range(40, 61))}
    results = []
    for fused in (False, True):
        runner = ModelRunner(config, num_blocks=32, block_size=4, device=DEVICE,
                             dtype="float32", fused_elementwise=fused)
        driver = plan_driver(runner, token_budget=16)
        for rid, prompt in prompts.items():
            driver.add(rid, prompt, params)
        outputs = driver.run()
        results.append((outputs, {rid: [e[0][1] for e in r.logprobs] for rid, r in driver.requests.items()}))
    (plain, plain_lp), (fused, fused_lp) = results
    assert fused == plain
    for rid in prompts:
        torch.testing.assert_close(torch.tensor(fused_lp[rid]), torch.tensor(plain_lp[rid]),
                                   atol=1e-4, rtol=0)


def test_fused_kernels_on_a_cpu_need_the_interpreter(monkeypatch):
    from cadence.gpu import ModelRunner, preset
    from cadence.statemachine.errors import ConfigError

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="fused_elementwise needs a CUDA device"):
        ModelRunner(preset("tiny"), num_blocks=8, device="cpu", fused_elementwise=True)


def test_fused_kernels_are_the_default_on_cuda_with_the_triton_backend_only(monkeypatch):
    """Left unset, the fused kernels are on where they were measured to win (CUDA, the
    "triton" attention backend, Triton importable) and off everywhere else; asked for
    explicitly, the answer is kept."""
    import importlib.util

    from cadence.gpu import ModelRunner, preset

    def resolved(device: str, backend: str, requested=None) -> bool:
        runner = ModelRunner.__new__(ModelRunner)
        runner.device = torch.device(device)
        return runner._resolve_fused_elementwise(requested, backend)

    assert resolved("cuda", "triton") is True
    assert resolved("cuda", "sdpa") is False
    assert resolved("cpu", "cpu") is False
    assert resolved("cpu", "sdpa") is False
    assert resolved("cuda", "triton", requested=False) is False
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real_find_spec(name, *a))
    assert resolved("cuda", "triton") is False
    # A CPU runner built with every default does not run the Triton kernels (its own, if any).
    fused = ModelRunner(preset("tiny"), num_blocks=8, device="cpu").model.model.layers[0].mlp.fused
    assert fused is None or fused.__name__ == "cadence.gpu.cpu_kernels"
