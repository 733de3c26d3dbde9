"""Shared pieces of the engine tests: a scripted simulated executor and configs."""

from __future__ import annotations

import trio

from cadence.actors import CacheConfig, EngineConfig, ExecutorError, SamplingParams, SchedulerConfig
from cadence.actors.detokenizer import ByteTokenizer
from cadence.actors.simulated import FaultPlan, LatencyModel, SimulatedExecutor

LATENCY = LatencyModel(base_us=1000.0, prefill_us_per_token=10.0, decode_us_per_seq=50.0)
PRINTABLE = tuple(range(32, 127))
EOS = ByteTokenizer.eos_token_id


def text_executor(*, faults: FaultPlan | None = None, token_fn=None, seed: int = 0,
                  eos_probability: float = 0.0) -> SimulatedExecutor:
    """A simulated executor speaking the byte tokenizer's vocabulary (printable ASCII)."""
    return SimulatedExecutor(LATENCY, vocab_size=ByteTokenizer.vocab_size, eos_token_id=EOS,
                             eos_probability=eos_probability, seed=seed, faults=faults,
                             sample_ids=PRINTABLE, token_fn=token_fn)


def scripted(outputs: dict[str, bytes | list[int]], prompt_lens: dict[str, int]):
    """A token_fn that makes request `rid` generate exactly `outputs[rid]`, then EOS."""
    def token_fn(request_id: str, position: int) -> int:
        out = list(outputs[request_id])
        k = position - prompt_lens[request_id]
        return out[k] if k < len(out) else EOS
    return token_fn


def config(executor=None, *, tokenizer=None, max_num_seqs: int = 4, num_blocks: int = 64,
           block_size: int = 4, max_num_batched_tokens: int = 64, max_model_len: int = 128,
           debug_checks: bool = True, **kwargs) -> EngineConfig:
    """An engine config for tests: small cache, invariants checked after every core call."""
    executor = executor if executor is not None else text_executor()
    if tokenizer is None and isinstance(executor, SimulatedExecutor) and executor.vocab_size == ByteTokenizer.vocab_size:
        tokenizer = ByteTokenizer()
    sched_keys = {"policy", "max_waiting", "enable_chunked_prefill", "schedule_interval_us",
                  "preempt_for_priority", "long_prefill_token_threshold", "max_batch_size",
                  "async_scheduling", "admission_headroom_steps"}
    sched = {k: kwargs.pop(k) for k in list(kwargs) if k in sched_keys}
    return EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=max_model_len, debug_checks=debug_checks, **sched),
        cache=CacheConfig(num_blocks=num_blocks, block_size=block_size),
        executor=executor, tokenizer=tokenizer, record_trace=True, **kwargs)


async def gather_outcomes(engine, prompts: dict, params=None, *, delays=None, on_token=None) -> dict[str, object]:
    """Run every request of `prompts` (id -> prompt) at once: each one's tokens, or the
    ExecutorError it ended with. params: id -> SamplingParams (default: 6 greedy
    tokens); delays: id -> seconds before it is sent; on_token(id) on each delta."""
    outcomes: dict[str, object] = {}

    async def one(rid: str) -> None:
        await trio.sleep((delays or {}).get(rid, 0.0))
        p = (params or {}).get(rid, SamplingParams(max_tokens=6, temperature=0.0))
        tokens: list[int] = []
        try:
            async for delta in engine.generate(prompts[rid], p, request_id=rid):
                tokens.extend(delta.token_ids)
                if on_token is not None and delta.token_ids:
                    on_token(rid)
            outcomes[rid] = tokens
        except ExecutorError as exc:
            outcomes[rid] = exc

    async with trio.open_nursery() as nursery:
        for rid in prompts:
            nursery.start_soon(one, rid)
    return outcomes


async def watch_health(engine, seen: list[str], interval_s: float = 0.05) -> None:
    """Append `engine.health` to `seen` whenever it changes, until cancelled."""
    while True:
        if not seen or seen[-1] != engine.health:
            seen.append(engine.health)
        await trio.sleep(interval_s)
