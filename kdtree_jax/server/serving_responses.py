"""POST /v1/responses: OpenAI's Responses API over the chat path. The request is read into a chat request (input
items -> messages, `instructions` -> a system message, flattened function tools -> chat tools, `text.format` ->
response_format, `max_output_tokens` -> max_completion_tokens), rendered, constrained and parsed as a chat is; its
result comes back as a `response` object whose `output` holds a reasoning item, a message (`output_text`) and
`function_call` items, or streamed as the Responses API's events (response.created, output_item.added/done,
content_part.added/done, output_text.delta/done, function_call_arguments.delta/done, response.completed, or
response.incomplete where max_output_tokens cut it off), each with its sequence_number.

Earlier turns come back as input items: an assistant message and the `function_call` items after it are one
assistant turn with its tool calls, a `function_call_output` a tool turn answering `call_id`, and a `reasoning` item
the next assistant turn's reasoning. Nothing is stored: a request stands alone (previous_response_id is refused).
"""
from __future__ import annotations

import bisect
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.sse import format_sse_event
from pydantic import ValidationError

from kdtree_jax.server.chat_output import ChatOutputParser
from kdtree_jax.server.protocol import ApiError, ChatCompletionRequest, ResponsesRequest, param_path
from kdtree_jax.server.reasoning import REASONING_FIELD, THINK_END
from kdtree_jax.server.serving_chat import ServingChat
from kdtree_jax.server.serving_common import Choices, Endpoint, Job, OpenAIServer
from kdtree_jax.server.tool_calls import SECTION_BEGIN

RESPONSES = Endpoint("input", None, "resp_")
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")  # content parts read as text
# a chat request's field -> the Responses field it came from (for the 400s the chat path raises)
CHAT_FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


class ServingResponses:
    """The Responses endpoint over the chat endpoint's rendering and the shared per-request code of `server`."""

    def __init__(self, server: OpenAIServer, chat: ServingChat):
        self.server, self.chat = server, chat

    async def start(self, body: ResponsesRequest, arrival: float) -> Choices:
        server = self.server
        server.check_model(body.model)
        chat = chat_request(body)
        try:
            ids, plan = await self.chat.prompt(chat)
            await server.check_constraint(plan.constraint, plan.constraint_field)
            return await server.start([(ids, "input")], chat, RESPONSES, arrival, plan)
        except ApiError as e:
            raise _renamed(e) from None

    # ---- whole ------------------------------------------------------------------------------------------------
    def response(self, choices: Choices, texts: list[str], body: ResponsesRequest) -> dict:
        job, (text,) = choices.first, texts
        parser = _parser(job)
        parser.feed(text)
        parser.finish()
        message = parser.message()
        finish = parser.finish_reason(job.finish_reason)
        cut = finish == "length"
        output = []
        if message.get(REASONING_FIELD):
            output.append(_reasoning_item(_id("rs"), message[REASONING_FIELD], "completed"))
        if message.get("content"):
            output.append(_message_item(_id("msg"), message["content"], "completed"))
        for call in message.get("tool_calls", []):
            fn = call["function"]
            output.append(_call_item(_id("fc"), call["id"], fn["name"], fn["arguments"], "completed"))
        if cut and output:  # the item the cut fell in, as the stream closes it
            output[-1]["status"] = "incomplete"
        usage = self._usage(choices, bool(message.get(REASONING_FIELD)))
        return self._response(choices, body, "incomplete" if cut else "completed", output, usage)

    # ---- streamed ---------------------------------------------------------------------------------------------
    async def events(self, choices: Choices, body: ResponsesRequest) -> AsyncIterator[bytes]:
        job = choices.first
        out = _EventWriter()
        yield out.event("response.created", response=self._response(choices, body, "in_progress", [], None))
        yield out.event("response.in_progress", response=self._response(choices, body, "in_progress", [], None))
        parser = _parser(job)
        async for piece, _ in job.pieces():
            for d in parser.feed(piece) if piece else []:
                for event in out.delta(d):
                    yield event
        for d in parser.finish():
            for event in out.delta(d):
                yield event
        if job.failed:
            error = job.error()["error"]
            failed = self._response(choices, body, "failed", out.items, None)
            failed["error"] = {"code": error.get("code") or "server_error", "message": error["message"]}
            yield out.event("response.failed", response=failed)
            return
        cut = parser.finish_reason(job.finish_reason) == "length"
        for event in out.close("incomplete" if cut else "completed"):
            yield event
        status = "incomplete" if cut else "completed"
        usage = self._usage(choices, any(item["type"] == "reasoning" for item in out.items))
        yield out.event(f"response.{status}", response=self._response(choices, body, status, out.items, usage))

    # ---- the response object ----------------------------------------------------------------------------------
    def _response(self, choices: Choices, body: ResponsesRequest, status: str, output: list[dict],
                  usage: dict | None) -> dict:
        fmt = body.text.get("format") if isinstance(body.text, dict) else None
        return {
            "id": choices.id, "object": "response", "created_at": choices.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "model": self.server.settings.model_name, "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls, "temperature": body.temperature, "top_p": body.top_p,
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto", "tools": body.tools or [],
            "text": {"format": fmt or {"type": "text"}}, "metadata": body.metadata or {}, "store": False,
            "background": False, "previous_response_id": None, "reasoning": None, "truncation": "disabled",
            "user": body.user,
        }

    def _usage(self, choices: Choices, reasoned: bool) -> dict:
        """OpenAI's usage fields; reasoning_tokens: the tokens up to the one that ended the reasoning (all of them
        where it never ended)."""
        usage, ids = choices.usage(), choices.first.text.token_ids
        reasoning = 0
        if reasoned:
            decode = self.server.tokenizer.decode
            reasoning = bisect.bisect_left(range(len(ids) + 1), True, key=lambda k: _ended(decode(ids[:k])))
            reasoning = min(reasoning, len(ids))
        return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                "total_tokens": usage["total_tokens"], "input_tokens_details": usage["prompt_tokens_details"],
                "output_tokens_details": {"reasoning_tokens": reasoning}}


# ---- request -> chat request -------------------------------------------------------------------------------------
def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses request stands for; ApiError (400) names the Responses field at fault."""
    chat: dict[str, Any] = {"messages": chat_messages(body.input, body.instructions),
                            "parallel_tool_calls": body.parallel_tool_calls, "top_p": body.top_p}
    if body.tools:
        chat["tools"] = chat_tools(body.tools)
    if body.tool_choice is not None:
        chat["tool_choice"] = chat_tool_choice(body.tool_choice)
    fmt = response_format(body.text)
    if fmt is not None:
        chat["response_format"] = fmt
    for field, value in (("max_completion_tokens", body.max_output_tokens), ("temperature", body.temperature),
                         ("user", body.user)):
        if value is not None:
            chat[field] = value
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:
        err = e.errors()[0]
        param = _responses_field(param_path(tuple(err["loc"])) or "input")
        raise ApiError(400, f"{param}: {err['msg']}", param=param) from None


def chat_messages(items: Any, instructions: str | None) -> list[dict]:
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("input", "must be a string or a non-empty list of input items")
    reasoning: str | None = None  # a reasoning item's text, for the next assistant turn
    for i, item in enumerate(items):
        field = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(field, "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise _bad(f"{field}.role", f"must be one of {MESSAGE_ROLES}, got {role!r}")
            msg = {"role": role, "content": _text(item.get("content"), f"{field}.content")}
            if role == "assistant" and reasoning is not None:
                msg[REASONING_FIELD], reasoning = reasoning, None
            messages.append(msg)
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", field), "type": "function",
                    "function": {"name": _str(item, "name", field), "arguments": _str(item, "arguments", field)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the calls after an assistant message are its own
                last.setdefault("tool_calls", []).append(call)
            else:
                msg = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    msg[REASONING_FIELD], reasoning = reasoning, None
                messages.append(msg)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _str(item, "call_id", field),
                             "content": _text(item.get("output"), f"{field}.output")})
        elif kind == "reasoning":
            parts = [p.get("text", "") for p in (item.get("content") or item.get("summary") or [])
                     if isinstance(p, dict)]
            reasoning = "".join(parts)
        else:
            raise _bad(f"{field}.type", f"{kind!r} is not supported by this server (message, function_call, "
                                        "function_call_output, reasoning)")
    return messages


def chat_tools(tools: list) -> list[dict]:
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise _bad(f"tools[{i}].type", f"only function tools are supported by this server, got {kind!r}")
        fn = {"name": _str(tool, "name", f"tools[{i}]")}
        for key in ("description", "parameters"):
            if tool.get(key) is not None:
                fn[key] = tool[key]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice", "must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\"}")


def response_format(text: Any) -> dict | None:
    """`text.format` as a chat response_format (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("text", "must be an object")
    if text.get("verbosity") is not None:
        raise _bad("text.verbosity", "not supported by this server")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
        raise _bad("text.format", "must be {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}")
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                   if k in fmt}}


def _text(content: Any, field: str) -> str:
    """A message's content (a string or text parts) as text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(field, "must be a string or a list of text parts")
    out = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise _bad(f"{field}[{k}]", f"only text parts are supported by this server ({', '.join(TEXT_PARTS)}), "
                                        f"got {kind!r}")
        out.append(part["text"])
    return "".join(out)


def _str(item: dict, key: str, field: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad(f"{field}.{key}", "must be a string")
    return value


def _bad(field: str, detail: str) -> ApiError:
    return ApiError(400, f"{field}: {detail}", param=field)


def _responses_field(chat_field: str) -> str:
    for chat, responses in CHAT_FIELDS.items():
        if chat_field == chat or chat_field.startswith(chat + ".") or chat_field.startswith(chat + "["):
            return responses if chat == "messages" else responses + chat_field[len(chat):]
    if chat_field.startswith("tools[") and ".function." in chat_field:
        return chat_field.replace(".function.", ".", 1)
    return chat_field


def _renamed(e: ApiError) -> ApiError:
    """A chat path's 400 with the Responses field named instead of the chat one."""
    if e.param is None:
        return e
    param = _responses_field(e.param)
    message = param + e.message[len(e.param):] if e.message.startswith(e.param) else e.message
    return ApiError(e.status, message, type=e.type, param=param, code=e.code, headers=e.headers)


# ---- output items and stream events -------------------------------------------------------------------------------
def _ended(text: str) -> bool:
    """Reasoning has ended in `text` (at `</think>`, or where a tool-call section begins)."""
    return THINK_END in text or SECTION_BEGIN in text


def _parser(job: Job) -> ChatOutputParser:
    return ChatOutputParser(reasoning=job.plan.reasoning, tools=job.plan.tools,
                            starts_in_reasoning=job.plan.starts_in_reasoning)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [_text_part(text)]}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class _EventWriter:
    """Chat deltas (reasoning_content, content, tool_calls) -> the Responses API's stream events: an output item
    opens when its kind of delta first comes and closes when another kind does or the response ends."""

    def __init__(self):
        self.sequence = 0
        self.items: list[dict] = []  # the output items so far, the open one last
        self._open: str | None = None  # the open item's kind: "reasoning", "message" or "function_call"

    def event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return format_sse_event(event=kind, data_str=json.dumps(data, ensure_ascii=False, separators=(",", ":")))

    def delta(self, d: dict) -> list[bytes]:
        out: list[bytes] = []
        if d.get(REASONING_FIELD):
            out += self._ensure("reasoning")
            out.append(self._text_delta("response.reasoning_text.delta", d[REASONING_FIELD]))
        if d.get("content"):
            out += self._ensure("message")
            out.append(self._text_delta("response.output_text.delta", d["content"]))
        for call in d.get("tool_calls") or []:
            fn = call.get("function") or {}
            if "id" in call:  # a new call
                out += self.close("completed")
                self.items.append(_call_item(_id("fc"), call["id"], fn.get("name", ""), "", "in_progress"))
                self._open = "function_call"
                out.append(self._added())
            if fn.get("arguments"):
                item = self.items[-1]
                item["arguments"] += fn["arguments"]
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=len(self.items) - 1, delta=fn["arguments"]))
        return out

    def close(self, status: str) -> list[bytes]:
        """Close the open item (`status`: "completed", or "incomplete" where the response was cut off)."""
        if self._open is None:
            return []
        item, index, kind = self.items[-1], len(self.items) - 1, self._open
        self._open = None
        item["status"] = status
        ref = {"item_id": item["id"], "output_index": index}
        if kind == "function_call":
            out = [self.event("response.function_call_arguments.done", **ref, name=item["name"],
                              arguments=item["arguments"])]
        else:
            part = item["content"][0]
            done = "response.output_text.done" if kind == "message" else "response.reasoning_text.done"
            extra = {"logprobs": []} if kind == "message" else {}
            out = [self.event(done, **ref, content_index=0, text=part["text"], **extra),
                   self.event("response.content_part.done", **ref, content_index=0, part=dict(part))]
        return [*out, self.event("response.output_item.done", output_index=index, item=_copy(item))]

    def _ensure(self, kind: str) -> list[bytes]:
        if self._open == kind:
            return []
        out = self.close("completed")
        item_id = _id("rs" if kind == "reasoning" else "msg")
        item = (_reasoning_item(item_id, "", "in_progress") if kind == "reasoning"
                else _message_item(item_id, "", "in_progress"))
        self.items.append(item)
        self._open = kind
        return [*out, self._added(), self.event("response.content_part.added", item_id=item_id,
                                                output_index=len(self.items) - 1, content_index=0,
                                                part=dict(item["content"][0]))]

    def _added(self) -> bytes:
        item = _copy(self.items[-1])
        if item["type"] != "function_call":
            item["content"] = []  # its part is added next
        return self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)

    def _text_delta(self, kind: str, text: str) -> bytes:
        item = self.items[-1]
        item["content"][0]["text"] += text
        extra = {"logprobs": []} if kind == "response.output_text.delta" else {}
        return self.event(kind, item_id=item["id"], output_index=len(self.items) - 1, content_index=0, delta=text,
                          **extra)


def _copy(item: dict) -> dict:
    return json.loads(json.dumps(item))
