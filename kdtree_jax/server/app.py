"""The OpenAI-compatible HTTP app (FastAPI) over a serving front (`ServingFront`: the engine in a thread of this
process, or in its own process).

POST /v1/completions and /v1/chat/completions (stream false or true: SSE chunks as OpenAI sends them, ending with
`data: [DONE]`), POST /v1/responses (OpenAI's Responses API over the chat path; streamed as its events), GET
/v1/models, /health and /metrics (Prometheus text). Every error is OpenAI's error JSON with
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

This module is the HTTP layer (routes, API key, error handlers, lifespan, the response types); what each endpoint
does is in serving_completion.py and serving_chat.py, over serving_common.py.
"""
from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kdtree_jax.server.metrics import CONTENT_TYPE
from kdtree_jax.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
    error_body,
    param_path,
)
from kdtree_jax.server.serving_chat import ServingChat
from kdtree_jax.server.serving_common import ENGINE_DEAD, Choices, OpenAIServer, ServerSettings
from kdtree_jax.server.serving_completion import ServingCompletion
from kdtree_jax.server.serving_responses import ServingResponses
from kdtree_jax.serving.frontend import ServingFront

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20  # a larger request body is refused with 413 before it is read
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of the stream


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
    """An SSE response whose requests are cancelled however the response ends (done, client gone, shutdown)."""

    def __init__(self, choices: Choices, events: AsyncIterator[bytes]):
        super().__init__(events, headers=SSE_HEADERS)
        self.choices = choices

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.choices.close()



def build_app(front: ServingFront, tokenizer, settings: ServerSettings) -> FastAPI:
    """The ASGI app; its lifespan starts `front` (warmed up already) and drains it at shutdown."""
    server = OpenAIServer(front, tokenizer, settings)
    completion, chat = ServingCompletion(server), ServingChat(server)
    responses = ServingResponses(server, chat)

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

    async def respond(choices: Choices, body, request: Request, events, complete):
        """SSE chunks as the choices run, or one JSON body once they have ended."""
        if body.stream:
            return JobEventStream(choices, events(choices, body))
        texts = await server.run_to_end(choices, request)
        if choices.failed:
            return JSONResponse(choices.error(), status_code=choices.error_status)
        return JSONResponse(complete(choices, texts, body))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        job = await completion.start(body, time.perf_counter())
        return await respond(job, body, request, completion.events, completion.response)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        job = await chat.start(body, time.perf_counter())
        return await respond(job, body, request, chat.events, chat.response)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        choices = await responses.start(body, time.perf_counter())
        return await respond(choices, body, request, responses.events, responses.response)

    @app.get("/v1/models")
    async def models():
        return _models(server)

    @app.get("/health")
    async def health():
        body, status = _health(server)
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    return app


# ---- helpers ---------------------------------------------------------------------------------------------------
def _health(server: OpenAIServer) -> tuple[dict, int]:
    """(body, status): 200 while serving; 503 shutting down, or with the engine's death as `error`."""
    front = server.front
    if front.failure is not None:
        return {"status": ENGINE_DEAD, "error": front.failure}, 503
    slots = front.config.max_slots
    stats = front.stats()
    body = {"status": "shutting_down" if server.closing else "ok", "running": stats.running,
            "waiting": front.n_waiting, "free_slots": slots - stats.running, "max_slots": slots,
            "free_pages": stats.free_pages, "num_pages": stats.num_pages, "page_size": stats.page_size}
    return body, 503 if server.closing else 200


def _models(server: OpenAIServer) -> dict:
    created = int(time.time())
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": created, "owned_by": "kdtree-jax", "root": server.settings.root,
         "max_model_len": server.max_context} for name in server.settings.model_names]}


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
