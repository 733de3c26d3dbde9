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


def test_the_model_switch_routes_norms_and_mlps_through_the_kernels():
    """set_fused_elementwise(True) gives every RMSNorm and MLP the kernels; a decoder
    layer's output then matches the torch path."""
    from cadence.gpu.attention import get_attention_backend
    from cadence.gpu.config import PRESETS
    from cadence.gpu.model import MLP, build_model, init_random_weights

    config = PRESETS["tiny"]
    model = build_model(config, get_attention_backend("reference"), torch.float32, DEVICE)
    init_random_weights(model, seed=0)
    layer = model.model.layers[0]
    hidden = torch.randn(3, config.hidden_size, device=DEVICE)
    expected = layer.mlp(layer.post_attention_layernorm.add_and_norm(hidden, hidden)[0])
    model.set_fused_elementwise(True)
    assert all(m.fused is triton_fused for m in model.modules() if isinstance(m, (RMSNorm, MLP)))
    got = layer.mlp(layer.post_attention_layernorm.add_and_norm(hidden, hidden)[0])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    model.set_fused_elementwise(False)
    assert all(m.fused is None for m in model.modules() if isinstance(m, (RMSNorm, MLP)))


def test_a_runner_with_fused_kernels_generates_the_same_greedy_tokens(plan_driver):
    """The whole model through the fused kernels (interpreted on a CPU) against the
    torch path: same greedy tokens, log-probabilities within float32 noise."""
    from cadence.gpu import ModelRunner, preset
    from cadence.statemachine.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)
    prompts = {"a": [5, 9, 2, 7], "b": list(range(40, 61))}
    results = []
    for fused in (False, True):
        runner = ModelRunner(preset("tiny"), num_blocks=32, block_size=4, device=DEVICE,
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
