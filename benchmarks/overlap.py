"""Async scheduling: time per step with steps overlapped against steps run one after another.

Part `sim` runs the embedded engine on the simulated executor in virtual time
(Trio's MockClock), so the figures are exact and the machine's load does not
move them. The simulated executor models a step as host work (input
preparation and output handling, `host_us`) followed by device work; a serial
engine pays their sum per step, an overlapped one hands step N+1 over while N
is on the device. Each line pairs one latency model, serial against overlapped,
on the same requests: `step_ratio` is overlapped over serial virtual time per
step (the target at a 1:1 host:device cost is <= 0.6).

  fixed   every step costs `--device-us` on the device and `--host-us` on the host;
  model   the default latency model (a fixed cost, per prefill token, per decoding
          sequence) with `host_us` set to the serial run's mean device time per step,
          so host and device cost the same on average; steps whose device time
          differs from the host's cannot halve, so `ideal_step_ratio` gives the bound
          (each serial step costing the larger of its host and device parts).

Part `cpu` (with `--cpu`) runs the built-in demo model on this machine's CPU,
serial against overlapped, and reports output tokens per wall second as a ratio
(here the host's work is the event loop's: planning, routing, detokenising).

    python benchmarks/overlap.py                      # nano workload, 1:1, both models
    python benchmarks/overlap.py --requests 64 --host-ratios 0.5,1,2
    python benchmarks/overlap.py --cpu --cpu-requests 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import trio
import trio.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nano_workload import nano  # noqa: E402

from cadence.actors import EngineConfig, SamplingParams, open_engine  # noqa: E402
from cadence.actors.simulated import LatencyModel, SimulatedExecutor  # noqa: E402


class TimedExecutor(SimulatedExecutor):
    """The simulated executor, keeping each step's modelled device time (microseconds)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.device_us: list[float] = []

    def _run(self, plan, sampling=None):
        output, step_us = super()._run(plan, sampling)
        self.device_us.append(step_us)
        return output, step_us


def sim_config(latency: LatencyModel, overlap: bool, max_model_len: int) -> EngineConfig:
    """The nano-vllm engine settings on a simulated executor."""
    executor = TimedExecutor(latency, vocab_size=10_001, eos_token_id=None)
    return EngineConfig.from_kwargs(
        executor=executor, max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=max_model_len,
        num_blocks=8192, block_size=16, async_scheduling=overlap, step_timeout_s=1e9)


async def run_sim(workload, latency: LatencyModel, overlap: bool) -> dict:
    """Every request at once; virtual seconds, steps and device time."""
    cfg = sim_config(latency, overlap, workload.max_seq_len + 1)
    start = trio.current_time()
    async with open_engine(cfg) as engine:
        steps = []
        engine.scheduler.on_step = lambda plan, now: steps.append(plan.step_id)

        async def one(i: int) -> None:
            params = SamplingParams(max_tokens=workload.output_lens[i], ignore_eos=True, temperature=0.0)
            await engine.generate(list(workload.prompts[i]), params, request_id=f"n{i}").collect()

        async with trio.open_nursery() as nursery:
            for i in range(workload.num_requests):
                nursery.start_soon(one, i)
        elapsed = trio.current_time() - start
        stats = engine.stats()
        return dict(elapsed_s=elapsed, num_steps=len(steps), planned_ahead=engine.scheduler.num_planned_ahead,
                    tokens=stats.num_tokens_generated, device_us=cfg.executor.device_us)


def simulate(workload, latency: LatencyModel, overlap: bool) -> dict:
    return trio.run(run_sim, workload, latency, overlap, clock=trio.testing.MockClock(autojump_threshold=0))


def pair(workload, label: str, latency: LatencyModel) -> dict:
    serial = simulate(workload, latency, False)
    overlapped = simulate(workload, latency, True)
    per_step = {k: r["elapsed_s"] / r["num_steps"] for k, r in (("serial", serial), ("overlapped", overlapped))}
    assert serial["tokens"] == overlapped["tokens"] == workload.num_output_tokens
    # The best overlap can do on the serial run's steps: each costs the larger of its two parts.
    host, device = latency.host_us, serial["device_us"]
    ideal = sum(max(host, d) for d in device) / sum(host + d for d in device)
    return dict(bench="overlap", part="sim", model=label, requests=workload.num_requests,
                host_us=latency.host_us, serial_steps=serial["num_steps"],
                overlapped_steps=overlapped["num_steps"], planned_ahead=overlapped["planned_ahead"],
                serial_ms_per_step=round(per_step["serial"] * 1e3, 4),
                overlapped_ms_per_step=round(per_step["overlapped"] * 1e3, 4),
                step_ratio=round(per_step["overlapped"] / per_step["serial"], 4),
                ideal_step_ratio=round(ideal, 4),
                wall_ratio=round(overlapped["elapsed_s"] / serial["elapsed_s"], 4))


def mean_device_us(workload, latency: LatencyModel) -> float:
    """The serial run's mean device time per step under `latency` (no host cost)."""
    run = simulate(workload, latency, False)
    return run["elapsed_s"] / run["num_steps"] * 1e6


async def run_cpu(prompts, max_tokens: int, overlap: bool) -> tuple[float, int]:
    cfg = EngineConfig.from_kwargs(executor="inprocess", model="demo", device="cpu",
                                   async_scheduling=overlap, max_num_seqs=len(prompts))
    async with open_engine(cfg) as engine:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        await engine.generate(prompts[0], SamplingParams(max_tokens=2)).collect()  # warm-up
        t0 = time.perf_counter()
        outputs = []

        async def one(i: int) -> None:
            outputs.append(len((await engine.generate(prompts[i], params).collect()).token_ids))

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        return time.perf_counter() - t0, sum(outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=256, help="first N requests of the nano workload")
    parser.add_argument("--device-us", type=float, default=2000.0, help="device time per step (fixed model)")
    parser.add_argument("--host-ratios", default="1", help="host:device cost ratios for the fixed model")
    parser.add_argument("--cpu", action="store_true", help="also time the demo model on this CPU")
    parser.add_argument("--no-sim", action="store_true", help="skip the simulated part")
    parser.add_argument("--cpu-requests", type=int, default=16)
    parser.add_argument("--cpu-max-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3, help="CPU rounds (serial and overlapped alternate)")
    args = parser.parse_args()

    workload = nano().head(args.requests)
    for ratio in [] if args.no_sim else [float(r) for r in args.host_ratios.split(",")]:
        latency = LatencyModel(base_us=args.device_us, prefill_us_per_token=0.0, decode_us_per_seq=0.0,
                               host_us=ratio * args.device_us)
        print(json.dumps(pair(workload, f"fixed host:device={ratio:g}:1", latency)), flush=True)
    if not args.no_sim:
        default = LatencyModel()
        host = mean_device_us(workload, default)
        latency = LatencyModel(default.base_us, default.prefill_us_per_token, default.decode_us_per_seq,
                               host_us=host)
        print(json.dumps(pair(workload, "model host=mean device", latency)), flush=True)

    if args.cpu:
        from cadence.actors.workloads import scaled

        draw = scaled(args.cpu_requests, 64, 64, max_token_id=255)  # the demo model's byte vocabulary
        prompts = [list(p) for p in draw.prompts]
        ratios = []
        for rep in range(args.reps):
            order = (False, True) if rep % 2 == 0 else (True, False)
            rates = {}
            for overlap in order:
                seconds, tokens = trio.run(run_cpu, prompts, args.cpu_max_tokens, overlap)
                rates[overlap] = tokens / seconds
            ratios.append(rates[True] / rates[False])
            print(json.dumps(dict(bench="overlap", part="cpu", rep=rep, requests=len(prompts),
                                  serial_tok_s=round(rates[False], 1), overlapped_tok_s=round(rates[True], 1),
                                  throughput_ratio=round(ratios[-1], 4))), flush=True)
        print(json.dumps(dict(bench="overlap", part="cpu", summary=True,
                              median_throughput_ratio=round(statistics.median(ratios), 4))), flush=True)


if __name__ == "__main__":
    main()
