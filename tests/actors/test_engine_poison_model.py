"""Reproductions on a real (random-weight) model in the engine: requests whose
sampling parameters once failed the whole step, and after max_restarts closed
the engine for everybody. Each now costs only itself, whether validation
refuses it at the door or the model runner reports it alone."""

from __future__ import annotations

import pytest
import trio

from cadence.actors import (
    CacheConfig, EngineConfig, InvalidRequestError, PoisonRequestError, SamplingParams,
    SchedulerConfig, open_engine,
)

pytest.importorskip("torch")

# A guard against a hang on a busy machine, not a measure of speed.
GUARD_S = 120
GREEDY = SamplingParams(max_tokens=3, temperature=0.0)


def model_config() -> EngineConfig:
    return EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
        cache=CacheConfig(num_blocks=64, block_size=4), executor="inprocess", model="tiny",
        device="cpu", max_restarts=0, step_timeout_s=GUARD_S, start_timeout_s=GUARD_S)


@pytest.mark.parametrize("poison", [
    dict(max_tokens=3, temperature=1.0, top_k=2**63),
    dict(max_tokens=3, temperature=0.0, min_tokens=2, stop_token_ids=[100_000]),
], ids=["top_k_2_63", "stop_token_out_of_vocab"])
async def test_a_request_the_model_cannot_sample_fails_alone_and_the_engine_stays_open(poison):
    outcomes: dict[str, object] = {}
    with trio.fail_after(GUARD_S):
        async with open_engine(model_config()) as engine:

            async def one(rid: str, params: SamplingParams | dict) -> None:
                try:
                    if isinstance(params, dict):
                        params = SamplingParams(**params)  # may be refused right here
                    outcomes[rid] = (await engine.generate([5, 6, 7, 8], params, request_id=rid).collect()).token_ids
                except (InvalidRequestError, PoisonRequestError) as exc:
                    outcomes[rid] = exc

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, "a", GREEDY)
                nursery.start_soon(one, "poison", poison)
                nursery.start_soon(one, "b", GREEDY)
            # max_restarts=0: a failure of the whole step would have closed the engine.
            assert not engine.closed and engine.scheduler.num_failures == 0
            again = (await engine.generate([5, 6, 7, 8], GREEDY, request_id="c").collect()).token_ids
            assert not engine.core.requests and engine.core.blocks.num_used_blocks == 0
    assert isinstance(outcomes["poison"], (InvalidRequestError, PoisonRequestError))
    assert "'poison'" in str(outcomes["poison"]) or isinstance(outcomes["poison"], InvalidRequestError)
    assert outcomes["a"] == outcomes["b"] == again and len(again) == 3
