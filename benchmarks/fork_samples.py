"""`n` > 1 in the core: a request group against n independent requests.

Submits groups of `--n` samples of one prompt (prefix caching off, so blocks are
shared only by the fork), all at once or one prompt every `--gap` steps, to the
scheduling core and runs it to completion with
fabricated outputs (each sample generates exactly `--max-tokens` tokens). Once
as request groups (`Scheduler.add_group`), once as n independent requests per
prompt (`add_request`), on the same arrivals. Counts the prompt tokens computed
(scheduled tokens that were prompt positions, recomputation after preemption
included), the steps to drain, and the CPU time of `schedule()` + `update()`.

Prints one JSON line per mode and one with the ratios (independent / fork).
Usage:
    python benchmarks/fork_samples.py
    python benchmarks/fork_samples.py --n 4 --prompts 64 --num-blocks 512 --gap 2
"""

from __future__ import annotations

import argparse
import json
import random
import time

from cadence.statemachine.config import CacheConfig, SchedulerConfig
from cadence.statemachine.plan import StepResult
from cadence.statemachine.request import Request, SamplingLimits
from cadence.statemachine.scheduler import Scheduler

# Tokens of a prompt: drawn from this range, so prompts share no prefix.
VOCAB = 30_000
# The token every sample generates (its EOS is ignored: lengths are exact).
TOKEN = 7


def prompts(num: int, low: int, high: int, seed: int) -> list[list[int]]:
    """`num` prompts of random lengths in [low, high]."""
    rng = random.Random(seed)
    return [[rng.randrange(10, VOCAB) for _ in range(rng.randint(low, high))] for _ in range(num)]


def run(mode: str, args: argparse.Namespace) -> dict:
    """Drain the workload as request groups (`mode` "fork") or as independent
    requests ("independent"); return the counts."""
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             max_model_len=args.max_model_len, max_waiting=100_000)
    cache = CacheConfig(num_blocks=args.num_blocks, block_size=args.block_size,
                        enable_prefix_caching=False)
    s = Scheduler(config, cache)
    work = prompts(args.prompts, args.min_prompt, args.max_prompt, args.seed)
    limits = SamplingLimits(max_tokens=args.max_tokens, ignore_eos=True)
    num_prompt_tokens = num_steps = 0
    cpu_s = 0.0
    arrived = 0
    while arrived < len(work) or s.has_work():
        while arrived < len(work) and num_steps >= arrived * args.gap:
            prompt = work[arrived]
            members = [Request(f"p{arrived}.{i}", prompt, limits, arrival_s=float(num_steps))
                       for i in range(args.n)]
            if mode == "fork":
                s.add_group(members)
            else:
                for member in members:
                    s.add_request(member)
            arrived += 1
        started = time.process_time()
        plan = s.schedule(float(num_steps))
        requests = s.requests
        for rid, n in plan.num_scheduled_tokens.items():
            r = requests[rid]
            before = r.num_computed_tokens - n
            num_prompt_tokens += max(0, min(n, r.num_prompt_tokens - before))
        sampled = {rid: [TOKEN] for rid in s.sampling_ids(plan)}
        s.update(plan, StepResult(plan.step_id, sampled))
        cpu_s += time.process_time() - started
        num_steps += 1
    stats = s.stats()
    return {"bench": "fork_samples", "mode": mode, "n": args.n, "prompts": args.prompts,
            "prompt_tokens_computed": num_prompt_tokens, "steps": num_steps,
            "scheduled_tokens": stats.num_scheduled_tokens,
            "shared_prompt_tokens": stats.num_shared_prompt_tokens,
            "preemptions": stats.num_preemptions, "core_cpu_s": round(cpu_s, 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=200)
    parser.add_argument("--max-prompt", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--gap", type=int, default=0, help="steps between prompts (0: a burst)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    fork, alone = run("fork", args), run("independent", args)
    for row in (fork, alone):
        print(json.dumps(row))
    print(json.dumps({
        "bench": "fork_samples", "ratio": "independent/fork", "n": args.n,
        "num_blocks": args.num_blocks, "gap": args.gap,
        "prompt_tokens_computed": round(alone["prompt_tokens_computed"] / fork["prompt_tokens_computed"], 3),
        "steps": round(alone["steps"] / fork["steps"], 3),
        "core_cpu_s": round(alone["core_cpu_s"] / fork["core_cpu_s"], 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
