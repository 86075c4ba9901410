"""Kimi K2 tool-call parsing: whole completions against hand-written expectations (vLLM's `kimi_k2` conventions:
the header is the id), malformed sections as content, and the stream parser against the whole-text parser on
random completions cut at random places."""
from __future__ import annotations

import json

import pytest

from kdtree_jax.server.tool_calls import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    SECTION_BEGIN,
    SECTION_END,
    ToolCall,
    ToolCallStreamParser,
    parse_tool_calls,
)


def call(header: str, args: str, pad: str = "") -> str:
    return f"{CALL_BEGIN}{header}{ARGUMENT_BEGIN}{pad}{args}{pad}{CALL_END}"


def section(*calls: str, sep: str = "") -> str:
    return SECTION_BEGIN + sep + sep.join(calls) + sep + SECTION_END


WEATHER = '{"city": "Paris", "unit": "c"}'


def collect(deltas: list[dict]) -> tuple[str, list[dict]]:
    """Add OpenAI stream deltas up into (content, tool_calls), checking the delta shapes on the way: a call's first
    delta has index (the next one), id, type and name; later ones only arguments."""
    content, calls = "", []
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"}), d
        if "content" in d:
            assert d["content"], "empty content delta"
            content += d["content"]
            continue
        (tc,) = d["tool_calls"]
        if tc["index"] == len(calls):
            assert set(tc) == {"index", "id", "type", "function"} and tc["type"] == "function", tc
            assert tc["function"]["arguments"] == ""
            calls.append({"id": tc["id"], "type": "function", "function": dict(tc["function"])})
        else:
            assert tc["index"] == len(calls) - 1 and set(tc) == {"index", "function"}, tc
            assert set(tc["function"]) == {"arguments"} and tc["function"]["arguments"], tc
            calls[-1]["function"]["arguments"] += tc["function"]["arguments"]
    return content, calls


def stream(text: str, cuts: list[int]) -> tuple[ToolCallStreamParser, list[dict]]:
    parser, deltas, prev = ToolCallStreamParser(), [], 0
    for cut in [*sorted(cuts), len(text)]:
        deltas += parser.feed(text[prev:cut])
        prev = cut
    deltas += parser.finish()
    return parser, deltas


# ---- whole completions ----

def test_parses_calls_and_content():
    text = "Let me look.\n" + section(call("functions.get_weather:0", WEATHER),
                                      call(" functions.get_time:1 ", "{}", pad="\n"), sep="\n")
    res = parse_tool_calls(text)
    assert res.content == "Let me look.\n"
    assert res.tool_calls == [ToolCall("functions.get_weather:0", "get_weather", WEATHER),
                              ToolCall("functions.get_time:1", "get_time", "{}")]
    assert res.openai_tool_calls()[0] == {"id": "functions.get_weather:0", "type": "function",
                                          "function": {"name": "get_weather", "arguments": WEATHER}}
    assert res.finish_reason("stop") == "tool_calls"
    assert res.finish_reason("length") == "length"


def test_header_without_functions_prefix_and_no_content():
    res = parse_tool_calls(section(call("search:3", '{"q": "<|x|> ok"}')))
    assert res.content is None
    assert res.tool_calls == [ToolCall("search:3", "search", '{"q": "<|x|> ok"}')]


def test_plain_text_is_content():
    res = parse_tool_calls("no tools <|tool_calls here")
    assert res.content == "no tools <|tool_calls here" and res.tool_calls == []
    assert res.finish_reason("stop") == "stop"


def test_text_after_a_section_is_content():
    res = parse_tool_calls("a" + section(call("functions.f:0", "{}")) + "b")
    assert res.content == "ab" and [c.name for c in res.tool_calls] == ["f"]


MALFORMED = {
    "no call end": "x" + SECTION_BEGIN + CALL_BEGIN + "functions.f:0" + ARGUMENT_BEGIN + "{}" + SECTION_END,
    "bad header": "x" + section(call("functions.get weather:0", "{}")),
    "header without index": "x" + section(call("functions.f", "{}")),
    "header with a marker": "x" + section(CALL_BEGIN + "functions.f:0" + CALL_BEGIN + "f:1" + ARGUMENT_BEGIN + "{}"
                                          + CALL_END),
    "text between calls": "x" + section(call("functions.f:0", "{}"), call("functions.g:1", "{}"), sep=" and "),
    "empty section": "x" + SECTION_BEGIN + " " + SECTION_END,
    "marker inside arguments": "x" + section(call("functions.f:0", '{"a": 1' + SECTION_BEGIN + "}")),
}


# malformed before the stream could send a call: the stream gives the same content as the whole parse
MALFORMED_BEFORE_A_CALL = ["bad header", "header without index", "header with a marker", "text between calls",
                           "empty section"]


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_section_is_content(name):
    text = MALFORMED[name]
    res = parse_tool_calls(text)
    parser, deltas = stream(text, [])
    content, calls = collect(deltas)
    assert (res.content or "", res.openai_tool_calls()) == (content, calls)  # whole reads as streamed
    if name in MALFORMED_BEFORE_A_CALL:
        assert (content, calls) == (text, []) and res.finish_reason("stop") == "stop"
    else:  # a call was sent before the flaw showed: it stays, but the choice does not end as "tool_calls"
        assert [c["function"]["name"] for c in calls] == ["f"] and content.startswith("x")
        assert not parser.complete and parser.finish_reason("stop") == "stop" and res.finish_reason("stop") == "stop"


def test_a_section_cut_off_anywhere_leaves_no_markup_in_content(rng):
    """Every prefix that ends inside a section (max_tokens or a stop cut it): the text before it is the content,
    each call whose header is complete is a call (the last one's arguments as far as they got), no marker is
    content, the finish reason stays the engine's; streamed at random splits, the same. Markers are special tokens:
    a cut falls between them, never inside one."""
    text = "Let me check." + section(call("functions.get_time:0", '{"tz": "UTC"}'),
                                     call("functions.get_weather:1", WEATHER, pad=" "), sep="\n")
    start = len("Let me check.")
    inside = {at + i for m in (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)
              for at in range(len(text)) if text.startswith(m, at) for i in range(1, len(m))}
    for end in sorted(set(range(start + 1, len(text))) - inside):
        cut = text[:end]
        whole = parse_tool_calls(cut)
        assert whole.content == "Let me check." and not whole.complete, cut
        headers = [h for h in ("functions.get_time:0", "functions.get_weather:1")
                   if cut.find(ARGUMENT_BEGIN, cut.find(h)) > cut.find(h) >= 0]
        assert [c.id for c in whole.tool_calls] == headers, cut
        for c in whole.tool_calls:
            full = '{"tz": "UTC"}' if c.name == "get_time" else WEATHER
            assert full.startswith(c.arguments) and not any(m in c.arguments for m in (CALL_END, SECTION_END))
        assert whole.finish_reason("length") == "length" and whole.finish_reason("stop") == "stop"
        cuts = rng.integers(0, end + 1, size=int(rng.integers(0, 8))).tolist()
        parser, deltas = stream(cut, cuts)
        assert collect(deltas) == (whole.content, whole.openai_tool_calls()), (cut, cuts)
        assert parser.result() == whole


@pytest.mark.parametrize("name", MALFORMED_BEFORE_A_CALL)
def test_malformed_first_call_streams_as_content_at_any_split(name, rng):
    text = MALFORMED[name]
    for _ in range(20):
        cuts = rng.integers(0, len(text) + 1, size=rng.integers(0, 12)).tolist()
        parser, deltas = stream(text, cuts)
        assert collect(deltas) == (text, []), cuts
        assert parser.finish_reason("stop") == "stop"


def test_stream_keeps_sent_calls_when_a_later_call_is_malformed():
    good = call("functions.f:0", "{}")
    text = "hi" + SECTION_BEGIN + good + call("bad header:1", "{}") + SECTION_END
    _, deltas = stream(text, [])
    content, calls = collect(deltas)
    assert [c["function"]["name"] for c in calls] == ["f"]
    assert content == "hi" + call("bad header:1", "{}") + SECTION_END  # nothing after the sent call is lost


def test_stream_cut_inside_arguments_is_incomplete():
    text = SECTION_BEGIN + CALL_BEGIN + "functions.f:0" + ARGUMENT_BEGIN + '{"city": "Par'
    parser, deltas = stream(text, [len(text) - 3])
    content, calls = collect(deltas)
    assert content == "" and calls[0]["function"]["arguments"] == '{"city": "Par'
    assert not parser.complete and parser.finish_reason("stop") == "stop"


def test_arguments_stream_in_pieces():
    args = json.dumps({"text": "a fairly long argument " * 4})
    text = section(call("functions.write:0", args))
    _, deltas = stream(text, list(range(len(text))))
    pieces = [d for d in deltas if "tool_calls" in d and "id" not in d["tool_calls"][0]]
    assert len(pieces) > len(args) // 2  # sent as it arrives, not held to the end
    assert collect(deltas)[1][0]["function"]["arguments"] == args


def test_several_markers_in_one_delta():
    text = "ok" + section(call("functions.a:0", "{}"), call("functions.b:1", '{"x": [1, 2]}'))
    parser, deltas = stream(text, [])
    assert collect(deltas) == ("ok", parse_tool_calls(text).openai_tool_calls())
    assert parser.complete and parser.finish_reason("stop") == "tool_calls"


# ---- random completions: stream == whole ----

PIECES = ["<", "|", "<|", "tool", "|>", " ", "\n", "é", "🙂", "{", "}", '"', "x", "call", "<|tool_call_e"]


def random_text(rng, n: int) -> str:
    return "".join(PIECES[i] for i in rng.integers(0, len(PIECES), size=n))


def random_args(rng) -> str:
    value = {"k" + str(i): random_text(rng, int(rng.integers(0, 6))) for i in range(int(rng.integers(0, 4)))}
    return json.dumps(value, ensure_ascii=bool(rng.integers(2)))


def random_completion(rng) -> str:
    ws = [" ", "\n", "", "  \n"]
    text = random_text(rng, int(rng.integers(0, 8)))
    for _ in range(int(rng.integers(0, 3))):
        calls = [call(f"{'functions.' if rng.integers(2) else ''}fn_{i}-x:{i}", random_args(rng),
                      pad=ws[rng.integers(len(ws))]) for i in range(int(rng.integers(1, 4)))]
        text += section(*calls, sep=ws[rng.integers(len(ws))]) + random_text(rng, int(rng.integers(0, 4)))
    return text


def test_stream_matches_whole_parse_on_random_completions(rng):
    for _ in range(300):
        text = random_completion(rng)
        whole = parse_tool_calls(text)
        n_cuts = int(rng.integers(0, len(text) + 1))
        cuts = rng.integers(0, len(text) + 1, size=n_cuts).tolist()
        parser, deltas = stream(text, cuts)
        content, calls = collect(deltas)
        assert (content or None, calls) == (whole.content, whole.openai_tool_calls()), (text, cuts)
        assert parser.result() == whole
        assert parser.complete


def test_random_text_without_sections_passes_through(rng):
    for _ in range(200):
        text = random_text(rng, int(rng.integers(0, 30)))
        cuts = rng.integers(0, len(text) + 1, size=int(rng.integers(0, 10))).tolist()
        assert collect(stream(text, cuts)[1]) == (text, [])
