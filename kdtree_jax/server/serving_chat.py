"""POST /v1/chat/completions: messages and tools through the chat template to a request in flight, tool_choice and
response_format to its constraint, and its result as one `chat.completion` body or as SSE chunks, with tool calls
and reasoning parsed out where the request and the server's parsers ask for it. The HTTP app (app.py) picks which
and wraps it in the response."""
from __future__ import annotations

import re
from collections.abc import AsyncIterator

from fastapi.concurrency import run_in_threadpool
from jinja2.exceptions import TemplateError

from kdtree_jax.server import constraints
from kdtree_jax.server.chat_output import parse_chat_output
from kdtree_jax.server.logprobs import chat_content
from kdtree_jax.server.protocol import ApiError, ChatCompletionRequest
from kdtree_jax.server.reasoning import THINK_BEGIN
from kdtree_jax.server.serving_common import ChatPlan, Choices, Endpoint, Job, OpenAIServer

CHAT = Endpoint("messages", None, "chatcmpl-")
TOOL_CHOICES = ("none", "auto", "required")
# template variables the request's own fields set: chat_template_kwargs may not override them
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt")
CHAT_FIELD_RE = re.compile(r"^(messages|tools)(\[\d+\]|\.\w+)*")  # the field a ChatInputError starts with


class ServingChat:
    """The chat completions endpoint over the shared per-request code of `server`."""

    def __init__(self, server: OpenAIServer):
        self.server = server

    async def start(self, body: ChatCompletionRequest, arrival: float) -> Choices:
        """Check, render, tokenize and submit; refusals raise ApiError before any response has started."""
        server = self.server
        server.check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs true", param="top_logprobs")
        ids, plan = await self.prompt(body)
        await server.check_constraint(plan.constraint, plan.constraint_field)
        return await server.start([(ids, "messages")], body, CHAT, arrival, plan,
                                  logprobs=(self._top(body), None, "top_logprobs" if body.top_logprobs else "logprobs"))

    @staticmethod
    def _top(body: ChatCompletionRequest) -> int | None:
        """The alternatives per token asked for; None: no log-probabilities."""
        return (body.top_logprobs or 0) if body.logprobs else None

    def _logprobs(self, body: ChatCompletionRequest, entries) -> dict | None:
        k = self._top(body)
        return None if k is None else {"content": chat_content(self.server.token_texts, entries, k)}

    async def prompt(self, body: ChatCompletionRequest) -> tuple[list[int], ChatPlan]:
        """The rendered prompt's ids and how the output is constrained and read."""
        messages = [m.as_template_message() for m in body.messages]
        kwargs = dict(body.chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & set(RESERVED_TEMPLATE_KWARGS))
        if reserved:
            raise ApiError(400, f"chat_template_kwargs: {reserved[0]!r} is set by the request's own field",
                           param="chat_template_kwargs")
        if body.tools:
            kwargs["tools"] = body.tools
        try:
            text = await run_in_threadpool(self.server.tokenizer.apply_chat_template, messages, True, **kwargs)
        except TemplateError as e:
            m = CHAT_FIELD_RE.match(str(e))
            field = m.group(0) if m else ("chat_template_kwargs" if body.chat_template_kwargs else "messages")
            raise ApiError(400, f"the chat template refused the request: {e}", param=field) from None
        plan = self.plan(body, starts_in_reasoning=text.endswith(THINK_BEGIN))
        return await self.server.encode_text(text, "messages", special=True), plan

    def plan(self, body: ChatCompletionRequest, starts_in_reasoning: bool) -> ChatPlan:
        """tool_choice, response_format and structured_outputs -> the output's constraint and parsers; 400 names
        the field that is wrong."""
        settings = self.server.settings
        tools = constraints.declared_tools(body.tools or [])
        choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
        if isinstance(choice, str) and choice not in TOOL_CHOICES:
            raise ApiError(400, f"tool_choice: must be one of {TOOL_CHOICES} or a named function, got {choice!r}",
                           param="tool_choice")
        try:
            name = constraints.named_tool(choice)
        except ValueError as e:
            raise ApiError(400, f"tool_choice: {e}", param="tool_choice") from None
        forced = name is not None or choice == "required"
        if forced and not tools:
            raise ApiError(400, f"tool_choice: {choice!r} needs tools", param="tool_choice")
        if name is not None and name not in tools:
            raise ApiError(400, f"tool_choice: function {name!r} is not among the declared tools "
                                f"{sorted(tools)}", param="tool_choice")
        if choice == "auto" and tools and not settings.enable_auto_tool_choice:
            raise ApiError(400, 'tool_choice: "auto" needs the server started with --enable-auto-tool-choice and '
                                "--tool-call-parser", param="tool_choice")
        spec, field = self.server.output_constraint(body)
        if forced:
            if spec is not None:
                raise ApiError(400, f"{field}: cannot be combined with tool_choice {choice!r}", param=field)
            try:
                spec = constraints.tool_call_spec(tools, name, body.parallel_tool_calls)
            except ValueError as e:
                tool = str(e).split(":", 1)[0]
                k = list(tools).index(tool)
                field = f"tools[{k}].function.parameters"
                raise ApiError(400, f"{field}: {str(e).split(': ', 1)[-1]}", param=field) from None
            field = "tool_choice"
        if spec is not None and starts_in_reasoning:
            spec = constraints.after_reasoning(spec, self.server.tokenizer.special_tokens)
        return ChatPlan(spec, field, tools=bool(tools) and (forced or choice == "auto"),
                        reasoning=settings.reasoning_parser is not None, starts_in_reasoning=starts_in_reasoning)

    def message(self, job: Job, text: str) -> tuple[dict, str]:
        """A whole choice's assistant message and finish reason, its tool calls and reasoning parsed out."""
        p = job.plan
        if p.parses:
            return parse_chat_output(text, job.finish_reason, reasoning=p.reasoning, tools=p.tools,
                                     starts_in_reasoning=p.starts_in_reasoning)
        return {"role": "assistant", "content": text}, job.finish_reason

    def response(self, choices: Choices, texts: list[str], body: ChatCompletionRequest) -> dict:
        out = []
        for job, text in zip(choices.jobs, texts):
            message, finish = self.message(job, text)
            choice = {"index": job.index, "message": message,
                      "logprobs": self._logprobs(body, job.logprobs), "finish_reason": finish,
                      "stop_reason": job.stop_reason}
            if body.return_token_ids:
                choice["token_ids"] = job.text.token_ids
            out.append(choice)
        response = {**self.server.head(choices, "chat.completion"), "choices": out, "usage": choices.usage(),
                    **choices.spec_decode()}
        if body.return_token_ids:
            response["prompt_token_ids"] = choices.first.prompt_ids
        return response

    def events(self, choices: Choices, body: ChatCompletionRequest) -> AsyncIterator[bytes]:
        return self.server.stream(choices, body, self.chunks, "chat.completion.chunk")

    async def chunks(self, job: Job, body: ChatCompletionRequest) -> AsyncIterator[dict | Job]:
        """One choice's chunks: the role, its deltas (reasoning, content, tool calls), its finish chunk."""
        sent = 0  # tokens whose entries went out
        asked = self._top(body) is not None

        def chunk(delta: dict, ids: list[int], finish: str | None = None) -> dict:
            nonlocal sent
            entries, sent = job.logprobs[sent: sent + len(ids)], sent + len(ids)
            choice = {"index": job.index, "delta": delta, "logprobs": self._logprobs(body, entries) if ids else None,
                      "finish_reason": finish}
            if body.return_token_ids:
                choice["token_ids"] = ids
            return {**self.server.head(job, "chat.completion.chunk"), "choices": [choice]}

        yield chunk({"role": "assistant", "content": ""}, [])
        parser = job.plan.parser() if job.plan.parses else None
        async for piece, ids in job.pieces():
            if parser is None:
                if piece or (ids and (body.return_token_ids or asked)):
                    yield chunk({"content": piece}, ids)
                continue
            deltas = parser.feed(piece) if piece else []
            if not deltas and ids and (body.return_token_ids or asked):
                deltas = [{}]
            for i, d in enumerate(deltas):
                yield chunk(d, ids if i == 0 else [])
        finish = job.finish_reason
        if parser is not None:
            for d in parser.finish():
                yield chunk(d, [])
            finish = parser.finish_reason(finish)
        yield self.server.finished(job, chunk({}, [], finish))
