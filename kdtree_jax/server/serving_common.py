"""What the endpoints share per request: the server's settings, the model check, tokenization, the output
constraint, the engine submission (sampling params, limits, stop strings), the requests in flight (`Job`: one
choice's text, finish and stop reasons, errors; `Choices`: the response's choices, its usage) and the SSE stream of
their chunks. The HTTP app (app.py) and the endpoints (serving_completion.py, serving_chat.py, serving_responses.py)
build on it, so it imports none of them.

A response has n choices per prompt (`n`, and a list of prompts on /v1/completions): choice i * n + j is sample j of
prompt i, a request of its own. Sample 0 of each prompt is submitted first and its siblings once it has prefilled,
so they find its full pages in the prefix cache instead of prefilling them again; with a `seed`, sample j draws from
`choice_seed(seed, j)` (sample 0 from the seed itself, as a request with n = 1), without one each draws its own.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator

import numpy as np
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
    """What differs between the endpoints."""

    prompt_field: str  # the field the prompt comes in
    default_limit: int | None  # max tokens when the request gives none (None: the rest of the context)
    id_prefix: str  # a response id is this and a random hex (OpenAI: "chatcmpl-", "cmpl-", "resp_")


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


def choice_seed(seed: int | None, j: int) -> int | None:
    """The seed of sample j of a prompt: the request's own for j = 0, one derived from (seed, j) for the others
    (numpy's SeedSequence: 32 bits, as the engine takes), None (each draws its own) without a seed."""
    if seed is None or j == 0 or seed < 0:
        return seed
    return int(np.random.SeedSequence([seed, j]).generate_state(1)[0])


class Job:
    """One choice in flight: its engine stream, its text as it becomes final, and how it ended."""

    def __init__(self, server: OpenAIServer, stream: RequestStream, text: TextStream, prompt_ids: list[int],
                 arrival: float, choices: Choices, index: int):
        self.id, self.created, self.plan = choices.id, choices.created, choices.plan
        self.index = index  # the choice's index in the response
        self.stream, self.text, self.prompt_ids, self.arrival = stream, text, prompt_ids, arrival
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
        """What stopped it (vLLM's field): the stop string, or the stop token id; None where max_tokens 0 hid the
        output."""
        if self.hide_output:
            return None
        if self.text.stopped:
            return self.text.stop_string
        ids = self.record.token_ids
        return ids[-1] if self.record.finish_reason == "stop" and ids else None

    @property
    def completion_tokens(self) -> int:
        """The completion's tokens in the response (none where max_tokens 0 hides the one the engine drew)."""
        return 0 if self.hide_output else len(self.text.token_ids)

    def spec_decode(self) -> dict:
        return _spec_decode(self._server, [self.record])

    def error(self) -> dict:
        code = ENGINE_DEAD if self._server.front.failure is not None else None
        return error_body(f"generation failed: {self.record.error or self.record.finish_reason}", "server_error",
                          code=code)

    @property
    def error_status(self) -> int:
        """500 for a request that failed; 503 once the engine has died (nothing can be served until a restart)."""
        return 503 if self._server.front.failure is not None else 500


class Choices:
    """A response's choices (`Job`s, in index order) under one id; usage counts each prompt once."""

    def __init__(self, id_prefix: str, n: int, plan: ChatPlan):
        self.id = f"{id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.n, self.plan = n, plan
        self.jobs: list[Job] = []

    @property
    def first(self) -> Job:
        return self.jobs[0]

    @property
    def failed(self) -> bool:
        return any(j.failed for j in self.jobs)

    def _failure(self) -> Job:
        return next(j for j in self.jobs if j.failed)

    def error(self) -> dict:
        return self._failure().error()

    @property
    def error_status(self) -> int:
        return self._failure().error_status

    def close(self) -> None:
        for j in self.jobs:
            j.close()

    def usage(self) -> dict:
        """Each prompt's tokens once (its samples share them), every choice's completion tokens; cached: what each
        prompt's first sample found in the prefix cache."""
        firsts = self.jobs[::self.n]
        prompt = sum(len(j.prompt_ids) for j in firsts)
        n = sum(j.completion_tokens for j in self.jobs)
        cached = sum(j.record.cached_tokens for j in firsts if j.record is not None)
        return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def spec_decode(self) -> dict:
        return _spec_decode(self.first._server, [j.record for j in self.jobs])


def _spec_decode(server: OpenAIServer, records: list) -> dict:
    """The requests' speculative statistics together, named as vLLM names them: under `spec_decode` where the
    server speculates, nothing where it decodes one token a step (mode ar), as vLLM without speculation."""
    if not server.speculates:
        return {}
    accepts = [a for r in records for a in r.accept_lengths]
    return {"spec_decode": {"num_spec_steps": len(accepts),
                            "num_draft_tokens": sum(r.num_draft_tokens for r in records),
                            "num_accepted_tokens": sum(r.num_accepted_tokens for r in records),
                            "mean_acceptance_length": float(np.mean(accepts)) if accepts else 0.0}}


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

    async def start(self, prompts: list[tuple[list[int], str]], body, endpoint: Endpoint, arrival: float,
                    plan: ChatPlan = ChatPlan(), *,
                    logprobs: tuple[int | None, int | None, str] = (None, None, "logprobs")) -> Choices:
        """Submit n samples of each (prompt ids, its field) to the engine; refusals raise ApiError before any
        response has started, and cancel what was submitted already. `logprobs`: (top-k of the output's, of the
        prompt's, the request field that asked), for every choice; max_tokens 0 submits one token and hides it."""
        n = getattr(body, "n", None) or 1
        total = len(prompts) * n
        limit, limit_field = body.token_limit
        for ids, field in prompts:
            self._check_length(len(ids), limit, limit_field, field)
        max_queue = self.front.config.max_queue
        if total > max_queue:
            field = "n" if len(prompts) == 1 else endpoint.prompt_field
            raise ApiError(400, f"{field}: {total} choices exceed the {max_queue} requests this server queues",
                           param=field)
        queued = self.front.n_waiting
        if queued + total > max_queue:
            raise _queue_full(f"{queued} requests are waiting and this one adds {total} (max_queue {max_queue})")
        choices = Choices(endpoint.id_prefix, n, plan)
        try:
            firsts = [self._submit(choices, ids, field, i * n, body, endpoint, arrival, body.seed, logprobs)
                      for i, (ids, field) in enumerate(prompts)]
            if n > 1:  # the siblings come once the first has prefilled: they share its pages
                await asyncio.gather(*(job.stream.first_output() for job in firsts))
                for i, (ids, field) in enumerate(prompts):
                    for j in range(1, n):
                        self._submit(choices, ids, field, i * n + j, body, endpoint, arrival,
                                     choice_seed(body.seed, j), logprobs)
        except BaseException:
            choices.close()
            raise
        choices.jobs.sort(key=lambda job: job.index)
        return choices

    def _submit(self, choices: Choices, ids: list[int], prompt_field: str, index: int, body, endpoint: Endpoint,
                arrival: float, seed: int | None, logprobs: tuple[int | None, int | None, str]) -> Job:
        """One choice to the engine; its Job joins `choices`."""
        plan = choices.plan
        limit, limit_field = body.token_limit
        rest = self.max_context - len(ids)
        max_new = limit if limit is not None else min(endpoint.default_limit or rest, rest)
        output_k, prompt_k, logprobs_field = logprobs
        params = RequestParams(
            max_new_tokens=max(max_new, 1),
            temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
            top_k=max(body.top_k, 0), top_p=body.top_p, seed=seed,
            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos, constraint=plan.constraint,
            logprobs=output_k, prompt_logprobs=prompt_k)
        fields = {"prompt": prompt_field, "max_new_tokens": limit_field, "constraint": plan.constraint_field,
                  "logprobs": logprobs_field, "prompt_logprobs": logprobs_field}
        try:
            stream = self.front.submit(ids, params)
        except RequestError as e:
            field = fields.get(e.field) or e.field
            raise ApiError(400, f"{field}: {str(e).split(': ', 1)[-1]}", param=field) from None
        except QueueFullError as e:
            raise _queue_full(str(e)) from None
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
        job = Job(self, stream, text, ids, arrival, choices, index)
        job.hide_output = max_new == 0
        choices.jobs.append(job)
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

    async def run_to_end(self, choices: Choices, request: Request) -> list[str]:
        """A non-streaming response: each choice's whole text. A client that goes away meanwhile cancels them."""
        async def text(job: Job) -> str:
            return "".join([piece async for piece, _ in job.pieces()])

        watcher = asyncio.ensure_future(_cancel_on_disconnect(request, choices))
        try:
            return list(await asyncio.gather(*(text(job) for job in choices.jobs)))
        finally:
            watcher.cancel()
            choices.close()

    # ---- responses ----------------------------------------------------------------------------------------
    def head(self, job: Job | Choices, obj: str) -> dict:
        return {"id": job.id, "object": obj, "created": job.created, "model": self.settings.model_name}

    @staticmethod
    def finished(job: Job, last: dict) -> dict | Job:
        """A choice's finish chunk, with its stop reason and speculative statistics; the job itself where it
        failed (the stream then ends with its error)."""
        if job.failed:
            return job
        last["choices"][0]["stop_reason"] = job.stop_reason
        return {**last, **job.spec_decode()}

    async def stream(self, choices: Choices, body, chunks, obj: str) -> AsyncIterator[bytes]:
        """SSE events: every choice's chunks (`chunks(job, body)`, ending with `finished`) as they come, the usage
        chunk if asked for, then [DONE]; a choice that failed ends the stream with its error."""
        async with contextlib.aclosing(merged([chunks(job, body) for job in choices.jobs])) as items:
            async for item in items:
                if isinstance(item, Job):
                    yield sse_event(item.error())
                    yield SSE_DONE
                    return
                yield sse_event(item)
        if body.include_usage:
            yield sse_event({**self.head(choices, obj), "choices": [], "usage": choices.usage()})
        yield SSE_DONE


def _queue_full(detail: str) -> ApiError:
    return ApiError(503, f"the server is overloaded: {detail}; retry later", type="server_error", code="queue_full",
                    headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)})


async def merged(iterators: list[AsyncIterator]) -> AsyncIterator:
    """The items of several async iterators, each in its own order, as they come; one iterator is read as is."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(it: AsyncIterator) -> None:
        try:
            async for item in it:
                await queue.put((item, None))
            await queue.put((end, None))
        except Exception as e:  # raised again in the reader
            await queue.put((end, e))

    tasks = [asyncio.ensure_future(pump(it)) for it in iterators]
    try:
        left = len(tasks)
        while left:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is end:
                left -= 1
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


def sse_event(obj: dict) -> bytes:
    """One SSE `data:` event holding `obj` as compact JSON (non-ASCII text as is, as OpenAI sends it)."""
    return format_sse_event(data_str=json.dumps(obj, ensure_ascii=False, separators=(",", ":")))


async def _cancel_on_disconnect(request: Request, choices: Choices) -> None:
    """Wait for the client to go away (the body is read already), then cancel its requests."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for job in choices.jobs:
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
