"""What completions and chat completions share per request: the server's settings, the model check, tokenization,
the output constraint, the engine submission (sampling params, limits, stop strings), the request in flight (`Job`:
its text, finish and stop reasons, usage, errors) and the end of an SSE stream. The HTTP app (app.py) and the two
endpoints (serving_completion.py, serving_chat.py) build on it, so it imports neither.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from fastapi.sse import format_sse_event

from kdtree_jax.constrain import device as cd
from kdtree_jax.constrain.automaton import ConstraintCompiler, ConstraintSpec, ConstraintVocabulary
from kdtree_jax.server import constraints
from kdtree_jax.server.chat_output import ChatOutputParser
from kdtree_jax.server.logprobs import TokenTexts
from kdtree_jax.server.metrics import ServerMetrics
from kdtree_jax.server.protocol import DEFAULT_TEMPERATURE, ApiError, error_body
from kdtree_jax.server.reasoning import THINK_BEGIN, THINK_END
from kdtree_jax.server.text import TextStream
from kdtree_jax.server.tool_calls import MARKERS as TOOL_MARKERS
from kdtree_jax.serving import EngineClosedError, QueueFullError, RequestError, RequestParams, RequestStream
from kdtree_jax.serving.frontend import EngineDeadError, ServingFront

QUEUE_FULL_RETRY_AFTER_S = 1  # Retry-After of a 503 for a full queue
# the record's finish reason -> the response's (vLLM's names; "abort": cancelled by the server, e.g. at shutdown)
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort"}
SSE_DONE = format_sse_event(data_str="[DONE]")
ENGINE_DEAD = "engine_dead"  # the error code, and /health's status, once the engine has died
TOOL_CALL_PARSERS = ("kimi_k2",)  # --tool-call-parser choices
REASONING_PARSERS = ("kimi_k2",)  # --reasoning-parser choices


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """What differs between completions and chat completions."""

    prompt_field: str  # the field the prompt comes in
    default_limit: int | None  # max tokens when the request gives none (None: the rest of the context)
    id_prefix: str


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
    """How one request's output is constrained and, for a chat, read (a completion has a constraint at most)."""

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
        self.logprobs: list = []  # the entries (`TokenLogprob`) of `text.token_ids`, where the request asked
        self.prompt_logprobs: list | None = None  # one per prompt token (None first), where it asked
        self.hide_output = False  # max_tokens 0: the one token the engine drew is not part of the response

    async def pieces(self) -> AsyncIterator[tuple[str, list[int]]]:
        """(text, token ids) as they become final. A stop string cancels the request; the record is then awaited,
        so `record` is set when the iteration ends."""
        async for delta in self.stream:
            self._server.metrics.generation_tokens.inc(len(delta.token_ids))
            if self.text.stopped:
                continue  # cancelled: only its record is still to come
            before = len(self.text.token_ids)
            piece = self.text.feed(delta.token_ids)
            if delta.logprobs:
                self.logprobs += delta.logprobs[: len(self.text.token_ids) - before]
            if delta.prompt_logprobs is not None:
                self.prompt_logprobs = delta.prompt_logprobs
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
        n = 0 if self.hide_output else len(self.text.token_ids)
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
    """Turns OpenAI requests into serving-engine requests and their results back into OpenAI responses: the part
    both endpoints use, and the server's lifecycle (background tasks, drain at shutdown)."""

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
        self.token_texts = TokenTexts(tokenizer)
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

    def start(self, ids: list[int], body, endpoint: Endpoint, arrival: float, plan: ChatPlan = ChatPlan(), *,
              logprobs: tuple[int | None, int | None, str] = (None, None, "logprobs")) -> Job:
        """Submit to the engine; refusals raise ApiError before any response has started. `logprobs`: (top-k of the
        output's, of the prompt's, the request field that asked); max_tokens 0 submits one token and hides it."""
        limit, limit_field = body.token_limit
        self._check_length(len(ids), limit, limit_field, endpoint.prompt_field)
        rest = self.max_context - len(ids)
        max_new = limit if limit is not None else min(endpoint.default_limit or rest, rest)
        output_k, prompt_k, logprobs_field = logprobs
        params = RequestParams(
            max_new_tokens=max(max_new, 1),
            temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
            top_k=max(body.top_k, 0), top_p=body.top_p, seed=body.seed,
            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos, constraint=plan.constraint,
            logprobs=output_k, prompt_logprobs=prompt_k)
        fields = {"prompt": endpoint.prompt_field, "max_new_tokens": limit_field, "constraint": plan.constraint_field,
                  "logprobs": logprobs_field, "prompt_logprobs": logprobs_field}
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
        job.hide_output = max_new == 0
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

    async def stream_end(self, job: Job, body, last: dict, obj: str) -> AsyncIterator[bytes]:
        """The finish chunk (with the speculative statistics), the usage chunk if asked for, then [DONE]."""
        if job.failed:
            yield sse_event(job.error())
        else:
            last["choices"][0]["stop_reason"] = job.stop_reason
            yield sse_event({**last, **job.spec_decode()})
            if body.include_usage:
                yield sse_event({**self.head(job, obj), "choices": [], "usage": job.usage()})
        yield SSE_DONE


def sse_event(obj: dict) -> bytes:
    """One SSE `data:` event holding `obj` as compact JSON (non-ASCII text as is, as OpenAI sends it)."""
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
