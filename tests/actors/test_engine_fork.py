"""`n` > 1 through the engine: `Engine.generate_group` submits one request group,
whose prompt is computed once and whose samples share its blocks. With prefix
caching off (so nothing else shares blocks) the samples must equal those of n
independent requests with the same seeds, on the simulated executor and on the
demo model's real forward pass, and aborting one must leave the others as they were.
"""

from __future__ import annotations

import attrs
import pytest
import trio

from cadence.actors import EngineConfig, QueueFullError, SamplingParams, open_engine

from engine_helpers import config, text_executor

PROMPT = list(range(40, 70))  # 30 tokens
BLOCK = 4
SHARED = (len(PROMPT) - 1) // BLOCK * BLOCK
IDS = ["s0", "s1", "s2", "s3"]


def no_cache(cfg: EngineConfig) -> EngineConfig:
    return attrs.evolve(cfg, cache=attrs.evolve(cfg.cache, enable_prefix_caching=False))


def samples(max_tokens: int, temperature: float = 1.0) -> list[SamplingParams]:
    """One set of parameters per sample: seeds differ, as the HTTP API's `n` gives them."""
    return [SamplingParams(max_tokens=max_tokens, seed=11 + i, temperature=temperature,
                           ignore_eos=True) for i in range(len(IDS))]


async def run(engine, fork: bool, params, *, abort: str | None = None, prompt=PROMPT,
              after_abort=None) -> dict[str, list[int]]:
    """Run the samples (as a group or as independent requests); with `abort`, that
    one is abandoned after its third token (its siblings, admitted once its prompt
    was computed, hold its prompt blocks by then) and `after_abort` (a coroutine
    function of the engine) runs beside the others."""
    streams = (engine.generate_group(prompt, params, request_ids=IDS) if fork
               else [engine.generate(prompt, p, request_id=r) for p, r in zip(params, IDS)])
    out: dict[str, list[int]] = {}

    async def consume(rid, stream):
        tokens = out.setdefault(rid, [])
        async for delta in stream:
            tokens.extend(delta.token_ids)
            if rid == abort and len(tokens) >= 3:
                await stream.aclose()
                if after_abort is not None:
                    await after_abort(engine)
                return

    for stream in streams:
        stream.enqueue()
    async with trio.open_nursery() as nursery:
        for rid, stream in zip(IDS, streams):
            nursery.start_soon(consume, rid, stream)
    await engine.wait_idle()
    return out


def assert_every_block_free(engine) -> None:
    blocks = engine.core.blocks
    assert not blocks.tables and blocks.num_free_blocks == blocks.num_blocks


async def test_simulated_fork_equals_independent_requests_and_computes_the_prompt_once(autojump_clock):
    cfg = no_cache(config(text_executor(), max_num_seqs=8, block_size=BLOCK))
    results = {}
    for fork in (True, False):
        async with open_engine(attrs.evolve(cfg, executor=text_executor())) as engine:
            results[fork] = (await run(engine, fork, samples(6)), engine.stats())
            assert_every_block_free(engine)
    (forked, fork_stats), (alone, alone_stats) = results[True], results[False]
    assert forked == alone and all(len(t) == 6 for t in forked.values())
    decodes = 4 * (6 - 1)
    assert fork_stats.num_scheduled_tokens == len(PROMPT) + 3 * (len(PROMPT) - SHARED) + decodes
    assert alone_stats.num_scheduled_tokens == 4 * len(PROMPT) + decodes
    assert fork_stats.num_shared_prompt_tokens == 3 * SHARED and alone_stats.num_shared_prompt_tokens == 0


async def test_simulated_abort_of_one_sample_leaves_the_others_unchanged(autojump_clock):
    cfg = no_cache(config(text_executor(), max_num_seqs=8, block_size=BLOCK))
    async with open_engine(cfg) as engine:
        whole = await run(engine, True, samples(6))
        shared_before = engine.stats().num_shared_prompt_tokens
        cut = await run(engine, True, samples(6), abort="s0")
        assert engine.stats().num_shared_prompt_tokens - shared_before == 3 * SHARED
        assert_every_block_free(engine)
    assert len(cut.pop("s0")) < 6
    assert cut == {rid: whole[rid] for rid in IDS[1:]}


async def test_a_group_is_refused_whole(autojump_clock):
    async with open_engine(config(max_waiting=3, max_num_seqs=1)) as engine:
        streams = engine.generate_group(PROMPT, samples(2))
        for stream in streams:
            with pytest.raises(QueueFullError, match="a group of 4 requests"):
                await stream.start()
        assert not engine.core.requests


def demo_config(**kwargs) -> EngineConfig:
    return EngineConfig.from_kwargs(executor="inprocess", model="demo", max_model_len=96,
                                    num_blocks=48, block_size=BLOCK, max_num_seqs=8,
                                    enable_prefix_caching=False, **kwargs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_the_demo_model_samples_a_group_as_independent_requests(temperature):
    """The followers' first blocks were computed by the leader: their attention reads
    KV written for another request, so equal samples mean the sharing is right."""
    params = samples(5, temperature)
    results = {}
    for fork in (True, False):
        async with open_engine(demo_config()) as engine:
            results[fork] = await run(engine, fork, params)
            stats = engine.stats()
            assert stats.num_shared_prompt_tokens == (3 * SHARED if fork else 0)
            assert_every_block_free(engine)
    assert results[True] == results[False]
    assert all(len(t) == 5 for t in results[True].values())
    if temperature:
        assert len({tuple(t) for t in results[True].values()}) > 1  # the seeds differ


async def test_the_demo_model_keeps_shared_blocks_when_the_leader_is_aborted():
    """After the leader goes, a newcomer takes every block that is free; the shared
    prompt blocks are not among them, so the other samples come out unchanged."""
    params = samples(5)

    async def newcomer(engine):
        await engine.generate(list(range(100, 140)), SamplingParams(max_tokens=3)).collect()

    async with open_engine(demo_config()) as engine:
        whole = await run(engine, True, params)
        shared_before = engine.stats().num_shared_prompt_tokens
        cut = await run(engine, True, params, abort="s0", after_abort=newcomer)
        assert engine.stats().num_shared_prompt_tokens - shared_before == 3 * SHARED
        assert_every_block_free(engine)
    del cut["s0"]
    assert cut == {rid: whole[rid] for rid in IDS[1:]}


async def test_samples_asking_for_prompt_logprobs_are_independent_requests(autojump_clock):
    """Each needs the logits of every prompt position, which shared blocks do not give."""
    cfg = no_cache(config(text_executor(), max_num_seqs=8, block_size=BLOCK))
    params = [attrs.evolve(p, prompt_logprobs=1) for p in samples(2)]
    async with open_engine(cfg) as engine:
        streams = engine.generate_group(PROMPT, params, request_ids=IDS)
        for stream in streams:
            stream.enqueue()
        for stream in streams:
            await stream.start()
        assert all(engine.core.requests[rid].group is None for rid in IDS)
        firsts = [await stream.__anext__() for stream in streams]
        await engine.wait_idle()
        assert engine.stats().num_shared_prompt_tokens == 0
    assert all(out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(PROMPT)
               for out in firsts)
