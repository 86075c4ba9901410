"""POST /v1/responses through the real `openai` client (`client.responses.create`, whole and streamed, and the SDK's
`responses.stream` helper, which checks the events' order as it accumulates them) and through an openai-agents
tool-using agent run to its end, against a server over a scripted front (nothing compiles): input items and
instructions into the chat template, flattened function tools, text.format, max_output_tokens, output items and
stream events, and the 400s that name the Responses field."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from test_agent_api import AGENT, CALL, MODEL, SCRIPT, ScriptedFront, tokenizer  # noqa: F401 (a fixture)
from test_server import serve_in_thread

from kdtree_jax.constrain.automaton import ConstraintSpec
from kdtree_jax.server import ServerSettings, build_app
from kdtree_jax.serving import ServeConfig

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER,
          "strict": True}]
ASK = "What is the weather in Paris?"
ANSWER = "It is 18 degrees in Paris."
ARGUMENTS = '{"city": "Paris", "unit": "celsius"}'


@pytest.fixture(scope="module")
def served(tokenizer):
    """(front, base URL, prompts the front saw): the reply is a tool call, or ANSWER once the prompt holds a tool's
    result."""
    front = ScriptedFront(tokenizer, ServeConfig(num_pages=4, constraint_states=4096))
    prompts: list[str] = []

    def script(ids, params):
        prompts.append(tokenizer.decode(ids))
        return f"{ANSWER}<|im_end|>" if "## Return of" in prompts[-1] else SCRIPT

    front.script = script
    app = build_app(front, tokenizer, ServerSettings(model_names=(MODEL,), **AGENT))
    with serve_in_thread(app) as url:
        yield front, url, prompts
    front.finish = "stop"


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


@pytest.mark.timeout(60)
def test_a_response_holds_reasoning_message_and_function_call_items(served):
    front, url, prompts = served
    r = _client(url).responses.create(model=MODEL, input=ASK, instructions="Answer briefly.", tools=TOOLS)
    assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_")
    assert [item.type for item in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text == "The user wants weather."
    assert r.output_text == "Let me check." and r.output[1].role == "assistant"
    call = r.output[2]
    assert (call.call_id, call.name, call.arguments) == ("functions.get_weather:0", "get_weather", ARGUMENTS)
    assert prompts[-1].index("Answer briefly.") < prompts[-1].index(ASK)  # instructions: a system turn first
    assert '"name":"get_weather"' in prompts[-1]  # the flattened tool reached the template
    assert r.usage.input_tokens == len(front.tokenizer.encode(prompts[-1]))
    assert r.usage.output_tokens == len(front.tokenizer.encode(SCRIPT))
    assert r.usage.output_tokens_details.reasoning_tokens == len(front.tokenizer.encode("<think>The user wants "
                                                                                        "weather.</think>"))


@pytest.mark.timeout(60)
def test_streamed_events_add_up_to_the_whole_response(served):
    """Every event the SDK's stream helper reads, in order, with sequence numbers 0, 1, ...; its final response
    equals the whole one, less the ids."""
    _, url, _ = served
    client = _client(url)
    whole = client.responses.create(model=MODEL, input=ASK, tools=TOOLS)
    with client.responses.stream(model=MODEL, input=ASK, tools=TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    for kind in ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
                 "response.output_text.done", "response.content_part.done", "response.function_call_arguments.delta",
                 "response.function_call_arguments.done", "response.output_item.done",
                 "response.reasoning_text.delta"):
        assert kind in kinds, kind
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert (text, args) == ("Let me check.", ARGUMENTS)

    def items(response):  # less the ids, and the helper's `parsed`
        def plain(value):
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items() if k not in ("id", "parsed", "parsed_arguments")}
            return [plain(v) for v in value] if isinstance(value, list) else value
        return [plain(item.model_dump()) for item in response.output]

    assert items(final) == items(whole) and final.usage == whole.usage and final.status == "completed"


@pytest.mark.timeout(60)
def test_earlier_calls_and_their_outputs_become_tool_turns(served):
    _, url, prompts = served
    history = [{"role": "user", "content": ASK},
               {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                                 "text": "Need the weather."}]},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
               {"type": "function_call", "call_id": "functions.get_weather:0", "name": "get_weather",
                "arguments": ARGUMENTS},
               {"type": "function_call_output", "call_id": "functions.get_weather:0", "output": "18 degrees"}]
    r = _client(url).responses.create(model=MODEL, input=history, tools=TOOLS)
    assert r.output_text == ANSWER and [item.type for item in r.output] == ["message"]
    prompt = prompts[-1]
    assert "## Return of functions.get_weather:0\n18 degrees" in prompt
    assert "Checking." + CALL in prompt  # the message and its call: one assistant turn


@pytest.mark.timeout(60)
def test_text_format_and_max_output_tokens_reach_the_engine(served):
    front, url, _ = served
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    _client(url).responses.create(model=MODEL, input="Reply in JSON.", max_output_tokens=7, text={
        "format": {"type": "json_schema", "name": "reply", "schema": schema, "strict": True}})
    assert front.params[-1].constraint == ConstraintSpec.json_schema(schema)
    assert front.params[-1].max_new_tokens == 7


@pytest.mark.timeout(60)
def test_a_response_cut_off_is_incomplete_streamed_or_not(served):
    front, url, _ = served
    front.finish = "length"
    try:
        client = _client(url)
        whole = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, max_output_tokens=40)
        events = list(client.responses.create(model=MODEL, input=ASK, tools=TOOLS, max_output_tokens=40,
                                              stream=True))
    finally:
        front.finish = "stop"
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert whole.output[-1].status == events[-1].response.output[-1].status == "incomplete"


BAD = {  # name: (body fields, the field the 400 names)
    "hosted_tool": ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    "image_input": ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                    "input[0].content[0]"),
    "unknown_item": ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0].type"),
    "previous_response_id": ({"previous_response_id": "resp_1"}, "previous_response_id"),
    "bad_schema": ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
                   "text.format"),
    "max_output_tokens_zero": ({"max_output_tokens": 0}, "max_output_tokens"),
    "call_without_call_id": ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
                             "input[0].call_id"),
    "named_tool_undeclared": ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_responses_input_is_a_400_naming_the_field(served, case):
    front, url, _ = served
    fields, param = BAD[case]
    before = len(front.params)
    r = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": ASK, **fields}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
    assert len(front.params) == before


@pytest.mark.timeout(120)
@pytest.mark.parametrize("streamed", [False, True])
def test_an_openai_agents_agent_calls_its_tool_and_answers(served, streamed):
    """openai-agents' Responses model: the agent calls get_weather with the scripted arguments, sends the result
    back as a function_call_output, and ends with the model's answer."""
    agents = pytest.importorskip("agents")
    _, url, _ = served
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str, unit: str) -> str:
        """Weather in a city."""
        calls.append({"city": city, "unit": unit})
        return "18 degrees"

    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="none", max_retries=0))
    agent = agents.Agent(name="weather", instructions="Answer briefly.", model=model, tools=[get_weather])

    async def run():
        if not streamed:
            return await agents.Runner.run(agent, ASK)
        result = agents.Runner.run_streamed(agent, ASK)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    assert result.final_output == ANSWER
    assert calls == [json.loads(ARGUMENTS)]
