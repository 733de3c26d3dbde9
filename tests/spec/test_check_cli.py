"""`cadence check`: exit 0 for a clean policy, 1 with a counterexample otherwise."""

import textwrap

import pytest

from cadence.spec.check import check_policy, main

# `cadence check` explores whole scopes.
pytestmark = pytest.mark.timeout(1800)


def test_a_clean_policy_exits_zero(capsys, shared_explorer):
    assert main(["--policy", "deadline", "--no-stateful"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "deadline: CLEAN" in out and "states" in out and "1 clean, 0 with violations" in out
    assert "starvation search" in out and "coverage of deadline" in out
    # Progress: each stage as it starts, on stderr, one exploration per CI scope.
    stages = [line.split("] ")[1] for line in captured.err.splitlines()]
    assert stages[:2] == ["exploring the small scope", "searching for starvation"]
    assert {"exploring the tight scope", "exploring the pipelined scope",
            "exploring the forked scope"} <= set(stages)
    assert all(line.startswith("[1/1 deadline, ") for line in captured.err.splitlines())


def test_strict_priority_starves_with_a_printed_lasso(capsys, shared_explorer):
    assert main(["--policy", "strict-priority", "--no-stateful", "--scope", "small"]) == 1
    out = capsys.readouterr().out
    assert "strict-priority: VIOLATION" in out and "starvation" in out
    assert "def test_strict_priority_starves_" in out


def test_a_user_policy_by_path(tmp_path, monkeypatch, capsys):
    (tmp_path / "cli_policies.py").write_text(textwrap.dedent("""
        from cadence.statemachine.policy import KeyedPolicy

        class NewestFirst(KeyedPolicy):
            name = "newest"

            def key(self, request):
                return (-request.arrival_s,)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    verdict = check_policy("cli_policies:NewestFirst", liveness=False, stateful=False)
    assert not verdict.clean
    assert "same class" in verdict.problems[0]
    assert "CheckedHarness" in "\n".join(verdict.details)


def test_an_unloadable_policy_is_a_usage_error_before_any_check(capsys):
    assert main(["--policy", "fcfs", "--policy", "no_such_module:Nothing", "--no-stateful", "--no-liveness",
                 "--quiet"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no verdict, no "VIOLATION": nothing was checked
    assert captured.err == ("cadence check: policy 'no_such_module:Nothing' cannot be loaded: "
                            "No module named 'no_such_module'\n")
