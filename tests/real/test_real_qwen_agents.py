"""The OpenAI Agents SDK (its default model class, ``OpenAIResponsesModel``, over /v1/responses)
running an agent with one function tool against `verispec serve` on the real Qwen2.5-Coder 1.5B:
the model calls the tool, the SDK runs it and sends its result back (``function_call_output``),
and the final answer carries the tool's result. Once with the tool forced on the first turn
(the SDK then resets ``tool_choice``), once as agents run by default (``auto``, streamed)."""

from __future__ import annotations

import asyncio

import openai
import pytest
from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
from agents.models.openai_responses import OpenAIResponsesModel
from serving import running_server

from verispec.api import load_model

TARGET = "qwen2.5-coder-1.5b-instruct"
# greedy, the 1.5B model needs both rules: without the second it answers without calling the tool
# (an invented forecast), without the third it calls the tool again after its result
INSTRUCTIONS = ("You are a helpful assistant. Call get_weather for any weather question. When a tool result arrives, "
                "answer the user's question with it in one sentence.")


@pytest.fixture(scope="module")
def served():
    set_tracing_disabled(True)  # no export to OpenAI's tracing service
    with running_server(load_model(TARGET), TARGET, max_batch=2, max_model_len=2048) as s:
        yield s[0]


def weather_agent(url: str, calls: list[str], **settings) -> Agent:
    @function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        calls.append(city)
        return f"The weather in {city}: 17 degrees Celsius and foggy."

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    return Agent(name="weather", instructions=INSTRUCTIONS,
                 tools=[get_weather], model=OpenAIResponsesModel(model=TARGET, openai_client=client),
                 model_settings=ModelSettings(temperature=0, max_tokens=150, **settings))


@pytest.mark.qwen
@pytest.mark.parametrize("mode", ["required", "auto-streamed"])
def test_agents_sdk_runs_a_function_tool_over_responses(served, mode):
    calls: list[str] = []
    if mode == "required":
        agent = weather_agent(served, calls, tool_choice="required", parallel_tool_calls=False)
        result = asyncio.run(Runner.run(agent, "What is the weather in Paris right now?", max_turns=4))
    else:
        agent = weather_agent(served, calls)

        async def streamed():
            run = Runner.run_streamed(agent, "What is the weather in Paris right now?", max_turns=4)
            async for _ in run.stream_events():
                pass
            return run

        result = asyncio.run(streamed())
    assert calls and calls[0].lower().startswith("paris"), result.final_output
    answer = str(result.final_output)
    assert "17" in answer or "fog" in answer.lower(), answer
