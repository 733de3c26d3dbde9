"""The engine end to end with the simulated executor: streaming, aborts, timeouts,
stop strings, priorities, validation at submission, and shutdown.

Every test runs under a MockClock (autojump), so latencies are virtual and the
whole file takes about a second.
"""

from __future__ import annotations

import json

import pytest
import trio
import trio.testing

from cadence.actors import (
    DuplicateRequestError, EngineClosedError, InvalidRequestError, QueueFullError,
    RequestNotFoundError, RequestTooLongError, SamplingParams, open_engine,
)
from cadence.actors.trace import read_trace
from engine_helpers import EOS, config, scripted, text_executor


async def collect(stream):
    return [out async for out in stream]


async def test_streams_one_delta_per_token_with_text_and_timing(autojump_clock):
    executor = text_executor()
    async with open_engine(config(executor)) as engine:
        outs = await collect(engine.generate("hello", SamplingParams(max_tokens=6), request_id="a"))
    assert [len(o.token_ids) for o in outs] == [1] * 6
    assert [o.num_tokens for o in outs] == list(range(1, 7))
    assert [o.finish_reason for o in outs] == [None] * 5 + ["length"]
    tokens = [t for o in outs for t in o.token_ids]
    assert tokens == [executor.expected_token("a", 5 + k) for k in range(6)]
    assert "".join(o.text for o in outs) == bytes(tokens).decode()
    first = outs[0]
    assert first.arrival_s <= first.first_token_s <= first.now_s <= outs[-1].now_s
    assert all(o.first_token_s == first.first_token_s for o in outs)


async def test_token_prompts_and_a_slow_consumer_get_merged_deltas(autojump_clock):
    async with open_engine(config()) as engine:
        stream = await engine.submit([10, 20, 30], SamplingParams(max_tokens=5))
        await trio.sleep(1.0)  # the request finishes meanwhile
        outs = await collect(stream)
    assert len(outs) == 1
    assert outs[0].num_tokens == 5 and len(outs[0].token_ids) == 5
    assert outs[0].finish_reason == "length"


async def test_eos_finishes_with_stop_and_min_tokens_defers_it(autojump_clock):
    outputs = {"a": b"ab", "b": b"ab"}
    executor = text_executor(token_fn=scripted(outputs, {"a": 2, "b": 2}))
    async with open_engine(config(executor)) as engine:
        a = await collect(engine.generate("xy", SamplingParams(max_tokens=8), request_id="a"))
        b = await collect(engine.generate("xy", SamplingParams(max_tokens=8, min_tokens=4), request_id="b"))
    assert [t for o in a for t in o.token_ids] == [ord("a"), ord("b"), EOS]
    assert a[-1].finish_reason == "stop" and "".join(o.text for o in a) == "ab"
    assert [t for o in b for t in o.token_ids] == [ord("a"), ord("b"), EOS, EOS]
    assert b[-1].finish_reason == "stop"


async def test_stop_string_split_across_deltas_ends_the_request(autojump_clock):
    outputs = {"s": b"one, two. three"}
    executor = text_executor(token_fn=scripted(outputs, {"s": 1}))
    async with open_engine(config(executor)) as engine:
        outs = await collect(engine.generate("p", SamplingParams(max_tokens=30, stop=["two."]),
                                             request_id="s"))
        await engine.wait_idle()
        assert engine.core.blocks.num_used_blocks == 0
        assert "s" not in engine.core.requests
    assert "".join(o.text for o in outs) == "one, "
    assert outs[-1].finish_reason == "stop" and outs[-1].detail == "stop string"
    # Tokens stream as they come; the text of ", t", "w", "o" was held back.
    assert outs[-1].num_tokens == len("one, two.")
    trace = engine.trace.records
    assert [r["event"] for r in trace if r["request_id"] == "s"][-1] == "abort"


async def test_stop_string_can_be_kept_in_the_output(autojump_clock):
    executor = text_executor(token_fn=scripted({"s": b"abcSTOPdef"}, {"s": 1}))
    async with open_engine(config(executor)) as engine:
        outs = await collect(engine.generate(
            "p", SamplingParams(max_tokens=30, stop=["STOP", "cS"], include_stop_str_in_output=True),
            request_id="s"))
    assert "".join(o.text for o in outs) == "abcS"  # the earliest match wins


async def test_multibyte_characters_are_never_split(autojump_clock):
    text = "né 🙂!"
    executor = text_executor(token_fn=scripted({"u": text.encode()}, {"u": 1}))
    async with open_engine(config(executor)) as engine:
        outs = await collect(engine.generate("p", SamplingParams(max_tokens=20), request_id="u"))
    pieces = [o.text for o in outs]
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
    assert "🙂" in pieces  # four tokens, one delta of text


async def test_abort_ends_the_stream_and_frees_the_blocks(autojump_clock):
    async with open_engine(config()) as engine:
        stream = await engine.submit("hello", SamplingParams(max_tokens=50), request_id="a")
        first = await stream.__anext__()
        await engine.abort("a")
        rest = await collect(stream)
        assert rest[-1].finish_reason == "abort" and rest[-1].detail == "aborted"
        assert first.num_tokens <= rest[-1].num_tokens < 50
        assert "a" not in engine.core.requests
        assert engine.core.blocks.num_used_blocks == 0
        with pytest.raises(RequestNotFoundError):
            await engine.abort("a")


async def test_breaking_out_of_the_loop_aborts_the_request(autojump_clock):
    async with open_engine(config()) as engine:
        async for out in engine.generate("hello", SamplingParams(max_tokens=100), request_id="b"):
            if out.num_tokens == 3:
                break
        await engine.wait_idle()
        assert "b" not in engine.core.requests
        assert engine.core.blocks.num_used_blocks == 0
        assert engine.core.stats().completed_by_reason == {"abort": 1}
    events = [r["event"] for r in engine.trace.records if r["request_id"] == "b"]
    assert events[-1] == "abort" and events.count("tokens") < 100


async def test_cancelling_the_consumer_aborts_the_request(autojump_clock):
    async with open_engine(config()) as engine:
        with trio.move_on_after(0.01):
            async for _ in engine.generate("hello", SamplingParams(max_tokens=100), request_id="c"):
                pass
        await trio.testing.wait_all_tasks_blocked()
        assert not engine.core.requests
        assert engine.core.blocks.num_used_blocks == 0


async def test_cancelled_before_admission_never_runs(autojump_clock):
    async with open_engine(config(max_num_seqs=1)) as engine:
        with trio.CancelScope() as scope:
            scope.cancel()
            await engine.submit("hello", SamplingParams(max_tokens=5), request_id="w")
        await trio.testing.wait_all_tasks_blocked()
        assert engine.core.stats().num_requests_added == 0
        assert not engine.scheduler.actors


async def test_timeout_aborts_with_detail_timeout(autojump_clock):
    async with open_engine(config()) as engine:
        start = trio.current_time()
        outs = await collect(engine.generate("hello", SamplingParams(max_tokens=100), timeout_s=0.05))
        assert trio.current_time() - start == pytest.approx(0.05)
        await engine.wait_idle()
        assert trio.current_time() - start == pytest.approx(0.05)
        assert not engine.core.requests and engine.core.blocks.num_used_blocks == 0
    assert outs[-1].finish_reason == "abort" and outs[-1].detail == "timeout"
    assert 0 < outs[-1].num_tokens < 100


async def test_priority_policy_admits_waiting_requests_by_priority(autojump_clock):
    cfg = config(max_num_seqs=1, policy="priority")
    async with open_engine(cfg) as engine:
        finished = []

        async def run(rid, priority):
            await collect(engine.generate("x" * 8, SamplingParams(max_tokens=4), request_id=rid,
                                          priority=priority))
            finished.append(rid)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "first", 1)
            await trio.testing.wait_all_tasks_blocked()
            for rid, priority in (("low", 2), ("high", 0), ("mid", 1)):
                nursery.start_soon(run, rid, priority)
                await trio.testing.wait_all_tasks_blocked()
    # "high" preempts the running "first" although every seat is taken; "first" keeps
    # its place by arrival ahead of "mid" of the same priority.
    assert finished == ["high", "first", "mid", "low"]
    admitted = [r["request_id"] for r in engine.trace.records if r["event"] == "admit"]
    assert admitted == ["first", "high", "first", "mid", "low"]
    preempted = [r["request_id"] for r in engine.trace.records if r["event"] == "preempt"]
    assert preempted == ["first"]


async def test_validation_errors_raise_at_submission_with_the_core_message(autojump_clock):
    async with open_engine(config(max_model_len=32, max_num_seqs=1, max_waiting=1)) as engine:
        with pytest.raises(RequestTooLongError, match="max_model_len is 32"):
            await engine.submit([1] * 30, SamplingParams(max_tokens=8))
        with pytest.raises(RequestTooLongError):
            async for _ in engine.generate([1] * 30, SamplingParams(max_tokens=8)):
                pass
        with pytest.raises(InvalidRequestError, match="token id"):
            await engine.submit([1, 100_000], SamplingParams(max_tokens=2))
        with pytest.raises(InvalidRequestError, match="at least one token"):
            await engine.submit([], SamplingParams(max_tokens=2))
        with pytest.raises(InvalidRequestError, match="timeout_s"):
            await engine.submit("x", SamplingParams(max_tokens=2), timeout_s=0)
        running = await engine.submit("x", SamplingParams(max_tokens=8), request_id="run")
        await running.__anext__()
        waiting = await engine.submit("y", SamplingParams(max_tokens=8), request_id="wait")
        with pytest.raises(QueueFullError, match="max_waiting is 1"):
            await engine.submit("z", SamplingParams(max_tokens=8))
        with pytest.raises(DuplicateRequestError):
            await engine.submit("z", SamplingParams(max_tokens=8), request_id="run")
        assert (await collect(running))[-1].finish_reason == "length"
        assert (await collect(waiting))[-1].finish_reason == "length"
    assert [r["request_id"] for r in engine.trace.records if r["event"] == "add"] == ["run", "wait"]


async def test_text_prompts_and_stop_strings_need_a_tokenizer(autojump_clock):
    from cadence.actors.simulated import SimulatedExecutor
    async with open_engine(config(SimulatedExecutor(seed=1))) as engine:
        assert engine.tokenizer is None
        with pytest.raises(InvalidRequestError, match="tokenizer"):
            await engine.submit("hello")
        with pytest.raises(InvalidRequestError, match="tokenizer"):
            await engine.submit([1, 2], SamplingParams(stop=["x"]))
        outs = await collect(engine.generate([1, 2], SamplingParams(max_tokens=3)))
    assert [o.text for o in outs] == [None, None, None]


async def test_closing_the_engine_ends_live_streams_with_engine_closed(autojump_clock):
    errors = []
    async with trio.open_nursery() as nursery:
        async with open_engine(config()) as engine:
            stream = await engine.submit("hello", SamplingParams(max_tokens=100))

            async def consume():
                try:
                    await collect(stream)
                except EngineClosedError as exc:
                    errors.append(exc)

            nursery.start_soon(consume)
            await trio.sleep(0.01)
            core = engine.core
    assert len(errors) == 1
    assert not core.requests and core.blocks.num_used_blocks == 0
    with pytest.raises(EngineClosedError):
        await engine.submit("again")


async def test_schedule_interval_spaces_the_steps(autojump_clock):
    times = []
    cfg = config(schedule_interval_us=20_000)
    async with open_engine(cfg, on_step=lambda plan, now: times.append(now)) as engine:
        await collect(engine.generate("abc", SamplingParams(max_tokens=5)))
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert len(times) == 5 and all(gap >= 0.02 - 1e-9 for gap in gaps)


async def test_trace_file_matches_the_records_in_memory(autojump_clock, tmp_path):
    path = tmp_path / "trace.jsonl"
    async with open_engine(config(trace_path=str(path))) as engine:
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(collect, engine.generate("abc", SamplingParams(max_tokens=3)))
    records = list(read_trace(path))
    assert records == json.loads(json.dumps(engine.trace.records))
    kinds = {r["event"] for r in records}
    assert kinds == {"add", "admit", "tokens", "finish"}
    add = next(r for r in records if r["event"] == "add")
    assert set(add) == {"seq", "t", "step", "request_id", "event", "reason", "prompt_len",
                        "max_tokens", "priority", "tenant"}
    finish = next(r for r in records if r["event"] == "finish")
    assert finish["reason"] == "length" and "tokens" not in finish


async def test_plan_ahead_overlaps_prefill_chunks_without_changing_outputs(autojump_clock):
    results = {}
    for plan_ahead in (True, False):
        cfg = config(max_num_batched_tokens=8, plan_ahead=plan_ahead, max_num_seqs=4)
        async with open_engine(cfg) as engine:
            outs = {}

            async def run(i):
                outs[i] = [t for o in await collect(engine.generate(
                    "p" * (10 + 7 * i), SamplingParams(max_tokens=4), request_id=f"r{i}"))
                    for t in o.token_ids]

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(run, i)
            results[plan_ahead] = (outs, engine.scheduler.num_planned_ahead)
    assert results[True][0] == results[False][0]
    assert results[True][1] > 0 and results[False][1] == 0


async def test_logprobs_reach_each_delta_and_the_collected_result(autojump_clock):
    """A request asking for logprobs gets, per token, the sampled token first and
    then that many alternatives; one that does not ask gets None."""
    async with open_engine(config(text_executor())) as engine:
        outs = await collect(engine.generate("hello", SamplingParams(max_tokens=5, logprobs=2),
                                             request_id="a"))
        result = await engine.generate("hello", SamplingParams(max_tokens=3, logprobs=1),
                                       request_id="b").collect()
        plain = await engine.generate("hello", SamplingParams(max_tokens=3), request_id="c").collect()
    for out in outs:
        assert len(out.logprobs) == len(out.token_ids)
        for token, entry in zip(out.token_ids, out.logprobs):
            assert entry[0] == (token, 0.0) and len(entry) == 3
    assert [entry[0][0] for entry in result.logprobs] == result.token_ids
    assert plain.logprobs is None
