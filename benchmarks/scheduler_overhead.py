"""Scheduler overhead: replay workload traces through the core with fabricated outputs.

Per step: add the requests whose arrival step has come, `schedule()`, fabricate
one token for every scheduled request whose known tokens are all computed after
the step, `update()`. A request finishes after exactly `output_len` tokens:
with `--max-tokens exact` its max_tokens is output_len (EOS ignored); with
`--max-tokens generous` its max_tokens is max_model_len - prompt and its last
token is EOS, as clients that send a large limit and stop at EOS. A request
belongs to its record's tenant (the `backlog` preset: 100 tenants with Zipf
shares), else requests of priority p to tenant "p" (for the fair policy). When nothing is live the
step counter jumps to the next arrival. The scheduler's clock reads STEP_S
(20 ms) per step, or what `--step-s` says (repeatable: the matrix runs at each);
the counters must not depend on it, since the core's policies count in steps
and tokens, not seconds. Only `schedule()` + `update()` are timed, in CPU time
of the driving thread. Waits are steps from arrival to first admission; the
longest wait of the lowest priority is the `starve` preset's victim's, which the
default `priority` serves within 1,000 steps at any clock (the aging bound).
On traces whose records name tenants (`backlog`), `jain_backlogged` is Jain's
index of the tokens each tenant was served while every tenant still had a
request waiting for its first admission (1: equal service; see TenantService).

Prints one JSON line per run. Usage:
    python benchmarks/scheduler_overhead.py                    # every preset, fcfs, exact, caching on
    python benchmarks/scheduler_overhead.py --preset nano --caching off --max-tokens generous
    python benchmarks/scheduler_overhead.py --matrix --vllm --out benchmarks/results/x.jsonl
        # every preset x policy x max-tokens mode x caching (a subset: repeat
        # --preset / --policy / --max-tokens / --caching), with the vLLM model's
        # figures for the same mode, and a table at the end
    python benchmarks/scheduler_overhead.py --matrix --vllm --step-s 1 --step-s 0.02
        # the same at two clock scales (a slow engine and a fast one)
    python benchmarks/scheduler_overhead.py --matrix --vllm --max-tokens generous \
        --preset poisson --seed 41 --seed 51 --seed 61
        # traces of the preset's shape drawn from other seeds (a family the
        # defaults were not tuned on), and per cell a summary line over them:
        # mean and worst steps ratio to the vLLM model, seeds behind, preemptions
    python benchmarks/scheduler_overhead.py --matrix --vllm --set starvation_skip_limit=0 \
        --set admission_growth_share=0
        # the same with SchedulerConfig fields overridden (repeatable; each row
        # records them under "overrides"): to measure a trade-off, not a default
    python benchmarks/scheduler_overhead.py --matrix --vllm --vllm-rules --policy fcfs
        # the core under the vLLM model's own rules (VLLM_RULES): steps equal to the
        # model's without prefix caching; what is left is Cadence's rules' doing
    python benchmarks/scheduler_overhead.py --waiting-scaling  # 1,000 vs 100,000 waiting, every policy
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import attrs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from vllm_model import replay as vllm_replay, wait_figures  # noqa: E402
from workloads import PRESETS, engine_config, generate, load, output_token, prompt_tokens  # noqa: E402

from cadence.statemachine.blocks import block_keys_for  # noqa: E402
from cadence.statemachine.config import CacheConfig, SchedulerConfig  # noqa: E402
from cadence.statemachine.errors import ConfigError  # noqa: E402
from cadence.statemachine.plan import StepResult  # noqa: E402
from cadence.statemachine.request import Request, SamplingLimits  # noqa: E402
from cadence.statemachine.scheduler import Scheduler  # noqa: E402

BINS = ((1, 32), (33, 128), (129, 256))
# The end-of-sequence token of generous mode: below every trace token id.
EOS_TOKEN = 2
MAX_TOKENS_MODES = ("exact", "generous")
# Seconds the scheduler's clock advances per step: a decode step of a small model
# on one GPU (the nano workload ran at ~17 ms per step on the H200).
STEP_S = 0.02
MATRIX_POLICIES = ("fcfs", "priority", "fair")
# SchedulerConfig overrides under which the core follows the vLLM scheduler model's
# rules (benchmarks/vllm_model.py): no admission margins, admission stops at the
# first waiting request that does not fit, none after a preemption, and `fcfs`
# preempts the latest admitted. Given one block fewer (vLLM's null block), the core
# then plans step for step what the model plans without prefix caching
# (tests/test_vllm_model.py), so `--vllm-rules` sets apart what Cadence's own rules
# change from what the two implementations do differently.
VLLM_RULES = {
    "admission_growth_share": 0.0, "admission_watermark": 0.0,
    "predicted_growth_share": 0.0, "predicted_watermark": 0.0,
    "thrash_growth_share": 0.0, "thrash_watermark": 0.0,
    "max_lookahead": 0, "admit_after_preemption": False, "fcfs_victim": "latest_admitted",
}


def vllm_rules_engine(engine: dict) -> dict:
    """A preset's engine for the core under VLLM_RULES: one block fewer, as vLLM's pool."""
    return {**engine, "num_gpu_blocks": engine["num_gpu_blocks"] - 1}


def limits_for(rec: dict, engine: dict, max_tokens: str) -> SamplingLimits:
    """The declared limits of a trace record in one max-tokens mode."""
    if max_tokens == "exact":
        return SamplingLimits(max_tokens=rec["output_len"], ignore_eos=True)
    return SamplingLimits(max_tokens=engine["max_model_len"] - rec["prompt_len"],
                          eos_token_ids=frozenset((EOS_TOKEN,)))


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


# Fields each run sets from the preset's engine and the command line itself.
ENGINE_FIELDS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                 "enable_chunked_prefill", "policy")


def parse_overrides(items: list[str]) -> dict:
    """`NAME=VALUE` strings as SchedulerConfig overrides, each value read as its
    field's type (a bool as true/false, on/off or 1/0) and the whole checked by
    building a config; a ValueError names the field at fault."""
    fields = attrs.fields_dict(SchedulerConfig)
    out: dict = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--set wants NAME=VALUE, got {item!r}")
        if name in ENGINE_FIELDS:
            raise ValueError(f"--set {name}: set by the preset or the command line, not here")
        if name not in fields:
            raise ValueError(f"--set {name}: not a SchedulerConfig field")
        default = fields[name].default
        kind = type(default.factory() if isinstance(default, attrs.Factory) else default)
        try:
            if kind is bool:
                if text.lower() not in ("true", "false", "on", "off", "1", "0"):
                    raise ValueError(text)
                value = text.lower() in ("true", "on", "1")
            elif kind in (int, float):
                value = kind(text)
            elif default is None:  # an optional number: none, or what the text reads as
                value = None if text.lower() == "none" else float(text) if "." in text else int(text)
            else:
                value = text
        except ValueError:
            what = "number or none" if default is None else kind.__name__
            raise ValueError(f"--set {name}: {text!r} is not a {what}") from None
        out[name] = value
    try:
        SchedulerConfig(**out)
    except (ConfigError, ValueError, TypeError) as e:
        raise ValueError(f"--set: {e}") from None
    return out


def tokens_floor(records: list[dict], block_size: int, prefix_caching: bool) -> int:
    """The fewest tokens any scheduler computes for the trace: every prompt token
    and every output token but the last (which is sampled, never fed back); with
    prefix caching, each full prompt block whose prefix an earlier request
    already had is computed once (the last prompt token always is, for its
    logits). No preemption, no recompute."""
    seen: set[bytes] = set()
    total = 0
    for r in records:
        prompt = prompt_tokens(r)
        hit = 0
        if prefix_caching:
            # The core's own chained block keys, up to the block of the last token.
            keys = block_keys_for(prompt, block_size, None)[:(len(prompt) - 1) // block_size]
            while hit < len(keys) and keys[hit] in seen:
                hit += 1
            seen.update(keys[hit:])
        total += len(prompt) - hit * block_size + r["output_len"] - 1
    return total


def replay(records: list[dict], engine: dict, policy: str = "fcfs", prefix_caching: bool = True,
           max_tokens: str = "exact", step_s: float = STEP_S, on_plan=None, **overrides) -> dict:
    """Run one trace through a fresh scheduler and return the figures. The
    scheduler's clock reads `step_s` seconds per step; waits are reported in steps.
    `on_plan`, if given, is called (outside the timed part) with each step's
    {request id: tokens} that schedules any."""
    if max_tokens not in MAX_TOKENS_MODES:
        raise ValueError(f"max_tokens must be one of {MAX_TOKENS_MODES}, got {max_tokens!r}")
    core = make_scheduler(engine, policy, prefix_caching, **overrides)
    generous = max_tokens == "generous"
    made: list[Request] = []
    by_id = {str(r["id"]): r for r in records}
    pending = [(r["arrival_step"], str(r["id"]), prompt_tokens(r), r) for r in records]
    pending.reverse()
    step = 0
    step_us: list[float] = []
    batch: list[int] = []
    num_scheduled = 0
    produced: dict[str, int] = {}
    finished: dict[str, int] = {}
    fairness = TenantService(records)
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
                request = Request(rid, prompt, limits_for(rec, engine, max_tokens),
                                  priority=rec["priority"],
                                  tenant=rec.get("tenant", str(rec["priority"])),
                                  arrival_s=arrival * step_s)
                made.append(request)
                core.add_request(request)
            add_s += counter() - t_add
            t0 = counter()
            plan = core.schedule(step * step_s)
            t1 = counter()
            if on_plan is not None and plan.num_scheduled_tokens:
                on_plan(dict(plan.num_scheduled_tokens))
            requests = core.requests
            sampled = {}
            for rid in core.sampling_ids(plan):
                k = produced.get(rid, 0)
                rec = by_id[rid]
                sampled[rid] = [EOS_TOKEN if generous and k + 1 == rec["output_len"]
                                else output_token(rec, k)]
                produced[rid] = k + 1
            result = StepResult(plan.step_id, sampled)
            fairness.saw(plan, requests)
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
        "tokens_floor": tokens_floor(records, engine["block_size"], prefix_caching),
        "preemptions": stats.num_preemptions,
        "recompute_tokens": stats.num_recompute_tokens,
        "prefix_hit_tokens": stats.num_prefix_hit_tokens,
        "resume_hit_tokens": core.num_resume_hit_tokens,
        **wait_figures([(r.priority, round((r.first_scheduled_s - r.arrival_s) / step_s))
                        for r in made]),
        "finished_ok": not wrong,
        "num_wrong": len(wrong),
        **fairness.figures(),
    }


class TenantService:
    """Tokens scheduled per tenant while every tenant of the trace still has a
    request that was never admitted (on traces whose records name tenants and
    arrive in one step, as `backlog`'s: a tenant yet to arrive is no backlog). In
    that window every tenant is backlogged, so max-min fairness gives each the
    same share, and Jain's index of the tokens served measures how close the
    step came to it: 1 is equal service, 1 / tenants is one tenant served."""

    def __init__(self, records: list[dict]) -> None:
        self.unadmitted: dict[str, int] = {}
        if (records and all("tenant" in r for r in records)
                and len({r["arrival_step"] for r in records}) == 1):
            for r in records:
                self.unadmitted[r["tenant"]] = self.unadmitted.get(r["tenant"], 0) + 1
        self.served = dict.fromkeys(self.unadmitted, 0)
        self.open = len(self.unadmitted) > 1
        self.num_steps = 0

    def saw(self, plan, requests: dict) -> None:
        """Count one step's plan (before its update)."""
        if not self.open:
            return
        for rid, n in plan.num_scheduled_tokens.items():
            self.served[requests[rid].tenant] += n
        for new in plan.new_requests:
            if not new.resumed:
                tenant = requests[new.request_id].tenant
                self.unadmitted[tenant] -= 1
                if not self.unadmitted[tenant]:
                    self.open = False
        self.num_steps += 1

    def figures(self) -> dict:
        xs = list(self.served.values())
        if len(xs) < 2 or not any(xs):
            return {}
        return {"jain_backlogged": round(sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)), 4),
                "backlogged_steps": self.num_steps}


def waiting_scaling(num_waiting: int, policy: str = "priority", num_tenants: int = 2,
                    num_steps: int = 300, arrivals_per_step: int = 4) -> dict:
    """Per-step time with `num_waiting` requests of `num_tenants` tenants queued
    behind a full KV cache, while requests finish, are admitted and arrive
    (`arrivals_per_step`) every step, so each step runs an admission pass."""
    engine = {**engine_config("nano"), "num_gpu_blocks": 2048}
    core = make_scheduler(engine, policy, True)

    def make(i: int, arrival: float) -> Request:
        return Request(str(i), [100 + (i * 7 + j) % 31000 for j in range(200)],
                       SamplingLimits(max_tokens=16 + i % 48, ignore_eos=True),
                       priority=i % 3, tenant=str(i % num_tenants), arrival_s=arrival)

    for i in range(num_waiting):
        core.add_request(make(i, 0.0))
    times = []
    produced = 0
    next_id = num_waiting
    for step in range(num_steps):
        for _ in range(arrivals_per_step):
            core.add_request(make(next_id, float(step)))
            next_id += 1
        t0 = time.thread_time()
        plan = core.schedule(float(step))
        sampled = {rid: [100 + produced % 7] for rid in core.sampling_ids(plan)}
        core.update(plan, StepResult(plan.step_id, sampled))
        times.append((time.thread_time() - t0) * 1e6)
        produced += 1
    steady = times[num_steps // 3:]
    return {"num_waiting": num_waiting, "num_running": core.num_running,
            "median_step_us": round(statistics.median(steady), 1)}


TABLE_FIELDS = ("steps", "tokens_scheduled", "preemptions", "median_wait", "p99_wait",
                "median_wait_priority0", "max_wait_lowest_priority", "us_per_req_step")


def table(rows: list[dict]) -> str:
    """A markdown table of matrix rows, the vLLM model's figures beside each."""
    head = ("| preset | policy | max_tokens | caching | s/step | steps | tokens | preempt | wait p50 | "
            "wait p99 | prio-0 wait p50 | lowest-prio wait max | µs/req-step | vLLM steps | "
            "vLLM tokens | vLLM preempt | vLLM wait p50 | vLLM p99 | vLLM prio-0 p50 | "
            "vLLM lowest-prio max |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if r["bench"] != "scheduler_overhead":
            continue
        v = r.get("vllm") or {}
        lines.append("| " + " | ".join(str(x) for x in (
            r["preset"] if "seed" not in r else f'{r["preset"]}@{r["seed"]}',
            r["policy"], r["max_tokens"], "on" if r["prefix_caching"] else "off",
            r["step_s"], *(r[f] for f in TABLE_FIELDS),
            *(v.get(f, "") for f in ("steps", "tokens_scheduled", "preemptions", "median_wait",
                                     "p99_wait", "median_wait_priority0",
                                     "max_wait_lowest_priority")))) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", action="append", choices=sorted(PRESETS))
    ap.add_argument("--trace", help="a JSON-lines trace file (uses --engine-preset's config)")
    ap.add_argument("--engine-preset", default="nano", choices=sorted(PRESETS))
    ap.add_argument("--policy", action="append", help="repeatable (default fcfs; --matrix: "
                    + ", ".join(MATRIX_POLICIES) + ")")
    ap.add_argument("--max-tokens", action="append", choices=MAX_TOKENS_MODES,
                    help="declared max_tokens: exact (= output length, EOS ignored) or generous "
                         "(max_model_len - prompt, EOS at the real length); repeatable")
    ap.add_argument("--caching", action="append", choices=("on", "off"), help="prefix caching; repeatable")
    ap.add_argument("--no-prefix-caching", action="store_true", help="same as --caching off")
    ap.add_argument("--matrix", action="store_true",
                    help="every combination of the options not given (presets, policies, modes, caching)")
    ap.add_argument("--vllm", action="store_true",
                    help="add the vLLM model's figures for the same preset, mode and caching "
                         "(its priority policy beside priority, FCFS beside the others)")
    ap.add_argument("--step-s", action="append", type=float,
                    help=f"seconds the scheduler's clock advances per step (default {STEP_S}); "
                         "repeatable: every run is made at each")
    ap.add_argument("--seed", action="append", type=int,
                    help="draw each preset's trace from this seed instead of its own; repeatable "
                         "(with --vllm, a seed-family summary line per cell follows)")
    ap.add_argument("--out", help="also append the JSON lines to this file")
    ap.add_argument("--repeat", type=int, default=1, help="runs per preset; the median run is printed")
    ap.add_argument("--waiting-scaling", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="override a SchedulerConfig field in every run; repeatable")
    ap.add_argument("--vllm-rules", action="store_true",
                    help="run the core under the vLLM model's rules (VLLM_RULES, one block "
                         "fewer); --set still applies on top; rows say \"vllm_rules\": true")
    args = ap.parse_args(argv)
    try:
        overrides = parse_overrides(args.set)
    except ValueError as e:
        ap.error(str(e))
    if (overrides or args.vllm_rules) and args.waiting_scaling:
        ap.error("--set and --vllm-rules apply to trace replays, not --waiting-scaling")
    if args.vllm_rules:
        overrides = {**VLLM_RULES, **overrides}
    out_file = open(args.out, "a") if args.out else None

    def emit(row: dict) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        if out_file is not None:
            out_file.write(line + "\n")
            out_file.flush()

    if args.waiting_scaling:
        for policy in args.policy or MATRIX_POLICIES + ("weighted", "deadline"):
            for tenants in (2, 100):
                small = waiting_scaling(1_000, policy, tenants)
                large = waiting_scaling(100_000, policy, tenants)
                emit({"bench": "waiting_scaling", "policy": policy, "tenants": tenants,
                      "small": small, "large": large,
                      "ratio": round(large["median_step_us"] / small["median_step_us"], 3)})
        return 0
    policies = args.policy or (list(MATRIX_POLICIES) if args.matrix else ["fcfs"])
    modes = args.max_tokens or (list(MAX_TOKENS_MODES) if args.matrix else ["exact"])
    caching = args.caching or (["off"] if args.no_prefix_caching else
                               ["off", "on"] if args.matrix else ["on"])
    seeds = args.seed or [None]
    runs = [(args.trace, None, load(args.trace), engine_config(args.engine_preset))] if args.trace else [
        (p, seed, generate(p, seed), engine_config(p)) for p in (args.preset or list(PRESETS))
        for seed in seeds]
    clocks = args.step_s or [STEP_S]
    rows = []
    for name, seed, records, engine in runs:
        core_engine = vllm_rules_engine(engine) if args.vllm_rules else engine
        for policy in policies:
            vllm_policy = "priority" if policy == "priority" else "fcfs"
            for mode in modes:
                for cache in caching:
                    on = cache == "on"
                    # The vLLM model reads no clock: one run serves every clock scale.
                    vllm = vllm_replay(records, engine, on, policy=vllm_policy) if args.vllm else None
                    for step_s in clocks:
                        results = [replay(records, core_engine, policy, on, mode, step_s, **overrides)
                                   for _ in range(args.repeat)]
                        results.sort(key=lambda r: r["sched_total_s"])
                        row = {"bench": "scheduler_overhead", "preset": name, "policy": policy,
                               "max_tokens": mode, "prefix_caching": on, "step_s": step_s,
                               **({"seed": seed} if seed is not None else {}),
                               **({"overrides": overrides} if overrides else {}),
                               **({"vllm_rules": True} if args.vllm_rules else {}),
                               **results[len(results) // 2]}
                        if vllm is not None:
                            row["vllm"] = vllm
                        rows.append(row)
                        emit(row)
    if args.seed and args.vllm:
        for row in seed_family(rows):
            emit(row)
    if args.matrix or len(rows) > 1:
        print(table(rows))
    return 0


def seed_family(rows: list[dict]) -> list[dict]:
    """Per preset, policy, mode, caching and clock: the runs over every seed
    against the vLLM model's, as one summary row each."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        if "seed" in r and "vllm" in r:
            key = (r["preset"], r["policy"], r["max_tokens"], r["prefix_caching"], r["step_s"])
            cells.setdefault(key, []).append(r)
    out = []
    for (preset, policy, mode, on, step_s), rs in cells.items():
        ratios = [r["steps"] / r["vllm"]["steps"] for r in rs]
        out.append({
            "bench": "scheduler_seed_family", "preset": preset, "policy": policy,
            "max_tokens": mode, "prefix_caching": on, "step_s": step_s,
            "seeds": [r["seed"] for r in rs],
            "steps_ratio_mean": round(statistics.mean(ratios), 4),
            "steps_ratio_max": round(max(ratios), 4),
            "seeds_behind": sum(x > 1 for x in ratios),
            "steps_behind": sum(max(0, r["steps"] - r["vllm"]["steps"]) for r in rs),
            **({"overrides": rs[0]["overrides"]} if "overrides" in rs[0] else {}),
            "preemptions": sum(r["preemptions"] for r in rs),
            "vllm_preemptions": sum(r["vllm"]["preemptions"] for r in rs),
            "tokens_ratio": round(sum(r["tokens_scheduled"] for r in rs)
                                  / sum(r["vllm"]["tokens_scheduled"] for r in rs), 4),
        })
    return out


if __name__ == "__main__":
    raise SystemExit(main())
