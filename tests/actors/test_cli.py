"""The `cadence` command: the seed demo, generate, check, and one-line errors."""

from __future__ import annotations

import argparse
import io
import re
import shutil
import sys
from pathlib import Path

import pytest

from cadence.actors import ConfigError, cli
from cadence.actors.bench import add_bench_parser
from cadence.actors.engine import demo_model_dir
from cadence.actors.engine_args import (PACED_BURST_SPLIT, PACED_FINISH_HOLD_STEPS, PACED_MIXED_PREFILL_TOKENS,
                                         SERVE_ADMISSION_DELAY_BUDGET, SERVE_CPU_AVX512_MAX_NUM_BATCHED_TOKENS,
                                         SERVE_CPU_MAX_NUM_BATCHED_TOKENS, SERVE_CPU_MIXED_DRAIN_STEPS,
                                         SERVE_CPU_MIXED_PREFILL_CHUNKS, SERVE_CPU_MIXED_PREFILL_TOKENS,
                                         SERVE_CPU_SMALL_MODEL_MAX_NUM_BATCHED_TOKENS,
                                         engine_config_from_args)
from cadence.actors.serve.server import add_serve_parser
from cadence.actors.wire import DEFAULT_PORT
from cadence.gpu.cpu_kernels import has_avx512
from cadence.statemachine.config import SchedulerConfig

README = Path(__file__).resolve().parents[2] / "README.md"


def run(capsys, *argv) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_demo_prints_every_batch_and_the_stats():
    out = io.StringIO()
    cli.run_demo(cli.DemoConfig(), out)
    text = out.getvalue()
    steps = re.findall(r"^step +\d+ .*\[(.*)\]$", text, re.M)
    batches = [dict(item.split(":") for item in step.split()) for step in steps]
    assert all(len(batch) <= 8 for batch in batches)
    # The first batch admits the first eight prompts whole (10..17 tokens).
    assert batches[0] == {f"req-{i:02d}": str(10 + i) for i in range(8)}
    # Each request runs in four steps: its prefill (which samples the first token), then three decodes.
    appearances = {}
    for batch in batches:
        for rid in batch:
            appearances[rid] = appearances.get(rid, 0) + 1
    assert appearances == {f"req-{i:02d}": 4 for i in range(15)}
    assert "requests completed:    15 {'length': 15}" in text
    assert "tokens generated:      60" in text
    again = io.StringIO()
    cli.run_demo(cli.DemoConfig(), again)
    assert again.getvalue() == text  # virtual time: the same output every run


def test_demo_command(capsys):
    status, out, _ = run(capsys, "demo", "--requests", "3", "--max-tokens", "2")
    assert status == 0 and "requests completed:    3" in out


def test_generate_streams_text(capsys):
    status, out, err = run(capsys, "generate", "Hello", "--max-tokens", "12", "--model", "simulated")
    assert status == 0
    assert len(out.rstrip("\n")) == 12
    assert "[12 tokens, finish: length]" in err


def test_generate_defaults_to_the_demo_model_and_echoes_the_prompt(capsys):
    status, out, err = run(capsys, "generate", "def ", "--max-tokens", "24")
    assert status == 0
    assert out.startswith("def ")
    # Byte-level tokenizer: 24 tokens are 24 bytes of text after the prompt.
    assert len(out.rstrip("\n").encode()) == len("def ") + 24
    assert "[24 tokens, finish: length]" in err
    again = run(capsys, "generate", "def ", "--max-tokens", "24")[1]
    assert again == out  # greedy by default


def test_user_mistakes_print_one_line_and_exit_2(capsys):
    status, out, err = run(capsys, "generate", "x", "--max-tokens", "99999")
    assert status == 2
    assert err.count("\n") == 1 and "max_model_len" in err and "Traceback" not in err
    assert out == ""  # the prompt is echoed only once the request is accepted
    status, _, err = run(capsys, "generate", "a b", "--token-ids")
    assert status == 2 and "must be integers" in err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--requests", "many"])
    assert exit_info.value.code == 2


def test_check_is_lazy_and_says_when_it_is_missing(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "cadence.spec.check", None)
    status, _, err = run(capsys, "check", "--anything")
    assert status == 2 and "cadence.spec.check" in err


def test_help_everywhere(capsys):
    for argv in ([], ["demo"], ["generate"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv + ["--help"])
        assert exit_info.value.code == 0
        assert "usage: cadence" in capsys.readouterr().out


def test_build_kernels_builds_them_or_says_why_not(capsys, monkeypatch):
    from cadence.gpu import cpu_kernels

    status, out, _ = run(capsys, "build-kernels")
    assert status == 0 and cpu_kernels.build_name() in out and cpu_kernels.is_built()
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    monkeypatch.setattr(cpu_kernels, "unavailable_reason", lambda: "RuntimeError: no compiler")
    status, _, err = run(capsys, "build-kernels")
    assert status == 1 and "no compiler" in err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert re.fullmatch(r"cadence \S+.*\n", capsys.readouterr().out)


def test_generate_passes_the_sampling_options_and_prints_logprobs(capsys):
    greedy = run(capsys, "generate", "def ", "--max-tokens", "6", "--dtype", "float32")[1]
    # top-k 1 leaves one candidate, so sampling at temperature 1 gives the greedy text.
    status, out, err = run(capsys, "generate", "def ", "--max-tokens", "6", "--temperature", "1",
                           "--top-k", "1", "--top-p", "0.9", "--dtype", "float32", "--logprobs", "2")
    assert status == 0 and out == greedy
    token_lines = [line for line in err.splitlines() if re.match(r"^ *\d+ ", line)]
    assert len(token_lines) == 6
    assert all(len(line.split(":")) == 3 for line in token_lines)  # two alternatives each


def test_a_checkpoint_without_a_tokenizer_takes_token_ids(tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(demo_model_dir(), model,
                    ignore=shutil.ignore_patterns("tokenizer.json", "tokenizer_config.json"))
    status, out, err = run(capsys, "generate", "100 101 102", "--token-ids", "--model", str(model),
                           "--max-tokens", "3")
    assert status == 0, err
    assert len(out.split()) == 3 and all(t.isdigit() for t in out.split())
    status, out, err = run(capsys, "generate", "def ", "--model", str(model))
    assert status == 2 and "tokenizer.json" in err and "--token-ids" in err and out == ""


def _subparser(add, name: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cadence")
    add(parser.add_subparsers(dest="command"))
    return parser._subparsers._group_actions[0].choices[name]


def test_every_serve_and_bench_option_says_what_it_does():
    for add, name in ((add_serve_parser, "serve"), (add_bench_parser, "bench")):
        parser = _subparser(add, name)
        silent = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
        assert silent == [], f"{name} options without help: {silent}"


def test_serve_and_bench_default_to_the_demo_model_and_name_the_simulated_one():
    serve = _subparser(add_serve_parser, "serve")
    config = engine_config_from_args(serve.parse_args([]))
    assert (config.executor, config.model) == ("inprocess", "demo")
    assert config.tokenizer is not None  # the demo model brings its own
    config = engine_config_from_args(serve.parse_args(["--model", "simulated"]))
    assert config.executor == "simulated"
    with pytest.raises(ConfigError, match="--sim-step-us times the simulated executor"):
        engine_config_from_args(serve.parse_args(["--sim-step-us", "0"]))
    bench = _subparser(add_bench_parser, "bench")
    # bench looks where serve listens (its --port default is resolved at run time, by protocol).
    port_help = next(a.help for a in bench._actions if "--port" in a.option_strings)
    assert serve.parse_args([]).port == DEFAULT_PORT and f"default: {DEFAULT_PORT}" in port_help


def test_a_server_shares_its_admissions_and_an_offline_engine_does_not():
    serve = _subparser(add_serve_parser, "serve")
    config = engine_config_from_args(serve.parse_args(["--model", "simulated"]))
    assert config.scheduler.admission_delay_budget == SERVE_ADMISSION_DELAY_BUDGET > 0
    off = engine_config_from_args(serve.parse_args(["--model", "simulated", "--admission-delay-budget", "0"]))
    assert off.scheduler.admission_delay_budget == 0
    assert SchedulerConfig().admission_delay_budget == 0  # the embedded engine and LLM
    with pytest.raises(ConfigError, match="admission.delay.budget must be >= 0"):
        engine_config_from_args(serve.parse_args(["--model", "simulated", "--admission-delay-budget", "-1"]))


def test_a_cpu_server_gives_a_small_model_a_smaller_token_budget(tmp_path):
    """The demo model (and any shape under SMALL_MODEL_MACS) takes a quarter of the CPU
    budget a step; a larger model the whole, as does one whose configuration cannot be
    read (its load reports that); the option and other devices are unchanged."""
    from cadence.gpu.config import SMALL_MODEL_MACS, macs_per_token, preset

    serve = _subparser(add_serve_parser, "serve")

    def budget(*argv):
        return engine_config_from_args(serve.parse_args(list(argv))).scheduler.max_num_batched_tokens

    assert macs_per_token(preset("tiny")) < SMALL_MODEL_MACS <= macs_per_token(preset("qwen3-0.6b"))
    assert budget("--device", "cpu") == SERVE_CPU_SMALL_MODEL_MAX_NUM_BATCHED_TOKENS == 512  # the demo model
    assert budget("--device", "cpu", "--model", "tiny") == 512
    larger = SERVE_CPU_AVX512_MAX_NUM_BATCHED_TOKENS if has_avx512() else SERVE_CPU_MAX_NUM_BATCHED_TOKENS
    assert budget("--device", "cpu", "--model", "qwen3-0.6b") == larger
    (tmp_path / "config.json").write_text("{not json")
    assert budget("--device", "cpu", "--model", str(tmp_path)) == SERVE_CPU_MAX_NUM_BATCHED_TOKENS
    assert budget("--device", "cpu", "--model", str(tmp_path / "missing")) == SERVE_CPU_MAX_NUM_BATCHED_TOKENS
    assert budget("--device", "cpu", "--max-num-batched-tokens", "4096") == 4096
    assert budget("--device", "cuda") == SchedulerConfig().max_num_batched_tokens


@pytest.mark.parametrize("flags, expected", [("fpu avx2 fma", 2048), ("fpu avx2 avx512f avx512bw", 256),
                                              ("fpu avx2 avx512f", 2048)])
def test_a_cpu_servers_budget_for_a_larger_model_follows_the_cpus_vector_units(monkeypatch, flags, expected):
    """With AVX-512 (where the kernels attend a step's prompts in one pass) a step takes
    256 tokens, elsewhere vLLM's 2,048; the demo model 512 on either."""
    from cadence.gpu import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: f"flags\t\t: {flags}")
    serve = _subparser(add_serve_parser, "serve")

    def budget(*argv):
        return engine_config_from_args(serve.parse_args(list(argv))).scheduler.max_num_batched_tokens

    assert budget("--device", "cpu", "--model", "qwen3-0.6b") == expected
    assert budget("--device", "cpu") == SERVE_CPU_SMALL_MODEL_MAX_NUM_BATCHED_TOKENS
    assert budget("--device", "cpu", "--model", "qwen3-0.6b", "--max-num-batched-tokens", "4096") == 4096


@pytest.mark.parametrize("flags", ["fpu avx2 avx512f avx512bw", "fpu avx2 fma"])
def test_a_cpu_server_bounds_prompts_beside_decodes_with_avx512(monkeypatch, flags):
    """With AVX-512 and a model that is not small, a step beside decodes computes at
    most 16 prompt tokens or an eighth of the longest prompt, for queues up to 64 steps
    of it, at any thread count; a small model or a CPU without AVX-512 keep no bound;
    a bound given keeps the core's drain and no chunks unless they are given too."""
    from cadence.gpu import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: f"flags\t\t: {flags}")
    serve = _subparser(add_serve_parser, "serve")

    def mixed(*argv):
        s = engine_config_from_args(serve.parse_args(["--device", "cpu", *argv])).scheduler
        return (s.max_num_batched_tokens, s.mixed_prefill_tokens, s.mixed_prefill_drain_steps,
                s.mixed_prefill_chunks)

    core = SchedulerConfig().mixed_prefill_drain_steps
    assert core == 16 and SchedulerConfig().mixed_prefill_tokens == 0  # the embedded engine and LLM
    assert SchedulerConfig().mixed_prefill_chunks == 0
    assert mixed("--threads", "8") == (SERVE_CPU_SMALL_MODEL_MAX_NUM_BATCHED_TOKENS, 0, core, 0)  # the demo
    if "avx512bw" not in flags:
        assert mixed("--model", "qwen3-0.6b", "--threads", "4") == (SERVE_CPU_MAX_NUM_BATCHED_TOKENS, 0, core, 0)
        return
    bounded = (SERVE_CPU_AVX512_MAX_NUM_BATCHED_TOKENS, SERVE_CPU_MIXED_PREFILL_TOKENS, SERVE_CPU_MIXED_DRAIN_STEPS,
               SERVE_CPU_MIXED_PREFILL_CHUNKS)
    assert bounded == (256, 16, 64, 8)
    for threads in ("1", "2", "auto"):
        assert mixed("--model", "qwen3-0.6b", "--threads", threads) == bounded
    assert mixed("--model", "qwen3-0.6b", "--mixed-prefill-tokens", "24") == (256, 24, core, 0)
    assert mixed("--model", "qwen3-0.6b", "--mixed-prefill-tokens", "0") == (256, 0, core, 0)
    assert mixed("--model", "qwen3-0.6b", "--mixed-prefill-tokens", "24", "--mixed-prefill-drain-steps",
                 "64", "--mixed-prefill-chunks", "4") == (256, 24, 64, 4)
    assert mixed("--model", "qwen3-0.6b", "--mixed-prefill-drain-steps", "5") == (256, 16, 5, 8)
    assert mixed("--model", "qwen3-0.6b", "--mixed-prefill-chunks", "2") == (256, 16, 64, 2)
    assert engine_config_from_args(serve.parse_args(
        ["--device", "cuda", "--model", "qwen3-0.6b"])).scheduler.mixed_prefill_tokens == 0
    with pytest.raises(ConfigError, match="--mixed-prefill-drain-steps must be >= 1, got 0"):
        mixed("--mixed-prefill-drain-steps", "0")
    with pytest.raises(ConfigError, match="--mixed-prefill-chunks must be >= 0, got -1"):
        mixed("--mixed-prefill-chunks", "-1")


def test_a_cpu_server_schedules_as_vllms_and_takes_the_pacing_rules_when_asked(monkeypatch):
    from cadence.gpu import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "flags\t\t: fpu avx2 fma")
    serve = _subparser(add_serve_parser, "serve")
    cpu = engine_config_from_args(serve.parse_args(["--device", "cpu", "--model", "qwen3-0.6b"])).scheduler
    assert cpu.max_num_batched_tokens == SERVE_CPU_MAX_NUM_BATCHED_TOKENS == 2048
    assert (cpu.mixed_prefill_tokens, cpu.admission_burst_split, cpu.admission_finish_hold_steps,
            cpu.admission_delay_budget) == (0, 0, 0, 0)
    assert cpu.mixed_prefill_per_decode == SchedulerConfig().mixed_prefill_per_decode
    # A GPU's prompt tokens beside decodes are cheap: it keeps the share and the core's budget.
    cuda = engine_config_from_args(serve.parse_args(["--device", "cuda"])).scheduler
    assert (cuda.mixed_prefill_tokens, cuda.admission_burst_split, cuda.admission_finish_hold_steps) == (0, 0, 0)
    assert cuda.admission_delay_budget == SERVE_ADMISSION_DELAY_BUDGET
    assert cuda.max_num_batched_tokens == SchedulerConfig().max_num_batched_tokens
    simulated = engine_config_from_args(serve.parse_args(["--model", "simulated"])).scheduler
    assert (simulated.mixed_prefill_tokens, simulated.admission_burst_split) == (0, 0)
    assert simulated.max_num_batched_tokens == SchedulerConfig().max_num_batched_tokens
    paced = engine_config_from_args(serve.parse_args(
        ["--device", "cpu", "--mixed-prefill-tokens", str(PACED_MIXED_PREFILL_TOKENS),
         "--burst-split", str(PACED_BURST_SPLIT), "--finish-hold", str(PACED_FINISH_HOLD_STEPS),
         "--max-num-batched-tokens", "8192"])).scheduler
    assert (paced.mixed_prefill_tokens, paced.admission_burst_split, paced.admission_finish_hold_steps,
            paced.max_num_batched_tokens) == (24, 3, 2, 8192)
    given = engine_config_from_args(serve.parse_args(
        ["--device", "cpu", "--mixed-prefill-tokens", "7", "--mixed-prefill-per-decode", "0.5",
         "--admission-delay-budget", "99"])).scheduler
    assert (given.mixed_prefill_tokens, given.mixed_prefill_per_decode) == (7, 0.5)
    assert given.admission_delay_budget == 99
    split = engine_config_from_args(serve.parse_args(["--device", "cuda", "--burst-split", "2"])).scheduler
    assert split.admission_burst_split == 2
    defaults = SchedulerConfig()  # the embedded engine and LLM
    assert (defaults.mixed_prefill_tokens, defaults.admission_burst_split,
            defaults.admission_finish_hold_steps) == (0, 0, 0)
    with pytest.raises(ConfigError, match="--finish-hold must be >= 0"):
        engine_config_from_args(serve.parse_args(["--finish-hold", "-1"]))
    with pytest.raises(ConfigError, match="--burst-split must be >= 0"):
        engine_config_from_args(serve.parse_args(["--burst-split", "-1"]))
    with pytest.raises(ConfigError, match="--mixed-prefill-tokens must be >= 0"):
        engine_config_from_args(serve.parse_args(["--mixed-prefill-tokens", "-1"]))
    with pytest.raises(ConfigError, match="mixed_prefill_per_decode"):
        engine_config_from_args(serve.parse_args(["--device", "cpu", "--mixed-prefill-per-decode", "-1"]))
    for hostile in ("nan", "inf"):  # argparse takes both as floats
        with pytest.raises(ConfigError, match="mixed_prefill_per_decode must be"):
            engine_config_from_args(serve.parse_args(["--device", "cpu", "--mixed-prefill-per-decode", hostile]))


def test_the_readme_serves_where_bench_looks():
    ports = re.findall(r"cadence serve[^\n]*--port (\d+)", README.read_text())
    assert all(int(port) == DEFAULT_PORT for port in ports), ports


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit):
        cli.main(argv + ["--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


def test_help_says_what_serve_speaks_and_the_demo_models_length_limit(capsys):
    import json
    from pathlib import Path

    from cadence.actors.engine import demo_model_dir

    positions = json.loads((Path(demo_model_dir()) / "config.json").read_text())["max_position_embeddings"]
    for command in ("generate", "serve"):
        text = _help([command], capsys)
        assert f"default 4096, lowered to the model's own limit where that is smaller: {positions} for the " \
               "demo model" in text, command
    serve = _help(["serve"], capsys)
    assert "msgpack protocol" in serve and "OpenAI-API clients over HTTP" in serve and "8000" in serve


def test_trace_path_writes_each_requests_events(capsys, tmp_path):
    """`--trace-path` (serve and bench --embedded) records every request's life:
    one add, then admit and tokens, and exactly one finish, tokens adding up to max_tokens."""
    from cadence.actors.trace import read_trace
    from cadence.actors.bench import load_workload

    path = tmp_path / "events.jsonl"
    status, _, err = run(capsys, "bench", "--embedded", "--model", "simulated", "--sim-step-us", "0",
                         "--no-progress", "--workload", "nano-vllm", "--num-requests", "3",
                         "--trace-path", str(path))
    assert status == 0, err
    records = list(read_trace(path))
    by_request: dict[str, list[dict]] = {}
    for record in records:
        by_request.setdefault(record["request_id"], []).append(record)
    assert len(by_request) == 3
    expected = sorted(r.max_tokens for r in load_workload("nano-vllm", 3))
    produced = []
    for events in by_request.values():
        names = [e["event"] for e in events]
        assert names[0] == "add" and names[-1] == "finish" and names.count("finish") == 1
        assert "admit" in names
        produced.append(sum(len(e["tokens"]) for e in events if e["event"] == "tokens"))
    assert sorted(produced) == expected
    assert [r["seq"] for r in records] == list(range(len(records)))


def test_an_unwritable_trace_path_is_named_in_the_error(capsys, tmp_path):
    missing = tmp_path / "no-such-dir" / "events.jsonl"
    status, _, err = run(capsys, "bench", "--embedded", "--model", "simulated", "--sim-step-us", "0",
                         "--no-progress", "--workload", "nano-vllm", "--num-requests", "1",
                         "--trace-path", str(missing))
    assert status != 0
    assert "trace_path: cannot write" in err and str(missing) in err and "Traceback" not in err
