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
