"""One chat choice's generated text -> an OpenAI assistant message (reasoning, content, tool calls) and its finish
reason: the reasoning parser first, its content through the tool-call parser. The server builds one
`ChatOutputParser` per streamed choice, or calls `parse_chat_output` once on a whole completion (the same parser)."""
from __future__ import annotations

from typing import Any

from kdtree_jax.server.reasoning import REASONING_FIELD, ReasoningStreamParser
from kdtree_jax.server.tool_calls import ToolCallStreamParser


class ChatOutputParser:
    """`feed(delta)` / `finish()` -> OpenAI chat deltas in order: `reasoning_content`, then `content` and
    `tool_calls`. `reasoning=False` or `tools=False` turns that parser off (its text stays content)."""

    def __init__(self, *, reasoning: bool, tools: bool, starts_in_reasoning: bool = True):
        self._reasoning = ReasoningStreamParser(starts_in_reasoning) if reasoning else None
        self._tools = ToolCallStreamParser() if tools else None
        self._content = ""

    def feed(self, delta: str) -> list[dict[str, Any]]:
        return self._route(self._reasoning.feed(delta) if self._reasoning else [{"content": delta}], final=False)

    def finish(self) -> list[dict[str, Any]]:
        return self._route(self._reasoning.finish() if self._reasoning else [], final=True)

    def _route(self, deltas: list[dict[str, Any]], final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for d in deltas:
            if "content" not in d:
                out.append(d)
            elif self._tools is not None:
                out.extend(self._tools.feed(d["content"]))
            elif d["content"]:
                self._content += d["content"]
                out.append(d)
        if final and self._tools is not None:
            out.extend(self._tools.finish())
        return out

    def message(self) -> dict[str, Any]:
        """The assistant message the deltas so far add up to."""
        reasoning = self._reasoning.reasoning if self._reasoning else ""
        content = self._tools.content if self._tools else self._content
        calls = [c.to_openai() for c in self._tools.tool_calls] if self._tools else []
        return _message(reasoning or None, content or None, calls)

    def finish_reason(self, engine_reason: str) -> str:
        return self._tools.finish_reason(engine_reason) if self._tools else engine_reason


def parse_chat_output(text: str, engine_reason: str, *, reasoning: bool, tools: bool,
                      starts_in_reasoning: bool = True) -> tuple[dict[str, Any], str]:
    """A whole completion -> (assistant message, finish reason): the stream parser over the whole text, so a
    response reads the same streamed or not (a cut-off tool call too)."""
    parser = ChatOutputParser(reasoning=reasoning, tools=tools, starts_in_reasoning=starts_in_reasoning)
    parser.feed(text)
    parser.finish()
    return parser.message(), parser.finish_reason(engine_reason)


def _message(reasoning: str | None, content: str | None, tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        msg[REASONING_FIELD] = reasoning
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg
