"""AsyncioEngine under asyncio.run: many concurrent streams, cancellation of a
consumer (its request aborted, its blocks freed), errors as themselves."""

from __future__ import annotations

import asyncio

import pytest

from cadence.actors import (
    AsyncioEngine, EngineClosedError, InvalidRequestError, RequestNotFoundError,
    RequestTooLongError, SamplingParams,
)
from cadence.actors.simulated import LatencyModel

NUM_STREAMS = 50
# A step of one millisecond: long requests stay running while the test acts on them.
STEP = LatencyModel(base_us=1000.0, prefill_us_per_token=0.0, decode_us_per_seq=0.0)
WAIT_S = 30.0


def _engine(**options) -> AsyncioEngine:
    return AsyncioEngine(executor="simulated", latency=STEP, max_num_seqs=64, num_blocks=1024,
                         block_size=16, enable_prefix_caching=False, **options)


def test_fifty_concurrent_streams_each_get_their_own_tokens():
    async def main():
        async with _engine() as engine:
            async def consume(i: int):
                deltas = [out async for out in engine.generate(f"prompt {i}", SamplingParams(max_tokens=5 + i % 7))]
                return deltas
            all_deltas = await asyncio.wait_for(
                asyncio.gather(*(consume(i) for i in range(NUM_STREAMS))), WAIT_S)
            stats = await engine.stats()
        return all_deltas, stats

    all_deltas, stats = asyncio.run(main())
    for i, deltas in enumerate(all_deltas):
        assert sum(len(out.token_ids) for out in deltas) == 5 + i % 7
        assert [out.finish_reason for out in deltas][-1] == "length"
        assert all(out.finish_reason is None for out in deltas[:-1])
        assert len({out.request_id for out in deltas}) == 1
        assert [t for out in deltas for t in out.outputs[0].token_ids] == [t for out in deltas for t in out.token_ids]
        assert deltas[-1].outputs[0].finish_reason == "length"  # vLLM's names on each delta
    assert len({deltas[0].request_id for deltas in all_deltas}) == NUM_STREAMS
    assert stats.num_requests_completed == NUM_STREAMS


def test_cancelling_a_consumer_aborts_its_request_and_frees_its_blocks():
    async def main():
        async with _engine(max_model_len=20_000) as engine:
            started = asyncio.Event()

            async def consume():
                async for out in engine.generate("long", SamplingParams(max_tokens=10_000)):
                    if out.token_ids:
                        started.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(started.wait(), WAIT_S)
            busy = await engine.stats()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(engine.wait_idle(), WAIT_S)
            return busy, await engine.stats()

    busy, idle = asyncio.run(main())
    assert busy.num_running == 1 and busy.kv_usage > 0
    assert idle.completed_by_reason.get("abort") == 1
    assert idle.num_running == 0 and idle.kv_usage == 0


def test_abort_collect_and_errors_come_out_as_themselves():
    async def main():
        async with _engine(max_model_len=64) as engine:
            with pytest.raises(RequestTooLongError):
                await engine.generate("x", SamplingParams(max_tokens=1000)).start()
            with pytest.raises(InvalidRequestError):
                await engine.generate([10**9]).collect()
            with pytest.raises(RequestNotFoundError):
                await engine.abort("nobody")
            stream = await engine.generate("y", SamplingParams(max_tokens=50), request_id="r").start()
            assert stream.request_id == "r"
            await engine.abort("r")
            result = await asyncio.wait_for(stream.collect(), WAIT_S)
            full = await engine.generate("hello", SamplingParams(max_tokens=3)).collect()
        with pytest.raises(EngineClosedError):
            await engine.generate("z").start()
        return result, full

    aborted, full = asyncio.run(main())
    assert aborted.finish_reason == "abort" and aborted.request_id == "r"
    assert full.prompt == "hello" and full.prompt_token_ids == list(b"hello")
    assert len(full.token_ids) == 3 and full.text == bytes(full.token_ids).decode()


def test_closing_the_engine_ends_a_waiting_consumer_with_engine_closed():
    async def main():
        engine = _engine(max_model_len=20_000)
        async with engine:
            stream = await engine.generate("long", SamplingParams(max_tokens=10_000)).start()
            await stream.__anext__()

            async def consume():
                async for _ in stream:
                    pass

            task = asyncio.create_task(consume())
        with pytest.raises(EngineClosedError):
            await asyncio.wait_for(task, WAIT_S)

    asyncio.run(main())


@pytest.mark.parametrize("cancel_after_s", [0.0, 0.001, 0.05])
def test_a_consumer_cancelled_at_any_point_leaves_no_request_behind(cancel_after_s):
    """Cancelled while its submission is in flight, just after, or while streaming: the
    request ends aborted either way (the answer that arrives for nobody is undone)."""
    async def main():
        async with _engine(max_model_len=20_000) as engine:
            async def consume():
                async for _ in engine.generate("long", SamplingParams(max_tokens=10_000)):
                    pass

            task = asyncio.create_task(consume())
            await asyncio.sleep(cancel_after_s)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # The submission may still be on its way to the engine: wait until it has
            # arrived and ended (a request left running would keep this loop going).
            async def settled():
                while True:
                    stats = await engine.stats()
                    if stats.num_requests_added and stats.num_requests_completed == stats.num_requests_added:
                        return stats
                    await asyncio.sleep(0.01)
            return await asyncio.wait_for(settled(), WAIT_S)

    stats = asyncio.run(main())
    assert stats.num_running == 0 and stats.kv_usage == 0
    assert stats.completed_by_reason == {"abort": 1}
