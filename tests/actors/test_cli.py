"""The `cadence` command: the seed demo, generate, check, and one-line errors."""

from __future__ import annotations

import io
import re
import sys

import pytest

from cadence.actors import cli


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
    status, _, err = run(capsys, "generate", "x", "--max-tokens", "99999")
    assert status == 2
    assert err.count("\n") == 1 and "max_model_len" in err and "Traceback" not in err
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
