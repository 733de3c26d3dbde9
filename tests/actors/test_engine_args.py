"""The engine options shared by `cadence serve`, `bench` and `generate`: supervision
and queue limits can be set from the command line."""

from __future__ import annotations

import argparse

import pytest

from cadence.actors.engine_args import add_engine_arguments, engine_config_from_args
from cadence.actors.serve.server import add_serve_parser
from cadence.statemachine.errors import ConfigError


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return engine_config_from_args(parser.parse_args(list(argv)))


def test_supervision_and_queue_options_reach_the_engine_config():
    config = parse("--step-timeout", "5", "--max-restarts", "7", "--max-waiting", "9",
                   "--restart-window", "60", "--restart-backoff", "0.25",
                   "--restart-backoff-max", "8", "--heartbeat-timeout", "2")
    assert (config.step_timeout_s, config.max_restarts, config.restart_window_s) == (5.0, 7, 60.0)
    assert (config.restart_backoff_s, config.restart_backoff_max_s) == (0.25, 8.0)
    assert config.heartbeat_timeout_s == 2.0 and config.scheduler.max_waiting == 9


def test_the_defaults_are_the_engine_defaults_and_zero_turns_heartbeats_off():
    default = parse()
    assert default.max_restarts == 3 and default.heartbeat_timeout_s == 5.0
    assert default.scheduler.max_waiting == 1_000_000
    assert parse("--heartbeat-timeout", "0").heartbeat_timeout_s is None


@pytest.mark.parametrize(("argv", "message"), [
    (("--step-timeout", "0"), "step_timeout_s must be > 0"),
    (("--max-restarts", "-1"), "max_restarts must be >= 0"),
    (("--heartbeat-timeout", "-1"), "--heartbeat-timeout must be >= 0"),
])
def test_out_of_range_values_name_the_option(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse(*argv)


def test_cadence_serve_takes_them():
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers(dest="command")
    add_serve_parser(subparsers)
    args = parser.parse_args(["serve", "--step-timeout", "3", "--max-restarts", "1",
                              "--max-waiting", "4", "--heartbeat-timeout", "1.5"])
    config = engine_config_from_args(args)
    assert (config.step_timeout_s, config.max_restarts, config.scheduler.max_waiting,
            config.heartbeat_timeout_s) == (3.0, 1, 4, 1.5)


def test_threads_and_cpu_path_reach_the_executor_options():
    assert parse().executor_options == {}
    config = parse("--threads", "2", "--cpu-path", "eager")
    assert config.executor_options == {"num_threads": 2, "cpu_path": "eager"}
    for bad in ("0", "two"):
        with pytest.raises(ConfigError, match="--threads must be 'auto' or an integer >= 1"):
            parse("--threads", bad)


def test_llm_takes_the_cpu_options_by_name():
    from cadence.actors.llm import engine_config_from_options

    config = engine_config_from_options(model="demo", num_threads=1, cpu_path="packed")
    assert config.executor_options == {"num_threads": 1, "cpu_path": "packed"}
