"""Kimi K2 tool calls in generated text -> OpenAI `tool_calls`, streamed (`ToolCallStreamParser`) or whole
(`parse_tool_calls`: the same parser over the whole text, so a response reads the same streamed or not).

Kimi writes a section of calls after any plain text:
`<|tool_calls_section_begin|>` then per call `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>ARGS
<|tool_call_end|>`, then `<|tool_calls_section_end|>`. As in vLLM's `kimi_k2` parser, the call's id is the header
itself (`functions.NAME:IDX`, or `NAME:IDX`), the name is NAME, and the arguments are the text between the markers
with surrounding whitespace removed (not re-serialised). Text before and after a section is content. A section that
is malformed (a call without its end, a header that is not `[functions.]NAME:IDX`, text between calls, no call at
all) is content, verbatim, from where the last call sent ends: nothing the model wrote is dropped. A section the text
ends inside (cut off by max_tokens or a stop) is no flaw: the calls whose headers are complete are calls (the last
one's arguments as far as they got, and the choice does not end as "tool_calls"), and its markup is not content.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)
MARKER_START = "<|"  # every marker starts so; a header never contains it

FUNCTION_NAME_MAX = 64  # OpenAI's limit on a function name ([A-Za-z0-9_-]{1,64})
HEADER_RE = re.compile(rf"(?:functions\.)?([A-Za-z0-9_-]{{1,{FUNCTION_NAME_MAX}}}):(\d+)")
# A header past this length cannot be `functions.NAME:IDX`: the stream parser gives up waiting for its end.
MAX_HEADER_CHARS = 2 * FUNCTION_NAME_MAX + len("functions.:")

FINISH_TOOL_CALLS = "tool_calls"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str  # the model's header, e.g. "functions.get_weather:0"
    name: str
    arguments: str  # JSON text as the model wrote it

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class ToolCallResult:
    content: str | None  # text outside well-formed sections; None when empty
    tool_calls: list[ToolCall]
    complete: bool = True  # every section ended and every call was closed

    def openai_tool_calls(self) -> list[dict[str, Any]]:
        return [c.to_openai() for c in self.tool_calls]

    def finish_reason(self, engine_reason: str) -> str:
        return tool_finish_reason(bool(self.tool_calls), self.complete, engine_reason)


def tool_finish_reason(called: bool, complete: bool, engine_reason: str) -> str:
    """"tool_calls" when the model called tools, closed every call and stopped on its own; the engine's reason
    otherwise (a "length" stop stays "length": the calls may be cut short)."""
    return FINISH_TOOL_CALLS if called and complete and engine_reason == "stop" else engine_reason


def parse_header(header: str) -> tuple[str, str] | None:
    """`functions.NAME:IDX` (whitespace around allowed) -> (id, name); None when it is not a call header."""
    stripped = header.strip()
    m = HEADER_RE.fullmatch(stripped)
    return (stripped, m.group(1)) if m else None


def parse_tool_calls(text: str) -> ToolCallResult:
    """Split a whole completion into content and tool calls, as the stream parser reads it."""
    parser = ToolCallStreamParser()
    parser.feed(text)
    parser.finish()
    return parser.result()


def _held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers` (a marker the next
    delta may complete)."""
    start = text.find(MARKER_START[0], max(0, len(text) - max(map(len, markers)) + 1))
    while start >= 0:
        tail = text[start:]
        if any(m.startswith(tail) and m != tail for m in markers):
            return len(tail)
        start = text.find(MARKER_START[0], start + 1)
    return 0


class ToolCallStreamParser:
    """Text deltas in (any split: markers may arrive in pieces or several in one delta), OpenAI chat deltas out:
    `{"content": ...}` for text, then per call `{"tool_calls": [{"index", "id", "type", "function": {"name",
    "arguments": ""}}]}` once its header is complete, then `{"tool_calls": [{"index", "function": {"arguments"}}]}`
    pieces. For a well-formed or cut-off completion the deltas add up to `parse_tool_calls` of the whole text.

    A stream cannot take back what it sent: a section found malformed before any of its calls was sent is content
    verbatim; one found malformed later keeps the calls already sent and the rest of the text is content.
    `complete` says whether every section ended and every sent call was closed."""

    _TEXT, _SECTION, _HEADER, _ARGS, _RAW = range(5)

    def __init__(self) -> None:
        self._state = self._TEXT
        self._buf = ""
        self._raw = ""  # section text consumed since the last sent call (becomes content if the section is malformed)
        self._section_calls = 0
        self._args_sent = ""  # arguments of the open call sent so far (whitespace-stripped at the start)
        self.tool_calls: list[ToolCall] = []
        self.content = ""
        self.complete = True

    # ---- public ----
    def feed(self, delta: str) -> list[dict[str, Any]]:
        self._buf += delta
        out: list[dict[str, Any]] = []
        self._drain(out, final=False)
        return _merge(out)

    def finish(self) -> list[dict[str, Any]]:
        """End of stream: releases held-back text; a section left open is cut off, as the module says."""
        out: list[dict[str, Any]] = []
        self._drain(out, final=True)
        if self._state == self._ARGS:
            self._send_args(self._buf.rstrip(), out)
            self._buf = ""
            self.complete = False
        elif self._state in (self._SECTION, self._HEADER):  # cut off between calls or inside a header
            self._raw = self._buf = ""
            self.complete = False
        self._state = self._RAW
        return _merge(out)

    def result(self) -> ToolCallResult:
        return ToolCallResult(self.content or None, list(self.tool_calls), self.complete)

    def finish_reason(self, engine_reason: str) -> str:
        return tool_finish_reason(bool(self.tool_calls), self.complete, engine_reason)

    # ---- state machine ----
    def _drain(self, out: list[dict[str, Any]], final: bool) -> None:
        step = {self._TEXT: self._step_text, self._SECTION: self._step_section, self._HEADER: self._step_header,
                self._ARGS: self._step_args, self._RAW: self._step_raw}
        while self._buf and step[self._state](out, final):
            pass

    def _step_raw(self, out, final) -> bool:
        self._send_content(self._buf, out)
        self._buf = ""
        return False

    def _step_text(self, out, final) -> bool:
        at = self._buf.find(SECTION_BEGIN)
        if at >= 0:
            self._send_content(self._buf[:at], out)
            self._raw, self._buf = SECTION_BEGIN, self._buf[at + len(SECTION_BEGIN):]
            self._state, self._section_calls = self._SECTION, 0
            return True
        hold = 0 if final else _held_suffix(self._buf, (SECTION_BEGIN,))
        self._send_content(self._buf[:len(self._buf) - hold], out)
        self._buf = self._buf[len(self._buf) - hold:]
        return False

    def _step_section(self, out, final) -> bool:
        body = self._buf.lstrip()
        self._raw += self._buf[:len(self._buf) - len(body)]
        self._buf = body
        if body.startswith(CALL_BEGIN):
            self._raw, self._buf = self._raw + CALL_BEGIN, body[len(CALL_BEGIN):]
            self._state = self._HEADER
            return True
        if body.startswith(SECTION_END) and self._section_calls:
            self._raw, self._buf = "", body[len(SECTION_END):]
            self._state = self._TEXT
            return True
        if body and not final and not body.startswith(SECTION_END) and any(
                m.startswith(body) for m in (CALL_BEGIN, SECTION_END)):
            return False  # a marker still arriving
        if body:
            self._malformed(out)
        return False

    def _step_header(self, out, final) -> bool:
        at = self._buf.find(ARGUMENT_BEGIN)
        header = self._buf if at < 0 else self._buf[:at]
        if MARKER_START in header:
            bad = at >= 0 or not ARGUMENT_BEGIN.startswith(header[header.find(MARKER_START):])
        else:
            bad = len(header) > MAX_HEADER_CHARS
        parsed = parse_header(header) if at >= 0 and not bad else None
        if bad or (at >= 0 and parsed is None):
            self._malformed(out)
            return False
        if at < 0:
            return False  # header still arriving
        call_id, name = parsed
        index = len(self.tool_calls)
        self.tool_calls.append(ToolCall(call_id, name, ""))
        self._section_calls += 1
        out.append({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                    "function": {"name": name, "arguments": ""}}]})
        self._raw, self._buf, self._args_sent = "", self._buf[at + len(ARGUMENT_BEGIN):], ""
        self._state = self._ARGS
        return True

    def _step_args(self, out, final) -> bool:
        end = self._buf.find(CALL_END)
        stray = min((i for i in (self._buf.find(m) for m in MARKERS if m != CALL_END) if i >= 0), default=-1)
        if stray >= 0 and (end < 0 or stray < end):
            self._send_args(self._buf[:stray], out)
            self._buf = self._buf[stray:]
            self.complete = False
            self._state = self._RAW
            return True
        if end >= 0:
            self._send_args(self._buf[:end].rstrip(), out)
            self._buf = self._buf[end + len(CALL_END):]
            self._state = self._SECTION
            return True
        hold = _held_suffix(self._buf, MARKERS)
        ready = self._buf[:len(self._buf) - hold]
        sendable = ready.rstrip()  # trailing whitespace is sent only if more arguments follow it
        self._send_args(sendable, out)
        self._buf = self._buf[len(sendable):]
        return False

    # ---- emitting ----
    def _malformed(self, out: list[dict[str, Any]]) -> None:
        self._send_content(self._raw + self._buf, out)
        self._raw = self._buf = ""
        self._state = self._RAW

    def _send_content(self, text: str, out: list[dict[str, Any]]) -> None:
        if text:
            self.content += text
            out.append({"content": text})

    def _send_args(self, text: str, out: list[dict[str, Any]]) -> None:
        if not self._args_sent:
            text = text.lstrip()
        if not text:
            return
        self._args_sent += text
        index = len(self.tool_calls) - 1
        call = self.tool_calls[index]
        self.tool_calls[index] = dataclasses.replace(call, arguments=call.arguments + text)
        out.append({"tool_calls": [{"index": index, "function": {"arguments": text}}]})


def _merge(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Join neighbouring content deltas and neighbouring argument pieces of one call."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        prev = out[-1] if out else None
        if prev and "content" in d and "content" in prev:
            out[-1] = {"content": prev["content"] + d["content"]}
        elif (prev and "tool_calls" in d and "tool_calls" in prev and "id" not in d["tool_calls"][0]
              and "id" not in prev["tool_calls"][0] and prev["tool_calls"][0]["index"] == d["tool_calls"][0]["index"]):
            p, q = prev["tool_calls"][0], d["tool_calls"][0]
            out[-1] = {"tool_calls": [{**p, "function": {**p["function"],
                                                         "arguments": p["function"]["arguments"]
                                                         + q["function"]["arguments"]}}]}
        else:
            out.append(d)
    return out
