"""The chat template with tools (Kimi K2.6's spelling): tool declarations, assistant tool calls, tool results,
thinking marks; plain chats render byte for byte as the template without tools did; bad tool fields are
ValueErrors that name the field; a rendered call parses back through the tool-call parser."""
from __future__ import annotations

import json
import os

import pytest
from jinja2.exceptions import TemplateError

from kdtree_jax.checkpoint.tokenizer import DEFAULT_CHAT_TEMPLATE, KimiTokenizer
from kdtree_jax.server.tool_calls import parse_tool_calls

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MINI = os.path.join(REPO, "checkpoints", "kdtree-mini")

# The template as it was before tools: plain chats must render exactly as it does.
PLAIN_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' or message['role'] == 'tool' -%}<|im_system|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>"
    "{%- else -%}{{ raise_exception('unknown chat role: ' ~ message['role']) }}"
    "{%- endif -%}"
    "{{ message.get('name') or message['role'] }}<|im_middle|>{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_ID = "functions.get_weather:0"
TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "I need the tool",
     "tool_calls": [{"id": CALL_ID, "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": CALL_ID, "name": "get_weather", "content": "sunny, 21C"},
]


@pytest.fixture(scope="module")
def mini() -> KimiTokenizer:
    """The kdtree-mini tokenizer rendering with the module's default template (the shipped files hold the same
    template: test_shipped_checkpoint_template_is_the_default)."""
    tok = KimiTokenizer.from_dir(os.path.join(MINI, "tokenizer"))
    tok.chat_template, tok._template = DEFAULT_CHAT_TEMPLATE, None
    return tok


@pytest.mark.parametrize("where", ["tokenizer", "target"])
def test_shipped_checkpoint_template_is_the_default(where):
    with open(os.path.join(MINI, where, "tokenizer_config.json")) as f:
        assert json.load(f)["chat_template"] == DEFAULT_CHAT_TEMPLATE


def test_plain_chats_render_as_before(mini, rng):
    """Random chats without tools: the output equals the tool-less template's, byte for byte."""
    plain = KimiTokenizer.__new__(KimiTokenizer)
    plain.__dict__.update(mini.__dict__)
    plain.chat_template, plain._template = PLAIN_TEMPLATE, None
    words = ["hi", "", " ", "\n", "<|im_end|>", "你好", "{{ x }}", "None", "## Return of", "<think>"]
    for _ in range(100):
        msgs = []
        for _ in range(int(rng.integers(1, 6))):
            msg = {"role": ["system", "user", "assistant"][rng.integers(3)],
                   "content": "".join(words[i] for i in rng.integers(0, len(words), size=int(rng.integers(0, 5))))}
            if rng.integers(4) == 0:
                msg["name"] = "bob"
            msgs.append(msg)
        gen = bool(rng.integers(2))
        assert mini.apply_chat_template(msgs, gen) == plain.apply_chat_template(msgs, gen), msgs
        assert mini.apply_chat_template(msgs, gen, tools=[]) == plain.apply_chat_template(msgs, gen)


def test_tools_calls_and_results(mini):
    out = mini.apply_chat_template(TURNS, tools=[WEATHER_TOOL])
    assert out == (
        '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"get_weather",'
        '"description":"Weather now","parameters":{"type":"object","properties":{"city":{"type":"string"}},'
        '"required":["city"]}}}]<|im_end|>'
        "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Checking.<|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
        "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\nsunny, 21C<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>")
    ids = mini.encode_chat(TURNS, tools=[WEATHER_TOOL])
    for marker in ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                   "<|tool_call_end|>", "<|tool_calls_section_end|>"):
        assert ids.count(mini.special_id(marker)) == 1, marker


def test_call_without_content_object_arguments_and_declaration_override(mini):
    msgs = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "functions.a:1", "type": "function", "function": {"name": "a", "arguments": {"x": [1, "é"]}}},
        {"id": "functions.b:2", "type": "function", "function": {"name": "b", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "functions.a:1", "content": "ok"}]
    out = mini.apply_chat_template(msgs, add_generation_prompt=False, tools=[WEATHER_TOOL], tools_ts_str="TS")
    assert out == ("<|im_system|>tool_declare<|im_middle|>TS<|im_end|>"
                   "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|>"
                   '<|tool_call_begin|>functions.a:1<|tool_call_argument_begin|>{"x": [1, "é"]}<|tool_call_end|>'
                   "<|tool_call_begin|>functions.b:2<|tool_call_argument_begin|>{}<|tool_call_end|>"
                   "<|tool_calls_section_end|><|im_end|>"
                   "<|im_system|>tool<|im_middle|>## Return of functions.a:1\nok<|im_end|>")


def test_rendered_calls_parse_back(mini):
    """The template's spelling of an assistant turn is what the tool-call parser reads."""
    out = mini.apply_chat_template(TURNS[1:2], add_generation_prompt=False)
    body = out.split("<|im_middle|>", 1)[1].removesuffix("<|im_end|>")
    res = parse_tool_calls(body)
    assert res.content == "Checking."
    assert res.openai_tool_calls() == TURNS[1]["tool_calls"]


def test_thinking_marks(mini):
    answer = {"role": "assistant", "content": "Sunny.", "reasoning_content": "old thought"}
    msgs = [*TURNS[:1], answer, *TURNS]
    on = mini.apply_chat_template(msgs, thinking=True)
    # reasoning is kept after the last answer without tool calls, dropped before it
    assert "<|im_middle|><think></think>Sunny.<|im_end|>" in on
    assert "<|im_middle|><think>I need the tool</think>Checking.<|tool_calls_section_begin|>" in on
    assert on.endswith("<|im_assistant|>assistant<|im_middle|><think>")
    off = mini.apply_chat_template(msgs, thinking=False)
    assert "I need the tool" not in off and off.endswith("<|im_middle|><think></think>")
    assert "<think>" not in mini.apply_chat_template(msgs)


@pytest.mark.parametrize("msgs, kwargs, field", [
    ([{"role": "tool", "content": "x"}], {}, r"messages\[0\]\.tool_call_id"),
    ([{"role": "user", "content": "q"}, {"role": "tool", "content": "x", "tool_call_id": ""}], {},
     r"messages\[1\]\.tool_call_id"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}], {},
     r"messages\[0\]\.tool_calls\[0\]\.function\.name"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}], {},
     r"messages\[0\]\.tool_calls\[0\]\.id"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": 3}}]}],
     {}, r"messages\[0\]\.tool_calls\[0\]\.function\.arguments"),
    ([{"role": "user", "content": "", "tool_calls": []}], {}, r"messages\[0\]\.tool_calls"),
    ([{"role": "user", "content": "q"}], {"tools": [{"type": "function", "function": {}}]}, r"tools\[0\]\.function"),
    ([{"role": "user", "content": "q"}], {"tools": {"a": 1}}, r"^tools"),
    ([{"role": "user", "content": "q"}], {"thinking": "yes"}, r"thinking"),
])
def test_bad_tool_fields_name_the_field(mini, msgs, kwargs, field):
    with pytest.raises(ValueError, match=field) as err:
        mini.apply_chat_template(msgs, **kwargs)
    assert isinstance(err.value, TemplateError)  # the server reports template refusals as a 400
