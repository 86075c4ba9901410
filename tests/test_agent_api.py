"""Kimi's agent API through the server: tools and tool_choice, tool calls parsed into OpenAI `tool_calls` (whole
and streamed), reasoning_content, response_format / structured_outputs, and the 400s that name their field.

Two servers: a stub front that emits a scripted completion (the parsing path, the 400s: nothing compiles), and the
shipped pair served by the serving engine (constrained outputs that the real `openai` client reads and `jsonschema`
validates). Constrained decoding on the device is tested in `test_constrained_decoding.py`; here it is the serving
engine that lays requests' automata out in its tables.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient
from test_server import serve_in_thread

from kdtree_jax.checkpoint.tokenizer import KimiTokenizer
from kdtree_jax.constrain.automaton import MARKER_CHAR_BASE, ConstraintCompiler, ConstraintSpec, ConstraintVocabulary
from kdtree_jax.decode.engine import Engine
from kdtree_jax.server import ServerSettings, build_app
from kdtree_jax.server import constraints as agent_constraints
from kdtree_jax.serving import AsyncServingEngine, RequestParams, RequestRecord, ServeConfig, ServingEngine
from kdtree_jax.serving.request import TokenDelta
from kdtree_jax.serving.frontend import EngineStats, ServingFront

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(REPO, "checkpoints", "kdtree-mini")
MODEL = "kdtree-mini"
AGENT = {"enable_auto_tool_choice": True, "tool_call_parser": "kimi_k2", "reasoning_parser": "kimi_k2"}
STUB_STATES = 64  # the stub server's constraint states cap: a schema past it is a 400
DELTA_TOKENS = 3  # the stub streams its script this many tokens at a time (markers arrive split from their text)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
        '{"city": "Paris", "unit": "celsius"}<|tool_call_end|><|tool_calls_section_end|>')
SCRIPT = f"<think>The user wants weather.</think>Let me check.{CALL}<|im_end|>"


# ---- a front that answers every request with a scripted completion ---------------------------------------------
class ScriptedFront(ServingFront):
    """Every request gets `script`'s tokens (or those of `script(prompt ids, params)`), DELTA_TOKENS at a time,
    then a record ending as `finish` says. Remembers the params of each request (the constraint the server built,
    the seed); a request without a seed draws one, as the engine does."""

    def __init__(self, tokenizer: KimiTokenizer, config: ServeConfig):
        super().__init__()
        self.config, self.tokenizer = config, tokenizer
        self.script = SCRIPT
        self.finish = "stop"
        self.params: list[RequestParams] = []

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def shutdown(self, timeout=None) -> None:
        self._closing = True

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, self.config.num_pages, self.config.num_pages, self.config.page_size, 0.0, 0)

    def _check(self, prompt, params):
        return list(prompt), (), random.getrandbits(32)

    def _queued(self) -> int:
        return 0

    def _post(self, msg: tuple) -> None:
        if msg[0] != "submit":
            return
        _, rid, ids, params = msg
        self.params.append(params)
        out = self.tokenizer.encode(self.script(ids, params) if callable(self.script) else self.script)
        events = [TokenDelta(rid, out[i:i + DELTA_TOKENS], time.perf_counter())
                  for i in range(0, len(out), DELTA_TOKENS)]
        events.append(RequestRecord(rid, out, self.finish, len(ids), [], 0))
        self._loop.call_soon(self._push_events, events)


@pytest.fixture(scope="module")
def tokenizer() -> KimiTokenizer:
    return KimiTokenizer.from_dir(os.path.join(SHIPPED, "tokenizer"))


def _stub(tokenizer, **settings):
    front = ScriptedFront(tokenizer, ServeConfig(num_pages=4, constraint_states=STUB_STATES))
    app = build_app(front, tokenizer, ServerSettings(model_names=(MODEL,), **settings))
    return front, app


@pytest.fixture(scope="module")
def stub(tokenizer):
    """(front, base URL) of a stub server with the agent flags."""
    front, app = _stub(tokenizer, **AGENT)
    with serve_in_thread(app) as url:
        yield front, url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _gather_stream(stream) -> tuple[dict, str | None]:
    """An openai chat stream -> (message with content, reasoning_content, tool_calls joined), finish reason."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        choice = chunk.choices[0]
        d = choice.delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        for c in d.tool_calls or []:
            call = calls.setdefault(c.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = c.id or call["id"]
            if c.function is not None:
                call["name"] = c.function.name or call["name"]
                call["arguments"] += c.function.arguments or ""
        finish = choice.finish_reason or finish
    return {"content": content, "reasoning_content": reasoning, "tool_calls": [calls[i] for i in sorted(calls)]}, finish


# ---- parsing: the stub's scripted reply ---------------------------------------------------------------------------
def test_auto_tool_choice_parses_reasoning_content_and_tool_calls(stub):
    front, url = stub
    front.script = SCRIPT
    r = _client(url).chat.completions.create(model=MODEL, messages=USER, tools=TOOLS)
    msg, choice = r.choices[0].message, r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert msg.reasoning_content == "The user wants weather."
    assert msg.content == "Let me check."
    assert [(c.id, c.type, c.function.name) for c in msg.tool_calls] == [
        ("functions.get_weather:0", "function", "get_weather")]
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert front.params[-1].constraint is None  # "auto" parses, it does not constrain


def test_streamed_tool_calls_and_reasoning_add_up_to_the_whole_response(stub):
    front, url = stub
    front.script = SCRIPT
    msg, finish = _gather_stream(_client(url).chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                                                      stream=True))
    assert finish == "tool_calls"
    assert msg["reasoning_content"] == "The user wants weather." and msg["content"] == "Let me check."
    assert msg["tool_calls"] == [{"id": "functions.get_weather:0", "name": "get_weather",
                                  "arguments": '{"city": "Paris", "unit": "celsius"}'}]


@pytest.fixture
def scripted(stub):
    """The stub's front and URL; its script and finish are restored after the test."""
    front, url = stub
    yield front, url
    front.script, front.finish = SCRIPT, "stop"


CUT_OFF = {  # name: (script, finish the engine reports, extra request fields, message fields, finish reason)
    "max_tokens_in_arguments": (CALL.replace("get_weather", "get_time").split('"Paris"')[0].replace(
        '{"city": ', '{"zone": "U'), "length", {"tools": TOOLS},
        {"tool_calls": [("functions.get_time:0", "get_time", '{"zone": "U')]}, "length"),
    "max_tokens_after_a_call": (CALL.replace("<|tool_calls_section_end|>", "") + "<|tool_call_begin|>functions.get",
                                "length", {"tools": TOOLS},
                                {"tool_calls": [("functions.get_weather:0", "get_weather",
                                                 '{"city": "Paris", "unit": "celsius"}')]}, "length"),
    "max_tokens_in_the_header": ("<think>Hm.</think>Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.ge",
                                 "length", {"tools": TOOLS}, {"reasoning_content": "Hm.", "content": "Sure."},
                                 "length"),
    "stop_string_in_arguments": (SCRIPT, "stop", {"tools": TOOLS, "stop": [", "]},
                                 {"reasoning_content": "The user wants weather.", "content": "Let me check.",
                                  "tool_calls": [("functions.get_weather:0", "get_weather", '{"city": "Paris"')]},
                                 "stop"),
    "max_tokens_in_reasoning": ("<think>The user wants", "length", {"tools": TOOLS},
                                {"reasoning_content": "The user wants"}, "length"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(CUT_OFF))
def test_a_cut_off_tool_call_or_reasoning_reads_the_same_streamed_or_not(scripted, case):
    """A tool-call section or reasoning cut off by max_tokens or a stop string: no markup in `content`, the calls
    whose headers are complete in `tool_calls` (the last one's arguments as far as they got), the engine's finish
    reason; the openai client reads the same message streamed and not."""
    front, url = scripted
    script, front.finish, extra, want, want_finish = CUT_OFF[case]
    front.script = script
    client = _client(url)
    whole = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=40, **extra).choices[0]
    streamed, finish = _gather_stream(client.chat.completions.create(model=MODEL, messages=USER, max_tokens=40,
                                                                     stream=True, **extra))
    calls = [(c.id, c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    got = {"reasoning_content": getattr(whole.message, "reasoning_content", None), "content": whole.message.content,
           "tool_calls": calls or None}
    assert got == {"reasoning_content": None, "content": None, "tool_calls": None, **want}
    assert whole.finish_reason == finish == want_finish
    assert streamed == {"reasoning_content": want.get("reasoning_content", ""), "content": want.get("content", ""),
                        "tool_calls": [{"id": i, "name": n, "arguments": a} for i, n, a in calls]}
    assert not any("<|" in (m.get("content") or "") for m in (streamed, got))


def test_tool_choice_none_and_no_parsers_leave_the_text_as_content(tokenizer):
    """tool_choice "none": no tool parsing (the section's markers are special tokens: no text); a server without
    --reasoning-parser keeps <think> in the content."""
    front, app = _stub(tokenizer)
    with TestClient(app) as http:
        body = {"model": MODEL, "messages": USER, "tools": TOOLS, "tool_choice": "none"}
        msg = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert front.params[-1].constraint is None
    assert msg["content"].startswith("<think>The user wants weather.</think>Let me check.")
    assert "tool_calls" not in msg and "reasoning_content" not in msg


def test_tool_turns_pass_through_to_the_template(stub, tokenizer):
    """An assistant turn with tool_calls and a tool turn with its tool_call_id reach the chat template."""
    _, url = stub
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18 degrees"}]
    r = _client(url).chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                             extra_body={"return_token_ids": True})
    prompt = tokenizer.decode(r.model_extra["prompt_token_ids"])
    assert "## Return of functions.get_weather:0\n18 degrees" in prompt
    assert CALL in prompt and '"name":"get_time"' in prompt  # the earlier call, and the declared tools


# ---- constraints the server builds ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiler(tokenizer) -> ConstraintCompiler:
    return ConstraintCompiler(ConstraintVocabulary.from_tokenizer(tokenizer))


def test_forced_tool_choice_is_a_section_of_special_tokens_around_schema_arguments(tokenizer, compiler):
    """The section's markers match their special tokens only (not the same characters as text), the arguments
    follow the tool's schema, and a named tool_choice allows that tool alone."""
    stop = [tokenizer.special_id("<|im_end|>")]
    tools = agent_constraints.declared_tools(TOOLS)
    required = compiler.compile(agent_constraints.tool_call_spec(tools, None, parallel=True))
    named = compiler.compile(agent_constraints.tool_call_spec(tools, "get_time", parallel=True))
    two = CALL.replace("<|tool_calls_section_end|>", "") + CALL.split("<|tool_calls_section_begin|>")[1].replace(
        "get_weather:0", "get_weather:1")
    assert required.accepts(tokenizer.encode(CALL) + stop)
    assert required.accepts(tokenizer.encode(two) + stop)
    assert not required.accepts(tokenizer.encode(CALL, allow_special=False) + stop)  # markers spelt as text
    placeholders = []  # each marker as the ordinary token of the character the regex names it by
    for piece in re.split(r"(<\|[a-z_]+\|>)", CALL):
        i = agent_constraints.TOOL_MARKERS.index(piece) if piece in agent_constraints.TOOL_MARKERS else None
        placeholders += tokenizer.encode(piece if i is None else chr(MARKER_CHAR_BASE + i), allow_special=False)
    assert not required.accepts(placeholders + stop)
    assert not required.accepts(tokenizer.encode(CALL.replace('"celsius"', '"kelvin"')) + stop)  # off schema
    assert not named.accepts(tokenizer.encode(CALL) + stop)
    assert named.accepts(tokenizer.encode(CALL.replace("get_weather", "get_time").replace(
        '{"city": "Paris", "unit": "celsius"}', '{"zone": "UTC"}')) + stop)


BAD_REQUESTS = {
    "invalid_schema": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, "response_format"),
    "schema_not_json": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{"}}},
                        "response_format"),
    "invalid_regex": ({"structured_outputs": {"regex": "(("}}, "structured_outputs"),
    "two_structured_kinds": ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    "schema_past_the_compile_cap": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"k": {"type": "string", "maxLength": 4 * STUB_STATES}},
        "required": ["k"]}}}}, "response_format"),
    "schema_past_the_tables_cap": ({"structured_outputs": {"json": {  # compiles, but not into STUB_STATES states
        "type": "object", "properties": {"k": {"type": "string", "maxLength": STUB_STATES // 8}},
        "required": ["k"]}}}, "structured_outputs"),
    "auto_without_the_flag": ({"tools": TOOLS}, "tool_choice"),
    "named_tool_not_declared": ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                                "tool_choice"),
    "required_without_tools": ({"tool_choice": "required"}, "tool_choice"),
    "tool_message_without_id": ({"messages": [*USER, {"role": "tool", "content": "18"}]}, "messages[1].tool_call_id"),
    "tool_schema_invalid": ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}],
        "tool_choice": "required"}, "tools[0].function.parameters"),
    "template_kwarg_reserved": ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_agent_input_is_a_400_naming_the_field(case, tokenizer):
    """Each answered in OpenAI's error JSON, param = the field; none reaches the engine. The server here runs
    without --enable-auto-tool-choice."""
    extra, field = BAD_REQUESTS[case]
    front, app = _stub(tokenizer, tool_call_parser="kimi_k2")
    with TestClient(app) as http:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error", error
    assert error["message"].startswith(field) or field in error["message"], error
    if "cap" in case:
        assert "cap" in error["message"], error
    assert front.params == []


def test_marker_characters_spelt_by_ordinary_tokens_never_match_a_marker():
    """A vocabulary whose ordinary tokens hold a marker's character, alone and inside a longer token: only the
    special token matches the marker."""
    special, stop = 5, 6
    vocab = ConstraintVocabulary.from_token_bytes([b"a", bytes([MARKER_CHAR_BASE]), b"a" + bytes([MARKER_CHAR_BASE]),
                                                   b"b"], 7, [stop], {"<|m|>": special})
    compiler = ConstraintCompiler(vocab)
    automaton = compiler.compile(ConstraintSpec.regex(f"a{ConstraintSpec.marker(0)}b", ["<|m|>"]))
    assert automaton.accepts([0, special, 3, stop])
    assert not automaton.accepts([0, 1, 3, stop]) and not automaton.accepts([2, 3, stop])
    plain = compiler.compile(ConstraintSpec.regex("a[^b]b"))  # without markers the special token spells nothing
    assert plain.accepts([0, 1, 3, stop]) and not plain.accepts([0, special, 3, stop])


def test_structured_outputs_on_completions_reach_the_engine(tokenizer):
    front, app = _stub(tokenizer)
    with TestClient(app) as http:
        for extra, want in (({"structured_outputs": {"choice": ["yes", "no"]}}, ConstraintSpec.choice(["yes", "no"])),
                            ({"response_format": {"type": "json_schema", "json_schema": {
                                "name": "flag", "schema": {"type": "boolean"}}}},
                             ConstraintSpec.json_schema({"type": "boolean"}))):
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Answer:", **extra})
            assert r.status_code == 200, r.text
            assert front.params[-1].constraint == want


# ---- the shipped pair through the serving engine --------------------------------------------------------------
SERVE = {"max_slots": 2, "max_context": 384, "budget": 8, "rounds_per_step": 2, "page_size": 16,
         "max_num_batched_tokens": 64, "prefill_batch": 1, "step_widths": (2,), "constraint_states": 512,
         "constraint_exceptions": 1 << 17}


@pytest.fixture(scope="module")
def served():
    """(core, base URL): the shipped pair behind the agent flags, warmed up."""
    engine = Engine.load(os.path.join(SHIPPED, "target"), os.path.join(SHIPPED, "drafter"))
    core = ServingEngine(engine, ServeConfig(**SERVE))
    core.warm_up()
    app = build_app(AsyncServingEngine(core), engine.tokenizer, ServerSettings(model_names=(MODEL,), **AGENT))
    with serve_in_thread(app) as url:
        yield core, url


def _arguments_valid(call, schema) -> None:
    jsonschema.validate(json.loads(call["arguments"] if isinstance(call, dict) else call.function.arguments), schema)


@pytest.mark.heavy
def test_forced_tool_calls_of_the_shipped_pair_parse_and_follow_the_schema(served):
    """A named tool_choice (whole response) and "required" (streamed): the openai client reads tool_calls whose
    arguments validate against the tool's schema, finish_reason "tool_calls"."""
    _, url = served
    client = _client(url)
    named = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    assert choice.message.tool_calls[0].id == "functions.get_time:0"
    _arguments_valid(choice.message.tool_calls[0], TIME)
    msg, finish = _gather_stream(client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, max_tokens=120, temperature=0, tool_choice="required",
        parallel_tool_calls=False, stream=True))
    assert finish == "tool_calls" and len(msg["tool_calls"]) == 1, msg
    call = msg["tool_calls"][0]
    _arguments_valid(call, {"get_weather": WEATHER, "get_time": TIME}[call["name"]])
    assert re.fullmatch(rf"functions\.{call['name']}:\d+", call["id"])


@pytest.mark.heavy
def test_structured_outputs_of_the_shipped_pair_validate(served):
    """response_format json_schema on chat, structured_outputs regex and choice on completions, two of them at
    once (two automata in the tables): each output matches its constraint."""
    core, url = served
    client = _client(url)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}

    async def both():
        ac = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        return await asyncio.gather(
            ac.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A person as JSON."}],
                                       max_tokens=60, temperature=0, response_format={
                                           "type": "json_schema", "json_schema": {"name": "person", "schema": schema}}),
            ac.completions.create(model=MODEL, prompt="The date is", max_tokens=16, temperature=0.8, seed=7,
                                  extra_body={"structured_outputs": {"regex": r" [0-9]{4}-[0-9]{2}-[0-9]{2}"}}))

    chat, dated = asyncio.run(both())
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    assert re.fullmatch(r" [0-9]{4}-[0-9]{2}-[0-9]{2}", dated.choices[0].text), dated.choices[0].text
    pick = client.completions.create(model=MODEL, prompt="def f(x):\n    return", max_tokens=8, temperature=0,
                                     extra_body={"structured_outputs": {"choice": [" None", " x + 1", " True"]}})
    assert pick.choices[0].text in (" None", " x + 1", " True") and pick.choices[0].finish_reason == "stop"
    assert core.automata.layout.live == 0  # every placement freed with its request


@pytest.mark.heavy
def test_a_forced_tool_call_cut_off_by_max_tokens_reads_the_same_streamed_or_not(served):
    """The shipped pair's named tool call cut off by max_tokens: finish_reason "length", the partial call in
    tool_calls (its arguments as far as they got), no markup in content; streamed, the same."""
    _, url = served
    client = _client(url)
    kw = {"model": MODEL, "messages": USER, "tools": TOOLS, "max_tokens": 28, "temperature": 0,
          "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    whole = client.chat.completions.create(**kw).choices[0]
    streamed, finish = _gather_stream(client.chat.completions.create(stream=True, **kw))
    assert whole.finish_reason == finish == "length"
    assert whole.message.content is None and streamed["content"] == "", (whole, streamed)
    assert whole.message.tool_calls, whole.message
    (call,) = whole.message.tool_calls
    assert (call.id, call.function.name) == ("functions.get_time:0", "get_time")
    assert call.function.arguments.startswith("{")
    assert streamed["tool_calls"] == [{"id": call.id, "name": "get_time", "arguments": call.function.arguments}]


@pytest.mark.heavy
def test_responses_of_the_shipped_pair_follow_text_format_and_force_a_call(served):
    """/v1/responses on the serving engine: text.format json_schema gives output_text that validates, whole and
    streamed alike; a named tool_choice gives a function_call item whose arguments follow the tool's schema."""
    _, url = served
    client = _client(url)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
              "additionalProperties": False}
    kw = {"model": MODEL, "input": "A city as JSON.", "max_output_tokens": 40, "temperature": 0,
          "text": {"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}}}
    whole = client.responses.create(**kw)
    assert whole.status == "completed", whole
    jsonschema.validate(json.loads(whole.output_text), schema)
    streamed = "".join(e.delta for e in client.responses.create(stream=True, **kw)
                       if e.type == "response.output_text.delta")
    assert streamed == whole.output_text
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    called = client.responses.create(model=MODEL, input=USER[0]["content"], tools=tools, max_output_tokens=80,
                                     temperature=0, tool_choice={"type": "function", "name": "get_time"})
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert (call.name, call.call_id) == ("get_time", "functions.get_time:0")
    jsonschema.validate(json.loads(call.arguments), TIME)
