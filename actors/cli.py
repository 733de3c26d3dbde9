"""The `cadence` command line.

    cadence demo                 the seed simulation: 15 requests on the simulated executor
    cadence generate "def "      stream a completion from the built-in demo model
    cadence check ...            the formal checks of cadence.spec

A mistake on the user's side (a bad option value, a prompt that does not fit)
prints one line and exits with status 2; anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from typing import Sequence

import attrs
import trio
import trio.testing

from cadence.statemachine.config import POLICY_NAMES, CacheConfig, SchedulerConfig
from cadence.statemachine.errors import CadenceError
from cadence.statemachine.plan import StepPlan
from cadence.statemachine.sampling import SamplingParams

from . import bench
from .serve import server
from .engine import (  # noqa: F401  (demo_model_dir, resolve_model: also imported from here)
    EXECUTOR_KINDS, SIMULATED_MODEL, EngineConfig, demo_model_dir, open_engine, resolve_model,
)
from .engine_args import DEFAULT_MAX_MODEL_LEN, cpu_options, max_model_len_help, tokenizer_for
from .validation import plural
from .unwrap import unwrap_sole_error
from .simulated import ZERO_LATENCY, LatencyModel

__all__ = ["main", "run_demo", "DemoConfig"]

USAGE_ERROR = 2


class UsageError(Exception):
    """A mistake in the command line that is not a CadenceError."""


@attrs.frozen
class DemoConfig:
    """The seed simulation: `num_requests` requests with prompts of
    `min_prompt_len`, `min_prompt_len` + 1, ... tokens, all arriving at once."""

    num_requests: int = 15
    min_prompt_len: int = 10
    max_tokens: int = 4
    max_batch_size: int = 8
    policy: str = "fcfs"
    seed: int = 0
    real_time: bool = False


def _format_batch(plan: StepPlan, now_s: float) -> str:
    batch = " ".join(f"{rid}:{n}" for rid, n in plan.num_scheduled_tokens.items())
    return (f"step {plan.step_id:3d}  t={now_s:8.4f}s  {len(plan.num_scheduled_tokens)} requests, "
            f"{plan.total_num_scheduled_tokens:4d} tokens  [{batch}]")


async def _demo(config: DemoConfig, out) -> None:
    start = trio.current_time()
    engine_config = EngineConfig(
        scheduler=SchedulerConfig(max_batch_size=config.max_batch_size, policy=config.policy),
        cache=CacheConfig(num_blocks=1024, block_size=16), executor="simulated", seed=config.seed)

    def on_step(plan: StepPlan, now_s: float) -> None:
        print(_format_batch(plan, now_s - start), file=out)

    async with open_engine(engine_config, on_step=on_step) as engine:
        streams = []
        for index in range(config.num_requests):  # all at once, in index order
            prompt = [1 + (index + k) % 200 for k in range(config.min_prompt_len + index)]
            stream = engine.generate(prompt, SamplingParams(max_tokens=config.max_tokens),
                                     request_id=f"req-{index:02d}")
            streams.append(stream.enqueue())
        async with trio.open_nursery() as nursery:
            for stream in streams:
                nursery.start_soon(stream.collect)
        print("", file=out)
        print(engine.stats().format(), file=out)


def run_demo(config: DemoConfig = DemoConfig(), out=None) -> None:
    """Run the seed simulation, printing each step's batch and the final stats.

    Time is virtual (a MockClock) unless `config.real_time`, so the printed
    times are the simulated executor's latency model, the same on every run.
    """
    out = out if out is not None else sys.stdout
    clock = None if config.real_time else trio.testing.MockClock(autojump_threshold=0)
    trio.run(_demo, config, out, clock=clock)


async def _generate(args, out) -> None:
    simulated = args.model == SIMULATED_MODEL or args.executor == "simulated"
    tokenizer = None if simulated else tokenizer_for(args.model)
    prompt = _parse_prompt(args)
    if isinstance(prompt, str) and tokenizer is None and not simulated:
        raise UsageError(f"model {args.model!r} has no tokenizer.json; give the prompt as token "
                         "ids with --token-ids")
    config = EngineConfig(
        scheduler=SchedulerConfig(max_model_len=args.max_model_len),
        executor=args.executor or ("simulated" if simulated else "inprocess"), model=args.model,
        tokenizer=tokenizer, dtype=args.dtype, device=args.device, seed=args.seed,
        latency=LatencyModel() if args.latency else ZERO_LATENCY,
        executor_options={} if simulated else cpu_options(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, logprobs=args.logprobs,
                            stop=tuple(args.stop), seed=args.seed)
    async with open_engine(config) as engine:
        # Submitted first, so a refusal prints alone rather than after the echoed prompt.
        stream = await engine.generate(prompt, params).start()
        if isinstance(prompt, str) and tokenizer is not None:
            out.write(prompt)
        deltas = []
        async for delta in stream:
            if delta.text is not None:
                out.write(delta.text)
            else:
                out.write(" ".join(map(str, delta.token_ids)) + " ")
            out.flush()
            deltas.append(delta)
    out.write("\n")
    last = deltas[-1]
    print(f"[{plural(last.num_tokens, 'token')}, finish: {last.finish_reason}]", file=sys.stderr)
    if args.logprobs is not None:
        _print_logprobs(deltas, tokenizer)


def _print_logprobs(deltas, tokenizer) -> None:
    """One line per generated token on stderr: its id, text, logprob and the top alternatives."""
    for delta in deltas:
        for token, entry in zip(delta.token_ids, delta.logprobs or ()):
            text = repr(tokenizer.decode([token])) if tokenizer is not None else ""
            alternatives = " ".join(f"{t}:{lp:.3f}" for t, lp in entry[1:])
            print(f"{token:>7} {text:<12} {entry[0][1]:9.4f}  {alternatives}", file=sys.stderr)


def _parse_prompt(args) -> str | list[int]:
    if not args.token_ids:
        return args.prompt
    try:
        return [int(t) for t in args.prompt.replace(",", " ").split()]
    except ValueError:
        raise UsageError(f"--token-ids: the prompt must be integers, got {args.prompt!r}") from None


def _check(argv: Sequence[str]) -> int:
    try:
        from cadence.spec.check import main as check_main
    except ImportError as exc:
        if exc.name not in ("cadence.spec.check", "cadence.spec"):
            raise
        print("cadence check: the checker (cadence.spec.check) is not part of this installation",
              file=sys.stderr)
        return USAGE_ERROR
    return check_main(list(argv)) or 0


def _version() -> str:
    try:
        return importlib.metadata.version("cadence")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(
        prog="cadence", description="An LLM inference engine around a formally checked scheduler.")
    parser.add_argument("--version", action="version", version=f"cadence {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="run the seed simulation on the simulated executor",
                          description="Run the seed article's simulation on the real engine with the "
                                      "simulated executor: print each step's batch and the final stats.")
    demo.add_argument("--requests", type=int, default=15, help="number of requests (default 15)")
    demo.add_argument("--min-prompt-len", type=int, default=10,
                      help="prompt length of the first request; each next one is one longer (default 10)")
    demo.add_argument("--max-tokens", type=int, default=4, help="tokens per request (default 4)")
    demo.add_argument("--max-batch-size", type=int, default=8, help="requests per step (default 8)")
    demo.add_argument("--policy", default="fcfs", choices=POLICY_NAMES, help="scheduling policy")
    demo.add_argument("--seed", type=int, default=0, help="the simulated executor's seed")
    demo.add_argument("--real-time", action="store_true",
                      help="run on the wall clock instead of virtual time")

    gen = sub.add_parser("generate", help="stream a completion for one prompt",
                         description="Stream a completion. Without --model the built-in demo "
                                     "model answers (trained on Python source); --model simulated "
                                     "uses no model at all.")
    gen.add_argument("prompt", help="the prompt text (or token ids with --token-ids)")
    gen.add_argument("--token-ids", action="store_true", help="read the prompt as token ids: '1 2 3'")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0,
                     help="sample from the smallest set of tokens this likely (default 1: all)")
    gen.add_argument("--top-k", type=int, default=0,
                     help="sample from the k likeliest tokens (default 0: all)")
    gen.add_argument("--logprobs", type=int, default=None, metavar="K",
                     help="print each token's logprob and its K likeliest alternatives to stderr")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop string (repeatable)")
    gen.add_argument("--model", default="demo",
                     help="a model directory, a preset name (random weights), 'demo' for the "
                          "built-in demo model (default), or 'simulated' for no model")
    gen.add_argument("--executor", choices=EXECUTOR_KINDS,
                     help="where the model runs (default: inprocess; simulated for --model simulated)")
    gen.add_argument("--dtype", default="auto",
                     help="weights dtype: float32, bfloat16, float16 or auto (default: the "
                          "checkpoint's on GPU; on CPU bfloat16 where it has bfloat16 units "
                          "(AMX, AVX-512 BF16), else float32)")
    gen.add_argument("--threads", default="auto", metavar="N",
                     help="torch's CPU threads for the model: an integer, or auto (default)")
    gen.add_argument("--cpu-path", choices=("auto", "packed", "eager"), default="auto",
                     help="how the model computes on a CPU (default auto: packed where it can)")
    gen.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    gen.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN,
                     help=max_model_len_help("longest sequence"))
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.add_argument("--latency", action="store_true",
                     help="simulated executor: sleep as its latency model says")

    sub.add_parser("check", help="run the formal checks of cadence.spec (arguments pass through)",
                   add_help=False)
    sub.add_parser("build-kernels", help="compile the CPU path's C++ kernels now (once per machine)",
                   description="Compile the CPU path's C++ kernels (cadence/gpu/cpu_kernels.cpp) into "
                               "torch's extension cache, as the first large model on this machine "
                               "would; small models (the demo model) use them only once built. "
                               "Needs a C++ compiler and ninja; exits 1 saying why if it cannot.")
    server.add_serve_parser(sub)
    bench.add_bench_parser(sub)
    return parser


def _build_kernels() -> int:
    from cadence.gpu import cpu_kernels

    if cpu_kernels.load() is None:
        print(f"cadence build-kernels: {cpu_kernels.unavailable_reason()}", file=sys.stderr)
        return 1
    print(f"cadence build-kernels: built {cpu_kernels.build_name()}")
    return 0


def _is_following_rank() -> bool:
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1 \
        and int(os.environ["RANK"]) != 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `cadence` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if _is_following_rank():
        # Under a launcher (torchrun), ranks other than 0 run the model shard that
        # rank 0's engine drives; rank 0 runs the command itself.
        from cadence.gpu.tp_worker import follow_launched
        return follow_launched()
    if argv[:1] == ["check"]:
        return _check(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command in ("serve", "bench"):
        return args.func(args)
    if args.command == "build-kernels":
        return _build_kernels()
    try:
        if args.command == "demo":
            run_demo(DemoConfig(num_requests=args.requests, min_prompt_len=args.min_prompt_len,
                                max_tokens=args.max_tokens, max_batch_size=args.max_batch_size,
                                policy=args.policy, seed=args.seed, real_time=args.real_time))
        else:
            with unwrap_sole_error():
                trio.run(_generate, args, sys.stdout)
    except (CadenceError, UsageError) as exc:
        print(f"cadence {args.command}: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
