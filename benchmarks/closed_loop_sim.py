"""Clients in a closed loop against the scheduling core, on a modelled clock.

Each of `--clients` clients sends a request (a prompt of `--prompt` tokens, `--output`
tokens out, EOS ignored), waits for its last token, and sends the next `--lag`
seconds later, until `--requests` are done. A step takes `--step-s` plus
`--token-s` per token it computes (a CPU's cost model: fit to a trace of the real
server, float32 125M model at 2 threads: 9 ms and 0.5 ms). The scheduler is the
real core with a CPU server's defaults, or with `--paced` the pacing rules
(`cadence.actors.engine_args`: a bound on prompt tokens beside decodes, bursts
split in thirds, the finish hold, and a budget of 8,192 tokens a step); options
override any SchedulerConfig field (`--set name=value`). One JSON line per run:
requests/s, TTFT p50 and the gaps between tokens (p50, p99) as a client would see
them, in ms.

It shows what the admission rules do to a loop of clients without a model: e.g.
    python benchmarks/closed_loop_sim.py --paced --set admission_finish_hold_steps=0
    python benchmarks/closed_loop_sim.py --clients 8 --jitter 0.5 --set mixed_prefill_tokens=32
"""

from __future__ import annotations

import argparse
import heapq
import json
import random

from cpu_peers import quantile
from scheduler_overhead import parse_overrides

from cadence.actors.engine_args import (PACED_BURST_SPLIT, PACED_FINISH_HOLD_STEPS, PACED_MIXED_PREFILL_TOKENS,
                                        SERVE_CPU_MAX_NUM_BATCHED_TOKENS)
from cadence.statemachine.config import CacheConfig, SchedulerConfig
from cadence.statemachine.plan import StepResult
from cadence.statemachine.request import Request, SamplingLimits
from cadence.statemachine.scheduler import Scheduler


def simulate(clients: int, requests: int, prompt: int, output: int, lag_s: float,
             step_s: float, token_s: float, jitter: float, seed: int, paced: bool = False,
             **overrides) -> dict:
    fields = dict(max_num_batched_tokens=SERVE_CPU_MAX_NUM_BATCHED_TOKENS, max_model_len=4 * (prompt + output))
    if paced:
        fields.update(admission_burst_split=PACED_BURST_SPLIT, mixed_prefill_tokens=PACED_MIXED_PREFILL_TOKENS,
                      admission_finish_hold_steps=PACED_FINISH_HOLD_STEPS,
                      max_num_batched_tokens=SchedulerConfig().max_num_batched_tokens)
    fields.update(overrides)
    scheduler = Scheduler(SchedulerConfig(**fields), CacheConfig(num_blocks=8192, block_size=16))
    rng = random.Random(seed)

    def length(n: int) -> int:
        return max(1, round(n * (1 + jitter * (2 * rng.random() - 1))))

    arrivals: list[tuple[float, int]] = [(i * 1e-4, i) for i in range(min(clients, requests))]
    sent, done, now = len(arrivals), 0, 0.0
    sent_at: dict[str, float] = {}
    token_times: dict[str, list[float]] = {}
    while done < requests:
        while arrivals and arrivals[0][0] <= now:
            at, i = heapq.heappop(arrivals)
            rid = f"r{i}"
            limits = SamplingLimits(max_tokens=length(output), ignore_eos=True)
            scheduler.add_request(Request(rid, [3 + (i * 7919 + k) % 30000 for k in range(length(prompt))],
                                          limits, arrival_s=at))
            sent_at[rid], token_times[rid] = at, []
        if not scheduler.has_work():
            now = arrivals[0][0]
            continue
        plan = scheduler.schedule(now)
        now += step_s + token_s * plan.total_num_scheduled_tokens
        sampled = {}
        for rid in scheduler.sampling_ids(plan):
            sampled[rid] = [100]
            token_times[rid].append(now)
        for event in scheduler.update(plan, StepResult(plan.step_id, sampled)):
            if event.finish_reason is not None:
                done += 1
                if sent < requests:
                    heapq.heappush(arrivals, (now + lag_s, sent))
                    sent += 1
    ttfts = sorted(times[0] - sent_at[rid] for rid, times in token_times.items())
    gaps = sorted(b - a for times in token_times.values() for a, b in zip(times, times[1:]))
    return dict(requests_per_s=round(requests / now, 3), ttft_p50_ms=round(quantile(ttfts, 0.5) * 1e3, 1),
                itl_p50_ms=round(quantile(gaps, 0.5) * 1e3, 1), itl_p99_ms=round(quantile(gaps, 0.99) * 1e3, 1),
                steps=scheduler.step_id, finish_holds=scheduler.collector.num_admission_finish_holds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--lag", type=float, default=0.005, help="seconds from a last token to the next request")
    parser.add_argument("--step-s", type=float, default=0.009)
    parser.add_argument("--token-s", type=float, default=0.0005)
    parser.add_argument("--jitter", type=float, default=0.0, help="lengths vary by up to this share either way")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--paced", action="store_true", help="the pacing rules instead of the server's defaults")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a SchedulerConfig field (repeatable; as scheduler_overhead.py's --set)")
    args = parser.parse_args()
    try:
        overrides = parse_overrides(args.set)
    except ValueError as e:
        parser.error(str(e))
    result = simulate(args.clients, args.requests, args.prompt, args.output, args.lag, args.step_s,
                      args.token_s, args.jitter, args.seed, args.paced, **overrides)
    print(json.dumps(dict(clients=args.clients, requests=args.requests, jitter=args.jitter, paced=args.paced,
                          overrides=overrides, **result)))


if __name__ == "__main__":
    main()
