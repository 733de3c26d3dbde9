"""`cadence bench`: statistics on known timings, and short runs against an embedded
engine and a server in a background thread."""

from __future__ import annotations

import argparse
import json
import math
import sys

import pytest

from cadence.actors.bench import (
    RequestTiming, add_bench_parser, format_result, load_workload, summarize,
)
from cadence.actors.serve.server import ServerThread

from test_server_support import engine_config, server_config


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="cadence")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def _timing(start: float, first: float, end: float, num_tokens: int, itl: list[float]) -> RequestTiming:
    return RequestTiming(num_prompt_tokens=10, start_s=start, first_token_s=first, end_s=end,
                         num_tokens=num_tokens, itl_s=itl)


def test_summary_statistics_on_known_timings():
    timings = [
        _timing(0.0, 0.1, 1.1, 11, [0.1] * 10),   # TTFT 100 ms, TPOT 100 ms
        _timing(0.0, 0.3, 0.5, 3, [0.1, 0.1]),    # TTFT 300 ms, TPOT 100 ms
        _timing(1.0, 1.2, 1.2, 1, []),            # one token: no TPOT
        RequestTiming(num_prompt_tokens=10, start_s=0.0, error="QueueFullError: full"),
    ]
    result = summarize("w", "t", timings, duration_s=2.0, slo={"ttft_ms": 200.0})
    assert (result.num_requests, result.num_completed, result.num_failed) == (4, 3, 1)
    assert result.ttft_ms["mean"] == pytest.approx(200.0)
    assert result.ttft_ms["p50"] == pytest.approx(200.0)
    assert result.ttft_ms["p90"] == pytest.approx(280.0)  # linear between the closest ranks
    assert result.tpot_ms["mean"] == pytest.approx(100.0)
    assert result.itl_ms["p99"] == pytest.approx(100.0)
    assert result.e2e_ms["p50"] == pytest.approx(500.0)
    assert result.request_throughput == pytest.approx(1.5)
    assert result.output_throughput == pytest.approx(15 / 2.0)
    assert result.total_token_throughput == pytest.approx((30 + 15) / 2.0)
    assert result.goodput == pytest.approx(1.0)  # the 300 ms TTFT one misses the SLO
    assert result.first_error == "QueueFullError: full"
    text = format_result(result)
    assert "goodput" in text and "TTFT <= 200 ms" in text and "p90" in text


def test_empty_statistics_are_nan_not_errors():
    result = summarize("w", "t", [], duration_s=0.0, slo={})
    assert math.isnan(result.ttft_ms["mean"]) and result.num_completed == 0


@pytest.mark.parametrize("name", ["nano-vllm", "nano"])
def test_the_nano_workloads_match_their_description(name):
    requests = load_workload(name)
    assert len(requests) == 256
    assert all(100 <= len(r.prompt_token_ids) <= 1024 and 100 <= r.max_tokens <= 1024 for r in requests)
    assert load_workload(name, 5) == requests[:5]
    if name == "nano-vllm":
        assert sum(r.max_tokens for r in requests) == 133_966  # nano-vllm's published total


def test_bench_against_an_embedded_engine_writes_one_json_line(tmp_path, capsys):
    out = tmp_path / "result.json"
    args = _parse("--embedded", "--model", "simulated", "--workload", "prefix", "--num-requests", "12",
                  "--sim-step-us", "0",
                  "--max-num-seqs", "8", "--json", str(out), "--no-progress")
    assert args.func(args) == 0
    (line,) = out.read_text().splitlines()
    result = json.loads(line)
    assert result["num_completed"] == 12 and result["num_failed"] == 0
    assert result["num_output_tokens"] == sum(r.max_tokens for r in load_workload("prefix", 12))
    assert result["ttft_ms"]["p50"] > 0 and result["e2e_ms"]["p99"] >= result["e2e_ms"]["p50"]
    assert "end-to-end latency" in capsys.readouterr().out


def test_bench_against_a_server_over_several_connections(capsys):
    with ServerThread(engine_config(), server_config()) as thread:
        host, port = thread.server.tcp_address
        args = _parse("--host", host, "--port", str(port), "--num-requests", "16", "--connections", "3",
                      "--request-rate", "500", "--json", "-", "--no-progress")
        assert args.func(args) == 0
        stats = thread.call(thread.server.engine.stats)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["num_completed"] == 16 and result["target"] == f"{host}:{port}"
    assert stats.num_requests_completed == 16
    assert stats.num_tokens_generated == result["num_output_tokens"]


def test_plot_without_matplotlib_is_a_one_line_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes the import fail
    args = _parse("--embedded", "--model", "simulated", "--num-requests", "2", "--plot", "out.png")
    assert args.func(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--plot needs matplotlib" in err[0]
    assert "cadence[plot]" in err[0]  # the extra that installs it


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    args = _parse("--embedded", "--model", "simulated", "--workload", "prefix", "--num-requests", "6",
                  "--sim-step-us", "500",
                  "--plot", str(path), "--sample-interval-s", "0.02", "--no-progress")
    assert args.func(args) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [
    (["--workload", "nope"], "unknown workload"),
    (["--workload", "missing.jsonl"], "cannot read the trace"),
    (["--port", "1", "--num-requests", "1"], "cannot connect"),
    (["--percentiles", "50,x"], "--percentiles"),
    (["--request-rate", "0"], "--request-rate"),
])
def test_user_errors_are_one_line(argv, message, capsys):
    args = _parse(*argv, "--no-progress")
    assert args.func(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


class _SomeNeverEnd:
    """A target whose requests with max_tokens 0 never end; the others give 2 tokens."""

    async def stream(self, request):
        import trio

        if request.max_tokens == 0:
            await trio.sleep_forever()
        for _ in range(2):
            await trio.sleep(0.01)
            yield 1


async def test_a_stopped_run_returns_what_finished_and_marks_the_rest_interrupted():
    import trio

    from cadence.actors.bench import BenchRequest, run_benchmark

    requests = [BenchRequest([1], 2), BenchRequest([1], 0), BenchRequest([1], 2)]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        async def stop_when_the_others_are_done():
            await trio.sleep(1.0)
            stop.set()
        nursery.start_soon(stop_when_the_others_are_done)
        timings, _, duration = await run_benchmark(_SomeNeverEnd(), requests, stop=stop)
    assert [t.ok for t in timings] == [True, False, True] and timings[1].error == "interrupted"
    assert [t.num_tokens for t in timings] == [2, 0, 2] and duration < 5.0
    result = summarize("test", "fake", timings, duration, {})
    assert (result.num_completed, result.num_failed) == (2, 1)


async def test_ctrl_c_sets_the_stop_event():
    import signal

    import trio
    import trio.testing

    from cadence.actors.bench import _set_on_sigint

    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_set_on_sigint, stop)
        await trio.testing.wait_all_tasks_blocked()
        signal.raise_signal(signal.SIGINT)  # caught by the receiver, not by the test run
        with trio.fail_after(5):
            await stop.wait()
