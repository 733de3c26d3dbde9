"""Scheduler overhead: replay workload traces through the core with fabricated outputs.

Per step: add the requests whose arrival step has come, `schedule()`, fabricate
one token for every scheduled request whose known tokens are all computed after
the step, `update()`. A request finishes after exactly `output_len` tokens
(`max_tokens = output_len`, EOS ignored). When nothing is live the step counter
jumps to the next arrival. Only `schedule()` + `update()` are timed, in CPU time of the driving thread.

Prints one JSON line per run. Usage:
    python benchmarks/scheduler_overhead.py                    # every preset
    python benchmarks/scheduler_overhead.py --preset nano --no-prefix-caching
    python benchmarks/scheduler_overhead.py --waiting-scaling  # 1,000 vs 100,000 waiting
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workloads import PRESETS, engine_config, generate, load, output_token, prompt_tokens  # noqa: E402

from cadence.statemachine.config import CacheConfig, SchedulerConfig  # noqa: E402
from cadence.statemachine.plan import StepResult  # noqa: E402
from cadence.statemachine.request import Request, SamplingLimits  # noqa: E402
from cadence.statemachine.scheduler import Scheduler  # noqa: E402

BINS = ((1, 32), (33, 128), (129, 256))


def make_scheduler(engine: dict, policy: str, prefix_caching: bool, **overrides) -> Scheduler:
    sched = SchedulerConfig(
        max_num_seqs=engine["max_num_seqs"],
        max_num_batched_tokens=engine["max_num_batched_tokens"],
        max_model_len=engine["max_model_len"],
        enable_chunked_prefill=engine["chunked_prefill"],
        policy=policy,
        **overrides,
    )
    cache = CacheConfig(num_blocks=engine["num_gpu_blocks"], block_size=engine["block_size"],
                        enable_prefix_caching=prefix_caching)
    return Scheduler(sched, cache)


def replay(records: list[dict], engine: dict, policy: str = "fcfs", prefix_caching: bool = True,
           **overrides) -> dict:
    """Run one trace through a fresh scheduler and return the figures."""
    core = make_scheduler(engine, policy, prefix_caching, **overrides)
    by_id = {str(r["id"]): r for r in records}
    pending = [(r["arrival_step"], str(r["id"]), prompt_tokens(r), r) for r in records]
    pending.reverse()
    step = 0
    step_us: list[float] = []
    batch: list[int] = []
    num_scheduled = 0
    produced: dict[str, int] = {}
    finished: dict[str, int] = {}
    # CPU time of this thread: on a shared machine, time spent descheduled is not
    # the scheduler's cost. Wall time is reported beside it.
    counter = time.thread_time
    wall_start = time.perf_counter()
    total_s = 0.0
    add_s = 0.0
    gc.collect()
    gc.disable()
    try:
        while pending or core.has_work():
            if not core.has_work() and pending and pending[-1][0] > step:
                step = pending[-1][0]
            t_add = counter()
            while pending and pending[-1][0] <= step:
                arrival, rid, prompt, rec = pending.pop()
                core.add_request(Request(rid, prompt, SamplingLimits(max_tokens=rec["output_len"], ignore_eos=True),
                                         priority=rec["priority"], arrival_s=float(arrival)))
            add_s += counter() - t_add
            t0 = counter()
            plan = core.schedule(float(step))
            t1 = counter()
            requests = core.requests
            sampled = {}
            for rid in plan.num_scheduled_tokens:
                req = requests[rid]
                if req.num_computed_tokens == req.num_tokens:
                    k = produced.get(rid, 0)
                    sampled[rid] = [output_token(by_id[rid], k)]
                    produced[rid] = k + 1
            result = StepResult(plan.step_id, sampled)
            t2 = counter()
            events = core.update(plan, result)
            t3 = counter()
            for ev in events:
                if ev.finish_reason is not None:
                    finished[ev.request_id] = produced.get(ev.request_id, 0)
            dt = (t1 - t0) + (t3 - t2)
            total_s += dt
            n = len(plan.num_scheduled_tokens)
            if n:
                step_us.append(dt * 1e6)
                batch.append(n)
                num_scheduled += n
            step += 1
    finally:
        gc.enable()
    wall_s = time.perf_counter() - wall_start
    stats = core.stats()
    wrong = [rid for rid, rec in by_id.items() if finished.get(rid) != rec["output_len"]]
    bins = {}
    for lo, hi in BINS:
        xs = [us for us, n in zip(step_us, batch) if lo <= n <= hi]
        bins[f"{lo}-{hi}"] = {"steps": len(xs), "median_us": round(statistics.median(xs), 1) if xs else None}
    prompt_total = sum(r["prompt_len"] for r in records)
    output_total = sum(r["output_len"] for r in records)
    return {
        "steps": len(step_us),
        "logical_steps": step,
        "sched_total_s": round(total_s, 4),
        "add_s": round(add_s, 4),
        "wall_s_whole_replay": round(wall_s, 3),
        "p50_us": round(statistics.median(step_us), 1),
        "p99_us": round(sorted(step_us)[int(0.99 * (len(step_us) - 1))], 1),
        "us_per_req_step": round(total_s * 1e6 / num_scheduled, 3),
        "bins": bins,
        "tokens_scheduled": stats.num_scheduled_tokens,
        "tokens_over_prompt_plus_output": round(stats.num_scheduled_tokens / (prompt_total + output_total), 4),
        "preemptions": stats.num_preemptions,
        "recompute_tokens": stats.num_recompute_tokens,
        "prefix_hit_tokens": stats.num_prefix_hit_tokens,
        "resume_hit_tokens": core.num_resume_hit_tokens,
        "finished_ok": not wrong,
        "num_wrong": len(wrong),
    }


def waiting_scaling(num_waiting: int, num_steps: int = 300) -> dict:
    """Per-step time with `num_waiting` requests queued behind a full KV cache."""
    engine = {**engine_config("nano"), "num_gpu_blocks": 2048}
    core = make_scheduler(engine, "priority", True)
    for i in range(num_waiting):
        core.add_request(Request(str(i), [100 + (i * 7 + j) % 31000 for j in range(200)],
                                 SamplingLimits(max_tokens=1000, ignore_eos=True),
                                 priority=i % 3, arrival_s=0.0))
    times = []
    produced = 0
    for step in range(num_steps):
        t0 = time.thread_time()
        plan = core.schedule(float(step))
        reqs = core.requests
        sampled = {rid: [100 + produced % 7] for rid in plan.num_scheduled_tokens
                   if reqs[rid].num_computed_tokens == reqs[rid].num_tokens}
        core.update(plan, StepResult(plan.step_id, sampled))
        times.append((time.thread_time() - t0) * 1e6)
        produced += 1
    steady = times[num_steps // 3:]
    return {"num_waiting": num_waiting, "num_running": core.num_running,
            "median_step_us": round(statistics.median(steady), 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", action="append", choices=sorted(PRESETS))
    ap.add_argument("--trace", help="a JSON-lines trace file (uses --engine-preset's config)")
    ap.add_argument("--engine-preset", default="nano", choices=sorted(PRESETS))
    ap.add_argument("--policy", default="fcfs")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--repeat", type=int, default=1, help="runs per preset; the median run is printed")
    ap.add_argument("--waiting-scaling", action="store_true")
    args = ap.parse_args(argv)
    if args.waiting_scaling:
        small, large = waiting_scaling(1_000), waiting_scaling(100_000)
        print(json.dumps({"bench": "waiting_scaling", "small": small, "large": large,
                          "ratio": round(large["median_step_us"] / small["median_step_us"], 3)}))
        return 0
    runs = [(args.trace, load(args.trace), engine_config(args.engine_preset))] if args.trace else [
        (p, generate(p), engine_config(p)) for p in (args.preset or list(PRESETS))]
    for name, records, engine in runs:
        results = [replay(records, engine, args.policy, not args.no_prefix_caching)
                   for _ in range(args.repeat)]
        results.sort(key=lambda r: r["sched_total_s"])
        out = {"bench": "scheduler_overhead", "preset": name, "policy": args.policy,
               "prefix_caching": not args.no_prefix_caching, **results[len(results) // 2]}
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
