"""The OpenAI Agents SDK's default model class (``OpenAIResponsesModel``) over /v1/responses on
stories260K: an agent with one function tool (the call forced on the first turn, then ``auto``,
as the SDK resets ``tool_choice``), run whole and streamed. The SDK parses the call, runs the
tool, sends its result back as a ``function_call_output`` item, and ends with the text of the
second response. (The real-model run, whose answer carries the tool's result, is
tests/real/test_real_qwen_agents.py.)"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from agents import Agent, FunctionTool, ModelSettings, Runner, set_tracing_disabled
from agents.models.openai_responses import OpenAIResponsesModel
from serving import MODEL, running_server, stories_native_model, with_chat_template

from verispec.server.responses_store import owner_of

TOOL_TEMPLATE = ("{% if tools %}tools: {{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m['role'] }}: "
                 "{{ m['content'] }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
                 "{% endfor %}\n{% endfor %}assistant:")
RESULT = "sunny and 21 degrees"
KEY = "sk-agent"


@pytest.fixture(scope="module")
def served():
    set_tracing_disabled(True)  # no export to OpenAI's tracing service
    with running_server(with_chat_template(stories_native_model(), TOOL_TEMPLATE), max_model_len=512) as s:
        yield s


def weather_agent(url: str, calls: list[dict]) -> Agent:
    async def get_weather(_ctx, arguments: str) -> str:
        calls.append(json.loads(arguments))
        return RESULT

    # letters only: the "." that ends the text answer (stop) cannot cut the call
    tool = FunctionTool(name="get_weather", description="Weather of a city", on_invoke_tool=get_weather,
                        params_json_schema={"type": "object", "required": ["city"], "additionalProperties": False,
                                            "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"}}})
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    return Agent(name="weather", instructions="Answer about the weather.", tools=[tool],
                 model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                 model_settings=ModelSettings(temperature=0, max_tokens=150, tool_choice="required",
                                              parallel_tool_calls=False, extra_body={"stop": ["."]}))


@pytest.mark.parametrize("streamed", [False, True])
def test_an_agent_runs_a_function_tool_over_responses(served, streamed):
    url, app = served[0], served[2].config.app
    calls: list[dict] = []

    async def run():
        agent = weather_agent(url, calls)  # one client per event loop
        if not streamed:
            return await Runner.run(agent, "Weather in Paris?", max_turns=3), []
        result = Runner.run_streamed(agent, "Weather in Paris?", max_turns=3)
        kinds = [e.data.type async for e in result.stream_events() if e.type == "raw_response_event"]
        return result, kinds

    result, kinds = asyncio.run(run())
    assert len(calls) == 1 and set(calls[0]) == {"city"}
    first, last = (app.state.responses.get(owner_of(f"Bearer {KEY}"), r.response_id) for r in result.raw_responses)
    assert first.response["output"][0]["type"] == "function_call"
    outputs = [item for item in last.conversation if item["type"] == "function_call_output"]
    assert [o["output"] for o in outputs] == [RESULT]  # the SDK sent the tool's result back
    assert outputs[0]["call_id"] == first.response["output"][0]["call_id"]
    assert result.final_output == last.response["output_text"] and result.final_output
    if streamed:
        assert kinds.count("response.completed") == 2 and "response.function_call_arguments.delta" in kinds
