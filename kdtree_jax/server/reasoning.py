"""Kimi K2 reasoning (`kimi_k2`): `<think>` ... `</think>` in generated text -> `reasoning_content` and `content`,
whole (`split_reasoning`) or streamed (`ReasoningStreamParser`).

Where thinking starts depends on the prompt. Kimi K2.5 / K2.6 templates end the generation prompt with `<think>`
when thinking is on (the default; `<think></think>` when the request sets `thinking: false`), so the output starts
inside reasoning: `starts_in_reasoning=True`, as vLLM's `kimi_k2` parser assumes with thinking on. Templates that
leave the tag to the model (K2-Thinking, and `checkpoints/kdtree-mini` unless `thinking` is passed) use
`starts_in_reasoning=False`: the output is content unless it opens with `<think>` itself. Either way a `<think>` at
the very start is consumed, and reasoning ends at `</think>` (consumed) or, as in vLLM, where a tool-call section
begins (`<|tool_calls_section_begin|>` stays in the content for the tool-call parser).
"""
from __future__ import annotations

from typing import Any

from kdtree_jax.server.tool_calls import SECTION_BEGIN

THINK_BEGIN = "<think>"
THINK_END = "</think>"
REASONING_FIELD = "reasoning_content"  # vLLM's name for the field, in messages and in stream deltas


def split_reasoning(text: str, starts_in_reasoning: bool = True) -> tuple[str | None, str | None]:
    """A whole completion -> (reasoning, content); an empty part is None."""
    if text.startswith(THINK_BEGIN):
        text = text[len(THINK_BEGIN):]
    elif not starts_in_reasoning:
        return None, text or None
    end = text.find(THINK_END)
    section = text.find(SECTION_BEGIN)
    if end >= 0 and (section < 0 or end < section):
        reasoning, content = text[:end], text[end + len(THINK_END):]
    elif section >= 0:
        reasoning, content = text[:section], text[section:]
    else:
        reasoning, content = text, ""
    return reasoning or None, content or None


class ReasoningStreamParser:
    """Text deltas in (tags may be split across deltas), `{"reasoning_content": ...}` / `{"content": ...}` deltas
    out; they add up to `split_reasoning` of the whole text."""

    _START, _REASONING, _CONTENT = range(3)

    def __init__(self, starts_in_reasoning: bool = True):
        self.starts_in_reasoning = starts_in_reasoning
        self._state = self._START
        self._buf = ""
        self.reasoning = ""
        self.content = ""

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> list[dict[str, Any]]:
        return self._drain(final=True)

    @property
    def in_reasoning(self) -> bool:
        """True until reasoning has ended (or was never opened); the content stream starts after it."""
        return self._state != self._CONTENT

    def _drain(self, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._state == self._START:
            if self._buf.startswith(THINK_BEGIN):
                self._buf = self._buf[len(THINK_BEGIN):]
                self._state = self._REASONING
            elif THINK_BEGIN.startswith(self._buf) and not final:
                return out  # could still become `<think>`
            else:
                self._state = self._REASONING if self.starts_in_reasoning else self._CONTENT
        if self._state == self._REASONING:
            end, section = self._buf.find(THINK_END), self._buf.find(SECTION_BEGIN)
            if end >= 0 and (section < 0 or end < section):
                self._emit(out, REASONING_FIELD, self._buf[:end])
                self._buf = self._buf[end + len(THINK_END):]
                self._state = self._CONTENT
            elif section >= 0:
                self._emit(out, REASONING_FIELD, self._buf[:section])
                self._buf = self._buf[section:]
                self._state = self._CONTENT
            else:
                hold = 0 if final else _held_suffix(self._buf, (THINK_END, SECTION_BEGIN))
                self._emit(out, REASONING_FIELD, self._buf[:len(self._buf) - hold])
                self._buf = self._buf[len(self._buf) - hold:]
        if self._state == self._CONTENT:
            self._emit(out, "content", self._buf)
            self._buf = ""
        return out

    def _emit(self, out: list[dict[str, Any]], field: str, text: str) -> None:
        if not text:
            return
        if field == REASONING_FIELD:
            self.reasoning += text
        else:
            self.content += text
        out.append({field: text})


def _held_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    for start in range(max(0, len(text) - max(map(len, tags)) + 1), len(text)):
        tail = text[start:]
        if any(t.startswith(tail) for t in tags):
            return len(tail)
    return 0
