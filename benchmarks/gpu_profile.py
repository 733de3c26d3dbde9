"""Where a decode step's GPU time goes: a kernel-level profile of the nano workload.

Runs the nano workload (Qwen3-0.6B shapes, random weights) through the core and
the runner until every prompt is prefilled, then profiles a few pure-decode
steps with torch.profiler, eagerly (graphs off, so each operator is visible) and
with decode CUDA graphs. Writes $OUT/gpu_profile.json and the operator tables.

    OUT=/tmp/p python benchmarks/gpu_profile.py --dry-run     # CPU, tiny preset
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nano_workload  # noqa: E402

from cadence.gpu.config import preset  # noqa: E402
from cadence.gpu.runner import ModelRunner  # noqa: E402
from cadence.statemachine.config import CacheConfig, SchedulerConfig  # noqa: E402
from cadence.statemachine.request import Request  # noqa: E402
from cadence.statemachine.sampling import SamplingParams  # noqa: E402
from cadence.statemachine.scheduler import Scheduler  # noqa: E402


def prefilled(runner: ModelRunner, workload, max_num_seqs: int) -> tuple[Scheduler, dict]:
    """A core with every request admitted and past its prompt."""
    core = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=runner.max_model_len),
                     CacheConfig(num_blocks=runner.num_blocks, block_size=runner.block_size))
    params = {}
    for i, (prompt, num_out) in enumerate(zip(workload.prompts, workload.output_lens)):
        rid = f"req-{i}"
        params[rid] = SamplingParams(temperature=0.0, max_tokens=num_out, ignore_eos=True)
        core.add_request(Request(rid, prompt, params[rid].limits()))
    while True:
        plan = core.schedule()
        core.update(plan, runner.execute(plan, {d.request_id: params[d.request_id] for d in plan.new_requests}))
        if plan.total_num_scheduled_tokens == len(plan.num_scheduled_tokens) and not core.num_waiting:
            return core, params


def profile_steps(runner, core, params, num_steps: int, device: str) -> tuple[str, list[dict], float]:
    """Profile `num_steps` decode steps; the operator table, top rows and seconds per step."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sort = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(num_steps):
            plan = core.schedule()
            core.update(plan, runner.execute(plan, {d.request_id: params[d.request_id] for d in plan.new_requests}))
        if device == "cuda":
            torch.cuda.synchronize()
        per_step = (time.perf_counter() - start) / num_steps
    averages = prof.key_averages()
    rows = []
    for e in sorted(averages, key=lambda e: getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) if device == "cuda" else e.cpu_time_total, reverse=True)[:30]:
        rows.append({"name": e.key[:120], "count": e.count, "cpu_us": e.cpu_time_total,
                     "device_us": getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0))})
    return averages.table(sort_by=sort, row_limit=30), rows, per_step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny preset, 8 small requests")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_profile"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        device, name, dtype = "cpu", "tiny", "float32"
        workload = nano_workload.scaled(8, 64, 64, max_token_id=preset(name).vocab_size - 1)
    else:
        device, name, dtype, workload = "cuda", "qwen3-0.6b", "bfloat16", nano_workload.nano()
    result: dict = {"device": device, "preset": name, "num_requests": workload.num_requests}
    for graphs in ((False, True) if device == "cuda" else (False,)):
        extra = dict(use_cuda_graphs=graphs) if device == "cuda" else {}
        num_blocks = sum(-(-(len(p) + o) // 16) for p, o in zip(workload.prompts, workload.output_lens)) + 16
        runner = ModelRunner(preset(name), num_blocks=num_blocks, block_size=16, device=device, dtype=dtype,
                             attention_backend="triton" if device == "cuda" else "reference",
                             max_num_seqs=256, max_model_len=min(4096, preset(name).max_model_len), seed=0, **extra)
        core, params = prefilled(runner, workload, 256)
        profile_steps(runner, core, params, 2, device)  # warm-up
        table, rows, per_step = profile_steps(runner, core, params, args.steps, device)
        label = "graphs" if graphs else "eager"
        (out / f"gpu_profile_{label}.txt").write_text(table)
        result[label] = {"ms_per_decode_step": per_step * 1e3, "batch": core.num_running, "top": rows}
        print(f"== {label}: {per_step * 1e3:.2f} ms per decode step, batch {core.num_running}")
        print(table[:6000], flush=True)
        del runner, core
        if device == "cuda":
            torch.cuda.empty_cache()
    (out / "gpu_profile.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
