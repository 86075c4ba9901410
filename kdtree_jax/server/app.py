"""The OpenAI-compatible HTTP app (FastAPI) over a serving front (`ServingFront`: the engine in a thread of this
process, or in its own process).

POST /v1/completions and /v1/chat/completions (stream false or true: SSE chunks as OpenAI sends them, ending with
`data: [DONE]`), GET /v1/models, /health and /metrics (Prometheus text). Every error is OpenAI's error JSON with
the status it calls for: 400 naming the field, 401 without the API key (where one is set: /v1/* only), 404 for an
unknown model or path, 503 while the queue is full, the server is shutting down or the engine has died (then
/health is 503 too, saying why, and requests in flight end with that error). A request whose client goes away is
cancelled at once, which frees its slot.

Kimi's agent API on /v1/chat/completions, as vLLM serves it with `--tool-call-parser kimi_k2 --reasoning-parser
kimi_k2`: `tools` reach the chat template; with tool_choice "auto" (needs --enable-auto-tool-choice) the output is
parsed into OpenAI `tool_calls` (finish_reason "tool_calls"), streamed as OpenAI streams them; "required" or a named
function constrains the output to a tool-call section whose arguments follow the tool's parameter schema; "none"
leaves the output as text. The reasoning parser moves `<think>` text to `reasoning_content` (its own stream deltas).
`response_format` (json_object, json_schema) and vLLM's `structured_outputs` constrain completions and chats; a
constraint is compiled before the request is queued, so one that cannot be compiled is a 400 naming its field.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from jinja2.exceptions import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kdtree_jax.constrain import device as cd
from kdtree_jax.constrain.automaton import ConstraintCompiler, ConstraintSpec, ConstraintVocabulary
from kdtree_jax.server import constraints
from kdtree_jax.server.chat_output import ChatOutputParser, parse_chat_output
from kdtree_jax.server.metrics import CONTENT_TYPE, ServerMetrics
from kdtree_jax.server.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    param_path,
)
from kdtree_jax.server.reasoning import THINK_BEGIN, THINK_END
from kdtree_jax.server.text import TextStream
from kdtree_jax.server.tool_calls import MARKERS as TOOL_MARKERS
from kdtree_jax.serving import EngineClosedError, QueueFullError, RequestError, RequestParams, RequestStream
from kdtree_jax.serving.frontend import EngineDeadError, ServingFront

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20  # a larger request body is refused with 413 before it is read
QUEUE_FULL_RETRY_AFTER_S = 1  # Retry-After of a 503 for a full queue
# the record's finish reason -> the response's (vLLM's names; "abort": cancelled by the server, e.g. at shutdown)
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort"}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of the stream
SSE_DONE = format_sse_event(data_str="[DONE]")
ENGINE_DEAD = "engine_dead"  # the error code, and /health's status, once the engine has died
TOOL_CALL_PARSERS = ("kimi_k2",)  # --tool-call-parser choices
REASONING_PARSERS = ("kimi_k2",)  # --reasoning-parser choices
TOOL_CHOICES = ("none", "auto", "required")
# template variables the request's own fields set: chat_template_kwargs may not override them
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt")
CHAT_FIELD_RE = re.compile(r"^(messages|tools)(\[\d+\]|\.\w+)*")  # the field a ChatInputError starts with


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """What differs between completions and chat completions."""

    prompt_field: str  # the field the prompt comes in
    default_limit: int | None  # max tokens when the request gives none (None: the rest of the context)
    id_prefix: str


COMPLETIONS = Endpoint("prompt", DEFAULT_COMPLETION_MAX_TOKENS, "cmpl")
CHAT = Endpoint("messages", None, "chatcmpl")


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    model_names: tuple[str, ...]  # names a request's "model" may give; responses name the first
    shutdown_timeout: float = 10.0  # seconds running requests get to finish at shutdown before they are cancelled
    root: str | None = None  # the checkpoint served, as /v1/models shows it
    api_key: str | None = None  # set: every /v1/* request must carry `Authorization: Bearer <api_key>`
    enable_auto_tool_choice: bool = False  # tool_choice "auto" allowed (the model decides whether to call)
    tool_call_parser: str | None = None  # "kimi_k2": tool-call sections -> OpenAI tool_calls
    reasoning_parser: str | None = None  # "kimi_k2": <think> text -> reasoning_content

    def __post_init__(self):
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")

    @property
    def model_name(self) -> str:
        return self.model_names[0]


@dataclasses.dataclass(frozen=True)
class ChatPlan:
    """How one chat request's output is constrained and read."""

    constraint: ConstraintSpec | None = None
    constraint_field: str | None = None  # the request field the constraint came from
    tools: bool = False  # parse tool-call sections into tool_calls
    reasoning: bool = False  # parse <think> into reasoning_content
    starts_in_reasoning: bool = False  # the prompt ends inside <think>

    @property
    def parses(self) -> bool:
        return self.tools or self.reasoning

    def parser(self) -> ChatOutputParser:
        return ChatOutputParser(reasoning=self.reasoning, tools=self.tools,
                                starts_in_reasoning=self.starts_in_reasoning)


class Job:
    """One request in flight: its engine stream, its text as it becomes final, and how it ended."""

    def __init__(self, server: OpenAIServer, stream: RequestStream, text: TextStream, prompt_ids: list[int],
                 arrival: float, id_prefix: str):
        self.id = f"{id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.stream, self.text, self.prompt_ids, self.arrival = stream, text, prompt_ids, arrival
        self.plan = ChatPlan()  # a chat request's output parsing (none for completions)
        self._server = server
        self.record = None  # the engine's RequestRecord once the request ended
        self._closed = False

    async def pieces(self) -> AsyncIterator[tuple[str, list[int]]]:
        """(text, token ids) as they become final. A stop string cancels the request; the record is then awaited,
        so `record` is set when the iteration ends."""
        async for delta in self.stream:
            self._server.metrics.generation_tokens.inc(len(delta.token_ids))
            if self.text.stopped:
                continue  # cancelled: only its record is still to come
            before = len(self.text.token_ids)
            piece = self.text.feed(delta.token_ids)
            if self.text.stopped:
                self.stream.cancel()
            yield piece, self.text.token_ids[before:]
        yield self.text.finish(), []
        self._finished(self.stream.record)

    def close(self) -> None:
        """Called however the response ended; a request still running (client gone, server cancelled the
        handler) is cancelled, which frees its slot before the next step. Call when nothing iterates `pieces`."""
        if self.record is None and not self._closed:
            self.stream.cancel()
            self._server.background(self._finish_abandoned())
        self._closed = True

    async def _finish_abandoned(self) -> None:
        async for delta in self.stream:
            self._server.metrics.generation_tokens.inc(len(delta.token_ids))
        self._finished(self.stream.record)

    def _finished(self, record) -> None:
        if self.record is None:
            self.record = record
            self._server.metrics.finished(record, self.arrival, self.finish_reason)

    @property
    def finish_reason(self) -> str:
        if self.text.stopped:
            return "stop"
        return FINISH_REASONS.get(self.record.finish_reason, "error")

    @property
    def failed(self) -> bool:
        return self.finish_reason == "error"

    @property
    def stop_reason(self) -> str | int | None:
        """What stopped it (vLLM's field): the stop string, or the stop token id."""
        if self.text.stopped:
            return self.text.stop_string
        ids = self.record.token_ids
        return ids[-1] if self.record.finish_reason == "stop" and ids else None

    def usage(self) -> dict:
        n = len(self.text.token_ids)
        cached = self.record.cached_tokens if self.record is not None else 0
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": n,
                "total_tokens": len(self.prompt_ids) + n, "prompt_tokens_details": {"cached_tokens": cached}}

    def spec_decode(self) -> dict:
        """The request's speculative statistics, named as vLLM names them: under `spec_decode` where the server
        speculates, nothing where it decodes one token a step (mode ar), as vLLM without speculation."""
        if not self._server.speculates:
            return {}
        r = self.record
        return {"spec_decode": {"num_spec_steps": r.rounds, "num_draft_tokens": r.num_draft_tokens,
                                "num_accepted_tokens": r.num_accepted_tokens,
                                "mean_acceptance_length": r.mean_acceptance_length}}

    def error(self) -> dict:
        code = ENGINE_DEAD if self._server.front.failure is not None else None
        return error_body(f"generation failed: {self.record.error or self.record.finish_reason}", "server_error",
                          code=code)

    @property
    def error_status(self) -> int:
        """500 for a request that failed; 503 once the engine has died (nothing can be served until a restart)."""
        return 503 if self._server.front.failure is not None else 500


class OpenAIServer:
    """Turns OpenAI requests into serving-engine requests and their results back into OpenAI responses."""

    def __init__(self, front: ServingFront, tokenizer, settings: ServerSettings):
        if tokenizer is None:
            raise ValueError("the OpenAI server needs the checkpoint's tokenizer")
        self.front, self.tokenizer, self.settings = front, tokenizer, settings
        self.max_context = front.config.max_context
        self.speculates = front.config.mode != "ar"  # whether rounds verify drafts (the figures then mean something)
        self.metrics = ServerMetrics(front, settings.model_name, speculative=self.speculates)
        self.hidden_ids = frozenset(tokenizer.special_tokens.values())
        specials = tokenizer.special_tokens
        self.tool_marker_ids = frozenset(specials[m] for m in TOOL_MARKERS if m in specials)
        self.think_ids = frozenset(specials[m] for m in (THINK_BEGIN, THINK_END) if m in specials)
        self.table_layout = cd.TableLayout(tokenizer.vocab_size, front.config.constraint_caps)
        self._compiler: ConstraintCompiler | None = None
        self._compiler_lock = threading.Lock()
        self.max_token_chars = _longest_token(tokenizer)
        self.closing = False
        self._tasks: set[asyncio.Task] = set()
        self._drain: asyncio.Task | None = None

    # ---- lifecycle ----------------------------------------------------------------------------------------
    async def drain(self) -> None:
        """Stop taking requests; running ones get `shutdown_timeout` seconds, then are cancelled (they end with
        finish_reason "abort"). Safe to call more than once."""
        self.closing = True
        if self._drain is None:
            self._drain = asyncio.ensure_future(self.front.shutdown(timeout=self.settings.shutdown_timeout))
        await asyncio.shield(self._drain)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- requests -----------------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.settings.model_names:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves "
                                f"{', '.join(map(repr, self.settings.model_names))}.",
                           param="model", code="model_not_found")

    async def encode_text(self, text: str, field: str, *, special: bool) -> list[int]:
        """Token ids of a text prompt, tokenized off the event loop. A text that is surely over max_context is
        refused before it is tokenized."""
        if len(text) > self.max_context * self.max_token_chars:
            raise ApiError(400, f"the prompt has {len(text)} characters, more than this model's maximum context "
                                f"length of {self.max_context} tokens can hold", param=field,
                           code="context_length_exceeded")
        return await run_in_threadpool(self.tokenizer.encode, text, special)

    async def chat_prompt(self, body: ChatCompletionRequest) -> tuple[list[int], ChatPlan]:
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
            text = await run_in_threadpool(self.tokenizer.apply_chat_template, messages, True, **kwargs)
        except TemplateError as e:
            m = CHAT_FIELD_RE.match(str(e))
            field = m.group(0) if m else ("chat_template_kwargs" if body.chat_template_kwargs else "messages")
            raise ApiError(400, f"the chat template refused the request: {e}", param=field) from None
        plan = self.chat_plan(body, starts_in_reasoning=text.endswith(THINK_BEGIN))
        return await self.encode_text(text, "messages", special=True), plan

    def chat_plan(self, body: ChatCompletionRequest, starts_in_reasoning: bool) -> ChatPlan:
        """tool_choice, response_format and structured_outputs -> the output's constraint and parsers; 400 names
        the field that is wrong."""
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
        if choice == "auto" and tools and not self.settings.enable_auto_tool_choice:
            raise ApiError(400, 'tool_choice: "auto" needs the server started with --enable-auto-tool-choice and '
                                "--tool-call-parser", param="tool_choice")
        spec, field = self.output_constraint(body)
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
            spec = constraints.after_reasoning(spec, self.tokenizer.special_tokens)
        return ChatPlan(spec, field, tools=bool(tools) and (forced or choice == "auto"),
                        reasoning=self.settings.reasoning_parser is not None, starts_in_reasoning=starts_in_reasoning)

    @staticmethod
    def output_constraint(body) -> tuple[ConstraintSpec | None, str | None]:
        """`response_format` or `structured_outputs` (not both) -> (spec, field)."""
        given = [f for f in ("response_format", "structured_outputs") if getattr(body, f) is not None]
        if len(given) > 1:
            raise ApiError(400, "structured_outputs: cannot be combined with response_format",
                           param="structured_outputs")
        read = {"response_format": constraints.response_format_spec,
                "structured_outputs": constraints.structured_outputs_spec}
        for field in given:
            try:
                spec = read[field](getattr(body, field))
            except ValueError as e:
                raise ApiError(400, f"{field}.{e}", param=field) from None
            return spec, field
        return None, None

    def compiler(self) -> ConstraintCompiler:
        """The engine's own compiler where it runs in this process (one cache), else one over the tokenizer."""
        with self._compiler_lock:
            if self._compiler is None:
                core = getattr(self.front, "core", None)
                self._compiler = (core.engine.constraint_compiler() if core is not None
                                  else ConstraintCompiler(ConstraintVocabulary.from_tokenizer(self.tokenizer)))
            return self._compiler

    async def check_constraint(self, spec: ConstraintSpec | None, field: str | None) -> None:
        """Compile the constraint off the event loop (the engine's compile is then a cache hit where it shares
        the compiler); 400 naming `field` where it does not compile or can never fit the device tables."""
        if spec is None:
            return
        try:
            automaton = await run_in_threadpool(lambda: self.compiler().compile(spec))
        except ValueError as e:
            raise ApiError(400, f"{field}: {e}", param=field) from None
        problem = self.table_layout.fits_alone(automaton)
        if problem is not None:
            raise ApiError(400, f"{field}: {problem}", param=field)

    def start(self, ids: list[int], body, endpoint: Endpoint, arrival: float, plan: ChatPlan = ChatPlan()) -> Job:
        """Submit to the engine; refusals raise ApiError before any response has started."""
        limit, limit_field = body.token_limit
        self._check_length(len(ids), limit, limit_field, endpoint.prompt_field)
        rest = self.max_context - len(ids)
        max_new = limit if limit is not None else min(endpoint.default_limit or rest, rest)
        params = RequestParams(
            max_new_tokens=max_new, temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
            top_k=max(body.top_k, 0), top_p=body.top_p, seed=body.seed,
            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos, constraint=plan.constraint)
        fields = {"prompt": endpoint.prompt_field, "max_new_tokens": limit_field, "constraint": plan.constraint_field}
        try:
            stream = self.front.submit(ids, params)
        except RequestError as e:
            field = fields.get(e.field) or e.field
            raise ApiError(400, f"{field}: {str(e).split(': ', 1)[-1]}", param=field) from None
        except QueueFullError as e:
            raise ApiError(503, f"the server is overloaded: {e}; retry later", type="server_error",
                           code="queue_full", headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)}) from None
        except EngineDeadError as e:
            raise ApiError(503, str(e), type="server_error", code=ENGINE_DEAD) from None
        except EngineClosedError:
            raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down") from None
        self.metrics.prompt_tokens.inc(len(ids))
        hidden = self.hidden_ids
        if plan.tools:  # the parser reads the section's markers
            hidden = hidden - self.tool_marker_ids
        if plan.reasoning:
            hidden = hidden - self.think_ids
        text = TextStream(self.tokenizer, body.stop or (), hidden)
        job = Job(self, stream, text, ids, arrival, endpoint.id_prefix)
        job.plan = plan
        return job

    def _check_length(self, n: int, limit: int | None, limit_field: str, prompt_field: str) -> None:
        if n >= self.max_context:
            raise ApiError(400, f"the prompt has {n} tokens; this model's maximum context length is "
                                f"{self.max_context} tokens (prompt + completion)", param=prompt_field,
                           code="context_length_exceeded")
        if limit is not None and n + limit > self.max_context:
            raise ApiError(400, f"{limit_field} {limit} plus the prompt's {n} tokens exceeds this model's maximum "
                                f"context length of {self.max_context} tokens", param=limit_field,
                           code="context_length_exceeded")

    async def run_to_end(self, job: Job, request: Request) -> str:
        """A non-streaming request: its whole text. A client that goes away meanwhile cancels it."""
        watcher = asyncio.ensure_future(_cancel_on_disconnect(request, job))
        try:
            return "".join([piece async for piece, _ in job.pieces()])
        finally:
            watcher.cancel()
            job.close()

    # ---- responses ----------------------------------------------------------------------------------------
    def head(self, job: Job, obj: str) -> dict:
        return {"id": job.id, "object": obj, "created": job.created, "model": self.settings.model_name}

    def completion(self, job: Job, text: str, body: CompletionRequest) -> dict:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": job.finish_reason,
                  "stop_reason": job.stop_reason}
        if body.return_token_ids:
            choice |= {"prompt_token_ids": job.prompt_ids, "token_ids": job.text.token_ids}
        return {**self.head(job, "text_completion"), "choices": [choice], "usage": job.usage(), **job.spec_decode()}

    def chat_completion(self, job: Job, text: str, body: ChatCompletionRequest) -> dict:
        message, finish = {"role": "assistant", "content": text}, job.finish_reason
        p = job.plan
        if p.parses:
            message, finish = parse_chat_output(text, finish, reasoning=p.reasoning, tools=p.tools,
                                                starts_in_reasoning=p.starts_in_reasoning)
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish,
                  "stop_reason": job.stop_reason}
        out = {**self.head(job, "chat.completion"), "choices": [choice], "usage": job.usage(), **job.spec_decode()}
        if body.return_token_ids:
            choice["token_ids"] = job.text.token_ids
            out["prompt_token_ids"] = job.prompt_ids
        return out

    async def completion_events(self, job: Job, body: CompletionRequest) -> AsyncIterator[bytes]:
        def chunk(text: str, ids: list[int], finish: str | None = None) -> dict:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            if body.return_token_ids:
                choice["token_ids"] = ids
            return {**self.head(job, "text_completion"), "choices": [choice]}

        async for piece, ids in job.pieces():
            if piece or (ids and body.return_token_ids):
                yield _sse(chunk(piece, ids))
        async for event in self._stream_end(job, body, chunk("", [], job.finish_reason), "text_completion"):
            yield event

    async def chat_events(self, job: Job, body: ChatCompletionRequest) -> AsyncIterator[bytes]:
        def chunk(delta: dict, ids: list[int], finish: str | None = None) -> dict:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            if body.return_token_ids:
                choice["token_ids"] = ids
            return {**self.head(job, "chat.completion.chunk"), "choices": [choice]}

        yield _sse(chunk({"role": "assistant", "content": ""}, []))
        parser = job.plan.parser() if job.plan.parses else None
        async for piece, ids in job.pieces():
            if parser is None:
                if piece or (ids and body.return_token_ids):
                    yield _sse(chunk({"content": piece}, ids))
                continue
            deltas = parser.feed(piece) if piece else []
            if not deltas and ids and body.return_token_ids:
                deltas = [{}]
            for i, d in enumerate(deltas):
                yield _sse(chunk(d, ids if i == 0 else []))
        finish = job.finish_reason
        if parser is not None:
            for d in parser.finish():
                yield _sse(chunk(d, []))
            finish = parser.finish_reason(finish)
        async for event in self._stream_end(job, body, chunk({}, [], finish), "chat.completion.chunk"):
            yield event

    async def _stream_end(self, job: Job, body, last: dict, obj: str) -> AsyncIterator[bytes]:
        """The finish chunk (with the speculative statistics), the usage chunk if asked for, then [DONE]."""
        if job.failed:
            yield _sse(job.error())
        else:
            last["choices"][0]["stop_reason"] = job.stop_reason
            yield _sse({**last, **job.spec_decode()})
            if body.include_usage:
                yield _sse({**self.head(job, obj), "choices": [], "usage": job.usage()})
        yield SSE_DONE

    def health(self) -> tuple[dict, int]:
        """(body, status): 200 while serving; 503 shutting down, or with the engine's death as `error`."""
        if self.front.failure is not None:
            return {"status": ENGINE_DEAD, "error": self.front.failure}, 503
        slots = self.front.config.max_slots
        stats = self.front.stats()
        body = {"status": "shutting_down" if self.closing else "ok", "running": stats.running,
                "waiting": self.front.n_waiting, "free_slots": slots - stats.running, "max_slots": slots,
                "free_pages": stats.free_pages, "num_pages": stats.num_pages, "page_size": stats.page_size}
        return body, 503 if self.closing else 200

    def models(self) -> dict:
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "kdtree-jax", "root": self.settings.root,
             "max_model_len": self.max_context} for name in self.settings.model_names]}


class ApiKeyMiddleware:
    """Refuses a /v1/* request without `Authorization: Bearer <key>` with 401 in OpenAI's error shape, as vLLM's
    --api-key does; /health and /metrics stay open for probes and scrapers. Plain ASGI: a request it passes reaches
    the app untouched (its streamed response, its client's disconnect)."""

    def __init__(self, app, key: str):
        self.app, self._expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            given = dict(scope["headers"]).get(b"authorization")
            if given is None or not secrets.compare_digest(given, self._expected):
                await _unauthorized(given is None)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _unauthorized(missing: bool) -> JSONResponse:
    """OpenAI's answers: a missing key, or an incorrect one (code invalid_api_key)."""
    if missing:
        body = error_body("You didn't provide an API key. You need to provide your API key in an Authorization "
                          "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).", "invalid_request_error")
    else:
        body = error_body("Incorrect API key provided.", "invalid_request_error", code="invalid_api_key")
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})


class JobEventStream(EventSourceResponse):
    """An SSE response whose request is cancelled however the response ends (done, client gone, shutdown)."""

    def __init__(self, job: Job, events: AsyncIterator[bytes]):
        super().__init__(events, headers=SSE_HEADERS)
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.close()


def build_app(front: ServingFront, tokenizer, settings: ServerSettings) -> FastAPI:
    """The ASGI app; its lifespan starts `front` (warmed up already) and drains it at shutdown."""
    server = OpenAIServer(front, tokenizer, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await front.start()
        yield
        await server.drain()

    app = FastAPI(title="kdtree-jax", lifespan=lifespan, max_body_size=MAX_BODY_BYTES)
    app.state.openai = server
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, key=settings.api_key)

    async def respond(job: Job, body, request: Request, events, complete):
        """SSE chunks as the job runs, or one JSON body once it has ended."""
        if body.stream:
            return JobEventStream(job, events(job, body))
        text = await server.run_to_end(job, request)
        if job.failed:
            return JSONResponse(job.error(), status_code=job.error_status)
        return JSONResponse(complete(job, text, body))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        arrival = time.perf_counter()
        server.check_model(body.model)
        prompt = body.prompt if body.prompt is not None else ""
        ids = list(prompt) if isinstance(prompt, list) else await server.encode_text(prompt, "prompt", special=True)
        spec, field = server.output_constraint(body)
        await server.check_constraint(spec, field)
        job = server.start(ids, body, COMPLETIONS, arrival, ChatPlan(spec, field))
        return await respond(job, body, request, server.completion_events, server.completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        arrival = time.perf_counter()
        server.check_model(body.model)
        ids, plan = await server.chat_prompt(body)
        await server.check_constraint(plan.constraint, plan.constraint_field)
        job = server.start(ids, body, CHAT, arrival, plan)
        return await respond(job, body, request, server.chat_events, server.chat_completion)

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/health")
    async def health():
        body, status = server.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    return app


# ---- helpers ---------------------------------------------------------------------------------------------------
def _sse(obj: dict) -> bytes:
    return format_sse_event(data_str=json.dumps(obj, ensure_ascii=False, separators=(",", ":")))


async def _cancel_on_disconnect(request: Request, job: Job) -> None:
    """Wait for the client to go away (the body is read already), then cancel its request."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.stream.cancel()


def _longest_token(tokenizer) -> int:
    """The most characters one token decodes to: a text longer than max_context times this is surely too long."""
    longest = 1
    for i in range(tokenizer.vocab_size):
        try:
            longest = max(longest, len(tokenizer.token_bytes(i)))
        except ValueError:  # an id a sparse vocabulary leaves out
            continue
    return longest


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """pydantic's errors as OpenAI's 400 (not FastAPI's 422), naming the first bad field."""
    err = exc.errors()[0]
    ctx = err.get("ctx") or {}
    loc = tuple(err.get("loc", ()))
    if err.get("type") == "json_invalid":
        message, param = f"the body is not valid JSON: {ctx.get('error', err.get('msg'))}", None
    elif loc == ("body",):
        message, param = "the body must be a JSON object (Content-Type: application/json)", None
    else:
        param = param_path(loc)
        detail = str(ctx["error"]) if err.get("type") == "value_error" and "error" in ctx else err.get("msg")
        message = f"{param}: {detail}" if param else str(detail)
    return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error in %s %s", request.method, request.url.path)
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)
