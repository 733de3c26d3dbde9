"""examples/langchain_tools.py against a live server: langchain-openai's `bind_tools` and
`with_structured_output` work unchanged (run when langchain-openai is installed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from cadence.actors.engine import EngineConfig, demo_model_dir
from cadence.actors.serve.http import HttpConfig
from cadence.actors.serve.server import ServerConfig, ServerThread

pytest.importorskip("langchain_openai", reason="langchain-openai is not installed (pip install langchain-openai)")
pytest.importorskip("xgrammar", reason="structured output needs xgrammar (the test extra has it)")

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "langchain_tools.py"


def test_the_langchain_example_calls_a_tool_and_gets_a_structured_answer():
    spec = importlib.util.spec_from_file_location("langchain_tools_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    engine = EngineConfig.from_kwargs(executor="inprocess", model=demo_model_dir(), max_model_len=512,
                                      num_blocks=128, block_size=16)
    http = HttpConfig(port=0, api_key="lc-key", served_model_name="demo")
    with ServerThread(engine, ServerConfig(port=0), http=http) as thread:
        host, port = thread.server.http.address
        result = example.main(f"http://{host}:{port}/v1", api_key="lc-key")
    call = result["tool_call"]
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Rome", "Oslo")
    assert call["id"].startswith("call_")
    answer = result["answer"]
    assert isinstance(answer, example.Answer) and 0 <= answer.score <= 9
