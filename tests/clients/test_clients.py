"""The clients people drive a local model with, unmodified and pinned (pyproject's ``clients``
extra), against ``verispec serve`` on the real Qwen2.5-Coder 1.5B with its default method (the
0.5B draft and suffix drafting): a tool round trip in each (the model calls the tool, the
tool's result comes back, the final answer uses it), auto / required / named / streamed, and
structured output with and without tools. ``make test-clients`` (CI runs it after the other
groups).

The tool's answer is something the model cannot know (an order's tracking code), so a final
answer that contains it shows the round trip happened. Greedy everywhere: the runs are
deterministic, and the server's output under speculation equals its plain decoding (checked
in tests/real and tests/server; here it is the clients' side that is under test).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import BaseModel
from serving import running_server

from verispec.api import load_model

pytestmark = pytest.mark.clients

TARGET = "qwen2.5-coder-1.5b-instruct"
TRACKING = "ZX81-4410"
STATUS = {"order_id": "A1027", "status": "shipped", "carrier": "DHL", "tracking": TRACKING}
QUESTION = "Where is my order A1027? What is its tracking code?"
# an agent's instructions: without them the 1.5B model, greedy, calls the tool again after its result
INSTRUCTIONS = ("You help customers with their orders. Call a tool when you need data you do not have; once you "
                "have a tool's result, answer the customer in plain text.")
SYSTEM = {"role": "system", "content": INSTRUCTIONS}
ORDER_TOOL = {"type": "function", "function": {
    "name": "order_status", "description": "The shipping status of an order, by its id",
    "parameters": {"type": "object", "required": ["order_id"], "additionalProperties": False,
                   "properties": {"order_id": {"type": "string", "description": "The order's id, e.g. A1000"}}}}}


def order_status(order_id: str) -> str:
    """The shipping status of an order, by its id."""
    return json.dumps(STATUS | {"order_id": order_id})


class Invoice(BaseModel):
    customer: str
    total_eur: float
    paid: bool


INVOICE_ASK = "Invoice for Ada Lovelace: 3 items at 12.50 EUR each, not yet paid. Give it as JSON."


@pytest.fixture(scope="module")
def server():
    model = load_model(TARGET)
    with running_server(model, TARGET, max_batch=2, max_model_len=4096, default_max_tokens=200) as (url, _, _):
        yield f"{url}/v1"


def openai_client(server):
    import openai
    return openai.OpenAI(base_url=server, api_key="none", max_retries=0, timeout=300)


# --- openai -------------------------------------------------------------------------------------

@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "order_status"}}],
                         ids=["auto", "required", "named"])
def test_openai_tool_round_trip(server, choice):
    client = openai_client(server)
    messages = [SYSTEM, {"role": "user", "content": QUESTION}]
    r = client.chat.completions.create(model=TARGET, messages=messages, tools=[ORDER_TOOL], tool_choice=choice,
                                       temperature=0, max_tokens=120)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    [call] = c.message.tool_calls
    assert call.function.name == "order_status"
    args = json.loads(call.function.arguments)
    assert args == {"order_id": "A1027"}
    messages += [c.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": order_status(**args)}]
    final = client.chat.completions.create(model=TARGET, messages=messages, tools=[ORDER_TOOL], temperature=0,
                                           max_tokens=120)
    assert final.choices[0].finish_reason == "stop"
    assert TRACKING in final.choices[0].message.content


def test_openai_streamed_tool_call_arrives_in_pieces(server):
    client = openai_client(server)
    stream = client.chat.completions.create(model=TARGET, messages=[SYSTEM, {"role": "user", "content": QUESTION}],
                                            tools=[ORDER_TOOL], tool_choice="required", temperature=0,
                                            max_tokens=120, stream=True)
    names, pieces, finish = [], [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or ():
            if tc.function and tc.function.name:
                names.append((tc.index, tc.id, tc.function.name))
            if tc.function and tc.function.arguments:
                pieces.append(tc.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert [(i, n) for i, _, n in names] == [(0, "order_status")] and names[0][1]
    assert len(pieces) > 1  # the arguments stream, not one final blob
    assert json.loads("".join(pieces)) == {"order_id": "A1027"}
    assert finish == "tool_calls"


def test_openai_streamed_text_with_tools_bound_arrives_as_generated(server):
    client = openai_client(server)
    stream = client.chat.completions.create(
        model=TARGET, messages=[{"role": "user", "content": "Write a Python function that reverses a string."}],
        tools=[ORDER_TOOL], temperature=0, max_tokens=80, stream=True)
    texts = [ch.choices[0].delta.content for ch in stream if ch.choices and ch.choices[0].delta.content]
    assert len(texts) > 3  # many deltas, not the whole answer in the last chunk


class Shipment(BaseModel):
    order_id: str
    tracking: str


def test_openai_parse_with_and_without_tools(server):
    client = openai_client(server)
    r = client.chat.completions.parse(model=TARGET, messages=[{"role": "user", "content": INVOICE_ASK}],
                                      response_format=Invoice, temperature=0, max_tokens=120)
    inv = r.choices[0].message.parsed
    assert inv is not None and inv.total_eur == pytest.approx(37.5) and inv.paid is False
    # with tools: the call first, then an answer that follows the schema (OpenAI's "tools, then a structured answer")
    strict = {"type": "function", "function": ORDER_TOOL["function"] | {"strict": True}}  # parse() takes strict tools
    messages = [SYSTEM, {"role": "user", "content": QUESTION}]
    kw = {"model": TARGET, "tools": [strict], "response_format": Shipment, "temperature": 0, "max_tokens": 120}
    r = client.chat.completions.parse(messages=messages, **kw)
    [call] = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.parsed_arguments == {"order_id": "A1027"}
    messages += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": order_status("A1027")}]
    final = client.chat.completions.parse(messages=messages, **kw).choices[0]
    assert final.finish_reason == "stop" and final.message.parsed == Shipment(order_id="A1027", tracking=TRACKING)


# --- LangChain ----------------------------------------------------------------------------------

def test_langchain_tool_round_trip_and_structured_output(server):
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def order_status_tool(order_id: str) -> str:
        """The shipping status of an order, by its id."""
        return order_status(order_id)

    order_status_tool.name = "order_status"
    llm = ChatOpenAI(model=TARGET, base_url=server, api_key="none", temperature=0, max_tokens=120, max_retries=0)
    bound = llm.bind_tools([order_status_tool])
    messages = [SystemMessage(INSTRUCTIONS), HumanMessage(QUESTION)]
    ai = bound.invoke(messages)
    [call] = ai.tool_calls
    assert call["name"] == "order_status" and call["args"]["order_id"] == "A1027"  # not strict: extra keys may come
    messages += [ai, ToolMessage(order_status(**call["args"]), tool_call_id=call["id"])]
    assert TRACKING in bound.invoke(messages).content
    inv = llm.with_structured_output(Invoice, method="json_schema").invoke(INVOICE_ASK)
    assert inv.total_eur == pytest.approx(37.5) and inv.paid is False


# --- pydantic-ai --------------------------------------------------------------------------------

def _pydantic_ai_model(server):
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    return OpenAIChatModel(TARGET, provider=OpenAIProvider(base_url=server, api_key="none"))


def test_pydantic_ai_tool_run(server):
    from pydantic_ai import Agent
    from pydantic_ai.settings import ModelSettings

    agent = Agent(_pydantic_ai_model(server), instructions=INSTRUCTIONS, model_settings=ModelSettings(temperature=0, max_tokens=150))
    agent.tool_plain(order_status)
    result = agent.run_sync(QUESTION)
    assert TRACKING in result.output


@pytest.mark.parametrize("mode", ["tool", "native"])
def test_pydantic_ai_structured_output_with_a_tool(server, mode):
    from pydantic_ai import Agent
    from pydantic_ai.output import NativeOutput
    from pydantic_ai.settings import ModelSettings

    class Shipment(BaseModel):
        order_id: str
        tracking: str

    output = Shipment if mode == "tool" else NativeOutput(Shipment)  # default: an output tool; native: the schema
    agent = Agent(_pydantic_ai_model(server), output_type=output, instructions=INSTRUCTIONS,
                  model_settings=ModelSettings(temperature=0, max_tokens=150))
    agent.tool_plain(order_status)
    result = agent.run_sync(QUESTION)
    assert result.output.tracking == TRACKING and result.output.order_id == "A1027"


# --- litellm ------------------------------------------------------------------------------------

def test_litellm_tool_round_trip_and_context_window_error(server):
    import litellm

    kw = {"model": f"openai/{TARGET}", "api_base": server, "api_key": "none", "temperature": 0, "max_tokens": 120}
    messages = [SYSTEM, {"role": "user", "content": QUESTION}]
    r = litellm.completion(messages=messages, tools=[ORDER_TOOL], **kw)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "order_status"
    messages += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": order_status(**json.loads(call.function.arguments))}]
    final = litellm.completion(messages=messages, tools=[ORDER_TOOL], **kw)
    assert TRACKING in final.choices[0].message.content
    long = [{"role": "user", "content": "word " * 6000}]
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(messages=long, **kw)


# --- OpenAI Agents SDK (the Responses API) ------------------------------------------------------

def test_openai_agents_sdk_runs_a_function_tool_over_responses(server):
    import openai
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from agents.model_settings import ModelSettings

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=server, api_key="none", max_retries=0, timeout=300)
    agent = Agent(name="support", instructions=INSTRUCTIONS,
                  tools=[function_tool(order_status)],
                  model=OpenAIResponsesModel(model=TARGET, openai_client=client),
                  model_settings=ModelSettings(temperature=0, max_tokens=150))
    result = asyncio.run(Runner.run(agent, QUESTION, max_turns=4))
    assert TRACKING in result.final_output
