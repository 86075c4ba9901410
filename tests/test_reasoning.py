"""Kimi K2 reasoning split (`<think>` ... `</think>`), whole and streamed, and the chat-output parser that runs the
reasoning parser and then the tool-call parser: hand-written cases, then streams cut at random places against the
whole-text parse."""
from __future__ import annotations

import pytest

from kdtree_jax.server.chat_output import ChatOutputParser, parse_chat_output
from kdtree_jax.server.reasoning import ReasoningStreamParser, split_reasoning
from kdtree_jax.server.tool_calls import ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END

CALL = f"{SECTION_BEGIN}{CALL_BEGIN}functions.f:0{ARGUMENT_BEGIN}{{\"a\": 1}}{CALL_END}{SECTION_END}"

CASES = [  # (text, starts_in_reasoning, reasoning, content)
    ("plan</think>answer", True, "plan", "answer"),
    ("<think>plan</think>answer", True, "plan", "answer"),
    ("<think>plan</think>answer", False, "plan", "answer"),
    ("answer only", False, None, "answer only"),
    ("still thinking", True, "still thinking", None),
    ("</think>answer", True, None, "answer"),
    ("a <think> b</think> c</think>", True, "a <think> b", " c</think>"),
    (" <think>x</think>y", False, None, " <think>x</think>y"),  # the tag opens reasoning only at the very start
    ("plan" + CALL, True, "plan", CALL),  # a tool-call section ends reasoning and stays in the content
    ("plan</think>" + CALL, True, "plan", CALL),
    ("", True, None, None),
    ("<think>", False, None, None),
]


@pytest.mark.parametrize("text, starts, reasoning, content", CASES)
def test_split_reasoning(text, starts, reasoning, content):
    assert split_reasoning(text, starts) == (reasoning, content)


def stream_reasoning(text: str, cuts: list[int], starts: bool) -> tuple[str | None, str | None]:
    parser, deltas, prev = ReasoningStreamParser(starts), [], 0
    for cut in [*sorted(cuts), len(text)]:
        deltas += parser.feed(text[prev:cut])
        prev = cut
    deltas += parser.finish()
    reasoning = content = ""
    for d in deltas:
        ((field, value),) = d.items()
        assert value and field in ("reasoning_content", "content")
        assert not (field == "reasoning_content" and content), "reasoning after content"
        if field == "content":
            content += value
        else:
            reasoning += value
    assert (parser.reasoning, parser.content) == (reasoning, content)
    return reasoning or None, content or None


@pytest.mark.parametrize("text, starts, reasoning, content", CASES)
def test_stream_split_at_every_point(text, starts, reasoning, content):
    for cut in range(len(text) + 1):
        assert stream_reasoning(text, [cut], starts) == (reasoning, content), cut
    assert stream_reasoning(text, list(range(len(text))), starts) == (reasoning, content)


def test_tags_are_held_until_complete():
    parser = ReasoningStreamParser(True)
    assert parser.feed("<thi") == []
    assert parser.feed("nk>abc</th") == [{"reasoning_content": "abc"}]
    assert parser.in_reasoning
    assert parser.feed("ink>ok") == [{"content": "ok"}]
    assert not parser.in_reasoning
    assert parser.feed("</think>") == [{"content": "</think>"}]
    assert parser.finish() == []


def test_held_prefix_that_is_not_a_tag_is_released():
    parser = ReasoningStreamParser(True)
    assert parser.feed("x </thi") == [{"reasoning_content": "x "}]
    assert parser.feed("s") == [{"reasoning_content": "</this"}]
    assert parser.feed("<|tool_calls") == []
    assert parser.finish() == [{"reasoning_content": "<|tool_calls"}]


PIECES = ["<think>", "</think>", "<", "</", "think", ">", "<thi", "nk>", "a", " ", "é", SECTION_BEGIN, CALL,
          "<|tool_calls_sec"]


def test_stream_matches_whole_on_random_texts(rng):
    for _ in range(400):
        text = "".join(PIECES[i] for i in rng.integers(0, len(PIECES), size=int(rng.integers(0, 10))))
        starts = bool(rng.integers(2))
        cuts = rng.integers(0, len(text) + 1, size=int(rng.integers(0, len(text) + 1))).tolist()
        assert stream_reasoning(text, cuts, starts) == split_reasoning(text, starts), (text, cuts, starts)


# ---- reasoning + tool calls ----

def collect_message(deltas: list[dict]) -> dict:
    msg = {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": []}
    for d in deltas:
        if "tool_calls" in d:
            (tc,) = d["tool_calls"]
            if tc["index"] == len(msg["tool_calls"]):
                msg["tool_calls"].append({"id": tc["id"], "type": "function", "function": dict(tc["function"])})
            else:
                msg["tool_calls"][tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
        else:
            ((field, value),) = d.items()
            msg[field] += value
    msg["content"] = msg["content"] or None
    if not msg["reasoning_content"]:
        del msg["reasoning_content"]
    if not msg["tool_calls"]:
        del msg["tool_calls"]
    return msg


def test_chat_output_reasoning_then_tool_call():
    text = "<think>need the weather</think>Checking." + CALL
    msg, finish = parse_chat_output(text, "stop", reasoning=True, tools=True)
    assert msg == {"role": "assistant", "content": "Checking.", "reasoning_content": "need the weather",
                   "tool_calls": [{"id": "functions.f:0", "type": "function",
                                   "function": {"name": "f", "arguments": '{"a": 1}'}}]}
    assert finish == "tool_calls"
    assert parse_chat_output(text, "stop", reasoning=False, tools=False) == (
        {"role": "assistant", "content": text}, "stop")
    msg, finish = parse_chat_output("plan" + CALL, "stop", reasoning=True, tools=True)  # no </think>
    assert msg["reasoning_content"] == "plan" and msg["content"] is None and finish == "tool_calls"


@pytest.mark.parametrize("reasoning, tools", [(True, True), (True, False), (False, True)])
def test_chat_output_stream_matches_whole(reasoning, tools, rng):
    for _ in range(200):
        text = "".join(PIECES[i] for i in rng.integers(0, len(PIECES), size=int(rng.integers(0, 8))))
        starts = bool(rng.integers(2))
        parser, deltas, prev = ChatOutputParser(reasoning=reasoning, tools=tools, starts_in_reasoning=starts), [], 0
        for cut in sorted(rng.integers(0, len(text) + 1, size=int(rng.integers(0, 12))).tolist()) + [len(text)]:
            deltas += parser.feed(text[prev:cut])
            prev = cut
        deltas += parser.finish()
        msg, finish = parse_chat_output(text, "stop", reasoning=reasoning, tools=tools, starts_in_reasoning=starts)
        assert collect_message(deltas) == msg == parser.message(), text
        assert parser.finish_reason("stop") == finish
