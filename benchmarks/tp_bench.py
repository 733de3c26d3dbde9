"""Tensor parallelism on the CPU: decode tokens per second at tp=1 and tp=2, and the collective path's cost.

A batch of `--requests` greedy requests is prefilled in one step, then
`--steps` decode steps are timed at rank 0 (plan broadcast, shard forward with
its all-reduces, logits gather, token broadcast). Every rank gets one torch
thread, so tp=2 uses two cores where tp=1 uses one. Two shapes are measured:
"small" (random weights saved as a checkpoint, enough compute per step to
matter) and "tiny" (almost no compute, so the tp=2 step time is mostly the
collective path). The last line is that per-step overhead: tp=2 minus tp=1
step time on "tiny".

Prints one JSON line per (model, tp), then the overhead line. Usage:
    python benchmarks/tp_bench.py
    python benchmarks/tp_bench.py --requests 16 --steps 100
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from cadence.gpu.config import PRESETS, ModelConfig
from cadence.gpu.model import build_model, init_random_weights
from cadence.gpu.parallel import start_local_runner
from cadence.gpu.runner import ModelRunner
from cadence.statemachine.plan import NewRequestData, StepPlan
from cadence.statemachine.sampling import SamplingParams

BLOCK_SIZE = 16
PROMPT_LEN = 32
SMALL_HF_CONFIG = dict(
    model_type="llama", vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
    num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=1024,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, hidden_act="silu", tie_word_embeddings=False,
)


def save_small_checkpoint(directory: Path) -> None:
    """Random weights of the "small" shape, in the Hugging Face layout."""
    config = ModelConfig.from_hf_config(SMALL_HF_CONFIG)
    model = build_model(config, None, torch.float32, "cpu")
    init_random_weights(model, seed=0)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(SMALL_HF_CONFIG))


def plans(num_requests: int, num_steps: int):
    """A prefill plan admitting every request, then the decode plans (blocks added as they fill)."""
    blocks_per_request = -(-(PROMPT_LEN + num_steps + 1) // BLOCK_SIZE)
    greedy = SamplingParams(temperature=0.0, max_tokens=num_steps + 1, ignore_eos=True)
    ids = [f"r{i}" for i in range(num_requests)]
    new = [NewRequestData(rid, [3 + (i * 7 + j) % 97 for j in range(PROMPT_LEN)], PROMPT_LEN,
                          list(range(i * blocks_per_request, (i + 1) * blocks_per_request)), 0)
           for i, rid in enumerate(ids)]
    yield StepPlan(0, {rid: PROMPT_LEN for rid in ids}, PROMPT_LEN * num_requests, new, {}, [], [], []), \
        {rid: greedy for rid in ids}
    for step in range(1, num_steps + 1):
        yield StepPlan(step, {rid: 1 for rid in ids}, num_requests, [], {}, [], [], []), {}


def single_runner(model: str, num_blocks: int) -> ModelRunner:
    """An unsharded runner of a preset or a checkpoint directory."""
    if model in PRESETS:
        return ModelRunner(PRESETS[model], num_blocks=num_blocks, block_size=BLOCK_SIZE, device="cpu")
    return ModelRunner.from_pretrained(model, num_blocks=num_blocks, block_size=BLOCK_SIZE, device="cpu")


def measure(runner, num_requests: int, num_steps: int) -> dict:
    """Decode tokens per second and mean step time; the first decode steps warm up untimed."""
    warmup = 2
    timed_s = 0.0
    for plan, sampling in plans(num_requests, num_steps + warmup):
        start = time.perf_counter()
        runner.execute(plan, sampling)
        if plan.step_id > warmup:
            timed_s += time.perf_counter() - start
    return {"tokens_per_s": round(num_requests * num_steps / timed_s, 1),
            "step_ms": round(1e3 * timed_s / num_steps, 3)}


def main() -> None:
    """Run the four measurements and print them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    num_blocks = args.requests * -(-(PROMPT_LEN + args.steps + 4) // BLOCK_SIZE)
    step_ms = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_small_checkpoint(Path(tmp))
        for name, model in (("small", tmp), ("tiny", "tiny")):
            for tp in (1, 2):
                spec = {"model": model, "num_blocks": num_blocks, "block_size": BLOCK_SIZE, "device": "cpu"}
                if tp == 1:
                    runner = single_runner(model, num_blocks)
                else:
                    runner = start_local_runner(tp, spec, num_threads=1)
                try:
                    result = measure(runner, args.requests, args.steps)
                finally:
                    if tp > 1:
                        runner.close()
                step_ms[name, tp] = result["step_ms"]
                print(json.dumps({"bench": "tp", "model": name, "tp": tp, "requests": args.requests,
                                  "steps": args.steps, **result}), flush=True)
    overhead = step_ms["tiny", 2] - step_ms["tiny", 1]
    print(json.dumps({"bench": "tp", "collective_overhead_ms_per_step": round(overhead, 3),
                      "collectives_per_step": "plan broadcast, 1 + 2 x layers all-reduces, logits gather, "
                                              "token broadcast"}), flush=True)


if __name__ == "__main__":
    main()
