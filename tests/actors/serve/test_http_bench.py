"""`cadence bench --http` against the HTTP API of a server in a background thread."""

from __future__ import annotations

import argparse
import json

from cadence.actors.bench import add_bench_parser
from cadence.actors.serve.http import HttpConfig
from cadence.actors.serve.server import ServerThread

from test_server_support import engine_config, server_config


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="cadence")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_bench_drives_the_http_api_and_counts_every_token(capsys):
    with ServerThread(engine_config(), server_config(), http=HttpConfig(port=0, api_key="k")) as thread:
        host, port = thread.server.http.address
        args = _parse("--http", "--host", host, "--port", str(port), "--api-key", "k",
                      "--workload", "prefix", "--num-requests", "12", "--request-rate", "500",
                      "--json", "-", "--no-progress")
        assert args.func(args) == 0
        stats = thread.call(thread.server.engine.stats)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["num_completed"] == 12 and result["target"] == f"http://{host}:{port}"
    assert stats.num_requests_completed == 12
    assert stats.num_tokens_generated == result["num_output_tokens"]


def test_a_wrong_key_fails_every_request(capsys):
    with ServerThread(engine_config(), server_config(), http=HttpConfig(port=0, api_key="k")) as thread:
        host, port = thread.server.http.address
        args = _parse("--http", "--host", host, "--port", str(port), "--api-key", "wrong",
                      "--num-requests", "2", "--no-progress")
        assert args.func(args) == 2  # the model list is refused before any request
    assert "401" in capsys.readouterr().err


def test_http_with_plot_is_a_usage_error(capsys):
    args = _parse("--http", "--num-requests", "2", "--plot", "out.png")
    assert args.func(args) == 2
    assert "--http" in capsys.readouterr().err
