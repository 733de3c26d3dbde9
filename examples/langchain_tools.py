"""langchain-openai against `cadence serve`, unchanged: a chat model with tools bound
(`bind_tools`, the call forced so the demo model makes one) and a structured answer
(`with_structured_output`, a JSON schema followed token by token).

    pip install langchain-openai
    cadence serve --model demo &
    python examples/langchain_tools.py [http://127.0.0.1:8000/v1]
"""

from __future__ import annotations

import sys
from typing import Literal

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"


@tool
def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
    """The weather in a city."""
    return f"It is sunny in {city}."


class Answer(BaseModel):
    """A short verdict."""

    verdict: bool = Field(description="yes or no")
    score: int = Field(ge=0, le=9)


def main(base_url: str = DEFAULT_BASE_URL, api_key: str = "unused") -> dict:
    """Run both calls; returns what they gave (the tool call and the parsed answer)."""
    model = ChatOpenAI(model="demo", base_url=base_url, api_key=api_key, max_tokens=64, temperature=0.7,
                       seed=0, max_retries=0)
    asked = model.bind_tools([get_weather], tool_choice="get_weather")
    message = asked.invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    print("tool call:", call["name"], call["args"])
    print("tool result:", get_weather.invoke(call["args"]))
    answer = model.with_structured_output(Answer, method="json_schema").invoke("Is Python fun?")
    print("structured:", answer)
    return {"tool_call": call, "answer": answer}


if __name__ == "__main__":
    main(*sys.argv[1:2])
