"""The README's examples run as written: the `LLM`, `open_engine` and asyncio blocks,
verbatim, on the built-in demo model; its vLLM table is the one in the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cadence.actors.llm import VLLM_OPTIONS

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def _block(marker: str) -> str:
    (code,) = [block for block in BLOCKS if marker in block]
    return code


@pytest.mark.parametrize("marker", ["LLM(", "open_engine(", "AsyncioEngine("])
def test_readme_example_runs_verbatim(marker, capsys):
    exec(compile(_block(marker), f"README.md: the {marker} example", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    assert out.strip(), "the example printed nothing"
    if marker == "LLM(":
        lines = out.splitlines()
        assert len(lines) == 2 and lines[0].startswith("'def ' -> '") and lines[0].endswith(" length")


def test_readme_vllm_table_is_the_code_table():
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]+)` \|$", README, re.M))
    assert list(rows) == list(VLLM_OPTIONS)
    for vllm_name, cadence_option in VLLM_OPTIONS.items():
        documented = rows[vllm_name]
        if cadence_option.startswith("executor_options."):
            assert documented == f'executor_options["{cadence_option.split(".", 1)[1]}"]'
        else:
            assert documented.endswith("." + cadence_option)


def _commands(ending: str) -> list[str]:
    return [line.strip() for line in README.splitlines() if line.strip().endswith(ending)]


def test_the_main_job_installs_only_what_running_needs():
    (main_job,) = _commands('&& cadence generate "def "')
    extras = re.findall(r'-e "\.\[([^\]]*)\]"', main_job)
    assert extras == ["gpu"], main_job  # no test extras (triton, transformers, openai) to run it
    first_screen = README[:README.index("## Using it")]
    assert "git clone" in first_screen and "venv" in first_screen and "Python 3.11" in first_screen


def test_ci_runs_the_readme_test_command():
    (test_command,) = _commands("&& python -m pytest -q")
    install, run = test_command.split(" && ")
    ci = (Path(__file__).resolve().parent.parent / ".ci" / "run").read_text()
    torch, editable = install.removeprefix("pip install ").split(" ", 1)
    assert f"python -m pip install -q {torch}\n" in ci and f"python -m pip install -q {editable}\n" in ci
    assert f"\n{run}\n" in ci


def test_the_readme_says_which_way_in_simulates():
    from cadence.actors import cli

    sentence = " ".join(README[README.index("Every way in"):].split(").")[0].split())
    assert "but `cadence demo`" in sentence and "simulated executor" in sentence
    (demo,) = [action.choices["demo"] for action in cli.build_parser()._subparsers._group_actions]
    assert "simulated executor" in demo.description  # what the README says is what it runs
