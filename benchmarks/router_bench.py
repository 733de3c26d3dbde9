"""What the router costs and what its cache-aware placement buys.

Two measurements, each printed as one JSON line:

- "router_latency": the extra time per request of going through the router
  instead of straight to a server: median and p99 of end-to-end request time
  (a 16-token prompt, `--max-tokens` tokens, one request at a time) both ways,
  against simulated engines whose steps take no time, so the difference is the
  router's own work (one more socket hop each way, placement, relaying).
- "router_hit_rate": the prefix-cache hit rate summed over the replicas
  (num_prefix_hit_tokens / num_prefix_query_tokens) for a prefix-heavy trace
  (the "prefix" preset of workloads.py, scaled down: `--groups` groups sharing
  a `--prefix-len`-token prefix plus 16-256 own tokens), with each policy.

    python benchmarks/router_bench.py --replicas 4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import trio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workloads import token_id  # noqa: E402

from cadence.actors.client import open_client  # noqa: E402
from cadence.actors.engine import EngineConfig  # noqa: E402
from cadence.actors.serve.router import RouterConfig, open_router  # noqa: E402
from cadence.actors.serve.server import ServerConfig, open_server  # noqa: E402
from cadence.actors.simulated import ZERO_LATENCY  # noqa: E402

# The simulated engine pairs with the byte tokenizer: token ids are bytes.
VOCAB = 256


def _engine() -> EngineConfig:
    return EngineConfig.from_kwargs(executor="simulated", latency=ZERO_LATENCY, max_num_seqs=64, num_blocks=8192,
                                    max_model_len=4096, max_num_batched_tokens=8192)


def prefix_prompts(num_requests: int, num_groups: int, prefix_len: int, seed: int) -> list[list[int]]:
    """Prompts built as the "prefix" preset builds them, scaled down."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num_requests):
        group = rng.randrange(num_groups)
        own = rng.randint(16, 256)
        prompts.append([(token_id((1 << 32) | group, p) if p < prefix_len else token_id(i, p)) % VOCAB
                        for p in range(prefix_len + own)])
    return prompts


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _timed(address, num_requests: int, max_tokens: int) -> list[float]:
    async with open_client(address) as client:
        for _ in range(10):  # warm up
            await client.complete(list(range(1, 17)), max_tokens=max_tokens)
        times = []
        for _ in range(num_requests):
            start = time.perf_counter()
            await client.complete(list(range(1, 17)), max_tokens=max_tokens)
            times.append(time.perf_counter() - start)
    return times


async def latency(num_replicas: int, num_requests: int, max_tokens: int) -> dict:
    """Per-request time straight to a server and through the router."""
    async with open_server(_engine(), ServerConfig(port=0)) as first:
        servers = [first]
        async with trio.open_nursery() as nursery:
            extra = []
            for _ in range(num_replicas - 1):
                extra.append(await nursery.start(_serve_one))
            servers += extra
            direct = await _timed(first.tcp_address, num_requests, max_tokens)
            config = RouterConfig(replicas=tuple(s.tcp_address for s in servers), port=0)
            async with open_router(config) as router:
                routed = await _timed(router.tcp_address, num_requests, max_tokens)
            nursery.cancel_scope.cancel()
    ms = 1000.0
    return {
        "metric": "router_latency", "replicas": num_replicas, "requests": num_requests,
        "max_tokens": max_tokens,
        "direct_median_ms": round(statistics.median(direct) * ms, 3),
        "direct_p99_ms": round(_percentile(direct, 0.99) * ms, 3),
        "router_median_ms": round(statistics.median(routed) * ms, 3),
        "router_p99_ms": round(_percentile(routed, 0.99) * ms, 3),
        "added_median_ms": round((statistics.median(routed) - statistics.median(direct)) * ms, 3),
        "added_p99_ms": round((_percentile(routed, 0.99) - _percentile(direct, 0.99)) * ms, 3),
    }


async def _serve_one(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
    async with open_server(_engine(), ServerConfig(port=0)) as server:
        task_status.started(server)
        await trio.sleep_forever()


async def hit_rate(num_replicas: int, policy: str, prompts: list[list[int]], concurrency: int) -> float:
    """The replicas' summed prefix-cache hit rate for `prompts` sent through a router."""
    async with trio.open_nursery() as nursery:
        servers = [await nursery.start(_serve_one) for _ in range(num_replicas)]
        config = RouterConfig(replicas=tuple(s.tcp_address for s in servers), port=0, policy=policy)
        async with open_router(config) as router, open_client(router.tcp_address) as client:
            limit = trio.Semaphore(concurrency)

            async def one(prompt):
                async with limit:
                    await client.complete(prompt, max_tokens=4)

            async with trio.open_nursery() as requests:
                for prompt in prompts:
                    await limit.acquire()  # arrivals in trace order
                    limit.release()
                    requests.start_soon(one, prompt)
            stats = await client.stats()
        nursery.cancel_scope.cancel()
    return stats["num_prefix_hit_tokens"] / max(1, stats["num_prefix_query_tokens"])


async def main_async(args: argparse.Namespace) -> None:
    print(json.dumps(await latency(args.replicas, args.requests, args.max_tokens)), flush=True)
    prompts = prefix_prompts(args.trace_requests, args.groups, args.prefix_len, args.seed)
    rates = {policy: await hit_rate(args.replicas, policy, prompts, args.concurrency)
             for policy in ("prefix", "round_robin", "least_loaded")}
    print(json.dumps({
        "metric": "router_hit_rate", "replicas": args.replicas, "requests": len(prompts),
        "groups": args.groups, "prefix_len": args.prefix_len, "concurrency": args.concurrency,
        "hit_rate_prefix_affinity": round(rates["prefix"], 4),
        "hit_rate_round_robin": round(rates["round_robin"], 4),
        "hit_rate_least_loaded": round(rates["least_loaded"], 4),
    }), flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run both measurements and print one JSON line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--requests", type=int, default=500, help="timed requests per path")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--trace-requests", type=int, default=300)
    parser.add_argument("--groups", type=int, default=10)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=2)
    args = parser.parse_args(argv)
    trio.run(main_async, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
