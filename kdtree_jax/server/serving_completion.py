"""POST /v1/completions: a text or token-id prompt to a request in flight, and its result as one `text_completion`
body or as SSE chunks. The HTTP app (app.py) picks which and wraps it in the response."""
from __future__ import annotations

from collections.abc import AsyncIterator

from kdtree_jax.server.protocol import DEFAULT_COMPLETION_MAX_TOKENS, CompletionRequest
from kdtree_jax.server.serving_common import ChatPlan, Endpoint, Job, OpenAIServer, sse_event

COMPLETIONS = Endpoint("prompt", DEFAULT_COMPLETION_MAX_TOKENS, "cmpl")


class ServingCompletion:
    """The completions endpoint over the shared per-request code of `server`."""

    def __init__(self, server: OpenAIServer):
        self.server = server

    async def start(self, body: CompletionRequest, arrival: float) -> Job:
        """Check, tokenize and submit; refusals raise ApiError before any response has started."""
        server = self.server
        server.check_model(body.model)
        prompt = body.prompt if body.prompt is not None else ""
        ids = list(prompt) if isinstance(prompt, list) else await server.encode_text(prompt, "prompt", special=True)
        spec, field = server.output_constraint(body)
        await server.check_constraint(spec, field)
        return server.start(ids, body, COMPLETIONS, arrival, ChatPlan(spec, field))

    def response(self, job: Job, text: str, body: CompletionRequest) -> dict:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": job.finish_reason,
                  "stop_reason": job.stop_reason}
        if body.return_token_ids:
            choice |= {"prompt_token_ids": job.prompt_ids, "token_ids": job.text.token_ids}
        return {**self.server.head(job, "text_completion"), "choices": [choice], "usage": job.usage(),
                **job.spec_decode()}

    async def events(self, job: Job, body: CompletionRequest) -> AsyncIterator[bytes]:
        def chunk(text: str, ids: list[int], finish: str | None = None) -> dict:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            if body.return_token_ids:
                choice["token_ids"] = ids
            return {**self.server.head(job, "text_completion"), "choices": [choice]}

        async for piece, ids in job.pieces():
            if piece or (ids and body.return_token_ids):
                yield sse_event(chunk(piece, ids))
        async for event in self.server.stream_end(job, body, chunk("", [], job.finish_reason), "text_completion"):
            yield event
